"""The messages of records stored by reference (docs/protocol.md 5.13 and 5.14):
UNFILLED asks for a source's failed records whose bytes the FT layer does not hold,
UNFILLED_LIST answers with their storage seqs and coordinates, FILL hands their bytes
and key hashes back (or says the source no longer has them); BATCH_RANGES opens a
barrier-mode batch's offset ranges, and RANGE_NUMBERS answers their numbers.
ftlayer.core.fills and ftlayer.core.ranges have the contracts."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
from numpy.typing import NDArray

from ftlayer.records import Payloads, RecordBatch

from .blocks import dump_json, is_int, is_u32, parse_json, read_records, record_parts
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
    "BatchRanges",
    "Fill",
    "RangeRead",
    "Unfilled",
    "UnfilledList",
    "decode_batch_ranges",
    "decode_fill",
    "decode_range_numbers",
    "decode_range_read",
    "decode_unfilled",
    "decode_unfilled_list",
    "encode_batch_ranges",
    "encode_fill",
    "encode_range_numbers",
    "encode_range_read",
    "encode_unfilled",
    "encode_unfilled_list",
]

_UNFILLED: Final = struct.Struct("<II")  # source id, limit
_RANGE_READ: Final = struct.Struct("<QQQ")  # first range root, count, seed


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
    key_hashes: NDArray[np.int64]
    has_key: NDArray[np.bool_]


@dataclass(frozen=True, slots=True)
class RangeRead:
    """RANGE_READ: a reader emits `n` records of a tree-mode range from the one whose
    range root is `first` on, with ids under `seed` (ftlayer.core.rangeacks.read)."""

    first: int
    n: int
    seed: int


@dataclass(frozen=True, slots=True)
class BatchRanges:
    """BATCH_RANGES: (source id, topic, partition, start, end) ranges to open; `tree`:
    as tree-mode ranges (each record completes with its tree)."""

    ranges: list[tuple[int, str, int, int, int]]
    tree: bool = False


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
    keys: tuple[NDArray[np.int64], NDArray[np.bool_]] | None = None,
    *,
    max_frame: int = DEFAULT_MAX_FRAME,
) -> bytes:
    """FILL: u32 n, seqs u64[n], found u8[n] (0 or 1), key hashes i64[n], has_key
    u8[n], payload lengths u32[n] (0 where not found), the payloads concatenated."""
    seq_array = np.asarray(seqs, dtype="<u8")
    found_array = np.asarray(found, dtype=np.bool_)
    n = len(seq_array)
    if keys is None:
        keys = (np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.bool_))
    if not n == len(found_array) == len(payloads) == len(keys[0]) == len(keys[1]):
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
        np.asarray(keys[0], dtype="<i8").tobytes(),
        np.asarray(keys[1], dtype=np.bool_).astype("u1").tobytes(),
        lengths.astype("<u4").tobytes(),
        *payloads,
    ]
    return _join_frame(Kind.FILL, request_id, parts, max_frame)


def decode_fill(message: Frame | bytes) -> Fill:
    body = _body(message, Kind.FILL)
    n = body.u32("record count")
    seqs = body.array("<u8", n, "seqs")
    found = body.array("u1", n, "found flags")
    key_hashes = body.array("<i8", n, "key hashes")
    has_key = body.array("u1", n, "has_key")
    lengths = body.array("<u4", n, "payload lengths")
    blob = body.rest()
    total = int(lengths.sum(dtype=np.uint64))
    if total != len(blob):
        raise MalformedFrame(
            f"FILL payload lengths add up to {total} bytes, but {len(blob)} bytes follow them"
        )
    if n and (
        int(found.max()) > 1 or int(has_key.max()) > 1 or bool((lengths[found == 0] > 0).any())
    ):
        raise BadRequest(
            "FILL found and has_key flags are 0 or 1, and a record not found has no payload"
        )
    return Fill(
        seqs, found.astype(np.bool_), Payloads(blob, lengths), key_hashes, has_key.astype(np.bool_)
    )


def encode_batch_ranges(
    request_id: int, ranges: Sequence[tuple[int, str, int, int, int]], *, tree: bool = False
) -> bytes:
    """BATCH_RANGES: utf-8 JSON {"ranges": [[source id, topic, partition, start, end]]},
    with "tree": true for tree-mode ranges."""
    body: dict[str, object] = {"ranges": [list(r) for r in ranges]}
    if tree:
        body["tree"] = True
    _check_ranges(body)
    return encode_frame(Kind.BATCH_RANGES, request_id, dump_json(body, "BATCH_RANGES body"))


def decode_batch_ranges(message: Frame | bytes) -> BatchRanges:
    body = parse_json(_body(message, Kind.BATCH_RANGES).rest(), Kind.BATCH_RANGES)
    _check_ranges(body)
    return BatchRanges(
        [(int(a), str(b), int(c), int(d), int(e)) for a, b, c, d, e in body["ranges"]],
        tree=bool(body.get("tree", False)),
    )


def _check_ranges(body: object, kind: Kind = Kind.BATCH_RANGES) -> None:
    """BATCH_RANGES' body, or the ranges and "tree" of another `kind`'s."""
    ok = (
        isinstance(body, dict)
        and set(body) in ({"ranges"}, {"ranges", "tree"})
        and isinstance(body.get("tree", False), bool)
        and isinstance(body["ranges"], list)
        and len(body["ranges"]) <= MAX_U32
        and all(
            isinstance(r, list)
            and len(r) == 5
            and is_u32(r[0])
            and isinstance(r[1], str)
            and is_int(r[2])
            and 0 <= r[2] < 2**31
            and is_int(r[3])
            and is_int(r[4])
            and 0 <= r[3] <= r[4] < 2**63
            for r in body["ranges"]
        )
    )
    if not ok:
        raise BadRequest(
            f'{kind.name} body must be {{"ranges": [[u32 source id, topic, partition, start, '
            f'end]]}} (and "tree": a bool) with 0 <= start <= end, got {body!r}'[:600]
        )


def encode_range_numbers(request_id: int, numbers: Sequence[int]) -> bytes:
    """RANGE_NUMBERS: u32 n, u32 numbers[n] (0: an empty range, none opened)."""
    array = np.asarray(list(numbers), dtype=np.int64)
    if len(array) and (int(array.min()) < 0 or int(array.max()) > MAX_U32):
        raise BadRequest("range numbers are u32")
    return encode_frame(
        Kind.RANGE_NUMBERS, request_id, _U32.pack(len(array)) + array.astype("<u4").tobytes()
    )


def decode_range_numbers(message: Frame | bytes) -> list[int]:
    body = _body(message, Kind.RANGE_NUMBERS)
    n = body.u32("count")
    numbers = body.array("<u4", n, "range numbers")
    body.done()
    return [int(x) for x in numbers.tolist()]


def encode_range_read(request_id: int, first: int, n: int, seed: int) -> bytes:
    """RANGE_READ: u64 the range root of the first record read, u64 n, u64 seed."""
    if not (0 <= first < 2**64 and 0 <= n < 2**64 and 0 < seed < 2**64):
        raise BadRequest(f"RANGE_READ needs u64 root, count and seed (not 0), got {first, n, seed}")
    return encode_frame(Kind.RANGE_READ, request_id, _RANGE_READ.pack(first, n, seed))


def decode_range_read(message: Frame | bytes) -> RangeRead:
    body = _body(message, Kind.RANGE_READ)
    first, n, seed = body.unpack(_RANGE_READ, "RANGE_READ body")
    body.done()
    if not seed:
        raise BadRequest("RANGE_READ's seed is not 0")
    return RangeRead(first, n, seed)
