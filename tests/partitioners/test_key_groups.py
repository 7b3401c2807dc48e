"""Key groups are Flink's, stable, contiguous per partition and rescaling-safe."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ftlayer.errors import ConfigError
from ftlayer.partitioners.key_groups import (
    DEFAULT_MAX_PARALLELISM,
    UPPER_BOUND_MAX_PARALLELISM,
    assign_key_groups,
    key_group_of,
    key_group_partitions,
    key_group_range,
)

# From Java (tests/partitioners/reference/GoldenHashes.java): Flink's key group of a
# Long key, at max parallelism 128 and 32768, and its partition at 128 groups, n = 5.
JAVA_KEY_GROUPS = [
    (0, 94, 31198, 3),
    (1, 86, 16342, 3),
    (-1, 94, 31198, 3),
    (42, 29, 28189, 1),
    (-2147483648, 62, 19646, 2),
    (2147483647, 62, 19646, 2),
    (4294967296, 86, 16342, 3),
    (-9223372036854775808, 108, 10348, 4),
    (9223372036854775807, 108, 10348, 4),
    (7267258763698366930, 17, 31121, 0),
    (4453636977479779157, 19, 12947, 0),
    (-5355548178795149064, 122, 9210, 4),
    (4090692220550007408, 119, 8183, 4),
    (3819179536249750202, 11, 7435, 0),
    (3816701305809022105, 104, 21480, 4),
    (-8878005791378378344, 43, 29099, 1),
    (3547410949950980598, 42, 30378, 1),
    (-5969576742649852382, 113, 9201, 4),
    (9010519564650163885, 54, 15158, 2),
    (5199281011428660706, 9, 9481, 0),
    (-1242935952102261150, 28, 9500, 1),
]

key_hash_values = st.integers(-(2**63), 2**63 - 1)
max_parallelisms = st.integers(1, UPPER_BOUND_MAX_PARALLELISM)


def java_key_group(key_hash: int, max_parallelism: int) -> int:
    """Flink's assignToKeyGroup for a Long key, one Java int operation per line."""

    def i32(x: int) -> int:
        x &= 0xFFFFFFFF
        return x - (1 << 32) if x >= 1 << 31 else x

    def rotl(x: int, r: int) -> int:
        u = x & 0xFFFFFFFF
        return i32((u << r) | (u >> (32 - r)))

    def ushr(x: int, r: int) -> int:
        return (x & 0xFFFFFFFF) >> r

    code = i32(key_hash ^ ((key_hash & 0xFFFFFFFFFFFFFFFF) >> 32))
    code = i32(code * 0xCC9E2D51)
    code = rotl(code, 15)
    code = i32(code * 0x1B873593)
    code = rotl(code, 13)
    code = i32(code * 5 + 0xE6546B64)
    code ^= 4
    code = i32(code ^ ushr(code, 16))
    code = i32(code * 0x85EBCA6B)
    code = i32(code ^ ushr(code, 13))
    code = i32(code * 0xC2B2AE35)
    code = i32(code ^ ushr(code, 16))
    positive = code if code >= 0 else (-code if code != -(2**31) else 0)
    return positive % max_parallelism


@pytest.mark.parametrize(("key_hash", "at_128", "at_32768", "partition_of_5"), JAVA_KEY_GROUPS)
def test_key_groups_match_flink_computed_in_java(
    key_hash: int, at_128: int, at_32768: int, partition_of_5: int
) -> None:
    assert key_group_of(key_hash, 128) == at_128
    assert key_group_of(key_hash, 32768) == at_32768
    groups = assign_key_groups(np.array([key_hash], dtype=np.int64), 128)
    assert key_group_partitions(groups, 128, 5).tolist() == [partition_of_5]


@given(st.lists(key_hash_values, max_size=30), max_parallelisms)
def test_key_groups_match_flink_reference_and_are_stable(
    key_hashes: list[int], max_parallelism: int
) -> None:
    array = np.array(key_hashes, dtype=np.int64)
    groups = assign_key_groups(array, max_parallelism)
    assert groups.dtype == np.int32
    assert groups.tolist() == [java_key_group(h, max_parallelism) for h in key_hashes]
    assert assign_key_groups(array.copy(), max_parallelism).tolist() == groups.tolist()


def test_default_max_parallelism_is_flinks_minimum() -> None:
    assert DEFAULT_MAX_PARALLELISM == 128
    assert key_group_of(42) == 29


@given(st.data(), max_parallelisms)
def test_partitions_own_contiguous_nonempty_ranges(
    data: st.DataObject, max_parallelism: int
) -> None:
    n = data.draw(st.integers(1, max_parallelism))
    owner = key_group_partitions(np.arange(max_parallelism, dtype=np.int32), max_parallelism, n)
    assert bool((np.diff(owner) >= 0).all()), "ranges are in partition order"
    partitions = np.arange(n, dtype=np.int32)
    starts = np.searchsorted(owner, partitions, side="left").tolist()
    ends = np.searchsorted(owner, partitions, side="right").tolist()
    expected = [key_group_range(p, n, max_parallelism) for p in range(n)]
    assert starts == [r.start for r in expected]
    assert ends == [r.stop for r in expected]
    assert all(len(r) > 0 for r in expected), "every partition owns a key group"


@given(st.data(), st.integers(2, UPPER_BOUND_MAX_PARALLELISM))
def test_growing_by_a_factor_splits_partitions_never_merges(
    data: st.DataObject, max_parallelism: int
) -> None:
    n = data.draw(st.integers(1, max_parallelism // 2))
    groups = np.arange(max_parallelism, dtype=np.int32)
    before = key_group_partitions(groups, max_parallelism, n)
    for factor in (2, data.draw(st.integers(2, max_parallelism // n))):
        after = key_group_partitions(groups, max_parallelism, n * factor)
        assert (after // factor).tolist() == before.tolist()
        pairs = np.unique(np.stack([after, before]), axis=1)
        assert pairs.shape[1] == n * factor, "each new partition takes groups of one old one"


@pytest.mark.parametrize("max_parallelism", [0, -1, UPPER_BOUND_MAX_PARALLELISM + 1, True, 1.5])
def test_invalid_max_parallelism_is_a_config_error(max_parallelism: Any) -> None:
    with pytest.raises(ConfigError, match="max_parallelism"):
        key_group_of(1, max_parallelism)


def test_more_partitions_than_key_groups_is_a_config_error() -> None:
    groups = np.arange(4, dtype=np.int32)
    with pytest.raises(ConfigError, match="num_partitions 5 exceeds max_parallelism 4"):
        key_group_partitions(groups, 4, 5)
    with pytest.raises(ConfigError, match="exceeds"):
        key_group_range(0, 5, 4)
    with pytest.raises(ConfigError, match="partition 3 is not in"):
        key_group_range(3, 3, 4)
