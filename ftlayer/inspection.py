"""Find one record: where it is in the FT layer and what happened to it.

A record the FT layer holds is in exactly one of four states (`RecordState`):

- `pending`: its tree is in flight under its root (read by its source, or a replay
  whose queue entry a checkpoint already pruned);
- `queued`: in the replay queue under a replay seq, for the partition(s) its replay
  partitioner chose; it stays there until the checkpoint of the batch that took it in
  prunes it, so a replay being processed right now is still `queued`;
- `waiting`: failed, waiting for its backoff to end (`due`) before it is queued;
- `dead-letter`: its retries are spent; it stays stored until delivered or purged.

A record found in none of them completed (its tree's ack value returned to 0 and it
was deleted) or never reached this FT layer: "unknown or completed". A root that failed
recently (the FT layer's retired roots) is reported as such: its record goes on under
a new root, found by its Kafka coordinates.

`FTLayer.inspect` finds records by root (the pending table) or by Kafka coordinates
(topic, partition, offset: every pending root and every dead letter, O(pending +
dead letters), a diagnostic's price); the INSPECT request carries it over the wire
(docs/protocol.md) and `ftlayer inspect` (ftlayer.cli.inspect) shows it. By
coordinates several records may match: a batch that Spark ran again persisted its
records a second time under other roots, and two queries may read one topic.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from ftlayer.errors import ConfigError, CorruptData

__all__ = [
    "INSPECT_PAYLOAD_BYTES",
    "InspectedRecord",
    "Inspection",
    "RecordQuery",
    "RecordState",
]

INSPECT_PAYLOAD_BYTES: Final = 64 * 1024
"""An INSPECT reply carries at most this many bytes of each record's payload (its
start, where the ftkafka payload codec keeps the key); `payload_bytes` is the whole size."""
_U64_MAX: Final = (1 << 64) - 1
_I64_MIN: Final = -(1 << 63)


class RecordState(enum.StrEnum):
    """Where a record the FT layer holds is (module docstring)."""

    PENDING = "pending"
    QUEUED = "queued"
    WAITING = "waiting"
    DEAD_LETTER = "dead-letter"


@dataclass(frozen=True, slots=True)
class RecordQuery:
    """What to look for: a root, or Kafka coordinates (topic, partition, offset)."""

    root: int | None = None
    topic: str | None = None
    partition: int | None = None
    offset: int | None = None

    def __post_init__(self) -> None:
        by_root = self.root is not None
        coordinates = (self.topic, self.partition, self.offset)
        if by_root == any(c is not None for c in coordinates) or (
            not by_root and any(c is None for c in coordinates)
        ):
            raise ConfigError(
                "look a record up by its root, or by its topic, partition and offset "
                f"(all three), got {self.to_json()}"
            )
        if by_root and not (_is_int(self.root) and 0 <= int(self.root or 0) <= _U64_MAX):
            raise ConfigError(f"a root is an unsigned 64-bit integer, got {self.root!r}")
        if not by_root and not (
            isinstance(self.topic, str)
            and _is_int(self.partition)
            and 0 <= int(self.partition or 0) < 1 << 31
            and _is_int(self.offset)
            and _I64_MIN <= int(self.offset or 0) < 1 << 63
        ):
            raise ConfigError(
                "Kafka coordinates are a topic (str), a partition (0 .. 2**31-1) and an "
                f"offset (int64), got {self.to_json()}"
            )

    @property
    def by_root(self) -> bool:
        return self.root is not None

    def to_json(self) -> dict[str, Any]:
        if self.root is not None:
            return {"root": self.root}
        return {"topic": self.topic, "partition": self.partition, "offset": self.offset}

    @classmethod
    def from_json(cls, data: Any) -> RecordQuery:
        """Strict: ConfigError naming what is wrong."""
        if not isinstance(data, Mapping) or set(data) not in (
            {"root"},
            {"topic", "partition", "offset"},
        ):
            raise ConfigError(
                'a record query is {"root": u64} or {"topic": str, "partition": int, '
                f'"offset": int}}, got {str(data)[:200]}'
            )
        return cls(**dict(data))

    def describe(self) -> str:
        if self.root is not None:
            return f"root {self.root:#x}"
        return f"{self.topic}-{self.partition} offset {self.offset}"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class InspectedRecord:
    """One stored record as the FT layer knows it. `history` is its retry record
    (ftlayer.core.retries.RetryRecord's JSON form: attempts, failure times, causes,
    due, dead_at, requeued), None if it never failed. `payload` is its stored payload,
    cut to INSPECT_PAYLOAD_BYTES over the wire; `payload_bytes` the whole size."""

    state: RecordState
    root: int
    """The root its tree runs under now (0 for a dead letter)."""
    seq: int
    """Its storage seq (what `ftlayer dead-letters` names a dead letter by)."""
    source_id: int
    topic: str
    partition: int
    offset: int
    payload_bytes: int
    has_key: bool
    key_hash: int
    replay_seq: int | None = None
    """`queued`: its replay seq (a batch from S to E takes it in if S.replay < it <= E.replay)."""
    replay_partitions: tuple[int, ...] = ()
    """`queued`: the partition(s) it re-enters."""
    queued_since: float | None = None
    """`queued`: when it entered the queue, as far as its history tells (its last
    failure, or the end of its backoff); None without a history (recovery)."""
    due: float | None = None
    """`waiting`: when its backoff ends (wall clock)."""
    barrier_hold: bool = False
    """Held at the barrier of the batch that carries it (ft.completion=barrier): it
    completes when that batch is done."""
    history: dict[str, Any] | None = None
    payload: bytes = field(default=b"", repr=False)

    def to_json(self) -> dict[str, Any]:
        """Every field but the payload (which travels as bytes)."""
        return {
            "state": self.state.value,
            "root": self.root,
            "seq": self.seq,
            "source_id": self.source_id,
            "topic": self.topic,
            "partition": self.partition,
            "offset": self.offset,
            "payload_bytes": self.payload_bytes,
            "has_key": self.has_key,
            "key_hash": self.key_hash,
            "replay_seq": self.replay_seq,
            "replay_partitions": list(self.replay_partitions),
            "queued_since": self.queued_since,
            "due": self.due,
            "barrier_hold": self.barrier_hold,
            "history": self.history,
        }

    @classmethod
    def from_json(cls, data: Any, payload: bytes = b"") -> InspectedRecord:
        """Strict: CorruptData naming what is wrong."""
        try:
            if not isinstance(data, Mapping):
                raise CorruptData(f"not an object: {type(data).__name__}")
            history = data["history"]
            if history is not None and not isinstance(history, dict):
                raise CorruptData(f"history is not an object: {history!r}")
            replay_seq, queued_since, due = data["replay_seq"], data["queued_since"], data["due"]
            return cls(
                state=RecordState(data["state"]),
                root=_int(data["root"]),
                seq=_int(data["seq"]),
                source_id=_int(data["source_id"]),
                topic=_str(data["topic"]),
                partition=_int(data["partition"]),
                offset=_int(data["offset"]),
                payload_bytes=_int(data["payload_bytes"]),
                has_key=bool(data["has_key"]),
                key_hash=_int(data["key_hash"]),
                replay_seq=None if replay_seq is None else _int(replay_seq),
                replay_partitions=tuple(_int(p) for p in data["replay_partitions"]),
                queued_since=None if queued_since is None else float(queued_since),
                due=None if due is None else float(due),
                barrier_hold=bool(data["barrier_hold"]),
                history=history,
                payload=payload,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptData(f"bad inspected record {str(data)[:300]}: {exc}") from None


def _int(value: Any) -> int:
    if not _is_int(value):
        raise CorruptData(f"{value!r} is not an integer")
    return int(value)


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise CorruptData(f"{value!r} is not a string")
    return value


@dataclass(frozen=True, slots=True)
class Inspection:
    """What the FT layer found for a query: the records (none: unknown or completed),
    and, for a root it does not hold, whether that root failed recently (`retired`:
    its record goes on under a new root)."""

    query: RecordQuery
    records: tuple[InspectedRecord, ...] = ()
    retired: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "query": self.query.to_json(),
            "records": [r.to_json() for r in self.records],
            "retired": self.retired,
        }

    @classmethod
    def from_json(cls, data: Any, payloads: Sequence[bytes] | None = None) -> Inspection:
        """Strict: CorruptData naming what is wrong. `payloads`: the records' payloads,
        in order (the reply's bytes)."""
        if not isinstance(data, Mapping) or set(data) != {"query", "records", "retired"}:
            raise CorruptData(f"an inspection has query, records and retired: {str(data)[:200]}")
        records = data["records"]
        if not isinstance(records, list) or not isinstance(data["retired"], bool):
            raise CorruptData(f"bad inspection {str(data)[:200]}")
        payloads = payloads if payloads is not None else [b""] * len(records)
        if len(payloads) != len(records):
            raise CorruptData(f"{len(records)} records but {len(payloads)} payloads")
        return cls(
            RecordQuery.from_json(data["query"]),
            tuple(InspectedRecord.from_json(r, p) for r, p in zip(records, payloads, strict=True)),
            data["retired"],
        )

    @property
    def verdict(self) -> str:
        """One word for scripts: the state of the record found, "several" (more than
        one record matched), "retired" or "unknown or completed"."""
        if len(self.records) == 1:
            return self.records[0].state.value
        if self.records:
            return "several"
        return "retired" if self.retired else "unknown or completed"
