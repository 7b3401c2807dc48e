"""The timeout persistence layer: a persistence layer whose pending roots expire.

Every batch of roots that starts pending together (a persist, or failed records queued
for replay) is one entry of a RotatingHashMap with n buckets, rotated every T / (n - 1)
seconds by tick(now). All roots of a batch start pending at the same moment, so one
entry times them all: when it expires, between T and T * (1 + 1/(n-1)) after the batch
(later only by as much as tick() is called late, never earlier), on_timeout receives
the batch's roots with the storage seqs of their records; the FT layer fails those
still pending with the same seq, so their records are replayed under new roots. Roots
that completed or failed meanwhile are skipped there, and so is a root persisted again
since (a new record, so a new seq): an entry only ever times out the tree it was made
for, never a later tree of the same root.

Timeouts are counted from the moment a root is tracked, not from the last XOR event:
like Storm's message timeout, T bounds how long a whole tree may take. The FT layer
tracks a root when it is persisted, and a replay's root when its source fetches it.
A root tracked twice (a replay fetched again) has two entries; the first to expire
times it out, and the FT layer skips the other (the root is no longer pending).

`track(roots, timeout_s=T2)` times roots with another timeout than the layer's own (a
source configured with its own T): each distinct timeout has its own RotatingHashMap,
made on first use and rotated by the same tick().
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

from ftlayer.acking.rotating import RotatingHashMap, rotation_interval, validate_timeout
from ftlayer.persistence.base import PersistenceStorage
from ftlayer.persistence.layer import PersistenceLayer

#: Receives the roots of batches that timed out and their records' storage seqs, aligned
#: (some may have completed, failed or been persisted again since).
TimeoutCallback = Callable[[NDArray[np.uint64], NDArray[np.uint64]], None]
_Entry = tuple[NDArray[np.uint64], NDArray[np.uint64]]


class TimeoutPersistenceLayer(PersistenceLayer):
    """A PersistenceLayer whose tracked roots time out; see the module docstring."""

    def __init__(
        self,
        storage: PersistenceStorage,
        *,
        timeout_s: float,
        buckets: int = 3,
        on_timeout: TimeoutCallback,
        start: float = 0.0,
        defer_deletes: bool = False,
    ) -> None:
        validate_timeout(timeout_s, buckets)
        super().__init__(storage, defer_deletes=defer_deletes)
        self.timeout_s = timeout_s
        self.buckets = buckets
        self.rotation_interval_s = rotation_interval(timeout_s, buckets)
        self._on_timeout = on_timeout
        self._by_timeout: dict[float, RotatingHashMap[int, _Entry]] = {
            timeout_s: RotatingHashMap(buckets, self._expired, timeout_s=timeout_s, start=start)
        }
        self._batch_number = 0

    def track(
        self,
        roots: NDArray[np.uint64],
        seqs: NDArray[np.uint64],
        timeout_s: float | None = None,
        now: float = 0.0,
    ) -> None:
        """Start the timeout of roots that became pending now, whose records have the
        storage seqs `seqs` (aligned): the layer's T, or `timeout_s` (then `now` starts
        its buckets' clock if they are new)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        batches = self._by_timeout.get(timeout)
        if batches is None:
            validate_timeout(timeout, self.buckets)
            batches = RotatingHashMap(self.buckets, self._expired, timeout_s=timeout, start=now)
            self._by_timeout[timeout] = batches
        self._batch_number += 1
        batches.put(self._batch_number, (roots, seqs))

    def tick(self, now: float) -> int:
        """Rotate every timeout's buckets that are due by `now`, timing out the roots
        that expired; returns the number of rotations."""
        return sum(batches.tick(now) for batches in list(self._by_timeout.values()))

    @property
    def shortest_rotation_interval_s(self) -> float:
        """The shortest rotation interval over every timeout in use (for tickers)."""
        return min(rotation_interval(t, self.buckets) for t in tuple(self._by_timeout))

    def _expired(self, batches: dict[int, _Entry]) -> None:
        entries = list(batches.values())
        self._on_timeout(
            np.concatenate([roots for roots, _ in entries]),
            np.concatenate([seqs for _, seqs in entries]),
        )
