"""The read path of an LMDB store: `get`, `scan` and `len`, beside any write.

A read runs in one read transaction of the environment (lmdb_env: `_read`), which sees
the last commit and waits for no write. With `buffers=True` a chunk's value is a
memoryview into the map, and only the records asked for are copied out of it
(`_piece`: their span at once when they lie close together, else each alone, joined).
A `RecordsRead` keeps those copies and where each record lies in them, and decodes
every record of the read in one vectorized step (base.decode_packed) with no bytes
object per record; a record's tags come from its chunk's override table when it has
an entry there, applied once the records are decoded.

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

from collections.abc import Iterator
from functools import partial

import lmdb
import numpy as np
from numpy.typing import NDArray

from ftlayer.records import RecordBatch

from .base import RecordNotStored, decode_packed
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
        stored = read.stored()[where]
        if not bool(stored.all()):
            raise RecordNotStored(seq_array[~stored])
        batch, _ = read.decode(where)
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
            batch, replay_seqs = read.decode(None)
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
        """The records `seqs` (sorted, distinct); a row no chunk gave is not stored."""
        found = RecordsRead(seqs, len(seqs))
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
            return RecordsRead(np.zeros(0, dtype=np.uint64), 0)
        seqs: list[NDArray[np.uint64]] = []
        found = RecordsRead(np.zeros(0, dtype=np.uint64), 0)
        while found.count < limit:
            head = self._chunks.head_at(txn, cursor)
            wanted = np.flatnonzero(~head.deleted & (head.seqs >= start))
            positions = wanted[: limit - found.count]
            if len(positions):
                seqs.append(head.seqs[positions])
                rows = np.arange(found.count, found.count + len(positions))
                found.count += len(positions)
                found.add(self._chunks.records_of(txn, head), head, positions, rows)
            if not cursor.next():
                break
        if seqs:
            found.seqs = np.concatenate(seqs)
        return found


class RecordsRead:
    """Records read from chunks in one transaction: the bytes of each chunk's records
    that were asked for (one copy of their span, `pieces`), where each record lies in
    them, and the tags of those with an override entry, applied when decoded. A row
    no chunk gave is not stored."""

    __slots__ = (
        "_lengths",
        "_piece_rows",
        "_pieces",
        "_replays",
        "_roots",
        "_rows",
        "_starts",
        "count",
        "seqs",
    )  # fmt: skip

    def __init__(self, seqs: NDArray[np.uint64], count: int) -> None:
        self.seqs = seqs
        self.count = count
        """Rows: the seqs asked for (`get`), or the records found so far (a scan)."""
        self._pieces: list[bytes] = []
        self._piece_rows: list[NDArray[np.intp]] = []
        self._starts: list[NDArray[np.int64]] = []  # within the piece
        self._lengths: list[NDArray[np.int64]] = []
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
        starts, ends = head.bounds(positions)
        piece, within = _piece(blob, starts, ends)
        self._pieces.append(piece)
        self._piece_rows.append(rows)
        self._starts.append(within)
        self._lengths.append((ends - starts).astype(np.int64, copy=False))
        tagged, roots, replays = head.tags_of(positions)
        if len(tagged):
            self._rows.append(rows[tagged])
            self._roots.append(roots)
            self._replays.append(replays)

    def stored(self) -> NDArray[np.bool_]:
        """Per row: a chunk gave its record."""
        found = np.zeros(self.count, dtype=np.bool_)
        for rows in self._piece_rows:
            found[rows] = True
        return found

    def decode(self, where: NDArray[np.intp] | None) -> tuple[RecordBatch, NDArray[np.uint64]]:
        """The records of rows `where` (None: every row, in order; each must be
        stored), decoded from the pieces in one step, their override tags applied."""
        starts = np.zeros(self.count, dtype=np.int64)
        lengths = np.zeros(self.count, dtype=np.int64)
        base = 0
        for piece, rows, within, length in zip(
            self._pieces, self._piece_rows, self._starts, self._lengths, strict=True
        ):
            starts[rows] = within + base
            lengths[rows] = length
            base += len(piece)
        if where is not None:
            starts, lengths = starts[where], lengths[where]
        buffer = self._pieces[0] if len(self._pieces) == 1 else b"".join(self._pieces)
        batch, replay_seqs = decode_packed(buffer, starts, lengths)
        if self._rows:
            tag_of = np.full(self.count, -1, dtype=np.intp)
            tag_of[np.concatenate(self._rows)] = np.arange(sum(map(len, self._rows)))
            picked = tag_of if where is None else tag_of[where]
            at = np.flatnonzero(picked >= 0)
            batch.roots[at] = np.concatenate(self._roots)[picked[at]]
            replay_seqs[at] = np.concatenate(self._replays)[picked[at]]
        return batch, replay_seqs


def _piece(
    blob: bytes | memoryview, starts: NDArray[np.int64], ends: NDArray[np.int64]
) -> tuple[bytes, NDArray[np.int64]]:
    """The bytes [starts, ends) of `blob` (a chunk's value, maybe a view into the map)
    in one bytes, and where each record starts in it: their span at once when they
    lie close together, else each copied alone and joined."""
    lo, hi = int(starts[0]), int(ends[-1])
    lengths = (ends - starts).astype(np.int64, copy=False)
    if hi - lo <= 2 * int(lengths.sum()):
        return bytes(blob[lo:hi]), (starts - lo).astype(np.int64, copy=False)
    joined = b"".join(
        [bytes(blob[a:b]) for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]
    )
    return joined, np.cumsum(lengths) - lengths
