"""Records stored by reference: the failed ones whose bytes the FT layer does not hold.

A source that can replay by offset (Kafka) persists its records by reference
(`ft.persist=reference`): the FT layer stores where each record is, not its bytes
(`RecordBatch.references`). A record that completes never needs its bytes. One that
fails does: its retries, its dead letter and `ftlayer inspect` must not depend on the
source's retention. So a failed record stored by reference is *unfilled* until its
source copies its bytes in:

- `note_failed` (from every failure path, through requeue) lists the failed records
  still stored by reference;
- the source asks for its unfilled records (`unfilled`: the ftkafka driver's filler
  thread, behind every trigger that finds some), reads each at its coordinates and
  hands the bytes back (`fill`), with each record's key hash: stored in one
  transaction before the reply (`PersistenceStorage.fill`), and from then on every
  read of the record (a replay, a dead letter, inspect) has them. A record of a
  batch range, whose key the FT layer did not know, waits *unrouted* until then: its
  key picks its replay partition;
- a record the source no longer has (retention, compaction, a deleted topic) is
  *expired*: a pending one (queued, waiting for its backoff, or replaying) fails with
  the final cause `source-expired` and becomes a dead letter; a dead letter gets that
  cause added to its history. Either way it is no longer unfilled, is counted
  (`failed["source-expired"]`, per source too), and is never skipped silently.

A queued replay its source fetches before it was filled is read at its coordinates by
the reader that fetched it (or failed `source-expired` there).

The list is in memory only: `rebuild` makes it again at start from the failed records
in storage (queued, waiting and dead-lettered records still stored by reference),
leaving out the dead letters whose last cause is source-expired. A seq that left
storage since it was listed (completed, purged) is dropped when `unfilled` meets it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from ftlayer.causes import Cause, Causes, FailKind
from ftlayer.persistence.base import RecordNotStored
from ftlayer.records import RecordBatch

from .faillog import log_requeue_error
from .state import CoreState
from .stats import FailCause

__all__ = [
    "FillResult",
    "UnfilledRecords",
    "fill",
    "note_failed",
    "rebuild",
    "requires_key",
    "unfilled",
]

Requeue = Callable[[CoreState, NDArray[np.uint64], NDArray[np.uint64], FailCause, Causes], None]
Enqueue = Callable[[CoreState, NDArray[np.uint64], NDArray[np.uint64], RecordBatch], None]

SOURCE_EXPIRED: Final = Cause(
    FailKind.SOURCE_EXPIRED, error="the source no longer has the record", final=True
)


class UnfilledRecords:
    """Failed records of one source stored by reference: their storage seqs and the
    stored records (coordinates, key hashes; payloads empty)."""

    __slots__ = ("records", "seqs")

    def __init__(self, seqs: NDArray[np.uint64], records: RecordBatch) -> None:
        self.seqs = seqs
        self.records = records

    def __len__(self) -> int:
        return len(self.seqs)


class FillResult:
    """What a `fill` did: records whose bytes it stored, and records found expired."""

    __slots__ = ("expired", "filled")

    def __init__(self, filled: int, expired: int) -> None:
        self.filled = filled
        self.expired = expired

    def as_dict(self) -> dict[str, int]:
        return {"filled": self.filled, "expired": self.expired}


def note_failed(
    s: CoreState, seqs: NDArray[np.uint64], batch: RecordBatch, dead: NDArray[np.bool_]
) -> None:
    """Records that just failed (`batch`, stored under `seqs`): those stored by
    reference are unfilled, except dead letters that expired in their source."""
    if not batch.any_references:
        return
    rows = np.flatnonzero(batch.reference_mask)
    unknown = batch.key_unknown
    for row, seq, source_id in zip(
        rows.tolist(), seqs[rows].tolist(), batch.source_ids[rows].tolist(), strict=True
    ):
        if dead[row] and _expired_dead_letter(s, seq):
            s.unfilled.discard(seq)
        else:
            s.unfilled.add(seq, int(source_id), bool(unknown[row]))


def unfilled(s: CoreState, source_id: int, limit: int) -> UnfilledRecords:
    """Up to `limit` unfilled records of `source_id`, oldest first."""
    listed = s.unfilled.of_source(source_id)[: max(0, limit)]
    seqs = np.array(listed, dtype=np.uint64)
    if not len(seqs):
        return UnfilledRecords(seqs, RecordBatch.empty())
    # A failure's records as it stored them, while all still wait under its roots (one
    # that left the store since is met, and dropped, by the read below).
    kept = _kept(s, seqs, listed)
    if kept is not None:
        return UnfilledRecords(seqs, kept)
    try:
        records = s.storage.get(seqs)
    except RecordNotStored as exc:  # completed or purged since
        s.unfilled.discard_many(np.intersect1d(seqs, exc.missing).tolist())
        seqs = seqs[~np.isin(seqs, exc.missing)]
        records = s.storage.get(seqs)
    still = records.reference_mask
    s.unfilled.discard_many(seqs[~still].tolist())  # filled meanwhile
    if not bool(still.all()):
        seqs, records = seqs[still], records.take(np.flatnonzero(still))
    return UnfilledRecords(seqs, records)


def fill(
    s: CoreState,
    seqs: NDArray[np.uint64],
    payloads: Sequence[bytes],
    found: NDArray[np.bool_],
    requeue: Requeue,
    enqueue: Enqueue,
    keys: tuple[NDArray[np.int64], NDArray[np.bool_]] | None = None,
) -> FillResult:
    """The source read records stored by reference (`seqs`): `found` ones with these
    `payloads` (stored now), the others expired in the source (see the module
    docstring); `requeue` is ftlayer.core.failure's, which fails the pending ones.
    Seqs not stored, or not unfilled, are left alone. `enqueue` (failure's) queues
    the filled records that waited for their key and are due."""
    if keys is not None:
        found = _without_needed_keys(s, seqs, found, keys, requeue)
    rows = np.flatnonzero(found)
    filled = 0
    if len(rows):
        every = len(rows) == len(seqs)  # the usual answer: all found, in one buffer
        found_keys = keys if keys is None or every else (keys[0][rows], keys[1][rows])
        fill_seqs = seqs if every else seqs[rows]
        listed = fill_seqs.tolist()
        # The bytes are staged: the retag of the records routed now commits them (one
        # transaction for both), or the flush below when none is routed.
        done, records = s.storage.fill_records(
            fill_seqs,
            payloads if every else [payloads[i] for i in rows.tolist()],
            found_keys,
            staged=True,
            stored=_kept(s, fill_seqs, listed),
        )
        filled = len(done)
        s.stats.filled += filled
        s.unfilled.discard_many(listed)
        try:
            _route_filled(s, done, records, enqueue)
        finally:
            s.storage.flush_staged()
    gone = seqs[~found]
    gone = gone[s.storage.contains(gone)] if len(gone) else gone
    if not len(gone):
        return FillResult(filled, 0)
    s.changing()
    # Pending ones (queued, waiting or replaying) fail, final: dead letters.
    live = s.acker.live_columns("root", "seq", copy=False)
    pending = np.isin(live["seq"], gone)
    roots, pending_seqs = live["root"][pending], live["seq"][pending]
    if len(roots):
        requeue(s, roots, pending_seqs, FailCause.SOURCE_EXPIRED, _expired(len(roots)))
    # Dead letters already: the cause goes into their history.
    now = s.wall()
    changed = {}
    for seq in np.setdiff1d(gone, pending_seqs).tolist():
        record = s.book.dead.get(seq)
        if record is not None and not _expired_dead_letter(s, seq):
            record = record.copy()
            record.add_failure(now, SOURCE_EXPIRED)
            record.dead_at = now
            changed[seq] = record
    if changed:
        old = s.book.stage(changed)
        try:
            s.storage.flush_staged()
        except BaseException:
            s.book.unstage(old)
            raise
        s.book.commit(changed)
        s.stats.failed[FailCause.SOURCE_EXPIRED.value] += len(changed)
        s.meters.failed(
            FailCause.SOURCE_EXPIRED.value,
            np.array([r.source_id for r in changed.values()], dtype=np.uint32),
        )
    gone_list = gone.tolist()
    s.unfilled.discard_many(gone_list)
    for seq in gone_list:
        s.unrouted.pop(seq, None)
    return FillResult(filled, len(roots) + len(changed))


def _kept(s: CoreState, seqs: NDArray[np.uint64], listed: list[int]) -> RecordBatch | None:
    """The records of `seqs` as their failure stored them, while every one is kept and
    still waits under that failure's root (so stored exactly so); else None."""
    kept = s.unfilled.kept(listed)
    if kept is None or not bool(s.live_with_seqs(kept.roots, seqs).all()):
        return None
    return kept


_WAITING: Final = np.dtype([("root", np.uint64), ("due", np.float64)])


def _keep_waiting(
    s: CoreState, seq_list: list[int], records: RecordBatch, rows: NDArray[np.intp]
) -> None:
    """Filled records (`rows` of `records`) still waiting for their backoff: kept as
    stored, for the ticker to queue without a read (failure.release_due)."""
    seqs = [seq_list[i] for i in rows.tolist()]
    waiting = np.fromiter(map(s.book.is_waiting, seqs), np.bool_, len(seqs))
    if bool(waiting.any()):
        chosen = rows[waiting]
        s.waiting_records.keep([seq_list[i] for i in chosen.tolist()], records.take(chosen))


def _route_filled(
    s: CoreState, seqs: NDArray[np.uint64], records: RecordBatch, enqueue: Enqueue
) -> None:
    """Filled records that waited for their key (unrouted): queued now if due, else
    they wait for their backoff. The records are those the fill stored, so routing
    them reads nothing."""
    now = s.wall()
    seq_list = seqs.tolist()
    # Their keys known now, they can be routed: out of the unrouted list, all at once.
    popped = list(map(s.unrouted.pop, seq_list, repeat(None, len(seq_list))))
    at = np.arange(len(popped), dtype=np.intp)
    if None in popped:  # some were not waiting for their key
        unrouted = np.array([w is not None for w in popped], dtype=np.bool_)
        at = np.flatnonzero(unrouted)
        _keep_waiting(s, seq_list, records, np.flatnonzero(~unrouted))
    waits = [w for w in popped if w is not None]
    if not waits:
        return
    waiting = np.array(waits, dtype=_WAITING)
    later = waiting["due"] > now
    if bool(later.any()):  # their backoff not over yet: they wait for it
        for row in np.flatnonzero(later).tolist():
            root, due = waits[row]
            s.book.wait(seq_list[int(at[row])], root, due)
        at, waiting = at[~later], waiting[~later]
        if not len(at):
            return
    root_array = np.ascontiguousarray(waiting["root"])
    live = s.live_with_seqs(root_array, seqs[at])  # not completed or purged since
    if not bool(live.all()):
        at, root_array = at[live], root_array[live]
        if not len(at):
            return
    routed = seqs[at]
    if len(at) > 1 and not bool((routed[1:] > routed[:-1]).all()):
        order = np.argsort(routed, kind="stable")  # replayed in the order they were stored
        at, root_array, routed = at[order], root_array[order], routed[order]
    s.changing()
    try:
        enqueue(s, root_array, routed, records if len(at) == len(records) else records.take(at))
    except BaseException as exc:
        log_requeue_error("bytes filled in", root_array, seqs[at], exc)
        for seq, root in zip(seqs[at].tolist(), root_array.tolist(), strict=True):
            s.book.wait(seq, root, now + 1.0)  # routed now: try again shortly
        raise


def _without_needed_keys(
    s: CoreState,
    seqs: NDArray[np.uint64],
    found: NDArray[np.bool_],
    keys: tuple[NDArray[np.int64], NDArray[np.bool_]],
    requeue: Requeue,
) -> NDArray[np.bool_]:
    """Records whose key was unknown, turns out absent, and is needed by their source's
    replay partitioner fail, final (they could never be replayed), and leave the
    unrouted list; their bytes are stored all the same (`found` is returned)."""
    keyless = found & ~keys[1]
    if not bool(keyless.any()):
        return found
    candidates = seqs[keyless]
    # Only a source whose partitioner needs a key makes a keyless record fail: the
    # others' are routed as they are, without reading them.
    needing: dict[int | None, bool] = {None: False}
    sources = [s.unfilled.source_of(seq) for seq in candidates.tolist()]
    for source_id in set(sources) - set(needing):
        needing[source_id] = source_id is not None and requires_key(s, source_id)
    candidates = candidates[np.array([needing[x] for x in sources], dtype=np.bool_)]
    if not len(candidates):
        return found
    candidates = candidates[s.storage.contains(candidates)]
    if not len(candidates):
        return found
    records = s.storage.get(candidates)
    needs = np.array(
        [
            bool(unknown) and requires_key(s, int(source))
            for unknown, source in zip(records.key_unknown, records.source_ids, strict=True)
        ],
        dtype=np.bool_,
    )
    if not bool(needs.any()):
        return found
    doomed = candidates[needs]
    live = s.acker.live_columns("root", "seq", copy=False)
    pending = np.isin(live["seq"], doomed)
    if bool(pending.any()):
        cause = Cause(
            FailKind.ERROR,
            "ftlayer",
            "PartitioningError: the record has no key and its source's replay "
            "partitioner replays by key",
            final=True,
        )
        requeue(
            s,
            live["root"][pending],
            live["seq"][pending],
            FailCause.EXPLICIT,
            Causes.one(cause, int(pending.sum())),
        )
    for seq in doomed.tolist():
        s.unrouted.pop(seq, None)
    return found  # their bytes are still stored: the dead letters keep them


def requires_key(s: CoreState, source_id: int) -> bool:
    """Whether `source_id`'s replay partitioner routes by key."""
    config = s.source_config(source_id)
    return config is not None and config.partitioner.requires_key


def rebuild(s: CoreState) -> None:
    """The unfilled list at start: failed records (queued, waiting, dead letters) still
    stored by reference, but dead letters that expired in their source."""
    queued = s.queue.columns()["seq"] if len(s.queue) else np.zeros(0, np.uint64)
    candidates = np.union1d(
        np.asarray(queued, dtype=np.uint64),
        np.fromiter(s.book.seqs(), dtype=np.uint64, count=len(s.book)),
    )
    if not len(candidates):
        return
    candidates = candidates[s.storage.contains(candidates)]
    for start in range(0, len(candidates), 65536):
        chunk = candidates[start : start + 65536]
        records = s.storage.get(chunk)
        if not records.any_references:
            continue
        rows = np.flatnonzero(records.reference_mask)
        unknown = records.key_unknown[rows].tolist()
        for seq, source_id, key_unknown in zip(
            chunk[rows].tolist(), records.source_ids[rows].tolist(), unknown, strict=True
        ):
            if not _expired_dead_letter(s, seq):
                s.unfilled.add(seq, int(source_id), key_unknown)


def counts_by_source(s: CoreState) -> dict[int, int]:
    """Unfilled records per source id."""
    return s.unfilled.counts()


def _expired(n: int) -> Causes:
    return Causes.one(SOURCE_EXPIRED, n)


def _expired_dead_letter(s: CoreState, seq: int) -> bool:
    record: Any = s.book.dead.get(seq)
    cause = None if record is None else record.last_cause
    return cause is not None and cause.kind is FailKind.SOURCE_EXPIRED
