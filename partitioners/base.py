"""The replay partitioner contract.

A replay partitioner answers one question for a batch of persisted records that are
about to be replayed: which source partition (Spark input partition, Kafka partition)
does each record re-enter? It must answer it the way the source partitioned the
original, so that a replayed record meets the same downstream task, and so the same
keyed state, as its original did.

`targets(batch, num_partitions)` returns two parallel arrays `(record_index, partition)`:
the pair `(i, p)` says record `i` of the batch goes to partition `p`. The pairs are
ordered by record index; a record appears once for every partitioner except broadcast,
which pairs it with every partition. Nothing is returned partially: a batch that cannot
be replayed as a whole raises PartitioningError and no record is placed.

`num_partitions` is the partition count now, which may differ from the count when the
records first entered (a rescale). It must be an int >= 1 (ConfigError otherwise).

Partitioners are cheap value objects; only rebalance keeps state (its round-robin
position), and no partitioner is thread-safe: give each replaying writer its own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np
from numpy.typing import NDArray

from ftlayer.errors import ConfigError, PartitioningError
from ftlayer.records import RecordBatch

Targets = tuple[NDArray[np.intp], NDArray[np.int32]]

_MAX_PARTITIONS = np.iinfo(np.int32).max


class ReplayPartitioner(ABC):
    """Places replayed records on source partitions, mirroring the original partitioning."""

    name: ClassVar[str]
    """The name `create_partitioner` knows this partitioner by."""

    requires_key: ClassVar[bool] = False
    """True for partitioners that replay by the stored key hash."""

    def check_routable(self, batch: RecordBatch, num_partitions: int) -> None:
        """Raise PartitioningError if some record of `batch` could never be replayed by
        this partitioner (checked when records are persisted, so nothing unroutable is
        ever stored). Never changes the partitioner's state."""
        check_num_partitions(num_partitions)
        if self.requires_key:
            require_keys(batch, self.name)

    def targets(self, batch: RecordBatch, num_partitions: int) -> Targets:
        """The `(record_index, partition)` pairs for `batch`, ordered by record index."""
        check_num_partitions(num_partitions)
        return self._targets(batch, num_partitions)

    @abstractmethod
    def _targets(self, batch: RecordBatch, num_partitions: int) -> Targets: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class SingleTargetPartitioner(ReplayPartitioner):
    """A partitioner that sends every record to exactly one partition."""

    def partition_of(self, batch: RecordBatch, num_partitions: int) -> NDArray[np.int32]:
        """The one partition each record of `batch` goes to, in record order."""
        check_num_partitions(num_partitions)
        return self._partition_of(batch, num_partitions)

    def _targets(self, batch: RecordBatch, num_partitions: int) -> Targets:
        return np.arange(len(batch), dtype=np.intp), self._partition_of(batch, num_partitions)

    @abstractmethod
    def _partition_of(self, batch: RecordBatch, num_partitions: int) -> NDArray[np.int32]: ...


def check_num_partitions(num_partitions: int) -> None:
    """Raise ConfigError unless `num_partitions` is an int in [1, 2**31 - 1]."""
    # bool is an int subclass, and True would silently mean one partition.
    if isinstance(num_partitions, bool) or not isinstance(num_partitions, int | np.integer):
        raise ConfigError(f"num_partitions must be an int, got {num_partitions!r}")
    if not 1 <= num_partitions <= _MAX_PARTITIONS:
        raise ConfigError(
            f"num_partitions must be between 1 and {_MAX_PARTITIONS}, got {num_partitions}"
        )


def describe_record(batch: RecordBatch, index: int) -> str:
    """A record's Kafka coordinates, as a user would look it up."""
    return (
        f"topic {batch.topics[index]!r} partition {int(batch.partitions[index])} "
        f"offset {int(batch.offsets[index])}"
    )


def require_keys(batch: RecordBatch, partitioner: str) -> None:
    """Raise PartitioningError, naming the first keyless record, if any record has no key."""
    if bool(batch.has_key.all()):
        return
    keyless = np.flatnonzero(~batch.has_key)
    raise PartitioningError(
        f"partitioner {partitioner!r} replays by the stored key hash, but "
        f"{len(keyless)} of {len(batch)} records have no key (first: "
        f"{describe_record(batch, int(keyless[0]))}); replay an unkeyed source with "
        "'forward' or 'rebalance'"
    )
