"""What the ftkafka source does when Spark reports a batch done (commit(end)): consumer
group offsets (issue 4, section 5 and test g) and replay-queue pruning.

With `kafka.group.id`, the ftkafka source commits, for every partition, the group
offset min(batch end, lowest offset still pending in the FT layer) when Spark reports a
batch done (commit(end), one batch late). Real Tansu, a real `ftlayer serve`, local
Spark: a sink that leaves one record unacked must hold its partition's committed offset
at that record while the other partition moves on, and acking it lets the offset pass.
Both modes also run on an FT layer of two shards (`ftlayer serve --shard I --shards
2`): the topic's two partitions are then on different shards (shard (source id + p)
mod 2), each shard checkpoints its own and allows its own partition's group offset.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fixture_types import MakeTopic
from kafka import KafkaConsumer, TopicPartition
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from serverproc import Server, StartServer

from ftlayer.client import FTClient
from ftlayer.integration.ftcolumns import FTSettings, to_unsigned
from ftlayer.integration.harness.kafka import produce, wait_until
from ftlayer.integration.sinks import settle
from ftlayer.integration.source import parse_options
from ftlayer.shards import partition_shard

HELD = (0, 3)  # (partition, offset) of the record the sink does not ack at first


def committed(bootstrap: str, group: str, topic: str, partitions: int) -> dict[int, int | None]:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    try:
        return {p: consumer.committed(TopicPartition(topic, p)) for p in range(partitions)}
    finally:
        consumer.close(autocommit=False)


def start_layer(start_server: StartServer, tmp_path: Path, shards: int) -> list[Server]:
    """One `ftlayer serve`, or the shards of one, in shard order; trees never time out
    within a test."""
    if shards == 1:
        return [start_server(None, "--tree-timeout-s", "600")]
    return [
        start_server(
            tmp_path / f"shard{i}",
            "--shard",
            str(i),
            "--shards",
            str(shards),
            "--tree-timeout-s",
            "600",
        )
        for i in range(shards)
    ]


def held_shard(servers: list[Server], topic: str) -> Server:
    """The server that owns HELD's partition."""
    source_id = parse_options({"subscribe": topic, "kafka.bootstrap.servers": "x"}).source_ids()
    return servers[partition_shard(source_id[topic], HELD[0], len(servers))]


def run(
    spark: SparkSession, opts: dict[str, str], checkpoint: Path, settings: FTSettings
) -> list[dict[str, Any]]:
    """One availableNow run whose sink acks every row but HELD; returns HELD's rows."""
    held: list[dict[str, Any]] = []

    def sink(batch: DataFrame, batch_id: int) -> None:
        # Two actions on one micro-batch: cache it, or the source would read (and
        # persist, under new roots) the batch twice (see integration.sinks).
        batch.persist()
        is_held = (F.col("partition") == HELD[0]) & (F.col("offset") == HELD[1])
        held.extend(row.asDict() for row in batch.filter(is_held).collect())
        settle(batch.filter(~is_held), settings, ack=True)
        batch.unpersist()

    query = (
        spark.readStream.format("ftkafka")
        .options(**opts)
        .load()
        .writeStream.foreachBatch(sink)
        .trigger(availableNow=True)
        .option("checkpointLocation", str(checkpoint))
        .start()
    )
    try:
        assert query.awaitTermination(120), "the availableNow query did not finish"
    finally:
        query.stop()
    return held


@pytest.mark.parametrize("shards", [1, 2])
def test_group_offsets_never_pass_an_incomplete_record(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
    shards: int,
) -> None:
    servers = start_layer(start_server, tmp_path, shards)
    address = ",".join(s.address for s in servers)
    settings = FTSettings(address)
    topic, group = make_topic(2), f"g-{uuid.uuid4().hex[:8]}"
    server = held_shard(servers, topic)
    for p in range(2):  # 20 records in each partition, offsets 0..19
        produce(kafka_bootstrap, topic, [(None, b"a%d" % i) for i in range(20)], partition=p)
    opts = {
        "kafka.bootstrap.servers": kafka_bootstrap,
        "subscribe": topic,
        "ft.address": address,
        "ft.completion": "tree",  # a record is held by not acking it
        "kafka.group.id": group,
        "maxOffsetsPerTrigger": "10",  # 5 per partition: 4 batches, commits one late
    }
    held = run(spark, opts, tmp_path / "checkpoint", settings)
    assert len(held) == 1
    after_first = committed(kafka_bootstrap, group, topic, 2)
    assert after_first[0] == HELD[1], after_first  # held at the unacked record
    assert after_first[1] is not None and after_first[1] >= 10, after_first
    for each in servers:  # every shard completed checkpoints of its own partition
        with each.client() as client:
            assert client.status()["checkpoints"][topic]["completed"] >= 3, each.address

    # The held record completes; the next run's commits move past it.
    with server.client() as client:
        root, record_id = (to_unsigned(np.array([held[0][c]])) for c in ("ft_root", "ft_id"))
        client.xor(root, record_id)
        assert client.status()["pending"] == 0  # this server holds only this topic
    for p in range(2):
        produce(kafka_bootstrap, topic, [(None, b"b%d" % i) for i in range(20)], partition=p)
    run(spark, opts, tmp_path / "checkpoint", settings)
    after_second = committed(kafka_bootstrap, group, topic, 2)
    assert after_second[0] is not None and after_second[0] > 20, after_second
    assert after_second[1] is not None and after_second[1] >= after_first[1], after_second


@pytest.mark.parametrize("shards", [1, 2])
def test_aligned_checkpoints_hold_every_partition_until_the_record_completes(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
    shards: int,
) -> None:
    """ft.checkpointMode=aligned: a checkpoint completes only when no record from before
    its barrier is pending, in any partition; only then do the group offsets move, to
    the barrier. The unaligned test above moves partition 1 past the held record's
    batch at once; here neither partition moves until the held record completes.
    On two shards each shard aligns its own partitions: the held record holds its
    shard's checkpoints and partition 0's group offset, while the other shard's
    checkpoints complete and partition 1's group offset moves to the barrier."""
    servers = start_layer(start_server, tmp_path, shards)
    address = ",".join(s.address for s in servers)
    settings = FTSettings(address)
    topic, group = make_topic(2), f"g-{uuid.uuid4().hex[:8]}"
    server = held_shard(servers, topic)
    others = [s for s in servers if s is not server]
    for p in range(2):
        produce(kafka_bootstrap, topic, [(None, b"a%d" % i) for i in range(20)], partition=p)
    opts = {
        "kafka.bootstrap.servers": kafka_bootstrap,
        "subscribe": topic,
        "ft.address": address,
        "ft.completion": "tree",  # a record is held by not acking it
        "kafka.group.id": group,
        "maxOffsetsPerTrigger": "10",
        "ft.checkpointMode": "aligned",
    }
    held = run(spark, opts, tmp_path / "checkpoint", settings)
    assert len(held) == 1
    first = committed(kafka_bootstrap, group, topic, 2)
    if shards == 1:
        assert first == {0: None, 1: None}
    else:  # the other shard's partition moved to its barrier; the held one did not
        assert first[0] is None and first[1] is not None and first[1] >= 10, first
        for other in others:
            with other.client() as client:
                checkpoints = client.status()["checkpoints"][topic]
            assert checkpoints["completed"] >= 3, checkpoints
            assert all(c["alignment_wait_s"] < 1.0 for c in checkpoints["recent"]), checkpoints
    with server.client() as client:
        checkpoints = client.status()["checkpoints"][topic]
        assert checkpoints["completed"] == 0
        # Aligning: batches Spark reported done; begun: the last batch (its commit
        # comes one batch late).
        states = [c["state"] for c in checkpoints["open"]]
        assert "aligning" in states and set(states) <= {"aligning", "begun"}, states
        assert all(c["mode"] == "aligned" for c in checkpoints["open"])
        # A second later the held record completes: the checkpoints waiting for it
        # complete in order, each after an alignment wait of at least that second.
        time.sleep(1.0)
        root, record_id = (to_unsigned(np.array([held[0][c]])) for c in ("ft_root", "ft_id"))
        client.xor(root, record_id)
    for p in range(2):
        produce(kafka_bootstrap, topic, [(None, b"b%d" % i) for i in range(20)], partition=p)
    run(spark, opts, tmp_path / "checkpoint", settings)
    after = committed(kafka_bootstrap, group, topic, 2)
    assert after[0] is not None and after[0] >= 20, after
    assert after[1] is not None and after[1] >= 20, after
    for each in servers:
        with each.client() as client:
            status = client.status()
        assert status["pending"] == 0, each.address
        assert status["checkpoints"][topic]["completed"] >= 4, each.address
    with server.client() as client:
        checkpoints = client.status()["checkpoints"][topic]
    recent = checkpoints["recent"]
    # The checkpoints that waited for the held record show the wait.
    assert max(c["alignment_wait_s"] for c in recent) >= 1.0, recent
    assert all(c["write_s"] is not None for c in recent), recent
    assert max(c["pending_roots"] for c in recent) >= 1, recent


def test_commit_prunes_the_replay_entries_of_finished_batches(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
) -> None:
    server: Server = start_server(None, "--tree-timeout-s", "600")
    settings = FTSettings(server.address)
    topic = make_topic(2)
    for p in range(2):  # offsets 0..9 in each partition: 4 records with offset % 5 == 0
        produce(kafka_bootstrap, topic, [(None, b"a%d" % i) for i in range(10)], partition=p)
    seen: set[tuple[int, int]] = set()

    def sink(batch: DataFrame, batch_id: int) -> None:
        # Runs in the driver: fail every 5th of the first 10 records of a partition the
        # first time it is seen, ack the rest; the failed ones come back as replays in
        # a later batch. The later records (offset 10 and up) are never failed: a
        # replay of one would enter the last batch, whose commit never comes.
        batch.persist()
        rows = batch.select("partition", "offset", "ft_root").collect()
        first = [
            r
            for r in rows
            if (r.partition, r.offset) not in seen and r.offset % 5 == 0 and r.offset < 10
        ]
        seen.update((r.partition, r.offset) for r in rows)
        doomed = F.col("ft_root").isin([r.ft_root for r in first])
        if first:
            with FTClient(server.address) as client:
                client.fail(to_unsigned(np.array([r.ft_root for r in first])))
            settle(batch.filter(~doomed), settings, ack=True)
        else:
            settle(batch, settings, ack=True)
        batch.unpersist()

    query = (
        spark.readStream.format("ftkafka")
        .option("kafka.bootstrap.servers", kafka_bootstrap)
        .option("subscribe", topic)
        .option("ft.address", server.address)
        .option("ft.completion", "tree")
        .load()
        .writeStream.foreachBatch(sink)
        .trigger(processingTime="300 milliseconds")
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .start()
    )
    try:
        with server.client() as client:
            wait_until(lambda: client.status()["failed"]["explicit"] == 4, 60, "the fails")
            wait_until(lambda: client.status()["pending"] == 0, 60, "the replays")
            assert client.status()["replay_queue"] > 0
            # Batches after the one that took the replays in: its commit prunes them.
            for round_ in range(3):
                produce(kafka_bootstrap, topic, [(None, b"b%d" % round_)])
                time.sleep(1.0)
            wait_until(lambda: client.status()["replay_queue"] == 0, 60, "the pruning")
            # The last record produced may still be in its batch when the pruning shows.
            wait_until(lambda: client.status()["pending"] == 0, 60, "the last batch")
            status = client.status()
            assert status["replay_queue"] == 0 and status["failed"]["explicit"] == 4
    finally:
        query.stop()
