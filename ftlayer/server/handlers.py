"""The FT-layer server's request handlers, items 3, 7 and 8 of ftlayer.server's
contract: the table from request kind to handler (`_handlers`) and each handler, which
decodes its request, calls the core under the lock (`_core`) and encodes the reply.
PERSIST stores its records outside the lock, between FTLayer.begin_persist and
end_persist (item 3); CHECKPOINT_BEGIN and CHECKPOINT_DONE go to the checkpoint
coordinator (item 7); SAVEPOINT deletes the completed records under the lock and copies
the store outside it, one at a time (item 8). Also the reads of the HTTP port
(`observe`, `dead_letter_rows`), under the lock as STATUS.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any, Final

import numpy as np
from numpy.typing import NDArray

from ftlayer import __version__
from ftlayer.checkpoint import CheckpointMode
from ftlayer.checkpoint.fetch import read_spooled, release_spooled, spool_part
from ftlayer.checkpoint.savepoint import Savepoint, create_savepoint
from ftlayer.core import FTLayer
from ftlayer.core.retries import DeadLetterFilter, RetryRecord
from ftlayer.errors import ConfigError, StateConflict, StorageError
from ftlayer.records import ReplayRecords
from ftlayer.shards import foreign_roots, partition_shard
from ftlayer.wire import (
    BadRequest,
    CheckpointRequest,
    Frame,
    Kind,
    ParkedOp,
    SavepointRequest,
    decode_batch_begin,
    decode_batch_ranges,
    decode_checkpoint_begin,
    decode_checkpoint_done,
    decode_dead_letter_restore,
    decode_dead_letters,
    decode_fail,
    decode_fail_parked,
    decode_fetch_replay,
    decode_fill,
    decode_heartbeat,
    decode_hold,
    decode_ingest,
    decode_inspect,
    decode_parked,
    decode_persist,
    decode_range_read,
    decode_register_source,
    decode_savepoint,
    decode_savepoint_read,
    decode_sink_hold,
    decode_sink_mark,
    decode_sink_settle,
    decode_status_request,
    decode_unfilled,
    decode_xor,
    encode_batch_begun,
    encode_checkpoint_reply,
    encode_dead_letter_list,
    encode_inspect_reply,
    encode_mark,
    encode_ok,
    encode_parked_list,
    encode_range_numbers,
    encode_replay,
    encode_savepoint_bytes,
    encode_savepoint_created,
    encode_status_reply,
    encode_unfilled_list,
)

from .state import Handler, ServerState

if TYPE_CHECKING:  # the HTTP port's modules load only with an HTTP port
    from ftlayer.web import DeadLetterRows, Observation

log = logging.getLogger("ftlayer.server")

# A savepoint waits this long at most for a round the deleter took (item 8).
_DELETES_MAX_WAIT_S: Final = 60.0


class RequestHandlers(ServerState):
    """One handler per request kind: (request id, frame) -> the reply frame."""

    def _handlers(self) -> dict[Kind, Handler]:
        return {
            Kind.PERSIST: self._persist,
            Kind.XOR: self._xor,
            Kind.FAIL: self._fail,
            Kind.FETCH_REPLAY: self._fetch_replay,
            Kind.STATUS: self._status_request,
            Kind.REGISTER_SOURCE: self._register_source,
            Kind.CHECKPOINT_BEGIN: self._checkpoint_request,
            Kind.CHECKPOINT_DONE: self._checkpoint_request,
            Kind.SAVEPOINT: self._savepoint_request,
            Kind.SAVEPOINT_READ: self._savepoint_read,
            Kind.DEAD_LETTERS: self._dead_letters,
            Kind.DEAD_LETTER_RESTORE: self._dead_letter_restore,
            Kind.HOLD: self._hold,
            Kind.HEARTBEAT: self._heartbeat,
            Kind.SINK_HOLD: self._sink_hold,
            Kind.SINK_SETTLE: self._sink_settle,
            Kind.INSPECT: self._inspect,
            Kind.UNFILLED: self._unfilled,
            Kind.FILL: self._fill,
            Kind.BATCH_RANGES: self._batch_ranges,
            Kind.SINK_MARK: self._sink_mark,
            Kind.INGEST: self._ingest,
            Kind.FAIL_PARKED: self._fail_parked,
            Kind.PARKED: self._parked_request,
            Kind.RANGE_READ: self._range_read,
            Kind.BATCH_BEGIN: self._batch_begin,
        }

    def _persist(self, rid: int, frame: Frame) -> bytes:
        """Step 3 of the module docstring: checked and its roots reserved under the
        lock, stored (group commit) outside it, pending under it again; OK once all
        three are done."""
        message = decode_persist(frame)
        self._own_roots(message.batch.roots)
        self._own_partitions(message.batch.source_ids, message.batch.partitions)
        with self._core() as ft:
            ticket = ft.begin_persist(message.batch, message.initial_values)
        try:
            seqs = ft.write_persist(ticket)
        except BaseException:
            with self._lock:
                if self._ft is not None:
                    self._ft.abort_persist(ticket)
            raise
        # Stopping now leaves the records stored, and not pending: the restart replays
        # them (the client gets an error, not OK).
        with self._core() as ft:
            ft.end_persist(ticket, seqs)
        return encode_ok(rid, len(message.batch))

    def _xor(self, rid: int, frame: Frame) -> bytes:
        message = decode_xor(frame)
        self._own_roots(message.roots)
        with self._core() as ft:
            ft.xor(message.roots, message.values)
        return encode_ok(rid, len(message.roots))

    def _hold(self, rid: int, frame: Frame) -> bytes:
        message = decode_hold(frame)
        self._own_roots(message.roots)
        with self._core() as ft:
            return encode_ok(rid, ft.hold(message.roots, message.values))

    def _sink_hold(self, rid: int, frame: Frame) -> bytes:
        message = decode_sink_hold(frame)
        self._own_roots(message.roots)
        with self._core() as ft:
            return encode_ok(rid, ft.sink_hold(message.key, message.roots, message.values))

    def _sink_settle(self, rid: int, frame: Frame) -> bytes:
        message = decode_sink_settle(frame)
        with self._core() as ft:
            return encode_ok(rid, ft.sink_settle(message.key, message.cause))

    def _heartbeat(self, rid: int, frame: Frame) -> bytes:
        message = decode_heartbeat(frame)
        with self._core(noted=False) as ft:
            return encode_ok(rid, ft.heartbeat(message.source_ids, message.lease_ms / 1000))

    def _unfilled(self, rid: int, frame: Frame) -> bytes:
        message = decode_unfilled(frame)
        with self._core(noted=False) as ft:  # noted rows are listed as they are
            found = ft.unfilled(message.source_id, message.limit)
        return encode_unfilled_list(rid, found.seqs, found.records, max_frame=self.max_frame)

    def _fill(self, rid: int, frame: Frame) -> bytes:
        """The bytes are stored (one transaction, synced) before the OK: once the
        source has it, it may forget them."""
        message = decode_fill(frame)
        with self._core(noted=False) as ft:  # noted rows are applied with their bytes
            result = ft.fill(
                message.seqs, message.payloads, message.found, (message.key_hashes, message.has_key)
            )
        return encode_ok(rid, result.filled)

    def _batch_ranges(self, rid: int, frame: Frame) -> bytes:
        """The ranges are stored (one transaction, synced) before the reply: the source
        emits no row of them before it has their numbers."""
        message = decode_batch_ranges(frame)
        self._own_ranges(message.ranges)
        with self._core(noted=False) as ft:
            numbers = ft.register_ranges(message.ranges, tree=message.tree)
        return encode_range_numbers(rid, numbers)

    def _own_ranges(self, ranges: list[tuple[int, str, int, int, int]]) -> None:
        """A shard takes only ranges of its own partitions (docs/protocol.md 5.15)."""
        if ranges:
            self._own_partitions(
                np.array([r[0] for r in ranges], dtype=np.int64),
                np.array([r[2] for r in ranges], dtype=np.int64),
            )

    def _range_read(self, rid: int, frame: Frame) -> bytes:
        """A reader announces the seed of its rows' ids before it emits them (in
        memory: a restart makes the range's records pending again)."""
        m = decode_range_read(frame)
        self._own_roots(np.array([m.first], dtype=np.uint64))
        with self._core() as ft:
            started = ft.read_range(m.first, m.n, m.seed)
        return encode_ok(rid, started)

    def _fail(self, rid: int, frame: Frame) -> bytes:
        """Failures of fresh batch-range rows are noted (journaled) before the OK and
        applied with the batch's others (ftlayer.core.failnotes); any other FAIL is
        applied (synced) before it."""
        message = decode_fail(frame)
        self._own_roots(message.roots)
        with self._core(noted=False) as ft:
            return encode_ok(rid, ft.note_failures(message.roots, message.causes))

    def _fail_parked(self, rid: int, frame: Frame) -> bytes:
        """Another shard's FAIL, kept here (ftlayer.core.parked): committed before the
        OK, so the sender may go on once it has it."""
        entry = decode_fail_parked(frame)
        if self.shard.count == 1 or entry.owner == self.shard.index:
            raise ConfigError(
                f"a failure parked for shard {entry.owner} is for another shard of the "
                f"cluster, not for {self.shard}: send a shard's own FAIL to it"
            )
        if entry.owner >= self.shard.count:
            raise ConfigError(
                f"a failure parked for shard {entry.owner}, outside this cluster of "
                f"{self.shard.count} shards"
            )
        with self._core():
            assert self._parked is not None
            self._parked.park(entry)
        return encode_ok(rid, entry.roots)

    def _parked_request(self, rid: int, frame: Frame) -> bytes:
        """The driver's list of the failures parked here, or its drop of those it
        delivered."""
        message = decode_parked(frame)
        if self.shard.count == 1:
            raise ConfigError(
                "a server of a cluster of one keeps no parked failures: PARKED is for "
                "the shards of a cluster"
            )
        with self._core():
            parked = self._parked
            assert parked is not None
            if message.op == ParkedOp.DROP:
                return encode_ok(rid, parked.drop(message.seqs.tolist()))
            listed, more = parked.listed(message.limit)
        # No more than fit one frame (half of it): the rest at the next request.
        sizes = np.cumsum([len(e.body) + 96 for e in listed]) if listed else np.zeros(0)
        fit = int(np.searchsorted(sizes, self.max_frame // 2, side="right"))
        keep = max(1, fit) if listed else 0
        return encode_parked_list(
            rid, listed[:keep], more or keep < len(listed), max_frame=self.max_frame
        )

    def _own_roots(self, roots: NDArray[np.uint64]) -> None:
        """In a cluster of shards, an event for another shard's root is refused, naming
        the root (ftlayer.shards): its client routed it wrong."""
        if self.shard.count > 1 and (why := foreign_roots(roots, self.shard)) is not None:
            raise ConfigError(why)

    def _own_partitions(self, source_ids: NDArray[Any], partitions: NDArray[Any]) -> None:
        """In a cluster of shards, records or ranges of a partition another shard owns
        are refused, naming it."""
        count = self.shard.count
        if count == 1 or not len(partitions):
            return
        owners = partition_shard(source_ids, partitions, count)
        wrong = np.flatnonzero(owners != self.shard.index)
        if len(wrong):
            i = int(wrong[0])
            raise ConfigError(
                f"partition {int(partitions[i])} of source {int(source_ids[i])} belongs to "
                f"shard {int(owners[i])}, not to {self.shard}: send its records and ranges "
                "to the shard that owns the partition"
            )

    def _fetch_replay(self, rid: int, frame: Frame) -> bytes:
        m = decode_fetch_replay(frame)
        with self._core(noted=False) as ft:  # noted rows are queued only once filled
            replay = ft.fetch_replay(m.lo, m.hi, source_id=m.source_id, partition=m.partition)
        page, through = _page(replay, m.hi, self.max_frame)
        return encode_replay(rid, page, through=through, max_frame=self.max_frame)

    def _ingest(self, rid: int, frame: Frame) -> bytes:
        m = decode_ingest(frame)
        with self._core() as ft:
            taken = ft.ingest(m.batch).taken
        return encode_ok(rid, taken)

    def _sink_mark(self, rid: int, frame: Frame) -> bytes:
        m = decode_sink_mark(frame)
        with self._core() as ft:
            mark, first = ft.sink_mark(m.sink, m.batch, m.mark)
        return encode_mark(rid, mark, first)

    def _status_request(self, rid: int, frame: Frame) -> bytes:
        request = decode_status_request(frame)
        with self._core(noted=not request.brief) as ft:  # brief: noted rows count unfilled
            if request.brief:
                _release_for_source(ft)
            status = self._brief_status(ft) if request.brief else self._status(ft)
        return encode_status_reply(rid, status, max_frame=self.max_frame)

    def _register_source(self, rid: int, frame: Frame) -> bytes:
        m = decode_register_source(frame)
        with self._core() as ft:
            ft.register_source(m.registration)
        return encode_ok(rid, 1)

    def _dead_letters(self, rid: int, frame: Frame) -> bytes:
        m = decode_dead_letters(frame)
        try:
            where = DeadLetterFilter.from_json(m.where)
        except ValueError as exc:
            raise BadRequest(f"DEAD_LETTERS: {exc}") from None
        with self._core() as ft:
            if m.op == "requeue":
                return encode_ok(rid, ft.requeue_dead_letters(where))
            if m.op in ("purge", "delivered"):
                return encode_ok(rid, ft.purge_dead_letters(where, delivered=m.op == "delivered"))
            # One more than asked, to know whether more match; never more than a reply
            # can carry, whatever the store holds.
            limit = min(m.limit or _MAX_LISTED_DEAD_LETTERS, _MAX_LISTED_DEAD_LETTERS) + 1
            letters, records = ft.dead_letters(where, limit)
        # At most `limit` of them, and no more than fit one frame (half of it for the
        # payloads leaves room for the JSON); "more" tells the caller to ask again.
        sizes = np.cumsum([len(p) + _DEAD_LETTER_ROW_BYTES for p in records.payloads])
        fit = int(np.searchsorted(sizes, self.max_frame // 2, side="right"))
        keep = min(len(letters), fit if m.limit is None else min(fit, m.limit))
        more = keep < len(letters)
        listed = [{"seq": seq, **record.to_json()} for seq, record in letters[:keep]]
        taken = records.take(np.arange(keep, dtype=np.intp))
        return encode_dead_letter_list(rid, listed, taken, more, max_frame=self.max_frame)

    def _inspect(self, rid: int, frame: Frame) -> bytes:
        query = decode_inspect(frame)
        with self._core() as ft:
            found = ft.inspect(query)
        return encode_inspect_reply(rid, found, max_frame=self.max_frame)

    def _dead_letter_restore(self, rid: int, frame: Frame) -> bytes:
        m = decode_dead_letter_restore(frame)
        try:
            history = [RetryRecord.from_json(letter) for letter in m.letters]
        except (ValueError, TypeError) as exc:
            raise BadRequest(f"DEAD_LETTER_RESTORE: {exc}") from None
        with self._core() as ft:
            return encode_ok(rid, ft.restore_dead_letters(m.records, history))

    def _checkpoint_request(self, rid: int, frame: Frame) -> bytes:
        begin = frame.kind == Kind.CHECKPOINT_BEGIN
        message = (decode_checkpoint_begin if begin else decode_checkpoint_done)(frame)
        with self._core(noted=False):  # noted rows' ranges wait for them (BatchRange.held)
            checkpoint = self._checkpoint(message)
        return encode_checkpoint_reply(rid, checkpoint)

    def _batch_begin(self, rid: int, frame: Frame) -> bytes:
        """BATCH_RANGES, CHECKPOINT_BEGIN and a FETCH_REPLAY per source, in that order,
        under one hold of the lock (docs/protocol.md 5.20): the ranges are stored
        (synced) before the barrier begins, and the replays are fetched after it, so
        their holds belong to the batch it begins. An error of a step is the request's
        ERROR; the steps before it stay done (each is idempotent: the request is sent
        again as a whole)."""
        m = decode_batch_begin(frame)
        self._own_ranges(m.ranges)
        replay = ReplayRecords.concat([])
        with self._core(noted=False) as ft:  # as each of the three requests does
            numbers = ft.register_ranges(m.ranges, tree=m.tree) if m.ranges else []
            checkpoint = self._checkpoint(m.checkpoint)
            if m.replays is not None:
                lo, hi = m.replays
                replay = _by_seq(
                    [ft.fetch_replay(lo, hi, source_id=s) for s in sorted(set(m.replay_sources))]
                )
        through: int | None = 0
        if m.replays is not None:
            head = len(json.dumps(checkpoint)) + 12 * len(numbers) + _BEGUN_HEAD_SLACK
            replay, through = _page(replay, m.replays[1], self.max_frame - head)
        return encode_batch_begun(
            rid, checkpoint, numbers, replay, through=through, max_frame=self.max_frame
        )

    def _savepoint_request(self, rid: int, frame: Frame) -> bytes:
        saved = self._savepoint(decode_savepoint(frame))  # takes the core lock only briefly
        return encode_savepoint_created(rid, saved.as_dict())

    def _savepoint_read(self, rid: int, frame: Frame) -> bytes:
        """A chunk of the spooled savepoint part (ftlayer.checkpoint.fetch), or its
        release: file reads only, under no lock."""
        message = decode_savepoint_read(frame)
        storage = self._storage
        if storage is None:
            raise StorageError("the server is stopping")
        if message.release:
            release_spooled(storage.path, message.name)
            return encode_savepoint_bytes(rid, b"")
        data = read_spooled(storage.path, message.name, message.offset, message.length)
        return encode_savepoint_bytes(rid, data)

    def _checkpoint(self, message: CheckpointRequest) -> dict[str, Any]:
        """Called under the lock: the reply's JSON."""
        checkpoints = self._checkpoints
        assert checkpoints is not None
        mode = CheckpointMode.named(message.mode)
        query, sources = message.query, message.sources
        if not message.begin:
            return checkpoints.done(query, message.position, sources, mode).to_json()
        completed = None
        if message.complete is not None:  # the batch before, done: one round trip
            completed = checkpoints.done(query, message.complete, sources, mode).to_json()
        reply = checkpoints.begin(query, message.position, sources, mode).to_json()
        if completed is not None:
            reply["completed"] = completed
        return reply

    def _savepoint(self, message: SavepointRequest) -> Savepoint:
        """Step 8 of the module docstring. Called without the core lock: the copy runs
        while events go on."""
        if not self._savepoint_lock.acquire(blocking=False):
            running_s = time.monotonic() - self._savepoint_started
            raise StateConflict(
                f"another savepoint of this server is being written (for {running_s:.1f} s); "
                "it takes one at a time: send SAVEPOINT again once that one is done"
            )
        try:
            self._savepoint_started = time.monotonic()
            with self._lock:
                ft, storage = self._ft, self._storage
                if ft is None or storage is None:
                    raise StorageError("the server is stopping")
                if self._parked is not None:
                    self._parked.refuse_savepoint()
                ft.apply_noted()  # the copy holds every failure the server answered
                # Completed records leave the store first: a restore replays only
                # records whose trees are not complete. Those the deleter took
                # before are being deleted: the copy waits for them.
                ft.flush_deletes()
                with self._deletes_changed:
                    taken = self._delete_rounds
            with self._deletes_changed:
                self._deletes_changed.wait_for(
                    lambda: self._deletes_done >= taken, _DELETES_MAX_WAIT_S
                )
            # The savepoint copies the LMDB environment this process opened: into
            # the directory asked for, or into the spool for the client to fetch.
            if message.directory is None:
                saved = spool_part(storage, message.name, message.savepoint_id)
            else:
                saved = create_savepoint(
                    storage, message.directory, message.name, savepoint_id=message.savepoint_id
                )
        finally:
            self._savepoint_lock.release()
        log.info(
            "savepoint %s written to %s: %d stored records, %d bytes",
            saved.name,
            saved.path,
            saved.stored_records,
            saved.data_bytes,
        )
        return saved

    def observe(self) -> Observation:
        """The STATUS reply and each source's latency histogram, copied together under
        the lock (for the HTTP port: ftlayer.web)."""
        from ftlayer.web import Observation

        with self._core() as ft:
            status = self._status(ft)
            by_source = ft.meters.by_source(ft.persistence.number_sources())
        return Observation(status, {str(s): m.latency for s, m in by_source.items()})

    def dead_letter_rows(self, limit: int) -> DeadLetterRows:
        """The oldest `limit` dead letters without their payloads, and how many there
        are (for the status page)."""
        from ftlayer.web import DeadLetterRows

        with self._core() as ft:
            stats = ft.stats
            # The page asks every second; the letters change only with these counts.
            key = (
                limit,
                ft.dead_letter_count,
                stats.dead_lettered,
                stats.dead_letters_purged,
                stats.dead_letters_delivered,
                stats.dead_letters_requeued,
            )
            cached = self._dead_letter_rows
            if cached is not None and cached[0] == key:
                return cached[1]
            letters, records = ft.dead_letters(None, limit)
            total = ft.dead_letter_count
        rows = []
        for i, (seq, record) in enumerate(letters):
            cause = record.last_cause
            rows.append(
                {
                    "seq": seq,
                    "source_id": record.source_id,
                    "topic": records.topics[i],
                    "partition": int(records.partitions[i]),
                    "offset": int(records.offsets[i]),
                    "attempts": record.attempts,
                    "dead_at": record.dead_at,
                    "cause": None if cause is None else cause.kind.label,
                    "step": None if cause is None else cause.step,
                    "error": None if cause is None else cause.error,
                }
            )
        found = DeadLetterRows(rows, total)
        self._dead_letter_rows = (key, found)
        return found

    def _brief_status(self, ft: FTLayer) -> dict[str, Any]:
        """The brief reply (ftlayer.status.BriefStatus); called under the lock."""
        status = ft.brief_stats()
        status.update(
            timeout_s=self.timeout_s,
            uptime_s=round(time.monotonic() - self._started_at, 3),
            version=__version__,
            shard=self.shard.index,
            shards=self.shard.count,
            store_id=self.store_id,
            parked=self._parked_counts(),
        )
        return status

    def _parked_counts(self) -> dict[str, dict[str, int]]:
        parked = self._parked
        if parked is None:
            return {}
        return {
            str(owner): {"entries": n, "roots": roots}
            for owner, (n, roots) in parked.counts().items()
        }

    def _status(self, ft: FTLayer) -> dict[str, Any]:
        """Called under the lock."""
        status = ft.current_stats().to_json()
        store = ft.store_figures()
        with self._connections_lock:
            connections = len(self._connections)
        status.update(
            pending_by_source={str(s): n for s, n in ft.pending_by_source().items()},
            stored_records=store.stored_records,
            deletes_pending=store.deletes_pending + self._deleting,
            lmdb_size_bytes=store.size_bytes,
            store_commits=store.commits,
            connections=connections,
            max_connections=self.max_connections,
            uptime_s=round(time.monotonic() - self._started_at, 3),
            checkpoints={} if self._checkpoints is None else self._checkpoints.status(),
            sources=ft.source_specs(),
            timeout_s=self.timeout_s,
            buckets=self.buckets,
            version=__version__,
            shard=self.shard.index,
            shards=self.shard.count,
            store_id=self.store_id,
            requests=self._request_costs.to_json(),
            parked=self._parked_counts(),
        )
        return status


# A REPLAY row's bytes besides its payload: replay seq, partition, then root, source id,
# key hash, has_key, partition, offset, topic index and payload length.
_REPLAY_ROW_BYTES: Final = 8 + 4 + 8 + 4 + 8 + 1 + 4 + 8 + 2 + 4
_REPLAY_SLACK: Final = 64
# A dead letter's bytes besides its payload: its record columns and a retry record of
# up to 16 causes of up to 1,200 bytes each, as JSON.
_DEAD_LETTER_ROW_BYTES: Final = _REPLAY_ROW_BYTES + 20_000
_MAX_LISTED_DEAD_LETTERS: Final = 10_000


_BEGUN_HEAD_SLACK: Final = 64
"""Room kept in a BATCH_BEGUN frame for its JSON beyond the checkpoint's and the range
numbers' own (its keys, its length prefix)."""


def _by_seq(found: list[ReplayRecords]) -> ReplayRecords:
    """The replays fetched source by source, in replay seq order (a page ends at a seq:
    `_first_page`)."""
    if len(found) == 1:
        return found[0]
    replay = ReplayRecords.concat(found)
    return replay.take(np.argsort(replay.replay_seqs, kind="stable"))


def _page(replay: ReplayRecords, hi: int, max_frame: int) -> tuple[ReplayRecords, int | None]:
    """The first page of `replay` (`_first_page`) and its `through`: `hi` when it holds
    every row, None (its last row's seq) otherwise."""
    page = _first_page(replay, max_frame)
    return page, (hi if len(page) == len(replay) else None)


def _first_page(replay: ReplayRecords, max_frame: int) -> ReplayRecords:
    """The rows of `replay` that fit one REPLAY frame: all of them, or the longest
    prefix that ends at a replay seq boundary (a broadcast replay has one row per
    partition under one seq, and they travel together). The client asks again from the
    last seq it got, the reply's `through` (docs/protocol.md, 5.2). A first seq too
    large for a frame is left to the encoder's FrameTooLarge."""
    n = len(replay)
    if n < 2:
        return replay
    records = replay.records
    lengths = np.fromiter(map(len, records.payloads), dtype=np.int64, count=n)
    topics = {t: len(t.encode()) for t in dict.fromkeys(records.topics)}
    budget = max_frame - _REPLAY_SLACK - 2 - sum(2 + size for size in topics.values())
    sizes = np.cumsum(lengths + _REPLAY_ROW_BYTES)
    if int(sizes[-1]) <= budget:
        return replay
    fits = int(np.searchsorted(sizes, budget, side="right"))
    seqs = replay.replay_seqs
    while 0 < fits < n and seqs[fits] == seqs[fits - 1]:
        fits -= 1  # never split the rows of one replay seq
    return replay if fits == 0 else replay.take(np.arange(fits))


def _release_for_source(ft: FTLayer) -> None:
    """A source's brief STATUS asks for its replay cursor (each trigger of the ftkafka
    driver): the failed records whose backoff has ended are queued first, so the batch
    it plans takes them in. The ticker queues them too, but only RELEASE_AFTER_S after
    the first backoff's end (ftlayer.core.layer): what ended meanwhile goes in one
    write here instead of a write per tick. A release that fails is logged; the
    records keep waiting and the ticker tries again."""
    try:
        ft.release_due()
    except Exception:
        log.exception("could not queue the records whose backoff ended; the ticker retries")
