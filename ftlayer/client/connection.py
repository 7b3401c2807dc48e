"""FTClient: a blocking client of the FT-layer server (docs/protocol.md).

One connection, opened lazily with its handshake (HELLO, CHALLENGE, AUTH, WELCOME) on
the first call. Every call sends one request and waits for its reply, under one lock,
so a client may be shared by threads (they take turns). It is an FTChannel: Persister
and TaskHandler work over it exactly as over an in-process FTLayer (a TaskHandler then
buffers its events; over a BatchingChannel, ftlayer.client.channel, it does not).

- persist returns only after the server's OK, which it sends only once the storage
  committed the records: a source that emits after persist() never emits an
  unpersisted record.
- Connecting (lazily, and again after a broken connection) retries refused attempts
  with exponential backoff for up to `reconnect_s` (60 s by default), so a restarting
  server is waited for; nothing of a request is sent before its connection is up, so
  every call may wait this way. Then ConnectionLost.
- A connection that breaks after a request was sent is retried once (reconnecting as
  above) for the idempotent calls only (status, brief_status, fetch_replay,
  register_source, register_ranges, checkpoint, begin_batch, heartbeat, inspect,
  listing dead letters). persist, xor, fail and savepoint raise ConnectionLost
  instead: the request may or may not have been applied, and only the caller knows
  whether to resend. The next call reconnects.
- A connection the server closed while it was idle (its idle limit, a restart) is
  noticed before the next request is sent, and replaced: that request is not lost.
- While it retries, it logs a warning (logger ftlayer.client) naming the server's
  address and until when it retries: when retrying starts, then at most every
  RETRY_LOG_INTERVAL_S while it goes on, across the clients of one name and address
  in a process (a heartbeat thread that makes a fresh client after each failure warns
  no more often).
- A server at its connection limit answers ERROR 103 (ServerBusy); connecting treats
  that as a refused attempt and retries it with the same backoff.
- TLS that does not fit is not retried: TLSMismatch (a ConfigError) at once, naming
  the cause: the server speaks TLS and the client has no CA (the server says so with
  ERROR 104), the client speaks TLS to a plain-TCP server, or the server's certificate
  does not verify against the client's CA or does not name the host it was reached
  by.
- An ERROR reply raises: the matching ProtocolError subclass for codes 1-9,
  ServerStorageError for 101, RequestRejected (a ValueError) for 102, ServerBusy for
  103 (retried while connecting, see above), ServerError otherwise; each carries the
  server's message.
"""

from __future__ import annotations

import logging
import math
import os
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ftlayer.causes import Cause, Causes
from ftlayer.errors import ConfigError
from ftlayer.inspection import Inspection, RecordQuery
from ftlayer.records import RecordBatch, ReplayRecords
from ftlayer.registration import SourceRegistration
from ftlayer.status import BriefStatus, CheckpointReport, Status
from ftlayer.wire import (
    DEFAULT_MAX_FRAME,
    DeadLetterList,
    Kind,
    MalformedFrame,
    ParkedList,
    ParkedOp,
    SinkMark,
    UnfilledList,
    decode_batch_begun,
    decode_checkpoint_reply,
    decode_dead_letter_list,
    decode_inspect_reply,
    decode_mark,
    decode_ok,
    decode_parked_list,
    decode_range_numbers,
    decode_replay_page,
    decode_savepoint_bytes,
    decode_savepoint_created,
    decode_status_reply,
    decode_unfilled_list,
    encode_batch_begin,
    encode_batch_ranges,
    encode_checkpoint_request,
    encode_dead_letter_list,
    encode_dead_letters,
    encode_fail,
    encode_fail_parked,
    encode_fetch_replay,
    encode_fill,
    encode_heartbeat,
    encode_hold,
    encode_ingest,
    encode_inspect,
    encode_parked,
    encode_persist,
    encode_range_read,
    encode_register_source,
    encode_savepoint,
    encode_savepoint_read,
    encode_sink_hold,
    encode_sink_mark,
    encode_sink_settle,
    encode_status_request,
    encode_unfilled,
    encode_xor,
)

from .link import Link

log = logging.getLogger("ftlayer.client")


@dataclass(frozen=True, slots=True)
class BatchStart:
    """FTClient.begin_batch's answers: the barrier's checkpoint, a number per range
    (0: an empty range) and the replays the batch takes in (none unless asked)."""

    checkpoint: CheckpointReport
    range_numbers: list[int]
    replays: ReplayRecords


SAVEPOINT_TIMEOUT_S: Final = 3600.0
"""How long FTClient.savepoint waits for its reply by default: the server copies the
whole store before it answers."""


class FTClient(Link):
    """A blocking client of one FT-layer server; see the module docstring. Its
    connection and the plumbing of each request are ftlayer.client.link's."""

    def __init__(
        self,
        address: str,
        token: bytes | None = None,
        connect_timeout: float = 5.0,
        *,
        request_timeout: float | None = 120.0,
        name: str | None = None,
        max_frame: int = DEFAULT_MAX_FRAME,
        tls: bool | str | os.PathLike[str] | ssl.SSLContext = False,
        reconnect_s: float = 60.0,
    ) -> None:
        super().__init__(
            address,
            token,
            connect_timeout,
            request_timeout=request_timeout,
            name=name,
            max_frame=max_frame,
            tls=tls,
            reconnect_s=reconnect_s,
        )
        self.store_id: str | None = None
        """The server's store id as its last STATUS reply gave it (None: none read)."""
        self._whole_status_only = False  # the server refused the brief STATUS once

    # ---- FTChannel ---------------------------------------------------------------

    def persist(self, batch: RecordBatch, initial_values: ArrayLike | None = None) -> None:
        """Persist records; returns once the server confirmed they are stored."""
        self._call(
            lambda rid: encode_persist(rid, batch, initial_values, max_frame=self.max_frame),
            Kind.OK,
            retry=False,
        )

    def xor(self, roots: ArrayLike, values: ArrayLike) -> int:
        """Send XOR events; returns how many the server applied."""
        frame = self._call(
            lambda rid: encode_xor(rid, roots, values, max_frame=self.max_frame),
            Kind.OK,
            retry=False,
        )
        return decode_ok(frame).count

    def hold(self, roots: ArrayLike, values: ArrayLike) -> int:
        """`FTLayer.hold`: barrier-mode roots go on in a new batch (XOR `values` and a
        fresh barrier hold); returns how many were pending. Not retried on a broken
        connection: those trees then time out and are replayed."""
        frame = self._call(
            lambda rid: encode_hold(rid, roots, values, max_frame=self.max_frame),
            Kind.OK,
            retry=False,
        )
        return decode_ok(frame).count

    def sink_hold(self, key: int, roots: ArrayLike, values: ArrayLike) -> int:
        """`FTLayer.sink_hold`: the acks of rows that reached a batch sink, held under
        its key until `sink_settle`; returns how many were pending. Not retried on a
        broken connection: those trees then time out and are replayed."""
        frame = self._call(
            lambda rid: encode_sink_hold(rid, key, roots, values, max_frame=self.max_frame),
            Kind.OK,
            retry=False,
        )
        return decode_ok(frame).count

    def sink_settle(
        self, key: int, cause: Cause | None = None, *, reconnect_s: float | None = None
    ) -> int:
        """`FTLayer.sink_settle`: the sink's write under `key` succeeded (ack every
        held pair) or, with `cause`, failed (fail every held root); returns how many.
        Not retried: a lost settle leaves the trees to time out (replayed).
        `reconnect_s`: how long this call waits for a connection (None: the client's)."""
        frame = self._call(
            lambda rid: encode_sink_settle(rid, key, cause),
            Kind.OK,
            retry=False,
            reconnect_s=reconnect_s,
        )
        return decode_ok(frame).count

    def fail(
        self,
        roots: ArrayLike,
        causes: Causes | Cause | None = None,
        *,
        reconnect_s: float | None = None,
    ) -> int:
        """Fail roots explicitly, with their causes (one for all, one per root, or
        unspecified); returns how many were pending (and are now retried or
        dead-lettered). `reconnect_s`: how long this call waits for a connection
        (None: the client's)."""
        if not isinstance(causes, Causes):
            causes = Causes.one(causes, len(np.asarray(roots)))
        frame = self._call(
            lambda rid: encode_fail(rid, roots, causes, max_frame=self.max_frame),
            Kind.OK,
            retry=False,
            reconnect_s=reconnect_s,
        )
        return decode_ok(frame).count

    def fail_parked(
        self,
        owner: int,
        store_id: str,
        roots: ArrayLike,
        causes: Causes | None,
        *,
        reconnect_s: float | None = None,
    ) -> int:
        """FAIL_PARKED: have this server keep a FAIL for shard `owner`, which could not
        be reached (ftlayer.core.parked); returns how many roots it keeps, once they
        are committed. Not retried on a broken connection (ConnectionLost)."""
        frame = self._call(
            lambda rid: encode_fail_parked(
                rid, owner, store_id, roots, causes, max_frame=self.max_frame
            ),
            Kind.OK,
            retry=False,
            reconnect_s=reconnect_s,
        )
        return decode_ok(frame).count

    def parked(self, limit: int = 1000) -> ParkedList:
        """The failures of other shards parked on this server, oldest first (at most
        `limit`, and one frame of them). Read-only, so retried."""
        return decode_parked_list(
            self._call(
                lambda rid: encode_parked(rid, ParkedOp.LIST, limit=limit),
                Kind.PARKED_LIST,
                retry=True,
            )
        )

    def drop_parked(self, seqs: Sequence[int]) -> int:
        """Delete parked failures by seq (once delivered); returns how many were
        there. Idempotent (a seq is never reused), so retried."""
        frame = self._call(
            lambda rid: encode_parked(rid, ParkedOp.DROP, seqs=list(seqs)),
            Kind.OK,
            retry=True,
        )
        return decode_ok(frame).count

    def savepoint(
        self,
        directory: str | None,
        name: str | None = None,
        *,
        savepoint_id: str | None = None,
        timeout_s: float = SAVEPOINT_TIMEOUT_S,
    ) -> dict[str, Any]:
        """Have the server write a savepoint of its store into `directory`, an absolute
        path on the server's host, or (None) into its spool, from where `read_savepoint`
        fetches it (ftlayer.checkpoint.savepoint and .fetch; `name` None: the default
        name; `savepoint_id`: the id a cluster's parts share, None: none).
        Returns the savepoint created (Savepoint.as_dict: the manifest and "path").

        The server copies the whole store before it replies; this waits up to
        `timeout_s` for that. RequestRejected for a bad or existing name, a directory
        that is a file, or a savepoint already being written; ServerStorageError if the
        server could not write it (disk full, no permission); BadRequest for a relative
        `directory`. Not idempotent (a second request with the same name is refused, one
        without a name makes a second savepoint), so a connection that breaks after the
        request was sent is not retried: ConnectionLost, and the savepoint may or may
        not exist."""
        if not 0 < timeout_s < math.inf:
            raise ConfigError(f"timeout_s must be a positive number of seconds, got {timeout_s}")
        which = f"savepoint {name!r}" if name is not None else "the savepoint"
        if directory is not None:
            if_lost = (
                f"{which} may or may not have been created in {directory} (the server may "
                f"still be writing it): check with `ftlayer savepoint list --dir {directory}` "
                "on the server's host before you ask again"
            )
        else:
            if_lost = (
                f"{which} may or may not have been written into the server's spool (the "
                "server may still be writing it); the next savepoint replaces it there"
            )
        frame = self._call(
            lambda rid: encode_savepoint(rid, directory, name, savepoint_id=savepoint_id),
            Kind.SAVEPOINT_CREATED,
            retry=False,
            timeout_s=timeout_s,
            if_lost=if_lost,
        )
        return decode_savepoint_created(frame).savepoint

    def read_savepoint(self, name: str, offset: int, length: int) -> bytes:
        """`length` bytes at `offset` of the data file of savepoint part `name` in the
        server's spool (fewer at its end, none past it). Idempotent: retried once on a
        broken connection. RequestRejected if the spool does not hold `name`."""
        frame = self._call(
            lambda rid: encode_savepoint_read(rid, name, offset, length),
            Kind.SAVEPOINT_BYTES,
            retry=True,
        )
        return decode_savepoint_bytes(frame).data

    def release_savepoint(self, name: str) -> None:
        """Have the server delete savepoint part `name` from its spool."""
        self._call(
            lambda rid: encode_savepoint_read(rid, name, 0, 0, release=True),
            Kind.SAVEPOINT_BYTES,
            retry=False,
        )

    # ---- idempotent calls --------------------------------------------------------

    def register_source(self, registration: SourceRegistration) -> None:
        """`FTLayer.register_source` on the server: how the source's records are
        replayed and retried, its own tree timeout, dead-letter topic, completion mode
        and name (ftlayer.registration; stored by the server, so it survives restarts).
        RequestRejected for an unknown partitioner, bad options or a retry policy out
        of range."""
        self._call(lambda rid: encode_register_source(rid, registration), Kind.OK, retry=True)

    def fetch_replay(
        self, lo: int, hi: int, source_id: int | None = None, partition: int | None = None
    ) -> ReplayRecords:
        """`FTLayer.fetch_replay` on the server: records with lo < replay seq <= hi.

        A REPLAY holds at most one frame of rows; the server sends the first rows that
        fit, whole replay seqs at a time, and the seq up to which it sent every row
        (`through`: `hi` when all fit), and this asks again from there until a reply
        comes back empty or reaches `hi`: one request when every row fits."""
        pages: list[ReplayRecords] = []
        while True:
            start = lo

            def encode(rid: int, start: int = start) -> bytes:
                return encode_fetch_replay(rid, start, hi, source_id=source_id, partition=partition)

            page, through = decode_replay_page(self._call(encode, Kind.REPLAY, retry=True))
            pages.append(page)
            if not len(page) or through >= hi:
                return ReplayRecords.concat(pages)
            lo = through

    def checkpoint(
        self,
        *,
        begin: bool,
        query: str,
        position: Mapping[str, Any],
        sources: Sequence[int],
        mode: str = "unaligned",
        complete: Mapping[str, Any] | None = None,
    ) -> CheckpointReport:
        """CHECKPOINT_BEGIN (begin=True: barrier `position` of `query`) or
        CHECKPOINT_DONE (Spark finished the batch that ends there); returns the
        checkpoint as JSON (ftlayer.checkpoint.Checkpoint.to_json), with
        "commit_offsets" {topic: {partition (str): offset}} or None. A BEGIN with
        `complete` completes that earlier barrier first, in the same round trip; the
        reply then also has "completed": that checkpoint. All are idempotent, so they
        are resent after a reconnect."""
        if complete is not None and not begin:
            raise ConfigError("complete= goes with a CHECKPOINT_BEGIN (begin=True)")

        def request(rid: int) -> bytes:
            return encode_checkpoint_request(
                rid,
                begin=begin,
                query=query,
                position=position,
                sources=sources,
                mode=mode,
                complete=complete,
            )

        frame = self._call(request, Kind.CHECKPOINT, retry=True)
        return CheckpointReport.from_json(decode_checkpoint_reply(frame).checkpoint)

    def begin_batch(
        self,
        *,
        query: str,
        position: Mapping[str, Any],
        sources: Sequence[int],
        mode: str = "unaligned",
        complete: Mapping[str, Any] | None = None,
        ranges: Sequence[tuple[int, str, int, int, int]] = (),
        tree: bool = False,
        replays: tuple[int, int] | None = None,
        replay_sources: Sequence[int] = (),
    ) -> BatchStart:
        """BATCH_BEGIN: `register_ranges(ranges, tree=tree)`, then `checkpoint(begin=True,
        ...)`, then (with `replays`, (lo, hi)) `fetch_replay(lo, hi, s)` for each of
        `replay_sources`, in one round trip; their answers. Replays that did not fit
        the reply are fetched after it, from where it stopped. Idempotent as each of
        the three is, so retried."""

        def encode(rid: int) -> bytes:
            return encode_batch_begin(
                rid,
                query=query,
                position=position,
                sources=sources,
                mode=mode,
                complete=complete,
                ranges=ranges,
                tree=tree,
                replays=replays,
                replay_sources=replay_sources,
            )

        begun = decode_batch_begun(self._call(encode, Kind.BATCH_BEGUN, retry=True))
        if len(begun.range_numbers) != len(ranges):
            raise MalformedFrame(
                f"BATCH_BEGUN has {len(begun.range_numbers)} range numbers for {len(ranges)} ranges"
            )
        found = begun.replays
        if replays is not None and len(found) and begun.through < replays[1]:
            rest = [
                self.fetch_replay(begun.through, replays[1], s) for s in sorted(set(replay_sources))
            ]
            found = ReplayRecords.concat([found, *rest])
        return BatchStart(CheckpointReport.from_json(begun.checkpoint), begun.range_numbers, found)

    def heartbeat(self, source_ids: Sequence[int], lease_s: float) -> int:
        """`FTLayer.heartbeat`: the batch of these sources runs and their driver is
        alive; the FT layer postpones their trees' timeouts for `lease_s` more seconds
        (0 ends the lease; sent in whole milliseconds). Returns how many of the sources
        have an open batch."""
        lease_ms = round(lease_s * 1000)
        frame = self._call(
            lambda rid: encode_heartbeat(rid, source_ids, lease_ms), Kind.OK, retry=True
        )
        return decode_ok(frame).count

    def unfilled(self, source_id: int, limit: int = 10_000) -> UnfilledList:
        """`FTLayer.unfilled`: up to `limit` failed records of `source_id` stored by
        reference whose bytes the FT layer does not hold: seqs and coordinates."""

        def encode(rid: int) -> bytes:
            return encode_unfilled(rid, source_id, limit)

        return decode_unfilled_list(self._call(encode, Kind.UNFILLED_LIST, retry=True))

    def register_ranges(
        self, ranges: Sequence[tuple[int, str, int, int, int]], *, tree: bool = False
    ) -> list[int]:
        """`FTLayer.register_ranges`: open a batch's offset ranges, (source id, topic,
        partition, start, end) each (`tree`: tree-mode ranges); durable once this
        returns; their numbers (0 for an empty range). Idempotent (the same range gets
        its number back), so retried."""

        def encode(rid: int) -> bytes:
            return encode_batch_ranges(rid, ranges, tree=tree)

        return decode_range_numbers(self._call(encode, Kind.RANGE_NUMBERS, retry=True))

    def read_range(self, first: int, n: int, seed: int) -> int:
        """`FTLayer.read_range`: the `n` records of a tree-mode range from range root
        `first` on are emitted with ids under `seed` (ftlayer.rangeroots.emission_ids);
        returns how many start their trees over. Idempotent, so retried."""

        def encode(rid: int) -> bytes:
            return encode_range_read(rid, first, n, seed)

        return decode_ok(self._call(encode, Kind.OK, retry=True)).count

    def ingest(self, batch: RecordBatch) -> int:
        """`FTLayer.ingest`: a receiver's records (with their bytes; `offsets` each
        one's identity upstream, or -1), stored and queued for their source's reader
        once this returns; how many were taken (the others were second copies of
        records ingested within the window). Not resent on a lost connection: a record
        with an identity is taken once however often it is sent, one without may be
        taken twice."""

        def encode(rid: int) -> bytes:
            return encode_ingest(rid, batch, max_frame=self.max_frame)

        return decode_ok(self._call(encode, Kind.OK, retry=False)).count

    def sink_mark(self, sink: str, batch: int, mark: Mapping[str, Any]) -> SinkMark:
        """`FTLayer.sink_mark`: the mark of `sink`'s batch `batch`, the one stored
        already or `mark`, stored now (durable once this returns; `first` says which).
        Idempotent for the mark it keeps, so retried."""

        def encode(rid: int) -> bytes:
            return encode_sink_mark(rid, sink, batch, mark)

        return decode_mark(self._call(encode, Kind.MARK, retry=True))

    def fill(
        self,
        seqs: NDArray[np.uint64],
        found: NDArray[np.bool_],
        payloads: Sequence[bytes],
        keys: tuple[NDArray[np.int64], NDArray[np.bool_]] | None = None,
    ) -> int:
        """`FTLayer.fill`: the bytes of records `unfilled` listed (where `found`), or
        that their source no longer has them. Durable once this returns; idempotent, so
        retried. Returns how many were filled."""

        def encode(rid: int) -> bytes:
            return encode_fill(rid, seqs, found, payloads, keys, max_frame=self.max_frame)

        return decode_ok(self._call(encode, Kind.OK, retry=True)).count

    def status(self, *, reconnect_s: float | None = None) -> Status:
        """The server's counters (FTStats fields, lmdb_size_bytes, connections, ...).
        `reconnect_s`: how long this call waits for a connection (None: the client's)."""
        frame = self._call(
            encode_status_request, Kind.STATUS_REPLY, retry=True, reconnect_s=reconnect_s
        )
        status = Status.from_json(decode_status_reply(frame).status)
        self.store_id = status.store_id
        return status

    def brief_status(self, *, reconnect_s: float | None = None) -> BriefStatus:
        """The brief STATUS reply: what a source's driver reads per batch (replay
        cursors, pending and unfilled records per source, the server's place, store and
        timeout), without the whole reply's heavy sections. A server that predates it
        refuses the request's flags byte (ERROR 1, MalformedFrame); this client then
        asks it for the whole reply, and keeps doing so, and answers its brief part."""
        if not self._whole_status_only:
            try:
                frame = self._call(
                    lambda rid: encode_status_request(rid, brief=True),
                    Kind.STATUS_REPLY,
                    retry=True,
                    reconnect_s=reconnect_s,
                )
            except MalformedFrame:
                self._whole_status_only = True
            else:
                brief = BriefStatus.from_json(decode_status_reply(frame).status)
                self.store_id = brief.store_id
                return brief
        return self.status(reconnect_s=reconnect_s).brief()

    def dead_letters(
        self, where: Mapping[str, Any] | None = None, limit: int | None = None
    ) -> DeadLetterList:
        """The dead letters that match `where` (DeadLetterFilter's JSON form: source_id,
        partition, cause, since, until, seqs), oldest first: at most `limit`, and at
        most one frame of them (`more` then says so)."""

        def encode(rid: int) -> bytes:
            return encode_dead_letters(rid, "list", where, limit)

        return decode_dead_letter_list(self._call(encode, Kind.DEAD_LETTER_LIST, retry=True))

    def inspect(self, query: RecordQuery) -> Inspection:
        """Where the record(s) `query` names are (ftlayer.inspection): by root or by
        Kafka coordinates; no records: unknown or completed. Read-only, so retried."""

        def encode(rid: int) -> bytes:
            return encode_inspect(rid, query)

        return decode_inspect_reply(self._call(encode, Kind.INSPECT_REPLY, retry=True))

    def dead_letter_op(self, op: str, where: Mapping[str, Any] | None = None) -> int:
        """ "requeue" (replay them now, after a fix), "purge" (delete them for good) or
        "delivered" (their dead-letter topic confirmed them: delete them) the dead
        letters that match `where`; returns how many. Not retried on a broken
        connection (ConnectionLost): see whether it happened, then ask again."""

        def encode(rid: int) -> bytes:
            return encode_dead_letters(rid, op, where)

        return decode_ok(self._call(encode, Kind.OK, retry=False)).count

    def restore_dead_letters(
        self, letters: Sequence[Mapping[str, Any]], records: RecordBatch
    ) -> int:
        """Dead letters taken back from a dead-letter topic (after a fix): the FT layer
        stores them again under the roots of `records`, with their histories
        (`letters`, RetryRecord's JSON form), and replays them now. Returns how many.
        Not retried on a broken connection (ConnectionLost)."""

        def encode(rid: int) -> bytes:
            return encode_dead_letter_list(
                rid, letters, records, False, max_frame=self.max_frame,
                kind=Kind.DEAD_LETTER_RESTORE,
            )  # fmt: skip

        return decode_ok(self._call(encode, Kind.OK, retry=False)).count

    # ---- lifecycle ---------------------------------------------------------------
