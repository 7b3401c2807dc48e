"""The first failure of a record of a batch range, in one write.

A batch read by reference (ftlayer.core.ranges) has no record stored per row. When a
task fails one of its rows (FAIL naming its range root), the record must become a
failed record like any other: stored by reference (its key unknown until its source
copies its bytes in, ftlayer.core.fills), under a new root, with a retry record of its
first failure, waiting for its backoff or for its key. The general path gets there in
two steps, each its own transaction: `ranges.materialize` stores the record pending
under its range root, then `failure.requeue` reads it back, decides its fate and
retags it. A row failed for the first time needs neither: its fate follows from its
cause and its source's retry policy alone (no history), so `fail_fresh` stores the
records already tagged with their new roots, and their retry records with them, in one
write transaction (`PersistenceStorage.put` with `meta`): the retry records as one
entry per (source, cause), a group (ftlayer.core.retries.FreshGroup). The rest happens
in memory, with one vectorized step per column.

A row whose bytes its source copied in already (`FilledRows`: the notes of a batch's
FAILs applied by the source's FILL, ftlayer.core.failnotes.fill) is stored with them
and its key instead, in the same write: never unfilled, it waits for its backoff or
enters the replay queue at once.

Rows this path leaves to the general one: a root of no open range, an offset already
materialized (a second event for it), and a row whose first failure is its last (a
final cause, or a policy with no retries), whose dead letter the general path makes.
The state a fresh failure leaves (stored record, retry record, acker entry, journal,
waiting or unrouted, unfilled, counts, log lines) is the same either way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from itertools import repeat
from typing import Final

import numpy as np
from numpy.typing import NDArray

from ftlayer.causes import Cause, Causes, FailKind
from ftlayer.policy import JITTER
from ftlayer.rangeroots import decode, is_range_root
from ftlayer.records import KEY_UNKNOWN, RecordBatch

from .faillog import log_failed, log_requeue_error
from .persist import stored_meanwhile
from .queueing import queue_stored, reserve_replay_seqs
from .rangetable import BatchRange
from .retries import FreshGroup, RetryRecord
from .state import CoreState, source_list
from .stats import FailCause

__all__ = ["FilledRows", "fail_fresh", "fresh_rows"]

Enqueue = Callable[[CoreState, NDArray[np.uint64], NDArray[np.uint64], RecordBatch], None]

_WAIT: Final = 1  # faillog's WAITING
_QUEUE: Final = 0  # faillog's QUEUED: unrouted until the key is known


@dataclass(frozen=True, slots=True)
class FilledRows:
    """The bytes a source copied in for rows failed and not applied yet
    (ftlayer.core.failnotes.fill): per range root, ascending, its payload, key hash
    and whether it has a key."""

    roots: NDArray[np.uint64]
    payloads: list[bytes]
    key_hashes: NDArray[np.int64]
    has_key: NDArray[np.bool_]
    enqueue: Enqueue
    """How records due at once enter the replay queue (ftlayer.core.failure's)."""

    def find(self, keys: NDArray[np.uint64]) -> tuple[NDArray[np.bool_], NDArray[np.intp]]:
        """Per key: whether its bytes are here, and where (valid where they are)."""
        if not len(self.roots):
            return np.zeros(len(keys), dtype=np.bool_), np.zeros(len(keys), dtype=np.intp)
        at = np.minimum(np.searchsorted(self.roots, keys), len(self.roots) - 1)
        return self.roots[at] == keys, at


def fail_fresh(
    s: CoreState,
    keys: NDArray[np.uint64],
    causes: Causes,
    failed_at: NDArray[np.float64] | None = None,
    counted: FailCause = FailCause.EXPLICIT,
    filled: FilledRows | None = None,
) -> NDArray[np.bool_]:
    """Fail the rows of `keys` (distinct roots, `causes` aligned) that this path takes
    (module docstring); returns which keys it took (failed, counted under `counted`).
    `failed_at`: when each failed (wall clock; default now), which its backoff counts
    from. `filled`: rows whose bytes their source copied in already: stored with them
    (not by reference) and routed by their keys at once, so they are never unfilled."""
    taken = np.zeros(len(keys), dtype=np.bool_)
    if not len(s.ranges) or not len(keys):
        return taken
    ranged = np.flatnonzero(is_range_root(keys))
    if not len(ranged):
        return taken
    rows, ranges, which, offsets = fresh_rows(s, keys, ranged)
    if not len(rows):
        return taken
    # Fates: only rows whose first failure leaves them a replay.
    now = s.wall()
    source_ids = np.array([r.source_id for r in ranges], dtype=np.uint32)[which]
    row_causes = causes.take(rows)
    keep = np.ones(len(rows), dtype=np.bool_)
    for cause, at in row_causes.groups():
        if cause.final or cause.kind is FailKind.SOURCE_EXPIRED:
            keep[at] = False
    sources = source_list(source_ids)
    for source_id in sources:
        if s.retry_policy(source_id).exhausted(1):
            keep[source_ids == source_id] = False
    if not bool(keep.all()):
        chosen = np.flatnonzero(keep)
        rows, source_ids, offsets = rows[chosen], source_ids[chosen], offsets[chosen]
        which = which[chosen]
        row_causes = row_causes.take(chosen)
        if not len(rows):
            return taken
    n = len(rows)
    if failed_at is not None:  # failures noted earlier (ftlayer.core.failnotes)
        row_at = failed_at[rows]
        now = float(row_at.min())
        due = _due(s, source_ids, row_at)
    else:
        due = _due(s, source_ids, now)
    new_roots = s.new_roots(n)
    payloads: list[bytes] = [b""] * n
    key_hashes = np.full(n, KEY_UNKNOWN, dtype=np.int64)
    has_key = np.zeros(n, dtype=np.bool_)
    with_bytes = np.zeros(n, dtype=np.bool_)
    if filled is not None:
        with_bytes, at = filled.find(keys[rows])
        for row, i in zip(
            np.flatnonzero(with_bytes).tolist(), at[with_bytes].tolist(), strict=True
        ):
            payloads[row] = filled.payloads[i]
        key_hashes[with_bytes] = filled.key_hashes[at[with_bytes]]
        has_key[with_bytes] = filled.has_key[at[with_bytes]]
    batch = RecordBatch.build(
        new_roots,
        payloads,
        source_ids=source_ids,
        key_hashes=key_hashes,
        has_key=has_key,
        topics=_topics(ranges, which),
        partitions=np.array([r.partition for r in ranges], dtype=np.int32)[which],
        offsets=offsets,
        references=~with_bytes,
    )
    # Filled rows whose backoff is over (or who have none) are stored queued: their
    # replay seqs in the write that stores them, not in a retag of their own.
    waiting = due > 0
    ready = with_bytes & (~waiting | (due <= s.wall()))
    routed = _route_ready(s, batch, ready)
    if routed is None:
        ready[:] = False
    waiting &= ~ready
    kinds = _kinds(source_ids, row_causes)
    groups: list[FreshGroup] = []

    def meta(seqs: NDArray[np.uint64]) -> dict[str, bytes]:
        """The retry records, a group per (source, cause): known once the seqs are."""
        groups[:] = [
            FreshGroup.new(source_id, cause, now, seqs[at].tolist(), due[at].tolist())
            for source_id, cause, at in kinds
        ]
        return {group.key: group.encode() for group in groups}

    s.changing()
    replay_column = None
    if routed is not None:
        replay_column = np.zeros(n, dtype=np.uint64)
        replay_column[ready] = reserve_replay_seqs(s, int(np.count_nonzero(ready)))
    # The records, their retry records and the ready rows' replay seqs: one write.
    seqs = s.persistence.persist(batch, meta, replay_column)
    # In memory: the book, the acker, the journal, and where each record waits.
    seq_list = seqs.tolist()
    s.book.add_groups(groups)
    s.acker.add(new_roots, None, seq=seqs, **s.persistence.locators(batch))
    if s.journal is not None:
        s.journal.add(new_roots)
    stored_meanwhile(s, seqs)
    fate = np.where(waiting, _WAIT, _QUEUE).astype(np.int8)
    if bool(waiting.all()):  # all wait for their backoff
        s.book.wait_many(seqs, new_roots, due)
    elif bool(waiting.any()):
        at_waiting = np.flatnonzero(waiting)
        s.book.wait_many(seqs[at_waiting], new_roots[at_waiting], due[at_waiting])
    # The others wait for their key (so their replay partition), which comes with their
    # bytes; the rows filled have both already.
    unrouted = ~waiting & ~with_bytes
    if bool(unrouted.any()):
        at_unrouted = np.flatnonzero(unrouted)
        s.unrouted.update(
            zip(
                seqs[at_unrouted].tolist(),
                zip(new_roots[at_unrouted].tolist(), repeat(now, len(at_unrouted)), strict=True),
                strict=True,
            )
        )
    if bool(with_bytes.any()):
        assert filled is not None
        if routed is not None:
            assert replay_column is not None
            at_ready, ready_batch, route = routed
            queue_stored(
                s,
                new_roots[at_ready],
                seqs[at_ready],
                ready_batch,
                replay_column[at_ready],
                route,
            )
        due_now = with_bytes & ~waiting & ~ready
        s.stats.filled += int(np.count_nonzero(ready))
        _route_with_bytes(s, seqs, new_roots, batch, with_bytes & waiting, due_now, filled.enqueue)
    if not bool(with_bytes.any()):  # stored by reference: unfilled
        s.unfilled.add_many(seq_list, source_ids.tolist(), key_unknown=True)
        s.unfilled.keep(seq_list, batch)  # UNFILLED answers from them, as stored
    elif not bool(with_bytes.all()):
        by_reference = np.flatnonzero(~with_bytes)
        listed = seqs[by_reference].tolist()
        s.unfilled.add_many(listed, source_ids[by_reference].tolist(), key_unknown=True)
        s.unfilled.keep(listed, batch.take(by_reference))
    for i, r in enumerate(ranges):
        r.leave((offsets if len(ranges) == 1 else offsets[which == i]).tolist())
    # Counts and log lines, as a requeue's (no source-expired cause among them).
    s.stats.failed[counted.value] += n
    s.meters.failed(counted.value, source_ids)
    log_failed(
        counted.value,
        keys[rows],
        new_roots,
        seqs,
        batch,
        fate,
        row_causes,
        due,
        _Records(s, seq_list),
    )
    taken[rows] = True
    return taken


def _route_ready(
    s: CoreState, batch: RecordBatch, ready: NDArray[np.bool_]
) -> tuple[NDArray[np.intp], RecordBatch, tuple[NDArray[np.intp], NDArray[np.int32]]] | None:
    """The `ready` rows (their positions and records) and their replay partitions
    (CoreState.route of them); None when there are none, or when routing them fails:
    they are then stored waiting and queued after the write, by a retag, as before
    their backoff ended."""
    if not bool(ready.any()):
        return None
    at_ready = np.flatnonzero(ready)
    ready_batch = batch.take(at_ready)
    try:
        return at_ready, ready_batch, s.route(ready_batch)
    except Exception:  # the queueing after the write meets it again, and logs it
        return None


def _route_with_bytes(
    s: CoreState,
    seqs: NDArray[np.uint64],
    roots: NDArray[np.uint64],
    batch: RecordBatch,
    waiting: NDArray[np.bool_],
    due_now: NDArray[np.bool_],
    enqueue: Enqueue,
) -> None:
    """Rows stored with their bytes (their keys known): those waiting for their
    backoff are kept as stored, for the ticker to queue without a read
    (failure.release_due); those due now enter the replay queue, or, when that write
    fails, wait a second for the ticker to queue them (the failure is applied: it must
    not be applied again)."""
    s.stats.filled += int(np.count_nonzero(waiting | due_now))
    if bool(waiting.any()):
        rows = np.flatnonzero(waiting)
        s.waiting_records.keep(seqs[rows].tolist(), batch.take(rows))
    if bool(due_now.any()):
        rows = np.flatnonzero(due_now)
        try:
            enqueue(s, roots[rows], seqs[rows], batch.take(rows))
        except Exception as exc:  # stored already: they wait a moment and are queued then
            log_requeue_error("bytes filled in", roots[rows], seqs[rows], exc)
            now = s.wall()
            for seq, root in zip(seqs[rows].tolist(), roots[rows].tolist(), strict=True):
                s.book.wait(seq, root, now + 1.0)


def fresh_rows(
    s: CoreState, keys: NDArray[np.uint64], ranged: NDArray[np.intp]
) -> tuple[NDArray[np.intp], list[BatchRange], NDArray[np.intp], NDArray[np.int64]]:
    """The rows of `keys` (among `ranged`) naming an offset of an open range that is
    not materialized: their rows, the ranges they name, which of those each row
    names, and their offsets."""
    numbers, deltas = decode(keys[ranged])
    rows: list[NDArray[np.intp]] = []
    offsets: list[NDArray[np.int64]] = []
    which: list[NDArray[np.intp]] = []
    ranges: list[BatchRange] = []
    for number in source_list(numbers):  # usually one range
        r = s.ranges.by_number.get(number)
        if r is None:
            continue
        at = np.flatnonzero((numbers == number) & (deltas < len(r)))
        found = r.start + deltas[at].astype(np.int64)
        if r.materialized or r.acks is not None or r.held is not None:  # else all fresh
            fresh = r.unfinished(found)
            at, found = at[fresh], found[fresh]
        if len(at):
            rows.append(ranged[at])
            offsets.append(found)
            which.append(np.full(len(at), len(ranges), dtype=np.intp))
            ranges.append(r)
    if not rows:
        return np.zeros(0, np.intp), [], np.zeros(0, np.intp), np.zeros(0, np.int64)
    return np.concatenate(rows), ranges, np.concatenate(which), np.concatenate(offsets)


def _topics(ranges: list[BatchRange], which: NDArray[np.intp]) -> list[str]:
    """The topic of each row (of the range `which` names)."""
    names = [r.topic for r in ranges]
    if len(set(names)) == 1:
        return [names[0]] * len(which)
    return [names[i] for i in which.tolist()]


def _due(
    s: CoreState, source_ids: NDArray[np.uint32], now: float | NDArray[np.float64]
) -> NDArray[np.float64]:
    """Per row, when its replay may start after its first failure at `now` (one time
    for all, or one per row; 0: at once)."""
    due = np.zeros(len(source_ids), dtype=np.float64)
    for source_id in source_list(source_ids):
        policy = s.retry_policy(source_id)
        if not policy.step_s(1):
            continue
        at = np.flatnonzero(source_ids == source_id)
        # RetryPolicy.delay_s(1) for each row, its jitter drawn from a generator the
        # layer's own seeds (one draw of it, at the first call: making a generator
        # costs 17 us, 130 us in a server's FAIL that runs cold).
        jitter = _jitter_rng(s).random(len(at))
        delays = policy.step_s(1) * (1.0 - JITTER * jitter)
        start = now if np.ndim(now) == 0 else np.asarray(now)[at]
        due[at] = np.where(delays > 0, start + delays, 0.0)
    return due


def _jitter_rng(s: CoreState) -> np.random.Generator:
    """The core's generator of fresh failures' jitter, seeded by its own at first use."""
    rng = s.jitter_rng
    if rng is None:
        rng = s.jitter_rng = np.random.default_rng(s.rng.getrandbits(64))
    return rng


def _kinds(
    source_ids: NDArray[np.uint32], causes: Causes
) -> list[tuple[int, Cause, NDArray[np.intp]]]:
    """(source id, cause, its rows) of every pair among the rows."""
    out: list[tuple[int, Cause, NDArray[np.intp]]] = []
    for source_id in source_list(source_ids):
        mine = source_ids == source_id
        for cause, at in causes.groups():
            rows = at[mine[at]]
            if len(rows):
                out.append((source_id, cause, rows))
    return out


class _Records(Mapping[int, RetryRecord]):
    """The retry records of `seqs`, read from the book when a log line wants one."""

    def __init__(self, s: CoreState, seqs: list[int]) -> None:
        self._book, self._seqs = s.book, seqs

    def __getitem__(self, seq: int) -> RetryRecord:
        record = self._book.get(seq)
        if record is None:
            raise KeyError(seq)
        return record

    def __iter__(self) -> Iterator[int]:
        return iter(self._seqs)

    def __len__(self) -> int:
        return len(self._seqs)
