"""Persist and takeover: a source record becomes a pending root, and re-reads take over.

Contract (FTLayer.persist, begin_persist, end_persist, abort_persist):

1. A record is persisted before its source emits it. `persist` is one call; a caller
   that serializes the core with a lock runs three steps instead: `begin_persist`
   (under the lock: check the batch, reserve its roots), the storage write (outside
   it: `write_persist`, thread-safe), `end_persist` or `abort_persist` (under the lock
   again). Between the steps the persist is invisible: its roots are not pending,
   only reserved against a second persist of them.
2. Refused, with nothing stored: a reserved root (0 or 1), a root repeated in the
   batch, pending, being persisted or retired within the TTL (late events of the old
   tree would corrupt the new one), or a record its source's replay partitioner could
   not route.
3. When the roots become pending: their first ack values (the source's emission ids,
   plus a barrier hold for barrier-mode sources) and locators enter the acker, their
   timeouts start (tagged with their source's open batch), the journal learns them,
   a tree-mode re-read takes over the earlier roots of the same records, and
   barrier-mode roots get their holds.
4. A failed write leaves nothing; a crash after the write and before `end_persist`
   replays the stored records: a journal base never counts records of a persist under
   way as stored before it (`PersistTicket.floor`, `CoreState.ended`).

Takeover (the module docstring of ftlayer.core.takeover says why): a tree-mode persist
of records already pending at the same coordinates with the same stored bytes retires
the old roots (`superseded`, `take_over`); in barrier mode the takeover happens at the
timeout instead (`covered_at_timeout`, asked by ftlayer.core.failure).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ftlayer.acking.ids import new_ids
from ftlayer.acking.u64map import U64Map
from ftlayer.errors import ConfigError, StateConflict
from ftlayer.records import RecordBatch

from .retries import RetryRecord
from .state import CoreState, PersistTicket, sources_of
from .takeover import chunk_groups, pending_at

__all__ = [
    "abort_persist",
    "begin_persist",
    "check_new_roots",
    "covered_at_timeout",
    "end_persist",
    "pend_while_storing",
    "persist",
    "retire_covered",
    "stored_meanwhile",
    "write_persist",
]

_Held = list[tuple[int, NDArray[np.intp]]] | None


def persist(
    s: CoreState,
    batch: RecordBatch,
    initial_values: ArrayLike | None = None,
    *,
    counted: bool = True,
) -> None:
    """Persist source records before their source emits them, in one call (the storage
    write under the caller's lock, if it has one). `counted=False`: records counted
    persisted before (of a batch range, ftlayer.core.ranges)."""
    s.changing()
    values = _checked(s, batch, initial_values)
    if s.tickets:
        _check_not_persisting(s, batch.roots)
    # Step 1: the barrier holds, the locators, and a re-read's takeover.
    values, held, locators, superseded = _to_pend(s, batch, values)
    # Steps 2-3: the acker validates the roots (reserved, repeated, already pending),
    # the storage confirms the records are durable (and nothing is taken over on an
    # error: the old roots still cover their records).
    seqs = pend_while_storing(s, batch, values, locators, lambda: s.persistence.persist(batch))
    # Step 4: timeouts, journal, takeover, holds.
    _pended(s, batch, values, seqs, held, locators, superseded, counted=counted)


def begin_persist(
    s: CoreState, batch: RecordBatch, initial_values: ArrayLike | None = None
) -> PersistTicket:
    """Step 1 of 3: check the batch and reserve its roots, changing nothing else."""
    values = _checked(s, batch, initial_values)
    # The reservation refuses what the acker would (a reserved root, one repeated in
    # the batch) and roots being persisted; then no root may be pending either.
    if not s.tickets:
        s.persisting = U64Map({}, len(batch), key_name="root")
    s.persisting.insert(batch.roots)
    pending = s.acker.lookup("ack", batch.roots)[0]
    if bool(pending.any()):
        _unreserve(s, batch.roots)
        root = int(batch.roots[int(np.argmax(pending))])
        raise StateConflict(f"root {root:#x} is already present")
    ticket = PersistTicket(batch, values, s.storage.next_seq)
    s.tickets.add(ticket)
    return ticket


def write_persist(s: CoreState, ticket: PersistTicket) -> NDArray[np.uint64]:
    """Step 2 of 3: store the ticket's records (no lock of the core needed: the storage
    is thread-safe, and every seq it gives is at least `ticket.floor`)."""
    return s.storage.put(ticket.batch)


def abort_persist(s: CoreState, ticket: PersistTicket) -> None:
    """The storage write of a begun persist failed: its roots are free again."""
    if ticket in s.tickets:
        _end_ticket(s, ticket)


def end_persist(s: CoreState, ticket: PersistTicket, seqs: NDArray[np.uint64]) -> None:
    """Step 3 of 3: the records are stored under `seqs`; the roots become pending."""
    s.changing()
    _end_ticket(s, ticket)
    batch = ticket.batch
    try:
        values, held, locators, superseded = _to_pend(s, batch, ticket.initial_values)
        s.acker.add(batch.roots, values, seq=seqs, **locators)
    except BaseException:
        # A storage read failed, or (paranoid check) a root was drawn twice: none of
        # the roots is pending, and nobody was told the records are persisted, so
        # they leave the store again.
        s.persistence.discard(seqs)
        raise
    _pended(s, batch, values, seqs, held, locators, superseded)


def pend_while_storing(
    s: CoreState,
    batch: RecordBatch,
    values: NDArray[np.uint64] | None,
    locators: dict[str, NDArray[Any]],
    store: Callable[[], NDArray[np.uint64]],
) -> NDArray[np.uint64]:
    """Add the batch's roots to the acker (which refuses reserved, repeated and pending
    roots), then store the records with `store()`; on any error the roots leave the
    acker again and the error propagates: nothing is half-persisted. Returns the seqs,
    set in the acker."""
    rows = s.acker.add(batch.roots, values, **locators)
    try:
        seqs = store()
    except BaseException:
        s.acker.remove(batch.roots)
        raise
    s.acker.set_column("seq", rows, seqs)
    return seqs


def check_new_roots(s: CoreState, batch: RecordBatch) -> None:
    """The checks of a batch stored under roots of its own (not via persist): routable,
    none retired recently, none being persisted."""
    _check_routable(s, batch)
    if len(s.retired):
        _check_not_retired(s, batch.roots)
    if s.tickets:
        _check_not_persisting(s, batch.roots)


def stored_meanwhile(s: CoreState, seqs: NDArray[np.uint64]) -> None:
    """Records stored and pending while a persist is under way: a journal base taken
    before that persist ends must not take them for records of it (replayed by a
    recovery) when they complete before the base."""
    if s.tickets and len(seqs):
        s.ended.append(seqs)


def _checked(
    s: CoreState, batch: RecordBatch, initial_values: ArrayLike | None
) -> NDArray[np.uint64] | None:
    """A persist's checks before its roots: routable, none failed recently; the first
    ack values as an array of one per root."""
    _check_routable(s, batch)
    if len(s.retired):
        _check_not_retired(s, batch.roots)
    values = None if initial_values is None else np.asarray(initial_values, dtype=np.uint64)
    if values is not None and values.shape != batch.roots.shape:
        raise ConfigError(f"{len(batch)} roots but {values.shape} initial ack values")
    return values


def _end_ticket(s: CoreState, ticket: PersistTicket) -> None:
    """`ticket`'s persist is over (ended or aborted): its roots are free, and with no
    persist under way no seq needs remembering for a journal base."""
    s.tickets.remove(ticket)
    _unreserve(s, ticket.batch.roots)
    if not s.tickets:
        s.ended.clear()


def _unreserve(s: CoreState, roots: NDArray[np.uint64]) -> None:
    """The reserved `roots` of one persist (distinct, every one reserved) are free;
    with no persist under way, every root is (the next begin makes a new map)."""
    if s.tickets:
        keys = np.ascontiguousarray(roots, dtype=np.uint64)
        s.persisting.delete(s.persisting.find_slots(keys)[0])


def _to_pend(
    s: CoreState, batch: RecordBatch, values: NDArray[np.uint64] | None
) -> tuple[NDArray[np.uint64] | None, _Held, dict[str, NDArray[Any]], NDArray[np.uint64] | None]:
    """What the roots of a persist need to become pending: their first ack values with
    the barrier holds of barrier-mode rows (and those rows), the locators, and the
    pending roots a re-read takes over."""
    held = s.barrier_mode_rows(batch.source_ids) if s.barrier_mode else None
    if held is not None:
        zeros = np.zeros(len(batch), np.uint64) if values is None else None
        values = _with_holds(values, held, zeros)
    locators = s.persistence.locators(batch)
    return values, held, locators, _superseded(s, locators, batch.payloads)


def _pended(
    s: CoreState,
    batch: RecordBatch,
    values: NDArray[np.uint64] | None,
    seqs: NDArray[np.uint64],
    held: _Held,
    locators: dict[str, NDArray[Any]],
    superseded: NDArray[np.uint64] | None,
    *,
    counted: bool = True,
) -> None:
    """The roots of a persist are pending (in the acker, with their seqs): their
    timeouts start, the journal learns them, the re-read roots retire, and the
    barrier-mode roots get their holds."""
    s.track(batch.roots, seqs, batch.source_ids)
    stored_meanwhile(s, seqs)
    if counted:
        s.stats.persisted += len(batch)
    journal = s.journal
    if journal is not None:
        if values is None:
            journal.add(batch.roots)
        else:
            journal.xor(batch.roots, values)
    if len(seqs) and counted:
        s.meters.persisted(batch.source_ids, int(seqs[0]), s.clock())
    if superseded is not None:
        _take_over(s, superseded, {**locators, "seq": seqs})
    if held is not None:
        assert values is not None
        for source_id, rows in held:
            s.add_holds(source_id, batch.roots[rows], values[rows])


def _check_not_retired(s: CoreState, roots: NDArray[np.uint64]) -> None:
    retired = s.retired.known(roots, s.clock())
    if bool(retired.any()):
        root = int(roots[int(np.argmax(retired))])
        raise StateConflict(
            f"repeated root {root:#x}: it failed recently and late events of its old "
            f"tree could still arrive ({int(retired.sum())} such roots in the batch); "
            "persist every record under a fresh random root"
        )


def _check_not_persisting(s: CoreState, roots: NDArray[np.uint64]) -> None:
    persisting = s.persisting.find(np.ascontiguousarray(roots, dtype=np.uint64)) >= 0
    if bool(persisting.any()):
        root = int(roots[int(np.argmax(persisting))])
        raise StateConflict(f"root {root:#x} is already present")


def _check_routable(s: CoreState, batch: RecordBatch) -> None:
    if batch.any_references:  # a key not known yet is checked when it is (fills)
        known = ~batch.key_unknown
        if not bool(known.all()):
            batch = batch.take(np.flatnonzero(known))
    for source_id in sources_of(batch):
        config = s.source_config(source_id)
        if config is not None:
            rows = batch.source_ids == source_id
            sub = batch if bool(rows.all()) else batch.take(rows)
            config.partitioner.check_routable(sub, config.num_partitions)


# ---- re-reads take over (ftlayer.core.takeover) ---------------------------------------


def _superseded(
    s: CoreState, locators: Mapping[str, NDArray[Any]], payloads: Sequence[bytes]
) -> NDArray[np.uint64] | None:
    """The pending roots of the same records as a chunk about to be persisted (same
    coordinates and the same stored bytes), if the chunk is a re-read of a tree-mode
    source (None: it is not, the usual case, found in O(partitions)); raises the read
    marks."""
    groups = chunk_groups(locators["topic"], locators["partition"], locators["offset"])
    rereads = s.marks.read(groups)
    if rereads and s.barrier_mode:  # a row may be computed twice there: no takeover
        sources = s.persistence.number_sources()
        rereads = [g for g in rereads if int(sources[g.topic]) not in s.barrier_mode]
    if not rereads or not len(s.acker):
        return None
    live = s.acker.live_columns("root", "seq", "topic", "partition", "offset", copy=False)
    rows = np.flatnonzero(pending_at(live, rereads))
    if not len(rows):
        return None
    row_at = _rows_by_coordinates(locators)
    at = [
        row_at[c]
        for c in zip(
            live["topic"][rows].tolist(),
            live["partition"][rows].tolist(),
            live["offset"][rows].tolist(),
            strict=True,
        )
    ]
    same = _same_bytes(s.storage.get(live["seq"][rows]).payloads, [payloads[i] for i in at])
    return live["root"][rows[same]].copy() if bool(same.any()) else None


def _take_over(
    s: CoreState, old_roots: NDArray[np.uint64], successors: Mapping[str, NDArray[Any]]
) -> None:
    """Retire pending roots whose records a newer copy covers: out of the acker, no
    replay and no completion; their retry records move to the newer copies
    (`successors`: their "topic", "partition", "offset" and storage "seq", ascending
    by seq); their stored copies are deleted (in the transaction of those moves)."""
    removed = s.acker.remove(old_roots)
    if not len(removed.roots):
        return
    cols = removed.columns
    if len(s.book):
        _carry_retries(s, cols, successors)
    s.persistence.complete(removed.roots, cols)  # not counted as completed: still pending
    if s.journal is not None:  # their stored copies go: gone, not to restore
        s.journal.gone(removed.roots)
    s.retired.add(removed.roots, s.clock())
    s.stats.taken_over += len(removed.roots)


def _carry_retries(
    s: CoreState, cols: Mapping[str, NDArray[Any]], successors: Mapping[str, NDArray[Any]]
) -> None:
    """The retry records of taken-over copies go to the newest copies at the same
    coordinates (staged: durable with the deletion of the old copies)."""
    old = [
        (seq, record, (int(t), int(p), int(o)))
        for seq, t, p, o in zip(
            cols["seq"].tolist(),
            cols["topic"].tolist(),
            cols["partition"].tolist(),
            cols["offset"].tolist(),
            strict=True,
        )
        if (record := s.book.get(seq)) is not None
    ]
    if not old:
        return
    newest = {  # ascending seqs: the last copy at a coordinate wins
        (int(t), int(p), int(o)): int(seq)
        for t, p, o, seq in zip(
            successors["topic"].tolist(),
            successors["partition"].tolist(),
            successors["offset"].tolist(),
            successors["seq"].tolist(),
            strict=True,
        )
    }
    carried: dict[int, RetryRecord] = {}
    for _seq, record, at in old:
        seq = newest[at]
        if seq not in carried or carried[seq].attempts < record.attempts:
            carried[seq] = dataclasses.replace(record.copy(), due=0.0)
    s.book.stage(carried)
    s.book.commit(carried)
    s.book.forget([seq for seq, _, _ in old])


def retire_covered(s: CoreState, roots: NDArray[np.uint64]) -> None:
    """Take over `roots` by the newest pending copies of their records."""
    _, offsets = s.acker.lookup("offset", roots)
    live = s.acker.live_columns("topic", "partition", "offset", "seq", copy=False)
    near = np.flatnonzero(np.isin(live["offset"], offsets))
    near = near[np.argsort(live["seq"][near], kind="stable")]
    _take_over(s, roots, {name: column[near] for name, column in live.items()})


def covered_at_timeout(
    s: CoreState, roots: NDArray[np.uint64], seqs: NDArray[np.uint64]
) -> NDArray[np.bool_]:
    """Which timed-out roots of barrier-mode sources a newer copy of their record (same
    coordinates, a later storage seq) still pending covers: a dead attempt's roots
    whose retry read the records again (barrier mode takes nothing over at persist).
    They retire instead of being replayed."""
    covered = np.zeros(len(roots), dtype=np.bool_)
    _, topics = s.acker.lookup("topic", roots)
    sources = s.persistence.number_sources()[topics.astype(np.intp)]
    rows = np.flatnonzero(np.isin(sources, np.fromiter(s.barrier_mode, np.uint32)))
    if not len(rows):
        return covered
    _, partitions = s.acker.lookup("partition", roots[rows])
    _, offsets = s.acker.lookup("offset", roots[rows])
    keep = offsets >= 0
    rows, partitions, offsets = rows[keep], partitions[keep], offsets[keep]
    if not len(rows):
        return covered
    live = s.acker.live_columns("topic", "partition", "offset", "seq", copy=False)
    near = np.flatnonzero(np.isin(live["offset"], offsets))
    newest: dict[tuple[int, int, int], int] = {}
    for t, p, o, seq in zip(
        live["topic"][near].tolist(),
        live["partition"][near].tolist(),
        live["offset"][near].tolist(),
        live["seq"][near].tolist(),
        strict=True,
    ):
        newest[(t, p, o)] = max(seq, newest.get((t, p, o), 0))
    older: list[int] = []
    newer: list[int] = []
    for row, t, p, o in zip(
        rows.tolist(), topics[rows].tolist(), partitions.tolist(), offsets.tolist(), strict=True
    ):
        seq = newest.get((t, p, o), 0)
        if seq > int(seqs[row]):
            older.append(row)
            newer.append(seq)
    if older:  # the same record, not another one at reused coordinates
        old = s.storage.get(seqs[older]).payloads
        new = s.storage.get(np.array(newer, dtype=np.uint64)).payloads
        covered[older] = _same_bytes(old, new)
    return covered


def _rows_by_coordinates(locators: Mapping[str, NDArray[Any]]) -> dict[tuple[int, int, int], int]:
    """{(topic number, partition, offset): row} of a batch's locators."""
    return {
        c: i
        for i, c in enumerate(
            zip(
                locators["topic"].tolist(),
                locators["partition"].tolist(),
                locators["offset"].tolist(),
                strict=True,
            )
        )
    }


def _same_bytes(a: Sequence[bytes], b: Sequence[bytes]) -> NDArray[np.bool_]:
    """Which pairs of stored payloads are equal: the same source record read twice (a
    recreated topic, or a new cluster after a savepoint restore, reuses offsets for
    other records)."""
    return np.fromiter((x == y for x, y in zip(a, b, strict=True)), np.bool_, len(a))


def _with_holds(
    initial: ArrayLike | None,
    held: list[tuple[int, NDArray[np.intp]]],
    zeros: NDArray[np.uint64] | None,
) -> NDArray[np.uint64]:
    """First ack values in which every barrier-mode row holds a non-zero value: the
    emission ids the source gave (the usual case), or fresh ids where it gave none."""
    values = zeros if zeros is not None else np.array(initial, dtype=np.uint64, copy=True)
    for _source, rows in held:
        missing = rows[values[rows] == 0]
        if len(missing):
            values[missing] = new_ids(len(missing))
    return values
