"""FTClient: a blocking client of the FT-layer server (docs/protocol.md).

One connection, opened lazily with its handshake (HELLO, CHALLENGE, AUTH, WELCOME) on
the first call. Every call sends one request and waits for its reply, under one lock,
so a client may be shared by threads (they take turns). It is an FTChannel: Persister,
XorHandler and TaskHandler work over it exactly as over an in-process FTLayer.

- persist returns only after the server's OK, which it sends only once the storage
  committed the records: a source that emits after persist() never emits an
  unpersisted record.
- A broken connection is retried once, after a short backoff, for the idempotent calls
  only (status, fetch_replay). persist, xor and fail raise ConnectionLost instead: the
  request may or may not have been applied, and only the caller knows whether to
  resend. The next call reconnects.
- An ERROR reply raises: the matching ProtocolError subclass for codes 1-9,
  ServerStorageError for 101, RequestRejected (a ValueError) for 102, ServerError
  otherwise; each carries the server's message.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import Any, Final, Self, TypeVar

from numpy.typing import ArrayLike

from ftlayer.core import ReplayRecords
from ftlayer.errors import ConfigError, FTLayerError, StorageError
from ftlayer.protocol import (
    DEFAULT_MAX_FRAME,
    DIGEST_SIZE,
    MAX_U32,
    AuthFailed,
    BadRequest,
    ErrorCode,
    Frame,
    FrameReader,
    FrameTooLarge,
    Kind,
    MalformedFrame,
    NotAuthenticated,
    ProtocolError,
    ReservedKind,
    UnexpectedKind,
    UnknownKind,
    UnsupportedVersion,
    auth_digest,
    decode_challenge,
    decode_error,
    decode_ok,
    decode_replay,
    decode_status_reply,
    decode_welcome,
    encode_auth,
    encode_fail,
    encode_fetch_replay,
    encode_hello,
    encode_persist,
    encode_status_request,
    encode_xor,
    new_nonce,
)
from ftlayer.records import RecordBatch

T = TypeVar("T")

_RETRY_BACKOFF_S: Final = 0.2
_RECV_BYTES: Final = 1 << 20
_PROTOCOL_ERRORS: Final[dict[int, type[ProtocolError]]] = {
    cls.code: cls
    for cls in (
        MalformedFrame,
        FrameTooLarge,
        UnknownKind,
        UnsupportedVersion,
        AuthFailed,
        NotAuthenticated,
        BadRequest,
        ReservedKind,
        UnexpectedKind,
    )
}


class ServerError(FTLayerError):
    """The server answered ERROR with a code of 100 or more; `code` is that code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"server error {code}: {message}")
        self.code = code


class ServerStorageError(ServerError, StorageError):
    """ERROR 101: the server's storage refused the write; nothing was persisted."""


class RequestRejected(ServerError, ValueError):
    """ERROR 102: the core refused the request (reserved or repeated root, a record its
    partitioner cannot route); nothing was applied."""


class ConnectionLost(FTLayerError):
    """The connection broke before the reply: the request may or may not be applied."""


def parse_address(address: str) -> tuple[str, int]:
    """ "host:port" (or "[v6]:port") as (host, port); ConfigError if it is not one."""
    host, sep, port_text = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(f"server address must be HOST:PORT, got {address!r}")
    return host, int(port_text)


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
    ) -> None:
        self.host, self.port = parse_address(address)
        self.address = address
        self._token = token
        self._connect_timeout = connect_timeout
        self._request_timeout = request_timeout
        self._name = name if name is not None else f"client@{socket.gethostname()}:{os.getpid()}"
        self.max_frame = max_frame
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._reader = FrameReader(max_frame)
        self._frames: deque[Frame] = deque()
        self._next_id = 1
        self.session_id: int | None = None

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

    def fail(self, roots: ArrayLike) -> int:
        """Fail roots explicitly; returns how many were pending (and are now replayed)."""
        frame = self._call(
            lambda rid: encode_fail(rid, roots, max_frame=self.max_frame), Kind.OK, retry=False
        )
        return decode_ok(frame).count

    # ---- idempotent reads --------------------------------------------------------

    def fetch_replay(
        self, lo: int, hi: int, source_id: int | None = None, partition: int | None = None
    ) -> ReplayRecords:
        """`FTLayer.fetch_replay` on the server: records with lo < replay seq <= hi."""
        frame = self._call(
            lambda rid: encode_fetch_replay(rid, lo, hi, source_id=source_id, partition=partition),
            Kind.REPLAY,
            retry=True,
        )
        return decode_replay(frame)

    def status(self) -> dict[str, Any]:
        """The server's counters (FTStats fields, lmdb_size_bytes, connections, ...)."""
        frame = self._call(encode_status_request, Kind.STATUS_REPLY, retry=True)
        return decode_status_reply(frame).status

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

    def _call(self, encode: Callable[[int], bytes], expect: Kind, *, retry: bool) -> Frame:
        with self._lock:
            attempts = 2 if retry else 1
            for attempt in range(attempts):
                connected = self._sock is not None
                try:
                    if not connected:
                        self._connect()
                    return self._request(encode, expect)
                except OSError as exc:
                    self._drop()
                    if attempt + 1 < attempts:
                        time.sleep(_RETRY_BACKOFF_S)
                        continue
                    what = "broke" if connected else "could not be opened"
                    raise ConnectionLost(
                        f"the connection to the FT-layer server at {self.address} {what}: {exc}"
                    ) from exc
            raise AssertionError("unreachable")

    def _request(self, encode: Callable[[int], bytes], expect: Kind) -> Frame:
        rid = self._take_id()
        data = encode(rid)  # raises (BadRequest, FrameTooLarge) before anything is sent
        assert self._sock is not None
        self._sock.sendall(data)
        return self._reply(rid, expect)

    def _take_id(self) -> int:
        rid = self._next_id
        self._next_id = 1 if rid >= MAX_U32 else rid + 1
        return rid

    def _reply(self, rid: int, expect: Kind) -> Frame:
        frame = self._receive()
        if frame.kind == Kind.ERROR:
            error = decode_error(frame)
            if frame.request_id == 0 or error.code in _PROTOCOL_ERRORS:
                # The server may close after these; a fresh connection is in step.
                self._drop()
            raise _error_for(error.code, error.message)
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
            data = self._sock.recv(_RECV_BYTES)
            if not data:
                raise ConnectionResetError("the server closed the connection")
            try:
                self._frames.extend(self._reader.feed(data))
            except ProtocolError:
                self._drop()
                raise
        return self._frames.popleft()

    def _connect(self) -> None:
        sock = socket.create_connection((self.host, self.port), timeout=self._connect_timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(self._request_timeout)
        self._sock, self._reader, self._frames = sock, FrameReader(self.max_frame), deque()
        try:
            client_nonce = new_nonce()
            hello = self._request(
                lambda rid: encode_hello(rid, client_nonce, self._name), Kind.CHALLENGE
            )
            challenge = decode_challenge(hello)
            if challenge.auth_required and self._token is None:
                raise NotAuthenticated(
                    f"the FT-layer server at {self.address} requires a token; none was given"
                )
            digest = (
                bytes(DIGEST_SIZE)
                if self._token is None
                else auth_digest(self._token, challenge.server_nonce, client_nonce)
            )
            welcome = decode_welcome(
                self._request(lambda rid: encode_auth(rid, digest), Kind.WELCOME)
            )
        except BaseException:
            self._drop()
            raise
        self.session_id = welcome.session_id

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = None
        self.session_id = None


def _error_for(code: int, message: str) -> FTLayerError:
    protocol_error = _PROTOCOL_ERRORS.get(code)
    if protocol_error is not None:
        return protocol_error(f"server: {message}")
    if code == ErrorCode.STORAGE:
        return ServerStorageError(code, message)
    if code == ErrorCode.REJECTED:
        return RequestRejected(code, message)
    return ServerError(code, message)
