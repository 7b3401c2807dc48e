"""Upstreams that cannot replay, with their receivers, for the demo and the kill tests.

An upstream here is a sender of `records` events and the receiver processes
(`ftlayer ingest KIND`, integration.receivers) that store them in the FT layer for the
`ftingest` source:

- `HttpUpstream`: a webhook sender (a thread) POSTs the events in JSON arrays of
  `chunk` records, each with its id, to one of the `ftlayer ingest http` processes; a
  record counts as acknowledged upstream once its request was answered 200. On a 503
  (the source is at its pending limit; `busy` counts them, `retry_after` keeps the
  values) it waits the Retry-After, on any other failure
  (a receiver killed mid-request) it sends the same records again, to a receiver that
  is alive: the ids make a second copy of a record already stored count as a duplicate
  the FT layer drops.
- `JetStreamUpstream`: the events published to a JetStream stream (its server keeps
  them) and `ftlayer ingest jetstream` processes on one durable pull consumer; a
  record counts as acknowledged upstream once the consumer's ack floor passed it.

`kill_receiver` SIGKILLs one receiver process and starts another in its place after
`restart_after_s`; `receivers_killed` counts the kills. `acked` is how many events were
acknowledged upstream, `done` whether all were.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final, Self

from ftlayer.errors import FTLayerError

from .child import log_tail

__all__ = ["HttpUpstream", "JetStreamUpstream", "Upstream", "UpstreamError"]

_START_TIMEOUT_S: Final = 30.0


class UpstreamError(FTLayerError):
    """An upstream or a receiver of it could not be started."""


Event = tuple[bytes, bytes]  # key, value


class Upstream:
    """A sender of events and its receiver processes (module docstring)."""

    kind = ""

    def __init__(
        self,
        ft_address: str,
        source: str,
        partitions: int,
        events: Sequence[Event],
        *,
        workdir: Path,
        receivers: int = 1,
        max_pending: int = 50_000,
        restart_after_s: float = 1.0,
    ) -> None:
        self.ft_address = ft_address
        self.source = source
        self.partitions = partitions
        self.events = events
        self.workdir = workdir
        self.max_pending = max_pending
        self.restart_after_s = restart_after_s
        self.receivers_killed = 0
        self._procs: list[subprocess.Popen[bytes] | None] = [None] * receivers
        self._started = 0
        self._started_as = [0] * receivers  # receiver i's log: receiver-i-<this>.log
        self._lock = threading.Lock()

    # ---- receivers ----

    def receiver_command(self, index: int) -> list[str]:
        raise NotImplementedError

    def _ready(self, index: int, line: str) -> None:
        """The receiver process `index` printed `line` once it serves."""

    def _start_receiver(self, index: int) -> None:
        log = self.workdir / f"receiver-{index}-{self._started}.log"
        self._started_as[index] = self._started
        self._started += 1
        with log.open("wb") as stderr:
            proc = subprocess.Popen(
                self.receiver_command(index), stdout=subprocess.PIPE, stderr=stderr
            )
        assert proc.stdout is not None
        line = _read_line(proc, _START_TIMEOUT_S)
        if not line.startswith(f"ftlayer ingest {self.kind} "):
            proc.kill()
            proc.wait()
            raise UpstreamError(
                f"receiver {index} did not start ({line!r}); its log: {log.read_text()[-2000:]}"
            )
        self._ready(index, line)
        with self._lock:
            self._procs[index] = proc

    def start_receivers(self) -> None:
        for index in range(len(self._procs)):
            self._start_receiver(index)

    def kill_receiver(self, index: int = 0) -> None:
        """SIGKILL receiver `index`, and start another in its place after
        `restart_after_s`."""
        with self._lock:
            proc, self._procs[index] = self._procs[index], None
        if proc is None:
            return
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        self.receivers_killed += 1
        time.sleep(self.restart_after_s)
        self._start_receiver(index)

    def check(self) -> None:
        """Raise UpstreamError if a receiver exited that nobody stopped, ending with its
        log (a receiver goes on through FT-layer outages: an exit is a failure)."""
        with self._lock:
            procs = list(enumerate(self._procs))
        dead = [(i, p) for i, p in procs if p is not None and p.poll() is not None]
        for index, proc in dead:
            log = self.workdir / f"receiver-{index}-{self._started_as[index]}.log"
            raise UpstreamError(
                f"receiver {index} exited with code {proc.returncode}{log_tail(log)}"
            )

    def logs(self) -> list[Path]:
        """Every receiver's log so far, oldest first."""
        return sorted(self.workdir.glob("receiver-*-*.log"), key=lambda p: p.stat().st_mtime)

    def receiver_pids(self) -> list[int]:
        with self._lock:
            return [p.pid for p in self._procs if p is not None]

    def close(self) -> None:
        with self._lock:
            procs, self._procs = self._procs, [None] * len(self._procs)
        for proc in procs:
            if proc is None:
                continue
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()

    # ---- the sender ----

    def start(self) -> None:
        """Start the receivers, then the sending."""
        raise NotImplementedError

    @property
    def acked(self) -> int:
        raise NotImplementedError

    @property
    def done(self) -> bool:
        return self.acked >= len(self.events)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class HttpUpstream(Upstream):
    """Webhooks: a sender thread and `ftlayer ingest http` receivers (module docstring)."""

    kind = "http"

    def __init__(self, *args: Any, chunk: int = 500, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.chunk = chunk
        self._addresses: list[str | None] = [None] * len(self._procs)
        self._acked = 0
        self.resent = 0  # requests sent again after a failure
        self.busy = 0  # 503 answers: the source was at its pending limit
        self.retry_after: set[float] = set()  # the Retry-After values of those answers
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def receiver_command(self, index: int) -> list[str]:
        return [
            sys.executable, "-m", "ftlayer.cli", "ingest", "http",
            "--server", self.ft_address, "--source", self.source,
            "--partitions", str(self.partitions), "--port", "0",
            "--max-pending", str(self.max_pending), "--max-body-bytes", str(16 << 20),
        ]  # fmt: skip

    def _ready(self, index: int, line: str) -> None:
        self._addresses[index] = line.split("http://", 1)[1].split("/", 1)[0]

    def kill_receiver(self, index: int = 0) -> None:
        self._addresses[index] = None
        super().kill_receiver(index)

    def start(self) -> None:
        self.start_receivers()
        self._thread = threading.Thread(target=self._send_all, name="http-upstream", daemon=True)
        self._thread.start()

    @property
    def acked(self) -> int:
        return self._acked

    def _send_all(self) -> None:
        try:
            for first in range(0, len(self.events), self.chunk):
                body = json.dumps(
                    [
                        {"key": key.decode(), "value": json.loads(value), "id": first + i}
                        for i, (key, value) in enumerate(self.events[first : first + self.chunk])
                    ]
                ).encode()
                n = min(self.chunk, len(self.events) - first)
                if not self._send(body, first):
                    return
                self._acked += n
        except BaseException as exc:  # reported by the demo, not lost in a thread
            self.error = exc

    def _send(self, body: bytes, first: int) -> bool:
        """POST `body` until a receiver answers 200; False once stopped."""
        tries = 0
        while not self._stop.is_set():
            live = [a for a in self._addresses if a is not None]
            if not live:
                time.sleep(0.1)
                continue
            address = live[(first // self.chunk + tries) % len(live)]
            tries += 1
            status, retry_after = _post(address, f"/sources/{self.source}", body)
            if status == 200:
                return True
            if status == 503:
                self.busy += 1
                self.retry_after.add(retry_after)
            if tries > 1 or status != 503:
                self.resent += 1
            time.sleep(retry_after if status == 503 else 0.1)
        return False

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        super().close()


def _post(address: str, path: str, body: bytes) -> tuple[int, float]:
    """(status, Retry-After seconds) of one POST; status 0 if the connection failed."""
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        reply = conn.getresponse()
        reply.read()
        return reply.status, float(reply.getheader("Retry-After") or 0.2)
    except (OSError, http.client.HTTPException):
        return 0, 0.0
    finally:
        conn.close()


class JetStreamUpstream(Upstream):
    """A JetStream stream holding the events and `ftlayer ingest jetstream` receivers on
    one durable pull consumer (module docstring)."""

    kind = "jetstream"

    def __init__(self, *args: Any, nats_url: str, stream: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.nats_url = nats_url
        self.stream = stream
        self.subject = f"{stream}.events"
        self.durable = f"{stream}-ftlayer"
        self._acked = 0
        self._checked_at = 0.0

    def receiver_command(self, index: int) -> list[str]:
        return [
            sys.executable, "-m", "ftlayer.cli", "ingest", "jetstream",
            "--server", self.ft_address, "--nats", self.nats_url, "--stream", self.stream,
            "--durable", self.durable, "--source", self.source,
            "--partitions", str(self.partitions), "--max-pending", str(self.max_pending),
            "--ack-wait", "5", "--key-header", "key",
        ]  # fmt: skip

    def start(self) -> None:
        _run(self._publish())
        self.start_receivers()

    async def _publish(self) -> None:
        """Create the stream and publish every event to it (the server keeps them)."""
        import nats

        nc = await nats.connect(self.nats_url)
        try:
            js = nc.jetstream()
            await js.add_stream(name=self.stream, subjects=[self.subject])
            window = 2000
            for first in range(0, len(self.events), window):
                acks = [
                    js.publish_async(self.subject, value, headers={"key": key.decode()})
                    for key, value in self.events[first : first + window]
                ]
                await asyncio.gather(*acks)
            await js.publish_async_completed()
        finally:
            await nc.close()

    @property
    def acked(self) -> int:
        now = time.monotonic()
        if now - self._checked_at >= 0.5:
            self._checked_at = now
            self._acked = max(self._acked, _run(self._ack_floor()))
        return self._acked

    async def _ack_floor(self) -> int:
        """How many of the stream's messages the receivers acknowledged, all of them
        below the consumer's ack floor."""
        import nats

        try:
            nc = await nats.connect(self.nats_url, allow_reconnect=False, connect_timeout=2)
        except Exception:  # the server gone or busy: what was seen stands
            return 0
        try:
            info = await nc.jetstream().consumer_info(self.stream, self.durable)
            return int(info.ack_floor.stream_seq or 0)
        except Exception:  # no consumer yet, or the server busy: ask again later
            return 0
        finally:
            await nc.close()


def _run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


def _read_line(proc: subprocess.Popen[bytes], timeout_s: float) -> str:
    """The first stdout line of `proc`, or '' after `timeout_s` or at its exit."""
    found: list[bytes] = []
    reader = threading.Thread(
        target=lambda: found.append(proc.stdout.readline() if proc.stdout else b""), daemon=True
    )
    reader.start()
    reader.join(timeout_s)
    return found[0].decode(errors="replace").strip() if found else ""
