"""Fixtures for the persistence tests: every storage, opened and reopened the same way."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from storage_backends import Backend

from ftlayer.persistence.base import PersistenceStorage


@pytest.fixture(params=["lmdb", "memory"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    opened = Backend(request.param, tmp_path)
    yield opened
    opened.close_all()


@pytest.fixture
def storage(backend: Backend) -> PersistenceStorage:
    return backend.open()
