"""Rewinding the partitions of an FT-layer shard that lost its store.

Each position of the ftkafka source names the store every shard's replay cursor counts
in (ftlayer.position, "stores"; a store's id is STATUS `store_id`, ftlayer.shards). A
shard that answers with another store than the query's position names lost its data
dir (it started empty), or was given another store (a savepoint restored in its
place): the incomplete records its old store held are gone from the FT layer. Kafka
still has them, from each partition's committed group offset on, since that offset
never passes an incomplete record (the checkpoints that allow it count the pending
records of the partition's own shard, .groups). So the driver (`SourceDriver.available`)

1. needs the consumer group (kafka.group.id): without one there is no offset to go
   back to, and the query stops with a SourceError naming the shard and the option;
2. reads the committed group offset of each of the shard's partitions. One ahead of
   the query's position is a SourceError (a group shared with another consumer); a
   partition with none goes back to the earliest offset Kafka holds, with a warning
   (the query never completed a checkpoint of it);
3. registers the query's sources with the new store;
4. ends the next batch at those offsets for the shard's partitions, with the new
   store's id and the new store's replay start as the shard's cursor. A position may so
   go back: a batch whose end offset of a partition is below its start reads nothing of
   that partition, and a batch whose start and end name different stores of a shard
   takes in none of that shard's replays (`replay_bounds`; both in
   `FTKafkaStreamReader.partitions`). The batch after it reads
   the shard's partitions from their group offsets on, and its replays from the new
   store's start.

What is read again: of each of the shard's partitions, the records from its committed
group offset g to the query's position S, [g, S). Each of them was either pending in
the lost store (its tree incomplete, in an open batch range, or failed and waiting for
its retry or replay) or complete but not yet covered by a group commit, which trails
completion by about one batch (it is made when the next batch is planned). So a rewind
reads again at most what the shard had pending plus what completed after its
partitions' last commit: `Rewind.reread`, logged, and visible in Spark's progress as a
batch whose endOffset is below its startOffset. Nothing else is read again: the other
shards' partitions go on.

What the lost store held and Kafka does not is gone: the retry counts of its failed
records (a record read again starts from no retries), its dead letters not yet
delivered (a poison record read again fails again, and is dead-lettered again), and
the bytes of failed records copied in from Kafka (read from Kafka again).

Barrier checkpoints never mix stores: `SourceDriver.checkpoint` sends a shard only the
part of a barrier that names its current store, and does not complete there a barrier
of its old store (its group offsets would pass the records read again); a reply counts
only if it came over a connection whose store was checked (`ShardClients.store_on`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kafka import TopicPartition

from ftlayer.errors import SourceError
from ftlayer.position import KafkaOffsets, Position, offsets_to_json

__all__ = ["Rewind", "no_group", "plan_rewind", "replay_bounds", "same_stores"]


@dataclass(frozen=True, slots=True)
class Rewind:
    """Shard `shard`'s partitions going back to their committed group offsets, because
    it serves store `store` instead of `was`."""

    shard: int
    was: str
    store: str
    offsets: KafkaOffsets
    """Where each of the shard's partitions goes back to."""
    reread: int
    """The records read again: over the shard's partitions, position - group offset."""
    cursor: int
    """The shard's replay cursor in the new store: where its replays start."""
    without_commit: tuple[str, ...] = ()
    """The partitions (topic-p) with no committed offset, sent back to Kafka's earliest."""

    def describe(self, where: str) -> str:
        """What the rewind does and costs, as the driver logs it."""
        earliest = (
            f"; with no committed offset, from the earliest: {', '.join(self.without_commit)}"
            if self.without_commit
            else ""
        )
        return (
            f"{where} serves another store (store id {self.store}, was {self.was}): its "
            "data dir was lost or replaced. Its partitions go back to their committed group "
            f"offsets {offsets_to_json(self.offsets)} and read {self.reread} records again "
            "(each pending in the lost store, or completed after its partition's last "
            "commit); the retry counts and undelivered dead letters of the lost store are "
            f"gone{earliest}"
        )


def no_group(where: str, store: str, was: str) -> SourceError:
    """The error of a lost store when the query has no consumer group (step 1)."""
    return SourceError(
        f"{where} serves another store than this query's position names (store id "
        f"{store}, was {was}): its data dir was lost or replaced, and the records it held "
        "of its partitions with it; Kafka still has them from the partitions' committed "
        "group offsets on, but this query has no consumer group to go back to (set "
        "kafka.group.id)"
    )


def plan_rewind(
    shard: int,
    was: str,
    store: str,
    cursor: int,
    position: Mapping[str, Mapping[int, int]],
    committed: Mapping[TopicPartition, int | None],
    earliest: Mapping[str, Mapping[int, int]],
    where: str,
) -> Rewind:
    """The rewind of shard `shard`'s partitions (`position`: the query's offsets of
    those partitions) to their `committed` group offsets, or to `earliest` for those
    with none; SourceError naming the partition for a committed offset ahead of the
    query's (module docstring, step 2)."""
    offsets: KafkaOffsets = {}
    reread = 0
    without: list[str] = []
    for topic, partitions in sorted(position.items()):
        for p, at in sorted(partitions.items()):
            group = committed.get(TopicPartition(topic, p))
            if group is None:
                without.append(f"{topic}-{p}")
                group = min(earliest[topic][p], at)
            elif group > at:
                raise SourceError(
                    f"{where} lost its store, and the group offset of {topic}-{p} "
                    f"({group}) is ahead of this query's offset ({at}): another consumer "
                    "commits offsets under this query's kafka.group.id, so the records "
                    "the lost store held cannot be found again; give the query a group "
                    "of its own"
                )
            offsets.setdefault(topic, {})[p] = group
            reread += at - group
    return Rewind(shard, was, store, offsets, reread, cursor, tuple(without))


def same_stores(first: Position, then: Position) -> tuple[bool, ...]:
    """Per shard: do the two positions' cursors count in the same store (True where
    either names none)?"""
    count = len(then.cursors or first.cursors or (0,))
    if first.stores is None or then.stores is None:
        return (True,) * count
    return tuple(a == b for a, b in zip(first.stores, then.stores, strict=True))


def replay_bounds(first: Position, barrier: Position) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The replay cursors (lo, hi] a batch from `first` to `barrier` takes in of each
    shard: none of a shard whose store changed between the two (its cursors count in
    different stores)."""
    hi = barrier.cursors or (0,)
    lo = hi if first.cursors is None else first.cursors
    same = same_stores(first, barrier)
    return tuple(a if kept else b for a, b, kept in zip(lo, hi, same, strict=True)), hi
