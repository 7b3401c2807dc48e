"""Holds: acks kept back until a batch's barrier or a batch sink's write.

Barrier holds (ftlayer.core.barrier says why): every root that enters a batch of a
barrier-mode source holds a random value B in its ack value, and (root, B) is an open
hold of its source. At the batch's barrier (`release_barrier`) every open hold of the
query's sources is XOR-ed back in one pass: roots nobody else holds complete; roots
that failed meanwhile are no longer pending and their release is dropped (not counted
as released); roots a step holds past the batch (a loop record in transit) complete
when their holder acks. `hold` gives a pending root a fresh hold in a new batch (a
loop record read back).

Sink holds (ftlayer.core.sinkholds): a batch sink's acks (root, id), sent by the steps
that produced its rows, are held under the sink's random key (`sink_hold`) until its
write is done (`sink_settle`: XOR-ed) or failed (its roots fail). Holds under a key
that never settles are dropped once a timeout passed and all their roots are gone.

Holds are journaled with the acker, so a restart restores them; releasing them writes
one journal record per source or key, not one per root.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ftlayer.acking.ids import new_ids
from ftlayer.causes import Cause
from ftlayer.errors import ConfigError

from . import rangeacks
from .completion import complete, xor
from .failure import fail
from .ranges import materialize
from .sinkholds import check_sink_key
from .state import CoreState, source_list

__all__ = [
    "drop_stale_sink_keys",
    "hold",
    "open_holds_pending",
    "release_barrier",
    "sink_hold",
    "sink_settle",
]


def hold(s: CoreState, roots: ArrayLike, values: ArrayLike) -> int:
    """A barrier-mode root goes on in a new batch: XOR `values` (releasing what held it)
    together with a fresh barrier hold. Pending roots only; returns how many."""
    s.changing()
    keys = np.ascontiguousarray(roots, dtype=np.uint64)
    vals = np.ascontiguousarray(values, dtype=np.uint64)
    if keys.shape != vals.shape:
        raise ConfigError(f"hold: {keys.shape} roots but {vals.shape} values")
    materialize(s, keys)  # a loop's record of a batch range: a record of its own
    pending, topics = s.acker.lookup("topic", keys)
    if not bool(pending.all()):
        s.count_dropped(keys[~pending])
    keys, vals = keys[pending], vals[pending]
    if not len(keys):
        return 0
    sources = s.persistence.number_sources()[topics.astype(np.intp)]
    holds = new_ids(len(keys))
    xor(s, keys, vals ^ holds)
    for source_id in source_list(sources):
        rows = sources == source_id
        s.add_holds(source_id, keys[rows], holds[rows])
    return len(keys)


def release_barrier(s: CoreState, source_ids: Sequence[int]) -> int:
    """The batch of these sources is done: release every open barrier hold of theirs;
    roots nobody else holds complete. Returns how many completed."""
    roots, values = _release_holds(s, source_ids)
    if not len(roots):
        return 0
    result = s.acker.xor(roots, values)
    s.stats.barrier_released += len(roots) - len(result.dropped)
    if len(result.completed):
        complete(s, result)
    return len(result.completed)


def sink_hold(s: CoreState, key: int, roots: ArrayLike, values: ArrayLike) -> int:
    """The acks (root, id) of rows that reached a batch sink, held under the sink's
    `key` until `sink_settle`. For a key already settled they are applied at once, as
    the settle did. Pending roots only; returns how many."""
    check_sink_key(key)
    keys = np.ascontiguousarray(roots, dtype=np.uint64)
    vals = np.ascontiguousarray(values, dtype=np.uint64)
    if keys.shape != vals.shape:
        raise ConfigError(f"sink hold: {keys.shape} roots but {vals.shape} values")
    s.changing()
    pending = _pending(s, keys)
    if not bool(pending.all()):
        s.count_dropped(keys[~pending])
        keys, vals = keys[pending], vals[pending]
    if not len(keys):
        return 0
    settled, cause = s.sink_keys.settled(key)
    if not settled:
        s.sink_keys.opened(key, s.clock())
        s.add_holds(key, keys, vals)
    elif cause is None:
        xor(s, keys, vals)
    else:
        fail(s, np.unique(keys), cause)
    return len(keys)


def sink_settle(s: CoreState, key: int, cause: Cause | None = None) -> int:
    """The batch sink's write under `key` is done: XOR every ack held under it; or,
    with `cause`, it failed: fail every root held under it. Returns how many pairs
    were XOR-ed, or roots failed."""
    check_sink_key(key)
    s.sink_keys.settle(key, cause)
    roots, values = _release_holds(s, [key])
    if not len(roots):
        return 0
    if cause is not None:
        pending = _pending(s, roots)
        return fail(s, np.unique(roots[pending]), cause)
    n = len(roots)
    if rangeacks.has_tree_ranges(s):  # a tree-mode range's records: its ack values
        roots, values, _ = rangeacks.xor(s, roots, values, journal=False)  # released
    # Pairs of roots no longer pending (a re-read took them over) are dropped, uncounted.
    result = s.acker.xor(roots, values, count_dropped=False)
    if len(result.completed):
        complete(s, result)
    return n - len(result.dropped)


def drop_stale_sink_keys(s: CoreState, now: float) -> None:
    """Forget the holds of sink keys open longer than a timeout whose roots are all gone
    (timed out, failed, taken over): their sink will never settle them."""
    for key in s.sink_keys.older_than(now - s.timeouts.timeout_s):
        roots = s.holds.roots_of(key)
        if not bool(_pending(s, roots).any()):
            _release_holds(s, [key])
            s.sink_keys.forget(key)


def open_holds_pending(s: CoreState) -> int:
    """Open holds whose roots are still pending (a root that completed by XOR or failed
    before its release holds nothing any more)."""
    if not len(s.holds):
        return 0
    roots = s.holds.columns()["root"]
    return int(np.count_nonzero(_pending(s, roots)))


def _pending(s: CoreState, roots: NDArray[np.uint64]) -> NDArray[np.bool_]:
    """Per root: pending, in the acker table or in a tree-mode range."""
    found = s.acker.lookup("ack", roots)[0]
    if rangeacks.has_tree_ranges(s):
        found = found | rangeacks.pending(s, roots)
    return found


def _release_holds(
    s: CoreState, keys: Sequence[int]
) -> tuple[NDArray[np.uint64], NDArray[np.uint64]]:
    """Every open hold of these sources (or sink keys), (roots, values), removed here
    and in the journal (which knows the holds: no pairs are journaled again when the
    caller XORs them)."""
    roots, values = s.holds.release(keys)
    if len(roots):
        s.changing()
        if s.journal is not None:
            s.journal.release(keys)
    return roots, values
