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

The rows a sink acked and failed: not from the foreachBatch sinks (`ft_kafka_sink`,
`ft_foreach_batch`), since Spark reports only metrics observed on the streaming
query's own plan, and those sinks ack and fail in foreachBatch jobs of their own
(observing inside foreachBatch reaches no progress). `ft_kafka_stream`
(integration.kafkastream) puts the Kafka write into the query's plan and observes
each batch's `acked`, `failed` and `failed_by_error` there; `ft_foreach_batch` keeps
them in its `last_result` (`SinkResult`) on the driver.

The records the tasks failed (a FailException, or another error under
on_error="fail-record"), by cause: no observation downstream of a step can count them,
since a step fails a record from inside its mapInArrow and drops its row. Build the
steps with `FTTasks(settings, observe=True)` (or `observe=` on one step) instead: each
observed step counts its partition itself and reports `records`, `outputs`, `failed`,
`explicit` and `error` under `observedMetrics["ftlayer.step.<kind>(<function>)"]`
(integration.tasks.observed). A count the driver fetched from the FT layer would not
be the batch's: fails reach the FT layer as they happen, from this batch's tasks, its
sink and the timeouts of earlier batches' trees alike, and nothing in them names a
micro-batch (nor has a Python streaming source a hook for metrics of its own in the
progress: PySpark 4.3's DataSourceStreamReader reports offsets only). The rest is in
the FT layer: `ftlayer status` (`failed` by cause: `explicit`, every fail event, the
sinks' and steps' included; `timeout`; `recovery`; per source in `by_source`;
`dead_lettered`), and per record, with each failure's kind (explicit, error, sink,
timeout), step and error, `ftlayer inspect` and the dead letters.
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
