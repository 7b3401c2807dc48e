"""Sink holds: `ft_foreach_batch` in tree mode without caching the batch
(ftlayer.core.sinkholds has the FT layer's side).

The sink must ack every row its function wrote, and it learns the rows' roots only by
reading the batch's FT columns. Reading them after the write computes the batch a
second time, unless the batch is cached first, and the cache costs about as much as
the FT layer's whole budget in a fast pipeline. So when the sink can tell where its
rows come from, it leaves the acks to the steps that produce them:

1. On the driver (`held_steps`), the sink finds the running streaming query (the
   `sql.streaming.queryId` local property, the default session's query manager) and
   walks its plan from the sink down. Every FTTasks map or filter step (one
   mapInArrow, fused or not) is a Python function named `ftlayer_step_<id>`; every
   other FT task (observed steps, aggregates) is named `ftlayer_task_<id>`. The rows
   reach the sink from *top steps*: steps with no other FT task between them and the
   sink. The sink holds only when it reaches nothing but top steps, each fed (below)
   only by the ftkafka source: a leaf with FT columns and no step above it (rows
   straight from the source), an FT task on top, or a plan it cannot read, and it
   caches as before.
2. It sets the `ftlayer.sink.hold` local property to "<key>:<step ids>" around the
   user's function, so that every Spark job the function runs carries it to its
   tasks; the key is random, 64 bits with the top bit set.
3. In those tasks, a top step (`holding`) sends, at the end of its partition, the ack
   pairs (root, id) of every row it produced, under the key (SINK_HOLD): what the
   sink would have sent for those rows, held by the FT layer, not applied.
4. After the function, the sink settles the key (SINK_SETTLE): returned, the held
   acks are XOR-ed and the trees complete; raised, every held root fails.

The key travels as a local property, so it reaches the jobs `fn` starts in its own
thread (or in a pyspark InheritableThread), not those of a plain Python thread: such a
job's rows are never acked, and their trees time out and are replayed (duplicates,
never a loss). Rows a plain Spark operator drops between a top step and the sink are
acked with the rest (the sink's own acks would have left them to time out). The function computing
the batch twice (two actions) reads the source twice: the re-read takes the first
read's roots over (ftlayer.core.takeover), and only the second computation's acks
complete trees. That is why a step must be fed by the ftkafka source: rows of a
static DataFrame with FT columns keep their roots when computed again, and are cached.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterator
from typing import Any, Final

import numpy as np

from ftlayer.integration.anchors import read_anchors
from ftlayer.wire.messages import SINK_KEY_BIT

from .ftcolumns import ROOT_COLUMN, FTSettings

log = logging.getLogger(__name__)

__all__ = [
    "HOLD_PROPERTY",
    "STEP_PREFIX",
    "TASK_PREFIX",
    "held_steps",
    "hold_value",
    "holding",
    "named_task",
    "new_sink_key",
]

HOLD_PROPERTY: Final = "ftlayer.sink.hold"
STEP_PREFIX: Final = "ftlayer_step_"
TASK_PREFIX: Final = "ftlayer_task_"
_QUERY_ID_PROPERTY: Final = "sql.streaming.queryId"  # Spark's StreamExecution.QUERY_ID_KEY

Runner = Callable[[Iterator[Any]], Iterator[Any]]


def new_sink_key() -> int:
    return SINK_KEY_BIT | secrets.randbits(63)


def hold_value(key: int, steps: list[str]) -> str:
    """The local property's value: the key in hex, then the top steps' ids."""
    return f"{key:x}:{','.join(steps)}"


def _held_by(step: str) -> int | None:
    """The sink key this task holds its rows' acks under, if `step` is a top step of
    the sink whose job this task belongs to."""
    from pyspark import TaskContext

    context = TaskContext.get()
    value = context.getLocalProperty(HOLD_PROPERTY) if context is not None else None
    if not value:
        return None
    key, _, steps = value.partition(":")
    return int(key, 16) if step in steps.split(",") else None


def named_task(run: Runner) -> Runner:
    """An FT task's mapInArrow function named as one (`ftlayer_task_<id>`), so that a
    sink sees it in the plan and does not hold past it."""
    run.__name__ = TASK_PREFIX + secrets.token_hex(6)
    return run


def holding(run: Runner, settings: FTSettings) -> Runner:
    """A map or filter step's mapInArrow function, named `ftlayer_step_<id>`, which in
    a sink's job where it is a top step sends its output rows' acks under the sink's
    key at the end of its partition (module docstring, step 3)."""
    step = secrets.token_hex(6)

    def hold_or_run(batches: Iterator[Any]) -> Iterator[Any]:
        key = _held_by(step)
        if key is None:
            yield from run(batches)
            return
        roots: list[Any] = []
        ids: list[Any] = []
        for out in run(batches):
            if out.num_rows:
                anchors = read_anchors(out).merged()
                tree = anchors.ids != 0
                roots.append(anchors.roots[tree])
                ids.append(anchors.ids[tree])
            yield out
        if roots:
            settings.channel().sink_hold(key, np.concatenate(roots), np.concatenate(ids))

    hold_or_run.__name__ = STEP_PREFIX + step
    return hold_or_run


# ---- the driver: the sink's top steps ------------------------------------------------


def held_steps(spark: Any) -> list[str] | None:
    """The ids of the steps the running streaming query's rows reach its sink from, if
    the sink may leave its acks to them (module docstring, step 1); else None."""
    query_id = spark.sparkContext.getLocalProperty(_QUERY_ID_PROPERTY)
    if not query_id:
        return None
    try:
        session = spark._jvm.org.apache.spark.sql.SparkSession.getDefaultSession()
        sessions = [spark._jsparkSession] + ([session.get()] if session.isDefined() else [])
        for jsession in sessions:
            query = jsession.streams().get(query_id)
            if query is not None:
                return _top_steps(query.streamingQuery().lastExecution().analyzed())
    except Exception as exc:  # a Spark without these internals: the sink caches
        log.debug("the sink cannot read its query's plan (%r): it caches the batch", exc)
    return None


def _top_steps(plan: Any) -> list[str] | None:
    found: list[str] = []
    stack = [plan]
    while stack:
        node = stack.pop()
        name = _function_name(node)
        if name is not None and name.startswith(STEP_PREFIX):
            if not _fed_by_source_only(node):
                return None
            found.append(name[len(STEP_PREFIX) :])
            continue
        if name is not None and name.startswith(TASK_PREFIX):
            return None
        children = _children(node)
        if not children and _has_ft_columns(node):
            return None  # rows straight from a source (or a table with FT columns)
        stack.extend(children)
    return found or None


def _fed_by_source_only(step: Any) -> bool:
    """Every leaf under `step` with FT columns is a streaming Python source (ftkafka):
    a computation done again reads it again, under new roots."""
    stack = _children(step)
    while stack:
        node = stack.pop()
        children = _children(node)
        if children:
            stack.extend(children)
        elif _has_ft_columns(node):
            kind = node.getClass().getSimpleName()
            if kind != "StreamingDataSourceV2ScanRelation":
                return False
            if "PythonMicroBatchStream" not in node.stream().getClass().getName():
                return False
    return True


def _function_name(node: Any) -> str | None:
    if node.getClass().getSimpleName() != "MapInArrow":
        return None
    return str(node.functionExpr().name())


def _children(node: Any) -> list[Any]:
    children = node.children()
    return [children.apply(i) for i in range(children.size())]


def _has_ft_columns(node: Any) -> bool:
    output = node.output()
    return any(output.apply(i).name() == ROOT_COLUMN for i in range(output.size()))
