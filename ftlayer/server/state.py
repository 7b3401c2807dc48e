"""What every role of the FT-layer server shares (the contract is ftlayer.server's
docstring): its configuration, checked when a server is made (a token on a
non-loopback host, bounded timeouts and connections, the TLS files, the HTTP port's
bind rules), the one lock around the core (`_core`), the counters the deleter and the
requests keep for each other, and each connection's handshake state.

`ServerState` holds all of it; the roles (`Transport`, `RequestHandlers`, `Workers`)
are its subclasses and `FTServer` is all of them.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Final

from ftlayer.acking.rotating import rotation_interval
from ftlayer.checkpoint import CheckpointCoordinator
from ftlayer.checkpoint.fetch import SPOOL_IDLE_S
from ftlayer.core import FTLayer
from ftlayer.core.leases import DEFAULT_LAPSED_S, check_lapsed_s
from ftlayer.core.parked import ParkedFailures
from ftlayer.errors import ConfigError, StorageError
from ftlayer.persistence.lmdb_storage import LmdbStorage
from ftlayer.shards import ShardPlace
from ftlayer.wire import DEFAULT_MAX_FRAME, NONCE_SIZE, Frame, FrameReader, Kind, new_nonce

from .requestcosts import RequestCosts

if TYPE_CHECKING:  # the HTTP port's modules load only with an HTTP port
    from ftlayer.web import DeadLetterRows, WebServer

# The deleter's transactions: at most this much work each (ftlayer.server.workers), so
# a persist waits for at most one; a request that leaves this many completed records
# wakes the deleter (_core).
_DELETE_CHUNK: Final = 16_384
_POLL_S: Final = 0.25  # sockets and waits poll at this, to notice stop() and deadlines
# A worker with nothing to do (the deleter with no completed records, the checkpoint
# writer with nothing to write) waits for the request that gives it work (_core), and
# looks again after this at the latest: an idle server wakes a few times a minute.
_IDLE_WAIT_S: Final = 10.0
# Staged meta entries (checkpoint records, completed batch ranges) commit within this
# on an idle store; on a running stream the next batch's write carries them first, so
# a batch of up to this long costs one commit, not two.
_STAGED_MAX_WAIT_S: Final = 2.0
# A request wakes the ticker when its change brings work due more than this before the
# ticker would wake (it wakes a little after what it sleeps until, Workers._tick_loop).
_WAKE_SOONER_S: Final = 0.002

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


class ServerState:
    """The configuration and shared state of one FTServer (see ftlayer.server)."""

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
        journal_base_bytes: int | None = None,
        http_port: int | None = None,
        http_host: str = "127.0.0.1",
        http_public: bool = False,
        shard: ShardPlace | None = None,
        lapsed_batch_timeout_s: float = DEFAULT_LAPSED_S,
        spool_idle_s: float = SPOOL_IDLE_S,
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
        if not 0 < spool_idle_s < float("inf"):
            raise ConfigError(
                f"spool_idle_s must be a positive number of seconds, got {spool_idle_s!r}"
            )
        if isinstance(max_connections, bool) or max_connections < 1:
            raise ConfigError(f"max_connections must be at least 1, got {max_connections!r}")
        self._tls = _tls_context(tls_cert, tls_key)
        if http_port is not None:
            _check_http_bind(http_host, http_port, token, self._tls, http_public)
        self._interval_s = min(0.5, rotation_interval(timeout_s, buckets) / 10)
        FrameReader(max_frame)  # validates max_frame before anything is opened
        self.data_dir = os.fspath(data_dir)
        self.shard = ShardPlace() if shard is None else shard
        self.store_id = ""  # the store's id (ftlayer.server.shard), known once started
        self.host = host
        self.port = port
        self.timeout_s = timeout_s
        self.lapsed_batch_timeout_s = check_lapsed_s(lapsed_batch_timeout_s)
        """How long the trees of a batch whose heartbeat lease lapsed wait for their
        source's next barrier (ftlayer.core.leases)."""
        self.spool_idle_s = spool_idle_s
        """How long a savepoint part spooled for a client to fetch is kept after it was
        made or last read (ftlayer.checkpoint.fetch)."""
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
        # Workers waiting for work (_IDLE_WAIT_S), set and cleared under the lock: the
        # request that gives them some wakes them (_wake_workers).
        self._deleter_idle = False
        self._writer_idle = False
        self._checkpoint_writes_due = threading.Event()
        # The ticker sleeps until its next work (Workers._tick_loop), which it sets here
        # (time.monotonic, under the lock); a request whose change brings work sooner
        # wakes it (_wake_workers) to work out its sleep again.
        self._tick_due = threading.Event()
        self._ticker_wakes_at = 0.0
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
        self._request_costs = RequestCosts()  # STATUS `requests`
        self.journal = journal
        self.journal_base_bytes = journal_base_bytes
        self._lock = threading.RLock()  # stop() holds it into write_pending
        self._stopping = threading.Event()
        self._storage: LmdbStorage | None = None
        self._parked: ParkedFailures | None = None  # other shards' failures kept here
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
        self._request_handlers: dict[Kind, Handler] = self._handlers()

    def _handlers(self) -> dict[Kind, Handler]:
        """The table from request kind to handler (ftlayer.server.handlers); without
        one, every request kind is refused as not served."""
        return {}

    @contextlib.contextmanager
    def _core(self, *, noted: bool = True) -> Iterator[FTLayer]:
        """The core, under the lock; StorageError once the server is stopping. Wakes
        the workers the change gave work (`_wake_workers`). First applies the failures
        noted by FAILs (ftlayer.core.failnotes) unless `noted` is False: requests that
        neither read nor change what they concern (a FAIL, a HEARTBEAT, BATCH_RANGES,
        FETCH_REPLAY, a brief STATUS), or that take them as they are (a barrier's
        ranges wait for them, UNFILLED lists them, FILL applies them with their
        bytes)."""
        with self._lock:
            ft = self._ft
            if ft is None:
                raise StorageError("the server is stopping")
            try:
                if noted and ft.has_noted:
                    ft.apply_noted()
                yield ft
            finally:
                self._wake_workers(ft)

    def _wake_workers(self, ft: FTLayer) -> None:
        """After a change to the core (the caller holds the lock): wake the deleter
        when a transaction's worth of completed records waits, or when it sleeps and
        the first ones came; the checkpoint writer when it sleeps and something waits
        to be written."""
        marked = ft.persistence.marked
        if marked >= _DELETE_CHUNK or (marked and self._deleter_idle):
            self._deleter_idle = False
            self._deletes_due.set()
        checkpoints = self._checkpoints
        if self._writer_idle and checkpoints is not None and checkpoints.has_writes:
            self._writer_idle = False
            self._checkpoint_writes_due.set()
        if not self._tick_due.is_set() and (
            self._ticker_wakes_at - time.monotonic() > self._tick_delay(ft) + _WAKE_SOONER_S
        ):
            self._tick_due.set()

    def _tick_delay(self, ft: FTLayer) -> float:
        """Seconds until the ticker has work (the caller holds the lock): the core's
        (FTLayer.tick_delay), an aligning checkpoint's poll (every `_interval_s`),
        staged writes due a commit (`_STAGED_MAX_WAIT_S` after the first)."""
        delay = ft.tick_delay()
        if self._checkpoints is not None and self._checkpoints.aligning:
            delay = min(delay, self._interval_s)
        since = ft.staged_since()
        if since is not None:
            delay = min(delay, since + _STAGED_MAX_WAIT_S - time.monotonic())
        return delay


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
