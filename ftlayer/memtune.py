"""The `ftlayer serve` process's memory tuning: large allocations without fresh pages
(glibc's malloc tuned for a process that allocates and frees buffers of megabytes many
times a second), and a frozen start-up heap for the garbage collector.

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

`settle_heap` loads the server's numba kernels (numba's import and the kernels' cache:
about 0.25 s that the first PERSIST would otherwise wait for) and then freezes
everything allocated so far (`gc.freeze`): the modules, numba's and LLVM's objects
among them, some 100,000 objects that every full collection would walk again, are left
out of the collections from then on. Measured under the fast bench's persist traffic:
the collector's CPU fell from 0.108 s to 0.059 s over 2.6 million records.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import threading
from typing import Final

log = logging.getLogger(__name__)

__all__ = ["settle_heap", "tune_malloc"]

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


def settle_heap() -> threading.Thread:
    """Load the server's kernels, then freeze the heap (module docstring), in a thread
    of its own (started, returned): the server serves meanwhile, and a PERSIST that
    comes first waits for the kernels as it would have anyway."""

    def settle() -> None:
        from ftlayer.acking.u64map import compile_kernels as acker_kernels
        from ftlayer.persistence.kernels import compile_kernels as chunk_kernels

        try:
            acker_kernels()
            chunk_kernels()
        except Exception:  # they load on first use instead
            log.exception("loading the numba kernels at start failed")
        gc.freeze()
        log.debug("heap settled: %d objects frozen", gc.get_freeze_count())

    thread = threading.Thread(target=settle, name="ftlayer-settle-heap", daemon=True)
    thread.start()
    return thread
