"""RetryPolicy: how often and how soon a failed record is replayed before it is
dead-lettered (per source: the ftkafka options ft.maxRetries, ft.retryBackoffMs and
ft.retryBackoffMaxMs, registered with the FT layer). A module of its own, with no
import of the FT-layer core, so the Spark side can parse its options without loading
the server's modules (ftlayer.core.retries keeps the records the policy decides on)."""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from ftlayer.errors import ConfigError

__all__ = ["IMMEDIATE", "JITTER", "RetryPolicy"]

MAX_RETRIES_LIMIT: Final = 1_000_000
MAX_BACKOFF_MS: Final = 7 * 24 * 3600 * 1000
JITTER: Final = 0.2
"""A delay is drawn uniformly from [1 - JITTER, 1] times the exponential step."""


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often and how soon a failed record is replayed (per source).

    `max_retries`: replays after the first failure before the record is dead-lettered
    (-1: for ever). The delay before replay n (n = 1, 2, ...) is
    min(backoff_max_ms, backoff_ms * 2 ** (n - 1)) times a jitter in [0.8, 1]."""

    max_retries: int = 10
    backoff_ms: int = 500
    backoff_max_ms: int = 30_000

    def __post_init__(self) -> None:
        checks = (
            ("ft.maxRetries", self.max_retries, -1, MAX_RETRIES_LIMIT),
            ("ft.retryBackoffMs", self.backoff_ms, 0, MAX_BACKOFF_MS),
            ("ft.retryBackoffMaxMs", self.backoff_max_ms, 0, MAX_BACKOFF_MS),
        )
        for option, value, lo, hi in checks:
            if type(value) is not int or not lo <= value <= hi:
                raise ConfigError(f"{option} must be an integer from {lo} to {hi}, got {value!r}")
        if self.backoff_max_ms < self.backoff_ms:
            raise ConfigError(
                f"ft.retryBackoffMaxMs ({self.backoff_max_ms}) is below ft.retryBackoffMs "
                f"({self.backoff_ms})"
            )

    def step_s(self, attempts: int) -> float:
        """The delay before the replay after failure number `attempts`, before jitter."""
        if attempts < 1 or self.backoff_ms == 0:
            return 0.0
        exponent = min(attempts - 1, 62)
        return min(self.backoff_max_ms, self.backoff_ms * (1 << exponent)) / 1000.0

    def delay_s(self, attempts: int, rng: random.Random) -> float:
        step = self.step_s(attempts)
        return step * (1.0 - JITTER * rng.random()) if step else 0.0

    def exhausted(self, failures: int) -> bool:
        """True once `failures` failures leave no replay: after max_retries + 1 (the
        first attempt and max_retries replays all failed), dead-letter."""
        return self.max_retries >= 0 and failures > self.max_retries

    def to_json(self) -> dict[str, int]:
        return {
            "max_retries": self.max_retries,
            "backoff_ms": self.backoff_ms,
            "backoff_max_ms": self.backoff_max_ms,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> RetryPolicy:
        if data is None:
            return IMMEDIATE
        unknown = set(data) - {"max_retries", "backoff_ms", "backoff_max_ms"}
        if unknown:
            raise ConfigError(f"unknown retry settings {sorted(unknown)}")
        return cls(**dict(data))


IMMEDIATE: Final = RetryPolicy(max_retries=-1, backoff_ms=0, backoff_max_ms=0)
"""The FT layer's own default, for a source that registered no policy: replay at once,
for ever (the mechanism without a policy). The ftkafka source always registers one,
by default RetryPolicy() (10 retries, 0.5 s doubling up to 30 s)."""
