"""ftlayer's figures in Spark's own progress (issue 16, part 3), on real parts: the Tansu
broker, a real `ftlayer serve`, local Spark. A query observes its source (with
`ft.replayColumn`) and its sink's input with `ft_observe`; summed over its batches, as
a StreamingQueryListener sees them, the source read every event once plus every
failed one again as a replay, the replays are exactly the failures, and the sink got
every event once; `lastProgress` carries the same metrics."""

from __future__ import annotations

import os
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fixture_types import MakeTopic
from pyspark import cloudpickle
from pyspark.sql import DataFrame, SparkSession
from serverproc import StartServer
from sparkprogress import Progress, first_sight

from ftlayer.errors import FailException
from ftlayer.integration import FTSettings, FTTasks, ft_foreach_batch, ft_observe
from ftlayer.integration.ftcolumns import REPLAY_COLUMN
from ftlayer.integration.harness.kafka import produce

cloudpickle.register_pickle_by_value(sys.modules[__name__])

N = 3_000


def fails_once(i: int) -> bool:
    return zlib.crc32(i.to_bytes(8, "little")) % 50 == 0


def make_step(marks: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The events `fails_once` picks fail on first sight (an O_EXCL marker file)."""

    def step(row: dict[str, Any]) -> dict[str, Any]:
        event_id = int(row["key"])
        if fails_once(event_id) and first_sight(marks, event_id):
            raise FailException(f"event {event_id}: first sight")
        return {"id": event_id}

    return step


class Collected:
    def __init__(self) -> None:
        self.ids: list[int] = []

    def __call__(self, batch: DataFrame, epoch_id: int) -> None:
        self.ids.extend(row.id for row in batch.select("id").collect())


def test_each_batch_progress_carries_what_ftlayer_read_replayed_and_delivered(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
) -> None:
    server = start_server(None, "--tree-timeout-s", "60")
    settings = FTSettings(server.address)
    topic = make_topic(2)
    produce(kafka_bootstrap, topic, [(str(i).encode(), b"v%d" % i) for i in range(N)])
    failing = {i for i in range(N) if fails_once(i)}
    marks = tmp_path / "marks"
    marks.mkdir()
    source = (
        spark.readStream.format("ftkafka")
        .option("kafka.bootstrap.servers", kafka_bootstrap)
        .option("subscribe", topic)
        .option("maxOffsetsPerTrigger", "1000")
        .option("ft.address", server.address)
        .option("ft.retryBackoffMs", "0")
        .option("ft.replayColumn", "true")
        .load()
    )
    assert source.schema[REPLAY_COLUMN].dataType.simpleString() == "boolean"
    tasks = FTTasks(settings)
    stepped = tasks.map(ft_observe(source, "ftlayer.source"), make_step(str(marks)), "id long")
    assert REPLAY_COLUMN not in stepped.columns  # an FT column: not handed on by tasks
    collected = Collected()
    listener = Progress()
    spark.streams.addListener(listener)
    query = (
        ft_observe(stepped, "ftlayer.sink")
        .writeStream.foreachBatch(ft_foreach_batch(collected, settings))
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(processingTime="250 milliseconds")
        .start()
    )
    listener.query_id = str(query.id)
    try:
        deadline = time.monotonic() + 240
        while listener.total("ftlayer.sink", "rows") < N or len(set(collected.ids)) < N:
            assert query.exception() is None, query.exception()
            assert time.monotonic() < deadline, (listener.batches, len(collected.ids))
            time.sleep(0.2)
        last = query.lastProgress
    finally:
        query.stop()
        spark.streams.removeListener(listener)
    assert sorted(collected.ids) == list(range(N))
    assert len(failing) == len(os.listdir(marks)) > 10
    # The source read every event once and every failed one once more, as a replay.
    assert listener.total("ftlayer.source", "rows") == N + len(failing)
    assert listener.total("ftlayer.source", "replays") == len(failing)
    # The sink got every event once.
    assert listener.total("ftlayer.sink", "rows") == N
    # A batch's own progress: each batch's source rows = Kafka rows read + its replays.
    for batch_id, metrics in listener.batches.items():
        source_metrics = metrics["ftlayer.source"]
        assert 0 <= source_metrics["replays"] <= source_metrics["rows"], batch_id
    # lastProgress carries them too (the last batch may have read nothing new).
    assert set(last["observedMetrics"]) == {"ftlayer.source", "ftlayer.sink"}
    assert set(last["observedMetrics"]["ftlayer.source"].asDict()) == {"rows", "replays"}
    assert set(last["observedMetrics"]["ftlayer.sink"].asDict()) == {"rows"}
