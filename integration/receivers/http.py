"""The HTTP receiver (`ftlayer ingest http`): webhooks made reliable.

A client POSTs records to `/sources/<name>`; the receiver answers 200 only once they are
durable in the FT layer (integration.receivers.Receiver.store), so a 200 means the
record will reach the query's sink or its dead letters, and anything else means it was
not stored: send it again. Bodies:

- `application/json`: one object or an array of objects `{"key": string or null,
  "value": any JSON, "id": integer >= 0 (optional)}`; a record's value is stored as its
  JSON text (UTF-8), its key as UTF-8.
- `application/octet-stream`: one record, the body its value; the `Ftlayer-Key` header
  its key, `Ftlayer-Id` its identity.

A record's `id` (or `Ftlayer-Id`) is its identity: sent again within the FT layer's
ingest window (a client that retried after a lost 200), it is stored once. The answer
is JSON `{"stored": n, "duplicates": d}`.

Errors, each a JSON `{"error": ...}` and nothing stored: 404 for a path that names no
source this receiver serves; 411 without a Content-Length; 413 for a body over
`max_body_bytes`; 415 for another content type; 400 for a body that is not such JSON, a
record without a key for a source that routes by key, or a bad identity; 503 with
`Retry-After` while the source has `max_pending` records pending (flow control: the
query is behind) or the FT layer cannot be reached.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Final

from ftlayer.errors import ConfigError, FTLayerError

from . import Message, Receiver

__all__ = ["DEFAULT_MAX_BODY_BYTES", "HttpReceiver"]

log = logging.getLogger("ftlayer.ingest.http")

DEFAULT_MAX_BODY_BYTES: Final = 1 << 20
_RETRY_AFTER_S: Final = 1
_PREFIX: Final = "/sources/"


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class HttpReceiver:
    """Serves `receivers` (by source name) on host:port until `stop` (module docstring)."""

    def __init__(
        self,
        receivers: Mapping[str, Receiver],
        host: str = "127.0.0.1",
        port: int = 0,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        if max_body_bytes < 1:
            raise ConfigError(f"max_body_bytes must be at least 1, got {max_body_bytes}")
        self.receivers = dict(receivers)
        self.max_body_bytes = max_body_bytes
        # A receiver's FT-layer client serves one request at a time.
        self._locks = {name: threading.Lock() for name in self.receivers}
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body: Mapping[str, Any]
                try:
                    status, body = 200, owner._post(self)
                except _Refused as exc:
                    status, body = exc.status, {"error": str(exc)}
                self._answer(status, body)

            def do_GET(self) -> None:
                self._answer(405, {"error": "POST records to /sources/<name>"})

            def _answer(self, status: int, body: Mapping[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if status == 503:
                    self.send_header("Retry-After", str(_RETRY_AFTER_S))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("%s " + format, self.address_string(), *args)

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def start(self) -> HttpReceiver:
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="ftlayer-ingest-http", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(10)

    def _post(self, request: BaseHTTPRequestHandler) -> dict[str, int]:
        path = request.path.split("?", 1)[0]
        name = path[len(_PREFIX) :] if path.startswith(_PREFIX) else None
        receiver = None if name is None else self.receivers.get(name)
        if receiver is None:
            raise _Refused(
                404,
                f"no source at {path!r}: POST to {_PREFIX}<name>, one of {sorted(self.receivers)}",
            )
        length_header = request.headers.get("Content-Length")
        if length_header is None:
            raise _Refused(411, "a Content-Length is required")
        try:
            length = int(length_header)
        except ValueError:
            raise _Refused(400, f"a bad Content-Length: {length_header!r}") from None
        if length > self.max_body_bytes:
            raise _Refused(413, f"a body of {length} bytes is over {self.max_body_bytes}")
        kind = (request.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        if kind not in ("application/json", "application/octet-stream"):
            raise _Refused(
                415,
                f"content type {kind or '(none)'!r}: send application/json or "
                "application/octet-stream",
            )
        body = request.rfile.read(length)
        if kind == "application/json":
            messages = _json_messages(body)
        else:
            messages = [_octet_message(body, request.headers)]
        assert name is not None
        try:
            with self._locks[name]:
                if not receiver.has_room():
                    raise _Refused(503, f"source {name!r} is at its limit of pending records")
                stored = receiver.store(messages, f"http:{name}")
        except ConfigError as exc:
            raise _Refused(400, str(exc)) from None
        except (FTLayerError, OSError) as exc:
            log.warning(
                "HTTP receiver: storing %d records of %r failed: %r", len(messages), name, exc
            )
            raise _Refused(503, f"the FT layer did not store them: {exc}") from None
        return {"stored": stored, "duplicates": len(messages) - stored}


def _json_messages(body: bytes) -> list[Message]:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _Refused(400, f"the body is not JSON: {exc}") from None
    items = data if isinstance(data, list) else [data]
    if not items:
        raise _Refused(400, "no records in the body")
    messages = []
    for item in items:
        if not isinstance(item, dict) or "value" not in item or set(item) - {"key", "value", "id"}:
            raise _Refused(
                400, 'each record is {"key": string or null, "value": any JSON, "id": integer}'
            )
        key = item.get("key")
        if key is not None and not isinstance(key, str):
            raise _Refused(400, f"a record's key is a string or null, got {key!r}"[:200])
        messages.append(
            Message(
                None if key is None else key.encode(),
                json.dumps(item["value"]).encode(),
                identity=_identity(item.get("id")),
            )
        )
    return messages


def _octet_message(body: bytes, headers: Any) -> Message:
    key = headers.get("Ftlayer-Key")
    raw_id = headers.get("Ftlayer-Id")
    try:
        identity = _identity(None if raw_id is None else int(raw_id))
    except ValueError:
        raise _Refused(400, f"Ftlayer-Id is an integer >= 0, got {raw_id!r}") from None
    return Message(None if key is None else key.encode(), body, identity=identity)


def _identity(value: object) -> int:
    if value is None:
        return -1
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise _Refused(400, f"a record's id is an integer from 0 to 2^63-1, got {value!r}")
    return value
