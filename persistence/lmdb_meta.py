"""The meta entries of an LMDB store: the FT layer's own state (checkpoints, registered
sources) beside the records.

They live in the `meta` sub-database (lmdb_layout) under their UTF-8 keys, so
`meta_keys(prefix)` is one cursor range, in byte order. The hooks here get their
arguments checked (`PersistenceStorage.put_meta` and the others, in base).

Staged entries (`stage_meta`) wait in the environment's staged map (None: staged as
deleted) until the store's next write transaction commits them (lmdb_env). Until then
`get_meta` and `meta_keys` answer from the staged map first, so a reader sees a staged
entry at once and never an older value of its key.

Costs: a meta read is one read transaction, after a look into the staged map under
`_staged_lock`; a meta write is one write transaction (and fsync with `sync=True`);
staging never waits for a transaction.

Threads: thread-safe, like the whole store (lmdb_env).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import lmdb

from .base import MetaValue
from .lmdb_env import LmdbEnvironment

__all__ = ["LmdbMeta"]


def _copied(value: bytes | None) -> bytes | None:
    return None if value is None else bytes(value)


class LmdbMeta(LmdbEnvironment):
    """The meta entries of `LmdbStorage`; see the module docstring."""

    def _get_meta(self, key: bytes) -> bytes | None:
        with self._staged_lock:
            if key in self._staged:
                return self._staged[key]
        return self._read(lambda txn: txn.get(key), db=self._meta)

    def _get_metas(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Several meta values in one read transaction (staged ones first)."""
        with self._staged_lock:
            staged = {key: self._staged[key] for key in keys if key in self._staged}

        def read(txn: lmdb.Transaction[bytes]) -> list[bytes | None]:
            return [staged[key] if key in staged else _copied(txn.get(key)) for key in keys]

        return self._read(read, db=self._meta)

    def _put_meta(self, key: bytes, value: MetaValue) -> None:
        self._write(lambda txn: txn.put(key, value), db=self._meta, supersedes=(key,))

    def _delete_meta(self, key: bytes) -> bool:
        return bool(self._write(lambda txn: txn.delete(key), db=self._meta, supersedes=(key,)))

    def _update_meta(
        self, puts: Sequence[tuple[bytes, MetaValue]], deletes: Sequence[bytes]
    ) -> None:
        def write(txn: lmdb.Transaction[bytes]) -> None:
            for key in deletes:
                txn.delete(key)
            for key, value in puts:
                txn.put(key, value)

        self._write(write, db=self._meta, supersedes={*deletes, *(key for key, _ in puts)})

    def _meta_keys(self, prefix: bytes) -> list[str]:
        def keys(txn: lmdb.Transaction[bytes]) -> list[str]:
            cursor = txn.cursor()
            found: list[str] = []
            if not cursor.set_range(prefix):
                return found
            for key in cursor.iternext(keys=True, values=False):
                if not bytes(key).startswith(prefix):
                    break
                found.append(bytes(key).decode())
            return found

        stored = self._read(keys, db=self._meta)
        with self._staged_lock:
            staged = {k.decode(): v for k, v in self._staged.items() if k.startswith(prefix)}
        if not staged:
            return stored
        found = {key for key in stored if staged.get(key, b"") is not None}
        found.update(key for key, value in staged.items() if value is not None)
        return sorted(found, key=str.encode)

    def _stage_meta(
        self, puts: Sequence[tuple[bytes, MetaValue]], deletes: Sequence[bytes]
    ) -> None:
        """Committed with this store's next write transaction, whatever it writes (a
        persist, a delete, a meta update, `flush_staged`); until then not durable, but
        get_meta and meta_keys see them. Never waits for a transaction."""
        staged: dict[bytes, bytes | None] = dict.fromkeys(deletes)
        for key, value in puts:
            staged[key] = bytes(value)
        with self._staged_lock:
            self._staged.update(staged)
            if self._staged_since is None:
                self._staged_since = time.monotonic()
