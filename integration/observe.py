"""ftlayer's figures in Spark's own progress: `ft_observe(df, name)`.

`DataFrame.observe` on a streaming DataFrame makes Spark aggregate named metrics over
each micro-batch's rows and report them in that batch's StreamingQueryProgress, under
`observedMetrics[name]`: `query.lastProgress`, `query.recentProgress` and every
StreamingQueryListener's `onQueryProgress` see them. `ft_observe` observes the rows at
one point of an FT pipeline:

- `rows`: the batch's rows there;
- `replays`: those that are replayed records (the source's `ft_replay` column, with
  the source option `ft.replayColumn=true`; absent without the column).

Right after `load()` these are the records the batch read (Kafka records and replays
alike) and the replays among them, that is, the failures of earlier batches coming
back; before `writeStream` (a second name) the rows the sink gets. One aggregation
per batch (a count and a sum, combined per partition), on the rows Spark computes
anyway: `ftlayer bench pipeline --observe` measures it.

What is not there, and why: the rows a sink acked or failed, and the failures of the
tasks by cause. Spark reports only metrics observed on the streaming query's own plan;
the sinks ack and fail inside their foreachBatch jobs, and a task's failed records
leave no row behind, so no aggregate of the plan can count them (observing inside
foreachBatch reaches no progress). They are in each sink's `last_result` on the
driver (`SinkResult`: acked, failed, the first error), in the FT layer's counters
(`ftlayer status`: failed by cause, dead-lettered, replayed) and, per record, in
`ftlayer inspect`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from .ftcolumns import REPLAY_COLUMN

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["DEFAULT_NAME", "ft_observe"]

DEFAULT_NAME: Final = "ftlayer"


def ft_observe(df: DataFrame, name: str = DEFAULT_NAME) -> DataFrame:
    """`df` with ftlayer's figures observed under `name` in every batch's progress
    (`lastProgress["observedMetrics"][name]`: rows, and replays where `df` has the
    `ft_replay` column); see the module docstring. Names must differ within a query."""
    from pyspark.sql import functions as F

    metrics = [F.count(F.lit(1)).alias("rows")]
    if REPLAY_COLUMN in df.columns:
        replays = F.sum(F.col(REPLAY_COLUMN).cast("long"))
        metrics.append(F.coalesce(replays, F.lit(0)).alias("replays"))
    return df.observe(name, *metrics)
