"""`Observation`: what the HTTP port reads of a server at one instant."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ftlayer.core.meters import LatencyHistogram

__all__ = ["DeadLetterRows", "Observation"]


@dataclass(frozen=True, slots=True)
class Observation:
    """The STATUS reply's JSON and each source's complete-latency histogram, copied
    together under the server's lock (FTServer.observe), so they agree."""

    status: Mapping[str, Any]
    latency: Mapping[str, LatencyHistogram]
    """Per source id (a string, as in STATUS)."""


@dataclass(frozen=True, slots=True)
class DeadLetterRows:
    """The oldest dead letters (FTServer.dead_letter_rows): their coordinates, attempts
    and last cause, never their payloads; `total`: how many are stored."""

    rows: list[dict[str, Any]]
    total: int
