"""User code's results as (rows, parents, failed): output rows, the index of the input
each came from, and a failed mask over the inputs. Per-record and per-batch forms,
predicates, the checks that refuse rows that do not fit the declared schema (or a float
with a fraction in an integer column), and one log line per partition of failures."""

from __future__ import annotations

import dataclasses
import logging
import reprlib
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from cachetools import TTLCache
from numpy.typing import ArrayLike, NDArray
from pyspark.sql.types import Row as SparkRow
from pyspark.sql.types import (
    StructType,
)

from ftlayer.causes import Cause, Causes, FailKind
from ftlayer.errors import FailException, TaskOutputError
from ftlayer.errors import OutputSchemaError as OutputSchemaError  # re-exported by .tasks

# One logger for every part of the task wrappers: its name is what users configure.
log = logging.getLogger("ftlayer.integration.tasks")

# What pyarrow raises when user rows do not fit the declared schema.
_CONVERSION_ERRORS: Final = (pa.ArrowException, TypeError, ValueError, OverflowError)

OnError = Literal["fail-record", "fail-task"]
Row = dict[str, Any]
Schema = StructType | str
GroupKey = tuple[Any, ...]
_MESSAGE_CHARS: Final = 300  # of an error's message, in the log and in its identity
_TRACEBACK_TTL_S: Final = 600.0
# Per (step, error type, message): when this process logged its traceback.
_tracebacks_logged: TTLCache[tuple[str, str, str], str] = TTLCache(
    maxsize=4096, ttl=_TRACEBACK_TTL_S
)
_traceback_lock = threading.Lock()
_NO_PARENTS: Final = np.zeros(0, dtype=np.intp)


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


# ---- results of user code, as (rows, parents, failed) ---------------------------------


def conform(rows: Any, schema: Any) -> Any:
    """User rows (RecordBatch or Table) as one RecordBatch of exactly `schema`."""
    if isinstance(rows, pa.Table):
        rows = single_batch(rows)
    if not isinstance(rows, pa.RecordBatch):
        # A TypeError on purpose: a wrong return type is a programming error, which
        # take_causes retries only once (_PROGRAMMING_ERRORS), not ft.maxRetries times.
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


def single_batch(table: Any) -> Any:
    """A Table as one RecordBatch (columns concatenated; empty keeps the schema)."""
    batches = table.combine_chunks().to_batches()
    return batches[0] if batches else pa.RecordBatch.from_pylist([], schema=table.schema)


def empty_batch(schema: Any) -> Any:
    return pa.RecordBatch.from_pylist([], schema=schema)


def as_bool_mask(value: Any, n: int, what: str) -> NDArray[np.bool_]:
    """A boolean mask of length n from a numpy/pyarrow/list value; null counts as False."""
    if isinstance(value, pa.ChunkedArray):
        value = value.combine_chunks()
    if isinstance(value, pa.Array):
        value = pc.fill_null(value, False).to_numpy(zero_copy_only=False)
    mask = np.asarray(value, dtype=np.bool_)
    if mask.shape != (n,):
        raise TaskOutputError(f"{what}: expected {n} flags, got shape {mask.shape}")
    return mask


class Failures:
    """The records one task partition failed: for the log, per distinct error (its type
    and message) how many records it failed and the first exception, FailExceptions
    (the user's own decision) apart, counted only; and for the FT layer, the cause of
    each failed input of the batch in hand (`take_causes`)."""

    def __init__(self, step: str = "") -> None:
        self.step = step
        self.count = 0
        self.explicit = 0
        self.errors: dict[tuple[str, str], tuple[int, BaseException]] = {}
        self._batch: list[tuple[Any, Cause]] = []  # (rows or None for all, cause)

    def add(self, exc: BaseException, count: int = 1, rows: Any = None) -> None:
        """`count` records failed with `exc`: input rows `rows` of the batch in hand (an
        index, a slice, indices or a mask; None: every row)."""
        self.count += count
        self._batch.append((rows, self._cause(exc)))
        if isinstance(exc, FailException):
            self.explicit += count
            return
        key = (type(exc).__qualname__, str(exc)[:_MESSAGE_CHARS])
        seen, first = self.errors.get(key, (0, exc))
        self.errors[key] = (seen + count, first)

    def add_count(self, count: int, rows: Any = None) -> None:
        """Records failed by a mask the user code returned (TaskOutput.failed)."""
        self.count += count
        self.explicit += count
        self._batch.append((rows, Cause(FailKind.EXPLICIT, self.step, "TaskOutput.failed")))

    def _cause(self, exc: BaseException) -> Cause:
        final = isinstance(exc, OutputSchemaError)  # the same code fails the same way
        return Cause.of_exception(exc, self.step, final=final).clipped()

    def take_causes(self, failed: NDArray[np.bool_] | None, n: int) -> Causes | None:
        """The cause of each of the batch's n inputs (only the failed ones matter), and
        forget them. A failure is final (dead-lettered at once, section 4.8 of the user
        guide) when it is certain to repeat: an OutputSchemaError. A programming error
        (TypeError, AttributeError, NameError, ...) that failed every one of at least
        two records of the batch alike is final if repeated: retried once, in a later
        batch (another task attempt, maybe another executor), and dead-lettered if it
        fails so again."""
        batch, self._batch = self._batch, []
        if failed is None or not batch:
            return None
        codes: dict[Cause, int] = {}
        index = np.zeros(n, dtype=np.uint16)
        for rows, cause in batch:
            code = codes.setdefault(cause, len(codes))
            if rows is None:
                index[:] = code
            else:
                index[rows] = code
        table = list(codes)
        if n >= 2 and bool(failed.all()) and len(np.unique(index)) == 1:
            only = table[int(index[0])]
            if not only.final and only.error_type in _PROGRAMMING_ERRORS:
                table[int(index[0])] = dataclasses.replace(only, final_if_repeated=True)
        return Causes(tuple(table), index)


_PROGRAMMING_ERRORS: Final = frozenset(
    {
        "TypeError",
        "AttributeError",
        "NameError",
        "UnboundLocalError",
        "ImportError",
        "ModuleNotFoundError",
        "NotImplementedError",
        "SyntaxError",
    }
)
"""Errors of the code, not of the data: on every record of a batch, likely to repeat
(but an ImportError may be one executor's: retried once)."""


def _batch_result(
    result: Any, n: int, schema: Any
) -> tuple[Any, NDArray[np.intp], NDArray[np.bool_] | None]:
    """A batch function's result as (rows, parents, failed), checked."""
    if isinstance(result, TaskOutput):
        rows = conform(result.rows, schema)
        parents = (
            np.arange(rows.num_rows, dtype=np.intp)
            if result.parents is None
            else np.ascontiguousarray(result.parents, dtype=np.intp)
        )
        failed = (
            None if result.failed is None else as_bool_mask(result.failed, n, "TaskOutput.failed")
        )
    else:
        rows, parents, failed = conform(result, schema), np.arange(n, dtype=np.intp), None
        if rows.num_rows != n:
            raise TaskOutputError(
                f"{rows.num_rows} rows returned for {n} inputs; return "
                "TaskOutput(rows, parents) when output rows are not one per input"
            )
    if len(parents) != rows.num_rows:
        raise TaskOutputError(f"{rows.num_rows} output rows but {len(parents)} parents")
    if rows.num_rows and (int(parents.min()) < 0 or int(parents.max()) >= n):
        raise TaskOutputError(f"parents must index the {n} inputs")
    if failed is not None and bool(failed[parents].any()):
        raise TaskOutputError("a failed input cannot have output rows")
    return rows, parents, failed


def run_batch_fn(
    fn: Callable[[Any], Any],
    payload: Any,
    schema: Any,
    on_error: OnError,
    failures: Failures,
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
            failures.add_count(int(failed.sum()), rows=failed)
        return rows, parents, failed
    return empty_batch(schema), _NO_PARENTS, np.ones(n, dtype=np.bool_)


def run_record_fn(
    fn: Callable[[Row], Iterable[Row]],
    payload: Any,
    schema: Any,
    on_error: OnError,
    failures: Failures,
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
            failures.add(exc, rows=i)
            continue
        except Exception as exc:
            if on_error == "fail-task":
                raise
            failed[i] = True
            failures.add(exc, rows=i)
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
    failures.add(first, len(bad_inputs), rows=bad_inputs)
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


def run_predicate(
    predicate: Callable[[Row], bool], payload: Any, on_error: OnError, failures: Failures
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
            failures.add(exc, rows=i)
        except Exception as exc:
            if on_error == "fail-task":
                raise
            failed[i] = True
            failures.add(exc, rows=i)
    return keep, failed if failed.any() else None


def run_batch_predicate(
    predicate: Callable[[Any], Any], payload: Any, on_error: OnError, failures: Failures
) -> tuple[NDArray[np.bool_], NDArray[np.bool_] | None]:
    n = payload.num_rows
    try:
        return as_bool_mask(predicate(payload), n, "filter_batches predicate"), None
    except FailException as exc:
        failures.add(exc, n)
    except Exception as exc:
        if on_error == "fail-task":
            raise
        failures.add(exc, n)
    return np.zeros(n, dtype=np.bool_), np.ones(n, dtype=np.bool_)


def log_with_time_and_level() -> None:
    """In a Python worker where nobody configured logging, give ftlayer's loggers a
    stderr handler whose lines carry the time, level and logger name (Python's
    last-resort handler prints the bare message). Idempotent; a configured root or
    ftlayer logger is left alone."""
    ftlayer_log = logging.getLogger("ftlayer")
    if ftlayer_log.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    ftlayer_log.addHandler(handler)


def log_failures(failures: Failures, what: str, ft: bool) -> None:
    """One log line per distinct error of this partition, with its count; the traceback
    only the first time this process sees that error of that step within
    `_TRACEBACK_TTL_S` (a record failing again on every replay logs one line, not one
    traceback, per partition). FailExceptions get one line in all."""
    if not failures.count:
        return
    fate = "their trees failed and will be replayed" if ft else "dropped (FT is off)"
    if failures.explicit:
        # Under FT a replay follows; with FT off the records are gone: say so loudly.
        level = logging.INFO if ft else logging.WARNING
        log.log(level, "%s: %d records raised FailException, %s", what, failures.explicit, fate)
    for (kind, message), (count, first) in failures.errors.items():
        key = (what, kind, message)
        with _traceback_lock:
            logged_at = _tracebacks_logged.get(key)
            if logged_at is None:
                _tracebacks_logged[key] = time.strftime("%H:%M:%S")
        if logged_at is None:
            log.warning(
                "%s: %d records failed with %s: %s; %s",
                what, count, kind, message, fate,
                exc_info=first,
            )  # fmt: skip
        else:
            log.warning(
                "%s: %d records failed with %s: %s; %s (traceback logged at %s)",
                what, count, kind, message, fate, logged_at,
            )  # fmt: skip
