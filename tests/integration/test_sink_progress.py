"""The Kafka sink inside the query's plan (`ft_kafka_stream`) reports each batch's acked
and failed-by-cause rows in Spark's own progress (issue 16, part 3), on real parts: the
Tansu broker, a real `ftlayer serve`, local Spark. Some rows are larger than the
producer's request limit: once (on first sight, then replayed and written) or always
(dead-lettered after ft.maxRetries). Summed over the batches a StreamingQueryListener
sees, acked equals what the output topic holds, and failed by cause equals what the FT
layer counts (`ftlayer status`) and keeps (the dead letters' causes)."""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from fixture_types import MakeTopic
from pyspark import TaskContext, cloudpickle
from pyspark.errors import StreamingQueryException
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from serverproc import StartServer
from sparkprogress import Progress, first_sight

from ftlayer.client import FTClient
from ftlayer.integration import (
    FTSettings,
    FTTasks,
    SinkError,
    ft_kafka_stream,
    ft_observe,
)
from ftlayer.integration.harness.kafka import produce, read_all

cloudpickle.register_pickle_by_value(sys.modules[__name__])

N = 1_500
LIMIT = 16_000  # the producer's max_request_size
BIG = b"x" * 20_000
TOO_LARGE = "MessageSizeTooLargeError"


def once(i: int) -> bool:
    """Too large on first sight only: replayed, then written."""
    return i % 97 == 5


def always(i: int) -> bool:
    """Too large every time: dead-lettered."""
    return i % 250 == 7


def make_step(marks: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def step(row: dict[str, Any]) -> dict[str, Any]:
        event_id = int(row["key"])
        value = b"v%d" % event_id
        if always(event_id) or (once(event_id) and first_sight(marks, event_id)):
            value = BIG
        return {"key": row["key"], "value": value}

    return step


@pytest.mark.parametrize("completion", ["barrier", "tree"])
def test_each_batch_progress_carries_the_sinks_acked_and_failed_by_cause(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
    completion: str,
) -> None:
    server = start_server(None, "--tree-timeout-s", "120")
    settings = FTSettings(server.address)
    topic, out = make_topic(2), make_topic(2)
    produce(kafka_bootstrap, topic, [(str(i).encode(), b"in") for i in range(N)])
    dead = {i for i in range(N) if always(i)}
    retried = {i for i in range(N) if once(i) and not always(i)}
    marks = tmp_path / "marks"
    marks.mkdir()
    source = (
        spark.readStream.format("ftkafka")
        .option("kafka.bootstrap.servers", kafka_bootstrap)
        .option("subscribe", topic)
        .option("maxOffsetsPerTrigger", "500")
        .option("ft.address", server.address)
        .option("ft.completion", completion)
        .option("ft.maxRetries", "1")
        .option("ft.retryBackoffMs", "0")
        .option("ft.replayColumn", "true")
        .load()
    )
    stepped = FTTasks(settings).map(
        ft_observe(source, "ftlayer.source"), make_step(str(marks)), "key binary, value binary"
    )
    listener = Progress()
    spark.streams.addListener(listener)
    query = (
        ft_kafka_stream(
            stepped, kafka_bootstrap, out, settings, producer_config={"max_request_size": LIMIT}
        )
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(processingTime="250 milliseconds")
        .start()
    )
    listener.query_id = str(query.id)
    try:
        deadline = time.monotonic() + 240
        with FTClient(server.address) as client:
            while True:
                assert query.exception() is None, query.exception()
                status = client.status()
                if (
                    listener.total("ftlayer.sink", "acked") >= N - len(dead)
                    and status.dead_lettered >= len(dead)
                    and status.pending == 0
                ):
                    break
                assert time.monotonic() < deadline, (listener.batches, status.to_json())
                time.sleep(0.3)
            letters = client.dead_letters().letters
        last = query.lastProgress
    finally:
        query.stop()
        spark.streams.removeListener(listener)
    written = Counter(int(record.key) for record in read_all(kafka_bootstrap, out))
    # Nothing lost, nothing twice: every event is in the topic once, or a dead letter.
    assert set(written) == set(range(N)) - dead and set(written.values()) == {1}
    assert len(letters) == len(dead)
    assert len(retried) == len(os.listdir(marks)) > 10
    # acked: what the topic holds.
    assert listener.total("ftlayer.sink", "acked") == written.total() == N - len(dead)
    # failed by cause: one failure per retried event, two per dead one (ft.maxRetries 1),
    # all of them the sink's, as the FT layer counted and kept them.
    failures = len(retried) + 2 * len(dead)
    assert listener.total("ftlayer.sink", "failed") == failures
    assert listener.failed_by_error("ftlayer.sink") == {TOO_LARGE: failures}
    assert status.failed == {"explicit": failures, "timeout": 0, "recovery": 0, "source-expired": 0}
    assert status.dead_lettered == len(dead)
    assert all(
        cause["kind"] == "sink" and TOO_LARGE in cause["error"]
        for letter in letters
        for cause in letter["causes"]
    )
    # Every failure came back once as a replay, the dead ones' last one excepted.
    assert listener.total("ftlayer.source", "replays") == len(retried) + len(dead)
    # A batch's own progress: every row it read was written or failed by the sink.
    for batch_id, metrics in listener.batches.items():
        sink_metrics = metrics["ftlayer.sink"]
        read = metrics["ftlayer.source"]["rows"]
        assert sink_metrics["acked"] + sink_metrics["failed"] == read, (batch_id, metrics)
        assert sum(sink_metrics["failed_by_error"].values()) == sink_metrics["failed"]
    # lastProgress carries the same metrics (the last batch may have read nothing).
    sink = last["observedMetrics"]["ftlayer.sink"].asDict()
    assert set(sink) == {"acked", "failed", "failed_by_error", "error"}


def test_with_ft_off_a_failed_write_stops_the_query(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    tmp_path: Path,
) -> None:
    """FT off: nothing could replay a row whose write failed, so its task fails, and
    the query stops with the SinkError once Spark's task retries are spent; each
    attempt wrote the partition's other rows (at least once, never lost)."""
    topic, out = make_topic(1), make_topic(1)
    produce(kafka_bootstrap, topic, [(b"0", b"small"), (b"1", BIG)])
    source = (
        spark.readStream.format("ftkafka")
        .option("kafka.bootstrap.servers", kafka_bootstrap)
        .option("subscribe", topic)
        .option("ft.enabled", "false")
        .load()
        .select("key", "value")
    )
    settings = FTSettings(None, enabled=False)
    query = (
        ft_kafka_stream(
            source, kafka_bootstrap, out, settings, producer_config={"max_request_size": LIMIT}
        )
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .start()
    )
    try:
        with pytest.raises(StreamingQueryException, match=SinkError.__name__) as caught:
            query.awaitTermination(600)  # the error ends it; a bound for a hang only
    finally:
        query.stop()
    assert TOO_LARGE in str(caught.value)
    # Each attempt wrote the small row again: the retries' duplicates, nothing lost.
    keys = [int(record.key) for record in read_all(kafka_bootstrap, out)]
    assert set(keys) == {0} and len(keys) >= 2, keys


def summarise_then_fail_once(marks: str) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """The sink's shape: one summary row after the partition's rows; the first attempt
    of each task yields a wrong one (1000 times too many) and then fails."""

    def run(batches: Iterator[Any]) -> Iterator[Any]:
        rows = sum(batch.num_rows for batch in batches)
        context = TaskContext.get()
        assert context is not None
        first = context.attemptNumber() == 0
        yield pa.RecordBatch.from_pydict({"rows": pa.array([rows * (1000 if first else 1)])})
        if first:
            Path(marks, f"{context.stageId()}-{context.partitionId()}").touch()
            raise RuntimeError("the first attempt fails after its summary row")

    return run


def test_a_task_retried_after_its_summary_row_counts_once(
    spark: SparkSession, kafka_bootstrap: str, make_topic: MakeTopic, tmp_path: Path
) -> None:
    """What the sink's figures rest on: Spark merges a task's observed aggregates only
    when the task succeeds, so an attempt that yielded its summary row and then failed
    is not in the batch's progress."""
    n = 200
    topic = make_topic(2)
    produce(kafka_bootstrap, topic, [(str(i).encode(), b"v") for i in range(n)])
    marks = tmp_path / "marks"
    marks.mkdir()
    summaries = (
        spark.readStream.format("ftkafka")
        .option("kafka.bootstrap.servers", kafka_bootstrap)
        .option("subscribe", topic)
        .option("ft.enabled", "false")
        .load()
        .select("value")
        .mapInArrow(summarise_then_fail_once(str(marks)), "rows long")
    )
    query = (
        summaries.observe("summaries", F.sum("rows").alias("rows"))
        .writeStream.format("noop")
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    try:
        assert query.awaitTermination(180), "the query did not finish"
        progress = query.recentProgress
    finally:
        query.stop()
    observed = [p["observedMetrics"]["summaries"]["rows"] for p in progress]
    assert sum(r for r in observed if r is not None) == n, observed
    assert len(os.listdir(marks)) >= 2  # each partition's first attempt failed
