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
  above) for the idempotent calls only (status, brief_status, fetch_replay, register_source,
  checkpoint, heartbeat, inspect, listing dead letters). persist, xor, fail and savepoint
  raise ConnectionLost instead: the request may or may not have been applied, and only
  the caller knows whether to resend. The next call reconnects.
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

import datetime as dt
import logging
import math
import os
import select
import socket
import ssl
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Final, Self, TypeVar

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ftlayer.causes import Cause, Causes
from ftlayer.errors import ConfigError, FTLayerError
from ftlayer.inspection import Inspection, RecordQuery
from ftlayer.logs import fields
from ftlayer.records import RecordBatch, ReplayRecords
from ftlayer.registration import SourceRegistration
from ftlayer.status import BriefStatus, CheckpointReport, Status
from ftlayer.wire import (
    DEFAULT_MAX_FRAME,
    DIGEST_SIZE,
    MAX_U32,
    AuthFailed,
    DeadLetterList,
    ErrorCode,
    Frame,
    FrameReader,
    Kind,
    MalformedFrame,
    NotAuthenticated,
    ParkedList,
    ParkedOp,
    ProtocolError,
    SinkMark,
    UnexpectedKind,
    UnfilledList,
    auth_digest,
    decode_challenge,
    decode_checkpoint_reply,
    decode_dead_letter_list,
    decode_error,
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
    decode_welcome,
    encode_auth,
    encode_batch_ranges,
    encode_checkpoint_request,
    encode_dead_letter_list,
    encode_dead_letters,
    encode_fail,
    encode_fail_parked,
    encode_fetch_replay,
    encode_fill,
    encode_heartbeat,
    encode_hello,
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
    new_nonce,
)

from . import trace
from .endpoint import client_tls_context, parse_address, trusted_cas
from .errors import (
    PROTOCOL_ERRORS,
    ConnectionLost,
    ServerBusy,
    ServerError,
    TLSMismatch,
    error_for,
)

T = TypeVar("T")

log = logging.getLogger("ftlayer.client")

SAVEPOINT_TIMEOUT_S: Final = 3600.0
"""How long FTClient.savepoint waits for its reply by default: the server copies the
whole store before it answers."""
RETRY_LOG_INTERVAL_S: Final = 10.0
"""While a client retries an unreachable server, at most one warning this often."""
_retry_warned_at: dict[tuple[str, str], float] = {}
"""(client name, address) -> when the last retry warning was logged (monotonic), while
retrying goes on: shared by the clients of a process."""
_FIRST_BACKOFF_S: Final = 0.05
_MAX_BACKOFF_S: Final = 1.0
_RECV_BYTES: Final = 256 << 10
"""A connection's receive buffer, made once (`recv(n)` would allocate n bytes a call)."""
_CA_HINT: Final = "the source option ft.tlsCa, or --tls-ca of the ftlayer command"
_NOT_TLS_REASONS: Final = frozenset(
    {"WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG", "HTTP_REQUEST"}
)
"""What OpenSSL says when the answer to a ClientHello is not TLS (a plain-TCP server's
ERROR frame)."""
_TOKEN_HINT: Final = (
    "give the token of the server's --token-file, with the source option ft.tokenFile "
    "(or ft.token), or with --token-file of the ftlayer command"
)


def _closed_while_idle(sock: socket.socket) -> bool:
    """Whether an idle connection (no request outstanding) became readable: the server
    sends nothing unasked, so that is its close (EOF, a reset) or a stream gone wrong.
    Checked before each request, so the first call after a server restart reconnects
    instead of failing with ConnectionLost: nothing of it was sent on the dead socket."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


class FTClient:
    """A blocking client of one FT-layer server; see the module docstring."""

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
        self.host, self.port = parse_address(address)
        self._tls = client_tls_context(tls)
        self._trusted = trusted_cas(tls)
        self.address = address
        self._token = token
        self._connect_timeout = connect_timeout
        if not reconnect_s >= 0:
            raise ConfigError(f"reconnect_s must be 0 or more seconds, got {reconnect_s}")
        self._reconnect_s = reconnect_s
        self._request_timeout = request_timeout
        self._name = name if name is not None else f"client@{socket.gethostname()}:{os.getpid()}"
        self.max_frame = max_frame
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._reader = FrameReader(max_frame)
        self._frames: deque[Frame] = deque()
        self._received: memoryview | None = None  # the receive buffer, from the first connect
        self._next_id = 1
        self.requests_sent: Counter[int] = Counter()
        """Frames sent, by kind (a `Kind`), handshakes included: for tests and metrics."""
        self.store_id: str | None = None
        """The server's store id as its last STATUS reply gave it (None: none read)."""
        self.connections = 0
        """Connections opened so far (handshake done): replies got while it stays the
        same came over one connection, from one server process and its one store."""
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

    def close(self) -> None:
        with self._lock:
            self._drop()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ---- plumbing ----------------------------------------------------------------

    def _call(
        self,
        encode: Callable[[int], bytes],
        expect: Kind,
        *,
        retry: bool,
        timeout_s: float | None = None,
        if_lost: str = "",
        reconnect_s: float | None = None,
    ) -> Frame:
        """Send one request and return its reply. `timeout_s`: how long to wait for
        this reply (None: `request_timeout`); `if_lost`: what ConnectionLost adds when
        the connection broke after the request was sent; `reconnect_s`: how long to
        retry connecting (None: `reconnect_s` of the client)."""
        with self._lock:
            attempts = 2 if retry else 1
            for attempt in range(attempts):
                if self._sock is not None and _closed_while_idle(self._sock):
                    self._drop()  # the server went away (say, restarted) since the last call
                if self._sock is None:
                    self._connect_with_backoff(reconnect_s)  # nothing of it is sent yet
                try:
                    if timeout_s is None:
                        return self._request(encode, expect)
                    return self._request_within(encode, expect, timeout_s)
                except OSError as exc:
                    self._drop()
                    if attempt + 1 < attempts:
                        continue  # idempotent: reconnect (with backoff) and send again
                    raise ConnectionLost(
                        f"the connection to the FT-layer server at {self.address} "
                        f"{_broke(exc, timeout_s or self._request_timeout)}"
                        f"{'; ' + if_lost if if_lost else ''}"
                    ) from exc
            raise AssertionError("unreachable")

    def _request_within(
        self, encode: Callable[[int], bytes], expect: Kind, timeout_s: float
    ) -> Frame:
        """`_request` with its own reply timeout; the connection's own is restored."""
        assert self._sock is not None
        self._sock.settimeout(timeout_s)
        try:
            return self._request(encode, expect)
        finally:
            if self._sock is not None:  # still connected: not dropped by an error
                self._sock.settimeout(self._request_timeout)

    def _connect_with_backoff(self, reconnect_s: float | None = None) -> None:
        """Connect and handshake, retrying refused or broken attempts with exponential
        backoff (50 ms doubling to 1 s) for up to `reconnect_s`: a restarting server is
        waited for, with a warning when retrying starts and then at most every
        RETRY_LOG_INTERVAL_S. A TLS error (an untrusted certificate, a plain-TCP
        server) is not retried (TLSMismatch, or ConnectionLost for another TLS alert),
        but a TLS connection the server cut during its handshake (a server at its
        connection limit, or restarting) is; authentication errors (ProtocolError) are
        not."""
        started = time.monotonic()
        budget = self._reconnect_s if reconnect_s is None else reconnect_s
        deadline = started + budget
        delay, tries = _FIRST_BACKOFF_S, 0
        while True:
            tries += 1
            try:
                self._connect()
            except (OSError, ServerBusy) as exc:
                self._drop()
                if isinstance(exc, ssl.SSLError) and not isinstance(exc, ssl.SSLEOFError):
                    raise self._tls_failure(exc) from exc
                now = time.monotonic()
                if now + delay > deadline:
                    raise ConnectionLost(
                        f"the connection to the FT-layer server at {self.address} could not "
                        f"be opened ({tries} attempts in {budget:g} s): {exc}"
                    ) from exc
                self._warn_retrying(exc, tries, now - started, deadline - now)
            else:
                if _retry_warned_at.pop((self._name, self.address), None) is not None:
                    log.warning(
                        "%s: reached the FT-layer server at %s again", self._name, self.address
                    )
                return
            time.sleep(delay)
            delay = min(2 * delay, _MAX_BACKOFF_S)

    def _warn_retrying(self, exc: BaseException, tries: int, spent_s: float, left_s: float) -> None:
        """The warning of a retry: at the first, then at most every RETRY_LOG_INTERVAL_S
        (across calls and clients of this name and address: a client that retries at
        every call, or a fresh client per call, warns no more often)."""
        now = time.monotonic()
        key = (self._name, self.address)
        warned = _retry_warned_at.get(key)
        if warned is not None and now - warned < RETRY_LOG_INTERVAL_S:
            return
        _retry_warned_at[key] = now
        until = (dt.datetime.now() + dt.timedelta(seconds=left_s)).strftime("%H:%M:%S")
        log.warning(
            "%s: cannot reach the FT-layer server at %s (%s); %s until %s (%.0f s more), "
            "then the call fails",
            self._name,
            self.address,
            exc,
            "retrying"
            if warned is None
            else f"still retrying after {tries} attempts in {spent_s:.0f} s,",
            until,
            left_s,
            extra=fields(address=self.address, attempts=tries, retry_s=round(left_s, 1)),
        )

    def _tls_failure(self, exc: ssl.SSLError) -> FTLayerError:
        """What a failed TLS handshake means, as the error to raise (never retried)."""
        where = f"the FT-layer server at {self.address}"
        if isinstance(exc, ssl.SSLCertVerificationError):
            problem = exc.verify_message or exc.reason or str(exc)
            if "mismatch" in problem.lower():
                return TLSMismatch(
                    f"the TLS certificate of {where} does not name {self.host} ({problem}): "
                    f"its subjectAltName must list the host or address clients connect to "
                    f"(the host in ft.address or --server)"
                )
            return TLSMismatch(
                f"the TLS certificate of {where} does not verify against {self._trusted} "
                f"({problem}): give the CA that signed the server's certificate "
                f"({_CA_HINT})"
            )
        if exc.reason in _NOT_TLS_REASONS:
            return TLSMismatch(
                f"{where} does not speak TLS (it answered the TLS handshake in plain TCP: "
                f"{exc.reason}): connect without a CA ({_CA_HINT}), or serve TLS "
                "(ftlayer serve --tls-cert and --tls-key)"
            )
        return ConnectionLost(f"the TLS connection to {where} could not be opened: {exc}")

    def _request(self, encode: Callable[[int], bytes], expect: Kind) -> Frame:
        rid = self._take_id()
        data = encode(rid)  # raises (BadRequest, FrameTooLarge) before anything is sent
        assert self._sock is not None
        self._sock.sendall(data)
        self.requests_sent[data[4]] += 1  # the kind byte of the frame head (>IBI)
        if trace.TRACE_PATH is None:
            return self._reply(rid, expect)
        sent = time.perf_counter()
        reply = self._reply(rid, expect)
        trace.note(Kind(data[4]).name, time.perf_counter() - sent, len(data))
        return reply

    def _take_id(self) -> int:
        rid = self._next_id
        self._next_id = 1 if rid >= MAX_U32 else rid + 1
        return rid

    def _reply(self, rid: int, expect: Kind) -> Frame:
        frame = self._receive()
        if frame.kind == Kind.ERROR:
            error = decode_error(frame)
            if frame.request_id == 0 or error.code in PROTOCOL_ERRORS:
                # The server may close after these; a fresh connection is in step.
                self._drop()
            raise error_for(error.code, error.message)
        if frame.request_id != rid or frame.kind != expect:
            self._drop()
            raise UnexpectedKind(
                f"expected {expect.name} for request {rid}, got kind 0x{frame.kind:02x} "
                f"for request {frame.request_id}: the connection was out of step"
            )
        return frame

    def _receive(self) -> Frame:
        assert self._sock is not None
        while not self._frames:
            assert self._received is not None
            data = self._received[: self._sock.recv_into(self._received)]
            if not data:
                raise ConnectionResetError("the server closed the connection")
            try:
                self._frames.extend(self._reader.feed(data))
            except ProtocolError:
                self._drop()
                raise
            error = self._reader.error
            if error is not None and not self._frames:
                self._drop()
                raise error
        return self._frames.popleft()

    def _connect(self) -> None:
        sock = socket.create_connection((self.host, self.port), timeout=self._connect_timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._tls is not None:
            try:
                sock = self._tls.wrap_socket(sock, server_hostname=self.host)
            except BaseException:
                sock.close()
                raise
        sock.settimeout(self._request_timeout)
        self._sock, self._reader, self._frames = sock, FrameReader(self.max_frame), deque()
        if self._received is None:
            self._received = memoryview(bytearray(_RECV_BYTES))
        try:
            client_nonce = new_nonce()
            try:
                hello = self._request(
                    lambda rid: encode_hello(rid, client_nonce, self._name), Kind.CHALLENGE
                )
            except ServerError as exc:
                if exc.code != ErrorCode.TLS_REQUIRED:
                    raise
                raise TLSMismatch(
                    f"the FT-layer server at {self.address} speaks TLS; give its CA "
                    f"certificate ({_CA_HINT})"
                ) from None
            challenge = decode_challenge(hello)
            if challenge.auth_required and self._token is None:
                raise NotAuthenticated(
                    f"the FT-layer server at {self.address} requires a token; none was "
                    f"given: {_TOKEN_HINT}"
                )
            digest = (
                bytes(DIGEST_SIZE)
                if self._token is None
                else auth_digest(self._token, challenge.server_nonce, client_nonce)
            )
            try:
                decode_welcome(self._request(lambda rid: encode_auth(rid, digest), Kind.WELCOME))
            except AuthFailed as exc:
                raise AuthFailed(
                    f"the FT-layer server at {self.address} refused the token ({exc}): "
                    f"{_TOKEN_HINT}"
                ) from None
        except BaseException:
            self._drop()
            raise
        self.connections += 1

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = None


def _broke(exc: OSError, timeout_s: float | None) -> str:
    if isinstance(exc, TimeoutError) and timeout_s is not None:
        return f"broke: timed out after {timeout_s:g} s"
    return f"broke: {exc}"
