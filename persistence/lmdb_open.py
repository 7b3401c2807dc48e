"""Opening an LMDB store: refuse what is not ours without writing to it, then find where
the store stands.

Opening never writes into something that is not ours. A path that is a file, a
non-empty directory without data.mdb, a data.mdb that LMDB cannot read, or an LMDB
environment without our format marker raises NotAnLmdbEnvironment and leaves the path
byte-for-byte untouched: an existing data.mdb is first probed read-only without the lock
file (LMDB would otherwise create lock.mdb before reading data.mdb). The one exception is
an LMDB environment whose main database is empty, which is what a crash between creating
a store and its first commit leaves behind: it becomes a store.

How `LmdbEnvironment` (lmdb_env) opens a store:

1. `prepare_directory`: the path is refused unless it is missing, an empty directory or
   an ftlayer store (`_check_ours`); a store this process has open already is refused
   too; then the directory is created if missing.
2. lmdb.open, then `initialize_store` in the first write transaction: the
   sub-databases opened (created on first use), a new store marked with the format
   marker, a v1 store converted to chunks (in that same transaction: all of it or
   nothing), the next seq found: the larger of the high-water mark and the last
   chunk's last seq + 1.
3. The store is entered in `open_stores` until it closes.

LMDB corrupts an environment opened twice in one process. py-lmdb refuses the second
open, but our read-only probe would report that as "not an LMDB environment"; tracking
our own open stores (`open_stores`, by the directory's device and inode) lets us say
what is really wrong, and lets a savepoint refuse to replace a store that is open
(`is_open_in_process`).

Costs: the cold path. A probe opens the environment once more, read-only; converting a
v1 store reads and writes every record once.

Threads: `open_stores` has no lock of its own; opening and closing one path from two
threads at once is not supported.
"""

from __future__ import annotations

import logging
import os
import weakref

import lmdb
import numpy as np

from ftlayer.errors import NotAnLmdbEnvironment, StorageError

from .base import PersistenceStorage
from .lmdb_layout import (
    CHUNKS_DB,
    DATA_FILE,
    FORMAT_KEY,
    FORMAT_MARKER,
    INDEX_DB,
    MAX_DBS,
    META_DB,
    NEXT_SEQ_KEY,
    RECORDS_DB,
    STATE_DB,
    STORE_DB,
    STORED_KEY,
    V1_MARKER,
    ChunkHead,
    Chunks,
)

__all__ = ["initialize_store", "is_open_in_process", "open_stores", "prepare_directory"]

log = logging.getLogger("ftlayer.persistence.lmdb_storage")  # one logger for the store

# The stores open in this process, by their directory's (device, inode).
open_stores: weakref.WeakValueDictionary[tuple[int, int], PersistenceStorage] = (
    weakref.WeakValueDictionary()
)


def prepare_directory(path: str) -> tuple[int, int]:
    """Make sure `path` is a new or an ftlayer LMDB directory without writing to it if not.

    Returns the directory's identity (device, inode). Creates the directory if missing.
    """
    try:
        if os.path.exists(path) and not os.path.isdir(path):
            raise NotAnLmdbEnvironment(
                f"{path} is a file, not an LMDB environment (a directory holding data.mdb); "
                "left untouched"
            )
        data_file = os.path.join(path, DATA_FILE)
        if os.path.isdir(path) and not os.path.exists(data_file) and os.listdir(path):
            raise NotAnLmdbEnvironment(
                f"{path} is not an LMDB environment: it holds files but no {DATA_FILE}; "
                "left untouched"
            )
        os.makedirs(path, exist_ok=True)
        stat = os.stat(path)
    except OSError as exc:
        raise StorageError(f"cannot open LMDB storage at {path}: {exc}") from exc
    identity = (stat.st_dev, stat.st_ino)
    if identity in open_stores:
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
        probe = lmdb.open(path, readonly=True, lock=False, create=False, max_dbs=MAX_DBS)
    except lmdb.Error as exc:
        raise NotAnLmdbEnvironment(
            f"{path} is not an LMDB environment: LMDB cannot read its {DATA_FILE} ({exc}); "
            "left untouched"
        ) from exc
    try:
        with probe.begin() as txn:
            if txn.stat()["entries"] == 0:
                return
            try:
                store = probe.open_db(STORE_DB, txn=txn, create=False)
                marker = txn.get(FORMAT_KEY, db=store)
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
    if marker not in (FORMAT_MARKER, V1_MARKER):
        raise StorageError(
            f"{path} is an ftlayer store of format {marker!r}; this version reads "
            f"{FORMAT_MARKER!r} (and converts {V1_MARKER!r}): open it with the ftlayer "
            "version that wrote it. Left untouched"
        )


def is_open_in_process(path: str | os.PathLike[str]) -> bool:
    """Whether an LmdbStorage of this process has the environment at `path` open."""
    try:
        stat = os.stat(path)
    except OSError:
        return False
    return (stat.st_dev, stat.st_ino) in open_stores


def initialize_store(
    env: lmdb.Environment, path: str, chunk_bytes: int, txn: lmdb.Transaction[bytes]
) -> tuple[Chunks, lmdb._Database, lmdb._Database, int]:
    """Open (creating on first use) the sub-databases; mark a new store, convert a v1
    store; find the next seq."""
    # (py-lmdb's stubs declare Transaction.env, but the C extension has no such attribute.)
    chunks = Chunks(*(env.open_db(name, txn=txn) for name in (CHUNKS_DB, INDEX_DB, STATE_DB)))
    meta = env.open_db(META_DB, txn=txn)
    store = env.open_db(STORE_DB, txn=txn)
    marker = txn.get(FORMAT_KEY, db=store)
    if marker is None:
        txn.put(FORMAT_KEY, FORMAT_MARKER, db=store)
    elif marker == V1_MARKER:
        converted = _convert_v1(env, txn, chunks, chunk_bytes)
        txn.put(STORED_KEY, converted.to_bytes(8, "big"), db=store)
        txn.put(FORMAT_KEY, FORMAT_MARKER, db=store)
        log.info("%s: %d records of format %r converted to chunks", path, converted, V1_MARKER)
    elif marker != FORMAT_MARKER:  # paranoid: _check_ours refused it before
        raise StorageError(f"{path} is an ftlayer store of format {marker!r}")
    high_water = txn.get(NEXT_SEQ_KEY, db=store)
    next_seq = 1 if high_water is None else int.from_bytes(high_water, "big")
    cursor = txn.cursor(chunks.index_db)
    if cursor.last():
        next_seq = max(next_seq, chunks.head_at(txn, cursor).last + 1)
    return chunks, meta, store, next_seq


def _convert_v1(
    env: lmdb.Environment, txn: lmdb.Transaction[bytes], chunks: Chunks, chunk_bytes: int
) -> int:
    """Move the records of a v1 store (one value per seq) into chunks of up to
    `chunk_bytes` under the same seqs, in `txn`, and drop the v1 sub-database; returns
    how many records moved."""
    records = env.open_db(RECORDS_DB, txn=txn, create=False)
    keys: list[bytes] = []
    values: list[bytes] = []
    moved = 0

    def add_chunk() -> None:
        seqs = np.frombuffer(b"".join(keys), dtype=">u8").astype(np.uint64)
        ends = np.cumsum(np.fromiter(map(len, values), dtype=np.int64, count=len(values)))
        chunks.add(txn, ChunkHead.new(int(seqs[0]), ends, seqs), b"".join(values))

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
