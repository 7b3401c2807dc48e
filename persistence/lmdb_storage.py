"""The LMDB persistence storage: the default, durable `PersistenceStorage`.

`LmdbStorage` keeps the source records in one LMDB environment (a directory holding
data.mdb and lock.mdb), each persisted batch as one chunk (one LMDB value holding its
records back to back) with a small index and state beside it, and the FT layer's meta
entries in a sub-database of their own. What it promises:

- Durable with `sync=True` (the default): every commit is on disk when the call
  returns. Every write is all-or-nothing, and the map grows by itself.
- Thread-safe: puts of several threads at once share one transaction and one fsync
  (group commit), and reads never wait for a write transaction. Staged meta entries
  and deletes (`stage_meta`, `stage_deletes`) ride on the next write transaction;
  `copy_to` copies the store without stopping writes.
- It never writes into a directory that is not an ftlayer store, and converts a store
  of the previous layout (one LMDB value per record) when it opens it.

Each concern is a module of its own, which opens with its contract:

| module        | what it holds                                                          |
|---------------|------------------------------------------------------------------------|
| `lmdb_layout` | the on-disk format: sub-databases, chunk values, a chunk's head         |
| `lmdb_open`   | opening: refusing what is not ours, converting a v1 store, the next seq |
| `lmdb_env`    | transactions and their locks, map growth, staged writes, copy_to, close |
| `lmdb_writes` | put (group commit), delete, set_roots, compaction                       |
| `lmdb_reads`  | get, scan, len                                                          |
| `lmdb_meta`   | the meta entries, staged or not                                         |

The arguments of every verb are checked once for every storage, by
`PersistenceStorage` (base), before they reach these modules.
"""

from __future__ import annotations

import os
from typing import Final

from .lmdb_layout import FORMAT_MARKER
from .lmdb_meta import LmdbMeta
from .lmdb_open import is_open_in_process
from .lmdb_reads import LmdbReads
from .lmdb_writes import OVERRIDES_KEPT, LmdbWrites

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_MAP_SIZE",
    "FORMAT_MARKER",
    "LmdbStorage",
    "is_open_in_process",
]

DEFAULT_MAP_SIZE: Final = 64 * 1024 * 1024
DEFAULT_CHUNK_BYTES: Final = 1 << 20


class LmdbStorage(LmdbWrites, LmdbReads, LmdbMeta):
    """Source records in an LMDB environment at `path` (a directory, created if missing).

    `map_size` is the initial map size in bytes; it doubles whenever a write needs more.
    `sync=False` trades durability of the last commits on an OS crash for speed (see
    lmdb_env). `chunk_bytes` bounds the bytes of a chunk a put writes (a record larger
    than that is a chunk of its own), `overrides_kept` how many override entries a
    chunk keeps whatever its size (lmdb_writes, compaction). Raises
    NotAnLmdbEnvironment if `path` holds something that is not an ftlayer LMDB store,
    and StorageError if the store is already open in this process.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        map_size: int = DEFAULT_MAP_SIZE,
        sync: bool = True,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        overrides_kept: int = OVERRIDES_KEPT,
    ) -> None:
        super().__init__(
            path,
            map_size=map_size,
            sync=sync,
            chunk_bytes=chunk_bytes,
            overrides_kept=overrides_kept,
        )

    def __repr__(self) -> str:
        state = " (closed)" if self._env is None else ""
        return f"LmdbStorage({self._path!r}){state}"
