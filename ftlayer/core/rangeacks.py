"""Tree mode by range: a batch range's records complete one by one, without an entry each.

A tree-mode batch read by reference can be registered as ranges too (ftlayer.core.ranges,
`register(..., tree=True)`). Each reader of a range draws a seed and announces it
(`read`, RANGE_READ) before it emits a row; every row carries its range root and its
emission id under that seed (ftlayer.rangeroots.emission_ids). The FT layer keeps per
range an array of ack values, one of states and one of seeds
(ftlayer.core.rangetable.RangeAcks), not an acker entry, a stored record and a delete
per record. The contract:

- `read`: a read of records of an open range starts their trees over: each record
  still pending gets the read's seed and no event applied. A task retried, a batch
  computed twice (a sink's two actions) or run again reads its records again under a
  new seed, so the events of the earlier read complete nothing: its rows' ids are
  not the records' emission ids any more; the acks a batch sink holds for the
  earlier read's rows are dropped. (An event of an earlier read that arrives after
  the new read began is XOR-ed in all the same and leaves its record to time out: a
  replay, never a loss.)
- `xor` applies the XOR events that name a tree-mode range's roots to its arrays
  (vectorized, per range); a record whose value equals its emission id is complete:
  counted completed with its latency from the range's opening. Events of every other
  root are handed back for the acker table. An event for a record no longer pending
  in its range (complete, or gone: failed, excluded) is dropped as late. A value of 0
  excludes its offset (the reader's word for a record a loop fed back, as in barrier
  mode). A range none of whose records is pending any more is closed: its meta is
  deleted with the store's next write transaction (staged), as a barrier's ranges are.
- A failure (FAIL, a timeout) of a range record makes it a record of its own, as in
  barrier mode (ftlayer.core.rangefail), under a new root: it leaves its range (GONE;
  later events for its range root are late), and a range left with no pending record
  closes (`close_finished`).
- `expired`: the roots of the records still pending in ranges opened at least the
  tree timeout ago, whose batch is not running (a running batch's heartbeats hold its
  timeouts off, as they hold those of stored records): the ticker fails them
  (`FailCause.TIMEOUT`), and they are replayed.
- A batch sink's held acks (ftlayer.core.holding) name range roots like any other:
  `pending` says which are pending, and a settle XORs them in here.
- Recovery: the ack values live in memory. A range that comes back from its meta has
  every record pending again from the restart on and none read: what a later read
  does not complete by the timeout is replayed (duplicates, nothing lost). A sink's
  held acks of range records are not journaled either (CoreState.add_holds).

Cost: O(events) per XOR batch with one `np.bitwise_xor.at` per range touched, and the
emission ids of the events' records only; nothing per record at registration but the
three arrays (17 bytes a record in memory).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from numpy.typing import NDArray

from ftlayer.rangeroots import decode, emission_ids, encode, is_range_root

from .rangetable import COMPLETED, PENDING, RANGE_META_PREFIX, BatchRange, RangeAcks
from .state import CoreState

__all__ = [
    "close_finished",
    "expired",
    "has_tree_ranges",
    "next_expiry",
    "pending",
    "read",
    "xor",
]


def has_tree_ranges(s: CoreState) -> bool:
    """Whether any open range is a tree-mode one."""
    return any(r.acks is not None for r in s.ranges.by_number.values())


def read(s: CoreState, first: int, n: int, seed: int) -> int:
    """A reader emits the `n` records of a range from the one whose range root is
    `first` on, under `seed` (see the module docstring); returns how many of them
    were still pending in an open tree-mode range (their trees start over)."""
    if not seed or n <= 0 or not is_range_root([first])[0]:
        return 0
    numbers, deltas = decode([first])
    r = s.ranges.by_number.get(int(numbers[0]))
    if r is None or r.acks is None:
        return 0
    lo = int(deltas[0])
    hi = min(lo + n, len(r))
    if lo >= hi:
        return 0
    acks = r.acks
    mine = np.flatnonzero(acks.state[lo:hi] == PENDING) + lo
    s.changing()
    again = mine[acks.seeds[mine] != 0]
    if len(again) and len(s.holds):  # read before: the earlier read's held sink acks go
        s.holds.discard(encode(r.number, 0, again))
    acks.acc[mine] = 0
    acks.seeds[mine] = seed
    return len(mine)


def pending(s: CoreState, roots: NDArray[np.uint64]) -> NDArray[np.bool_]:
    """Per root: the range root of a record pending in an open tree-mode range."""
    found = np.zeros(len(roots), dtype=np.bool_)
    ranged = np.flatnonzero(is_range_root(roots))
    if not len(ranged):
        return found
    numbers, deltas = decode(roots[ranged])
    for number, mine in _groups(numbers):
        r = s.ranges.by_number.get(number)
        if r is None or r.acks is None:
            continue
        mine = mine[deltas[mine] < len(r)]
        found[ranged[mine]] = r.acks.state[deltas[mine]] == PENDING
    return found


def xor(
    s: CoreState, roots: NDArray[np.uint64], values: NDArray[np.uint64]
) -> tuple[NDArray[np.uint64], NDArray[np.uint64], int]:
    """Apply the events of tree-mode range roots (see the module docstring); returns
    the other events, to be applied to the acker table, and how many records
    completed."""
    ranged = is_range_root(roots)
    if not bool(ranged.any()):
        return roots, values, 0
    at = np.flatnonzero(ranged)
    numbers, deltas = decode(roots[at])
    taken = np.zeros(len(roots), dtype=np.bool_)
    completed = 0
    for number, mine in _groups(numbers):  # a range per partition of a batch
        r = s.ranges.by_number.get(number)
        if r is None or r.acks is None:
            continue  # a barrier-mode range's, or none open: the acker table's path
        taken[at[mine]] = True
        completed += _apply(s, r, deltas[mine], values[at[mine]])
    if not bool(taken.any()):
        return roots, values, completed
    return roots[~taken], values[~taken], completed


def _apply(
    s: CoreState, r: BatchRange, deltas: NDArray[np.int64], values: NDArray[np.uint64]
) -> int:
    """The events (offset from the range's start, value) of range `r`; returns how
    many of its records completed."""
    acks = r.acks
    if acks is None:
        raise TypeError(f"range {r.number} is a barrier-mode range")
    inside = deltas < len(r)
    if not bool(inside.all()):
        s.stats.unknown_events += int(np.count_nonzero(~inside))
        deltas, values = deltas[inside], values[inside]
    pending = acks.state[deltas] == PENDING
    if not bool(pending.all()):
        s.stats.late_events += int(np.count_nonzero(~pending))
        deltas, values = deltas[pending], values[pending]
    if not len(deltas):
        return 0
    zero = values == 0
    if bool(zero.any()):  # excluded: a record a loop fed back (module docstring)
        excluded = np.unique(deltas[zero])
        r.leave((excluded + r.start).tolist())
        s.stats.persisted -= len(excluded)
        s.meters.ranged(r.source_id, -len(excluded))
        keep = acks.state[deltas] == PENDING
        deltas, values = deltas[keep], values[keep]
    s.stats.xor_events += len(deltas)
    np.bitwise_xor.at(acks.acc, deltas, values)
    # Checked per event, not per distinct record (no sort): a record named twice is
    # marked twice, and counted once by what is left pending. A record no read
    # announced (seed 0) completes nothing.
    seeds = acks.seeds[deltas]
    ids = emission_ids(seeds, encode(r.number, 0, deltas))
    done = deltas[(acks.acc[deltas] == ids) & (seeds != 0)]
    if not len(done):
        return 0
    s.changing()
    acks.state[done] = COMPLETED
    left = int(np.count_nonzero(acks.state == PENDING))
    completed, acks.left = acks.left - left, left
    s.stats.completed += completed
    number = s.persistence.topic_number(r.source_id, r.topic)
    s.meters.range_completed(number, completed, latency_s=s.clock() - acks.opened_at)
    if not acks.left:
        _close(s, r)
    return completed


_PEELED = 8
"""Range numbers split off one by one before `_groups` sorts the rest."""


def _groups(numbers: NDArray[np.int64]) -> Iterator[tuple[int, NDArray[np.intp]]]:
    """(number, its positions) of each distinct number: an event batch names a few
    ranges (one per partition), so each is split off with one comparison, not a
    sort of the whole batch; past `_PEELED` of them the rest is grouped by a sort."""
    rest = np.arange(len(numbers))
    left = numbers
    for _ in range(_PEELED):
        if not len(rest):
            return
        first = int(left[0])
        mine = left == first
        yield first, rest[mine]
        rest, left = rest[~mine], left[~mine]
    if len(rest):
        order = np.argsort(left, kind="stable")
        ordered = left[order]
        starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
        for i, start in enumerate(starts.tolist()):
            end = int(starts[i + 1]) if i + 1 < len(starts) else len(order)
            yield int(ordered[start]), rest[order[start:end]]


def close_finished(s: CoreState) -> None:
    """Close every tree-mode range none of whose records is pending any more (its last
    ones failed or timed out: records of their own now)."""
    for r in [r for r in s.ranges.by_number.values() if r.acks is not None and not r.acks.left]:
        _close(s, r)


def _close(s: CoreState, r: BatchRange) -> None:
    """Range `r` holds no pending record any more: its meta goes with the store's next
    write transaction."""
    s.changing()
    s.storage.stage_meta({}, [f"{RANGE_META_PREFIX}{r.number}"])
    del s.ranges.by_number[r.number]


def expired(s: CoreState, now: float) -> NDArray[np.uint64]:
    """The roots of records pending in tree-mode ranges opened at least their source's
    tree timeout (the FT layer's, for a source without one) before `now` (the core's
    clock), unless the batch the range opened in is still running."""
    found = [
        encode(r.number, 0, np.flatnonzero(acks.state == PENDING))
        for r, acks, deadline in _deadlines(s)
        if deadline <= now and not _running(s, acks, now)
    ]
    if not found:
        return np.zeros(0, dtype=np.uint64)
    return np.concatenate(found)


def next_expiry(s: CoreState, now: float) -> float | None:
    """When `expired` next has something (the core's clock; None: no tree-mode range
    has a pending record). A range whose timeout passed while its batch runs is looked
    at again a rotation of the timeouts later."""
    found: float | None = None
    for _, acks, deadline in _deadlines(s):
        if deadline <= now and _running(s, acks, now):
            deadline = now + s.timeouts.rotation_interval_s
        found = deadline if found is None else min(found, deadline)
    return found


def _deadlines(s: CoreState) -> Iterator[tuple[BatchRange, RangeAcks, float]]:
    """Each tree-mode range with a pending record, its acks, and when its timeout ends."""
    for r in s.ranges.by_number.values():
        acks = r.acks
        if acks is None or not acks.left:
            continue
        config = s.source_config(r.source_id)
        timeout_s = None if config is None else config.timeout_s
        yield r, acks, acks.opened_at + (s.timeouts.timeout_s if timeout_s is None else timeout_s)


def _running(s: CoreState, acks: RangeAcks, now: float) -> bool:
    """Whether the batch the range opened in still runs (its heartbeats hold its
    timeout off)."""
    return acks.batch is not None and s.leases.running(acks.batch, now)
