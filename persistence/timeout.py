"""The timeout persistence layer: a persistence layer whose pending roots expire.

Every batch of roots that starts pending (a persist, or failed records queued for
replay) is one entry of a RotatingHashMap with n buckets, rotated every T / (n - 1)
seconds by tick(now). All roots of a batch start pending at the same moment, so one
entry per batch times them all: when the entry expires, between T and
T * (1 + 1/(n-1)) after the batch (later only by how late tick() is called, never
earlier), the roots of the batch that are still pending are taken from the index and
on_timeout receives them with their storage seqs; the FT layer then fails them, so
their records are replayed under new roots.

Timeouts are counted from persist (or from the moment a failed record was queued for
replay), not from the last XOR event: like Storm's message timeout, T bounds how long a
whole tree may take.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

from ftlayer.persistence.base import PersistenceStorage
from ftlayer.persistence.layer import PersistenceLayer
from ftlayer.records import RecordBatch
from ftlayer.rotating import RotatingHashMap, rotation_interval, validate_timeout

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
        super().__init__(storage)
        self.timeout_s = timeout_s
        self.buckets = buckets
        self.rotation_interval_s = rotation_interval(timeout_s, buckets)
        self._on_timeout = on_timeout
        self._batches: RotatingHashMap[int, NDArray[np.uint64]] = RotatingHashMap(
            buckets, self._expired, timeout_s=timeout_s, start=start
        )
        self._batch_number = 0

    def track(
        self, roots: NDArray[np.uint64], seqs: NDArray[np.uint64], batch: RecordBatch
    ) -> None:
        super().track(roots, seqs, batch)
        self._batch_number += 1
        self._batches.put(self._batch_number, roots)

    def tick(self, now: float) -> int:
        """Rotate if due by `now`, failing the roots that expired; returns 1 if it did."""
        return self._batches.tick(now)

    def _expired(self, batches: dict[int, NDArray[np.uint64]]) -> None:
        roots, seqs = self.take(np.concatenate(list(batches.values())))
        if len(roots):
            self._on_timeout(roots, seqs)
