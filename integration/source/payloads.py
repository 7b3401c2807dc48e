"""The payload codec: how the ftkafka source stores a Kafka record in the FT layer.

A persisted payload is a 14-byte little-endian header (u8 format version 1, u8 flags:
1 = key present, 2 = value present; i64 timestamp in epoch ms; u32 key length), then the
key bytes, then the value bytes (the rest). The FT layer never reads it; the source
decodes it when the record is replayed. Both directions work on whole chunks: one
numpy header array and one join per chunk, pyarrow binary arrays on the way back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import pyarrow as pa
from numpy.typing import ArrayLike, NDArray

from ftlayer.errors import SourceError

if TYPE_CHECKING:
    pass


_HEADER: Final = np.dtype([("version", "u1"), ("flags", "u1"), ("ts", "<i8"), ("klen", "<u4")])
_HEADER_SIZE: Final = _HEADER.itemsize
_FORMAT_VERSION: Final = 1
_KEY_PRESENT: Final = 1
_VALUE_PRESENT: Final = 2


def _regions(total: int, starts: NDArray[np.int64], lengths: NDArray[np.int64]) -> Any:
    """A boolean mask of `total` bytes, True inside [starts[i], starts[i] + lengths[i])
    (regions do not overlap)."""
    marks = np.zeros(total + 1, dtype=np.int8)
    nonempty = lengths > 0
    marks[starts[nonempty]] += 1
    marks[(starts + lengths)[nonempty]] -= 1
    return np.cumsum(marks[:-1], dtype=np.int8).astype(np.bool_)


def encode_payloads(
    keys: Sequence[bytes | None], values: Sequence[bytes | None], timestamps_ms: ArrayLike
) -> list[bytes]:
    """The persisted payload of each record (None: no key, or no value; timestamps in
    epoch ms). The headers are built as one numpy array and all payloads with one join;
    the per-record Python steps are list comprehensions over what kafka-python returned."""
    n = len(keys)
    key_bytes = [k or b"" for k in keys]
    value_bytes = [v or b"" for v in values]
    klen = np.fromiter(map(len, key_bytes), dtype=np.int64, count=n)
    vlen = np.fromiter(map(len, value_bytes), dtype=np.int64, count=n)
    header = np.zeros(n, dtype=_HEADER)
    header["version"] = _FORMAT_VERSION
    header["flags"] = np.fromiter((k is not None for k in keys), np.uint8, n) * _KEY_PRESENT
    header["flags"] |= np.fromiter((v is not None for v in values), np.uint8, n) * _VALUE_PRESENT
    header["ts"] = timestamps_ms
    header["klen"] = klen
    headers = header.tobytes()
    parts: list[bytes] = [b""] * (3 * n)
    parts[0::3] = [headers[i : i + _HEADER_SIZE] for i in range(0, n * _HEADER_SIZE, _HEADER_SIZE)]
    parts[1::3] = key_bytes
    parts[2::3] = value_bytes
    blob = b"".join(parts)
    ends = np.cumsum(_HEADER_SIZE + klen + vlen).tolist()
    return [blob[s:e] for s, e in zip([0, *ends[:-1]], ends, strict=True)]


def decode_payloads(payloads: Sequence[bytes]) -> tuple[Any, Any, NDArray[np.int64]]:
    """(keys, values, timestamps_ms) from payloads made by `encode_payloads`: two
    pyarrow binary arrays (null where the record had none) and an int64 array."""
    n = len(payloads)
    sizes = np.fromiter(map(len, payloads), dtype=np.int64, count=n)
    if n and int(sizes.min()) < _HEADER_SIZE:
        raise SourceError("a replayed payload is shorter than its header: not ftkafka's")
    ends = np.cumsum(sizes)
    starts = ends - sizes
    total = int(ends[-1]) if n else 0
    blob = np.frombuffer(b"".join(payloads), dtype=np.uint8)
    header_bytes = blob[_regions(total, starts, np.full(n, _HEADER_SIZE))]
    header = header_bytes.view(_HEADER) if n else np.zeros(0, dtype=_HEADER)
    if n and bool((header["version"] != _FORMAT_VERSION).any()):
        raise SourceError(
            f"replayed payloads of format versions {sorted(set(header['version'].tolist()))}; "
            f"this ftkafka reads version {_FORMAT_VERSION}"
        )
    klen = header["klen"].astype(np.int64)
    vlen = sizes - _HEADER_SIZE - klen
    if bool((vlen < 0).any()):
        raise SourceError("a replayed payload's key length runs past its end")
    flags = header["flags"]
    keys = _binary_array(blob[_regions(total, starts + _HEADER_SIZE, klen)], klen,
                         (flags & _KEY_PRESENT) > 0)  # fmt: skip
    values = _binary_array(blob[_regions(total, starts + _HEADER_SIZE + klen, vlen)], vlen,
                           (flags & _VALUE_PRESENT) > 0)  # fmt: skip
    return keys, values, header["ts"].astype(np.int64)


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
