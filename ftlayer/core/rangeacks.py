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
- Recovery (with the acker journal, ftlayer.core.journal): the opening of a tree-mode
  range (RANGE_OPEN), each read (RANGE_READ), the events applied to its arrays
  (RANGE_XOR) and a sink's held acks (as every hold) are journaled, and a journal base
  copies the open ranges' arrays (`snapshot`). `recover` puts the base's arrays back
  into the ranges that come back from their meta, then applies the segments' ops in
  order, uncounted and not journaled again: every record's tree is as it was at the
  stop (a record stored since, a record of its own, is GONE from its range, marked by
  the scan of the store). Only the ops after the newest opening of a range number are
  that range's (numbers go round). Without a journal (`--no-journal`, or one written
  before a machine restart) a range that comes back from its meta has every record
  pending again and none read: what a later read does not complete by the timeout is
  replayed (duplicates, nothing lost).

Cost: O(events) per XOR batch and range it names, in compiled loops
(ftlayer.core.rangekernels: the ranges named, then per range one pass that sorts out
unknown and late events and one that XORs the others in and checks the records they
name against their emission ids); nothing per record at registration but the three
arrays (17 bytes a record in memory).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterator
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ftlayer.rangeroots import DELTA_BITS, MAX_NUMBER, decode, encode, is_range_root

from .journal import RANGE_OPEN, RANGE_READ, RANGE_XOR, JournalState
from .rangetable import PENDING, RANGE_META_PREFIX, BatchRange, RangeAcks
from .state import CoreState

__all__ = [
    "close_finished",
    "expired",
    "has_tree_ranges",
    "next_expiry",
    "open_records",
    "pending",
    "read",
    "recover",
    "snapshot",
    "xor",
]


def has_tree_ranges(s: CoreState) -> bool:
    """Whether any open range is a tree-mode one."""
    return any(r.acks is not None for r in s.ranges.by_number.values())


def open_records(s: CoreState) -> int:
    """Records of the open tree-mode ranges (a journal base copies each)."""
    return sum(len(r) for r in s.ranges.by_number.values() if r.acks is not None)


def read(s: CoreState, first: int, n: int, seed: int) -> int:
    """A reader emits the `n` records of a range from the one whose range root is
    `first` on, under `seed` (see the module docstring); returns how many of them
    were still pending in an open tree-mode range (their trees start over)."""
    started = _read(s, first, n, seed, discard=True)
    if started and s.journal is not None:
        s.journal.range_read(first, n, seed)
    return started


def _read(s: CoreState, first: int, n: int, seed: int, *, discard: bool) -> int:
    """`read` without the journal; `discard`: drop the held sink acks of an earlier
    read (the journal's reader drops them itself)."""
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
    if discard and len(again) and len(s.holds):  # the earlier read's held sink acks go
        s.holds.discard(encode(r.number, 0, again))
    acks.acc[mine] = 0
    acks.seeds[mine] = seed
    return len(mine)


def pending(s: CoreState, roots: NDArray[np.uint64]) -> NDArray[np.bool_]:
    """Per root: the range root of a record pending in an open tree-mode range."""
    roots = np.ascontiguousarray(roots, dtype=np.uint64)
    found = np.zeros(len(roots), dtype=np.bool_)
    for head in _named_heads(roots):
        r = s.ranges.by_number.get(head & MAX_NUMBER)
        if r is not None and r.acks is not None:
            _kernels().mark_pending(roots, np.uint64(head), r.acks.state, found)
    return found


def xor(
    s: CoreState,
    roots: NDArray[np.uint64],
    values: NDArray[np.uint64],
    *,
    journal: bool = True,
    counted: bool = True,
) -> tuple[NDArray[np.uint64], NDArray[np.uint64], int]:
    """Apply the events of tree-mode range roots (see the module docstring); returns
    the other events, to be applied to the acker table, and how many records
    completed. `journal`: write the events applied to the journal (not when the
    journal has them already: a sink's released holds, a recovery); `counted`: count
    completions and events in the stats and meters (not in a recovery)."""
    roots = np.ascontiguousarray(roots, dtype=np.uint64)
    values = np.ascontiguousarray(values, dtype=np.uint64)
    heads = _named_heads(roots)
    if not heads:
        return roots, values, 0
    taken = np.zeros(len(roots), dtype=np.bool_)
    completed = 0
    for head in heads:  # a range per partition of a batch
        r = s.ranges.by_number.get(head & MAX_NUMBER)
        if r is None or r.acks is None:
            continue  # a barrier-mode range's, or none open: the acker table's path
        completed += _apply(s, r, head, roots, values, taken, counted)
    if not bool(taken.any()):
        return roots, values, completed
    if journal and s.journal is not None:
        s.journal.range_xor(roots[taken], values[taken])
    return roots[~taken], values[~taken], completed


def _apply(
    s: CoreState,
    r: BatchRange,
    head: int,
    roots: NDArray[np.uint64],
    values: NDArray[np.uint64],
    taken: NDArray[np.bool_],
    counted: bool = True,
) -> int:
    """The events among (`roots`, `values`) of range `r`, whose roots' head is `head`
    (each marked in `taken`); returns how many of its records completed."""
    acks = r.acks
    if acks is None:
        raise TypeError(f"range {r.number} is a barrier-mode range")
    kernels = _kernels()
    counts = np.zeros(4, dtype=np.int64)
    kernels.scan_events(roots, values, np.uint64(head), acks.state, taken, counts)
    unknown, late, zeros, live = counts.tolist()
    if counted:
        s.stats.unknown_events += unknown
        s.stats.late_events += late
    if not live:
        return 0
    s.changing()  # the ack values and states are state a journal base copies
    if zeros:  # excluded: a record a loop fed back (module docstring)
        mine = (roots >> np.uint64(DELTA_BITS)) == np.uint64(head)
        deltas = decode(roots[mine])[1]
        zero = values[mine] == 0
        inside = deltas < len(r)
        at = deltas[zero & inside]
        excluded = np.unique(at[acks.state[at] == PENDING])
        r.leave((excluded + r.start).tolist())
        if counted:
            s.stats.persisted -= len(excluded)
            s.meters.ranged(r.source_id, -len(excluded))
    # Every event is applied before any record is checked (a record named twice is
    # checked on its final value, completed once); a record no read announced (seed 0)
    # completes nothing.
    applied, done = kernels.apply_events(
        roots, values, np.uint64(head), acks.acc, acks.state, acks.seeds
    )
    if counted:
        s.stats.xor_events += applied
    completed = 0
    if done:
        left = int(np.count_nonzero(acks.state == PENDING))
        completed, acks.left = acks.left - left, left
        if counted:
            s.stats.completed += completed
            number = s.persistence.topic_number(r.source_id, r.topic)
            s.meters.range_completed(number, completed, latency_s=s.clock() - acks.opened_at)
    if not acks.left:  # its last pending records completed, or were excluded
        _close(s, r)
    return completed


_MAX_HEADS = 64
"""Distinct ranges an event batch may name before they are found by a sort."""


def _named_heads(roots: NDArray[np.uint64]) -> list[int]:
    """The distinct heads (range bit and number) of the range roots among `roots`."""
    out = np.zeros(_MAX_HEADS, dtype=np.uint64)
    found = _kernels().distinct_heads(roots, out)
    if found >= 0:
        return [int(head) for head in out[:found].tolist()]
    heads = roots[is_range_root(roots)] >> np.uint64(DELTA_BITS)
    return [int(head) for head in np.unique(heads).tolist()]


@functools.cache
def _kernels() -> Any:
    """ftlayer.core.rangekernels, imported on first use (numba's import takes a while)."""
    return importlib.import_module("ftlayer.core.rangekernels")


def compile_kernels() -> None:
    """Compile the kernels (ftlayer.core.rangekernels), or load them from numba's
    cache, with the types `xor` calls them with: events of held acks, and events as
    read off the wire (read-only arrays, which numba types apart). `make` runs this
    once, so no server start waits for it."""
    acks = RangeAcks.new(4, 0.0)
    roots = encode(1, 0, np.arange(2))
    kernels = _kernels()
    for events in (roots, np.frombuffer(roots.tobytes(), np.uint64)):
        taken = np.zeros(2, dtype=np.bool_)
        kernels.distinct_heads(events, np.zeros(_MAX_HEADS, dtype=np.uint64))
        head = np.uint64(int(events[0]) >> DELTA_BITS)
        kernels.mark_pending(events, head, acks.state, taken)
        kernels.scan_events(events, events, head, acks.state, taken, np.zeros(4, np.int64))
        kernels.apply_events(events, events, head, acks.acc, acks.state, acks.seeds)


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
    found = []
    for r, acks, deadline in list(_deadlines(s)):
        if deadline > now:
            continue
        if _running(s, acks, now):
            _postpone(s, acks, now)
        else:
            found.append(encode(r.number, 0, np.flatnonzero(acks.state == PENDING)))
    if not found:
        return np.zeros(0, dtype=np.uint64)
    return np.concatenate(found)


def _postpone(s: CoreState, acks: RangeAcks, now: float) -> None:
    """A range's timeout came while its batch runs: it is held off, and its pending
    records count as postponed timeouts once a rotation of the timeouts, as stored
    roots' entries do (STATUS `timeouts_postponed`)."""
    if now >= acks.postponed_until:
        s.timeouts.postponed += acks.left
        acks.postponed_until = now + s.timeouts.rotation_interval_s


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


def snapshot(s: CoreState) -> dict[str, NDArray[Any]]:
    """The open tree-mode ranges for a journal base ("tranges.*"): per range its number,
    source, partition, start and end; and their records' ack values, seeds and states,
    range after range."""
    found = [r for r in s.ranges.by_number.values() if r.acks is not None]
    acks = [r.acks for r in found if r.acks is not None]

    def column(values: list[int]) -> NDArray[np.int64]:
        return np.array(values, dtype=np.int64)

    return {
        "tranges.number": column([r.number for r in found]),
        "tranges.source": column([r.source_id for r in found]),
        "tranges.partition": column([r.partition for r in found]),
        "tranges.start": column([r.start for r in found]),
        "tranges.end": column([r.end for r in found]),
        "tranges.acc": _joined([a.acc for a in acks], np.uint64),
        "tranges.seeds": _joined([a.seeds for a in acks], np.uint64),
        "tranges.state": _joined([a.state for a in acks], np.uint8),
    }


def _joined(arrays: list[NDArray[Any]], dtype: Any) -> NDArray[Any]:
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype=dtype)


def recover(s: CoreState, journal: JournalState) -> None:
    """The ack values of the open tree-mode ranges as they were at the stop: the
    journal base's copy of each range that is still open (the same range: number,
    source, partition and bounds), then what the journal's segments say happened
    since, in order (reads, events, a sink's released acks), uncounted and not
    journaled again. A range opened again under a number after the base starts from
    that opening. The caller closes the ranges left with no pending record
    (`close_finished`) once the records stored since are marked."""
    last_open = {
        int(payload[0]): i
        for i, (kind, payload) in enumerate(journal.range_ops)
        if kind == RANGE_OPEN
    }
    _restore_base(s, journal.ranges, set(last_open))
    ahead = set(last_open)  # numbers whose newest opening is still to come
    for i, (kind, payload) in enumerate(journal.range_ops):
        if kind == RANGE_OPEN:
            if last_open[int(payload[0])] == i:
                ahead.discard(int(payload[0]))
        elif kind == RANGE_READ:
            first, n, seed = (int(v) for v in payload[:3])
            if int(decode([first])[0][0]) not in ahead:
                _read(s, first, n, seed, discard=False)
        elif kind == RANGE_XOR:
            half = len(payload) // 2
            roots, values = payload[:half], payload[half:]
            if ahead:  # an earlier range's events under a number opened again later
                mine = np.ones(len(roots), dtype=np.bool_)
                for number, at in _groups(decode(roots)[0]):
                    if number in ahead:
                        mine[at] = False
                roots, values = roots[mine], values[mine]
            if len(roots):
                xor(s, roots, values, journal=False, counted=False)


def _restore_base(s: CoreState, base: dict[str, NDArray[Any]], reopened: set[int]) -> None:
    """The base's copies of the ranges still open as they were (not those whose number
    was opened again since)."""
    if "tranges.number" not in base:
        return
    ends = np.cumsum(base["tranges.end"] - base["tranges.start"])
    rows = zip(
        base["tranges.number"].tolist(),
        base["tranges.source"].tolist(),
        base["tranges.partition"].tolist(),
        base["tranges.start"].tolist(),
        base["tranges.end"].tolist(),
        ends.tolist(),
        strict=True,
    )
    for number, source_id, partition, start, end, stop in rows:
        r = s.ranges.by_number.get(number)
        if r is None or r.acks is None or number in reopened:
            continue
        if (r.source_id, r.partition, r.start, r.end) != (source_id, partition, start, end):
            continue
        at = slice(stop - (end - start), stop)
        acks = r.acks
        acks.acc[:] = base["tranges.acc"][at]
        acks.seeds[:] = base["tranges.seeds"][at]
        acks.state[:] = base["tranges.state"][at]
        acks.left = int(np.count_nonzero(acks.state == PENDING))
