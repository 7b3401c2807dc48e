"""Key groups: rescaling-safe placement of keyed records, as Flink's KeyGroupRangeAssignment.

A key hash belongs to one of `max_parallelism` key groups, fixed for the life of the
job; partitions own contiguous ranges of key groups. Changing the partition count moves
whole key groups between partitions and never splits one, so every record of a key,
original or replayed, before or after a rescale, lands where that key's state lives.

    folded     = (int32)(key_hash ^ (key_hash >>> 32))        Java's Long.hashCode
    key_group  = murmurHash(folded) % max_parallelism         Flink's MathUtils.murmurHash
    partition  = key_group * num_partitions // max_parallelism

murmurHash is Flink's: murmur3's body for a single 4-byte block (c1 = 0xcc9e2d51,
rotl 15, c2 = 0x1b873593, rotl 13, h * 5 + 0xe6546b64), then `^ 4` (the length) and
murmur3's fmix32, made non-negative by negation (Integer.MIN_VALUE becomes 0). So the
key group of a stored key hash is exactly the key group Flink assigns to a Java `Long`
key of that value.

Guarantees, for 1 <= num_partitions <= max_parallelism <= 2**15 (Flink's upper bound):
- a key hash has one key group, whatever the partition count;
- partition p owns the key groups `key_group_range(p, n, max_parallelism)`, contiguous
  and never empty, and the ranges tile [0, max_parallelism) in partition order;
- going from n to c * n partitions splits partition p into partitions
  c * p ... c * p + c - 1 (`partition(c * n) // c == partition(n)`): doubling splits
  key groups between partitions and never merges those of two old partitions.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from ftlayer.errors import ConfigError

DEFAULT_MAX_PARALLELISM = 128
UPPER_BOUND_MAX_PARALLELISM = 1 << 15


def check_max_parallelism(max_parallelism: int, num_partitions: int | None = None) -> None:
    """ConfigError unless 1 <= num_partitions <= max_parallelism <= 2**15."""
    if isinstance(max_parallelism, bool) or not isinstance(max_parallelism, int | np.integer):
        raise ConfigError(f"max_parallelism must be an int, got {max_parallelism!r}")
    if not 1 <= max_parallelism <= UPPER_BOUND_MAX_PARALLELISM:
        raise ConfigError(
            f"max_parallelism must be between 1 and {UPPER_BOUND_MAX_PARALLELISM}, "
            f"got {max_parallelism}"
        )
    if num_partitions is not None and num_partitions > max_parallelism:
        raise ConfigError(
            f"num_partitions {num_partitions} exceeds max_parallelism {max_parallelism}: "
            "a key group is never split, so there cannot be more partitions than key "
            "groups; start the job with a larger max_parallelism"
        )


def assign_key_groups(key_hashes: NDArray[np.int64], max_parallelism: int) -> NDArray[np.int32]:
    """The key group, in [0, max_parallelism), of every stored key hash."""
    check_max_parallelism(max_parallelism)
    wide = np.asarray(key_hashes, dtype=np.int64).view(np.uint64)
    code = ((wide ^ (wide >> np.uint64(32))) & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    code *= np.uint32(0xCC9E2D51)
    code = _rotate_left(code, 15)
    code *= np.uint32(0x1B873593)
    code = _rotate_left(code, 13)
    code = code * np.uint32(5) + np.uint32(0xE6546B64)
    code ^= np.uint32(4)
    code ^= code >> 16
    code *= np.uint32(0x85EBCA6B)
    code ^= code >> 13
    code *= np.uint32(0xC2B2AE35)
    code ^= code >> 16
    signed = code.view(np.int32).astype(np.int64)
    positive = np.abs(signed)
    positive[positive == 1 << 31] = 0
    return (positive % max_parallelism).astype(np.int32)


def _rotate_left(code: NDArray[np.uint32], bits: int) -> NDArray[np.uint32]:
    return (code << np.uint32(bits)) | (code >> np.uint32(32 - bits))


def key_group_of(key_hash: int, max_parallelism: int = DEFAULT_MAX_PARALLELISM) -> int:
    """The key group of one stored key hash (a signed 64-bit int)."""
    return int(assign_key_groups(np.array([key_hash], dtype=np.int64), max_parallelism)[0])


def key_group_partitions(
    key_groups: NDArray[np.int32], max_parallelism: int, num_partitions: int
) -> NDArray[np.int32]:
    """The partition owning each key group: key_group * num_partitions // max_parallelism."""
    check_max_parallelism(max_parallelism, num_partitions)
    groups = np.asarray(key_groups, dtype=np.int64)
    return (groups * num_partitions // max_parallelism).astype(np.int32)


def key_group_range(partition: int, num_partitions: int, max_parallelism: int) -> range:
    """The key groups partition `partition` owns (Flink's computeKeyGroupRangeForOperatorIndex)."""
    check_max_parallelism(max_parallelism, num_partitions)
    if not 0 <= partition < num_partitions:
        raise ConfigError(f"partition {partition} is not in [0, {num_partitions})")
    start = (partition * max_parallelism + num_partitions - 1) // num_partitions
    end = ((partition + 1) * max_parallelism - 1) // num_partitions
    return range(start, end + 1)
