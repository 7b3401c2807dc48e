"""Replay partitioners: where a replayed record re-enters the pipeline.

A failed record is replayed into the source partition its original would be sent to,
so it meets the same task and the same keyed state (see `base` for the contract,
`strategies` for each partitioner and what it guarantees after a rescale,
`key_hashes` for the key hash a source stores with each record, and `key_groups` for
rescaling-safe placement). Create partitioners by name with `create_partitioner`.
"""

from .base import ReplayPartitioner, SingleTargetPartitioner, Targets
from .factory import PARTITIONER_NAMES, create_partitioner
from .key_groups import (
    DEFAULT_MAX_PARALLELISM,
    assign_key_groups,
    key_group_of,
    key_group_partitions,
    key_group_range,
)
from .key_hashes import (
    check_spark_hash_seed,
    kafka_key_hash,
    kafka_key_hashes,
    spark_key_hash,
    spark_key_hashes,
)
from .strategies import (
    BroadcastPartitioner,
    ForwardPartitioner,
    GlobalPartitioner,
    KafkaHashPartitioner,
    KeyGroupPartitioner,
    RebalancePartitioner,
    SparkHashPartitioner,
)

__all__ = [
    "DEFAULT_MAX_PARALLELISM",
    "PARTITIONER_NAMES",
    "BroadcastPartitioner",
    "ForwardPartitioner",
    "GlobalPartitioner",
    "KafkaHashPartitioner",
    "KeyGroupPartitioner",
    "RebalancePartitioner",
    "ReplayPartitioner",
    "SingleTargetPartitioner",
    "SparkHashPartitioner",
    "Targets",
    "assign_key_groups",
    "check_spark_hash_seed",
    "create_partitioner",
    "kafka_key_hash",
    "kafka_key_hashes",
    "key_group_of",
    "key_group_partitions",
    "key_group_range",
    "spark_key_hash",
    "spark_key_hashes",
]
