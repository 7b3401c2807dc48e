"""The partition runners (run on executors): one mapInArrow function per task kind, map
and filter, whose handler is a TaskHandler (FT on) or the null handler (FT off). Each
reads its inputs' anchors, runs the user code's step, anchors the outputs and, at the
end of the partition, hands the task's events to the process's channel."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Final

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

from ftlayer.acking.handlers import Anchors, NoFTTaskHandler, TaskHandler
from ftlayer.integration.anchors import (
    ALL_FT_COLUMNS,
    EXTRA_ANCHORS_COLUMN,
    anchor_columns,
    read_anchors,
)
from ftlayer.integration.ftcolumns import (
    FT_COLUMNS,
    ID_COLUMN,
    FTSettings,
)

from .results import Failures, log_failures, log_with_time_and_level

# ---- the partition runners (run on executors) ------------------------------------------

# One step: the payload batch in, (payload rows out, parents, failed) back.
Step = Callable[[Any, Failures], tuple[Any, NDArray[np.intp], NDArray[np.bool_] | None]]


def payload_of(batch: Any) -> Any:
    names = [n for n in batch.schema.names if n not in ALL_FT_COLUMNS]
    return batch.select(names)


def task_handler(settings: FTSettings) -> tuple[TaskHandler | NoFTTaskHandler, Callable[[], None]]:
    """The FT switch of every runner below: this task's handler, and what ends the task
    (the attempt's events handed to the process's channel, which then sends them). With
    FT off the handler anchors nothing and sends nothing, and there is no channel."""
    if not settings.enabled:
        off = NoFTTaskHandler()
        return off, off.flush
    channel = settings.channel()
    # A row has exactly one consumer here: a row with one output hands its id over.
    handler = TaskHandler(channel, hand_over=True)

    def finish() -> None:
        handler.flush()
        channel.flush()

    return handler, finish


_NO_ANCHORS: Final = Anchors.single(np.zeros(0, np.uint64), np.zeros(0, np.uint64))


def inputs_of(batch: Any, ft: bool) -> Anchors:
    """The anchors of a batch's rows; with FT off there are no FT columns, and the null
    handler reads no anchors."""
    return read_anchors(batch) if ft else _NO_ANCHORS


def map_partition(
    settings: FTSettings, step: Step, out_schema: Any, multi: bool, what: str
) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """A mapInArrow function: run `step` per batch, anchor its outputs (FT on), flush at
    the end. With FT off failed records are dropped."""
    ft = settings.enabled
    ids = ID_COLUMN in out_schema.names  # not in barrier mode

    def run(batches: Iterator[Any]) -> Iterator[Any]:
        handler, finish = task_handler(settings)
        log_with_time_and_level()
        failures = Failures(what)
        for batch in batches:
            inputs = inputs_of(batch, ft)
            rows, parents, failed = step(payload_of(batch) if ft else batch, failures)
            causes = failures.take_causes(failed, batch.num_rows)
            if (
                failed is None
                and _is_identity(parents, batch.num_rows)
                and handler.pass_through(inputs)  # one output per input: same anchors
            ):
                if rows.num_rows:
                    yield _with_columns_of(rows, batch, out_schema) if ft else rows
                continue
            outputs = handler.process(inputs, parents, failed, causes)
            if rows.num_rows:
                if outputs is None:
                    yield rows
                else:
                    anchors = anchor_columns(outputs, multi, ids)
                    yield pa.RecordBatch.from_arrays([*rows.columns, *anchors], schema=out_schema)
        finish()
        log_failures(failures, what, ft=ft)

    return run


def filter_partition(
    settings: FTSettings,
    decide: Callable[[Any, Failures], tuple[NDArray[np.bool_], NDArray[np.bool_] | None]],
    what: str,
) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """A filter keeps its input's schema: kept rows get new ids in place (FT on)."""
    ft = settings.enabled

    def run(batches: Iterator[Any]) -> Iterator[Any]:
        handler, finish = task_handler(settings)
        log_with_time_and_level()
        failures = Failures(what)
        for batch in batches:
            inputs = inputs_of(batch, ft)
            keep, failed = decide(payload_of(batch) if ft else batch, failures)
            causes = failures.take_causes(failed, batch.num_rows)
            if failed is None and handler.pass_through(inputs, keep):
                # The kept rows keep their FT columns (barrier rows, handed-over ids).
                if keep.all():
                    yield batch
                elif keep.any():
                    yield batch.filter(pa.array(keep))
                continue
            if failed is not None:
                keep &= ~failed
            parents = np.flatnonzero(keep)
            outputs = handler.process(inputs, parents, failed, causes)
            if len(parents):
                kept = batch.take(pa.array(parents))
                yield kept if outputs is None else _with_anchors(kept, outputs)
        finish()
        log_failures(failures, what, ft=ft)

    return run


_IDENTITY: list[NDArray[np.intp]] = [np.arange(0, dtype=np.intp)]


def _is_identity(parents: NDArray[np.intp], n: int) -> bool:
    """Whether output j came from input j for every one of the n inputs (a map)."""
    if len(parents) != n:
        return False
    if len(_IDENTITY[0]) < n:
        _IDENTITY[0] = np.arange(max(n, 2 * len(_IDENTITY[0])), dtype=np.intp)
    return bool(np.array_equal(parents, _IDENTITY[0][:n]))


def _with_columns_of(rows: Any, batch: Any, schema: Any) -> Any:
    """`rows` with `batch`'s FT columns as they are (the outputs of a map whose
    anchors are its inputs')."""
    columns = list(rows.columns)
    for field in list(schema)[rows.num_columns :]:
        column = batch.column(field.name)
        columns.append(column if column.type == field.type else column.cast(field.type))
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def _with_anchors(batch: Any, anchors: Anchors) -> Any:
    """`batch` with its FT columns replaced by these anchors (same positions)."""
    present = batch.schema.names
    multi, ids = EXTRA_ANCHORS_COLUMN in present, ID_COLUMN in present
    names = [n for n in (*FT_COLUMNS, EXTRA_ANCHORS_COLUMN) if n in present]
    for name, column in zip(names, anchor_columns(anchors, multi, ids), strict=True):
        index = batch.schema.get_field_index(name)
        column = column.cast(batch.schema.field(index).type)
        batch = batch.set_column(index, batch.schema.field(index), column)
    return batch
