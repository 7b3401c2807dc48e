"""Request timing for profiling: where a pipeline's tasks and driver wait on the FT
layer. With `FTLAYER_REQUEST_TRACE=FILE` in a process's environment (Spark's local
Python workers inherit the driver's), every FTClient request appends one line to FILE:

    <unix time> <pid> <request kind> <milliseconds from sent to reply> <request bytes>

The time is the caller's wait: the round trip, the server's queue and its handler.
`scripts/request_waits.py` runs the fast bench with it and sums the lines by kind.
Unset (the default), a request pays one comparison. Each line is one `write` to a
file opened with O_APPEND, so the processes of a pipeline can share FILE.
"""

from __future__ import annotations

import os
import time
from typing import Final

__all__ = ["TRACE_PATH", "note"]

TRACE_PATH: Final = os.environ.get("FTLAYER_REQUEST_TRACE") or None


def note(kind: str, seconds: float, size: int) -> None:
    """Append one request's line to TRACE_PATH (set)."""
    if TRACE_PATH is None:
        return
    line = f"{time.time():.4f} {os.getpid()} {kind} {seconds * 1000:.3f} {size}\n".encode()
    fd = os.open(TRACE_PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
