"""Opening and reopening every kind of storage the same way, for the persistence tests."""

from __future__ import annotations

import itertools
from pathlib import Path

from ftlayer.persistence.base import PersistenceStorage
from ftlayer.persistence.lmdb_storage import LmdbStorage
from ftlayer.persistence.memory import MemoryStorage


class Backend:
    """Opens storages of one kind; `reopen` is what a restart does to a storage.

    For LMDB a reopen closes the environment and opens its directory again; a memory
    storage does not survive a restart, so there `reopen` hands back the same storage
    (the contract tests then check nothing more than the session already guarantees).
    """

    def __init__(self, name: str, tmp_path: Path) -> None:
        self.name = name
        self.durable = name == "lmdb"
        self._tmp_path = tmp_path
        self._counter = itertools.count()
        self._opened: list[PersistenceStorage] = []
        self._paths: dict[int, Path] = {}

    def open(self, **options: int) -> PersistenceStorage:
        storage: PersistenceStorage
        if self.durable:
            path = self._tmp_path / f"store-{next(self._counter)}"
            storage = LmdbStorage(path, **options)
            self._paths[id(storage)] = path
        else:
            storage = MemoryStorage()
        self._opened.append(storage)
        return storage

    def reopen(self, storage: PersistenceStorage) -> PersistenceStorage:
        if not self.durable:
            return storage
        path = self._paths[id(storage)]
        storage.close()
        reopened = LmdbStorage(path)
        self._paths[id(reopened)] = path
        self._opened.append(reopened)
        return reopened

    def close_all(self) -> None:
        for storage in self._opened:
            storage.close()
