"""The environment of an LMDB store: its transactions, their locks, map growth, staged
writes, copies and close.

`LmdbEnvironment` is the base of `LmdbStorage` (lmdb_storage): it opens the environment
(lmdb_open), and the write path (lmdb_writes), the read path (lmdb_reads) and the meta
entries (lmdb_meta) run their work through its `_write` and `_read`.

Transactions
------------
- `_write(work)`: write transactions run one at a time, under `_lock` (LMDB has one
  writer). What `stage_meta` and `stage_deletes` left staged rides on the next one,
  whatever it writes: in the same transaction, after `work`, and forgotten once it
  commits (unless staged again meanwhile); a staged meta entry whose key `work`
  itself writes is older than that write and is dropped instead (`supersedes`).
- The map grows by itself: a transaction that fills the map is aborted, the map size
  doubled, and the whole transaction run again from the start, so every operation stays
  all-or-nothing (and `work` must have no effect outside its transaction). A map that
  another process grew is adopted.
- `_read(work)`: reads (get, scan, meta, len, copy_to) take no lock of the writer's:
  LMDB readers see the last commit and never wait for a write transaction. Only a map
  resize, which LMDB allows while no transaction of this process is open, holds new
  reads back and waits for running ones (a copy_to included) to end (`_quiesce`).

Durability: with `sync=True` (the default) every commit is on disk when the call returns.
With `sync=False` a commit is atomic but may be lost to an OS crash until `sync()`.
Meta entries and deletes staged with `stage_meta` and `stage_deletes` ride on the next
transaction instead of a commit (and sync) of their own: done once any later write
commits, or `flush_staged`; until then a crash loses them (a staged delete is then
replayed after the restart: a duplicate, never a loss).

Costs: a write transaction is one commit, and with `sync=True` one fsync, however much
rides on it; a read is one read transaction and two turns of the readers' condition;
staging is a list append or dict update under `_staged_lock`, never a transaction.

Threads: every method is thread-safe. `_lock` (reentrant) serializes write transactions,
map resizes and close; `_staged_lock` guards the staged writes and is held only to copy
or change them; `_readers_changed` counts the reads in progress for `_quiesce`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from functools import partial
from typing import Any, TypeVar

import lmdb
import numpy as np
from numpy.typing import NDArray

from ftlayer.errors import ConfigError, StorageError

from .base import PersistenceStorage
from .lmdb_layout import DATA_FILE, MAX_CHUNK, MAX_DBS
from .lmdb_open import initialize_store, open_stores, prepare_directory

__all__ = ["LmdbEnvironment"]

_T = TypeVar("_T")
log = logging.getLogger("ftlayer.persistence.lmdb_storage")  # one logger for the store


class LmdbEnvironment(PersistenceStorage):
    """An open LMDB store and its transactions; see the module docstring.

    Opens the environment at `path` (lmdb_open) with the options `LmdbStorage`
    documents. Abstract: `LmdbStorage` adds the records and the meta entries.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        map_size: int,
        sync: bool,
        chunk_bytes: int,
    ) -> None:
        if map_size < 1:
            raise ConfigError(f"map_size must be a positive number of bytes, got {map_size}")
        if not 0 < chunk_bytes <= MAX_CHUNK:
            raise ConfigError(f"chunk_bytes must be 1 to {MAX_CHUNK}, got {chunk_bytes}")
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
        self._commits = 0  # write transactions committed (`commits`)
        # Reads in progress (a copy_to's too): they run outside _lock, beside a write
        # transaction, and a map resize, which LMDB forbids while a transaction of this
        # process is open, holds new ones back (_quiescing) and waits for these to end.
        self._readers = 0
        self._quiescing = False
        self._readers_changed = threading.Condition()
        identity = prepare_directory(self._path)
        try:
            env = lmdb.open(self._path, map_size=map_size, max_dbs=MAX_DBS, sync=sync, subdir=True)
        except lmdb.Error as exc:
            raise StorageError(f"cannot open LMDB storage at {self._path}: {exc}") from exc
        self._env = env
        try:
            self._chunks, self._meta, self._store, self._next_seq = self._write(
                partial(initialize_store, env, self._path, chunk_bytes), db=None
            )
        except BaseException:
            self._env = None
            env.close()
            raise
        open_stores[identity] = self
        self._identity = identity

    @property
    def path(self) -> str:
        return self._path

    @property
    def map_size(self) -> int:
        """The current LMDB map size in bytes; it doubles whenever a write needs more."""
        return self._live_env().info()["map_size"]

    def _stage_deletes(self, seqs: NDArray[np.uint64]) -> None:
        """Carried out by this store's next write transaction, whatever it writes (a
        put, above all: a record batch and the deletes of the records completed since
        the last one share one commit and one fsync), or `flush_staged`. Never waits
        for a transaction."""
        with self._staged_lock:
            self._staged_deletes.append(seqs)
            if self._staged_since is None:
                self._staged_since = time.monotonic()

    @property
    def staged_deletes(self) -> int:
        with self._staged_lock:
            return sum(len(seqs) for seqs in self._staged_deletes)

    @property
    def staged_since(self) -> float | None:
        with self._staged_lock:
            return self._staged_since

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

    def size_bytes(self) -> int:
        """Size of data.mdb on disk (LMDB never shrinks it; freed pages are reused)."""
        self._live_env()
        return os.path.getsize(os.path.join(self._path, DATA_FILE))

    def sync(self) -> None:
        self._live_env().sync(True)

    @property
    def commits(self) -> int:
        return self._commits

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
            if open_stores.get(self._identity) is self:
                del open_stores[self._identity]

    @property
    def closed(self) -> bool:
        return self._env is None

    def _check_open(self) -> None:
        self._live_env()

    def _live_env(self) -> lmdb.Environment:
        if self._env is None:
            raise StorageError(f"LMDB storage at {self._path} is closed")
        return self._env

    @abstractmethod
    def _delete_in(self, txn: lmdb.Transaction[bytes], seqs: NDArray[np.uint64]) -> int:
        """Delete the records `seqs` in `txn`; how many were stored (the write path's,
        lmdb_writes: `_write` carries out the staged deletes with it)."""

    def _write(
        self,
        work: Callable[[lmdb.Transaction[bytes]], _T],
        *,
        db: lmdb._Database | None,
        supersedes: Collection[bytes] = (),
    ) -> _T:
        """Run `work` in one write transaction (default database `db`) and commit it.

        If the map is full, the transaction is aborted, the map doubled and `work` run
        again from the start, so it must not have effects outside the transaction.
        `supersedes`: meta keys `work` writes; a value or delete staged for one of them
        is older than that write, so it is left out of the transaction and forgotten
        once it commits (a staged delete of a key a later write stores again never
        undoes that write).
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
                            if key in supersedes:
                                continue
                            if value is None:
                                txn.delete(key, db=self._meta)
                            else:
                                txn.put(key, value, db=self._meta)
                        if deletes:
                            self._delete_in(txn, np.concatenate(deletes))
                    self._commits += 1
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
