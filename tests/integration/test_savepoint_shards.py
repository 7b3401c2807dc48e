"""A savepoint of an FT layer of two shards, restored into three shards and into one,
on real parts: two `ftlayer serve --shard I --shards 2` processes, the `ftlayer
savepoint` command, the Tansu broker and local Spark.

The job (tree mode) reads a topic of 4 partitions through both shards; its sink leaves
every fifth record unacked, so those stay stored on the shard of their partition.
`ftlayer savepoint create --server A,B` has each running shard write its part; the
shards stop. `ftlayer savepoint restore --data-dir D0,D1,D2` (and, apart, `--data-dir
D0`) moves every stored record to the shard its partition maps to at the new count.
New records arrive meanwhile. A new query of the same source on the restored FT layer,
from the starting offsets the restore printed, must get every held record and every
new record: none lost, and nothing left stored once its sink acked everything.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fixture_types import MakeTopic
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from serverproc import Server, StartServer

from ftlayer.client import FTClient
from ftlayer.integration.ftcolumns import FTSettings
from ftlayer.integration.harness.kafka import produce, wait_until
from ftlayer.integration.sinks import settle
from ftlayer.integration.source import parse_options
from ftlayer.shards import partition_shard

PARTITIONS = 4
SOURCE_NAME = "sharded-savepoint-job"
OLD, NEW = 400, 120
QUERY_TIMEOUT_S = 120
LONG_TIMEOUT = ("--tree-timeout-s", "600")  # held records stay pending


def run_query(
    spark: SparkSession,
    bootstrap: str,
    topic: str,
    servers: list[Server],
    checkpoint: Path,
    held: set[bytes] | None = None,
    **extra: str,
) -> list[bytes]:
    """One availableNow run of the job over these shards; its sink acks every row but
    those in `held`. Returns the values it saw."""
    addresses = ",".join(s.address for s in servers)
    settings = FTSettings(addresses)
    seen: list[bytes] = []
    keep = sorted(v.decode() for v in held or ())

    def sink(batch: DataFrame, _batch_id: int) -> None:
        batch.persist()
        seen.extend(bytes(row.value) for row in batch.select("value").collect())
        settle(batch.filter(~F.col("value").cast("string").isin(keep)), settings, ack=True)
        batch.unpersist()

    query = (
        spark.readStream.format("ftkafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", topic)
        .option("ft.address", addresses)
        .option("ft.completion", "tree")  # rows are left pending by not acking them
        # Stored references: the held records are stored, and the restore moves them
        # (by range they stay in memory, and a restored query reads them again from
        # Kafka: tests/core/test_savepoint.py).
        .option("ft.treeRanges", "false")
        .option("ft.sourceName", SOURCE_NAME)
        .option("maxOffsetsPerTrigger", "100")
        .options(**extra)
        .load()
        .writeStream.foreachBatch(sink)
        .trigger(availableNow=True)
        .option("checkpointLocation", str(checkpoint))
        .start()
    )
    try:
        assert query.awaitTermination(QUERY_TIMEOUT_S), "the availableNow query did not finish"
    finally:
        query.stop()
    return seen


def status(server: Server) -> Any:
    with FTClient(server.address) as client:
        return client.status()


def settled(servers: list[Server], stored: list[int]) -> bool:
    now = [status(s) for s in servers]
    return [(s.stored_records, s.pending, s.deletes_pending) for s in now] == [
        (n, n, 0) for n in stored
    ]


def savepoint(*args: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "ftlayer.cli", "savepoint", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    reply: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return reply


@pytest.mark.parametrize("count", [3, 1])
def test_a_savepoint_of_two_shards_restores_into_another_number_and_loses_nothing(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
    count: int,
) -> None:
    topic = make_topic(PARTITIONS)
    placed = produce(kafka_bootstrap, topic, [(None, f"old-{i}".encode()) for i in range(OLD)])
    old = [
        start_server(tmp_path / f"old{i}", "--shard", str(i), "--shards", "2", *LONG_TIMEOUT)
        for i in (0, 1)
    ]
    held = {f"old-{i}".encode() for i in range(0, OLD, 5)}
    first = run_query(spark, kafka_bootstrap, topic, old, tmp_path / "cp-old", held)
    assert set(first) == {f"old-{i}".encode() for i in range(OLD)}
    options = {"subscribe": topic, "kafka.bootstrap.servers": "x", "ft.sourceName": SOURCE_NAME}
    source_id = parse_options(options).source_ids()[topic]
    shard_of_value = {
        f"old-{i}".encode(): int(partition_shard(source_id, at.partition, 2))
        for i, at in enumerate(placed)
    }
    held_on = [sum(1 for v in held if shard_of_value[v] == i) for i in (0, 1)]
    wait_until(lambda: settled(old, held_on), timeout=30, what="acked records deleted")

    # Each running shard writes its part; then the shards stop.
    saved = tmp_path / "savepoints"
    parts = savepoint(
        "create", "--server", ",".join(s.address for s in old), "--dir", str(saved), "--name", "sp"
    )["parts"]
    assert [(p["name"], p["shard"], p["shards"]) for p in parts] == [
        ("sp.shard-0-of-2", 0, 2),
        ("sp.shard-1-of-2", 1, 2),
    ]
    assert [p["stored_records"] for p in parts] == held_on
    for server in old:
        server.proc.terminate()
        assert server.proc.wait(15) == 0

    # Restored into `count` shards: every held record on the shard of its partition.
    targets = [tmp_path / f"new{j}" for j in range(count)]
    result = savepoint(
        "restore", "sp", "--dir", str(saved), "--data-dir", ",".join(map(str, targets))
    )
    assert result["from_shards"] == 2 and len(result["shards"]) == count
    assert result["stored_records"] == len(held)
    starting = result["starting_offsets"][SOURCE_NAME]
    assert sorted(starting[topic]) == [str(p) for p in range(PARTITIONS)]
    produce(kafka_bootstrap, topic, [(None, f"new-{i}".encode()) for i in range(NEW)])
    flags = ["--shards", str(count), *LONG_TIMEOUT]
    new = [start_server(target, "--shard", str(j), *flags) for j, target in enumerate(targets)]
    for j, server in enumerate(new):
        now = status(server)
        assert now.failed["recovery"] == result["shards"][j]["stored_records"]
    second = run_query(
        spark,
        kafka_bootstrap,
        topic,
        new,
        tmp_path / "cp-new",
        startingOffsets=json.dumps({topic: starting[topic]}),
    )
    wait_until(lambda: settled(new, [0] * count), timeout=30, what="every record acked")
    # Nothing lost: every held record came back, and every new record arrived; what the
    # old query acked is either below the saved position or read again.
    assert held <= set(second), sorted(held - set(second))[:5]
    assert {f"new-{i}".encode() for i in range(NEW)} <= set(second)
    below = {
        f"old-{i}".encode()
        for i, at in enumerate(placed)
        if at.offset < int(starting[topic][str(at.partition)])
    }
    assert (set(first) - held) | set(second) >= {f"old-{i}".encode() for i in range(OLD)}
    assert not (set(second) & (below - held)), "a record below the saved position read again"
    print(
        f"2 shards -> {count}: {len(held)} held records restored "
        f"{[s['stored_records'] for s in result['shards']]}, {len(second)} rows read after"
    )
