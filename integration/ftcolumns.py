"""What every ftlayer-wrapped DataFrame shares: the FT columns and how to reach the FT layer.

A record under fault tolerance carries its anchor in LongType columns:

- `ft_root` (ROOT_COLUMN): the root id of the source record it descends from;
- `ft_id` (ID_COLUMN): its own record id, in tree mode only. A barrier-mode source's
  rows complete at the barrier and carry no record id (it would be 0 on every row):
  their `ft_root` column's metadata says so (COMPLETION_METADATA), and Spark keeps a
  column's metadata through select, where and joins, so every wrapper and sink
  downstream knows it too. One long column less through every step of the pipeline.

Ids are unsigned 64-bit on the wire and in the acker; Spark has no unsigned type, so a
column holds the same 64 bits read as a signed int64 (`to_signed` / `to_unsigned`
convert whole numpy arrays without a copy). With FT off a DataFrame has neither column.

`FTSettings` names the FT-layer server a job talks to, or the shards of an FT layer of
several (`HOST:PORT,HOST:PORT,...`, in shard order). It is a small frozen dataclass,
so it pickles into Spark closures; `channel()` is called on the executor and returns
that process's shared BatchingChannel (one lazy connection per Python worker, reused
across tasks), or over several shards a ShardedChannel of one shared BatchingChannel
per shard, which sends each XOR, FAIL and HOLD to the shard that owns its root.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
from numpy.typing import ArrayLike, NDArray
from pyspark.sql.types import ArrayType, BinaryType, StringType, StructField, StructType

from ftlayer.client import BatchingChannel, parse_address, shared_channel
from ftlayer.client.sharded import ShardedChannel, parse_addresses
from ftlayer.errors import ConfigError

ROOT_COLUMN: Final = "ft_root"
ID_COLUMN: Final = "ft_id"
FT_COLUMNS: Final = (ROOT_COLUMN, ID_COLUMN)
REPLAY_COLUMN: Final = "ft_replay"
"""With the source option ft.replayColumn: true on a row that is a replayed record. An FT
column (tasks keep it from user code, sinks do not write it), but no anchor."""
COMPLETION_METADATA: Final = "ftlayer.completion"
"""The `ft_root` column's metadata key that says its rows' trees complete at the barrier
(value "barrier"), and that they have no `ft_id` column; Spark keeps a column's
metadata through select, where, joins."""


def completes_at_barrier(schema: StructType) -> bool:
    """Whether rows of this schema come from a barrier-mode source (COMPLETION_METADATA
    on `ft_root`)."""
    if ROOT_COLUMN not in schema.fieldNames():
        return False
    return schema[ROOT_COLUMN].metadata.get(COMPLETION_METADATA) == "barrier"


def missing_ft_columns(schema: StructType) -> list[str]:
    """The anchor columns an FT-on DataFrame of this schema lacks: `ft_root`, and
    `ft_id` unless its rows complete at the barrier (`completes_at_barrier`)."""
    names = set(schema.fieldNames())
    wanted = [ROOT_COLUMN] if completes_at_barrier(schema) else list(FT_COLUMNS)
    return [name for name in wanted if name not in names]


HEADERS_TYPE: Final = ArrayType(
    StructType([StructField("key", StringType()), StructField("value", BinaryType())])
)
"""A record's Kafka headers as a column (the ftkafka source under includeHeaders, what
the Kafka sink writes): the type Spark's own Kafka source gives them."""
LOOP_HEADER: Final = "ftlayer-anchor"
"""The Kafka header of a record a loop sink fed back into a source's topic: its tree's
root and the id of the record in transit, 8 bytes each, big-endian, then a 16-byte tag,
HMAC-SHA256 of both under the pipeline's loop key (FTSettings.loop_secret), cut short.
A record whose header does not carry a good tag is not continued: it starts a tree of
its own, as any source record."""
_LOOP_CONTEXT: Final = b"ftlayer-anchor-v1"
_TAG_SIZE: Final = 16


def _tag(secret: bytes, ids: bytes) -> bytes:
    return hmac.new(secret, _LOOP_CONTEXT + ids, hashlib.sha256).digest()[:_TAG_SIZE]


def loop_header(root: int, record_id: int, secret: bytes) -> bytes:
    ids = root.to_bytes(8, "big") + record_id.to_bytes(8, "big")
    return ids + _tag(secret, ids)


def read_loop_headers(
    headers: Sequence[Sequence[tuple[str, bytes | None]] | None], secret: bytes | None
) -> tuple[NDArray[np.uint64], NDArray[np.uint64], int]:
    """(roots, ids, refused) from each record's LOOP_HEADER: 0 and 0 for records without
    one, and for records whose header is not signed with `secret` (copied, forged, or
    no key here): those start a new tree; `refused` counts them."""
    roots = np.zeros(len(headers), dtype=np.uint64)
    ids = np.zeros(len(headers), dtype=np.uint64)
    refused = 0
    if not any(headers):  # no record has a header: no Python step per record
        return roots, ids, refused
    for i, found in enumerate(headers):
        for key, value in found or ():
            if key != LOOP_HEADER:
                continue
            good = (
                secret is not None
                and value is not None
                and len(value) == 16 + _TAG_SIZE
                and hmac.compare_digest(value[16:], _tag(secret, value[:16]))
            )
            if not good:
                refused += 1
                continue
            assert value is not None
            roots[i] = int.from_bytes(value[:8], "big")
            ids[i] = int.from_bytes(value[8:16], "big")
    return roots, ids, refused


def to_signed(ids: ArrayLike) -> NDArray[np.int64]:
    """u64 ids as the int64 values a LongType column holds (same bits, no copy)."""
    return np.ascontiguousarray(ids, dtype=np.uint64).view(np.int64)


def to_unsigned(values: ArrayLike) -> NDArray[np.uint64]:
    """A LongType column's int64 values as the u64 ids they carry (same bits, no copy)."""
    return np.ascontiguousarray(values, dtype=np.int64).view(np.uint64)


Channel = BatchingChannel | ShardedChannel
"""A process's channel to the FT layer: to its one server, or to each of its shards."""


@dataclass(frozen=True, slots=True)
class FTSettings:
    """Where the FT layer is: `address` HOST:PORT (HOST:PORT,HOST:PORT,... for the
    shards of an FT layer of several, in shard order) and an optional auth `token`.

    `enabled=False` is the FT-off switch: the same pipeline then runs with no FT
    columns, no connection and no FT cost.
    """

    address: str | None = None
    token: bytes | None = None
    enabled: bool = True
    tls_ca: str | None = None
    """Connect with TLS, trusting the CA certificate(s) in this PEM file."""
    loop_key: bytes | None = None
    """The key loop headers are signed with; None: derived from `token`."""
    reconnect_s: float = 60.0
    """How long a task's connection to the FT layer retries a refused or broken
    connection, with backoff, before the task fails: a restart of the FT layer within
    it costs the job nothing (Spark retries a task that fails anyway)."""

    @property
    def loop_secret(self) -> bytes | None:
        """The key of this pipeline's loop headers: `loop_key`, else one derived from the
        token; None with neither (a loop sink then refuses to start)."""
        if self.loop_key is not None:
            return self.loop_key
        if self.token is not None:
            return hashlib.sha256(b"ftlayer-loop-key-v1\0" + self.token).digest()
        return None

    def __post_init__(self) -> None:
        if not self.reconnect_s >= 0:
            raise ConfigError(f"reconnect_s must be 0 or more seconds, got {self.reconnect_s}")
        if self.enabled:
            if not self.address:
                raise ConfigError("FT is on but no FT-layer address was given (HOST:PORT)")
            for address in self.addresses:  # a clear error now, not on an executor later
                parse_address(address)

    @property
    def addresses(self) -> tuple[str, ...]:
        """The FT layer's shards in order (one address: an FT layer of one shard)."""
        return () if self.address is None else tuple(parse_addresses(self.address))

    @property
    def shards(self) -> int:
        return max(1, len(self.addresses))

    def channel(self) -> Channel:
        """This process's shared channel to the FT layer (over several shards, to each);
        ConfigError when FT is off."""
        if not self.enabled or self.address is None:
            raise ConfigError("FT is off: there is no FT-layer channel")
        addresses = self.addresses
        if len(addresses) == 1:
            return shared_channel(addresses[0], self.token, self.tls_ca, self.reconnect_s)
        return ShardedChannel(
            [shared_channel(a, self.token, self.tls_ca, self.reconnect_s) for a in addresses]
        )
