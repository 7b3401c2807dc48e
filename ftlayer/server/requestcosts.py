"""What the server's requests cost, by kind: how many it answered and the CPU their
handlers spent.

Each request (but SAVEPOINT, which waits for the deleter) is handled on its
connection's thread; `RequestCosts.add` counts it and
the thread's CPU time over its handler (`time.thread_time`: this thread's user and
system time, so a wait for the core's lock or for the disk costs nothing, and work
done for it on another thread, such as the deleter's deletes, is not counted). STATUS
reports the totals (`requests`, docs/protocol.md 6.2) and /metrics serves them as
`ftlayer_requests_total` and `ftlayer_request_cpu_seconds_total` by `kind`: which
requests keep an FT layer busy, and what one of each costs.
"""

from __future__ import annotations

import threading
from typing import Any

from ftlayer.wire import Kind

__all__ = ["RequestCosts"]


class RequestCosts:
    """Per request kind: how many were handled and their handlers' CPU seconds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[Kind, int] = {}
        self._cpu_s: dict[Kind, float] = {}

    def add(self, kind: Kind, cpu_s: float) -> None:
        with self._lock:
            self._counts[kind] = self._counts.get(kind, 0) + 1
            self._cpu_s[kind] = self._cpu_s.get(kind, 0.0) + cpu_s

    def to_json(self) -> dict[str, dict[str, Any]]:
        """{kind name: {"count": n, "cpu_s": seconds}}, kinds in name order."""
        with self._lock:
            return {
                kind.name: {"count": n, "cpu_s": round(self._cpu_s[kind], 6)}
                for kind, n in sorted(self._counts.items(), key=lambda item: item[0].name)
            }
