"""The FT-layer core: persist, track, complete, fail and replay source records.

Every source record is persisted before its source emits it. From then on its root id
is pending in one table, the acker table, which keeps per root the ack value and the
record's locator (storage seq and Kafka coordinates); the timeout persistence layer
holds the stored record and times the root in rotating buckets. A root stops being
pending in exactly one of three ways:

1. Completion. XOR events (root, value) arrive from sources and tasks; the first time
   a root's ack value returns to 0 its tree is complete: the record is deleted from
   storage and completion listeners get (root, topic, partition, offset), so Kafka
   offsets can move past it.
2. Failure, for one of three causes: explicit (a task raised FailException and its
   handler sent a fail), timeout (the root stayed pending between T and
   T * (1 + 1/(n-1))), or recovery (the FT layer restarted and its acker journal,
   ftlayer.core.journal, does not know the record's tree: a persist whose journal
   write died with the process, or any record after a machine crash or without a
   journal; the trees it knows are restored as they were). The record stays in
   storage; it is re-tagged with a fresh root id and a replay sequence number
   (1, 2, 3, ... never reused, also across restarts) and enters the replay queue,
   routed by the replay partitioner of its source to the partition(s) it re-enters.
   The fresh root is pending again; its timeout starts when its source fetches it
   (fetch_replay), not at the requeue, so a replay never times out merely because it
   waited to be read (a stalled or stopped query): like a record still in Kafka, it
   has not entered the pipeline yet. The source that re-emits the record sends the
   emission's XOR event for it (Persister.emit_replays).
3. Takeover (ftlayer.core.takeover). Spark ran the work again (a retried task, a
   speculative attempt, a batch run again): the record is persisted again at the same
   (source, topic, partition, offset), or its replay is fetched again (tree mode); or
   a root times out while a newer copy of its record is pending (barrier mode). The
   newer root covers the record, and the old one is retired: no replay, no completion
   notice, its stored copy deleted, its retry record moved to the newer copy. A
   persist finds its re-reads by per-partition read marks, so only a re-read scans
   the pending roots.

A tree does not time out while the batch carrying it runs (ftlayer.core.leases): the
sources' barriers open their batches (`batch_began`), Spark's "done" closes them
(`batch_done`), and the source's driver keeps a lease on its running batch by
heartbeats (`heartbeat`). A timeout entry tracked in a source's open batch that
expires while that batch is still open and leased is postponed, not failed; once the
batch is done or its lease lapsed (the driver died or was stopped), it times out at
its next expiry, within T * (1 + 1/(n-1)) of that moment. Entries of earlier batches,
and of sources that send no heartbeats, time out as described above.

Events for roots that are not pending are dropped: "late" when the root failed
recently (RetiredRoots remembers failed roots for 2T by default), "unknown" otherwise.
They never create pending entries that could not complete. Persisting a root that is
pending or remembered as failed is refused (ConfigError, nothing stored): late events
of the old tree would corrupt the new one. A completed root is not remembered (that
would cost memory per completed record); persisting it again starts a new tree, and
the completed tree's timeout entry cannot touch it (persistence/timeout.py matches
entries to trees by storage seq).

Events for roots that are not pending are dropped: "late" when the root failed or was
taken over recently (RetiredRoots remembers them for 2T by default), "unknown"
otherwise. They never create pending entries that could not complete. Persisting a
root that is pending or remembered as failed is refused (ConfigError, nothing
stored): late events of the old tree would corrupt the new one. A completed root is
not remembered (that would cost memory per completed record); persisting it again
starts a new tree, and the completed tree's timeout entry cannot touch it
(persistence/timeout.py matches entries to trees by storage seq).

Nothing is lost: a record leaves storage only when its tree completed, or when a copy
persisted again under a new root took it over (that copy is stored first). A failure
between persist and emit, a lost event, a lost fail, a crashed task or a crashed FT
layer all end in a timeout or a recovery, that is, in a replay (or, after a crash the
journal covers, in the tree going on where it was).

A persist is one call (`persist`) or three steps (`begin_persist`, the storage write
by the caller, `end_persist` or `abort_persist`), so that a caller serializing the
core with a lock writes the records outside it. Between the steps the persist is
invisible (its roots are not pending, only reserved against a second persist of them)
and harmless: a failed write leaves nothing, and a crash after the write replays the
stored records, since the state snapshots a journal base is made of never count
records of a persist under way as stored before them (`PersistTicket.floor`).

Not thread-safe: one thread drives a core at a time (the server serializes its
clients with a lock; a persist's storage write may run outside it).
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Final, cast

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ftlayer.acking.acker import AckerTable, XorResult
from ftlayer.acking.ids import new_ids
from ftlayer.acking.rotating import validate_timeout
from ftlayer.acking.u64map import U64Map
from ftlayer.causes import Cause, Causes, FailKind
from ftlayer.errors import ConfigError
from ftlayer.inspection import InspectedRecord, Inspection, RecordQuery, RecordState
from ftlayer.persistence.base import PersistenceStorage
from ftlayer.persistence.layer import LOCATOR_COLUMNS, Completed
from ftlayer.persistence.timeout import TimeoutPersistenceLayer
from ftlayer.records import RecordBatch, ReplayRecords

from .barrier import OpenHolds
from .faillog import log_failed, log_requeue_error
from .journal import Journal, JournalState
from .leases import BatchLeases, BatchTag
from .meters import Meters, total_latency
from .replay import REPLAY_SEQ_META_KEY, ReplayQueue
from .retired import RetiredRoots
from .retries import DEAD_LETTER, IMMEDIATE, DeadLetterFilter, RetryBook, RetryPolicy, RetryRecord
from .sinkholds import SINK_KEY_BIT, SinkKeys, check_sink_key
from .sources import SourceConfig, SourceRegistry
from .stats import FailCause, FTStats
from .takeover import ReadMarks, chunk_groups, pending_at

_EMPTY_U64: NDArray[np.uint64] = np.zeros(0, dtype=np.uint64)

CompletionListener = Callable[[Completed], None]


JOURNAL_BASE_MIN_BYTES: Final = 1 << 20
"""A checkpoint's snapshot is the journal's base only once the journal has grown by this
much (or by a base's size, if larger): FTLayer._journal_base_due."""
_BASE_BYTES_PER_ROOT: Final = 24


@dataclasses.dataclass(frozen=True, eq=False)
class PersistTicket:
    """A persist between `FTLayer.begin_persist` and its end: the batch, its first ack
    values (checked) and the store's next seq at its beginning."""

    batch: RecordBatch
    initial_values: NDArray[np.uint64] | None
    floor: int


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
    ) -> None:
        self._clock = clock
        self._journal = journal
        self._wall = wall_clock
        self._rng = random.Random(seed)
        self._default_retry = retry or IMMEDIATE
        self.storage = storage
        self.acker = AckerTable(columns=LOCATOR_COLUMNS)
        self._leases = BatchLeases()
        self.persistence = TimeoutPersistenceLayer(
            storage,
            timeout_s=timeout_s,
            buckets=buckets,
            on_timeout=self._on_timeout,
            start=clock(),
            defer_deletes=defer_deletes,
            postpone=self._batch_running,
        )
        self._sources = SourceRegistry(storage, sources, default_source)
        meta = storage.get_meta(REPLAY_SEQ_META_KEY)
        self._queue = ReplayQueue(next_seq=int(meta.decode()) if meta else 1)
        self._retired = RetiredRoots(retired_ttl_s or 2 * timeout_s, start=clock())
        self._book = RetryBook(storage)
        self._barrier = self._sources.barrier
        self._holds = OpenHolds()
        self._sink_keys = SinkKeys()
        self._listeners: list[CompletionListener] = []
        self._change_hooks: list[Callable[[], None]] = []
        self.stats = FTStats()
        self.meters = Meters()
        """Per-source counters and the complete latency (ftlayer.core.meters)."""
        self._marks = ReadMarks()
        # Persists begun and not ended (begin_persist), and their roots, reserved: a
        # map made afresh whenever none is under way (deleted keys cost its lookups).
        self._tickets: set[PersistTicket] = set()
        self._persisting = U64Map({}, key_name="root")
        # The seqs stored by persists that ended (or records stored otherwise) while a
        # persist was under way: a journal base taken then knows their fate although
        # they lie at or above a ticket's floor (state_snapshot, "journal.ended_seqs").
        self._ended: list[NDArray[np.uint64]] = []
        self._recover()

    # ---- configuration ---------------------------------------------------------

    def source_config(self, source_id: int) -> SourceConfig | None:
        return self._sources.get(source_id)

    def source_specs(self) -> dict[str, dict[str, Any]]:
        """The registered sources as stored (SourceRegistry.specs), by source id."""
        return self._sources.specs()

    def register_source(
        self,
        source_id: int,
        partitioner: str,
        num_partitions: int,
        options: Mapping[str, object] | None = None,
        timeout_s: float | None = None,
        retry: RetryPolicy | None = None,
        dead_letter_topic: str | None = None,
        completion: str = "tree",
    ) -> SourceConfig:
        """Configure how `source_id`'s records are replayed, and store that in the
        storage's meta entries, so a restarted FT layer routes its recovered records the
        same way (the registrations load before recovery). Registering again replaces
        the config; records already queued keep the partitions they were routed to.
        `timeout_s` gives the source's trees their own timeout (None: the FT layer's);
        it applies to roots that start pending from now on. `retry`: how often and how
        soon its failed records are replayed (None: RetryPolicy's defaults);
        `dead_letter_topic`: where its source's driver writes its dead letters (None:
        they stay in the store); `completion`: "tree" or "barrier"
        (ftlayer.core.barrier).
        ConfigError (nothing changed) for an unknown partitioner or bad options."""
        if timeout_s is not None:
            validate_timeout(timeout_s, self.persistence.buckets)
        config = self._sources.register(
            source_id,
            partitioner,
            num_partitions,
            options,
            timeout_s,
            retry,
            dead_letter_topic,
            completion,
        )
        self._barrier = self._sources.barrier
        return config

    def add_change_hook(self, hook: Callable[[], None]) -> None:
        """Call `hook()` before every change to the state `state_snapshot` copies (persist,
        xor, fail, tick, prune_replay), so a snapshot can be copied lazily: a
        checkpoint barrier copies nothing at once, and the copy taken before the next
        change is still the state at the barrier (ftlayer.checkpoint)."""
        self._change_hooks.append(hook)

    def _changing(self) -> None:
        for hook in self._change_hooks:
            hook()

    def add_completion_listener(self, listener: CompletionListener) -> None:
        self._listeners.append(listener)

    @property
    def replay_cursor(self) -> int:
        """The highest replay seq handed out so far (0 before the first failure)."""
        return self._queue.cursor

    def replay_cursor_of(self, source_id: int) -> int:
        """The highest replay seq of `source_id`'s records; for a source with none since
        this FT layer started, the cursor at the start. Never behind a value it
        returned before (also across restarts), and a source's replays all have seqs
        at most this: a reader that takes in (its last cursor, this] misses none."""
        return self._queue.cursor_of(source_id)

    def retries(self, root: int) -> int:
        """How many times the record now tracked under `root` failed (and was or will be
        replayed); 0 for a root not pending or never failed."""
        pending, seqs = self.acker.lookup("seq", np.array([root], dtype=np.uint64))
        record = self._book.get(int(seqs[0])) if bool(pending[0]) else None
        return 0 if record is None else record.attempts

    def retry_record(self, seq: int) -> RetryRecord | None:
        """The failure history of stored record `seq`, if it ever failed."""
        return self._book.get(seq)

    def retry_policy(self, source_id: int) -> RetryPolicy:
        config = self.source_config(source_id)
        return self._default_retry if config is None else config.retry

    @property
    def waiting_replays(self) -> int:
        """Failed records waiting for their backoff before they enter the replay queue."""
        return self._book.waiting

    def __len__(self) -> int:
        return len(self.acker)

    @property
    def queued_replays(self) -> int:
        """Entries in the replay queue (not pruned yet)."""
        return len(self._queue)

    # ---- persist ---------------------------------------------------------------

    def persist(self, batch: RecordBatch, initial_values: ArrayLike | None = None) -> None:
        """Persist source records before their source emits them.

        `initial_values` are the roots' first ack values: the XOR of the record ids the
        source emits for each record (0, the default, when it sends those as events).
        Raises, with nothing stored, on a reserved root (0 or 1), a root repeated in the
        batch, pending, being persisted or failed within the retired TTL (ValueError,
        ConfigError), or a record its source's replay partitioner could not route (no
        key for a hash partitioner).

        In one call, the storage write under the caller's lock if it has one; a caller
        that would rather write outside it calls `begin_persist`, writes, and calls
        `end_persist` (the server).
        """
        self._changing()
        values = self._checked(batch, initial_values)
        if self._tickets:
            self._check_not_persisting(batch.roots)
        # Step 1: the barrier holds, the locators, and a re-read's takeover.
        values, held, locators, superseded = self._to_pend(batch, values)
        # Step 2: the acker validates the roots (reserved, repeated, already pending).
        rows = self.acker.add(batch.roots, values, **locators)
        # Step 3: the storage confirms the records are durable; on any error the roots
        # leave the acker again and the error propagates: nothing is half-persisted
        # (and nothing taken over: the old roots still cover their records).
        try:
            seqs = self.persistence.persist(batch)
        except BaseException:
            self.acker.remove(batch.roots)
            raise
        self.acker.set_column("seq", rows, seqs)
        # Step 4: timeouts, journal, takeover, holds.
        self._pended(batch, values, seqs, held, locators, superseded)

    def begin_persist(
        self, batch: RecordBatch, initial_values: ArrayLike | None = None
    ) -> PersistTicket:
        """The first of a persist's three steps (see `persist`, which raises what this
        raises): check the batch and reserve its roots, changing nothing else. Then the
        caller stores `ticket.batch` (`storage.put`, no lock of this core needed: every
        storage seq it gets is at least `ticket.floor`) and ends the persist with
        `end_persist` (stored) or `abort_persist` (the write failed).

        Until it ends, the persist is invisible: its roots are not pending (events and
        fails for them are dropped as unknown; no client has them before the persist's
        OK), but a persist of the same roots is refused; and the state snapshots give
        the journal a storage seq at most `floor`, so a crash before `end_persist`
        replays the stored records (ftlayer.core.journal) instead of taking them for
        completed."""
        values = self._checked(batch, initial_values)
        # The reservation refuses what the acker would (a reserved root, one repeated in
        # the batch) and roots being persisted; then no root may be pending either.
        if not self._tickets:
            self._persisting = U64Map({}, len(batch), key_name="root")
        self._persisting.insert(batch.roots)
        pending = self.acker.lookup("ack", batch.roots)[0]
        if bool(pending.any()):
            self._unreserve(batch.roots)
            root = int(batch.roots[int(np.argmax(pending))])
            raise ValueError(f"root {root:#x} is already present")
        ticket = PersistTicket(batch, values, self.storage.next_seq)
        self._tickets.add(ticket)
        return ticket

    def abort_persist(self, ticket: PersistTicket) -> None:
        """The storage write of a begun persist failed: its roots are free again, and
        nothing else changed."""
        if ticket in self._tickets:
            self._end_ticket(ticket)

    def end_persist(self, ticket: PersistTicket, seqs: NDArray[np.uint64]) -> None:
        """The last step of a persist: its records are stored under `seqs`. The roots
        become pending with their first ack values and their records' locators, their
        timeouts start, the journal learns them, a re-read takes over the pending roots
        of the same records (ftlayer.core.takeover) and barrier-mode roots get their
        holds. Only now does a snapshot, a fail or an event see them."""
        self._changing()
        self._end_ticket(ticket)
        batch = ticket.batch
        try:
            values, held, locators, superseded = self._to_pend(batch, ticket.initial_values)
            self.acker.add(batch.roots, values, seq=seqs, **locators)
        except BaseException:
            # A storage read failed, or (paranoid check) a root was drawn twice: none of
            # the roots is pending, and nobody was told the records are persisted, so
            # they leave the store again.
            self.persistence.discard(seqs)
            raise
        self._pended(batch, values, seqs, held, locators, superseded)

    def _checked(
        self, batch: RecordBatch, initial_values: ArrayLike | None
    ) -> NDArray[np.uint64] | None:
        """A persist's checks before its roots: routable, none failed recently; the
        first ack values as an array of one per root."""
        self._check_routable(batch)
        if len(self._retired):
            self._check_not_retired(batch.roots)
        values = None if initial_values is None else np.asarray(initial_values, dtype=np.uint64)
        if values is not None and values.shape != batch.roots.shape:
            raise ValueError(f"{len(batch)} roots but {values.shape} initial ack values")
        return values

    def _end_ticket(self, ticket: PersistTicket) -> None:
        """`ticket`'s persist is over (ended or aborted): its roots are free, and with no
        persist under way no seq needs remembering for a journal base (`_ended`)."""
        self._tickets.remove(ticket)
        self._unreserve(ticket.batch.roots)
        if not self._tickets:
            self._ended.clear()

    def _unreserve(self, roots: NDArray[np.uint64]) -> None:
        """The reserved `roots` of one persist (distinct, every one reserved) are free;
        with no persist under way, every root is (the next begin makes a new map)."""
        if self._tickets:
            keys = np.ascontiguousarray(roots, dtype=np.uint64)
            self._persisting.delete(self._persisting.find_slots(keys)[0])

    def _to_pend(
        self, batch: RecordBatch, values: NDArray[np.uint64] | None
    ) -> tuple[
        NDArray[np.uint64] | None,
        list[tuple[int, NDArray[np.intp]]] | None,
        dict[str, NDArray[Any]],
        NDArray[np.uint64] | None,
    ]:
        """What the roots of a persist need to become pending: their first ack values
        with the barrier holds of barrier-mode rows (and those rows), the locators,
        and the pending roots a re-read takes over (ftlayer.core.takeover)."""
        held = self._barrier_rows(batch.source_ids) if self._barrier else None
        if held is not None:
            zeros = np.zeros(len(batch), np.uint64) if values is None else None
            values = _with_holds(values, held, zeros)
        locators = self.persistence.locators(batch)
        return values, held, locators, self._superseded(locators, batch.payloads)

    def _pended(
        self,
        batch: RecordBatch,
        values: NDArray[np.uint64] | None,
        seqs: NDArray[np.uint64],
        held: list[tuple[int, NDArray[np.intp]]] | None,
        locators: dict[str, NDArray[Any]],
        superseded: NDArray[np.uint64] | None,
    ) -> None:
        """The roots of a persist are pending (in the acker, with their seqs): their
        timeouts start, the journal learns them, the re-read roots retire, and the
        barrier-mode roots get their holds."""
        self._track(batch.roots, seqs, batch.source_ids)
        self._stored_meanwhile(seqs)
        self.stats.persisted += len(batch)
        journal = self._journal
        if journal is not None:
            if values is None:
                journal.add(batch.roots)
            else:
                journal.xor(batch.roots, values)
        if len(seqs):
            self.meters.persisted(batch.source_ids, int(seqs[0]), self._clock())
        if superseded is not None:
            self._take_over(superseded, {**locators, "seq": seqs})
        if held is not None:
            assert values is not None
            for source_id, rows in held:
                self._add_holds(source_id, batch.roots[rows], values[rows])

    def _stored_meanwhile(self, seqs: NDArray[np.uint64]) -> None:
        """Records stored and pending while a persist is under way: a journal base
        taken before that persist ends must not take them for records of it (replayed
        by a recovery) when they complete before the base."""
        if self._tickets and len(seqs):
            self._ended.append(seqs)

    # ---- re-reads take over (ftlayer.core.takeover) ---------------------------------

    def _superseded(
        self, locators: Mapping[str, NDArray[Any]], payloads: Sequence[bytes]
    ) -> NDArray[np.uint64] | None:
        """The pending roots of the same records as a chunk about to be persisted (same
        coordinates and the same stored bytes), if the chunk is a re-read of a
        tree-mode source (None: it is not, the usual case, found in O(partitions));
        raises the read marks."""
        groups = chunk_groups(locators["topic"], locators["partition"], locators["offset"])
        rereads = self._marks.read(groups)
        if rereads and self._barrier:  # a row may be computed twice there: no takeover
            sources = self.persistence.number_sources()
            rereads = [g for g in rereads if int(sources[g.topic]) not in self._barrier]
        if not rereads or not len(self.acker):
            return None
        live = self.acker.live_columns("root", "seq", "topic", "partition", "offset", copy=False)
        rows = np.flatnonzero(pending_at(live, rereads))
        if not len(rows):
            return None
        row_at = _rows_by_coordinates(locators)
        at = [
            row_at[c]
            for c in zip(
                live["topic"][rows].tolist(),
                live["partition"][rows].tolist(),
                live["offset"][rows].tolist(),
                strict=True,
            )
        ]
        same = _same_bytes(self.storage.get(live["seq"][rows]).payloads, [payloads[i] for i in at])
        return live["root"][rows[same]].copy() if bool(same.any()) else None

    def _take_over(
        self, old_roots: NDArray[np.uint64], successors: Mapping[str, NDArray[Any]]
    ) -> None:
        """Retire pending roots whose records a newer copy covers (the module docstring
        of ftlayer.core.takeover): out of the acker, no replay and no completion
        notice; their retry records move to the newer copies (`successors`: their
        "topic", "partition", "offset" and storage "seq", ascending by seq); their
        stored copies are deleted (in the transaction of those moves)."""
        removed = self.acker.remove(old_roots)
        if not len(removed.roots):
            return
        cols = removed.columns
        if len(self._book):
            self._carry_retries(cols, successors)
        self.persistence.complete(removed.roots, cols)  # no listener: still pending
        if self._journal is not None:  # their stored copies go: gone, not to restore
            self._journal.gone(removed.roots)
        self._retired.add(removed.roots, self._clock())
        self.stats.taken_over += len(removed.roots)

    def _carry_retries(
        self, cols: Mapping[str, NDArray[Any]], successors: Mapping[str, NDArray[Any]]
    ) -> None:
        """The retry records of taken-over copies go to the newest copies at the same
        coordinates (staged: durable with the deletion of the old copies)."""
        old = [
            (seq, record, (int(t), int(p), int(o)))
            for seq, t, p, o in zip(
                cols["seq"].tolist(),
                cols["topic"].tolist(),
                cols["partition"].tolist(),
                cols["offset"].tolist(),
                strict=True,
            )
            if (record := self._book.get(seq)) is not None
        ]
        if not old:
            return
        newest = {  # ascending seqs: the last copy at a coordinate wins
            (int(t), int(p), int(o)): int(seq)
            for t, p, o, seq in zip(
                successors["topic"].tolist(),
                successors["partition"].tolist(),
                successors["offset"].tolist(),
                successors["seq"].tolist(),
                strict=True,
            )
        }
        carried: dict[int, RetryRecord] = {}
        for _seq, record, at in old:
            seq = newest[at]
            if seq not in carried or carried[seq].attempts < record.attempts:
                carried[seq] = dataclasses.replace(_copy(record), due=0.0)
        self._book.stage(carried)
        self._book.commit(carried)
        self._book.forget([seq for seq, _, _ in old])

    def _retire_covered(self, roots: NDArray[np.uint64]) -> None:
        """Take over `roots` by the newest pending copies of their records."""
        _, offsets = self.acker.lookup("offset", roots)
        live = self.acker.live_columns("topic", "partition", "offset", "seq", copy=False)
        near = np.flatnonzero(np.isin(live["offset"], offsets))
        near = near[np.argsort(live["seq"][near], kind="stable")]
        self._take_over(roots, {name: column[near] for name, column in live.items()})

    def _covered_at_timeout(
        self, roots: NDArray[np.uint64], seqs: NDArray[np.uint64]
    ) -> NDArray[np.bool_]:
        """Which timed-out roots of barrier-mode sources a newer copy of their record
        (same coordinates, a later storage seq) still pending covers: a dead attempt's
        roots whose retry read the records again (barrier mode takes nothing over at
        persist, ftlayer.core.takeover). They retire instead of being replayed."""
        covered = np.zeros(len(roots), dtype=np.bool_)
        _, topics = self.acker.lookup("topic", roots)
        sources = self.persistence.number_sources()[topics.astype(np.intp)]
        rows = np.flatnonzero(np.isin(sources, np.fromiter(self._barrier, np.uint32)))
        if not len(rows):
            return covered
        _, partitions = self.acker.lookup("partition", roots[rows])
        _, offsets = self.acker.lookup("offset", roots[rows])
        keep = offsets >= 0
        rows, partitions, offsets = rows[keep], partitions[keep], offsets[keep]
        if not len(rows):
            return covered
        live = self.acker.live_columns("topic", "partition", "offset", "seq", copy=False)
        near = np.flatnonzero(np.isin(live["offset"], offsets))
        newest: dict[tuple[int, int, int], int] = {}
        for t, p, o, seq in zip(
            live["topic"][near].tolist(),
            live["partition"][near].tolist(),
            live["offset"][near].tolist(),
            live["seq"][near].tolist(),
            strict=True,
        ):
            newest[(t, p, o)] = max(seq, newest.get((t, p, o), 0))
        older: list[int] = []
        newer: list[int] = []
        for row, t, p, o in zip(
            rows.tolist(), topics[rows].tolist(), partitions.tolist(), offsets.tolist(), strict=True
        ):
            seq = newest.get((t, p, o), 0)
            if seq > int(seqs[row]):
                older.append(row)
                newer.append(seq)
        if older:  # the same record, not another one at reused coordinates
            old = self.storage.get(seqs[older]).payloads
            new = self.storage.get(np.array(newer, dtype=np.uint64)).payloads
            covered[older] = _same_bytes(old, new)
        return covered

    def _barrier_rows(self, source_ids: NDArray[Any]) -> list[tuple[int, NDArray[np.intp]]] | None:
        """(source id, rows) of the rows of barrier-mode sources; None if none."""
        found = [
            (s, np.flatnonzero(source_ids == s))
            for s in _source_list(source_ids)
            if s in self._barrier
        ]
        return found or None

    # ---- completion at the barrier ---------------------------------------------------

    def hold(self, roots: ArrayLike, values: ArrayLike) -> int:
        """A barrier-mode root goes on in a new batch (a loop record read back): XOR
        `values` (releasing what held it, say the loop's record in transit) together
        with a fresh barrier hold, released at that batch's barrier. Pending roots
        only; returns how many were held."""
        self._changing()
        keys = np.ascontiguousarray(roots, dtype=np.uint64)
        vals = np.ascontiguousarray(values, dtype=np.uint64)
        if keys.shape != vals.shape:
            raise ValueError(f"hold: {keys.shape} roots but {vals.shape} values")
        pending, topics = self.acker.lookup("topic", keys)
        if not bool(pending.all()):
            self._count_dropped(keys[~pending])
        keys, vals = keys[pending], vals[pending]
        if not len(keys):
            return 0
        sources = self.persistence.number_sources()[topics.astype(np.intp)]
        holds = new_ids(len(keys))
        self.xor(keys, vals ^ holds)
        for source_id in _source_list(sources):
            rows = sources == source_id
            self._add_holds(source_id, keys[rows], holds[rows])
        return len(keys)

    def _add_holds(
        self, source_id: int, roots: NDArray[np.uint64], values: NDArray[np.uint64]
    ) -> None:
        self._holds.add(source_id, roots, values)
        if self._journal is not None:
            self._journal.hold(source_id, roots, values)

    def release_barrier(self, source_ids: Sequence[int]) -> int:
        """The batch of these sources is done: release every open barrier hold of
        theirs; roots nobody else holds complete. Returns how many completed."""
        roots, values = self._release_holds(source_ids)
        if not len(roots):
            return 0
        result = self.acker.xor(roots, values)
        self.stats.barrier_released += len(roots)
        if len(result.completed):
            self._complete(result)
        return len(result.completed)

    # ---- a batch sink's acks, held until its write is done (ftlayer.core.sinkholds) --

    def sink_hold(self, key: int, roots: ArrayLike, values: ArrayLike) -> int:
        """The acks (root, id) of rows that reached a batch sink, sent by the step that
        produced them, held under the sink's `key` until `sink_settle`: nothing is
        XOR-ed yet. For a key already settled they are applied at once, as the settle
        did (XOR-ed, or their roots failed). Pending roots only; returns how many."""
        check_sink_key(key)
        keys = np.ascontiguousarray(roots, dtype=np.uint64)
        vals = np.ascontiguousarray(values, dtype=np.uint64)
        if keys.shape != vals.shape:
            raise ValueError(f"sink hold: {keys.shape} roots but {vals.shape} values")
        self._changing()
        pending = self.acker.lookup("ack", keys)[0]
        if not bool(pending.all()):
            self._count_dropped(keys[~pending])
            keys, vals = keys[pending], vals[pending]
        if not len(keys):
            return 0
        settled, cause = self._sink_keys.settled(key)
        if not settled:
            self._sink_keys.opened(key, self._clock())
            self._add_holds(key, keys, vals)
        elif cause is None:
            self.xor(keys, vals)
        else:
            self.fail(np.unique(keys), cause)
        return len(keys)

    def sink_settle(self, key: int, cause: Cause | None = None) -> int:
        """The batch sink's write under `key` is done: XOR every ack held under it (the
        trees nobody else holds complete); or, with `cause`, it failed: fail every
        root held under it. Pairs of roots no longer pending (a re-read took them
        over) are dropped. Returns how many pairs were XOR-ed, or roots failed."""
        check_sink_key(key)
        self._sink_keys.settle(key, cause)
        roots, values = self._release_holds([key])
        if not len(roots):
            return 0
        pending = self.acker.lookup("ack", roots)[0]
        roots, values = roots[pending], values[pending]
        if cause is not None:
            return self.fail(np.unique(roots), cause)
        result = self.acker.xor(roots, values)
        if len(result.completed):
            self._complete(result)
        return len(roots)

    def _drop_stale_sink_keys(self, now: float) -> None:
        """Forget the holds of sink keys open longer than a timeout whose roots are all
        gone (timed out, failed, taken over): their sink will never settle them."""
        for key in self._sink_keys.older_than(now - self.persistence.timeout_s):
            roots = self._holds.roots_of(key)
            if not bool(self.acker.lookup("ack", roots)[0].any()):
                self._release_holds([key])
                self._sink_keys.forget(key)

    def _release_holds(self, keys: Sequence[int]) -> tuple[NDArray[np.uint64], NDArray[np.uint64]]:
        """Every open hold of these sources (or sink keys), (roots, values), removed
        here and in the journal (which knows the holds: no pairs are journaled again
        when the caller XORs them)."""
        roots, values = self._holds.release(keys)
        if len(roots):
            self._changing()
            if self._journal is not None:
                self._journal.release(keys)
        return roots, values

    @property
    def open_holds(self) -> int:
        """Barrier holds not released yet."""
        return len(self._holds)

    # ---- running batches: timeouts that follow progress ---------------------------

    def batch_began(self, source_ids: Sequence[int]) -> None:
        """The next batch of these sources is about to run (its barrier): roots tracked
        from now on belong to it (ftlayer.core.leases). It has no lease until the
        first `heartbeat`."""
        self._leases.began(source_ids, self._clock())

    def batch_done(self, source_ids: Sequence[int]) -> None:
        """The batch of these sources is done: its lease ends, and the trees it left
        unfinished time out at their next expiry."""
        self._leases.done(source_ids)

    def heartbeat(self, source_ids: Sequence[int], lease_s: float) -> int:
        """The driver of these sources is alive and their batch is running: while it
        stays open and `lease_s` has not passed since this call, the timeouts of its
        trees are postponed (0 ends the lease). Returns how many of the sources have
        an open batch (a heartbeat for one without is ignored)."""
        if not 0 <= lease_s < math.inf:  # also NaN
            raise ConfigError(f"a lease is a finite number of seconds >= 0, got {lease_s!r}")
        return self._leases.renew(source_ids, lease_s, self._clock())

    def _batch_running(self, tag: Hashable, now: float) -> bool:
        """The timeout layer's question at an entry's expiry: postpone it?"""
        return self._leases.running(cast(BatchTag, tag), now)

    def _check_not_retired(self, roots: NDArray[np.uint64]) -> None:
        retired = self._retired.known(roots, self._clock())
        if bool(retired.any()):
            root = int(roots[int(np.argmax(retired))])
            raise ConfigError(
                f"repeated root {root:#x}: it failed recently and late events of its old "
                f"tree could still arrive ({int(retired.sum())} such roots in the batch); "
                "persist every record under a fresh random root"
            )

    def _check_not_persisting(self, roots: NDArray[np.uint64]) -> None:
        persisting = self._persisting.find(np.ascontiguousarray(roots, dtype=np.uint64)) >= 0
        if bool(persisting.any()):
            root = int(roots[int(np.argmax(persisting))])
            raise ValueError(f"root {root:#x} is already present")

    def _check_routable(self, batch: RecordBatch) -> None:
        for source_id in _sources_of(batch):
            config = self.source_config(source_id)
            if config is not None:
                rows = batch.source_ids == source_id
                sub = batch if bool(rows.all()) else batch.take(rows)
                config.partitioner.check_routable(sub, config.num_partitions)

    # ---- xor -------------------------------------------------------------------

    def xor(self, roots: ArrayLike, values: ArrayLike) -> XorResult:
        """Apply XOR events; completes the roots whose ack value returns to 0."""
        self._changing()
        result = self.acker.xor(roots, values)
        if self._journal is not None:
            self._journal.xor(np.asarray(roots), np.asarray(values))
            if self._journal.wants_base:
                self.write_journal_base()
        self.stats.xor_events += len(np.asarray(roots))
        if len(result.dropped):
            self._count_dropped(result.dropped)
        if len(result.completed):
            self._complete(result)
        return result

    def _complete(self, result: XorResult) -> None:
        done = self.persistence.complete(result.completed, result.columns)
        if self._journal is not None:
            self._journal.gone(result.completed)
        self.stats.completed += len(done)
        seqs = result.columns["seq"]
        # A record with a retry record failed before: a replay, left out of the latency.
        replays = self._book.forget(seqs.tolist()) if len(self._book) else None
        self.meters.completed(seqs, result.columns["topic"], replays, self._clock())
        self._notify(done)

    def take_deletes(self) -> NDArray[np.uint64]:
        """With defer_deletes: the seqs of completed records not deleted yet, unmarked.

        The caller deletes them (`storage.delete`), possibly in another thread while
        this core goes on (LmdbStorage is thread-safe); if that fails, the records stay
        stored and are replayed after the next restart: duplicates, never a loss."""
        return self.persistence.take_marked()

    def retry_deletes(self, seqs: NDArray[np.uint64]) -> None:
        """With defer_deletes: seqs from `take_deletes` whose delete failed, marked
        again for the next take or flush."""
        self.persistence.mark_again(seqs)

    def flush_deletes(self) -> int:
        """With defer_deletes: delete the completed records not deleted yet, now."""
        return self.persistence.flush_deletes()

    def _notify(self, done: Completed) -> None:
        """Tell every listener, even if one raises; then raise the first error."""
        errors: list[BaseException] = []
        for listener in self._listeners:
            try:
                listener(done)
            except Exception as exc:  # re-raised once every listener was told
                errors.append(exc)
        if errors:
            raise errors[0]

    def xor_one(self, root: int, value: int) -> bool:
        """One XOR event (cold paths); True if it completed its root."""
        one = self.xor(np.array([root], dtype=np.uint64), np.array([value], dtype=np.uint64))
        return len(one.completed) == 1

    def _count_dropped(self, roots: NDArray[np.uint64]) -> None:
        late = 0
        if len(self._retired):
            late = int(np.count_nonzero(self._retired.known(roots, self._clock())))
        self.stats.late_events += late
        self.stats.unknown_events += len(roots) - late

    # ---- fail and replay ---------------------------------------------------------

    def fail(self, roots: ArrayLike, causes: Causes | Cause | None = None) -> int:
        """Fail pending roots, with their causes (one for all, one per root, or
        unspecified): each record is replayed after its backoff, or dead-lettered once
        its retries are spent (ftlayer.core.retries). Returns how many were pending.

        If this raises (say, the storage refuses the write), the roots stay pending
        and will time out: a failure can be retried, never lost."""
        self._changing()
        root_array = np.ascontiguousarray(roots, dtype=np.uint64)
        if not isinstance(causes, Causes):
            causes = Causes.one(causes, len(root_array))
        elif len(causes) != len(root_array):
            raise ValueError(f"fail: {len(root_array)} roots but {len(causes)} causes")
        keys, first = np.unique(root_array, return_index=True)
        pending, seqs = self.acker.lookup("seq", keys)
        if not bool(pending.all()):
            self._count_dropped(keys[~pending])
        if bool(pending.any()):
            self._requeue(keys[pending], seqs, FailCause.EXPLICIT, causes.take(first[pending]))
        return int(np.count_nonzero(pending))

    def tick(self, now: float | None = None) -> int:
        """Fail the roots whose timeout passed by `now` (default: the clock); returns
        the number of bucket rotations done."""
        self._changing()
        now = self._clock() if now is None else now
        self._retired.rotate(now)
        rotations = self.persistence.tick(now)
        self.release_due()
        if rotations and len(self._sink_keys):
            self._drop_stale_sink_keys(now)
        return rotations

    def release_due(self, now: float | None = None) -> int:
        """Queue the failed records whose backoff has passed by `now` (wall clock,
        default: now); returns how many. Called by tick."""
        due = self._book.due(self._wall() if now is None else now)
        if not due:
            return 0
        self._changing()
        seqs = np.array([seq for seq, _ in due], dtype=np.uint64)
        roots = np.array([root for _, root in due], dtype=np.uint64)
        # Only records still waiting under that root (not completed or purged since).
        pending, current = self.acker.lookup("seq", roots)
        live = pending.copy()
        live[pending] = current == seqs[pending]
        seqs, roots = seqs[live], roots[live]
        if not len(seqs):
            return 0
        order = np.argsort(seqs, kind="stable")
        seqs, roots = seqs[order], roots[order]
        batch = self.storage.get(seqs)
        try:
            self._enqueue(roots, seqs, batch)
        except BaseException as exc:
            log_requeue_error("backoff ended", roots, seqs, exc)
            for seq, root in zip(seqs.tolist(), roots.tolist(), strict=True):
                self._book.wait(seq, root, self._wall() + 1.0)  # try again shortly
            raise
        return len(seqs)

    def _enqueue(
        self, roots: NDArray[np.uint64], seqs: NDArray[np.uint64], batch: RecordBatch
    ) -> None:
        """Records waiting (pending, untimed) under `roots` enter the replay queue now:
        replay seqs, stored with the records; their timeout starts when their source
        fetches them (fetch_replay)."""
        index, partitions = self._route(batch)
        replay_seqs = self._reserve(len(seqs))
        self.persistence.retag(seqs, roots, replay_seqs)
        self._queue.append(
            replay_seqs[index], roots[index], seqs[index], batch.source_ids[index], partitions
        )
        self.stats.replayed += len(seqs)
        self.meters.replayed(batch.source_ids)

    def _reserve(self, n: int) -> NDArray[np.uint64]:
        """The next n replay seqs; the counter is stored before any record uses one."""
        return self._queue.reserve(
            n, lambda next_seq: self.storage.put_meta(REPLAY_SEQ_META_KEY, str(next_seq).encode())
        )

    def _on_timeout(self, roots: NDArray[np.uint64], seqs: NDArray[np.uint64]) -> None:
        # Only the tree the entry was made for: a root completed or failed meanwhile is
        # not pending, and one persisted again since has another record (seq).
        pending, current = self.acker.lookup("seq", roots)
        same = pending.copy()
        same[pending] = current == seqs[pending]
        if not bool(same.any()):
            return
        roots, seqs = roots[same], seqs[same]
        if len(roots) > 1:  # a replay fetched twice (a batch run again) is timed twice
            roots, first = np.unique(roots, return_index=True)
            seqs = seqs[first]
        try:
            if self._barrier:  # a newer copy pending covers it: retire, no replay
                covered = self._covered_at_timeout(roots, seqs)
                if bool(covered.any()):
                    self._retire_covered(roots[covered])
                    roots, seqs = roots[~covered], seqs[~covered]
            if len(roots):
                self._requeue(roots, seqs, FailCause.TIMEOUT, Causes.one(_TIMEOUT, len(roots)))
        except BaseException:
            # The batch left the rotating buckets: time its roots again, or a storage
            # error here would leave them pending with no timeout at all.
            self.persistence.track(roots, seqs)
            raise

    def _requeue(
        self,
        old_roots: NDArray[np.uint64],
        seqs: NDArray[np.uint64],
        cause: FailCause,
        causes: Causes | None = None,
    ) -> None:
        """Failed records, in the order they were first persisted: each gets a new
        root and is, by its source's retry policy, queued for replay now, left waiting
        for its backoff, or dead-lettered (`causes` None: a recovery, which is no
        attempt of the record's: it keeps its count and due time).

        Steps 1-2 may raise (storage errors); they leave the old roots pending, so a
        failed requeue is retried by the timeout. Steps 3-5 only touch memory.
        Step 1: decide each record's fate and route the ones queued now; step 2: store
        the retry records, new roots and replay seqs (one transaction); step 3: swap
        the old roots for the new ones in the acker; step 4: queue (a queued replay's
        timeout starts when its source fetches it), wait or dead-letter; step 5:
        count."""
        n = len(seqs)
        order = np.argsort(seqs, kind="stable")
        old_roots, seqs = old_roots[order], seqs[order]
        if causes is not None:
            causes = causes.take(order)
        batch = self.storage.get(seqs)
        # Step 1.
        now = self._wall()
        fate, due, records = self._fates(seqs, batch.source_ids, causes, now)
        queued, waiting, dead = fate == _QUEUE, fate == _WAIT, fate == _DEAD
        new_roots = new_ids(n)
        new_roots[dead] = 0
        replay_seqs = np.zeros(n, dtype=np.uint64)
        replay_seqs[dead] = DEAD_LETTER
        queued_rows = np.flatnonzero(queued)
        sub = batch if len(queued_rows) == n else batch.take(queued_rows)
        index, partitions = self._route(sub) if len(queued_rows) else (None, None)
        # Step 2.
        if len(queued_rows):
            replay_seqs[queued_rows] = self._reserve(len(queued_rows))
        old_meta = self._book.stage(records)
        try:
            self.persistence.retag(seqs, new_roots, replay_seqs)
        except BaseException as exc:
            self._book.unstage(old_meta)
            log_requeue_error(cause.value, old_roots, seqs, exc)
            raise
        self._book.commit(records)
        # Step 3. The new roots wait (ack value 0) for their source to emit them again.
        self.acker.remove(old_roots)
        live = ~dead
        kept = batch if bool(live.all()) else batch.take(np.flatnonzero(live))
        self.acker.add(new_roots[live], None, seq=seqs[live], **self.persistence.locators(kept))
        if self._journal is not None:
            self._journal.add(new_roots[live])
        # Step 4.
        if len(queued_rows):
            assert index is not None and partitions is not None
            q_roots, q_seqs = new_roots[queued_rows], seqs[queued_rows]
            self._queue.append(
                replay_seqs[queued_rows][index],
                q_roots[index],
                q_seqs[index],
                sub.source_ids[index],
                partitions,
            )
        for row in np.flatnonzero(waiting).tolist():
            self._book.wait(int(seqs[row]), int(new_roots[row]), float(due[row]))
        self._retired.add(old_roots, self._clock())
        # Step 5.
        self.stats.failed[cause.value] += n
        self.meters.failed(cause.value, batch.source_ids)
        if len(queued_rows):
            self.stats.replayed += len(queued_rows)
            self.meters.replayed(batch.source_ids[queued_rows])
        log_failed(cause.value, old_roots, new_roots, seqs, batch, fate, causes, due, records)
        if bool(dead.any()):
            rows = np.flatnonzero(dead)
            self.stats.dead_lettered += len(rows)
            self.meters.dead_lettered(batch.source_ids[rows])
            gone = batch.take(rows)
            self._notify(
                Completed(
                    roots=old_roots[rows],
                    topics=gone.topics,
                    partitions=gone.partitions.astype(np.int32, copy=False),
                    offsets=gone.offsets.astype(np.int64, copy=False),
                )
            )

    def _fates(
        self,
        seqs: NDArray[np.uint64],
        source_ids: NDArray[Any],
        causes: Causes | None,
        now: float,
    ) -> tuple[NDArray[np.int8], NDArray[np.float64], dict[int, RetryRecord]]:
        """Per record: queue now, wait until due[i], or dead-letter; and the retry
        records that change (to be stored)."""
        n = len(seqs)
        fate = np.full(n, _QUEUE, dtype=np.int8)
        due = np.zeros(n, dtype=np.float64)
        changed: dict[int, RetryRecord] = {}
        for i, (seq, source_id) in enumerate(zip(seqs.tolist(), source_ids.tolist(), strict=True)):
            record = self._book.get(seq)
            if causes is None:  # recovery: no attempt of the record's
                if record is not None and record.due > now:
                    fate[i], due[i] = _WAIT, record.due
                continue
            cause = causes[i]
            policy = self.retry_policy(int(source_id))
            record = _copy(record) if record is not None else RetryRecord(int(source_id))
            record.add_failure(now, cause)
            if cause.final or policy.exhausted(record.failures):
                fate[i] = _DEAD
                record.dead_at, record.due = now, 0.0
            else:
                delay = policy.delay_s(record.failures, self._rng)
                record.due = now + delay if delay > 0 else 0.0
                if delay > 0:
                    fate[i], due[i] = _WAIT, record.due
            changed[seq] = record
        return fate, due, changed

    def _track(
        self, roots: NDArray[np.uint64], seqs: NDArray[np.uint64], source_ids: NDArray[Any]
    ) -> None:
        """Start the timeouts of roots that became pending now (their records' storage
        seqs aligned), each with its source's timeout (the FT layer's for sources
        without their own), tagged with its source's open batch (postponed while that
        batch runs)."""
        now = self._clock()
        sources = _source_list(source_ids)
        for source_id in sources:
            config = self.source_config(source_id)
            timeout = None if config is None else config.timeout_s
            tag = self._leases.tag(source_id)
            if len(sources) == 1:
                self.persistence.track(roots, seqs, timeout, now, tag)
            else:
                rows = source_ids == source_id
                self.persistence.track(roots[rows], seqs[rows], timeout, now, tag)

    def _route(self, batch: RecordBatch) -> tuple[NDArray[np.intp], NDArray[np.int32]]:
        """(record index, target partition) pairs, by each record's source partitioner;
        sources without a config re-enter their original partition."""
        index_parts: list[NDArray[np.intp]] = []
        partition_parts: list[NDArray[np.int32]] = []
        for source_id in _sources_of(batch):
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
        found = self._queue.fetch(lo, hi, source_id, partition)
        rseqs, roots, seqs, parts = found.replay_seqs, found.roots, found.seqs, found.partitions
        pending, pending_seqs = self.acker.lookup("seq", roots)
        live = pending.copy()
        live[pending] = pending_seqs == seqs[pending]
        again, sources = found.again, found.source_ids
        if not bool(live.all()):
            rseqs, roots, seqs, parts = rseqs[live], roots[live], seqs[live], parts[live]
            again, sources = again[live], sources[live]
        if bool(again.any()):
            roots = self._renew(roots, again, sources)
        records = self.storage.get(seqs).with_roots(roots)
        if len(roots):
            self._track(roots, seqs, records.source_ids)
            if self._barrier:
                self._hold_replays(records)
        return ReplayRecords(replay_seqs=rseqs, partitions=parts, records=records)

    def _renew(
        self, roots: NDArray[np.uint64], again: NDArray[np.bool_], sources: NDArray[Any]
    ) -> NDArray[np.uint64]:
        """`roots` with the tree-mode, single-entry ones fetched `again` under fresh
        roots, which take the old ones over: same record, same locator, ack value 0
        (the re-run emits it again), no replay; the queue entries follow."""
        rows = np.flatnonzero(again)
        if self._barrier:  # a barrier-mode replay completes at its batch's barrier
            rows = rows[~np.isin(sources[rows], np.fromiter(self._barrier, np.uint32))]
        if len(rows):
            rows = rows[self._queue.entries_of(roots[rows]) == 1]
        if not len(rows):
            return roots
        self._changing()
        removed = self.acker.remove(roots[rows])
        fresh = new_ids(len(removed.roots))
        self.acker.add(fresh, None, **removed.columns)
        self._queue.renew(removed.roots, fresh)
        self._retired.add(removed.roots, self._clock())
        self.stats.taken_over += len(removed.roots)
        order = np.argsort(removed.roots)
        renewed = roots.copy()
        renewed[rows] = fresh[order][np.searchsorted(removed.roots[order], roots[rows])]
        return renewed

    def _hold_replays(self, records: RecordBatch) -> None:
        """Barrier-mode replays a batch takes in get their barrier holds (once, also
        when the range is fetched again, or a broadcast replay has several rows)."""
        for source_id, rows in self._barrier_rows(records.source_ids) or []:
            roots = np.unique(records.roots[rows])
            fresh = roots[self._holds.new_roots(source_id, roots)]
            if len(fresh):
                self._changing()
                holds = new_ids(len(fresh))
                self.acker.xor(fresh, holds)  # 0 -> the hold: nothing completes
                if self._journal is not None:
                    self._journal.xor(fresh, holds)
                self._add_holds(source_id, fresh, holds)

    def lowest_pending_offsets(
        self, topics: Sequence[str] | None = None
    ) -> dict[str, dict[int, int]]:
        """{topic: {partition: the lowest Kafka offset of a pending root}}, over every
        pending root (replayed ones keep their original offset), for `topics` only if
        given. A partition with nothing pending is absent: a Kafka consumer group may
        then commit up to what its source has read; otherwise never past this offset.
        Records persisted without an offset (negative) are ignored."""
        cols = self.acker.live_columns("topic", "partition", "offset", copy=False)
        topic, partition = cols["topic"], cols["partition"]
        offsets = cols["offset"].astype(np.int64, copy=False)
        keep = offsets >= 0
        if topics is not None:
            wanted = self.persistence.topic_numbers(topics)
            keep &= topic == wanted[0] if len(wanted) == 1 else np.isin(topic, wanted)
        if not bool(keep.all()):
            topic, partition, offsets = topic[keep], partition[keep], offsets[keep]
        result: dict[str, dict[int, int]] = {}
        if not len(offsets):
            return result
        topic_nums, partitions, lowest = _min_per_partition(topic, partition, offsets)
        names = self.persistence.topic_names(topic_nums.astype(np.uint32))
        for name, p, offset in zip(names, partitions.tolist(), lowest.tolist(), strict=True):
            lowest_of = result.setdefault(name, {})  # two sources may read one topic
            lowest_of[p] = min(offset, lowest_of.get(p, offset))
        return result

    def pending_by_source(self) -> dict[int, int]:
        """{source id: its pending roots}, sources with none left out: records in flight
        and records waiting in the replay queue alike. O(pending): a count of the topic
        number column (a number names a source and topic), so no column more per root."""
        numbers = self.acker.live_columns("topic", copy=False)["topic"]
        if not len(numbers):
            return {}
        sources = self.persistence.number_sources()
        counts = np.bincount(numbers, minlength=len(sources))
        result: dict[int, int] = {}
        for number in np.flatnonzero(counts).tolist():
            source = int(sources[number])
            result[source] = result.get(source, 0) + int(counts[number])
        return result

    def prune_replay(self, upto: int, source_id: int | None = None) -> int:
        """Forget queue entries with replay seq <= upto, of `source_id` or of every
        source: the batches that took them in are checkpointed and never run again.
        Returns how many entries were dropped. Their roots stay pending: a replay that
        fails again is queued again under a new replay seq."""
        self._changing()
        if self._journal is not None:
            self._journal.prune(upto, source_id)
        return self._queue.prune(upto, source_id)

    def replay_start_of(self, source_id: int) -> int:
        """Where a new query of `source_id` starts its replay cursor: the point its
        queue entries were pruned to (0 if never), so it takes in every queued replay
        of the source that no finished batch took in."""
        return self._queue.start_of(source_id)

    # ---- checkpoints -------------------------------------------------------------

    def state_snapshot(self, *, journal_base: bool | None = None) -> dict[str, NDArray[Any]]:
        """Copies of the state a checkpoint holds: every pending root with its ack value
        and the storage seq of its record ("acker.*"), the replay queue ("queue.*") and
        the retry counts ("retries.*"). O(pending) array copies and no storage
        access, so a caller that serializes this core (the server's lock) holds it
        only for the copy; writing the snapshot can happen elsewhere
        (ftlayer.checkpoint)."""
        # The Kafka coordinates are in the stored record (by seq): not copied again.
        state = {f"acker.{name}": column for name, column in self.acker.snapshot("seq").items()}
        state.update({f"queue.{name}": column for name, column in self._queue.columns().items()})
        if len(self._book):  # the retry counts of pending roots that failed before
            live = self.acker.live_columns("root", "seq", copy=False)
            failed = np.isin(live["seq"], np.array(self._book.seqs(), dtype=np.uint64))
            roots, seqs = live["root"][failed], live["seq"][failed].tolist()
            records = [self._book.get(seq) for seq in seqs]
            counts = [0 if r is None else r.attempts for r in records]
            state["retries.root"] = roots.copy()
            state["retries.count"] = np.array(counts, dtype=np.int64)
        else:
            state["retries.root"] = np.zeros(0, dtype=np.uint64)
            state["retries.count"] = np.zeros(0, dtype=np.int64)
        holds = self._holds.columns()
        state.update({f"holds.{name}": column for name, column in holds.items()})
        points = self._queue.prune_points()
        state["pruned.source"] = np.array([-1 if s is None else s for s in points], dtype=np.int64)
        state["pruned.upto"] = np.array(list(points.values()), dtype=np.int64)
        state["replay.next_seq"] = np.array([self._queue.cursor + 1], dtype=np.uint64)
        if journal_base is None:
            journal_base = self._journal_base_due()
        if self._journal is not None and journal_base:  # the base of the segment begun now
            state["journal.segment"] = np.array([self._journal.rotate()], dtype=np.uint64)
            # Records stored from here on are not in this state: a persist begun and not
            # ended may be storing some below the store's next seq (begin_persist).
            next_seq = min([self.storage.next_seq, *(t.floor for t in self._tickets)])
            state["journal.next_seq"] = np.array([next_seq], dtype=np.uint64)
            # Except those stored meanwhile by persists that ended: their fate is here.
            ended = np.concatenate(self._ended) if self._ended else np.zeros(0, np.uint64)
            ended = ended[ended >= np.uint64(next_seq)]
            self._ended = [ended] if len(ended) else []
            state["journal.ended_seqs"] = np.sort(ended)
        return state

    def _journal_base_due(self) -> bool:
        """Whether a snapshot should also be the journal's base: once the journal has
        grown by as much as a base would hold (24 bytes per pending root, at least
        JOURNAL_BASE_MIN_BYTES), so a checkpoint per micro-batch does not write a base
        each time, and recovery reads at most about twice a base; and at once after a
        failed journal write (a base starts it again)."""
        journal = self._journal
        if journal is None:
            return False
        due = max(JOURNAL_BASE_MIN_BYTES, _BASE_BYTES_PER_ROOT * len(self.acker))
        return journal.broken is not None or journal.segment_bytes >= due

    @property
    def journal(self) -> Journal | None:
        return self._journal

    def write_journal_base(self) -> None:
        """Write the journal's base now (the state, O(pending)) and truncate it: when its
        segment outgrew its limit and no checkpoint wrote a base (no barrier-driven
        source)."""
        from ftlayer.checkpoint.snapshot import encode_snapshot  # a codec; no cycle at run

        journal = self._journal
        if journal is None:
            return
        state = self.state_snapshot(journal_base=True)
        journal.write_base(int(state["journal.segment"][0]), bytes(encode_snapshot(state)))

    # ---- recovery and status ---------------------------------------------------

    def _recover(self) -> None:
        """Every record found in storage at start was pending when the last process
        stopped, or is a dead letter. With a journal (ftlayer.core.journal) that knows
        its root, a record is restored as it was: pending with its ack value, in the
        replay queue under its replay seq if no finished batch took it in, waiting for
        its backoff, or (its tree completed, the delete was still staged) deleted. Every
        other record is replayed under a new root: at once, or when the backoff of its
        last failure ends (its retry record keeps the due time). Dead letters stay as
        they are."""
        journal = None if self._journal is None else self._journal.recover()
        # Collect first: re-tagging writes to the storage being scanned.
        found = []
        stored_dead: set[int] = set()
        for seqs, batch, replay in self.storage.scan():
            dead = replay == DEAD_LETTER
            if bool(dead.any()):
                stored_dead.update(seqs[dead].tolist())
                keep = np.flatnonzero(~dead)
                seqs, batch, replay = seqs[keep], batch.take(keep), replay[keep]
            if len(seqs):
                found.append((batch, seqs, replay))
        stored = {int(s) for _, seqs, _ in found for s in seqs.tolist()} | stored_dead
        stale = [seq for seq in self._book.seqs() if seq not in stored]
        if stale:  # completed or purged, and the crash came before their record left
            self._book.forget(stale)
        restored: list[tuple[RecordBatch, NDArray[np.uint64], NDArray[np.uint64], Any]] = []
        gone: list[NDArray[np.uint64]] = []
        for batch, seqs, replay in found:
            if journal is None:
                self._requeue(batch.roots, seqs, FailCause.RECOVERY)
                continue
            known, acks = journal.known(batch.roots)
            done = journal.is_gone(batch.roots)
            known &= ~done
            earlier = ~(known | done) & journal.done_before_base(seqs)
            if bool(earlier.any()) and len(self._book):
                failed = np.isin(seqs, np.array(self._book.seqs(), dtype=np.uint64))
                earlier &= ~failed
            done |= earlier
            if bool(done.any()):
                gone.append(seqs[done])
            if bool(known.any()):
                rows = np.flatnonzero(known)
                restored.append((batch.take(rows), seqs[rows], replay[rows], acks[rows]))
            lost = ~(known | done)
            if bool(lost.any()):
                rows = np.flatnonzero(lost)
                self._requeue(batch.roots[rows], seqs[rows], FailCause.RECOVERY)
        if journal is not None:
            self._restore(journal, restored, gone)
        # A re-read of a recovered record (a re-run of the last batch, a new query from
        # the group offsets) takes over its root, restored or replayed.
        if len(self.acker):
            live = self.acker.live_columns("topic", "partition", "offset", copy=False)
            self._marks.rebuild(live["topic"], live["partition"], live["offset"])

    def _restore(
        self,
        journal: JournalState,
        restored: list[tuple[RecordBatch, NDArray[np.uint64], NDArray[np.uint64], Any]],
        gone: list[NDArray[np.uint64]],
    ) -> None:
        """Recovery from the journal: the records it knows, as they were."""
        if gone:
            done = np.concatenate(gone)
            self._book.forget(done.tolist())
            self.storage.delete(done)
            self.stats.recovered_completed += len(done)
        if not restored:
            return
        batch = RecordBatch.concat([b for b, _, _, _ in restored])
        seqs = np.concatenate([s for _, s, _, _ in restored])
        replay = np.concatenate([r for _, _, r, _ in restored])
        acks = np.concatenate([a for _, _, _, a in restored]).astype(np.uint64)
        roots = batch.roots
        self.acker.add(roots, acks, seq=seqs, **self.persistence.locators(batch))
        self.stats.recovered_pending += len(roots)
        self._queue.restore_prune_points(journal.pruned)
        # The replay queue: the base's entries whose roots are still pending under the
        # same record, and the records queued since the base (replay seq at or past the
        # base's next one), routed again; minus what prunes since then dropped.
        queued = np.zeros(len(roots), dtype=np.bool_)
        base = journal.queue
        next_seq = int(base["next_seq"][0]) if "next_seq" in base else 1
        if len(base.get("replay_seq", ())):
            rseq, broots, bseqs = base["replay_seq"], base["root"], base["seq"]
            pending, current = self.acker.lookup("seq", broots)
            live = pending.copy()
            live[pending] = current == bseqs[pending]
            sources, parts = base["source_id"], base["partition"]
            live &= rseq > self._queue.prune_point_array(sources)
            if bool(live.any()):
                self._queue.append(
                    rseq[live],
                    broots[live],
                    bseqs[live],
                    sources[live].astype(np.uint32),
                    parts[live].astype(np.int32),
                    restored=True,
                )
            queued |= np.isin(roots, broots[live])
        newer = (replay >= next_seq) & (replay > 0) & (replay != DEAD_LETTER)
        newer &= replay > self._queue.prune_point_array(batch.source_ids)
        newer &= ~queued
        if bool(newer.any()):
            rows = np.flatnonzero(newer)
            sub = batch.take(rows)
            index, partitions = self._route(sub)
            self._queue.append(
                replay[rows][index],
                roots[rows][index],
                seqs[rows][index],
                sub.source_ids[index],
                partitions,
            )
            queued[rows] = True
        # Waiting for their backoff: no replay seq yet, a retry record with a due time.
        waiting = np.zeros(len(roots), dtype=np.bool_)
        if len(self._book):
            for row in np.flatnonzero((replay == 0) & ~queued).tolist():
                record = self._book.get(int(seqs[row]))
                if record is not None and record.dead_at is None and record.due > 0:
                    self._book.wait(int(seqs[row]), int(roots[row]), record.due)
                    waiting[row] = True
        # The rest are in flight: timed from now.
        timed = ~(queued | waiting)
        if bool(timed.any()):
            rows = np.flatnonzero(timed)
            self._track(roots[rows], seqs[rows], batch.source_ids[rows])
        # Open barrier holds of roots still pending: released at their batch's barrier.
        for source_id, (hold_roots, values) in journal.holds.items():
            pending = self.acker.lookup("seq", hold_roots)[0]
            if bool(pending.any()):
                self._holds.add(source_id, hold_roots[pending], values[pending])
                if source_id & SINK_KEY_BIT:  # a sink's acks: it settles them, or they go stale
                    self._sink_keys.opened(source_id, self._clock())

    # ---- dead letters ----------------------------------------------------------------

    def dead_letters(
        self, where: DeadLetterFilter | None = None, limit: int | None = None
    ) -> tuple[list[tuple[int, RetryRecord]], RecordBatch]:
        """The dead letters that match `where` (oldest first, at most `limit`): their
        storage seqs with their retry records, and their stored records (with root 0)."""
        where = where or DeadLetterFilter()
        # The retry record decides all but the partition; the stored records are read
        # a chunk at a time, only for letters that pass that far.
        anywhere = dataclasses.replace(where, partition=None)
        seqs = [
            seq for seq in sorted(self._book.dead) if anywhere.matches(seq, self._book.dead[seq], 0)
        ]
        chosen: list[tuple[int, RetryRecord]] = []
        batches: list[RecordBatch] = []
        for start in range(0, len(seqs), _DEAD_LETTER_CHUNK):
            chunk = seqs[start : start + _DEAD_LETTER_CHUNK]
            batch = self.storage.get(np.array(chunk, dtype=np.uint64))
            rows = np.arange(len(chunk), dtype=np.intp)
            if where.partition is not None:
                rows = np.flatnonzero(batch.partitions == where.partition)
            if limit is not None:
                rows = rows[: limit - len(chosen)]
            chosen += [(chunk[i], self._book.dead[chunk[i]]) for i in rows.tolist()]
            batches.append(batch.take(rows) if len(rows) < len(chunk) else batch)
            if limit is not None and len(chosen) >= limit:
                break
        if not batches:
            return chosen, self.storage.get(np.zeros(0, dtype=np.uint64))
        return chosen, batches[0] if len(batches) == 1 else RecordBatch.concat(batches)

    def requeue_dead_letters(self, where: DeadLetterFilter) -> int:
        """Put the matching dead letters back for replay now (after a fix): each gets a
        new root and a replay seq; its history stays, and its retries count afresh.
        Returns how many."""
        chosen, batch = self.dead_letters(where)
        if not chosen:
            return 0
        self._changing()
        seqs = np.array([seq for seq, _ in chosen], dtype=np.uint64)
        roots = new_ids(len(seqs))
        records: dict[int, RetryRecord] = {}
        for seq, record in chosen:
            records[seq] = record.requeued_copy()
        old_meta = self._book.stage(records)
        try:
            self.persistence.retag(seqs, roots, np.zeros(len(seqs), dtype=np.uint64))
        except BaseException:
            self._book.unstage(old_meta)
            raise
        self._book.commit(records)
        locators = self.persistence.locators(batch)
        self.acker.add(roots, None, seq=seqs, **locators)
        self._marks.read(chunk_groups(locators["topic"], locators["partition"], locators["offset"]))
        if self._journal is not None:
            self._journal.add(roots)
        self._enqueue(roots, seqs, batch)
        self.stats.dead_letters_requeued += len(seqs)
        return len(seqs)

    def restore_dead_letters(self, batch: RecordBatch, history: Sequence[RetryRecord]) -> int:
        """Dead letters taken back from a dead-letter topic (after a fix): stored again
        under the fresh roots of `batch`, with their history (`history[i]` for record
        i), and queued for replay now with a fresh retry budget. Returns how many. On
        any error nothing is stored, or what was stored is pending and timed (a
        replay, never a loss)."""
        n = len(batch)
        if len(history) != n:
            raise ValueError(f"{n} records but {len(history)} histories")
        if not n:
            return 0
        self._changing()
        self._check_routable(batch)
        if len(self._retired):
            self._check_not_retired(batch.roots)
        if self._tickets:
            self._check_not_persisting(batch.roots)
        locators = self.persistence.locators(batch)
        slots = self.acker.add(batch.roots, None, **locators)
        try:
            # Not persistence.persist: the marked deletes stay marked, for the deleter of a
            # server (its own transactions) or the next persist.
            seqs = self.storage.put(batch)
        except BaseException:
            self.acker.remove(batch.roots)
            raise
        self.acker.set_column("seq", slots, seqs)
        self._stored_meanwhile(seqs)
        if self._journal is not None:
            self._journal.add(batch.roots)
        self._marks.read(chunk_groups(locators["topic"], locators["partition"], locators["offset"]))
        records: dict[int, RetryRecord] = {}
        for seq, source_id, record in zip(
            seqs.tolist(), batch.source_ids.tolist(), history, strict=True
        ):
            records[seq] = record.requeued_copy(int(source_id))
        old_meta = self._book.stage(records)
        try:
            self._enqueue(batch.roots, seqs, batch)
        except BaseException:
            self._book.unstage(old_meta)
            self._track(batch.roots, seqs, batch.source_ids)  # the timeout retries it
            raise
        self._book.commit(records)
        self.stats.persisted += n
        self.meters.persisted(batch.source_ids, int(seqs[0]), self._clock())
        self.stats.dead_letters_requeued += n
        return n

    def purge_dead_letters(self, where: DeadLetterFilter, *, delivered: bool = False) -> int:
        """Delete the matching dead letters for good (a user's purge, or `delivered`:
        the dead-letter topic confirmed them). Returns how many."""
        chosen, _batch = self.dead_letters(where)
        if not chosen:
            return 0
        self._changing()
        seqs = [seq for seq, _ in chosen]
        self._book.forget(seqs)  # staged: committed by the delete's transaction
        self.storage.delete(np.array(seqs, dtype=np.uint64))
        if delivered:
            self.stats.dead_letters_delivered += len(seqs)
        else:
            self.stats.dead_letters_purged += len(seqs)
        return len(seqs)

    @property
    def dead_letter_count(self) -> int:
        return len(self._book.dead)

    # ---- finding one record (ftlayer.inspection) -------------------------------------

    def inspect(self, query: RecordQuery) -> Inspection:
        """The records `query` names and where each is (ftlayer.inspection): by root, the
        pending root (or whether it failed recently); by Kafka coordinates, every
        pending root and every dead letter at them. O(pending + dead letters) for
        coordinates, plus a read of the records found: a diagnostic, changes nothing."""
        found: list[tuple[int, int]] = []  # (root, seq)
        retired = False
        if query.root is not None:
            key = np.array([query.root], dtype=np.uint64)
            if query.root > 1 and len(self.acker):
                pending, seqs = self.acker.lookup("seq", key)
                if bool(pending[0]):
                    found.append((query.root, int(seqs[0])))
            if not found and len(self._retired):
                retired = bool(self._retired.known(key, self._clock())[0])
        else:
            found += self._pending_at(query)
            found += [(0, seq) for seq in self._dead_letters_at(query)]
        if not found:
            return Inspection(query, (), retired)
        seqs = np.array([seq for _, seq in found], dtype=np.uint64)
        batch = self.storage.get(seqs)
        queue = self._queue.columns() if len(self._queue) else None
        held = self._holds.columns()["root"] if len(self._holds) else _EMPTY_U64
        records = []
        for i, (root, seq) in enumerate(found):
            history = self._book.get(seq)
            state, replay_seq, since, due = RecordState.PENDING, None, None, None
            parts: tuple[int, ...] = ()
            if seq in self._book.dead:
                state = RecordState.DEAD_LETTER
            elif self._book.waiting_root(seq) == root:
                state, due = RecordState.WAITING, None if history is None else history.due
            elif queue is not None:
                entries = (queue["root"] == root) & (queue["seq"] == seq)
                if bool(entries.any()):
                    state = RecordState.QUEUED
                    replay_seq = int(queue["replay_seq"][entries][0])
                    parts = tuple(int(p) for p in queue["partition"][entries].tolist())
                    if history is not None:
                        since = max(history.last_failed, history.due)
            records.append(
                InspectedRecord(
                    state=state,
                    root=root,
                    seq=seq,
                    source_id=int(batch.source_ids[i]),
                    topic=batch.topics[i],
                    partition=int(batch.partitions[i]),
                    offset=int(batch.offsets[i]),
                    payload_bytes=len(batch.payloads[i]),
                    has_key=bool(batch.has_key[i]),
                    key_hash=int(batch.key_hashes[i]),
                    replay_seq=replay_seq,
                    replay_partitions=parts,
                    queued_since=since,
                    due=due,
                    barrier_hold=bool(root) and bool(np.any(held == root)),
                    history=None if history is None else history.to_json(),
                    payload=bytes(batch.payloads[i]),
                )
            )
        return Inspection(query, tuple(records), retired)

    def _pending_at(self, query: RecordQuery) -> list[tuple[int, int]]:
        """(root, seq) of the pending roots at the query's Kafka coordinates."""
        numbers = self.persistence.topic_numbers([str(query.topic)])
        if not len(numbers) or not len(self.acker):
            return []
        live = self.acker.live_columns("root", "seq", "topic", "partition", "offset", copy=False)
        hit = (live["offset"] == query.offset) & (live["partition"] == query.partition)
        hit &= np.isin(live["topic"], numbers)
        return list(zip(live["root"][hit].tolist(), live["seq"][hit].tolist(), strict=True))

    def _dead_letters_at(self, query: RecordQuery) -> list[int]:
        """The seqs of the dead letters at the query's Kafka coordinates."""
        seqs = sorted(self._book.dead)
        hits: list[int] = []
        for start in range(0, len(seqs), _DEAD_LETTER_CHUNK):
            chunk = seqs[start : start + _DEAD_LETTER_CHUNK]
            batch = self.storage.get(np.array(chunk, dtype=np.uint64))
            rows = (batch.offsets == query.offset) & (batch.partitions == query.partition)
            hits += [
                chunk[i] for i in np.flatnonzero(rows).tolist() if batch.topics[i] == query.topic
            ]
        return hits

    def current_stats(self) -> FTStats:
        """The counters, with the current state filled in: pending roots, and the replay
        queue's length and cursors."""
        self.stats.pending = len(self.acker)
        self.stats.replay_queue = self.queued_replays
        self.stats.replay_cursor = self._queue.cursor
        self.stats.replay_cursors = self._queue.cursors()
        self.stats.replay_cursor_at_start = self._queue.cursor_at_start
        self.stats.replay_pruned = self._queue.pruned()
        self.stats.retry_waiting = self._book.waiting
        self.stats.dead_letters = len(self._book.dead)
        self.stats.barrier_holds = len(self._holds)
        self.stats.timeouts_postponed = self.persistence.postponed
        self.stats.batches_running = self._leases.status(self._clock())
        by_source = self.meters.by_source(self.persistence.number_sources())
        queued = self.queued_replays_by_source()
        self.stats.by_source = {
            str(s): meters.to_json(queued.get(s, 0)) for s, meters in by_source.items()
        }
        self.stats.complete_latency = total_latency(by_source).summary()
        return self.stats

    def queued_replays_by_source(self) -> dict[int, int]:
        """{source id: its entries in the replay queue}, sources with none left out."""
        return self._queue.counts()


def _rows_by_coordinates(locators: Mapping[str, NDArray[Any]]) -> dict[tuple[int, int, int], int]:
    """{(topic number, partition, offset): row} of a batch's locators."""
    return {
        c: i
        for i, c in enumerate(
            zip(
                locators["topic"].tolist(),
                locators["partition"].tolist(),
                locators["offset"].tolist(),
                strict=True,
            )
        )
    }


def _same_bytes(a: Sequence[bytes], b: Sequence[bytes]) -> NDArray[np.bool_]:
    """Which pairs of stored payloads are equal: the same source record read twice
    (a recreated topic, or a new cluster after a savepoint restore, reuses offsets for
    other records)."""
    return np.fromiter((x == y for x, y in zip(a, b, strict=True)), np.bool_, len(a))


_DEAD_LETTER_CHUNK: Final = 1024
_QUEUE: Final = 0
_WAIT: Final = 1
_DEAD: Final = 2
_TIMEOUT: Final = Cause(FailKind.TIMEOUT)


def _copy(record: RetryRecord) -> RetryRecord:
    """A copy to change (the book's own changes only once its write succeeded)."""
    return dataclasses.replace(record, causes=list(record.causes))


_DENSE_CELLS = 1 << 20
_EMPTY_CELL: Final = int(np.iinfo(np.int64).max)


def _min_per_partition(
    topics: NDArray[Any], partitions: NDArray[Any], values: NDArray[np.int64]
) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
    """(topic, partition, the minimum value) of each distinct (topic, partition).
    Topic numbers are dense and partitions small, so a table indexed by (topic,
    partition) and np.minimum.at do it in O(n) (the checkpoint of every micro-batch
    asks this); a sort when the table would be large (or a partition is negative)."""
    t_lo, t_hi = int(topics.min()), int(topics.max())
    width = int(partitions.max()) + 1
    cells = (t_hi - t_lo + 1) * width
    if int(partitions.min()) >= 0 and cells <= _DENSE_CELLS:
        # Cells from the lowest topic on; with one topic (a checkpoint asks for its
        # query's) the partition alone is the cell.
        cell = partitions if t_lo == t_hi else (topics.astype(np.intp) - t_lo) * width + partitions
        table = np.full(cells, _EMPTY_CELL, dtype=np.int64)
        np.minimum.at(table, cell, values)
        present = np.flatnonzero(table != _EMPTY_CELL)
        return present // width + t_lo, present % width, table[present]
    t = topics.astype(np.int64, copy=False)
    p = partitions.astype(np.int64, copy=False)
    order = np.lexsort((p, t))
    t, p, values = t[order], p[order], values[order]
    starts = np.flatnonzero(np.r_[True, (t[1:] != t[:-1]) | (p[1:] != p[:-1])])
    return t[starts], p[starts], np.minimum.reduceat(values, starts)


def _with_holds(
    initial: ArrayLike | None,
    held: list[tuple[int, NDArray[np.intp]]],
    zeros: NDArray[np.uint64] | None,
) -> NDArray[np.uint64]:
    """First ack values in which every barrier-mode row holds a non-zero value: the
    emission ids the source gave (the usual case), or fresh ids where it gave none."""
    values = zeros if zeros is not None else np.array(initial, dtype=np.uint64, copy=True)
    for _source, rows in held:
        missing = rows[values[rows] == 0]
        if len(missing):
            values[missing] = new_ids(len(missing))
    return values


def _sources_of(batch: RecordBatch) -> list[int]:
    """The distinct source ids of a batch (usually one: a batch comes from one source)."""
    return _source_list(batch.source_ids)


def _source_list(ids: NDArray[Any]) -> list[int]:
    if len(ids) and bool((ids == ids[0]).all()):
        return [int(ids[0])]
    return [int(i) for i in np.unique(ids)]
