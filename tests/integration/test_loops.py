"""Loops (issue 5, section 6; FLIP-16): a pipeline that feeds records back into its own
input topic keeps their root ids in a Kafka header, so one tree spans every iteration.

Real Tansu, a real `ftlayer serve`, local Spark. Event i starts with a countdown
n = i % 4. The step decrements it; the sink records the state update (event, n) in a
SQLite table keyed on (event, n) and then either writes the record back into the
input topic (n > 0, `ft_kafka_sink(..., loop=True)`) or acks it (n = 0). The step
fails 8% of (event, n) on first sight: a failure in any iteration replays the
original record, which runs the whole loop again.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fixture_types import MakeTopic
from pyspark import cloudpickle
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from serverproc import StartServer

from ftlayer.client import FTClient
from ftlayer.errors import ConfigError, FailException
from ftlayer.integration.ftcolumns import LOOP_HEADER, FTSettings, loop_header
from ftlayer.integration.harness.kafka import produce, wait_until
from ftlayer.integration.sinks import ft_kafka_sink, settle
from ftlayer.integration.tasks import FTTasks

cloudpickle.register_pickle_by_value(sys.modules[__name__])

EVENTS = 200
STEP_SCHEMA = "key binary, value binary, event long, n long"
LOOP_KEY = "the pipeline's loop key"


def make_step(flaky_dir: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def step(row: dict[str, Any]) -> dict[str, Any]:
        data = json.loads(row["value"])
        event, n = data["event"], data["n"]
        if zlib.crc32(f"{event}/{n}".encode()) % 100 < 8:
            marker = Path(flaky_dir) / f"{event}-{n}"
            try:  # first sight, across processes
                marker.touch(exist_ok=False)
            except FileExistsError:
                pass
            else:
                raise FailException(f"step: event {event} at countdown {n}")
        after = json.dumps({"event": event, "n": n - 1}).encode()
        return {"key": row["key"], "value": after, "event": event, "n": n}

    return step


class State:
    """The pipeline's state: one row per (event, countdown) it went through."""

    def __init__(self, path: Path) -> None:
        self.db = sqlite3.connect(path, check_same_thread=False)
        self.db.execute("CREATE TABLE updates (event INTEGER, n INTEGER, PRIMARY KEY (event, n))")
        self.attempts = 0

    def update(self, rows: list[Any]) -> None:
        self.attempts += len(rows)
        with self.db:
            self.db.executemany(
                "INSERT OR IGNORE INTO updates VALUES (?, ?)", [(r.event, r.n) for r in rows]
            )

    def rows(self) -> set[tuple[int, int]]:
        return set(self.db.execute("SELECT event, n FROM updates"))


@pytest.mark.parametrize("completion", ["tree", "barrier"])
def test_a_loop_keeps_each_tree_across_iterations_and_updates_state_once(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
    completion: str,
) -> None:
    """In barrier mode too (issue 13): a record in transit holds its tree open past its
    batch, and the batch that reads it back holds it until its own barrier."""
    server = start_server(None, "--tree-timeout-s", "120")
    settings = FTSettings(server.address, loop_key=LOOP_KEY.encode())
    topic = make_topic(2)
    produce(
        kafka_bootstrap,
        topic,
        [(b"k%d" % i, json.dumps({"event": i, "n": i % 4}).encode()) for i in range(EVENTS)],
    )
    expected = {(i, n) for i in range(EVENTS) for n in range(i % 4 + 1)}
    state, flaky = State(tmp_path / "state.db"), tmp_path / "flaky"
    flaky.mkdir()
    loop_back = ft_kafka_sink(kafka_bootstrap, topic, settings, loop=True)

    def sink(batch: DataFrame, epoch_id: int) -> None:
        batch.persist()
        state.update(batch.select("event", "n").collect())
        loop_back(batch.where(F.col("n") > 0), epoch_id)
        settle(batch.where(F.col("n") == 0), settings, ack=True)
        batch.unpersist()

    source = (
        spark.readStream.format("ftkafka")
        .option("kafka.bootstrap.servers", kafka_bootstrap)
        .option("subscribe", topic)
        .option("ft.address", server.address)
        .option("ft.loopKey", LOOP_KEY)
        .option("ft.checkpointMode", "aligned")
        .option("ft.completion", completion)
        .load()
    )
    query = (
        FTTasks(settings)
        .map(source, make_step(str(flaky)), STEP_SCHEMA)
        .writeStream.foreachBatch(sink)
        .trigger(processingTime="300 milliseconds")
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .start()
    )
    try:
        with FTClient(server.address) as client:

            def done() -> bool:
                if not query.isActive:
                    raise AssertionError(f"the query stopped: {query.exception()}")
                status = client.status()
                return (
                    status["pending"] == 0
                    and status["stored_records"] == 0
                    and state.rows() == expected
                    and not query.status["isTriggerActive"]
                )

            wait_until(done, 180, "every loop to finish", interval=0.25)
            status = client.status()
    finally:
        query.stop()

    # Each state update happened exactly once, and every (event, n) was reached.
    assert state.rows() == expected
    # Failures made the loop run again: the table absorbed the repeated updates.
    assert status["failed"]["explicit"] > 0 and state.attempts > len(expected)
    # One tree per event, tracked across its iterations: only the 200 source records
    # were persisted (not the 300 records the loop fed back), and every tree completed
    # exactly once, with nothing pending.
    assert status["persisted"] == EVENTS
    assert status["completed"] == EVENTS
    assert status["unknown_events"] == 0


def test_a_copied_or_forged_loop_header_starts_a_tree_of_its_own(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
) -> None:
    """Only a header signed with the pipeline's loop key continues a tree: a record that
    carries any other `ftlayer-anchor` header is persisted and tracked like any source
    record, so it is never processed untracked."""
    server = start_server(None, "--tree-timeout-s", "120")
    settings = FTSettings(server.address, loop_key=LOOP_KEY.encode())
    topic = make_topic(1)
    signed_elsewhere = loop_header(7, 8, b"another pipeline's key")
    produce(
        kafka_bootstrap,
        topic,
        [
            (b"a", b"plain", []),
            (b"b", b"forged", [(LOOP_HEADER, os.urandom(32))]),
            (b"c", b"old-format", [(LOOP_HEADER, (7).to_bytes(8, "big") * 2)]),
            (b"d", b"copied", [(LOOP_HEADER, signed_elsewhere)]),
        ],
    )
    seen: list[str] = []

    def sink(batch: DataFrame, epoch_id: int) -> None:
        batch.persist()  # two actions on one batch: read (and persist) the source once
        seen.extend(bytes(row.value).decode() for row in batch.select("value").collect())
        settle(batch, settings, ack=True)
        batch.unpersist()

    query = (
        spark.readStream.format("ftkafka")
        .option("kafka.bootstrap.servers", kafka_bootstrap)
        .option("subscribe", topic)
        .option("ft.address", server.address)
        .option("ft.loopKey", LOOP_KEY)
        .load()
        .writeStream.foreachBatch(sink)
        .trigger(availableNow=True)
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .start()
    )
    try:
        assert query.awaitTermination(120), "the query did not finish"
    finally:
        query.stop()
    assert sorted(seen) == ["copied", "forged", "old-format", "plain"]
    with FTClient(server.address) as client:
        wait_until(
            lambda: client.status()["stored_records"] == 0,
            30,
            f"acked records deleted: {client.status().to_json()}",
        )
        status = client.status()
    # Every record was persisted as a source record and its tree completed.
    assert (status["persisted"], status["completed"], status["pending"]) == (4, 4, 0)
    assert status["unknown_events"] == 0


def test_a_loop_sink_needs_a_key_to_sign_with(start_server: StartServer) -> None:
    server = start_server(None)
    with pytest.raises(ConfigError, match=r"ft\.loopKeyFile"):
        ft_kafka_sink("127.0.0.1:1", "t", FTSettings(server.address), loop=True)
    assert FTSettings(server.address, token=b"t").loop_secret is not None
