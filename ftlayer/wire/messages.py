"""The message bodies after the handshake (PERSIST, XOR, FAIL, FETCH_REPLAY, REPLAY,
REGISTER_SOURCE, the checkpoint and savepoint requests, HOLD, HEARTBEAT, SINK_HOLD,
SINK_SETTLE, STATUS, OK, ERROR): one type and one encoder/decoder pair per kind, and
`decode`, one table from kind to decoder."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ftlayer.causes import Cause, Causes, FailKind
from ftlayer.inspection import INSPECT_PAYLOAD_BYTES, Inspection, RecordQuery
from ftlayer.records import Payloads, RecordBatch, ReplayRecords

from .auth import (
    Auth,
    Challenge,
    Hello,
    Welcome,
    decode_auth,
    decode_challenge,
    decode_hello,
    decode_welcome,
)
from .frames import (
    _U16,
    _U32,
    DEFAULT_MAX_FRAME,
    MAX_U32,
    BadRequest,
    Frame,
    Kind,
    MalformedFrame,
    ProtocolError,
    _Body,
    _body,
    _join_frame,
    _utf8,
    encode_frame,
    kind_of,
)

_FETCH: Final = struct.Struct("<QQqi")
_CAUSE_HEAD: Final = struct.Struct("<BBH")
_ERROR_HEAD: Final = struct.Struct("<H")
_MAX_TOPICS: Final = 0xFFFF
_HEARTBEAT_HEAD: Final = struct.Struct("<II")
SINK_KEY_BIT: Final = 1 << 63
"""Set in every sink key (SINK_HOLD, SINK_SETTLE): source ids are u32, so a key never
names a source's barrier holds (ftlayer.core.sinkholds)."""
_SINK_KEY: Final = struct.Struct("<Q")
_SINK_SETTLE_HEAD: Final = struct.Struct("<QB")  # key, outcome (0 written, 1 failed)
_MAX_HEARTBEAT_SOURCES: Final = 0xFFFF  # a query reads at most this many topics


@dataclass(frozen=True, slots=True)
class Persist:
    batch: RecordBatch
    initial_values: NDArray[np.uint64]


@dataclass(frozen=True, slots=True)
class Xor:
    roots: NDArray[np.uint64]
    values: NDArray[np.uint64]


@dataclass(frozen=True, slots=True)
class Fail:
    roots: NDArray[np.uint64]
    causes: Causes
    """A cause per root (UNSPECIFIED for every root of a FAIL that names none)."""


@dataclass(frozen=True, slots=True)
class SinkHold:
    key: int
    roots: NDArray[np.uint64]
    values: NDArray[np.uint64]


@dataclass(frozen=True, slots=True)
class SinkSettle:
    key: int
    cause: Cause | None
    """None: the sink's write succeeded; else why it failed."""


@dataclass(frozen=True, slots=True)
class FetchReplay:
    """`FTLayer.fetch_replay(lo, hi, source_id=, partition=)`; None filters nothing."""

    lo: int
    hi: int
    source_id: int | None
    partition: int | None


@dataclass(frozen=True, slots=True)
class RegisterSource:
    """`FTLayer.register_source`: how one source's records are replayed."""

    source_id: int
    partitioner: str
    num_partitions: int
    options: dict[str, Any]
    timeout_s: float | None = None
    retry: dict[str, Any] | None = None
    """The retry policy (ftlayer.core.retries.RetryPolicy.to_json); None: the defaults."""
    dead_letter_topic: str | None = None
    completion: str = "tree"
    """"tree" or "barrier" (ftlayer.core.barrier)."""


@dataclass(frozen=True, slots=True)
class CheckpointRequest:
    """CHECKPOINT_BEGIN (`begin`) or CHECKPOINT_DONE of barrier `position` of
    `query` (see ftlayer.checkpoint)."""

    begin: bool
    query: str
    position: dict[str, Any]
    sources: list[int]
    mode: str
    complete: dict[str, Any] | None = None
    """CHECKPOINT_BEGIN only: a barrier of the same query to complete first (Spark's
    commit of the batch before, which comes right before the next batch is planned):
    one round trip for both."""


@dataclass(frozen=True, slots=True)
class CheckpointReply:
    """The checkpoint as JSON (Checkpoint.to_json)."""

    checkpoint: dict[str, Any]


@dataclass(frozen=True, slots=True)
class SavepointRequest:
    """SAVEPOINT: write a savepoint of the running server's store into `directory` (a
    path on the server's host) under `name` (None: the default name; see
    ftlayer.checkpoint.savepoint.create_savepoint)."""

    directory: str
    name: str | None


@dataclass(frozen=True, slots=True)
class SavepointCreated:
    """The savepoint created, as JSON (Savepoint.as_dict: its manifest and "path")."""

    savepoint: dict[str, Any]


@dataclass(frozen=True, slots=True)
class StatusRequest:
    pass


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """HEARTBEAT: the driver of these sources is alive and their batch runs; lease it for
    `lease_ms` more milliseconds (0 ends the lease; `FTLayer.heartbeat`)."""

    source_ids: tuple[int, ...]
    lease_ms: int


@dataclass(frozen=True, slots=True)
class StatusReply:
    status: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Ok:
    count: int


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """An ERROR reply. `code` is an int: codes this version does not know are kept."""

    code: int
    message: str


@dataclass(frozen=True, slots=True)
class DeadLettersRequest:
    """DEAD_LETTERS: `op` ("list", "requeue", "purge" or "delivered") the dead letters
    that match `where` (DeadLetterFilter.to_json); list returns at most `limit`."""

    op: str
    where: dict[str, Any]
    limit: int | None = None


@dataclass(frozen=True, slots=True)
class DeadLetterList:
    """DEAD_LETTER_LIST: the dead letters listed (their retry records as JSON, each with
    its "seq"), their stored records in the same order, and whether more matched than
    the reply holds."""

    letters: list[dict[str, Any]]
    records: RecordBatch
    more: bool


Message = (
    Hello
    | Challenge
    | Auth
    | Welcome
    | Persist
    | Xor
    | Fail
    | FetchReplay
    | RegisterSource
    | CheckpointRequest
    | CheckpointReply
    | SavepointRequest
    | SavepointCreated
    | StatusRequest
    | StatusReply
    | Heartbeat
    | SinkHold
    | SinkSettle
    | Ok
    | ReplayRecords
    | DeadLettersRequest
    | RecordQuery
    | Inspection
    | DeadLetterList
    | ErrorReply
)


# ---- records (PERSIST and REPLAY) ------------------------------------------------------


def _u64_column(values: ArrayLike, n: int | None, what: str) -> NDArray[np.uint64]:
    """`values` as a 1-d uint64 array (of length n, unless n is None); BadRequest for
    another length or a value that is not a u64."""
    try:
        array = values if isinstance(values, np.ndarray) else np.asarray(values, dtype=np.uint64)
        if array.dtype.kind not in "iu":
            raise TypeError(f"got dtype {array.dtype}")
        if array.dtype.kind == "i" and array.size and int(array.min()) < 0:
            raise ValueError(f"got {int(array.min())}")
        if array.ndim != 1 or (n is not None and len(array) != n):
            raise ValueError(f"got shape {array.shape}")
    except (ValueError, TypeError, OverflowError) as exc:
        count = "" if n is None else f"{n} "
        raise BadRequest(f"{what} must be {count}unsigned 64-bit integers: {exc}") from None
    return array.astype("<u8", copy=False)


def _encode_topics(topics: Sequence[str], n: int) -> tuple[bytes, bytes]:
    """(topic index u16[n], topic table) for the record layout."""
    if n == 0:
        return b"", _U16.pack(0)
    # list.count compares by identity first: a batch built with one topic object (the
    # usual case) is recognised without hashing every entry.
    if topics.count(topics[0]) == n:
        distinct: list[str] = [topics[0]]
        index = np.zeros(n, dtype="<u2")
    else:
        codes = {topic: code for code, topic in enumerate(dict.fromkeys(topics))}
        if len(codes) > _MAX_TOPICS:
            raise BadRequest(f"a batch may have at most {_MAX_TOPICS} topics, got {len(codes)}")
        distinct = list(codes)
        index = np.fromiter(map(codes.__getitem__, topics), dtype="<u2", count=n)
    table = [_U16.pack(len(distinct))]
    for topic in distinct:
        raw = topic.encode("utf-8")
        if len(raw) > 0xFFFF:
            raise BadRequest(
                f"topic {topic[:40]!r}... is {len(raw)} utf-8 bytes, at most 65535 fit"
            )
        table += [_U16.pack(len(raw)), raw]
    return index.tobytes(), b"".join(table)


def _record_parts(
    batch: RecordBatch, initial: NDArray[np.uint64] | None, parts: list[bytes]
) -> None:
    """Append the record columns (see the module docstring), after u32 n, to `parts`.

    The payloads are appended one by one (or as the one buffer of `Payloads`), not
    joined: the frame is built with a single join, so the payload bytes are copied
    once."""
    n = len(batch)
    payloads = batch.payloads
    if isinstance(payloads, Payloads):
        lengths = payloads.lengths
        payload_parts: Sequence[bytes] = [payloads.blob]
    else:
        lengths = np.fromiter(map(len, payloads), dtype=np.int64, count=n)
        payload_parts = payloads
    if n and int(lengths.max()) > MAX_U32:
        raise BadRequest("a payload is longer than 4 GiB: the record layout cannot carry it")
    index, table = _encode_topics(batch.topics, n)
    parts.append(np.ascontiguousarray(batch.roots, dtype="<u8").tobytes())
    if initial is not None:
        parts.append(initial.tobytes())
    parts += [
        np.ascontiguousarray(batch.source_ids, dtype="<u4").tobytes(),
        np.ascontiguousarray(batch.key_hashes, dtype="<i8").tobytes(),
        np.ascontiguousarray(batch.has_key, dtype=np.bool_).astype("u1").tobytes(),
        np.ascontiguousarray(batch.partitions, dtype="<i4").tobytes(),
        np.ascontiguousarray(batch.offsets, dtype="<i8").tobytes(),
        index,
        table,
        lengths.astype("<u4").tobytes(),
    ]
    parts += payload_parts


def _read_records(body: _Body, n: int, with_initial: bool) -> tuple[RecordBatch, NDArray[Any]]:
    """The record columns of n records from `body` (after u32 n), checked completely
    before the batch is built; (batch, initial values or an empty array)."""
    roots = body.array("<u8", n, "roots")
    initial = body.array("<u8", n if with_initial else 0, "initial ack values")
    source_ids = body.array("<u4", n, "source ids")
    key_hashes = body.array("<i8", n, "key hashes")
    has_key = body.array("u1", n, "has_key")
    partitions = body.array("<i4", n, "partitions")
    offsets = body.array("<i8", n, "offsets")
    topic_index = body.array("<u2", n, "topic index")
    count = body.u16("topic count")
    table = [body.text(body.u16(f"topic {i} length"), f"topic {i}") for i in range(count)]
    lengths = body.array("<u4", n, "payload lengths")
    blob = body.rest()
    total = int(lengths.sum(dtype=np.uint64))
    if total != len(blob):
        raise MalformedFrame(
            f"{body.kind.name} payload lengths add up to {total} bytes, but {len(blob)} "
            "bytes follow them"
        )
    if n and int(has_key.max()) > 1:
        raise BadRequest(f"{body.kind.name} has_key must be 0 or 1, got {int(has_key.max())}")
    if n and int(topic_index.max()) >= count:
        raise BadRequest(
            f"{body.kind.name} topic index {int(topic_index.max())} is out of range: "
            f"the topic table has {count} topics"
        )
    batch = RecordBatch(
        roots=roots,
        source_ids=source_ids,
        key_hashes=key_hashes,
        has_key=has_key.astype(np.bool_),
        topics=_topics(table, topic_index, n),
        partitions=partitions,
        offsets=offsets,
        payloads=Payloads(blob, lengths),
    )
    return batch, initial


def _topics(table: list[str], index: NDArray[Any], n: int) -> list[str]:
    if len(table) == 1:
        return [table[0]] * n
    names = np.empty(len(table), dtype=object)
    names[:] = table
    topics: list[str] = names[index].tolist()
    return topics


def encode_persist(
    request_id: int,
    batch: RecordBatch,
    initial_values: ArrayLike | None = None,
    *,
    max_frame: int = DEFAULT_MAX_FRAME,
) -> bytes:
    """PERSIST: `FTLayer.persist(batch, initial_values)`; None means all initial values 0."""
    n = len(batch)
    initial = (
        np.zeros(n, dtype=np.uint64)
        if initial_values is None
        else _u64_column(initial_values, n, "initial values")
    )
    parts = [_U32.pack(n)]
    _record_parts(batch, initial, parts)
    return _join_frame(Kind.PERSIST, request_id, parts, max_frame)


def decode_persist(message: Frame | bytes) -> Persist:
    body = _body(message, Kind.PERSIST)
    n = body.u32("record count")
    batch, initial = _read_records(body, n, with_initial=True)
    return Persist(batch, initial)


def encode_replay(
    request_id: int, replay: ReplayRecords, *, max_frame: int = DEFAULT_MAX_FRAME
) -> bytes:
    """REPLAY: the reply to FETCH_REPLAY, `FTLayer.fetch_replay`'s ReplayRecords."""
    n = len(replay.records)
    if len(replay.replay_seqs) != n or len(replay.partitions) != n:
        raise BadRequest(
            f"REPLAY needs one replay seq and one partition per record: {n} records, "
            f"{len(replay.replay_seqs)} replay seqs, {len(replay.partitions)} partitions"
        )
    parts = [
        _U32.pack(n),
        np.ascontiguousarray(replay.replay_seqs, dtype="<u8").tobytes(),
        np.ascontiguousarray(replay.partitions, dtype="<i4").tobytes(),
    ]
    _record_parts(replay.records, None, parts)
    return _join_frame(Kind.REPLAY, request_id, parts, max_frame)


def decode_replay(message: Frame | bytes) -> ReplayRecords:
    body = _body(message, Kind.REPLAY)
    n = body.u32("record count")
    replay_seqs = body.array("<u8", n, "replay seqs")
    partitions = body.array("<i4", n, "target partitions")
    batch, _ = _read_records(body, n, with_initial=False)
    return ReplayRecords(replay_seqs=replay_seqs, partitions=partitions, records=batch)


# ---- events ----------------------------------------------------------------------------


def encode_xor(
    request_id: int, roots: ArrayLike, values: ArrayLike, *, max_frame: int = DEFAULT_MAX_FRAME
) -> bytes:
    """XOR: events (roots[i], values[i]) for `FTLayer.xor`."""
    root_array = _u64_column(roots, None, "XOR roots")
    n = len(root_array)
    value_array = _u64_column(values, n, "XOR values")
    body = b"".join([_U32.pack(n), root_array.tobytes(), value_array.tobytes()])
    return encode_frame(Kind.XOR, request_id, body, max_frame=max_frame)


def encode_hold(
    request_id: int, roots: ArrayLike, values: ArrayLike, *, max_frame: int = DEFAULT_MAX_FRAME
) -> bytes:
    """HOLD: XOR's body, for `FTLayer.hold` (a barrier-mode root going on in a new batch)."""
    return _retag(encode_xor(request_id, roots, values, max_frame=max_frame), Kind.HOLD)


def decode_hold(message: Frame | bytes) -> Xor:
    return decode_xor(message, Kind.HOLD)


def _retag(frame: bytes, kind: Kind) -> bytes:
    """The same frame with another kind byte (offset 4, after the length)."""
    return frame[:4] + bytes([kind]) + frame[5:]


def decode_xor(message: Frame | bytes, kind: Kind = Kind.XOR) -> Xor:
    body = _body(message, kind)
    n = body.u32("event count")
    _expect_size(body, 16 * n, n, "events")
    roots = body.array("<u8", n, "roots")
    values = body.array("<u8", n, "values")
    return Xor(roots, values)


def encode_fail(
    request_id: int,
    roots: ArrayLike,
    causes: Causes | None = None,
    *,
    max_frame: int = DEFAULT_MAX_FRAME,
) -> bytes:
    """FAIL: the roots for `FTLayer.fail`, then (unless every cause is unspecified)
    their causes: u16 C, C causes (u8 kind, u8 flags: bit 0 final, u16 + utf-8 step,
    u16 + utf-8 error), and a u16 cause index per root."""
    root_array = _u64_column(roots, None, "FAIL roots")
    parts = [_U32.pack(len(root_array)), root_array.tobytes()]
    if causes is not None and not causes.unspecified:
        if len(causes) != len(root_array):
            raise BadRequest(f"FAIL: {len(root_array)} roots but {len(causes)} causes")
        parts.append(_U16.pack(len(causes.table)))
        for cause in causes.table:
            parts += _cause_parts(cause)
        parts.append(causes.index.astype("<u2", copy=False).tobytes())
    return encode_frame(Kind.FAIL, request_id, b"".join(parts), max_frame=max_frame)


def decode_fail(message: Frame | bytes) -> Fail:
    body = _body(message, Kind.FAIL)
    n = body.u32("root count")
    left = len(body.data) - body.pos
    if left < 8 * n:
        raise MalformedFrame(f"FAIL declares {n} roots ({8 * n} bytes), but {left} bytes follow")
    roots = body.array("<u8", n, "roots")
    if body.pos == len(body.data):
        return Fail(roots, Causes.one(None, n))
    count = body.u16("cause count")
    table = [_read_cause(body, f"FAIL cause {i}") for i in range(count)]
    index = body.array("<u2", n, "cause index")
    body.done()
    if n and int(index.max()) >= count:
        raise MalformedFrame(f"FAIL cause index {int(index.max())} beyond its {count} causes")
    return Fail(roots, Causes(tuple(table), index.astype(np.uint16)))


def _cause_parts(cause: Cause) -> list[bytes]:
    """A cause on the wire: u8 kind, u8 flags (bit 0 final), u16 + utf-8 step, u16 +
    utf-8 error (clipped to fit)."""
    cause = cause.clipped()
    step, error = cause.step.encode("utf-8"), cause.error.encode("utf-8")
    head = _CAUSE_HEAD.pack(int(cause.kind), int(cause.final), len(step))
    return [head, step, _U16.pack(len(error)), error]


def _read_cause(body: _Body, what: str) -> Cause:
    code, flags, step_len = body.unpack(_CAUSE_HEAD, what)
    if code not in FailKind._value2member_map_ or flags & ~1:
        raise BadRequest(
            f"{what} has an unknown encoding: kind {code}, flags {flags:#x} "
            f"(kinds {[int(k) for k in FailKind]}, flag bit 0 = final)"
        )
    step = body.text(step_len, f"{what} step")
    error = body.text(body.u16(f"{what} error length"), f"{what} error")
    return Cause(FailKind(code), step, error, bool(flags & 1))


# ---- a batch sink's held acks (ftlayer.core.sinkholds) -------------------------------


def encode_sink_hold(
    request_id: int,
    key: int,
    roots: ArrayLike,
    values: ArrayLike,
    *,
    max_frame: int = DEFAULT_MAX_FRAME,
) -> bytes:
    """SINK_HOLD: u64 sink key, then XOR's body: the acks of rows that reached a batch
    sink, held under its key until SINK_SETTLE."""
    root_array = _u64_column(roots, None, "SINK_HOLD roots")
    n = len(root_array)
    value_array = _u64_column(values, n, "SINK_HOLD values")
    body = b"".join([_sink_key(key), _U32.pack(n), root_array.tobytes(), value_array.tobytes()])
    return encode_frame(Kind.SINK_HOLD, request_id, body, max_frame=max_frame)


def decode_sink_hold(message: Frame | bytes) -> SinkHold:
    body = _body(message, Kind.SINK_HOLD)
    (key,) = body.unpack(_SINK_KEY, "sink key")
    n = body.u32("event count")
    _expect_size(body, 16 * n, n, "events")
    roots = body.array("<u8", n, "roots")
    values = body.array("<u8", n, "values")
    return SinkHold(int(key), roots, values)


def encode_sink_settle(request_id: int, key: int, cause: Cause | None = None) -> bytes:
    """SINK_SETTLE: u64 sink key, u8 outcome (0: the write succeeded, 1: it failed),
    and for a failure its cause (as in FAIL)."""
    parts = [_SINK_SETTLE_HEAD.pack(_sink_key_value(key), 0 if cause is None else 1)]
    if cause is not None:
        parts += _cause_parts(cause)
    return encode_frame(Kind.SINK_SETTLE, request_id, b"".join(parts))


def decode_sink_settle(message: Frame | bytes) -> SinkSettle:
    body = _body(message, Kind.SINK_SETTLE)
    key, outcome = body.unpack(_SINK_SETTLE_HEAD, "sink key and outcome")
    if outcome not in (0, 1):
        raise BadRequest(f"SINK_SETTLE outcome must be 0 (written) or 1 (failed), got {outcome}")
    cause = _read_cause(body, "SINK_SETTLE cause") if outcome else None
    body.done()
    return SinkSettle(int(key), cause)


def _sink_key_value(key: int) -> int:
    if not isinstance(key, int) or isinstance(key, bool) or not 0 <= key < 1 << 64:
        raise BadRequest(f"a sink key is a u64, got {key!r}")
    return key


def _sink_key(key: int) -> bytes:
    return _SINK_KEY.pack(_sink_key_value(key))


def _expect_size(body: _Body, size: int, n: int, what: str) -> None:
    """Fixed-layout bodies: the declared count must match the byte length exactly."""
    left = len(body.data) - body.pos
    if left != size:
        raise MalformedFrame(
            f"{body.kind.name} declares {n} {what} ({size} bytes), but {left} bytes follow"
        )


# ---- replay fetch, status, replies -----------------------------------------------------


def encode_fetch_replay(
    request_id: int,
    lo: int,
    hi: int,
    *,
    source_id: int | None = None,
    partition: int | None = None,
) -> bytes:
    """FETCH_REPLAY: records with lo < replay seq <= hi; None (-1 on the wire) = any."""
    sid = -1 if source_id is None else source_id
    part = -1 if partition is None else partition
    if not (0 <= lo < 2**64 and 0 <= hi < 2**64 and -1 <= sid <= MAX_U32 and -1 <= part < 2**31):
        raise BadRequest(
            f"FETCH_REPLAY needs u64 lo and hi, a u32 source id and a non-negative i32 "
            f"partition (or None), got {lo}, {hi}, {source_id}, {partition}"
        )
    return encode_frame(Kind.FETCH_REPLAY, request_id, _FETCH.pack(lo, hi, sid, part))


def decode_fetch_replay(message: Frame | bytes) -> FetchReplay:
    body = _body(message, Kind.FETCH_REPLAY)
    lo, hi, source_id, partition = body.unpack(_FETCH, "lo, hi, source id and partition")
    body.done()
    if not -1 <= source_id <= MAX_U32 or partition < -1:
        raise BadRequest(
            f"FETCH_REPLAY source id {source_id} or partition {partition} is out of range "
            "(-1 means any)"
        )
    return FetchReplay(
        lo, hi, None if source_id == -1 else source_id, None if partition == -1 else partition
    )


def encode_register_source(
    request_id: int,
    source_id: int,
    partitioner: str,
    num_partitions: int,
    options: Mapping[str, Any] | None = None,
    timeout_s: float | None = None,
    retry: Mapping[str, Any] | None = None,
    dead_letter_topic: str | None = None,
    completion: str = "tree",
) -> bytes:
    """REGISTER_SOURCE: u32 source id, then the config as a JSON object."""
    if isinstance(source_id, bool) or not 0 <= source_id <= MAX_U32:
        raise BadRequest(f"REGISTER_SOURCE needs a u32 source id, got {source_id!r}")
    spec: dict[str, Any] = {
        "partitioner": partitioner,
        "num_partitions": num_partitions,
        "options": dict(options or {}),
    }
    if timeout_s is not None:
        spec["timeout_s"] = timeout_s
    if retry is not None:
        spec["retry"] = dict(retry)
    if dead_letter_topic is not None:
        spec["dead_letter_topic"] = dead_letter_topic
    if completion != "tree":
        spec["completion"] = completion
    try:
        text = json.dumps(spec, separators=(",", ":"), allow_nan=False, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"REGISTER_SOURCE options are not JSON: {exc}") from None
    return encode_frame(Kind.REGISTER_SOURCE, request_id, _U32.pack(source_id) + text.encode())


def decode_register_source(message: Frame | bytes) -> RegisterSource:
    body = _body(message, Kind.REGISTER_SOURCE)
    source_id = body.u32("source id")
    text = _utf8(body.rest(), Kind.REGISTER_SOURCE, "config")
    try:
        spec = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise MalformedFrame(f"REGISTER_SOURCE config is not JSON: {exc}") from None
    required = {"partitioner", "num_partitions", "options"}
    optional = {"timeout_s", "retry", "dead_letter_topic", "completion"}
    get = spec.get if isinstance(spec, dict) else (lambda _key: None)
    timeout, retry, topic = get("timeout_s"), get("retry"), get("dead_letter_topic")
    completion = get("completion") or "tree"
    if not (
        isinstance(spec, dict)
        and required <= set(spec) <= required | optional
        and isinstance(spec["partitioner"], str)
        and type(spec["num_partitions"]) is int
        and isinstance(spec["options"], dict)
        and (timeout is None or _finite_positive(timeout))
        and (retry is None or isinstance(retry, dict))
        and (topic is None or (isinstance(topic, str) and topic))
        and completion in ("tree", "barrier")
    ):
        raise BadRequest(
            'REGISTER_SOURCE config must be a JSON object with a str "partitioner", an '
            'int "num_partitions", an object "options" and optionally a finite positive number '
            '"timeout_s", an object "retry", a non-empty str "dead_letter_topic" and '
            f'"completion" ("tree" or "barrier"), and nothing else; got {text[:200]!r}'
        )
    return RegisterSource(
        source_id,
        spec["partitioner"],
        spec["num_partitions"],
        spec["options"],
        None if timeout is None else float(timeout),
        retry,
        topic,
        completion,
    )


def _finite_positive(value: Any) -> bool:
    """A JSON number (not a bool) that is above 0 and finite as a float."""
    if type(value) not in (int, float):
        return False
    try:
        return 0 < float(value) < math.inf
    except OverflowError:  # an int beyond float range
        return False


_CHECKPOINT_MODES: Final = ("aligned", "unaligned")


def encode_checkpoint_request(
    request_id: int,
    *,
    begin: bool,
    query: str,
    position: Mapping[str, Any],
    sources: Sequence[int],
    mode: str,
    complete: Mapping[str, Any] | None = None,
) -> bytes:
    """CHECKPOINT_BEGIN (begin=True; with `complete`, that barrier is completed
    first) or CHECKPOINT_DONE."""
    kind = Kind.CHECKPOINT_BEGIN if begin else Kind.CHECKPOINT_DONE
    body: dict[str, Any] = {
        "query": query,
        "position": dict(position),
        "sources": list(sources),
        "mode": mode,
    }
    if complete is not None:
        body["complete"] = dict(complete)
    _check_checkpoint(body, kind)
    return encode_frame(kind, request_id, json.dumps(body, sort_keys=True).encode())


def _decode_checkpoint_request(message: Frame | bytes, kind: Kind) -> CheckpointRequest:
    body = _json(_body(message, kind).rest(), kind)
    _check_checkpoint(body, kind)
    return CheckpointRequest(
        kind is Kind.CHECKPOINT_BEGIN,
        body["query"],
        body["position"],
        list(body["sources"]),
        body["mode"],
        body.get("complete"),
    )


def decode_checkpoint_begin(message: Frame | bytes) -> CheckpointRequest:
    return _decode_checkpoint_request(message, Kind.CHECKPOINT_BEGIN)


def decode_checkpoint_done(message: Frame | bytes) -> CheckpointRequest:
    return _decode_checkpoint_request(message, Kind.CHECKPOINT_DONE)


def _check_checkpoint(body: Any, kind: Kind) -> None:
    """The shape of a checkpoint request; the values are the coordinator's to check."""
    keys = {"query", "position", "sources", "mode"}
    if kind is Kind.CHECKPOINT_BEGIN and isinstance(body, dict) and "complete" in body:
        keys.add("complete")
    if (
        not isinstance(body, dict)
        or set(body) != keys
        or not isinstance(body.get("complete", {}), dict)
        or not isinstance(body["query"], str)
        or not isinstance(body["position"], dict)
        or not isinstance(body["sources"], list)
        or not all(
            isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= MAX_U32
            for s in body["sources"]
        )
        or body["mode"] not in _CHECKPOINT_MODES
    ):
        extra = ', "complete": object (optional)' if kind is Kind.CHECKPOINT_BEGIN else ""
        raise BadRequest(
            f'{kind.name} body must be a JSON object {{"query": str, "position": object, '
            f'"sources": [u32], "mode": "aligned" or "unaligned"{extra}}}, got {body!r}'[:600]
        )


def _encode_object(kind: Kind, request_id: int, value: Mapping[str, Any], what: str) -> bytes:
    """A reply whose body is one JSON object."""
    try:
        text = json.dumps(dict(value), sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"{what} is not a JSON object: {exc}") from None
    return encode_frame(kind, request_id, text.encode())


def _decode_object(message: Frame | bytes, kind: Kind) -> dict[str, Any]:
    body = _json(_body(message, kind).rest(), kind)
    if not isinstance(body, dict):
        raise MalformedFrame(f"{kind.name} body is JSON {type(body).__name__}, not an object")
    return body


def encode_checkpoint_reply(request_id: int, checkpoint: Mapping[str, Any]) -> bytes:
    return _encode_object(Kind.CHECKPOINT, request_id, checkpoint, "checkpoint")


def decode_checkpoint_reply(message: Frame | bytes) -> CheckpointReply:
    return CheckpointReply(_decode_object(message, Kind.CHECKPOINT))


def encode_savepoint(request_id: int, directory: str, name: str | None = None) -> bytes:
    """SAVEPOINT into the savepoints directory `directory` on the server's host."""
    body = {"dir": directory, "name": name}
    _check_savepoint(body)
    return encode_frame(Kind.SAVEPOINT, request_id, json.dumps(body, sort_keys=True).encode())


def decode_savepoint(message: Frame | bytes) -> SavepointRequest:
    body = _json(_body(message, Kind.SAVEPOINT).rest(), Kind.SAVEPOINT)
    _check_savepoint(body)
    return SavepointRequest(body["dir"], body["name"])


def _check_savepoint(body: Any) -> None:
    """The shape of a SAVEPOINT request. The directory must be absolute: a relative one
    would name a place under the server's working directory, which the client cannot
    know. The name is the server's to check (ftlayer.checkpoint.savepoint)."""
    if (
        not isinstance(body, dict)
        or set(body) != {"dir", "name"}
        or not isinstance(body["dir"], str)
        or not (body["name"] is None or isinstance(body["name"], str))
    ):
        raise BadRequest(
            f'SAVEPOINT body must be a JSON object {{"dir": str, "name": str or null}}, '
            f"got {body!r}"[:600]
        )
    directory = body["dir"]
    if not directory.startswith("/") or "\0" in directory:
        raise BadRequest(
            "SAVEPOINT dir must be an absolute path on the server's host (a relative one "
            f"would depend on the server's working directory), got {directory!r}"[:600]
        )


def encode_savepoint_created(request_id: int, savepoint: Mapping[str, Any]) -> bytes:
    return _encode_object(Kind.SAVEPOINT_CREATED, request_id, savepoint, "savepoint")


def decode_savepoint_created(message: Frame | bytes) -> SavepointCreated:
    return SavepointCreated(_decode_object(message, Kind.SAVEPOINT_CREATED))


def _json(raw: bytes, kind: Kind) -> Any:
    text = _utf8(raw, kind, "body")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise MalformedFrame(f"{kind.name} body is not JSON: {exc}") from None


def encode_status_request(request_id: int) -> bytes:
    return encode_frame(Kind.STATUS, request_id, b"")


def decode_status_request(message: Frame | bytes) -> StatusRequest:
    _body(message, Kind.STATUS).done()
    return StatusRequest()


def encode_heartbeat(request_id: int, source_ids: Sequence[int], lease_ms: int) -> bytes:
    """HEARTBEAT: u32 lease ms, u32 n, source ids u32[n]."""
    ids = list(source_ids)
    if not (
        _is_u32(lease_ms) and all(_is_u32(s) for s in ids) and len(ids) <= _MAX_HEARTBEAT_SOURCES
    ):
        raise BadRequest(
            f"HEARTBEAT needs a u32 lease in ms and at most {_MAX_HEARTBEAT_SOURCES} u32 "
            f"source ids, got {lease_ms!r} and {ids!r}"[:600]
        )
    body = _HEARTBEAT_HEAD.pack(lease_ms, len(ids)) + np.array(ids, dtype="<u4").tobytes()
    return encode_frame(Kind.HEARTBEAT, request_id, body)


def decode_heartbeat(message: Frame | bytes) -> Heartbeat:
    body = _body(message, Kind.HEARTBEAT)
    lease_ms, n = body.unpack(_HEARTBEAT_HEAD, "lease and source count")
    _expect_size(body, 4 * n, n, "source ids")
    if n > _MAX_HEARTBEAT_SOURCES:
        raise BadRequest(f"HEARTBEAT names {n} sources, more than {_MAX_HEARTBEAT_SOURCES}")
    ids = body.array("<u4", n, "source ids")
    return Heartbeat(tuple(int(s) for s in ids.tolist()), int(lease_ms))


def _is_u32(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_U32


def encode_status_reply(
    request_id: int, status: Mapping[str, Any], *, max_frame: int = DEFAULT_MAX_FRAME
) -> bytes:
    """STATUS_REPLY: `status` as a JSON object (e.g. dataclasses.asdict(current_stats()))."""
    try:
        text = json.dumps(dict(status), separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"status is not a JSON object: {exc}") from None
    return encode_frame(Kind.STATUS_REPLY, request_id, text.encode("utf-8"), max_frame=max_frame)


def decode_status_reply(message: Frame | bytes) -> StatusReply:
    body = _body(message, Kind.STATUS_REPLY)
    text = _utf8(body.rest(), Kind.STATUS_REPLY, "body")
    try:
        status = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise MalformedFrame(f"STATUS_REPLY body is not JSON: {exc}") from None
    if not isinstance(status, dict):
        raise MalformedFrame(f"STATUS_REPLY body is JSON {type(status).__name__}, not an object")
    return StatusReply(status)


def encode_ok(request_id: int, count: int = 0) -> bytes:
    if not 0 <= count <= MAX_U32:
        raise BadRequest(f"OK count must be a u32, got {count}")
    return encode_frame(Kind.OK, request_id, _U32.pack(count))


def decode_ok(message: Frame | bytes) -> Ok:
    body = _body(message, Kind.OK)
    count = body.u32("count")
    body.done()
    return Ok(count)


_MAX_ERROR_MESSAGE: Final = 4096


def encode_error(request_id: int, code: int, message: str) -> bytes:
    """ERROR; messages longer than 4096 utf-8 bytes are cut (an error must always fit)."""
    if not 0 <= code <= 0xFFFF:
        raise BadRequest(f"error code must be a u16, got {code}")
    raw = message.encode("utf-8")
    if len(raw) > _MAX_ERROR_MESSAGE:
        raw = raw[:_MAX_ERROR_MESSAGE].decode("utf-8", errors="ignore").encode("utf-8")
    return encode_frame(Kind.ERROR, request_id, _ERROR_HEAD.pack(code) + raw)


def encode_error_for(request_id: int, error: ProtocolError) -> bytes:
    """The ERROR reply that reports `error` (its code and message)."""
    return encode_error(request_id, error.code, str(error))


def decode_error(message: Frame | bytes) -> ErrorReply:
    body = _body(message, Kind.ERROR)
    (code,) = body.unpack(_ERROR_HEAD, "error code")
    return ErrorReply(code, _utf8(body.rest(), Kind.ERROR, "message"))


# ---- dead letters ------------------------------------------------------------------------

DEAD_LETTER_OPS: Final = ("list", "requeue", "purge", "delivered")


def encode_dead_letters(
    request_id: int, op: str, where: Mapping[str, Any] | None = None, limit: int | None = None
) -> bytes:
    """DEAD_LETTERS: a utf-8 JSON object {"op": str, "where": object, "limit": int or null}."""
    body = {"op": op, "where": dict(where or {}), "limit": limit}
    _check_dead_letters(body)
    return encode_frame(Kind.DEAD_LETTERS, request_id, json.dumps(body, sort_keys=True).encode())


def decode_dead_letters(message: Frame | bytes) -> DeadLettersRequest:
    body = _json(_body(message, Kind.DEAD_LETTERS).rest(), Kind.DEAD_LETTERS)
    _check_dead_letters(body)
    return DeadLettersRequest(body["op"], body["where"], body["limit"])


def _check_dead_letters(body: Any) -> None:
    limit = body.get("limit") if isinstance(body, dict) else None
    if not (
        isinstance(body, dict)
        and set(body) == {"op", "where", "limit"}
        and body["op"] in DEAD_LETTER_OPS
        and isinstance(body["where"], dict)
        and (limit is None or (type(limit) is int and limit > 0))
    ):
        raise BadRequest(
            f'DEAD_LETTERS must be a JSON object {{"op": one of {list(DEAD_LETTER_OPS)}, '
            f'"where": object, "limit": a positive int or null}}; got {str(body)[:200]!r}'
        )


def encode_dead_letter_list(
    request_id: int,
    letters: Sequence[Mapping[str, Any]],
    records: RecordBatch,
    more: bool,
    *,
    max_frame: int = DEFAULT_MAX_FRAME,
    kind: Kind = Kind.DEAD_LETTER_LIST,
) -> bytes:
    """DEAD_LETTER_LIST: u32 J, a utf-8 JSON object {"letters": [...], "more": bool}
    of J bytes, then u32 n and the record columns without initial values (as REPLAY's).
    DEAD_LETTER_RESTORE (`kind`) has the same layout: dead letters taken back from a
    dead-letter topic, with their histories, to store and replay again."""
    if len(letters) != len(records):
        raise BadRequest(f"{len(letters)} dead letters but {len(records)} records")
    head = json.dumps({"letters": list(letters), "more": more}, separators=(",", ":")).encode()
    parts = [_U32.pack(len(head)), head, _U32.pack(len(records))]
    _record_parts(records, None, parts)
    return _join_frame(kind, request_id, parts, max_frame)


def decode_dead_letter_list(
    message: Frame | bytes, kind: Kind = Kind.DEAD_LETTER_LIST
) -> DeadLetterList:
    body = _body(message, kind)
    head = _json(body.raw(body.u32("JSON length"), "JSON"), kind)
    n = body.u32("record count")
    records, _ = _read_records(body, n, with_initial=False)
    if not (
        isinstance(head, dict)
        and isinstance(head.get("letters"), list)
        and isinstance(head.get("more"), bool)
        and len(head["letters"]) == n
    ):
        raise MalformedFrame(f"{kind.name} JSON does not describe its {n} records")
    return DeadLetterList(head["letters"], records, head["more"])


def decode_dead_letter_restore(message: Frame | bytes) -> DeadLetterList:
    return decode_dead_letter_list(message, Kind.DEAD_LETTER_RESTORE)


# ---- inspect ---------------------------------------------------------------------------


def encode_inspect(request_id: int, query: RecordQuery) -> bytes:
    """INSPECT: a utf-8 JSON object {"root": u64} or {"topic": str, "partition": int,
    "offset": int} (ftlayer.inspection.RecordQuery)."""
    return encode_frame(Kind.INSPECT, request_id, json.dumps(query.to_json()).encode())


def decode_inspect(message: Frame | bytes) -> RecordQuery:
    body = _json(_body(message, Kind.INSPECT).rest(), Kind.INSPECT)
    try:
        return RecordQuery.from_json(body)
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"INSPECT: {exc}"[:600]) from None


def encode_inspect_reply(
    request_id: int, inspection: Inspection, *, max_frame: int = DEFAULT_MAX_FRAME
) -> bytes:
    """INSPECT_REPLY: u32 J, a utf-8 JSON object of J bytes (Inspection.to_json: the
    query, the records found, "retired"), then per record u32 length and the start of
    its payload: at most INSPECT_PAYLOAD_BYTES each, and together at most half a frame
    (its "payload_bytes" is the whole size)."""
    head = json.dumps(inspection.to_json(), separators=(",", ":"), allow_nan=False).encode()
    cut = min(INSPECT_PAYLOAD_BYTES, max_frame // 2 // max(1, len(inspection.records)))
    parts = [_U32.pack(len(head)), head]
    for record in inspection.records:
        payload = record.payload[:cut]
        parts += [_U32.pack(len(payload)), payload]
    return _join_frame(Kind.INSPECT_REPLY, request_id, parts, max_frame)


def decode_inspect_reply(message: Frame | bytes) -> Inspection:
    body = _body(message, Kind.INSPECT_REPLY)
    head = _json(body.raw(body.u32("JSON length"), "JSON"), Kind.INSPECT_REPLY)
    records = head.get("records") if isinstance(head, dict) else None
    if not isinstance(records, list):
        raise MalformedFrame(f"INSPECT_REPLY JSON has no records list: {str(head)[:200]}")
    payloads = [body.raw(body.u32("payload length"), "payload") for _ in records]
    body.done()
    try:
        return Inspection.from_json(head, payloads)
    except ValueError as exc:
        raise MalformedFrame(f"INSPECT_REPLY: {exc}"[:600]) from None


# ---- dispatch --------------------------------------------------------------------------


def decode(frame: Frame) -> Message:
    """The message in `frame`, by its kind; UnknownKind for a kind not in `Kind`."""
    return _DECODERS[kind_of(frame)](frame)


_DECODERS: Final[dict[Kind, Callable[[Frame], Message]]] = {
    Kind.HELLO: decode_hello,
    Kind.AUTH: decode_auth,
    Kind.PERSIST: decode_persist,
    Kind.XOR: decode_xor,
    Kind.FAIL: decode_fail,
    Kind.FETCH_REPLAY: decode_fetch_replay,
    Kind.STATUS: decode_status_request,
    Kind.REGISTER_SOURCE: decode_register_source,
    Kind.CHECKPOINT_BEGIN: decode_checkpoint_begin,
    Kind.CHECKPOINT_DONE: decode_checkpoint_done,
    Kind.SAVEPOINT: decode_savepoint,
    Kind.DEAD_LETTERS: decode_dead_letters,
    Kind.DEAD_LETTER_LIST: decode_dead_letter_list,
    Kind.DEAD_LETTER_RESTORE: decode_dead_letter_restore,
    Kind.HOLD: decode_hold,
    Kind.HEARTBEAT: decode_heartbeat,
    Kind.SINK_HOLD: decode_sink_hold,
    Kind.SINK_SETTLE: decode_sink_settle,
    Kind.INSPECT: decode_inspect,
    Kind.INSPECT_REPLY: decode_inspect_reply,
    Kind.CHECKPOINT: decode_checkpoint_reply,
    Kind.SAVEPOINT_CREATED: decode_savepoint_created,
    Kind.CHALLENGE: decode_challenge,
    Kind.WELCOME: decode_welcome,
    Kind.OK: decode_ok,
    Kind.REPLAY: decode_replay,
    Kind.STATUS_REPLY: decode_status_reply,
    Kind.ERROR: decode_error,
}
