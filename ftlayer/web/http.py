"""The HTTP port of `ftlayer serve`: /metrics, the status page and its JSON.

Routes (GET only; nothing here changes the server):

- `/metrics`: the Prometheus text format (OpenMetrics when the scraper asks for it),
  from `ftlayer.web.metrics`, read at scrape time.
- `/`: the status page (`static/index.html` with `app.js` and `style.css` under
  `/static/`), which polls `/api/status` once a second.
- `/api/status[?since=T]`: `{"now", "status", "history", "dead_letters"}`: the STATUS
  reply (docs/protocol.md, 6.2), the samples taken after wall time T (all kept, without
  T), and the oldest dead letters without their payloads.

A sampler thread takes one sample a second (counters and gauges of the STATUS reply),
keeping the last `history_s` seconds, so the page charts the minutes before it was
opened. Each request is served in a thread of its own (socketserver's ThreadingMixIn):
a slow client holds only its thread, and for at most REQUEST_TIMEOUT_S per read. With
`token`, every request must carry it, as `Authorization: Bearer <token>` or as the
password of HTTP basic auth (any user name; browsers ask for it); with `tls`, the port
speaks HTTPS only (the TLS handshake runs in the request's thread). Which binds need
which is FTServer's rule (ftlayer.server, module docstring).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hmac
import json
import logging
import socket
import socketserver
import ssl
import sys
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any, Final, Self

from prometheus_client.exposition import choose_encoder

from ftlayer.errors import ConfigError, FTLayerError
from ftlayer.threadnames import named_thread

from .metrics import registry
from .observation import DeadLetterRows, Observation

__all__ = ["SAMPLE_FIELDS", "WebServer"]

log = logging.getLogger("ftlayer.web")

SAMPLE_FIELDS: Final = (
    "t",
    "persisted",
    "completed",
    "failed",
    "replayed",
    "dead_lettered",
    "pending",
    "replay_queue",
    "retry_waiting",
)
"""The columns of a history sample: wall time (UNIX seconds), then STATUS figures
(`failed`: every cause together)."""

_STATIC_TYPES: Final = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
_SECURITY_HEADERS: Final = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
DEAD_LETTERS_SHOWN: Final = 50
REQUEST_TIMEOUT_S: Final = 10.0
"""A request's every read (TLS handshake included) must finish within this."""


class WebServer:
    """One HTTP port over a server's observations; see the module docstring. Binds in
    the constructor (ConfigError if it cannot), serves from start() until stop()."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        observe: Callable[[], Observation],
        dead_letters: Callable[[int], DeadLetterRows],
        token: bytes | None = None,
        tls: ssl.SSLContext | None = None,
        sample_interval_s: float = 1.0,
        history_s: float = 900.0,
    ) -> None:
        self._observe = observe
        self._dead_letters = dead_letters
        self._token = token
        self._tls = tls
        self._registry = registry(observe)
        self._static = _load_static()
        self.sample_interval_s = sample_interval_s
        self._history: deque[tuple[float, ...]] = deque(
            maxlen=max(2, int(history_s / sample_interval_s))
        )
        self._history_lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        try:
            self._httpd = _HTTPServer(host, port, self)
        except OSError as exc:
            raise ConfigError(
                f"cannot serve HTTP on {host}:{port}: {exc.strerror or exc}"
            ) from None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._httpd.server_address[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        host, port = self.address
        shown = f"[{host}]" if ":" in host else host
        return f"{'https' if self._tls else 'http'}://{shown}:{port}/"

    def start(self) -> Self:
        for target, name in ((self._serve, "http"), (self._sample_loop, "sampler")):
            thread = named_thread(target, name)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        """Stop serving and sampling, and close the port. Idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self._threads:
            self._httpd.shutdown()
        self._httpd.server_close()
        for thread in self._threads:
            thread.join(timeout=5.0)

    def _serve(self) -> None:
        self._httpd.serve_forever(poll_interval=0.25)

    # ---- history -------------------------------------------------------------------

    def _sample_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                status = self._observe().status
            except FTLayerError:
                return  # the server is stopping
            except Exception:
                log.exception("could not take a sample for the status page")
            else:
                sample = (
                    round(time.time(), 3),
                    status["persisted"],
                    status["completed"],
                    sum(status["failed"].values()),
                    status["replayed"],
                    status["dead_lettered"],
                    status["pending"],
                    status["replay_queue"],
                    status["retry_waiting"],
                )
                with self._history_lock:
                    self._history.append(sample)
            self._stopping.wait(self.sample_interval_s)

    def history(self, since: float | None = None) -> list[tuple[float, ...]]:
        """The samples taken after wall time `since` (all kept, without it), oldest first."""
        with self._history_lock:
            samples = list(self._history)
        return samples if since is None else [s for s in samples if s[0] > since]

    # ---- requests ------------------------------------------------------------------

    def authorized(self, header: str | None) -> bool:
        """Whether an Authorization header carries the token (always, without one)."""
        if self._token is None:
            return True
        if not header:
            return False
        scheme, _, value = header.strip().partition(" ")
        given: bytes | None = None
        if scheme.lower() == "bearer":
            given = value.strip().encode("latin-1", "replace")  # http.server's decoding
        elif scheme.lower() == "basic":
            with contextlib.suppress(binascii.Error, ValueError):
                given = base64.b64decode(value.strip(), validate=True).partition(b":")[2]
        return given is not None and hmac.compare_digest(given, self._token)

    def respond(self, path: str, accept: str | None) -> tuple[int, str, bytes]:
        """(HTTP status, content type, body) of a GET of `path`."""
        url = urllib.parse.urlsplit(path)
        route = url.path
        if route in ("/", "/index.html"):
            route = "/static/index.html"
        if route.startswith("/static/") and route[len("/static/") :] in self._static:
            content_type, body = self._static[route[len("/static/") :]]
            return 200, content_type, body
        if route == "/metrics":
            encoder, content_type = choose_encoder(accept or "")
            return 200, content_type, encoder(self._registry)
        if route == "/api/status":
            query = urllib.parse.parse_qs(url.query)
            try:
                since = float(query["since"][0]) if "since" in query else None
            except ValueError:
                return 400, "text/plain; charset=utf-8", b"since: a UNIX time in seconds\n"
            return 200, "application/json", self._api_status(since)
        return 404, "text/plain; charset=utf-8", b"not found\n"

    def _api_status(self, since: float | None) -> bytes:
        observation = self._observe()
        letters = self._dead_letters(DEAD_LETTERS_SHOWN)
        body = {
            "now": time.time(),
            "status": observation.status,
            "history": {
                "interval_s": self.sample_interval_s,
                "fields": list(SAMPLE_FIELDS),
                "rows": self.history(since),
            },
            "dead_letters": {"total": letters.total, "rows": letters.rows},
        }
        return json.dumps(body, allow_nan=False, separators=(",", ":")).encode()


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, host: str, port: int, web: WebServer) -> None:
        self.web = web
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind would resolve the host's name (socket.getfqdn): a DNS
        # lookup that can take seconds; nothing here uses the name.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, peer = super().get_request()
        tls = self.web._tls
        if tls is not None:  # the handshake runs in the request's thread (_Handler.setup)
            sock = tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, peer

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, OSError):  # a client gone, or not speaking TLS: its own loss
            log.info("HTTP from %s: %s", client_address[0], error)
        else:
            log.warning("HTTP request from %s failed", client_address[0], exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    protocol_version = "HTTP/1.1"
    timeout = REQUEST_TIMEOUT_S

    def setup(self) -> None:
        if isinstance(self.request, ssl.SSLSocket):
            self.request.settimeout(self.timeout)
            self.request.do_handshake()  # a failure: handle_error logs it
        super().setup()

    def do_GET(self) -> None:
        web = self.server.web
        if not web.authorized(self.headers.get("Authorization")):
            self._send(401, "text/plain; charset=utf-8", b"the token is required\n", auth=True)
            return
        try:
            status, content_type, body = web.respond(self.path, self.headers.get("Accept"))
        except FTLayerError as exc:  # the server is stopping
            status, content_type, body = 503, "text/plain; charset=utf-8", f"{exc}\n".encode()
        self._send(status, content_type, body)

    def _send(self, status: int, content_type: str, body: bytes, *, auth: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in _SECURITY_HEADERS.items():
            self.send_header(name, value)
        if auth:
            self.send_header("WWW-Authenticate", 'Basic realm="ftlayer", charset="UTF-8"')
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("HTTP %s: " + format, self.client_address[0], *args)


def _load_static() -> dict[str, tuple[str, bytes]]:
    """The page's files, from the package (no build step; nothing fetched elsewhere)."""
    folder = resources.files("ftlayer.web") / "static"
    return {name: (kind, (folder / name).read_bytes()) for name, kind in _STATIC_TYPES.items()}
