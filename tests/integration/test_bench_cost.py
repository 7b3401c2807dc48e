"""The pipeline benches' server cost per record (integration.harness.benchcost), read
from /proc for a process: here this test's own, which burns CPU and writes a file."""

from __future__ import annotations

import os
import time
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from ftlayer.client import FTClient
from ftlayer.integration.harness import benchcost
from ftlayer.integration.harness.benchcost import ServerCost, Usage, server_requests
from ftlayer.registration import SourceRegistration
from ftlayer.server import FTServer


def _burn_and_write(path: Path, size: int) -> None:
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:
        pass
    with path.open("wb") as f:
        f.write(b"x" * size)
        f.flush()
        os.fsync(f.fileno())


def test_cpu_and_bytes_per_record_over_the_runs_of_a_mode(tmp_path: Path) -> None:
    cost = ServerCost(os.getpid(), settle_s=0)
    with cost.run("barrier", 1_000):
        _burn_and_write(tmp_path / "a", 200_000)
    with cost.run("tree", 1_000):
        _burn_and_write(tmp_path / "b", 100_000)
    with cost.run(None, 1_000):  # an untimed run: not measured
        _burn_and_write(tmp_path / "c", 100_000)
    with pytest.raises(RuntimeError), cost.run("barrier", 1_000):  # a failed run: neither
        raise RuntimeError("the run failed")
    assert [(r.key, r.records) for r in cost.runs] == [("barrier", 1_000), ("tree", 1_000)]
    barrier = cost.figures(["barrier"])
    assert set(barrier) == {"server_cpu_us_per_record", "lmdb_bytes_per_record"}
    # 50 ms of CPU: a few clock ticks; the bytes are 0 where /tmp is a tmpfs.
    assert barrier["server_cpu_us_per_record"] >= 0
    assert barrier["lmdb_bytes_per_record"] >= 0
    assert cost.by_mode({"tree": ["tree"], "barrier": ["barrier"]}) == {
        "server_cpu_us_per_record_by_mode": {
            "tree": cost.figures(["tree"])["server_cpu_us_per_record"],
            "barrier": barrier["server_cpu_us_per_record"],
        },
        "lmdb_bytes_per_record_by_mode": {
            "tree": cost.figures(["tree"])["lmdb_bytes_per_record"],
            "barrier": barrier["lmdb_bytes_per_record"],
        },
    }
    assert cost.figures(["off"]) == {
        "server_cpu_us_per_record": None,
        "lmdb_bytes_per_record": None,
    }


def test_figures_sum_the_runs_and_bytes_are_none_when_proc_io_cannot_be_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    readings = iter(
        [
            *(Usage(1.0, 1_000), Usage(1.5, 5_001_000)),  # barrier, then barrier again
            *(Usage(2.0, 5_001_000), Usage(2.1, 6_001_000)),
            *(Usage(3.0, None), Usage(3.5, None)),  # tree, /proc/<pid>/io unreadable
        ]
    )
    monkeypatch.setattr(benchcost, "usage", lambda pid: next(readings))
    cost = ServerCost(os.getpid(), settle_s=0)
    for mode in ("barrier", "barrier"):
        with cost.run(mode, 100_000):
            pass
    # 0.6 s of CPU and 6,000,000 bytes over 200,000 records.
    assert cost.figures(["barrier"]) == {
        "server_cpu_us_per_record": 3.0,
        "lmdb_bytes_per_record": 30.0,
    }
    with cost.run("tree", 100_000):
        pass
    assert cost.figures(["tree"]) == {
        "server_cpu_us_per_record": 5.0,
        "lmdb_bytes_per_record": None,
    }


def test_usage_reads_this_process() -> None:
    before = benchcost.usage(os.getpid())
    assert before.cpu_s > 0
    assert before.write_bytes is None or before.write_bytes >= 0


def test_requests_by_kind_over_a_run_of_a_real_server(tmp_path: Path) -> None:
    """`server_requests`: the run's own requests per 1,000 records and their CPU per
    record, read from the server's STATUS before and after the run."""
    with FTServer(tmp_path / "data") as server:
        address = "{}:{}".format(*server.address)
        cost = ServerCost(os.getpid(), settle_s=0, requests=partial(server_requests, address))
        with FTClient(address) as client:
            client.register_source(SourceRegistration(7, "forward", 2))
            with cost.run("tree", 2_000):
                for _ in range(4):
                    client.xor(np.arange(1, 11, dtype=np.uint64), np.ones(10, np.uint64))
                client.status()
        figures = cost.figures(["tree"])
    requests = figures["server_requests"]
    # Four XOR requests and one STATUS in the run (the reads around it not counted).
    assert requests["XOR"]["per_1000_records"] == 2.0
    assert requests["STATUS"]["per_1000_records"] == 0.5
    assert "REGISTER_SOURCE" not in requests
    # XOR commits nothing (the acker journal is a file of its own): no store commit.
    assert figures["store_commits_per_1000_records"] == 0.0
    assert all(r["cpu_us_per_record"] >= 0 for r in requests.values())


def test_cpu_by_thread_names_a_real_servers_threads(tmp_path: Path) -> None:
    """`server_threads`: the CPU of each of a server's threads over a run, by the name
    the system knows it by (here a server in this process: its connection's thread
    answers the requests), and `exited` for threads gone before the run ended."""
    with FTServer(tmp_path / "data") as server:
        address = "{}:{}".format(*server.address)
        cost = ServerCost(os.getpid(), settle_s=0, threads=True)
        with FTClient(address) as client, cost.run("tree", 2_000):
            roots = np.arange(1, 200_001, dtype=np.uint64)
            for _ in range(4):
                client.xor(roots, np.ones(len(roots), np.uint64))
        figures = cost.figures(["tree"])
    threads = figures["server_threads"]
    assert threads["ftl-conn"] > 0  # four XORs of 200,000 roots: milliseconds
    assert threads["exited"] >= 0
    # By name, largest first, together the process's CPU (to the clocks' rounding: the
    # process's user and system times are each read in whole clock ticks, before and
    # after the run, so their sum over it is off by up to two ticks either way).
    assert list(threads.values()) == sorted(threads.values(), reverse=True)
    total = figures["server_cpu_us_per_record"]
    two_ticks_us = 2 * 1e6 / os.sysconf("SC_CLK_TCK")
    assert sum(threads.values()) == pytest.approx(total, rel=0.2, abs=two_ticks_us / 2_000)
