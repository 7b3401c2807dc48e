"""The LMDB persistence storage: the default, durable `PersistenceStorage`.

One LMDB environment (a directory holding data.mdb and lock.mdb) with five named
sub-databases:

| sub-database | key                             | value                                   |
|--------------|---------------------------------|-----------------------------------------|
| `chunks`     | chunk key: a seq, 8 bytes BE    | the chunk's records, back to back       |
| `index`      | chunk key                       | its seqs and where each record ends     |
| `state`      | chunk key                       | which records are deleted; tag overrides |
| `meta`       | UTF-8 meta key                  | the caller's bytes (`put_meta`)         |
| `ftlayer`    | `format`                        | the format marker                       |
|              | `next_seq`, `records`           | seq high-water mark; stored records     |

(`next_seq` and `records` are 8 bytes big-endian.)

Chunks
------
A `put` stores its batch as one chunk: one LMDB value holding the records back to back,
each in the record layout of `base`, under the seq of its first record (a batch of more
than `chunk_bytes`, 1 MiB by default, becomes several chunks of whole records; a record
larger than that is a chunk of its own). LMDB's cost is per value, not per byte, so a
batch costs a few B-tree operations however many records it holds, and deleting a
whole batch as few. Beside the records, two small values: the chunk's index, written
with it and never changed, and its state, rewritten by every delete and retag (a bit
per record and the override table: a write touches a few bytes per record of the
chunk, not the chunk). All integers little-endian, no padding:

| value  | field      | type                  | meaning                                      |
|--------|------------|-----------------------|----------------------------------------------|
| index  | count      | u32                   | records in the chunk, deleted ones included   |
|        | flags      | u32                   | bit 0: seqs listed, else key, key + 1, ...    |
|        | seqs       | count x u64           | with flag bit 0 only: the seqs, increasing    |
|        | ends       | count x u32           | where each record ends in the chunk           |
| state  | live       | u32                   | records still stored                          |
|        | overrides  | u32                   | entries in the override table                 |
|        | live_bytes | u64                   | bytes of the records still stored             |
|        | deleted    | ceil(count / 8) bytes | bit i (least significant first): i deleted    |
|        | override   | overrides x 20 bytes  | u32 index, u64 root, u64 replay_seq; by index |

A chunk's seqs lie between its key and the next chunk's key, so the chunk of a seq is
the last one keyed at or below it, and key order is seq order.

- `delete` sets the records' bits in the states of their chunks, in one transaction: a
  deleted record is gone for every reader at once, one state written per chunk however
  many of its records go. A chunk whose records are all deleted is dropped (its three
  values).
- `set_roots` writes the new tags into the override table (increasing index, one entry
  per record); `get` and `scan` take a record's tags from there when it has an entry.
  Retagging one record costs a state write, not a rewrite of its chunk.
- Compaction: a chunk is rewritten (its stored records only, their tags from the
  override table written into their bytes, under the same key and seqs, now listed)
  when a write leaves fewer than a quarter of its bytes stored, or more than a quarter
  of its stored records with an override entry. So deleted records never take more than
  three times the bytes of the stored ones in any chunk (a few records of a batch kept
  long, say a dead letter or a slow tree, do not pin the batch), a rewrite for deletes
  copies less than a third of the bytes deleted since the chunk was last written, and
  the override table stays smaller than the chunk.

Big-endian keys sort in seq order, and seqs only grow, so every `put` appends at the
right edge of the B-trees (`append=True` skips the key search). The high-water mark is
written in the same transaction as the records it covers, so a seq is never reused even
after every record was deleted; on open the next seq is the larger of it and the last
chunk's last seq + 1. The count of stored records is kept the same way (`len`).

Format versions: the marker is `ftlayer-lmdb-v2`. A v1 store (one LMDB value per
record in a `records` sub-database, written by earlier versions) is converted when
opened, in one transaction (its records become chunks under the same seqs, tags
included; all of it or nothing); earlier versions refuse a v2 store, naming its format.

Opening never writes into something that is not ours. A path that is a file, a
non-empty directory without data.mdb, a data.mdb that LMDB cannot read, or an LMDB
environment without our format marker raises NotAnLmdbEnvironment and leaves the path
byte-for-byte untouched: an existing data.mdb is first probed read-only without the lock
file (LMDB would otherwise create lock.mdb before reading data.mdb). The one exception is
an LMDB environment whose main database is empty, which is what a crash between creating
a store and its first commit leaves behind: it becomes a store.

The map grows by itself: a transaction that fills the map is aborted, the map size
doubled, and the whole transaction retried, so every operation stays all-or-nothing.

Durability: with `sync=True` (the default) every commit is on disk when the call returns.
With `sync=False` a commit is atomic but may be lost to an OS crash until `sync()`.
Meta entries and deletes staged with `stage_meta` and `stage_deletes` ride on the next
transaction instead of a commit (and sync) of their own: done once any later write
commits, or `flush_staged`.

Threads. A store may be shared by threads (the server's connections persist into it
outside its core's lock, its deleter deletes): every method is thread-safe.

- Write transactions run one at a time (LMDB has one writer). Puts of several
  threads at once share one (group commit): a `put` encodes its records in its own
  thread, queues them and waits for the write lock; whoever gets it writes every
  queued batch in one transaction, one commit and one fsync, and hands each its seqs,
  or, if the transaction fails, the error (nothing of any of them is stored). A put
  alone is a group of one.
- Reads (get, scan, meta, len, copy_to) take no lock of the writer's: LMDB readers see
  the last commit and never wait for a write transaction. Only a map resize, which
  LMDB allows while no transaction of this process is open, holds new reads back and
  waits for running ones (a copy_to included) to end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any, Final, NamedTuple, TypeVar

import lmdb
import numpy as np
from numpy.typing import NDArray

from ftlayer.errors import ConfigError, NotAnLmdbEnvironment, StorageError
from ftlayer.records import RecordBatch

from .base import (
    TAGS,
    MetaValue,
    PersistenceStorage,
    RecordNotStored,
    Seqs,
    as_seqs,
    check_batch_size,
    check_retag_columns,
    check_stored,
    decode_records,
    encode_chunk,
    encode_meta_key,
)

FORMAT_MARKER: Final = b"ftlayer-lmdb-v2"
DEFAULT_MAP_SIZE: Final = 64 * 1024 * 1024
DEFAULT_CHUNK_BYTES: Final = 1 << 20

_V1_MARKER: Final = b"ftlayer-lmdb-v1"
_RECORDS_DB: Final = b"records"  # v1: one value per record (converted on open)
_CHUNKS_DB: Final = b"chunks"
_INDEX_DB: Final = b"index"
_STATE_DB: Final = b"state"
_META_DB: Final = b"meta"
_STORE_DB: Final = b"ftlayer"
_FORMAT_KEY: Final = b"format"
_NEXT_SEQ_KEY: Final = b"next_seq"
_STORED_KEY: Final = b"records"
_MAX_DBS: Final = 6
_DATA_FILE: Final = "data.mdb"

_INDEX: Final = struct.Struct("<II")  # count, flags
_STATE: Final = struct.Struct("<IIQ")  # live, overrides, live_bytes
_OVERRIDE: Final = np.dtype([("index", "<u4"), ("root", "<u8"), ("replay_seq", "<u8")])
_LISTED: Final = 1  # index flags bit 0: the chunk's seqs are listed
_MAX_CHUNK: Final = 0xFFFFFFFF  # record ends are u32
_MAX_SEQ: Final = 2**64 - 1

_T = TypeVar("_T")
log = logging.getLogger(__name__)

# LMDB corrupts an environment opened twice in one process. py-lmdb refuses the second
# open, but our read-only probe would report that as "not an LMDB environment"; tracking
# our own open stores lets us say what is really wrong.
_open_stores: weakref.WeakValueDictionary[tuple[int, int], LmdbStorage] = (
    weakref.WeakValueDictionary()
)


class LmdbStorage(PersistenceStorage):
    """Source records in an LMDB environment at `path` (a directory, created if missing).

    `map_size` is the initial map size in bytes; it doubles whenever a write needs more.
    `sync=False` trades durability of the last commits on an OS crash for speed (see the
    module docstring). `chunk_bytes` bounds the bytes of a chunk a put writes (a record
    larger than that is a chunk of its own). Raises NotAnLmdbEnvironment if `path` holds
    something that is not an ftlayer LMDB store, and StorageError if the store is
    already open in this process.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        map_size: int = DEFAULT_MAP_SIZE,
        sync: bool = True,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        if map_size < 1:
            raise ConfigError(f"map_size must be a positive number of bytes, got {map_size}")
        if not 0 < chunk_bytes <= _MAX_CHUNK:
            raise ConfigError(f"chunk_bytes must be 1 to {_MAX_CHUNK}, got {chunk_bytes}")
        self._path = os.fspath(path)
        self._chunk_bytes = chunk_bytes
        self._env: lmdb.Environment | None = None
        # One lock around every transaction: threads may share a store (a server's
        # deleter thread deletes while its core persists), and LMDB allows a map
        # resize only while this process has no transaction open.
        self._lock = threading.RLock()
        # stage_meta: meta writes (None: a delete) waiting for the next transaction,
        # under a lock of their own, so staging never waits for a transaction.
        self._staged: dict[bytes, bytes | None] = {}
        self._staged_deletes: list[NDArray[np.uint64]] = []  # seqs (stage_deletes)
        self._staged_since: float | None = None  # monotonic time of the oldest staged
        self._staged_lock = threading.Lock()
        # Reads in progress (a copy_to's too): they run outside _lock, beside a write
        # transaction, and a map resize, which LMDB forbids while a transaction of this
        # process is open, holds new ones back (_quiescing) and waits for these to end.
        self._readers = 0
        self._quiescing = False
        self._readers_changed = threading.Condition()
        # Puts waiting for a write transaction (group commit, see the module docstring).
        self._queued: list[_QueuedPut] = []
        self._queued_lock = threading.Lock()
        identity = _prepare_directory(self._path)
        try:
            env = lmdb.open(self._path, map_size=map_size, max_dbs=_MAX_DBS, sync=sync, subdir=True)
        except lmdb.Error as exc:
            raise StorageError(f"cannot open LMDB storage at {self._path}: {exc}") from exc
        self._env = env
        try:
            self._chunks, self._meta, self._store, self._next_seq = self._write(
                partial(_initialize, env, self._path, chunk_bytes), db=None
            )
        except BaseException:
            self._env = None
            env.close()
            raise
        _open_stores[identity] = self
        self._identity = identity

    @property
    def path(self) -> str:
        return self._path

    @property
    def map_size(self) -> int:
        """The current LMDB map size in bytes; it doubles whenever a write needs more."""
        return self._live_env().info()["map_size"]

    def __repr__(self) -> str:
        state = " (closed)" if self._env is None else ""
        return f"LmdbStorage({self._path!r}){state}"

    def put(self, batch: RecordBatch) -> NDArray[np.uint64]:
        """Store `batch` (see the contract); with other threads putting at once, in one
        transaction with theirs (group commit, see the module docstring): each put's
        batch is encoded in its own thread and written as its own chunk(s)."""
        self._live_env()
        if len(batch) == 0:
            return np.zeros(0, dtype=np.uint64)
        queued = _QueuedPut(len(batch), encode_chunk(batch))
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
            high_water = txn.get(_NEXT_SEQ_KEY, db=self._store)
            if high_water is not None and int.from_bytes(high_water, "big") > first:
                # Paranoid check: our seq counter is behind the store's high-water mark.
                raise StorageError(
                    f"{self._path}: seqs from {first} are already taken; the store was "
                    "written by someone else"
                )
            for queued, start in zip(group, starts, strict=True):
                assert queued.encoded is not None
                self._add_chunks(txn, start, *queued.encoded)
            txn.put(_NEXT_SEQ_KEY, _key(first + n), db=self._store)
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
            head = _Head.new(first + lo, ends[lo:hi] - start)
            data = blob if hi - lo == len(ends) else view[start : int(ends[hi - 1])]
            if not self._chunks.add(txn, head, data):
                raise StorageError(
                    f"{self._path}: a chunk from seq {first + lo} is already stored; "
                    "the store was written by someone else"
                )

    def delete(self, seqs: Seqs) -> int:
        self._live_env()
        found = as_seqs(seqs)
        if not len(found):
            return 0
        return self._write(partial(self._delete_in, seqs=found), db=None)

    def get(self, seqs: Seqs) -> RecordBatch:
        self._live_env()
        seq_array = as_seqs(seqs)
        order = np.argsort(seq_array, kind="stable")
        ordered = seq_array[order]
        first = _firsts(ordered)
        wanted = ordered[first]
        where = np.empty(len(seq_array), dtype=np.intp)  # each seq's place in `wanted`
        where[order] = np.cumsum(first) - 1
        read = self._read(partial(self._read_records, wanted), db=None, buffers=True)
        values = [read.values[i] for i in where.tolist()]
        check_stored(seq_array, values)
        batch, _ = read.decode(values, where)  # type: ignore[arg-type]  # checked: no None
        return batch

    def set_roots(
        self,
        seqs: Seqs,
        roots: NDArray[np.uint64] | Sequence[int],
        replay_seqs: NDArray[np.uint64] | Sequence[int],
    ) -> None:
        self._live_env()
        seq_array, root_array, replay_array = check_retag_columns(seqs, roots, replay_seqs)
        if len(seq_array) == 0:
            return
        wanted, last = _distinct_last(seq_array)  # a seq given twice: its last entry wins
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

    def scan(
        self, batch_size: int = 65536
    ) -> Iterator[tuple[NDArray[np.uint64], RecordBatch, NDArray[np.uint64]]]:
        self._live_env()
        check_batch_size(batch_size)
        return self._scan(batch_size)

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
            if len(read.seqs) < batch_size or int(read.seqs[-1]) == _MAX_SEQ:
                return
            start = int(read.seqs[-1]) + 1

    def get_meta(self, key: str) -> bytes | None:
        self._live_env()
        raw_key = encode_meta_key(key)
        with self._staged_lock:
            if raw_key in self._staged:
                return self._staged[raw_key]
        return self._read(lambda txn: txn.get(raw_key), db=self._meta)

    def put_meta(self, key: str, value: bytes) -> None:
        self._live_env()
        raw_key = encode_meta_key(key)
        if not isinstance(value, bytes | bytearray | memoryview):
            raise TypeError(f"meta values are bytes, got {type(value).__name__}")
        self._write(lambda txn: txn.put(raw_key, value), db=self._meta)

    def delete_meta(self, key: str) -> bool:
        self._live_env()
        raw_key = encode_meta_key(key)
        return bool(self._write(lambda txn: txn.delete(raw_key), db=self._meta))

    def update_meta(self, puts: Mapping[str, MetaValue], deletes: Sequence[str] = ()) -> None:
        self._live_env()
        raw_puts = [(encode_meta_key(key), value) for key, value in puts.items()]
        raw_deletes = [encode_meta_key(key) for key in deletes]
        for _, value in raw_puts:
            if not isinstance(value, bytes | bytearray | memoryview):
                raise TypeError(f"meta values are bytes, got {type(value).__name__}")

        def write(txn: lmdb.Transaction[bytes]) -> None:
            for key in raw_deletes:
                txn.delete(key)
            for key, value in raw_puts:
                txn.put(key, value)

        self._write(write, db=self._meta)

    def meta_keys(self, prefix: str = "") -> list[str]:
        self._live_env()
        raw = prefix.encode()

        def keys(txn: lmdb.Transaction[bytes]) -> list[str]:
            cursor = txn.cursor()
            found: list[str] = []
            if not cursor.set_range(raw):
                return found
            for key in cursor.iternext(keys=True, values=False):
                if not bytes(key).startswith(raw):
                    break
                found.append(bytes(key).decode())
            return found

        stored = self._read(keys, db=self._meta)
        with self._staged_lock:
            staged = {k.decode(): v for k, v in self._staged.items() if k.startswith(raw)}
        if not staged:
            return stored
        found = {key for key in stored if staged.get(key, b"") is not None}
        found.update(key for key, value in staged.items() if value is not None)
        return sorted(found, key=str.encode)

    def stage_meta(self, puts: Mapping[str, bytes], deletes: Sequence[str] = ()) -> None:
        """Committed with this store's next write transaction, whatever it writes (a
        persist, a delete, a meta update, `flush_staged`); until then not durable, but
        get_meta and meta_keys see them. Never waits for a transaction."""
        self._live_env()
        staged: dict[bytes, bytes | None] = {encode_meta_key(key): None for key in deletes}
        for key, value in puts.items():
            if not isinstance(value, bytes | bytearray | memoryview):
                raise TypeError(f"meta values are bytes, got {type(value).__name__}")
            staged[encode_meta_key(key)] = bytes(value)
        with self._staged_lock:
            self._staged.update(staged)
            if self._staged_since is None:
                self._staged_since = time.monotonic()

    def stage_deletes(self, seqs: Seqs) -> None:
        """Carried out by this store's next write transaction, whatever it writes (a
        put, above all: a record batch and the deletes of the records completed since
        the last one share one commit and one fsync), or `flush_staged`. Never waits
        for a transaction."""
        self._live_env()
        found = as_seqs(seqs)
        if not len(found):
            return
        with self._staged_lock:
            self._staged_deletes.append(found)
            if self._staged_since is None:
                self._staged_since = time.monotonic()

    @property
    def staged_deletes(self) -> int:
        with self._staged_lock:
            return sum(len(seqs) for seqs in self._staged_deletes)

    def flush_staged(self, older_than_s: float = 0.0) -> None:
        with self._staged_lock:
            since = self._staged_since
        if since is None or time.monotonic() - since < older_than_s:
            return
        self._write(lambda txn: None, db=self._meta)

    def copy_to(self, path: str | os.PathLike[str], *, compact: bool = True) -> None:
        """Write a consistent copy of the whole environment (records and meta) to the
        empty or new directory `path`: the state at the start of the copy (LMDB
        copies from one read transaction), staged meta entries and deletes included.
        Writes of this process go on meanwhile; only one that must grow the map
        waits for the copy to end."""
        env = self._live_env()
        target = os.fspath(path)
        os.makedirs(target, exist_ok=True)
        if os.listdir(target):
            raise StorageError(f"cannot copy LMDB storage into {target}: it is not empty")
        try:
            self.flush_staged()  # staged meta entries and deletes belong in the copy
            # A reader: a write of this process that fills the map waits for it to end
            # (_quiesce), since LMDB forbids a resize while its read transaction is open.
            with self._reading() as env:
                env.copy(target, compact=compact)  # py-lmdb releases the GIL meanwhile
        except lmdb.Error as exc:
            raise StorageError(
                f"could not copy LMDB storage at {self._path} to {target}: {exc}"
                f"{_write_hint(exc, target)}"
            ) from exc

    @property
    def next_seq(self) -> int:
        self._live_env()
        return self._next_seq

    def __len__(self) -> int:
        self._live_env()
        return self._read(partial(_stored, self._store), db=None)

    def size_bytes(self) -> int:
        """Size of data.mdb on disk (LMDB never shrinks it; freed pages are reused)."""
        self._live_env()
        return os.path.getsize(os.path.join(self._path, _DATA_FILE))

    def sync(self) -> None:
        self._live_env().sync(True)

    def close(self) -> None:
        """Commits what is staged (logged if that fails), then closes."""
        with self._lock:  # waits for a transaction of another thread to end
            if self._env is not None:
                try:
                    self.flush_staged()
                except StorageError as exc:
                    log.error("closing %s: staged writes not committed: %s", self._path, exc)
            env = self._env
            if env is None:
                return

            def shut() -> None:
                self._env = None
                env.close()

            self._quiesce(shut)  # a read of another thread ends first
            if _open_stores.get(self._identity) is self:
                del _open_stores[self._identity]

    @property
    def closed(self) -> bool:
        return self._env is None

    def _live_env(self) -> lmdb.Environment:
        if self._env is None:
            raise StorageError(f"LMDB storage at {self._path} is closed")
        return self._env

    def _write(
        self, work: Callable[[lmdb.Transaction[bytes]], _T], *, db: lmdb._Database | None
    ) -> _T:
        """Run `work` in one write transaction (default database `db`) and commit it.

        If the map is full, the transaction is aborted, the map doubled and `work` run
        again from the start, so it must not have effects outside the transaction.
        """
        with self._lock:
            env = self._live_env()
            while True:
                try:
                    with self._staged_lock:
                        staged = dict(self._staged)
                        deletes = list(self._staged_deletes)
                    with env.begin(db=db, write=True) as txn:
                        result = work(txn)
                        for key, value in staged.items():
                            if value is None:
                                txn.delete(key, db=self._meta)
                            else:
                                txn.put(key, value, db=self._meta)
                        if deletes:
                            self._delete_in(txn, np.concatenate(deletes))
                    if staged or deletes:
                        self._unstage(staged, deletes)
                    return result
                except lmdb.MapFullError:
                    self._quiesce(partial(env.set_mapsize, 2 * env.info()["map_size"]))
                except lmdb.MapResizedError:
                    # Another process grew the map: adopt its size.
                    self._quiesce(partial(env.set_mapsize, 0))
                except lmdb.Error as exc:
                    raise StorageError(
                        f"LMDB storage at {self._path}: {exc}{_write_hint(exc, self._path)}"
                    ) from exc

    def _delete_in(self, txn: lmdb.Transaction[bytes], seqs: NDArray[np.uint64]) -> int:
        """Delete the records `seqs` in `txn` (see `delete`); how many were stored."""
        ordered = np.sort(seqs)
        wanted = ordered[_firsts(ordered)]
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

    def _settle(self, txn: lmdb.Transaction[bytes], head: _Head) -> None:
        """Write a changed head: drop its chunk if nothing is stored there any more,
        compact it if the rules of the module docstring say so."""
        if head.live == 0:
            self._chunks.drop(txn, head.key)
        elif 4 * head.live_bytes < head.size or 4 * len(head.overrides) > head.live:
            self._compact(txn, head)
        else:
            txn.put(_key(head.key), head.encode_state(), db=self._chunks.state_db)

    def _compact(self, txn: lmdb.Transaction[bytes], head: _Head) -> None:
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
        compacted = _Head.new(head.key, np.cumsum(sizes), head.seqs[keep])
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
        stored = _stored(self._store, txn) + change
        txn.put(_STORED_KEY, stored.to_bytes(8, "big"), db=self._store)

    def _read_records(self, seqs: NDArray[np.uint64], txn: lmdb.Transaction[memoryview]) -> _Read:
        """The records `seqs` (sorted, distinct); None for a seq not stored."""
        found = _Read(seqs, [None] * len(seqs))
        for head, lo, hi in self._chunks.spans(txn, seqs):
            positions, stored = head.locate(seqs[lo:hi])
            if stored.any():
                blob = self._chunks.records_of(txn, head)
                found.add(blob, head, positions[stored], lo + np.flatnonzero(stored))
        return found

    def _read_from(self, start: int, limit: int, txn: lmdb.Transaction[memoryview]) -> _Read:
        """Up to `limit` stored records from seq `start` on, in seq order."""
        cursor = txn.cursor(db=self._chunks.index_db)
        if _floor(cursor, start) is None and not cursor.first():
            return _Read(np.zeros(0, dtype=np.uint64), [])
        seqs: list[NDArray[np.uint64]] = []
        found = _Read(np.zeros(0, dtype=np.uint64), [])
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

    def _quiesce(self, action: Callable[[], object]) -> None:
        """Run `action` (a map resize, the close) while no read is open (called under
        _lock, so no write is either): new reads wait, running ones end first."""
        with self._readers_changed:
            self._quiescing = True
            try:
                self._readers_changed.wait_for(lambda: self._readers == 0)
                action()
            finally:
                self._quiescing = False
                self._readers_changed.notify_all()

    @contextlib.contextmanager
    def _reading(self) -> Iterator[lmdb.Environment]:
        """The environment, counted as read by this thread until the block ends."""
        with self._readers_changed:
            self._readers_changed.wait_for(lambda: not self._quiescing)
            self._readers += 1
        try:
            yield self._live_env()
        finally:
            with self._readers_changed:
                self._readers -= 1
                self._readers_changed.notify_all()

    def _unstage(
        self, committed: Mapping[bytes, bytes | None], deletes: Sequence[NDArray[np.uint64]]
    ) -> None:
        """Forget the staged writes just committed, unless staged again since."""
        with self._staged_lock:
            for key, value in committed.items():
                if key in self._staged and self._staged[key] is value:
                    del self._staged[key]
            done = {id(seqs) for seqs in deletes}
            self._staged_deletes = [s for s in self._staged_deletes if id(s) not in done]
            if not self._staged and not self._staged_deletes:
                self._staged_since = None

    def _read(
        self,
        work: Callable[[lmdb.Transaction[Any]], _T],
        *,
        db: lmdb._Database | None,
        buffers: bool = False,
    ) -> _T:
        """Run `work` in one read transaction, beside any write (see the module
        docstring). With `buffers`, values are memoryviews into the map, valid only
        inside `work` (no copy of a chunk to read a record)."""
        while True:
            with self._reading() as env:
                try:
                    with env.begin(db=db, buffers=True) if buffers else env.begin(db=db) as txn:
                        return work(txn)
                except lmdb.MapResizedError:
                    pass  # resized below, once this read is no longer counted
                except lmdb.Error as exc:
                    raise StorageError(f"LMDB storage at {self._path}: {exc}") from exc
            with self._lock:  # another process grew the map: adopt its size
                self._quiesce(partial(self._live_env().set_mapsize, 0))


class _QueuedPut:
    """One put waiting for a group commit: its record count and its encoded chunk
    (`encode_chunk`), then its seqs or the error of the transaction (set under the
    store's write lock)."""

    __slots__ = ("encoded", "error", "n", "seqs")

    def __init__(self, n: int, encoded: tuple[bytes, NDArray[np.int64]]) -> None:
        self.n = n
        self.encoded: tuple[bytes, NDArray[np.int64]] | None = encoded
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


def is_open_in_process(path: str | os.PathLike[str]) -> bool:
    """Whether an LmdbStorage of this process has the environment at `path` open."""
    try:
        stat = os.stat(path)
    except OSError:
        return False
    return (stat.st_dev, stat.st_ino) in _open_stores


class _Head:
    """A chunk's head (layout in the module docstring), decoded; changed, then encoded.

    `seqs` (uint64), `ends` (int64: where each record ends in the chunk) and `deleted`
    (bool) have one entry per record of the chunk, `overrides` one per retagged record.
    The seqs of a chunk that does not list them are made only when asked for.
    """

    __slots__ = ("_seqs", "deleted", "ends", "key", "listed", "live", "live_bytes", "overrides")

    def __init__(
        self,
        key: int,
        seqs: NDArray[np.uint64] | None,
        ends: NDArray[np.int64],
        deleted: NDArray[np.bool_],
        overrides: NDArray[np.void],
        *,
        listed: bool,
        live: int,
        live_bytes: int,
    ) -> None:
        self.key = key
        self._seqs = seqs
        self.ends = ends
        self.deleted = deleted
        self.overrides = overrides
        self.listed = listed
        self.live = live
        self.live_bytes = live_bytes

    @classmethod
    def new(
        cls, key: int, ends: NDArray[np.int64], seqs: NDArray[np.uint64] | None = None
    ) -> _Head:
        """The head of a chunk as written: records ending at `ends`, none deleted, with
        `seqs` (increasing, from `key` on) or else key, key + 1, ..."""
        count = len(ends)
        if int(ends[-1]) > _MAX_CHUNK:
            raise StorageError(
                f"a record of {int(ends[-1]):,} bytes is more than the {_MAX_CHUNK:,} the "
                "record layout allows; nothing was stored"
            )
        listed = seqs is not None and (int(seqs[0]) != key or int(seqs[-1]) - key != count - 1)
        return cls(
            key,
            seqs if listed else None,
            ends.astype(np.int64, copy=False),
            np.zeros(count, dtype=np.bool_),
            np.zeros(0, dtype=_OVERRIDE),
            listed=listed,
            live=count,
            live_bytes=int(ends[-1]),
        )

    @classmethod
    def decode(cls, key: int, index: bytes | memoryview, state: bytes | memoryview) -> _Head:
        """The head of chunk `key` from its index and state values."""
        count, flags = _INDEX.unpack_from(index)
        live, n_overrides, live_bytes = _STATE.unpack_from(state)
        listed = bool(flags & _LISTED)
        mask_bytes = (count + 7) // 8
        if len(index) != _INDEX.size + (12 if listed else 4) * count or len(state) != (
            _STATE.size + mask_bytes + n_overrides * _OVERRIDE.itemsize
        ):
            raise StorageError(f"the head of chunk {key} is malformed: storage corrupt")
        at = _INDEX.size
        seqs = None
        if listed:
            seqs = np.frombuffer(index, dtype="<u8", count=count, offset=at).astype(np.uint64)
            at += 8 * count
        ends = np.frombuffer(index, dtype="<u4", count=count, offset=at).astype(np.int64)
        mask = np.frombuffer(state, dtype=np.uint8, count=mask_bytes, offset=_STATE.size)
        deleted = np.unpackbits(mask, count=count, bitorder="little").view(np.bool_)
        overrides = np.frombuffer(
            state, dtype=_OVERRIDE, count=n_overrides, offset=_STATE.size + mask_bytes
        ).copy()
        return cls(
            key, seqs, ends, deleted, overrides, listed=listed, live=live, live_bytes=live_bytes
        )

    def encode_index(self) -> bytes:
        fixed = _INDEX.pack(len(self.ends), _LISTED if self.listed else 0)
        seqs = self.seqs.astype("<u8").tobytes() if self.listed else b""
        return fixed + seqs + self.ends.astype("<u4").tobytes()

    def encode_state(self) -> bytes:
        tally = _STATE.pack(self.live, len(self.overrides), self.live_bytes)
        mask = np.packbits(self.deleted, bitorder="little")
        return tally + mask.tobytes() + self.overrides.tobytes()

    @property
    def seqs(self) -> NDArray[np.uint64]:
        """The chunk's seqs, increasing."""
        if self._seqs is None:
            self._seqs = np.arange(self.key, self.key + len(self.ends), dtype=np.uint64)
        return self._seqs

    @property
    def last(self) -> int:
        """The chunk's last seq (stored or not)."""
        return int(self.seqs[-1]) if self.listed else self.key + len(self.ends) - 1

    @property
    def size(self) -> int:
        """The chunk's bytes."""
        return int(self.ends[-1])

    def bounds(self, positions: NDArray[np.intp]) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """Where the records `positions` start and end in the chunk."""
        ends = self.ends[positions]
        starts = np.where(positions > 0, self.ends[positions - 1], 0)
        return starts, ends

    def locate(self, seqs: NDArray[np.uint64]) -> tuple[NDArray[np.intp], NDArray[np.bool_]]:
        """The positions of `seqs` (between the key and the last seq) in the chunk, and
        which of them are records stored (in the chunk and not deleted)."""
        count = len(self.ends)
        if self.listed:
            positions = np.searchsorted(self.seqs, seqs).clip(max=count - 1)
            here = self.seqs[positions] == seqs
        else:
            positions = (seqs - np.uint64(self.key)).astype(np.intp)
            here = positions < count
            positions = positions.clip(max=count - 1)
        return positions, here & ~self.deleted[positions]

    def remove(self, positions: NDArray[np.intp]) -> None:
        """Mark the stored records `positions` (distinct) deleted."""
        starts, ends = self.bounds(positions)
        self.deleted[positions] = True
        self.live -= len(positions)
        self.live_bytes -= int((ends - starts).sum())
        if len(self.overrides):
            self.overrides = self.overrides[~np.isin(self.overrides["index"], positions)]

    def retag(
        self, positions: NDArray[np.intp], roots: NDArray[np.uint64], replays: NDArray[np.uint64]
    ) -> None:
        """Give the records `positions` (distinct) these tags (override entries)."""
        new = np.empty(len(positions), dtype=_OVERRIDE)
        new["index"] = positions
        new["root"] = roots
        new["replay_seq"] = replays
        merged = np.concatenate([self.overrides, new])
        _, newest = _distinct_last(merged["index"])
        self.overrides = merged[newest]

    def tags_of(
        self, positions: NDArray[np.intp]
    ) -> tuple[NDArray[np.intp], NDArray[np.uint64], NDArray[np.uint64]]:
        """Which of `positions` have an override entry, and its root and replay seq."""
        if not len(self.overrides):
            empty = np.zeros(0, dtype=np.uint64)
            return np.zeros(0, dtype=np.intp), empty, empty
        index = self.overrides["index"]
        at = np.searchsorted(index, positions).clip(max=len(index) - 1)
        tagged = np.flatnonzero(index[at] == positions)
        entries = self.overrides[at[tagged]]
        return tagged, entries["root"].astype(np.uint64), entries["replay_seq"].astype(np.uint64)


class _Read:
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
        head: _Head,
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


class _Chunks(NamedTuple):
    """The sub-databases of the chunks (see the module docstring), and what is done to
    a chunk there."""

    records_db: lmdb._Database
    index_db: lmdb._Database
    state_db: lmdb._Database

    def add(self, txn: lmdb.Transaction[Any], head: _Head, data: bytes | memoryview) -> bool:
        """Store a new chunk, keyed above every other; False (nothing written) if not."""
        key = _key(head.key)
        if not txn.put(key, data, append=True, db=self.records_db):
            return False  # append=True refuses a key that is not above the last one
        txn.put(key, head.encode_index(), append=True, db=self.index_db)
        txn.put(key, head.encode_state(), append=True, db=self.state_db)
        return True

    def replace(self, txn: lmdb.Transaction[Any], head: _Head, data: bytes) -> None:
        key = _key(head.key)
        txn.put(key, data, db=self.records_db)
        txn.put(key, head.encode_index(), db=self.index_db)
        txn.put(key, head.encode_state(), db=self.state_db)

    def drop(self, txn: lmdb.Transaction[Any], key: int) -> None:
        for db in self:
            txn.delete(_key(key), db=db)

    def records_of(self, txn: lmdb.Transaction[Any], head: _Head) -> bytes | memoryview:
        """The value of `head`'s chunk (a view into the map in a buffers transaction)."""
        data: bytes | memoryview | None = txn.get(_key(head.key), db=self.records_db)
        if data is None or len(data) != head.size:
            raise StorageError(
                f"the records of chunk {head.key} are missing or of the wrong size: storage corrupt"
            )
        return data

    def head_at(self, txn: lmdb.Transaction[Any], cursor: lmdb.Cursor[Any]) -> _Head:
        """The head of the chunk an index cursor is on."""
        key = cursor.key()
        state = txn.get(key, db=self.state_db)
        if state is None:
            raise StorageError(f"chunk {bytes(key).hex()} has no state: storage corrupt")
        return _Head.decode(int.from_bytes(key, "big"), cursor.value(), state)

    def spans(
        self, txn: lmdb.Transaction[Any], seqs: NDArray[np.uint64]
    ) -> Iterator[tuple[_Head, int, int]]:
        """The chunks that `seqs` (sorted, distinct) may be in, with the range [lo, hi)
        of `seqs` between each one's key and last seq."""
        cursor = txn.cursor(db=self.index_db)
        i, n = 0, len(seqs)
        while i < n:
            seq = int(seqs[i])
            if _floor(cursor, seq) is not None:
                head = self.head_at(txn, cursor)
                if seq <= head.last:
                    hi = int(np.searchsorted(seqs, head.last, side="right"))
                    yield head, i, hi
                    i = hi
                    continue
            # seq is in no chunk: go on from the next chunk's key.
            if seq == _MAX_SEQ or not cursor.set_range(_key(seq + 1)):
                return
            i = int(np.searchsorted(seqs, int.from_bytes(cursor.key(), "big")))


def _firsts(ordered: NDArray[Any]) -> NDArray[np.bool_]:
    """Which entries of `ordered` (sorted) differ from the one before."""
    first = np.ones(len(ordered), dtype=np.bool_)
    first[1:] = ordered[1:] != ordered[:-1]
    return first


def _distinct_last(values: NDArray[Any]) -> tuple[NDArray[Any], NDArray[np.intp]]:
    """The distinct `values`, increasing, and where each occurs last in `values`.

    (np.unique would do, but numpy 2 finds distinct values by hashing, several times
    slower than this sort on the seqs of a batch.)"""
    order = np.argsort(values, kind="stable")  # equal values keep their order
    ordered = values[order]
    last = np.ones(len(values), dtype=np.bool_)
    last[:-1] = ordered[1:] != ordered[:-1]
    return ordered[last], order[last]


def _floor(cursor: lmdb.Cursor[Any], seq: int) -> int | None:
    """The last key at or below `seq`, the cursor left on it; None if there is none."""
    key = _key(seq)
    if cursor.set_range(key):
        if cursor.key() == key:
            return seq
        if not cursor.prev():
            return None
    elif not cursor.last():
        return None
    return int.from_bytes(cursor.key(), "big")


def _key(seq: int) -> bytes:
    """The LMDB key of a seq: 8 bytes big-endian, so byte order is seq order."""
    return seq.to_bytes(8, "big")


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


def _stored(store: lmdb._Database, txn: lmdb.Transaction[bytes]) -> int:
    """The count of stored records."""
    raw = txn.get(_STORED_KEY, db=store)
    return 0 if raw is None else int.from_bytes(raw, "big")


def _initialize(
    env: lmdb.Environment, path: str, chunk_bytes: int, txn: lmdb.Transaction[bytes]
) -> tuple[_Chunks, lmdb._Database, lmdb._Database, int]:
    """Open (creating on first use) the sub-databases; mark a new store, convert a v1
    store; find the next seq."""
    # (py-lmdb's stubs declare Transaction.env, but the C extension has no such attribute.)
    chunks = _Chunks(*(env.open_db(name, txn=txn) for name in (_CHUNKS_DB, _INDEX_DB, _STATE_DB)))
    meta = env.open_db(_META_DB, txn=txn)
    store = env.open_db(_STORE_DB, txn=txn)
    marker = txn.get(_FORMAT_KEY, db=store)
    if marker is None:
        txn.put(_FORMAT_KEY, FORMAT_MARKER, db=store)
    elif marker == _V1_MARKER:
        converted = _convert_v1(env, txn, chunks, chunk_bytes)
        txn.put(_STORED_KEY, converted.to_bytes(8, "big"), db=store)
        txn.put(_FORMAT_KEY, FORMAT_MARKER, db=store)
        log.info("%s: %d records of format %r converted to chunks", path, converted, _V1_MARKER)
    elif marker != FORMAT_MARKER:  # paranoid: _check_ours refused it before
        raise StorageError(f"{path} is an ftlayer store of format {marker!r}")
    high_water = txn.get(_NEXT_SEQ_KEY, db=store)
    next_seq = 1 if high_water is None else int.from_bytes(high_water, "big")
    cursor = txn.cursor(chunks.index_db)
    if cursor.last():
        next_seq = max(next_seq, chunks.head_at(txn, cursor).last + 1)
    return chunks, meta, store, next_seq


def _convert_v1(
    env: lmdb.Environment, txn: lmdb.Transaction[bytes], chunks: _Chunks, chunk_bytes: int
) -> int:
    """Move the records of a v1 store (one value per seq) into chunks of up to
    `chunk_bytes` under the same seqs, in `txn`, and drop the v1 sub-database; returns
    how many records moved."""
    records = env.open_db(_RECORDS_DB, txn=txn, create=False)
    keys: list[bytes] = []
    values: list[bytes] = []
    moved = 0

    def add_chunk() -> None:
        seqs = np.frombuffer(b"".join(keys), dtype=">u8").astype(np.uint64)
        ends = np.cumsum(np.fromiter(map(len, values), dtype=np.int64, count=len(values)))
        chunks.add(txn, _Head.new(int(seqs[0]), ends, seqs), b"".join(values))

    size = 0
    for key, value in txn.cursor(db=records):
        if keys and size + len(value) > chunk_bytes:
            add_chunk()
            keys, values, size = [], [], 0
        keys.append(key)
        values.append(value)
        size += len(value)
        moved += 1
    if keys:
        add_chunk()
    txn.drop(records, delete=True)
    return moved


def _prepare_directory(path: str) -> tuple[int, int]:
    """Make sure `path` is a new or an ftlayer LMDB directory without writing to it if not.

    Returns the directory's identity (device, inode). Creates the directory if missing.
    """
    try:
        if os.path.exists(path) and not os.path.isdir(path):
            raise NotAnLmdbEnvironment(
                f"{path} is a file, not an LMDB environment (a directory holding data.mdb); "
                "left untouched"
            )
        data_file = os.path.join(path, _DATA_FILE)
        if os.path.isdir(path) and not os.path.exists(data_file) and os.listdir(path):
            raise NotAnLmdbEnvironment(
                f"{path} is not an LMDB environment: it holds files but no {_DATA_FILE}; "
                "left untouched"
            )
        os.makedirs(path, exist_ok=True)
        stat = os.stat(path)
    except OSError as exc:
        raise StorageError(f"cannot open LMDB storage at {path}: {exc}") from exc
    identity = (stat.st_dev, stat.st_ino)
    if identity in _open_stores:
        raise StorageError(f"LMDB storage at {path} is already open in this process")
    if os.path.exists(data_file):
        _check_ours(path)
    return identity


def _check_ours(path: str) -> None:
    """Raise unless the LMDB environment at `path` is an ftlayer store (or empty).

    Opened read-only and without the lock (MDB_NOLOCK) so that nothing is created or
    changed in a directory that turns out not to be ours.
    """
    try:
        probe = lmdb.open(path, readonly=True, lock=False, create=False, max_dbs=_MAX_DBS)
    except lmdb.Error as exc:
        raise NotAnLmdbEnvironment(
            f"{path} is not an LMDB environment: LMDB cannot read its {_DATA_FILE} ({exc}); "
            "left untouched"
        ) from exc
    try:
        with probe.begin() as txn:
            if txn.stat()["entries"] == 0:
                return
            try:
                store = probe.open_db(_STORE_DB, txn=txn, create=False)
                marker = txn.get(_FORMAT_KEY, db=store)
            except lmdb.Error:
                marker = None
    except lmdb.Error as exc:
        raise NotAnLmdbEnvironment(
            f"{path} is not a readable LMDB environment ({exc}); left untouched"
        ) from exc
    finally:
        probe.close()
    if marker is None:
        raise NotAnLmdbEnvironment(
            f"{path} is an LMDB environment but not an ftlayer store (no format marker); "
            "left untouched"
        )
    if marker not in (FORMAT_MARKER, _V1_MARKER):
        raise StorageError(
            f"{path} is an ftlayer store of format {marker!r}; this version reads "
            f"{FORMAT_MARKER!r} (and converts {_V1_MARKER!r}): open it with the ftlayer "
            "version that wrote it. Left untouched"
        )


def _write_hint(exc: lmdb.Error, path: str) -> str:
    """What a failed write most likely means: LMDB reports a write the disk (or a file
    size limit) refused as an I/O error."""
    text = str(exc)
    if "Input/output error" not in text and "No space" not in text:
        return ""
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return " (the disk may be full)"
    return (
        f" (the disk may be full, or a file size limit reached: {free:,} bytes free "
        "on its filesystem); nothing of this write was stored"
    )
