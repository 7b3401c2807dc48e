"""The read path of an LMDB store: `get`, `scan` and `len`, beside any write.

A read runs in one read transaction of the environment (lmdb_env: `_read`), which sees
the last commit and waits for no write. With `buffers=True` a chunk's value is a
memoryview into the map, and only the records asked for are copied out of it
(`_slices`: their span at once when they lie close together, else each alone). A
record's tags come from its chunk's override table when it has an entry there: a
`RecordsRead` applies them once its records are decoded.

- `get(seqs)`: the distinct seqs, sorted, are looked up chunk by chunk (`Chunks.spans`:
  one cursor seek and one head decoded per chunk); a seq given twice is read once and
  returned twice, and every seq not stored is named (`check_stored`).
- `scan(batch_size)`: one read transaction per batch, closed before the batch is
  yielded: a reader held open across yields would stop LMDB from reusing freed pages
  and block map growth for as long as the caller takes. So each batch is consistent,
  and a write between two batches may or may not be seen.
- `len()`: the count of stored records that every write keeps (lmdb_writes).

Costs: one read transaction per call (per batch for `scan`), one head decoded per chunk
touched, one copy of the bytes of the records returned, one decode per batch (base).

Threads: thread-safe; no lock of the writer's is taken (only a map resize holds a new
read back, lmdb_env).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import partial

import lmdb
import numpy as np
from numpy.typing import NDArray

from ftlayer.records import RecordBatch

from .base import check_stored, decode_records
from .lmdb_env import LmdbEnvironment
from .lmdb_layout import MAX_SEQ, ChunkHead, firsts, seek_floor, stored_count

__all__ = ["LmdbReads"]


class LmdbReads(LmdbEnvironment):
    """The read path of `LmdbStorage`; see the module docstring."""

    def _get(self, seq_array: NDArray[np.uint64]) -> RecordBatch:
        order = np.argsort(seq_array, kind="stable")
        ordered = seq_array[order]
        first = firsts(ordered)
        wanted = ordered[first]
        where = np.empty(len(seq_array), dtype=np.intp)  # each seq's place in `wanted`
        where[order] = np.cumsum(first) - 1
        read = self._read(partial(self._read_records, wanted), db=None, buffers=True)
        values = [read.values[i] for i in where.tolist()]
        check_stored(seq_array, values)
        batch, _ = read.decode(values, where)  # type: ignore[arg-type]  # checked: no None
        return batch

    def _scan(
        self, batch_size: int
    ) -> Iterator[tuple[NDArray[np.uint64], RecordBatch, NDArray[np.uint64]]]:
        # One read transaction per batch, closed before the batch is yielded: a reader
        # held open across yields would stop LMDB from reusing freed pages and block
        # map growth for as long as the caller takes.
        start = 0
        while True:
            read = self._read(partial(self._read_from, start, batch_size), db=None, buffers=True)
            if not len(read.seqs):
                return
            batch, replay_seqs = read.decode(read.values, None)  # type: ignore[arg-type]
            yield read.seqs, batch, replay_seqs
            if len(read.seqs) < batch_size or int(read.seqs[-1]) == MAX_SEQ:
                return
            start = int(read.seqs[-1]) + 1

    def __len__(self) -> int:
        self._live_env()
        return self._read(partial(stored_count, self._store), db=None)

    def _read_records(
        self, seqs: NDArray[np.uint64], txn: lmdb.Transaction[memoryview]
    ) -> RecordsRead:
        """The records `seqs` (sorted, distinct); None for a seq not stored."""
        found = RecordsRead(seqs, [None] * len(seqs))
        for head, lo, hi in self._chunks.spans(txn, seqs):
            positions, stored = head.locate(seqs[lo:hi])
            if stored.any():
                blob = self._chunks.records_of(txn, head)
                found.add(blob, head, positions[stored], lo + np.flatnonzero(stored))
        return found

    def _read_from(self, start: int, limit: int, txn: lmdb.Transaction[memoryview]) -> RecordsRead:
        """Up to `limit` stored records from seq `start` on, in seq order."""
        cursor = txn.cursor(db=self._chunks.index_db)
        if seek_floor(cursor, start) is None and not cursor.first():
            return RecordsRead(np.zeros(0, dtype=np.uint64), [])
        seqs: list[NDArray[np.uint64]] = []
        found = RecordsRead(np.zeros(0, dtype=np.uint64), [])
        while len(found.values) < limit:
            head = self._chunks.head_at(txn, cursor)
            wanted = np.flatnonzero(~head.deleted & (head.seqs >= start))
            positions = wanted[: limit - len(found.values)]
            if len(positions):
                seqs.append(head.seqs[positions])
                rows = np.arange(len(found.values), len(found.values) + len(positions))
                found.values.extend([None] * len(positions))
                found.add(self._chunks.records_of(txn, head), head, positions, rows)
            if not cursor.next():
                break
        if seqs:
            found.seqs = np.concatenate(seqs)
        return found


class RecordsRead:
    """Records read from chunks in one transaction: their values (None: not stored),
    and the tags of those with an override entry, applied when decoded."""

    __slots__ = ("_replays", "_roots", "_rows", "seqs", "values")

    def __init__(self, seqs: NDArray[np.uint64], values: list[bytes | None]) -> None:
        self.seqs = seqs
        self.values = values
        self._rows: list[NDArray[np.intp]] = []
        self._roots: list[NDArray[np.uint64]] = []
        self._replays: list[NDArray[np.uint64]] = []

    def add(
        self,
        blob: bytes | memoryview,
        head: ChunkHead,
        positions: NDArray[np.intp],
        rows: NDArray[np.intp],
    ) -> None:
        """The records `positions` of `head`'s chunk, whose value is `blob`, as `rows`."""
        values = _slices(blob, *head.bounds(positions))
        first, last = int(rows[0]), int(rows[-1])
        if last - first == len(rows) - 1:
            self.values[first : last + 1] = values
        else:
            for row, value in zip(rows.tolist(), values, strict=True):
                self.values[row] = value
        tagged, roots, replays = head.tags_of(positions)
        if len(tagged):
            self._rows.append(rows[tagged])
            self._roots.append(roots)
            self._replays.append(replays)

    def decode(
        self, values: Sequence[bytes], where: NDArray[np.intp] | None
    ) -> tuple[RecordBatch, NDArray[np.uint64]]:
        """`values` (the read's values, or those picked by `where`) decoded, their
        override tags applied."""
        batch, replay_seqs = decode_records(values)
        if self._rows:
            tag_of = np.full(len(self.values), -1, dtype=np.intp)
            tag_of[np.concatenate(self._rows)] = np.arange(sum(map(len, self._rows)))
            picked = tag_of if where is None else tag_of[where]
            at = np.flatnonzero(picked >= 0)
            batch.roots[at] = np.concatenate(self._roots)[picked[at]]
            replay_seqs[at] = np.concatenate(self._replays)[picked[at]]
        return batch, replay_seqs


def _slices(
    blob: bytes | memoryview, starts: NDArray[np.int64], ends: NDArray[np.int64]
) -> list[bytes]:
    """The bytes [starts, ends) of `blob` (a chunk's value, maybe a view into the map)."""
    lo, hi = int(starts[0]), int(ends[-1])
    if hi - lo <= 2 * int((ends - starts).sum()):
        span = bytes(blob[lo:hi])  # one copy, then bytes slices
        return [
            span[a:b] for a, b in zip((starts - lo).tolist(), (ends - lo).tolist(), strict=True)
        ]
    return [bytes(blob[a:b]) for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]
