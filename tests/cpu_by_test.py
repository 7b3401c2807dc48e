"""CPU of each test, its processes' included: with FTLAYER_TEST_CPU=FILE in the
environment, each test appends one line to FILE: its node id, its wall seconds and the
CPU seconds of this pytest process and every process under it (Spark's JVM, its Python
workers and source runners, the FT-layer servers and brokers the tests start, the
processes on the test hosts) spent from the test's setup to its teardown.

Measured from /proc: the utime, stime, cutime and cstime of the process tree at both
ends. A process that ended in between counts through its parent's cutime once the parent
collected it; one that ended uncollected, or left the tree (daemonized), loses what it
spent in the test. What a shared fixture costs (the Spark session, the broker) falls to
the first test that uses it. Summed over a file, it says where the suite's CPU goes:

    FTLAYER_TEST_CPU=/tmp/cpu.tsv make unit
    sort -t$'\\t' -k3 -g -r /tmp/cpu.tsv | head -30
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

OUT = os.environ.get("FTLAYER_TEST_CPU")
_TICKS = os.sysconf("SC_CLK_TCK")


def _tree_cpu(root: int) -> float:
    """CPU seconds of `root` and every process under it, with their collected children."""
    parents: dict[int, int] = {}
    spent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        spent[int(entry)] = sum(int(f) for f in fields[11:15])
    total, queue, seen = 0, [root], set()
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    while queue:
        pid = queue.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += spent.get(pid, 0)
        queue.extend(children.get(pid, ()))
    return total / _TICKS


if OUT:

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
        began, cpu = time.monotonic(), _tree_cpu(os.getpid())
        yield
        wall, used = time.monotonic() - began, _tree_cpu(os.getpid()) - cpu
        with open(OUT, "a") as out:
            out.write(f"{item.nodeid}\t{wall:.2f}\t{used:.2f}\n")
