"""Creating replay partitioners by name: the one list of names the rest of ftlayer uses.

`create_partitioner(name, **options)` returns a new partitioner; an unknown name raises
PartitioningError listing `PARTITIONER_NAMES`, and an option the partitioner does not
take raises ConfigError listing the ones it does. Options:

- rebalance: `start` (int >= 0, default 0), the first partition of the rotation;
- key-group: `max_parallelism` (1 ... 2**15, default 128), the number of key groups;
- the others take none.
"""

from __future__ import annotations

import inspect
from typing import Any

from ftlayer.errors import ConfigError, PartitioningError

from .base import ReplayPartitioner
from .strategies import (
    BroadcastPartitioner,
    ForwardPartitioner,
    GlobalPartitioner,
    KafkaHashPartitioner,
    KeyGroupPartitioner,
    RebalancePartitioner,
    SparkHashPartitioner,
)

_PARTITIONERS: dict[str, type[ReplayPartitioner]] = {
    cls.name: cls
    for cls in (
        ForwardPartitioner,
        KafkaHashPartitioner,
        SparkHashPartitioner,
        RebalancePartitioner,
        BroadcastPartitioner,
        GlobalPartitioner,
        KeyGroupPartitioner,
    )
}

PARTITIONER_NAMES: tuple[str, ...] = tuple(_PARTITIONERS)


def create_partitioner(name: str, **options: Any) -> ReplayPartitioner:
    """A new replay partitioner called `name`, configured by `options`."""
    cls = _PARTITIONERS.get(name)
    if cls is None:
        raise PartitioningError(
            f"unknown replay partitioner {name!r}; valid names: {', '.join(PARTITIONER_NAMES)}"
        )
    signature = inspect.signature(cls)
    try:
        signature.bind(**options)
    except TypeError:
        accepted = ", ".join(signature.parameters) or "none"
        raise ConfigError(
            f"replay partitioner {name!r} does not take options {sorted(options)}; "
            f"its options: {accepted}"
        ) from None
    return cls(**options)
