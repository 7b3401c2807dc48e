"""The Kafka sink inside the query's own plan: `ft_kafka_stream(df, ...)`, whose acked
and failed rows every micro-batch's StreamingQueryProgress carries.

`ft_kafka_sink` writes in a foreachBatch job of its own, and Spark reports in a
batch's progress only the metrics observed on the streaming query's plan (see
integration.observe). `ft_kafka_stream` puts the write into that plan instead:

    source -> tasks -> write (mapInArrow, one summary row per partition)
           -> observe(name, sums of the summary rows) -> the `noop` sink

It returns the DataStreamWriter (format `noop`); the caller adds the checkpoint
location, trigger and output mode, and starts it. Each partition of a micro-batch is
written to Kafka by the same partition function as `ft_kafka_sink` (integration.sinks:
one producer per partition, a row acked once the broker confirmed its write, failed
with a `sink` cause otherwise, vectorized per Arrow batch; headers alike), and
yields one summary row. Spark sums the summary rows of the batch and
reports them under `lastProgress["observedMetrics"][name]` (and to every
StreamingQueryListener):

- `acked`: rows whose write the broker confirmed (in barrier mode their trees
  complete at the batch's barrier: the sink sends no acks, so "acked" is "written");
- `failed`: rows whose write failed; their roots were failed and are replayed;
- `failed_by_error`: those rows per error type, e.g. `{"MessageSizeTooLargeError": 3}`
  (all of cause kind `sink`; an Arrow batch's failed rows all have its first error as
  their cause, here and in the FT layer's cause of each root);
- `error`: one write error of the batch (repr), null if none failed.

Only successful task attempts count: a partition yields its summary row after its last
write, and Spark merges a task's observed aggregates only when the task succeeds (on
PySpark 4.3, an attempt that yielded its row and then failed is not in the batch's
figures: tests/integration/test_sink_progress.py). So a retried task counts once; the
rows its failed attempt wrote stay in the topic and the retry writes them again
(duplicates in the topic, never in the figures): this sink does not resume a retried
task as `ft_kafka_sink` does (integration.resume), which takes a driver step per batch
(a write id and the topic's end offsets before the batch writes) that a plan built
once has no place for. A batch that Spark runs again after a restart counts in its new
run.

Failures, unlike `ft_kafka_sink`'s: nothing is raised on the driver, since the write
happens in the tasks and a task that raised would be retried and write its confirmed
rows again. A failed write fails its roots (replayed, with `ft.maxRetries` and dead
letters as for any failure) and the query goes on, as with on_error="fail-and-continue";
the progress says how many failed and why. FT off: nothing could replay a failed row,
so the task raises SinkError after its writes; Spark retries it (the confirmed rows
are written again) and the query stops once spark.task.maxFailures is reached.

No loop mode: a loop sink writes only the rows that go round again, and the rest go
to another sink (rule 4.2 of the user guide), which takes a foreachBatch function
routing each row to `ft_kafka_sink(..., loop=True)` or the final sink; a query has
one sink in its plan.

A task's own failures (a FailException in an FTTasks step) do not appear here: the
failed row is dropped inside the task, so no row reaches the sink or any observation
downstream; `FTTasks(settings, observe=True)` reports them per step
(integration.tasks.observed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Final

from ftlayer.errors import ConfigError

from .ftcolumns import FTSettings
from .sinks import (
    _SUMMARY_SCHEMA,
    DEFAULT_PRODUCER_CONFIG,
    SinkError,
    _check_ft_columns,
    _kafka_partition,
    kafka_columns,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.streaming.readwriter import DataStreamWriter

__all__ = ["SINK_NAME", "ft_kafka_stream"]

SINK_NAME: Final = "ftlayer.sink"
"""The default name of the sink's observed metrics in a batch's progress."""


def ft_kafka_stream(
    df: DataFrame,
    bootstrap_servers: str,
    topic: str,
    settings: FTSettings,
    *,
    key_column: str | None = "key",
    value_column: str = "value",
    producer_config: Mapping[str, Any] | None = None,
    headers_column: str | None = "headers",
    name: str = SINK_NAME,
) -> DataStreamWriter:
    """`df.writeStream` writing `key_column`/`value_column` (and `headers_column`, if
    `df` has it) to `topic` inside the query's plan, with the acked and failed rows
    observed under `name` in every batch's progress (module docstring). Rows are
    acked once the broker confirmed them and failed (replayed) otherwise, as with
    `ft_kafka_sink`."""
    from pyspark.sql import functions as F

    if not df.isStreaming:
        raise ConfigError("ft_kafka_stream writes a streaming DataFrame; use ft_kafka_sink")
    ft_columns = _check_ft_columns(df, settings)
    data_columns, headers = kafka_columns(df, key_column, value_column, headers_column, False)
    config = {**DEFAULT_PRODUCER_CONFIG, **(producer_config or {})}
    run = _kafka_partition(
        settings, bootstrap_servers, topic, key_column, value_column, config, False, headers
    )
    if not settings.enabled:
        run = _raising(run, topic)
    summary = df.select(*data_columns, *ft_columns).mapInArrow(run, _SUMMARY_SCHEMA)
    merged = F.aggregate(
        F.collect_list("failed_by"),
        F.create_map().cast("map<string,long>"),
        lambda total, part: F.map_zip_with(
            total, part, lambda _, a, b: F.coalesce(a, F.lit(0)) + F.coalesce(b, F.lit(0))
        ),
    )
    observed = summary.observe(
        name,
        F.coalesce(F.sum("written"), F.lit(0)).alias("acked"),
        F.coalesce(F.sum("failed"), F.lit(0)).alias("failed"),
        merged.alias("failed_by_error"),
        F.min("error").alias("error"),
    )
    return observed.writeStream.format("noop")


def _raising(
    run: Callable[[Iterator[Any]], Iterator[Any]], topic: str
) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """FT off: a partition with a failed write fails its task (nothing could replay it)."""

    def checked(batches: Iterator[Any]) -> Iterator[Any]:
        for summary in run(batches):
            row = summary.to_pylist()[0]
            if row["failed"]:
                raise SinkError(
                    f"{row['failed']} of {row['written'] + row['failed']} rows were not "
                    f"written to Kafka topic {topic!r} (FT is off: nothing replays them); "
                    f"first error: {row['error']}"
                )
            yield summary

    return checked
