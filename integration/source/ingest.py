"""`ftingest`: a PySpark streaming source that reads what receivers stored in the FT
layer, for upstreams that cannot replay (NATS JetStream and core subjects, HTTP
webhooks, one's own; ftlayer.integration.receivers).

Usage::

    from ftlayer.integration.source import register
    register(spark)  # ftkafka and ftingest
    df = (spark.readStream.format("ftingest")
          .option("subscribe", "orders")        # the receivers' source name(s)
          .option("ft.address", "ft-host:7070")
          .load())

A receiver stores each record durably in the FT layer (INGEST) before it acknowledges
it upstream; from then on the FT layer's store holds the record's only copy. The record
waits in the FT layer's replay queue under a replay seq, routed to a partition by its
source's replay partitioner, exactly as a failed Kafka record waits for its replay.
ftingest is the ftkafka source with no Kafka part: its positions keep one empty Kafka
offset (0) per partition of each source and the replay cursors of the FT layer, a batch
takes in the records with S.replay < seq <= E.replay (deterministic: a batch that Spark
runs again reads the same records), one input partition per partition of the source,
and everything after the read is ftkafka's: anchoring, FTTasks, sinks, both completion
modes, retries, dead letters, barrier checkpoints, heartbeats, metrics, inspect and
savepoints. A record leaves the store when its tree completes. On an FT layer of
several shards (ft.address lists them, as the receivers were given them) a receiver
stores a record on any shard, and each input partition takes its records from every
shard (the replay cursor per shard, as ftkafka's replays).

The rows are ftkafka's (`source_schema`, no headers): key, value, topic (the upstream's
name the receiver gave, e.g. the JetStream stream or `http:<source>`), partition (the
input partition the partitioner chose), offset (the record's identity upstream, e.g.
its stream sequence; -1: none), timestamp (when the receiver took it), ft_root, ft_id.

Options are ftkafka's, with `subscribe` naming sources (not topics) and these
differences (`parse_options(..., ingest=True)`): ft.address is required; startingOffsets
is earliest only (a stored record is the only copy: a query never skips one); no Kafka
consumer option, no kafka.group.id, no includeHeaders, ft.persist or ft.replayColumn;
kafka.bootstrap.servers only with ft.deadLetterTopic (dead letters go to that topic;
without it they stay in the FT layer, `ftlayer dead-letters`). A source's partition
count and partitioner are fixed by its receivers when they register it: the query
takes the count from the FT layer, and its ft.partitioner must be the receivers'. Start
a receiver first: a query of a source nobody registered stops with a ConfigError.

Backpressure is the receivers' (`Receiver.has_room`): they stop taking at the query's
ft.maxPendingRecords, which the query registers with the source (`max_pending`), or at
their own --max-pending if lower; the query takes in every queued record, at most
maxOffsetsPerTrigger per batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from kafka import TopicPartition

from ftlayer.errors import ConfigError, SourceError
from ftlayer.position import KafkaOffsets, Position
from ftlayer.registration import SourceRegistration
from ftlayer.status import BriefStatus, Status

from .driver import SourceDriver, _whole_status
from .rewind import Rewind

__all__ = ["IngestDriver"]


class IngestDriver(SourceDriver):
    """The driver side of ftingest: SourceDriver with no Kafka (module docstring). Every
    Kafka offset is 0; the partition counts are the sources' registrations."""

    def start(self) -> None:
        self.shards.check_places()
        self._partition_counts = self._registered()
        self._register_sources()

    def _registered(self) -> dict[str, int]:
        """Each source's partition count, as its receivers registered it (and this
        query's partitioner theirs, unless ft.partitioner was given); ConfigError if
        no receiver registered a source, or with another partitioner than the option's,
        or the sources' receivers chose different partitioners."""
        status: Status = self.shards.call(0, "read the sources' registrations", _whole_status)
        counts: dict[str, int] = {}
        chosen: dict[str, Mapping[str, Any]] = {}
        for name, source_id in self.source_ids.items():
            known: Mapping[str, Any] | None = status.sources.get(str(source_id))
            if known is None:
                raise ConfigError(
                    f"option subscribe: no receiver registered source {name!r} with the FT "
                    f"layer at {self.shards.where(0)} (source id {source_id}): start its "
                    "receivers first (ftlayer ingest ...), they register it"
                )
            given = self.options.partitioner
            if given and known.get("partitioner") != given:
                raise ConfigError(
                    f"option ft.partitioner={given!r}: source {name!r} is registered by its "
                    f"receivers with {known.get('partitioner')!r}; give the same partitioner "
                    "(or leave the option out: the query takes the receivers')"
                )
            chosen[name] = known
            counts[name] = int(known["num_partitions"])
        kinds = {(k.get("partitioner"), str(k.get("options") or {})) for k in chosen.values()}
        if len(kinds) > 1:
            raise ConfigError(
                f"option subscribe: the sources' receivers chose different partitioners "
                f"({sorted(kinds)}): read them in queries of their own"
            )
        if not self.options.partitioner:
            known = next(iter(chosen.values()))
            self.options = dataclasses.replace(
                self.options,
                partitioner=str(known["partitioner"]),
                partitioner_options=dict(known.get("options") or {}),
            )
        return counts

    def _topic_partitions(self, check_exist: bool) -> dict[str, int]:
        # A source's partitions are fixed by its receivers: read once, at start.
        return dict(self._partition_counts) if not check_exist else self._registered()

    def _registration(self, topic: str) -> SourceRegistration:
        # The receivers stop taking at the query's ft.maxPendingRecords (or their own
        # --max-pending, if lower): flow control for a source the query cannot hold
        # back by offsets.
        registration = super()._registration(topic)
        return dataclasses.replace(registration, max_pending=self.options.max_pending_records)

    def _earliest(self, tps: list[TopicPartition]) -> KafkaOffsets:
        return _nothing(tps)

    def _ends(self, tps: list[TopicPartition]) -> KafkaOffsets:
        return _nothing(tps)

    def _rewind(self, first: Position, shard: int, was: str, status: BriefStatus) -> Rewind:
        raise SourceError(
            f"{self.shards.where(shard)} serves another store than this query's position "
            f"names (store id {status.store_id}, was {was}): its data dir was lost or "
            "replaced. The records receivers stored there and no batch completed were "
            "their only copy: they are lost. Run the FT layer on disks that survive "
            "(docs/deploy.md), and start a new query (a new checkpointLocation)"
        )

    def fill_failed(self, source_ids: list[int], shard: int | None = None) -> int:
        return 0  # every ingested record is stored with its bytes

    def _fill_behind(self, shard: int, status: BriefStatus) -> None:
        pass  # nothing to copy in, as above

    def commit_group(self, target: Mapping[str, Mapping[int, int]]) -> KafkaOffsets:
        return {}  # no consumer group (refused by the options)


def _nothing(tps: list[TopicPartition]) -> KafkaOffsets:
    """Offset 0 of every partition: ftingest reads no Kafka range."""
    offsets: KafkaOffsets = {}
    for tp in tps:
        offsets.setdefault(tp.topic, {})[tp.partition] = 0
    return offsets
