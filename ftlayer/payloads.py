"""The payload codec: how the ftkafka source stores a Kafka record in the FT layer.

A persisted payload starts with a 14-byte little-endian header: u8 format version, u8
flags (1 = key present, 2 = value present, 4 = Kafka headers present), i64 timestamp
in epoch ms, u32 key length.

- Version 1 (a record without Kafka headers): the header, the key bytes, then the
  value bytes (the rest).
- Version 2 (a record with Kafka headers; flag 4): the header, u32 length L and L bytes
  of headers, then the key and value as in version 1. The headers: u16 count, then per
  header u16 key length, the key (utf-8), u32 value length (0xFFFFFFFF: no value) and
  the value bytes.

A record without headers is always written as version 1, so a payload stored before
headers were kept, and every payload of a source without includeHeaders, reads the
same; an older ftkafka refuses a version 2 payload by its version instead of misreading
it. The FT layer never reads a payload; the source decodes it when the record is
replayed. Both directions work on whole chunks: one numpy header array per chunk, cut
into one bytes object per record by numpy and put before each key and value by `map`
(no Python step per record; a chunk with Kafka headers takes one join), pyarrow binary
arrays on the way back; only records that have headers cost a Python step each.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import pyarrow as pa
from numpy.typing import ArrayLike, NDArray

from ftlayer.errors import SourceError
from ftlayer.records import Payloads

__all__ = [
    "HEADERS_ARROW",
    "Headers",
    "decode_key",
    "decode_payloads",
    "encode_payload_columns",
    "encode_payloads",
    "headers_array",
]

Headers = Sequence[tuple[str, bytes | None]]
"""One record's Kafka headers: (key, value) pairs in order; a value may be None."""

HEADERS_ARROW: Final = pa.list_(
    pa.struct([pa.field("key", pa.string()), pa.field("value", pa.binary())])
)
"""The `headers` column, as Spark's Kafka source has it: array<struct<key, value>>."""

_HEADER: Final = np.dtype([("version", "u1"), ("flags", "u1"), ("ts", "<i8"), ("klen", "<u4")])
_HEADER_SIZE: Final = _HEADER.itemsize
_KEY_PRESENT: Final = 1
_VALUE_PRESENT: Final = 2
_HEADERS_PRESENT: Final = 4
_U16: Final = struct.Struct("<H")
_U32: Final = struct.Struct("<I")
_NO_VALUE: Final = 0xFFFFFFFF


def _regions(total: int, starts: NDArray[np.int64], lengths: NDArray[np.int64]) -> Any:
    """A boolean mask of `total` bytes, True inside [starts[i], starts[i] + lengths[i])
    (regions do not overlap)."""
    marks = np.zeros(total + 1, dtype=np.int8)
    nonempty = lengths > 0
    marks[starts[nonempty]] += 1
    marks[(starts + lengths)[nonempty]] -= 1
    return np.cumsum(marks[:-1], dtype=np.int8).astype(np.bool_)


def _encode_headers(headers: Headers) -> bytes:
    parts = [_U16.pack(len(headers))]
    for key, value in headers:
        raw = key.encode("utf-8")
        parts += [_U16.pack(len(raw)), raw]
        parts.append(_U32.pack(_NO_VALUE) if value is None else _U32.pack(len(value)) + value)
    blob = b"".join(parts)
    return _U32.pack(len(blob)) + blob


def _decode_headers(raw: bytes) -> list[tuple[str, bytes | None]]:
    def need(at: int, size: int) -> None:
        if at + size > len(raw):
            raise SourceError("a replayed payload's Kafka headers run past their length")

    need(0, 2)
    (count,) = _U16.unpack_from(raw, 0)
    at = 2
    found: list[tuple[str, bytes | None]] = []
    for _ in range(count):
        need(at, 2)
        (klen,) = _U16.unpack_from(raw, at)
        need(at + 2, klen + 4)
        try:
            key = raw[at + 2 : at + 2 + klen].decode("utf-8")
        except UnicodeDecodeError:
            raise SourceError("a replayed payload's Kafka header key is not utf-8") from None
        (vlen,) = _U32.unpack_from(raw, at + 2 + klen)
        at += 2 + klen + 4
        if vlen == _NO_VALUE:
            found.append((key, None))
            continue
        need(at, vlen)
        found.append((key, raw[at : at + vlen]))
        at += vlen
    if at != len(raw):
        raise SourceError("a replayed payload's Kafka headers have trailing bytes")
    return found


def encode_payloads(
    keys: Sequence[bytes | None],
    values: Sequence[bytes | None],
    timestamps_ms: ArrayLike,
    headers: Sequence[Headers] | None = None,
) -> list[bytes]:
    """The persisted payload of each record (None: no key, or no value; timestamps in
    epoch ms; `headers`: each record's Kafka headers, or None to keep none). The
    headers are built as one numpy array and all payloads with one join; the per-record
    Python steps are list comprehensions over what kafka-python returned."""
    n = len(keys)
    if n == 0:
        return []
    if headers is None or not any(headers):
        return _encode_plain(keys, values, timestamps_ms)
    key_bytes = [k or b"" for k in keys]
    value_bytes = [v or b"" for v in values]
    klen = np.fromiter(map(len, key_bytes), dtype=np.int64, count=n)
    vlen = np.fromiter(map(len, value_bytes), dtype=np.int64, count=n)
    header = np.zeros(n, dtype=_HEADER)
    header["version"] = 1
    header["flags"] = np.fromiter((k is not None for k in keys), np.uint8, n) * _KEY_PRESENT
    header["flags"] |= np.fromiter((v is not None for v in values), np.uint8, n) * _VALUE_PRESENT
    header["ts"] = timestamps_ms
    header["klen"] = klen
    if headers is None or not any(headers):  # the usual chunk: version 1, three parts each
        width, xlen, extra = 3, np.zeros(n, dtype=np.int64), None
    else:
        extra = [_encode_headers(h) if h else b"" for h in headers]
        xlen = np.fromiter(map(len, extra), dtype=np.int64, count=n)
        with_headers = (xlen > 0).astype(np.uint8)
        header["version"] += with_headers
        header["flags"] |= with_headers * _HEADERS_PRESENT
        width = 4
    heads = header.tobytes()
    parts: list[bytes] = [b""] * (width * n)
    parts[0::width] = [
        heads[i : i + _HEADER_SIZE] for i in range(0, n * _HEADER_SIZE, _HEADER_SIZE)
    ]
    if extra is not None:
        parts[1::width] = extra
    parts[width - 2 :: width] = key_bytes
    parts[width - 1 :: width] = value_bytes
    blob = b"".join(parts)
    ends = np.cumsum(_HEADER_SIZE + xlen + klen + vlen).tolist()
    return [blob[s:e] for s, e in zip([0, *ends[:-1]], ends, strict=True)]


def _filled(items: Sequence[bytes | None]) -> tuple[Any, Sequence[bytes]]:
    """(present flags, or True for all; the bytes with b"" for None) of keys or values,
    without a Python step per item when none is None."""
    if None not in items:
        return True, items  # type: ignore[return-value]
    present = np.fromiter((item is not None for item in items), np.bool_, len(items))
    return present, [item or b"" for item in items]


def _encode_plain(
    keys: Sequence[bytes | None], values: Sequence[bytes | None], timestamps_ms: ArrayLike
) -> list[bytes]:
    """Version 1 payloads (no Kafka headers): the headers as one numpy array cut into
    one bytes object each by numpy, then header + key + value per record by `map`."""
    n = len(keys)
    header = np.zeros(n, dtype=_HEADER)
    header["version"] = 1
    header["ts"] = timestamps_ms
    has_value, value_bytes = _filled(values)
    value_flags = np.where(has_value, _VALUE_PRESENT, 0)
    if keys.count(None) == n:  # the usual unkeyed topic: header + value
        header["flags"] = value_flags
        heads = np.frombuffer(header.tobytes(), dtype=f"V{_HEADER_SIZE}").tolist()
        return list(map(operator.add, heads, value_bytes))
    has_key, key_bytes = _filled(keys)
    header["flags"] = np.where(has_key, _KEY_PRESENT, 0) | value_flags
    header["klen"] = np.fromiter(map(len, key_bytes), np.int64, n)
    heads = np.frombuffer(header.tobytes(), dtype=f"V{_HEADER_SIZE}").tolist()
    return list(map(operator.add, map(operator.add, heads, key_bytes), value_bytes))


def encode_payload_columns(keys: Any, values: Any, timestamps_ms: ArrayLike) -> Payloads:
    """`encode_payloads` of records without Kafka headers, from their Arrow binary key
    and value columns (null: none), as one `Payloads` buffer: the headers are one numpy
    array, and a numba kernel (`ftlayer.payloadkernels.interleave`) lays header, key and value of
    every record out in one pass, with no Python object per record. The same bytes as
    `encode_payloads` (tests/integration/test_payloads.py checks it)."""
    from ftlayer import payloadkernels  # numba: loaded by the first reader, not by every importer

    n = len(values)
    kdata, koff, has_key = _binary_columns(keys, n)
    vdata, voff, has_value = _binary_columns(values, n)
    header = np.zeros(n, dtype=_HEADER)
    header["version"] = 1
    header["ts"] = timestamps_ms
    header["flags"] = has_key * _KEY_PRESENT | has_value * _VALUE_PRESENT
    header["klen"] = np.diff(koff)
    heads = np.frombuffer(header.tobytes(), dtype=np.uint8)
    data, sizes = payloadkernels.interleave(heads, _HEADER_SIZE, kdata, koff, vdata, voff)
    return Payloads(data.tobytes(), sizes)


_NO_BYTES: Final = np.zeros(0, dtype=np.uint8)


def _binary_columns(array: Any, n: int) -> tuple[Any, NDArray[np.int64], NDArray[np.uint8]]:
    """(data, int64 offsets of each entry into data, present flags) of an Arrow binary
    array, a null entry empty whatever bytes its slot spans."""
    if array is None or array.null_count == n:
        return _NO_BYTES, np.zeros(n + 1, dtype=np.int64), np.zeros(n, dtype=np.uint8)
    if pa.types.is_large_binary(array.type) or pa.types.is_large_string(array.type):
        width: Any = np.int64
    else:
        width = np.int32
    _, offsets_buffer, data_buffer = array.buffers()
    offsets = np.frombuffer(offsets_buffer, dtype=width)[array.offset : array.offset + n + 1]
    offsets = offsets.astype(np.int64)
    data = np.frombuffer(data_buffer, dtype=np.uint8) if data_buffer is not None else _NO_BYTES
    if not array.null_count:
        return data, offsets, np.ones(n, dtype=np.uint8)
    present = array.is_valid().to_numpy(zero_copy_only=False)
    lengths = np.where(present, np.diff(offsets), 0)
    if bool((lengths == np.diff(offsets)).all()):
        return data, offsets, present.astype(np.uint8)
    starts = offsets[:-1]  # a null slot spans bytes: gather only the present ones
    kept = data[_regions(len(data), starts, lengths)] if len(data) else _NO_BYTES
    return kept, np.concatenate([[0], np.cumsum(lengths)]), present.astype(np.uint8)


def decode_payloads(
    payloads: Sequence[bytes],
) -> tuple[Any, Any, NDArray[np.int64], list[list[tuple[str, bytes | None]]]]:
    """(keys, values, timestamps_ms, headers) from payloads made by `encode_payloads`:
    two pyarrow binary arrays (null where the record had none), an int64 array, and
    each record's Kafka headers (empty where it kept none). SourceError for a payload
    that is not one."""
    n = len(payloads)
    if isinstance(payloads, Payloads):
        sizes, joined = payloads.lengths, payloads.blob
    else:
        sizes = np.fromiter(map(len, payloads), dtype=np.int64, count=n)
        joined = b"".join(payloads)
    if n and int(sizes.min()) < _HEADER_SIZE:
        raise SourceError("a replayed payload is shorter than its header: not ftkafka's")
    ends = np.cumsum(sizes)
    starts = ends - sizes
    total = int(ends[-1]) if n else 0
    blob = np.frombuffer(joined, dtype=np.uint8)
    header_bytes = blob[_regions(total, starts, np.full(n, _HEADER_SIZE))]
    header = header_bytes.view(_HEADER) if n else np.zeros(0, dtype=_HEADER)
    flags = header["flags"]
    with_headers = (flags & _HEADERS_PRESENT) > 0
    expected = np.where(with_headers, 2, 1)
    if n and bool((header["version"] != expected).any()):
        raise SourceError(
            f"replayed payloads of format versions {sorted(set(header['version'].tolist()))}; "
            "this ftkafka reads version 1, and version 2 with Kafka headers"
        )
    xlen = np.zeros(n, dtype=np.int64)
    headers: list[list[tuple[str, bytes | None]]] = [[] for _ in range(n)]
    for i in np.flatnonzero(with_headers).tolist():
        at = int(starts[i]) + _HEADER_SIZE
        if at + 4 > int(ends[i]):
            raise SourceError("a replayed payload's Kafka headers run past its end")
        (length,) = _U32.unpack_from(joined, at)
        if at + 4 + length > int(ends[i]):
            raise SourceError("a replayed payload's Kafka headers run past its end")
        headers[i] = _decode_headers(joined[at + 4 : at + 4 + length])
        xlen[i] = 4 + length
    klen = header["klen"].astype(np.int64)
    key_at = starts + _HEADER_SIZE + xlen
    vlen = sizes - _HEADER_SIZE - xlen - klen
    if bool((vlen < 0).any()):
        raise SourceError("a replayed payload's key length runs past its end")
    keys = _binary_array(blob[_regions(total, key_at, klen)], klen, (flags & _KEY_PRESENT) > 0)
    values = _binary_array(blob[_regions(total, key_at + klen, vlen)], vlen,
                           (flags & _VALUE_PRESENT) > 0)  # fmt: skip
    return keys, values, header["ts"].astype(np.int64), headers


def decode_key(payload: bytes) -> tuple[bytes | None, int]:
    """(key or None, timestamp in epoch ms) of one payload made by `encode_payloads`,
    which may be cut short after its key (`ftlayer inspect` gets the start of a
    payload); SourceError for bytes that are not such a payload."""
    if len(payload) < _HEADER_SIZE:
        raise SourceError("the payload is shorter than ftkafka's header: not ftkafka's")
    header = np.frombuffer(payload[:_HEADER_SIZE], dtype=_HEADER)[0]
    version, flags = int(header["version"]), int(header["flags"])
    with_headers = bool(flags & _HEADERS_PRESENT)
    if version != (2 if with_headers else 1):
        raise SourceError(f"payload format version {version}: not ftkafka's")
    at = _HEADER_SIZE
    if with_headers:
        if at + 4 > len(payload):
            raise SourceError("the payload is cut before its Kafka headers end")
        (length,) = _U32.unpack_from(payload, at)
        at += 4 + length
    klen = int(header["klen"])
    if at + klen > len(payload):
        raise SourceError("the payload is cut before its key ends")
    key = payload[at : at + klen] if flags & _KEY_PRESENT else None
    return key, int(header["ts"])


def headers_array(headers: Sequence[Headers]) -> Any:
    """The `headers` column of these records (HEADERS_ARROW)."""
    return pa.array(
        [[{"key": k, "value": v} for k, v in record] for record in headers], type=HEADERS_ARROW
    )


def _binary_array(data: NDArray[np.uint8], lengths: NDArray[np.int64], valid: Any) -> Any:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths.astype(np.int32), out=offsets[1:])
    nulls = int(len(valid) - np.count_nonzero(valid))
    bitmap = pa.py_buffer(np.packbits(valid, bitorder="little")) if nulls else None
    return pa.Array.from_buffers(
        pa.binary(),
        len(lengths),
        [bitmap, pa.py_buffer(offsets), pa.py_buffer(data.tobytes())],
        null_count=nulls,
    )
