"""The FT-layer core: persist, track, complete, fail and replay source records.

Every source record is persisted before its source emits it. From then on its root id
is pending in one table, the acker table, which keeps per root the ack value and the
record's locator (storage seq and Kafka coordinates); the record stays in storage and
its root is timed in rotating buckets. A root stops being pending in exactly one of
three ways:

1. Completion (ftlayer.core.completion): XOR events (root, value) arrive from sources,
   tasks and sinks, and barrier holds are released at a batch's barrier
   (ftlayer.core.holding); the first time a root's ack value returns to 0 its tree is
   complete and its record is deleted, so Kafka offsets can move past it.
2. Failure (ftlayer.core.failure, which opens with the table of a root's life):
   explicit (a task raised FailException), timeout (the root stayed pending between T
   and T * (1 + 1/(n-1)), unless its batch still runs under a lease, or its lease
   lapsed and the source's next barrier may yet come: ftlayer.core.leases), or
   recovery (a restarted FT layer whose journal does not know the record's tree:
   ftlayer.core.recovery). The record is re-tagged with a fresh root
   and, by its source's retry policy, replayed (routed by its source's replay
   partitioner) or dead-lettered (ftlayer.core.deadletters).
3. Takeover (ftlayer.core.persist, ftlayer.core.takeover): Spark ran the work again and
   a newer copy of the same record covers it; the old root retires with no replay.

Events for roots that are not pending are dropped: "late" when the root failed or was
taken over recently (RetiredRoots remembers them for 2T by default), "unknown"
otherwise. They never create pending entries that could not complete. Persisting a
root that is pending or remembered as retired is refused (StateConflict, nothing
stored): late events of the old tree would corrupt the new one. A completed root is
not remembered (that would cost memory per completed record); persisting it again
starts a new tree, and the completed tree's timeout entry cannot touch it (timeouts
match entries to trees by storage seq).

Nothing is lost: a record leaves storage only when its tree completed, or when a copy
persisted again under a new root took it over (that copy is stored first). A failure
between persist and emit, a lost event, a lost fail, a crashed task or a crashed FT
layer all end in a timeout or a recovery, that is, in a replay (or, after a crash the
journal covers, in the tree going on where it was).

`FTLayer` is a facade over one `CoreState` (ftlayer.core.state, which lists the rooms):
each method says what it does and hands the work to its room. Not thread-safe: one
thread drives a core at a time (the server serializes its clients with a lock); only
`write_persist`, a persist's storage write, may run outside it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ftlayer.acking.acker import AckerTable, XorResult
from ftlayer.acking.rotating import validate_timeout
from ftlayer.causes import Cause, Causes
from ftlayer.errors import ConfigError
from ftlayer.inspection import Inspection, RecordQuery
from ftlayer.persistence.base import PersistenceStorage
from ftlayer.persistence.layer import PersistenceLayer
from ftlayer.persistence.timeout import RootTimeouts
from ftlayer.rangeroots import is_range_root
from ftlayer.records import RecordBatch, ReplayRecords
from ftlayer.registration import SourceRegistration
from ftlayer.shards import ShardPlace

from . import (
    completion,
    deadletters,
    failnotes,
    failure,
    fills,
    holding,
    ingest,
    persist,
    queries,
    rangeacks,
    ranges,
    recovery,
    sinkmarks,
)
from .ingestids import DEFAULT_WINDOW_S, IngestIds, IngestResult
from .journal import Journal
from .leases import DEFAULT_LAPSED_S, check_lapsed_s
from .meters import Meters
from .retries import IMMEDIATE, DeadLetterFilter, RetryPolicy, RetryRecord
from .sources import SourceConfig
from .state import CompletionListener, CoreState, PersistTicket
from .stats import FTStats

#: A ticker that sleeps until `tick_delay` queues a failed record at most this long
#: after its backoff ended (never before). Its source asks sooner: the server queues
#: what ended at each brief STATUS, which asks for the replay cursor a batch takes in,
#: so a running query never waits for this; a tick queues for those that do not ask.
RELEASE_AFTER_S: Final = 1.0

#: A barrier that completes at most this many stored records (a batch's replays)
#: stages their deletes, which then ride on the store's next write (the next batch's
#: BATCH_RANGES, as the completed ranges' own deletes do) instead of waking the
#: server's deleter for a transaction of their own; more go to the deleter.
BARRIER_DELETES_STAGED_MAX: Final = 4096

__all__ = ["CompletionListener", "FTLayer", "PersistTicket", "StoreFigures"]


@dataclasses.dataclass(frozen=True, slots=True)
class StoreFigures:
    """The store's figures for STATUS: records stored, completed records whose delete is
    not committed yet (marked in the core, or staged in the store), bytes."""

    stored_records: int
    deletes_pending: int
    size_bytes: int
    commits: int
    """Write transactions committed since the store opened (PersistenceStorage.commits)."""


class FTLayer:
    """The in-process FT-layer core; see the module docstring for the contract."""

    def __init__(
        self,
        storage: PersistenceStorage,
        *,
        timeout_s: float = 30.0,
        buckets: int = 3,
        sources: Mapping[int, SourceConfig] | None = None,
        default_source: SourceConfig | None = None,
        retired_ttl_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        defer_deletes: bool = False,
        retry: RetryPolicy | None = None,
        wall_clock: Callable[[], float] = time.time,
        seed: int | None = None,
        journal: Journal | None = None,
        journal_base_bytes: int | None = None,
        shard: ShardPlace | None = None,
        ingest_window_s: float = DEFAULT_WINDOW_S,
        lapsed_batch_timeout_s: float = DEFAULT_LAPSED_S,
    ) -> None:
        def on_timeout(roots: NDArray[np.uint64], seqs: NDArray[np.uint64]) -> None:
            failure.on_timeout(self._s, roots, seqs)

        self._s = CoreState(
            storage,
            timeout_s=timeout_s,
            buckets=buckets,
            sources=None if sources is None else dict(sources),
            default_source=default_source,
            retired_ttl_s=retired_ttl_s,
            clock=clock,
            defer_deletes=defer_deletes,
            retry=retry or IMMEDIATE,
            wall_clock=wall_clock,
            seed=seed,
            journal=journal,
            journal_base_bytes=journal_base_bytes,
            on_timeout=on_timeout,
            shard=shard or ShardPlace(),
            lapsed_batch_timeout_s=check_lapsed_s(lapsed_batch_timeout_s),
        )
        if not ingest_window_s > 0:
            raise ConfigError(f"ingest_window_s must be > 0 seconds, got {ingest_window_s!r}")
        self._s.ingest_ids = IngestIds(ingest_window_s)
        recovery.recover(self._s)

    # ---- the state, for the server, the checkpoint coordinator and tests -------------

    @property
    def storage(self) -> PersistenceStorage:
        return self._s.storage

    @property
    def acker(self) -> AckerTable:
        return self._s.acker

    @property
    def persistence(self) -> PersistenceLayer:
        """Where pending roots' records are stored (and the deletes marked)."""
        return self._s.persistence

    @property
    def timeouts(self) -> RootTimeouts:
        """The rotating timeouts of pending roots."""
        return self._s.timeouts

    @property
    def stats(self) -> FTStats:
        return self._s.stats

    @property
    def meters(self) -> Meters:
        """Per-source counters and the complete latency (ftlayer.core.meters)."""
        return self._s.meters

    @meters.setter
    def meters(self, meters: Meters) -> None:
        self._s.meters = meters

    @property
    def journal(self) -> Journal | None:
        return self._s.journal

    # ---- configuration ---------------------------------------------------------

    def source_config(self, source_id: int) -> SourceConfig | None:
        return self._s.source_config(source_id)

    def source_specs(self) -> dict[str, dict[str, Any]]:
        """The registered sources as stored (SourceRegistry.specs), by source id."""
        return self._s.sources.specs()

    def register_source(self, registration: SourceRegistration) -> SourceConfig:
        """Configure how a source's records are replayed (ftlayer.registration), and
        store that in the storage's meta entries, so a restarted FT layer routes its
        recovered records the same way (the registrations load before recovery).
        Registering again replaces the config; records already queued keep the
        partitions they were routed to, and its own tree timeout applies to roots that
        start pending from then on. ConfigError (nothing changed) for an unknown
        partitioner, bad options, a timeout or retry policy out of range."""
        s = self._s
        if registration.timeout_s is not None:
            validate_timeout(registration.timeout_s, s.timeouts.buckets)
        config = s.sources.register(registration)
        s.barrier_mode = s.sources.barrier_mode
        return config

    def add_change_hook(self, hook: Callable[[], None]) -> None:
        """Call `hook()` before every change to the state `state_snapshot` copies
        (persist, xor, fail, tick, prune_replay), so a copy can be taken lazily: a
        checkpoint barrier copies nothing at once, and the copy taken before the next
        change is still the state at the barrier (ftlayer.checkpoint)."""
        self._s.change_hooks.append(hook)

    def add_completion_listener(self, listener: CompletionListener) -> None:
        """Tell `listener` of every root whose record left the pipeline (its tree
        completed, or it was dead-lettered), with its Kafka coordinates: an observer
        for a core embedded in process (tests, benches). The server registers none: its
        sources learn what they may commit from `lowest_pending_offsets`."""
        self._s.listeners.append(listener)

    @property
    def replay_cursor(self) -> int:
        """The highest replay seq handed out so far (0 before the first failure)."""
        return self._s.queue.cursor

    def replay_cursor_of(self, source_id: int) -> int:
        """The highest replay seq of `source_id`'s records; for a source with none since
        this FT layer started, the cursor at the start. Never behind a value it
        returned before (also across restarts), and a source's replays all have seqs
        at most this: a reader that takes in (its last cursor, this] misses none."""
        return self._s.queue.cursor_of(source_id)

    def replay_start_of(self, source_id: int) -> int:
        """Where a new query of `source_id` starts its replay cursor: the point its
        queue entries were pruned to (0 if never), so it takes in every queued replay
        of the source that no finished batch took in."""
        return self._s.queue.start_of(source_id)

    def retries(self, root: int) -> int:
        """How many times the record now tracked under `root` failed (and was or will be
        replayed); 0 for a root not pending or never failed."""
        pending, seqs = self._s.acker.lookup("seq", np.array([root], dtype=np.uint64))
        record = self._s.book.get(int(seqs[0])) if bool(pending[0]) else None
        return 0 if record is None else record.attempts

    def retry_record(self, seq: int) -> RetryRecord | None:
        """The failure history of stored record `seq`, if it ever failed."""
        return self._s.book.get(seq)

    def retry_policy(self, source_id: int) -> RetryPolicy:
        return self._s.retry_policy(source_id)

    @property
    def waiting_replays(self) -> int:
        """Failed records waiting for their backoff before they enter the replay queue."""
        return self._s.book.waiting

    def __len__(self) -> int:
        return len(self._s.acker)

    @property
    def pending(self) -> int:
        """Roots whose tree is not complete: the acker table's, and the records pending
        in open batch ranges (STATUS `pending`)."""
        return len(self._s.acker) + sum(ranges.pending_counts(self._s).values())

    @property
    def queued_replays(self) -> int:
        """Entries in the replay queue (not pruned yet)."""
        return len(self._s.queue)

    def queued_replays_by_source(self) -> dict[int, int]:
        """{source id: its entries in the replay queue}, sources with none left out."""
        return self._s.queue.counts()

    # ---- persist (ftlayer.core.persist) ------------------------------------------

    def persist(self, batch: RecordBatch, initial_values: ArrayLike | None = None) -> None:
        """Persist source records before their source emits them.

        `initial_values` are the roots' first ack values: the XOR of the record ids the
        source emits for each record (0, the default, when it sends those as events).
        Raises, with nothing stored: ConfigError for a reserved root (0 or 1) or a root
        repeated in the batch; StateConflict for a root pending, being persisted or
        failed within the retired TTL; PartitioningError for a record its source's
        replay partitioner could not route (no key for a hash partitioner).

        In one call, the storage write under the caller's lock if it has one; a caller
        that would rather write outside it calls `begin_persist`, `write_persist` and
        `end_persist` (the server)."""
        persist.persist(self._s, batch, initial_values)

    def begin_persist(
        self, batch: RecordBatch, initial_values: ArrayLike | None = None
    ) -> PersistTicket:
        """The first of a persist's three steps (see `persist`, which raises what this
        raises): check the batch and reserve its roots, changing nothing else. Then the
        caller stores the records with `write_persist` (no lock of this core needed:
        every storage seq it gets is at least `ticket.floor`) and ends the persist with
        `end_persist` (stored) or `abort_persist` (the write failed).

        Until it ends, the persist is invisible: its roots are not pending (events and
        fails for them are dropped as unknown; no client has them before the persist's
        OK), but a persist of the same roots is refused; and the state copies give the
        journal a storage seq at most `floor`, so a crash before `end_persist` replays
        the stored records (ftlayer.core.journal) instead of taking them for
        completed."""
        return persist.begin_persist(self._s, batch, initial_values)

    def write_persist(self, ticket: PersistTicket) -> NDArray[np.uint64]:
        """The second step: store the ticket's records durably (committed and synced);
        returns their storage seqs. Safe to call without serializing the core (the
        storage is thread-safe); the only method that is."""
        return persist.write_persist(self._s, ticket)

    def abort_persist(self, ticket: PersistTicket) -> None:
        """The storage write of a begun persist failed: its roots are free again, and
        nothing else changed."""
        persist.abort_persist(self._s, ticket)

    def end_persist(self, ticket: PersistTicket, seqs: NDArray[np.uint64]) -> None:
        """The last step of a persist: its records are stored under `seqs`. The roots
        become pending with their first ack values and their records' locators, their
        timeouts start, the journal learns them, a re-read takes over the pending roots
        of the same records (ftlayer.core.takeover) and barrier-mode roots get their
        holds. Only now does a state copy, a fail or an event see them."""
        persist.end_persist(self._s, ticket, seqs)

    # ---- XOR and completion (ftlayer.core.completion) ---------------------------------

    def xor(self, roots: ArrayLike, values: ArrayLike) -> XorResult:
        """Apply XOR events; completes the roots whose ack value returns to 0."""
        return completion.xor(self._s, roots, values)

    def xor_one(self, root: int, value: int) -> bool:
        """One XOR event (cold paths); True if it completed its root."""
        one = self.xor(np.array([root], dtype=np.uint64), np.array([value], dtype=np.uint64))
        return len(one.completed) == 1

    def take_deletes(self) -> NDArray[np.uint64]:
        """With defer_deletes: the seqs of completed records not deleted yet, unmarked.

        The caller deletes them (`delete_stored`), possibly in another thread while this
        core goes on; if that fails, they go back with `retry_deletes`, and a record a
        crash leaves undeleted is replayed after the restart: duplicates, never a
        loss."""
        return completion.take_deletes(self._s)

    def delete_stored(self, seqs: NDArray[np.uint64]) -> None:
        """Delete records taken with `take_deletes` from storage, in one transaction.
        Safe to call without serializing the core (the storage is thread-safe)."""
        self._s.storage.delete(seqs)

    def flush_staged(self, older_than_s: float = 0.0) -> None:
        """Commit the storage's staged writes (checkpoint records, deletes) that waited
        at least `older_than_s`. Safe to call without serializing the core."""
        self._s.storage.flush_staged(older_than_s)

    def staged_since(self) -> float | None:
        """When (time.monotonic) the oldest staged write `flush_staged` would commit was
        staged; None when none waits."""
        return self._s.storage.staged_since

    def store_figures(self) -> StoreFigures:
        """What the store holds: records, deletes not committed yet, size."""
        storage = self._s.storage
        return StoreFigures(
            stored_records=len(storage),
            deletes_pending=self._s.persistence.marked + storage.staged_deletes,
            size_bytes=storage.size_bytes(),
            commits=storage.commits,
        )

    def retry_deletes(self, seqs: NDArray[np.uint64]) -> None:
        """With defer_deletes: seqs from `take_deletes` whose delete failed, marked
        again for the next take or flush."""
        completion.retry_deletes(self._s, seqs)

    def flush_deletes(self) -> int:
        """With defer_deletes: delete the completed records not deleted yet, now."""
        return completion.flush_deletes(self._s)

    # ---- holds (ftlayer.core.holding) ----------------------------------------------

    def hold(self, roots: ArrayLike, values: ArrayLike) -> int:
        """A barrier-mode root goes on in a new batch (a loop record read back): XOR
        `values` (releasing what held it, say the loop's record in transit) together
        with a fresh barrier hold, released at that batch's barrier. Pending roots
        only; returns how many were held."""
        return holding.hold(self._s, roots, values)

    def release_barrier(self, source_ids: Sequence[int]) -> int:
        """The batch of these sources is done: release every open barrier hold of
        theirs; roots nobody else holds complete. Returns how many completed."""
        return holding.release_barrier(self._s, source_ids)

    def sink_hold(self, key: int, roots: ArrayLike, values: ArrayLike) -> int:
        """The acks (root, id) of rows that reached a batch sink, sent by the step that
        produced them, held under the sink's `key` until `sink_settle`: nothing is
        XOR-ed yet. For a key already settled they are applied at once, as the settle
        did (XOR-ed, or their roots failed). Pending roots only; returns how many."""
        return holding.sink_hold(self._s, key, roots, values)

    def sink_settle(self, key: int, cause: Cause | None = None) -> int:
        """The batch sink's write under `key` is done: XOR every ack held under it (the
        trees nobody else holds complete); or, with `cause`, it failed: fail every
        root held under it. Pairs of roots no longer pending (a re-read took them
        over) are dropped. Returns how many pairs were XOR-ed, or roots failed."""
        return holding.sink_settle(self._s, key, cause)

    @property
    def open_holds(self) -> int:
        """Barrier and sink holds not released yet (also those of roots gone since)."""
        return len(self._s.holds)

    # ---- running batches: timeouts that follow progress (ftlayer.core.leases) -------

    def batch_began(self, source_ids: Sequence[int]) -> None:
        """The next batch of these sources is about to run (its barrier): roots tracked
        from now on belong to it. It has no lease until the first `heartbeat`. A batch
        of theirs still open (never reported done: its driver died and the restarted
        one plans it again) is adopted: its trees follow this batch from now on."""
        self._s.leases.began(source_ids, self._s.clock())
        ranges.tag_batch(self._s, source_ids)

    def batch_done(self, source_ids: Sequence[int]) -> None:
        """The batch of these sources is done: its lease ends, and the trees it left
        unfinished (and those of the batches it adopted) time out at their next
        expiry."""
        self._s.leases.done(source_ids)

    def heartbeat(self, source_ids: Sequence[int], lease_s: float) -> int:
        """The driver of these sources is alive and their batch is running: while it
        stays open and `lease_s` has not passed since this call, the timeouts of its
        trees are postponed (0 ends the lease). Returns how many of the sources have
        an open batch (a heartbeat for one without is ignored)."""
        if not 0 <= lease_s < math.inf:  # also NaN
            raise ConfigError(f"a lease is a finite number of seconds >= 0, got {lease_s!r}")
        return self._s.leases.renew(source_ids, lease_s, self._s.clock())

    # ---- fail, timeouts and replay (ftlayer.core.failure) ---------------------------

    def fail(self, roots: ArrayLike, causes: Causes | Cause | None = None) -> int:
        """Fail pending roots, with their causes (one for all, one per root, or
        unspecified): each record is replayed after its backoff, or dead-lettered once
        its retries are spent (ftlayer.core.retries). Returns how many were pending.

        If this raises (say, the storage refuses the write), the roots stay pending
        and will time out: a failure can be retried, never lost."""
        return failure.fail(self._s, roots, causes)

    def note_failures(self, roots: ArrayLike, causes: Causes | Cause | None = None) -> int:
        """`fail` as the server takes a FAIL: the failures of fresh batch-range rows are
        noted (journaled, applied later with the batch's others, ftlayer.core.failnotes),
        anything else is failed at once, after the notes. Returns what `fail` would."""
        s = self._s
        noted = failnotes.note(s, roots, causes)
        if noted is not None:
            return noted
        failnotes.apply(s)
        return failure.fail(s, roots, causes)

    @property
    def has_noted(self) -> bool:
        """Whether failures are noted and not applied yet (`apply_noted`)."""
        return bool(self._s.noted)

    def apply_noted(self) -> int:
        """Apply the noted failures now (ftlayer.core.failnotes); returns how many roots
        were pending."""
        return failnotes.apply(self._s)

    def tick(self, now: float | None = None) -> int:
        """Fail the roots whose timeout passed by `now` (default: the clock), queue the
        failed records whose backoff ended, drop stale sink holds, and apply noted
        failures once the oldest is NOTE_MAX_AGE_S old (no tick is due for them: the
        source's fill applies them, and every request that reads or changes them
        applies them first); returns the number of bucket rotations done."""
        s = self._s
        s.changing()
        now = s.clock() if now is None else now
        due = failnotes.due_in(s)
        if due is not None and due <= 0:
            failnotes.apply(s)
        s.retired.rotate(now)
        rotations = s.timeouts.tick(now)
        if len(s.ranges):
            failure.time_out_ranges(s, now)
        failure.release_due(s)
        if rotations and len(s.sink_keys):
            holding.drop_stale_sink_keys(s, now)
        return rotations

    def tick_delay(self) -> float:
        """Seconds until `tick` has something to do (<= 0: it has now; inf: nothing
        until a request adds something): the earliest of the rotation that could time
        a root out (any rotation while sink holds are open, which it may drop) and
        RELEASE_AFTER_S after the end of the first backoff, so that the records whose
        backoffs end within a second (a batch's failures, with their jitter) are
        queued by one tick, unless their source asked first (`release_due`). A tick
        before then does nothing."""
        s = self._s
        delay = math.inf
        rotation = s.timeouts.next_rotation(every_timeout=bool(len(s.sink_keys)))
        if rotation is not None:
            delay = rotation - s.clock()
        due = s.book.next_due()
        if due is not None:
            delay = min(delay, due + RELEASE_AFTER_S - s.wall())
        expiry = rangeacks.next_expiry(s, s.clock())
        if expiry is not None:
            delay = min(delay, expiry - s.clock())
        return delay

    def release_due(self, now: float | None = None) -> int:
        """Queue the failed records whose backoff has passed by `now` (wall clock,
        default: now); returns how many. Called by tick, and by the server before a
        brief STATUS (the replay cursor a source's next batch takes in)."""
        return failure.release_due(self._s, now)

    def fetch_replay(
        self,
        lo: int,
        hi: int,
        *,
        source_id: int | None = None,
        partition: int | None = None,
    ) -> ReplayRecords:
        """Replayed records with lo < replay seq <= hi (optionally of one source and one
        target partition) whose roots are still pending. The same range gives the same
        records until they complete, fail again or are pruned. Their timeout starts now:
        the source reads them (a range fetched again is timed from its first fetch).

        A tree-mode replay fetched again (a re-run: a retried task, a speculative
        attempt, a batch run again) comes under a fresh root, which takes the old one
        over (ftlayer.core.takeover): the old root may hold the emission and events of
        the earlier run, which the re-run's tree would never balance. A broadcast
        replay keeps its root (each partition's copy is a child of it)."""
        return failure.fetch_replay(self._s, lo, hi, source_id, partition)

    def prune_replay(self, upto: int, source_id: int | None = None) -> int:
        """Forget queue entries with replay seq <= upto, of `source_id` or of every
        source: the batches that took them in are checkpointed and never run again.
        Returns how many entries were dropped. Their roots stay pending: a replay that
        fails again is queued again under a new replay seq."""
        return failure.prune_replay(self._s, upto, source_id)

    # ---- batch ranges (ftlayer.core.ranges) ------------------------------------------

    def register_ranges(
        self, opened: Sequence[tuple[int, str, int, int, int]], *, tree: bool = False
    ) -> list[int]:
        """Open a batch's ranges, (source id, topic, partition, start, end) each, durable
        on return; their numbers in order (0 for an empty one). The rows of a range
        carry range roots (ftlayer.rangeroots); its records are pending until a barrier
        of their source at or past its end is done (`complete_ranges`). With `tree`,
        each record is pending until its tree completes instead (its rows carry their
        emission ids under their read's seed, `read_range`; ftlayer.core.rangeacks),
        or its range's timeout fails it."""
        return ranges.register(self._s, opened, tree=tree)

    def read_range(self, first: int, n: int, seed: int) -> int:
        """A reader emits `n` records of a tree-mode range from range root `first` on,
        with ids under `seed` (ftlayer.rangeroots.emission_ids): the pending ones start
        their trees over (ftlayer.core.rangeacks.read). Returns how many."""
        return rangeacks.read(self._s, first, n, seed)

    def complete_ranges(
        self, source_ids: Sequence[int], kafka: Mapping[str, Mapping[Any, int]]
    ) -> int:
        """The batches of `source_ids` are done up to the barrier `kafka`: their open
        ranges wholly below it complete, but for the offsets of failures noted and not
        applied yet, which wait for their bytes (`BatchRange.held`, applied by `fill`
        or any request that needs them). Returns how many records completed."""
        s = self._s
        completed = ranges.complete(s, source_ids, kafka)
        s.persistence.stage_marked(at_most=BARRIER_DELETES_STAGED_MAX)
        return completed

    @property
    def open_ranges(self) -> int:
        return len(self._s.ranges)

    # ---- records stored by reference (ftlayer.core.fills) ----------------------------

    def unfilled(self, source_id: int, limit: int = 10_000) -> fills.UnfilledRecords:
        """Up to `limit` failed records of `source_id` stored by reference whose bytes
        the source has not copied in yet, oldest first: their seqs and coordinates;
        then the rows of batch ranges whose failures are noted and not applied yet
        (ftlayer.core.failnotes), under their range roots in place of seqs."""
        listed = fills.unfilled(self._s, source_id, limit)
        noted = failnotes.unfilled(self._s, source_id, limit - len(listed))
        if not len(noted):
            return listed
        if not len(listed):
            return noted
        return fills.UnfilledRecords(
            np.concatenate([listed.seqs, noted.seqs]),
            RecordBatch.concat([listed.records, noted.records]),
        )

    def ingest(self, batch: RecordBatch) -> IngestResult:
        """A receiver's records of a source that cannot replay, with their bytes:
        stored (durable on return) and queued for the source's reader, second copies
        of records ingested within the window dropped (ftlayer.core.ingest)."""
        return ingest.ingest(self._s, batch)

    def sink_mark(
        self, sink: str, batch: int, proposed: Mapping[str, Any]
    ) -> tuple[dict[str, Any], bool]:
        """The mark of `sink`'s batch `batch`: the one stored already, or `proposed`,
        stored now (durable on return); and whether it is `proposed`
        (ftlayer.core.sinkmarks)."""
        return sinkmarks.mark(self._s, sink, batch, proposed)

    def fill(
        self,
        seqs: ArrayLike,
        payloads: Sequence[bytes],
        found: ArrayLike,
        keys: tuple[ArrayLike, ArrayLike] | None = None,
    ) -> fills.FillResult:
        """The source read records stored by reference (`seqs`, from `unfilled`): the
        `found` ones' bytes are stored (durable on return); the others are gone from
        the source: a pending one fails, final (`source-expired`), into the dead
        letters; a dead letter gets the cause added to its history. `keys`: each
        record's (key hash, has_key), which routes a record whose key was unknown (of a
        batch range); those due are queued at once."""
        seq_array = np.asarray(seqs, dtype=np.uint64)
        found_array = np.asarray(found, dtype=np.bool_)
        if not len(seq_array) == len(payloads) == len(found_array):
            raise ConfigError(
                f"fill needs a payload and a found flag per seq: got {len(seq_array)} "
                f"seqs, {len(payloads)} payloads, {len(found_array)} flags"
            )
        key_arrays = None
        if keys is not None:
            key_arrays = (
                np.asarray(keys[0], dtype=np.int64),
                np.asarray(keys[1], dtype=np.bool_),
            )
            if not len(key_arrays[0]) == len(key_arrays[1]) == len(seq_array):
                raise ConfigError("fill needs a key hash and a has_key flag per seq")
        s = self._s
        # Rows whose failures are noted (UNFILLED listed them by range root): applied
        # now with their bytes (ftlayer.core.failnotes.fill); the rest are stored seqs.
        ranged = is_range_root(seq_array)
        noted_filled = 0
        if bool(ranged.any()):
            rows = np.flatnonzero(ranged)
            noted_filled = failnotes.fill(
                s,
                seq_array[rows],
                [payloads[i] for i in rows.tolist()],
                found_array[rows],
                None if key_arrays is None else (key_arrays[0][rows], key_arrays[1][rows]),
            )
            rest = np.flatnonzero(~ranged)
            seq_array, found_array = seq_array[rest], found_array[rest]
            payloads = [payloads[i] for i in rest.tolist()]
            if key_arrays is not None:
                key_arrays = (key_arrays[0][rest], key_arrays[1][rest])
        result = fills.FillResult(0, 0)
        if len(seq_array):
            result = fills.fill(
                s, seq_array, payloads, found_array, failure.requeue, failure.enqueue, key_arrays
            )
        result.filled += noted_filled
        failure.release_due(s)
        return result

    # ---- state copies and recovery (ftlayer.core.recovery) --------------------------

    def state_snapshot(self, *, journal_base: bool | None = None) -> dict[str, NDArray[Any]]:
        """Copies of the state a journal base holds: every pending root with its ack value
        and the storage seq of its record ("acker.*"), the replay queue ("queue.*"), the
        retry counts ("retries.*") and the open holds. O(pending) array copies and no
        storage access, so a caller that serializes this core holds its lock only for
        the copy; writing it can happen elsewhere (ftlayer.checkpoint)."""
        return recovery.state_snapshot(self._s, journal_base=journal_base)

    def journal_base_due(self) -> bool:
        """Whether a state copy taken now should be the journal's base: the journal has
        grown by as much as a base would hold (at least JOURNAL_BASE_MIN_BYTES), or its
        last write failed. False without a journal."""
        return recovery.journal_base_due(self._s)

    def write_journal_base(self) -> None:
        """Write the journal's base now (the state, O(pending)) and truncate it: when its
        segment outgrew its limit and no checkpoint wrote a base (no barrier-driven
        source)."""
        recovery.write_journal_base(self._s)

    # ---- dead letters (ftlayer.core.deadletters) ----------------------------------

    def dead_letters(
        self, where: DeadLetterFilter | None = None, limit: int | None = None
    ) -> tuple[list[tuple[int, RetryRecord]], RecordBatch]:
        """The dead letters that match `where` (oldest first, at most `limit`): their
        storage seqs with their retry records, and their stored records (with root 0)."""
        return deadletters.dead_letters(self._s, where, limit)

    def requeue_dead_letters(self, where: DeadLetterFilter) -> int:
        """Put the matching dead letters back for replay now (after a fix): each gets a
        new root and a replay seq; its history stays, and its retries count afresh.
        Returns how many."""
        return deadletters.requeue_dead_letters(self._s, where)

    def restore_dead_letters(self, batch: RecordBatch, history: Sequence[RetryRecord]) -> int:
        """Dead letters taken back from a dead-letter topic (after a fix): stored again
        under the fresh roots of `batch`, with their history (`history[i]` for record
        i), and queued for replay now with a fresh retry budget. Returns how many. On
        any error nothing is stored, or what was stored is pending and timed (a
        replay, never a loss)."""
        return deadletters.restore_dead_letters(self._s, batch, history)

    def purge_dead_letters(self, where: DeadLetterFilter, *, delivered: bool = False) -> int:
        """Delete the matching dead letters for good (a user's purge, or `delivered`:
        the dead-letter topic confirmed them). Returns how many."""
        return deadletters.purge_dead_letters(self._s, where, delivered=delivered)

    @property
    def dead_letter_count(self) -> int:
        return len(self._s.book.dead)

    # ---- queries (ftlayer.core.queries) -------------------------------------------

    def lowest_pending_offsets(
        self, topics: Sequence[str] | None = None
    ) -> dict[str, dict[int, int]]:
        """{topic: {partition: the lowest Kafka offset of a pending root}}, over every
        pending root (replayed ones keep their original offset), for `topics` only if
        given. A partition with nothing pending is absent: a Kafka consumer group may
        then commit up to what its source has read; otherwise never past this offset.
        Records persisted without an offset (negative) are ignored."""
        return queries.lowest_pending_offsets(self._s, topics)

    def pending_by_source(self) -> dict[int, int]:
        """{source id: its pending roots}, sources with none left out: records in flight
        and records waiting in the replay queue alike. O(pending)."""
        return queries.pending_by_source(self._s)

    def inspect(self, query: RecordQuery) -> Inspection:
        """The records `query` names and where each is (ftlayer.inspection): by root, the
        pending root (or whether it failed recently); by Kafka coordinates, every
        pending root and every dead letter at them. O(pending + dead letters) for
        coordinates, plus a read of the records found: a diagnostic, changes nothing."""
        return queries.inspect(self._s, query)

    def brief_stats(self) -> dict[str, Any]:
        """The core's part of the brief STATUS reply (ftlayer.status.BriefStatus), as
        JSON: replay cursors and prune points, pending roots and unfilled records per
        source."""
        return queries.brief_stats(self._s)

    def current_stats(self) -> FTStats:
        """The counters, with the current state filled in: pending roots, and the replay
        queue's length and cursors."""
        return queries.current_stats(self._s)
