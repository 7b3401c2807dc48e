"""Failure, timeouts, requeue and replay: what happens to a root that does not complete.

A root's life, on one screen (a record keeps its storage seq through all of it; each
failure gives it a new root, and the old root is retired: late events for it are
dropped and counted as late):

state        | event                                          | next state
-------------+------------------------------------------------+------------------------------
(none)       | begin_persist (persist)                        | reserved
reserved     | end_persist: the records are stored            | pending: timed; barrier: held
reserved     | abort_persist: the write failed                | (nothing stored)
pending      | ack value back to 0: XOR, barrier release,     | complete: record deleted
             |   sink settle (completion, holding)            |
pending      | fail: FailException, error, refused sink write | failed
pending      | timeout, its batch running and leased          | pending (postponed)
pending      | timeout (on_timeout)                           | failed
range record | tree mode: its range's timeout (time_out_ranges) | failed
pending      | barrier mode: timeout, a newer copy pending    | retired, no replay
pending      | tree mode: the same record persisted again     | retired; the new root pending
failed       | fate: retries left, no backoff (requeue)       | queued under a new root
failed       | fate: a backoff                                | waiting under a new root
failed       | fate: a final cause, a final-if-repeated one   | dead letter (root 0, kept)
             |   repeated, or retries spent                   |
waiting      | its backoff ends (tick: release_due)           | queued
queued       | its source fetches it (fetch_replay)           | pending: timed; barrier: held
queued       | tree mode: fetched again (a re-run)            | pending, fresh root
queued       | its batch is checkpointed (prune_replay)       | pending, entry forgotten
dead letter  | requeue, or restore from a dead-letter topic   | queued, fresh retry budget
dead letter  | purge, or delivered to the dead-letter topic   | (gone)
stored       | restart, the journal knows its tree (recovery) | as it was
stored       | restart, the journal does not know it          | failed (no attempt counted)
retired      | a late event for it                            | dropped, counted "late"

A failed record's fate follows its source's retry policy (ftlayer.core.retries: max
retries, exponential backoff with jitter, `final` causes dead-letter at once). A
queued replay's timeout starts when its source fetches it, not at the requeue: like a
record still in Kafka, it has not entered the pipeline yet, so a stalled query never
makes its replays time out. Replay seqs are handed out in order (1, 2, 3, ...), never
reused, also across restarts (the counter is stored before any record uses one).

Failure paths may raise (a storage error while re-tagging): then the old roots stay
pending and time out again; a failure can be retried, never lost.
"""

from __future__ import annotations

from itertools import repeat
from typing import Any, Final

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ftlayer.acking.ids import new_ids
from ftlayer.causes import Cause, Causes, FailKind
from ftlayer.errors import ConfigError
from ftlayer.persistence.layer import Completed
from ftlayer.records import RecordBatch, ReplayRecords

from . import rangeacks
from .faillog import DEAD as _DEAD
from .faillog import QUEUED as _QUEUE
from .faillog import WAITING as _WAIT
from .faillog import log_failed, log_requeue_error
from .fills import note_failed
from .persist import covered_at_timeout, retire_covered
from .queueing import queue_stored, reserve_replay_seqs
from .rangefail import FilledRows, fail_fresh
from .ranges import materialize
from .retries import DEAD_LETTER, RetryRecord
from .state import CoreState
from .stats import FailCause

__all__ = [
    "enqueue",
    "fail",
    "fetch_replay",
    "on_timeout",
    "prune_replay",
    "release_due",
    "requeue",
    "time_out_ranges",
]

_TIMEOUT: Final = Cause(FailKind.TIMEOUT)


def fail(
    s: CoreState,
    roots: ArrayLike,
    causes: Causes | Cause | None = None,
    failed_at: NDArray[np.float64] | None = None,
    counted: FailCause = FailCause.EXPLICIT,
    filled: FilledRows | None = None,
) -> int:
    """Fail pending roots, with their causes (one for all, one per root, or none):
    each record is replayed after its backoff, or dead-lettered once its retries are
    spent. Returns how many were pending. `failed_at`: per root, when it failed (failures
    noted earlier, ftlayer.core.failnotes: a batch range's first failures count their
    backoff from it). `counted`: the cause they are counted under (but source-expired
    ones: FailCause.SOURCE_EXPIRED). `filled`: bytes a source copied in for batch-range
    rows among them (rangefail.fail_fresh)."""
    s.changing()
    root_array = np.ascontiguousarray(roots, dtype=np.uint64)
    if not isinstance(causes, Causes):
        causes = Causes.one(causes, len(root_array))
    elif len(causes) != len(root_array):
        raise ConfigError(f"fail: {len(root_array)} roots but {len(causes)} causes")
    keys, first = np.unique(root_array, return_index=True)
    causes = causes.take(first)
    # A batch range's rows failed for the first time: in one write (rangefail).
    at = None if failed_at is None else failed_at[first]
    fresh = fail_fresh(s, keys, causes, at, counted, filled)
    taken = int(np.count_nonzero(fresh))
    if taken:
        keys, causes = keys[~fresh], causes.take(np.flatnonzero(~fresh))
    materialize(s, keys)  # other records of a batch range become records of their own
    rangeacks.close_finished(s)  # a tree-mode range whose last pending records failed
    if not len(keys):
        return taken
    pending, seqs = s.acker.lookup("seq", keys)
    if not bool(pending.all()):
        s.count_dropped(keys[~pending])
    if bool(pending.any()):
        roots, causes = keys[pending], causes.take(np.flatnonzero(pending))
        # Counted by who decided: a task (explicit), or the source (source-expired).
        expired = causes.of_kind(FailKind.SOURCE_EXPIRED)
        for rows, kind in ((~expired, counted), (expired, FailCause.SOURCE_EXPIRED)):
            if bool(rows.any()):
                requeue(s, roots[rows], seqs[rows], kind, causes.take(np.flatnonzero(rows)))
    return taken + int(np.count_nonzero(pending))


def on_timeout(s: CoreState, roots: NDArray[np.uint64], seqs: NDArray[np.uint64]) -> None:
    """An entry of the rotating timeouts expired: fail its roots still pending under the
    same record (barrier mode: retire those a newer copy covers)."""
    same = s.live_with_seqs(roots, seqs)
    if not bool(same.any()):
        return
    roots, seqs = roots[same], seqs[same]
    if len(roots) > 1:  # a replay fetched twice (a batch run again) is timed twice
        roots, first = np.unique(roots, return_index=True)
        seqs = seqs[first]
    try:
        if s.barrier_mode:  # a newer copy pending covers it: retire, no replay
            covered = covered_at_timeout(s, roots, seqs)
            if bool(covered.any()):
                retire_covered(s, roots[covered])
                roots, seqs = roots[~covered], seqs[~covered]
        if len(roots):
            requeue(s, roots, seqs, FailCause.TIMEOUT, Causes.one(_TIMEOUT, len(roots)))
    except BaseException:
        # The batch left the rotating buckets: time its roots again, or a storage
        # error here would leave them pending with no timeout at all.
        s.timeouts.track(roots, seqs)
        raise


def time_out_ranges(s: CoreState, now: float) -> int:
    """Fail the records of tree-mode ranges whose timeout passed by `now` (the core's
    clock; ftlayer.core.rangeacks.expired), counted as timeouts: each becomes a record
    of its own and is replayed after its backoff (or dead-lettered). Returns how many."""
    roots = rangeacks.expired(s, now)
    if not len(roots):
        return 0
    return fail(s, roots, _TIMEOUT, counted=FailCause.TIMEOUT)


def release_due(s: CoreState, now: float | None = None) -> int:
    """Queue the failed records whose backoff has passed by `now` (wall clock, default:
    now); returns how many."""
    due = s.book.due(s.wall() if now is None else now)
    if not due:
        return 0
    s.changing()
    seqs = np.array([seq for seq, _ in due], dtype=np.uint64)
    roots = np.array([root for _, root in due], dtype=np.uint64)
    # Only records still waiting under that root (not completed or purged since).
    live = s.live_with_seqs(roots, seqs)
    seqs, roots = seqs[live], roots[live]
    if not len(seqs):
        return 0
    order = np.argsort(seqs, kind="stable")
    seqs, roots = seqs[order], roots[order]
    # Key unknown: routed once the source copied it in. Those the unfilled list knows
    # so need no read (a batch range's failed rows, whose backoff usually ends before
    # their source's next batch fills them).
    unknown = s.unfilled.keys_unknown(seqs.tolist())
    if bool(unknown.any()):
        s.unrouted.update(
            zip(seqs[unknown].tolist(), zip(roots[unknown].tolist(), repeat(0.0)), strict=True)
        )
        keep = np.flatnonzero(~unknown)
        seqs, roots = seqs[keep], roots[keep]
        if not len(seqs):
            return 0
    # Filled while they waited: as their fill stored them (ftlayer.core.fills).
    listed = seqs.tolist()
    kept = s.waiting_records.kept(listed)
    s.waiting_records.discard_many(listed)
    batch = s.storage.get(seqs) if kept is None else kept
    if batch.any_references:
        unknown = batch.key_unknown
        if bool(unknown.any()):
            for seq, root in zip(seqs[unknown].tolist(), roots[unknown].tolist(), strict=True):
                s.unrouted[seq] = (root, 0.0)
            keep = np.flatnonzero(~unknown)
            seqs, roots, batch = seqs[keep], roots[keep], batch.take(keep)
            if not len(seqs):
                return 0
    try:
        enqueue(s, roots, seqs, batch)
    except BaseException as exc:
        log_requeue_error("backoff ended", roots, seqs, exc)
        for seq, root in zip(seqs.tolist(), roots.tolist(), strict=True):
            s.book.wait(seq, root, s.wall() + 1.0)  # try again shortly
        raise
    return len(seqs)


def enqueue(
    s: CoreState, roots: NDArray[np.uint64], seqs: NDArray[np.uint64], batch: RecordBatch
) -> None:
    """Records waiting (pending, untimed) under `roots` enter the replay queue now:
    replay seqs, stored with the records; their timeout starts when their source
    fetches them."""
    route = s.route(batch)
    replay_seqs = reserve_replay_seqs(s, len(seqs))
    s.persistence.retag(seqs, roots, replay_seqs)
    queue_stored(s, roots, seqs, batch, replay_seqs, route)


def requeue(
    s: CoreState,
    old_roots: NDArray[np.uint64],
    seqs: NDArray[np.uint64],
    cause: FailCause,
    causes: Causes | None = None,
) -> None:
    """Failed records, in the order they were first persisted: each gets a new root and
    is, by its source's retry policy, queued for replay now, left waiting for its
    backoff, or dead-lettered (`causes` None: a recovery, which is no attempt of the
    record's: it keeps its count and due time).

    Steps 1-2 may raise (storage errors); they leave the old roots pending, so a
    failed requeue is retried by the timeout. Steps 3-5 only touch memory.
    """
    n = len(seqs)
    order = np.argsort(seqs, kind="stable")
    old_roots, seqs = old_roots[order], seqs[order]
    if causes is not None:
        causes = causes.take(order)
    batch = s.storage.get(seqs)
    # Step 1: decide each record's fate and route the ones queued now.
    now = s.wall()
    fate, due, records = _fates(s, seqs, batch.source_ids, causes, now)
    queued, waiting, dead = fate == _QUEUE, fate == _WAIT, fate == _DEAD
    # A record whose key is not known yet (of a batch range) is routed only once its
    # source copied its bytes in (ftlayer.core.fills): unrouted until then.
    unrouted = queued & batch.key_unknown if batch.any_references else None
    if unrouted is not None and bool(unrouted.any()):
        queued = queued & ~unrouted
    new_roots = s.new_roots(n)
    new_roots[dead] = 0
    replay_seqs = np.zeros(n, dtype=np.uint64)
    replay_seqs[dead] = DEAD_LETTER
    queued_rows = np.flatnonzero(queued)
    sub = batch if len(queued_rows) == n else batch.take(queued_rows)
    index, partitions = s.route(sub) if len(queued_rows) else (None, None)
    # Step 2: store the retry records, new roots and replay seqs (one transaction).
    if len(queued_rows):
        replay_seqs[queued_rows] = reserve_replay_seqs(s, len(queued_rows))
    old_meta = s.book.stage(records)
    try:
        s.persistence.retag(seqs, new_roots, replay_seqs)
    except BaseException as exc:
        s.book.unstage(old_meta)
        log_requeue_error(cause.value, old_roots, seqs, exc)
        raise
    s.book.commit(records)
    # Step 3: swap the old roots for the new ones in the acker; the new roots wait
    # (ack value 0) for their source to emit them again.
    s.acker.remove(old_roots)
    live = ~dead
    kept = batch if bool(live.all()) else batch.take(np.flatnonzero(live))
    s.acker.add(new_roots[live], None, seq=seqs[live], **s.persistence.locators(kept))
    if s.journal is not None:
        s.journal.add(new_roots[live])
    # Step 4: queue (a queued replay's timeout starts when its source fetches it),
    # wait or dead-letter.
    if len(queued_rows):
        assert index is not None and partitions is not None
        q_roots, q_seqs = new_roots[queued_rows], seqs[queued_rows]
        s.queue.append(
            replay_seqs[queued_rows][index],
            q_roots[index],
            q_seqs[index],
            sub.source_ids[index],
            partitions,
        )
        s.queue.records.add(q_seqs, sub, replay_seqs[queued_rows])
    for row in np.flatnonzero(waiting).tolist():
        s.book.wait(int(seqs[row]), int(new_roots[row]), float(due[row]))
    if unrouted is not None:
        for row in np.flatnonzero(unrouted).tolist():
            s.unrouted[int(seqs[row])] = (int(new_roots[row]), now)
    s.retired.add(old_roots, s.clock())
    note_failed(s, seqs, batch, dead)  # records stored by reference: their bytes wanted
    # Step 5: count.
    s.stats.failed[cause.value] += n
    s.meters.failed(cause.value, batch.source_ids)
    if len(queued_rows):
        s.stats.replayed += len(queued_rows)
        s.meters.replayed(batch.source_ids[queued_rows])
    log_failed(cause.value, old_roots, new_roots, seqs, batch, fate, causes, due, records)
    if bool(dead.any()):
        rows = np.flatnonzero(dead)
        s.stats.dead_lettered += len(rows)
        s.meters.dead_lettered(batch.source_ids[rows])
        if s.listeners:
            gone = batch.take(rows)
            s.notify(
                Completed(
                    roots=old_roots[rows],
                    topics=gone.topics,
                    partitions=gone.partitions.astype(np.int32, copy=False),
                    offsets=gone.offsets.astype(np.int64, copy=False),
                )
            )


def _fates(
    s: CoreState,
    seqs: NDArray[np.uint64],
    source_ids: NDArray[Any],
    causes: Causes | None,
    now: float,
) -> tuple[NDArray[np.int8], NDArray[np.float64], dict[int, RetryRecord]]:
    """Per record: queue now, wait until due[i], or dead-letter; and the retry records
    that change (to be stored)."""
    n = len(seqs)
    fate = np.full(n, _QUEUE, dtype=np.int8)
    due = np.zeros(n, dtype=np.float64)
    changed: dict[int, RetryRecord] = {}
    for i, (seq, source_id) in enumerate(zip(seqs.tolist(), source_ids.tolist(), strict=True)):
        record = s.book.get(seq)
        if causes is None:  # recovery: no attempt of the record's
            if record is not None and record.due > now:
                fate[i], due[i] = _WAIT, record.due
            continue
        cause = causes[i]
        policy = s.retry_policy(int(source_id))
        repeated = cause.final_if_repeated and _same_error_as_last(record, cause)
        record = record.copy() if record is not None else RetryRecord(int(source_id))
        record.add_failure(now, cause)
        if cause.final or repeated or policy.exhausted(record.failures):
            fate[i] = _DEAD
            record.dead_at, record.due = now, 0.0
        else:
            delay = policy.delay_s(record.failures, s.rng)
            record.due = now + delay if delay > 0 else 0.0
            if delay > 0:
                fate[i], due[i] = _WAIT, record.due
        changed[seq] = record
    return fate, due, changed


def _same_error_as_last(record: RetryRecord | None, cause: Cause) -> bool:
    """Whether the record's last failure was a final-if-repeated one of the same
    exception type: then this one repeats it, and is final."""
    last = None if record is None else record.last_cause
    return last is not None and last.final_if_repeated and last.error_type == cause.error_type


def fetch_replay(
    s: CoreState,
    lo: int,
    hi: int,
    source_id: int | None = None,
    partition: int | None = None,
) -> ReplayRecords:
    """Replayed records with lo < replay seq <= hi (optionally of one source and one
    target partition) whose roots are still pending; their timeout starts now. A
    tree-mode replay fetched again comes under a fresh root, which takes the old one
    over (ftlayer.core.takeover); a broadcast replay keeps its root."""
    found = s.queue.fetch(lo, hi, source_id, partition)
    rseqs, roots, seqs, parts = found.replay_seqs, found.roots, found.seqs, found.partitions
    live = s.live_with_seqs(roots, seqs)
    again, sources = found.again, found.source_ids
    if not bool(live.all()):
        rseqs, roots, seqs, parts = rseqs[live], roots[live], seqs[live], parts[live]
        again, sources = again[live], sources[live]
    if bool(again.any()):
        roots = _renew(s, roots, again, sources)
    kept = s.queue.records.get(seqs)  # as queued, when every one is kept
    records = (s.storage.get(seqs) if kept is None else kept).with_roots(roots)
    if len(roots):
        s.track(roots, seqs, records.source_ids)
        if s.barrier_mode:
            _hold_replays(s, records)
    return ReplayRecords(replay_seqs=rseqs, partitions=parts, records=records)


def _renew(
    s: CoreState, roots: NDArray[np.uint64], again: NDArray[np.bool_], sources: NDArray[Any]
) -> NDArray[np.uint64]:
    """`roots` with the tree-mode, single-entry ones fetched `again` under fresh roots,
    which take the old ones over: same record, same locator, ack value 0 (the re-run
    emits it again), no replay; the queue entries follow."""
    rows = np.flatnonzero(again)
    if s.barrier_mode:  # a barrier-mode replay completes at its batch's barrier
        rows = rows[~np.isin(sources[rows], np.fromiter(s.barrier_mode, np.uint32))]
    if len(rows):
        rows = rows[s.queue.entries_of(roots[rows]) == 1]
    if not len(rows):
        return roots
    s.changing()
    removed = s.acker.remove(roots[rows])
    fresh = s.new_roots(len(removed.roots))
    s.acker.add(fresh, None, **removed.columns)
    s.queue.renew(removed.roots, fresh)
    s.retired.add(removed.roots, s.clock())
    s.stats.taken_over += len(removed.roots)
    order = np.argsort(removed.roots)
    renewed = roots.copy()
    renewed[rows] = fresh[order][np.searchsorted(removed.roots[order], roots[rows])]
    return renewed


def _hold_replays(s: CoreState, records: RecordBatch) -> None:
    """Barrier-mode replays a batch takes in get their barrier holds (once, also when
    the range is fetched again, or a broadcast replay has several rows)."""
    for source_id, rows in s.barrier_mode_rows(records.source_ids) or []:
        roots = np.unique(records.roots[rows])
        fresh = roots[s.holds.new_roots(source_id, roots)]
        if len(fresh):
            s.changing()
            holds = new_ids(len(fresh))
            s.acker.xor(fresh, holds)  # 0 -> the hold: nothing completes
            if s.journal is not None:
                s.journal.xor(fresh, holds)
            s.add_holds(source_id, fresh, holds)


def prune_replay(s: CoreState, upto: int, source_id: int | None = None) -> int:
    """Forget queue entries with replay seq <= upto, of `source_id` or of every source:
    the batches that took them in are checkpointed and never run again. Returns how
    many entries were dropped. Their roots stay pending."""
    s.changing()
    if s.journal is not None:
        s.journal.prune(upto, source_id)
    return s.queue.prune(upto, source_id)
