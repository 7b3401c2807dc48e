"""Find one record: where it is in the FT layer, what happened to it, and `ftlayer inspect`.

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
(docs/protocol.md) and `ftlayer inspect` shows it:

    ftlayer inspect --server HOST:PORT (--root R | --topic T --partition P --offset O)
                    [--token-file F] [--tls-ca CA] [--json]

R is the root as `ftlayer` logs print it (0x...), in decimal, or as Spark's `ft_root`
column shows it (a signed 64-bit integer). By coordinates several records may match:
a batch that Spark ran again persisted its records a second time under other roots,
and two queries may read one topic.
"""

from __future__ import annotations

import argparse
import datetime as dt
import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from ftlayer.errors import ConfigError

if TYPE_CHECKING:
    from ftlayer.client import FTClient

__all__ = [
    "INSPECT_PAYLOAD_BYTES",
    "InspectedRecord",
    "Inspection",
    "RecordQuery",
    "RecordState",
    "add_parser",
    "run",
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
            raise ValueError(
                "look a record up by its root, or by its topic, partition and offset "
                f"(all three), got {self.to_json()}"
            )
        if by_root and not (_is_int(self.root) and 0 <= int(self.root or 0) <= _U64_MAX):
            raise ValueError(f"a root is an unsigned 64-bit integer, got {self.root!r}")
        if not by_root and not (
            isinstance(self.topic, str)
            and _is_int(self.partition)
            and 0 <= int(self.partition or 0) < 1 << 31
            and _is_int(self.offset)
            and _I64_MIN <= int(self.offset or 0) < 1 << 63
        ):
            raise ValueError(
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
        """Strict: ValueError naming what is wrong."""
        if not isinstance(data, Mapping) or set(data) not in (
            {"root"},
            {"topic", "partition", "offset"},
        ):
            raise ValueError(
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
        """Strict: ValueError naming what is wrong."""
        try:
            if not isinstance(data, Mapping):
                raise TypeError(f"not an object: {type(data).__name__}")
            history = data["history"]
            if history is not None and not isinstance(history, dict):
                raise TypeError(f"history is not an object: {history!r}")
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
            raise ValueError(f"bad inspected record {str(data)[:300]}: {exc}") from None


def _int(value: Any) -> int:
    if not _is_int(value):
        raise TypeError(f"{value!r} is not an integer")
    return int(value)


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{value!r} is not a string")
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
        """Strict: ValueError naming what is wrong. `payloads`: the records' payloads,
        in order (the reply's bytes)."""
        if not isinstance(data, Mapping) or set(data) != {"query", "records", "retired"}:
            raise ValueError(f"an inspection has query, records and retired: {str(data)[:200]}")
        records = data["records"]
        if not isinstance(records, list) or not isinstance(data["retired"], bool):
            raise ValueError(f"bad inspection {str(data)[:200]}")
        payloads = payloads if payloads is not None else [b""] * len(records)
        if len(payloads) != len(records):
            raise ValueError(f"{len(records)} records but {len(payloads)} payloads")
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


# ---- ftlayer inspect ---------------------------------------------------------------------


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "inspect", help="find one record: where it is, its attempts, causes, size and key"
    )
    parser.add_argument("--server", required=True, help="HOST:PORT of the FT-layer server")
    parser.add_argument("--token-file", default=None, help="file holding the auth token")
    parser.add_argument("--tls-ca", default=None, help="TLS, trusting this CA file")
    parser.add_argument(
        "--root", default=None, help="its root: 0x hex, decimal, or Spark's signed ft_root"
    )
    parser.add_argument(
        "--topic", default=None, help="its Kafka topic (with --partition, --offset)"
    )
    parser.add_argument("--partition", type=int, default=None, help="its Kafka partition")
    parser.add_argument("--offset", type=int, default=None, help="its Kafka offset")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")


def parse_root(text: str) -> int:
    """A root as the logs (0x...), a user (decimal) or Spark's ft_root column (a signed
    int64) write it; ConfigError otherwise."""
    try:
        value = int(text, 0)
    except ValueError:
        raise ConfigError(f"--root takes 0x hex or a decimal integer, got {text!r}") from None
    if _I64_MIN <= value < 0:
        value += 1 << 64  # ft_root holds the u64's bits as a signed int64
    if not 0 <= value <= _U64_MAX:
        raise ConfigError(f"a root is a 64-bit integer, got {text!r}")
    return value


def query_of(args: argparse.Namespace) -> RecordQuery:
    coordinates = (args.topic, args.partition, args.offset)
    if args.root is not None and any(c is not None for c in coordinates):
        raise ConfigError("give --root, or --topic, --partition and --offset: not both")
    if args.root is not None:
        return RecordQuery(root=parse_root(args.root))
    if any(c is None for c in coordinates):
        raise ConfigError("give --root, or all of --topic, --partition and --offset")
    try:
        return RecordQuery(topic=args.topic, partition=args.partition, offset=args.offset)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def run(args: argparse.Namespace, client: FTClient) -> int:
    """`ftlayer inspect` on a connected client: a readable report, or one JSON object
    last (with the record's key decoded where its payload is an ftkafka one)."""
    found = client.inspect(query_of(args))
    if args.json:
        out = found.to_json()
        out["verdict"] = found.verdict
        for shown, record in zip(out["records"], found.records, strict=True):
            shown.update(_key_of(record))
        print(json.dumps(out, sort_keys=True))
    else:
        print(describe(found))
    return 0


def _key_of(record: InspectedRecord) -> dict[str, Any]:
    """The Kafka key and timestamp from an ftkafka payload: key (utf-8 text, else
    hex), key_bytes, timestamp_ms; {"key_error": why} for a payload that is not one."""
    from ftlayer.errors import SourceError
    from ftlayer.integration.source.payloads import decode_key

    try:
        key, timestamp_ms = decode_key(record.payload)
    except SourceError as exc:
        return {"key_error": str(exc)}
    if key is None:
        return {"key": None, "key_bytes": None, "timestamp_ms": timestamp_ms}
    try:
        text = key.decode("utf-8")
    except UnicodeDecodeError:
        text = "0x" + key.hex()
    return {"key": text, "key_bytes": len(key), "timestamp_ms": timestamp_ms}


def _when(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return dt.datetime.fromtimestamp(seconds, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


_STATE_TEXT: Final = {
    RecordState.PENDING: "pending: its tree is in flight",
    RecordState.QUEUED: "queued for replay",
    RecordState.WAITING: "waiting for its backoff before it is replayed",
    RecordState.DEAD_LETTER: "dead-lettered: its retries are spent",
}


def describe(found: Inspection) -> str:
    """The readable report of `ftlayer inspect`."""
    asked = found.query.describe()
    if not found.records:
        if found.retired:
            return (
                f"{asked}: failed recently; its record goes on under a new root "
                "(inspect it by its topic, partition and offset)"
            )
        return (
            f"{asked}: unknown or completed (the FT layer holds no such record: its tree "
            "completed, or it never reached this FT layer)"
        )
    lines = [f"{asked}: {len(found.records)} records found"] if len(found.records) > 1 else []
    for record in found.records:
        lines += _describe_record(record)
    return "\n".join(lines)


def _describe_record(record: InspectedRecord) -> list[str]:
    key = _key_of(record)
    if "key_error" in key:
        key_text = f"key not readable ({key['key_error']})"
    elif key["key"] is None:
        key_text = "no key"
    else:
        key_text = f"key {key['key']!r} ({key['key_bytes']} bytes)"
    lines = [
        f"record {record.topic}-{record.partition} offset {record.offset} "
        f"(source {record.source_id}, seq {record.seq}): {_STATE_TEXT[record.state]}",
        f"  root {record.root:#x}" if record.root else "  no root (a dead letter's tree is over)",
        f"  payload {record.payload_bytes:,} bytes, {key_text}",
    ]
    if record.state is RecordState.QUEUED:
        parts = ", ".join(str(p) for p in record.replay_partitions)
        lines.append(
            f"  replay seq {record.replay_seq} for partition(s) {parts}, "
            f"queued since {_when(record.queued_since)}"
        )
    if record.state is RecordState.WAITING:
        lines.append(f"  replayed after {_when(record.due)}")
    if record.barrier_hold:
        lines.append("  held at its batch's barrier: completes when that batch is done")
    history = record.history
    if history is None:
        lines.append("  never failed")
        return lines
    attempts = history["attempts"]
    lines.append(
        f"  {attempts} failed attempt{'' if attempts == 1 else 's'}, "
        f"first {_when(history['first_failed'])}, "
        f"last {_when(history['last_failed'])}"
        + (f", dead since {_when(history['dead_at'])}" if history.get("dead_at") else "")
        + (f", requeued {history['requeued']} times" if history.get("requeued") else "")
    )
    for n, cause in enumerate(history["causes"], start=1):
        if n == 5 and history.get("omitted"):
            lines.append(f"    ... {history['omitted']} failures not kept ...")
        text = cause["kind"] + (" (final)" if cause.get("final") else "")
        if cause["step"]:
            text += f" in {cause['step']}"
        if cause["error"]:
            text += f": {cause['error']}"
        lines.append(f"    {_when(cause['at'])}  {text}")
    return lines
