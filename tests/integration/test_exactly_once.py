"""Exactly-once where the sink allows it (issue 5, section 4): `ft_foreach_batch` with a
content key, aligned checkpoints, and a sink table that inserts if absent.

Real Tansu, a real `ftlayer serve`, local Spark (local[2,4]), a SQLite table as the
idempotent sink (its primary key is the content key, the event id). The pipeline is
the demo's: parse, a flaky enrich that fails 5% of records on first sight
(FailException: their trees are replayed), then a buggy step that emits every tenth
record twice. Duplicates reach the sink three ways, and the table must still hold each
event's output exactly once:

1. The sink writes a batch, then dies before the acks (the query stops with the error,
   the batch is not committed): the restarted query runs that batch again under new
   roots, and its records are written again.
2. Records of a failed tree whose output was already written are replayed whole.
3. The buggy step's duplicate rows arrive in one batch: the sink hands its function
   one row per key and acks both.
"""

from __future__ import annotations

import json
import sqlite3
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from fixture_types import MakeTopic
from pipeline_job import wait_settled
from pyspark import cloudpickle
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming import StreamingQuery
from serverproc import StartServer

from ftlayer.integration.ftcolumns import FTSettings
from ftlayer.integration.harness.demo import (
    ENRICHED_SCHEMA,
    PARSED_SCHEMA,
    event,
    is_flaky,
    make_enrich,
    parse,
)
from ftlayer.integration.harness.kafka import produce
from ftlayer.integration.sinks import ft_foreach_batch
from ftlayer.integration.tasks import FTTasks

cloudpickle.register_pickle_by_value(sys.modules[__name__])

EVENTS = 400
CRASH_AT = 200  # the sink dies after writing the first batch holding this event id
FAIL_RATE = 0.05  # the enrich step's share of events failed on first sight


def twice_every_tenth(row: dict[str, Any]) -> list[dict[str, Any]]:
    """A buggy step: every tenth event leaves it twice."""
    return [row, row] if row["id"] % 10 == 3 else [row]


class SinkTable:
    """The user's idempotent sink: INSERT OR IGNORE on the event id, on the driver.

    It also counts the batches each id was handed to it in (`handed`), and keeps the ids
    of the batch it died in (`crashed_ids`): the table's primary key alone makes its
    ids unique, so what ftlayer adds is measured on what reaches the sink's function."""

    def __init__(self, path: Path) -> None:
        self.db = sqlite3.connect(path, check_same_thread=False)
        self.db.execute("CREATE TABLE IF NOT EXISTS out (id INTEGER PRIMARY KEY, value BLOB)")
        self.attempts = 0
        self.repeated_in_a_batch = 0
        self.handed: Counter[int] = Counter()
        self.crashed_ids: set[int] = set()
        self.crashed = False

    def write(self, batch: DataFrame, epoch_id: int) -> None:
        rows = batch.select("id", "value").collect()
        ids = [row.id for row in rows]
        self.repeated_in_a_batch += len(ids) - len(set(ids))
        self.attempts += len(rows)
        self.handed.update(set(ids))
        with self.db:
            self.db.executemany(
                "INSERT OR IGNORE INTO out VALUES (?, ?)", [(r.id, r.value) for r in rows]
            )
        if not self.crashed and CRASH_AT in ids:
            self.crashed = True
            self.crashed_ids = set(ids)
            raise RuntimeError(f"the sink died after writing batch {epoch_id}, before its acks")

    def ids(self) -> list[int]:
        return [row[0] for row in self.db.execute("SELECT id FROM out ORDER BY id")]


def start(
    spark: SparkSession,
    opts: dict[str, str],
    settings: FTSettings,
    table: SinkTable,
    flaky_dir: Path,
    checkpoint: Path,
) -> StreamingQuery:
    tasks = FTTasks(settings)
    parsed = tasks.map(
        spark.readStream.format("ftkafka").options(**opts).load(), parse, PARSED_SCHEMA
    )
    enriched = tasks.map(parsed, make_enrich(str(flaky_dir), FAIL_RATE), ENRICHED_SCHEMA)
    doubled = tasks.flat_map(enriched, twice_every_tenth, ENRICHED_SCHEMA)
    return (
        doubled.writeStream.foreachBatch(ft_foreach_batch(table.write, settings, key=["id"]))
        .trigger(processingTime="300 milliseconds")
        .option("checkpointLocation", str(checkpoint))
        .start()
    )


def test_an_idempotent_sink_holds_each_output_once_despite_failures_and_a_restart(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
) -> None:
    server = start_server(None, "--tree-timeout-s", "600")
    settings = FTSettings(server.address)
    topic = make_topic(2)
    produce(kafka_bootstrap, topic, [event(i, users=7) for i in range(EVENTS)])
    opts = {
        "kafka.bootstrap.servers": kafka_bootstrap,
        "subscribe": topic,
        "ft.address": server.address,
        "ft.checkpointMode": "aligned",
        "maxOffsetsPerTrigger": "50",
    }
    table, flaky = SinkTable(tmp_path / "sink.db"), tmp_path / "flaky"
    flaky.mkdir()
    checkpoint = tmp_path / "checkpoint"

    # Run 1 ends when the sink dies after writing the batch that holds CRASH_AT.
    query = start(spark, opts, settings, table, flaky, checkpoint)
    with pytest.raises(StreamingQueryException, match="died after writing"):
        query.awaitTermination(180)
    written_before = len(table.ids())
    assert CRASH_AT in table.ids() and written_before < EVENTS

    # Run 2 restarts from the checkpoint: Spark runs the uncommitted batch again.
    query = start(spark, opts, settings, table, flaky, checkpoint)
    try:
        status = wait_settled(query, server.address, topic, EVENTS, 180)
    finally:
        query.stop()

    assert table.ids() == list(range(EVENTS))  # each event's output, exactly once
    # What ftlayer adds, on what reached the sink's function (the primary key would
    # hide a duplicate): every event's output, though 5% failed and a batch died
    # unacked (none lost: their records were replayed or read again) ...
    assert set(table.handed) == set(range(EVENTS))
    assert table.repeated_in_a_batch == 0  # ... one row per key in a batch ...
    # ... and an event handed over again only where a failure explains it: the batch the
    # sink died in (run again), or a record that failed on first sight (its replay and
    # the re-run batch's copy may both reach the sink).
    again = {i for i, n in table.handed.items() if n > 1}
    flaky_ids = {i for i in range(EVENTS) if is_flaky(i, FAIL_RATE)}
    assert CRASH_AT in again, sorted(again)
    assert again <= table.crashed_ids | flaky_ids, sorted(again - table.crashed_ids)
    # Duplicates did reach the sink: the crashed batch twice, the replayed trees whose
    # output was already written, the doubled rows (these are dropped before fn).
    assert table.attempts > EVENTS, table.attempts
    assert status["pending"] == 0 and status["failed"]["explicit"] > 0, status
    checkpoints = status["checkpoints"][topic]
    assert checkpoints["completed"] > 0 and all(
        c["mode"] == "aligned" for c in checkpoints["recent"]
    )
    for row in table.db.execute("SELECT id, value FROM out"):
        assert json.loads(row[1])["id"] == row[0]
