"""The timeout persistence layer: a persistence layer whose pending roots expire.

Pending roots live in a RotatingHashMap with n buckets, rotated every T / (n - 1)
seconds by tick(now). A root that stays pending (not completed, not failed) for T
expires between T and T * (1 + 1/(n-1)) after it was persisted or queued for replay,
and on_timeout receives it with its storage seq; the FT layer then fails it, so its
record is replayed under a new root. Timeouts are counted from persist (or from the
moment a failed record was queued for replay), not from the last XOR event: like
Storm's message timeout, it bounds how long a whole tree may take.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

from ftlayer.persistence.base import PersistenceStorage
from ftlayer.persistence.layer import IndexEntry, PersistenceLayer
from ftlayer.rotating import rotation_interval, validate_timeout

#: Receives the roots that timed out and their storage seqs.
TimeoutCallback = Callable[[NDArray[np.uint64], NDArray[np.uint64]], None]


class TimeoutPersistenceLayer(PersistenceLayer):
    """A PersistenceLayer that fails roots pending longer than the timeout."""

    def __init__(
        self,
        storage: PersistenceStorage,
        *,
        timeout_s: float,
        buckets: int = 3,
        on_timeout: TimeoutCallback,
        start: float = 0.0,
    ) -> None:
        validate_timeout(timeout_s, buckets)
        self.timeout_s = timeout_s
        self.buckets = buckets
        self.rotation_interval_s = rotation_interval(timeout_s, buckets)
        self._on_timeout = on_timeout
        super().__init__(
            storage, buckets=buckets, on_expire=self._expired, timeout_s=timeout_s, start=start
        )

    def tick(self, now: float) -> int:
        """Rotate as often as due by `now`, failing expired roots; returns rotations done."""
        return self._index.tick(now)

    def _expired(self, entries: dict[int, IndexEntry]) -> None:
        roots = np.fromiter(entries.keys(), dtype=np.uint64, count=len(entries))
        seqs = np.fromiter((e[0] for e in entries.values()), dtype=np.uint64, count=len(entries))
        self._on_timeout(roots, seqs)
