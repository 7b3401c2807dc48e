"""The ftkafka driver's FT layer: one server, or the shards of an FT layer of several.

`ft.address` names the FT layer's shards in shard order (`HOST:PORT,HOST:PORT,...`;
one address is an FT layer of one shard). Which shard owns what needs no lookup
(ftlayer.shards): partition p of a topic belongs to shard (the topic's source id + p)
mod N (`ShardMap`), and with it the partition's records, their roots, its lowest
pending offset and so its group offset, its batch ranges, and its records' barrier
holds, retries and dead letters. So the driver

1. checks at start, before it registers anything, that every shard answers and stands
   where ft.address puts it (STATUS `shard` and `shards`, `ShardClients.check_places`):
   a shard that does not answer is a SourceError naming it, one in another place a
   ConfigError naming it and both places;
2. registers each topic's source with every shard (a replay partitioner may route a
   record to a partition of another shard: the shard that holds the record queues it);
3. keeps one replay cursor per shard in its position (ftlayer.position: each shard
   numbers its own replays), so a batch takes in S.replay[i] < seq <= E.replay[i] of
   every shard i, and each input partition fetches its replays from every shard;
4. sends every barrier to every shard, each its own part (`ShardMap.part`: the offsets
   of its partitions and its cursor): a checkpoint is complete when every shard's part
   is, and each partition's group offset is the one its own shard allows
   (`CheckpointAnswers`);
5. opens each batch range on its partition's shard, and delivers dead letters, copies
   failed records' bytes and applies ft.maxPendingRecords shard by shard (driver.py).

A shard down stalls only its own partitions. With several shards the driver reads each
shard's STATUS once per trigger with a single connection attempt (`statuses`); a shard
that does not answer is *down*: its partitions take in no new records and its cursor
stays where it was (no replays of it are taken in), its part of each barrier is not
sent, and its dead letters wait, while the other shards' partitions run, complete and
commit their group offsets as usual. Once it answers again, the sources are registered
with it again and its partitions go on from where they stopped; its next barrier also
completes the barriers it missed (the FT layer completes a query's checkpoints in
order). A shard whose failures tasks parked on other shards while it did not answer
(a shard that died under a running batch) is *held* the same way until the driver
delivered them (.parking). The query fails only when no shard answered for
ft.reconnectTimeoutMs. A shard
that answers with another store id than the query's position names lost its data dir:
its partitions go back to their committed group offsets (.rewind), the others go on.

With one address every call goes to that server exactly as it does without shards:
the same requests, a position whose cursor is one number, and a server that does not
answer is waited for (ft.reconnectTimeoutMs) and then fails the query.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from ftlayer.client import ConnectionLost, FTClient
from ftlayer.errors import ConfigError, SourceError
from ftlayer.position import KafkaOffsets, Position
from ftlayer.shards import partition_shard
from ftlayer.status import BriefStatus, CheckpointReport

from .options import SourceOptions

__all__ = ["CheckpointAnswers", "ShardClients", "ShardMap", "brief_status"]

T = TypeVar("T")

log = logging.getLogger("ftlayer.source")


class ShardMap:
    """Which shard owns each partition of a query's topics (module docstring)."""

    def __init__(self, source_ids: Mapping[str, int], shards: int) -> None:
        self.source_ids = dict(source_ids)
        self.shards = shards

    def owner(self, topic: str, partition: int) -> int:
        if self.shards == 1:
            return 0
        return int(partition_shard(self.source_ids[topic], partition, self.shards))

    def owned(self, kafka: Mapping[str, Mapping[int, int]], shard: int) -> KafkaOffsets:
        """The entries of `kafka` whose partitions `shard` owns (every topic kept)."""
        return {
            topic: {p: o for p, o in partitions.items() if self.owner(topic, p) == shard}
            for topic, partitions in kafka.items()
        }

    def part(self, position: Position, shard: int) -> Position:
        """The barrier `position` as shard `shard` is sent it: its partitions' offsets
        and its own replay cursor."""
        return position.part(self.owned(position.kafka, shard), shard)


@dataclass(frozen=True, slots=True)
class CheckpointAnswers:
    """Every shard's answer to one barrier's CHECKPOINT request (None from a shard whose
    request failed), and the group offsets they allow together: each partition's from
    the shard that owns it."""

    reports: tuple[CheckpointReport | None, ...]
    shard_map: ShardMap

    @property
    def answered(self) -> bool:
        return any(report is not None for report in self.reports)

    def commit_offsets(self) -> KafkaOffsets | None:
        """The group offsets these checkpoints allow (None: none allows any)."""
        return self._merged(lambda report: report.commit_offsets)

    def completed_offsets(self) -> KafkaOffsets | None:
        """The group offsets of the checkpoints a CHECKPOINT_BEGIN completed first."""
        return self._merged(
            lambda report: None if report.completed is None else report.completed.commit_offsets
        )

    def _merged(
        self, pick: Callable[[CheckpointReport], KafkaOffsets | None]
    ) -> KafkaOffsets | None:
        merged: KafkaOffsets = {}
        for shard, report in enumerate(self.reports):
            offsets = None if report is None else pick(report)
            for topic, partitions in self.shard_map.owned(offsets or {}, shard).items():
                if partitions:
                    merged.setdefault(topic, {}).update(partitions)
        return merged or None


class ShardClients:
    """The driver's FTClients of each shard, each made on first use; calls that fail
    with SourceError naming the shard, and which shards are down (module docstring,
    "A shard down")."""

    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        self.addresses = options.ft.addresses
        self._clients: list[FTClient | None] = [None] * len(self.addresses)
        self._quick: list[FTClient | None] = [None] * len(self.addresses)
        self.down: dict[int, float] = {}
        """The shards that did not answer the last STATUS, and since when (monotonic)."""
        self.held: set[int] = set()
        """Shards that answer but wait for their parked failures (.parking): as down
        for admission and barriers."""
        self._all_down_since: float | None = None
        self.store_ids: list[str] = []
        """Each shard's store id, as it last answered (`check_places`, then the
        driver's `available`)."""
        self._stores_seen: dict[FTClient, tuple[int, str]] = {}

    @property
    def count(self) -> int:
        return len(self.addresses)

    @property
    def stalled(self) -> set[int]:
        """The shards whose partitions take in nothing and get no barrier: down or
        held."""
        return set(self.down) | self.held

    def where(self, shard: int) -> str:
        """The shard as messages name it."""
        if self.count == 1:
            return f"the FT layer at {self.addresses[0]} (option ft.address)"
        return f"shard {shard} of the FT layer, at {self.addresses[shard]} (option ft.address)"

    def call(self, shard: int, what: str, call: Callable[[FTClient], T]) -> T:
        """A call to one shard that must get through. Its client retries refused
        connections with backoff for ft.reconnectTimeoutMs (a restarting server is
        waited for), then it fails."""
        client = self._clients[shard]
        if client is None:
            client = self._clients[shard] = self.connect(
                shard,
                name="ftkafka-driver",
                request_timeout=30.0,
                reconnect_s=self.options.ft_reconnect_timeout_s,
            )
        return self._on(self._clients, shard, client, what, call)

    def quick(self, shard: int, what: str, call: Callable[[FTClient], T]) -> T:
        """A call to one shard that may fail (the next batch asks again): with several
        shards, one connection attempt only, so a shard that is down does not hold up
        the others' partitions; with one shard, as `call`."""
        if self.count == 1:
            return self.call(shard, what, call)
        client = self._quick[shard]
        if client is None:
            client = self._quick[shard] = self.connect(
                shard, name="ftkafka-driver", request_timeout=30.0, reconnect_s=0.0
            )
        return self._on(self._quick, shard, client, what, call)

    def _on(
        self,
        clients: list[FTClient | None],
        shard: int,
        client: FTClient,
        what: str,
        call: Callable[[FTClient], T],
    ) -> T:
        began = time.monotonic()
        try:
            return call(client)
        except (ConnectionLost, OSError) as exc:
            client.close()
            clients[shard] = None
            self._stores_seen.pop(client, None)
            raise SourceError(
                f"could not {what}: {self.where(shard)} did not answer within "
                f"{time.monotonic() - began:.1f} s: {exc}"
            ) from exc

    def each(self, what: str, call: Callable[[FTClient], T]) -> list[T]:
        """The call on every shard, in shard order."""
        return [self.call(shard, what, call) for shard in range(self.count)]

    def statuses(self) -> tuple[list[BriefStatus | None], list[int]]:
        """Every shard's STATUS, None for a shard that is down, and the shards that are
        back since the last call. With one shard a failure is a SourceError (after
        ft.reconnectTimeoutMs); with several, only once no shard answered for
        ft.reconnectTimeoutMs."""
        if self.count == 1:
            return [self.call(0, "read the replay cursor", self._status)], []
        statuses: list[BriefStatus | None] = []
        back: list[int] = []
        now = time.monotonic()
        for shard in range(self.count):
            try:
                status = self.quick(shard, "read the replay cursor", self._status)
            except SourceError as exc:
                statuses.append(None)
                if shard not in self.down:
                    self.down[shard] = now
                    log.warning(
                        "%s is down: its partitions take in nothing until it answers "
                        "again, the others go on (%s)",
                        self.where(shard),
                        exc,
                    )
                continue
            statuses.append(status)
            if shard in self.down:
                log.warning(
                    "%s answers again after %.1f s: its partitions go on",
                    self.where(shard),
                    now - self.down.pop(shard),
                )
                back.append(shard)
        if len(self.down) < self.count:
            self._all_down_since = None
            return statuses, back
        if self._all_down_since is None:
            self._all_down_since = now
        elif now - self._all_down_since > self.options.ft_reconnect_timeout_s:
            raise SourceError(
                f"no shard of the FT layer at {self.options.ft.address} (option "
                f"ft.address) answered for {now - self._all_down_since:.1f} s "
                "(ft.reconnectTimeoutMs)"
            )
        return statuses, back

    def _status(self, client: FTClient) -> BriefStatus:
        """A STATUS, noting the store that answered over the client's connection."""
        status = brief_status(client)
        self._stores_seen[client] = (client.connections, status.store_id)
        return status

    def store_on(self, client: FTClient, connection: int) -> str | None:
        """The store that `client` reached over its connection number `connection`
        (FTClient.connections), read by a STATUS once per connection; None if that
        connection is gone (then which store answered over it is not known)."""
        seen = self._stores_seen.get(client)
        if seen is None or seen[0] != client.connections:
            self._status(client)
            seen = self._stores_seen[client]
        return seen[1] if seen[0] == connection else None

    def connect(
        self, shard: int, *, name: str, request_timeout: float, reconnect_s: float
    ) -> FTClient:
        """A client of its own to shard `shard` (the heartbeat thread's)."""
        ft = self.options.ft
        return FTClient(
            self.addresses[shard],
            token=ft.token,
            connect_timeout=self.options.ft_connect_timeout_s,
            request_timeout=request_timeout,
            name=name,
            tls=ft.tls_ca or False,
            reconnect_s=reconnect_s,
        )

    def check_places(self) -> list[BriefStatus]:
        """Every shard's STATUS, once each was found where ft.address puts it: shard i
        of as many shards as ft.address names (ConfigError naming the first that is
        not)."""
        statuses = self.each("check the FT layer's shards", self._status)
        for shard, (address, status) in enumerate(zip(self.addresses, statuses, strict=True)):
            if (status.shard, status.shards) != (shard, self.count):
                raise ConfigError(
                    f"option ft.address: the FT layer at {address} is shard {status.shard} "
                    f"of {status.shards}, but ft.address names it as shard {shard} of "
                    f"{self.count}: list every shard of the cluster, in shard order"
                )
        self.store_ids = [status.store_id for status in statuses]
        return statuses

    def close(self) -> None:
        self._stores_seen.clear()
        for clients in (self._clients, self._quick):
            for shard, client in enumerate(clients):
                if client is not None:
                    client.close()
                clients[shard] = None


def brief_status(client: FTClient) -> BriefStatus:
    """The brief STATUS: all the source's driver reads per batch (docs/protocol.md 6.2)."""
    return client.brief_status()
