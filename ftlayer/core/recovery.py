"""Recovery and state copies: what a restarted FT layer knows, and where that comes from.

Contract:

1. Every record found in storage at start was pending when the last process stopped,
   or is a dead letter (a record leaves storage only when its tree completed, or when
   a newer copy took it over).
2. With a journal (ftlayer.core.journal) that knows a record's root, the record is
   restored as it was: pending with its ack value and open holds, in the replay queue
   under its replay seq if no finished batch took it in, waiting for its backoff, or
   (its tree completed and the delete was still staged) deleted. A tree restored in
   flight is timed from the restart; if its source's batch was running at the stop
   (it left barrier holds), the tree belongs to that batch, reopened lapsed: it waits
   for the source's driver (its heartbeats) or next barrier, as the trees of a batch
   whose driver died do (ftlayer.core.leases).
3. Every other record is failed under a new root ("recovery": no attempt of the
   record's, so its retry count and due time stay): replayed at once, or when the
   backoff of its last failure ends. Dead letters stay as they are.
4. A re-read of a recovered record (a re-run of the last batch, a new query from the
   group offsets) takes over its root: the read marks are rebuilt from what is pending.
5. Failed records stored by reference whose bytes their source has not copied in are
   listed again (ftlayer.core.fills.rebuild), and bytes left behind by a record deleted
   just before a crash are dropped.
6. Failures of batch-range rows that were noted and not applied (ftlayer.core.failnotes)
   are applied from the journal; without a journal read whole, the open ranges' rows
   are failed.

`state_snapshot` copies the state a journal base holds (every pending root with its
ack value and record seq, the replay queue, retry counts, open holds, prune points):
O(pending) array copies and no storage access, so a caller that serializes the core
holds its lock only for the copy. A copy is the journal's base once the journal has
grown by as much as a base would hold (`journal_base_due`), or when asked
(`write_journal_base`: the journal outgrew its segment and no checkpoint wrote a base).
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from ftlayer.records import RecordBatch

from . import failnotes, rangeacks
from .failure import requeue
from .fills import rebuild as rebuild_unfilled
from .journal import JournalState
from .ranges import note_stored
from .retries import DEAD_LETTER
from .sinkholds import SINK_KEY_BIT
from .state import CoreState
from .statecodec import encode_snapshot
from .stats import FailCause

__all__ = [
    "JOURNAL_BASE_MIN_BYTES",
    "journal_base_due",
    "recover",
    "state_snapshot",
    "write_journal_base",
]

JOURNAL_BASE_MIN_BYTES: Final = 1 << 20
"""A checkpoint's state copy is the journal's base only once the journal has grown by
this much (or by a base's size, if larger): `journal_base_due`."""
_BASE_BYTES_PER_ROOT: Final = 24
_BASE_BYTES_PER_RANGE_RECORD: Final = 17

_Restored = list[tuple[RecordBatch, NDArray[np.uint64], NDArray[np.uint64], Any]]


def state_snapshot(s: CoreState, *, journal_base: bool | None = None) -> dict[str, NDArray[Any]]:
    """Copies of the state: every pending root with its ack value and the storage seq
    of its record ("acker.*"), the replay queue ("queue.*"), the retry counts
    ("retries.*"), the open holds ("holds.*"), the prune points and the replay counter;
    with `journal_base` (None: when due), also what makes it the journal's base."""
    # The Kafka coordinates are in the stored record (by seq): not copied again.
    state = {f"acker.{name}": column for name, column in s.acker.snapshot("seq").items()}
    state.update({f"queue.{name}": column for name, column in s.queue.columns().items()})
    if len(s.book):  # the retry counts of pending roots that failed before
        live = s.acker.live_columns("root", "seq", copy=False)
        failed = np.isin(live["seq"], np.array(s.book.seqs(), dtype=np.uint64))
        roots, seqs = live["root"][failed], live["seq"][failed].tolist()
        state["retries.root"] = roots.copy()
        state["retries.count"] = np.array(s.book.attempts(seqs), dtype=np.int64)
    else:
        state["retries.root"] = np.zeros(0, dtype=np.uint64)
        state["retries.count"] = np.zeros(0, dtype=np.int64)
    holds = s.holds.columns()
    state.update({f"holds.{name}": column for name, column in holds.items()})
    if rangeacks.has_tree_ranges(s):
        state.update(rangeacks.snapshot(s))
    points = s.queue.prune_points()
    state["pruned.source"] = np.array([-1 if p is None else p for p in points], dtype=np.int64)
    state["pruned.upto"] = np.array(list(points.values()), dtype=np.int64)
    state["replay.next_seq"] = np.array([s.queue.cursor + 1], dtype=np.uint64)
    if journal_base is None:
        journal_base = journal_base_due(s)
    if s.journal is not None and journal_base:  # the base of the segment begun now
        state["journal.segment"] = np.array([s.journal.rotate()], dtype=np.uint64)
        failnotes.journal_again(s)  # noted failures are events after it, not state
        # Records stored from here on are not in this state: a persist begun and not
        # ended may be storing some below the store's next seq (begin_persist).
        next_seq = min([s.storage.next_seq, *(t.floor for t in s.tickets)])
        state["journal.next_seq"] = np.array([next_seq], dtype=np.uint64)
        # Except those stored meanwhile by persists that ended: their fate is here.
        ended = np.concatenate(s.ended) if s.ended else np.zeros(0, np.uint64)
        ended = ended[ended >= np.uint64(next_seq)]
        s.ended = [ended] if len(ended) else []
        state["journal.ended_seqs"] = np.sort(ended)
    return state


def journal_base_due(s: CoreState) -> bool:
    """Whether a state copy should also be the journal's base: once the journal has
    grown by as much as a base would hold (24 bytes per pending root and 17 per record
    of an open tree-mode range, at least
    JOURNAL_BASE_MIN_BYTES), so a checkpoint per micro-batch does not write a base each
    time, and recovery reads at most about twice a base; or by `journal_base_bytes`
    when the FT layer was given it (`ftlayer serve --journal-base-bytes`); and at once
    after a failed journal write (a base starts it again)."""
    journal = s.journal
    if journal is None:
        return False
    due = s.journal_base_bytes
    if due is None:
        size = _BASE_BYTES_PER_ROOT * len(s.acker)
        if len(s.ranges):  # a tree-mode range's records: 17 bytes each
            size += _BASE_BYTES_PER_RANGE_RECORD * rangeacks.open_records(s)
        due = max(JOURNAL_BASE_MIN_BYTES, size)
    return journal.broken is not None or journal.segment_bytes >= due


def write_journal_base(s: CoreState) -> None:
    """Write the journal's base now (the state, O(pending)) and truncate it."""
    journal = s.journal
    if journal is None:
        return
    state = state_snapshot(s, journal_base=True)
    journal.write_base(int(state["journal.segment"][0]), bytes(encode_snapshot(state)))


def recover(s: CoreState) -> None:
    """Restore the state from storage and journal (the module docstring's contract)."""
    journal = None if s.journal is None else s.journal.recover()
    if journal is not None and rangeacks.has_tree_ranges(s):
        rangeacks.recover(s, journal)  # the open tree-mode ranges' ack values
    # Step 1: collect first (re-tagging writes to the storage being scanned).
    found = []
    stored_dead: set[int] = set()
    for seqs, batch, replay in s.storage.scan():
        note_stored(s, batch)  # records of an open batch range that became records
        dead = replay == DEAD_LETTER
        if bool(dead.any()):
            stored_dead.update(seqs[dead].tolist())
            keep = np.flatnonzero(~dead)
            seqs, batch, replay = seqs[keep], batch.take(keep), replay[keep]
        if len(seqs):
            found.append((batch, seqs, replay))
    if rangeacks.has_tree_ranges(s):
        rangeacks.close_finished(s)  # their last pending records were stored since
    stored = {int(q) for _, seqs, _ in found for q in seqs.tolist()} | stored_dead
    stale = [seq for seq in s.book.seqs() if seq not in stored]
    if stale:  # completed or purged, and the crash came before their record left
        s.book.forget(stale)
    # Step 2: what the journal knows is restored; step 3: the rest is failed.
    restored: _Restored = []
    gone: list[NDArray[np.uint64]] = []
    for batch, seqs, replay in found:
        if journal is None:
            requeue(s, batch.roots, seqs, FailCause.RECOVERY)
            continue
        known, acks = journal.known(batch.roots)
        done = journal.is_gone(batch.roots)
        known &= ~done
        earlier = ~(known | done) & journal.done_before_base(seqs)
        if bool(earlier.any()) and len(s.book):
            failed = np.isin(seqs, np.array(s.book.seqs(), dtype=np.uint64))
            earlier &= ~failed
        done |= earlier
        if bool(done.any()):
            gone.append(seqs[done])
        if bool(known.any()):
            rows = np.flatnonzero(known)
            restored.append((batch.take(rows), seqs[rows], replay[rows], acks[rows]))
        lost = ~(known | done)
        if bool(lost.any()):
            rows = np.flatnonzero(lost)
            requeue(s, batch.roots[rows], seqs[rows], FailCause.RECOVERY)
    if journal is not None:
        _restore(s, journal, restored, gone)
        _restore_holds(s, journal)
    # Step 4: a re-read of a recovered record takes over its root.
    if len(s.acker):
        live = s.acker.live_columns("topic", "partition", "offset", copy=False)
        s.marks.rebuild(live["topic"], live["partition"], live["offset"])
    # Step 5: failed records stored by reference whose bytes are still wanted.
    s.storage.drop_stale_fills()
    rebuild_unfilled(s)
    # Step 6: failures of batch-range rows noted and not applied before the stop.
    failnotes.recover(s, journal)


def _restore_holds(s: CoreState, journal: JournalState) -> None:
    """The open holds of roots still pending (restored ones, or records pending in
    tree-mode ranges): a barrier's are released at their batch's barrier; a sink's
    acks, at its settle (or they go stale)."""
    ranged = rangeacks.has_tree_ranges(s)
    for source_id, (hold_roots, values) in journal.holds.items():
        pending = s.acker.lookup("seq", hold_roots)[0]
        if ranged:
            pending |= rangeacks.pending(s, hold_roots)
        if bool(pending.any()):
            s.holds.add(source_id, hold_roots[pending], values[pending])
            if source_id & SINK_KEY_BIT:  # a sink's acks: it settles them, or they go stale
                s.sink_keys.opened(source_id, s.clock())


def _restore(
    s: CoreState, journal: JournalState, restored: _Restored, gone: list[NDArray[np.uint64]]
) -> None:
    """Recovery from the journal: the records it knows, as they were."""
    if gone:
        done = np.concatenate(gone)
        s.book.forget(done.tolist())
        s.storage.delete(done)
        s.stats.recovered_completed += len(done)
    if not restored:
        return
    batch = RecordBatch.concat([b for b, _, _, _ in restored])
    seqs = np.concatenate([q for _, q, _, _ in restored])
    replay = np.concatenate([r for _, _, r, _ in restored])
    acks = np.concatenate([a for _, _, _, a in restored]).astype(np.uint64)
    roots = batch.roots
    s.acker.add(roots, acks, seq=seqs, **s.persistence.locators(batch))
    s.stats.recovered_pending += len(roots)
    s.queue.restore_prune_points(journal.pruned)
    # The replay queue: the base's entries whose roots are still pending under the
    # same record, and the records queued since the base (replay seq at or past the
    # base's next one), routed again; minus what prunes since then dropped.
    queued = np.zeros(len(roots), dtype=np.bool_)
    base = journal.queue
    next_seq = int(base["next_seq"][0]) if "next_seq" in base else 1
    if len(base.get("replay_seq", ())):
        rseq, broots, bseqs = base["replay_seq"], base["root"], base["seq"]
        live = s.live_with_seqs(broots, bseqs)
        sources, parts = base["source_id"], base["partition"]
        live &= rseq > s.queue.prune_point_array(sources)
        if bool(live.any()):
            s.queue.append(
                rseq[live],
                broots[live],
                bseqs[live],
                sources[live].astype(np.uint32),
                parts[live].astype(np.int32),
                restored=True,
            )
        queued |= np.isin(roots, broots[live])
    newer = (replay >= next_seq) & (replay > 0) & (replay != DEAD_LETTER)
    newer &= replay > s.queue.prune_point_array(batch.source_ids)
    newer &= ~queued
    if bool(newer.any()):
        rows = np.flatnonzero(newer)
        sub = batch.take(rows)
        index, partitions = s.route(sub)
        s.queue.append(
            replay[rows][index],
            roots[rows][index],
            seqs[rows][index],
            sub.source_ids[index],
            partitions,
        )
        queued[rows] = True
    # Waiting for their backoff: no replay seq yet, a retry record with a due time.
    # Failed with their key unknown: waiting for their source to copy their bytes in.
    waiting = np.zeros(len(roots), dtype=np.bool_)
    if len(s.book):
        unknown = batch.key_unknown
        for row in np.flatnonzero((replay == 0) & ~queued).tolist():
            record = s.book.get(int(seqs[row]))
            if record is None or record.dead_at is not None:
                continue
            if unknown[row]:
                s.unrouted[int(seqs[row])] = (int(roots[row]), record.due)
                waiting[row] = True
            elif record.due > 0:
                s.book.wait(int(seqs[row]), int(roots[row]), record.due)
                waiting[row] = True
    # The rest are in flight: timed from now, in a batch of their source's that is
    # lapsed at once if a batch of it was running at the stop (it left barrier holds of
    # pending roots): they wait for its driver or its next barrier (ftlayer.core.leases).
    running = [
        source_id
        for source_id, (hold_roots, _) in journal.holds.items()
        if not source_id & SINK_KEY_BIT and bool(s.acker.lookup("seq", hold_roots)[0].any())
    ]
    s.leases.recovered(running, s.clock())
    timed = ~(queued | waiting)
    if bool(timed.any()):
        rows = np.flatnonzero(timed)
        s.track(roots[rows], seqs[rows], batch.source_ids[rows])
