"""SourceRegistration: what a source tells the FT layer about itself, as one object.

A source registers before its first persist (REGISTER_SOURCE, protocol.md 5.3): how
its failed records are replayed (its replay partitioner, with options, over its
partition count), its own tree timeout if it has one, its retry policy, where its
dead letters go, how its trees complete, and its name. The same object travels from
the source's driver (integration.source.driver) through the client (ftlayer.client),
the wire (ftlayer.wire.control) and the server's handler to the core
(`FTLayer.register_source`, ftlayer.core.sources), which checks the ranges and stores
`to_spec()`, so a restarted FT layer routes and retries as before.

Checks are split by layer, so each answers with its own error code: the wire refuses a
wrongly shaped registration (BadRequest, 7); the core refuses values out of range or
unknown names (ConfigError, 102: an unknown partitioner, 0 partitions, a retry policy
out of its bounds). This module has no import of the core, so an executor or a driver
builds registrations without loading server code.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from ftlayer.policy import IMMEDIATE, RetryPolicy

__all__ = ["COMPLETIONS", "SourceRegistration", "ingest_source_id"]

COMPLETIONS: Final = ("tree", "barrier")
"""How a source's trees complete: by XOR events of every step (tree), or at the end of
the batch that carried them (barrier; failures and holders still per record)."""


def ingest_source_id(name: str) -> int:
    """The u32 source id of the source that cannot replay named `name` (its receivers
    and the `ftingest` query that reads it): the same in every process (crc32)."""
    return zlib.crc32(f"{name}\x00ingest".encode())


@dataclass(frozen=True, slots=True)
class SourceRegistration:
    """One source's registration; see the module docstring.

    `retry`: a RetryPolicy, or its JSON settings (`RetryPolicy.to_json`, each key
    optional: a missing one takes the policy's default), or None: no policy, failed
    records are replayed at once for ever (IMMEDIATE). `timeout_s`: the source's own
    tree timeout (None: the FT layer's). `name`: the source's name (`ft.sourceName`),
    shown by status; None: unnamed. `max_pending`: for a source that cannot replay, the
    pending records at which its receivers stop taking (the ftingest query's
    ft.maxPendingRecords; integration.receivers); None: only the receivers' own."""

    source_id: int
    partitioner: str
    num_partitions: int
    options: Mapping[str, Any] = field(default_factory=dict)
    timeout_s: float | None = None
    retry: RetryPolicy | Mapping[str, Any] | None = None
    dead_letter_topic: str | None = None
    completion: str = "tree"
    name: str | None = None
    max_pending: int | None = None

    def retry_policy(self) -> RetryPolicy | None:
        """`retry` as a RetryPolicy (None stays None); ConfigError for settings out of
        range."""
        if self.retry is None or isinstance(self.retry, RetryPolicy):
            return self.retry
        return RetryPolicy.from_json(self.retry)

    def to_spec(self) -> dict[str, Any]:
        """The JSON object REGISTER_SOURCE carries: the required keys, and of the
        optional ones only those that differ from their defaults."""
        spec: dict[str, Any] = {
            "partitioner": self.partitioner,
            "num_partitions": self.num_partitions,
            "options": dict(self.options),
        }
        if self.timeout_s is not None:
            spec["timeout_s"] = self.timeout_s
        if self.retry is not None:
            retry = self.retry
            spec["retry"] = retry.to_json() if isinstance(retry, RetryPolicy) else dict(retry)
        if self.dead_letter_topic is not None:
            spec["dead_letter_topic"] = self.dead_letter_topic
        if self.completion != "tree":
            spec["completion"] = self.completion
        if self.name is not None:
            spec["name"] = self.name
        if self.max_pending is not None:
            spec["max_pending"] = self.max_pending
        return spec

    def stored_spec(self, retry: RetryPolicy | None) -> dict[str, Any]:
        """What the core stores for it (ftlayer.core.sources): `to_spec` with the checked
        retry policy, "timeout_s" always present, and the policy left out when it is
        the FT layer's own default (IMMEDIATE), so older stores read the same."""
        spec = self.to_spec()
        spec.setdefault("timeout_s", None)
        spec.pop("retry", None)
        if retry is not None and retry != IMMEDIATE:
            spec["retry"] = retry.to_json()
        return spec
