"""The `ftkafka` streaming source on real parts: the Tansu broker, a real `ftlayer serve`
process and local Spark (`local[2,4]`).

What a user would notice is checked, never internals: every produced record arrives
exactly once with its key, value, coordinates and timestamp; with FT on each row
carries the anchor the FT layer tracks (acking it completes the record); failed records
come back in a later batch, in the input partition their replay partitioner chose; a
batch run twice never completes a root early and loses nothing; bad options fail before
any batch with the option's name in the message; an unreachable broker or FT layer is
an error within seconds.

Queries use Trigger.AvailableNow (deterministic: the query reads what was there when it
started, then stops) with a memory sink, except `startingOffsets=latest`, which needs a
running query. Rows are compared with what `read_all` reads back from Kafka.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from fixture_types import MakeTopic
from pyspark import TaskContext
from pyspark.errors import AnalysisException
from pyspark.errors.exceptions.captured import StreamingQueryException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.datasource import ReadAllAvailable
from pyspark.sql.types import LongType
from serverproc import Server, StartServer

from ftlayer.errors import ConfigError
from ftlayer.integration.ftcolumns import FT_COLUMNS, to_unsigned
from ftlayer.integration.harness.broker import free_port
from ftlayer.integration.harness.kafka import produce, read_all, wait_until
from ftlayer.integration.resume import WRITE_HEADER, WriteTag
from ftlayer.integration.sinks import ft_kafka_sink
from ftlayer.integration.source import (
    FTKafkaDataSource,
    FTKafkaPartition,
    FTKafkaStreamReader,
    SourceError,
    parse_options,
    source_schema,
)
from ftlayer.partitioners import kafka_key_hash

# (topic, partition, offset) -> (key, value, timestamp in ms)
Coords = tuple[str, int, int]
KAFKA_COLUMNS = ["key", "value", "topic", "partition", "offset", "timestamp"]
QUERY_TIMEOUT_S = 90


@pytest.fixture
def ft_layer(start_server: StartServer) -> Server:
    """An FT-layer server whose trees time out only after 10 minutes: these tests ack
    rows after their query ends, and a slow, shared machine must not turn a late ack
    into a timeout and a replay."""
    return start_server(None, "--tree-timeout-s", "600")


def options(bootstrap: str, topics: Iterable[str], **extra: object) -> dict[str, str]:
    found = {"kafka.bootstrap.servers": bootstrap, "subscribe": ",".join(topics)}
    found.update({k.replace("_", "."): str(v) for k, v in extra.items()})
    return found


def ft_options(bootstrap: str, topics: Iterable[str], server: Server, **extra: object) -> dict:
    """The source's options with FT on, in tree mode: these tests follow each record's
    anchor and XOR events (barrier mode has tests/integration/test_barrier_pipelines.py)."""
    return options(
        bootstrap, topics, **{"ft_address": server.address, "ft_completion": "tree", **extra}
    )


def records(prefix: str, n: int, *, keyless_every: int = 0, tombstone_every: int = 0) -> list:
    """(key, value) pairs; every `keyless_every`-th without a key, every
    `tombstone_every`-th with a key but no value (a Kafka tombstone)."""
    made = []
    for i in range(n):
        key = None if keyless_every and i % keyless_every == 0 else f"{prefix}-k{i % 37}".encode()
        tombstone = tombstone_every and i % tombstone_every == 1 and key is not None
        value = None if tombstone else f"{prefix}-{i}".encode()
        made.append((key, value))
    return made


def kafka_contents(bootstrap: str, topics: Iterable[str]) -> dict[Coords, tuple]:
    return {
        (r.topic, r.partition, r.offset): (r.key, r.value, r.timestamp)
        for topic in topics
        for r in read_all(bootstrap, topic)
    }


def run_available_now(
    spark: SparkSession,
    opts: Mapping[str, str],
    checkpoint: Path,
    transform: Callable[[DataFrame], DataFrame] = lambda frame: frame,
) -> tuple[list[dict[str, Any]], list[int]]:
    """One Trigger.AvailableNow run: (rows with their input partition, rows per batch).
    foreachBatch, not the memory sink: the memory sink cannot restart from a
    checkpoint. A failed query raises here, with its cause."""
    rows: list[dict[str, Any]] = []
    batches: list[int] = []

    def sink(batch: DataFrame, batch_id: int) -> None:
        got = [row.asDict() for row in batch.collect()]
        rows.extend(got)
        batches.append(len(got))

    frame = (
        spark.readStream.format("ftkafka")
        .options(**opts)
        .load()
        .withColumn("input_partition", F.spark_partition_id())
        .withColumn("timestamp_ms", F.unix_millis("timestamp"))
    )
    query = (
        transform(frame)
        .writeStream.foreachBatch(sink)
        .trigger(availableNow=True)
        .option("checkpointLocation", str(checkpoint))
        .start()
    )
    try:
        assert query.awaitTermination(QUERY_TIMEOUT_S), "the availableNow query did not finish"
    finally:
        query.stop()
    for row in rows:
        row["key"] = None if row["key"] is None else bytes(row["key"])
        row["value"] = None if row["value"] is None else bytes(row["value"])
    return rows, batches


def coords(row: Mapping[str, Any]) -> Coords:
    return (row["topic"], row["partition"], row["offset"])


def assert_rows_match_kafka(rows: list[dict[str, Any]], kafka: Mapping[Coords, tuple]) -> None:
    got = sorted(coords(r) for r in rows)
    assert len(got) == len(set(got)), "a record arrived twice"
    assert got == sorted(kafka), "records lost or invented"
    for row in rows:
        key, value, timestamp = kafka[coords(row)]
        assert (row["key"], row["value"], row["timestamp_ms"]) == (key, value, timestamp), row


def anchors(rows: Iterable[Mapping[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    rows = list(rows)
    roots = to_unsigned(np.array([r["ft_root"] for r in rows], dtype=np.int64))
    ids = to_unsigned(np.array([r.get("ft_id", 0) for r in rows], dtype=np.int64))
    return roots, ids


def ack(server: Server, rows: Iterable[Mapping[str, Any]]) -> None:
    """What a sink does once a row is fully processed: XOR its anchor's id into its root."""
    roots, ids = anchors(rows)
    with server.client() as client:
        client.xor(roots, ids)


def status(server: Server) -> dict[str, Any]:
    with server.client() as client:
        return client.status()


# ---- rows, batches and anchors -----------------------------------------------------------


def test_every_record_arrives_once_with_its_anchor_across_topics_and_batches(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    ft_layer: Server,
    tmp_path: Path,
) -> None:
    orders, payments = make_topic(3), make_topic(2)
    produce(kafka_bootstrap, orders, records("o", 240, keyless_every=10, tombstone_every=25))
    produce(kafka_bootstrap, payments, records("p", 160))
    kafka = kafka_contents(kafka_bootstrap, [orders, payments])
    limit = 150

    rows, batches = run_available_now(
        spark,
        ft_options(kafka_bootstrap, [orders, payments], ft_layer, maxOffsetsPerTrigger=limit),
        tmp_path / "checkpoint",
    )

    assert_rows_match_kafka(rows, kafka)
    # maxOffsetsPerTrigger splits the 400 records over batches; a partition with a
    # backlog gets at least one record per batch, so a batch may exceed the cap by
    # fewer records than there are partitions (5), as in Spark's Kafka source.
    with_rows = [n for n in batches if n]
    assert len(with_rows) >= 3 and sum(with_rows) == 400, batches
    assert max(with_rows) <= limit + 5, batches
    # One input partition per (topic, Kafka partition), in subscribe order.
    first_input = {orders: 0, payments: 3}
    assert all(r["input_partition"] == first_input[r["topic"]] + r["partition"] for r in rows)
    # Every row carries its own root, and the FT layer holds every record as pending.
    roots, ids = anchors(rows)
    assert len(set(roots.tolist())) == 400 and 0 not in roots and 0 not in ids
    before = status(ft_layer)
    assert (before["persisted"], before["pending"], before["completed"]) == (400, 400, 0)
    # The anchor in the FT columns is the one the FT layer tracks: acking it completes.
    ack(ft_layer, rows)
    after = status(ft_layer)
    assert (after["completed"], after["pending"], after["unknown_events"]) == (400, 0, 0)


def test_ft_timeout_ms_gives_the_querys_trees_their_own_timeout(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    ft_layer: Server,
    tmp_path: Path,
) -> None:
    # The server's timeout is 600 s; this query's records time out after 2 to 3 s.
    topic = make_topic(2)
    produce(kafka_bootstrap, topic, records("t", 30))
    rows, _ = run_available_now(
        spark,
        ft_options(kafka_bootstrap, [topic], ft_layer, ft_treeTimeoutMs=2000),
        tmp_path / "checkpoint",
    )
    assert len(rows) == 30
    # Never acked: all 30 time out (and their replays again every 2-3 s).
    wait_until(lambda: status(ft_layer)["failed"]["timeout"] >= 30, 20.0, "the timeouts")


def test_ft_off_gives_the_same_rows_without_ft_columns_or_ft_traffic(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    ft_layer: Server,
    tmp_path: Path,
) -> None:
    topic = make_topic(2)
    produce(kafka_bootstrap, topic, records("f", 120, keyless_every=7, tombstone_every=9))
    opts = ft_options(kafka_bootstrap, [topic], ft_layer, ft_enabled="false")

    frame = spark.readStream.format("ftkafka").options(**opts).load()
    rows, _ = run_available_now(spark, opts, tmp_path / "checkpoint")

    assert frame.columns == KAFKA_COLUMNS
    assert not set(FT_COLUMNS) & set(rows[0])
    assert_rows_match_kafka(rows, kafka_contents(kafka_bootstrap, [topic]))
    seen = status(ft_layer)
    assert (seen["persisted"], seen["xor_events"], seen["replay_cursor"]) == (0, 0, 0)


# ---- replays --------------------------------------------------------------------------------


def test_failed_records_come_back_in_a_later_batch_where_their_partitioner_routes_them(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    ft_layer: Server,
    tmp_path: Path,
) -> None:
    topic, partitions = make_topic(4), 4
    produce(kafka_bootstrap, topic, records("r", 200))
    opts = ft_options(kafka_bootstrap, [topic], ft_layer, ft_partitioner="kafka-hash")
    checkpoint = tmp_path / "checkpoint"
    first, _ = run_available_now(spark, opts, checkpoint)
    assert len(first) == 200
    failed = [r for r in first if r["offset"] % 5 == 0]
    with ft_layer.client() as client:
        assert client.fail(anchors(failed)[0]) == len(failed)
    ack(ft_layer, [r for r in first if r["offset"] % 5 != 0])
    produce(kafka_bootstrap, topic, records("late", 20))
    # An AvailableNow run reads the replays queued when it starts: theirs, once their
    # backoff (ft.retryBackoffMs) has passed.
    wait_until(lambda: status(ft_layer)["retry_waiting"] == 0, 20, "the backoff")

    # The query restarts from its checkpoint: the next batch takes in the replays.
    second, _ = run_available_now(spark, opts, checkpoint)

    original = {coords(r): r for r in first}
    replayed = [r for r in second if coords(r) in original]
    new = [r for r in second if coords(r) not in original]
    assert sorted(coords(r) for r in replayed) == sorted(coords(r) for r in failed)
    assert len(new) == 20 and all(r["value"].startswith(b"late-") for r in new)
    old_roots = set(anchors(first)[0].tolist())
    for row in replayed:
        before = original[coords(row)]
        assert (row["key"], row["value"], row["timestamp_ms"]) == (
            before["key"],
            before["value"],
            before["timestamp_ms"],
        )
        # kafka-hash routes by the stored murmur2 key hash: the partition Kafka chose.
        kafka_choice = (kafka_key_hash(row["key"]) & 0x7FFFFFFF) % partitions
        assert row["input_partition"] == row["partition"] == kafka_choice
    assert not old_roots & set(anchors(replayed)[0].tolist()), "a replay kept its old root"
    # The replays' anchors are live: acking everything completes every record.
    ack(ft_layer, second)
    seen = status(ft_layer)
    assert (seen["completed"], seen["pending"], seen["failed"]["explicit"]) == (220, 0, len(failed))


def _headers_of(row: Mapping[str, Any]) -> list[tuple[str, bytes | None]]:
    return [(h["key"], None if h["value"] is None else bytes(h["value"])) for h in row["headers"]]


def test_kafka_headers_are_read_replayed_with_their_record_and_written_by_the_sink(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    ft_layer: Server,
    tmp_path: Path,
) -> None:
    topic, out = make_topic(2), make_topic(2)
    made = [
        (
            f"k{i}".encode(),
            f"v{i}".encode(),
            [] if i % 7 == 0 else [("trace", b"t%d" % i), ("e", b"")],
        )
        for i in range(60)
    ]
    produce(kafka_bootstrap, topic, made)
    sent = {value: headers for _key, value, headers in made}
    opts = ft_options(kafka_bootstrap, [topic], ft_layer, includeHeaders="true")
    checkpoint = tmp_path / "checkpoint"
    first, _ = run_available_now(spark, opts, checkpoint)
    assert sorted(r["value"] for r in first) == sorted(sent)
    assert all(_headers_of(r) == sent[r["value"]] for r in first)
    failed = [r for r in first if r["offset"] % 4 == 0]
    with ft_layer.client() as client:
        client.fail(anchors(failed)[0])
    ack(ft_layer, [r for r in first if r["offset"] % 4 != 0])
    wait_until(lambda: status(ft_layer)["retry_waiting"] == 0, 20, "the backoff")

    # The replays come back with their headers: the FT layer kept them with the payload.
    second, _ = run_available_now(spark, opts, checkpoint)
    assert sorted(r["value"] for r in second) == sorted(r["value"] for r in failed)
    assert all(_headers_of(r) == sent[r["value"]] for r in second)
    ack(ft_layer, second)

    # The Kafka sink writes the headers column as each record's headers.
    sink = ft_kafka_sink(kafka_bootstrap, out, parse_options(opts).ft)
    query = (
        spark.readStream.format("ftkafka")
        .options(**{**opts, "ft.sourceName": "headers-to-sink"})
        .load()
        .select("key", "value", "headers", *FT_COLUMNS)
        .writeStream.foreachBatch(sink)
        .trigger(availableNow=True)
        .option("checkpointLocation", str(tmp_path / "sink-checkpoint"))
        .start()
    )
    try:
        assert query.awaitTermination(QUERY_TIMEOUT_S), "the sink query did not finish"
    finally:
        query.stop()
    # Each record's own headers, in order, then the sink's write tag (integration.resume).
    written = {r.value: list(r.headers) for r in read_all(kafka_bootstrap, out)}
    assert {value: headers[:-1] for value, headers in written.items()} == {
        value: [(k, v) for k, v in headers] for value, headers in sent.items()
    }
    assert all(
        headers[-1][0] == WRITE_HEADER and WriteTag.decode(headers[-1][1]) is not None
        for headers in written.values()
    )
    assert status(ft_layer)["pending"] == 0


def test_without_include_headers_there_is_no_headers_column(
    spark: SparkSession, kafka_bootstrap: str, make_topic: MakeTopic, tmp_path: Path
) -> None:
    topic = make_topic(1)
    produce(kafka_bootstrap, topic, [(b"k", b"v", [("trace", b"t")])])
    rows, _ = run_available_now(spark, options(kafka_bootstrap, [topic]), tmp_path / "cp")
    assert len(rows) == 1 and "headers" not in rows[0]
    opts = options(kafka_bootstrap, [topic], includeHeaders="true")
    with_headers, _ = run_available_now(spark, opts, tmp_path / "cp-headers")
    assert _headers_of(with_headers[0]) == [("trace", b"t")]


def test_a_batch_read_twice_never_completes_a_root_early_and_loses_nothing(
    kafka_bootstrap: str, make_topic: MakeTopic, start_server: StartServer
) -> None:
    """Spark re-runs a batch (an uncommitted batch after a restart, a retried task) by
    calling read() again for the same offsets; here read() is called twice directly.
    With stored references (ft.treeRanges=false): each read persists its records under
    roots of its own. (By range, the default, a second read starts the same records'
    trees over: tests/integration/test_tree_ranges.py.)"""
    server = start_server(None, "--tree-timeout-s", "3")
    topic = make_topic(2)
    produce(kafka_bootstrap, topic, records("t", 60))
    opts = ft_options(kafka_bootstrap, [topic], server, ft_treeRanges="false")
    reader = FTKafkaDataSource(opts).streamReader(source_schema(True))

    def read_batch(start: dict[str, Any]) -> tuple[dict[str, Any], Callable[[], list[dict]]]:
        end = reader.latestOffset(start, ReadAllAvailable())
        parts = reader.partitions(start, end)
        return end, lambda: [row for p in parts for row in read_rows(reader, p)]

    try:
        start = reader.initialOffset()
        end, read = read_batch(start)
        first = read()
        ack(server, first)  # the first run's trees complete
        second = read()  # the re-run persists the same records under fresh roots
        assert sorted(map(coords, second)) == sorted(map(coords, first))
        assert not set(anchors(first)[0].tolist()) & set(anchors(second)[0].tolist())
        seen = status(server)
        assert (seen["persisted"], seen["completed"], seen["pending"]) == (120, 60, 60)
        # Spark asks for the next batch once this one is done: its heartbeats stop
        # (ft.heartbeatMs), so the trees it left unfinished can time out.
        assert reader.latestOffset(end, ReadAllAvailable()) == end

        # Nobody acks the re-run's trees: they time out and are queued for replay, once
        # their backoff (ft.retryBackoffMs) has passed.
        wait_until(lambda: status(server)["failed"]["timeout"] == 60, 20, "the timeouts")
        wait_until(lambda: status(server)["retry_waiting"] == 0, 20, "the backoff")
        end2, read_replays = read_batch(end)
        assert end2["replay"] > end["replay"] and end2["kafka"] == end["kafka"]
        copy_a = read_replays()
        copy_b = read_replays()  # the replay batch runs twice as well
        assert sorted(map(coords, copy_a)) == sorted(map(coords, copy_b))
        assert sorted(map(coords, copy_a)) == sorted(map(coords, second))
        by_coords = {coords(r): r for r in second}
        assert all(r["value"] == by_coords[coords(r)]["value"] for r in copy_b)
        # The re-run fetched the replays under fresh roots, which took the first
        # copy's over (its emission events hang off the old ones).
        assert not set(anchors(copy_a)[0].tolist()) & set(anchors(copy_b)[0].tolist())
        assert status(server)["taken_over"] == 60

        # The first copy's acks are late: they complete nothing.
        ack(server, copy_a)
        seen = status(server)
        assert (seen["completed"], seen["pending"], seen["late_events"]) == (60, 60, 60)
        ack(server, copy_b)
        seen = status(server)
        assert (seen["completed"], seen["pending"], seen["failed"]["timeout"]) == (120, 0, 60)
    finally:
        reader.stop()


@pytest.mark.parametrize("by_range", [True, False], ids=["by-range", "stored"])
def test_a_task_spark_retries_takes_the_dead_attempts_roots_over_never_completing_early(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
    by_range: bool,
) -> None:
    """A task that fails after the source read its records is run again: by range (the
    default) the retry reads them again under a seed of its own, which starts their
    trees over; with stored references the retry persists them again under roots of
    its own, which take the dead attempt's over. Either way no record completes early,
    none is replayed, and the retry's acks complete every one."""
    server = start_server()
    topic = make_topic(2)
    positions = produce(kafka_bootstrap, topic, records("retry", 40))

    # Defined here, not at module level: Spark's workers cannot import this test module,
    # so the function must be pickled by value. Unannotated: PySpark reads a UDF's type
    # hints to pick its evaluation type.
    def fail_first_attempt_of_partition_0(offset):  # type: ignore[no-untyped-def]
        """Kills the first attempt of input partition 0's task after the source read and
        persisted its range; Spark (local[2,4]) then runs the task again."""
        context = TaskContext.get()
        assert context is not None
        if context.partitionId() == 0 and context.attemptNumber() == 0:
            raise RuntimeError("injected task failure after the source read its range")
        return offset

    fail_first_attempt = F.udf(fail_first_attempt_of_partition_0, LongType())
    in_partition_0 = sum(1 for p in positions if p.partition == 0)
    assert 0 < in_partition_0 < 40

    rows, _ = run_available_now(
        spark,
        ft_options(kafka_bootstrap, [topic], server, ft_treeRanges=str(by_range).lower()),
        tmp_path / "checkpoint",
        lambda frame: frame.withColumn("checked", fail_first_attempt("offset")),
    )

    assert_rows_match_kafka(rows, kafka_contents(kafka_bootstrap, [topic]))
    seen = status(server)
    if by_range:  # one range per partition, read twice: nothing persisted per read
        assert (seen["persisted"], seen["pending"], seen["taken_over"]) == (40, 40, 0)
        assert seen["stored_records"] == 0
    else:
        # The failed attempt had persisted partition 0's records under roots of its
        # own; the retry read them again, and its roots took those over (no replay).
        assert (seen["persisted"], seen["pending"]) == (40 + in_partition_0, 40)
        assert seen["taken_over"] == in_partition_0
    ack(server, rows)
    seen = status(server)
    assert (seen["completed"], seen["pending"], seen["failed"]["timeout"]) == (40, 0, 0)


def read_rows(reader: FTKafkaStreamReader, part: Any) -> list[dict[str, Any]]:
    batches = list(reader.read(part))
    if not batches:
        return []
    rows = pa.Table.from_batches(batches).to_pylist()
    for row in rows:
        row["timestamp_ms"] = int(row["timestamp"].timestamp() * 1000)
    return rows


# ---- starting offsets ------------------------------------------------------------------------


def test_starting_offsets_latest_reads_only_records_produced_after_the_start(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    ft_layer: Server,
    tmp_path: Path,
) -> None:
    topic = make_topic(2)
    produce(kafka_bootstrap, topic, records("before", 50))
    name = f"ftkafka_{uuid.uuid4().hex[:12]}"
    frame = (
        spark.readStream.format("ftkafka")
        .options(**ft_options(kafka_bootstrap, [topic], ft_layer, startingOffsets="latest"))
        .load()
    )
    query = (
        frame.writeStream.format("memory")
        .queryName(name)
        .trigger(processingTime="200 milliseconds")
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .start()
    )
    try:
        # The start position is fixed by the first trigger; then the query waits.
        wait_until(
            lambda: query.status["message"] == "Waiting for data to arrive",
            QUERY_TIMEOUT_S,
            "the query's first trigger",
        )
        after = produce(kafka_bootstrap, topic, records("after", 40))
        wait_until(lambda: spark.table(name).count() >= 40, QUERY_TIMEOUT_S, "the new records")
        rows = spark.table(name).collect()
    finally:
        query.stop()
    assert sorted((r["partition"], r["offset"]) for r in rows) == sorted(after)
    assert all(bytes(r["value"]).startswith(b"after-") for r in rows)


def test_starting_offsets_json_gives_each_partition_its_start(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    ft_layer: Server,
    tmp_path: Path,
) -> None:
    topic = make_topic(3)
    produce(kafka_bootstrap, topic, records("j", 150))
    kafka = kafka_contents(kafka_bootstrap, [topic])
    starting = {topic: {"0": 5, "1": -2, "2": -1}}  # offset 5, earliest, latest
    opts = ft_options(kafka_bootstrap, [topic], ft_layer, startingOffsets=json.dumps(starting))

    rows, _ = run_available_now(spark, opts, tmp_path / "checkpoint")

    wanted = {c: v for c, v in kafka.items() if (c[1] == 0 and c[2] >= 5) or c[1] == 1}
    assert any(c[1] == 2 for c in kafka) and any(c[1] == 0 and c[2] < 5 for c in kafka)
    assert_rows_match_kafka(rows, wanted)


# ---- bad input ------------------------------------------------------------------------------


BAD_OPTIONS = [
    ({"kafka.bootstrap.servers": None}, "option kafka.bootstrap.servers is required"),
    ({"subscribe": None}, "option subscribe needs at least one topic"),
    ({"subscribe": " , "}, "option subscribe needs at least one topic"),
    ({"startingOffsets": '{"t": {"0": 1'}, "option startingOffsets must be"),
    ({"startingOffsets": '{"t": {"zero": 1}}'}, "partition 'zero'"),
    ({"startingOffsets": '{"t": {"0": -3}}'}, "offset -3"),
    ({"startingOffsets": '{"other": {"0": 1}}'}, "names topics ['other']"),
    ({"maxOffsetsPerTrigger": "0"}, "option maxOffsetsPerTrigger must be at least 1, got '0'"),
    ({"maxOffsetsPerTrigger": "many"}, "option maxOffsetsPerTrigger must be an integer"),
    ({"ft.address": "h:1", "ft.partitioner": "nope"}, "ft.partitioner='nope'"),
    ({"ft.address": "h:1", "ft.partitioner.start": "x"}, "ft.partitioner.start"),
    ({"ft.address": "no-port"}, "ft.address='no-port'"),
    ({"ft.enabled": "true"}, "ft.address is not set"),
    ({"ft.enabled": "maybe"}, "ft.enabled must be true or false, got 'maybe'"),
    ({"kafka.nonsense.setting": "1"}, "kafka.nonsense.setting"),
    ({"subscribePattern": "t.*"}, "subscribepattern is not supported"),
    ({"failOnDataLoss": "false"}, "unknown option 'failondataloss'"),
    ({"ft.address": "h:1", "ft.treeTimeoutMs": "0"}, "option ft.treeTimeoutMs must be at least 1"),
    (
        {"ft.address": "h:1", "ft.treeTimeoutMs": "soon"},
        "option ft.treeTimeoutMs must be an integer",
    ),
]


@pytest.mark.parametrize(("bad", "message"), BAD_OPTIONS)
def test_a_bad_option_is_a_config_error_naming_it(bad: dict[str, str | None], message: str) -> None:
    """What Spark runs at load() (DataSource.schema), called directly: no broker needed."""
    given = {"kafka.bootstrap.servers": "h:1", "subscribe": "t", **bad}
    opts = {k: v for k, v in given.items() if v is not None}
    with pytest.raises(ConfigError) as raised:
        FTKafkaDataSource(opts).schema()
    assert message in str(raised.value)


def test_a_bad_option_fails_load_in_spark_with_its_name(spark: SparkSession) -> None:
    opts = {"kafka.bootstrap.servers": "h:1", "subscribe": "t", "maxOffsetsPerTrigger": "-4"}
    with pytest.raises(AnalysisException, match="option maxOffsetsPerTrigger must be at least 1"):
        spark.readStream.format("ftkafka").options(**opts).load()


def test_an_unknown_topic_fails_the_query_before_any_batch(
    spark: SparkSession, kafka_bootstrap: str, make_topic: MakeTopic, tmp_path: Path
) -> None:
    missing = f"no-such-topic-{uuid.uuid4().hex[:8]}"
    topic = make_topic(1)
    with pytest.raises(StreamingQueryException, match=f"topic.*{missing}.*do not exist") as failed:
        run_available_now(spark, options(kafka_bootstrap, [topic, missing]), tmp_path / "ck")
    assert "option subscribe" in str(failed.value)


def driver_reader(opts: Mapping[str, str]) -> FTKafkaStreamReader:
    source = FTKafkaDataSource(dict(opts))
    return source.streamReader(source.schema())


def test_starting_offsets_for_a_partition_that_does_not_exist_or_past_the_end(
    kafka_bootstrap: str, make_topic: MakeTopic
) -> None:
    topic = make_topic(2)
    produce(kafka_bootstrap, topic, [(b"k", b"v")] * 3)
    ends = {p: sum(1 for r in read_all(kafka_bootstrap, topic) if r.partition == p) for p in (0, 1)}
    cases = [
        ({topic: {"0": 0, "1": 0, "2": 0}}, "has no partition [2]; it has partitions 0-1"),
        ({topic: {"0": 0}}, "must give every partition of topic"),
        ({topic: {"0": ends[0] + 1, "1": 0}}, f"offset {ends[0] + 1} of {topic}-0 is outside"),
    ]
    for starting, message in cases:
        reader = driver_reader(
            options(kafka_bootstrap, [topic], startingOffsets=json.dumps(starting))
        )
        try:
            with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
                reader.initialOffset()
        finally:
            reader.stop()


def test_an_unreachable_broker_is_an_error_after_bounded_retries(kafka_bootstrap: str) -> None:
    dead = f"127.0.0.1:{free_port()}"
    reader = driver_reader(
        options(
            dead,
            ["t"],
            **{
                "fetchOffset.numRetries": 2,
                "fetchOffset.retryIntervalMs": 100,
                "kafka.bootstrap.timeout.ms": 300,
            },
        )
    )
    began = time.monotonic()
    with pytest.raises(SourceError, match=f"Kafka at {dead} \\(kafka.bootstrap.servers\\): 3 att"):
        reader.initialOffset()
    # 3 attempts of 0.3 s and backoffs of 0.1 + 0.2 s: about 1.2 s, never a hang.
    assert 1.0 < time.monotonic() - began < 10


def test_an_unreachable_ft_layer_is_an_error_after_bounded_retries(
    kafka_bootstrap: str, make_topic: MakeTopic
) -> None:
    topic = make_topic(1)
    dead = f"127.0.0.1:{free_port()}"
    reader = driver_reader(
        options(kafka_bootstrap, [topic], ft_address=dead, **{"ft.reconnectTimeoutMs": 1000})
    )
    began = time.monotonic()
    try:
        with pytest.raises(SourceError, match=f"FT layer at {dead} \\(option ft.address\\)") as e:
            reader.initialOffset()
    finally:
        reader.stop()
    # The client retried with backoff for about ft.reconnectTimeoutMs, then gave up.
    assert "attempts in" in str(e.value)
    assert 0.5 < time.monotonic() - began < 10


def test_a_range_kafka_cannot_deliver_fails_the_read_with_a_clear_error_not_a_hang(
    kafka_bootstrap: str, make_topic: MakeTopic
) -> None:
    """An executor whose range is gone (a truncated or recreated topic) gives up after
    kafkaConsumer.pollTimeoutMs with the partition and the offset it reached."""
    topic = make_topic(1)
    produce(kafka_bootstrap, topic, records("gone", 5))
    reader = driver_reader(
        options(kafka_bootstrap, [topic], **{"kafkaConsumer.pollTimeoutMs": 500})
    )
    beyond = FTKafkaPartition(topic, 0, 0, 8, source_id=0, replay_lo=0, replay_hi=0)
    began = time.monotonic()
    with pytest.raises(SourceError, match=rf"{topic}-0 \[0, 8\).*nothing arrived.*offset 5"):
        read_rows(reader, beyond)
    assert time.monotonic() - began < 10


def test_an_idle_query_looks_for_new_records_at_most_every_idle_probe_interval(
    kafka_bootstrap: str, make_topic: MakeTopic
) -> None:
    """Spark asks an idle query for its latest offset every 10 ms; the source looks at
    Kafka (and the FT layer) at most every idleProbeIntervalMs, so records that come in
    an idle spell are planned at most that much later, and never lost."""
    topic = make_topic(1)
    produce(kafka_bootstrap, topic, records("idle", 3))
    interval_s = 3.0
    opts = options(kafka_bootstrap, [topic], idleProbeIntervalMs=int(interval_s * 1000))
    reader = FTKafkaDataSource(opts).streamReader(source_schema(False))
    start = reader.initialOffset()
    end = reader.latestOffset(start, ReadAllAvailable())
    assert end["kafka"][topic] == {"0": 3}
    looking = time.monotonic()  # the next look is due no sooner than interval_s from here
    assert reader.latestOffset(end, ReadAllAvailable()) == end  # looked: nothing new
    produce(kafka_bootstrap, topic, records("idle-more", 2))
    answer = reader.latestOffset(end, ReadAllAvailable())
    if time.monotonic() - looking < interval_s:  # (a machine this slow cannot tell)
        assert answer == end  # not looked again yet: the two records wait
    wait_until(lambda: reader.latestOffset(end, ReadAllAvailable()) != end, 15, "the look")
    assert time.monotonic() - looking >= interval_s
    assert reader.latestOffset(end, ReadAllAvailable())["kafka"][topic] == {"0": 5}

    # With 0 the source looks at every trigger: new records show at once.
    eager = FTKafkaDataSource(options(kafka_bootstrap, [topic], idleProbeIntervalMs=0))
    eager_reader = eager.streamReader(source_schema(False))
    first = eager_reader.latestOffset(eager_reader.initialOffset(), ReadAllAvailable())
    assert eager_reader.latestOffset(first, ReadAllAvailable()) == first
    produce(kafka_bootstrap, topic, records("idle-eager", 1))
    assert eager_reader.latestOffset(first, ReadAllAvailable())["kafka"][topic] == {"0": 6}
