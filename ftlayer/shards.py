"""A server's place in a cluster of FT-layer shards, and the identity of its store.

`ftlayer serve --shard I --shards N` (default 0 of 1: a cluster of one) names the
server's place: shard I of N. Its data dir keeps that place (meta `cluster/shape`)
from its first start: a data dir holds the records of one shard of one cluster shape,
so a server started on it in another place refuses to start, naming both places.

Each store has an id (meta `cluster/store_id`, 16 hex digits drawn when the store is
first served): a store that comes back empty (its data dir lost and made again) has
another id than the one a client knew. STATUS reports the place and the id (`shard`,
`shards`, `store_id`).

A savepoint restored into a data dir is a new store: the restore drops both entries,
and the server started on it claims the place its flags give.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from ftlayer.errors import ConfigError, CorruptData

if TYPE_CHECKING:  # the executor side imports this module, never the storage
    from ftlayer.persistence.base import PersistenceStorage

__all__ = ["CLUSTER_META_PREFIX", "MAX_SHARDS", "ShardPlace", "claim"]

CLUSTER_META_PREFIX: Final = "cluster/"
SHAPE_META_KEY: Final = "cluster/shape"
STORE_ID_META_KEY: Final = "cluster/store_id"
MAX_SHARDS: Final = 256


@dataclass(frozen=True, slots=True)
class ShardPlace:
    """Shard `index` of a cluster of `count` shards."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        for name, value in (("index", self.index), ("count", self.count)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"a shard {name} is an integer, got {value!r}")
        if not 1 <= self.count <= MAX_SHARDS:
            raise ConfigError(f"a cluster has 1 to {MAX_SHARDS} shards, got {self.count}")
        if not 0 <= self.index < self.count:
            raise ConfigError(
                f"shard {self.index} is not in a cluster of {self.count} "
                f"(shards are numbered 0 to {self.count - 1})"
            )

    def __str__(self) -> str:
        return f"shard {self.index} of {self.count}"

    def to_json(self) -> dict[str, int]:
        return {"shard": self.index, "shards": self.count}

    @classmethod
    def from_json(cls, data: Any) -> ShardPlace:
        """Strict: CorruptData unless `data` is what to_json wrote."""
        try:
            return cls(int(data["shard"]), int(data["shards"]))
        except (KeyError, TypeError, ValueError, ConfigError) as exc:
            raise CorruptData(f"bad shard place {data!r}: {exc}") from None


def claim(storage: PersistenceStorage, place: ShardPlace, where: str) -> str:
    """The store's id, after checking that `storage` (the data dir `where`) holds the
    records of `place`: claimed on its first start, refused (ConfigError naming both
    places) when it holds another shard's."""
    raw_shape = storage.get_meta(SHAPE_META_KEY)
    raw_id = storage.get_meta(STORE_ID_META_KEY)
    if raw_shape is not None:
        try:
            stored = ShardPlace.from_json(json.loads(raw_shape))
        except ValueError as exc:
            raise CorruptData(f"{where}: bad {SHAPE_META_KEY} entry: {exc}") from None
        if stored != place:
            raise ConfigError(
                f"the data dir {where} holds the records of {stored}, not of {place}: "
                f"start it with --shard {stored.index} --shards {stored.count}, or give "
                f"{place} a data dir of its own"
            )
    store_id = raw_id.decode() if raw_id is not None else secrets.token_hex(8)
    if raw_shape is None or raw_id is None:
        storage.update_meta(
            {
                SHAPE_META_KEY: json.dumps(place.to_json(), sort_keys=True).encode(),
                STORE_ID_META_KEY: store_id.encode(),
            }
        )
    return store_id
