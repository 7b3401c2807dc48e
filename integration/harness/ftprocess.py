"""An FT-layer server as a child process (`ftlayer serve`), for the demo and benchmarks.

`FTServerProcess(data_dir, *serve_args)` starts `python -m ftlayer.cli serve` with this
interpreter, waits for its "ftlayer serving on HOST:PORT" line, and stops it on exit
(SIGTERM, then SIGKILL). The server logs to `log_path` (a file next to the data dir by
default), named in every error. It dies with its parent on Linux (PDEATHSIG), so a
killed demo leaves no server behind; the signal comes when the thread that started it
ends, not only its process, so start (and restart) it from a thread that outlives it.
`command_prefix` runs it on another host (``ip netns exec NAME`` for a network
namespace, with `--host` its address there). Once the process died (`kill()`, or its
host died), `start()` runs it again with the same data dir and arguments: a restart,
appending to the same log.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

from ftlayer.errors import FTLayerError

__all__ = [
    "FTServerProcess",
    "ServerProcessError",
    "read_http_url",
    "read_serving_address",
    "serve_command",
]

_SERVING: bytes = b"ftlayer serving on "
_HTTP: bytes = b"ftlayer http on "


class ServerProcessError(FTLayerError):
    """The FT-layer server process did not start, or died."""


def serve_command(data_dir: str | os.PathLike[str], *extra: str) -> list[str]:
    """The command line of `ftlayer serve` on `data_dir` with this interpreter."""
    return [sys.executable, "-m", "ftlayer.cli", "serve", "--data-dir", os.fspath(data_dir), *extra]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def read_serving_address(
    proc: subprocess.Popen[bytes], log_path: Path, timeout: float = 60.0
) -> str:
    """The HOST:PORT of the "ftlayer serving on HOST:PORT" line a starting `ftlayer
    serve` prints first (its stdout a pipe; " (TLS)" follows the address of a TLS
    server); ServerProcessError, naming the log, if the line does not come within
    `timeout` seconds or the process exits first."""
    return _read_line(proc, _SERVING, log_path, timeout)


def read_http_url(proc: subprocess.Popen[bytes], log_path: Path, timeout: float = 60.0) -> str:
    """The URL of the "ftlayer http on" line that `ftlayer serve --http-port` prints
    right after its "serving on" line (read that one first)."""
    return _read_line(proc, _HTTP, log_path, timeout)


def _read_line(proc: subprocess.Popen[bytes], prefix: bytes, log_path: Path, timeout: float) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    line = b""
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not selector.select(left):
                raise ServerProcessError(
                    f"the FT-layer server did not start within {timeout:g} s; its log: {log_path}"
                )
            chunk = os.read(proc.stdout.fileno(), 1)
            if not chunk:
                raise ServerProcessError(
                    f"the FT-layer server exited with code {proc.wait()} at start: "
                    f"{_log_tail(log_path)}"
                )
            line += chunk
    words = line[len(prefix) :].decode().split()
    if not line.startswith(prefix) or not words:
        raise ServerProcessError(f"unexpected line from the server: {line!r}")
    return words[0]  # what follows the address (" (TLS)") describes it


def _log_tail(log_path: Path, lines: int = 5) -> str:
    try:
        return " | ".join(log_path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {log_path})"


class FTServerProcess:
    """One `ftlayer serve` child process; a context manager. See the module docstring."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *serve_args: str,
        log_path: str | os.PathLike[str] | None = None,
        start_timeout: float = 60.0,
        command_prefix: Sequence[str] = (),
    ) -> None:
        self.data_dir = Path(data_dir)
        self.command_prefix = tuple(command_prefix)
        self.serve_args = serve_args
        self.log_path = Path(log_path) if log_path else self.data_dir.with_suffix(".log")
        self.start_timeout = start_timeout
        self.address = ""
        self.http_url: str | None = None
        """The status page's URL, when `serve_args` has --http-port."""
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> Self:
        if self._proc is not None and self._proc.poll() is None:
            raise ServerProcessError("the FT-layer server process is already running")
        if self._proc is not None and self._proc.stdout is not None:
            self._proc.stdout.close()  # the pipe of the process that died
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                [*self.command_prefix, *serve_command(self.data_dir, *self.serve_args)],
                stdout=subprocess.PIPE,
                stderr=log,
                preexec_fn=_die_with_parent,
            )
        try:
            self.address = read_serving_address(self._proc, self.log_path, self.start_timeout)
            if "--http-port" in self.serve_args:
                self.http_url = read_http_url(self._proc, self.log_path, self.start_timeout)
        except ServerProcessError:
            self.kill()
            raise
        return self

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash would; waits until the process is gone."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(10)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (a clean stop), then SIGKILL after `timeout` seconds."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
