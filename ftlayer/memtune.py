"""Large allocations without fresh pages: glibc's malloc tuned for a process that
allocates and frees buffers of megabytes many times a second.

glibc serves an allocation above its mmap threshold (128 KiB at first, raised
dynamically up to 32 MiB as such blocks are freed) with a fresh mmap, and returns it to
the kernel on free; every page of the next one is then a page fault and a zeroed page.
The FT-layer server allocates several buffers of a frame's size per PERSIST (the frame's
bytes, its body, the records' chunk, their numpy columns): measured on the development
machine, splitting a 2 MB frame out of its stream cost 1.6 ms with fresh pages and
0.14 ms with reused ones (docs/benchmarks.md, "Where FT on spends its time"). Raising
the mmap threshold to 64 MiB keeps such buffers on the heap, and the trim threshold of
128 MiB keeps that much freed heap for the next ones, at the price of up to that much
more resident memory after a burst.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Final

log = logging.getLogger(__name__)

__all__ = ["tune_malloc"]

_M_TRIM_THRESHOLD: Final = -1
_M_MMAP_THRESHOLD: Final = -3
MMAP_THRESHOLD_BYTES: Final = 64 << 20
TRIM_THRESHOLD_BYTES: Final = 128 << 20


def tune_malloc() -> bool:
    """Set the thresholds (module docstring) in this process; False where the C library
    has no glibc `mallopt` (it then allocates as it did)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
    log.debug("malloc thresholds %s", "set" if done else "not set")
    return done
