"""A replayed record re-enters the partition its original went to, on real parts.

Each test runs end to end through the FT layer: records are placed by a real
partitioner (kafka-python's default murmur2 partitioner on the embedded Tansu broker,
or PySpark's `partitionBy` in real Python workers), persisted through a `Persister`
into an `FTLayer` on LMDB on disk, failed by a sink task that raises FailException for
some of its inputs (`TaskHandler.process(..., failed=...)`) or by a restart, and
fetched back from the replay queue. The partition each replayed record is routed to
is then compared with the partition the real partitioner chose for its original:
a mismatch is a record replayed beside the wrong keyed state, which a user notices.

Records are matched by payload (every payload is unique), never by the stored
coordinates alone, so a key hash, a partition or a payload mangled on its way through
LMDB shows up as a mismatch too.
"""

from __future__ import annotations

import random
import re
from collections.abc import Hashable, Iterable, Sequence
from pathlib import Path

import numpy as np
import pytest
from fixture_types import MakeTopic
from numpy.typing import NDArray
from pyspark.sql import SparkSession

from ftlayer.acking.handlers import Anchors, Persister, TaskHandler
from ftlayer.core import FailCause, FTLayer, SourceConfig
from ftlayer.errors import PartitioningError
from ftlayer.integration.harness.kafka import KafkaRecord, produce, read_all
from ftlayer.partitioners import (
    DEFAULT_MAX_PARALLELISM,
    assign_key_groups,
    kafka_key_hashes,
    key_group_partitions,
    key_group_range,
    spark_key_hash,
)
from ftlayer.persistence import LmdbStorage
from ftlayer.records import ReplayRecords

PARTITIONS = 4
SEED = 1234
# Records reach the FT layer in micro-batches, as the Kafka source persists them.
MICRO_BATCH = 128
NO_OUTPUTS = np.zeros(0, dtype=np.intp)


def kafka_test_keys(rng: random.Random) -> list[bytes]:
    """Readable keys, random bytes of 0 to 40 bytes (every murmur2 tail length) and
    empty keys: b"" is a key, hashed like any other, unlike None."""
    keys = [f"user-{i}".encode() for i in range(300)]
    keys += [rng.randbytes(rng.randint(0, 40)) for _ in range(200)]
    keys += [b""] * 4
    rng.shuffle(keys)
    return keys


def persist_and_sink(
    ft: FTLayer,
    records: Sequence[KafkaRecord],
    failed: NDArray[np.bool_],
    *,
    source_id: int = 0,
) -> Anchors:
    """Persist consumed Kafka records in micro-batches, then run them through a sink
    task that acks every record and raises FailException for those marked `failed`.
    Returns the records' anchors (their original roots)."""
    persister = Persister(ft, source_id=source_id)
    sink = TaskHandler(ft)
    roots: list[NDArray[np.uint64]] = []
    ids: list[NDArray[np.uint64]] = []
    for start in range(0, len(records), MICRO_BATCH):
        chunk = records[start : start + MICRO_BATCH]
        hashes, has_key = kafka_key_hashes([r.key for r in chunk])
        anchors = persister.persist(
            [r.value or b"" for r in chunk],
            topics=[r.topic for r in chunk],
            partitions=[r.partition for r in chunk],
            offsets=[r.offset for r in chunk],
            key_hashes=hashes,
            has_key=has_key,
        )
        sink.process(anchors, NO_OUTPUTS, failed=failed[start : start + MICRO_BATCH])
        roots.append(anchors.roots)
        ids.append(anchors.ids)
    sink.flush()
    return Anchors.single(np.concatenate(roots), np.concatenate(ids))


def targets_by_payload(replay: ReplayRecords) -> dict[bytes, int]:
    """Replay target partition per payload; a record replayed twice fails the test."""
    payloads = list(replay.records.payloads)
    targets = dict(zip(payloads, replay.partitions.tolist(), strict=True))
    assert len(targets) == len(payloads), "a record was queued for replay twice"
    return targets


def misplaced_kafka_replays(
    replay: ReplayRecords, originals: dict[bytes, KafkaRecord]
) -> list[tuple[bytes | None, int, int, int]]:
    """(key, Kafka partition, offset, replay target) of every record replayed into a
    partition other than the one Kafka put its original in, or stored with other
    coordinates than Kafka's."""
    wrong = []
    stored = zip(
        replay.records.payloads,
        replay.partitions.tolist(),
        replay.records.partitions.tolist(),
        replay.records.offsets.tolist(),
        strict=True,
    )
    for payload, target, partition, offset in stored:
        original = originals[payload]
        if not target == partition == original.partition or offset != original.offset:
            wrong.append((original.key, original.partition, original.offset, target))
    return wrong


def test_kafka_hash_replays_into_the_partition_kafka_chose(
    kafka_bootstrap: str, make_topic: MakeTopic, tmp_path: Path
) -> None:
    rng = random.Random(SEED)
    topic = make_topic(PARTITIONS)
    keys = kafka_test_keys(rng)
    values = [f"value-{i}".encode() for i in range(len(keys))]
    positions = produce(kafka_bootstrap, topic, zip(keys, values, strict=True))
    consumed = read_all(kafka_bootstrap, topic, timeout=20.0)
    originals = {r.value: r for r in consumed if r.value is not None}
    # Paranoid check: the premise is that the records read back are the ones produced,
    # keys unchanged (b"" stays b"", not None), where the broker acknowledged them.
    assert [(originals[v].key, originals[v].partition, originals[v].offset) for v in values] == [
        (k, p.partition, p.offset) for k, p in zip(keys, positions, strict=True)
    ]
    assert {r.partition for r in consumed} == set(range(PARTITIONS))

    failed = np.array([i % 3 == 0 or rng.random() < 0.1 for i in range(len(consumed))])
    failed_records = [r for r, f in zip(consumed, failed.tolist(), strict=True) if f]
    failed_values = sorted(r.value or b"" for r in failed_records)
    path = tmp_path / "ft"
    storage = LmdbStorage(path)
    ft = FTLayer(storage, default_source=SourceConfig.named("kafka-hash", PARTITIONS))
    persist_and_sink(ft, consumed, failed)

    # Acked records completed and left storage; failed ones wait for replay.
    assert ft.stats.completed == len(consumed) - len(failed_records)
    assert len(storage) == len(failed_records) == ft.replay_cursor
    replay = ft.fetch_replay(0, ft.replay_cursor)
    assert sorted(targets_by_payload(replay)) == failed_values
    assert misplaced_kafka_replays(replay, originals) == []

    # Each partition's reader gets exactly the failed records Kafka put there, in
    # offset order (replays keep the order their originals were persisted in). Fetched
    # a second time, they come under fresh roots (a re-run takes the replay over).
    latest = []
    for p in range(PARTITIONS):
        mine = ft.fetch_replay(0, ft.replay_cursor, partition=p)
        assert list(mine.records.payloads) == [r.value for r in failed_records if r.partition == p]
        assert mine.partitions.tolist() == [p] * len(mine)
        latest.append(mine.records.roots)
    roots = np.concatenate(latest)
    assert not set(roots.tolist()) & set(replay.records.roots.tolist())

    # The replays fail again: the second replay goes to the same partitions.
    first_cursor = ft.replay_cursor
    sink = TaskHandler(ft)
    sink.process(
        Anchors.single(roots, np.zeros(len(roots), np.uint64)),
        NO_OUTPUTS,
        failed=np.ones(len(roots), dtype=np.bool_),
    )
    sink.flush()
    again = ft.fetch_replay(first_cursor, ft.replay_cursor)
    assert len(again) == len(failed_records)
    assert misplaced_kafka_replays(again, originals) == []
    assert {ft.retries(root) for root in again.records.roots.tolist()} == {2}

    # A restart replays every stored record from LMDB alone (key hashes read from disk).
    storage.close()
    with LmdbStorage(path) as reopened:
        recovered = FTLayer(reopened, default_source=SourceConfig.named("kafka-hash", PARTITIONS))
        assert recovered.stats.failed[FailCause.RECOVERY.value] == len(failed_records)
        after_restart = recovered.fetch_replay(ft.replay_cursor, recovered.replay_cursor)
        assert sorted(targets_by_payload(after_restart)) == failed_values
        assert misplaced_kafka_replays(after_restart, originals) == []


def test_keyless_records_are_refused_by_kafka_hash_and_replayed_by_forward(
    kafka_bootstrap: str, make_topic: MakeTopic, tmp_path: Path
) -> None:
    rng = random.Random(SEED + 1)
    topic = make_topic(PARTITIONS)
    keys: list[bytes | None] = [f"user-{i}".encode() for i in range(60)] + [None] * 60
    rng.shuffle(keys)
    values = [f"value-{i}".encode() for i in range(len(keys))]
    produce(kafka_bootstrap, topic, zip(keys, values, strict=True))
    consumed = read_all(kafka_bootstrap, topic, timeout=20.0)
    originals = {r.value: r for r in consumed if r.value is not None}
    assert sorted(originals) == sorted(values)
    keyed = [r for r in consumed if r.key is not None]
    storage = LmdbStorage(tmp_path / "ft")
    ft = FTLayer(
        storage,
        default_source=SourceConfig.named("kafka-hash", PARTITIONS),
        sources={1: SourceConfig.named("forward", PARTITIONS)},
    )
    # Keyed records persist; the failed half stays stored, queued for replay.
    keyed_failed = np.arange(len(keyed)) % 2 == 0
    persist_and_sink(ft, keyed, keyed_failed)
    before = (len(storage), len(ft), ft.replay_cursor)
    assert before == (len(keyed) // 2,) * 3

    # A kafka-hash source refuses the batch at persist, naming the first keyless record:
    # Kafka placed it at random, so no key hash can send its replay back there.
    batch = consumed[:MICRO_BATCH]
    first_keyless = next(r for r in batch if r.key is None)
    keyless = sum(r.key is None for r in batch)
    expected = (
        f"{keyless} of {len(batch)} records have no key (first: topic {topic!r} "
        f"partition {first_keyless.partition} offset {first_keyless.offset})"
    )
    hashes, has_key = kafka_key_hashes([r.key for r in batch])
    with pytest.raises(PartitioningError, match=re.escape(expected)):
        Persister(ft).persist(
            [r.value or b"" for r in batch],
            topics=topic,
            partitions=[r.partition for r in batch],
            offsets=[r.offset for r in batch],
            key_hashes=hashes,
            has_key=has_key,
        )
    # Nothing of the batch was stored, not even its keyed records.
    assert (len(storage), len(ft), ft.replay_cursor) == before

    # The same records from a forward source persist, and replay where Kafka put them.
    persist_and_sink(ft, consumed, np.ones(len(consumed), dtype=np.bool_), source_id=1)
    replay = ft.fetch_replay(0, ft.replay_cursor, source_id=1)
    assert sorted(targets_by_payload(replay)) == sorted(values)
    assert misplaced_kafka_replays(replay, originals) == []
    # The kafka-hash source's replays are untouched by the refused batch.
    hashed = ft.fetch_replay(0, ft.replay_cursor, source_id=0)
    assert list(hashed.records.payloads) == [
        r.value for r, f in zip(keyed, keyed_failed.tolist(), strict=True) if f
    ]
    assert misplaced_kafka_replays(hashed, originals) == []


def spark_test_keys() -> list[Hashable]:
    """Keys of the types PySpark's portable_hash treats differently: None (hash 0),
    str and bytes (seeded hashes), ints (negative, and beyond 2**61 where hash()
    wraps), and tuples (portable_hash's own mix, nested and with None inside)."""
    rng = random.Random(SEED + 2)
    keys: list[Hashable] = [None, "", b"", 0, -1, -2, (), (None,)]
    keys += [f"user-{i}" for i in range(80)]
    keys += [f"ключ-{i}-{rng.random()}" for i in range(20)]
    keys += [rng.randbytes(rng.randint(1, 40)) for _ in range(60)]
    keys += [rng.randint(-(2**63), 2**63) for _ in range(40)] + [2**70, -(2**70), 2**61 - 1]
    keys += [(f"user-{i}", i, None, (b"x" * i, -i)) for i in range(60)]
    assert len({repr(k) for k in keys}) == len(keys)
    return keys


def spark_placement(
    spark: SparkSession, keys: Sequence[Hashable], partitions: int
) -> dict[str, tuple[int, int]]:
    """repr(key) -> (partition, hash) as `partitionBy` placed each key, with the hash
    computed by spark_key_hash inside the Spark workers."""
    placed: Iterable[tuple[int, int, str]] = (
        spark.sparkContext.parallelize(list(keys), 3)
        .map(lambda k: (k, spark_key_hash(k)))
        .partitionBy(partitions)
        .mapPartitionsWithIndex(lambda i, it: ((i, h, repr(k)) for k, h in it))
        .collect()
    )
    return {key: (index, h) for index, h, key in placed}


def test_spark_hash_replays_into_the_partition_spark_chose(
    spark: SparkSession, tmp_path: Path
) -> None:
    keys = spark_test_keys()
    at_4 = spark_placement(spark, keys, PARTITIONS)
    assert len(at_4) == len(keys)
    assert {p for p, _ in at_4.values()} == set(range(PARTITIONS))
    payloads = [repr(k).encode() for k in keys]
    path = tmp_path / "ft"
    storage = LmdbStorage(path)
    ft = FTLayer(storage, default_source=SourceConfig.named("spark-hash", PARTITIONS))
    anchors = Persister(ft).persist(
        payloads,
        topics="spark-keys",
        partitions=[at_4[repr(k)][0] for k in keys],
        offsets=np.arange(len(keys)),
        key_hashes=[at_4[repr(k)][1] for k in keys],
    )
    assert ft.fail(anchors.roots) == len(keys)

    replay = ft.fetch_replay(0, ft.replay_cursor)
    targets = targets_by_payload(replay)
    assert sorted(targets) == sorted(payloads)
    wrong = [(k, at_4[repr(k)][0], targets[repr(k).encode()]) for k in keys]
    assert [w for w in wrong if w[1] != w[2]] == []

    # Restarted with 7 partitions (a rescale), the recovered replays go where
    # partitionBy(7) puts their keys: beside the new records of the same key.
    at_7 = spark_placement(spark, keys, 7)
    cursor = ft.replay_cursor
    storage.close()
    with LmdbStorage(path) as reopened:
        rescaled = FTLayer(reopened, default_source=SourceConfig.named("spark-hash", 7))
        targets_7 = targets_by_payload(rescaled.fetch_replay(cursor, rescaled.replay_cursor))
    assert sorted(targets_7) == sorted(payloads)
    wrong = [(k, at_7[repr(k)][0], targets_7[repr(k).encode()]) for k in keys]
    assert [w for w in wrong if w[1] != w[2]] == []


def key_group_replay(
    path: Path,
    partitions: int,
    max_parallelism: int,
    keys: Sequence[bytes],
    payloads: Sequence[bytes],
) -> dict[bytes, int]:
    """Persist keyed records under a key-group source, fail them all, and return each
    payload's replay target partition."""
    hashes, has_key = kafka_key_hashes(keys)
    source = SourceConfig.named("key-group", partitions, max_parallelism=max_parallelism)
    with LmdbStorage(path) as storage:
        ft = FTLayer(storage, default_source=source)
        anchors = Persister(ft).persist(
            payloads,
            topics="users",
            partitions=(hashes & 0x7FFFFFFF) % PARTITIONS,
            offsets=np.arange(len(keys)),
            key_hashes=hashes,
            has_key=has_key,
        )
        assert ft.fail(anchors.roots) == len(keys)
        return targets_by_payload(ft.fetch_replay(0, ft.replay_cursor))


@pytest.mark.parametrize("max_parallelism", [DEFAULT_MAX_PARALLELISM, 48])
def test_key_group_replays_follow_key_groups_across_a_rescale(
    tmp_path: Path, max_parallelism: int
) -> None:
    rng = random.Random(SEED + 3)
    keys = [f"user-{i}".encode() for i in range(700)]
    keys += [rng.randbytes(rng.randint(0, 40)) for _ in range(300)]
    payloads = [f"value-{i}".encode() for i in range(len(keys))]
    hashes, _ = kafka_key_hashes(keys)
    groups = assign_key_groups(hashes, max_parallelism)
    expected_4 = key_group_partitions(groups, max_parallelism, PARTITIONS)
    # The option reaches the partitioner: another max_parallelism places keys elsewhere.
    default_4 = key_group_partitions(
        assign_key_groups(hashes, DEFAULT_MAX_PARALLELISM), DEFAULT_MAX_PARALLELISM, PARTITIONS
    )
    assert bool((expected_4 != default_4).any()) == (max_parallelism != DEFAULT_MAX_PARALLELISM)

    at_4 = key_group_replay(tmp_path / "n4", PARTITIONS, max_parallelism, keys, payloads)
    got_4 = np.array([at_4[p] for p in payloads], dtype=np.int32)
    assert got_4.tolist() == expected_4.tolist()
    owns = [
        int(g) in key_group_range(int(p), PARTITIONS, max_parallelism)
        for g, p in zip(groups, got_4, strict=True)
    ]
    assert all(owns)

    # Rescaled to 8 partitions (a new FT layer over new storage, same records): each
    # old partition splits in two, and no new partition takes keys from two old ones.
    at_8 = key_group_replay(tmp_path / "n8", 2 * PARTITIONS, max_parallelism, keys, payloads)
    got_8 = np.array([at_8[p] for p in payloads], dtype=np.int32)
    merged = [(k, int(p4), int(p8)) for k, p4, p8 in zip(keys, got_4, got_8, strict=True)]
    assert [m for m in merged if m[2] // 2 != m[1]] == []
    halves = {p4: {p8 for _, q4, p8 in merged if q4 == p4} for p4 in range(PARTITIONS)}
    assert halves == {p4: {2 * p4, 2 * p4 + 1} for p4 in range(PARTITIONS)}
