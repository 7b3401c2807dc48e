"""Task wrappers: map, flat_map, filter and per-key aggregation under fault tolerance.

`FTTasks(settings)` wraps user code around DataFrames. Every wrapper runs on Arrow
batches (`DataFrame.mapInArrow`); the FT work for a batch is a handful of numpy
operations, never a Python object per record:

1. Read the inputs' anchors from their FT columns (`read_anchors`).
2. Run the user code. Per-record forms (`map`, `flat_map`, `filter`) call it once per
   record with a dict of the payload columns; batch forms (`map_batches`,
   `filter_batches`) call it once per Arrow batch. Either way the result is the output
   rows plus `parents`, the index of the input each output row came from, and a
   `failed` mask over the inputs.
3. `TaskHandler.process(inputs, parents, failed)` draws a fresh id for every output,
   gives it its anchors, and buffers one combined XOR event per input and root (the
   input's id XOR its outputs' ids, as Storm does). Failed inputs send a fail for
   their roots instead, and none of their outputs is emitted.
4. The outputs leave with FT columns: their root and new id.
5. At the end of the partition (the end of the mapInArrow iterator) the events go to
   the process's shared `BatchingChannel` and are flushed, so a partition's events
   are on their way when its task ends. Events are kept in the task until then (up to
   65,536 of them), so a task that fails and is retried by Spark has usually sent
   nothing: the retry completes the trees. When a partition is larger, or a retry
   follows a partial flush, the first attempt's events leave the trees unbalanced:
   they time out and are replayed (a duplicate, never a loss).

Errors in user code, per record:

- `FailException` fails only that record's tree: its roots fail and are replayed, its
  outputs (if any) are dropped, the rest of the batch goes on.
- Any other exception: `on_error="fail-record"` (default) treats it like a
  FailException and logs it; `on_error="fail-task"` lets it propagate, so Spark fails
  the task and retries it (`local[N,F]` and clusters retry F times), and the query
  stops if every attempt fails.
- In a batch form, an exception fails every record of the batch the same way; the
  batch function can instead fail single records by returning a `TaskOutput` with a
  `failed` mask.
- Output rows that do not fit the declared schema (a missing column, a value of
  another type) raise `OutputSchemaError`, naming the step, the column and the value,
  and count as an exception of the user code: under fail-record only the records whose
  output does not fit fail. A per-record function must return a dict (or a Row) with
  every declared column: pyarrow would read a missing key as null. A float with a
  fraction for an integer column does not fit either (pyarrow would truncate it).

One computation, one consumer. Every computation of a wrapper draws fresh ids for
its outputs and sends the events for its inputs, and every wrapper or sink that reads
a row consumes its id. So an FT DataFrame must be computed once (`ft_foreach_batch`
caches the micro-batch for that and `ft_kafka_sink` runs one job; persist a DataFrame
yourself before two actions on it) and each
row must reach exactly one consumer. To branch, persist the parent and route its rows
with plain `where` predicates that send each row to exactly one branch. A row read by
two wrappers, or computed twice, leaves its tree unbalanced: it times out and is
replayed, and since the replay takes the same path, it is replayed again, for ever.
A plain Spark `where` that drops rows does not ack them either: use `filter`.

Multi-anchored rows. An aggregate derived from many inputs carries one anchor per
input (its new id under each input's root; see `TaskHandler.process_grouped`). Such a
row keeps `ft_root`/`ft_id` for its first anchor and holds the others in
`ft_extra_anchors` (EXTRA_ANCHORS_COLUMN), an `array<struct<root: long, id: long>>`
with the same signed-int64 bits as the FT columns. A row's anchors are therefore
`[(ft_root, ft_id)] + ft_extra_anchors`; a null or empty list means the row has one
anchor, so a single-anchored DataFrame unions with a multi-anchored one after adding
`F.lit(None).cast(EXTRA_ANCHORS_TYPE)`. Every wrapper here and every sink reads it;
a wrapper whose input has the column keeps it in its output (a map over aggregates
gives rows anchored to every root of their aggregate). Dropping the column (a plain
`select`) leaves the extra anchors unacked: their trees time out and are replayed.

Aggregation (`aggregate`): rows are hash-partitioned by the group keys and sorted
within partitions (what `groupBy().applyInArrow` does too), then one mapInArrow pass
finds the groups, calls the user function once per group with the group's key and
rows as a `pyarrow.Table`, and anchors each output row to every input of its group
with one `process_grouped` call per Arrow batch. Unlike applyInArrow, which calls the
function per group with no end-of-partition hook, this flushes at the end of each
partition like the other wrappers. A group function that returns several rows (or
none) gets them anchored by a second `process` over the group's combined anchors.

FT off (`FTSettings(enabled=False)`): the same user code runs through the same
runners with the null handler (NoFTTaskHandler: no FT columns, no ids, no connection);
an aggregate of a static DataFrame uses Spark's own groupBy().applyInArrow. A record
whose code raises FailException, or any exception under `fail-record`, is dropped and
logged: without the FT layer there is nothing to replay it from.
"""

from __future__ import annotations

import itertools
import logging
import reprlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, cast, get_args

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from numpy.typing import ArrayLike, NDArray
from pyspark.sql import DataFrame
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import (
    ArrayType,
    DataType,
    LongType,
    MapType,
    StructField,
    StructType,
)
from pyspark.sql.types import Row as SparkRow

from ftlayer.acking.handlers import Anchors, NoFTTaskHandler, TaskHandler
from ftlayer.errors import ConfigError, FailException, FTLayerError

from .ftcolumns import FT_COLUMNS, ID_COLUMN, ROOT_COLUMN, FTSettings, to_signed, to_unsigned

__all__ = [
    "ALL_FT_COLUMNS",
    "EXTRA_ANCHORS_COLUMN",
    "EXTRA_ANCHORS_TYPE",
    "FTTasks",
    "OnError",
    "OutputSchemaError",
    "TaskOutput",
    "anchor_columns",
    "ft_columns_of",
    "read_anchors",
]

log = logging.getLogger(__name__)

EXTRA_ANCHORS_COLUMN: Final = "ft_extra_anchors"
EXTRA_ANCHORS_TYPE: Final = ArrayType(
    StructType([StructField("root", LongType(), False), StructField("id", LongType(), False)]),
    containsNull=False,
)
ALL_FT_COLUMNS: Final = (*FT_COLUMNS, EXTRA_ANCHORS_COLUMN)

_PAIR_ARROW: Final = pa.struct(
    [pa.field("root", pa.int64(), nullable=False), pa.field("id", pa.int64(), nullable=False)]
)
_EXTRA_ARROW: Final = pa.list_(pa.field("element", _PAIR_ARROW, nullable=False))
_NO_PARENTS: Final = np.zeros(0, dtype=np.intp)
# What pyarrow raises when user rows do not fit the declared schema.
_CONVERSION_ERRORS: Final = (pa.ArrowException, TypeError, ValueError, OverflowError)

OnError = Literal["fail-record", "fail-task"]
Row = dict[str, Any]
Schema = StructType | str
GroupKey = tuple[Any, ...]


class OutputSchemaError(FTLayerError, ValueError):
    """User code returned rows that do not fit its declared output schema: a column is
    missing, or holds a value of another type. The message names the column."""


@dataclass(frozen=True, slots=True)
class TaskOutput:
    """What a batch function returns when its output rows are not one per input.

    `rows` (RecordBatch or Table, the declared schema's columns); `parents[j]` is the
    index of the input row output j was derived from (a map: arange(n); a flat_map:
    repeated indices); `failed` marks inputs whose trees fail (they must have no
    output rows). In `aggregate`, `parents` must be None: every output row of a group
    derives from all of the group's inputs, and `failed` is a mask over the group.
    """

    rows: Any
    parents: ArrayLike | None = None
    failed: ArrayLike | None = None


# ---- FT columns ---------------------------------------------------------------------


def ft_columns_of(names: Iterable[str]) -> tuple[str, ...]:
    """The FT columns among `names`, in ALL_FT_COLUMNS order."""
    present = set(names)
    return tuple(c for c in ALL_FT_COLUMNS if c in present)


def _ids(batch: Any, name: str) -> NDArray[np.uint64]:
    column = batch.column(name)
    if column.null_count:
        raise ValueError(f"{column.null_count} rows have a null {name}: every FT row needs one")
    return to_unsigned(column.to_numpy(zero_copy_only=False))


def read_anchors(batch: Any) -> Anchors:
    """The anchors of an Arrow batch's rows: (ft_root, ft_id), then ft_extra_anchors."""
    roots, ids = _ids(batch, ROOT_COLUMN), _ids(batch, ID_COLUMN)
    if EXTRA_ANCHORS_COLUMN not in batch.schema.names:
        return Anchors.single(roots, ids)
    extra = batch.column(EXTRA_ANCHORS_COLUMN)
    lengths = pc.fill_null(pc.list_value_length(extra), 0).to_numpy(zero_copy_only=False)
    if not lengths.any():
        return Anchors.single(roots, ids)
    extra_roots, extra_ids = (
        to_unsigned(child.to_numpy(zero_copy_only=False)) for child in extra.flatten().flatten()
    )
    offsets = np.zeros(len(roots) + 1, dtype=np.int64)
    np.cumsum(lengths + 1, out=offsets[1:])
    first = offsets[:-1]
    is_extra = np.ones(int(offsets[-1]), dtype=np.bool_)
    is_extra[first] = False
    all_roots = np.empty(len(is_extra), dtype=np.uint64)
    all_ids = np.empty(len(is_extra), dtype=np.uint64)
    all_roots[first], all_ids[first] = roots, ids
    all_roots[is_extra], all_ids[is_extra] = extra_roots, extra_ids
    return Anchors(offsets, all_roots, all_ids)


def anchor_columns(anchors: Anchors, multi: bool) -> list[Any]:
    """The FT columns (Arrow arrays) for rows with these anchors: ft_root, ft_id, and
    with `multi` ft_extra_anchors. Every row needs at least one anchor."""
    n = len(anchors)
    counts = np.diff(anchors.offsets)
    # Paranoid check: an output without anchors would never be acked or failed.
    if n and int(counts.min()) < 1:
        raise AssertionError("an output row has no anchor")
    first = anchors.offsets[:-1]
    columns = [
        pa.array(to_signed(anchors.roots[first]), type=pa.int64()),
        pa.array(to_signed(anchors.ids[first]), type=pa.int64()),
    ]
    if multi:
        is_extra = np.ones(len(anchors.roots), dtype=np.bool_)
        is_extra[first] = False
        pairs = pa.StructArray.from_arrays(
            [
                pa.array(to_signed(anchors.roots[is_extra]), type=pa.int64()),
                pa.array(to_signed(anchors.ids[is_extra]), type=pa.int64()),
            ],
            fields=list(_PAIR_ARROW),
        )
        list_offsets = pa.array(anchors.offsets - np.arange(n + 1), type=pa.int32())
        columns.append(pa.ListArray.from_arrays(list_offsets, pairs, type=_EXTRA_ARROW))
    elif len(anchors.roots) != n:
        raise AssertionError("a single-anchored output got several anchors")
    return columns


# ---- results of user code, as (rows, parents, failed) ---------------------------------


def _conform(rows: Any, schema: Any) -> Any:
    """User rows (RecordBatch or Table) as one RecordBatch of exactly `schema`."""
    if isinstance(rows, pa.Table):
        rows = _single_batch(rows)
    if not isinstance(rows, pa.RecordBatch):
        raise TypeError(f"expected a pyarrow RecordBatch or Table, got {type(rows).__name__}")
    missing = [name for name in schema.names if name not in rows.schema.names]
    if missing:
        raise OutputSchemaError(
            f"output rows lack the declared column(s) {missing} (they have {rows.schema.names})"
        )
    rows = rows.select(schema.names)
    try:
        return rows.cast(schema)
    except _CONVERSION_ERRORS as exc:
        for field in schema:
            column = rows.column(field.name)
            try:
                column.cast(field.type)
            except _CONVERSION_ERRORS as column_exc:
                raise OutputSchemaError(
                    f"output column {field.name!r} is {column.type}, which does not cast "
                    f"to the declared {field.type}: {column_exc}"
                ) from exc
        raise


def _single_batch(table: Any) -> Any:
    """A Table as one RecordBatch (columns concatenated; empty keeps the schema)."""
    batches = table.combine_chunks().to_batches()
    return batches[0] if batches else pa.RecordBatch.from_pylist([], schema=table.schema)


def _empty(schema: Any) -> Any:
    return pa.RecordBatch.from_pylist([], schema=schema)


def _as_bool_mask(value: Any, n: int, what: str) -> NDArray[np.bool_]:
    """A boolean mask of length n from a numpy/pyarrow/list value; null counts as False."""
    if isinstance(value, pa.ChunkedArray):
        value = value.combine_chunks()
    if isinstance(value, pa.Array):
        value = pc.fill_null(value, False).to_numpy(zero_copy_only=False)
    mask = np.asarray(value, dtype=np.bool_)
    if mask.shape != (n,):
        raise ValueError(f"{what}: expected {n} flags, got shape {mask.shape}")
    return mask


@dataclass(slots=True)
class _Failures:
    """Records failed in one batch, for the log: how many, and the first exception."""

    count: int = 0
    first: BaseException | None = None

    def add(self, exc: BaseException, count: int = 1) -> None:
        self.count += count
        if self.first is None and not isinstance(exc, FailException):
            self.first = exc


def _batch_result(
    result: Any, n: int, schema: Any
) -> tuple[Any, NDArray[np.intp], NDArray[np.bool_] | None]:
    """A batch function's result as (rows, parents, failed), checked."""
    if isinstance(result, TaskOutput):
        rows = _conform(result.rows, schema)
        parents = (
            np.arange(rows.num_rows, dtype=np.intp)
            if result.parents is None
            else np.ascontiguousarray(result.parents, dtype=np.intp)
        )
        failed = (
            None if result.failed is None else _as_bool_mask(result.failed, n, "TaskOutput.failed")
        )
    else:
        rows, parents, failed = _conform(result, schema), np.arange(n, dtype=np.intp), None
        if rows.num_rows != n:
            raise ValueError(
                f"{rows.num_rows} rows returned for {n} inputs; return "
                "TaskOutput(rows, parents) when output rows are not one per input"
            )
    if len(parents) != rows.num_rows:
        raise ValueError(f"{rows.num_rows} output rows but {len(parents)} parents")
    if rows.num_rows and (int(parents.min()) < 0 or int(parents.max()) >= n):
        raise ValueError(f"parents must index the {n} inputs")
    if failed is not None and bool(failed[parents].any()):
        raise ValueError("a failed input cannot have output rows")
    return rows, parents, failed


def _run_batch_fn(
    fn: Callable[[Any], Any],
    payload: Any,
    schema: Any,
    on_error: OnError,
    failures: _Failures,
) -> tuple[Any, NDArray[np.intp], NDArray[np.bool_] | None]:
    """map_batches: call fn on the whole batch; an exception fails every record."""
    n = payload.num_rows
    try:
        rows, parents, failed = _batch_result(fn(payload), n, schema)
    except FailException as exc:
        failures.add(exc, n)
    except Exception as exc:
        if on_error == "fail-task":
            raise
        failures.add(exc, n)
    else:
        if failed is not None:
            failures.count += int(failed.sum())
        return rows, parents, failed
    return _empty(schema), _NO_PARENTS, np.ones(n, dtype=np.bool_)


def _run_record_fn(
    fn: Callable[[Row], Iterable[Row]],
    payload: Any,
    schema: Any,
    on_error: OnError,
    failures: _Failures,
    what: str,
) -> tuple[Any, NDArray[np.intp], NDArray[np.bool_] | None]:
    """map / flat_map: call fn per record (fn returns that record's output rows)."""
    n = payload.num_rows
    counts = np.zeros(n, dtype=np.int64)
    failed = np.zeros(n, dtype=np.bool_)
    outputs: list[Row] = []
    for i, row in enumerate(payload.to_pylist()):
        try:
            produced = list(fn(row))
        except FailException as exc:
            failed[i] = True
            failures.add(exc)
            continue
        except Exception as exc:
            if on_error == "fail-task":
                raise
            failed[i] = True
            failures.add(exc)
            continue
        outputs.extend(produced)
        counts[i] = len(produced)
    parents = np.repeat(np.arange(n, dtype=np.intp), counts)
    names = schema.names
    error: BaseException | None = None
    try:
        rows = pa.RecordBatch.from_pylist(outputs, schema=schema)
    except _CONVERSION_ERRORS as exc:
        error = exc
    # from_pylist reads a missing key (a typo, a tuple instead of a dict) as null, and
    # truncates a float into an integer column (1.5 -> 1) without a word.
    if (
        error is None
        and all(name in out for out in outputs for name in names)
        and not _truncates(outputs, schema)
    ):
        return rows, parents, failed if failed.any() else None
    # The slow path, only on error: find the outputs that do not fit the schema and
    # fail their inputs, as if their code had raised.
    misfits = {j: p for j, out in enumerate(outputs) if (p := _row_problem(out, schema))}
    if not misfits:
        raise error or AssertionError("every output fits, yet the batch does not")
    first = OutputSchemaError(
        f"{what}: an output row does not fit the declared schema: {next(iter(misfits.values()))}"
    )
    if on_error == "fail-task":
        raise first from error
    bad_inputs = sorted({int(parents[j]) for j in misfits})
    failed[bad_inputs] = True
    failures.add(first, len(bad_inputs))
    keep = ~failed[parents]
    outputs = [out for out, k in zip(outputs, keep.tolist(), strict=True) if k]
    rows = pa.RecordBatch.from_pylist(outputs, schema=schema)
    return rows, parents[keep], failed


def _has_fraction(value: Any) -> bool:
    """A float that an integer column would truncate."""
    return isinstance(value, float) and not value.is_integer()


def _truncates(outputs: Sequence[Any], schema: Any) -> bool:
    """True if an output puts a float with a fraction into an integer column."""
    integers = [f.name for f in schema if pa.types.is_integer(f.type)]
    return bool(integers) and any(
        _has_fraction(out.get(name))
        for out in outputs
        if isinstance(out, Mapping)
        for name in integers
    )


def _row_problem(row: Any, schema: Any) -> str | None:
    """Why one output row of a per-record function does not fit `schema`, or None."""
    if isinstance(row, SparkRow) and hasattr(row, "__fields__"):
        row = row.asDict()
    if not isinstance(row, Mapping):
        return f"it is a {type(row).__name__}, not a dict of the columns {schema.names}"
    missing = [name for name in schema.names if name not in row]
    if missing:
        return f"it lacks the declared column(s) {missing} (it has {list(row)})"
    for field in schema:
        value = row[field.name]
        if pa.types.is_integer(field.type) and _has_fraction(value):
            return (
                f"column {field.name!r} ({field.type}) cannot hold {value!r}: it would be truncated"
            )
        try:
            pa.array([value], type=field.type)
        except _CONVERSION_ERRORS as exc:
            return (
                f"column {field.name!r} ({field.type}) cannot hold {reprlib.repr(value)} "
                f"({type(value).__name__}): {exc}"
            )
    return None


def _run_predicate(
    predicate: Callable[[Row], bool], payload: Any, on_error: OnError, failures: _Failures
) -> tuple[NDArray[np.bool_], NDArray[np.bool_] | None]:
    """filter: call the predicate per record; returns (keep, failed)."""
    n = payload.num_rows
    keep = np.zeros(n, dtype=np.bool_)
    failed = np.zeros(n, dtype=np.bool_)
    for i, row in enumerate(payload.to_pylist()):
        try:
            keep[i] = bool(predicate(row))
        except FailException as exc:
            failed[i] = True
            failures.add(exc)
        except Exception as exc:
            if on_error == "fail-task":
                raise
            failed[i] = True
            failures.add(exc)
    return keep, failed if failed.any() else None


def _run_batch_predicate(
    predicate: Callable[[Any], Any], payload: Any, on_error: OnError, failures: _Failures
) -> tuple[NDArray[np.bool_], NDArray[np.bool_] | None]:
    n = payload.num_rows
    try:
        return _as_bool_mask(predicate(payload), n, "filter_batches predicate"), None
    except FailException as exc:
        failures.add(exc, n)
    except Exception as exc:
        if on_error == "fail-task":
            raise
        failures.add(exc, n)
    return np.zeros(n, dtype=np.bool_), np.ones(n, dtype=np.bool_)


def _log_failures(failures: _Failures, what: str, ft: bool) -> None:
    if not failures.count:
        return
    fate = "their trees failed and will be replayed" if ft else "dropped (FT is off)"
    if failures.first is None:  # FailException only: the user's own decision
        # Under FT a replay follows; with FT off the records are gone: say so loudly.
        level = logging.INFO if ft else logging.WARNING
        log.log(level, "%s: %d records raised FailException, %s", what, failures.count, fate)
        return
    log.warning(
        "%s: %d records failed in this partition, %s; first error: %r",
        what,
        failures.count,
        fate,
        failures.first,
        exc_info=failures.first,
    )


# ---- the partition runners (run on executors) ------------------------------------------

# One step: the payload batch in, (payload rows out, parents, failed) back.
_Step = Callable[[Any, _Failures], tuple[Any, NDArray[np.intp], NDArray[np.bool_] | None]]


def _payload_of(batch: Any) -> Any:
    names = [n for n in batch.schema.names if n not in ALL_FT_COLUMNS]
    return batch.select(names)


def _task_handler(settings: FTSettings) -> tuple[TaskHandler | NoFTTaskHandler, Callable[[], None]]:
    """The FT switch of every runner below: this task's handler, and what ends the task
    (the attempt's events handed to the process's channel, which then sends them). With
    FT off the handler anchors nothing and sends nothing, and there is no channel."""
    if not settings.enabled:
        off = NoFTTaskHandler()
        return off, off.flush
    channel = settings.channel()
    handler = TaskHandler(channel)

    def finish() -> None:
        handler.flush()
        channel.flush()

    return handler, finish


_NO_ANCHORS: Final = Anchors.single(np.zeros(0, np.uint64), np.zeros(0, np.uint64))


def _inputs(batch: Any, ft: bool) -> Anchors:
    """The anchors of a batch's rows; with FT off there are no FT columns, and the null
    handler reads no anchors."""
    return read_anchors(batch) if ft else _NO_ANCHORS


def _map_partition(
    settings: FTSettings, step: _Step, out_schema: Any, multi: bool, what: str
) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """A mapInArrow function: run `step` per batch, anchor its outputs (FT on), flush at
    the end. With FT off failed records are dropped."""
    ft = settings.enabled

    def run(batches: Iterator[Any]) -> Iterator[Any]:
        handler, finish = _task_handler(settings)
        failures = _Failures()
        for batch in batches:
            inputs = _inputs(batch, ft)
            rows, parents, failed = step(_payload_of(batch) if ft else batch, failures)
            outputs = handler.process(inputs, parents, failed)
            if rows.num_rows:
                if outputs is None:
                    yield rows
                else:
                    columns = [*rows.columns, *anchor_columns(outputs, multi)]
                    yield pa.RecordBatch.from_arrays(columns, schema=out_schema)
        finish()
        _log_failures(failures, what, ft=ft)

    return run


def _filter_partition(
    settings: FTSettings,
    decide: Callable[[Any, _Failures], tuple[NDArray[np.bool_], NDArray[np.bool_] | None]],
    what: str,
) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """A filter keeps its input's schema: kept rows get new ids in place (FT on)."""
    ft = settings.enabled

    def run(batches: Iterator[Any]) -> Iterator[Any]:
        handler, finish = _task_handler(settings)
        failures = _Failures()
        for batch in batches:
            inputs = _inputs(batch, ft)
            keep, failed = decide(_payload_of(batch) if ft else batch, failures)
            if failed is not None:
                keep &= ~failed
            parents = np.flatnonzero(keep)
            outputs = handler.process(inputs, parents, failed)
            if len(parents):
                kept = batch.take(pa.array(parents))
                yield kept if outputs is None else _with_anchors(kept, outputs)
        finish()
        _log_failures(failures, what, ft=ft)

    return run


def _with_anchors(batch: Any, anchors: Anchors) -> Any:
    """`batch` with its FT columns replaced by these anchors (same positions)."""
    multi = EXTRA_ANCHORS_COLUMN in batch.schema.names
    names = [ROOT_COLUMN, ID_COLUMN, EXTRA_ANCHORS_COLUMN] if multi else list(FT_COLUMNS)
    for name, column in zip(names, anchor_columns(anchors, multi), strict=True):
        index = batch.schema.get_field_index(name)
        column = column.cast(batch.schema.field(index).type)
        batch = batch.set_column(index, batch.schema.field(index), column)
    return batch


# ---- aggregation -------------------------------------------------------------------------


def _key_changes(columns: Sequence[Any]) -> NDArray[np.bool_]:
    """changes[i]: row i+1's key differs from row i's (nulls equal nulls, NaN equals NaN,
    as in Spark's grouping)."""
    n = len(columns[0])
    changes = np.zeros(max(n - 1, 0), dtype=np.bool_)
    if n < 2:
        return changes
    for column in columns:
        before, after = column.slice(0, n - 1), column.slice(1)
        differ = pc.fill_null(pc.not_equal(before, after), False)
        differ = pc.or_(differ, pc.xor(before.is_null(), after.is_null()))
        if pa.types.is_floating(column.type):
            both_nan = pc.and_(pc.is_nan(before), pc.is_nan(after))
            differ = pc.and_(differ, pc.invert(pc.fill_null(both_nan, False)))
        changes |= differ.to_numpy(zero_copy_only=False)
    return changes


@dataclass(slots=True)
class _Grouper:
    """Cuts a partition sorted by the group keys into complete groups, batch by batch:
    the rows of the last group seen are held back until a row with another key (or the
    end of the partition) shows the group is complete."""

    by: Sequence[str]
    held: list[Any]

    def feed(self, batch: Any) -> Any | None:
        """Rows of the groups `batch` completes (one batch), or None."""
        if batch.num_rows == 0:
            return None
        keys = [batch.column(k) for k in self.by]
        if self.held:
            last = self.held[-1]
            keys = [
                pa.concat_arrays([last.column(k).slice(last.num_rows - 1), c])
                for k, c in zip(self.by, keys, strict=True)
            ]
            starts = _key_changes(keys)
        else:
            starts = np.concatenate([[True], _key_changes(keys)])
        boundaries = np.flatnonzero(starts)
        cut = int(boundaries[-1]) if len(boundaries) else 0
        if cut == 0 and not (len(boundaries) and self.held):
            self.held.append(batch)  # the batch only continues (or starts) one group
            return None
        complete = [*self.held, batch.slice(0, cut)]
        self.held = [batch.slice(cut)]
        return _concat_batches(complete)

    def finish(self) -> Any | None:
        held, self.held = self.held, []
        return _concat_batches(held) if held else None


def _concat_batches(batches: Sequence[Any]) -> Any:
    return _single_batch(pa.Table.from_batches(batches))


def _aggregate_groups(
    rows: Any,
    by: Sequence[str],
    fn: Callable[[GroupKey, Any], Any],
    schema: Any,
    on_error: OnError,
    failures: _Failures,
) -> tuple[Any, NDArray[np.intp], NDArray[np.int64], NDArray[np.bool_]]:
    """Call fn per group of `rows` (sorted by key, groups complete).

    Returns the output rows, each input's group index, each group's output count, and
    the failed mask over the inputs.
    """
    n = rows.num_rows
    starts = np.concatenate([[True], _key_changes([rows.column(k) for k in by])])
    groups = (np.cumsum(starts) - 1).astype(np.intp)
    bounds = [*np.flatnonzero(starts).tolist(), n]
    payload = pa.Table.from_batches([_payload_of(rows)])
    counts = np.zeros(len(bounds) - 1, dtype=np.int64)
    failed = np.zeros(n, dtype=np.bool_)
    outputs: list[Any] = []
    for g, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        key = tuple(rows.column(k)[lo] for k in by)
        try:
            result = fn(key, payload.slice(lo, hi - lo))
            group_failed = None
            if isinstance(result, TaskOutput):
                if result.parents is not None:
                    raise ValueError("aggregate: TaskOutput.parents must be None")
                if result.failed is not None:
                    group_failed = _as_bool_mask(result.failed, hi - lo, "TaskOutput.failed")
                result = result.rows
            out = _conform(result, schema)
        except FailException as exc:
            failed[lo:hi] = True
            failures.add(exc, hi - lo)
            continue
        except Exception as exc:
            if on_error == "fail-task":
                raise
            failed[lo:hi] = True
            failures.add(exc, hi - lo)
            continue
        if group_failed is not None:
            failed[lo:hi] = group_failed
            failures.count += int(group_failed.sum())
            if group_failed.all():
                continue  # no input is left to anchor the group's outputs to
        outputs.append(out)
        counts[g] = out.num_rows
    out_rows = _concat_batches(outputs) if outputs else _empty(schema)
    return out_rows, groups, counts, failed


def _aggregate_partition(
    settings: FTSettings,
    by: Sequence[str],
    fn: Callable[[GroupKey, Any], Any],
    payload_schema: Any,
    out_schema: Any,
    on_error: OnError,
    *,
    local_sort: bool = False,
) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """Groups of rows sorted by key (sorted here with `local_sort`), fn per group, every
    output multi-anchored to its group's inputs (FT on); with FT off a failed group emits
    nothing."""
    ft = settings.enabled

    def emit(
        rows: Any, handler: TaskHandler | NoFTTaskHandler, failures: _Failures
    ) -> Iterator[Any]:
        out, groups, counts, failed = _aggregate_groups(
            rows, by, fn, payload_schema, on_error, failures
        )
        combined = handler.process_grouped(
            _inputs(rows, ft), groups, len(counts), failed if failed.any() else None
        )
        if combined is not None and not np.array_equal(counts, np.ones_like(counts)):
            # Not one output per group: each output is a child of its group's combined
            # anchors; a group without outputs acks them (its inputs are done).
            parents = np.repeat(np.arange(len(counts), dtype=np.intp), counts)
            combined = handler.process(combined, parents)
        if out.num_rows:
            if combined is None:
                yield out
            else:
                columns = [*out.columns, *anchor_columns(combined, multi=True)]
                yield pa.RecordBatch.from_arrays(columns, schema=out_schema)

    def run(batches: Iterator[Any]) -> Iterator[Any]:
        handler, finish = _task_handler(settings)
        failures = _Failures()
        grouper = _Grouper(by, [])
        for batch in _sorted_by(batches, by) if local_sort else batches:
            complete = grouper.feed(batch)
            if complete is not None:
                yield from emit(complete, handler, failures)
        rest = grouper.finish()
        if rest is not None:
            yield from emit(rest, handler, failures)
        finish()
        _log_failures(failures, "aggregate", ft=ft)

    return run


def _sorted_by(batches: Iterator[Any], by: Sequence[str]) -> Iterator[Any]:
    """The whole partition's rows, sorted by the keys (in memory: a streaming partition
    cannot be sorted by Spark)."""
    collected = list(batches)
    if not collected:
        return iter(())
    table = pa.Table.from_batches(collected).sort_by([(k, "ascending") for k in by])
    return iter(table.combine_chunks().to_batches())


def _plain_group_fn(
    fn: Callable[[GroupKey, Any], Any], schema: Any, on_error: OnError
) -> Callable[[GroupKey, Any], Any]:
    """FT off: the user's group function for applyInArrow; a failed group emits nothing."""

    def run(key: GroupKey, table: Any) -> Any:
        try:
            result = fn(key, table)
            if isinstance(result, TaskOutput):
                result = result.rows
            return pa.Table.from_batches([_conform(result, schema)])
        except FailException:
            pass
        except Exception as exc:
            if on_error == "fail-task":
                raise
            log.warning("aggregate: group %r failed, dropped (FT is off): %r", key, exc)
        return schema.empty_table()

    return run


# ---- the public API (driver side) ----------------------------------------------------------


class FTTasks:
    """Task wrappers for one FT layer; see the module docstring.

    `on_error` is the default for every wrapper ("fail-record" or "fail-task"); each
    method can override it. Schemas are StructType or DDL strings and name the
    payload columns only: the wrappers add the FT columns.
    """

    def __init__(self, settings: FTSettings, *, on_error: OnError = "fail-record") -> None:
        self.settings = settings
        self.on_error = _check_on_error(on_error)

    @property
    def ft(self) -> bool:
        return self.settings.enabled

    # ---- per record ----

    def map(
        self,
        df: DataFrame,
        fn: Callable[[Row], Row],
        schema: Schema,
        *,
        on_error: OnError | None = None,
    ) -> DataFrame:
        """One output row (a dict of `schema`'s columns) per input row (a dict)."""
        return self._records(df, lambda row: (fn(row),), schema, on_error, _step("map", fn))

    def flat_map(
        self,
        df: DataFrame,
        fn: Callable[[Row], Iterable[Row]],
        schema: Schema,
        *,
        on_error: OnError | None = None,
    ) -> DataFrame:
        """Zero or more output rows per input row; all of a record's outputs are emitted,
        or (when it fails, even midway) none."""
        return self._records(df, fn, schema, on_error, _step("flat_map", fn))

    def filter(
        self,
        df: DataFrame,
        predicate: Callable[[Row], bool],
        *,
        on_error: OnError | None = None,
    ) -> DataFrame:
        """Keep the rows the predicate is true for; a dropped row's tree is acked."""
        mode = self._mode(on_error)

        def decide(payload: Any, failures: _Failures) -> Any:
            return _run_predicate(predicate, payload, mode, failures)

        return self._filter(df, decide, "filter")

    # ---- per batch ----

    def map_batches(
        self,
        df: DataFrame,
        fn: Callable[[Any], Any],
        schema: Schema,
        *,
        on_error: OnError | None = None,
    ) -> DataFrame:
        """fn(pyarrow.RecordBatch of the payload columns) returns a RecordBatch or Table
        with one row per input (a map), or a `TaskOutput` (anything else)."""
        mode = self._mode(on_error)
        payload_schema = self._payload_arrow(df, schema)

        def step(payload: Any, failures: _Failures) -> Any:
            return _run_batch_fn(fn, payload, payload_schema, mode, failures)

        return self._mapped(df, step, schema, "map_batches")

    def filter_batches(
        self,
        df: DataFrame,
        predicate: Callable[[Any], Any],
        *,
        on_error: OnError | None = None,
    ) -> DataFrame:
        """predicate(pyarrow.RecordBatch) returns a boolean mask (numpy or pyarrow; null
        drops the row)."""
        mode = self._mode(on_error)

        def decide(payload: Any, failures: _Failures) -> Any:
            return _run_batch_predicate(predicate, payload, mode, failures)

        return self._filter(df, decide, "filter_batches")

    # ---- grouped ----

    def aggregate(
        self,
        df: DataFrame,
        by: str | Sequence[str],
        fn: Callable[[GroupKey, Any], Any],
        schema: Schema,
        *,
        num_partitions: int | None = None,
        on_error: OnError | None = None,
    ) -> DataFrame:
        """Per-key aggregation within a micro-batch, multi-anchored.

        fn(key, rows) gets the group key (a tuple of pyarrow scalars, as applyInArrow
        passes it) and the group's rows (a pyarrow.Table of the payload columns) and
        returns a Table or RecordBatch of `schema` (usually one row), or a `TaskOutput`
        whose `failed` mask fails single inputs of the group. Every output row is
        anchored to every (not failed) input of its group, so an input's tree completes
        only when the aggregate's tree does. FailException (or any exception under
        fail-record) fails every root of the group; other groups go on.
        `num_partitions`: how many partitions the rows are hash-partitioned into by key
        (default: spark.sql.shuffle.partitions).
        """
        mode = self._mode(on_error)
        keys = [by] if isinstance(by, str) else list(by)
        self._check_keys(df, keys)
        payload_struct = _struct(df, schema)
        payload_schema = self._payload_arrow(df, payload_struct)
        self._check_ft_columns(df)
        # Hash-partitioned by the keys: groupBy adds no second shuffle on top of it.
        shuffled = df if num_partitions is None else df.repartition(num_partitions, *keys)
        # A streaming DataFrame can be neither sorted nor grouped by applyInArrow (Spark
        # refuses both outside stateful operators): each micro-batch partition is then
        # sorted by the keys in the task itself, in memory.
        local_sort = df.isStreaming
        if not self.ft and not local_sort:
            return shuffled.groupBy(*keys).applyInArrow(
                _plain_group_fn(fn, payload_schema, mode), payload_struct
            )
        if num_partitions is None:
            shuffled = df.repartition(*keys)
        if not local_sort:
            shuffled = shuffled.sortWithinPartitions(*keys)
        out_struct = _with_ft_fields(payload_struct, multi=True) if self.ft else payload_struct
        out_schema = self._arrow(df, out_struct)
        run = _aggregate_partition(
            self.settings, keys, fn, payload_schema, out_schema, mode, local_sort=local_sort
        )
        return shuffled.mapInArrow(run, out_struct)

    # ---- plumbing ----

    def _mode(self, on_error: OnError | None) -> OnError:
        return self.on_error if on_error is None else _check_on_error(on_error)

    def _records(
        self,
        df: DataFrame,
        fn: Callable[[Row], Iterable[Row]],
        schema: Schema,
        on_error: OnError | None,
        what: str,
    ) -> DataFrame:
        mode = self._mode(on_error)
        payload_schema = self._payload_arrow(df, schema)

        def step(payload: Any, failures: _Failures) -> Any:
            return _run_record_fn(fn, payload, payload_schema, mode, failures, what)

        return self._mapped(df, step, schema, what)

    def _mapped(self, df: DataFrame, step: _Step, schema: Schema, what: str) -> DataFrame:
        payload_struct = _struct(df, schema)
        self._check_ft_columns(df)
        multi = EXTRA_ANCHORS_COLUMN in df.columns
        out_struct = _with_ft_fields(payload_struct, multi) if self.ft else payload_struct
        run = _map_partition(self.settings, step, self._arrow(df, out_struct), multi, what)
        return df.mapInArrow(run, out_struct)

    def _filter(
        self,
        df: DataFrame,
        decide: Callable[[Any, _Failures], tuple[NDArray[np.bool_], NDArray[np.bool_] | None]],
        what: str,
    ) -> DataFrame:
        self._check_ft_columns(df)
        return df.mapInArrow(_filter_partition(self.settings, decide, what), df.schema)

    def _check_ft_columns(self, df: DataFrame) -> None:
        present = ft_columns_of(df.columns)
        if self.ft and not set(FT_COLUMNS) <= set(present):
            raise ConfigError(
                f"FT is on but the DataFrame has no {' / '.join(FT_COLUMNS)} columns "
                f"(it has {df.columns}): is it read from an FT source with the same FTSettings?"
            )
        if not self.ft and present:
            raise ConfigError(
                f"FT is off but the DataFrame has FT columns {list(present)}: the source, "
                "tasks and sinks of a pipeline must share one FTSettings"
            )

    def _check_keys(self, df: DataFrame, keys: Sequence[str]) -> None:
        if not keys:
            raise ConfigError("aggregate needs at least one group key column")
        fields = {f.name: f.dataType for f in df.schema.fields}
        for key in keys:
            if key in ALL_FT_COLUMNS or key not in fields:
                raise ConfigError(f"aggregate: {key!r} is not a payload column of {df.columns}")
            if isinstance(fields[key], ArrayType | MapType | StructType):
                raise ConfigError(
                    f"aggregate: group key {key!r} is {fields[key].simpleString()}; "
                    "keys must be atomic (number, string, binary, date, ...)"
                )

    def _payload_arrow(self, df: DataFrame, schema: Schema) -> Any:
        return self._arrow(df, _struct(df, schema))

    @staticmethod
    def _arrow(df: DataFrame, struct: StructType) -> Any:
        timezone = df.sparkSession.conf.get("spark.sql.session.timeZone")
        return to_arrow_schema(struct, timezone=timezone)


def _step(kind: str, fn: Callable[..., Any]) -> str:
    """A step as errors and logs name it: the wrapper and the user's function."""
    return f"{kind}({getattr(fn, '__name__', type(fn).__name__)})"


def _check_on_error(on_error: str) -> OnError:
    if on_error not in get_args(OnError):
        raise ConfigError(f"on_error must be one of {get_args(OnError)}, got {on_error!r}")
    return cast(OnError, on_error)


def _struct(df: DataFrame, schema: Schema) -> StructType:
    struct = DataType.fromDDL(schema) if isinstance(schema, str) else schema
    if not isinstance(struct, StructType):
        raise ConfigError(f"an output schema must be a struct, got {struct!r}")
    clash = [f.name for f in struct.fields if f.name in ALL_FT_COLUMNS]
    if clash:
        raise ConfigError(f"output schema must not declare the FT columns {clash}")
    return struct


def _with_ft_fields(struct: StructType, multi: bool) -> StructType:
    fields = [
        *struct.fields,
        StructField(ROOT_COLUMN, LongType(), False),
        StructField(ID_COLUMN, LongType(), False),
    ]
    if multi:
        fields.append(StructField(EXTRA_ANCHORS_COLUMN, EXTRA_ANCHORS_TYPE, True))
    return StructType(fields)
