"""EventBuffer: XOR events and failed roots waiting to be sent, as arrays.

The one buffer implementation of every event path. A task's XorHandler holds one in
its Python worker for the length of a task attempt (so an attempt that dies midway has
usually sent nothing, and its trees are not failed by half-sent events); a process's
BatchingChannel holds one to batch the events of every task of the worker into few
frames, flushed by size and time. Both drain it the same way: fails first, then the
XOR events, each as one concatenated array, so the events of a tree that failed in the
same drain count as late, not unknown.

Costs: add is O(1) (the arrays are kept by reference, not copied); drain is one
concatenation of what was added. Not thread-safe: its owner locks (BatchingChannel) or
is single-threaded (a task).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from ftlayer.causes import Cause, Causes
from ftlayer.errors import ConfigError

__all__ = ["Drained", "EventBuffer"]


class Drained(NamedTuple):
    fails: NDArray[np.uint64]
    roots: NDArray[np.uint64]
    values: NDArray[np.uint64]
    causes: Causes
    """A cause per failed root (ftlayer.causes)."""


_EMPTY: NDArray[np.uint64] = np.zeros(0, dtype=np.uint64)
_NO_CAUSES = Causes.one(None, 0)


class EventBuffer:
    """XOR events (root, value) and failed roots, in arrival order per kind."""

    def __init__(self) -> None:
        self._roots: list[NDArray[np.uint64]] = []
        self._values: list[NDArray[np.uint64]] = []
        self._fails: list[NDArray[np.uint64]] = []
        self._causes: list[Causes] = []
        self._count = 0

    def __len__(self) -> int:
        """XOR events and failed roots held."""
        return self._count

    def add_xor(self, roots: NDArray[np.uint64], values: NDArray[np.uint64]) -> None:
        if len(roots):
            self._roots.append(roots)
            self._values.append(values)
            self._count += len(roots)

    def add_fail(self, roots: NDArray[np.uint64], causes: Causes | Cause | None = None) -> None:
        """Failed roots with their causes: one for all, one per root, or unspecified."""
        if len(roots):
            if not isinstance(causes, Causes):
                causes = Causes.one(causes, len(roots))
            elif len(causes) != len(roots):
                raise ConfigError(f"fail: {len(roots)} roots but {len(causes)} causes")
            self._fails.append(roots)
            self._causes.append(causes)
            self._count += len(roots)

    def drain(self) -> Drained:
        """Everything held, concatenated, fails apart; the buffer is empty after."""
        fails, roots, values, causes = self._fails, self._roots, self._values, self._causes
        self._roots, self._values, self._fails, self._causes, self._count = [], [], [], [], 0
        return Drained(
            np.concatenate(fails) if fails else _EMPTY,
            np.concatenate(roots) if roots else _EMPTY,
            np.concatenate(values) if values else _EMPTY,
            Causes.concat(causes) if causes else _NO_CAUSES,
        )
