"""Parked failures (docs/protocol.md, 5.18): FAIL_PARKED (0x30), a FAIL for another
shard that could not be reached, stored by this shard until the driver delivers it;
PARKED (0x31), the driver's list or drop of them; PARKED_LIST (0x9C), the list.

A parked failure's body is FAIL's body (its roots and causes, byte for byte), so the
shard that keeps it stores those bytes and the driver hands them to their owner as
they came."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ftlayer.causes import Causes
from ftlayer.shards import MAX_SHARDS

from .blocks import u64_column
from .data import Fail, decode_fail, encode_fail
from .frames import (
    _U8,
    _U16,
    _U32,
    DEFAULT_MAX_FRAME,
    BadRequest,
    Frame,
    Kind,
    MalformedFrame,
    _body,
    _join_frame,
    encode_frame,
)

__all__ = [
    "ParkedFailure",
    "ParkedList",
    "ParkedOp",
    "ParkedRequest",
    "decode_fail_parked",
    "decode_parked",
    "decode_parked_list",
    "encode_fail_parked",
    "encode_parked",
    "encode_parked_list",
    "fail_body",
]

_HEAD: Final = 9  # a frame's length, kind and request id: FAIL's body follows
_STORE_ID_MAX: Final = 64
_ENTRY: Final = struct.Struct("<QH")


@dataclass(frozen=True, slots=True)
class ParkedFailure:
    """A FAIL for shard `owner` (whose store was `store_id` as its sender knew it, ""
    unknown), kept under `seq` by the shard that answers for it."""

    seq: int
    owner: int
    store_id: str
    body: bytes
    """FAIL's body: `fail` decodes it."""

    @property
    def fail(self) -> Fail:
        return decode_fail(self.body)

    @property
    def roots(self) -> int:
        """How many roots it names (from the body's first field)."""
        return int(_U32.unpack_from(self.body)[0]) if len(self.body) >= 4 else 0


@dataclass(frozen=True, slots=True)
class ParkedList:
    failures: tuple[ParkedFailure, ...]
    more: bool
    """More are parked than the reply carries: ask again once these are dropped."""


class ParkedOp:
    LIST: Final = 0
    DROP: Final = 1


@dataclass(frozen=True, slots=True)
class ParkedRequest:
    """PARKED: list (at most `limit` entries) or drop (`seqs`)."""

    op: int
    limit: int
    seqs: NDArray[np.uint64]


def fail_body(roots: ArrayLike, causes: Causes | None, *, max_frame: int) -> bytes:
    """FAIL's body for these roots and causes."""
    return encode_fail(0, roots, causes, max_frame=max_frame)[_HEAD:]


def _store_parts(store_id: str) -> list[bytes]:
    raw = store_id.encode()
    if len(raw) > _STORE_ID_MAX:
        raise BadRequest(f"a store id has at most {_STORE_ID_MAX} bytes, got {len(raw)}")
    return [_U8.pack(len(raw)), raw]


def _check_owner(owner: int) -> None:
    if isinstance(owner, bool) or not isinstance(owner, int) or not 0 <= owner < MAX_SHARDS:
        raise BadRequest(f"a parked failure's owner is a shard, 0 to {MAX_SHARDS - 1}: {owner!r}")


def encode_fail_parked(
    request_id: int,
    owner: int,
    store_id: str,
    roots: ArrayLike,
    causes: Causes | None = None,
    *,
    max_frame: int = DEFAULT_MAX_FRAME,
) -> bytes:
    """FAIL_PARKED: u16 owner shard, u8 S + S bytes utf-8 store id, then FAIL's body."""
    _check_owner(owner)
    parts = [_U16.pack(owner), *_store_parts(store_id)]
    parts.append(fail_body(roots, causes, max_frame=max_frame))
    return _join_frame(Kind.FAIL_PARKED, request_id, parts, max_frame)


def decode_fail_parked(message: Frame | bytes) -> ParkedFailure:
    """The request as the entry it becomes (seq 0: not kept yet); its FAIL body is
    checked here, so a shard keeps only a body its owner can decode."""
    body = _body(message, Kind.FAIL_PARKED)
    owner = body.u16("owner shard")
    if owner >= MAX_SHARDS:
        raise BadRequest(f"FAIL_PARKED: owner shard {owner} is beyond {MAX_SHARDS - 1}")
    size = body.unpack(_U8, "store id length")[0]
    store_id = body.text(size, "store id")
    rest = body.rest()
    entry = ParkedFailure(0, owner, store_id, rest)
    try:
        entry.fail  # noqa: B018 (decoded to check it)
    except MalformedFrame as exc:
        raise MalformedFrame(f"FAIL_PARKED: its FAIL body: {exc}") from None
    return entry


def encode_parked(request_id: int, op: int, *, limit: int = 0, seqs: ArrayLike = ()) -> bytes:
    """PARKED: u8 op; list (0): u32 limit; drop (1): u32 n, seqs u64[n]."""
    if op == ParkedOp.LIST:
        if not 0 < limit <= 0xFFFFFFFF:
            raise BadRequest(f"PARKED list: the limit is 1 to 2**32 - 1, got {limit}")
        return encode_frame(Kind.PARKED, request_id, _U8.pack(op) + _U32.pack(limit))
    if op == ParkedOp.DROP:
        column = u64_column(seqs, None, "PARKED seqs")
        parts = [_U8.pack(op), _U32.pack(len(column)), column.tobytes()]
        return _join_frame(Kind.PARKED, request_id, parts, DEFAULT_MAX_FRAME)
    raise BadRequest(f"PARKED: op is 0 (list) or 1 (drop), got {op!r}")


def decode_parked(message: Frame | bytes) -> ParkedRequest:
    body = _body(message, Kind.PARKED)
    op = body.unpack(_U8, "op")[0]
    if op == ParkedOp.LIST:
        limit = body.u32("limit")
        body.done()
        if limit == 0:
            raise BadRequest("PARKED list: the limit is at least 1")
        return ParkedRequest(op, limit, np.zeros(0, dtype=np.uint64))
    if op == ParkedOp.DROP:
        n = body.u32("seq count")
        seqs = body.array("<u8", n, "seqs")
        body.done()
        return ParkedRequest(op, 0, seqs.astype(np.uint64))
    raise BadRequest(f"PARKED: op is 0 (list) or 1 (drop), got {op}")


def encode_parked_list(
    request_id: int,
    failures: tuple[ParkedFailure, ...] | list[ParkedFailure],
    more: bool,
    *,
    max_frame: int = DEFAULT_MAX_FRAME,
) -> bytes:
    """PARKED_LIST: u8 more, u32 E, then per entry u64 seq, u16 owner, u8 S + store id,
    u32 L + L bytes of FAIL's body."""
    parts = [_U8.pack(1 if more else 0), _U32.pack(len(failures))]
    for entry in failures:
        _check_owner(entry.owner)
        parts += [_ENTRY.pack(entry.seq, entry.owner), *_store_parts(entry.store_id)]
        parts += [_U32.pack(len(entry.body)), entry.body]
    return _join_frame(Kind.PARKED_LIST, request_id, parts, max_frame)


def decode_parked_list(message: Frame | bytes) -> ParkedList:
    body = _body(message, Kind.PARKED_LIST)
    more = body.unpack(_U8, "more")[0]
    if more > 1:
        raise BadRequest(f"PARKED_LIST: more is 0 or 1, got {more}")
    count = body.u32("entry count")
    entries = []
    for i in range(count):
        seq, owner = body.unpack(_ENTRY, f"entry {i}")
        size = body.unpack(_U8, "store id length")[0]
        store_id = body.text(size, "store id")
        length = body.u32("FAIL body length")
        entries.append(ParkedFailure(seq, owner, store_id, body.raw(length, "FAIL body")))
    body.done()
    return ParkedList(tuple(entries), bool(more))
