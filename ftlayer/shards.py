"""A server's place in a cluster of FT-layer shards, the shard of a root and of a
partition, and the identity of a shard's store.

Which shard owns what needs no lookup:

- a source's Kafka partition p belongs to shard (source id + p) mod N
  (`partition_shard`): its records, their roots and its batch ranges live there;
- a root names its shard in bits 55-62 (`shard_of`), in a cluster of more than one
  shard: a drawn root of shard s is s << 55 | 55 random bits (ftlayer.acking.ids), a
  range root's number is s << 15 | a number of the shard's own (ftlayer.rangeroots),
  so bits 55-62 are the shard in both. Tasks and sinks send an event for a root to
  the shard its bits name. In a cluster of one shard no bit is reserved.

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

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ftlayer.errors import ConfigError, CorruptData

if TYPE_CHECKING:  # the executor side imports this module, never the storage
    from ftlayer.persistence.base import PersistenceStorage

__all__ = [
    "CLUSTER_META_PREFIX",
    "MAX_SHARDS",
    "SHAPE_META_KEY",
    "SHARD_SHIFT",
    "ShardPlace",
    "claim",
    "foreign_roots",
    "partition_shard",
    "shard_of",
]

CLUSTER_META_PREFIX: Final = "cluster/"
SHAPE_META_KEY: Final = "cluster/shape"
STORE_ID_META_KEY: Final = "cluster/store_id"
MAX_SHARDS: Final = 256
SHARD_SHIFT: Final = 55
"""A root's shard is in its bits 55-62 (8 bits: up to MAX_SHARDS shards)."""
RANGE_NUMBER_BITS: Final = 15
"""In a cluster of more than one shard, a shard numbers its batch ranges
shard << 15 | 1 to 2**15 - 1: range numbers are 23 bits, their top 8 the shard."""
_SHARD_MASK: Final = np.uint64(MAX_SHARDS - 1)


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

    def range_numbers(self) -> tuple[int, int]:
        """The batch range numbers this shard hands out: [first, last]."""
        if self.count == 1:
            return 1, (1 << 23) - 1
        base = self.index << RANGE_NUMBER_BITS
        return base + 1, base + (1 << RANGE_NUMBER_BITS) - 1

    def to_json(self) -> dict[str, int]:
        return {"shard": self.index, "shards": self.count}

    @classmethod
    def from_json(cls, data: Any) -> ShardPlace:
        """Strict: CorruptData unless `data` is what to_json wrote."""
        try:
            return cls(int(data["shard"]), int(data["shards"]))
        except (KeyError, TypeError, ValueError, ConfigError) as exc:
            raise CorruptData(f"bad shard place {data!r}: {exc}") from None


def shard_of(roots: ArrayLike, count: int) -> NDArray[np.int64]:
    """The shard each root names (all 0 in a cluster of one shard)."""
    keys = np.asarray(roots, dtype=np.uint64)
    if count == 1:
        return np.zeros(keys.shape, dtype=np.int64)
    return ((keys >> np.uint64(SHARD_SHIFT)) & _SHARD_MASK).astype(np.int64)


def partition_shard(source_ids: ArrayLike, partitions: ArrayLike, count: int) -> NDArray[np.int64]:
    """The shard that owns each Kafka partition (of its source: one id for all, or one
    per partition)."""
    parts = np.asarray(partitions, dtype=np.int64)
    return (np.asarray(source_ids, dtype=np.int64) + parts) % np.int64(count)


def foreign_roots(roots: ArrayLike, place: ShardPlace) -> str | None:
    """Why some of `roots` are not this shard's (None: all are): the first one named,
    with the shard its bits give or that it is outside the cluster."""
    if place.count == 1:
        return None
    keys = np.asarray(roots, dtype=np.uint64)
    shards = shard_of(keys, place.count)
    wrong = np.flatnonzero(shards != place.index)
    if not len(wrong):
        return None
    root, shard = int(keys[wrong[0]]), int(shards[wrong[0]])
    where = (
        f"shard {shard}'s"
        if shard < place.count
        else f"of shard {shard}, outside this cluster of {place.count} shards"
    )
    return (
        f"root {root:#x} is {where}, not a root of {place} ({len(wrong)} such roots): "
        "send each event to the shard its root's bits 55-62 name"
    )


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
