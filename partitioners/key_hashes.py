"""Key hashes: the one integer per record the hash partitioners replay by.

The FT layer never deserializes a record, so a source computes its key's hash when it
persists the record and stores it in `RecordBatch.key_hashes` (int64), with
`has_key` saying whether there was a key at all. Replay then needs nothing but that
integer. Each flavour below stores exactly the hash the real partitioner uses, so the
replay partition is bit for bit the one the real partitioner chose:

Kafka (`kafka_key_hash`, `kafka_key_hashes`)
    The stored hash is Kafka's murmur2 of the serialized key bytes (seed 0x9747b28c,
    m = 0x5bd1e995, r = 24, little-endian 4-byte words, tail bytes xor-ed from the
    highest down, then h ^= h >>> 13; h *= m; h ^= h >>> 15), as Java's *signed* 32-bit
    int, in [-2**31, 2**31). Java's `Utils.murmur2` returns that int; kafka-python's
    `kafka.partitioner.default.murmur2` returns the same 32 bits as an unsigned Python
    int. Both producers place a keyed record on `(h & 0x7fffffff) % num_partitions`
    (Java: `Utils.toPositive(murmur2(key)) % n`). A None key is "no key": the producer
    then chooses a partition at random (kafka-python) or sticky (Java), which nothing
    can mirror, so `has_key` is False.

Spark (`spark_key_hash`, `spark_key_hashes`)
    The stored hash is `pyspark.rdd.portable_hash(key)`: 0 for None; for a tuple,
    h = 0x345678, then per item h = ((h ^ portable_hash(item)) * 1000003) & sys.maxsize,
    then h ^ len(tuple); for anything else Python's `hash(key)`. It fits in int64.
    `RDD.partitionBy(n)` places a pair on `portable_hash(key) % n` with Python's
    modulo, so the partition is never negative. None is a key here (hash 0, partition 0).
    `hash()` of str, bytes and datetime values depends on the interpreter's hash seed,
    so a stored hash agrees with a Spark worker's only if the process that computed it
    started with the same PYTHONHASHSEED as the workers. PySpark gives every worker
    `PYTHONHASHSEED` from the driver's environment, "0" if the driver has none;
    computing the hash inside a Spark task (e.g. in the source's `read`) therefore
    agrees by construction. Like `portable_hash`, `spark_key_hash` refuses to run
    without PYTHONHASHSEED; `check_spark_hash_seed` also catches a variable that was set
    after the interpreter started, which portable_hash cannot see.

The batch functions work on a whole batch at once: `kafka_key_hashes` runs murmur2 as
numpy uint32 arithmetic across all keys (one numpy step per 4-byte word position, not
per key); a batch of fewer than 32 keys, and the last few keys much longer than the
rest, are hashed with Python ints, which is cheaper there.
"""

from __future__ import annotations

import os
import struct
import sys
from collections.abc import Hashable, Mapping, Sequence
from itertools import chain

import numpy as np
from numpy.typing import NDArray

from ftlayer.errors import ConfigError, PartitioningError

_SEED = 0x9747B28C
_M = 0x5BD1E995
_MASK32 = 0xFFFFFFFF
_SIGN32 = 0x80000000

# With fewer keys than this in play (in the batch, or still hashing words), a numpy
# call per step costs more than hashing those keys with Python ints.
_VECTOR_MIN_KEYS = 32
_PADS = (b"", b"\0\0\0", b"\0\0", b"\0")

_WORDS = struct.Struct("<I")


def kafka_key_hash(key: bytes) -> int:
    """Kafka's murmur2 of the serialized key, as Java's signed 32-bit int."""
    length = len(key)
    h = _SEED ^ length
    body = length & ~3
    for (k,) in _WORDS.iter_unpack(memoryview(key)[:body]):
        k = (k * _M) & _MASK32
        k ^= k >> 24
        k = (k * _M) & _MASK32
        h = ((h * _M) & _MASK32) ^ k
    extra = length & 3
    if extra >= 3:
        h ^= key[body + 2] << 16
    if extra >= 2:
        h ^= key[body + 1] << 8
    if extra >= 1:
        h ^= key[body]
        h = (h * _M) & _MASK32
    h ^= h >> 13
    h = (h * _M) & _MASK32
    h ^= h >> 15
    return h - (1 << 32) if h & _SIGN32 else h


def kafka_key_hashes(
    keys: Sequence[bytes | None],
) -> tuple[NDArray[np.int64], NDArray[np.bool_]]:
    """`(key_hashes, has_key)` for a batch of serialized Kafka keys; None means no key.

    A keyless record gets hash 0 and has_key False.
    """
    if keys.count(None) == len(keys):  # an unkeyed topic: no Python step per record
        return np.zeros(len(keys), dtype=np.int64), np.zeros(len(keys), dtype=np.bool_)
    has_key = np.fromiter((k is not None for k in keys), dtype=np.bool_, count=len(keys))
    hashes = np.zeros(len(keys), dtype=np.int64)
    present = [k for k in keys if k is not None]
    if present:
        hashes[has_key] = _murmur2_batch(present)
    return hashes, has_key


def _murmur2_batch(keys: Sequence[bytes]) -> NDArray[np.int32]:
    """murmur2 of every key, as signed 32-bit ints, with numpy doing the arithmetic.

    Every key is zero-padded to whole 4-byte words, so one frombuffer yields all words
    aligned, and a key's tail bytes are its last, padded word (xor-ing the tail bytes one
    by one, as Java does, equals xor-ing that word). Words are mixed all at once; the
    chain h = h * m ^ k is sequential per key, so it advances one word position per
    numpy step across all keys that still have a word there: sorted by word count,
    longest first, those keys are a prefix.
    """
    if len(keys) < _VECTOR_MIN_KEYS:
        return np.fromiter(map(kafka_key_hash, keys), dtype=np.int32, count=len(keys))
    m = np.uint32(_M)
    lengths = np.fromiter(map(len, keys), dtype=np.int64, count=len(keys))
    pads = [_PADS[n & 3] for n in lengths.tolist()]
    padded = np.frombuffer(b"".join(chain.from_iterable(zip(keys, pads, strict=True))), "<u4")
    k = padded * m
    k ^= k >> 24
    k *= m

    words = lengths >> 2
    first_word = np.zeros(len(keys), dtype=np.int64)
    np.cumsum(((lengths + 3) >> 2)[:-1], out=first_word[1:])
    order = np.argsort(-words, kind="stable")
    sorted_words = words[order]
    sorted_first = first_word[order]
    positions = int(sorted_words[0])
    # active[j]: how many keys have a word at position j (a prefix of `order`).
    active = np.searchsorted(-sorted_words, -np.arange(positions), side="left")
    hs = (np.uint32(_SEED) ^ lengths.astype(np.uint32))[order]
    j = 0
    while j < positions and active[j] >= _VECTOR_MIN_KEYS:
        live = hs[: active[j]]
        live *= m
        live ^= k[sorted_first[: active[j]] + j]
        j += 1
    if j < positions:
        for rank in range(int(active[j])):
            hr = int(hs[rank])
            start = int(sorted_first[rank])
            for kw in k[start + j : start + int(sorted_words[rank])].tolist():
                hr = ((hr * _M) & _MASK32) ^ kw
            hs[rank] = hr
    h = np.empty_like(hs)
    h[order] = hs

    tail = (lengths & 3) > 0
    h[tail] ^= padded[first_word[tail] + words[tail]]
    h[tail] *= m
    h ^= h >> 13
    h *= m
    h ^= h >> 15
    return h.view(np.int32)


def spark_key_hash(key: Hashable) -> int:
    """`pyspark.rdd.portable_hash(key)`: what `RDD.partitionBy` partitions by.

    Raises ConfigError without PYTHONHASHSEED (as portable_hash does), and
    PartitioningError for an unhashable key.
    """
    _require_hash_seed_variable()
    return _portable_hash(key)


def spark_key_hashes(keys: Sequence[Hashable]) -> NDArray[np.int64]:
    """`spark_key_hash` of every key. Every record gets a hash: None is a key in Spark."""
    _require_hash_seed_variable()
    return np.fromiter(map(_portable_hash, keys), dtype=np.int64, count=len(keys))


def _portable_hash(key: object) -> int:
    if key is None:
        return 0
    if isinstance(key, tuple):
        # portable_hash also maps -1 to -2 here, which cannot happen: h is masked
        # non-negative before the final xor with the (non-negative) length.
        h = 0x345678
        for item in key:
            h ^= _portable_hash(item)
            h *= 1000003
            h &= sys.maxsize
        return h ^ len(key)
    try:
        return hash(key)
    except TypeError as exc:
        raise PartitioningError(
            f"key {key!r} of type {type(key).__name__} is not hashable, so Spark's "
            "portable_hash cannot partition by it"
        ) from exc


_NO_SEED = (
    "PYTHONHASHSEED is not set: Spark's portable_hash refuses to hash without it, "
    "because str and bytes hashes would differ between processes; set it (Spark "
    "workers get the driver's value, '0' by default) before Python starts"
)


def _require_hash_seed_variable() -> None:
    if "PYTHONHASHSEED" not in os.environ:
        raise ConfigError(_NO_SEED)


def check_spark_hash_seed(
    environ: Mapping[str, str] = os.environ,
    hash_randomization: int = sys.flags.hash_randomization,
) -> None:
    """Raise ConfigError if this process's str hashes cannot match Spark workers'.

    Catches PYTHONHASHSEED missing, "random", or set after the interpreter started
    (the variable says 0 but hashing is randomized, or the reverse). It cannot tell
    two different non-zero seeds apart: only hashing inside a Spark task is safe then.
    """
    seed = environ.get("PYTHONHASHSEED")
    if seed is None:
        raise ConfigError(_NO_SEED)
    if seed in ("", "random"):
        raise ConfigError(
            f"PYTHONHASHSEED={seed!r} gives every Spark worker its own str hashes, so "
            "portable_hash partitioning is not reproducible; set a number such as 0"
        )
    if (seed != "0") != bool(hash_randomization):
        raise ConfigError(
            f"PYTHONHASHSEED={seed} was set after this Python process started "
            f"(its str hashing is {'randomized' if hash_randomization else 'not randomized'}"
            "), so its str/bytes key hashes will not match Spark workers'; set it in the "
            "environment that starts the process"
        )
