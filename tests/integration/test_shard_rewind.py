"""A shard that comes back with its data dir lost: the ftkafka source rewinds that
shard's partitions to their committed group offsets (integration/source/rewind.py).

- The plan: where each partition goes back to, how many records are read again, and
  the errors (a group offset ahead of the query's, no consumer group).
- Which replays a batch takes in when a shard's store changed: none of that shard's.
- On real parts (two `ftlayer serve --shard I --shards 2` processes, the Tansu broker,
  local Spark): shard 1 SIGKILLed mid-stream, its data dir deleted, and started again
  empty: nothing is lost, the rewind goes exactly to the committed group offsets of
  shard 1's partitions (Spark's progress shows it), and the duplicates at the sink are
  at most the records it reads again.
"""

from __future__ import annotations

import json
import re
import shutil
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
from pyspark.sql import DataFrame, SparkSession
from serverproc import Server, StartServer

from ftlayer.client import FTClient
from ftlayer.errors import SourceError
from ftlayer.integration.ftcolumns import FTSettings
from ftlayer.integration.harness.kafka import end_offsets, produce
from ftlayer.integration.sinks import ft_foreach_batch
from ftlayer.integration.source import parse_options
from ftlayer.integration.source.rewind import no_group, plan_rewind, replay_bounds
from ftlayer.integration.tasks import FTTasks
from ftlayer.position import Position
from ftlayer.shards import partition_shard

cloudpickle.register_pickle_by_value(sys.modules[__name__])

SCHEMA = "id long"
PARTITIONS = 4
PER_TRIGGER = 150


# ---- the plan ---------------------------------------------------------------------


def test_a_rewind_goes_back_to_the_group_offsets_and_counts_what_it_reads_again() -> None:
    position = {"t": {1: 500, 3: 420}, "u": {0: 90}}
    committed = {TopicPartition("t", 1): 380, TopicPartition("t", 3): 420}  # u-0: none
    rewind = plan_rewind(
        1, "old", "new", 7, position, committed, {"t": {1: 0, 3: 0}, "u": {0: 40}}, "shard 1"
    )
    assert rewind.offsets == {"t": {1: 380, 3: 420}, "u": {0: 40}}
    assert rewind.reread == (500 - 380) + 0 + (90 - 40)
    assert (rewind.shard, rewind.was, rewind.store, rewind.cursor) == (1, "old", "new", 7)
    assert rewind.without_commit == ("u-0",)
    described = rewind.describe("shard 1 of the FT layer")
    assert "read 170 records again" in described and "u-0" in described


def test_a_group_offset_ahead_of_the_query_or_no_group_is_a_clear_error() -> None:
    with pytest.raises(SourceError, match=re.escape("group offset of t-0 (600) is ahead")):
        plan_rewind(0, "a", "b", 0, {"t": {0: 500}}, {TopicPartition("t", 0): 600}, {}, "x")
    assert "set kafka.group.id" in str(no_group("shard 1", "b", "a"))


def test_a_batch_takes_in_no_replays_of_a_shard_whose_store_changed() -> None:
    start = Position.at({}, (40, 17), ("s0", "s1"))
    same = Position.at({}, (45, 20), ("s0", "s1"))
    assert replay_bounds(start, same) == ((40, 17), (45, 20))
    rewound = Position.at({}, (45, 3), ("s0", "s1-new"))
    assert replay_bounds(start, rewound) == ((40, 3), (45, 3))
    old_form = Position.at({}, (40, 17))  # offsets a query wrote without stores
    assert replay_bounds(old_form, rewound) == ((40, 17), (45, 3))


# ---- on real parts ----------------------------------------------------------------


class Collected:
    """The ids a foreachBatch sink wrote, on the driver."""

    def __init__(self) -> None:
        self.ids: list[int] = []

    def __call__(self, batch: DataFrame, epoch_id: int) -> None:
        self.ids.extend(row.id for row in batch.select("id").collect())


class Offsets:
    """Every batch's start and end offsets of the query's one source, from Spark's
    progress (gathered while the test waits: recentProgress keeps the last 100)."""

    def __init__(self, query: Any) -> None:
        self.query = query
        self.batches: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}

    def gather(self) -> None:
        for progress in self.query.recentProgress:
            source = progress["sources"][0]
            if source["startOffset"] is None:
                continue
            start, end = (
                json.loads(o) if isinstance(o, str) else o
                for o in (source["startOffset"], source["endOffset"])
            )
            if start is not None and end is not None:  # the first batch starts at None
                self.batches[progress["batchId"]] = (start, end)

    def rewound(self, topic: str) -> dict[int, tuple[int, int]]:
        """Per partition that went back: (the offset it went back from, and to)."""
        back: dict[int, tuple[int, int]] = {}
        for start, end in self.batches.values():
            for p, at in end["kafka"].get(topic, {}).items():
                was = start["kafka"].get(topic, {}).get(p, at)
                if at < was:
                    back[int(p)] = (was, at)
        return back


def group_offsets(bootstrap: str, group: str, tps: list[TopicPartition]) -> dict[int, int | None]:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    try:
        return {tp.partition: consumer.committed(tp) for tp in tps}
    finally:
        consumer.close(autocommit=False)


def free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def wait_for(predicate: Callable[[], bool], timeout_s: float, query: Any, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert query.exception() is None, f"the query failed: {query.exception()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


def test_a_shard_that_lost_its_data_dir_loses_nothing(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
) -> None:
    """SIGKILL shard 1 mid-stream, delete its data dir and start it again empty: its
    partitions go back to their committed group offsets, every record reaches the sink,
    and the duplicates are at most the records read again."""
    n = 4000
    ports = [free_port(), free_port()]
    flags = [["--port", ports[i], "--shard", str(i), "--shards", "2"] for i in (0, 1)]
    shards = [start_server(tmp_path / f"shard{i}", *flags[i]) for i in (0, 1)]
    addresses = ",".join(s.address for s in shards)
    settings = FTSettings(addresses)
    topic = make_topic(PARTITIONS)
    group = f"rewind-{uuid.uuid4().hex[:8]}"
    produce(kafka_bootstrap, topic, [(str(i).encode(), b"v") for i in range(n)])
    source_id = parse_options({"subscribe": topic, "kafka.bootstrap.servers": "x"}).source_ids()[
        topic
    ]
    mine = [
        TopicPartition(topic, p) for p in range(PARTITIONS) if partition_shard(source_id, p, 2) == 1
    ]
    source = (
        spark.readStream.format("ftkafka")
        .option("kafka.bootstrap.servers", kafka_bootstrap)
        .option("subscribe", topic)
        .option("maxOffsetsPerTrigger", str(PER_TRIGGER))
        .option("ft.address", addresses)
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
    offsets = Offsets(query)

    def completed(shard: Server) -> int:
        offsets.gather()
        with FTClient(shard.address) as client:
            return client.status().completed

    def pending() -> int:
        offsets.gather()
        total = 0
        for shard in shards:
            with FTClient(shard.address) as client:
                total += client.status().pending
        return total

    try:
        wait_for(
            lambda: (
                all(g for g in group_offsets(kafka_bootstrap, group, mine).values())
                and completed(shards[1]) >= n // 4  # mid-stream: a quarter of all records
            ),
            120,
            query,
            "shard 1's partitions to commit group offsets",
        )
        with FTClient(shards[1].address) as client:
            lost_store = client.status().store_id
        shards[1].kill()
        shutil.rmtree(shards[1].data_dir)
        began = time.monotonic()
        # The driver finds shard 1 down and goes on with shard 0's partitions; the group
        # offsets of shard 1's partitions stay where its last checkpoint put them.
        before = completed(shards[0])
        wait_for(lambda: completed(shards[0]) > before, 60, query, "shard 0 to go on")
        committed = group_offsets(kafka_bootstrap, group, mine)
        shards[1] = start_server(tmp_path / "shard1", *flags[1])
        with FTClient(shards[1].address) as client:
            assert client.status().store_id != lost_store  # a new, empty store
        ends = end_offsets(kafka_bootstrap, topic)

        def lag() -> int:
            now = group_offsets(kafka_bootstrap, group, [TopicPartition(topic, p) for p in ends])
            return sum(e - (now[p] or 0) for p, e in ends.items())

        wait_for(
            lambda: len(set(collected.ids)) == n and pending() == 0 and lag() == 0,
            180,
            query,
            "every record to complete",
        )
        recovered_s = time.monotonic() - began
        offsets.gather()
    finally:
        query.stop()
    # Nothing lost.
    assert set(collected.ids) == set(range(n))
    # Shard 1's partitions, and only they, went back, each to its committed group offset.
    rewound = offsets.rewound(topic)
    assert rewound, "no partition went back"
    assert set(rewound) <= {tp.partition for tp in mine}, (rewound, mine)
    for p, (_was, to) in rewound.items():
        assert to == committed[p], (p, rewound, committed)
    reread = sum(was - to for was, to in rewound.values())
    # What is read again is what shard 1 had pending plus what completed after its
    # partitions' last commit. In barrier mode that is at most two batches of its
    # partitions: the one running at the kill, and the one done before it whose group
    # offsets are committed when the next is planned.
    assert reread <= 2 * PER_TRIGGER, reread
    duplicates = len(collected.ids) - n
    assert duplicates <= reread, (duplicates, reread)
    print(
        f"shard 1's store lost: {reread} records read again from the group offsets "
        f"{committed}, {duplicates} duplicates at the sink; all {n} records in "
        f"{recovered_s:.1f} s after the kill"
    )
