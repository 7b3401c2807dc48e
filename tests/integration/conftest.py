"""Fixtures for tests against a real `ftlayer serve` process.

`start_server(data_dir=None, *extra_args) -> Server` starts one server process on a
free loopback port with a tmp data dir (or `data_dir`, to restart on the same data),
and waits for its "ftlayer serving on HOST:PORT" line (with --http-port, also for its
"ftlayer http on URL" line). Every process it started is
stopped (SIGTERM, then SIGKILL) by the finalizer, even when the test fails.
`ft_server` is one such server, started with the defaults.
`nats_server` is one real NATS server with JetStream for the session (tests use streams
and subjects of their own names).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from serverproc import (
    Server,
    StartServer,
    read_address,
    read_http,
    serve_command,
    stop_process,
)

from ftlayer.integration.harness.nats import NatsServer


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[StartServer]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(data_dir: Path | None = None, *extra: str) -> Server:
        data_dir = data_dir or tmp_path / "data"
        log = tmp_path / f"server-{len(procs)}.log"
        with log.open("wb") as stderr:
            proc = subprocess.Popen(
                serve_command(data_dir, *extra), stdout=subprocess.PIPE, stderr=stderr
            )
        procs.append(proc)
        address = read_address(proc, log)
        http_url = read_http(proc, log) if "--http-port" in extra else None
        return Server(proc, address, data_dir, log, http_url)

    yield start
    for proc in procs:
        stop_process(proc)


@pytest.fixture
def ft_server(start_server: StartServer) -> Server:
    return start_server()


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    with NatsServer(tmp_path_factory.mktemp("nats") / "jetstream") as server:
        yield server
