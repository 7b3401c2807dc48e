"""Barrier checkpoints of the FT layer, coordinated with Spark's micro-batches.

Every micro-batch boundary is a barrier. Barrier n is batch n's end position S_n: the
Kafka offsets per topic and partition and the replay cursor, which Spark writes to its
offset log before the batch runs. The `ftkafka` source announces it when Spark plans
the batch (CHECKPOINT_BEGIN) and reports the batch done through its commit(end), one
batch late (CHECKPOINT_DONE). A checkpoint belongs to a *query*: the ftkafka
source name (`ft.sourceName`, by default its topics).

Begin: the barrier opens the batch of the query's sources (`FTLayer.batch_began`), and
its completion closes it (`FTLayer.batch_done`): while it is open and its driver
heartbeats, its trees do not time out (ftlayer.core.leases). If the acker journal is
due a new base at the barrier (ftlayer.core.recovery.journal_base_due: it has grown by
about a base's size since the last one, or a write to it failed), the barrier also
owes the journal that base: a copy of the FT state, pending roots with their ack
values and record seqs, the replay queue, the retry counts, the open holds
(`FTLayer.state_snapshot`), array copies under the core's lock, O(pending), with no
storage access. The copy is lazy: the barrier only marks the state as owed, and the
copy is taken before the next change to it (`FTLayer.add_change_hook`) or by the
writer, whichever comes first, so it is the state at the barrier and the reply to
CHECKPOINT_BEGIN does not wait for it. Taking it starts the journal's next segment k,
so base k and segments k, k+1, ... are the state from then on (ftlayer.core.journal).
Writing it (`Journal.write_base`, which then deletes the older segments and bases)
happens afterwards and elsewhere (the server's checkpoint writer thread), so event
processing does not wait for it. One copy serves every barrier, of any query, begun
before the next change. A barrier with no base due copies and writes nothing.

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

A checkpoint that owed a base completes, besides, only once that base or a later one
is written; a checkpoint with no base due waits for nothing more. Checkpoints of a
query complete in order.

Durability, and why completion waits for a due base. The FT state survives a killed
process without any base: every record that is not complete is in the FT layer's
store (LMDB, fsync'ed when persisted), and what happens to the ack values, holds and
the replay queue is in the journal's segments, one os.write per request as it is
applied (the kernel keeps it when the process dies; an OS crash makes the journal
untrusted, and then every stored record is replayed). A base only lets the journal
drop what came before it, and `Journal.write_base` deletes the older segments only
once base k is whole on disk (written to a temporary file and renamed). So a base not
written yet, or whose write failed, loses nothing: recovery (`Journal.recover`,
`FTLayer`'s start) reads the last base written and the longer run of segments after it,
which is the same state; it costs disk and recovery time, no record and no ack value.
Group offsets never depend on a base either: they come from the roots pending at
completion, whose records are in LMDB. Completion waits for a due base, although
durability does not need it, so that a completed checkpoint says something an
operator can rely on: recovery after it starts from its barrier's base or a later one,
and its figures (copy, write, size) are final. In steady state the wait costs nothing
(the writer writes the base right after the reply to BEGIN; Spark reports the batch
done a batch later); while base writes fail, it holds group offsets (below).

Records: the record of each completed checkpoint ("checkpoint/<query>/<id>", JSON:
position, figures, group offsets) goes to the FT layer's own store for the newest
`retain` completed checkpoints of its query, so a restarted FT layer goes on numbering
and knows each query's last completed position (savepoints read it:
ftlayer.checkpoint.savepoint). Records are staged (PersistenceStorage.stage_meta): they
commit with the store's next write (a persist, the deletes of completed records) or
the server's next tick, never with an fsync of their own. With a store of records of
its own (`record_store`: the server's `<data dir>/checkpoints`, an LMDB environment
without fsync), the writer also commits them there right away, so a killed process
loses none; an OS crash may lose the newest, which only makes the restarted FT layer
know an older position (a savepoint starts further back: duplicates, no loss).
Either store may also hold "snapshot/<query>/<id>" entries (SNAPSHOT_PREFIX), copies
of the state per query that nothing reads: the coordinator deletes them when it
starts (once: it writes none) and goes on if that fails.

A failed write stalls no event. `write_pending` writes the due base and the records
apart (a journal file, an LMDB transaction); what fails is kept for the next call
(the server's writer tries again on its next round, which an idle stream has too, and
with every barrier):

1. Records: a failed write puts them back at the front of the queue, and the next
   write stores them. It holds no checkpoint: records are bookkeeping.
2. Base: a failed write leaves base k absent (never half written) and the journal as
   long as it was; the copy is kept and retried, until a later barrier copies a newer
   base. The older copy is then dropped and its checkpoints *superseded*: they
   complete (by their mode, in order) once the newer base is written, since it is the
   state at a later moment and the journal after it holds everything since. Keeping
   one copy bounds the memory of a journal that keeps failing: one copy of the state,
   not one per barrier.
3. While base writes fail, the checkpoints that owed a base (and the later ones of
   their queries) stay open and group offsets hold at the newest completed
   checkpoint's; the write that succeeds completes the backlog at once (the writer
   polls after it). The FT layer's own store keeps a staged record staged when its
   commit fails, so its next write carries it.

Not thread-safe: the caller serializes begin, done and poll with the core they
belong to (`lock`, which `write_pending` takes for the copy it owes; the server's
lock); `write_pending` may run in another thread (Journal.write_base and LmdbStorage
are safe to call outside the core's lock).
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
from ftlayer.persistence.base import PersistenceStorage
from ftlayer.position import (
    KafkaOffsets,
    Position,
    offsets_from_json,
    offsets_to_json,
)

log = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "checkpoint/"
SNAPSHOT_PREFIX = "snapshot/"
"""Meta keys of per-query state copies a data dir may hold: nothing reads them, and the
coordinator deletes them when it starts."""
CHECKPOINT_STORE_DIR = "checkpoints"
"""The LMDB environment inside a server's data dir that takes the checkpoint records at
once, without fsync (`CheckpointCoordinator(record_store=...)`)."""
MAX_QUERY_CHARS = 200
_QUERY_OK = re.compile(r"^[^\x00-\x1f\x7f-\x9f/]+$")
_RECENT = 20  # checkpoint records kept in memory per query, for status
_MAX_OPEN = 1000  # open (begun or aligning) checkpoints per query before the oldest go
_FAILURE_LOG_S = 60.0  # while writes of one kind keep failing, one error line per this


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
    """Time the copy of the journal base due at its barrier held the core (the only part
    that stops events); 0 if none was due."""
    write_s: float | None = None
    """Time writing that base (or the later one that superseded it) took: None until
    written, 0 if none was due."""
    size_bytes: int = 0
    """That base's size in bytes; 0 if none was due."""
    done_at: float | None = None
    completed_at: float | None = None
    alignment_wait_s: float | None = None
    commit_offsets: KafkaOffsets | None = None
    """The consumer-group offsets this checkpoint allows (set at completion)."""
    pruned: int = 0
    superseded: bool = False
    """The base copied at its barrier could not be written and a later one replaced it:
    it completes once that one is written."""
    owes_base: bool = False
    """A journal base was due at its barrier: it completes once that base (or a later
    one) is written."""
    journal_base: int | None = None
    """The number of that base, once copied (ftlayer.core.journal: base k)."""
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
        return cls(
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


@dataclass(slots=True)
class _Query:
    """The checkpoints of one query."""

    next_id: int = 1
    open: dict[str, Checkpoint] = field(default_factory=dict)  # by position key, in id order
    recent: deque[Checkpoint] = field(default_factory=lambda: deque(maxlen=_RECENT))
    last_complete: Checkpoint | None = None
    completed: int = 0
    stored: deque[int] = field(default_factory=deque)  # ids with a stored record, ascending


@dataclass(slots=True)
class _Base:
    """A journal base copied and not written yet, and the checkpoints it serves."""

    segment: int
    state: dict[str, NDArray[Any]]
    checkpoints: list[Checkpoint]
    blob: bytes | None = None  # encoded by the first attempt to write it


@dataclass(slots=True)
class _Failures:
    """Consecutive failed writes of one kind: logged at the first, then once a minute."""

    what: str
    count: int = 0
    logged_at: float = 0.0  # monotonic

    def failed(self, exc: BaseException, detail: str, **extra: Any) -> None:
        self.count += 1
        now = time.monotonic()
        if self.count == 1 or now - self.logged_at >= _FAILURE_LOG_S:
            self.logged_at = now
            log.error(
                "could not write %s (%s, attempt %d): %s; retried with the next write",
                self.what,
                detail,
                self.count,
                exc,
                extra=fields(attempt=self.count, **extra),
            )

    def succeeded(self) -> None:
        if self.count:
            log.info("%s written after %d failed attempts", self.what, self.count)
            self.count = 0


class CheckpointCoordinator:
    """Begins, completes and stores the checkpoints of every query of one FT layer, and
    writes the journal bases due at their barriers."""

    def __init__(
        self,
        ft: FTLayer,
        *,
        retain: int = 3,
        record_store: PersistenceStorage | None = None,
        lock: contextlib.AbstractContextManager[Any] | None = None,
    ) -> None:
        if isinstance(retain, bool) or retain < 1:
            raise ConfigError(f"retain needs at least 1 checkpoint, got {retain!r}")
        self.ft = ft
        self._core_lock = contextlib.nullcontext() if lock is None else lock
        """Serializes this coordinator with the core (reentrant if the caller of
        write_pending may hold it)."""
        self.retain = retain
        """Completed checkpoints whose record each query keeps."""
        self.record_store = ft.storage if record_store is None else record_store
        """The store that takes the checkpoint records at once (module docstring,
        "Records"): the FT layer's storage, or a store of its own."""
        self._owed: list[Checkpoint] = []  # begun with a base due, not copied yet
        self._base: _Base | None = None  # copied, not written yet (at most one)
        self._base_lock = threading.Lock()  # guards _base between copy and writer
        self._written_base = 0  # the highest base number this coordinator wrote
        self._queries: dict[str, _Query] = {}
        self._record_writes: deque[tuple[dict[str, bytes], list[str]]] = deque()
        self._write_lock = threading.Lock()
        self._base_failures = _Failures("the acker journal's base")
        self._record_failures = _Failures("checkpoint records")
        ft.add_change_hook(self.copy_pending)
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
        """Barrier `position` of `query`: if the journal is due a base, the state is
        owed a copy, taken before its next change (`copy_pending`) and then queued for
        writing. Idempotent: a position already begun (Spark plans a batch again after
        a restart) returns its checkpoint. Either way the sources' batch is running
        from now (FTLayer.batch_began: the timeouts of its trees follow its
        heartbeats)."""
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
        # A base copy owed but not taken yet is still the state now: it is due again.
        owes_base = bool(self._owed) or self._base_due()
        checkpoint = Checkpoint(
            query=query,
            id=q.next_id,
            mode=mode,
            position=position,
            key=key,
            sources=tuple(sorted({int(s) for s in sources})),
            begun_at=time.time() if now is None else now,
            pending_roots=self.ft.pending,
            replay_queue=self.ft.queued_replays,
            write_s=None if owes_base else 0.0,
            owes_base=owes_base,
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
        if owes_base:
            self._owed.append(checkpoint)
        return checkpoint

    def _base_due(self) -> bool:
        """Whether the journal is due a base now (FTLayer.journal_base_due)."""
        return self.ft.journal_base_due()

    @property
    def has_writes(self) -> bool:
        """Whether a base is owed or waits to be written, or records wait to be
        (`write_pending`)."""
        return bool(self._owed or self._base is not None or self._record_writes)

    def copy_pending(self) -> None:
        """Copy the state owed to the journal as its next base, for the checkpoints
        begun since the last copy (one copy serves them all: nothing changed in
        between), and queue it for writing; a base copied before and still unwritten
        is superseded by it. Runs before every change to the core (its change hook)
        and in `write_pending`; the caller holds the core's lock."""
        if not self._owed:
            return
        began = time.perf_counter()
        state = self.ft.state_snapshot(journal_base=True)
        copy_s = round(time.perf_counter() - began, 6)
        base = _Base(int(state["journal.segment"][0]), state, self._owed)
        self._owed = []
        for checkpoint in base.checkpoints:
            checkpoint.copy_s = copy_s
            checkpoint.journal_base = base.segment
        with self._base_lock:
            older, self._base = self._base, base
            if older is not None:
                _supersede(older, base)

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
        self.ft.complete_ranges(sources, barrier.kafka)
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

    @property
    def aligning(self) -> bool:
        """Whether a checkpoint is aligning: `poll` may complete it."""
        return any(
            checkpoint.state is CheckpointState.ALIGNING
            for q in self._queries.values()
            for checkpoint in q.open.values()
        )

    def poll(self, now: float | None = None) -> int:
        """Complete the aligning checkpoints whose roots are done and whose due base is
        written (the server calls this on every tick and after a write); returns how
        many completed."""
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
            if checkpoint.owes_base and (
                checkpoint.journal_base is None or checkpoint.journal_base > self._written_base
            ):
                break  # its base is still being written: the poll after the write sees it
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
        """Write the journal base owed or queued, and commit the records of the
        checkpoints completed since to `record_store` (one transaction); returns how many
        were written (the base counts one, each record one). Takes the copy still owed
        first (under `lock`); the writes run outside it. What fails is logged and kept
        for the next call (module docstring, "A failed write")."""
        with self._core_lock:
            self.copy_pending()
        with self._write_lock:
            return self._write_base() + self._write_records()

    def _write_base(self) -> int:
        """Step 2 of "A failed write": write the queued base, or keep it for the next
        call unless a newer one was queued meanwhile."""
        with self._base_lock:
            base, self._base = self._base, None
        journal = self.ft.journal
        if base is None or journal is None:
            return 0
        began = time.perf_counter()
        if base.blob is None:
            base.blob = bytes(encode_snapshot(base.state))
        try:
            journal.write_base(base.segment, base.blob)
        except OSError as exc:
            with self._base_lock:
                if self._base is None:
                    self._base = base
                else:  # a newer copy came meanwhile: it is written instead
                    _supersede(base, self._base)
            self._base_failures.failed(
                exc,
                f"base {base.segment}; the journal keeps its older base and segments, and "
                "checkpoints that owe a base do not complete until one is written",
                checkpoints=[c.id for c in base.checkpoints],
            )
            return 0
        write_s = round(time.perf_counter() - began, 6)
        for checkpoint in base.checkpoints:
            checkpoint.write_s = write_s
            checkpoint.size_bytes = len(base.blob)
        self._written_base = max(self._written_base, base.segment)
        self._base_failures.succeeded()
        return 1

    def _write_records(self) -> int:
        """Step 1 of "A failed write": commit the queued records to `record_store`, or put
        them back at the front of the queue."""
        records: dict[str, bytes] = {}
        dropped: list[str] = []
        while self._record_writes:
            puts, expired = self._record_writes.popleft()
            records.update(puts)
            dropped.extend(expired)
        if not records and not dropped:
            return 0
        try:
            self.record_store.update_meta(records, [k for k in dropped if k not in records])
        except Exception as exc:
            self._record_writes.appendleft((records, dropped))
            self._record_failures.failed(exc, f"{len(records)} of them; they hold nothing")
            return 0
        self._record_failures.succeeded()
        return len(records)

    def _store_record(self, query: str, q: _Query, checkpoint: Checkpoint) -> None:
        """Stage a completed checkpoint's record in the FT layer's store (committed
        with its next write, see PersistenceStorage.stage_meta) and drop the records
        past `retain`; queue it for `record_store` if that is a store of its own. A
        failure is logged: the record is bookkeeping, no record of data depends on
        it."""
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
        if self.record_store is not self.ft.storage:
            self._record_writes.append(({key: record}, expired))

    def _load(self) -> None:
        """Pick up each query's stored checkpoint records (after a restart), from the
        FT layer's store and `record_store` (which has the newest if the process was
        killed before the FT layer's store committed it); delete the state copies
        stored under SNAPSHOT_PREFIX."""
        found: dict[str, bytes] = {}
        stores = [self.ft.storage]
        if self.record_store is not self.ft.storage:
            stores.append(self.record_store)
        for store in stores:
            for key in store.meta_keys(CHECKPOINT_PREFIX):
                raw = store.get_meta(key)
                if raw is not None:
                    found.setdefault(key, raw)
            _delete_snapshots(store)
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


# ---- stored entries ----------------------------------------------------------------


def _entry_key(prefix: str, query: str, checkpoint_id: int) -> str:
    """The meta key of a checkpoint's record: `<prefix><query>/<id>`."""
    return f"{prefix}{query}/{checkpoint_id:012d}"


def _delete_snapshots(store: PersistenceStorage) -> None:
    """Delete the state copies a store holds under SNAPSHOT_PREFIX (nothing reads
    them). A failure is logged: they only take room, and the next start tries again."""
    keys = store.meta_keys(SNAPSHOT_PREFIX)
    if not keys:
        return
    try:
        store.update_meta({}, keys)
    except Exception as exc:
        log.warning("could not delete %d unused checkpoint snapshots: %s", len(keys), exc)
    else:
        log.info("deleted %d unused checkpoint snapshots (%s...)", len(keys), SNAPSHOT_PREFIX)


def _supersede(older: _Base, newer: _Base) -> None:
    """`older` will never be written: its checkpoints complete with `newer`, the state
    at a later moment (module docstring, "A failed write", step 2)."""
    for checkpoint in older.checkpoints:
        checkpoint.superseded = True
    newer.checkpoints.extend(older.checkpoints)


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
    PositionError naming the problem otherwise."""
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
