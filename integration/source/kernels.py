"""The numba kernels of the ftkafka reader's record decoding (`.columnar`, whose
docstring says what is decoded and what is left to kafka-python).

`scan` walks the record batches of one partition's fetch and says whether each is one
the fast path decodes; `fill`, run only after a clean scan, writes the fields of every
record, header and batch; `gather` copies byte ranges into one Arrow data buffer. Every
read of `scan` is bounded by its batch's end, so no bytes, however damaged, make it
read outside the fetch. Loaded by `.columnar` on first use (importing numba takes a
while, and only a reader needs it); compiled once and cached on disk beside this file
(numba's `cache=True`), so a fresh Spark Python worker loads the machine code instead
of compiling it.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
from numba import njit

__all__ = ["DECODED", "FALLBACK", "fill", "gather", "scan"]

# Offsets in a record batch of magic 2 (Kafka's DefaultRecordBatch): base offset i64,
# length i32, partition leader epoch i32, magic i8, crc u32, attributes i16, last
# offset delta i32, first timestamp i64, max timestamp i64, producer id i64, producer
# epoch i16, base sequence i32, record count i32; then the records.
_LOG_OVERHEAD: Final = 12  # base offset and length: what the length does not count
_CRC_AT: Final = 17
_ATTRIBUTES_AT: Final = 21  # where the CRC starts covering
_BATCH_HEADER: Final = 61
_COMPRESSION: Final = 0x07
_LOG_APPEND_TIME: Final = 0x08
_TRANSACTIONAL: Final = 0x10
_CONTROL: Final = 0x20

DECODED: Final = 0
FALLBACK: Final = 1  # something the fast path leaves to kafka-python


@njit(cache=True, nogil=True, inline="always")
def _int(buf: Any, at: int, size: int) -> Any:
    """A signed big-endian integer of `size` bytes."""
    value = np.int64(0)
    for i in range(size):
        value = (value << np.int64(8)) | np.int64(buf[at + i])
    if size < 8 and value >= np.int64(1) << np.int64(8 * size - 1):
        value -= np.int64(1) << np.int64(8 * size)
    return value


@njit(cache=True, nogil=True, inline="always")
def _varint(buf: Any, at: int, end: int) -> Any:
    """(value, next position) of the zigzag varint at `at`; next position -1 when it runs
    past `end` or past 64 bits."""
    raw = np.uint64(0)
    shift = np.uint64(0)
    while True:
        if at >= end:
            return np.int64(0), np.int64(-1)
        byte = np.uint64(buf[at])
        at += 1
        if shift == np.uint64(63) and byte > np.uint64(1):
            return np.int64(0), np.int64(-1)
        raw |= (byte & np.uint64(0x7F)) << shift
        if byte < np.uint64(0x80):
            break
        shift += np.uint64(7)
    value = np.int64(raw >> np.uint64(1)) ^ -np.int64(raw & np.uint64(1))
    return value, np.int64(at)


@njit(cache=True, nogil=True)
def scan(buf: Any, transactional_ok: bool) -> Any:
    """(DECODED, [records, headers, batches]) if every complete batch in `buf` is one the
    fast path decodes, else (FALLBACK, zeros)."""
    counts = np.zeros(3, dtype=np.int64)
    size = len(buf)
    pos = 0
    while size - pos >= _LOG_OVERHEAD:
        length = _int(buf, pos + 8, 4)
        end = pos + _LOG_OVERHEAD + length
        if end > size:
            break  # the last batch, cut off by the fetch size
        if length < _BATCH_HEADER - _LOG_OVERHEAD or buf[pos + 16] != 2:
            return FALLBACK, counts
        attributes = _int(buf, pos + _ATTRIBUTES_AT, 2)
        if attributes & (_COMPRESSION | _CONTROL):
            return FALLBACK, counts
        if attributes & _TRANSACTIONAL and not transactional_ok:
            return FALLBACK, counts
        at = pos + _BATCH_HEADER
        for _ in range(_int(buf, pos + 57, 4)):
            length, at = _varint(buf, at, end)
            start = at
            for _field in range(3):  # attributes, timestamp delta, offset delta
                if at >= 0:
                    _, at = _varint(buf, at, end)
            for _field in range(2):  # key, value
                if at >= 0:
                    size_of, at = _varint(buf, at, end)
                    if size_of > end - at:
                        return FALLBACK, counts
                    if size_of > 0:
                        at += size_of
            if at < 0:
                return FALLBACK, counts
            n_headers, at = _varint(buf, at, end)
            if at < 0 or n_headers < 0:
                return FALLBACK, counts
            for _h in range(n_headers):
                key_len, at = _varint(buf, at, end)
                if at < 0 or key_len < 0 or key_len > end - at:
                    return FALLBACK, counts
                at += key_len
                value_len, at = _varint(buf, at, end)
                if at < 0 or value_len > end - at:
                    return FALLBACK, counts
                if value_len > 0:
                    at += value_len
            counts[1] += n_headers
            if at - start != length:
                return FALLBACK, counts
            counts[0] += 1
        if at != end:
            return FALLBACK, counts
        counts[2] += 1
        pos = end
    return DECODED, counts


@njit(cache=True, nogil=True)
def fill(buf: Any, records: Any, headers: Any, batches: Any) -> None:
    """The fields of what scan counted: per record offset, timestamp, key and value
    position and length (-1: null), first header and header count; per header key and
    value position and length; per batch CRC range, CRC, base offset, next offset,
    leader epoch and size."""
    size = len(buf)
    pos = 0
    r = 0
    h = 0
    b = 0
    while size - pos >= _LOG_OVERHEAD:
        end = pos + _LOG_OVERHEAD + _int(buf, pos + 8, 4)
        if end > size:
            break
        base_offset = _int(buf, pos, 8)
        log_append = _int(buf, pos + _ATTRIBUTES_AT, 2) & _LOG_APPEND_TIME
        first_timestamp = _int(buf, pos + 27, 8)
        max_timestamp = _int(buf, pos + 35, 8)
        batches[0, b] = pos + _ATTRIBUTES_AT
        batches[1, b] = end
        batches[2, b] = _int(buf, pos + _CRC_AT, 4) & np.int64(0xFFFFFFFF)
        batches[3, b] = base_offset
        batches[4, b] = base_offset + _int(buf, pos + 23, 4) + 1
        batches[5, b] = _int(buf, pos + 12, 4)
        batches[6, b] = end - pos
        at = pos + _BATCH_HEADER
        for _ in range(_int(buf, pos + 57, 4)):
            _, at = _varint(buf, at, end)  # length
            _, at = _varint(buf, at, end)  # attributes
            delta, at = _varint(buf, at, end)
            records[1, r] = max_timestamp if log_append else first_timestamp + delta
            delta, at = _varint(buf, at, end)
            records[0, r] = base_offset + delta
            for field in (2, 4):  # key, value
                size_of, at = _varint(buf, at, end)
                records[field, r] = at
                records[field + 1, r] = size_of if size_of >= 0 else -1
                if size_of > 0:
                    at += size_of
            n_headers, at = _varint(buf, at, end)
            records[6, r] = h
            records[7, r] = n_headers
            for _h in range(n_headers):
                key_len, at = _varint(buf, at, end)
                headers[0, h] = at
                headers[1, h] = key_len
                at += key_len
                value_len, at = _varint(buf, at, end)
                headers[2, h] = at
                headers[3, h] = value_len if value_len >= 0 else -1
                if value_len > 0:
                    at += value_len
                h += 1
            r += 1
        b += 1
        pos = end


@njit(cache=True, nogil=True)
def gather(buf: Any, at: Any, lengths: Any) -> Any:
    """(int32 Arrow offsets, data) of the byte ranges buf[at[i] : at[i] + lengths[i]]
    (empty where length < 0)."""
    n = len(at)
    offsets = np.empty(n + 1, dtype=np.int32)
    offsets[0] = 0
    total = 0
    for i in range(n):
        if lengths[i] > 0:
            total += lengths[i]
        offsets[i + 1] = total
    data = np.empty(total, dtype=np.uint8)
    out = 0
    for i in range(n):
        for j in range(at[i], at[i] + max(lengths[i], 0)):
            data[out] = buf[j]
            out += 1
    return offsets, data
