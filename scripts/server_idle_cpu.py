"""The CPU an idle `ftlayer serve` (no client) spends, per thread: the server starts on
an empty store, settles SETTLE_S, then each thread's CPU (/proc/<pid>/task/*/schedstat,
ns on the CPU) is read over IDLE_S seconds, in ms of CPU per second.

    .venv/bin/python scripts/server_idle_cpu.py [IDLE_S]
"""

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ftlayer.integration.harness.benchcost import thread_usage

IDLE_S = float(sys.argv[1]) if len(sys.argv) > 1 else 20.0
SETTLE_S = 3.0


def main() -> None:
    with tempfile.TemporaryDirectory() as data_dir:
        server = subprocess.Popen(
            [str(Path(sys.executable).with_name("ftlayer")), "serve", "--data-dir", data_dir],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            time.sleep(SETTLE_S)
            before = thread_usage(server.pid)
            time.sleep(IDLE_S)
            after = thread_usage(server.pid)
        finally:
            server.terminate()
            server.wait(10)
    rows = sorted(
        ((name, (s - before.get(name, 0.0)) * 1e3 / IDLE_S) for name, s in after.items()),
        key=lambda row: -row[1],
    )
    total = sum(ms for _, ms in rows)
    print(f"idle server, {IDLE_S:.0f} s: {total:.2f} ms of CPU a second")
    for name, ms in rows:
        if ms >= 0.005:
            print(f"  {name:<24} {ms:.2f}")


if __name__ == "__main__":
    main()
