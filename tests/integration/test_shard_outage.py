"""A shard of an FT layer of two SIGKILLed mid-stream and started again on its data
dir OUTAGE_S later, on real parts: two `ftlayer serve --shard I --shards 2` processes,
the Tansu broker, local Spark; in barrier and in tree mode (ft.completion). Meanwhile
the other shard's partitions go on completing (STATUS samples), the dead shard's take
in nothing new; afterwards nothing is lost and the duplicates are at most a batch.
And shard 1 SIGKILLed mid-batch in barrier mode, with a failure of its rows in flight:
the failure is parked on shard 0 and the batch completes without shard 1.

The test mostly waits (the outage), so `make unit` runs it beside the rest (BESIDE).
"""

from __future__ import annotations

import os
import socket
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fixture_types import MakeTopic
from kafka import KafkaConsumer, TopicPartition
from pyspark import cloudpickle
from pyspark.sql import DataFrame, SparkSession
from serverproc import Server, StartServer

from ftlayer.client import FTClient
from ftlayer.errors import FailException
from ftlayer.integration.ftcolumns import FTSettings
from ftlayer.integration.harness.kafka import end_offsets, produce
from ftlayer.integration.sinks import ft_foreach_batch
from ftlayer.integration.source import parse_options
from ftlayer.integration.tasks import FTTasks
from ftlayer.shards import partition_shard
from ftlayer.status import Status

cloudpickle.register_pickle_by_value(sys.modules[__name__])

SCHEMA = "id long"
PARTITIONS = 4


class Collected:
    """The ids a foreachBatch sink wrote, on the driver."""

    def __init__(self) -> None:
        self.ids: list[int] = []

    def __call__(self, batch: DataFrame, epoch_id: int) -> None:
        self.ids.extend(row.id for row in batch.select("id").collect())


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


def _free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


OUTAGE_S = {"barrier": 15.0, "tree": 20.0}
PER_TRIGGER = 150
BEFORE_KILL = 600
"""Tree mode: the records produced before the kill, all complete when it lands."""


@pytest.mark.parametrize("completion", ["barrier", "tree"])
def test_a_shard_down_stalls_only_its_own_partitions_and_loses_nothing(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
    completion: str,
) -> None:
    """SIGKILL shard 1 mid-stream and start it again on its data dir OUTAGE_S later:
    meanwhile shard 0's partitions go on completing (from STATUS samples: more records
    than one batch holds, so batches planned after the kill complete), shard 1's take
    in nothing new; afterwards every record reaches the sink and every partition's
    group offset its end.

    Barrier mode: every record is produced first and the kill lands after shard 1's
    first completions, at any moment (a batch in flight finishes its rows without the
    shard). Tree mode: a batch in flight persists and acks its records of shard 1's
    partitions on shard 1 and waits for it, and with it every other partition
    (user-guide.md, section 6.12), so only a kill between two batches lets shard 0 go
    on: BEFORE_KILL records are produced and completed, the kill lands while the
    running query has no batch in flight, and the rest is produced right after it."""
    n = 4000 if completion == "barrier" else 3000
    first = n if completion == "barrier" else BEFORE_KILL
    ports = [_free_port(), _free_port()]
    flags = [["--port", ports[i], "--shard", str(i), "--shards", "2"] for i in (0, 1)]
    shards = [start_server(tmp_path / f"shard{i}", *flags[i]) for i in (0, 1)]
    addresses = ",".join(s.address for s in shards)
    settings = FTSettings(addresses)
    topic = make_topic(PARTITIONS)
    group = f"shards-{uuid.uuid4().hex[:8]}"
    positions = produce(kafka_bootstrap, topic, [(str(i).encode(), b"v") for i in range(first)])
    source_id = parse_options({"subscribe": topic, "kafka.bootstrap.servers": "x"}).source_ids()[
        topic
    ]

    def of_shard1() -> set[int]:
        return {
            i for i, at in enumerate(positions) if partition_shard(source_id, at.partition, 2) == 1
        }

    source = (
        spark.readStream.format("ftkafka")
        .option("kafka.bootstrap.servers", kafka_bootstrap)
        .option("subscribe", topic)
        .option("maxOffsetsPerTrigger", str(PER_TRIGGER))
        .option("ft.address", addresses)
        .option("ft.completion", completion)
        .option("kafka.group.id", group)
        .load()
    )
    collected = Collected()
    query = (
        FTTasks(settings)
        .map(source, lambda row: {"id": int(row["key"])}, SCHEMA)
        .writeStream.foreachBatch(ft_foreach_batch(collected, settings))
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(processingTime="250 milliseconds")
        .start()
    )

    def completed(shard: Server) -> int:
        with FTClient(shard.address) as client:
            return client.status().completed

    try:
        if completion == "barrier":
            _wait_for(lambda: completed(shards[1]) > 0, 120, query)
        else:  # every record so far complete, and no batch running
            _wait_for(
                lambda: (
                    len(set(collected.ids)) == first
                    and all(s.pending == 0 for s in statuses(shards))
                    and not query.status["isTriggerActive"]
                ),
                120,
                query,
            )
        shards[1].proc.kill()  # SIGKILL (barrier: a batch of its partitions likely in flight)
        shards[1].proc.wait(10)
        down_at = time.monotonic()
        samples = [completed(shards[0])]
        shard1_seen = [len(of_shard1() & set(collected.ids))]
        if first < n:
            more = [(str(i).encode(), b"v") for i in range(first, n)]
            positions += produce(kafka_bootstrap, topic, more)
        while time.monotonic() - down_at < OUTAGE_S[completion]:
            assert query.exception() is None, f"the query failed: {query.exception()}"
            time.sleep(0.5)
            samples.append(completed(shards[0]))
        shard1_seen.append(len(of_shard1() & set(collected.ids)))
        shards[1] = start_server(tmp_path / "shard1", *flags[1])
        _wait_for(
            lambda: (
                len(set(collected.ids)) == n
                and all(s.pending == 0 for s in statuses(shards))
                and group_lag(kafka_bootstrap, group, topic) == 0
            ),
            120,
            query,
        )
    finally:
        query.stop()
    # Shard 0's partitions kept completing while shard 1 was down: more records than
    # the batch in flight at the kill holds, so batches planned after it completed
    # too; and shard 1's took in nothing new (what reached the sink of them is at most
    # the batch in flight; none in tree mode, where none was).
    during = samples[-1] - samples[0]
    assert during > PER_TRIGGER, samples
    new_of_shard1 = shard1_seen[-1] - shard1_seen[0]
    assert new_of_shard1 <= (PER_TRIGGER if completion == "barrier" else 0), shard1_seen
    # Nothing lost; duplicates only from the batch in flight at the kill.
    assert set(collected.ids) == set(range(n))
    duplicates = len(collected.ids) - n
    assert duplicates <= PER_TRIGGER, duplicates
    print(
        f"{completion} mode, shard 1 down {OUTAGE_S[completion]:.0f} s: shard 0 completed "
        f"{during} records meanwhile; {duplicates} duplicates at the sink"
    )


def _wait_for(predicate: Callable[[], bool], timeout_s: float, query: Any) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert query.exception() is None, f"the query failed: {query.exception()}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.3)


PARKED_N = 1500
PARKED_OUTAGE_S = 20.0


def fails_once(i: int) -> bool:
    return i % 100 == 3


def parking_step(marks: str, source_id: int) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """Fails each fails-once record on first sight (an O_EXCL marker, across Python
    workers). The first such row of a shard 1 partition (with the file `armed`)
    signals (`waiting`) and waits for the test to have SIGKILLed shard 1 (`killed`)
    before it fails: the FAIL meets a dead shard mid-batch."""

    def step(row: dict[str, Any]) -> dict[str, Any]:
        event_id = int(row["key"])
        if fails_once(event_id):
            try:
                os.close(os.open(os.path.join(marks, str(event_id)), os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return {"id": event_id}
            on_shard1 = int(partition_shard(source_id, int(row["partition"]), 2)) == 1
            armed = os.path.exists(os.path.join(marks, "armed"))
            if on_shard1 and armed:
                try:
                    os.close(os.open(os.path.join(marks, "waiting"), os.O_CREAT | os.O_EXCL))
                except FileExistsError:
                    pass
                else:
                    deadline = time.monotonic() + 60
                    while not os.path.exists(os.path.join(marks, "killed")):
                        if time.monotonic() > deadline:
                            break
                        time.sleep(0.05)
            raise FailException(f"event {event_id}: upstream timed out")
        return {"id": event_id}

    return step


def test_a_shard_killed_mid_batch_stalls_only_its_partitions_and_loses_nothing(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
) -> None:
    """Barrier mode by reference, 1% of the records failing once, all partitions. Shard
    1 is SIGKILLed while a batch runs (a step of that batch holds a failing row of a
    shard 1 partition until the kill lands, then fails it) and started again on its
    data dir PARKED_OUTAGE_S later. The FAIL is parked on shard 0 and the batch
    completes: meanwhile shard 0's partitions go on completing (STATUS samples). Then
    nothing is lost, every failed record is failed once and reaches the sink, and the
    duplicates are counted (none expected: the batch in flight completes at its
    barrier once shard 1 is back)."""
    ports = [_free_port(), _free_port()]
    flags = [["--port", ports[i], "--shard", str(i), "--shards", "2"] for i in (0, 1)]
    shards = [start_server(tmp_path / f"shard{i}", *flags[i]) for i in (0, 1)]
    addresses = ",".join(s.address for s in shards)
    settings = FTSettings(addresses)
    topic = make_topic(PARTITIONS)
    group = f"parked-{uuid.uuid4().hex[:8]}"
    at = produce(kafka_bootstrap, topic, [(str(i).encode(), b"v") for i in range(PARKED_N)])
    source_id = parse_options({"subscribe": topic, "kafka.bootstrap.servers": "x"}).source_ids()[
        topic
    ]
    marks = tmp_path / "marks"
    marks.mkdir()
    (marks / "armed").touch()  # the first batch with a failing row of shard 1 meets the kill
    source = (
        spark.readStream.format("ftkafka")
        .option("kafka.bootstrap.servers", kafka_bootstrap)
        .option("subscribe", topic)
        .option("maxOffsetsPerTrigger", str(PER_TRIGGER))
        .option("ft.address", addresses)
        .option("ft.completion", "barrier")
        .option("ft.retryBackoffMs", "100")
        .option("kafka.group.id", group)
        .load()
    )
    collected = Collected()
    query = (
        FTTasks(settings)
        .map(source, parking_step(str(marks), source_id), SCHEMA)
        .writeStream.foreachBatch(ft_foreach_batch(collected, settings))
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(processingTime="250 milliseconds")
        .start()
    )

    def completed(shard: Server) -> int:
        with FTClient(shard.address) as client:
            return client.status().completed

    failing = {i for i in range(PARKED_N) if fails_once(i)}
    began = time.monotonic()
    try:
        _wait_for(lambda: (marks / "waiting").exists(), 120, query)
        running_s = time.monotonic() - began
        shards[1].proc.kill()  # SIGKILL while a step of a running batch holds a row
        shards[1].proc.wait(10)
        (marks / "killed").touch()
        down_at = time.monotonic()
        samples = [(0.0, completed(shards[0]))]
        parked_seen = 0
        while time.monotonic() - down_at < PARKED_OUTAGE_S:
            assert query.exception() is None, f"the query failed: {query.exception()}"
            time.sleep(0.5)
            with FTClient(shards[0].address) as client:
                status = client.status()
            samples.append((time.monotonic() - down_at, status.completed))
            parked_seen = max(parked_seen, status.parked_for(1))
        # Shard 0's own records all at the sink by the outage's end: it ran out of work
        # rather than stalled (its completions then stop early, however healthy).
        own0 = {i for i in range(PARKED_N) if partition_shard(source_id, at[i].partition, 2) == 0}
        own0_done = own0 <= set(collected.ids)
        shards[1] = start_server(tmp_path / "shard1", *flags[1])
        back_at = time.monotonic()
        _wait_for(
            lambda: (
                set(collected.ids) == set(range(PARKED_N))
                and all(s.pending == 0 and not s.parked for s in statuses(shards))
                and group_lag(kafka_bootstrap, group, topic) == 0
            ),
            120,
            query,
        )
        settled_s = time.monotonic() - back_at
    finally:
        query.stop()
    during = samples[-1][1] - samples[0][1]
    last_rise = max(
        (t for (t, n), (_, m) in zip(samples[1:], samples, strict=False) if n > m), default=0.0
    )
    assert parked_seen >= 1, samples
    assert during > PER_TRIGGER, samples  # shard 0 went on: the batch did not wait
    assert last_rise > PARKED_OUTAGE_S / 2 or own0_done, samples
    assert set(collected.ids) == set(range(PARKED_N))  # nothing lost
    duplicates = len(collected.ids) - PARKED_N
    # Each failed record reached the sink once: replayed once, neither lost nor twice.
    counts = Counter(collected.ids)
    assert all(counts[i] == 1 for i in failing), {i: counts[i] for i in failing}
    # Shard 0 (never restarted: its counters run since the start) failed each of its
    # partitions' failing records once.
    on0 = {i for i in failing if partition_shard(source_id, at[i].partition, 2) == 0}
    assert statuses(shards)[0].failed["explicit"] == len(on0)
    assert duplicates <= PER_TRIGGER, duplicates
    print(
        f"shard 1 killed mid-batch, down {PARKED_OUTAGE_S:.0f} s: {parked_seen} failures "
        f"parked on shard 0; shard 0 completed {during} records meanwhile, the last rise "
        f"{last_rise:.1f} s into the outage; {duplicates} duplicates, 0 lost, "
        f"{len(failing)} failing records each at the sink once; the kill "
        f"{running_s:.1f} s after the start, settled {settled_s:.1f} s after the restart"
    )
