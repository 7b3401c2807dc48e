"""Per-key aggregation inside a micro-batch partition: rows sorted by key (sorted here
for a stream), one call of the user's function per group, every output multi-anchored
to its group's inputs (FT on); FT off on a static DataFrame uses Spark's applyInArrow
through `plain_group_fn`."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from numpy.typing import NDArray

from ftlayer.acking.handlers import NoFTTaskHandler, TaskHandler
from ftlayer.errors import FailException, TaskOutputError
from ftlayer.integration.anchors import anchor_columns
from ftlayer.integration.ftcolumns import (
    ID_COLUMN,
    FTSettings,
)

from .results import (
    Failures,
    GroupKey,
    OnError,
    TaskOutput,
    as_bool_mask,
    conform,
    empty_batch,
    log,
    log_failures,
    log_with_time_and_level,
    single_batch,
)
from .runners import inputs_of, payload_of, task_handler

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
    return single_batch(pa.Table.from_batches(batches))


def _aggregate_groups(
    rows: Any,
    by: Sequence[str],
    fn: Callable[[GroupKey, Any], Any],
    schema: Any,
    on_error: OnError,
    failures: Failures,
) -> tuple[Any, NDArray[np.intp], NDArray[np.int64], NDArray[np.bool_]]:
    """Call fn per group of `rows` (sorted by key, groups complete).

    Returns the output rows, each input's group index, each group's output count, and
    the failed mask over the inputs.
    """
    n = rows.num_rows
    starts = np.concatenate([[True], _key_changes([rows.column(k) for k in by])])
    groups = (np.cumsum(starts) - 1).astype(np.intp)
    bounds = [*np.flatnonzero(starts).tolist(), n]
    payload = pa.Table.from_batches([payload_of(rows)])
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
                    raise TaskOutputError("aggregate: TaskOutput.parents must be None")
                if result.failed is not None:
                    group_failed = as_bool_mask(result.failed, hi - lo, "TaskOutput.failed")
                result = result.rows
            out = conform(result, schema)
        except FailException as exc:
            failed[lo:hi] = True
            failures.add(exc, hi - lo, rows=slice(lo, hi))
            continue
        except Exception as exc:
            if on_error == "fail-task":
                raise
            failed[lo:hi] = True
            failures.add(exc, hi - lo, rows=slice(lo, hi))
            continue
        if group_failed is not None:
            failed[lo:hi] = group_failed
            failures.add_count(int(group_failed.sum()), rows=np.flatnonzero(group_failed) + lo)
            if group_failed.all():
                continue  # no input is left to anchor the group's outputs to
        outputs.append(out)
        counts[g] = out.num_rows
    out_rows = _concat_batches(outputs) if outputs else empty_batch(schema)
    return out_rows, groups, counts, failed


def aggregate_partition(
    settings: FTSettings,
    by: Sequence[str],
    fn: Callable[[GroupKey, Any], Any],
    payload_schema: Any,
    out_schema: Any,
    on_error: OnError,
    *,
    local_sort: bool = False,
    failures: Callable[[str], Failures] = Failures,
) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """Groups of rows sorted by key (sorted here with `local_sort`), fn per group, every
    output multi-anchored to its group's inputs (FT on); with FT off a failed group emits
    nothing. `failures` makes the partition's Failures (an observed step keeps it)."""
    ft = settings.enabled
    ids = ID_COLUMN in out_schema.names  # not in barrier mode
    new_failures = failures

    def emit(
        rows: Any, handler: TaskHandler | NoFTTaskHandler, failures: Failures
    ) -> Iterator[Any]:
        out, groups, counts, failed = _aggregate_groups(
            rows, by, fn, payload_schema, on_error, failures
        )
        any_failed = failed if failed.any() else None
        causes = failures.take_causes(any_failed, rows.num_rows)
        combined = handler.process_grouped(
            inputs_of(rows, ft), groups, len(counts), any_failed, causes
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
                anchors = anchor_columns(combined, multi=True, ids=ids)
                columns = [*out.columns, *anchors]
                yield pa.RecordBatch.from_arrays(columns, schema=out_schema)

    def run(batches: Iterator[Any]) -> Iterator[Any]:
        handler, finish = task_handler(settings)
        log_with_time_and_level()
        failures = new_failures("aggregate")
        grouper = _Grouper(by, [])
        for batch in _sorted_by(batches, by) if local_sort else batches:
            complete = grouper.feed(batch)
            if complete is not None:
                yield from emit(complete, handler, failures)
        rest = grouper.finish()
        if rest is not None:
            yield from emit(rest, handler, failures)
        finish()
        log_failures(failures, "aggregate", ft=ft)

    return run


def _sorted_by(batches: Iterator[Any], by: Sequence[str]) -> Iterator[Any]:
    """The whole partition's rows, sorted by the keys (in memory: a streaming partition
    cannot be sorted by Spark)."""
    collected = list(batches)
    if not collected:
        return iter(())
    table = pa.Table.from_batches(collected).sort_by([(k, "ascending") for k in by])
    return iter(table.combine_chunks().to_batches())


def plain_group_fn(
    fn: Callable[[GroupKey, Any], Any], schema: Any, on_error: OnError
) -> Callable[[GroupKey, Any], Any]:
    """FT off: the user's group function for applyInArrow; a failed group emits nothing."""

    def run(key: GroupKey, table: Any) -> Any:
        try:
            result = fn(key, table)
            if isinstance(result, TaskOutput):
                result = result.rows
            return pa.Table.from_batches([conform(result, schema)])
        except FailException:
            pass
        except Exception as exc:
            if on_error == "fail-task":
                raise
            log.warning("aggregate: group %r failed, dropped (FT is off): %r", key, exc)
        return schema.empty_table()

    return run
