"""Barrier checkpoints of the FT layer, coordinated with Spark's micro-batches.

Every micro-batch boundary is a barrier. Barrier n is batch n's end position S_n: the
Kafka offsets per topic and partition and the replay cursor, which Spark writes to its
offset log before the batch runs. The `ftkafka` source announces it when Spark plans
the batch (CHECKPOINT_BEGIN) and reports the batch done through its commit(end), one
batch late (CHECKPOINT_DONE). A checkpoint belongs to a *query*: the ftkafka
source name (`ft.sourceName`, by default its topics).

Begin: the FT layer takes a snapshot of its state, pending roots with their ack
values and locators, the replay queue and the retry counts (`FTLayer.state_snapshot`):
array copies under the core's lock, O(pending), with no storage access. The copy is
lazy: the barrier only marks the state as owed, and the copy is taken before the next
change to it (`FTLayer.add_change_hook`) or by the writer, whichever comes first, so
it is the state at the barrier and the reply to CHECKPOINT_BEGIN does not wait for
it. Writing the snapshot to LMDB happens afterwards and elsewhere (the server's
checkpoint writer thread), so event processing does not wait for it: this is the
asynchronous phase of an asynchronous barrier snapshot. The stored records need no
copy: they are already in LMDB, and the snapshot names them by their storage seqs.
The barrier also opens the batch of the query's sources (`FTLayer.batch_began`), and
its completion closes it (`FTLayer.batch_done`): while it is open and its driver
heartbeats, its trees do not time out (ftlayer.core.leases).

Complete: Spark will never run batch n again. The FT layer prunes the replay queue
entries batch n took in (replay seq <= S_n's cursor) and decides the consumer-group
offsets the source may commit, by the query's mode:

- unaligned: checkpoint n completes at once. Roots still in flight belong to it: they
  are persisted, and a restart replays them. Group offsets move to the lowest offset
  still pending in each partition, capped at S_n.
- aligned: checkpoint n completes once no root that entered before S_n (a Kafka
  offset below S_n in its partition, replays included: they keep their original
  offset) is pending. Until then it is *aligning*; the server checks again on every
  tick. Group offsets then move to S_n. The time from the batch being done to the
  completion is the checkpoint's alignment wait.

A checkpoint also completes only once its snapshot is written, or a later snapshot
of its query is (see "A failed write" below). The newest `retain`
snapshots of each query stay in LMDB (meta keys "snapshot/<query>/<id>"; the server
keeps them in an LMDB environment of their own, `<data dir>/checkpoints`, written
without fsync, so they never queue behind the records' transactions: a snapshot lost
to an OS crash loses no record). The record of each completed checkpoint
("checkpoint/<query>/<id>", JSON: position, figures, group offsets) goes to the FT
layer's own store for the newest `retain` completed checkpoints, so a restarted FT
layer goes on numbering and knows each query's last completed position. Records are
staged (PersistenceStorage.stage_meta): they commit with the store's next write (a
persist, the deletes of completed records) or the server's next tick, never with an
fsync of their own. The writer also commits them, right away and without fsync, to
the store of snapshots, so a killed process loses none; an OS crash may lose the
newest, which only makes the restarted FT layer know an older position (a savepoint
starts further back: duplicates, no loss).
Savepoints (ftlayer.checkpoint.savepoint) copy the FT layer's store.

A failed write stalls nothing. `write_pending` writes its snapshots and records in one
transaction; if that fails, none of it is stored and all of it is kept for the next
write (the server's writer tries again on its next round, which an idle stream
has too, and with every barrier):

1. The records go back to the front of the queue: the next write stores them.
2. Of each query's snapshots only the newest is kept, and retried. The older ones are
   *superseded*: never written, they complete (by their mode, in order) once a later
   snapshot of their query is written. That later snapshot is the state at a later
   barrier of the same query, so it holds every root still pending of theirs; a
   restore from it loses nothing they would have kept, and group offsets never
   depended on the snapshot (they come from the roots pending at completion). Keeping
   one snapshot per query bounds the memory of a store that keeps failing: one copy of
   the state per query, not one per barrier.
3. The snapshot count per query (`retain`) moves only when the write succeeds, so a
   retried snapshot is counted once and the expiry deletes what was stored.

While writes fail, no checkpoint completes and group offsets hold (as they must: no
snapshot is durable); the write that succeeds completes the whole backlog at once.
The FT layer's own store keeps a staged record staged when its commit fails, so its
next write carries it.

Not thread-safe: the caller serializes begin, complete and poll with the core they
belong to (`lock`, which `write_pending` takes for the copy it owes; the server's
lock); `write_pending` may run in another thread (LmdbStorage is thread-safe).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import logging
import re
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from numpy.typing import NDArray

from ftlayer.core import FTLayer
from ftlayer.core.statecodec import encode_snapshot
from ftlayer.errors import ConfigError
from ftlayer.logs import fields
from ftlayer.persistence.base import MetaValue, PersistenceStorage
from ftlayer.position import (
    KafkaOffsets,
    Position,
    offsets_from_json,
    offsets_to_json,
)

log = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "checkpoint/"
SNAPSHOT_PREFIX = "snapshot/"
SNAPSHOT_DIR = "checkpoints"
"""The LMDB environment of snapshots (and copies of the checkpoint records) inside a
server's data dir."""
MAX_QUERY_CHARS = 200
_QUERY_OK = re.compile(r"^[^\x00-\x1f\x7f-\x9f/]+$")
_RECENT = 20  # checkpoint records kept in memory per query, for status
_MAX_OPEN = 1000  # open (begun or aligning) checkpoints per query before the oldest go
_FAILURE_LOG_S = 60.0  # while snapshot writes keep failing, one error line per this


class CheckpointMode(enum.Enum):
    ALIGNED = "aligned"
    UNALIGNED = "unaligned"

    @classmethod
    def named(cls, name: str) -> CheckpointMode:
        try:
            return cls(name)
        except ValueError:
            raise ConfigError(
                f"unknown checkpoint mode {name!r}: use 'aligned' or 'unaligned'"
            ) from None


class CheckpointState(enum.Enum):
    BEGUN = "begun"  # the batch is planned or running
    ALIGNING = "aligning"  # the batch is done; roots before S_n are still pending
    COMPLETE = "complete"


@dataclass(slots=True)
class Checkpoint:
    """One barrier's checkpoint and its figures (times are UNIX seconds)."""

    query: str
    id: int
    mode: CheckpointMode
    position: Position
    sources: tuple[int, ...]
    state: CheckpointState = CheckpointState.BEGUN
    begun_at: float = 0.0
    pending_roots: int = 0
    replay_queue: int = 0
    copy_s: float = 0.0
    """Time the snapshot's array copy held the core (the only part that stops events)."""
    write_s: float | None = None
    """Time writing the snapshot took (None until written)."""
    size_bytes: int = 0
    done_at: float | None = None
    completed_at: float | None = None
    alignment_wait_s: float | None = None
    commit_offsets: KafkaOffsets | None = None
    """The consumer-group offsets this checkpoint allows (set at completion)."""
    pruned: int = 0
    snapshot_written: bool = False
    superseded: bool = False
    """Its snapshot could not be written and a later one of its query replaces it: it
    completes once that one is written."""
    key: str = ""
    """position.key(), kept: the lookup of a barrier begun before."""

    def __post_init__(self) -> None:
        if not self.key:
            self.key = self.position.key()

    @property
    def duration_s(self) -> float | None:
        """From the barrier to completion."""
        if self.completed_at is None:
            return None
        return round(self.completed_at - self.begun_at, 6)

    def to_json(self) -> dict[str, Any]:
        return {
            "query": self.query,
            "id": self.id,
            "mode": self.mode.value,
            "state": self.state.value,
            "position": self.position.to_json(),
            "sources": list(self.sources),
            "begun_at": self.begun_at,
            "done_at": self.done_at,
            "completed_at": self.completed_at,
            "duration_s": self.duration_s,
            "alignment_wait_s": self.alignment_wait_s,
            "pending_roots": self.pending_roots,
            "replay_queue": self.replay_queue,
            "copy_s": self.copy_s,
            "write_s": self.write_s,
            "size_bytes": self.size_bytes,
            "pruned": self.pruned,
            "superseded": self.superseded,
            "commit_offsets": (
                None if self.commit_offsets is None else offsets_to_json(self.commit_offsets)
            ),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Checkpoint:
        checkpoint = cls(
            query=str(data["query"]),
            id=int(data["id"]),
            mode=CheckpointMode.named(str(data["mode"])),
            position=Position.parse(data["position"], need_replay=True),
            sources=tuple(int(s) for s in data["sources"]),
            state=CheckpointState(data["state"]),
            begun_at=float(data["begun_at"]),
            pending_roots=int(data["pending_roots"]),
            replay_queue=int(data.get("replay_queue", 0)),
            copy_s=float(data.get("copy_s", 0.0)),
            write_s=data.get("write_s"),
            size_bytes=int(data.get("size_bytes", 0)),
            done_at=data.get("done_at"),
            completed_at=data.get("completed_at"),
            alignment_wait_s=data.get("alignment_wait_s"),
            commit_offsets=_commit_offsets_of(data.get("commit_offsets")),
            pruned=int(data.get("pruned", 0)),
            superseded=bool(data.get("superseded", False)),
        )
        checkpoint.snapshot_written = True
        return checkpoint


@dataclass(slots=True)
class _Query:
    """The checkpoints of one query."""

    next_id: int = 1
    open: dict[str, Checkpoint] = field(default_factory=dict)  # by position key, in id order
    recent: deque[Checkpoint] = field(default_factory=lambda: deque(maxlen=_RECENT))
    last_complete: Checkpoint | None = None
    completed: int = 0
    stored: deque[int] = field(default_factory=deque)  # ids with a stored record, ascending
    snapshots: deque[int] = field(default_factory=deque)  # ids with a stored snapshot, ascending
    written_through: int = 0  # the highest id whose snapshot this process wrote


class CheckpointCoordinator:
    """Begins, completes and stores the checkpoints of every query of one FT layer."""

    def __init__(
        self,
        ft: FTLayer,
        *,
        retain: int = 3,
        snapshots: PersistenceStorage | None = None,
        lock: contextlib.AbstractContextManager[Any] | None = None,
    ) -> None:
        if isinstance(retain, bool) or retain < 1:
            raise ConfigError(f"retain needs at least 1 checkpoint, got {retain!r}")
        self.ft = ft
        self._core_lock = contextlib.nullcontext() if lock is None else lock
        """Serializes this coordinator with the core (reentrant if the caller of
        write_pending may hold it)."""
        self._uncopied: list[Checkpoint] = []
        ft.add_change_hook(self.copy_pending)
        self.retain = retain
        self.snapshots = ft.storage if snapshots is None else snapshots
        """Where snapshots go (meta entries): the FT layer's storage, or a store of
        their own, so their writes do not queue behind the records' transactions."""
        self._queries: dict[str, _Query] = {}
        self._writes: deque[tuple[Checkpoint, dict[str, NDArray[Any]]]] = deque()
        self._record_writes: deque[tuple[dict[str, bytes], list[str]]] = deque()
        self._write_lock = threading.Lock()
        self._failed_writes = 0  # consecutive failed write rounds
        self._failure_logged_at = 0.0  # monotonic
        self._load()

    # ---- begin -----------------------------------------------------------------

    def begin(
        self,
        query: str,
        position: Mapping[str, Any],
        sources: Sequence[int],
        mode: CheckpointMode,
        now: float | None = None,
    ) -> Checkpoint:
        """Barrier `position` of `query`: the state is owed a snapshot, copied before
        its next change (`copy_pending`) and then queued for writing. Idempotent: a
        position already begun (Spark plans a batch again after a restart) returns its
        checkpoint. Either way the sources' batch is running from now
        (FTLayer.batch_began: the timeouts of its trees follow its heartbeats)."""
        checkpoint = self._begin(check_query(query), check_position(position), sources, mode, now)
        self.ft.batch_began(sources)
        return checkpoint

    def _begin(
        self,
        query: str,
        position: Position,
        sources: Sequence[int],
        mode: CheckpointMode,
        now: float | None,
    ) -> Checkpoint:
        """`begin` of a checked query and position."""
        q = self._queries.setdefault(query, _Query())
        key = position.key()
        found = q.open.get(key) or self._find_recent(q, key)
        if found is not None:
            return found
        checkpoint = Checkpoint(
            query=query,
            id=q.next_id,
            mode=mode,
            position=position,
            key=key,
            sources=tuple(sorted({int(s) for s in sources})),
            begun_at=time.time() if now is None else now,
            pending_roots=len(self.ft),
            replay_queue=self.ft.queued_replays,
        )
        q.next_id += 1
        q.open[key] = checkpoint
        if len(q.open) > _MAX_OPEN:
            oldest = next(iter(q.open))
            dropped = q.open.pop(oldest)
            log.warning(
                "query %r has more than %d open checkpoints: checkpoint %d (%s) will never "
                "be reported complete; later ones still can",
                query,
                _MAX_OPEN,
                dropped.id,
                dropped.state.value,
                extra=fields(query=query, checkpoint=dropped.id),
            )
        self._uncopied.append(checkpoint)
        return checkpoint

    @property
    def has_writes(self) -> bool:
        """Whether a snapshot is owed or waits to be written (`write_pending`)."""
        return bool(self._uncopied or self._writes or self._record_writes)

    def copy_pending(self) -> None:
        """Copy the state for the checkpoints begun since the last copy (one copy
        serves them all: nothing changed in between) and queue it for writing. Runs
        before every change to the core (its change hook) and in `write_pending`;
        the caller holds the core's lock."""
        if not self._uncopied:
            return
        began = time.perf_counter()
        state = self.ft.state_snapshot()
        copy_s = round(time.perf_counter() - began, 6)
        for checkpoint in self._uncopied:
            checkpoint.copy_s = copy_s
            self._writes.append((checkpoint, state))
        self._uncopied.clear()

    # ---- done (Spark finished the batch) -------------------------------------------

    def done(
        self,
        query: str,
        position: Mapping[str, Any],
        sources: Sequence[int],
        mode: CheckpointMode,
        now: float | None = None,
    ) -> Checkpoint:
        """Spark reports the batch that ends at `position` done: prune the replay
        entries it took in and complete the checkpoint (unaligned) or start aligning
        (aligned). A position never begun (the FT layer restarted in between) is begun
        now. Returns the checkpoint; its `commit_offsets` are the group offsets the
        source may commit now: this checkpoint's, or for an aligning one the newest
        completed checkpoint's (None if there is none)."""
        now = time.time() if now is None else now
        barrier = check_position(position)
        # The query's batch is done and the next one has not started (Spark runs one
        # at a time): the barrier holds of its barrier-mode sources are released,
        # whatever the checkpoint's state (ftlayer.core.barrier); its trees' timeouts
        # are no longer postponed (ftlayer.core.leases).
        self.ft.release_barrier(sources)
        self.ft.batch_done(sources)
        checkpoint = self._begin(check_query(query), barrier, sources, mode, now)
        q = self._queries[query]
        if checkpoint.state is not CheckpointState.BEGUN:
            return self._answer(q, checkpoint)
        # Spark commits batches in order: the batches before this one are done too,
        # also if their own commit never reached the FT layer.
        for earlier in q.open.values():
            if earlier.id <= checkpoint.id and earlier.state is CheckpointState.BEGUN:
                earlier.done_at = now
                earlier.state = CheckpointState.ALIGNING
        replay = barrier.replay or 0
        if replay:
            checkpoint.pruned = sum(self.ft.prune_replay(replay, s) for s in checkpoint.sources)
        self._align(query, q, now)
        return self._answer(q, checkpoint)

    def poll(self, now: float | None = None) -> int:
        """Complete the aligning checkpoints whose roots are done (the server calls
        this on every tick); returns how many completed."""
        now = time.time() if now is None else now
        done = 0
        for query, q in self._queries.items():
            if any(c.state is CheckpointState.ALIGNING for c in q.open.values()):
                done += self._align(query, q, now)
        return done

    def _align(self, query: str, q: _Query, now: float) -> int:
        """Complete, in order, the open checkpoints that can complete."""
        lowest: dict[str, dict[int, int]] | None = None
        done = 0
        for key, checkpoint in list(q.open.items()):
            if checkpoint.state is not CheckpointState.ALIGNING:
                break  # a later checkpoint completes only after the earlier ones
            if not (
                checkpoint.snapshot_written
                or (checkpoint.superseded and q.written_through > checkpoint.id)
            ):
                break  # its snapshot is still being written: the next poll sees it
            if lowest is None:
                topics = list(checkpoint.position.kafka)
                lowest = self.ft.lowest_pending_offsets(topics)
            kafka = checkpoint.position.kafka
            if checkpoint.mode is CheckpointMode.ALIGNED:
                if not _nothing_pending_before(kafka, lowest):
                    break
                offsets = checkpoint.position.offsets()
            else:
                offsets = _capped(kafka, lowest)
            checkpoint.state = CheckpointState.COMPLETE
            checkpoint.completed_at = now
            checkpoint.alignment_wait_s = round(now - (checkpoint.done_at or now), 6)
            checkpoint.commit_offsets = offsets
            del q.open[key]
            q.recent.append(checkpoint)
            q.last_complete = checkpoint
            q.completed += 1
            done += 1
            self._store_record(query, q, checkpoint)
        return done

    def _answer(self, q: _Query, checkpoint: Checkpoint) -> Checkpoint:
        if checkpoint.state is CheckpointState.COMPLETE or q.last_complete is None:
            return checkpoint
        # Aligning: the group may move to the newest completed checkpoint's offsets.
        return dataclasses.replace(checkpoint, commit_offsets=q.last_complete.commit_offsets)

    # ---- storage ---------------------------------------------------------------

    def write_pending(self) -> int:
        """Write the queued snapshots to `snapshots` in one transaction and drop those
        past `retain`, with the records of checkpoints completed since (see
        `_store_record`); returns how many snapshots were written. Takes the snapshot
        still owed first (under `lock`); the write runs outside it, in queue order. A
        failed write is logged and kept for the next call, each query's older snapshots
        superseded by its newest (module docstring, "A failed write")."""
        with self._core_lock:
            self.copy_pending()
        with self._write_lock:
            items: list[tuple[Checkpoint, dict[str, NDArray[Any]]]] = []
            while self._writes:
                items.append(self._writes.popleft())
            records: dict[str, bytes] = {}
            dropped: list[str] = []
            while self._record_writes:
                puts, expired = self._record_writes.popleft()
                records.update(puts)
                dropped.extend(expired)
            if not items and not records:
                return 0
            began = time.perf_counter()
            snapshots: dict[str, MetaValue] = {}
            newest: tuple[int, bytes | bytearray] | None = None  # the journal's next base
            for checkpoint, state in items:
                snapshot = encode_snapshot(state)
                snapshots[_entry_key(SNAPSHOT_PREFIX, checkpoint.query, checkpoint.id)] = snapshot
                checkpoint.size_bytes = len(snapshot)
                if "journal.segment" in state:
                    segment = int(state["journal.segment"][0])
                    if newest is None or segment > newest[0]:
                        newest = (segment, snapshot)
            stored, expired = self._expire_snapshots(items)
            try:
                if self.snapshots is not self.ft.storage:
                    # The store of snapshots keeps the records too: committed now, without
                    # an fsync, they survive the process being killed before the FT
                    # layer's store commits its staged copy.
                    snapshots.update(records)
                    expired.extend(key for key in dropped if key not in records)
                self.snapshots.update_meta(snapshots, expired)
            except Exception as exc:
                self._keep_for_retry(items, records, dropped, exc)
                return 0
            write_s = round(time.perf_counter() - began, 6)
            for query, ids in stored.items():
                q = self._queries[query]
                q.snapshots = ids
                q.written_through = max(q.written_through, ids[-1])
            for checkpoint, _state in items:
                checkpoint.write_s = write_s
                checkpoint.snapshot_written = True
            if newest is not None:
                self._write_journal_base(*newest)
            if self._failed_writes:
                log.info(
                    "checkpoint snapshots written after %d failed attempts", self._failed_writes
                )
                self._failed_writes = 0
            return len(items)

    def _write_journal_base(self, segment: int, snapshot: bytes | bytearray) -> None:
        """The snapshot just written is also the acker journal's base: write it there and
        truncate the journal (ftlayer.core.journal). A failure only leaves the journal
        longer: the next snapshot tries again."""
        journal = self.ft.journal
        if journal is None:
            return
        try:
            journal.write_base(segment, bytes(snapshot))
        except OSError as exc:
            log.error(
                "could not write the journal base %d (the journal is not truncated "
                "until a later one is written): %s",
                segment,
                exc,
            )

    def _keep_for_retry(
        self,
        items: Sequence[tuple[Checkpoint, dict[str, NDArray[Any]]]],
        records: dict[str, bytes],
        dropped: list[str],
        exc: Exception,
    ) -> None:
        """Steps 1 and 2 of "A failed write" (module docstring): requeue the records and
        each query's newest snapshot ahead of what was queued since; supersede the
        older snapshots. Logs the first failure of a run and then one line a minute."""
        if records or dropped:
            self._record_writes.appendleft((records, dropped))
        newest: dict[str, tuple[Checkpoint, dict[str, NDArray[Any]]]] = {}
        for item in items:  # id order per query
            older = newest.get(item[0].query)
            if older is not None:
                older[0].superseded = True
            newest[item[0].query] = item
        kept = {id(item) for item in newest.values()}
        for item in reversed(items):  # ahead of the snapshots queued since, in order
            if id(item) in kept:
                self._writes.appendleft(item)
        self._failed_writes += 1
        now = time.monotonic()
        if self._failed_writes == 1 or now - self._failure_logged_at >= _FAILURE_LOG_S:
            self._failure_logged_at = now
            log.error(
                "could not write %d checkpoint snapshots (queries %s) and %d checkpoint "
                "records (attempt %d): %s; retried with the next write, and until one "
                "succeeds no checkpoint completes and group offsets hold",
                len(items),
                sorted(newest),
                len(records),
                self._failed_writes,
                exc,
                extra=fields(queries=sorted(newest), count=len(items), attempt=self._failed_writes),
            )

    def _store_record(self, query: str, q: _Query, checkpoint: Checkpoint) -> None:
        """Stage a completed checkpoint's record in the FT layer's store (committed
        with its next write, see PersistenceStorage.stage_meta) and drop the records
        past `retain`. A failure is logged: the record is bookkeeping, no record of
        data depends on it."""
        q.stored.append(checkpoint.id)
        expired: list[str] = []
        while len(q.stored) > self.retain:
            expired.append(_entry_key(CHECKPOINT_PREFIX, query, q.stored.popleft()))
        key = _entry_key(CHECKPOINT_PREFIX, query, checkpoint.id)
        record = json.dumps(checkpoint.to_json(), sort_keys=True).encode()
        try:
            self.ft.storage.stage_meta({key: record}, expired)
        except Exception as exc:
            log.error(
                "could not store the record of checkpoint %s: %s",
                key,
                exc,
                extra=fields(query=query, checkpoint=checkpoint.id),
            )
        self._record_writes.append(({key: record}, expired))

    def _expire_snapshots(
        self, items: Sequence[tuple[Checkpoint, Any]]
    ) -> tuple[dict[str, deque[int]], list[str]]:
        """The snapshot ids each query of `items` keeps once they are stored, and the
        keys of those past `retain` (tracked in memory: no read of the store per
        write). The caller adopts the ids only if the write succeeds, so a retried
        snapshot is counted once."""
        stored: dict[str, deque[int]] = {}
        expired: list[str] = []
        for checkpoint, _state in items:
            query = checkpoint.query
            ids = stored.setdefault(query, deque(self._queries[query].snapshots))
            ids.append(checkpoint.id)
            while len(ids) > self.retain:
                expired.append(_entry_key(SNAPSHOT_PREFIX, query, ids.popleft()))
        return stored, expired

    def _load(self) -> None:
        """Pick up each query's stored checkpoint records (after a restart), from the
        FT layer's store and the store of snapshots (which has the newest if the
        process was killed before the FT layer's store committed it)."""
        self._load_snapshot_ids()
        found: dict[str, bytes] = {}
        for store in (self.ft.storage, self.snapshots):
            for key in store.meta_keys(CHECKPOINT_PREFIX):
                raw = store.get_meta(key)
                if raw is not None:
                    found.setdefault(key, raw)
        for key in sorted(found):
            raw = found[key]
            try:
                checkpoint = Checkpoint.from_json(json.loads(raw.decode()))
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("ignoring unreadable checkpoint record %r: %s", key, exc)
                continue
            q = self._queries.setdefault(checkpoint.query, _Query())
            q.next_id = max(q.next_id, checkpoint.id + 1)
            q.stored.append(checkpoint.id)  # meta_keys come in key order: id order
            if checkpoint.state is CheckpointState.COMPLETE:
                q.recent.append(checkpoint)
                if q.last_complete is None or checkpoint.id > q.last_complete.id:
                    q.last_complete = checkpoint

    def _load_snapshot_ids(self) -> None:
        for key in self.snapshots.meta_keys(SNAPSHOT_PREFIX):
            query, _, number = key[len(SNAPSHOT_PREFIX) :].rpartition("/")
            if query and number.isdigit():  # key order: id order per query
                self._queries.setdefault(query, _Query()).snapshots.append(int(number))

    def _find_recent(self, q: _Query, key: str) -> Checkpoint | None:
        for checkpoint in reversed(q.recent):
            if checkpoint.key == key:
                return checkpoint
        return None

    # ---- status ----------------------------------------------------------------

    def last_complete(self, query: str) -> Checkpoint | None:
        q = self._queries.get(query)
        return None if q is None else q.last_complete

    def status(self) -> dict[str, Any]:
        """Per query: counts, the open checkpoints and the recent completed ones."""
        result: dict[str, Any] = {}
        for query, q in sorted(self._queries.items()):
            result[query] = {
                "completed": q.completed,
                "open": [c.to_json() for c in q.open.values()],
                "recent": [c.to_json() for c in q.recent],
                "last_complete_id": None if q.last_complete is None else q.last_complete.id,
            }
        return result


# ---- snapshots ----------------------------------------------------------------------


def _entry_key(prefix: str, query: str, checkpoint_id: int) -> str:
    """The meta key of a checkpoint's record or snapshot: `<prefix><query>/<id>`."""
    return f"{prefix}{query}/{checkpoint_id:012d}"


# ---- positions ----------------------------------------------------------------------


def check_query(query: object) -> str:
    if (
        not isinstance(query, str)
        or not 0 < len(query) <= MAX_QUERY_CHARS
        or not _QUERY_OK.match(query)
    ):
        raise ConfigError(
            f"a checkpoint query name is 1 to {MAX_QUERY_CHARS} characters without '/' "
            f"or control characters, got {query!r}"
        )
    return query


def check_position(position: object) -> Position:
    """A barrier position (the JSON form of ftlayer.position, "replay" included);
    PositionError (a ConfigError) naming the problem otherwise."""
    return Position.parse(position, need_replay=True, what="checkpoint")


def _nothing_pending_before(
    kafka: Mapping[str, Mapping[int, int]], lowest: Mapping[str, Mapping[int, int]]
) -> bool:
    """No pending root has an offset below the barrier in a partition it covers."""
    for topic, partitions in kafka.items():
        pending = lowest.get(topic, {})
        for p, barrier in partitions.items():
            if p in pending and pending[p] < barrier:
                return False
    return True


def _capped(
    kafka: Mapping[str, Mapping[int, int]], lowest: Mapping[str, Mapping[int, int]]
) -> dict[str, dict[int, int]]:
    """min(barrier, lowest pending offset) per partition."""
    return {
        topic: {p: min(o, lowest.get(topic, {}).get(p, o)) for p, o in partitions.items()}
        for topic, partitions in kafka.items()
    }


def _commit_offsets_of(data: object) -> KafkaOffsets | None:
    return None if data is None else offsets_from_json(data)
