"""The ftkafka query's consumer group (kafka.group.id): the driver commits its offsets
and reads them back.

A committed offset mirrors the query's progress for tools that watch consumer lag, and
it is where a shard's partitions go back to when the shard lost its store (.rewind): it
never passes an incomplete record, since the checkpoints that allow it count the
pending records of the partition's own shard. `commit` therefore only moves an offset
forward, and a failed commit is logged and retried at the next one: the query's own
progress is in Spark's checkpoint, the group offsets only mirror it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Final

from kafka import KafkaConsumer, TopicPartition
from kafka.errors import KafkaError
from kafka.structs import OffsetAndMetadata

from ftlayer.position import KafkaOffsets

from .kafkaread import close_consumer
from .options import SourceOptions

__all__ = ["ConsumerGroup"]

log = logging.getLogger("ftlayer.source")

_REQUEST_TIMEOUT_MS: Final = 6000
# Connection settings the group's consumer shares with the reading consumers.
SECURITY: Final = frozenset(
    k for k in KafkaConsumer.DEFAULT_CONFIG if k.startswith(("ssl_", "sasl_", "security_"))
)


class ConsumerGroup:
    """The committed offsets of the consumer group kafka.group.id (one consumer,
    made on first use, that never joins the group: it only commits and reads)."""

    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        self._consumer: Any = None
        self._committed: dict[tuple[str, int], int] = {}

    def commit(self, target: Mapping[str, Mapping[int, int]]) -> KafkaOffsets:
        """Commit these offsets where they move forward; returns what it committed (a
        failure is logged and commits nothing: the next commit tries again)."""
        commits = {
            TopicPartition(t, p): offset
            for t, partitions in target.items()
            for p, offset in partitions.items()
            if offset > self._committed.get((t, p), -1)
        }
        if not commits:
            return {}
        try:
            self._client().commit(
                offsets={tp: OffsetAndMetadata(o, "", -1) for tp, o in commits.items()}
            )
        except (KafkaError, OSError) as exc:
            log.warning(
                "could not commit offsets of group %r (retried at the next batch): %r",
                self.options.group_id,
                exc,
            )
            self.close()
            return {}
        for tp, offset in commits.items():
            self._committed[(tp.topic, tp.partition)] = offset
        return _by_topic(commits)

    def committed(self, tps: Sequence[TopicPartition]) -> dict[TopicPartition, int | None]:
        """The group's committed offset of each partition (None: it has none). Kafka
        errors propagate (the caller retries)."""
        try:
            consumer = self._client()
            return {tp: consumer.committed(tp) for tp in tps}
        except BaseException:
            self.close()
            raise

    def _client(self) -> Any:
        if self._consumer is None:
            self._consumer = KafkaConsumer(
                bootstrap_servers=self.options.bootstrap,
                group_id=self.options.group_id,
                enable_auto_commit=False,
                request_timeout_ms=_REQUEST_TIMEOUT_MS,
                **{k: v for k, v in self.options.kafka_config.items() if k in SECURITY},
            )
        return self._consumer

    def close(self) -> None:
        consumer, self._consumer = self._consumer, None
        close_consumer(consumer)


def _by_topic(found: Mapping[TopicPartition, int]) -> KafkaOffsets:
    offsets: KafkaOffsets = {}
    for tp, offset in found.items():
        offsets.setdefault(tp.topic, {})[tp.partition] = int(offset)
    return offsets
