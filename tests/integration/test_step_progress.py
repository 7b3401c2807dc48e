"""The FT tasks' own figures in Spark's progress (issue 16, part 3): with
`FTTasks(settings, observe=True)` every step reports, per micro-batch, the records it
read, the rows it emitted and the records it failed by cause, on real parts: the Tansu
broker, a real `ftlayer serve`, local Spark. A map fails some events on first sight
with FailException and others with a ValueError (under on_error="fail-record"); summed
over the batches a StreamingQueryListener sees, its failures by cause are the ones
injected and the ones the FT layer counted (`ftlayer status`), and every failed event
came back as a replay and reached the sink once."""

from __future__ import annotations

import os
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fixture_types import MakeTopic
from pyspark import cloudpickle
from pyspark.sql import DataFrame, SparkSession
from serverproc import StartServer
from sparkprogress import Progress, first_sight

from ftlayer.client import FTClient
from ftlayer.errors import ConfigError, FailException
from ftlayer.integration import FTSettings, FTTasks, ft_foreach_batch, ft_observe
from ftlayer.integration.harness.kafka import produce

cloudpickle.register_pickle_by_value(sys.modules[__name__])

N = 2_000
PARSE = "ftlayer.step.map(parse)"
KEEP = "ftlayer.step.filter(keep)"


def pick(i: int) -> int:
    return zlib.crc32(i.to_bytes(8, "little")) % 40


def explicit_once(i: int) -> bool:
    return pick(i) == 0


def error_once(i: int) -> bool:
    return pick(i) == 1


def dropped(i: int) -> bool:
    """The filter drops these (acked, not failed)."""
    return i % 7 == 0


def make_parse(marks: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The picked events fail on first sight (an O_EXCL marker file), then pass."""

    def parse(row: dict[str, Any]) -> dict[str, Any]:
        event_id = int(row["key"])
        if (explicit_once(event_id) or error_once(event_id)) and first_sight(marks, event_id):
            if explicit_once(event_id):
                raise FailException(f"event {event_id}: first sight")
            raise ValueError(f"event {event_id}: first sight")
        return {"id": event_id}

    return parse


def keep(row: dict[str, Any]) -> bool:
    return not dropped(row["id"])


class Collected:
    def __init__(self) -> None:
        self.ids: list[int] = []

    def __call__(self, batch: DataFrame, epoch_id: int) -> None:
        self.ids.extend(row.id for row in batch.select("id").collect())


@pytest.mark.parametrize("completion", ["barrier", "tree"])
def test_each_batch_progress_carries_the_steps_failures_by_cause(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
    completion: str,
) -> None:
    server = start_server(None, "--tree-timeout-s", "120")
    settings = FTSettings(server.address)
    topic = make_topic(2)
    produce(kafka_bootstrap, topic, [(str(i).encode(), b"v") for i in range(N)])
    explicit = {i for i in range(N) if explicit_once(i)}
    errors = {i for i in range(N) if error_once(i)}
    kept = {i for i in range(N) if not dropped(i)}
    marks = tmp_path / "marks"
    marks.mkdir()
    source = (
        spark.readStream.format("ftkafka")
        .option("kafka.bootstrap.servers", kafka_bootstrap)
        .option("subscribe", topic)
        .option("maxOffsetsPerTrigger", "700")
        .option("ft.address", server.address)
        .option("ft.completion", completion)
        .option("ft.retryBackoffMs", "0")
        .option("ft.replayColumn", "true")
        .load()
    )
    tasks = FTTasks(settings, observe=True)
    parsed = tasks.map(ft_observe(source, "ftlayer.source"), make_parse(str(marks)), "id long")
    filtered = tasks.filter(parsed, keep)
    # A barrier-mode row's anchor is its root alone (its record id would be 0).
    assert filtered.columns == ["id", "ft_root", *(["ft_id"] if completion == "tree" else [])]
    collected = Collected()
    listener = Progress()
    spark.streams.addListener(listener)
    query = (
        filtered.writeStream.foreachBatch(ft_foreach_batch(collected, settings))
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(processingTime="250 milliseconds")
        .start()
    )
    listener.query_id = str(query.id)
    failures = len(explicit) + len(errors)
    try:
        deadline = time.monotonic() + 300
        with FTClient(server.address) as client:
            while True:
                assert query.exception() is None, query.exception()
                status = client.status()
                if (
                    len(set(collected.ids)) >= len(kept)
                    and listener.total(KEEP, "outputs") >= len(kept)
                    and status.pending == 0
                ):
                    break
                assert time.monotonic() < deadline, (listener.batches, status.to_json())
                time.sleep(0.3)
        last = query.lastProgress
    finally:
        query.stop()
        spark.streams.removeListener(listener)
    # Nothing lost, nothing twice: every failed event came back and reached the sink.
    assert sorted(collected.ids) == sorted(kept)
    assert len(os.listdir(marks)) == failures and len(explicit) > 10 and len(errors) > 10
    # The map's failures by cause: the ones injected, the ones the FT layer counted.
    assert listener.total(PARSE, "explicit") == len(explicit)
    assert listener.total(PARSE, "error") == len(errors)
    assert listener.total(PARSE, "failed") == failures
    assert status.failed == {"explicit": failures, "timeout": 0, "recovery": 0, "source-expired": 0}
    assert listener.total("ftlayer.source", "replays") == failures
    # The map read every event once and each failed one again; the filter failed none.
    assert listener.total(PARSE, "records") == N + failures
    assert listener.total(KEEP, "records") == listener.total(PARSE, "outputs") == N
    assert listener.total(KEEP, "failed") == 0
    assert listener.total(KEEP, "outputs") == len(kept)
    # A batch's own progress: the map's inputs are the rows the batch read; each was
    # emitted or failed; the filter got what the map emitted.
    for batch_id, metrics in listener.batches.items():
        step, read = metrics[PARSE], metrics["ftlayer.source"]["rows"]
        assert step["records"] == read == step["outputs"] + step["failed"], (batch_id, metrics)
        assert step["failed"] == step["explicit"] + step["error"], (batch_id, metrics)
        assert metrics[KEEP]["records"] == step["outputs"], (batch_id, metrics)
    assert set(last["observedMetrics"]) == {"ftlayer.source", PARSE, KEEP}
    assert set(last["observedMetrics"][PARSE].asDict()) == {
        "records",
        "outputs",
        "failed",
        "explicit",
        "error",
    }


def test_observed_steps_keep_their_rows_and_schema(spark: SparkSession) -> None:
    """The summary rows never leave a step, the plan is today's without observe, and
    only a nested non-nullable column becomes nullable."""
    tasks = FTTasks(FTSettings(None, enabled=False))
    df = spark.range(50).selectExpr("id", "array(id) AS ids")
    schema = "id long not null, name string not null, ids array<long> not null"

    def named(row: dict[str, Any]) -> dict[str, Any]:
        if row["id"] % 10 == 3:
            raise FailException("three")
        return {"id": row["id"], "name": str(row["id"]), "ids": row["ids"]}

    plain = tasks.map(df, named, schema)
    observed = tasks.map(df, named, schema, observe=True)
    assert "CollectMetrics" not in plain._jdf.queryExecution().analyzed().toString()
    assert "CollectMetrics ftlayer.step.map(named)" in (
        observed._jdf.queryExecution().analyzed().toString()
    )
    assert [(f.name, f.nullable) for f in observed.schema.fields] == [
        ("id", False),
        ("name", False),
        ("ids", True),
    ]
    assert sorted(observed.collect()) == sorted(plain.collect())
    assert len(plain.collect()) == 45
    filtered = tasks.filter(observed, lambda row: row["id"] % 2 == 0, observe="evens")
    assert sorted(r.id for r in filtered.collect()) == [i for i in range(0, 50, 2) if i % 10 != 3]
    with pytest.raises(ConfigError, match="evens"):
        tasks.filter(filtered, lambda row: True, observe="evens")


def test_an_observed_aggregate_keeps_its_groups(spark: SparkSession) -> None:
    """FT off on a static DataFrame an aggregate runs through applyInArrow; observed,
    it runs through ftlayer's runner, with the same groups, a failed group dropped."""
    import pyarrow as pa

    tasks = FTTasks(FTSettings(None, enabled=False))
    df = spark.range(60).selectExpr("id % 6 AS k", "id")

    def total(key: Any, rows: Any) -> Any:
        if key[0].as_py() == 4:
            raise FailException("four")
        return pa.table({"k": [key[0].as_py()], "n": [rows.num_rows]})

    plain = tasks.aggregate(df, "k", total, "k long, n long")
    observed = tasks.aggregate(df, "k", total, "k long, n long", observe=True)
    assert "CollectMetrics ftlayer.step.aggregate(total)" in (
        observed._jdf.queryExecution().analyzed().toString()
    )
    assert sorted(observed.collect()) == sorted(plain.collect())
    assert sorted(r.k for r in observed.collect()) == [0, 1, 2, 3, 5]


SCALARS = [
    "boolean",
    "tinyint",
    "smallint",
    "int",
    "bigint",
    "float",
    "double",
    "decimal(12,3)",
    "decimal(38,10)",
    "string",
    "binary",
    "date",
    "timestamp",
    "timestamp_ntz",
    "interval day to second",
]


@pytest.mark.parametrize("ddl", SCALARS)
def test_a_non_nullable_scalar_column_gets_a_placeholder_of_its_type(ddl: str) -> None:
    """The summary row's value in a non-nullable scalar column: one value of exactly
    its Arrow type, so the column stays non-nullable; nested types get none."""
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.types import DataType

    from ftlayer.integration.tasks.observed import _placeholder

    field = to_arrow_schema(DataType.fromDDL(f"c {ddl} not null"), timezone="Europe/Paris")[0]
    value = _placeholder(field.type)
    assert value is not None and value.type == field.type and len(value) == 1
    assert value.null_count == 0
    nested = DataType.fromDDL(f"c array<{ddl}> not null, m map<string, {ddl}>, s struct<x: {ddl}>")
    assert all(_placeholder(f.type) is None for f in to_arrow_schema(nested, timezone="UTC"))
