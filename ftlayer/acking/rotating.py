"""RotatingHashMap: a map whose keys expire after a timeout, in O(1) per rotation step.

Modelled on Apache Storm's RotatingMap. The map is n >= 2 buckets (dicts), newest
first. put() writes into the newest bucket and removes the key from the others;
rotate() drops the oldest bucket, opens a new newest one, and hands every entry of the
dropped bucket to the expiry callback.

Expiry bound: call rotate() every T / (n - 1) seconds (`rotation_interval`). A key
put (or touched) at time t, and not touched since, expires at a rotation between
t + T and t + T * (1 + 1/(n-1)): it needs n rotations to fall off the end, and it was
put anywhere between two rotations. More buckets tighten the bound and cost memory
churn; n = 3 gives [T, 1.5 T].

Costs: put, get, pop and `in` are O(n) dict operations; rotate() is O(1) plus the
callback's work on the expired entries. The FT layer keeps one entry per batch of
roots (persistence/timeout.py), so none of this is per record.
Not thread-safe: the owner serializes calls (the FT-layer core does).

`tick(now)` drives rotations from a clock, so callers decide where time comes from
(tests pass a fake clock; the server passes time.monotonic()). A tick performs at most
one rotation and rotations are never closer than T / (n - 1), so the lower bound T
holds however irregularly tick() is called; each late tick delays expiry by its
lateness (see tick).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

from ftlayer.errors import ConfigError

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

ExpiryCallback = Callable[[dict[K, V]], None]


def validate_timeout(timeout_s: float, buckets: int) -> None:
    """Raise ConfigError unless 0 < timeout_s < inf and buckets >= 2."""
    if not 0 < timeout_s < math.inf:  # also rejects NaN
        raise ConfigError(
            f"timeout must be a positive, finite number of seconds, got {timeout_s!r}"
        )
    if isinstance(buckets, bool) or not isinstance(buckets, int) or buckets < 2:
        raise ConfigError(f"rotating timeouts need at least 2 buckets, got {buckets!r}")


def rotation_interval(timeout_s: float, buckets: int) -> float:
    """How often to rotate so that keys expire between T and T * (1 + 1/(n-1))."""
    validate_timeout(timeout_s, buckets)
    return timeout_s / (buckets - 1)


class RotatingHashMap(Generic[K, V]):
    """Keys expire n rotations after their last put; see the module docstring."""

    def __init__(
        self,
        buckets: int = 3,
        on_expire: ExpiryCallback[K, V] | None = None,
        *,
        timeout_s: float | None = None,
        start: float = 0.0,
    ) -> None:
        validate_timeout(timeout_s if timeout_s is not None else 1.0, buckets)
        self._buckets: deque[dict[K, V]] = deque({} for _ in range(buckets))
        self._on_expire = on_expire
        self._interval = None if timeout_s is None else rotation_interval(timeout_s, buckets)
        self._next_rotation = start + (self._interval or 0.0)

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    def __len__(self) -> int:
        return sum(len(b) for b in self._buckets)

    def __contains__(self, key: object) -> bool:
        return any(key in b for b in self._buckets)

    def __iter__(self) -> Iterator[K]:
        for bucket in self._buckets:
            yield from bucket

    def get(self, key: K, default: V | None = None) -> V | None:
        for bucket in self._buckets:
            if key in bucket:
                return bucket[key]
        return default

    def put(self, key: K, value: V) -> None:
        """Insert or touch `key`: it now expires n rotations from now."""
        it = iter(self._buckets)
        head = next(it)
        head[key] = value
        for bucket in it:
            bucket.pop(key, None)

    def pop(self, key: K, default: V | None = None) -> V | None:
        for bucket in self._buckets:
            if key in bucket:
                return bucket.pop(key)
        return default

    @property
    def next_rotation(self) -> float:
        """When tick() rotates next (by the clock tick() is given; needs timeout_s)."""
        return self._next_rotation

    def resume(self, now: float) -> None:
        """Before a put into this map while it is empty: if `tick` was not called at
        its rotations while it was empty (a ticker that sleeps when nothing can expire),
        its next rotation moves onto the schedule those ticks would have kept (the first
        one after `now`), so a key put now waits as long for its first rotation as
        under a ticker that never sleeps, not none."""
        if self._interval is None or now < self._next_rotation or len(self):
            return
        steps = math.floor((now - self._next_rotation) / self._interval) + 1
        self._next_rotation += steps * self._interval
        if self._next_rotation <= now:  # rounding
            self._next_rotation += self._interval

    def rotate(self) -> dict[K, V]:
        """Expire the oldest bucket: returns its entries after passing them to on_expire."""
        expired = self._buckets.pop()
        self._buckets.appendleft({})
        if expired and self._on_expire is not None:
            self._on_expire(expired)
        return expired

    def tick(self, now: float) -> int:
        """Rotate if a rotation is due by `now` (needs timeout_s); returns 1 if it did.

        Rotations are never closer than the rotation interval, so a key never expires
        before T. A late tick delays the rotation, and the next one is due an interval
        after it: with ticks at most d late, keys expire by T * (1 + 1/(n-1)) + n * d.
        """
        if self._interval is None:
            raise ConfigError("tick() needs a RotatingHashMap built with timeout_s")
        if now < self._next_rotation:
            return 0
        self.rotate()
        self._next_rotation = now + self._interval
        return 1
