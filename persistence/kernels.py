"""The numba kernel of a persisted batch's chunk (persistence/base.py, `encode_chunk`):
each record's fixed-width header-and-topic prefix and its payload, laid out back to
back in one pass. Loaded on first use (importing numba takes a while); compiled once
and cached on disk beside this file (`make` compiles it), nogil.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["compile_kernels", "prefixed"]


@njit(cache=True, nogil=True)
def prefixed(
    rows: np.ndarray, blob: np.ndarray, lengths: np.ndarray, out: np.ndarray, ends: np.ndarray
) -> None:
    """Record i is `rows[i]` then the next `lengths[i]` bytes of `blob`, written to
    `out` (exactly as long as all of them); `ends[i]` is where it ends in `out`."""
    width = rows.shape[1]
    at = 0
    taken = 0
    for i in range(rows.shape[0]):
        for j in range(width):
            out[at + j] = rows[i, j]
        at += width
        n = lengths[i]
        out[at : at + n] = blob[taken : taken + n]
        at += n
        taken += n
        ends[i] = at


def compile_kernels() -> None:
    """Compile the kernel (or load it from numba's cache) with the types encode_chunk
    calls it with: `make` runs this once."""
    for blob in (np.frombuffer(b"abc", dtype=np.uint8), np.zeros(3, dtype=np.uint8)):
        prefixed(  # a payload buffer off the wire is read-only: numba types it apart
            np.zeros((1, 2), dtype=np.uint8),
            blob,
            np.array([3], dtype=np.int64),
            np.empty(5, dtype=np.uint8),
            np.empty(1, dtype=np.int64),
        )
