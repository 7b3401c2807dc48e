"""XOR events and completion: a tree is complete when its ack value returns to 0.

XOR events (root, value) arrive from sources, tasks, sinks and the barrier's release;
`xor` applies a batch of them in one vectorized pass over the acker table
(ftlayer.acking.acker). A root whose ack value returns to 0 for the first time is
complete: it leaves the acker table, its stored record is deleted (or marked for the
server's deleter, with `defer_deletes`), the journal learns it is gone, its retry
record (if it failed before) is forgotten, and the meters count it with its latency.
Events for roots that are not pending are dropped and counted ("late" for a root
retired recently, "unknown" otherwise): they never create an entry that could not
complete.

Deferred deletes: completion only marks the records; `take_deletes` hands their seqs
to a deleter (which deletes them in transactions of its own, outside the caller's
lock), `retry_deletes` gives back those whose delete failed, `flush_deletes` deletes
now. A marked record that a crash leaves in storage is replayed at the restart unless
the journal knows its tree completed: a duplicate, never a loss.

Cost: O(events) for the XOR, O(completed) for the completion; nothing per event reads
storage.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ftlayer.acking.acker import XorResult

from . import rangeacks, ranges
from .recovery import write_journal_base
from .state import CoreState

__all__ = ["complete", "flush_deletes", "retry_deletes", "take_deletes", "xor"]


def xor(s: CoreState, roots: ArrayLike, values: ArrayLike) -> XorResult:
    """Apply XOR events; completes the roots whose ack value returns to 0. Events for
    range roots (ftlayer.core.ranges): value 0 says the offset is no record of its
    range (a record a loop fed back, read under its own tree's root); any other value
    makes the record one of its own first (a loop sink's ack and anchor). Events for
    the roots of a tree-mode range go to its ack values (ftlayer.core.rangeacks)."""
    if len(s.ranges):
        if rangeacks.has_tree_ranges(s):
            roots, values, _ = rangeacks.xor(
                s,
                np.ascontiguousarray(roots, dtype=np.uint64),
                np.ascontiguousarray(values, dtype=np.uint64),
            )
        roots, values = ranges.sort_out(s, roots, values)
    s.changing()
    result = s.acker.xor(roots, values)
    if s.journal is not None:
        s.journal.xor(np.asarray(roots), np.asarray(values))
        if s.journal.wants_base:
            write_journal_base(s)
    s.stats.xor_events += len(np.asarray(roots))
    if len(result.dropped):
        s.count_dropped(result.dropped)
    if len(result.completed):
        complete(s, result)
    return result


def complete(s: CoreState, result: XorResult) -> None:
    """The roots of `result.completed` are done: their records go, and they are counted."""
    done = s.persistence.complete(result.completed, result.columns)
    if s.journal is not None:
        s.journal.gone(result.completed)
    s.stats.completed += len(done)
    seqs = result.columns["seq"]
    # A record with a retry record failed before: a replay, left out of the latency.
    replays = s.book.forget(seqs) if len(s.book) else None
    s.meters.completed(seqs, result.columns["topic"], replays, s.clock())
    if s.listeners:
        s.notify(done)


def take_deletes(s: CoreState) -> NDArray[np.uint64]:
    """With defer_deletes: the seqs of completed records not deleted yet, unmarked."""
    return s.persistence.take_marked()


def retry_deletes(s: CoreState, seqs: NDArray[np.uint64]) -> None:
    """With defer_deletes: seqs from `take_deletes` whose delete failed, marked again."""
    s.persistence.mark_again(seqs)


def flush_deletes(s: CoreState) -> int:
    """With defer_deletes: delete the completed records not deleted yet, now."""
    return s.persistence.flush_deletes()
