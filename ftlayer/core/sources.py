"""The source registry: how each source's records are replayed (its replay partitioner
and partition count), its own tree timeout, its retry policy and its dead-letter topic,
registered by REGISTER_SOURCE and kept in the store under SOURCES_META_KEY, so a
restarted FT layer routes and retries replays as before."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ftlayer.acking.rotating import validate_timeout
from ftlayer.errors import ConfigError
from ftlayer.partitioners import ReplayPartitioner, create_partitioner
from ftlayer.persistence.base import PersistenceStorage
from ftlayer.registration import COMPLETIONS, SourceRegistration

from .retries import IMMEDIATE, RetryPolicy

__all__ = ["SOURCES_META_KEY", "SourceConfig", "SourceRegistry", "source_from_spec"]

SOURCES_META_KEY = "sources"
"""Meta key of the source registrations: JSON {source id: partitioner spec}."""


@dataclass(frozen=True, slots=True)
class SourceConfig:
    """How one source's records are replayed: its partitioner and partition count; its
    tree timeout, if it has its own (None: the FT layer's); how often and how soon a
    failed record is replayed before it is dead-lettered; and where its dead letters
    go (a Kafka topic its source's driver writes them to; None: they stay in the
    FT layer's store)."""

    partitioner: ReplayPartitioner
    num_partitions: int
    timeout_s: float | None = None
    retry: RetryPolicy = IMMEDIATE
    dead_letter_topic: str | None = None
    completion: str = "tree"
    """How its trees complete: "tree" (XOR events of every step) or "barrier" (at the
    end of the batch that carried them; ftlayer.core.barrier)."""

    def __post_init__(self) -> None:
        if isinstance(self.num_partitions, bool) or self.num_partitions < 1:
            raise ConfigError(f"a source needs at least 1 partition, got {self.num_partitions!r}")
        if self.timeout_s is not None:
            validate_timeout(self.timeout_s, 2)
        if self.completion not in COMPLETIONS:
            raise ConfigError(
                f"completion must be one of {list(COMPLETIONS)}, got {self.completion!r}"
            )

    @classmethod
    def named(
        cls,
        partitioner: str,
        num_partitions: int,
        timeout_s: float | None = None,
        retry: RetryPolicy | None = None,
        dead_letter_topic: str | None = None,
        completion: str = "tree",
        **options: object,
    ) -> SourceConfig:
        return cls(
            create_partitioner(partitioner, **options),
            num_partitions,
            timeout_s,
            retry or IMMEDIATE,
            dead_letter_topic,
            completion,
        )


def source_from_spec(spec: Mapping[str, Any]) -> SourceConfig:
    try:
        topic = spec.get("dead_letter_topic")
        if topic is not None and (not isinstance(topic, str) or not topic):
            raise ConfigError(f"a dead-letter topic is a non-empty str, got {topic!r}")
        return SourceConfig.named(
            spec["partitioner"],
            spec["num_partitions"],
            spec.get("timeout_s"),
            RetryPolicy.from_json(spec.get("retry")),
            topic,
            spec.get("completion", "tree"),
            **dict(spec.get("options") or {}),
        )
    except (KeyError, TypeError) as exc:
        raise ConfigError(f"bad source config {dict(spec)!r}: {exc}") from None


class SourceRegistry:
    """Every source's SourceConfig by source id, loaded from and stored in the storage's
    meta entries (SOURCES_META_KEY), so a restarted FT layer routes its recovered
    records as before (the registrations load before recovery); sources given in code
    take precedence, and `default` serves a source nobody registered."""

    def __init__(
        self,
        storage: PersistenceStorage,
        sources: Mapping[int, SourceConfig] | None = None,
        default: SourceConfig | None = None,
    ) -> None:
        self._storage = storage
        self._default = default
        self._specs: dict[str, dict[str, Any]] = {}
        self._configs: dict[int, SourceConfig] = {}
        stored = storage.get_meta(SOURCES_META_KEY)
        if stored:
            self._specs = json.loads(stored.decode())
            for key, spec in self._specs.items():
                self._configs[int(key)] = source_from_spec(spec)
        self._configs.update(sources or {})

    def get(self, source_id: int) -> SourceConfig | None:
        return self._configs.get(source_id, self._default)

    @property
    def barrier_mode(self) -> frozenset[int]:
        """The sources whose trees complete at the barrier."""
        return frozenset(s for s, c in self._configs.items() if c.completion == "barrier")

    def specs(self) -> dict[str, dict[str, Any]]:
        """Every registration as stored, by source id (a string): partitioner,
        partition count, options, timeout, and the retry policy, dead-letter topic,
        completion and name where set (SourceRegistration.stored_spec)."""
        return {key: dict(spec) for key, spec in self._specs.items()}

    def register(self, registration: SourceRegistration) -> SourceConfig:
        """Register (or replace) a source's config and store every registration;
        ConfigError, nothing changed, for a bad id, partitioner, option or retry
        policy."""
        source_id = registration.source_id
        if isinstance(source_id, bool) or not 0 <= source_id <= 0xFFFFFFFF:
            raise ConfigError(f"a source id is a u32, got {source_id!r}")
        name = registration.name
        if name is not None and (not isinstance(name, str) or not name):
            raise ConfigError(f"a source's name is a non-empty str, got {name!r}")
        spec = registration.stored_spec(registration.retry_policy())
        config = source_from_spec(spec)
        specs = {**self._specs, str(source_id): spec}
        self._storage.put_meta(SOURCES_META_KEY, json.dumps(specs, sort_keys=True).encode())
        self._specs = specs
        self._configs[source_id] = config
        return config
