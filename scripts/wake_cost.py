"""What code costs on this machine when it runs after a pause, in and out of the server.

1. Small steps, each run after a sleep of each gap: a pure-Python loop (about 8 µs
   warm), `time.monotonic()` (a vDSO call), three numpy calls on 16 numbers, an
   `os.write` of 40 bytes to a file (what the acker journal does per request), and the
   core's XOR of one event for a root it does not know (`FTLayer.xor` in process, with
   an LMDB store and a journal): the thread's own CPU (time.thread_time_ns), median of
   40 runs per gap. Nothing but the sleep differs between the gaps.
2. A real `ftlayer serve` answering a trivial request (that XOR, a HEARTBEAT, a brief
   STATUS) sent every GAP, N per gap: the server process's CPU per request (its
   threads' /proc schedstat), less what it spends idle over the same time (measured
   first, over 10 s).

With `SPIN=1`, two SCHED_IDLE processes spin on the CPUs meanwhile (they run only when
nothing else would): the CPUs never go idle, and whatever a pause costs that comes from
the CPU idling (a virtual CPU halted, then scheduled again by the host) goes away.

    [SPIN=1] .venv/bin/python scripts/wake_cost.py [N] [GAP_MS ...]
"""

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ftlayer.client import FTClient
from ftlayer.core import FTLayer
from ftlayer.core.journal import Journal
from ftlayer.integration.harness.benchcost import thread_usage
from ftlayer.integration.harness.ftprocess import FTServerProcess
from ftlayer.persistence import LmdbStorage

N = int(sys.argv[1]) if len(sys.argv) > 1 else 100
GAPS_S = [float(g) / 1000 for g in sys.argv[2:]] or [0.0, 0.02, 0.1]
LOOP_GAPS_S = sorted({0.0, 0.005, 0.02, 0.05, 0.1, *GAPS_S})
IDLE_S = 10.0


def loop(n: int = 300) -> int:
    total = 0
    for i in range(n):
        total += i * i
    return total


def step_cost(step: Callable[[], object], gap_s: float, runs: int = 40) -> float:
    """The step's median thread CPU in µs, each run after sleeping gap_s."""
    costs = []
    for _ in range(runs):
        if gap_s:
            time.sleep(gap_s)
        began = time.thread_time_ns()
        step()
        costs.append((time.thread_time_ns() - began) / 1e3)
    return sorted(costs)[runs // 2]


def step_costs(tmp: str) -> None:
    numbers = np.arange(16, dtype=np.uint64)
    fd = os.open(os.path.join(tmp, "appended"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    storage, journal = (
        LmdbStorage(os.path.join(tmp, "store")),
        Journal(os.path.join(tmp, "journal")),
    )
    ft = FTLayer(storage, timeout_s=120, journal=journal)
    root, value = np.array([12345], np.uint64), np.array([1], np.uint64)

    def numpy_calls() -> None:
        np.unique(numbers)
        np.bitwise_xor.reduce(numbers)
        np.ascontiguousarray(numbers, dtype=np.uint64)

    steps: dict[str, Callable[[], object]] = {
        "Python loop": loop,
        "time.monotonic()": time.monotonic,
        "numpy calls": numpy_calls,
        "os.write": lambda: os.write(fd, b"x" * 40),
        "FTLayer.xor": lambda: ft.xor(root, value),
    }
    print(f"µs of CPU a step after a pause (SPIN={os.environ.get('SPIN', '0')}):")
    print(" " * 18 + "".join(f"{gap_s * 1e3:>8.0f} ms" for gap_s in LOOP_GAPS_S))
    try:
        for name, step in steps.items():
            for _ in range(20):  # warm
                step()
            costs = "".join(f"{step_cost(step, gap_s):>11.1f}" for gap_s in LOOP_GAPS_S)
            print(f"  {name:<16}{costs}")
    finally:
        journal.close()
        storage.close()
        os.close(fd)


def server_cpu(pid: int) -> float:
    return sum(thread_usage(pid).values())


def request_costs(client: FTClient, pid: int) -> None:
    time.sleep(2.0)
    began = server_cpu(pid)
    time.sleep(IDLE_S)
    idle = (server_cpu(pid) - began) / IDLE_S
    print(f"the idle server: {idle * 1e3:.3f} ms of CPU a second")
    calls = {
        "XOR": lambda: client.xor([12345], [1]),
        "HEARTBEAT": lambda: client.heartbeat([1], 5.0),
        "brief STATUS": client.brief_status,
    }
    for kind, call in calls.items():
        for gap_s in GAPS_S:
            for _ in range(5):
                call()
            time.sleep(1.0)
            began, started = server_cpu(pid), time.perf_counter()
            for _ in range(N):
                if gap_s:
                    time.sleep(gap_s)
                call()
            spent = server_cpu(pid) - began - idle * (time.perf_counter() - started)
            print(
                f"  {kind:<13} every {gap_s * 1e3:5.0f} ms: "
                f"{spent * 1e3 / N:.3f} ms of the server's CPU a request"
            )


def main() -> None:
    spinners = []
    if os.environ.get("SPIN") == "1":
        spin = [sys.executable, "-c", "while True: pass"]
        spinners = [
            subprocess.Popen(["chrt", "-i", "0", *spin]) for _ in range(os.cpu_count() or 1)
        ]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            step_costs(tmp)
        with tempfile.TemporaryDirectory() as tmp, FTServerProcess(Path(tmp) / "data") as server:
            assert server.pid is not None
            with FTClient(server.address, name="wake-cost") as client:
                request_costs(client, server.pid)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


if __name__ == "__main__":
    main()
