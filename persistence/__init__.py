"""Persistence: where every source record waits until its tree completes.

- `PersistenceStorage` (base): the durable store contract; `LmdbStorage` (default) and
  `MemoryStorage` implement it.
- `PersistenceLayer` (layer): stores, deletes and re-tags the records of pending
  roots; their locators live in the acker table (LOCATOR_COLUMNS).
- `RootTimeouts` (timeout): rotating buckets that time out roots pending for longer
  than the timeout; the core holds it beside the persistence layer.
"""

from .base import PersistenceStorage, RecordNotStored
from .layer import LOCATOR_COLUMNS, Completed, PersistenceLayer
from .lmdb_storage import LmdbStorage
from .memory import MemoryStorage
from .timeout import RootTimeouts

__all__ = [
    "LOCATOR_COLUMNS",
    "Completed",
    "LmdbStorage",
    "MemoryStorage",
    "PersistenceLayer",
    "PersistenceStorage",
    "RecordNotStored",
    "RootTimeouts",
]
