"""Timeouts that follow progress (issue 14, part 3) on real parts: Tansu, a real
`ftlayer serve`, local Spark.

A batch whose step takes three times the tree timeout is not timed out while it runs,
in both completion modes: the source's driver heartbeats the running batch, so no
tree fails, nothing is replayed, and every record reaches the sink exactly once.
When the query stops mid-batch the heartbeats stop with it: the batch's trees time
out soon after, and a restarted query loses nothing.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fixture_types import MakeTopic
from pyspark import cloudpickle
from pyspark.sql import DataFrame, SparkSession
from serverproc import Server, StartServer

from ftlayer.client import FTClient
from ftlayer.integration.ftcolumns import FTSettings
from ftlayer.integration.harness.kafka import produce, wait_until
from ftlayer.integration.sinks import ft_foreach_batch
from ftlayer.integration.source.options import source_id
from ftlayer.integration.tasks import FTTasks
from ftlayer.status import Status

cloudpickle.register_pickle_by_value(sys.modules[__name__])

PARTITIONS = 2
PER_PARTITION = 100
TIMEOUT_MS = 2000  # ft.treeTimeoutMs: a tree would fail between 2 and 3 s after its persist
STEP_S = 6.0  # the slow step: three times the timeout
# After the last heartbeat: the lease (3 heartbeats of T/4) and one expiry, T*1.5.
TIMED_OUT_WITHIN_S = 0.75 * TIMEOUT_MS / 1000 + 1.5 * TIMEOUT_MS / 1000
SCHEDULING_S = 3.0  # what a busy machine may add to the server's ticks
SCHEMA = "partition int, offset long"


def slow_step(marks: str, seconds: float) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The wrapped step: the first record of each partition takes `seconds` (once, on
    first sight across Python workers and query runs)."""

    def step(row: dict[str, Any]) -> dict[str, Any]:
        if row["offset"] == 0:
            try:
                os.close(
                    os.open(os.path.join(marks, str(row["partition"])), os.O_CREAT | os.O_EXCL)
                )
            except FileExistsError:
                pass
            else:
                time.sleep(seconds)
        return {"partition": row["partition"], "offset": row["offset"]}

    return step


class Rows:
    """What the foreachBatch sink received, on the driver."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int]] = []

    def __call__(self, batch: DataFrame, epoch_id: int) -> None:
        self.rows.extend((r.partition, r.offset) for r in batch.collect())


def start_query(
    spark: SparkSession,
    bootstrap: str,
    topic: str,
    server: Server,
    step: Callable[[dict[str, Any]], dict[str, Any]],
    rows: Rows,
    checkpoint: Path,
    completion: str,
    persist: str = "reference",
) -> Any:
    settings = FTSettings(server.address)
    source = (
        spark.readStream.format("ftkafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", topic)
        .option("ft.address", server.address)
        .option("ft.treeTimeoutMs", str(TIMEOUT_MS))
        .option("ft.completion", completion)
        .option("ft.persist", persist)
        .option("ft.retryBackoffMs", "0")
        .load()
    )
    return (
        FTTasks(settings)
        .map(source, step, SCHEMA)
        .writeStream.foreachBatch(ft_foreach_batch(rows, settings))
        .option("checkpointLocation", str(checkpoint))
        .trigger(processingTime="300 milliseconds")
        .start()
    )


def settle(query: Any, client: FTClient, ready: Callable[[Status], bool]) -> Status:
    """Wait until `ready(status)` holds with nothing pending, twice in a row."""
    calm = 0
    deadline = time.monotonic() + 120
    while True:
        if query.exception() is not None:
            raise AssertionError(f"the query failed: {query.exception()}")
        status = client.status()
        calm = calm + 1 if ready(status) and status.pending == 0 else 0
        if calm >= 2:
            return status
        assert time.monotonic() < deadline, f"not settled: {status.to_json()}"
        time.sleep(0.3)


@pytest.mark.parametrize(
    ("completion", "persist"),
    [("tree", "reference"), ("barrier", "payload"), ("barrier", "reference")],
    ids=["tree", "barrier", "barrier-ranges"],
)
def test_a_step_three_times_the_timeout_times_nothing_out_and_replays_nothing(
    completion: str,
    persist: str,
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
) -> None:
    server = start_server()
    topic = make_topic(PARTITIONS)
    for p in range(PARTITIONS):
        produce(
            kafka_bootstrap, topic, [(None, b"r%d" % i) for i in range(PER_PARTITION)], partition=p
        )
    everything = sorted((p, o) for p in range(PARTITIONS) for o in range(PER_PARTITION))
    (tmp_path / "marks").mkdir()
    rows = Rows()
    step = slow_step(str(tmp_path / "marks"), STEP_S)
    query = start_query(
        spark, kafka_bootstrap, topic, server, step, rows, tmp_path / "cp", completion, persist
    )
    try:
        with server.client() as client:
            status = settle(query, client, lambda s: s.persisted >= len(everything))
    finally:
        query.stop()
    assert len(os.listdir(tmp_path / "marks")) == PARTITIONS  # both partitions were slow
    if completion == "barrier" and persist == "reference":
        # A batch range has no timeout to postpone: it completes with its batch.
        assert status.timeouts_postponed == 0 and status.open_ranges == 0
    else:
        # The trees outlived their timeout (their entries expired and were postponed) ...
        assert status.timeouts_postponed >= len(everything)
    # ... yet none failed, nothing was replayed, and each record reached the sink once.
    assert status.failed == {"explicit": 0, "timeout": 0, "recovery": 0, "source-expired": 0}
    assert status.persisted == status.completed == len(everything)
    assert status.replay_cursor == 0
    assert sorted(rows.rows) == everything


def test_a_query_stopped_mid_batch_lets_its_trees_time_out_and_loses_nothing(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
) -> None:
    """Per-record persists (payload): a stopped batch's trees time out once its lease
    lapses, and a restart reads them again. (By reference a batch is a range, which
    does not time out: the next test.)"""
    # No wait for a lapsed batch's next barrier (ftlayer.core.leases): this test is
    # about the lease alone; tests/core/test_lapsed.py tests the wait.
    server = start_server(None, "--lapsed-batch-timeout-s", "0")
    topic = make_topic(PARTITIONS)
    for p in range(PARTITIONS):
        produce(
            kafka_bootstrap, topic, [(None, b"r%d" % i) for i in range(PER_PARTITION)], partition=p
        )
    everything = {(p, o) for p in range(PARTITIONS) for o in range(PER_PARTITION)}
    source = str(source_id(topic, topic))
    marks = tmp_path / "marks"
    marks.mkdir()
    rows = Rows()
    hung = slow_step(str(marks), 3600.0)  # a step that hangs: only a stop ends it
    query = start_query(
        spark, kafka_bootstrap, topic, server, hung, rows, tmp_path / "cp", "barrier", "payload"
    )
    with server.client() as client:
        try:
            wait_until(
                lambda: (
                    len(os.listdir(marks)) == PARTITIONS
                    and client.status().persisted == len(everything)
                ),
                60,
                "the batch to hang in the step",
            )
            time.sleep(3 * TIMEOUT_MS / 1000)  # three timeouts: the heartbeats hold them off
            status = client.status()
            assert status.failed["timeout"] == 0 and status.timeouts_postponed > 0
            assert (status.lease_of(int(source)) or 0) > 0
        finally:
            query.stop()
        stopped = time.monotonic()

        # The driver stopped: no more heartbeats, the lease lapses (1.5 s: three
        # heartbeats of T/4) and the trees time out within T*1.5 after it. (The stop
        # fails the batch's sink, whose error fails the roots of a second computation
        # of the batch: those newer copies of the records are pending, so the stopped
        # batch's own roots retire under them when they time out, instead of being
        # replayed a second time: ftlayer.core.takeover.)
        def ended(s: Status) -> int:
            return s.failed["timeout"] + s.taken_over

        wait_until(
            lambda: ended(client.status()) == len(everything),
            30,
            "the stopped batch's trees to time out",
        )
        timed_out_s = time.monotonic() - stopped  # the last heartbeat came before
        assert timed_out_s <= TIMED_OUT_WITHIN_S + SCHEDULING_S, timed_out_s
        assert client.status().lease_of(int(source)) == 0.0
        # A restarted query runs the batch again, then the replays: nothing is lost.
        quick = slow_step(str(marks), 0.0)
        query = start_query(
            spark,
            kafka_bootstrap,
            topic,
            server,
            quick,
            rows,
            tmp_path / "cp",
            "barrier",
            "payload",
        )
        try:
            status = settle(
                query, client, lambda s: s.replay_queue == 0 and s.completed >= 2 * len(everything)
            )
        finally:
            query.stop()
    assert set(rows.rows) == everything
    assert status.failed["timeout"] + status.taken_over >= len(everything)


def test_a_query_stopped_mid_batch_by_range_times_nothing_out_and_loses_nothing(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
) -> None:
    """By reference, a stopped batch's ranges stay open (pending, holding their group
    offsets) and never time out; the restarted query runs the batch again from Spark's
    offset log, whose barrier completes them: nothing lost, no timeout."""
    server = start_server()
    topic = make_topic(PARTITIONS)
    for p in range(PARTITIONS):
        produce(
            kafka_bootstrap, topic, [(None, b"r%d" % i) for i in range(PER_PARTITION)], partition=p
        )
    everything = {(p, o) for p in range(PARTITIONS) for o in range(PER_PARTITION)}
    marks = tmp_path / "marks"
    marks.mkdir()
    rows = Rows()
    hung = slow_step(str(marks), 3600.0)  # a step that hangs: only a stop ends it
    query = start_query(
        spark, kafka_bootstrap, topic, server, hung, rows, tmp_path / "cp", "barrier"
    )
    with server.client() as client:
        try:
            wait_until(
                lambda: len(os.listdir(marks)) == PARTITIONS and client.status().open_ranges > 0,
                60,
                "the batch to hang in the step",
            )
        finally:
            query.stop()
        time.sleep(3 * TIMEOUT_MS / 1000)  # three timeouts, no heartbeats: nothing times out
        status = client.status()
        assert status.failed["timeout"] == 0 and status.open_ranges > 0
        assert status.pending_of(source_id(topic, topic)) == len(everything)
        quick = slow_step(str(marks), 0.0)
        query = start_query(
            spark, kafka_bootstrap, topic, server, quick, rows, tmp_path / "cp", "barrier"
        )
        try:
            status = settle(query, client, lambda s: s.open_ranges == 0 and s.replay_queue == 0)
        finally:
            query.stop()
    assert set(rows.rows) == everything
    assert status.failed["timeout"] == 0 and status.completed >= len(everything)
