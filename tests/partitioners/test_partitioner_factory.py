"""create_partitioner knows every partitioner by one name and explains bad requests."""

from __future__ import annotations

import pytest

from ftlayer.errors import ConfigError, PartitioningError
from ftlayer.partitioners import (
    PARTITIONER_NAMES,
    KeyGroupPartitioner,
    RebalancePartitioner,
    create_partitioner,
)


def test_names_are_the_documented_ones() -> None:
    assert PARTITIONER_NAMES == (
        "forward",
        "kafka-hash",
        "spark-hash",
        "rebalance",
        "broadcast",
        "global",
        "key-group",
    )


@pytest.mark.parametrize("name", PARTITIONER_NAMES)
def test_every_name_creates_a_fresh_partitioner_of_that_name(name: str) -> None:
    first, second = create_partitioner(name), create_partitioner(name)
    assert first.name == name
    assert first is not second, "rebalance state must not be shared between writers"


def test_options_reach_the_partitioner() -> None:
    key_group = create_partitioner("key-group", max_parallelism=4096)
    assert isinstance(key_group, KeyGroupPartitioner)
    assert key_group.max_parallelism == 4096
    rebalance = create_partitioner("rebalance", start=3)
    assert isinstance(rebalance, RebalancePartitioner)
    assert rebalance.position == 3


def test_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(PartitioningError, match="unknown replay partitioner 'hash'") as info:
        create_partitioner("hash")
    for name in PARTITIONER_NAMES:
        assert name in str(info.value)


@pytest.mark.parametrize(
    ("name", "options", "accepted"),
    [
        ("forward", {"start": 1}, "none"),
        ("key-group", {"max_parallelism": 8, "flavour": "x"}, "max_parallelism"),
    ],
)
def test_unknown_option_is_a_config_error_listing_the_accepted_ones(
    name: str, options: dict[str, object], accepted: str
) -> None:
    with pytest.raises(ConfigError, match=f"does not take options .*its options: {accepted}"):
        create_partitioner(name, **options)


def test_invalid_option_value_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="max_parallelism"):
        create_partitioner("key-group", max_parallelism=0)
