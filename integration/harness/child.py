"""A server process that tests, demos and benches start and stop (the Tansu broker, the
NATS server): what they share.

- `_spawn`: the command runs with its stdout and stderr appended to a log file (the
  command line first), stdin closed; on Linux it also gets SIGTERM when the thread
  that started it dies (`die_with_parent`), so a crashed or SIGKILLed test run leaves
  no orphan server behind.
- `_wait_ready`: until the deadline, a process that exited fails with its exit code
  and the log's tail; otherwise `probe` says what is still missing (None: ready).
- `_terminate`: SIGTERM, then SIGKILL after `stop_timeout`; the log file is closed.
- A context manager: `start()` on enter, `stop()` on exit.

Each subclass has its own error type and name for messages, and its own start and stop
policy (ports, logs kept or removed, a crash as SIGKILL).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, ClassVar, Self

from ftlayer.errors import FTLayerError

__all__ = ["ChildServer", "die_with_parent", "log_tail"]

_LOG_TAIL_BYTES = 4000
_PR_SET_PDEATHSIG = 1
_PRCTL = ctypes.CDLL(None).prctl if sys.platform == "linux" else None


def die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the parent thread dies (Linux only).

    Runs between fork and exec, so it only calls a function looked up beforehand.
    """
    assert _PRCTL is not None
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


def log_tail(path: Path | None) -> str:
    """The last few KiB of a server's log file, to end an error message with."""
    if path is None:
        return ""
    try:
        with path.open("rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - _LOG_TAIL_BYTES))
            tail = log.read().decode(errors="replace")
    except OSError:
        return f"\n(log {path} unreadable)"
    return f"\n--- last lines of {path} ---\n{tail}"


class ChildServer:
    """One server process; see the module docstring. Not thread-safe: start and stop it
    from one thread."""

    error: ClassVar[type[FTLayerError]] = FTLayerError
    """The error this server's problems raise."""
    what: ClassVar[str] = "the server"
    """How messages name it ("the Tansu broker")."""

    def __init__(
        self, log_path: str | os.PathLike[str] | None, start_timeout: float, stop_timeout: float
    ) -> None:
        self._log_path = Path(log_path) if log_path is not None else None
        self._start_timeout = start_timeout
        self._stop_timeout = stop_timeout
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._port: int | None = None

    @property
    def pid(self) -> int | None:
        """The process id while it runs."""
        return self._process.pid if self._process is not None else None

    @property
    def log_path(self) -> Path | None:
        """The file its output goes to (None before the first start)."""
        return self._log_path

    def start(self) -> str:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def _spawn(
        self, command: Sequence[str], port: int, env: Mapping[str, str] | None = None
    ) -> None:
        """Run `command` (which serves on `port`), its output appended to the log."""
        assert self._log_path is not None
        log = self._log_path.open("ab")
        log.write(f"$ {' '.join(command)}\n".encode())
        log.flush()
        try:
            self._process = subprocess.Popen(
                list(command),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=None if env is None else dict(env),
                preexec_fn=die_with_parent if _PRCTL is not None else None,
            )
        except OSError as exc:
            log.close()
            raise self.error(f"cannot run {self.what} {command[0]!r}: {exc}") from exc
        self._log, self._port = log, port

    def _wait_ready(self, port: int, probe: Callable[[float], str | None]) -> None:
        """Until `probe(seconds left)` says ready (None) or the deadline: the problem
        it names, or the process's exit, ends in `error` with the log's tail."""
        assert self._process is not None
        deadline = time.monotonic() + self._start_timeout
        problem = "the port never accepted a connection"
        while True:
            code = self._process.poll()
            if code is not None:
                raise self.error(
                    f"{self.what} exited with code {code} before answering on port {port}"
                    f"{self._log_tail()}"
                )
            found = probe(deadline - time.monotonic())
            if found is None:
                return
            problem = found
            if time.monotonic() >= deadline:
                raise self.error(
                    f"{self.what} did not answer within {self._start_timeout:.1f} s: "
                    f"{problem}{self._log_tail()}"
                )
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout=0.02)

    def _log_tail(self) -> str:
        return log_tail(self._log_path)

    def _terminate(self) -> bool:
        """Stop the process (SIGTERM, then SIGKILL after `stop_timeout`) and close the
        log; whether it had exited on its own before (it crashed: its log says why)."""
        process, self._process, self._port = self._process, None, None
        crashed = process is not None and process.poll() is not None
        try:
            if process is not None and not crashed:
                process.terminate()
                try:
                    process.wait(timeout=self._stop_timeout)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None
        return crashed

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
