"""The FT-layer core's one state object, and the primitives every room of the core uses.

`FTLayer` (ftlayer.core.layer) is a facade over one `CoreState`; its verbs live in
rooms of their own, each a module of functions over the state:

- persist and takeover (ftlayer.core.persist): persist in one or three steps, re-reads
  taking roots over;
- XOR and completion (ftlayer.core.completion): xor, completion, deferred deletes;
- holds (ftlayer.core.holding): barrier holds and their release, sink holds and settles;
- failure, timeouts, requeue and replay (ftlayer.core.failure, with the table of a
  root's life): fail, timeouts, retry fates, the replay queue;
- recovery and state copies (ftlayer.core.recovery): recovery from storage and journal,
  state_snapshot, journal bases;
- dead-letter admin (ftlayer.core.deadletters): list, requeue, restore, purge;
- records stored by reference (ftlayer.core.fills): the failed ones whose bytes their
  source has not copied in, filling them, and those the source no longer has;
- queries (ftlayer.core.queries): inspect, pending offsets and counts, stats.

The state is what a root's life touches: the acker table (ack value and locator per
pending root), the persistence layer over the storage, the rotating timeouts beside it, the
replay queue, the retry book, the retired roots, the open holds, the batch leases,
the read marks of takeover, the persists under way, and the counters. Only the rooms
change it, and only one thread at a time (the facade's contract); every change to
what `state_snapshot` copies calls `changing()` first, so a checkpoint copies lazily.

The primitives here are the few steps several rooms share: start timeouts (`track`),
route records to replay partitions (`route`), count dropped events, add holds, and
find the rows of barrier-mode sources.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Hashable
from typing import Any, Final, cast

import numpy as np
from numpy.typing import NDArray

from ftlayer.acking.acker import AckerTable
from ftlayer.acking.ids import new_ids
from ftlayer.acking.u64map import U64Map
from ftlayer.causes import Causes
from ftlayer.errors import ConfigError
from ftlayer.persistence.base import PersistenceStorage
from ftlayer.persistence.layer import LOCATOR_COLUMNS, Completed, PersistenceLayer
from ftlayer.persistence.timeout import RootTimeouts
from ftlayer.records import RecordBatch
from ftlayer.shards import ShardPlace

from .barrier import OpenHolds
from .ingestids import DEFAULT_WINDOW_S, IngestIds
from .journal import Journal
from .kept import KeptRecords
from .leases import DEFAULT_LAPSED_S, BatchLeases, BatchTag
from .meters import Meters
from .rangetable import OpenRanges
from .replay import REPLAY_SEQ_META_KEY, ReplayQueue
from .retired import RetiredRoots
from .retries import RetryBook, RetryPolicy
from .sinkholds import SinkKeys
from .sources import SourceConfig, SourceRegistry
from .stats import FTStats
from .takeover import ReadMarks
from .unfilled import Unfilled

__all__ = [
    "CompletionListener",
    "CoreState",
    "PersistTicket",
    "source_list",
    "sources_of",
]

EMPTY_U64: NDArray[np.uint64] = np.zeros(0, dtype=np.uint64)
KEPT_WAITING: Final = 250_000
"""At most this many filled records waiting for their backoff are kept in memory (and
at most ftlayer.core.kept.DEFAULT_MAX_BYTES of their payloads)."""

CompletionListener = Callable[[Completed], None]
"""Told of the roots whose records left the pipeline (completed, or dead-lettered) with
their Kafka coordinates: an observer for a core embedded in process."""


@dataclasses.dataclass(frozen=True, eq=False)
class PersistTicket:
    """A persist between `FTLayer.begin_persist` and its end: the batch, its first ack
    values (checked) and the store's next seq at its beginning."""

    batch: RecordBatch
    initial_values: NDArray[np.uint64] | None
    floor: int


class CoreState:
    """Everything the core knows; see the module docstring. Built by FTLayer."""

    def __init__(
        self,
        storage: PersistenceStorage,
        *,
        timeout_s: float,
        buckets: int,
        sources: dict[int, SourceConfig] | None,
        default_source: SourceConfig | None,
        retired_ttl_s: float | None,
        clock: Callable[[], float],
        defer_deletes: bool,
        retry: RetryPolicy,
        wall_clock: Callable[[], float],
        seed: int | None,
        journal: Journal | None,
        journal_base_bytes: int | None,
        on_timeout: Callable[[NDArray[np.uint64], NDArray[np.uint64]], None],
        shard: ShardPlace,
        lapsed_batch_timeout_s: float = DEFAULT_LAPSED_S,
    ) -> None:
        self.clock = clock
        self.shard = shard
        """This core's place in its cluster: its new roots and range numbers carry it
        (ftlayer.shards)."""
        self.wall = wall_clock
        self.rng = random.Random(seed)
        self.jitter_rng: np.random.Generator | None = None  # rangefail's, made at first use
        self.journal = journal
        if journal_base_bytes is not None and (
            isinstance(journal_base_bytes, bool) or journal_base_bytes < 0
        ):
            raise ConfigError(
                f"journal_base_bytes is a byte count >= 0 or None, got {journal_base_bytes!r}"
            )
        self.journal_base_bytes = journal_base_bytes
        """The journal growth after which a state copy is due as its base (None: the
        default of ftlayer.core.recovery.journal_base_due)."""
        self.default_retry = retry
        self.storage = storage
        self.acker = AckerTable(columns=LOCATOR_COLUMNS)
        self.leases = BatchLeases(lapsed_batch_timeout_s)
        self.persistence = PersistenceLayer(storage, defer_deletes=defer_deletes)
        self.timeouts = RootTimeouts(
            timeout_s=timeout_s,
            buckets=buckets,
            on_timeout=on_timeout,
            start=clock(),
            postpone=self._batch_running,
        )
        self.sources = SourceRegistry(storage, sources, default_source)
        meta = storage.get_meta(REPLAY_SEQ_META_KEY)
        self.queue = ReplayQueue(next_seq=int(meta.decode()) if meta else 1)
        self.retired = RetiredRoots(retired_ttl_s or 2 * timeout_s, start=clock())
        self.book = RetryBook(storage)
        self.ranges = OpenRanges(storage, shard.range_numbers(), now=clock())
        """The open batch ranges (ftlayer.core.ranges)."""
        self.noted: list[tuple[NDArray[np.uint64], Causes, float]] = []
        """Failures of batch-range rows noted, not applied yet (ftlayer.core.failnotes):
        (distinct roots, their causes, wall time), in order."""
        self.noted_keys: set[int] = set()
        """The roots of `noted`."""
        self.noted_since: float | None = None
        """When the first of `noted` came (the clock's time)."""
        self.unrouted: dict[int, tuple[int, float]] = {}
        """Failed records whose key (so their replay partition) is not known until their
        source copies their bytes in: storage seq -> (root, due time)."""
        self.ingest_ids = IngestIds(DEFAULT_WINDOW_S)
        """Identities of records ingested within the window (ftlayer.core.ingest)."""
        self.unfilled = Unfilled()
        """Failed records stored by reference whose bytes their source has not copied
        in yet, by source (ftlayer.core.fills)."""
        self.waiting_records = KeptRecords(KEPT_WAITING)
        """Filled records waiting for their backoff, as their fill stored them: the
        ticker queues them without a read (ftlayer.core.fills, failure.release_due)."""
        self.barrier_mode = self.sources.barrier_mode
        """The ids of the sources registered with barrier completion."""
        self.holds = OpenHolds()
        self.sink_keys = SinkKeys()
        self.change_hooks: list[Callable[[], None]] = []
        self.listeners: list[CompletionListener] = []
        self.stats = FTStats()
        self.meters = Meters()
        self.marks = ReadMarks()
        # Persists begun and not ended (begin_persist), and their roots, reserved: a
        # map made afresh whenever none is under way (deleted keys cost its lookups).
        self.tickets: set[PersistTicket] = set()
        self.persisting = U64Map({}, key_name="root")
        # The seqs stored by persists that ended (or records stored otherwise) while a
        # persist was under way: a journal base taken then knows their fate although
        # they lie at or above a ticket's floor (state_snapshot, "journal.ended_seqs").
        self.ended: list[NDArray[np.uint64]] = []

    # ---- shared primitives -----------------------------------------------------

    def new_roots(self, n: int) -> NDArray[np.uint64]:
        """`n` fresh roots of this shard (ftlayer.shards)."""
        return new_ids(n, self.shard.index, self.shard.count)

    def changing(self) -> None:
        """Called before every change to what `state_snapshot` copies."""
        for hook in self.change_hooks:
            hook()

    def notify(self, done: Completed) -> None:
        """Tell every completion listener, even if one raises; then raise the first
        error."""
        errors: list[BaseException] = []
        for listener in self.listeners:
            try:
                listener(done)
            except Exception as exc:  # re-raised once every listener was told
                errors.append(exc)
        if errors:
            raise errors[0]

    def source_config(self, source_id: int) -> SourceConfig | None:
        return self.sources.get(source_id)

    def retry_policy(self, source_id: int) -> RetryPolicy:
        config = self.source_config(source_id)
        return self.default_retry if config is None else config.retry

    def _batch_running(self, tag: Hashable, now: float) -> bool:
        """The timeout layer's question at an entry's expiry: postpone it?"""
        return self.leases.running(cast(BatchTag, tag), now)

    def track(
        self, roots: NDArray[np.uint64], seqs: NDArray[np.uint64], source_ids: NDArray[Any]
    ) -> None:
        """Start the timeouts of roots that became pending now (their records' storage
        seqs aligned), each with its source's timeout (the FT layer's for sources
        without their own), tagged with its source's open batch (postponed while that
        batch runs)."""
        now = self.clock()
        sources = source_list(source_ids)
        for source_id in sources:
            config = self.source_config(source_id)
            timeout = None if config is None else config.timeout_s
            tag = self.leases.tag(source_id)
            if len(sources) == 1:
                self.timeouts.track(roots, seqs, timeout, now, tag)
            else:
                rows = source_ids == source_id
                self.timeouts.track(roots[rows], seqs[rows], timeout, now, tag)

    def route(self, batch: RecordBatch) -> tuple[NDArray[np.intp], NDArray[np.int32]]:
        """(record index, target partition) pairs, by each record's source partitioner;
        sources without a config re-enter their original partition."""
        index_parts: list[NDArray[np.intp]] = []
        partition_parts: list[NDArray[np.int32]] = []
        for source_id in sources_of(batch):
            rows = np.flatnonzero(batch.source_ids == source_id)
            config = self.source_config(source_id)
            if config is None:
                index_parts.append(rows)
                partition_parts.append(batch.partitions[rows])
                continue
            sub = batch.take(rows) if len(rows) < len(batch) else batch
            idx, parts = config.partitioner.targets(sub, config.num_partitions)
            index_parts.append(rows[idx])
            partition_parts.append(parts.astype(np.int32))
        if not index_parts:
            return np.zeros(0, np.intp), np.zeros(0, np.int32)
        index = np.concatenate(index_parts)
        order = np.argsort(index, kind="stable")
        return index[order], np.concatenate(partition_parts)[order]

    def count_dropped(self, roots: NDArray[np.uint64]) -> None:
        """Events for roots that are not pending: "late" for a root retired recently,
        "unknown" otherwise."""
        late = 0
        if len(self.retired):
            late = int(np.count_nonzero(self.retired.known(roots, self.clock())))
        self.stats.late_events += late
        self.stats.unknown_events += len(roots) - late

    def add_holds(self, key: int, roots: NDArray[np.uint64], values: NDArray[np.uint64]) -> None:
        """Open holds (root, value) under a source id or a sink key, journaled."""
        self.holds.add(key, roots, values)
        if self.journal is not None:
            self.journal.hold(key, roots, values)

    def barrier_mode_rows(
        self, source_ids: NDArray[Any]
    ) -> list[tuple[int, NDArray[np.intp]]] | None:
        """(source id, rows) of the rows of barrier-mode sources; None if none."""
        found = [
            (s, np.flatnonzero(source_ids == s))
            for s in source_list(source_ids)
            if s in self.barrier_mode
        ]
        return found or None

    def live_with_seqs(
        self, roots: NDArray[np.uint64], seqs: NDArray[np.uint64]
    ) -> NDArray[np.bool_]:
        """Which `roots` are pending under the record `seqs` names (aligned): not
        completed, failed or persisted again since."""
        pending, current = self.acker.lookup("seq", roots)
        live = pending.copy()
        live[pending] = current == seqs[pending]
        return live


def sources_of(batch: RecordBatch) -> list[int]:
    """The distinct source ids of a batch (usually one: a batch comes from one source)."""
    return source_list(batch.source_ids)


def source_list(ids: NDArray[Any]) -> list[int]:
    if len(ids) and bool((ids == ids[0]).all()):
        return [int(ids[0])]
    return [int(i) for i in np.unique(ids)]
