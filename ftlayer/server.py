"""The FT-layer server: one FTLayer over LmdbStorage, hosted over TCP.

Sources and tasks reach the core through this process (docs/protocol.md is the wire
format). The contract:

1. One connection, one thread, at most `max_connections` of them (the next one gets
   ERROR 103 with request id 0 and is closed). The core is not thread-safe, so every
   call into it (persist, xor, fail, fetch_replay, current_stats, tick) runs under one
   lock. The LMDB commits of PERSIST and of the deletes run outside it (items 3 and 6),
   and an LMDB read under it never waits for a commit (LmdbStorage), so the requests of
   a stream wait for the core only while another one computes in it; only failed records
   (re-tagged for replay), registrations, dead-letter operations and a savepoint's
   deletes commit under the lock. Socket I/O never runs under it, so a slow or vanished
   client blocks only its own thread, and for a bounded time: the handshake (TLS
   included) must finish within `handshake_timeout_s`, a frame whose first bytes arrived
   must be complete within `frame_timeout_s`, a welcomed connection with no frame
   started is closed after `idle_timeout_s` without a byte, and a send must finish
   within `send_timeout_s`. Reads poll with a short timeout (to notice stop() and those
   deadlines).
2. Handshake: HELLO -> CHALLENGE (fresh server nonce) -> AUTH (checked with
   check_auth when a token is set) -> WELCOME. Until WELCOME, a frame of any other
   kind is refused by its kind before its body is decoded (ERROR 6 for a data
   request, 9 otherwise), and any error is answered and then the connection is closed.
3. PERSIST is answered OK only after the storage committed the records and they are
   pending in the core: OK means "confirmed persisted". It runs in three steps
   (FTLayer.begin_persist, end_persist): (a) under the lock the batch is checked and
   its roots reserved (a persist of the same roots is refused meanwhile); (b) outside
   it the records are written, in one LMDB transaction and one fsync with the other
   connections' persists waiting at that moment (group commit, LmdbStorage.put);
   (c) under the lock again the roots become pending, their timeouts start, the
   journal learns them, takeovers and barrier holds happen. Until (c) no other
   request sees the roots (events and fails for them are dropped as unknown: no
   client has them before the OK); a failed write (b) leaves nothing (the roots are
   free again, the client gets the error); a crash between (b) and (c) leaves stored
   records no journal knows, and the restart replays them (journal bases taken
   meanwhile do not count them as completed: ftlayer.core.journal).
4. Requests are answered one by one, in the order they arrive. A bad frame length
   breaks the stream: every complete frame before it is answered first, then ERROR
   with request id 0, then close. After WELCOME, a frame with a good length but a bad
   kind or body leaves the stream in step (docs/protocol.md, section 1): ERROR with
   that request id (an unknown kind is 3, a reply kind or a second HELLO 9, checked
   before the body is decoded), and serving goes on. A request is dispatched by the
   table in `_request_handlers`. Core errors map to ERROR 101 (StorageError) or 102
   (ValueError, ConfigError, PartitioningError: nothing applied); anything else is
   100 and is logged with its traceback. Other connections are never affected.
5. A ticker thread calls FTLayer.tick every min(0.5 s, rotation interval / 10), the
   shortest rotation interval of any timeout in use (sources may register their own),
   so a root times out at most that late.
6. Completed records are deleted from LMDB by the deleter thread, never in a PERSIST's
   transaction: it takes their seqs from the core (under the lock) as soon as a request
   left _DELETE_CHUNK of them, and at the latest every `delete_interval_s`, and deletes
   them outside the lock in transactions of their own of bounded work (`_delete_slices`:
   _DELETE_CHUNK scattered records, or up to 8 times as many that lie side by side, as
   a barrier's whole micro-batch does), each after the requests under way (the
   deleter's work can wait; theirs is what clients wait for): a persist waits for at
   most one of them, and usually for none. An
   XOR batch never waits for an LMDB commit. A completed record that a crash leaves
   undeleted is deleted at the restart if the journal knows its tree completed, and
   otherwise replayed (a duplicate, never a loss); a delete that fails is tried again;
   stop() deletes what is left before closing the storage.
7. Checkpoints (ftlayer.checkpoint): CHECKPOINT_BEGIN marks the state owed a copy
   and replies at once; the copy is taken under the lock before the next change to
   the core or by the checkpoint-writer thread (woken after the reply), which writes
   the snapshot to LMDB outside the lock. CHECKPOINT_DONE prunes and completes
   (unaligned) or starts aligning (aligned), staging the checkpoint's record in the
   store (it commits with the next write, or the ticker flushes it); the ticker
   completes aligning checkpoints once no root before their barrier is pending.
   `status` shows every query's checkpoints. A BEGIN also opens its sources' batch,
   its completion closes it, and HEARTBEAT (from the source's driver while the batch
   runs) leases it: its trees' timeouts are postponed while it is open and leased
   (ftlayer.core.leases; `status` shows `batches_running`).
8. Savepoints (ftlayer.checkpoint.savepoint): SAVEPOINT first deletes the completed
   records not deleted yet, under the lock (FTLayer.flush_deletes), and waits for those
   the deleter took before, so the store holds exactly the records whose trees are not
   complete (and those of persists under way: replayed after a restore); then, outside
   the lock, it copies the store (one LMDB read transaction: the store at one instant)
   into the requested directory on this host and replies with the savepoint's manifest.
   Every request goes on meanwhile, writes included (LmdbStorage.copy_to; only a write
   that must grow the LMDB map waits for the copy to end). One savepoint at a time: a
   SAVEPOINT that arrives while one is being written is refused (ERROR 102) rather than
   queued.

A non-loopback host without a token is refused (ConfigError): the token is the only
thing between the network and the acker table. With `tls_cert` and `tls_key` every
connection is TLS (the ssl module; TLS 1.2 at least): the handshake runs in the
connection's own thread within `handshake_timeout_s`, and a client that does not speak
TLS is logged and closed. The token still authenticates the client; TLS keeps the
records and ids private on the wire and proves the server's identity to clients that
check its certificate.

With `http_port`, an HTTP port (ftlayer.web) serves Prometheus metrics at /metrics and
a live status page at /, read-only: it reads the core under the lock as STATUS does
(`observe`) and changes nothing. It binds `http_host`, loopback by default. With a
token every HTTP request must carry it (bearer or basic auth; ftlayer.web.http). A
non-loopback `http_host` needs the token and TLS (HTTP sends the token itself, not a
proof of it, so only over TLS; the HTTP port then speaks HTTPS), or `http_public`:
then anyone who reaches the port reads the counters, source registrations and the dead
letters' coordinates and causes (never a payload), and nothing more, since nothing
there changes the server.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import ipaddress
import logging
import os
import secrets
import shutil
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Self

import numpy as np
from numpy.typing import NDArray

from ftlayer import __version__
from ftlayer.acking.rotating import rotation_interval
from ftlayer.checkpoint import SNAPSHOT_DIR, CheckpointCoordinator, CheckpointMode
from ftlayer.checkpoint.savepoint import Savepoint, create_savepoint
from ftlayer.core import FTLayer
from ftlayer.core.journal import JOURNAL_DIR, Journal
from ftlayer.core.retries import DeadLetterFilter, RetryPolicy, RetryRecord
from ftlayer.errors import ConfigError, FTLayerError, StorageError
from ftlayer.logs import fields
from ftlayer.persistence.lmdb_storage import LmdbStorage
from ftlayer.records import ReplayRecords
from ftlayer.wire import (
    DEFAULT_MAX_FRAME,
    HANDSHAKE_KINDS,
    NONCE_SIZE,
    PROTOCOL_VERSION,
    REQUEST_KINDS,
    BadRequest,
    CheckpointRequest,
    ErrorCode,
    Frame,
    FrameReader,
    Kind,
    NotAuthenticated,
    ProtocolError,
    SavepointRequest,
    UnexpectedKind,
    UnknownKind,
    check_auth,
    decode_auth,
    decode_checkpoint_begin,
    decode_checkpoint_done,
    decode_dead_letter_restore,
    decode_dead_letters,
    decode_fail,
    decode_fetch_replay,
    decode_heartbeat,
    decode_hello,
    decode_hold,
    decode_inspect,
    decode_persist,
    decode_register_source,
    decode_savepoint,
    decode_sink_hold,
    decode_sink_settle,
    decode_status_request,
    decode_xor,
    encode_challenge,
    encode_checkpoint_reply,
    encode_dead_letter_list,
    encode_error,
    encode_inspect_reply,
    encode_ok,
    encode_replay,
    encode_savepoint_created,
    encode_status_reply,
    encode_welcome,
    kind_of,
    new_nonce,
)

if TYPE_CHECKING:  # the HTTP port's modules load only with an HTTP port
    from ftlayer.web import DeadLetterRows, Observation, WebServer

log = logging.getLogger("ftlayer.server")

_STAGED_MAX_WAIT_S = 0.5  # staged checkpoint records commit within this on an idle store
# The deleter's transactions: at most this much work each (_delete_slices), so a
# persist waits for at most one; each waits for the requests under way
# (_after_requests), at most this long. A savepoint waits this long at most for a round
# the deleter took.
_DELETE_CHUNK: Final = 16_384
# A record whose seq follows the one deleted before it in the same transaction weighs
# this fraction of one that starts a run: a run of records lies in one chunk, or drops
# whole chunks, which LMDB does for far less than a chunk state rewritten per record.
_RUN_WEIGHT: Final = 8
_REQUESTS_FIRST_MAX_WAIT_S: Final = 1.0
_DELETES_MAX_WAIT_S: Final = 60.0
_EMPTY_SEQS: Final = np.zeros(0, dtype=np.uint64)

_RECV_BYTES: Final = 1 << 20
_POLL_S: Final = 0.25

Handler = Callable[[int, Frame], bytes]
"""A request's handler: (request id, frame) -> the reply frame; raises to refuse."""


def _is_loopback(host: str) -> bool:
    """True for a loopback address or "localhost" (names are not resolved otherwise)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Connection:
    """One client's handshake state; only its own thread touches it."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.name = ""
        self.server_nonce = new_nonce(NONCE_SIZE)
        self.client_nonce: bytes | None = None
        self.welcomed = False
        self.opened_at = time.monotonic()


class FTServer:
    """Hosts one FTLayer over LmdbStorage(data_dir); see the module docstring."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        host: str = "127.0.0.1",
        port: int = 0,
        timeout_s: float = 30.0,
        buckets: int = 3,
        token: bytes | None = None,
        max_frame: int = DEFAULT_MAX_FRAME,
        *,
        handshake_timeout_s: float = 10.0,
        frame_timeout_s: float = 30.0,
        idle_timeout_s: float = 600.0,
        send_timeout_s: float = 30.0,
        max_connections: int = 1024,
        delete_interval_s: float = 0.2,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        journal: bool = True,
        http_port: int | None = None,
        http_host: str = "127.0.0.1",
        http_public: bool = False,
    ) -> None:
        if token is not None and not token:
            raise ConfigError("the token is empty: give a non-empty token or none")
        if token is None and not _is_loopback(host):
            raise ConfigError(
                f"refusing to serve on non-loopback host {host!r} without a token: "
                "anyone who can reach it could ack or fail records (use --token-file)"
            )
        for name, value in (
            ("handshake_timeout_s", handshake_timeout_s),
            ("frame_timeout_s", frame_timeout_s),
            ("idle_timeout_s", idle_timeout_s),
            ("send_timeout_s", send_timeout_s),
        ):
            if not 0 < value < float("inf"):
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
        if isinstance(max_connections, bool) or max_connections < 1:
            raise ConfigError(f"max_connections must be at least 1, got {max_connections!r}")
        self._tls = _tls_context(tls_cert, tls_key)
        if http_port is not None:
            _check_http_bind(http_host, http_port, token, self._tls, http_public)
        self._interval_s = min(0.5, rotation_interval(timeout_s, buckets) / 10)
        FrameReader(max_frame)  # validates max_frame before anything is opened
        self.data_dir = os.fspath(data_dir)
        self.host = host
        self.port = port
        self.timeout_s = timeout_s
        self.buckets = buckets
        self.max_frame = max_frame
        self._token = token
        self._handshake_timeout_s = handshake_timeout_s
        self._frame_timeout_s = frame_timeout_s
        self._idle_timeout_s = idle_timeout_s
        self._send_timeout_s = send_timeout_s
        self.max_connections = max_connections
        self._delete_interval_s = delete_interval_s
        self._deletes_due = threading.Event()  # a request left completed records
        # The deleter's rounds (each: the seqs it took from the core, deleted outside
        # the lock): how many were taken and the last one done, and the records of the
        # running one not deleted yet. A savepoint waits for the round it raced.
        self._deletes_changed = threading.Condition()
        self._delete_rounds = 0
        self._deletes_done = 0
        self._deleting = 0
        # Requests begun and ended (but SAVEPOINT): the deleter lets those under way go
        # first (_after_requests).
        self._requests_changed = threading.Condition()
        self._requests_begun = 0
        self._requests_ended = 0
        self.journal = journal
        self._lock = threading.RLock()  # stop() holds it into write_pending
        self._stopping = threading.Event()
        self._storage: LmdbStorage | None = None
        self._ft: FTLayer | None = None
        self._checkpoints: CheckpointCoordinator | None = None
        self._checkpoints_queued = threading.Event()
        self._savepoint_lock = threading.Lock()  # one savepoint at a time
        self._savepoint_started = 0.0
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._connections: dict[int, _Connection] = {}
        self._connections_lock = threading.Lock()
        self._started_at = 0.0
        self._serve_lock: int | None = None
        self.http_port = http_port
        self.http_host = http_host
        self._http_public = http_public
        self._web: WebServer | None = None
        self._dead_letter_rows: tuple[tuple[int, ...], DeadLetterRows] | None = None
        self._request_handlers: dict[Kind, Handler] = {
            Kind.PERSIST: self._persist,
            Kind.XOR: self._xor,
            Kind.FAIL: self._fail,
            Kind.FETCH_REPLAY: self._fetch_replay,
            Kind.STATUS: self._status_request,
            Kind.REGISTER_SOURCE: self._register_source,
            Kind.CHECKPOINT_BEGIN: self._checkpoint_request,
            Kind.CHECKPOINT_DONE: self._checkpoint_request,
            Kind.SAVEPOINT: self._savepoint_request,
            Kind.DEAD_LETTERS: self._dead_letters,
            Kind.DEAD_LETTER_RESTORE: self._dead_letter_restore,
            Kind.HOLD: self._hold,
            Kind.HEARTBEAT: self._heartbeat,
            Kind.SINK_HOLD: self._sink_hold,
            Kind.SINK_SETTLE: self._sink_settle,
            Kind.INSPECT: self._inspect,
        }

    # ---- lifecycle ---------------------------------------------------------------

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) actually bound; the port is known once start() returned."""
        if self._listener is None:
            raise ConfigError("the server is not started")
        host, port = self._listener.getsockname()[:2]
        return str(host), int(port)

    def start(self) -> Self:
        """Open the storage (recovering what it holds), bind, and start serving."""
        if self._listener is not None:
            raise ConfigError("the server is already started")
        storage = LmdbStorage(self.data_dir)
        snapshots: LmdbStorage | None = None
        try:
            # One server per data dir: a second one would recover (and replay) what
            # the first one's jobs are processing. Taken before recovery writes.
            self._serve_lock = _lock_data_dir(self.data_dir)
            if not self.journal:  # an old journal would not know what happens from now on
                shutil.rmtree(os.path.join(self.data_dir, JOURNAL_DIR), ignore_errors=True)
            self._ft = FTLayer(
                storage,
                timeout_s=self.timeout_s,
                buckets=self.buckets,
                defer_deletes=True,
                journal=Journal(os.path.join(self.data_dir, JOURNAL_DIR)) if self.journal else None,
            )
            # Checkpoint snapshots: an LMDB environment of their own, without fsync (a
            # snapshot lost to an OS crash loses no record; see ftlayer.checkpoint).
            snapshots = LmdbStorage(os.path.join(self.data_dir, SNAPSHOT_DIR), sync=False)
            self._checkpoints = CheckpointCoordinator(
                self._ft, snapshots=snapshots, lock=self._lock
            )
            self._listener = _listen(self.host, self.port)
            if self.http_port is not None:
                self._web = self._web_server(self.http_port)
        except BaseException:
            if self._listener is not None:
                self._listener.close()
                self._listener = None
            self._ft = self._checkpoints = None
            self._release_serve_lock()
            storage.close()
            if snapshots is not None:
                snapshots.close()
            raise
        self._storage = storage
        self._listener.settimeout(_POLL_S)
        self._started_at = time.monotonic()
        stats = self._ft.current_stats()
        log.info(
            "serving %s on %s:%d (recovered %d pending records for replay; from the "
            "journal: %d restored pending, %d complete)",
            self.data_dir,
            *self.address,
            stats.failed["recovery"],
            stats.recovered_pending,
            stats.recovered_completed,
        )
        for target, name in (
            (self._accept_loop, "accept"),
            (self._tick_loop, "ticker"),
            (self._delete_loop, "deleter"),
            (self._checkpoint_write_loop, "checkpoint-writer"),
        ):
            thread = threading.Thread(target=target, name=f"ftlayer-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        if self._web is not None:
            self._web.start()
            log.info("HTTP on %s (/metrics, the status page at /)", self._web.url)
        return self

    def _web_server(self, port: int) -> WebServer:
        from ftlayer.web import WebServer

        return WebServer(
            self.http_host,
            port,
            observe=self.observe,
            dead_letters=self.dead_letter_rows,
            token=None if self._http_public else self._token,
            tls=self._tls,
        )

    @property
    def http_url(self) -> str | None:
        """The status page's URL (its port known once start() returned); None without
        an HTTP port."""
        return None if self._web is None else self._web.url

    def stop(self) -> None:
        """Close every socket, stop the ticker and close the storage. Idempotent."""
        if self._stopping.is_set() or self._listener is None:
            return
        self._stopping.set()
        self._deletes_due.set()  # the deleter stops waiting
        if self._web is not None:
            self._web.stop()
        self._listener.close()
        with self._connections_lock:
            connections = list(self._connections.values())
        for conn in connections:
            _shutdown(conn.sock)
        for thread in list(self._threads):
            thread.join(timeout=5.0)
        with self._lock:
            if self._ft is not None:
                marked = self._ft.persistence.marked
                try:
                    self._ft.flush_deletes()
                except StorageError as exc:
                    log.error(
                        "could not delete completed records (replayed at restart): %s",
                        exc,
                        extra=fields(count=marked),
                    )
            if self._checkpoints is not None:
                self._checkpoints.write_pending()
                self._checkpoints.snapshots.close()
            if self._storage is not None:
                self._storage.close()
            if self._ft is not None and self._ft.journal is not None:
                self._ft.journal.close()
            self._ft = self._checkpoints = None
            self._release_serve_lock()
        log.info("stopped")

    def _release_serve_lock(self) -> None:
        fd, self._serve_lock = self._serve_lock, None
        if fd is not None:
            os.close(fd)  # releases the flock

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ---- threads -----------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                sock, peer_address = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                break  # the listener was closed by stop()
            peer = f"{peer_address[0]}:{peer_address[1]}"
            with contextlib.suppress(OSError):  # small replies go out at once
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Connection(sock, peer)
            thread = threading.Thread(
                target=self._serve, args=(conn,), name=f"ftlayer-conn-{peer}", daemon=True
            )
            with self._connections_lock:
                full = len(self._connections) >= self.max_connections
                if not full:
                    self._connections[id(conn)] = conn
                    self._threads = [t for t in self._threads if t.is_alive()]
                    self._threads.append(thread)
            if full:
                _refuse(sock, peer, self.max_connections, tls=self._tls is not None)
            else:
                thread.start()

    def _tick_interval(self) -> float:
        """min(0.5 s, the shortest rotation interval in use / 10): sources may register
        timeouts shorter than the server's own."""
        ft = self._ft
        if ft is None:
            return self._interval_s
        return min(self._interval_s, ft.persistence.shortest_rotation_interval_s / 10)

    def _tick_loop(self) -> None:
        while not self._stopping.wait(self._tick_interval()):
            with self._lock:
                ft = self._ft
                if ft is None:
                    return
                try:  # the core logs the trees that time out, by source and partition
                    ft.tick()
                    if self._checkpoints is not None:
                        self._checkpoints.poll()
                except Exception:
                    log.exception("tick failed; the roots stay pending and are retried")
                    continue
                storage = self._storage
            if storage is not None:
                try:  # checkpoint records staged and no write since (ftlayer.checkpoint)
                    storage.flush_staged(older_than_s=_STAGED_MAX_WAIT_S)
                except StorageError as exc:
                    log.error("could not write staged checkpoint records: %s", exc)

    def _delete_loop(self) -> None:
        """Step 6 of the module docstring: take the completed records' seqs from the
        core (under the lock) as soon as a request left _DELETE_CHUNK of them, or
        every `delete_interval_s`, and delete them outside the lock, in transactions
        of their own of bounded work (`_delete_slices`), each after the requests
        under way. Seqs whose delete failed go back to the core, tried again after
        `delete_interval_s`."""
        while not self._stopping.is_set():
            self._deletes_due.wait(self._delete_interval_s)
            self._deletes_due.clear()
            if self._stopping.is_set():
                return  # stop() deletes what is left, under the lock
            with self._lock:
                ft, storage = self._ft, self._storage
                if ft is None or storage is None:
                    return
                seqs = ft.take_deletes()
                if not len(seqs):
                    continue
                with self._deletes_changed:
                    self._deleting = len(seqs)
                    self._delete_rounds += 1
                    round_ = self._delete_rounds
            left = seqs
            try:
                left = self._delete_chunks(storage, np.sort(seqs))
            except Exception:  # a bug: the thread goes on (deleting twice does no harm)
                log.exception("deleting completed records failed; they are tried again")
            finally:
                if len(left):
                    with self._lock:
                        if self._ft is not None:
                            self._ft.retry_deletes(left)
                with self._deletes_changed:
                    self._deleting = 0
                    self._deletes_done = round_
                    self._deletes_changed.notify_all()
            if len(left):
                self._stopping.wait(self._delete_interval_s)

    def _after_requests(self, timeout_s: float) -> None:
        """Until the requests under way now have ended (at most `timeout_s`): the
        deleter goes after them, and still gets its turn between them."""
        with self._requests_changed:
            begun = self._requests_begun
            self._requests_changed.wait_for(lambda: self._requests_ended >= begun, timeout_s)

    def _delete_chunks(self, storage: LmdbStorage, seqs: NDArray[np.uint64]) -> NDArray[np.uint64]:
        """Delete `seqs` (sorted) a slice per transaction; returns those not deleted."""
        for lo, hi in _delete_slices(seqs):
            self._after_requests(_REQUESTS_FIRST_MAX_WAIT_S)
            try:
                storage.delete(seqs[lo:hi])
            except StorageError as exc:
                log.error(
                    "could not delete completed records; they stay stored and are tried "
                    "again (a restart before that replays them: duplicates, not losses): %s",
                    exc,
                    extra=fields(count=len(seqs) - lo),
                )
                return seqs[lo:]
            with self._deletes_changed:
                self._deleting = len(seqs) - hi
        return _EMPTY_SEQS

    def _serve(self, conn: _Connection) -> None:
        log.info("connection from %s opened", conn.peer)
        reason = "closed by the client"
        try:
            if self._tls is not None:
                conn.sock = self._tls_handshake(conn)
            reason = self._converse(conn)
        except ssl.SSLError as exc:
            log.warning("%s: TLS handshake failed: %s", conn.peer, exc)
            reason = f"TLS handshake failed ({exc.reason or exc})"
        except OSError as exc:
            reason = f"socket error: {exc}"
        except Exception:
            log.exception("connection from %s failed", conn.peer)
            reason = "internal error"
        finally:
            with self._connections_lock:
                self._connections.pop(id(conn), None)
            _shutdown(conn.sock)
            conn.sock.close()
            log.info("connection from %s (%s) closed: %s", conn.peer, conn.name, reason)

    def _tls_handshake(self, conn: _Connection) -> ssl.SSLSocket:
        assert self._tls is not None
        conn.sock.settimeout(self._handshake_timeout_s)
        tls = self._tls.wrap_socket(conn.sock, server_side=True, do_handshake_on_connect=False)
        with self._connections_lock:  # stop() must shut down the wrapped socket
            conn.sock = tls
        tls.do_handshake()
        return tls

    def _converse(self, conn: _Connection) -> str:
        """Serve one connection until it ends; returns why it ended."""
        reader = FrameReader(self.max_frame)
        frame_started: float | None = None  # when the first bytes of a partial frame came
        last_active = time.monotonic()  # the last byte received or reply sent
        while not self._stopping.is_set():
            conn.sock.settimeout(_POLL_S)
            try:
                data = conn.sock.recv(_RECV_BYTES)
            except TimeoutError:
                now = time.monotonic()
                if not conn.welcomed and now - conn.opened_at > self._handshake_timeout_s:
                    return f"handshake not done within {self._handshake_timeout_s:g} s"
                if frame_started is not None and now - frame_started > self._frame_timeout_s:
                    return f"a frame not complete within {self._frame_timeout_s:g} s"
                idle = now - last_active > self._idle_timeout_s
                if conn.welcomed and frame_started is None and idle:
                    return f"idle for {self._idle_timeout_s:g} s"
                continue
            if not data:
                return "closed by the client"
            frames = reader.feed(data)
            for frame in frames:
                reply, close = self._handle(conn, frame)
                self._send(conn, reply)
                checkpoints = self._checkpoints
                if frame.kind == Kind.CHECKPOINT_BEGIN and checkpoints and checkpoints.has_writes:
                    # The checkpoint writer copies the state owed (unless the next
                    # change did), writes the snapshot and completes what it can, all
                    # after this reply: the client goes on meanwhile. (Not after a
                    # COMPLETE: its record waits for the next BEGIN's write, which in a
                    # Spark job comes right after, rather than contend with it.)
                    self._checkpoints_queued.set()
                if close:
                    return "refused before the handshake completed"
            if reader.error is not None:
                log.warning("%s: broken stream: %s", conn.peer, reader.error)
                self._send(conn, encode_error(0, reader.error.code, str(reader.error)))
                return f"broken stream ({reader.error.code.name})"
            last_active = time.monotonic()
            if not reader.pending_bytes:
                frame_started = None
            elif frame_started is None or frames:  # a new frame began in this chunk
                frame_started = last_active
        return "server stopping"

    def _send(self, conn: _Connection, data: bytes) -> None:
        conn.sock.settimeout(self._send_timeout_s)
        conn.sock.sendall(data)

    # ---- requests ----------------------------------------------------------------

    def _handle(self, conn: _Connection, frame: Frame) -> tuple[bytes, bool]:
        """(reply, close the connection after it) for one frame. The kind is checked
        before the body is decoded: only a request in its place gets decoded."""
        rid = frame.request_id
        try:
            kind = kind_of(frame)
            if kind not in REQUEST_KINDS:
                raise UnexpectedKind(f"{kind.name} is a reply kind, not a request")
            if not conn.welcomed:
                return self._handshake(conn, rid, kind, frame), False
            if kind in HANDSHAKE_KINDS:
                raise UnexpectedKind(f"{kind.name} after the handshake completed")
            handler = self._request_handlers.get(kind)
            if handler is None:
                raise UnknownKind(f"{kind.name} is not served by this server")
            if kind == Kind.SAVEPOINT:  # it waits for the deleter: the deleter does not
                return handler(rid, frame), False
            with self._requests_changed:
                self._requests_begun += 1
            try:
                return handler(rid, frame), False
            finally:
                with self._requests_changed:
                    self._requests_ended += 1
                    self._requests_changed.notify_all()
        except ProtocolError as exc:  # the frame, or a reply the wire cannot carry
            code, text = int(exc.code), str(exc)
        except StorageError as exc:
            code, text = int(ErrorCode.STORAGE), str(exc)
        except (ValueError, FTLayerError) as exc:
            code, text = int(ErrorCode.REJECTED), str(exc)
        except Exception as exc:
            log.exception("%s: request %d failed", conn.peer, rid)
            code, text = int(ErrorCode.INTERNAL), f"internal server error: {exc!r}"
        log.warning(
            "%s: request %d (kind 0x%02x): error %d: %s",
            conn.peer,
            rid,
            frame.kind,
            code,
            text,
            extra=fields(
                peer=conn.peer, client=conn.name, request_id=rid, kind=frame.kind, code=code
            ),
        )
        return encode_error(rid, code, text), not conn.welcomed

    def _handshake(self, conn: _Connection, rid: int, kind: Kind, frame: Frame) -> bytes:
        if kind not in HANDSHAKE_KINDS:
            raise NotAuthenticated(
                f"{kind.name} before the handshake completed: send HELLO and AUTH first"
            )
        if kind == Kind.HELLO and conn.client_nonce is None:
            hello = decode_hello(frame)
            conn.client_nonce, conn.name = hello.client_nonce, hello.client_name
            return encode_challenge(rid, self._token is not None, conn.server_nonce)
        if kind == Kind.AUTH and conn.client_nonce is not None:
            digest = decode_auth(frame).digest
            if self._token is not None:
                check_auth(self._token, conn.server_nonce, conn.client_nonce, digest)
            conn.welcomed = True
            return encode_welcome(rid, secrets.randbits(64), version=PROTOCOL_VERSION)
        expected = "AUTH" if conn.client_nonce is not None else "HELLO"
        raise UnexpectedKind(f"expected {expected} in the handshake, got {kind.name}")

    @contextlib.contextmanager
    def _core(self) -> Iterator[FTLayer]:
        """The core, under the lock; StorageError once the server is stopping. Wakes
        the deleter when a transaction's worth of completed records waits."""
        with self._lock:
            ft = self._ft
            if ft is None:
                raise StorageError("the server is stopping")
            try:
                yield ft
            finally:
                if ft.persistence.marked >= _DELETE_CHUNK:
                    self._deletes_due.set()

    def _persist(self, rid: int, frame: Frame) -> bytes:
        """Step 3 of the module docstring: checked and its roots reserved under the
        lock, stored (group commit) outside it, pending under it again; OK once all
        three are done."""
        message = decode_persist(frame)
        with self._core() as ft:
            ticket = ft.begin_persist(message.batch, message.initial_values)
            storage = self._storage
        assert storage is not None
        try:
            seqs = storage.put(message.batch)
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
        with self._core() as ft:
            ft.xor(message.roots, message.values)
        return encode_ok(rid, len(message.roots))

    def _hold(self, rid: int, frame: Frame) -> bytes:
        message = decode_hold(frame)
        with self._core() as ft:
            return encode_ok(rid, ft.hold(message.roots, message.values))

    def _sink_hold(self, rid: int, frame: Frame) -> bytes:
        message = decode_sink_hold(frame)
        with self._core() as ft:
            return encode_ok(rid, ft.sink_hold(message.key, message.roots, message.values))

    def _sink_settle(self, rid: int, frame: Frame) -> bytes:
        message = decode_sink_settle(frame)
        with self._core() as ft:
            return encode_ok(rid, ft.sink_settle(message.key, message.cause))

    def _heartbeat(self, rid: int, frame: Frame) -> bytes:
        message = decode_heartbeat(frame)
        with self._core() as ft:
            return encode_ok(rid, ft.heartbeat(message.source_ids, message.lease_ms / 1000))

    def _fail(self, rid: int, frame: Frame) -> bytes:
        message = decode_fail(frame)
        with self._core() as ft:
            return encode_ok(rid, ft.fail(message.roots, message.causes))

    def _fetch_replay(self, rid: int, frame: Frame) -> bytes:
        m = decode_fetch_replay(frame)
        with self._core() as ft:
            replay = ft.fetch_replay(m.lo, m.hi, source_id=m.source_id, partition=m.partition)
        return encode_replay(rid, _first_page(replay, self.max_frame), max_frame=self.max_frame)

    def _status_request(self, rid: int, frame: Frame) -> bytes:
        decode_status_request(frame)
        with self._core() as ft:
            status = self._status(ft)
        return encode_status_reply(rid, status, max_frame=self.max_frame)

    def _register_source(self, rid: int, frame: Frame) -> bytes:
        m = decode_register_source(frame)
        with self._core() as ft:
            ft.register_source(
                m.source_id,
                m.partitioner,
                m.num_partitions,
                m.options,
                m.timeout_s,
                None if m.retry is None else RetryPolicy.from_json(m.retry),
                m.dead_letter_topic,
                m.completion,
            )
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
        with self._core():
            checkpoint = self._checkpoint(message)
        return encode_checkpoint_reply(rid, checkpoint)

    def _savepoint_request(self, rid: int, frame: Frame) -> bytes:
        saved = self._savepoint(decode_savepoint(frame))  # takes the core lock only briefly
        return encode_savepoint_created(rid, saved.as_dict())

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
            raise ConfigError(
                f"another savepoint of this server is being written (for {running_s:.1f} s); "
                "it takes one at a time: send SAVEPOINT again once that one is done"
            )
        try:
            self._savepoint_started = time.monotonic()
            with self._lock:
                ft, storage = self._ft, self._storage
                if ft is None or storage is None:
                    raise StorageError("the server is stopping")
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
            saved = create_savepoint(storage, message.directory, message.name)
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

    def _checkpoint_write_loop(self) -> None:
        """Write queued checkpoint snapshots and records, outside the core lock: woken
        after a CHECKPOINT_BEGIN's reply; the records of checkpoints completed since
        go with that write, or, on an idle stream, within _POLL_S."""
        while not self._stopping.is_set():
            woken = self._checkpoints_queued.wait(_POLL_S)
            self._checkpoints_queued.clear()
            checkpoints = self._checkpoints
            if checkpoints is None:
                return
            if not woken and not checkpoints.has_writes:
                continue
            if checkpoints.write_pending():
                with self._lock:  # a checkpoint completed by its commit before the write
                    if self._checkpoints is not None:
                        self._checkpoints.poll()

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

    def _status(self, ft: FTLayer) -> dict[str, Any]:
        """Called under the lock."""
        status = dataclasses.asdict(ft.current_stats())
        assert self._storage is not None
        with self._connections_lock:
            connections = len(self._connections)
        status.update(
            pending_by_source={str(s): n for s, n in ft.pending_by_source().items()},
            stored_records=len(self._storage),
            deletes_pending=ft.persistence.marked + self._storage.staged_deletes + self._deleting,
            lmdb_size_bytes=self._storage.size_bytes(),
            connections=connections,
            max_connections=self.max_connections,
            uptime_s=round(time.monotonic() - self._started_at, 3),
            checkpoints={} if self._checkpoints is None else self._checkpoints.status(),
            sources=ft.source_specs(),
            timeout_s=self.timeout_s,
            buckets=self.buckets,
            version=__version__,
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


def _first_page(replay: ReplayRecords, max_frame: int) -> ReplayRecords:
    """The rows of `replay` that fit one REPLAY frame: all of them, or the longest
    prefix that ends at a replay seq boundary (a broadcast replay has one row per
    partition under one seq, and they travel together). The client asks again from the
    last seq it got (docs/protocol.md, 5.2). A first seq too large for a frame is left
    to the encoder's FrameTooLarge."""
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


def _check_http_bind(
    host: str, port: int, token: bytes | None, tls: ssl.SSLContext | None, public: bool
) -> None:
    """The HTTP port's bind rules (module docstring); ConfigError naming the way out."""
    if isinstance(port, bool) or not 0 <= port <= 65535:
        raise ConfigError(f"the HTTP port must be 0 to 65535, got {port!r}")
    if public or _is_loopback(host):
        return
    if token is None:
        raise ConfigError(
            f"refusing to serve HTTP on non-loopback host {host!r} without the token: give "
            "--token-file (and --tls-cert, --tls-key; every HTTP request must then carry "
            "the token), or --http-public to let anyone who reaches it read the status "
            "page and /metrics (read-only)"
        )
    if tls is None:
        raise ConfigError(
            f"refusing to serve HTTP with the token on non-loopback host {host!r} without "
            "TLS: HTTP sends the token itself, which would cross the network in the clear; "
            "give --tls-cert and --tls-key, or --http-public (read-only, no token)"
        )


def _tls_context(
    cert: str | os.PathLike[str] | None, key: str | os.PathLike[str] | None
) -> ssl.SSLContext | None:
    """A server TLS context from PEM files, or None without them; ConfigError if only one
    is given or they cannot be loaded."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise ConfigError(
            "TLS needs both a certificate and its private key (--tls-cert, --tls-key)"
        )
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(os.fspath(cert), os.fspath(key))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load the TLS certificate {cert} and key {key}: {exc}") from None
    return context


def _listen(host: str, port: int) -> socket.socket:
    try:
        return socket.create_server((host, port))
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def _refuse(sock: socket.socket, peer: str, limit: int, *, tls: bool) -> None:
    """Tell a connection over the limit so (ERROR 103, request id 0) and close it. A
    TLS connection is only closed: plain bytes would break its TLS handshake, and a
    handshake would cost a thread; its client sees the TLS handshake cut (EOF)."""
    log.warning("%s: refused: already %d connections (--max-connections)", peer, limit)
    if not tls:
        with contextlib.suppress(OSError):
            sock.settimeout(1.0)
            message = f"the server has its maximum of {limit} connections: try again later"
            sock.sendall(encode_error(0, ErrorCode.BUSY, message))
            sock.shutdown(socket.SHUT_WR)
    sock.close()


def _delete_slices(seqs: NDArray[np.uint64], limit: int = _DELETE_CHUNK) -> list[tuple[int, int]]:
    """[lo, hi) slices of `seqs` (sorted, distinct), one per delete transaction, each of
    at most `limit` in work: a record that starts a run of consecutive seqs
    weighs 1, one that goes on a run 1/_RUN_WEIGHT. Scattered completions (a record here
    and there in each chunk, each rewriting a chunk's state) go _DELETE_CHUNK at a
    time, as before; a barrier's micro-batch, one run of seqs over whole chunks that
    LMDB drops, goes in _RUN_WEIGHT times fewer transactions, each with its commit and
    fsync. Every slice holds at least one record."""
    n = len(seqs)
    if n == 0:
        return []
    starts = np.ones(n, dtype=np.int64)
    starts[1:] = np.diff(seqs) != 1
    work = np.cumsum(starts * (_RUN_WEIGHT - 1) + 1)  # in 1/_RUN_WEIGHT units
    slices: list[tuple[int, int]] = []
    lo, done = 0, 0
    while lo < n:  # each slice as long as the limit allows
        hi = max(lo + 1, int(np.searchsorted(work, done + limit * _RUN_WEIGHT, side="right")))
        slices.append((lo, hi))
        lo, done = hi, int(work[hi - 1])
    return slices


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already closed by the peer
        sock.shutdown(socket.SHUT_RDWR)


SERVE_LOCK_FILE: Final = "serve.lock"
"""In the data dir: held (flock) by the `ftlayer serve` that serves it, with its pid."""


def _lock_data_dir(data_dir: str | os.PathLike[str]) -> int:
    """Take the data dir's serve lock (an flock, which conflicts with another open of
    the file also within one process) and write this pid into it; the descriptor
    holds the lock until closed. ConfigError naming the holder if another server has
    it."""
    path = os.path.join(os.fspath(data_dir), SERVE_LOCK_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError(
            f"the data dir {os.fspath(data_dir)} is served by another `ftlayer serve` "
            f"(pid {holder}); one server per data dir: stop it first, or give this one "
            "a data dir of its own"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
