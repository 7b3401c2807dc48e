"""Retired roots: the roots that failed or were taken over recently
(ftlayer.core.takeover), so that their late events are counted as late (not unknown)
and a repeated root is refused at persist."""

from __future__ import annotations

from collections import deque

import numpy as np
from numpy.typing import NDArray

from ftlayer.acking.rotating import rotation_interval

__all__ = ["RetiredRoots"]

_EMPTY_U64: NDArray[np.uint64] = np.zeros(0, dtype=np.uint64)


class RetiredRoots:
    """Roots that failed recently, as a set that forgets them.

    A root added at time t is known until at least t + ttl_s and at most
    t + ttl_s * (1 + 1/(n-1)) (n generations rotated every ttl_s / (n-1), as the
    rotating buckets of ftlayer.acking.rotating; rotation happens on any call, by the time
    passed). Each generation is one sorted uint64 array, 8 bytes per root.
    Costs, k = roots in a call, m = roots known: add O(k log k + m) (a merge into the
    newest generation); known O(k log m) (a binary search per generation), and O(1)
    when nothing is known, the usual case on the persist path.
    """

    def __init__(self, ttl_s: float, *, generations: int = 3, start: float = 0.0) -> None:
        self._interval = rotation_interval(ttl_s, generations)
        self._generations: deque[NDArray[np.uint64]] = deque(
            [_EMPTY_U64] * generations, maxlen=generations
        )
        self._rotated_at = start

    def __len__(self) -> int:
        return sum(len(generation) for generation in self._generations)

    def rotate(self, now: float) -> None:
        """Drop the generations that expired by `now`."""
        steps = int((now - self._rotated_at) // self._interval)
        if steps > 0:
            self._rotated_at += steps * self._interval
            for _ in range(min(steps, len(self._generations))):
                self._generations.append(_EMPTY_U64)  # the oldest falls off the left

    def add(self, roots: NDArray[np.uint64], now: float) -> None:
        self.rotate(now)
        newest = np.concatenate([self._generations[-1], np.sort(roots)])
        self._generations[-1] = np.sort(newest, kind="stable")  # merges the two runs

    def known(self, roots: NDArray[np.uint64], now: float) -> NDArray[np.bool_]:
        """Which of `roots` are known (a mask aligned with them)."""
        self.rotate(now)
        found = np.zeros(len(roots), dtype=np.bool_)
        for generation in self._generations:
            if len(generation):
                at = np.minimum(np.searchsorted(generation, roots), len(generation) - 1)
                found |= generation[at] == roots
        return found
