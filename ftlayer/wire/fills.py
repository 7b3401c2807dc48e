"""The messages of records stored by reference (docs/protocol.md 5.12): UNFILLED asks
for a source's failed records whose bytes the FT layer does not hold, UNFILLED_LIST
answers with their storage seqs and coordinates, FILL hands their bytes back (or says
the source no longer has them). ftlayer.core.fills has the contract."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
from numpy.typing import NDArray

from ftlayer.records import Payloads, RecordBatch

from .blocks import is_u32, read_records, record_parts
from .frames import (
    _U32,
    DEFAULT_MAX_FRAME,
    MAX_U32,
    BadRequest,
    Frame,
    Kind,
    MalformedFrame,
    _body,
    _join_frame,
    encode_frame,
)

__all__ = [
    "Fill",
    "Unfilled",
    "UnfilledList",
    "decode_fill",
    "decode_unfilled",
    "decode_unfilled_list",
    "encode_fill",
    "encode_unfilled",
    "encode_unfilled_list",
]

_UNFILLED: Final = struct.Struct("<II")  # source id, limit


@dataclass(frozen=True, slots=True)
class Unfilled:
    """UNFILLED: up to `limit` unfilled records of `source_id`."""

    source_id: int
    limit: int


@dataclass(frozen=True, slots=True)
class UnfilledList:
    """UNFILLED_LIST: the records' storage seqs and the stored records (payloads empty)."""

    seqs: NDArray[np.uint64]
    records: RecordBatch

    def __len__(self) -> int:
        return len(self.seqs)


@dataclass(frozen=True, slots=True)
class Fill:
    """FILL: per storage seq, whether its source still has the record (`found`) and, if
    so, its bytes."""

    seqs: NDArray[np.uint64]
    found: NDArray[np.bool_]
    payloads: Sequence[bytes]


def encode_unfilled(request_id: int, source_id: int, limit: int) -> bytes:
    """UNFILLED: u32 source id, u32 limit."""
    if not (is_u32(source_id) and is_u32(limit)):
        raise BadRequest(f"UNFILLED needs a u32 source id and limit, got {source_id!r}, {limit!r}")
    return encode_frame(Kind.UNFILLED, request_id, _UNFILLED.pack(source_id, limit))


def decode_unfilled(message: Frame | bytes) -> Unfilled:
    body = _body(message, Kind.UNFILLED)
    source_id, limit = body.unpack(_UNFILLED, "source id and limit")
    body.done()
    return Unfilled(int(source_id), int(limit))


def encode_unfilled_list(
    request_id: int,
    seqs: NDArray[np.uint64],
    records: RecordBatch,
    *,
    max_frame: int = DEFAULT_MAX_FRAME,
) -> bytes:
    """UNFILLED_LIST: u32 n, seqs u64[n], then the record columns (no initial values)."""
    n = len(records)
    if len(seqs) != n:
        raise BadRequest(f"UNFILLED_LIST needs a seq per record: {len(seqs)} seqs, {n} records")
    parts = [_U32.pack(n), np.ascontiguousarray(seqs, dtype="<u8").tobytes()]
    record_parts(records, None, parts)
    return _join_frame(Kind.UNFILLED_LIST, request_id, parts, max_frame)


def decode_unfilled_list(message: Frame | bytes) -> UnfilledList:
    body = _body(message, Kind.UNFILLED_LIST)
    n = body.u32("record count")
    seqs = body.array("<u8", n, "seqs")
    records, _ = read_records(body, n, with_initial=False)
    return UnfilledList(seqs, records)


def encode_fill(
    request_id: int,
    seqs: NDArray[np.uint64] | Sequence[int],
    found: NDArray[np.bool_] | Sequence[bool],
    payloads: Sequence[bytes],
    *,
    max_frame: int = DEFAULT_MAX_FRAME,
) -> bytes:
    """FILL: u32 n, seqs u64[n], found u8[n] (0 or 1), payload lengths u32[n] (0 where
    not found), the payloads concatenated."""
    seq_array = np.asarray(seqs, dtype="<u8")
    found_array = np.asarray(found, dtype=np.bool_)
    n = len(seq_array)
    if not n == len(found_array) == len(payloads):
        raise BadRequest(
            f"FILL needs a found flag and a payload per seq: {n} seqs, {len(found_array)} "
            f"flags, {len(payloads)} payloads"
        )
    lengths = np.fromiter(map(len, payloads), dtype=np.int64, count=n)
    if n and (int(lengths.max()) > MAX_U32 or bool((lengths[~found_array] > 0).any())):
        raise BadRequest("FILL payloads are at most 4 GiB, and empty where not found")
    parts = [
        _U32.pack(n),
        seq_array.tobytes(),
        found_array.astype("u1").tobytes(),
        lengths.astype("<u4").tobytes(),
        *payloads,
    ]
    return _join_frame(Kind.FILL, request_id, parts, max_frame)


def decode_fill(message: Frame | bytes) -> Fill:
    body = _body(message, Kind.FILL)
    n = body.u32("record count")
    seqs = body.array("<u8", n, "seqs")
    found = body.array("u1", n, "found flags")
    lengths = body.array("<u4", n, "payload lengths")
    blob = body.rest()
    total = int(lengths.sum(dtype=np.uint64))
    if total != len(blob):
        raise MalformedFrame(
            f"FILL payload lengths add up to {total} bytes, but {len(blob)} bytes follow them"
        )
    if n and (int(found.max()) > 1 or bool((lengths[found == 0] > 0).any())):
        raise BadRequest("FILL found flags are 0 or 1, and a record not found has no payload")
    return Fill(seqs, found.astype(np.bool_), Payloads(blob, lengths))
