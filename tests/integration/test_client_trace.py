"""FTLAYER_REQUEST_TRACE (ftlayer/client/trace.py): a process's requests, timed, in a
file that several processes append to."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from serverproc import StartServer

CLIENT = """
import sys
from ftlayer.client import FTClient
with FTClient(sys.argv[1], name="traced") as client:
    for _ in range(int(sys.argv[2])):
        client.status()
"""


def _run_client(address: str, statuses: int, env: dict[str, str]) -> None:
    subprocess.run(
        [sys.executable, "-c", CLIENT, address, str(statuses)], env=env, check=True, timeout=60
    )


def test_each_request_of_each_process_is_a_line(start_server: StartServer, tmp_path: Path) -> None:
    server = start_server()
    trace = tmp_path / "requests.log"
    env = {**os.environ, "FTLAYER_REQUEST_TRACE": str(trace)}
    _run_client(server.address, 3, env)
    _run_client(server.address, 2, env)
    rows = [line.split() for line in trace.read_text().splitlines()]
    assert all(len(row) == 5 for row in rows), rows
    statuses = [row for row in rows if row[2] == "STATUS"]
    assert len(statuses) == 5  # both processes' requests, in one file
    assert len({row[1] for row in statuses}) == 2  # by pid
    assert all(float(row[3]) > 0 and int(row[4]) > 0 for row in statuses)
    assert {row[2] for row in rows} >= {"HELLO", "AUTH", "STATUS"}  # the handshake too
