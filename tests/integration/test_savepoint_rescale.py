"""A savepoint restored into a job with twice the partitions, on real parts: the Tansu
broker, real `ftlayer serve` processes, the `ftlayer savepoint` command and local Spark.

The job reads a topic of P Kafka partitions with `ftkafka` under the key-group replay
partitioner; its input partition i is Kafka partition i. Its producer places each key
where key groups do, so the records of one key meet in one input partition. A sink
leaves some records unacked: they stay stored in the FT layer. The query ends, the
server stops, and the user takes a savepoint of the data dir (refused while the server
runs) and restores it with `--partitions 2P` into a new data dir. The savepoint holds
the position of the query's newest complete barrier checkpoint, below which the old
job read every record; restore turns it into the new query's startingOffsets, with
the partitions new at 2P at earliest.

The new deployment is a new Kafka cluster (Tansu cannot add partitions to a topic)
holding the same topic with 2P partitions, where new records of the same keys go to
their key groups' partitions at 2P, and a new FT-layer server on the restored data
dir. A new query of the same source (same `ft.sourceName` and topic, a new Spark
checkpoint) must get every restored record once, with its original coordinates, in
the input partition that owns its key group at 2P: the partition where the new
records of its key arrive. None may be lost: once the new sink acked everything,
nothing is stored or pending in the new FT layer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fixture_types import MakeTopic
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from serverproc import Server, StartServer

from ftlayer.integration.ftcolumns import FTSettings
from ftlayer.integration.harness.broker import TansuBroker
from ftlayer.integration.harness.kafka import create_topic, produce, wait_until
from ftlayer.integration.sinks import settle
from ftlayer.partitioners import (
    DEFAULT_MAX_PARALLELISM,
    assign_key_groups,
    kafka_key_hashes,
    key_group_partitions,
)

P = 2
SOURCE_NAME = "savepoint-job"
KEYS = [f"user-{i}".encode() for i in range(160)]
QUERY_TIMEOUT_S = 90


def key_group_partition(key: bytes, partitions: int) -> int:
    hashes, _ = kafka_key_hashes([key])
    groups = assign_key_groups(hashes, DEFAULT_MAX_PARALLELISM)
    return int(key_group_partitions(groups, DEFAULT_MAX_PARALLELISM, partitions)[0])


def produce_by_key_group(bootstrap: str, topic: str, prefix: bytes, partitions: int) -> None:
    """One record per key, value prefix + key, in the partition its key group owns."""
    by_partition: dict[int, list[tuple[bytes | None, bytes]]] = defaultdict(list)
    for key in KEYS:
        by_partition[key_group_partition(key, partitions)].append((key, prefix + key))
    for partition, records in by_partition.items():
        produce(bootstrap, topic, records, partition=partition)


def run_query(
    spark: SparkSession,
    bootstrap: str,
    topic: str,
    server: Server,
    checkpoint: Path,
    unacked: Callable[[bytes], bool] = lambda _value: False,
    **extra: str,
) -> list[dict[str, Any]]:
    """One availableNow run of the job; its sink acks every row except those whose
    value is `unacked`, which it leaves pending. Returns every row it saw, with its
    input partition."""
    options = {
        **extra,
        "kafka.bootstrap.servers": bootstrap,
        "subscribe": topic,
        "ft.address": server.address,
        "ft.completion": "tree",  # rows are left pending by not acking them
        "ft.partitioner": "key-group",
        "ft.sourceName": SOURCE_NAME,
    }
    settings = FTSettings(server.address)
    seen: list[dict[str, Any]] = []

    def sink(batch: DataFrame, _batch_id: int) -> None:
        batch.persist()  # two actions on one micro-batch: read (and persist) it once
        rows = [row.asDict() for row in batch.collect()]
        seen.extend(rows)
        keep = [bytes(r["value"]).decode() for r in rows if unacked(bytes(r["value"]))]
        settle(batch.filter(~F.col("value").cast("string").isin(keep)), settings, ack=True)
        batch.unpersist()

    query = (
        spark.readStream.format("ftkafka")
        .options(**options)
        .load()
        .withColumn("input_partition", F.spark_partition_id())
        .writeStream.foreachBatch(sink)
        .trigger(availableNow=True)
        .option("checkpointLocation", str(checkpoint))
        .start()
    )
    try:
        assert query.awaitTermination(QUERY_TIMEOUT_S), "the availableNow query did not finish"
    finally:
        query.stop()
    for row in seen:
        row["key"], row["value"] = bytes(row["key"]), bytes(row["value"])
    return seen


def status(server: Server) -> dict[str, Any]:
    with server.client() as client:
        return client.status()


def settled(server: Server, stored: int) -> bool:
    """True once `stored` records are stored and pending, and no delete is due."""
    now = status(server)
    return (now["stored_records"], now["pending"], now["deletes_pending"]) == (stored,) * 2 + (0,)


def ftlayer(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ftlayer.cli", "savepoint", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_savepoint_restores_into_a_job_with_twice_the_partitions(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
) -> None:
    # The job at P partitions; its sink leaves every fifth key's record unacked.
    topic = make_topic(P)
    produce_by_key_group(kafka_bootstrap, topic, b"old-", P)
    old_data = tmp_path / "old-data"
    savepoints = tmp_path / "savepoints"
    new_data = tmp_path / "new-data"
    old_server = start_server(old_data, "--tree-timeout-s", "600")
    held = {b"old-" + k for k in KEYS[::5]}
    first = run_query(
        spark,
        kafka_bootstrap,
        topic,
        old_server,
        tmp_path / "cp-old",
        held.__contains__,
        maxOffsetsPerTrigger="40",  # several batches: Spark reports all but the last done
        # The savepoint moves to a new Kafka cluster, so it must hold the incomplete
        # records' bytes: by reference it would hold where they were in the old one.
        **{"ft.persist": "payload"},
    )
    assert sorted(r["value"] for r in first) == sorted(b"old-" + k for k in KEYS)
    assert all(r["input_partition"] == r["partition"] for r in first)
    original = {r["value"]: (r["topic"], r["partition"], r["offset"]) for r in first}
    wait_until(
        lambda: settled(old_server, len(held)),
        timeout=20,
        what="acked records deleted",
        interval=0.1,
    )

    # A running server's data dir is refused; once it stopped, the savepoint is taken.
    busy = ftlayer("create", "--data-dir", str(old_data), "--dir", str(savepoints))
    assert busy.returncode == 2 and "open in another process" in busy.stderr, busy.stderr
    old_server.proc.terminate()
    assert old_server.proc.wait(15) == 0
    created = ftlayer(
        "create",
        "--data-dir",
        str(old_data),
        "--dir",
        str(savepoints),
        "--name",
        "rescale",
        "--json",
    )
    assert created.returncode == 0, created.stderr
    manifest = json.loads(created.stdout.splitlines()[-1])
    assert manifest["stored_records"] == len(held)
    [(source, spec)] = manifest["sources"].items()
    assert (spec["partitioner"], spec["num_partitions"]) == ("key-group", P)
    # The position of the newest complete checkpoint: a batch that ran, so the old job
    # read every record below it.
    assert list(manifest["positions"]) == [SOURCE_NAME]
    saved_at = manifest["positions"][SOURCE_NAME]["kafka"][topic]
    read = {(r["partition"], r["offset"]) for r in first}
    assert all((int(p), o) in read for p, end in saved_at.items() for o in range(end))
    assert 0 < sum(saved_at.values()) <= len(KEYS)
    listed = ftlayer("list", "--dir", str(savepoints), "--json")
    assert [s["name"] for s in json.loads(listed.stdout)["savepoints"]] == ["rescale"]

    restored = ftlayer(
        "restore",
        "rescale",
        "--dir",
        str(savepoints),
        "--data-dir",
        str(new_data),
        "--partitions",
        str(2 * P),
        "--json",
    )
    assert restored.returncode == 0, restored.stderr
    result = json.loads(restored.stdout.splitlines()[-1])
    assert result["sources"][source]["num_partitions"] == 2 * P
    expected = {v: key_group_partition(v[len(b"old-") :], 2 * P) for v in held}
    per_partition: dict[str, int] = defaultdict(int)
    for partition in expected.values():
        per_partition[str(partition)] += 1
    assert result["replays"] == {source: dict(sorted(per_partition.items()))}
    # Where the new query should start reading: the saved position, and the earliest
    # offset of the partitions that are new at 2P.
    new_partitions = {str(p): -2 for p in range(P, 2 * P)}
    assert result["starting_offsets"] == {SOURCE_NAME: {topic: {**saved_at, **new_partitions}}}

    # The new deployment: a new cluster with the topic at 2P partitions, a new server
    # on the restored data dir, and a new query (new checkpoint) of the same source.
    with TansuBroker(log_path=tmp_path / "new-broker.log") as broker:
        create_topic(broker.bootstrap, topic, 2 * P)
        produce_by_key_group(broker.bootstrap, topic, b"new-", 2 * P)
        new_server = start_server(new_data, "--tree-timeout-s", "600")
        assert status(new_server)["failed"]["recovery"] == len(held)
        second = run_query(spark, broker.bootstrap, topic, new_server, tmp_path / "cp-new")
        wait_until(
            lambda: settled(new_server, 0), timeout=20, what="every record acked", interval=0.1
        )

    replays = [r for r in second if r["value"].startswith(b"old-")]
    assert sorted(r["value"] for r in replays) == sorted(held), "restored records lost or doubled"
    misplaced = [
        (r["value"], r["input_partition"])
        for r in replays
        if r["input_partition"] != expected[r["value"]]
    ]
    assert misplaced == []
    assert {r["value"]: (r["topic"], r["partition"], r["offset"]) for r in replays} == {
        v: original[v] for v in held
    }
    # Each restored record met the new records of its key, in one input partition.
    new_rows = {r["key"]: r["input_partition"] for r in second if r["value"].startswith(b"new-")}
    assert sorted(new_rows) == sorted(KEYS)
    assert all(r["input_partition"] == new_rows[r["key"]] for r in replays)
    assert {r["input_partition"] for r in replays} == set(range(2 * P))
