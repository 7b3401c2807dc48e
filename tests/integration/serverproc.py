"""Starting a real `ftlayer serve` process in tests: the command, its address, a handle;
stopping a child process; the records a source's readers would fetch."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ftlayer.client import FTClient
from ftlayer.integration.harness.ftprocess import (
    read_http_url,
    read_serving_address,
    serve_command,
)
from ftlayer.payloads import decode_payloads

__all__ = [
    "Server",
    "StartServer",
    "queued_records",
    "read_address",
    "read_http",
    "serve_command",
    "stop_process",
    "terminated",
]

START_DEADLINE_S = 60.0
"""A server starts in about 2 s on a quiet machine; beside two other test runs on two
slow cores it took over 15: the deadline only catches a server that never starts."""


STOP_DEADLINE_S = 60.0
"""A SIGTERMed server stops in 30 to 120 ms on a quiet machine (it syncs LMDB and the
journal); fsync waits seconds on a disk the rest of a parallel suite keeps busy, so the
deadline only catches a stop that hangs."""


def terminated(proc: subprocess.Popen[bytes], log: Path) -> int:
    """SIGTERM (a clean stop), then the exit code; a stop that hangs fails the test
    with the server's log (it logs when its stop begins, and each step's failure)."""
    proc.terminate()
    try:
        return proc.wait(STOP_DEADLINE_S)
    except subprocess.TimeoutExpired:
        text = log.read_text(errors="replace")
        raise AssertionError(f"the server did not stop in {STOP_DEADLINE_S:g} s:\n{text}") from None


def read_address(proc: subprocess.Popen[bytes], log: Path) -> str:
    """The HOST:PORT from the "ftlayer serving on" line, within the deadline."""
    return read_serving_address(proc, log, START_DEADLINE_S)


def read_http(proc: subprocess.Popen[bytes], log: Path) -> str:
    """The URL from the "ftlayer http on" line (after the "serving on" one)."""
    return read_http_url(proc, log, START_DEADLINE_S)


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    address: str
    data_dir: Path
    log: Path
    http_url: str | None = None
    """The HTTP port's URL, for a server started with --http-port."""

    def client(self, token: bytes | None = None) -> FTClient:
        return FTClient(self.address, token=token)

    def kill(self) -> None:
        """SIGKILL, and wait for the process to be gone."""
        self.proc.kill()
        self.proc.wait(10)


StartServer = Callable[..., Server]


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 10 s; closes its stdout pipe."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def queued_records(
    client: FTClient, source_id: int, partitions: int
) -> dict[int, list[tuple[bytes, bytes]]]:
    """Per partition, the (key, value) of each record the source's reader would fetch."""
    hi = client.status().replay_cursor_of([source_id])
    found: dict[int, list[tuple[bytes, bytes]]] = {}
    for p in range(partitions):
        records = client.fetch_replay(0, hi, source_id=source_id, partition=p).records
        keys, values, _, _ = decode_payloads(records.payloads)
        found[p] = list(zip(keys.to_pylist(), values.to_pylist(), strict=True))
    return found
