"""One connection of an FTClient (ftlayer.client.connection, whose docstring is the
contract): opened lazily with its handshake, reopened with backoff after it broke or
the server closed it while idle, TLS checked and never retried when it cannot work;
one request sent and its reply read at a time, under one lock (`Link._call`). FTClient
adds the requests."""

from __future__ import annotations

import datetime as dt
import logging
import os
import select
import socket
import ssl
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from types import TracebackType
from typing import Final, Self

from ftlayer.errors import ConfigError, FTLayerError
from ftlayer.logs import fields
from ftlayer.wire import (
    DEFAULT_MAX_FRAME,
    DIGEST_SIZE,
    MAX_U32,
    AuthFailed,
    ErrorCode,
    Frame,
    FrameReader,
    Kind,
    NotAuthenticated,
    ProtocolError,
    UnexpectedKind,
    auth_digest,
    decode_challenge,
    decode_error,
    decode_welcome,
    encode_auth,
    encode_hello,
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

log = logging.getLogger("ftlayer.client")

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


class Link:
    """One connection to an FT-layer server and its requests' plumbing (module
    docstring)."""

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
        self.connections = 0
        """Connections opened so far (handshake done): replies got while it stays the
        same came over one connection, from one server process and its one store."""

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
