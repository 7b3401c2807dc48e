"""The data path's messages (docs/protocol.md sections 4, 5.1, 5.2, 5.9 and 5.12):
PERSIST and its REPLAY twin (the record block), XOR and HOLD (u64 event columns), FAIL
with its causes, SINK_HOLD and SINK_SETTLE (a batch sink's held acks) and FETCH_REPLAY.
These carry arrays: a body is a few numpy columns, never one Python object per event."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ftlayer.causes import Cause, Causes
from ftlayer.records import RecordBatch, ReplayRecords

from .blocks import (
    cause_parts,
    expect_size,
    is_int,
    is_u64,
    read_cause,
    read_records,
    record_parts,
    u64_column,
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
    _Body,
    _body,
    _join_frame,
    encode_frame,
)

__all__ = [
    "SINK_KEY_BIT",
    "Fail",
    "FetchReplay",
    "Persist",
    "SinkHold",
    "SinkSettle",
    "Xor",
    "decode_fail",
    "decode_fetch_replay",
    "decode_hold",
    "decode_persist",
    "decode_replay",
    "decode_replay_page",
    "decode_sink_hold",
    "decode_sink_settle",
    "decode_xor",
    "encode_fail",
    "encode_fetch_replay",
    "encode_hold",
    "encode_persist",
    "encode_replay",
    "encode_sink_hold",
    "encode_sink_settle",
    "encode_xor",
]

_FETCH: Final = struct.Struct("<QQqi")
SINK_KEY_BIT: Final = 1 << 63
"""Set in every sink key (SINK_HOLD, SINK_SETTLE): source ids are u32, so a key never
names a source's barrier holds (ftlayer.core.sinkholds)."""
_SINK_KEY: Final = struct.Struct("<Q")
_SINK_SETTLE_HEAD: Final = struct.Struct("<QB")  # key, outcome (0 written, 1 failed)


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


# ---- records (PERSIST and REPLAY) ------------------------------------------------------


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
        else u64_column(initial_values, n, "initial values")
    )
    parts = [_U32.pack(n)]
    record_parts(batch, initial, parts)
    return _join_frame(Kind.PERSIST, request_id, parts, max_frame)


def decode_persist(message: Frame | bytes) -> Persist:
    body = _body(message, Kind.PERSIST)
    n = body.u32("record count")
    batch, initial = read_records(body, n, with_initial=True)
    return Persist(batch, initial)


def encode_replay(
    request_id: int,
    replay: ReplayRecords,
    *,
    through: int | None = None,
    max_frame: int = DEFAULT_MAX_FRAME,
) -> bytes:
    """REPLAY: the reply to FETCH_REPLAY, `FTLayer.fetch_replay`'s ReplayRecords, and
    `through`: the replay seq up to which the reply holds every row asked for (the
    request's hi when all of them fit; by default the last row's seq, 0 if none)."""
    return _join_frame(Kind.REPLAY, request_id, replay_parts(replay, through), max_frame)


def replay_parts(
    replay: ReplayRecords, through: int | None = None, parts: list[bytes] | None = None
) -> list[bytes]:
    """REPLAY's body (encode_replay) as byte strings, appended to `parts`: the replay
    page that BATCH_BEGUN carries after its JSON too."""
    n = len(replay.records)
    if len(replay.replay_seqs) != n or len(replay.partitions) != n:
        raise BadRequest(
            f"REPLAY needs one replay seq and one partition per record: {n} records, "
            f"{len(replay.replay_seqs)} replay seqs, {len(replay.partitions)} partitions"
        )
    if through is None:
        through = int(replay.replay_seqs[-1]) if n else 0
    out = [] if parts is None else parts
    out += [
        _U32.pack(n),
        u64_column([through], 1, "REPLAY through").tobytes(),
        np.ascontiguousarray(replay.replay_seqs, dtype="<u8").tobytes(),
        np.ascontiguousarray(replay.partitions, dtype="<i4").tobytes(),
    ]
    record_parts(replay.records, None, out)
    return out


def decode_replay(message: Frame | bytes) -> ReplayRecords:
    return decode_replay_page(message)[0]


def decode_replay_page(message: Frame | bytes) -> tuple[ReplayRecords, int]:
    """A REPLAY's rows and its `through` (encode_replay): the client asks again from
    `through` while it is below the hi it asked for."""
    return read_replay(_body(message, Kind.REPLAY))


def read_replay(body: _Body) -> tuple[ReplayRecords, int]:
    """A replay page (`replay_parts`) from `body`, to its end."""
    n = body.u32("record count")
    through = int(body.array("<u8", 1, "through")[0])
    replay_seqs = body.array("<u8", n, "replay seqs")
    partitions = body.array("<i4", n, "target partitions")
    batch, _ = read_records(body, n, with_initial=False)
    return ReplayRecords(replay_seqs=replay_seqs, partitions=partitions, records=batch), through


# ---- events (XOR, HOLD) ----------------------------------------------------------------


def encode_xor(
    request_id: int, roots: ArrayLike, values: ArrayLike, *, max_frame: int = DEFAULT_MAX_FRAME
) -> bytes:
    """XOR: events (roots[i], values[i]) for `FTLayer.xor`."""
    root_array = u64_column(roots, None, "XOR roots")
    n = len(root_array)
    value_array = u64_column(values, n, "XOR values")
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
    expect_size(body, 16 * n, n, "events")
    roots = body.array("<u8", n, "roots")
    values = body.array("<u8", n, "values")
    return Xor(roots, values)


# ---- FAIL ------------------------------------------------------------------------------


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
    root_array = u64_column(roots, None, "FAIL roots")
    parts = [_U32.pack(len(root_array)), root_array.tobytes()]
    if causes is not None and not causes.unspecified:
        if len(causes) != len(root_array):
            raise BadRequest(f"FAIL: {len(root_array)} roots but {len(causes)} causes")
        parts.append(_U16.pack(len(causes.table)))
        for cause in causes.table:
            parts += cause_parts(cause)
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
    table = [read_cause(body, f"FAIL cause {i}") for i in range(count)]
    index = body.array("<u2", n, "cause index")
    body.done()
    if n and int(index.max()) >= count:
        raise MalformedFrame(f"FAIL cause index {int(index.max())} beyond its {count} causes")
    return Fail(roots, Causes(tuple(table), index.astype(np.uint16)))


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
    root_array = u64_column(roots, None, "SINK_HOLD roots")
    n = len(root_array)
    value_array = u64_column(values, n, "SINK_HOLD values")
    body = b"".join([_sink_key(key), _U32.pack(n), root_array.tobytes(), value_array.tobytes()])
    return encode_frame(Kind.SINK_HOLD, request_id, body, max_frame=max_frame)


def decode_sink_hold(message: Frame | bytes) -> SinkHold:
    body = _body(message, Kind.SINK_HOLD)
    (key,) = body.unpack(_SINK_KEY, "sink key")
    n = body.u32("event count")
    expect_size(body, 16 * n, n, "events")
    roots = body.array("<u8", n, "roots")
    values = body.array("<u8", n, "values")
    return SinkHold(int(key), roots, values)


def encode_sink_settle(request_id: int, key: int, cause: Cause | None = None) -> bytes:
    """SINK_SETTLE: u64 sink key, u8 outcome (0: the write succeeded, 1: it failed),
    and for a failure its cause (as in FAIL)."""
    parts = [_SINK_SETTLE_HEAD.pack(_sink_key_value(key), 0 if cause is None else 1)]
    if cause is not None:
        parts += cause_parts(cause)
    return encode_frame(Kind.SINK_SETTLE, request_id, b"".join(parts))


def decode_sink_settle(message: Frame | bytes) -> SinkSettle:
    body = _body(message, Kind.SINK_SETTLE)
    key, outcome = body.unpack(_SINK_SETTLE_HEAD, "sink key and outcome")
    if outcome not in (0, 1):
        raise BadRequest(f"SINK_SETTLE outcome must be 0 (written) or 1 (failed), got {outcome}")
    cause = read_cause(body, "SINK_SETTLE cause") if outcome else None
    body.done()
    return SinkSettle(int(key), cause)


def _sink_key_value(key: int) -> int:
    if not is_u64(key):
        raise BadRequest(f"a sink key is a u64, got {key!r}")
    return key


def _sink_key(key: int) -> bytes:
    return _SINK_KEY.pack(_sink_key_value(key))


# ---- FETCH_REPLAY ----------------------------------------------------------------------


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
    if not (
        is_u64(lo)
        and is_u64(hi)
        and is_int(sid)
        and -1 <= sid <= MAX_U32
        and is_int(part)
        and -1 <= part < 2**31
    ):
        raise BadRequest(
            f"FETCH_REPLAY needs u64 lo and hi, a u32 source id and a non-negative i32 "
            f"partition (or None), got {lo!r}, {hi!r}, {source_id!r}, {partition!r}"
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
