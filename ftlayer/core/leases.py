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
whether its batch is still *waited for*: then the entry is postponed (tracked again)
instead of failing its roots. A batch is waited for while it is open and

- leased: its driver heartbeats;
- or its lease *lapsed* (the driver stopped heartbeating without the batch being
  reported done: it died, hangs or is cut off), for `lapsed_s` after the lapse (the
  server's `--lapsed-batch-timeout-s`, 600 s by default; 0 waits for nothing, as
  before). A restarted driver runs the batch again: Spark re-runs its last batch that
  was logged and not committed, with the same offsets and replay ranges, and plans it
  first (its BEGIN). Timing the dead run's trees out meanwhile would replay records
  that the run again takes in too (a duplicate at the sink per record), so they wait
  for that barrier instead;
- or it took over the wait of an earlier batch (below) and has no lease of its own
  yet.

A BEGIN that finds its source's batch still open (never reported done: a driver
restart, or Spark planning the batch again) *adopts* it: the new open batch carries
the numbers of the batches it adopted, so their entries follow the new batch from now
on, as its own do: waited for while it is leased (or lapsed, or, before its first
heartbeat, until the end of the wait it took over: a restarted driver's first heartbeat
comes right after its BEGIN), and timing out once it is done (its barrier released the
holds of the dead run with its own: ftlayer.core.barrier) or lapsed in turn. If no
barrier of the source ever comes, the wait ends `lapsed_s` after the lapse and the
entries time out as before, so a driver that never comes back loses nothing (its trees
are replayed, into the source's next run, whenever it runs).

A restarted FT layer knows no open batch. `recovered` opens one, lapsed at once, for
each source whose batch was running at the stop (it left barrier holds of pending
roots): the trees restored in flight belong to it, so they wait, as above, for the
source's driver (whose heartbeats renew it when it is alive) or its next barrier, and
time out `lapsed_s` after the restart if neither comes.

An entry of an earlier batch that was reported done (an unfinished tree there lost an
event), or of a source that sends no heartbeats, times out as before.

Costs: O(sources) per call, nothing per root or per entry beyond a dict lookup and a
set membership.
Not thread-safe: the FT-layer core's owner serializes calls.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from ftlayer.errors import ConfigError

__all__ = ["DEFAULT_LAPSED_S", "BatchLeases", "BatchTag", "check_lapsed_s"]

BatchTag = tuple[int, int]
"""(source id, open batch number): the batch a timeout entry was tracked in."""

DEFAULT_LAPSED_S: Final = 600.0
"""How long the trees of a batch whose lease lapsed wait for their source's next
barrier (module docstring): longer than a driver restart by a supervisor, a cluster
manager or an operator (15-50 s for the JVM, the session and the query; minutes where
a new driver must be scheduled), and a wait costs nothing a shorter one would save: a
replay enters only a batch of its source, and the source's next batch comes with the
barrier that ends the wait."""


def check_lapsed_s(lapsed_s: object) -> float:
    if isinstance(lapsed_s, bool) or not isinstance(lapsed_s, int | float):
        raise ConfigError(f"a lapsed batch's wait is a number of seconds, got {lapsed_s!r}")
    if not 0 <= lapsed_s < math.inf:  # also NaN
        raise ConfigError(
            f"a lapsed batch's wait is a finite number of seconds >= 0, got {lapsed_s!r}"
        )
    return float(lapsed_s)


@dataclass(slots=True)
class _OpenBatch:
    number: int
    began_at: float
    lease_until: float = float("-inf")
    lapses: bool = False
    """Whether its lease lapses into the wait for the next barrier (a heartbeat gave it
    one; a zero lease ends it without)."""
    wait_until: float = float("-inf")
    """Without a lease of its own: how long it is waited for (the wait it took over, or
    a recovered batch's)."""
    adopted: frozenset[int] = frozenset()
    """The numbers of the earlier batches of its source it adopted."""


class BatchLeases:
    """Per source, its open batch and the lease its driver's heartbeats keep on it."""

    def __init__(self, lapsed_s: float = DEFAULT_LAPSED_S) -> None:
        self.lapsed_s = check_lapsed_s(lapsed_s)
        self._open: dict[int, _OpenBatch] = {}
        self._numbers = 0

    def began(self, source_ids: Iterable[int], now: float) -> None:
        """These sources' next batch is planned and about to run (its barrier); one
        still open (never reported done) is adopted by it."""
        for source_id in source_ids:
            self._numbers += 1
            batch = _OpenBatch(self._numbers, now)
            earlier = self._open.get(int(source_id))
            if earlier is not None:
                batch.adopted = earlier.adopted | {earlier.number}
                batch.wait_until = self._waited_until(earlier)
            self._open[int(source_id)] = batch

    def recovered(self, source_ids: Iterable[int], now: float) -> None:
        """A restarted FT layer: these sources' batch was running when it stopped; it
        is open from now, lapsed (waited for `lapsed_s`, or while heartbeats renew it,
        or until the source's next barrier adopts it)."""
        for source_id in source_ids:
            if int(source_id) not in self._open:
                self._numbers += 1
                self._open[int(source_id)] = _OpenBatch(
                    self._numbers, now, wait_until=now + self.lapsed_s
                )

    def done(self, source_ids: Iterable[int]) -> None:
        """These sources' batch is done: it and its lease close (and the batches it
        adopted with it)."""
        for source_id in source_ids:
            self._open.pop(int(source_id), None)

    def renew(self, source_ids: Iterable[int], lease_s: float, now: float) -> int:
        """A heartbeat: the open batch of each of these sources is leased until
        `now + lease_s` (0 ends the lease, with no wait after it). Returns how many had
        an open batch."""
        renewed = 0
        for source_id in source_ids:
            batch = self._open.get(int(source_id))
            if batch is not None:
                batch.lease_until = now + lease_s
                batch.lapses = lease_s > 0
                if lease_s <= 0:
                    batch.wait_until = float("-inf")
                renewed += 1
        return renewed

    def tag(self, source_id: int) -> BatchTag | None:
        """The open batch of `source_id` that roots tracked now belong to, or None."""
        batch = self._open.get(source_id)
        return None if batch is None else (source_id, batch.number)

    def running(self, tag: BatchTag, now: float) -> bool:
        """Whether the batch `tag` names (or the one that adopted it) is still open and
        waited for at `now`: leased, lapsed less than `lapsed_s` ago, or within the
        wait it took over (module docstring)."""
        batch = self._open.get(tag[0])
        if batch is None or (batch.number != tag[1] and tag[1] not in batch.adopted):
            return False
        return now < self._waited_until(batch)

    def _waited_until(self, batch: _OpenBatch) -> float:
        if batch.lapses:
            return max(batch.lease_until + self.lapsed_s, batch.wait_until)
        return max(batch.lease_until, batch.wait_until)

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
