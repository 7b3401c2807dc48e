"""Kafka records as columns: the ftkafka reader's fetch and decode, without a Python
object per record.

kafka-python decodes every record of a fetch into a `ConsumerRecord` in pure Python
(its `DefaultRecordBatch._read_msg`), the larger part of what reading a partition costs.
`columnar_consumer` installs `ColumnarPartitionRecords` into one consumer's fetcher:
kafka-python still does everything around the records (connections, metadata, fetch
requests and sessions, errors, positions, leader epochs), but the raw bytes of each
partition's fetch response are decoded here, by `decode_record_batches` (compiled with
numba), into `RecordColumns`: offsets and timestamps as numpy arrays, keys and values
as Arrow binary arrays built from one gathered buffer each, Kafka headers as Python
pairs only for the records that have some. `consumer.poll(max_records=1)` then returns
one `RecordColumns` of at most `chunk_records` records per partition.

What the fast path decodes: record batches of magic 2 (Kafka 0.11 and later), not
compressed, not control batches, and (under `isolation_level=read_committed`) not
transactional. Anything else, and anything that does not parse exactly as Kafka's
format says (a CRC mismatch with `check_crcs`, a varint out of range, a record whose
length disagrees with its fields, bytes left after a batch's records, a header key that
is not utf-8), hands the whole fetch to kafka-python's own decoding, whose records
are turned into the same columns (`RecordColumns.of_records`) or whose error is raised
as kafka-python raises it. So the columns never depend on the fast path: it yields what
kafka-python would, faster (the property test in tests/integration/test_columnar.py).

The CRC-32C of every batch is checked as kafka-python checks it (the `crc32c`
package, one call per batch), unless the consumer has `check_crcs=False`.

The kernels are compiled on first use and cached on disk (numba's `cache=True`, in
`__pycache__` beside this file), so a fresh Python worker loads them instead of
compiling them again.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import crc32c
import numpy as np
import pyarrow as pa
from kafka.consumer.fetcher import Fetcher
from numba import njit  # type: ignore[import-untyped]
from numpy.typing import NDArray

__all__ = [
    "ColumnarPartitionRecords",
    "RecordColumns",
    "columnar_consumer",
    "decode_record_batches",
]

Header = tuple[str, bytes | None]

_BASE: Final[Any] = getattr(Fetcher, "PartitionRecords", object)

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

_MAX_ARROW_BYTES: Final = 2**31 - 1  # what a binary array's int32 offsets reach
# decode_record_batches' verdicts
DECODED: Final = 0
FALLBACK: Final = 1  # something the fast path leaves to kafka-python


@dataclass(frozen=True, slots=True)
class RecordColumns:
    """Consecutive records of one Kafka partition as columns: `keys` and `values` are
    Arrow binary arrays (null where the record has none), `offsets` and `timestamps`
    (epoch ms) int64 arrays, `headers` each record's Kafka headers in order, or None
    when no record has any."""

    keys: Any
    values: Any
    offsets: NDArray[np.int64]
    timestamps: NDArray[np.int64]
    headers: list[list[Header]] | None

    def __len__(self) -> int:
        return len(self.offsets)

    def slice(self, lo: int, hi: int) -> RecordColumns:
        """Records [lo, hi) (Arrow and numpy slices: no copy)."""
        return RecordColumns(
            self.keys.slice(lo, hi - lo),
            self.values.slice(lo, hi - lo),
            self.offsets[lo:hi],
            self.timestamps[lo:hi],
            None if self.headers is None else self.headers[lo:hi],
        )

    def before(self, end: int) -> RecordColumns:
        """The records with offset < `end`."""
        keep = self.offsets < end
        if keep.all():
            return self
        rows = np.flatnonzero(keep)
        mask = pa.array(keep)
        return RecordColumns(
            self.keys.filter(mask),
            self.values.filter(mask),
            self.offsets[rows],
            self.timestamps[rows],
            None if self.headers is None else [self.headers[i] for i in rows.tolist()],
        )

    def header_lists(self) -> list[list[Header]]:
        """`headers`, with an empty list per record when no record has any."""
        return [[] for _ in range(len(self))] if self.headers is None else self.headers

    @classmethod
    def of_records(cls, records: Sequence[Any]) -> RecordColumns:
        """The columns of kafka-python's ConsumerRecords (its own decoding's result)."""
        n = len(records)
        headers = [list(r.headers or ()) for r in records]
        return cls(
            pa.array([r.key for r in records], type=pa.binary()),
            pa.array([r.value for r in records], type=pa.binary()),
            np.fromiter((r.offset for r in records), np.int64, n),
            np.fromiter((r.timestamp for r in records), np.int64, n),
            headers if any(headers) else None,
        )

    @classmethod
    def concat(cls, parts: Sequence[RecordColumns]) -> RecordColumns:
        if len(parts) == 1:
            return parts[0]
        with_headers = any(p.headers is not None for p in parts)
        return cls(
            pa.concat_arrays([p.keys for p in parts]),
            pa.concat_arrays([p.values for p in parts]),
            np.concatenate([p.offsets for p in parts]),
            np.concatenate([p.timestamps for p in parts]),
            list(itertools.chain.from_iterable(p.header_lists() for p in parts))
            if with_headers
            else None,
        )

    @classmethod
    def of_polled(cls, polled: Sequence[Any]) -> RecordColumns:
        """What one `poll()` returned for a partition: RecordColumns from a consumer that
        `columnar_consumer` set up, ConsumerRecords from any other."""
        if polled and all(isinstance(p, RecordColumns) for p in polled):
            return cls.concat(polled)
        return cls.of_records(polled)


@dataclass(frozen=True, slots=True)
class _Batches:
    """One fetch's record batches as decode_record_batches found them."""

    crc_from: NDArray[np.int64]  # where the CRC starts covering
    ends: NDArray[np.int64]
    crcs: NDArray[np.int64]
    base_offsets: NDArray[np.int64]
    next_offsets: NDArray[np.int64]
    leader_epochs: NDArray[np.int64]
    sizes: NDArray[np.int64]


def decode_record_batches(
    raw: Any, *, from_offset: int, transactional_ok: bool = True, check_crcs: bool = True
) -> tuple[RecordColumns, _Batches] | None:
    """The records with offset >= `from_offset` of the complete record batches in `raw`
    (the `records` bytes of one partition of a FetchResponse; a batch cut off at the end
    is left out, as kafka-python leaves it), and the batches; None when the fast path
    leaves these bytes to kafka-python (see the module docstring)."""
    buf = np.frombuffer(raw, dtype=np.uint8)
    status, counts = _scan(buf, transactional_ok)
    if status != DECODED:
        return None
    n_records, n_headers, n_batches = (int(c) for c in counts)
    record_fields = np.empty((8, n_records), dtype=np.int64)
    header_fields = np.empty((4, n_headers), dtype=np.int64)
    batch_fields = np.empty((7, n_batches), dtype=np.int64)
    _fill(buf, record_fields, header_fields, batch_fields)
    batches = _Batches(*batch_fields)
    if check_crcs:
        view = memoryview(raw).cast("B")
        for lo, hi, crc in zip(
            batches.crc_from.tolist(), batches.ends.tolist(), batches.crcs.tolist(), strict=True
        ):
            if crc32c.crc32c(view[lo:hi]) != crc:
                return None
    offsets, stamps, key_at, key_len, value_at, value_len, header_from, header_count = record_fields
    if bool((offsets[1:] <= offsets[:-1]).any()):  # never so in a log Kafka wrote
        return None
    first = int(np.searchsorted(offsets, from_offset))  # a batch may begin before it
    if max(_bytes_of(key_len[first:]), _bytes_of(value_len[first:])) > _MAX_ARROW_BYTES:
        return None
    # Every record's headers, those before the fetch offset too: kafka-python decodes
    # them, and reports a header key that is not utf-8 there as well.
    headers = _headers(raw, header_fields, header_from, header_count)
    if headers is False:
        return None
    if isinstance(headers, list):
        headers = headers[first:] if any(headers[first:]) else None
    columns = RecordColumns(
        _binary(buf, key_at[first:], key_len[first:]),
        _binary(buf, value_at[first:], value_len[first:]),
        offsets[first:].copy(),
        stamps[first:].copy(),
        headers,
    )
    return columns, batches


def _headers(
    raw: Any, fields: NDArray[np.int64], first: NDArray[np.int64], counts: NDArray[np.int64]
) -> list[list[Header]] | bool | None:
    """Each record's headers as kafka-python has them (None: no record has any; False:
    a key is not utf-8, which kafka-python reports as a corrupt record)."""
    if not counts.any():
        return None
    key_at, key_len, value_at, value_len = fields.tolist()
    view = memoryview(raw).cast("B")
    found: list[list[Header]] = []
    try:
        for lo, count in zip(first.tolist(), counts.tolist(), strict=True):
            found.append(
                [
                    (
                        bytes(view[key_at[h] : key_at[h] + key_len[h]]).decode("utf-8"),
                        None
                        if value_len[h] < 0
                        else bytes(view[value_at[h] : value_at[h] + value_len[h]]),
                    )
                    for h in range(lo, lo + count)
                ]
            )
    except UnicodeDecodeError:
        return False
    return found


def _bytes_of(lengths: NDArray[np.int64]) -> int:
    return int(lengths[lengths > 0].sum())


def _binary(buf: NDArray[np.uint8], at: NDArray[np.int64], lengths: NDArray[np.int64]) -> Any:
    """A pyarrow binary array of buf[at[i] : at[i] + lengths[i]], null where length < 0."""
    offsets, data = _gather(buf, at, lengths)
    valid = lengths >= 0
    nulls = len(lengths) - int(np.count_nonzero(valid))
    bitmap = pa.py_buffer(np.packbits(valid, bitorder="little")) if nulls else None
    return pa.Array.from_buffers(
        pa.binary(), len(lengths), [bitmap, pa.py_buffer(offsets), pa.py_buffer(data)], nulls
    )


# The kernels. Every read is bounded by its batch's end; anything out of place returns
# FALLBACK from _scan, so _fill, run only after a clean scan, checks nothing again.


@njit(cache=True, nogil=True, inline="always")  # type: ignore[misc]
def _int(buf: Any, at: int, size: int) -> Any:
    """A signed big-endian integer of `size` bytes."""
    value = np.int64(0)
    for i in range(size):
        value = (value << np.int64(8)) | np.int64(buf[at + i])
    if size < 8 and value >= np.int64(1) << np.int64(8 * size - 1):
        value -= np.int64(1) << np.int64(8 * size)
    return value


@njit(cache=True, nogil=True, inline="always")  # type: ignore[misc]
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


@njit(cache=True, nogil=True)  # type: ignore[misc]
def _scan(buf: Any, transactional_ok: bool) -> Any:
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


@njit(cache=True, nogil=True)  # type: ignore[misc]
def _fill(buf: Any, records: Any, headers: Any, batches: Any) -> None:
    """The fields of what _scan counted: per record offset, timestamp, key and value
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


@njit(cache=True, nogil=True)  # type: ignore[misc]
def _gather(buf: Any, at: Any, lengths: Any) -> Any:
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


def columnar_consumer(consumer: Any, chunk_records: int) -> bool:
    """Make `consumer.poll(max_records=1)` return, per partition, one RecordColumns of at
    most `chunk_records` records instead of ConsumerRecords; False (and the consumer
    unchanged) if this kafka-python's fetcher has no PartitionRecords to replace."""
    fetcher = getattr(consumer, "_fetcher", None)
    if fetcher is None or getattr(type(fetcher), "PartitionRecords", None) is not _BASE:
        return False
    fetcher.PartitionRecords = functools.partial(
        ColumnarPartitionRecords, chunk_records=chunk_records
    )
    return True


class ColumnarPartitionRecords(_BASE):  # type: ignore[misc,valid-type]
    """kafka-python's PartitionRecords (one partition's part of a fetch response, taken
    by poll() item by item), whose items are RecordColumns of at most `chunk_records`
    records. The fetch position (`next_fetch_offset`) and `leader_epoch` move as
    kafka-python moves them: past each item's last record, and past the last batch
    after the last item."""

    def __init__(self, *args: Any, chunk_records: int, **kwargs: Any) -> None:
        self._chunk_records = max(1, chunk_records)
        super().__init__(*args, **kwargs)

    def _maybe_skip_record(self, record: Any) -> bool:
        return False  # the items start at the fetch offset already

    def _unpack_records(
        self, tp: Any, records: Any, key_deserializer: Any, value_deserializer: Any
    ) -> Iterator[RecordColumns]:
        raw = getattr(records, "_buffer", None)
        level = getattr(self, "isolation_level", None)
        decoded = None
        if raw is not None and key_deserializer is None and value_deserializer is None:
            decoded = decode_record_batches(
                raw,
                from_offset=self.fetch_offset,
                transactional_ok=isinstance(level, int) and level == 0,
                check_crcs=bool(getattr(self, "check_crcs", True)),
            )
        if decoded is None:
            yield from self._decoded_by_kafka_python(
                tp, records, key_deserializer, value_deserializer
            )
            return
        columns, batches = decoded
        n = len(columns)
        self.records_read += n
        self.bytes_read += int(batches.sizes.sum())
        for lo in range(0, n, self._chunk_records):
            hi = min(lo + self._chunk_records, n)
            if hi < n:
                last = int(columns.offsets[hi - 1])
                self.next_fetch_offset = last + 1
                batch = int(np.searchsorted(batches.base_offsets, last, side="right")) - 1
                self.leader_epoch = int(batches.leader_epochs[batch])
            else:
                self._past(batches)
                self.drain()  # before the last item: the next fetch may go out at once
            yield columns.slice(lo, hi)
        if n == 0:
            self._past(batches)
        self.drain()

    def _past(self, batches: _Batches) -> None:
        if len(batches.next_offsets):
            self.next_fetch_offset = int(batches.next_offsets[-1])
            self.leader_epoch = int(batches.leader_epochs[-1])

    def _decoded_by_kafka_python(
        self, tp: Any, records: Any, key_deserializer: Any, value_deserializer: Any
    ) -> Iterator[RecordColumns]:
        """kafka-python's own decoding (which also moves the position and drains), its
        ConsumerRecords turned into columns."""
        run: list[Any] = []
        unpacked = super()._unpack_records(tp, records, key_deserializer, value_deserializer)
        try:
            # What _maybe_skip_record skips: the records before the fetch offset that a
            # batch holds when the fetch offset is inside it.
            for record in itertools.dropwhile(super()._maybe_skip_record, unpacked):
                run.append(record)
                if len(run) == self._chunk_records:
                    yield RecordColumns.of_records(run)
                    run = []
        except Exception:  # as kafka-python does: the records before the error first
            if run:
                yield RecordColumns.of_records(run)
            raise
        if run:
            yield RecordColumns.of_records(run)
