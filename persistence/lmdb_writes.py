"""The write path of an LMDB store: puts in group commits, deletes, retags, compaction.

Every write runs in one write transaction of the environment (lmdb_env: `_write`), all
of it or nothing, and the chunks it changes keep the layout's invariants (lmdb_layout).

Put: a group commit
-------------------
Puts of several threads at once share one transaction, one commit and one fsync:

1. The put encodes its batch in its own thread (`encode_chunk`), outside every lock,
   and queues it (`_queued`).
2. It waits for the write lock (`_lock`).
3. Whoever gets the lock first takes every queued put (`_commit_queued`) and writes
   them in one transaction: each batch as its own chunk(s) of whole records, at most
   `chunk_bytes` each unless one record is larger (`_pieces`), under consecutive seqs
   in queue order, with the new high-water mark and the count of stored records.
4. Each put gets its seqs or, if the transaction failed, an error of its own (nothing
   of any of them is stored). A put that gets the lock after a group took it returns
   what the group left it. A put alone is a group of one.

The high-water mark (`next_seq`) is written in the same transaction as the records it
covers, so a seq is never reused, even after every record was deleted; on open the next
seq is the larger of it and the last chunk's last seq + 1 (lmdb_open). The count of
stored records (`len`) is kept the same way. Paranoid check: a group that finds the
stored mark above its first seq writes nothing (someone else wrote the store).

Delete, retag, compaction
-------------------------
- `delete` sets the records' bits in the states of their chunks, in one transaction: a
  deleted record is gone for every reader at once, one state written per chunk however
  many of its records go. A chunk whose records are all deleted is dropped (its three
  values).
- `set_roots` writes the new tags into the override table (increasing index, one entry
  per record); `get` and `scan` take a record's tags from there when it has an entry.
  Retagging one record costs a state write, not a rewrite of its chunk.
- Compaction (`_settle`): a chunk is rewritten (its stored records only, their tags from
  the override table written into their bytes, under the same key and seqs, now listed)
  when a write leaves fewer than a quarter of its bytes stored, or more override
  entries than a quarter of its stored records and than OVERRIDES_KEPT (1,024, the
  store's `overrides_kept`). So
  deleted records never take more than three times the bytes of the stored ones in any
  chunk (a few records of a batch kept long, say a dead letter or a slow tree, do not
  pin the batch), a rewrite for deletes copies less than a third of the bytes deleted
  since the chunk was last written, and the override table stays smaller than the
  chunk, and within 20 KiB or a quarter of its records. A chunk of up to 1,024 records
  retagged at once (a failure's records, queued for replay by their fill) keeps its
  tags in the table: they usually go with the whole chunk at the next barrier, which
  a rewrite would only delay.

Costs: a put is a few B-tree operations per chunk, appended at the right edge, however
many records it holds, plus its encoding in the caller's thread; a delete or retag
decodes the head of each chunk it touches and writes its state once; a compaction
copies the stored records of one chunk.

Threads: `put` may be called from any thread (above); every other write runs under
`_lock` in `_write`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from functools import partial
from typing import Final

import lmdb
import numpy as np
from numpy.typing import NDArray

from ftlayer.errors import ConfigError, StorageError
from ftlayer.records import RecordBatch

from .base import (
    TAGS,
    MetaOfSeqs,
    RecordNotStored,
    check_replay_column,
    encode_chunk,
    encode_meta_key,
)
from .lmdb_env import LmdbEnvironment
from .lmdb_layout import (
    NEXT_SEQ_KEY,
    STORED_KEY,
    ChunkHead,
    chunk_key,
    distinct_last,
    sorted_distinct,
    stored_count,
)

__all__ = ["OVERRIDES_KEPT", "LmdbWrites"]

OVERRIDES_KEPT: Final = 1024
"""A chunk keeps up to this many override entries whatever its size (compaction)."""


class LmdbWrites(LmdbEnvironment):
    """The write path of `LmdbStorage`; see the module docstring."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        map_size: int,
        sync: bool,
        chunk_bytes: int,
        overrides_kept: int = OVERRIDES_KEPT,
    ) -> None:
        if overrides_kept < 0:
            raise ConfigError(f"overrides_kept must be 0 or more, got {overrides_kept}")
        self._overrides_kept = overrides_kept
        # Puts waiting for a write transaction (group commit, see the module docstring).
        self._queued: list[_QueuedPut] = []
        self._queued_lock = threading.Lock()
        super().__init__(path, map_size=map_size, sync=sync, chunk_bytes=chunk_bytes)

    def put(
        self,
        batch: RecordBatch,
        meta: MetaOfSeqs | None = None,
        replay_seqs: NDArray[np.uint64] | None = None,
    ) -> NDArray[np.uint64]:
        """Store `batch` (see the contract); with other threads putting at once, in one
        transaction with theirs (group commit, see the module docstring): each put's
        batch is encoded in its own thread and written as its own chunk(s), its `meta`
        entries with it, its records' `replay_seqs` in their headers."""
        replay_array = check_replay_column(batch, replay_seqs)
        self._live_env()
        if len(batch) == 0:
            return np.zeros(0, dtype=np.uint64)
        queued = _QueuedPut(len(batch), encode_chunk(batch, replay_array), meta)
        with self._queued_lock:
            self._queued.append(queued)
        with self._lock:
            if queued.seqs is None and queued.error is None:  # no group took it yet
                self._commit_queued()
        if queued.error is not None:
            raise queued.error
        assert queued.seqs is not None
        return queued.seqs

    def _commit_queued(self) -> None:
        """Write every queued put in one transaction (called under _lock): each gets
        its seqs, or, if the transaction failed, an error of its own."""
        with self._queued_lock:
            group, self._queued = self._queued, []
        sizes = [queued.n for queued in group]
        n = sum(sizes)
        first = self._next_seq
        starts = np.cumsum([first, *sizes[:-1]]).tolist()

        def write(txn: lmdb.Transaction[bytes]) -> None:
            high_water = txn.get(NEXT_SEQ_KEY, db=self._store)
            if high_water is not None and int.from_bytes(high_water, "big") > first:
                # Paranoid check: our seq counter is behind the store's high-water mark.
                raise StorageError(
                    f"{self._path}: seqs from {first} are already taken; the store was "
                    "written by someone else"
                )
            for queued, start in zip(group, starts, strict=True):
                assert queued.encoded is not None
                self._add_chunks(txn, start, *queued.encoded)
                if queued.meta is not None:
                    seqs = np.arange(start, start + queued.n, dtype=np.uint64)
                    for key, value in queued.meta(seqs).items():
                        txn.put(encode_meta_key(key), value, db=self._meta)
            txn.put(NEXT_SEQ_KEY, chunk_key(first + n), db=self._store)
            self._count_stored(txn, n)

        try:
            self._write(write, db=None)
        except BaseException as exc:
            for queued in group:  # each thread raises its own (a traceback is per raise)
                queued.error = exc if len(group) == 1 else _shared_error(exc, len(group))
            return
        self._next_seq = first + n
        for queued, start in zip(group, starts, strict=True):
            queued.seqs = np.arange(start, start + queued.n, dtype=np.uint64)
            queued.encoded = None

    def _add_chunks(
        self, txn: lmdb.Transaction[bytes], first: int, blob: bytes, ends: NDArray[np.int64]
    ) -> None:
        """Store the records of `encode_chunk` (`blob`, `ends`) under the seqs from
        `first` on, in `txn`: as one chunk, or several of up to chunk_bytes each."""
        view = memoryview(blob)
        for lo, hi in _pieces(ends, self._chunk_bytes):
            start = int(ends[lo - 1]) if lo else 0
            head = ChunkHead.new(first + lo, ends[lo:hi] - start)
            data = blob if hi - lo == len(ends) else view[start : int(ends[hi - 1])]
            if not self._chunks.add(txn, head, data):
                raise StorageError(
                    f"{self._path}: a chunk from seq {first + lo} is already stored; "
                    "the store was written by someone else"
                )

    def _delete(self, seqs: NDArray[np.uint64], meta_deletes: Sequence[bytes] = ()) -> int:
        if not meta_deletes:
            return self._write(partial(self._delete_in, seqs=seqs), db=None)

        def write(txn: lmdb.Transaction[bytes]) -> int:
            deleted = self._delete_in(txn, seqs)
            for key in meta_deletes:
                txn.delete(key, db=self._meta)
            return deleted

        return self._write(write, db=None)

    def _set_roots(
        self,
        seq_array: NDArray[np.uint64],
        root_array: NDArray[np.uint64],
        replay_array: NDArray[np.uint64],
    ) -> None:
        wanted, last = distinct_last(seq_array)  # a seq given twice: its last entry wins
        new_roots, new_replays = root_array[last], replay_array[last]

        def write(txn: lmdb.Transaction[bytes]) -> None:
            stored = np.zeros(len(wanted), dtype=np.bool_)
            changes = []
            for head, lo, hi in list(self._chunks.spans(txn, wanted)):
                positions, here = head.locate(wanted[lo:hi])
                stored[lo:hi] = here
                changes.append((head, positions[here], lo + np.flatnonzero(here)))
            if not stored.all():
                raise RecordNotStored(seq_array[np.isin(seq_array, wanted[~stored])])
            for head, positions, rows in changes:
                head.retag(positions, new_roots[rows], new_replays[rows])
                self._settle(txn, head)

        self._write(write, db=None)

    def _delete_in(self, txn: lmdb.Transaction[bytes], seqs: NDArray[np.uint64]) -> int:
        """Delete the records `seqs` in `txn` (see `delete`); how many were stored."""
        wanted = sorted_distinct(seqs)
        removed = 0
        for head, lo, hi in list(self._chunks.spans(txn, wanted)):
            positions, stored = head.locate(wanted[lo:hi])
            if stored.any():
                head.remove(positions[stored])
                removed += int(stored.sum())
                self._settle(txn, head)
        if removed:
            self._count_stored(txn, -removed)
        return removed

    def _settle(self, txn: lmdb.Transaction[bytes], head: ChunkHead) -> None:
        """Write a changed head: drop its chunk if nothing is stored there any more,
        compact it if the rules of the module docstring say so."""
        if head.live == 0:
            self._chunks.drop(txn, head.key)
        elif 4 * head.live_bytes < head.size or len(head.overrides) > max(
            head.live // 4, self._overrides_kept
        ):
            self._compact(txn, head)
        else:
            txn.put(chunk_key(head.key), head.encode_state(), db=self._chunks.state_db)

    def _compact(self, txn: lmdb.Transaction[bytes], head: ChunkHead) -> None:
        """Rewrite a chunk as its stored records, their override tags in their bytes."""
        blob = self._chunks.records_of(txn, head)
        keep = np.flatnonzero(~head.deleted)
        starts, ends = head.bounds(keep)
        # Records kept side by side are copied as one slice.
        breaks = np.flatnonzero(np.diff(keep) != 1) + 1
        run_starts = starts[np.concatenate(([0], breaks))].tolist()
        run_ends = ends[np.concatenate((breaks, [len(keep)])) - 1].tolist()
        data = b"".join([blob[a:b] for a, b in zip(run_starts, run_ends, strict=True)])
        sizes = ends - starts
        compacted = ChunkHead.new(head.key, np.cumsum(sizes), head.seqs[keep])
        if len(head.overrides):
            rows = np.searchsorted(keep, head.overrides["index"])
            tags = np.empty(len(rows), dtype=TAGS)
            tags["root"] = head.overrides["root"]
            tags["replay_seq"] = head.overrides["replay_seq"]
            at = (compacted.ends[rows] - sizes[rows])[:, None] + np.arange(TAGS.itemsize)
            patched = bytearray(data)
            np.frombuffer(patched, dtype=np.uint8)[at] = tags.view(np.uint8).reshape(at.shape)
            data = bytes(patched)
        self._chunks.replace(txn, compacted, data)

    def _count_stored(self, txn: lmdb.Transaction[bytes], change: int) -> None:
        """Add `change` to the count of stored records, in `txn`."""
        stored = stored_count(self._store, txn) + change
        txn.put(STORED_KEY, stored.to_bytes(8, "big"), db=self._store)


class _QueuedPut:
    """One put waiting for a group commit: its record count and its encoded chunk
    (`encode_chunk`), then its seqs or the error of the transaction (set under the
    store's write lock)."""

    __slots__ = ("encoded", "error", "meta", "n", "seqs")

    def __init__(
        self, n: int, encoded: tuple[bytes, NDArray[np.int64]], meta: MetaOfSeqs | None
    ) -> None:
        self.n = n
        self.encoded: tuple[bytes, NDArray[np.int64]] | None = encoded
        self.meta = meta
        self.seqs: NDArray[np.uint64] | None = None
        self.error: BaseException | None = None


def _shared_error(exc: BaseException, group: int) -> StorageError:
    """What each put of a failed group commit raises: nothing of theirs was stored."""
    if isinstance(exc, StorageError):
        error = StorageError(str(exc))
    else:
        error = StorageError(f"the write of {group} batches failed: {exc!r}")
    error.__cause__ = exc
    return error


def _pieces(ends: NDArray[np.int64], limit: int) -> list[tuple[int, int]]:
    """The records [lo, hi) of each chunk a put writes: whole records, at most `limit`
    bytes a chunk unless one record is larger."""
    n = len(ends)
    if int(ends[-1]) <= limit:
        return [(0, n)]
    pieces = []
    lo, before = 0, 0
    while lo < n:
        hi = max(lo + 1, int(np.searchsorted(ends, before + limit, side="right")))
        pieces.append((lo, hi))
        lo, before = hi, int(ends[hi - 1])
    return pieces
