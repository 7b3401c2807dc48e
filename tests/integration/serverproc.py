"""Starting a real `ftlayer serve` process in tests: the command, its address, a handle."""

from __future__ import annotations

import os
import selectors
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ftlayer.client import FTClient
from ftlayer.integration.ftprocess import serve_command

__all__ = ["Server", "StartServer", "read_address", "serve_command"]

START_DEADLINE_S = 15.0


def read_address(proc: subprocess.Popen[bytes], log: Path) -> str:
    """The HOST:PORT from the "ftlayer serving on" line, within the deadline."""
    assert proc.stdout is not None
    deadline = time.monotonic() + START_DEADLINE_S
    line = b""
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not selector.select(left):
                raise AssertionError(f"server did not start in time: {log.read_text()}")
            chunk = os.read(proc.stdout.fileno(), 1)
            if not chunk:
                raise AssertionError(f"server exited {proc.wait()}: {log.read_text()}")
            line += chunk
    text = line.decode().strip()
    assert text.startswith("ftlayer serving on "), text
    return text.removeprefix("ftlayer serving on ")


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    address: str
    data_dir: Path
    log: Path

    def client(self, token: bytes | None = None) -> FTClient:
        return FTClient(self.address, token=token)

    def kill(self) -> None:
        """SIGKILL, and wait for the process to be gone."""
        self.proc.kill()
        self.proc.wait(10)


StartServer = Callable[..., Server]
