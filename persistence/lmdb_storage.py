"""The LMDB persistence storage: the default, durable `PersistenceStorage`.

One LMDB environment (a directory holding data.mdb and lock.mdb) with three named
sub-databases:

| sub-database | key                       | value                                         |
|--------------|---------------------------|-----------------------------------------------|
| `records`    | seq, 8 bytes big-endian   | the record value (layout in `base`)           |
| `meta`       | UTF-8 meta key            | the caller's bytes (`put_meta`)               |
| `ftlayer`    | `format`, `next_seq`      | format marker; seq high-water mark, 8 bytes BE |

Big-endian seq keys sort in seq order, and seqs only grow, so every `put` appends at the
right edge of the B-tree (`putmulti(append=True)` skips the key search) and deletes of
records completed in roughly put order touch neighbouring pages. The high-water mark is
written in the same transaction as the records it covers, so a seq is never reused even
after every record was deleted; on open the next seq is the larger of it and the last
key + 1.

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
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from itertools import chain, islice
from typing import Final, TypeVar

import lmdb
import numpy as np
from numpy.typing import NDArray

from ftlayer.errors import ConfigError, NotAnLmdbEnvironment, StorageError
from ftlayer.records import RecordBatch

from .base import (
    MetaValue,
    PersistenceStorage,
    Seqs,
    as_seqs,
    check_batch_size,
    check_retag_columns,
    check_stored,
    decode_records,
    encode_meta_key,
    encode_records,
    retag_records,
)

FORMAT_MARKER: Final = b"ftlayer-lmdb-v1"
DEFAULT_MAP_SIZE: Final = 64 * 1024 * 1024

_RECORDS_DB: Final = b"records"
_META_DB: Final = b"meta"
_STORE_DB: Final = b"ftlayer"
_FORMAT_KEY: Final = b"format"
_NEXT_SEQ_KEY: Final = b"next_seq"
_MAX_DBS: Final = 3
_DATA_FILE: Final = "data.mdb"

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
    module docstring). Raises NotAnLmdbEnvironment if `path` holds something that is not
    an ftlayer LMDB store, and StorageError if the store is already open in this process.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        map_size: int = DEFAULT_MAP_SIZE,
        sync: bool = True,
    ) -> None:
        if map_size < 1:
            raise ConfigError(f"map_size must be a positive number of bytes, got {map_size}")
        self._path = os.fspath(path)
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
            self._records, self._meta, self._store, self._next_seq = self._write(
                partial(_initialize, env), db=None
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
        transaction with theirs (group commit, see the module docstring)."""
        self._live_env()
        if len(batch) == 0:
            return np.zeros(0, dtype=np.uint64)
        queued = _QueuedPut(encode_records(batch))
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
        sizes = [len(queued.values) for queued in group]
        n = sum(sizes)
        first = self._next_seq
        keys = _keys(np.arange(first, first + n, dtype=np.uint64))
        next_seq = (first + n).to_bytes(8, "big")
        store = self._store

        def write(txn: lmdb.Transaction[bytes]) -> None:
            values = chain.from_iterable(queued.values for queued in group)
            _, added = txn.cursor().putmulti(zip(keys, values, strict=True), append=True)
            if added != n:
                # Paranoid check: append=True silently skips a key that is not above the
                # last one, which would mean our seq counter is behind the stored records.
                raise StorageError(
                    f"{self._path}: stored {added} of {n} records: seqs from {first} are "
                    "already taken; the store was written by someone else"
                )
            txn.put(_NEXT_SEQ_KEY, next_seq, db=store)

        try:
            self._write(write, db=self._records)
        except BaseException as exc:
            for queued in group:  # each thread raises its own (a traceback is per raise)
                queued.error = exc if len(group) == 1 else _shared_error(exc, len(group))
            return
        self._next_seq = first + n
        for queued, start in zip(group, np.cumsum([first, *sizes[:-1]]).tolist(), strict=True):
            queued.seqs = np.arange(start, start + len(queued.values), dtype=np.uint64)
            queued.values = []

    def delete(self, seqs: Seqs) -> int:
        self._live_env()
        keys = _keys(np.sort(as_seqs(seqs)))
        if not keys:
            return 0
        return self._write(lambda txn: sum(map(txn.delete, keys)), db=self._records)

    def get(self, seqs: Seqs) -> RecordBatch:
        self._live_env()
        seq_array = as_seqs(seqs)
        keys = _keys(seq_array)
        values = self._read(lambda txn: list(map(txn.get, keys)), db=self._records)
        check_stored(seq_array, values)
        return decode_records(values)[0]  # type: ignore[arg-type]  # checked: no None

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
        keys = _keys(seq_array)

        def write(txn: lmdb.Transaction[bytes]) -> None:
            old = list(map(txn.get, keys))
            check_stored(seq_array, old)
            new = retag_records(old, root_array, replay_array)  # type: ignore[arg-type]
            txn.cursor().putmulti(zip(keys, new, strict=True))

        self._write(write, db=self._records)

    def scan(
        self, batch_size: int = 65536
    ) -> Iterator[tuple[NDArray[np.uint64], RecordBatch, NDArray[np.uint64]]]:
        self._live_env()
        check_batch_size(batch_size)
        return self._scan(batch_size)

    def _scan(
        self, batch_size: int
    ) -> Iterator[tuple[NDArray[np.uint64], RecordBatch, NDArray[np.uint64]]]:
        # One read transaction per chunk, closed before the chunk is yielded: a reader
        # held open across yields would stop LMDB from reusing freed pages and block
        # map growth for as long as the caller takes.
        start = bytes(8)
        while True:
            items = self._read(partial(_read_chunk, start, batch_size), db=self._records)
            if not items:
                return
            keys, values = zip(*items, strict=True)
            seqs = np.frombuffer(b"".join(keys), dtype=">u8").astype(np.uint64)
            batch, replay_seqs = decode_records(values)
            yield seqs, batch, replay_seqs
            if len(items) < batch_size:
                return
            start = (int(seqs[-1]) + 1).to_bytes(8, "big")

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
        return self._read(lambda txn: txn.stat(self._records)["entries"], db=None)

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
                            seqs = np.sort(np.concatenate(deletes))
                            remove = partial(txn.delete, db=self._records)
                            sum(map(remove, _keys(seqs)))
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
        self, work: Callable[[lmdb.Transaction[bytes]], _T], *, db: lmdb._Database | None
    ) -> _T:
        """Run `work` in one read transaction, beside any write (see the module
        docstring)."""
        while True:
            with self._reading() as env:
                try:
                    with env.begin(db=db) as txn:
                        return work(txn)
                except lmdb.MapResizedError:
                    pass  # resized below, once this read is no longer counted
                except lmdb.Error as exc:
                    raise StorageError(f"LMDB storage at {self._path}: {exc}") from exc
            with self._lock:  # another process grew the map: adopt its size
                self._quiesce(partial(self._live_env().set_mapsize, 0))


class _QueuedPut:
    """One put waiting for a group commit: its encoded records, then its seqs or the
    error of the transaction (set under the store's write lock)."""

    __slots__ = ("error", "seqs", "values")

    def __init__(self, values: list[bytes]) -> None:
        self.values = values
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


def _keys(seqs: NDArray[np.uint64]) -> list[bytes]:
    """LMDB keys of `seqs`: 8 bytes big-endian each, so byte order is seq order."""
    keys: list[bytes] = seqs.astype(">u8").view("V8").tolist()
    return keys


def _read_chunk(
    start: bytes, limit: int, txn: lmdb.Transaction[bytes]
) -> list[tuple[bytes, bytes]]:
    """Up to `limit` (key, value) pairs from key `start` on."""
    cursor = txn.cursor()
    if not cursor.set_range(start):
        return []
    return list(islice(cursor.iternext(), limit))


def _initialize(
    env: lmdb.Environment, txn: lmdb.Transaction[bytes]
) -> tuple[lmdb._Database, lmdb._Database, lmdb._Database, int]:
    """Open (creating on first use) the sub-databases; mark a new store; find the next seq."""
    # (py-lmdb's stubs declare Transaction.env, but the C extension has no such attribute.)
    records = env.open_db(_RECORDS_DB, txn=txn)
    meta = env.open_db(_META_DB, txn=txn)
    store = env.open_db(_STORE_DB, txn=txn)
    if txn.get(_FORMAT_KEY, db=store) is None:
        txn.put(_FORMAT_KEY, FORMAT_MARKER, db=store)
    high_water = txn.get(_NEXT_SEQ_KEY, db=store)
    next_seq = 1 if high_water is None else int.from_bytes(high_water, "big")
    cursor = txn.cursor(records)
    if cursor.last():
        next_seq = max(next_seq, int.from_bytes(cursor.key(), "big") + 1)
    return records, meta, store, next_seq


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
    if marker != FORMAT_MARKER:
        raise StorageError(
            f"{path} is an ftlayer store of format {marker!r}; this version reads "
            f"{FORMAT_MARKER!r}. Left untouched"
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
