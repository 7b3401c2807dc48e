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
that did not change). "replay" is absent with FT off. Offsets are >= 0: the markers
EARLIEST (-2) and LATEST (-1) belong to the startingOffsets option, never to a
position.

`Position.parse` is the one parser of that form and `Position.to_json` its one
formatter; `offsets_to_json` / `offsets_from_json` do the same for bare Kafka offsets
({topic: {partition: offset}}, e.g. the group offsets a checkpoint allows).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
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
    (None with FT off). Treat `kafka` as read-only: `offsets()` gives a copy to change."""

    kafka: Mapping[str, Mapping[int, int]]
    replay: int | None = None

    @classmethod
    def parse(cls, data: object, *, need_replay: bool = False, what: str = "") -> Position:
        """The position of its JSON form (an object, not text); PositionError naming
        what is wrong for anything else, including a missing "replay" when
        `need_replay` (a barrier of the FT layer always has one). `what` names the
        position's use in messages ("checkpoint": "bad checkpoint offset of ...")."""
        what = f"{what} " if what else ""
        if not isinstance(data, Mapping):
            raise PositionError(f"a {what}position is a JSON object, got {_shown(data)}")
        extra = sorted(str(k) for k in set(data) - {"kafka", "replay"})
        if extra:
            raise PositionError(f'a {what}position has only "kafka" and "replay", got also {extra}')
        if "kafka" not in data:
            raise PositionError(f'a {what}position needs "kafka", got {_shown(data)}')
        replay = data.get("replay")
        if replay is None:
            if need_replay or "replay" in data:
                raise PositionError(
                    f'a {what}position needs "replay" (the replay cursor), got {_shown(data)}'
                )
        elif isinstance(replay, bool) or not isinstance(replay, int) or replay < 0:
            raise PositionError(f'a {what}position\'s "replay" is an integer >= 0, got {replay!r}')
        return cls(_offsets(data["kafka"], what), replay)

    def to_json(self) -> dict[str, Any]:
        """The JSON form: partitions as strings, topics and partitions sorted."""
        data: dict[str, Any] = {"kafka": offsets_to_json(self.kafka)}
        if self.replay is not None:
            data["replay"] = self.replay
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
