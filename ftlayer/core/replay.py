"""The replay queue: failed records waiting to re-enter the pipeline.

Each failed record gets a replay seq (1, 2, 3, ... never reused, also across restarts:
the next one is kept in the store under REPLAY_SEQ_META_KEY) and one entry per target
partition its replay partitioner chose. A micro-batch takes in the replays with
S.replay < seq <= E.replay of its source and partition (ftlayer.position); entries stay
fetchable until the batch's checkpoint prunes them, so a batch that Spark runs again
fetches the same replays. Each entry knows whether it was fetched before: fetching it
again is a re-run (a retried task, a speculative attempt, a batch run again after a
restart), which the FT layer gives a fresh root (`renew`; ftlayer.core.takeover).

The records of the entries are kept beside them as their failure path had them in
memory (`records.add`: the bytes a fill just stored, or the records a requeue read),
so the reader that fetches them costs no read of the store (`records.get`). Only
records with their bytes are kept (a record stored by reference is read from the
store, where a later fill merges in); a record queued again (a dead letter requeued)
is found in its newest append; and they go when their entries are pruned, or when
more than KEPT_RECORDS or KEPT_BYTES are kept (the oldest first). The stored record
stays the truth: nothing but a fill changes a record's bytes or coordinates, and a
fill only applies to a record stored by reference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from ftlayer.errors import StateConflict
from ftlayer.records import RecordBatch

__all__ = ["REPLAY_SEQ_META_KEY", "Fetched", "ReplayQueue"]

REPLAY_SEQ_META_KEY = "next_replay_seq"
"""Meta key of the next replay seq (decimal text): never reused, also across restarts."""
_EMPTY_U64: NDArray[np.uint64] = np.zeros(0, dtype=np.uint64)
_NAMES = ("replay_seq", "root", "seq", "source_id", "partition")
KEPT_RECORDS = 250_000
"""At most this many queued records kept in memory with their bytes (QueuedRecords)."""
KEPT_BYTES = 32 << 20
"""At most this many bytes of their payloads."""


class _Kept(NamedTuple):
    seqs: NDArray[np.uint64]  # sorted
    rows: NDArray[np.intp]  # each sorted seq's row of `records`
    records: RecordBatch
    newest: int  # the highest replay seq they were queued under
    source_ids: frozenset[int]
    size: int  # payload bytes


class QueuedRecords:
    """Queued records with their bytes, by storage seq (the module docstring)."""

    __slots__ = ("_bytes", "_count", "_kept")

    def __init__(self) -> None:
        self._kept: list[_Kept] = []  # oldest first
        self._count = 0
        self._bytes = 0

    def __len__(self) -> int:
        return self._count

    def add(
        self, seqs: NDArray[np.uint64], records: RecordBatch, replay_seqs: NDArray[np.uint64]
    ) -> None:
        """`records` (aligned with `seqs`) were queued under `replay_seqs`; those with
        their bytes are kept."""
        if not len(seqs):
            return
        if records.references is not None:
            rows = np.flatnonzero(~records.references)
            if not len(rows):
                return
            seqs, records = seqs[rows], records.take(rows)
        order = np.argsort(seqs, kind="stable")
        size = sum(map(len, records.payloads))
        sources = frozenset(np.unique(records.source_ids).tolist())
        newest = int(replay_seqs.max())
        self._kept.append(_Kept(seqs[order], order, records, newest, sources, size))
        self._count += len(seqs)
        self._bytes += size
        while self._kept and (self._count > KEPT_RECORDS or self._bytes > KEPT_BYTES):
            self._drop(0)

    def get(self, seqs: NDArray[np.uint64]) -> RecordBatch | None:
        """The records of `seqs` in that order, if every one is kept; else None."""
        if not self._kept or not len(seqs):
            return None
        where = np.full(len(seqs), -1, dtype=np.intp)  # index into `found`
        found: list[RecordBatch] = []
        start = 0
        for kept in reversed(self._kept):  # the newest append of a seq wins
            missing = np.flatnonzero(where < 0)
            if not len(missing):
                break
            at = np.searchsorted(kept.seqs, seqs[missing])
            at = np.minimum(at, len(kept.seqs) - 1)
            hit = kept.seqs[at] == seqs[missing]
            if bool(hit.any()):
                found.append(kept.records.take(kept.rows[at[hit]]))
                where[missing[hit]] = np.arange(start, start + int(hit.sum()))
                start += int(hit.sum())
        if bool((where < 0).any()):
            return None
        merged = RecordBatch.concat(found)
        return merged if _in_order(where) else merged.take(where)

    def prune(self, upto: int, source_id: int | None) -> None:
        """Entries with replay seqs up to `upto` (of `source_id`, or of every source)
        were pruned: records queued under none higher go."""
        for i in range(len(self._kept) - 1, -1, -1):
            kept = self._kept[i]
            if kept.newest <= upto and (source_id is None or kept.source_ids == {source_id}):
                self._drop(i)

    def _drop(self, i: int) -> None:
        kept = self._kept.pop(i)
        self._count -= len(kept.seqs)
        self._bytes -= kept.size


def _in_order(where: NDArray[np.intp]) -> bool:
    return bool((where == np.arange(len(where))).all())


class Fetched(NamedTuple):
    """Queue entries a reader fetched, column by column."""

    replay_seqs: NDArray[np.uint64]
    roots: NDArray[np.uint64]
    seqs: NDArray[np.uint64]
    source_ids: NDArray[np.uint32]
    partitions: NDArray[np.int32]
    again: NDArray[np.bool_]
    """Fetched before: the reader is a re-run of an earlier one."""


class ReplayQueue:
    """Failed records waiting to re-enter the pipeline, ordered by replay seq, with the
    cursors a reader needs: the replay seqs handed out, each source's cursor and each
    source's prune point.

    One entry per (record, target partition); a broadcast replay has several entries
    with the same replay seq. Entries stay fetchable until pruned, so a micro-batch that
    Spark runs again fetches the same replays again.
    """

    def __init__(self, next_seq: int = 1) -> None:
        # Columns: replay seq, root, storage seq, source id, target partition, fetched
        # before; each a list of appended chunks, merged on read (appends are rare:
        # failures).
        self._columns: tuple[list[NDArray[Any]], ...] = ([], [], [], [], [], [])
        self._pruned_upto: dict[int | None, int] = {}  # per source id; None: every source
        self._next_seq = next_seq
        self.cursor_at_start = next_seq - 1
        """The cursor when this queue was made: the cursor of a source with none since."""
        self._cursors: dict[int, int] = {}  # per source id: its highest replay seq
        self._counts: dict[int, int] = {}  # per source id: its entries
        self.records = QueuedRecords()
        """The records of entries, with their bytes, as they were queued."""

    # ---- replay seqs and cursors ----------------------------------------------------

    def reserve(self, n: int, store: Callable[[int], None]) -> NDArray[np.uint64]:
        """The next `n` replay seqs. `store(next seq)` makes the counter durable first:
        if it raises, no seq was handed out (a seq is never used twice, also across
        restarts)."""
        seqs = np.arange(self._next_seq, self._next_seq + n, dtype=np.uint64)
        store(self._next_seq + n)
        self._next_seq += n
        return seqs

    @property
    def cursor(self) -> int:
        """The highest replay seq handed out so far (0 before the first failure)."""
        return self._next_seq - 1

    def cursor_of(self, source_id: int) -> int:
        """The highest replay seq of `source_id`'s records; for a source with none since
        this queue was made, the cursor at its start. Never behind a value it returned
        before (also across restarts), and a source's replays all have seqs at most
        this: a reader that takes in (its last cursor, this] misses none."""
        return self._cursors.get(source_id, self.cursor_at_start)

    def cursors(self) -> dict[str, int]:
        """Every source's cursor, by source id as a string (JSON's way)."""
        return {str(s): c for s, c in self._cursors.items()}

    def start_of(self, source_id: int) -> int:
        """Where a new reader of `source_id` starts: the point its entries were pruned
        to (0 if never), so it takes in every queued replay no finished batch took in."""
        return max(self._pruned_upto.get(None, 0), self._pruned_upto.get(source_id, 0))

    def pruned(self) -> dict[str, int]:
        """Every prune point, by source id as a string ("*": every source)."""
        return {("*" if s is None else str(s)): upto for s, upto in self._pruned_upto.items()}

    def prune_points(self) -> dict[int | None, int]:
        """Every prune point by source id (None: every source), for a journal base."""
        return dict(self._pruned_upto)

    def restore_prune_points(self, points: dict[int | None, int]) -> None:
        """Prune points read back after a restart (ftlayer.core.journal)."""
        for source_id, upto in points.items():
            self._pruned_upto[source_id] = max(self._pruned_upto.get(source_id, 0), upto)

    def prune_point_array(self, source_ids: NDArray[Any]) -> NDArray[np.uint64]:
        """The prune point of each row's source (its own or every source's)."""
        every = self._pruned_upto.get(None, 0)
        points = np.full(len(source_ids), every, dtype=np.uint64)
        for source_id, upto in self._pruned_upto.items():
            if source_id is not None and upto > every:
                points[source_ids == source_id] = upto
        return points

    # ---- entries ----------------------------------------------------------------------

    def append(
        self,
        replay_seqs: NDArray[np.uint64],
        roots: NDArray[np.uint64],
        seqs: NDArray[np.uint64],
        source_ids: NDArray[np.uint32],
        partitions: NDArray[np.int32],
        *,
        restored: bool = False,
    ) -> None:
        """Queue entries. `restored`: entries read back after a restart
        (ftlayer.core.journal), which move no source's cursor: a source with none since
        the restart reads the cursor at the start, never behind what it read before."""
        if len(replay_seqs):
            fetched = np.zeros(len(replay_seqs), dtype=np.bool_)
            chunks: tuple[NDArray[Any], ...] = (
                replay_seqs,
                roots,
                seqs,
                source_ids,
                partitions,
                fetched,
            )
            for column, chunk in zip(self._columns, chunks, strict=True):
                column.append(chunk)
            for source_id in np.unique(source_ids).tolist():
                rows = source_ids == source_id
                self._counts[source_id] = self._counts.get(source_id, 0) + int(rows.sum())
                if not restored:
                    newest = int(replay_seqs[rows].max())
                    self._cursors[source_id] = max(self._cursors.get(source_id, 0), newest)

    def counts(self) -> dict[int, int]:
        """{source id: its entries}, sources with none left out (kept up to date by
        append and prune: no pass over the entries)."""
        return {s: n for s, n in self._counts.items() if n}

    def columns(self) -> dict[str, NDArray[Any]]:
        """Copies of every entry's columns, for checkpoints."""
        if not self._columns[0]:
            return {name: np.zeros(0, dtype=np.uint64) for name in _NAMES}
        return {name: column.copy() for name, column in zip(_NAMES, self._merged(), strict=False)}

    def _merged(self) -> tuple[NDArray[Any], ...]:
        for column in self._columns:
            if len(column) > 1:
                column[:] = [np.concatenate(column)]
        return tuple(column[0] for column in self._columns)

    def __len__(self) -> int:
        return sum(len(chunk) for chunk in self._columns[0])

    def fetch(self, lo: int, hi: int, source_id: int | None, partition: int | None) -> Fetched:
        """Entries with lo < replay_seq <= hi (of one source and target partition if
        given), marked as fetched from now on; `again` tells which were before.

        StateConflict if the range starts below the point the source (or every source)
        was pruned to: those entries are gone, and a batch that needs them again means
        the caller's position is older than a completed checkpoint of it."""
        pruned = self._pruned_upto.get(None, 0) if source_id is None else self.start_of(source_id)
        if lo < pruned:
            which = "" if source_id is None else f" of source {source_id}"
            raise StateConflict(
                f"replay range ({lo}, {hi}]{which} starts before its pruned point {pruned}"
            )
        if not self._columns[0]:
            return Fetched(
                _EMPTY_U64,
                _EMPTY_U64,
                _EMPTY_U64,
                np.zeros(0, dtype=np.uint32),
                np.zeros(0, dtype=np.int32),
                np.zeros(0, dtype=np.bool_),
            )
        rseq, roots, seqs, sources, parts, fetched = self._merged()
        mask = (rseq > lo) & (rseq <= hi)
        if source_id is not None:
            mask &= sources == source_id
        if partition is not None:
            mask &= parts == partition
        again = fetched[mask]
        fetched[mask] = True
        return Fetched(rseq[mask], roots[mask], seqs[mask], sources[mask], parts[mask], again)

    def entries_of(self, roots: NDArray[np.uint64]) -> NDArray[np.int64]:
        """How many entries each of `roots` has (more than one: a broadcast replay).
        O(entries)."""
        counts = np.zeros(len(roots), dtype=np.int64)
        if not self._columns[0]:
            return counts
        queued = self._merged()[1]
        unique, found = np.unique(queued[np.isin(queued, roots)], return_counts=True)
        at = np.searchsorted(unique, roots)
        hit = at < len(unique)
        hit[hit] = unique[at[hit]] == roots[hit]
        counts[hit] = found[at[hit]]
        return counts

    def renew(self, old_roots: NDArray[np.uint64], new_roots: NDArray[np.uint64]) -> None:
        """Entries of `old_roots[i]` are of `new_roots[i]` from now on."""
        if not self._columns[0] or not len(old_roots):
            return
        queued = self._merged()[1].copy()
        order = np.argsort(old_roots)
        sorted_old = old_roots[order]
        at = np.minimum(np.searchsorted(sorted_old, queued), len(sorted_old) - 1)
        hit = sorted_old[at] == queued
        queued[hit] = new_roots[order][at[hit]]
        self._columns[1][0] = queued

    def prune(self, upto: int, source_id: int | None = None) -> int:
        """Drop entries with replay_seq <= upto (of one source, or of every source);
        returns how many were dropped."""
        self._pruned_upto[source_id] = max(self._pruned_upto.get(source_id, 0), upto)
        self.records.prune(upto, source_id)
        if not self._columns[0]:
            return 0
        rseq, _roots, _seqs, sources, _parts, _fetched = self._merged()
        keep = rseq > upto
        if source_id is not None:
            keep |= sources != source_id
        dropped = sources[~keep]
        ids, counts = np.unique(dropped, return_counts=True)
        for dropped_id, n in zip(ids.tolist(), counts.tolist(), strict=True):
            self._counts[dropped_id] -= n
        for column in self._columns:
            column[0] = column[0][keep]
        return len(dropped)
