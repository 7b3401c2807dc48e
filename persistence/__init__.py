"""Persistence: where every source record waits until its tree completes.

- `PersistenceStorage` (base): the durable store contract; `LmdbStorage` (default) and
  `MemoryStorage` implement it.
- `PersistenceLayer` (layer): the index from pending root ids to stored records.
- `TimeoutPersistenceLayer` (timeout): the same, with rotating buckets that fail roots
  pending for longer than the timeout.
"""

from .base import PersistenceStorage, RecordNotStored
from .layer import Completed, PersistenceLayer
from .lmdb_storage import LmdbStorage
from .memory import MemoryStorage
from .timeout import TimeoutPersistenceLayer

__all__ = [
    "Completed",
    "LmdbStorage",
    "MemoryStorage",
    "PersistenceLayer",
    "PersistenceStorage",
    "RecordNotStored",
    "TimeoutPersistenceLayer",
]
