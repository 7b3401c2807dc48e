"""A replayed record re-enters the partition the source put its original in."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kafka.partitioner.default import DefaultPartitioner
from numpy.typing import NDArray
from pyspark.rdd import Partitioner, portable_hash

from ftlayer.errors import ConfigError, PartitioningError
from ftlayer.partitioners import (
    BroadcastPartitioner,
    ForwardPartitioner,
    GlobalPartitioner,
    KafkaHashPartitioner,
    KeyGroupPartitioner,
    RebalancePartitioner,
    ReplayPartitioner,
    SingleTargetPartitioner,
    SparkHashPartitioner,
    assign_key_groups,
    kafka_key_hashes,
    key_group_partitions,
    spark_key_hashes,
)
from ftlayer.records import RecordBatch

partition_counts = st.integers(1, 64)
key_hash_values = st.integers(-(2**63), 2**63 - 1)
spark_keys: st.SearchStrategy[Hashable] = st.recursive(
    st.none() | st.integers() | st.text() | st.binary(),
    lambda inner: st.lists(inner, max_size=3).map(tuple),
    max_leaves=8,
)


def batch_of(
    size: int,
    *,
    key_hashes: Sequence[int] | NDArray[np.int64] | None = None,
    has_key: Sequence[bool] | NDArray[np.bool_] | None = None,
    partitions: Sequence[int] | NDArray[np.int32] | int = 0,
    topic: str = "orders",
) -> RecordBatch:
    return RecordBatch.build(
        np.arange(1, size + 1, dtype=np.uint64),
        [b"payload-%d" % i for i in range(size)],
        key_hashes=key_hashes,
        has_key=has_key,
        topics=topic,
        partitions=partitions,
        offsets=np.arange(100, 100 + size, dtype=np.int64),
    )


class OneTopicCluster:
    """The ClusterMetadata surface kafka-python's DefaultPartitioner reads."""

    def __init__(self, num_partitions: int) -> None:
        self.partitions = set(range(num_partitions))

    def topics(self) -> set[str]:
        return {"orders"}

    def partitions_for_topic(self, topic: str) -> set[int]:
        return self.partitions

    def available_partitions_for_topic(self, topic: str) -> set[int]:
        return self.partitions


def all_partitioners() -> list[ReplayPartitioner]:
    return [
        ForwardPartitioner(),
        KafkaHashPartitioner(),
        SparkHashPartitioner(),
        RebalancePartitioner(),
        BroadcastPartitioner(),
        GlobalPartitioner(),
        KeyGroupPartitioner(),
    ]


# --- hash flavours: the real partitioner's choice, recomputed from the stored hash ---


@given(st.lists(st.binary(max_size=24), max_size=40), partition_counts)
def test_kafka_hash_replays_into_kafka_pythons_partition(
    keys: list[bytes], num_partitions: int
) -> None:
    cluster = OneTopicCluster(num_partitions)
    producer = DefaultPartitioner()
    original = [producer.partition("orders", k, k, None, None, cluster) for k in keys]
    hashes, has_key = kafka_key_hashes(keys)
    batch = batch_of(len(keys), key_hashes=hashes, has_key=has_key, partitions=original)
    records, partitions = KafkaHashPartitioner().targets(batch, num_partitions)
    assert records.tolist() == list(range(len(keys)))
    assert partitions.tolist() == original


@given(st.lists(spark_keys, max_size=40), partition_counts)
def test_spark_hash_replays_into_partition_by_partition(
    keys: list[Hashable], num_partitions: int
) -> None:
    partition_by = Partitioner(num_partitions, portable_hash)
    original = [partition_by(k) for k in keys]
    batch = batch_of(len(keys), key_hashes=spark_key_hashes(keys), partitions=original)
    assert SparkHashPartitioner().partition_of(batch, num_partitions).tolist() == original


def test_spark_hash_partition_is_never_negative() -> None:
    batch = batch_of(3, key_hashes=[-1, -(2**63), -7])
    assert SparkHashPartitioner().partition_of(batch, 4).tolist() == [3, 0, 1]


def test_kafka_hash_uses_only_the_low_31_bits() -> None:
    batch = batch_of(3, key_hashes=[-1, -(2**31), 2**40 + 5])
    assert KafkaHashPartitioner().partition_of(batch, 10).tolist() == [
        0x7FFFFFFF % 10,
        0,
        5,
    ]


# --- key groups ---


@given(st.lists(key_hash_values, max_size=40), partition_counts, partition_counts)
def test_key_group_replays_where_the_key_group_lives(
    key_hashes: list[int], before: int, after: int
) -> None:
    hashes = np.array(key_hashes, dtype=np.int64)
    groups = assign_key_groups(hashes, 128)
    original = key_group_partitions(groups, 128, before)
    batch = batch_of(len(key_hashes), key_hashes=hashes, partitions=original)
    partitioner = KeyGroupPartitioner()
    assert partitioner.partition_of(batch, before).tolist() == original.tolist()
    rescaled = partitioner.partition_of(batch, after)
    assert rescaled.tolist() == key_group_partitions(groups, 128, after).tolist()
    for group in set(groups.tolist()):
        assert len(set(rescaled[groups == group].tolist())) == 1


def test_key_group_rejects_more_partitions_than_key_groups() -> None:
    batch = batch_of(1, key_hashes=[1])
    with pytest.raises(ConfigError, match="exceeds max_parallelism 8"):
        KeyGroupPartitioner(max_parallelism=8).targets(batch, 9)
    assert KeyGroupPartitioner(max_parallelism=8).targets(batch, 8)[1].shape == (1,)


# --- records without a key ---


@pytest.mark.parametrize(
    "partitioner",
    [KafkaHashPartitioner(), SparkHashPartitioner(), KeyGroupPartitioner()],
    ids=lambda p: p.name,
)
def test_keyless_record_fails_the_whole_batch_naming_it(
    partitioner: SingleTargetPartitioner,
) -> None:
    batch = batch_of(
        4, key_hashes=[1, 2, 3, 4], has_key=[True, False, True, False], partitions=[0, 2, 1, 3]
    )
    expected = (
        rf"'{partitioner.name}'.*2 of 4 records have no key "
        r"\(first: topic 'orders' partition 2 offset 101\)"
    )
    with pytest.raises(PartitioningError, match=expected):
        partitioner.targets(batch, 4)
    with pytest.raises(PartitioningError, match=expected):
        partitioner.partition_of(batch, 4)


@pytest.mark.parametrize(
    "partitioner",
    [ForwardPartitioner(), RebalancePartitioner(), BroadcastPartitioner(), GlobalPartitioner()],
    ids=lambda p: p.name,
)
def test_partitioners_without_keys_accept_keyless_records(
    partitioner: ReplayPartitioner,
) -> None:
    records, _ = partitioner.targets(batch_of(3, partitions=[0, 1, 2]), 3)
    assert set(records.tolist()) == {0, 1, 2}


# --- forward ---


@given(st.lists(st.integers(0, 63), max_size=40), st.integers(0, 64))
def test_forward_replays_into_the_original_partition(
    originals: list[int], extra_partitions: int
) -> None:
    num_partitions = max(originals, default=0) + 1 + extra_partitions
    batch = batch_of(len(originals), partitions=originals)
    assert ForwardPartitioner().partition_of(batch, num_partitions).tolist() == originals


def test_forward_refuses_a_partition_gone_after_a_rescale() -> None:
    batch = batch_of(4, partitions=[0, 5, 1, 7])
    with pytest.raises(
        PartitioningError,
        match=r"2 of 4 records.*not in \[0, 4\) \(first: topic 'orders' partition 5 offset 101\)"
        r".*'key-group'",
    ):
        ForwardPartitioner().targets(batch, 4)


def test_forward_refuses_a_negative_partition() -> None:
    with pytest.raises(PartitioningError, match="partition -1 offset 100"):
        ForwardPartitioner().partition_of(batch_of(1, partitions=[-1]), 4)


# --- rebalance, broadcast, global ---


@given(st.lists(st.integers(0, 30), max_size=12), partition_counts, st.integers(0, 10**6))
def test_rebalance_continues_round_robin_across_calls_and_spreads_evenly(
    batch_sizes: list[int], num_partitions: int, start: int
) -> None:
    partitioner = RebalancePartitioner(start=start)
    placed = [partitioner.partition_of(batch_of(size), num_partitions) for size in batch_sizes]
    total = sum(batch_sizes)
    everything = np.concatenate([np.zeros(0, dtype=np.int32), *placed])
    expected = (start + np.arange(total)) % num_partitions
    assert everything.tolist() == expected.tolist()
    counts = np.bincount(everything, minlength=num_partitions)
    assert int(counts.max() - counts.min()) <= 1
    assert partitioner.position == start + total


def test_rebalance_resumes_from_a_saved_position() -> None:
    first = RebalancePartitioner()
    assert first.partition_of(batch_of(5), 3).tolist() == [0, 1, 2, 0, 1]
    resumed = RebalancePartitioner(start=first.position)
    assert resumed.partition_of(batch_of(2), 3).tolist() == [2, 0]


@pytest.mark.parametrize("start", [-1, True, 1.5])
def test_rebalance_start_must_be_a_non_negative_int(start: Any) -> None:
    with pytest.raises(ConfigError, match="start"):
        RebalancePartitioner(start=start)


@given(st.integers(0, 40), partition_counts)
def test_broadcast_sends_every_record_to_every_partition_once(
    size: int, num_partitions: int
) -> None:
    records, partitions = BroadcastPartitioner().targets(batch_of(size), num_partitions)
    assert len(records) == size * num_partitions
    assert bool((np.diff(records) >= 0).all()), "ordered by record index"
    pairs = set(zip(records.tolist(), partitions.tolist(), strict=True))
    assert pairs == {(r, p) for r in range(size) for p in range(num_partitions)}


def test_global_sends_everything_to_partition_zero() -> None:
    batch = batch_of(4, partitions=[3, 2, 1, 0])
    assert GlobalPartitioner().partition_of(batch, 4).tolist() == [0, 0, 0, 0]


# --- the contract every partitioner shares ---


@pytest.mark.parametrize("partitioner", all_partitioners(), ids=lambda p: p.name)
@given(st.integers(0, 20), partition_counts)
def test_targets_contract(partitioner: ReplayPartitioner, size: int, num_partitions: int) -> None:
    batch = batch_of(size, key_hashes=np.arange(size, dtype=np.int64) * 7919, partitions=0)
    records, partitions = partitioner.targets(batch, num_partitions)
    assert records.dtype == np.intp
    assert partitions.dtype == np.int32
    assert records.shape == partitions.shape
    assert bool((np.diff(records) >= 0).all())
    assert set(records.tolist()) == set(range(size)), "every record is placed"
    assert bool(((partitions >= 0) & (partitions < num_partitions)).all())
    if isinstance(partitioner, SingleTargetPartitioner):
        assert records.tolist() == list(range(size))


@pytest.mark.parametrize("partitioner", all_partitioners(), ids=lambda p: p.name)
@pytest.mark.parametrize("num_partitions", [0, -3, True, 2.0, "4", 2**31])
def test_invalid_partition_count_is_a_config_error(
    partitioner: ReplayPartitioner, num_partitions: Any
) -> None:
    with pytest.raises(ConfigError, match="num_partitions"):
        partitioner.targets(batch_of(1, key_hashes=[1]), num_partitions)


def test_a_numpy_partition_count_is_accepted() -> None:
    batch = batch_of(2, key_hashes=[1, 2])
    four: Any = np.int64(4)
    assert KafkaHashPartitioner().partition_of(batch, four).shape == (2,)
