"""Failures of batch-range rows: noted at their FAIL, applied together, once a batch.

A barrier-mode batch read by reference (ftlayer.core.ranges) fails its rows by range
root, one FAIL per task that failed any. Applied at once (ftlayer.core.rangefail), each
FAIL is a synced write and a dozen structures: about 1.7 ms of the server's CPU a
request, nearly all of it per request rather than per row, and a batch's tasks send
one each. So the server *notes* such a FAIL (`note`): its roots, causes and time are
appended to the acker journal (ftlayer.core.journal: one os.write, no fsync; a killed
process keeps it) and kept in memory, and the FAIL is answered.

A noted row is a failed record whose bytes its source has not copied in yet, like one
stored by reference (ftlayer.core.fills): the brief STATUS counts it unfilled
(`counts`), and UNFILLED lists it (`unfilled`) under its range root in place of a
storage seq, with its Kafka coordinates. The source's FILL of those range roots
applies the notes (`fill`): every noted row is failed in one `fail`, the filled ones
stored with their bytes and keys and routed at once (ftlayer.core.rangefail.FilledRows:
one write, no record by reference, no second write for the bytes). Until then nothing
in the batch's path needs them applied: the barrier completes every other record of
their range and keeps the range open for them (ftlayer.core.ranges, `BatchRange.held`),
so a group offset never passes them and flow control counts them. Anything that reads
or changes what they concern applies them first, by reference (`apply`): a request of
another kind than FAIL, HEARTBEAT, BATCH_RANGES, FETCH_REPLAY, a brief STATUS,
UNFILLED, FILL, the checkpoint requests and BATCH_BEGIN (a full STATUS, INSPECT, an
XOR, a savepoint), or a tick once the oldest note is NOTE_MAX_AGE_S old (no tick is due for
them before: a fill comes behind the next trigger). Each failed record's backoff counts
from its own FAIL.

Contract:

- Only a FAIL whose every root names a fresh row is noted: a range root of an open
  range whose offset is neither materialized nor noted. Any other FAIL applies the
  notes first and then fails its roots at once, so a second event for a noted offset
  meets it materialized, as it would have without the notes. The count a noted FAIL
  answers is the one `fail` would have: each of its distinct roots was pending.
- Nothing is noted without a journal that has not broken (a note must outlive the
  process): then a FAIL applies at once. A note whose journal write broke the journal
  is applied at once, with every earlier note (the broken journal's files are gone).
- Once applied, the notes' end is journaled (`Journal.notes_applied`): a restart reads
  only the notes after it, so a note never names a range number used again since.
  Notes are events after a state copy, not part of it: a copy that becomes the
  journal's base writes the notes still pending into the segment it begins
  (`journal_again`), so truncating the journal at that base drops none.
- A killed server's notes are in its journal: recovery (`recover`) applies them again,
  for the offsets of open ranges that did not become records (applied before the
  crash, they did). After a machine restart the journal is not read (its tail may be
  lost, ftlayer.core.journal), and neither when it ends early: then every offset of
  every open range that is not a record of its own is failed ("recovery", no attempt
  counted), so the batches running at the crash are replayed whole (duplicates,
  nothing lost).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Final

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ftlayer.causes import Cause, Causes
from ftlayer.rangeroots import decode, encode, is_range_root
from ftlayer.records import KEY_UNKNOWN, RecordBatch

from .failure import enqueue, fail, requeue
from .fills import UnfilledRecords, requires_key
from .journal import JournalState
from .rangefail import FilledRows, fresh_rows
from .ranges import complete_held, materialize
from .state import CoreState
from .stats import FailCause

__all__ = [
    "NOTE_MAX_AGE_S",
    "apply",
    "counts",
    "due_in",
    "fill",
    "fresh",
    "journal_again",
    "note",
    "recover",
    "unfilled",
]

log = logging.getLogger("ftlayer.core")

NOTE_MAX_AGE_S: Final = 10.0
"""A tick applies the notes once the oldest is this old (no FILL nor other request did
before): longer than a batch and the trigger behind it take, so that the source's
fill, behind its next trigger, applies them with their bytes."""


def note(s: CoreState, roots: ArrayLike, causes: Causes | Cause | None) -> int | None:
    """Note the failures of `roots` when each names a fresh row (module docstring);
    returns how many distinct roots it noted, or None when it noted nothing (the
    caller applies the notes and fails the roots at once)."""
    journal = s.journal
    if journal is None or journal.broken is not None or not len(s.ranges):
        return None
    root_array = np.ascontiguousarray(roots, dtype=np.uint64)
    if not len(root_array):
        return None
    if not isinstance(causes, Causes):
        causes = Causes.one(causes, len(root_array))
    elif len(causes) != len(root_array):
        return None  # fail() refuses it, naming both counts
    keys, first = np.unique(root_array, return_index=True)
    if not bool(fresh(s, keys).all()):
        return None
    causes = causes.take(first)
    at = s.wall()
    s.changing()  # a state copy owed at a barrier is taken first (it rotates the journal)
    journal.note(keys, causes, at)
    if journal.broken is not None:  # not written: it must not wait in memory only
        return None
    if not s.noted:
        s.noted_since = s.clock()
    s.noted.append((keys, causes, at))
    s.noted_keys.update(keys.tolist())
    return len(keys)


def fresh(s: CoreState, keys: NDArray[np.uint64]) -> NDArray[np.bool_]:
    """Per root: a range root of an open range whose offset is neither materialized
    (rangefail.fresh_rows) nor noted."""
    ok = np.zeros(len(keys), dtype=np.bool_)
    ranged = np.flatnonzero(is_range_root(keys))
    if len(ranged):
        ok[fresh_rows(s, keys, ranged)[0]] = True
    noted = s.noted_keys
    if noted:
        ok &= np.fromiter((k not in noted for k in keys.tolist()), np.bool_, len(keys))
    return ok


def apply(s: CoreState, filled: FilledRows | None = None) -> int:
    """Fail every noted root (one `fail`), then journal that they were applied;
    returns how many were pending. On an error the notes stay, to be applied again.
    `filled`: the bytes of noted rows their source copied in (`fill`)."""
    notes, keys, since = s.noted, s.noted_keys, s.noted_since
    if not notes:
        return 0
    # Taken first: a state copy that `fail` takes (a change hook) sees none of them.
    s.noted, s.noted_keys, s.noted_since = [], set(), None
    try:
        failed = fail(s, *_gathered(notes), filled=filled)
    except BaseException:
        s.noted, s.noted_since = notes + s.noted, since
        s.noted_keys |= keys
        journal_again(s)  # a copy taken meanwhile may have ended their segment
        raise
    if s.journal is not None:
        s.journal.notes_applied()
    complete_held(s)
    return failed


def unfilled(s: CoreState, source_id: int, limit: int) -> UnfilledRecords:
    """Up to `limit` noted rows of `source_id`, oldest first, as UNFILLED lists them:
    their range roots in place of storage seqs, their Kafka coordinates, no key yet
    (the source reads them and hands their bytes to `fill`)."""
    roots = _noted_of(s, source_id)[: max(0, limit)]
    if not len(roots):
        return UnfilledRecords(roots, RecordBatch.empty())
    numbers, deltas = decode(roots)
    ranges = [s.ranges.by_number[n] for n in numbers.tolist()]
    n = len(roots)
    records = RecordBatch.build(
        roots,
        [b""] * n,
        source_ids=source_id,
        key_hashes=np.full(n, KEY_UNKNOWN, dtype=np.int64),
        has_key=np.zeros(n, dtype=np.bool_),
        topics=[r.topic for r in ranges],
        partitions=[r.partition for r in ranges],
        offsets=np.array([r.start for r in ranges], dtype=np.int64) + deltas,
        references=True,
    )
    return UnfilledRecords(roots, records)


def counts(s: CoreState) -> dict[int, int]:
    """Noted rows per source id (those with any): unfilled, as STATUS counts them."""
    out: dict[int, int] = {}
    if not s.noted:
        return out
    numbers, _ = decode(np.fromiter(s.noted_keys, dtype=np.uint64, count=len(s.noted_keys)))
    found, count = np.unique(numbers, return_counts=True)
    for number, n in zip(found.tolist(), count.tolist(), strict=True):
        r = s.ranges.by_number.get(number)
        if r is not None:
            out[r.source_id] = out.get(r.source_id, 0) + n
    return out


def fill(
    s: CoreState,
    roots: NDArray[np.uint64],
    payloads: Sequence[bytes],
    found: NDArray[np.bool_],
    keys: tuple[NDArray[np.int64], NDArray[np.bool_]] | None,
) -> int:
    """The source read noted rows that `unfilled` listed (`roots`, range roots): every
    note is applied now, the `found` rows with their bytes and keys (stored with them
    and routed at once, ftlayer.core.rangefail.FilledRows: one write, no record by
    reference), the others as `apply` applies them (by reference: a row the source no
    longer has becomes a source-expired dead letter when it is filled again, by its
    seq). Without keys, or when no row given is noted any more (a request that needed
    them applied the notes meanwhile, by reference: they are listed again by seq),
    nothing is applied. A row without a key whose source's replay partitioner needs
    one is left to `apply` too. Returns how many rows were stored with their bytes."""
    if not s.noted or keys is None or not len(roots):
        return 0
    noted = s.noted_keys
    usable = found & np.fromiter(map(noted.__contains__, roots.tolist()), np.bool_, len(roots))
    keyless = usable & ~keys[1]
    if bool(keyless.any()):
        usable[np.flatnonzero(keyless)[_need_keys(s, roots[keyless])]] = False
    if not bool(usable.any()):
        return 0
    rows = np.flatnonzero(usable)
    rows = rows[np.argsort(roots[rows], kind="stable")]
    before = s.stats.filled
    apply(
        s,
        FilledRows(
            roots[rows],
            [payloads[i] for i in rows.tolist()],
            keys[0][rows],
            keys[1][rows],
            enqueue,
        ),
    )
    return s.stats.filled - before


def _noted_of(s: CoreState, source_id: int) -> NDArray[np.uint64]:
    """The distinct noted roots of `source_id`'s ranges, in the order they were noted."""
    if not s.noted:
        return np.zeros(0, dtype=np.uint64)
    keys = np.concatenate([k for k, _, _ in s.noted])
    numbers, _ = decode(keys)
    ranges = s.ranges.by_number
    distinct = np.unique(numbers)
    wanted = [
        n
        for n in distinct.tolist()
        if (r := ranges.get(n)) is not None and r.source_id == source_id
    ]
    if len(wanted) != len(distinct):
        keys = keys[np.isin(numbers, wanted)]
    _, first = np.unique(keys, return_index=True)  # noted twice: by one FAIL each
    return keys[np.sort(first)]


def _need_keys(s: CoreState, roots: NDArray[np.uint64]) -> NDArray[np.bool_]:
    """Per range root: whether its source's replay partitioner needs a key (or its
    range or its source is unknown: left to `apply` as well)."""
    numbers, _ = decode(roots)
    needs: dict[int, bool] = {}
    for number in set(numbers.tolist()):
        r = s.ranges.by_number.get(number)
        needs[number] = (
            r is None or s.source_config(r.source_id) is None or requires_key(s, r.source_id)
        )
    return np.fromiter(map(needs.__getitem__, numbers.tolist()), np.bool_, len(numbers))


def journal_again(s: CoreState) -> None:
    """Write the notes into the journal's segment again: called once the segment that
    held them was ended by a state copy that does not hold them (a base)."""
    if s.journal is not None:
        for keys, causes, at in s.noted:
            s.journal.note(keys, causes, at)


def due_in(s: CoreState) -> float | None:
    """Seconds until a tick applies the notes (None: there are none)."""
    if s.noted_since is None:
        return None
    if s.journal is not None and s.journal.broken is not None:
        return 0.0
    return s.noted_since + NOTE_MAX_AGE_S - s.clock()


def recover(s: CoreState, state: JournalState | None) -> None:
    """After a restart (module docstring): apply the journal's notes again, or, when
    the journal could not be read whole, fail every open range's rows."""
    journal = s.journal
    if journal is None or not len(s.ranges):
        return
    if not journal.trusted or (state is not None and state.truncated is not None):
        _fail_open_ranges(s)
        return
    if state is None or not state.notes:
        return
    keys, causes, at = _gathered(state.notes)
    keys, first = np.unique(keys, return_index=True)
    causes, at = causes.take(first), at[first]
    rows = np.flatnonzero(fresh(s, keys))
    if len(rows):
        fail(s, keys[rows], causes.take(rows), at[rows])
    journal.notes_applied()


def _gathered(
    notes: list[tuple[NDArray[np.uint64], Causes, float]],
) -> tuple[NDArray[np.uint64], Causes, NDArray[np.float64]]:
    """The notes' roots, causes and times, one after another."""
    keys = np.concatenate([k for k, _, _ in notes])
    causes = Causes.concat([c for _, c, _ in notes])
    at = np.concatenate([np.full(len(k), t, dtype=np.float64) for k, _, t in notes])
    return keys, causes, at


def _fail_open_ranges(s: CoreState) -> None:
    """Every offset of every open range that is not a record of its own, failed as a
    recovery (the journal that held the batch's noted failures was lost)."""
    log.warning(
        "the journal could not be read whole, so failures noted for the %d open batch "
        "ranges may be lost: every record of them is replayed (duplicates, nothing lost)",
        len(s.ranges),
    )
    for r in list(s.ranges.by_number.values()):
        offsets = np.arange(r.start, r.end, dtype=np.int64)
        offsets = offsets[r.unfinished(offsets)]
        if not len(offsets):
            continue
        keys = encode(r.number, r.start, offsets)
        materialize(s, keys)
        pending, seqs = s.acker.lookup("seq", keys)
        if bool(pending.any()):
            requeue(s, keys[pending], seqs[pending], FailCause.RECOVERY)
