"""Sinks on real parts: a real `ftlayer serve`, real local Spark, the real Tansu broker.

Input DataFrames are built as the ftkafka source builds them (records persisted with
the FT layer first, ft_root / ft_id from the Persister). The tests check what a user
sees: the server's counters, the replayed records' bytes, the records in the topic.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from fixture_types import MakeTopic
from pyspark import cloudpickle
from pyspark.sql import DataFrame, SparkSession
from serverproc import Server

from ftlayer.acking.handlers import Persister
from ftlayer.client import FTClient
from ftlayer.integration.ftcolumns import ID_COLUMN, ROOT_COLUMN, FTSettings, to_signed
from ftlayer.integration.harness.broker import TansuBroker
from ftlayer.integration.harness.kafka import create_topic, read_all
from ftlayer.integration.sinks import SinkError, ft_foreach_batch, ft_kafka_sink
from ftlayer.integration.tasks import FTTasks

# Spark's Python workers cannot import this module: ship its functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

N = 2000


def persisted_frame(
    spark: SparkSession, client: FTClient, payloads: list[bytes]
) -> tuple[DataFrame, pa.Table]:
    """Rows as a source emits them: persisted first, then carrying their anchors."""
    n = len(payloads)
    anchors = Persister(client, source_id=1).persist(
        payloads, topics="in", partitions=np.arange(n) % 2, offsets=np.arange(n)
    )
    table = pa.table(
        {
            "key": [f"key-{i % 50}" for i in range(n)],
            "value": pa.array(payloads, type=pa.binary()),
            ROOT_COLUMN: to_signed(anchors.roots),
            ID_COLUMN: to_signed(anchors.ids),
        }
    )
    return spark.createDataFrame(table), table


def records(n: int, tag: str = "record") -> list[bytes]:
    return [f"{tag}-{i}".encode() for i in range(n)]


def replayed_payloads(client: FTClient) -> list[bytes]:
    replay = client.fetch_replay(0, client.status()["replay_cursor"])
    return sorted(replay.records.payloads)


def test_foreach_batch_acks_only_after_fn_returned(spark: SparkSession, ft_server: Server) -> None:
    client = ft_server.client()
    settings = FTSettings(ft_server.address)
    df, _ = persisted_frame(spark, client, records(N))
    upper = FTTasks(settings).map(
        df, lambda r: {"key": r["key"], "value": r["value"].upper()}, "key string, value binary"
    )
    seen: dict[str, Any] = {}

    def write(batch: DataFrame, epoch_id: int) -> None:
        # Two actions on the batch, as real writers often do (count, then write): the
        # sink's cache makes them, and the acks, read one computation.
        seen["count"] = batch.count()
        seen["rows"] = batch.collect()
        seen["columns"] = batch.columns
        seen["status while writing"] = client.status()

    sink = ft_foreach_batch(write, settings)
    sink(upper, 7)

    assert seen["columns"] == ["key", "value"]
    assert seen["count"] == len(seen["rows"]) == N
    assert sorted(r.value for r in seen["rows"]) == sorted(p.upper() for p in records(N))
    assert (seen["status while writing"]["pending"], seen["status while writing"]["completed"]) == (
        N,
        0,
    )
    status = client.status()
    assert (status["pending"], status["completed"]) == (0, N)
    assert status["unknown_events"] == status["late_events"] == 0
    assert sink.last_result is not None
    assert (sink.last_result.epoch_id, sink.last_result.acked) == (7, N)


def test_foreach_batch_error_fails_every_root_of_the_batch(
    spark: SparkSession, ft_server: Server
) -> None:
    client = ft_server.client()
    settings = FTSettings(ft_server.address)

    def broken_writer(batch: DataFrame, epoch_id: int) -> None:
        raise OSError(f"the warehouse refused batch {epoch_id}")

    # Default fail-and-raise: every root fails for replay and the error propagates
    # (in a streaming query it stops the query).
    stopping = records(300, "stopping")
    df, _ = persisted_frame(spark, client, stopping)
    with pytest.raises(OSError, match="refused batch 1") as raised:
        ft_foreach_batch(broken_writer, settings)(df, 1)
    assert "the 300 rows of batch 1 were failed for replay" in str(raised.value.__notes__)
    status = client.status()
    assert (status["failed"]["explicit"], status["completed"]) == (300, 0)

    # fail-and-continue: the same failure, logged; the query would go on.
    continuing = records(200, "continuing")
    df, _ = persisted_frame(spark, client, continuing)
    sink = ft_foreach_batch(broken_writer, settings, on_error="fail-and-continue")
    sink(df, 2)
    assert sink.last_result is not None
    assert (sink.last_result.acked, sink.last_result.failed) == (0, 200)
    status = client.status()
    assert (status["failed"]["explicit"], status["completed"]) == (500, 0)
    assert status["replay_queue"] == 500
    assert replayed_payloads(client) == sorted(stopping + continuing)


def test_kafka_sink_writes_every_record_then_acks(
    spark: SparkSession, ft_server: Server, kafka_bootstrap: str, make_topic: MakeTopic
) -> None:
    client = ft_server.client()
    topic = make_topic(4)
    df, table = persisted_frame(spark, client, records(N))
    sink = ft_kafka_sink(kafka_bootstrap, topic, FTSettings(ft_server.address))
    sink(df, 0)

    written = read_all(kafka_bootstrap, topic, timeout=20)
    assert sorted((r.key, r.value) for r in written) == sorted(
        (k.encode(), v)
        for k, v in zip(table["key"].to_pylist(), table["value"].to_pylist(), strict=True)
    )
    status = client.status()
    assert (status["pending"], status["completed"]) == (0, N)
    assert sink.last_result is not None
    assert (sink.last_result.acked, sink.last_result.failed) == (N, 0)


def test_kafka_sink_fails_only_the_records_the_broker_did_not_take(
    spark: SparkSession, ft_server: Server, kafka_bootstrap: str, make_topic: MakeTopic
) -> None:
    client = ft_server.client()
    topic = make_topic(2)
    payloads = [
        f"record-{i}".encode() * (3000 if i % 100 == 42 else 1) for i in range(N)
    ]  # 1 % are larger than the producer's 16 kB request limit below
    too_large = sorted(p for p in payloads if len(p) > 16_000)
    df, _ = persisted_frame(spark, client, payloads)
    sink = ft_kafka_sink(
        kafka_bootstrap,
        topic,
        FTSettings(ft_server.address),
        on_error="fail-and-continue",
        producer_config={"max_request_size": 16_000},
    )
    sink(df, 0)

    written = sorted(r.value for r in read_all(kafka_bootstrap, topic, timeout=20))
    assert written == sorted(set(payloads) - set(too_large))
    status = client.status()
    assert status["completed"] == N - len(too_large)
    assert status["failed"]["explicit"] == status["replay_queue"] == len(too_large)
    assert replayed_payloads(client) == too_large
    assert sink.last_result is not None
    assert "MessageSizeTooLarge" in (sink.last_result.error or "")


def test_kafka_sink_fails_the_roots_of_writes_to_a_stopped_broker(
    spark: SparkSession, ft_server: Server, tmp_path: Path
) -> None:
    client = ft_server.client()
    settings = FTSettings(ft_server.address)
    # Tansu ignores SIGTERM while clients are connected: it is killed after 0.5 s.
    broker = TansuBroker(log_path=tmp_path / "tansu.log", stop_timeout=0.5)
    bootstrap = broker.start()
    try:
        create_topic(bootstrap, "orders", 2)
        sink = ft_kafka_sink(
            bootstrap,
            "orders",
            settings,
            producer_config={
                "delivery_timeout_ms": 2000,
                "request_timeout_ms": 1000,
                "max_block_ms": 1000,
                "bootstrap_timeout_ms": 1000,
            },
        )
        first, _ = persisted_frame(spark, client, records(500, "first"))
        sink(first, 0)
        assert len(read_all(bootstrap, "orders", timeout=20)) == 500
    finally:
        broker.stop()

    second_payloads = records(300, "second")
    second, _ = persisted_frame(spark, client, second_payloads)
    with pytest.raises(SinkError, match="300 of 300 rows of batch 1 were not written"):
        sink(second, 1)
    status = client.status()
    assert status["completed"] == 500  # the confirmed first batch only
    assert status["failed"]["explicit"] == status["replay_queue"] == 300
    assert replayed_payloads(client) == sorted(second_payloads)


def test_ft_off_sinks_write_without_ft_columns_or_events(
    spark: SparkSession, ft_server: Server, kafka_bootstrap: str, make_topic: MakeTopic
) -> None:
    client = ft_server.client()
    settings = FTSettings(ft_server.address, enabled=False)
    _, table = persisted_frame(spark, client, records(500))
    plain = spark.createDataFrame(table.drop_columns([ROOT_COLUMN, ID_COLUMN]))
    before = client.status()
    topic = make_topic(2)
    seen: list[Any] = []

    ft_kafka_sink(kafka_bootstrap, topic, settings)(plain, 0)
    ft_foreach_batch(lambda d, _: seen.extend(d.collect()), settings)(plain, 1)

    assert sorted(r.value for r in read_all(kafka_bootstrap, topic, timeout=20)) == sorted(
        records(500)
    )
    assert len(seen) == 500
    after = client.status()
    for counter in ("xor_events", "completed", "unknown_events"):
        assert after[counter] == before[counter], counter
    assert after["failed"] == before["failed"]
    with pytest.raises(Exception, match="FT is off but the sink's DataFrame has FT columns"):
        ft_foreach_batch(lambda d, _: None, settings)(spark.createDataFrame(table), 2)
