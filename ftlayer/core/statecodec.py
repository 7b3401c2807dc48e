"""The state codec: a copy of the FT layer's state (a dict of numpy
arrays, FTLayer.state_snapshot) as one blob and back.

Layout: the magic b"FTSNAP1\n", a u32 (little-endian) header length, a JSON header
listing per array its name, dtype and length, then each array's bytes in that order.
Encoding makes one copy of each array, into the blob; decoding checks the magic, the
header and the total length, and raises CorruptData for anything else.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ftlayer.errors import CorruptData

__all__ = ["decode_snapshot", "encode_snapshot"]

_SNAPSHOT_MAGIC = b"FTSNAP1\n"
_HEADER_LEN = struct.Struct("<I")


def encode_snapshot(state: Mapping[str, NDArray[Any]]) -> bytearray:
    """The arrays as one blob: magic, u32 header length, a JSON header (per array its
    name, dtype and length), then each array's bytes. One copy of each array, into
    the blob."""
    header = json.dumps(
        [[name, array.dtype.str, len(array)] for name, array in state.items()]
    ).encode()
    offset = len(_SNAPSHOT_MAGIC) + _HEADER_LEN.size + len(header)
    blob = bytearray(offset + sum(array.nbytes for array in state.values()))
    blob[:offset] = _SNAPSHOT_MAGIC + _HEADER_LEN.pack(len(header)) + header
    for array in state.values():
        if array.nbytes:
            np.frombuffer(blob, dtype=array.dtype, count=len(array), offset=offset)[:] = array
            offset += array.nbytes
    return blob


def decode_snapshot(raw: bytes) -> dict[str, NDArray[Any]]:
    """The arrays of a stored snapshot (see FTLayer.state_snapshot); CorruptData if
    `raw` is not one."""
    view = memoryview(raw)
    start = len(_SNAPSHOT_MAGIC) + _HEADER_LEN.size
    if bytes(view[: len(_SNAPSHOT_MAGIC)]) != _SNAPSHOT_MAGIC or len(view) < start:
        raise CorruptData("not an ftlayer checkpoint snapshot")
    (size,) = _HEADER_LEN.unpack_from(view, len(_SNAPSHOT_MAGIC))
    try:
        header = json.loads(bytes(view[start : start + size]))
        offset = start + size
        found: dict[str, NDArray[Any]] = {}
        for name, dtype, n in header:
            array = np.frombuffer(view, dtype=np.dtype(dtype), count=n, offset=offset)
            found[name] = array.copy()
            offset += array.nbytes
    except (ValueError, TypeError) as exc:
        raise CorruptData(f"a damaged checkpoint snapshot: {exc}") from None
    if offset != len(view):
        raise CorruptData("a damaged checkpoint snapshot: trailing bytes")
    return found
