"""CPU of each test, its processes' included: with FTLAYER_TEST_CPU=FILE in the
environment, each test appends one line to FILE: its node id, its wall seconds and the
CPU seconds that this pytest process and every process under it (Spark's JVM, its
Python workers and source runners, the FT-layer servers and brokers the tests start,
the processes on the test hosts) spent from the test's setup to its teardown.

Sampled from /proc: every process of the tree is looked at every SAMPLE_S seconds (and
at each test's start and end), and its own CPU (utime + stime) at its last sample
counts, so a process that ends between two samples loses at most SAMPLE_S of it. Its
parent's cutime would not do: Spark's Python daemon ignores SIGCHLD, so its workers'
CPU is never collected. What a shared fixture costs (the Spark session, the broker)
falls to the first test that uses it. Summed over a file, it says where the suite's
CPU goes:

    FTLAYER_TEST_CPU=/tmp/cpu.tsv make unit
    sort -t$'\\t' -k3 -g -r /tmp/cpu.tsv | head -30
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest

from ftlayer.integration.harness.standalone import proc_stats

OUT = os.environ.get("FTLAYER_TEST_CPU")
SAMPLE_S = 0.5
_TICKS = os.sysconf("SC_CLK_TCK")


class _Tree:
    """The CPU ticks every process of a tree has spent, by (pid, start time), as last
    sampled."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.spent: dict[tuple[int, int], int] = {}
        self.lock = threading.Lock()

    def sample(self) -> float:
        """Look at every process of the tree now; the CPU seconds of all seen so far."""
        parents: dict[int, int] = {}
        own: dict[int, tuple[int, int]] = {}
        for pid, fields in proc_stats():
            parents[pid] = int(fields[1])
            own[pid] = (int(fields[19]), int(fields[11]) + int(fields[12]))
        children: dict[int, list[int]] = {}
        for pid, parent in parents.items():
            children.setdefault(parent, []).append(pid)
        queue, seen = [self.root], set()
        with self.lock:
            while queue:
                pid = queue.pop()
                if pid in seen or pid not in own:
                    continue
                seen.add(pid)
                started, ticks = own[pid]
                self.spent[(pid, started)] = max(ticks, self.spent.get((pid, started), 0))
                queue.extend(children.get(pid, ()))
            return sum(self.spent.values()) / _TICKS


if OUT:
    _tree = _Tree(os.getpid())

    def _sampling() -> None:
        while True:
            time.sleep(SAMPLE_S)
            _tree.sample()

    threading.Thread(target=_sampling, name="cpu-by-test", daemon=True).start()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
        began, cpu = time.monotonic(), _tree.sample()
        yield
        wall, used = time.monotonic() - began, _tree.sample() - cpu
        with open(OUT, "a") as out:
            out.write(f"{item.nodeid}\t{wall:.2f}\t{used:.2f}\n")
