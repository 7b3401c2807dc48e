"""Where a vectorized pipeline's CPU goes, per FT mode: one run of `bench_fast`
(integration/harness/benchfast.py) with the CPU seconds of every process on the machine
sampled at each run's start and one second after its end (the server's deferred deletes
of the run land in it), grouped as Spark's JVM, its Python workers, the
FT-layer server, the broker and the rest, and given in µs per record (the machine has
2 cores, so CPU the server spends is CPU Spark's tasks do not get).

With FAIL_RATE (default 0) the FT-on runs fail that share of the records once each
(the bench's `--fail-rate`).

    [FAIL_RATE=0.01] .venv/bin/python scripts/fast_cpu.py [BATCH_SIZE] [ROUNDS]
"""

import collections
import json
import os
import statistics
import sys
import time
from typing import Any

from proc_cpu import TICK, processes

import ftlayer.integration.harness.benchfast as bf

BATCH = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 1
RECORDS = 400_000
FAIL_RATE = float(os.environ.get("FAIL_RATE", "0"))
SETTLE_S = 1.0


def _group(cmdline: str) -> str:
    if "ftlayer.cli serve" in cmdline:
        return "ft server"
    if "java" in cmdline.split(" ", 1)[0] or "org.apache.spark" in cmdline:
        return "spark jvm"
    if "pyspark" in cmdline:
        return "python workers"
    if "tansu" in cmdline:
        return "broker"
    return "other"


def _cpu() -> collections.Counter[str]:
    """CPU seconds per group (own and waited-for children)."""
    seen: collections.Counter[str] = collections.Counter()
    procs = processes()
    for pid, proc in procs.items():
        up, mine = pid, False  # only this process and its descendants
        while up in procs and up > 1:
            if up == os.getpid():
                mine = True
                break
            up = procs[up].parent
        if mine:
            group = "this bench" if pid == os.getpid() else _group(proc.cmdline)
            seen[group] += proc.own_s + proc.children_s
    with open("/proc/stat") as f:
        total = [int(x) for x in f.readline().split()[1:]]
    seen["machine busy"] = (sum(total) - total[3] - total[4]) / TICK
    return seen


marks: list[tuple[float, collections.Counter[str]]] = []
runs: list[dict[str, float]] = []
wait, processing_s = bf._wait, bf._processing_s


def wait_(*args: Any, **kwargs: Any) -> None:
    marks.append((time.perf_counter(), _cpu()))
    wait(*args, **kwargs)


def capture(query: Any, records: int) -> float:
    seconds = processing_s(query, records)
    t0, before = marks.pop()
    wall = time.perf_counter() - t0
    time.sleep(SETTLE_S)  # the server's deferred deletes of this run land in it
    after = _cpu()
    used = {k: (after[k] - before[k]) / records * 1e6 for k in after}
    used["wall"] = wall / records * 1e6
    runs.append(used)
    return seconds


bf._wait, bf._processing_s = wait_, capture
result = bf.bench_fast(records=RECORDS, batch_sizes=[BATCH], rounds=ROUNDS, fail_rate=FAIL_RATE)
# The bench adds rounds where runs are short (benchfast's MIN_TIMED_S): every run counts.
timed_rounds = (len(runs) - len(bf.WARM_UP)) // len(bf._order(0))
names = [f"warm-up ({m})" for m in bf.WARM_UP] + [
    mode for r in range(timed_rounds) for mode in bf._order(r)
]
keys = [
    "wall",
    "machine busy",
    "this bench",
    "spark jvm",
    "python workers",
    "ft server",
    "broker",
    "other",
]
print("µs per record   " + " ".join(f"{k:>14}" for k in keys))
for name, used in zip(names, runs, strict=True):
    print(f"{name:15} " + " ".join(f"{used.get(k, 0.0):14.2f}" for k in keys))
medians = {
    mode: {
        k: statistics.median(u.get(k, 0.0) for n, u in zip(names, runs, strict=True) if n == mode)
        for k in keys
    }
    for mode in ("off", "tree", "barrier")
}
print("median")
for mode, used in medians.items():
    print(f"{mode:15} " + " ".join(f"{used[k]:14.2f}" for k in keys))
print(json.dumps(result["batch_sizes"][str(BATCH)]))
