"""The ftkafka source over an FT layer of two shards, on real parts: two `ftlayer
serve --shard I --shards 2` processes, the Tansu broker, local Spark.

- A pipeline with explicit failures (once) and poison records (always, dead-lettered
  after one retry), in barrier and in tree mode: every other record reaches the sink,
  every poison record the dead-letter topic, the group offsets reach the end of every
  partition, and each shard's STATUS counts the records and dead letters of its own
  partitions only.
- Bad input at query start: shards listed in another order or another number than
  their cluster's, and a shard that does not answer, each named.

A shard SIGKILLed mid-stream and started again later: test_shard_outage.py.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fixture_types import MakeTopic
from kafka import KafkaConsumer, TopicPartition
from pyspark import cloudpickle
from pyspark.errors.exceptions.captured import StreamingQueryException
from pyspark.sql import DataFrame, SparkSession
from serverproc import Server, StartServer

from ftlayer.client import FTClient
from ftlayer.errors import ConfigError, FailException, SourceError
from ftlayer.integration.ftcolumns import FTSettings
from ftlayer.integration.harness.kafka import end_offsets, produce, read_all
from ftlayer.integration.sinks import ft_foreach_batch
from ftlayer.integration.source import parse_options
from ftlayer.integration.source.driver import SourceDriver
from ftlayer.integration.tasks import FTTasks
from ftlayer.shards import partition_shard
from ftlayer.status import Status

cloudpickle.register_pickle_by_value(sys.modules[__name__])

SCHEMA = "id long"
N = 2000
PARTITIONS = 4


def is_poison(i: int) -> bool:
    return i % 200 == 7


def fails_once(i: int) -> bool:
    return i % 37 == 5 and not is_poison(i)


def make_step(marks: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """Poison records always fail; the fails-once records on first sight (an O_EXCL
    marker, across Python workers)."""

    def step(row: dict[str, Any]) -> dict[str, Any]:
        event_id = int(row["key"])
        if is_poison(event_id):
            raise FailException(f"event {event_id} is poison")
        if fails_once(event_id):
            try:
                os.close(os.open(os.path.join(marks, str(event_id)), os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                raise FailException(f"event {event_id}: upstream timed out")
        return {"id": event_id}

    return step


class Collected:
    """The ids a foreachBatch sink wrote, on the driver."""

    def __init__(self) -> None:
        self.ids: list[int] = []

    def __call__(self, batch: DataFrame, epoch_id: int) -> None:
        self.ids.extend(row.id for row in batch.select("id").collect())


def start_shards(start_server: StartServer, tmp_path: Path, *extra: str) -> list[Server]:
    return [
        start_server(tmp_path / f"shard{i}", "--shard", str(i), "--shards", "2", *extra)
        for i in (0, 1)
    ]


def statuses(servers: list[Server]) -> list[Status]:
    out = []
    for server in servers:
        with FTClient(server.address) as client:
            out.append(client.status())
    return out


def group_lag(bootstrap: str, group: str, topic: str) -> int:
    ends = end_offsets(bootstrap, topic)
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    try:
        return sum(e - (consumer.committed(TopicPartition(topic, p)) or 0) for p, e in ends.items())
    finally:
        consumer.close(autocommit=False)


@pytest.mark.parametrize("completion", ["barrier", "tree"])
def test_two_shards_lose_nothing_and_each_does_its_own_partitions_work(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
    completion: str,
) -> None:
    shards = start_shards(start_server, tmp_path, "--tree-timeout-s", "60")
    addresses = ",".join(s.address for s in shards)
    settings = FTSettings(addresses)
    topic, dead_topic = make_topic(PARTITIONS), make_topic(1)
    group = f"shards-{uuid.uuid4().hex[:8]}"
    positions = produce(kafka_bootstrap, topic, [(str(i).encode(), b"v") for i in range(N)])
    partition_of = {i: p.partition for i, p in enumerate(positions)}
    (tmp_path / "marks").mkdir()
    source = (
        spark.readStream.format("ftkafka")
        .option("kafka.bootstrap.servers", kafka_bootstrap)
        .option("subscribe", topic)
        .option("maxOffsetsPerTrigger", "700")
        .option("ft.address", addresses)
        .option("ft.completion", completion)
        .option("ft.maxRetries", "1")
        .option("ft.retryBackoffMs", "100")
        .option("ft.deadLetterTopic", dead_topic)
        .option("kafka.group.id", group)
        .load()
    )
    source_id = parse_options({"subscribe": topic, "kafka.bootstrap.servers": "x"}).source_ids()[
        topic
    ]
    stepped = FTTasks(settings).map(source, make_step(str(tmp_path / "marks")), SCHEMA)
    collected = Collected()
    query = (
        stepped.writeStream.foreachBatch(ft_foreach_batch(collected, settings))
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(processingTime="250 milliseconds")
        .start()
    )
    poison = {i for i in range(N) if is_poison(i)}
    began = time.monotonic()
    try:
        deadline = time.monotonic() + 180
        while True:
            if query.exception() is not None:
                raise AssertionError(f"the query failed: {query.exception()}")
            now = statuses(shards)
            if (
                sum(s.persisted for s in now) >= N
                and all(s.pending == 0 and s.dead_letters == 0 for s in now)
                and sum(s.dead_lettered for s in now) == len(poison)
                and group_lag(kafka_bootstrap, group, topic) == 0
            ):
                break
            assert time.monotonic() < deadline, f"not settled: {[s.to_json() for s in now]}"
            time.sleep(0.3)
        settled_s = time.monotonic() - began
    finally:
        query.stop()
    # Nothing lost: every other record reached the sink, every poison record the
    # dead-letter topic (key and value as read).
    assert set(collected.ids) == set(range(N)) - poison
    letters = read_all(kafka_bootstrap, dead_topic, timeout=60)
    assert sorted(int(r.key) for r in letters) == sorted(poison)
    # Each shard did the work of its own partitions, and only that.
    owner = {p: int(partition_shard(source_id, p, 2)) for p in range(PARTITIONS)}
    assert sorted(set(owner.values())) == [0, 1]
    for index, status in enumerate(statuses(shards)):
        figures = status.by_source[str(source_id)]
        mine = [i for i in range(N) if owner[partition_of[i]] == index]
        assert figures.persisted == len(mine), index
        assert figures.dead_lettered == len(poison & set(mine)), index
        assert sum(figures.failed.values()) >= len([i for i in mine if fails_once(i)]), index
        assert status.checkpoints[topic].completed > 0, index  # ft.sourceName: the topic
        assert status.failed.get("timeout", 0) == 0, index  # no tree waited for a lost ack
    print(f"2 shards, {completion} mode: {N} records settled in {settled_s:.1f} s")


def _driver(kafka_bootstrap: str, topic: str, address: str, **options: str) -> SourceDriver:
    parsed = parse_options(
        {
            "kafka.bootstrap.servers": kafka_bootstrap,
            "subscribe": topic,
            "ft.address": address,
            **options,
        }
    )
    return SourceDriver(parsed, parsed.source_ids())


def test_shards_named_in_another_order_stop_the_query_at_start(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
) -> None:
    shards = start_shards(start_server, tmp_path)
    topic = make_topic(2)
    query = (
        spark.readStream.format("ftkafka")
        .option("kafka.bootstrap.servers", kafka_bootstrap)
        .option("subscribe", topic)
        .option("ft.address", f"{shards[1].address},{shards[0].address}")
        .load()
        .writeStream.format("noop")
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .start()
    )
    try:
        with pytest.raises(
            StreamingQueryException,
            match=re.escape(
                f"the FT layer at {shards[1].address} is shard 1 of 2, but ft.address "
                "names it as shard 0 of 2"
            ),
        ):
            query.awaitTermination(600)  # the error ends it; a bound for a hang only
    finally:
        query.stop()
    # Nothing was registered with either shard.
    assert all(not s.sources for s in statuses(shards))


def test_shards_of_another_cluster_shape_or_one_that_does_not_answer_are_named(
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
) -> None:
    shards = start_shards(start_server, tmp_path)
    alone = start_server(tmp_path / "alone")
    topic = make_topic(2)
    cases: list[tuple[str, type[Exception], str]] = [
        (  # one shard of two, named as the whole FT layer
            shards[0].address,
            ConfigError,
            f"the FT layer at {shards[0].address} is shard 0 of 2, but ft.address names "
            "it as shard 0 of 1",
        ),
        (  # a server of its own, named as a second shard
            f"{shards[0].address},{alone.address}",
            ConfigError,
            f"the FT layer at {alone.address} is shard 0 of 1, but ft.address names it "
            "as shard 1 of 2",
        ),
    ]
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{probe.getsockname()[1]}"
    cases.append(
        (
            f"{shards[0].address},{closed}",
            SourceError,
            f"shard 1 of the FT layer, at {closed} (option ft.address) did not answer",
        )
    )
    for address, error, words in cases:
        driver = _driver(kafka_bootstrap, topic, address, **{"ft.reconnectTimeoutMs": "300"})
        try:
            with pytest.raises(error, match=re.escape(words)):
                driver.start()
        finally:
            driver.close()
    assert all(not s.sources for s in statuses([*shards, alone]))
