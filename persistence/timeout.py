"""Rotating timeouts of pending roots: `RootTimeouts`, beside the persistence layer.

The core holds both: the persistence layer (ftlayer.persistence.layer) knows where a
pending root's record is stored, this knows when the root's tree times out. Neither
calls the other, and this holds no storage: an entry names its roots and the storage
seqs of their records, and on_timeout hands both to the core.

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

Postponing (Storm's reset-timeout, per entry): `track(..., tag=t)` tags an entry, and
when it expires the layer asks `postpone(t, now)`; if that is true the entry is put
back into the newest bucket of its map instead of timing out, so it expires again
exactly T * (1 + 1/(n-1)) later (n rotations), and is asked again then. The FT layer
tags an entry with the running batch of its source (ftlayer.core.leases). A postponed
entry therefore times out at the first expiry at which `postpone` is false: by
T * (1 + 1/(n-1)) after the moment it turned false (plus tick lateness), and never
before T after it was tracked. `postponed` counts the roots of postponed entries,
once per postponement. Cost per expiry: one `postpone` call per distinct tag and one
put per postponed entry, nothing per root.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import numpy as np
from numpy.typing import NDArray

from ftlayer.acking.rotating import RotatingHashMap, rotation_interval, validate_timeout

#: Receives the roots of batches that timed out and their records' storage seqs, aligned
#: (some may have completed, failed or been persisted again since).
TimeoutCallback = Callable[[NDArray[np.uint64], NDArray[np.uint64]], None]
#: Whether an expiring entry with this tag is postponed at `now` (see the docstring).
Postpone = Callable[[Hashable, float], bool]
_Entry = tuple[NDArray[np.uint64], NDArray[np.uint64], Hashable | None]


class RootTimeouts:
    """The rotating timeouts of pending roots; see the module docstring."""

    def __init__(
        self,
        *,
        timeout_s: float,
        buckets: int = 3,
        on_timeout: TimeoutCallback,
        start: float = 0.0,
        postpone: Postpone | None = None,
    ) -> None:
        validate_timeout(timeout_s, buckets)
        self.timeout_s = timeout_s
        self.buckets = buckets
        self.rotation_interval_s = rotation_interval(timeout_s, buckets)
        self._on_timeout = on_timeout
        self._postpone = postpone
        self._now = start  # the time of the tick() rotating now, for `postpone`
        self._by_timeout: dict[float, RotatingHashMap[int, _Entry]] = {}
        self._buckets_of(timeout_s, start)
        self._batch_number = 0
        self.postponed = 0
        """Roots of postponed entries, counted at every postponement."""

    def track(
        self,
        roots: NDArray[np.uint64],
        seqs: NDArray[np.uint64],
        timeout_s: float | None = None,
        now: float = 0.0,
        tag: Hashable | None = None,
    ) -> None:
        """Start the timeout of roots that became pending now, whose records have the
        storage seqs `seqs` (aligned): the layer's T, or `timeout_s` (then `now` starts
        its buckets' clock if they are new). With a `tag`, the entry is postponed
        while `postpone(tag, now)` holds at its expiry."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        batches = self._by_timeout.get(timeout)
        if batches is None:  # not `or`: a map with no entries is falsy
            batches = self._buckets_of(timeout, now)
        else:  # a map not ticked while empty (a sleeping ticker) resumes its schedule
            batches.resume(now)
        self._batch_number += 1
        batches.put(self._batch_number, (roots, seqs, tag))

    def _buckets_of(self, timeout: float, now: float) -> RotatingHashMap[int, _Entry]:
        validate_timeout(timeout, self.buckets)
        batches: RotatingHashMap[int, _Entry] = RotatingHashMap(
            self.buckets,
            lambda expired: self._expired(timeout, expired),
            timeout_s=timeout,
            start=now,
        )
        self._by_timeout[timeout] = batches
        return batches

    def tick(self, now: float) -> int:
        """Rotate every timeout's buckets that are due by `now`, timing out the roots
        that expired (or postponing them); returns the number of rotations."""
        self._now = now
        return sum(batches.tick(now) for batches in list(self._by_timeout.values()))

    def next_rotation(self, *, every_timeout: bool = False) -> float | None:
        """The earliest time (by tick()'s clock) a rotation could time a root out: that
        of the timeouts holding an entry (of every timeout with `every_timeout`); None
        when none does. A tick before it does nothing, so a ticker may sleep until it;
        a timeout's rotation that comes late delays its expiries by as much (tick)."""
        due = [
            batches.next_rotation
            for batches in self._by_timeout.values()
            if every_timeout or len(batches)
        ]
        return min(due) if due else None

    def _expired(self, timeout: float, batches: dict[int, _Entry]) -> None:
        entries = list(batches.values())
        if self._postpone is not None:
            entries = self._postponing(timeout, entries)
            if not entries:
                return
        self._on_timeout(
            np.concatenate([roots for roots, _, _ in entries]),
            np.concatenate([seqs for _, seqs, _ in entries]),
        )

    def _postponing(self, timeout: float, entries: list[_Entry]) -> list[_Entry]:
        """Put the entries whose tag is postponed back into the newest bucket (the
        rotation that expired them just opened it); returns the others."""
        assert self._postpone is not None
        verdicts: dict[Hashable, bool] = {}
        expired: list[_Entry] = []
        batches = self._by_timeout[timeout]
        for entry in entries:
            tag = entry[2]
            if tag is None:
                expired.append(entry)
                continue
            verdict = verdicts.get(tag)
            if verdict is None:
                verdict = verdicts[tag] = self._postpone(tag, self._now)
            if verdict:
                self._batch_number += 1
                batches.put(self._batch_number, entry)
                self.postponed += len(entry[0])
            else:
                expired.append(entry)
        return expired
