"""Kafka records as columns: the ftkafka reader's fetch and decode, without a Python
object per record.

kafka-python decodes every record of a fetch into a `ConsumerRecord` in pure Python
(its `DefaultRecordBatch._read_msg`), the larger part of what reading a partition costs.
`columnar_consumer` installs `ColumnarPartitionRecords` into one consumer's fetcher:
kafka-python still does everything around the records (connections, metadata, fetch
requests and sessions, errors, positions, leader epochs), but the raw bytes of each
partition's fetch response are decoded here, by `decode_record_batches` (over the numba
kernels of `.kernels`), into `RecordColumns`: offsets and timestamps as numpy arrays,
keys and values as Arrow binary arrays built from one gathered buffer each, Kafka
headers as Python pairs only for the records that have some.
`consumer.poll(max_records=1)` then returns one `RecordColumns` of at most
`chunk_records` records per partition.

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
`__pycache__` beside `kernels.py`), so a fresh Python worker loads them instead of
compiling them again; `make` compiles them once (`compile_kernels`).
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
from numpy.typing import NDArray

__all__ = [
    "ColumnarPartitionRecords",
    "RecordColumns",
    "columnar_consumer",
    "compile_kernels",
    "decode_record_batches",
]

Header = tuple[str, bytes | None]

_BASE: Final[Any] = getattr(Fetcher, "PartitionRecords", object)

_MAX_ARROW_BYTES: Final = 2**31 - 1  # what a binary array's int32 offsets reach


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
    from . import kernels  # numba: loaded by the first reader, not by every importer

    buf = np.frombuffer(raw, dtype=np.uint8)
    status, counts = kernels.scan(buf, transactional_ok)
    if status != kernels.DECODED:
        return None
    n_records, n_headers, n_batches = (int(c) for c in counts)
    record_fields = np.empty((8, n_records), dtype=np.int64)
    header_fields = np.empty((4, n_headers), dtype=np.int64)
    batch_fields = np.empty((7, n_batches), dtype=np.int64)
    kernels.fill(buf, record_fields, header_fields, batch_fields)
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
    readable, every = _headers(raw, header_fields, header_from, header_count)
    if not readable:
        return None
    headers = every[first:] if any(every[first:]) else None
    columns = RecordColumns(
        _binary(kernels.gather(buf, key_at[first:], key_len[first:]), key_len[first:]),
        _binary(kernels.gather(buf, value_at[first:], value_len[first:]), value_len[first:]),
        offsets[first:].copy(),
        stamps[first:].copy(),
        headers,
    )
    return columns, batches


def _headers(
    raw: Any, fields: NDArray[np.int64], first: NDArray[np.int64], counts: NDArray[np.int64]
) -> tuple[bool, list[list[Header]]]:
    """(True, each record's headers as kafka-python has them; empty: no record has any),
    or (False, []) for a header key that is not utf-8, which kafka-python reports as a
    corrupt record."""
    if not counts.any():
        return True, []
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
        return False, []
    return True, found


def _bytes_of(lengths: NDArray[np.int64]) -> int:
    return int(lengths[lengths > 0].sum())


def _binary(gathered: tuple[Any, Any], lengths: NDArray[np.int64]) -> Any:
    """A pyarrow binary array of the gathered (offsets, data), null where length < 0."""
    offsets, data = gathered
    valid = lengths >= 0
    nulls = len(lengths) - int(np.count_nonzero(valid))
    bitmap = pa.py_buffer(np.packbits(valid, bitorder="little")) if nulls else None
    return pa.Array.from_buffers(
        pa.binary(), len(lengths), [bitmap, pa.py_buffer(offsets), pa.py_buffer(data)], nulls
    )


def compile_kernels() -> None:
    """Compile the kernels (or load them from numba's cache): `make` runs this once, so
    no Spark task waits for a compilation."""
    decode_record_batches(
        bytes.fromhex(  # one record, key b"k", value b"v", header ("h", b"v")
            "00000000000000000000003e0000000002030e2c6a0000000000000000000000000000000000"
            "000000000000ffffffffffffffffffffffffffff0000000118000000026b02760202680276"
        ),
        from_offset=0,
    )
    from ftlayer.payloads import encode_payload_columns  # ftlayer.payloadkernels

    encode_payload_columns(
        pa.array([b"k"], pa.binary()), pa.array([b"v"], pa.binary()), np.zeros(1, np.int64)
    )


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


def probe_consumer(consumer: Any) -> bool:
    """Make `consumer.poll()` read fetch responses for their high watermarks only: their
    records are not decoded at all (the driver's end-offset probe, which Tansu's short
    ListOffsets(latest) makes a fetch). False (and the consumer unchanged) if this
    kafka-python's fetcher has no PartitionRecords to replace."""
    fetcher = getattr(consumer, "_fetcher", None)
    if fetcher is None or getattr(type(fetcher), "PartitionRecords", None) is not _BASE:
        return False
    fetcher.PartitionRecords = _HighWatermarkOnly
    return True


class _HighWatermarkOnly(_BASE):  # type: ignore[misc]
    """A partition's part of a fetch response that gives poll() no record: kafka-python
    has taken its high watermark already; the position stays where it was."""

    def _unpack_records(
        self, tp: Any, records: Any, key_deserializer: Any, value_deserializer: Any
    ) -> Iterator[Any]:
        self.drain()
        yield from ()


class ColumnarPartitionRecords(_BASE):  # type: ignore[misc]
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
