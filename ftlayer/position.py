"""A position: where a query stands in its input at a barrier.

A position holds, for every subscribed topic and partition, the Kafka offset of the
next record to read, and, with FT on, the replay cursor: the highest replay seq the
query has taken in. Micro-batch n runs between two positions S (its start, barrier
n - 1) and E (its end, barrier n) and covers

    the Kafka records S.kafka[t][p] <= offset < E.kafka[t][p] of every partition, and
    the replays S.replay < seq <= E.replay.

A partition E has and S has not starts empty (it appeared while the query ran).

One JSON form, everywhere a position crosses a boundary (Spark's offset log, the
CHECKPOINT requests, checkpoint records, savepoint manifests)::

    {"kafka": {"orders": {"0": 120, "1": 98}, "payments": {"0": 7}}, "replay": 42}

Partition numbers are strings (JSON object keys); topics and partitions are written in
sorted order, so equal positions have equal text (Spark runs no batch for an offset
that did not change). "replay" is absent with FT off.

With an FT layer of several shards (ftlayer.shards) each shard numbers its own replays,
so a query's position has one replay cursor per shard, in shard order, and a batch
takes in the replays S.replay[i] < seq <= E.replay[i] of every shard i::

    {"kafka": {"orders": {"0": 120, "1": 98}}, "replay": [42, 17]}

Only the ftkafka source's offsets have that form (`Position.parse(..., sharded=True)`);
each shard is sent its own part of a barrier (`Position.part`), whose cursor is a number.
The ftkafka source's offsets also name the store each cursor counts in, one store id
per shard ("stores", STATUS `store_id`): a shard whose store is not the one its cursor
counts in lost its data dir, and the source rewinds its partitions
(integration/source/rewind.py)::

    {"kafka": {"orders": {"0": 120}}, "replay": [42, 17],
     "stores": ["7dbf5e27e271f4e8", "0c1d2e3f40516273"]}

Offsets are >= 0: the markers EARLIEST (-2) and LATEST (-1) belong to the
startingOffsets option, never to a position.

`Position.parse` is the one parser of that form and `Position.to_json` its one
formatter; `offsets_to_json` / `offsets_from_json` do the same for bare Kafka offsets
({topic: {partition: offset}}, e.g. the group offsets a checkpoint allows).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from ftlayer.errors import PositionError

__all__ = [
    "EARLIEST",
    "LATEST",
    "KafkaOffsets",
    "Position",
    "PositionError",
    "offsets_from_json",
    "offsets_to_json",
]

EARLIEST: Final = -2
"""startingOffsets: the earliest offset Kafka holds."""
LATEST: Final = -1
"""startingOffsets: the end of the partition."""

KafkaOffsets = dict[str, dict[int, int]]
"""{topic: {partition: offset}}."""


@dataclass(frozen=True, slots=True)
class Position:
    """Kafka offsets of the next record per topic and partition, and the replay cursor
    (None with FT off, and with several shards: then `replays` has one per shard). Treat
    `kafka` as read-only: `offsets()` gives a copy to change."""

    kafka: Mapping[str, Mapping[int, int]]
    replay: int | None = None
    replays: tuple[int, ...] | None = None
    """The replay cursor of each shard, in shard order, with an FT layer of several."""
    stores: tuple[str, ...] | None = None
    """The store each shard's cursor counts in (its STATUS `store_id`), in shard order;
    only in the ftkafka source's offsets, and None in those a query wrote without."""

    def __post_init__(self) -> None:
        if self.replays is not None and (self.replay is not None or len(self.replays) < 2):
            raise PositionError(
                "a position has one replay cursor (`replay`) or one per shard of several "
                f"(`replays`), got replay={self.replay!r}, replays={self.replays!r}"
            )
        if self.stores is not None and len(self.stores) != len(self.cursors or ()):
            raise PositionError(
                f"a position names one store per replay cursor, got stores {self.stores!r} "
                f"for cursors {self.cursors!r}"
            )

    @classmethod
    def at(
        cls,
        kafka: Mapping[str, Mapping[int, int]],
        cursors: Sequence[int] | None,
        stores: Sequence[str] | None = None,
    ) -> Position:
        """The position at these offsets and replay cursors, one per shard (None: FT
        off), counted in these stores (one per shard, or None)."""
        named = None if stores is None else tuple(stores)
        if cursors is None:
            return cls(kafka, stores=named)
        if len(cursors) == 1:
            return cls(kafka, cursors[0], stores=named)
        return cls(kafka, None, tuple(cursors), named)

    @property
    def cursors(self) -> tuple[int, ...] | None:
        """The replay cursor of each shard (one for an FT layer of one shard); None with
        FT off."""
        if self.replays is not None:
            return self.replays
        return None if self.replay is None else (self.replay,)

    def part(self, kafka: Mapping[str, Mapping[int, int]], shard: int) -> Position:
        """Shard `shard`'s part of this position: the offsets `kafka` (of the partitions
        it owns) and its own replay cursor, the form every shard's CHECKPOINT takes."""
        cursors = self.cursors
        if cursors is None or not 0 <= shard < len(cursors):
            raise PositionError(f"a position with replay cursors {cursors} has no shard {shard}")
        return Position(kafka, cursors[shard])

    @classmethod
    def parse(
        cls, data: object, *, need_replay: bool = False, what: str = "", sharded: bool = False
    ) -> Position:
        """The position of its JSON form (an object, not text); PositionError naming
        what is wrong for anything else, including a missing "replay" when
        `need_replay` (a barrier of the FT layer always has one). `sharded`: "replay"
        may also be a list, a cursor per shard (the ftkafka source's offsets). `what`
        names the position's use in messages ("checkpoint": "bad checkpoint offset of
        ...")."""
        what = f"{what} " if what else ""
        if not isinstance(data, Mapping):
            raise PositionError(f"a {what}position is a JSON object, got {_shown(data)}")
        keys = ("kafka", "replay", "stores") if sharded else ("kafka", "replay")
        extra = sorted(str(k) for k in set(data) - set(keys))
        if extra:
            names = '"kafka", "replay" and "stores"' if sharded else '"kafka" and "replay"'
            raise PositionError(f"a {what}position has only {names}, got also {extra}")
        if "kafka" not in data:
            raise PositionError(f'a {what}position needs "kafka", got {_shown(data)}')
        replay = data.get("replay")
        stores = _stores(data, what)
        if replay is None:
            if need_replay or "replay" in data or stores is not None:
                raise PositionError(
                    f'a {what}position needs "replay" (the replay cursor), got {_shown(data)}'
                )
        elif sharded and isinstance(replay, list):
            if len(replay) < 2 or not all(_cursor(r) for r in replay):
                raise PositionError(
                    f'a {what}position\'s "replay" is an integer >= 0 or a list of one per '
                    f"shard of two or more, got {_shown(replay)}"
                )
            return cls(_offsets(data["kafka"], what), None, tuple(replay), stores)
        elif not _cursor(replay):
            raise PositionError(f'a {what}position\'s "replay" is an integer >= 0, got {replay!r}')
        return cls(_offsets(data["kafka"], what), replay, None, stores)

    def to_json(self) -> dict[str, Any]:
        """The JSON form: partitions as strings, topics and partitions sorted."""
        data: dict[str, Any] = {"kafka": offsets_to_json(self.kafka)}
        if self.replay is not None:
            data["replay"] = self.replay
        elif self.replays is not None:
            data["replay"] = list(self.replays)
        if self.stores is not None:
            data["stores"] = list(self.stores)
        return data

    def key(self) -> str:
        """The JSON text: equal positions, equal keys."""
        return json.dumps(self.to_json(), separators=(",", ":"))

    def offsets(self) -> KafkaOffsets:
        """A copy of the Kafka offsets, to change."""
        return {topic: dict(partitions) for topic, partitions in self.kafka.items()}

    def offset(self, topic: str, partition: int, default: int) -> int:
        return self.kafka.get(topic, {}).get(partition, default)


def offsets_to_json(offsets: Mapping[str, Mapping[int, int]]) -> dict[str, dict[str, int]]:
    """{topic: {"partition": offset}}, topics and partitions sorted."""
    return {
        topic: {str(p): offsets[topic][p] for p in sorted(offsets[topic])}
        for topic in sorted(offsets)
    }


def offsets_from_json(data: object) -> KafkaOffsets:
    """Kafka offsets of their JSON form; PositionError for anything else."""
    return _offsets(data, "")


def _offsets(data: object, what: str) -> KafkaOffsets:
    if not isinstance(data, Mapping):
        raise PositionError(
            f"Kafka offsets are an object {{topic: {{partition: offset}}}}, got {_shown(data)}"
        )
    offsets: KafkaOffsets = {}
    for topic, partitions in data.items():
        if not isinstance(topic, str) or not topic or not isinstance(partitions, Mapping):
            raise PositionError(f"bad {what}offsets of topic {topic!r}: {_shown(partitions)}")
        per_partition: dict[int, int] = {}
        for p, offset in partitions.items():
            number = _partition_number(p)
            if number is None or isinstance(offset, bool) or not isinstance(offset, int):
                raise PositionError(
                    f"bad {what}offset of {topic!r} partition {p!r}: {_shown(offset)}"
                )
            if offset < 0:
                raise PositionError(f"bad {what}offset of {topic}-{number}: {offset} is below 0")
            per_partition[number] = offset
        offsets[topic] = per_partition
    return offsets


def _stores(data: Mapping[Any, Any], what: str) -> tuple[str, ...] | None:
    """The "stores" of a position's JSON form (absent: None)."""
    if "stores" not in data:
        return None
    stores = data["stores"]
    if not isinstance(stores, list) or not all(isinstance(s, str) and s for s in stores):
        raise PositionError(
            f'a {what}position\'s "stores" is a list of store ids, one per shard, got '
            f"{_shown(stores)}"
        )
    return tuple(stores)


def _cursor(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _partition_number(p: object) -> int | None:
    if isinstance(p, bool):
        return None
    if isinstance(p, int):
        return p if p >= 0 else None
    if isinstance(p, str) and p.isdigit() and p.isascii():
        return int(p)
    return None


def _shown(value: object) -> str:
    """A value as an error message shows it: a huge one cut short."""
    text = repr(value)
    return text if len(text) <= 200 else f"{text[:200]}..."
