"""Waiting on a running streaming query (test_ftingest, test_poison): `wait_for` polls a
condition until it holds, and fails at once, with the query's exception, when the query
died meanwhile."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["wait_for"]


def wait_for(what: str, predicate: Callable[[], bool], timeout_s: float, query: Any) -> None:
    """Poll `predicate` every 0.2 s until it is true; fail when `query` (a StreamingQuery)
    failed, or after `timeout_s` seconds, naming `what` was awaited."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if query.exception() is not None:
            raise AssertionError(f"the query failed: {query.exception()}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
