"""Re-reads take over: a source record persisted again retires its earlier root.

Spark runs work again: a task retried after its Python worker died, a speculative
attempt, the last micro-batch re-run after a driver restart, a new query starting from
the consumer group's offsets. Each re-run reads the same Kafka records again and
persists them under new roots. The earlier roots then describe trees nobody will
finish (a dead attempt held its events and sent none), so without a takeover they
time out after T and their records are replayed once more: a duplicate at the sink
for every record the re-run already processed.

So the FT layer treats a record of a tree-mode source persisted again as the same
source record, identified by its Kafka coordinates (source, topic, partition, offset)
and confirmed by its stored bytes: the new persist *takes over* every pending root at
those coordinates whose stored payload is byte for byte the new one. Coordinates alone
are not enough: a recreated topic, or a new cluster after a savepoint restore, starts
its offsets again, for other records (the payload holds the Kafka timestamp, so two
such records practically never match). An old root taken over is removed from the
acker table without a replay and without a completion notice (the offset is still
pending, under the new root), its stored copy is deleted, its retry record (attempts,
causes) moves to the new copy so a poison record's count goes on, and it joins the
retired roots, so its late events count as `late`. The record is covered by a live
root at every moment: by the old one until the new one is stored, then by the new
one, whose timeout starts at its persist; a re-run that dies too leaves its root to
time out and be replayed.

A replay fetched again is the same case: the re-run emits it again, while the root
may already hold the earlier run's emission and part of its tree, which the re-run's
tree would never balance (the root would time out and be replayed once more).
`FTLayer.fetch_replay` gives a tree-mode replay fetched again (`ReplayQueue.fetch`
remembers per queue entry whether it was fetched) a fresh root that takes the old one
over in the same way; its queue entries follow. A broadcast replay keeps its root,
since each partition's copy is a child of that one root: a re-run of one copy leaves
the root to time out (a duplicate, never a loss). Barrier-mode replays keep theirs
too: they complete at their batch's barrier whatever the runs sent.

Detection keeps no memory per root. `ReadMarks` keeps, per (topic number,
partition), the highest Kafka offset persisted so far (topic numbers name a (source,
topic) pair: ftlayer.persistence.layer). A source reads each partition forward, so a
chunk whose lowest offset is at or below its partition's mark is a re-read; only then
does the FT layer scan the pending roots' coordinates (`pending_at`: O(pending),
vectorized, over the acker table's mirrored columns) and read the stored copies found
there. The usual persist pays a few numpy reductions over the chunk and one dict
lookup per (topic, partition) in it. Records persisted without an offset (negative)
have no coordinates: they never take over and are never taken over.

At persist, tree mode only. A tree-mode pipeline computes every FT row once
(docs/user-guide.md, 4.1), so a second read of a record is a re-run, and the newest
run is the one whose tree can still complete. Barrier mode allows a batch to be
computed twice (two actions on an uncached batch, one after the other): both reads are
live, and a failure in the first must still replay its record, so a barrier-mode
persist takes nothing over. A dead attempt's barrier-mode roots complete at their
batch's barrier, with the retry's; but that barrier comes after the retry, and a slow
batch lets them time out first. So in barrier mode the takeover happens at the
timeout instead: a root that times out while a newer copy of its record (same
coordinates, a later storage seq, the same bytes) is pending retires like a
taken-over root, without a replay (`covered_at_timeout` in ftlayer.core.persist). By then a first
computation that failed its record has long sent the fail (a task's fails are stored
before the task ends), so only a copy nobody finished retires, and the newer copy
still covers the record.

What a takeover assumes: one read of each source per batch. Two queries that share a
source name, or one query that scans a source twice (a self-join, a union of two
branches of one source DataFrame), take each other's records over: one read's trees
are then untracked, and its failures are dropped as late. Give each read its own
source name (docs/user-guide.md, 4.1 and 4.6).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

__all__ = ["ReadMarks", "Reread", "chunk_groups", "pending_at"]


class Reread(NamedTuple):
    """The offsets of one (topic number, partition) in a persisted chunk."""

    topic: int
    partition: int
    offsets: NDArray[np.int64]


def chunk_groups(
    topics: NDArray[Any], partitions: NDArray[Any], offsets: NDArray[Any]
) -> list[Reread]:
    """The chunk's offsets per (topic number, partition), negative offsets left out.
    A chunk of the ftkafka source is one partition of one topic: then O(rows) numpy
    comparisons and no copy."""
    n = len(offsets)
    if not n:
        return []
    offs = offsets.astype(np.int64, copy=False)
    t0, p0 = topics[0], partitions[0]
    if bool((topics == t0).all()) and bool((partitions == p0).all()):
        if int(offs.min()) < 0:
            offs = offs[offs >= 0]
        return [Reread(int(t0), int(p0), offs)] if len(offs) else []
    valid = offs >= 0
    if not bool(valid.any()):
        return []
    t = topics[valid].astype(np.int64)
    p = partitions[valid].astype(np.int64)
    offs = offs[valid]
    order = np.lexsort((p, t))
    t, p, offs = t[order], p[order], offs[order]
    starts = np.flatnonzero(np.r_[True, (t[1:] != t[:-1]) | (p[1:] != p[:-1])])
    ends = np.r_[starts[1:], len(t)]
    return [
        Reread(int(t[s]), int(p[s]), offs[s:e])
        for s, e in zip(starts.tolist(), ends.tolist(), strict=True)
    ]


class ReadMarks:
    """Per (topic number, partition): the highest Kafka offset persisted so far.

    `read(groups)` raises the marks by a chunk and returns the groups read before (a
    lowest offset at or below the mark). 16 bytes of keys and one int per partition
    ever read; O(groups) per chunk."""

    def __init__(self) -> None:
        self._high: dict[tuple[int, int], int] = {}

    def __len__(self) -> int:
        return len(self._high)

    def read(self, groups: list[Reread]) -> list[Reread]:
        rereads: list[Reread] = []
        high = self._high
        for group in groups:
            key = (group.topic, group.partition)
            mark = high.get(key, -1)
            lo, hi = int(group.offsets.min()), int(group.offsets.max())
            if lo <= mark:
                rereads.append(group)
            if hi > mark:
                high[key] = hi
        return rereads

    def rebuild(
        self, topics: NDArray[Any], partitions: NDArray[Any], offsets: NDArray[Any]
    ) -> None:
        """Raise the marks to the highest offset of every (topic, partition) given (the
        pending roots after a recovery)."""
        for group in chunk_groups(topics, partitions, offsets):
            key = (group.topic, group.partition)
            self._high[key] = max(self._high.get(key, -1), int(group.offsets.max()))


def pending_at(columns: dict[str, NDArray[Any]], rereads: list[Reread]) -> NDArray[np.bool_]:
    """Which rows of the pending roots' columns ("topic", "partition", "offset", in
    the acker table's live order) sit at the coordinates of `rereads`. O(pending) per
    group."""
    topic, partition, offset = columns["topic"], columns["partition"], columns["offset"]
    found = np.zeros(len(topic), dtype=np.bool_)
    for group in rereads:
        lo, hi = int(group.offsets.min()), int(group.offsets.max())
        rows = np.flatnonzero(
            (topic == group.topic)
            & (partition == group.partition)
            & (offset >= lo)
            & (offset <= hi)
        )
        if len(rows):
            found[rows[np.isin(offset[rows], group.offsets)]] = True
    return found
