"""The clock the core tests drive by hand: `FTLayer(..., clock=Clock(), wall_clock=...)`,
then ``clock.now = ...`` moves time for every timeout, lease and backoff."""

from __future__ import annotations


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
