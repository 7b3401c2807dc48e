"""Running batches and their heartbeat leases: what postpones a tree timeout.

A tree must not time out while the batch carrying it is still running: its tasks may
yet complete it, and a replay could only enter the next batch, which cannot start
before this one ends. So the FT layer knows, per source, its *open batch* and whether
that batch is alive:

- A source's batch opens at its barrier (CHECKPOINT_BEGIN: `began`) and closes when
  Spark reports it done (CHECKPOINT_DONE, or the next BEGIN's "complete": `done`).
  Batches are numbered 1, 2, 3, ... over all sources, never reused while the FT layer
  runs, so a number names one run of one batch (a batch Spark plans again after a
  restart is a new open batch).
- While the batch runs, the source's driver renews a *lease* on it by heartbeats
  (`renew`, HEARTBEAT): each gives the lease `lease_s` more from now. A driver that
  dies, hangs or is cut off stops renewing, and the lease lapses by itself `lease_s`
  after its last heartbeat. A heartbeat for a source with no open batch is ignored
  (a late one after `done` renews nothing). An open batch has no lease until its
  first heartbeat, and loses it at `done`.

The timeout layer tags every entry it tracks with its source's open batch (`tag`,
None when the source has none). When the entry expires, `running(tag, now)` says
whether that very batch is still open and leased: then the entry is postponed (tracked
again) instead of failing its roots. An entry of an earlier batch (its batch is done:
an unfinished tree there lost an event) or of a source that sends no heartbeats times
out as before.

Costs: O(sources) per call, nothing per root or per entry beyond a dict lookup.
Not thread-safe: the FT-layer core's owner serializes calls.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["BatchLeases", "BatchTag"]

BatchTag = tuple[int, int]
"""(source id, open batch number): the batch a timeout entry was tracked in."""


@dataclass(slots=True)
class _OpenBatch:
    number: int
    began_at: float
    lease_until: float = float("-inf")


class BatchLeases:
    """Per source, its open batch and the lease its driver's heartbeats keep on it."""

    def __init__(self) -> None:
        self._open: dict[int, _OpenBatch] = {}
        self._numbers = 0

    def began(self, source_ids: Iterable[int], now: float) -> None:
        """These sources' next batch is planned and about to run (its barrier)."""
        for source_id in source_ids:
            self._numbers += 1
            self._open[int(source_id)] = _OpenBatch(self._numbers, now)

    def done(self, source_ids: Iterable[int]) -> None:
        """These sources' batch is done: it and its lease close."""
        for source_id in source_ids:
            self._open.pop(int(source_id), None)

    def renew(self, source_ids: Iterable[int], lease_s: float, now: float) -> int:
        """A heartbeat: the open batch of each of these sources is leased until
        `now + lease_s` (0 ends the lease). Returns how many had an open batch."""
        renewed = 0
        for source_id in source_ids:
            batch = self._open.get(int(source_id))
            if batch is not None:
                batch.lease_until = now + lease_s
                renewed += 1
        return renewed

    def tag(self, source_id: int) -> BatchTag | None:
        """The open batch of `source_id` that roots tracked now belong to, or None."""
        batch = self._open.get(source_id)
        return None if batch is None else (source_id, batch.number)

    def running(self, tag: BatchTag, now: float) -> bool:
        """Whether the batch `tag` names is still open and leased at `now`."""
        batch = self._open.get(tag[0])
        return batch is not None and batch.number == tag[1] and now < batch.lease_until

    def status(self, now: float) -> dict[str, dict[str, float]]:
        """Per source id with an open batch (as a string, JSON's way): how long it has
        been running and how long its lease has left (0: none, or lapsed)."""
        return {
            str(source_id): {
                "running_s": round(now - batch.began_at, 3),
                "lease_s": round(max(0.0, batch.lease_until - now), 3),
            }
            for source_id, batch in sorted(self._open.items())
        }
