"""The FT-layer server's transport, items 1, 2 and 4 of ftlayer.server's contract:
accepting connections (at most `max_connections`: the next one is refused with ERROR
103, or only closed under TLS), a thread per connection, its TLS handshake (a client
whose first bytes are not a TLS handshake gets ERROR 104, in plain bytes, and the
close), its conversation (frames read with deadlines, requests answered one by one in their order,
a bad frame length breaking the stream), the handshake (HELLO, CHALLENGE, AUTH,
WELCOME; anything else before WELCOME refused by its kind), and the errors a request's
handler raises mapped to ERROR codes. A request's handler is found in the table of
ftlayer.server.handlers.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import ssl
import time
from typing import Final

from ftlayer.errors import ConfigError, FTLayerError, StorageError
from ftlayer.logs import fields
from ftlayer.threadnames import named_thread
from ftlayer.wire import (
    HANDSHAKE_KINDS,
    PROTOCOL_VERSION,
    REQUEST_KINDS,
    ErrorCode,
    Frame,
    FrameReader,
    Kind,
    NotAuthenticated,
    ProtocolError,
    UnexpectedKind,
    UnknownKind,
    check_auth,
    decode_auth,
    decode_hello,
    encode_challenge,
    encode_error,
    encode_welcome,
    kind_of,
)

from .state import _POLL_S, ServerState, _Connection

log = logging.getLogger("ftlayer.server")

_RECV_BYTES: Final = 256 << 10
"""A connection's receive buffer, made once: `recv(n)` would allocate n bytes a call
(and, this large, map and unmap them), where `recv_into` reuses it."""
_MAX_RECV_WAIT_S: Final = 2.0
"""The longest a connection's recv waits before it looks at the server's state again
(a connection opened while stop() ran, which stop() did not see)."""
_TLS_HANDSHAKE_RECORD: Final = 0x16
"""The first byte of every TLS connection: the content type of its ClientHello's record."""
_PLAIN_ON_TLS: Final = (
    "this FT-layer server speaks TLS: connect with TLS, trusting the CA that signed its "
    "certificate (the source option ft.tlsCa, or --tls-ca of the ftlayer command)"
)


class _PlainClient(Exception):
    """A client of a TLS server sent bytes that do not start a TLS handshake."""


class Transport(ServerState):
    """Accepting and serving connections; the requests go to `_request_handlers`."""

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:  # blocks until a client connects, or stop() shuts the listener down
                sock, peer_address = self._listener.accept()
            except OSError as exc:
                if self._stopping.is_set():
                    break
                # A client gone before its accept, or no file descriptor left: the
                # listener still serves the next one.
                log.warning("could not accept a connection: %s", exc)
                self._stopping.wait(_POLL_S)
                continue
            peer = f"{peer_address[0]}:{peer_address[1]}"
            with contextlib.suppress(OSError):  # small replies go out at once
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Connection(sock, peer)
            thread = named_thread(self._serve, "conn", (conn,), detail=peer)
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

    def _serve(self, conn: _Connection) -> None:
        log.info("connection from %s opened", conn.peer)
        reason = "closed by the client"
        try:
            if self._tls is not None:
                conn.sock = self._tls_handshake(conn)
            reason = self._converse(conn)
        except _PlainClient:
            log.warning(
                "%s: a plain-TCP client on this TLS server (it has no CA, ft.tlsCa or "
                "--tls-ca): told it so (ERROR 104)",
                conn.peer,
            )
            reason = "a plain-TCP client on a TLS server (ERROR 104)"
            with contextlib.suppress(OSError):
                self._send(conn, encode_error(0, ErrorCode.TLS_REQUIRED, _PLAIN_ON_TLS))
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
        """The TLS handshake, after a look at the first byte: _PlainClient if it does
        not start one (an ftlayer client without TLS sends HELLO, whose first byte is
        0), its bytes read, so that the close after the ERROR is not a reset that
        could drop the ERROR before the client reads it."""
        assert self._tls is not None
        conn.sock.settimeout(self._handshake_timeout_s)
        first = conn.sock.recv(1, socket.MSG_PEEK)
        if not first:  # a port probe (a load balancer's, Kubernetes'): nothing to log
            raise ConnectionAbortedError("closed by the client before its TLS handshake")
        if first[0] != _TLS_HANDSHAKE_RECORD:
            conn.sock.recv(_RECV_BYTES)
            raise _PlainClient
        tls = self._tls.wrap_socket(conn.sock, server_side=True, do_handshake_on_connect=False)
        with self._connections_lock:  # stop() must shut down the wrapped socket
            conn.sock = tls
        tls.do_handshake()
        return tls

    def _converse(self, conn: _Connection) -> str:
        """Serve one connection until it ends; returns why it ended."""
        reader = FrameReader(self.max_frame)
        received = memoryview(bytearray(_RECV_BYTES))
        frame_started: float | None = None  # when the first bytes of a partial frame came
        last_active = time.monotonic()  # the last byte received or reply sent
        while not self._stopping.is_set():
            conn.sock.settimeout(self._recv_timeout(conn, frame_started, last_active))
            try:
                data = received[: conn.sock.recv_into(received)]
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
                return "server stopping" if self._stopping.is_set() else "closed by the client"
            frames = reader.feed(data)
            for frame in frames:
                reply, close = self._handle(conn, frame)
                self._send(conn, reply)
                checkpoints = self._checkpoints
                begins = frame.kind in (Kind.CHECKPOINT_BEGIN, Kind.BATCH_BEGIN)
                if begins and checkpoints and checkpoints.has_writes:
                    # The checkpoint writer copies the state owed (unless the next
                    # change did), writes the base and completes what it can, all
                    # after this reply: the client goes on meanwhile. (Not after a
                    # COMPLETE: its record waits for the next BEGIN's write, which in a
                    # Spark job comes right after, rather than contend with it.)
                    self._checkpoints_queued.set()
                if close:
                    return "refused before the handshake completed"
            if reader.error is not None:
                if conn.client_nonce is None and data[0] == _TLS_HANDSHAKE_RECORD:
                    log.warning(
                        "%s: a TLS client on this plain-TCP server (the client has a CA, "
                        "ft.tlsCa or --tls-ca; this server has no --tls-cert)",
                        conn.peer,
                    )
                    self._send(conn, encode_error(0, reader.error.code, str(reader.error)))
                    return "a TLS client on a plain-TCP server"
                log.warning("%s: broken stream: %s", conn.peer, reader.error)
                self._send(conn, encode_error(0, reader.error.code, str(reader.error)))
                return f"broken stream ({reader.error.code.name})"
            last_active = time.monotonic()
            if not reader.pending_bytes:
                frame_started = None
            elif frame_started is None or frames:  # a new frame began in this chunk
                frame_started = last_active
        return "server stopping"

    def _recv_timeout(
        self, conn: _Connection, frame_started: float | None, last_active: float
    ) -> float:
        """How long a connection's next recv may wait: until its next deadline (the
        handshake's, a partial frame's, or the idle limit), at most _MAX_RECV_WAIT_S. An
        idle connection costs a wakeup per that, not per poll; stop() shuts every
        socket down, which ends a waiting recv at once."""
        if not conn.welcomed:
            deadline = conn.opened_at + self._handshake_timeout_s
        elif frame_started is not None:
            deadline = frame_started + self._frame_timeout_s
        else:
            deadline = last_active + self._idle_timeout_s
        return min(max(deadline - time.monotonic(), 0.0) + 0.01, _MAX_RECV_WAIT_S)

    def _send(self, conn: _Connection, data: bytes) -> None:
        conn.sock.settimeout(self._send_timeout_s)
        conn.sock.sendall(data)

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
            began = time.thread_time()
            try:
                return handler(rid, frame), False
            finally:
                self._request_costs.add(kind, time.thread_time() - began)
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


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already closed by the peer
        sock.shutdown(socket.SHUT_RDWR)
