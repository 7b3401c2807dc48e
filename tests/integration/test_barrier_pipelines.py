"""Barrier mode on real parts (issue 13, part 2): with `ft.completion=barrier` a
pipeline may use plain Spark operators between the source and the sink. Every input
record reaches the output (or the operator's state) or is replayed after an explicit
failure; nothing is lost; no tree is left pending after its batch; no XOR event is
sent for a record that is not held.

Real Tansu, a real `ftlayer serve`, local Spark (`local[2,4]`). Records fail once on
first sight (an O_EXCL marker, across Python workers) in a wrapped step.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from fixture_types import MakeTopic
from pyspark import cloudpickle
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StatefulProcessor, StatefulProcessorHandle
from serverproc import Server, StartServer

from ftlayer.client import FTClient
from ftlayer.errors import ConfigError, FailException
from ftlayer.integration.ftcolumns import FTSettings
from ftlayer.integration.harness.kafka import produce, read_all, wait_until
from ftlayer.integration.sinks import ft_foreach_batch, ft_kafka_sink
from ftlayer.integration.tasks import FTTasks
from ftlayer.status import Status

cloudpickle.register_pickle_by_value(sys.modules[__name__])

SCHEMA = "id long, value string"
BASE_MS = 1_800_000_000_000  # event times: a fixed base, one second per id
STATE_STORE_PROVIDER = "spark.sql.streaming.stateStore.providerClass"
ROCKSDB_STATE_STORE = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"


def fails_once(i: int) -> bool:
    return i % 37 == 5


def make_parse(marks: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The wrapped step: the key is the id; ids with fails_once fail on first sight."""

    def parse(row: dict[str, Any]) -> dict[str, Any]:
        event_id = int(row["key"])
        if fails_once(event_id):
            try:
                os.close(os.open(os.path.join(marks, str(event_id)), os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                raise FailException(f"event {event_id}: upstream timed out")
        return {"id": event_id, "value": (row["value"] or b"").decode()}

    return parse


def barrier_source(
    spark: SparkSession, bootstrap: str, topic: str, server: Server, persist: str = "reference"
) -> DataFrame:
    """Barrier mode; by reference (the default: batches by range) unless `persist`."""
    return (
        spark.readStream.format("ftkafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", topic)
        .option("ft.address", server.address)
        .option("ft.completion", "barrier")
        .option("ft.persist", persist)
        .option("ft.retryBackoffMs", "100")
        .load()
    )


class Rows:
    """What a foreachBatch sink received, on the driver."""

    def __init__(self, columns: list[str]) -> None:
        self.columns = columns
        self.rows: list[tuple[Any, ...]] = []

    def __call__(self, batch: DataFrame, epoch_id: int) -> None:
        self.rows.extend(tuple(r) for r in batch.select(*self.columns).collect())


def settle(
    query: Any, server: Server, ready: Callable[[Status], bool], timeout_s: float = 120.0
) -> Status:
    """Wait until `ready(status)` holds with no tree pending, twice in a row; the status."""
    deadline = time.monotonic() + timeout_s
    calm = 0
    with FTClient(server.address) as client:
        while True:
            if query.exception() is not None:
                raise AssertionError(f"the query failed: {query.exception()}")
            status = client.status()
            calm = calm + 1 if ready(status) and status.pending == 0 else 0
            if calm >= 2:
                return status
            assert time.monotonic() < deadline, f"not settled: {status.to_json()}"
            time.sleep(0.3)


def start(frame: DataFrame, sink: Any, checkpoint: Path, mode: str = "append") -> Any:
    return (
        frame.writeStream.foreachBatch(sink)
        .outputMode(mode)
        .option("checkpointLocation", str(checkpoint))
        .trigger(processingTime="300 milliseconds")
        .start()
    )


@pytest.mark.parametrize("persist", ["reference", "payload"])
def test_where_select_explode_and_a_static_join_need_nothing_of_the_user(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
    persist: str,
) -> None:
    n = 2000
    server = start_server(None, "--tree-timeout-s", "120")
    settings = FTSettings(server.address)
    topic = make_topic(4)
    produce(kafka_bootstrap, topic, [(str(i).encode(), b"v%d" % i) for i in range(n)])
    (tmp_path / "marks").mkdir()
    names = spark.createDataFrame([(k, f"name-{k}") for k in range(7)], "k long, name string")
    parsed = FTTasks(settings).map(
        barrier_source(spark, kafka_bootstrap, topic, server, persist),
        make_parse(str(tmp_path / "marks")),
        SCHEMA,
    )
    shaped = (
        parsed.where(F.col("id") % 3 != 0)  # a plain where drops rows: fine here
        .select("id", "ft_root", (F.col("id") % 7).alias("k"))
        .withColumn("copy", F.explode(F.array(F.lit(0), F.lit(1))))
        .join(F.broadcast(names), "k")
    )
    rows = Rows(["id", "copy", "name"])
    sink = ft_foreach_batch(rows, settings)
    query = start(shaped, sink, tmp_path / "cp")
    try:
        status = settle(query, server, lambda s: s.persisted >= n)
    finally:
        query.stop()
    kept = [i for i in range(n) if i % 3 != 0]
    assert sorted(rows.rows) == sorted((i, c, f"name-{i % 7}") for i in kept for c in (0, 1))
    failing = [i for i in range(n) if fails_once(i)]
    assert status.failed["explicit"] == len(failing) and status.failed["timeout"] == 0
    # Barrier mode sends no XOR event per record: the sink and the steps sent none.
    assert status.xor_events == 0
    # Released: every root's hold once, a failed record's under its replay's root (the
    # failed root's hold is dropped at its barrier, not counted).
    assert status.barrier_released == n and status.completed == n
    # By reference, nothing was persisted per record but the failed ones (their bytes
    # copied in from Kafka); with payload, every record's bytes.
    assert status.persisted == n
    if persist == "reference":
        assert status.filled == len(failing) and status.open_ranges == 0
    # The sink knew from the ft_root column's metadata that it had nothing to ack.
    assert sink.last_result is not None and sink.last_result.at_barrier


def test_a_watermarked_window_counts_every_record_and_drops_failed_ones_until_replayed(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
) -> None:
    n = 600
    server = start_server(None, "--tree-timeout-s", "120")
    settings = FTSettings(server.address)
    topic = make_topic(2)
    # One event per second of event time; 60-second windows.
    produce(kafka_bootstrap, topic, [(str(i).encode(), b"v") for i in range(n)])
    (tmp_path / "marks").mkdir()
    parsed = FTTasks(settings).map(
        barrier_source(spark, kafka_bootstrap, topic, server),
        make_parse(str(tmp_path / "marks")),
        SCHEMA,
    )
    timed = parsed.withColumn(
        "at", F.timestamp_millis(F.lit(BASE_MS) + F.col("id") * 1000)
    ).withWatermark("at", "10 minutes")
    counts = timed.groupBy(F.window("at", "60 seconds")).agg(F.count("*").alias("n"))
    totals: dict[Any, int] = {}

    def sink(batch: DataFrame, epoch_id: int) -> None:
        for row in batch.collect():
            totals[row["window"]["start"]] = row["n"]

    query = start(counts, sink, tmp_path / "cp", mode="update")
    try:
        settle(query, server, lambda s: s.persisted >= n and s.replay_queue == 0)
        time.sleep(2)  # a last batch for the replays' rows
    finally:
        query.stop()
    # Every record is in its window's count, the failed-once ones after their replay.
    assert sum(totals.values()) == n and len(totals) == n // 60


def test_a_failed_record_in_a_stream_stream_join_comes_back_and_joins_again(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
) -> None:
    n = 300
    server = start_server(None, "--tree-timeout-s", "120")
    settings = FTSettings(server.address)
    left_topic, right_topic = make_topic(2), make_topic(2)
    produce(kafka_bootstrap, left_topic, [(str(i).encode(), b"l%d" % i) for i in range(n)])
    produce(kafka_bootstrap, right_topic, [(str(i).encode(), b"r%d" % i) for i in range(n)])
    (tmp_path / "marks").mkdir()
    tasks = FTTasks(settings)
    left = tasks.map(
        barrier_source(spark, kafka_bootstrap, left_topic, server),
        make_parse(str(tmp_path / "marks")),  # failing once: left side only
        SCHEMA,
    )
    right = barrier_source(spark, kafka_bootstrap, right_topic, server).select(
        F.col("key").cast("string").cast("long").alias("rid"),
        F.col("value").cast("string").alias("rvalue"),
        F.col("ft_root").alias("r_root"),
    )
    at = F.timestamp_millis(F.lit(BASE_MS))
    joined = (
        left.withColumn("at", at)
        .withWatermark("at", "1 hour")
        .join(right.withColumn("rat", at).withWatermark("rat", "1 hour"), F.expr("id = rid"))
    )
    rows = Rows(["id", "value", "rvalue"])
    query = start(joined, ft_foreach_batch(rows, settings), tmp_path / "cp")
    try:
        status = settle(query, server, lambda s: s.persisted >= 2 * n)
    finally:
        query.stop()
    # Every pair joined once, the left records that failed after their replay: the
    # right side was still in the join's state.
    assert sorted(rows.rows) == [(i, f"l{i}", f"r{i}") for i in range(n)]
    assert status.failed["explicit"] == len([i for i in range(n) if fails_once(i)])


def test_drop_duplicates_within_watermark_and_apply_in_pandas_with_state(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
) -> None:
    import pandas as pd
    from pyspark.sql.streaming.state import GroupState, GroupStateTimeout

    n = 400
    server = start_server(None, "--tree-timeout-s", "120")
    settings = FTSettings(server.address)
    topic = make_topic(2)
    # Every id twice: dropDuplicatesWithinWatermark keeps one of each.
    produce(kafka_bootstrap, topic, [(str(i % n).encode(), b"v") for i in range(2 * n)])
    (tmp_path / "marks").mkdir()
    parsed = FTTasks(settings).map(
        barrier_source(spark, kafka_bootstrap, topic, server),
        make_parse(str(tmp_path / "marks")),
        SCHEMA,
    )
    distinct = (
        parsed.withColumn("at", F.timestamp_millis(F.lit(BASE_MS)))
        .withWatermark("at", "1 hour")
        .dropDuplicatesWithinWatermark(["id"])
        .withColumn("group", F.col("id") % 5)
    )

    def running(key: Any, frames: Any, state: GroupState) -> Any:
        seen = (state.get[0] if state.exists else 0) + sum(len(f) for f in frames)
        state.update((seen,))
        yield pd.DataFrame({"group": [key[0]], "seen": [seen]})

    counted = distinct.groupBy("group").applyInPandasWithState(
        running, "group long, seen long", "seen long", "update", GroupStateTimeout.NoTimeout
    )
    latest: dict[int, int] = {}

    def sink(batch: DataFrame, epoch_id: int) -> None:
        for row in batch.collect():
            latest[row["group"]] = max(latest.get(row["group"], 0), row["seen"])

    query = start(counted, sink, tmp_path / "cp", mode="update")
    try:
        settle(query, server, lambda s: s.persisted >= 2 * n and s.replay_queue == 0)
        time.sleep(2)
    finally:
        query.stop()
    # Each id counted once in its group's state, those that failed once after replay.
    assert latest == {g: n // 5 for g in range(5)}


class RunningCount(StatefulProcessor):
    """transformWithStateInPandas' processor: the rows seen per group, in a value state;
    one output row per group and batch."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.seen = handle.getValueState("seen", "seen long")

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
        seen = (self.seen.get()[0] if self.seen.exists() else 0) + sum(len(f) for f in rows)
        self.seen.update((seen,))
        yield pd.DataFrame({"group": [key[0]], "seen": [seen]})

    def close(self) -> None:
        pass


def test_transform_with_state_in_pandas_counts_each_record_once_failed_ones_after_replay(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
) -> None:
    """transformWithStateInPandas (state API v2, its state in RocksDB) after a wrapped
    step, as applyInPandasWithState above: each record reaches the operator's state
    once, those that failed in the wrapped step after their replay, and every tree
    completes at its barrier (rows out of the operator carry no root: the sink is
    plain, section 4.9 of the user guide)."""
    n = 400
    server = start_server(None, "--tree-timeout-s", "120")
    settings = FTSettings(server.address)
    topic = make_topic(2)
    produce(kafka_bootstrap, topic, [(str(i).encode(), b"v") for i in range(n)])
    (tmp_path / "marks").mkdir()
    parsed = FTTasks(settings).map(
        barrier_source(spark, kafka_bootstrap, topic, server),
        make_parse(str(tmp_path / "marks")),
        SCHEMA,
    )
    counted = (
        parsed.withColumn("group", F.col("id") % 5)
        .groupBy("group")
        .transformWithStateInPandas(RunningCount(), "group long, seen long", "Update", "None")
    )
    latest: dict[int, int] = {}

    def sink(batch: DataFrame, epoch_id: int) -> None:
        for row in batch.collect():
            latest[row["group"]] = max(latest.get(row["group"], 0), row["seen"])

    # The operator needs the RocksDB state store; the query keeps the setting it
    # started with, and the other tests' queries get the default store back.
    spark.conf.set(STATE_STORE_PROVIDER, ROCKSDB_STATE_STORE)
    try:
        query = start(counted, sink, tmp_path / "cp", mode="update")
    finally:
        spark.conf.unset(STATE_STORE_PROVIDER)
    try:
        status = settle(query, server, lambda s: s.persisted >= n and s.replay_queue == 0)
        # The replays' rows reach the state in the batch after their persist.
        wait_until(lambda: sum(latest.values()) >= n, 60, "the replayed rows in the state")
    finally:
        query.stop()
    # Each id counted once in its group's state, those that failed once after replay.
    assert latest == {g: n // 5 for g in range(5)}
    failing = [i for i in range(n) if fails_once(i)]
    assert status.failed["explicit"] == len(failing) and status.failed["timeout"] == 0
    assert status.completed == n and status.xor_events == 0


def test_after_a_stateful_operator_a_failure_fails_the_task_and_spark_runs_it_again(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
) -> None:
    """Rows out of an aggregation carry no root: a wrapped step refuses them, and a
    failure in plain code there fails the Spark task, which Spark runs again (the
    chosen rule, user guide section 4.9): the counts are complete and every tree of
    the batch completed at its barrier."""
    n = 300
    server = start_server(None, "--tree-timeout-s", "120")
    settings = FTSettings(server.address)
    topic = make_topic(2)
    produce(kafka_bootstrap, topic, [(str(i).encode(), b"v") for i in range(n)])
    marks = tmp_path / "marks"
    marks.mkdir()
    source = barrier_source(spark, kafka_bootstrap, topic, server)
    counts = (
        source.withColumn("id", F.col("key").cast("string").cast("long"))
        .withColumn("at", F.timestamp_millis(F.lit(BASE_MS) + F.col("id") * 1000))
        .withWatermark("at", "1 hour")
        .groupBy(F.window("at", "60 seconds"))
        .agg(F.count("*").alias("n"))
    )
    with pytest.raises(ConfigError, match=r"section 4\.9"):
        FTTasks(settings).map(counts, lambda row: row, "n long")
    marker = str(marks / "first")

    @F.udf("long")
    def checked(count):  # type: ignore[no-untyped-def]  # (hints make Spark guess a pandas UDF)
        try:  # the first call anywhere fails its task
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return count
        raise RuntimeError("a bug that bites once")

    totals: dict[Any, int] = {}

    def sink(batch: DataFrame, epoch_id: int) -> None:
        for row in batch.collect():
            totals[row["window"]["start"]] = row["n"]

    query = start(counts.withColumn("n", checked("n")), sink, tmp_path / "cp", mode="update")
    try:
        status = settle(query, server, lambda s: s.persisted >= n)
    finally:
        query.stop()
    assert os.path.exists(marker)  # it did fail once
    assert sum(totals.values()) == n and status.failed["explicit"] == 0
    assert status.completed == n and status.failed["timeout"] == 0


def test_a_write_the_broker_refuses_fails_its_record_alone_until_it_is_a_dead_letter(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
) -> None:
    """Barrier mode with the Kafka sink: a row whose write the broker refuses (larger
    than the producer's request limit) fails its record's root with the sink's error;
    the rest of its batch completes at the barrier. It fails on every replay, so it is
    dead-lettered after ft.maxRetries + 1 attempts, each cause the sink's."""
    n = 500
    server = start_server(None, "--tree-timeout-s", "120")
    settings = FTSettings(server.address)
    topic, out = make_topic(2), make_topic(2)
    big = {i for i in range(n) if i % 100 == 42}
    produce(
        kafka_bootstrap,
        topic,
        [(str(i).encode(), b"x" * (20_000 if i in big else 10)) for i in range(n)],
    )
    source = (
        spark.readStream.format("ftkafka")
        .option("kafka.bootstrap.servers", kafka_bootstrap)
        .option("subscribe", topic)
        .option("ft.address", server.address)
        .option("ft.maxRetries", "1")
        .option("ft.retryBackoffMs", "100")
        .load()
        .select("key", "value", "ft_root")
    )
    sink = ft_kafka_sink(
        kafka_bootstrap,
        out,
        settings,
        on_error="fail-and-continue",
        producer_config={"max_request_size": 16_000},
    )
    query = start(source, sink, tmp_path / "cp")
    try:
        status = settle(query, server, lambda s: s.persisted >= n and s.dead_letters == len(big))
        with FTClient(server.address) as client:
            letters = client.dead_letters().letters
    finally:
        query.stop()
    written = {int(r.key) for r in read_all(kafka_bootstrap, out)}
    assert written == set(range(n)) - big
    assert status.dead_lettered == len(big) and status.xor_events == 0
    assert all(letter["attempts"] == 2 for letter in letters)
    assert all(
        c["kind"] == "sink" and "MessageSizeTooLarge" in c["error"]
        for letter in letters
        for c in letter["causes"]
    )


def test_a_foreach_batch_that_raises_has_its_uncached_batch_replayed(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
) -> None:
    """Barrier mode with ft_foreach_batch: the batch is not cached (there are no acks);
    when the user's function raises, a second computation fails every root of the
    batch, and the replays bring each record back: every record ends at the sink, and
    nothing stays pending."""
    n = 300
    server = start_server(None, "--tree-timeout-s", "120")
    settings = FTSettings(server.address)
    topic = make_topic(2)
    produce(kafka_bootstrap, topic, [(str(i).encode(), b"v") for i in range(n)])
    marks = tmp_path / "raised"
    written: list[int] = []

    def write(batch: DataFrame, _epoch: int) -> None:
        ids = [int(r.key) for r in batch.select("key").collect()]
        if ids and not marks.exists():  # the first batch with rows fails once
            marks.touch()
            raise RuntimeError("the database is down")
        written.extend(ids)

    sink = ft_foreach_batch(write, settings, on_error="fail-and-continue")
    query = start(barrier_source(spark, kafka_bootstrap, topic, server), sink, tmp_path / "cp")
    try:
        status = settle(query, server, lambda s: s.persisted >= n and len(set(written)) == n)
    finally:
        query.stop()
    assert sorted(set(written)) == list(range(n))
    assert status.failed["explicit"] > 0 and status.xor_events == 0
    assert not sink.last_result or sink.last_result.at_barrier
    assert spark.sparkContext._jsc.getPersistentRDDs().isEmpty()  # nothing left cached
