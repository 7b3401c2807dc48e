"""The `ftingest` source (integration.source.ingest) on real parts: a real `ftlayer
serve`, receivers storing into it (integration.receivers), local Spark.

- Every record a receiver stored reaches the sink through FTTasks, in both completion
  modes: explicit failures are retried, poison records end as dead letters in the FT
  layer's store, records stored while the query runs are read in the next batches,
  each row in the partition its key routes it to, and every record leaves the store
  once its tree completed.
- A batch read twice (Spark runs a batch again) gives the same records.
- Bad input: a source no receiver registered, another partitioner than the receivers',
  options that mean nothing to ftingest.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pyspark import cloudpickle
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming.datasource import ReadAllAvailable
from querywait import wait_for
from serverproc import StartServer

from ftlayer.client import FTClient
from ftlayer.errors import ConfigError, FailException
from ftlayer.integration.ftcolumns import FTSettings
from ftlayer.integration.receivers import Message, Receiver
from ftlayer.integration.sinks import ft_foreach_batch
from ftlayer.integration.source import FTKafkaStreamReader, parse_options, source_schema
from ftlayer.integration.source.ingest import IngestDriver
from ftlayer.integration.tasks import FTTasks
from ftlayer.partitioners.key_hashes import kafka_key_hash
from ftlayer.registration import ingest_source_id

pytestmark = pytest.mark.integration
cloudpickle.register_pickle_by_value(sys.modules[__name__])

PARTITIONS = 3
SCHEMA = "id long, partition int, topic string, offset long"


def is_poison(i: int) -> bool:
    return i % 500 == 7


def fails_once(i: int) -> bool:
    return zlib.crc32(i.to_bytes(8, "little")) % 50 == 0 and not is_poison(i)


def make_step(marks: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """Poison records always fail; the fails-once records fail on first sight (an
    O_EXCL marker, across Python workers)."""

    def step(row: dict[str, Any]) -> dict[str, Any]:
        i = int(row["value"])
        if is_poison(i):
            raise FailException(f"record {i} is poison")
        if fails_once(i):
            try:
                os.close(os.open(os.path.join(marks, str(i)), os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                raise FailException(f"record {i}: upstream timed out")
        return {
            "id": i,
            "partition": row["partition"],
            "topic": row["topic"],
            "offset": row["offset"],
        }

    return step


class Collected:
    """The rows a foreachBatch sink wrote, on the driver."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, str, int]] = []

    def __call__(self, batch: DataFrame, epoch_id: int) -> None:
        self.rows.extend(tuple(r) for r in batch.collect())


def messages(first: int, n: int) -> list[Message]:
    """Records first..first+n-1: key k<i mod 97>, value the decimal i, identity i."""
    return [Message(b"k%d" % (i % 97), b"%d" % i, identity=i) for i in range(first, first + n)]


def start_query(
    spark: SparkSession, address: str, name: str, tmp_path: Path, **options: str
) -> tuple[Any, Collected]:
    """An ftingest query of source `name`: make_step through FTTasks into a collecting
    foreachBatch sink, poison records dead-lettered after 2 retries; with `options` on
    the source. Returns the query and what its sink collects."""
    settings = FTSettings(address)
    marks = tmp_path / "marks"
    marks.mkdir(exist_ok=True)
    source = (
        spark.readStream.format("ftingest")
        .option("subscribe", name)
        .option("ft.address", address)
        .option("ft.maxRetries", "2")
        .option("ft.retryBackoffMs", "100")
        .options(**options)
        .load()
    )
    collected = Collected()
    query = (
        FTTasks(settings)
        .map(source, make_step(str(marks)), SCHEMA)
        .writeStream.foreachBatch(ft_foreach_batch(collected, settings))
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(processingTime="250 milliseconds")
        .start()
    )
    return query, collected


@pytest.mark.parametrize("completion", ["barrier", "tree"])
def test_what_receivers_stored_reaches_the_sink_once_and_leaves_the_store(
    spark: SparkSession, start_server: StartServer, tmp_path: Path, completion: str
) -> None:
    n = 6000
    server = start_server(None, "--tree-timeout-s", "30")
    name = f"orders-{uuid.uuid4().hex[:6]}"
    receiver = Receiver(server.address, name, partitions=PARTITIONS)
    receiver.store(messages(0, n // 2), "stream-a")  # before the query starts
    query, collected = start_query(
        spark, server.address, name, tmp_path, **{"ft.completion": completion},
        maxOffsetsPerTrigger="2000",
    )  # fmt: skip
    poison = {i for i in range(n) if is_poison(i)}
    source_id = ingest_source_id(name)
    try:
        with FTClient(server.address) as client:
            wait_for("the first records at the sink", lambda: len(collected.rows) > 0, 120, query)
            receiver.store(messages(n // 2, n - n // 2), "stream-a")  # while it runs

            def settled() -> bool:
                status = client.status()
                return (
                    status.ingested == n
                    and status.pending_of(source_id) == 0
                    and status.dead_lettered == len(poison)
                )

            wait_for("every tree to complete or be dead-lettered", settled, 180, query)
            status = client.status()
    finally:
        query.stop()
        receiver.close()
    ids = [row[0] for row in collected.rows]
    assert sorted(ids) == sorted(set(range(n)) - poison)  # each once, none lost
    for i, partition, topic, offset in collected.rows:
        assert (topic, offset) == ("stream-a", i)
        assert partition == (kafka_key_hash(b"k%d" % (i % 97)) & 0x7FFFFFFF) % PARTITIONS
    assert status.dead_letters == len(poison) == 12  # kept in the store, listable
    assert status.failed.get("explicit", 0) == sum(map(fails_once, range(n))) + 3 * len(poison)
    assert status.stored_records == len(poison)  # the rest left the store


def test_a_batch_read_again_gives_the_same_records(start_server: StartServer) -> None:
    server = start_server()
    name = f"clicks-{uuid.uuid4().hex[:6]}"
    with Receiver(server.address, name, partitions=PARTITIONS) as receiver:
        receiver.store(messages(0, 500), "http:clicks")
    options = parse_options(
        {"subscribe": name, "ft.address": server.address, "ft.completion": "tree"}, ingest=True
    )
    reader = FTKafkaStreamReader(options, source_schema(True, completion="tree"))
    try:
        start = reader.initialOffset()
        end = reader.latestOffset(start, ReadAllAvailable())
        parts = reader.partitions(start, end)
        assert [p.partition for p in parts] == list(range(PARTITIONS))

        def read() -> list[tuple[bytes, int]]:
            rows = []
            for part in parts:
                for batch in reader.read(part):
                    values = batch.column("value").to_pylist()
                    rows += [(v, part.partition) for v in values]
            return sorted(rows)

        first, again = read(), read()
    finally:
        reader.stop()
    assert len(first) == 500 and first == again


def test_bad_input_is_a_clear_error(start_server: StartServer) -> None:
    server = start_server()
    ids = {"nobody": ingest_source_id("nobody")}
    options = parse_options({"subscribe": "nobody", "ft.address": server.address}, ingest=True)
    driver = IngestDriver(options, ids)
    with pytest.raises(ConfigError, match="no receiver registered source 'nobody'"):
        driver.start()
    driver.close()
    Receiver(server.address, "byhash", partitions=2, partitioner="spark-hash").close()
    given = {"subscribe": "byhash", "ft.address": server.address}
    driver = IngestDriver(
        parse_options({**given, "ft.partitioner": "kafka-hash"}, ingest=True),
        {"byhash": ingest_source_id("byhash")},
    )
    with pytest.raises(ConfigError, match="registered by its receivers with 'spark-hash'"):
        driver.start()
    driver.close()
    driver = IngestDriver(parse_options(given, ingest=True), {"byhash": ingest_source_id("byhash")})
    driver.start()  # without the option, the query takes the receivers' partitioner
    assert driver.options.partitioner == "spark-hash"
    driver.close()
    for options_given, message in [
        ({"subscribe": "a"}, "ft.address is required by ftingest"),
        ({"subscribe": "a", "ft.address": "h:1", "startingOffsets": "latest"}, "earliest only"),
        ({"subscribe": "a", "ft.address": "h:1", "kafka.group.id": "g"}, "no consumer group"),
        ({"subscribe": "a", "ft.address": "h:1", "kafka.fetch.max.bytes": "9"}, "reads no Kafka"),
        ({"subscribe": "a", "ft.address": "h:1", "ft.deadLetterTopic": "d"}, "needs kafka.boot"),
        ({"subscribe": "", "ft.address": "h:1"}, "at least one source name"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_options(options_given, ingest=True)


def test_the_querys_max_pending_records_holds_its_receivers(start_server: StartServer) -> None:
    """The query registers its ft.maxPendingRecords with the source: a receiver whose
    own limit is higher stops taking there (and at its own where that is lower)."""
    server = start_server()
    name = f"held-{uuid.uuid4().hex[:6]}"
    with Receiver(server.address, name, partitions=PARTITIONS, max_pending=100_000) as receiver:
        receiver.store(messages(0, 60), "http:held")
        assert receiver.has_room()  # 60 pending, below its own 100,000
        options = parse_options(
            {"subscribe": name, "ft.address": server.address, "ft.maxPendingRecords": "50"},
            ingest=True,
        )
        driver = IngestDriver(options, {name: ingest_source_id(name)})
        driver.start()  # registers the source with the query's limit
        driver.close()
        time.sleep(0.25)  # has_room asks the FT layer at most every 0.2 s
        assert not receiver.has_room()  # 60 pending, at the query's 50
        assert not receiver.has_room(0) and receiver.pending() == 60
    with Receiver(server.address, name, partitions=PARTITIONS, max_pending=10) as low:
        assert not low.has_room()  # its own limit, lower than the query's


def test_on_two_shards_every_record_is_read_once_and_a_redelivery_meets_its_first_copy(
    spark: SparkSession, start_server: StartServer, tmp_path: Path
) -> None:
    """A receiver given both shards stores each record on one (by its identity); the
    query, given both, reads every record once; a record sent again (a redelivery)
    goes to the shard that has it and is dropped there."""
    servers = [
        start_server(tmp_path / f"shard{i}", "--shard", str(i), "--shards", "2") for i in range(2)
    ]
    address = ",".join(s.address for s in servers)
    name = f"sharded-{uuid.uuid4().hex[:6]}"
    n = 3000
    with Receiver(address, name, partitions=PARTITIONS) as receiver:
        assert receiver.store(messages(0, n), "stream-s") == n
        assert receiver.store(messages(0, 500), "stream-s") == 0  # every copy dropped
        per_shard = []
        for server in servers:
            with FTClient(server.address) as client:
                per_shard.append(client.status())
        assert sum(st.ingested for st in per_shard) == n
        assert all(st.ingested > n // 4 for st in per_shard)  # both hold a share
        assert sum(st.ingest_duplicates for st in per_shard) == 500
        query, collected = start_query(spark, address, name, tmp_path)
        poison = {i for i in range(n) if is_poison(i)}
        try:
            wait_for(
                "every record of both shards to complete",
                lambda: receiver.pending() == 0 and len(collected.rows) >= n - len(poison),
                180,
                query,
            )
        finally:
            query.stop()
    ids = sorted(row[0] for row in collected.rows)
    assert ids == sorted(set(range(n)) - poison)
