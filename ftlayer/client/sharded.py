"""A process's channel to a cluster of FT-layer shards: `ShardedChannel`, one
BatchingChannel per shard, each event sent to the shard that owns it.

Routing needs no lookup (ftlayer.shards): a record goes to the shard of its source's
partition (`partition_shard`), an XOR, FAIL, HOLD or sink hold to the shard its root's
bits 55-62 name (`shard_of`); an event naming roots of several shards (a multi-anchored
row) is split, each shard getting its own roots in their order. A source registers with
every shard; a sink's settle goes to every shard, since the steps that held acks under
its key ran in other processes (executors) than the one that settles it (the driver),
and a settle of a key a shard holds nothing under only marks it settled there. A
process's holds and settle reach a shard in the order it made them (each shard's
channel keeps its own order; shards are independent of one another). A shard that is
down is not waited for at a settle: with several shards a settle makes one connection
attempt to each, and one that does not answer keeps its holds under the key unsettled,
so their trees time out and are replayed (nothing lost) while the sink's batch, and
the other shards' trees, go on. A FAIL that its shard does not take within a couple
of seconds (the shard died under a running batch) is parked on another shard
(`_park`, FAIL_PARKED; ftlayer.core.parked) and the task goes on: in barrier mode the
driver delivers it before that shard's next barrier. Calls that read (`status`,
`fetch_replay`) name their shard.

With one shard it is that shard's channel, routing nothing. Errors are each shard's
channel's (ftlayer.client.channel): an unreachable shard fails the calls that need it
and no other.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from types import TracebackType
from typing import Self

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ftlayer.causes import Cause, Causes
from ftlayer.errors import ConfigError
from ftlayer.records import RecordBatch, ReplayRecords
from ftlayer.registration import SourceRegistration
from ftlayer.shards import MAX_SHARDS, shard_of
from ftlayer.status import Status

from .channel import BatchingChannel
from .errors import ConnectionLost

__all__ = ["ShardedChannel", "parse_addresses"]

log = logging.getLogger("ftlayer.client")


_PARK_WARN_INTERVAL_S = 10.0
_park_warned: dict[int, float] = {}


def _warn_parked(shard: int, address: str, keeper: int, roots: int) -> None:
    """A warning that failures were parked: the first, then at most every 10 s per
    shard in a process."""
    now = time.monotonic()
    if now - _park_warned.get(shard, -_PARK_WARN_INTERVAL_S) < _PARK_WARN_INTERVAL_S:
        return
    _park_warned[shard] = now
    log.warning(
        "shard %d of the FT layer, at %s, did not answer: a FAIL of %d roots is parked on "
        "shard %d, for the driver to deliver once shard %d answers again",
        shard, address, roots, keeper, shard,
    )  # fmt: skip


def parse_addresses(text: str) -> list[str]:
    """`HOST:PORT` or `HOST:PORT,HOST:PORT,...` (the shards in order) as a list;
    ConfigError for an empty entry, a repeated one or too many."""
    addresses = [a.strip() for a in text.split(",")]
    if any(not a for a in addresses):
        raise ConfigError(f"an FT-layer address list has an empty entry: {text!r}")
    if len(set(addresses)) != len(addresses):
        raise ConfigError(f"an FT-layer address list names a shard twice: {text!r}")
    if len(addresses) > MAX_SHARDS:
        raise ConfigError(f"a cluster has at most {MAX_SHARDS} shards, got {len(addresses)}")
    return addresses


class ShardedChannel:
    """An FTChannel over the shards of a cluster (module docstring); `channels[i]` is
    shard i's."""

    def __init__(self, channels: Sequence[BatchingChannel]) -> None:
        if not 1 <= len(channels) <= MAX_SHARDS:
            raise ConfigError(f"a cluster has 1 to {MAX_SHARDS} shards, got {len(channels)}")
        self.channels = list(channels)
        if len(self.channels) > 1:
            for shard, channel in enumerate(self.channels):
                channel.parking = partial(self._park, shard)

    @property
    def shards(self) -> int:
        return len(self.channels)

    def _split(self, roots: NDArray[np.uint64]) -> list[tuple[int, NDArray[np.intp]]]:
        """(shard, the rows of `roots` it owns) for every shard named."""
        if self.shards == 1:
            return [(0, np.arange(len(roots)))]
        owners = shard_of(roots, self.shards)
        outside = np.flatnonzero(owners >= self.shards)
        if len(outside):
            root = int(roots[outside[0]])
            raise ConfigError(
                f"root {root:#x} names shard {int(owners[outside[0]])}, outside this cluster "
                f"of {self.shards} shards"
            )
        return [(int(s), np.flatnonzero(owners == s)) for s in np.unique(owners).tolist()]

    # ---- the FTChannel protocol ---------------------------------------------------

    def persist(self, batch: RecordBatch, initial_values: ArrayLike | None = None) -> None:
        """Each record to the shard its root names (the persister draws each record's
        root in the shard of its partition); returns once every shard confirmed."""
        values = None if initial_values is None else np.asarray(initial_values, np.uint64)
        for shard, rows in self._split(batch.roots):
            whole = len(rows) == len(batch)
            part = batch if whole else batch.take(rows)
            self.channels[shard].persist(
                part, None if values is None else (values if whole else values[rows])
            )

    def xor(self, roots: ArrayLike, values: ArrayLike) -> int:
        r = np.ascontiguousarray(roots, dtype=np.uint64)
        v = np.ascontiguousarray(values, dtype=np.uint64)
        if r.shape != v.shape or r.ndim != 1:
            raise ConfigError(f"xor: {r.shape} roots but {v.shape} values")
        for shard, rows in self._split(r):
            self.channels[shard].xor(r[rows], v[rows])
        return len(r)

    def fail(self, roots: ArrayLike, causes: Causes | Cause | None = None) -> int:
        r = np.ascontiguousarray(roots, dtype=np.uint64)
        if r.ndim != 1:
            raise ConfigError(f"fail: roots must be one-dimensional, got shape {r.shape}")
        if not isinstance(causes, Causes):
            causes = Causes.one(causes, len(r))
        for shard, rows in self._split(r):
            self.channels[shard].fail(r[rows], causes.take(rows))
        return len(r)

    def read_range(self, first: int, n: int, seed: int) -> int:
        """To the shard the range root names (the shard that owns the range)."""
        ((shard, _),) = self._split(np.array([first], dtype=np.uint64))
        return self.channels[shard].read_range(first, n, seed)

    def hold(self, roots: ArrayLike, values: ArrayLike) -> int:
        r = np.ascontiguousarray(roots, dtype=np.uint64)
        v = np.ascontiguousarray(values, dtype=np.uint64)
        return sum(self.channels[s].hold(r[rows], v[rows]) for s, rows in self._split(r))

    def sink_hold(self, key: int, roots: ArrayLike, values: ArrayLike) -> int:
        r = np.ascontiguousarray(roots, dtype=np.uint64)
        v = np.ascontiguousarray(values, dtype=np.uint64)
        return sum(self.channels[s].sink_hold(key, r[rows], v[rows]) for s, rows in self._split(r))

    def sink_settle(self, key: int, cause: Cause | None = None) -> int:
        """Settle `key` on every shard (module docstring): the pairs XOR-ed, or roots
        failed, on all of them together; with several shards, one that does not answer
        at once is skipped, and its held trees time out and are replayed."""
        if self.shards == 1:
            return self.channels[0].sink_settle(key, cause)
        settled = 0
        for shard, channel in enumerate(self.channels):
            try:
                settled += channel.sink_settle(key, cause, reconnect_s=0.0)
            except ConnectionLost as exc:
                log.warning(
                    "shard %d of the FT layer, at %s, did not answer the settle of a batch "
                    "sink: its acks held under the sink's key stay unsettled, and their "
                    "trees time out and are replayed (%s)",
                    shard,
                    channel.client.address,
                    exc,
                )
        return settled

    def _park(self, shard: int, roots: NDArray[np.uint64], causes: Causes) -> None:
        """Shard `shard` did not take this FAIL within its channel's park_after_s: keep
        it on the next shard that answers (FAIL_PARKED, committed there before it
        answers), for the driver to deliver before it sends `shard` a barrier again.
        With no other shard answering either, wait for `shard` as every call does
        (its client's reconnect_s), then fail."""
        count = self.shards
        owner = self.channels[shard]
        for step in range(1, count):
            keeper = self.channels[(shard + step) % count]
            try:
                keeper.client.fail_parked(
                    shard,
                    owner.client.store_id or "",
                    roots,
                    causes,
                    reconnect_s=keeper.park_after_s,
                )
            except ConnectionLost:
                continue
            _warn_parked(shard, owner.client.address, (shard + step) % count, len(roots))
            return
        log.warning(
            "shard %d of the FT layer, at %s, did not take a FAIL of %d roots, and no other "
            "shard answered to keep it: waiting for shard %d",
            shard, owner.client.address, len(roots), shard,
        )  # fmt: skip
        owner.client.fail(roots, causes)

    # ---- calls to every shard, or to one --------------------------------------------

    def register_source(self, registration: SourceRegistration) -> None:
        for channel in self.channels:
            channel.register_source(registration)

    def fetch_replay(
        self,
        shard: int,
        lo: int,
        hi: int,
        source_id: int | None = None,
        partition: int | None = None,
    ) -> ReplayRecords:
        """Shard `shard`'s replays with lo < replay seq <= hi (replay seqs are each
        shard's own)."""
        return self.channels[shard].fetch_replay(lo, hi, source_id, partition)

    def status(self, shard: int) -> Status:
        return self.channels[shard].status()

    def flush(self) -> None:
        """Flush every shard's channel; the first error is raised after all were tried."""
        self._each(lambda channel: channel.flush())

    def close(self) -> None:
        self._each(lambda channel: channel.close())

    def _each(self, call: Callable[[BatchingChannel], None]) -> None:
        first: BaseException | None = None
        for channel in self.channels:
            try:
                call(channel)
            except BaseException as exc:
                if first is None:
                    first = exc
                else:
                    with contextlib.suppress(Exception):
                        first.add_note(f"another shard failed too: {exc!r}")
        if first is not None:
            raise first

    @property
    def closed(self) -> bool:
        return all(channel.closed for channel in self.channels)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
