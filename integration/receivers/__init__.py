"""Receivers: the FT layer as the write-ahead log of a source that cannot replay.

A receiver takes records from an upstream that cannot seek (NATS core subjects, a
JetStream consumer, HTTP webhooks), stores them in the FT layer (INGEST,
ftlayer.core.ingest) and acknowledges them upstream only once the FT layer answered:
from then on the FT layer's store is their durable copy. Receivers run as processes of
their own, several per source for scale, each a client of the FT layer; a Spark query
reads what they stored, in ranges of the FT layer's replay seqs, partitioned by the
source's replay partitioner.

`Receiver` is the API one builds a receiver on::

    receiver = Receiver("127.0.0.1:7070", "orders", partitions=4)
    while True:
        messages = upstream.fetch()                     # take a batch
        if not receiver.has_room():                     # flow control: leave it there
            upstream.hold(messages); continue
        receiver.store([Message(m.key, m.data, identity=m.seq) for m in messages], "orders")
        upstream.ack(messages)                          # only now

`store` returns once every record is durable in the FT layer (or raises: then nothing
may be acknowledged upstream, and the upstream sends the records again). A record
with an `identity` (unique within the upstream named in `store`, such as JetStream's
stream sequence) is stored once however often it is sent within the FT layer's ingest
window, so a redelivery after a receiver died between `store` and its ack adds no
duplicate. `has_room` is flow control: the source's pending records (stored and not
complete) below `max_pending` (Storm's max.spout.pending), or below the limit the
query that reads the source registered (its ft.maxPendingRecords), if that is lower.

Shards: given the addresses of an FT layer of several shards (`HOST:PORT,HOST:PORT`, in
shard order), a receiver registers the source on each and stores each record on one:
a record with an identity always on the same shard (a hash of its identity, so a
redelivery meets the first copy there and is dropped), the others on the shards in
turn. Any shard may hold any record: the ftingest reader takes each partition's
records from every shard. A shard that is down fails the stores of its records once it
did not answer for `reconnect_s` (60 s; they are not acknowledged, and come again: the
bundled receivers go on, they do not exit); `has_room` counts the source's pending records
over every shard, and says "no room" when a shard (or the one FT layer) does not answer
within 2 s, with a warning at most every 10 s: the upstream keeps its records until it
answers (an HTTP sender gets 503 at once, a JetStream receiver fetches nothing),
rather than a request that waits out the client's whole reconnect window.

A record's payload is the ftkafka payload (ftlayer.payloads: key, value,
timestamp, headers), its key hash Kafka's murmur2 of the key (or PySpark's
portable_hash, for a spark-hash source), so the source's reader decodes it and its
replay partitioner routes it as a Kafka record's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

import numpy as np
from numpy.typing import NDArray

from ftlayer.acking.ids import new_ids
from ftlayer.client import ConnectionLost, FTClient
from ftlayer.errors import ConfigError
from ftlayer.partitioners.key_hashes import kafka_key_hashes, spark_key_hashes
from ftlayer.payloads import Headers, encode_payloads
from ftlayer.records import RecordBatch
from ftlayer.registration import SourceRegistration, ingest_source_id

__all__ = ["DEFAULT_MAX_PENDING", "Message", "Receiver", "ingest_source_id"]

DEFAULT_MAX_PENDING: Final = 100_000
log = logging.getLogger("ftlayer.ingest")

_ROOM_CHECK_S: Final = 0.2  # has_room asks the FT layer at most this often
# has_room waits this long for a shard that does not answer, then says "no room": the
# upstream keeps its records (HTTP 503, JetStream unfetched) instead of a request that
# hangs for the client's whole reconnect window.
_ROOM_RECONNECT_S: Final = 2.0
_NO_ROOM_WARN_S: Final = 10.0  # a shard that does not answer is logged at most this often
_PARTITIONERS: Final = ("kafka-hash", "spark-hash", "rebalance")


@dataclass(frozen=True, slots=True)
class Message:
    """One record taken from an upstream: its key and value (None: none), when it was
    taken (epoch ms; 0: now), its identity upstream (-1: none) and headers."""

    key: bytes | None
    value: bytes | None
    timestamp_ms: int = 0
    identity: int = -1
    headers: Headers = field(default_factory=list)


class Receiver:
    """A receiver's link to the FT layer for one source (module docstring)."""

    def __init__(
        self,
        address: str,
        source: str,
        *,
        partitions: int,
        partitioner: str = "kafka-hash",
        max_pending: int = DEFAULT_MAX_PENDING,
        token: bytes | None = None,
        tls_ca: str | None = None,
        reconnect_s: float = 60.0,
        name: str = "receiver",
    ) -> None:
        if not source:
            raise ConfigError("a receiver's source needs a name")
        if partitions < 1:
            raise ConfigError(f"partitions must be at least 1, got {partitions}")
        if partitioner not in _PARTITIONERS:
            raise ConfigError(f"partitioner must be one of {_PARTITIONERS}, got {partitioner!r}")
        if max_pending < 1:
            raise ConfigError(f"max_pending must be at least 1, got {max_pending}")
        self.source = source
        self.source_id = ingest_source_id(source)
        self.partitioner = partitioner
        self.max_pending = max_pending
        addresses = [a.strip() for a in address.split(",") if a.strip()]
        if not addresses:
            raise ConfigError(f"a receiver needs the FT layer's address, got {address!r}")
        self._clients = [
            FTClient(a, token=token, tls=tls_ca or False, reconnect_s=reconnect_s, name=name)
            for a in addresses
        ]
        self._next_shard = 0  # records without an identity go to the shards in turn
        self._room_at = 0.0
        self._pending = 0  # the source's pending records at `_room_at`
        self._limit = max_pending  # and the limit then (the query's, if lower)
        self._unreachable_warned = -_NO_ROOM_WARN_S
        try:
            for shard, client in enumerate(self._clients):
                self._join(shard, client, SourceRegistration(
                    self.source_id, partitioner, partitions, name=source
                ))  # fmt: skip
        except BaseException:
            self.close()
            raise

    def _join(self, shard: int, client: FTClient, registration: SourceRegistration) -> None:
        """Check `client` serves shard `shard` of as many as this receiver was given,
        and register the source there unless it is (with the same settings)."""
        status = client.status()
        if (status.shard, status.shards) != (shard, len(self._clients)):
            raise ConfigError(
                f"the FT layer at {client.address} is shard {status.shard} of "
                f"{status.shards}, but the receiver was given it as shard {shard} of "
                f"{len(self._clients)}: list every shard of the cluster, in shard order"
            )
        known = status.sources.get(str(self.source_id))
        if known is None:
            client.register_source(registration)
            return
        wanted = (registration.partitioner, registration.num_partitions)
        if (known.get("partitioner"), known.get("num_partitions")) != wanted:
            raise ConfigError(
                f"source {self.source!r} is registered with partitioner "
                f"{known.get('partitioner')!r} over {known.get('num_partitions')} partitions, "
                f"not {wanted[0]!r} over {wanted[1]}: give the same settings everywhere"
            )

    def close(self) -> None:
        for client in self._clients:
            client.close()

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def store(self, messages: Sequence[Message], upstream: str) -> int:
        """Store `messages` (taken from the upstream named `upstream`, within which
        their identities are unique) durably in the FT layer; returns how many were new
        (the others were second copies of records stored within the ingest window).
        Acknowledge them upstream only after this returned."""
        if not messages:
            return 0
        if self.partitioner == "kafka-hash" and any(m.key is None for m in messages):
            raise ConfigError(
                f"source {self.source!r} routes by key (kafka-hash): a message without a "
                "key cannot be routed; give every message a key, or use the rebalance "
                "partitioner"
            )
        n = len(messages)
        now_ms = int(time.time() * 1000)
        keys = [m.key for m in messages]
        payloads = encode_payloads(
            keys,
            [m.value for m in messages],
            np.array([m.timestamp_ms or now_ms for m in messages], dtype=np.int64),
            [m.headers for m in messages] if any(m.headers for m in messages) else None,
        )
        if self.partitioner == "spark-hash":
            hashes, has_key = spark_key_hashes(keys), np.ones(n, dtype=np.bool_)
        else:
            hashes, has_key = kafka_key_hashes(keys)
        batch = RecordBatch.build(
            new_ids(n),
            payloads,
            source_ids=self.source_id,
            key_hashes=hashes,
            has_key=has_key,
            topics=upstream,
            partitions=0,
            offsets=np.array([m.identity for m in messages], dtype=np.int64),
        )
        if len(self._clients) == 1:
            taken = self._clients[0].ingest(batch)  # no copy: one FT layer
        else:
            taken = sum(
                self._clients[shard].ingest(batch.take(rows))
                for shard, rows in self._by_shard(batch.offsets)
            )
        self._room_at = 0.0  # look again before the next batch
        return taken

    def _by_shard(self, identities: NDArray[np.int64]) -> list[tuple[int, NDArray[np.intp]]]:
        """Which shard stores which records: a record with an identity always the same
        one (a hash of it), so a redelivery reaches the shard that knows the first copy
        and is dropped there; the others in turn, a batch to a shard."""
        count = len(self._clients)
        mixed = identities.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)  # Fibonacci
        shards = ((mixed >> np.uint64(32)) % np.uint64(count)).astype(np.int64)
        unnamed = identities < 0
        if unnamed.any():
            shards[unnamed] = self._next_shard
            self._next_shard = (self._next_shard + 1) % count
        return [(shard, np.flatnonzero(shards == shard)) for shard in np.unique(shards).tolist()]

    def has_room(self, taken: int = 0) -> bool:
        """Whether the source's pending records (stored, not complete), plus `taken`
        records taken and not yet stored, are below `max_pending`: take more from the
        upstream only then. The FT layer is asked at most every 0.2 s, and at the first
        call after a `store`."""
        now = time.monotonic()
        if now - self._room_at >= _ROOM_CHECK_S:
            statuses = []
            for shard, client in enumerate(self._clients):
                try:
                    statuses.append(client.status(reconnect_s=_ROOM_RECONNECT_S))
                except ConnectionLost as exc:
                    # A shard that does not answer cannot store its share of a batch:
                    # no room until it does (the upstream keeps the records meanwhile).
                    self._warn_unreachable(shard, client, exc)
                    return False
            self._pending = sum(status.pending_of(self.source_id) for status in statuses)
            registered = (statuses[0].sources.get(str(self.source_id)) or {}).get("max_pending")
            self._limit = min(self.max_pending, registered or self.max_pending)
            self._room_at = now
        return self._pending + taken < self._limit

    def _warn_unreachable(self, shard: int, client: FTClient, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._unreachable_warned < _NO_ROOM_WARN_S:
            return
        self._unreachable_warned = now
        where = f"the FT layer at {client.address}"
        if len(self._clients) > 1:
            where = f"shard {shard} of the FT layer, at {client.address},"
        log.warning(
            "receiver of source %r: %s does not answer, so the receiver takes no records "
            "until it does (the upstream keeps them): %s",
            self.source,
            where,
            exc,
        )

    def pending(self) -> int:
        """The source's records stored and not complete (waiting for its reader, or in
        a batch)."""
        return sum(client.status().pending_of(self.source_id) for client in self._clients)
