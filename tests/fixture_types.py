"""Types of the shared fixtures of tests/conftest.py, for the signatures of the tests
that take them (the server fixtures' types are in tests/integration/serverproc.py)."""

from __future__ import annotations

from collections.abc import Callable

# `make_topic(partitions=4) -> name`: a fresh, ready topic on the session's broker.
MakeTopic = Callable[..., str]
