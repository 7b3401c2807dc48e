"""Run a measurement script with the FT-layer server and the broker on a core of their
own: this process (so Spark's driver, JVM and Python workers, which inherit its
affinity) on CPU 0, and every `ftlayer serve` and Tansu process, all their threads,
on CPU 1 as soon as they appear. On this 2-core machine it answers one question: does
FT on's cost come from the server's CPU taking Spark's cores, or from work on Spark's
side? (docs/benchmarks/profile.md, "What holds the ratios at 200,000-record batches")

    taskset -c 0 .venv/bin/python scripts/pin_server.py scripts/fast_cpu.py 200000 3
"""

import os
import runpy
import subprocess
import sys
import threading
import time

_PINNED_TO = "1"
_PATTERNS = ("ftlayer.cli serve", "tansu")


def _pin_forever() -> None:
    done: set[str] = set()
    while True:
        for pattern in _PATTERNS:
            found = subprocess.run(
                ["pgrep", "-f", pattern], capture_output=True, text=True, check=False
            )
            for pid in found.stdout.split():
                if pid not in done and int(pid) != os.getpid():
                    subprocess.run(
                        ["taskset", "-a", "-p", "-c", _PINNED_TO, pid],
                        capture_output=True,
                        check=False,
                    )
                    done.add(pid)
        time.sleep(0.2)


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    if os.sched_getaffinity(0) != {0}:
        raise SystemExit("run it under `taskset -c 0` (Spark must stay off CPU 1)")
    threading.Thread(target=_pin_forever, daemon=True).start()
    script, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
