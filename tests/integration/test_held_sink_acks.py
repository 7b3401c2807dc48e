"""`ft_foreach_batch` in tree mode without caching the batch (integration.sinkhold): the
steps that produce the sink's rows hold their acks under the sink's key, and the sink
settles them after its function. Real Tansu, a real `ftlayer serve`, local Spark: every
record is written once and completes, a function that computes its batch twice still
completes every tree, a function that raises has its rows replayed, and a pipeline
the sink cannot see through (an observed step on top) is cached as before."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pytest
from fixture_types import MakeTopic
from pyspark import cloudpickle
from pyspark.sql import DataFrame, SparkSession
from serverproc import Server, StartServer
from test_barrier_pipelines import settle, start

from ftlayer.integration.ftcolumns import FTSettings
from ftlayer.integration.harness.kafka import produce
from ftlayer.integration.sinks import ft_foreach_batch
from ftlayer.integration.tasks import FTTasks

cloudpickle.register_pickle_by_value(sys.modules[__name__])

N = 400
SCHEMA = "id long, value string"


def parse(row: dict[str, Any]) -> dict[str, Any]:
    return {"id": int(row["key"]), "value": (row["value"] or b"").decode()}


def even(batch: Any) -> Any:
    return pc.equal(pc.bit_wise_and(batch["id"], 1), 0)


class Written:
    """The sink's function: counts its batch, then collects it (two Spark actions, as
    real writers often do), and keeps the rows of the calls that returned; the calls
    listed in `raise_on` raise after collecting, as a write that failed."""

    def __init__(self, raise_on: tuple[int, ...] = ()) -> None:
        self.raise_on = raise_on
        self.ids: list[int] = []
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, batch: DataFrame, epoch_id: int) -> None:
        n = batch.count()
        rows = batch.collect()
        assert len(rows) == n
        with self.lock:
            self.calls += 1
            if self.calls in self.raise_on and rows:
                raise OSError(f"the warehouse refused batch {epoch_id}")
            self.ids.extend(r["id"] for r in rows)


def source(
    spark: SparkSession, bootstrap: str, topic: str, server: Server, tree_ranges: bool = False
) -> DataFrame:
    return (
        spark.readStream.format("ftkafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", topic)
        .option("ft.address", server.address)
        .option("ft.completion", "tree")
        .option("ft.treeRanges", str(tree_ranges).lower())
        .option("ft.retryBackoffMs", "100")
        .option("maxOffsetsPerTrigger", str(N // 4))
        .load()
    )


def _run(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
    written: Written,
    observe: bool = False,
    tree_ranges: bool = False,
) -> tuple[Any, Any]:
    server = start_server(None, "--tree-timeout-s", "120")
    settings = FTSettings(server.address)
    topic = make_topic(2)
    produce(kafka_bootstrap, topic, [(str(i).encode(), b"v%d" % i) for i in range(N)])
    tasks = FTTasks(settings, on_error="fail-record")
    parsed = tasks.map(source(spark, kafka_bootstrap, topic, server, tree_ranges), parse, SCHEMA)
    kept = tasks.filter_batches(parsed, even, observe="kept" if observe else False)
    sink = ft_foreach_batch(written, settings, on_error="fail-and-continue")
    query = start(kept, sink, tmp_path / "cp")
    try:
        # Every kept record written (the last ones may not even be read while the
        # trees read so far are all complete), then nothing pending, twice in a row.
        status = settle(query, server, lambda s: len(written.ids) >= N // 2)
    finally:
        query.stop()
    return sink, status


def test_the_steps_hold_the_sinks_acks_and_every_record_completes_once_written(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
) -> None:
    written = Written()
    sink, status = _run(spark, kafka_bootstrap, make_topic, start_server, tmp_path, written)
    # Every even record written once; every record complete, none failed or timed out,
    # although the function computed each batch twice (the re-read took the first
    # computation's roots over).
    assert sorted(written.ids) == list(range(0, N, 2))
    assert sink.last_result is not None and sink.last_result.held
    assert status.failed["timeout"] == status.failed["explicit"] == 0
    assert status.pending == 0 and status.replay_queue == 0
    assert status.taken_over > 0  # the second action's re-read


@pytest.mark.parametrize("raise_on", [(), (1,)], ids=["written", "a-write-fails"])
def test_by_range_every_record_completes_once_written_and_a_failed_write_is_replayed(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
    raise_on: tuple[int, ...],
) -> None:
    """ft.treeRanges: the batches are ranges in the FT layer (nothing stored per
    record); the sink's function computes each batch twice, and the second read
    starts the records' trees over (ftlayer.core.rangeacks), so every record
    completes once written; a write that fails has its rows replayed (their bytes
    copied in from Kafka first)."""
    written = Written(raise_on=raise_on)
    sink, status = _run(
        spark, kafka_bootstrap, make_topic, start_server, tmp_path, written, tree_ranges=True
    )
    assert sorted(written.ids) == list(range(0, N, 2))
    assert sink.last_result is not None and sink.last_result.held
    assert status.failed["timeout"] == 0 and status.pending == 0
    assert status.failed["explicit"] > 0 if raise_on else status.failed["explicit"] == 0
    # Nothing persisted per record of a range, nothing to take over; a replay is a
    # stored record, which the second computation takes over as before.
    assert status.taken_over <= status.failed["explicit"]
    # Stored: at most the failed records (a replay's record goes with the deleter).
    assert status.stored_records <= status.failed["explicit"] and status.open_ranges == 0


def test_a_write_that_fails_has_its_held_rows_failed_and_replayed(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
) -> None:
    written = Written(raise_on=(1,))
    sink, status = _run(spark, kafka_bootstrap, make_topic, start_server, tmp_path, written)
    assert sorted(written.ids) == list(range(0, N, 2))  # the failed batch's, replayed
    assert status.failed["explicit"] > 0 and status.failed["timeout"] == 0
    assert status.pending == 0
    assert sink.last_result is not None and sink.last_result.held


def test_an_ft_task_on_top_that_is_no_map_or_filter_step_keeps_the_cache(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
) -> None:
    written = Written()
    sink, status = _run(
        spark, kafka_bootstrap, make_topic, start_server, tmp_path, written, observe=True
    )
    assert sorted(written.ids) == list(range(0, N, 2))
    assert sink.last_result is not None and not sink.last_result.held
    assert sink.last_result.acked > 0
    assert status.failed["timeout"] == 0 and status.pending == 0
