"""Delivering parked failures (ftlayer.core.parked): the failures of a shard that other
shards keep, FAILed at their owner and then dropped where they were kept.

`drain` reads each keeper's list (PARKED list), sends each entry's FAIL to its owner
exactly as the task would have, and drops what it delivered from the keeper (PARKED
drop) only after the owner answered: a crash in between leaves the entry parked, and
its second delivery is harmless (its roots are no longer pending there: counted
dropped, neither replayed again nor lost). An entry whose owner now serves another
store than the one its failures belong to (its data dir was lost: its partitions go
back to their group offsets and read those records again) is dropped undelivered. An
entry whose owner is not reachable stays.

Used by the ftkafka driver before it sends a shard a barrier, and by `ftlayer
savepoint create` before it saves a cluster.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from ftlayer.wire import Fail, ParkedList

__all__ = ["Drained", "drain"]

log = logging.getLogger("ftlayer.client")

LIST_LIMIT = 1000
"""Entries per PARKED list request."""


@dataclass
class Drained:
    """What one `drain` did, in roots per owner shard."""

    delivered: dict[int, int] = field(default_factory=dict)
    dropped: dict[int, int] = field(default_factory=dict)
    """Of an owner's lost store: dropped undelivered."""
    kept: dict[int, int] = field(default_factory=dict)
    """Of an owner that was not reachable: still parked."""

    def add(self, into: dict[int, int], owner: int, roots: int) -> None:
        into[owner] = into.get(owner, 0) + roots


def drain(
    keepers: Iterable[int],
    listing: Callable[[int], ParkedList],
    deliver: Callable[[int, Fail], int],
    drop: Callable[[int, list[int]], int],
    stores: Mapping[int, str | None],
) -> Drained:
    """Deliver the failures parked on `keepers` (module docstring). `listing(keeper)`
    lists a keeper's entries, `deliver(owner, fail)` FAILs at the owner, `drop(keeper,
    seqs)` drops entries; `stores` maps each owner that may be delivered to onto the
    store its failures belong to, or None when it lost that store (its entries are
    dropped); an owner absent from it is not reachable (its entries stay). An error of
    a call propagates: what was dropped before it stays dropped, the rest parked."""
    done = Drained()
    for keeper in keepers:
        seen: set[int] = set()
        while True:
            listed = listing(keeper)
            fresh = [e for e in listed.failures if e.seq not in seen]
            finished: list[int] = []
            for entry in fresh:
                seen.add(entry.seq)
                owner = entry.owner
                if owner not in stores:
                    done.add(done.kept, owner, entry.roots)
                    continue
                store = stores[owner]
                if store is None or (entry.store_id and entry.store_id != store):
                    done.add(done.dropped, owner, entry.roots)
                else:
                    deliver(owner, entry.fail)
                    done.add(done.delivered, owner, entry.roots)
                finished.append(entry.seq)
            if finished:
                drop(keeper, finished)
            if not listed.more or not finished:
                break
    return done
