"""Key hashes agree bit for bit with the real Kafka and PySpark partitioners' hashes."""

from __future__ import annotations

import random
from collections.abc import Hashable
from typing import Any
from unittest.mock import patch

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kafka.partitioner.default import murmur2
from pyspark.rdd import portable_hash

from ftlayer.errors import ConfigError, PartitioningError
from ftlayer.partitioners import key_hashes
from ftlayer.partitioners.key_hashes import (
    check_spark_hash_seed,
    kafka_key_hash,
    kafka_key_hashes,
    spark_key_hash,
    spark_key_hashes,
)

# From Kafka's Java Utils.murmur2 (tests/partitioners/reference/GoldenHashes.java): the
# stored hash is the Java int, signed.
JAVA_MURMUR2 = [
    (b"", 275646681),
    (b"a", -1563381124),
    (b"ab", 316155434),
    (b"abc", 479470107),
    (b"abcd", -1323649548),
    (b"user-42", 1459644460),
    (b"21", -973932308),
    (b"kafka-python", -1017550085),
]

spark_keys: st.SearchStrategy[Hashable] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text()
    | st.binary(),
    lambda inner: st.lists(inner, max_size=4).map(tuple),
    max_leaves=12,
)


def java_int(unsigned: int) -> int:
    return unsigned - (1 << 32) if unsigned >= 1 << 31 else unsigned


@pytest.mark.parametrize(("key", "expected"), JAVA_MURMUR2)
def test_kafka_key_hash_is_javas_signed_murmur2(key: bytes, expected: int) -> None:
    assert kafka_key_hash(key) == expected
    assert kafka_key_hashes([key])[0].tolist() == [expected]


@given(st.binary(max_size=80))
def test_kafka_key_hash_matches_kafka_python(key: bytes) -> None:
    assert kafka_key_hash(key) == java_int(murmur2(key))


@pytest.mark.parametrize(
    "vector_min_keys", [1, 5, 10**9], ids=["all-numpy", "numpy-then-python", "all-python"]
)
@given(keys=st.lists(st.none() | st.binary(max_size=40), max_size=40))
def test_kafka_key_hashes_batch_matches_kafka_python(
    vector_min_keys: int, keys: list[bytes | None]
) -> None:
    with patch.object(key_hashes, "_VECTOR_MIN_KEYS", vector_min_keys):
        hashes, has_key = kafka_key_hashes(keys)
    assert hashes.dtype == np.int64
    assert has_key.tolist() == [k is not None for k in keys]
    assert hashes.tolist() == [0 if k is None else java_int(murmur2(k)) for k in keys]


def test_kafka_key_hashes_large_batch_with_long_outliers() -> None:
    rng = random.Random(7)
    keys: list[bytes | None] = [rng.randbytes(rng.randrange(0, 64)) for _ in range(3000)]
    keys += [rng.randbytes(4099), rng.randbytes(10_003), None]
    rng.shuffle(keys)
    hashes, has_key = kafka_key_hashes(keys)
    assert hashes.tolist() == [0 if k is None else java_int(murmur2(k)) for k in keys]
    assert int(has_key.sum()) == len(keys) - 1


def test_kafka_key_hashes_of_no_keys() -> None:
    hashes, has_key = kafka_key_hashes([])
    assert hashes.shape == has_key.shape == (0,)
    assert kafka_key_hashes([None, None])[1].tolist() == [False, False]


@given(spark_keys)
def test_spark_key_hash_matches_portable_hash(key: Hashable) -> None:
    assert spark_key_hash(key) == portable_hash(key)


@given(st.lists(spark_keys, max_size=20))
def test_spark_key_hashes_match_portable_hash(keys: list[Hashable]) -> None:
    hashes = spark_key_hashes(keys)
    assert hashes.dtype == np.int64
    assert hashes.tolist() == [portable_hash(k) for k in keys]


def test_spark_none_is_a_key_hashing_to_zero() -> None:
    assert spark_key_hash(None) == 0
    assert spark_key_hash((None, 1)) == portable_hash((None, 1))


def test_spark_key_hash_needs_pythonhashseed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED")
    with pytest.raises(ConfigError, match="PYTHONHASHSEED"):
        spark_key_hash("k")
    with pytest.raises(ConfigError, match="PYTHONHASHSEED"):
        spark_key_hashes([1])


def test_spark_unhashable_key_is_a_partitioning_error() -> None:
    unhashable: Any = ("ok", ["not", "hashable"])
    with pytest.raises(PartitioningError, match="list is not hashable"):
        spark_key_hash(unhashable)


def test_check_spark_hash_seed_accepts_a_seed_set_before_start() -> None:
    check_spark_hash_seed({"PYTHONHASHSEED": "0"}, hash_randomization=0)
    check_spark_hash_seed({"PYTHONHASHSEED": "42"}, hash_randomization=1)


@pytest.mark.parametrize(
    ("environ", "randomization", "reason"),
    [
        ({}, 1, "not set"),
        ({"PYTHONHASHSEED": "random"}, 1, "random"),
        ({"PYTHONHASHSEED": "0"}, 1, "set after this Python process started"),
        ({"PYTHONHASHSEED": "42"}, 0, "set after this Python process started"),
    ],
)
def test_check_spark_hash_seed_rejects_seeds_workers_cannot_share(
    environ: dict[str, str], randomization: int, reason: str
) -> None:
    with pytest.raises(ConfigError, match=reason):
        check_spark_hash_seed(environ, hash_randomization=randomization)
