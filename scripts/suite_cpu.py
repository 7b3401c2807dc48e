"""Where a command's CPU goes, by kind of process: runs COMMAND (say `.ci/run` in a
fresh clone, or `make unit`) and samples every process from /proc every INTERVAL
seconds until it ends, adding each process's CPU since the last sample to its kind
(Spark's Python workers, the driver-side Python source runners, the JVMs by role,
pytest, `ftlayer serve`, Tansu, ...); processes that were running before COMMAND
started count only from then on. A process that ends between two samples loses its
last INTERVAL's CPU, so short-lived ones are undercounted. Prints a table of CPU
seconds per kind, processes started per kind, and the whole machine's busy and idle
seconds over the run (/proc/stat).

    python scripts/suite_cpu.py [--interval S] -- COMMAND ...
"""

import argparse
import os
import subprocess
import sys
import time
from collections import Counter

from proc_cpu import TICK, processes

_JVM_ROLES = (
    ("deploy.master.Master", "JVM: standalone master"),
    ("deploy.worker.Worker", "JVM: standalone worker"),
    ("CoarseGrainedExecutorBackend", "JVM: executor"),
)
_PYTHON_KINDS = (
    ("pyspark.daemon", "Python: Spark's workers (pyspark.daemon)"),
    ("ftlayer.integration.daemon", "Python: Spark's workers (pyspark.daemon)"),
    ("python_streaming_source_runner", "Python: Spark's source runners (driver side)"),
    ("pyspark.sql.worker", "Python: Spark's planner workers"),
    ("ftlayer.cli serve", "Python: ftlayer serve"),
    ("ftlayer serve", "Python: ftlayer serve"),
    ("venv-pack", "pip and venv-pack"),
    ("pip", "pip and venv-pack"),
    ("mypy", "mypy"),
)


def kind_of(cmdline: str) -> str:
    words = cmdline.split()
    if not words:
        return "kernel threads"
    exe = os.path.basename(words[0])
    if exe == "java":
        return next((kind for mark, kind in _JVM_ROLES if mark in cmdline), "JVM: driver")
    if exe.startswith("python"):
        if len(words) > 1 and (
            os.path.basename(words[1]) == "pytest" or words[1:3] == ["-m", "pytest"]
        ):
            return "Python: pytest"
        return next((kind for mark, kind in _PYTHON_KINDS if mark in cmdline), "Python: other")
    if "tansu" in exe:
        return "Tansu"
    return exe


def busy_idle() -> tuple[float, float]:
    """The machine's busy and idle CPU seconds since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / TICK, (idle + iowait) / TICK


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=5.0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    last = {pid: p.own_s for pid, p in processes().items()}  # before: from now on only
    busy0, idle0 = busy_idle()
    began = time.monotonic()
    child = subprocess.Popen(command)
    cpu: Counter[str] = Counter()
    started: Counter[str] = Counter()
    me = os.getpid()
    while True:
        done = child.poll() is not None
        seen = processes()
        for pid, p in seen.items():
            if pid == me:
                continue
            kind = kind_of(p.cmdline)
            if pid not in last:
                started[kind] += 1
            cpu[kind] += max(0.0, p.own_s - last.get(pid, 0.0))
        last = {pid: p.own_s for pid, p in seen.items()}
        if done:
            break
        time.sleep(args.interval)
    busy1, idle1 = busy_idle()
    total = sum(cpu.values())
    print(f"\n{' '.join(command)}: exit {child.returncode}, {time.monotonic() - began:,.0f} s")
    print(f"machine: busy {busy1 - busy0:,.0f} s, idle {idle1 - idle0:,.0f} s of CPU")
    print(f"{'kind':<48} {'CPU s':>8} {'share':>6} {'started':>8}")
    for kind, seconds in cpu.most_common():
        share = seconds / total if total else 0.0
        print(f"{kind:<48} {seconds:8,.0f} {share:6.1%} {started[kind]:8,}")
    sys.exit(child.returncode)


if __name__ == "__main__":
    main()
