"""The replay partitioners, one per way a source can partition its records.

| name       | a replayed record goes to                                   | needs a key |
|------------|-------------------------------------------------------------|-------------|
| forward    | the partition its original entered (`batch.partitions`)    | no          |
| kafka-hash | (key_hash & 0x7fffffff) % n: Kafka's default partitioner    | yes         |
| spark-hash | key_hash % n, never negative: PySpark's RDD.partitionBy     | yes         |
| rebalance  | the next partition round robin, continuing across calls     | no          |
| broadcast  | every partition, once each                                  | no          |
| global     | partition 0                                                 | no          |
| key-group  | the owner of its key group (see key_groups)                 | yes         |

With the partition count unchanged, forward, kafka-hash, spark-hash and key-group all
send a record back where its original went (for the hash flavours, provided the source
stored the matching key hash, see key_hashes). They differ after a rescale:

- forward refuses: a record whose original partition no longer exists raises
  PartitioningError naming it. Folding it onto another partition (modulo) would put it
  beside state that is not its own; a job that rescales should use key-group.
- kafka-hash and spark-hash send the record where the producer / partitionBy would send
  its key at the new count, i.e. beside the new records of the same key.
- key-group moves it with its key group, so key-partitioned state moves with it.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from ftlayer.errors import ConfigError, PartitioningError
from ftlayer.records import RecordBatch

from .base import (
    ReplayPartitioner,
    SingleTargetPartitioner,
    Targets,
    describe_record,
    require_keys,
)
from .key_groups import (
    DEFAULT_MAX_PARALLELISM,
    assign_key_groups,
    check_max_parallelism,
    key_group_partitions,
)


class ForwardPartitioner(SingleTargetPartitioner):
    """Back to the partition the original entered; PartitioningError if it no longer exists."""

    name = "forward"

    def check_routable(self, batch: RecordBatch, num_partitions: int) -> None:
        self.partition_of(batch, num_partitions)

    def _partition_of(self, batch: RecordBatch, num_partitions: int) -> NDArray[np.int32]:
        partitions = batch.partitions
        gone = (partitions < 0) | (partitions >= num_partitions)
        if bool(gone.any()):
            lost = np.flatnonzero(gone)
            raise PartitioningError(
                f"partitioner 'forward' cannot replay {len(lost)} of {len(batch)} records: "
                f"their original partition is not in [0, {num_partitions}) (first: "
                f"{describe_record(batch, int(lost[0]))}); use 'key-group' for a job whose "
                "partition count changes"
            )
        return partitions.astype(np.int32, copy=True)


class KafkaHashPartitioner(SingleTargetPartitioner):
    """Kafka's default partitioner on the stored murmur2 hash: (h & 0x7fffffff) % n.

    Only the low 31 bits of the stored hash matter, as in Java's `Utils.toPositive`.
    """

    name = "kafka-hash"
    requires_key = True

    def _partition_of(self, batch: RecordBatch, num_partitions: int) -> NDArray[np.int32]:
        require_keys(batch, self.name)
        return ((batch.key_hashes & 0x7FFFFFFF) % num_partitions).astype(np.int32)


class SparkHashPartitioner(SingleTargetPartitioner):
    """PySpark's RDD.partitionBy on the stored portable_hash: h % n, never negative."""

    name = "spark-hash"
    requires_key = True

    def _partition_of(self, batch: RecordBatch, num_partitions: int) -> NDArray[np.int32]:
        require_keys(batch, self.name)
        # numpy's % takes the divisor's sign, as Python's does, so this is non-negative.
        return (batch.key_hashes % num_partitions).astype(np.int32)


class RebalancePartitioner(SingleTargetPartitioner):
    """Round robin: record i of a call goes to (position + i) % n; the position carries over.

    `position` is `start` plus the number of records placed so far. Over any sequence of
    calls with the same n, partition counts differ by at most one. Pass `position` back
    as `start` to resume the rotation (e.g. after recovery).
    """

    name = "rebalance"

    def __init__(self, start: int = 0) -> None:
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ConfigError(f"rebalance start must be an int >= 0, got {start!r}")
        self._position = start

    @property
    def position(self) -> int:
        return self._position

    def _partition_of(self, batch: RecordBatch, num_partitions: int) -> NDArray[np.int32]:
        begin = self._position % num_partitions
        partitions = (np.arange(len(batch), dtype=np.int64) + begin) % num_partitions
        self._position += len(batch)
        return partitions.astype(np.int32)

    def __repr__(self) -> str:
        return f"RebalancePartitioner(start={self._position})"


class BroadcastPartitioner(ReplayPartitioner):
    """Every record to every partition: pairs (i, 0), (i, 1), ..., (i, n - 1) for each i."""

    name = "broadcast"

    def _targets(self, batch: RecordBatch, num_partitions: int) -> Targets:
        records = np.repeat(np.arange(len(batch), dtype=np.intp), num_partitions)
        partitions = np.tile(np.arange(num_partitions, dtype=np.int32), len(batch))
        return records, partitions


class GlobalPartitioner(SingleTargetPartitioner):
    """Every record to partition 0."""

    name = "global"

    def _partition_of(self, batch: RecordBatch, num_partitions: int) -> NDArray[np.int32]:
        return np.zeros(len(batch), dtype=np.int32)


class KeyGroupPartitioner(SingleTargetPartitioner):
    """To the owner of the record's key group; rescaling-safe (see key_groups).

    num_partitions must not exceed max_parallelism (ConfigError).
    """

    name = "key-group"
    requires_key = True

    def __init__(self, max_parallelism: int = DEFAULT_MAX_PARALLELISM) -> None:
        check_max_parallelism(max_parallelism)
        self.max_parallelism = max_parallelism

    def check_routable(self, batch: RecordBatch, num_partitions: int) -> None:
        """Also ConfigError when num_partitions exceeds max_parallelism: a record
        persisted then could never be replayed."""
        super().check_routable(batch, num_partitions)
        check_max_parallelism(self.max_parallelism, num_partitions)

    def _partition_of(self, batch: RecordBatch, num_partitions: int) -> NDArray[np.int32]:
        check_max_parallelism(self.max_parallelism, num_partitions)
        require_keys(batch, self.name)
        groups = assign_key_groups(batch.key_hashes, self.max_parallelism)
        return key_group_partitions(groups, self.max_parallelism, num_partitions)

    def __repr__(self) -> str:
        return f"KeyGroupPartitioner(max_parallelism={self.max_parallelism})"
