"""The ftkafka driver's side of parked failures (ftlayer.core.parked): with several
FT-layer shards, a task whose FAIL its shard did not take (the shard died under a
running batch) parks it on another shard and goes on. Those failures belong to
ranges of the batch that the shard's next barrier completes, so the driver delivers
them before it sends that shard a barrier again.

`Parking.settle` runs on every trigger's STATUS of every shard (and before a
completion the trigger's STATUS did not cover yet: .driver). A shard is *suspect*
while failures of it may be parked somewhere: it was down, it restarted between two
STATUS reads (its uptime went back), or some shard's STATUS counts failures parked
for it. A suspect shard that answers

- with the store the query knows: has its parked failures delivered
  (ftlayer.client.drain: read from each keeper, FAILed at it, then dropped at the
  keeper), and is clear once every shard answered the same STATUS round (a shard that
  is down may keep some of its failures) and the delivery went through; until then
  it is *held*: as if down, its partitions take in nothing and it gets no barrier;
- with another store (its data dir was lost, its partitions go back to their group
  offsets, .rewind): has its parked failures dropped undelivered, logged, and is
  clear.

A shard that is down while none of its failures is parked holds up no other shard.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from functools import partial

from ftlayer.client import FTClient
from ftlayer.client.drain import Drained, drain
from ftlayer.errors import SourceError
from ftlayer.status import BriefStatus
from ftlayer.wire import Fail, ParkedList

from .cluster import ShardClients, brief_status

__all__ = ["Parking"]

log = logging.getLogger("ftlayer.source")


class Parking:
    """Which shards may have failures parked, and their delivery (module docstring)."""

    def __init__(self, shards: ShardClients) -> None:
        self.shards = shards
        self.suspect: set[int] = set()
        self._uptimes: dict[int, tuple[float, float]] = {}  # uptime, when (monotonic)
        self.settled = True
        """No batch ran since the last `settle` (with one shard: always)."""
        self.delivered = 0
        self.dropped = 0
        """Roots delivered, and dropped as failures of a lost store, since the start."""

    def settle(
        self, statuses: list[BriefStatus | None], stores: Sequence[str]
    ) -> list[BriefStatus | None]:
        """Look at this STATUS round (None: down), deliver what can be delivered, and
        return the round with every held shard as None (module docstring). `stores`:
        the store of each shard the query's position names."""
        shards = self.shards
        if shards.count == 1:
            return statuses
        self.settled = True
        self.suspect.update(shards.down)
        keepers_of: dict[int, set[int]] = {}
        for shard, status in enumerate(statuses):
            if status is None:
                continue
            now = time.monotonic()
            before = self._uptimes.get(shard)
            self._uptimes[shard] = (status.uptime_s, now)
            if before is not None and status.uptime_s < before[0] + (now - before[1]) - 1.0:
                self.suspect.add(shard)  # restarted between two rounds
            for named, counts in status.parked.items():
                if counts.get("entries", 0):
                    keepers_of.setdefault(int(named), set()).add(shard)
                    self.suspect.add(int(named))
        if not self.suspect:
            shards.held.clear()
            return statuses
        targets: dict[int, str | None] = {}
        for owner in sorted(self.suspect):
            status = statuses[owner]
            if status is not None:
                same = status.store_id == stores[owner]
                targets[owner] = status.store_id if same else None
        keepers = sorted({k for owner in targets for k in keepers_of.get(owner, ())})
        done: Drained | None = Drained()
        if keepers:
            try:
                done = drain(keepers, self._list, self._deliver, self._drop, targets)
            except SourceError as exc:
                log.warning("could not deliver parked failures (tried again next trigger): %s", exc)
                done = None
            if done is not None:
                self._report(done, stores)
        every = all(status is not None for status in statuses)
        out = list(statuses)
        for owner, store in targets.items():
            undelivered = done is None and owner in keepers_of
            if store is None or (every and not undelivered):
                self.suspect.discard(owner)
                shards.held.discard(owner)
                if done is not None and done.delivered.get(owner):
                    # Its failed records want their bytes copied in this trigger.
                    with contextlib.suppress(SourceError):  # else at the next trigger
                        out[owner] = shards.quick(owner, "read the replay cursor", brief_status)
                continue
            if owner not in shards.held:
                silent = [s for s, status in enumerate(statuses) if status is None]
                log.warning(
                    "%s answers, but failures of its partitions may be parked on %s: its "
                    "partitions take in nothing and get no barrier until they are delivered",
                    shards.where(owner),
                    f"shard(s) {silent}, which do not answer"
                    if silent
                    else f"shard(s) {sorted(keepers_of[owner])}, which could not deliver them",
                )
            shards.held.add(owner)
            out[owner] = None
        shards.held &= self.suspect
        return out

    def _report(self, done: Drained, stores: Sequence[str]) -> None:
        for owner, roots in sorted(done.delivered.items()):
            self.delivered += roots
            log.warning(
                "delivered %d failures of %s that tasks parked on other shards while it "
                "did not answer",
                roots,
                self.shards.where(owner),
            )
        for owner, roots in sorted(done.dropped.items()):
            self.dropped += roots
            log.warning(
                "dropped %d failures parked for %s: they belong to its store %s, which it "
                "lost; its partitions go back to their group offsets and read those records "
                "again",
                roots,
                self.shards.where(owner),
                stores[owner],
            )

    def _list(self, keeper: int) -> ParkedList:
        return self.shards.quick(keeper, "list the parked failures", _listed)

    def _deliver(self, owner: int, fail: Fail) -> int:
        return self.shards.quick(owner, "deliver parked failures", partial(_fail, fail))

    def _drop(self, keeper: int, seqs: list[int]) -> int:
        return self.shards.quick(keeper, "drop delivered parked failures", partial(_dropped, seqs))


def _listed(client: FTClient) -> ParkedList:
    return client.parked()


def _fail(fail: Fail, client: FTClient) -> int:
    return client.fail(fail.roots, fail.causes)


def _dropped(seqs: list[int], client: FTClient) -> int:
    return client.drop_parked(seqs)
