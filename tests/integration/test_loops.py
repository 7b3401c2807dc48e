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
import sqlite3
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pyspark import cloudpickle
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from serverproc import StartServer

from ftlayer.client import FTClient
from ftlayer.errors import FailException
from ftlayer.integration.ftcolumns import FTSettings
from ftlayer.integration.harness.kafka import produce, wait_until
from ftlayer.integration.sinks import ft_kafka_sink, settle
from ftlayer.integration.source import register
from ftlayer.integration.tasks import FTTasks

cloudpickle.register_pickle_by_value(sys.modules[__name__])

MakeTopic = Callable[..., str]
EVENTS = 200
STEP_SCHEMA = "key binary, value binary, event long, n long"


@pytest.fixture(scope="module", autouse=True)
def ftkafka(spark: SparkSession) -> None:
    register(spark)


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


def test_a_loop_keeps_each_tree_across_iterations_and_updates_state_once(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
) -> None:
    server = start_server(None, "--timeout-s", "120")
    settings = FTSettings(server.address)
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
        .option("ft.checkpointMode", "aligned")
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
