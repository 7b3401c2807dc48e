"""The numba kernel of the payload codec (`ftlayer.payloads.encode_payload_columns`):
lay out each record's header, key and value in one buffer in one pass. Loaded on first
use (importing numba takes a while; a receiver never needs it), compiled once and
cached on disk beside this file (numba's `cache=True`)."""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

__all__ = ["interleave"]


@njit(cache=True, nogil=True)
def interleave(heads: Any, width: int, kdata: Any, koff: Any, vdata: Any, voff: Any) -> Any:
    """(data, sizes) of records each made of its `width` bytes of `heads`, then its key
    kdata[koff[i] : koff[i + 1]], then its value vdata[voff[i] : voff[i + 1]] (the
    payloads of `ftlayer.payloads`: header, key, value)."""
    n = len(koff) - 1
    sizes = np.empty(n, dtype=np.int64)
    total = 0
    for i in range(n):
        sizes[i] = width + (koff[i + 1] - koff[i]) + (voff[i + 1] - voff[i])
        total += sizes[i]
    data = np.empty(total, dtype=np.uint8)
    out = 0
    for i in range(n):
        for j in range(i * width, (i + 1) * width):
            data[out] = heads[j]
            out += 1
        for j in range(koff[i], koff[i + 1]):
            data[out] = kdata[j]
            out += 1
        for j in range(voff[i], voff[i + 1]):
            data[out] = vdata[j]
            out += 1
    return data, sizes
