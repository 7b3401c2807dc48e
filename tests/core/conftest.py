"""Fixtures for the core tests.

- `storage` (function): each test that takes it runs twice, on `LmdbStorage` (in
  ``tmp_path / "ft"``, where a test may reopen it) and on `MemoryStorage`; closed at
  the end unless the test closed it. A module that needs one kind only defines its own.

The hand-driven clock is `manual_clock.Clock`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ftlayer.persistence import LmdbStorage, MemoryStorage, PersistenceStorage


@pytest.fixture(params=["lmdb", "memory"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[PersistenceStorage]:
    store: PersistenceStorage = (
        LmdbStorage(tmp_path / "ft") if request.param == "lmdb" else MemoryStorage()
    )
    yield store
    if not store.closed:
        store.close()
