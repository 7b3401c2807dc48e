"""The source registry: how each source's records are replayed (its replay partitioner
and partition count) and its own tree timeout, registered by REGISTER_SOURCE and kept
in the store under SOURCES_META_KEY, so a restarted FT layer routes replays as before."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ftlayer.acking.rotating import validate_timeout
from ftlayer.errors import ConfigError
from ftlayer.partitioners import ReplayPartitioner, create_partitioner

__all__ = ["SOURCES_META_KEY", "SourceConfig", "source_from_spec"]

SOURCES_META_KEY = "sources"
"""Meta key of the source registrations: JSON {source id: partitioner spec}."""


@dataclass(frozen=True, slots=True)
class SourceConfig:
    """How one source's records are replayed: its partitioner and partition count; and
    its tree timeout, if it has its own (None: the FT layer's)."""

    partitioner: ReplayPartitioner
    num_partitions: int
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.num_partitions, bool) or self.num_partitions < 1:
            raise ConfigError(f"a source needs at least 1 partition, got {self.num_partitions!r}")
        if self.timeout_s is not None:
            validate_timeout(self.timeout_s, 2)

    @classmethod
    def named(
        cls,
        partitioner: str,
        num_partitions: int,
        timeout_s: float | None = None,
        **options: object,
    ) -> SourceConfig:
        return cls(create_partitioner(partitioner, **options), num_partitions, timeout_s)


def source_from_spec(spec: Mapping[str, Any]) -> SourceConfig:
    try:
        return SourceConfig.named(
            spec["partitioner"],
            spec["num_partitions"],
            spec.get("timeout_s"),
            **dict(spec.get("options") or {}),
        )
    except (KeyError, TypeError) as exc:
        raise ConfigError(f"bad source config {dict(spec)!r}: {exc}") from None
