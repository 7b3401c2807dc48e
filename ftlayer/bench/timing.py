"""What every bench shares: the machine it ran on, its CPU steal, and a timed call
(after a collection, so garbage of the run before is not counted)."""

from __future__ import annotations

import gc
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def _machine() -> dict[str, Any]:
    return {"python": platform.python_version(), "cpus": os.cpu_count(), "numpy": np.__version__}


def _cpu_times() -> tuple[int, int] | None:
    """(steal, total) CPU ticks since boot from /proc/stat; None where there is none."""
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            fields = [int(x) for x in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal [guest guest_nice: within user]
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def _steal_percent(before: tuple[int, int] | None) -> float | None:
    """The share of CPU time the hypervisor took from this VM since `before`: on a
    shared machine, runs with much steal measure the neighbours as well."""
    after = _cpu_times()
    if before is None or after is None or after[1] <= before[1]:
        return None
    return round(100 * (after[0] - before[0]) / (after[1] - before[1]), 1)


def _timed(fn: Callable[[], object]) -> float:
    gc.collect()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _join(workers: list[Any]) -> None:
    """Wait for the bench's worker processes; terminate one that does not end in 30 s."""
    for worker in workers:
        worker.join(timeout=30)
        if worker.is_alive():
            worker.terminate()


def _drained_status(address: str) -> Any:
    """The server's STATUS once its storage is empty: completed records leave LMDB in the
    background (the deleter thread), and the storage must end empty, or the bench lost
    track of something. Gives up after 120 s (the caller's check then fails)."""
    from ftlayer.client import FTClient

    with FTClient(address, name="bench-status") as client:
        status = client.status()
        deadline = time.monotonic() + 120
        while status["stored_records"] and time.monotonic() < deadline:
            time.sleep(0.1)
            status = client.status()
    return status
