"""Starting a real `ftlayer serve` process in tests: the command, its address, a handle."""

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

__all__ = ["Server", "StartServer", "read_address", "read_http", "serve_command"]

START_DEADLINE_S = 15.0


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
