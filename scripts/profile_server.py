"""Where the FT-layer server's CPU goes in the fast pipeline bench: one run of
`bench_fast` (integration/harness/benchfast.py) at one batch size, with py-spy sampling
the `ftlayer serve` process of one FT mode (SERVER: barrier, the default, or tree; the
bench gives each mode a server of its own) the whole time (threads holding the GIL
only: Python at work, not numpy or LMDB with the GIL released; with PROFILE_NATIVE=1
every running thread, native frames included), folded into the functions that take
the most samples (the server's start, its imports, left out), by own time and by time
including callees, as a share of all samples and in µs per record of FT-on runs; and
the server's whole CPU time (from /proc) per record. Needs py-spy in the virtualenv
(`pip install py-spy`).

    [SERVER=tree] [FAIL_RATE=0.01] [PROFILE_NONBLOCKING=1] \
        .venv/bin/python scripts/profile_server.py [BATCH_SIZE] [ROUNDS] [TOP]
"""

import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import ftlayer.integration.harness.benchfast as bf

BATCH = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 1
TOP = int(sys.argv[3]) if len(sys.argv) > 3 else 30
NATIVE = os.environ.get("PROFILE_NATIVE") == "1"  # every running thread, C frames too
SERVER = os.environ.get("SERVER", "barrier")  # the FT mode whose server is sampled
RATE = 250  # samples per second
RECORDS = 400_000


def _server_pid(deadline: float) -> int | None:
    while time.monotonic() < deadline:
        out = subprocess.run(
            ["pgrep", "-f", f"ftlayer.cli serve --data-dir .*/ft-{SERVER} "],
            capture_output=True,
            text=True,
            check=False,
        )
        pids = [int(p) for p in out.stdout.split()]
        if pids:
            return pids[0]
        time.sleep(0.05)
    return None


_CPU_S = [0.0]  # the server's CPU seconds (user + system), last seen


def _watch_cpu(pid: int) -> None:
    tick = os.sysconf("SC_CLK_TCK")
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return
        _CPU_S[0] = (int(fields[11]) + int(fields[12])) / tick
        time.sleep(0.2)


def _record(path: str) -> None:
    pid = _server_pid(time.monotonic() + 600)
    if pid is None:
        return
    threading.Thread(target=_watch_cpu, args=(pid,), daemon=True).start()
    spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
    which = ["--native"] if NATIVE else ["--gil"]
    if os.environ.get("PROFILE_NONBLOCKING") == "1":  # the server is not stopped to sample
        which.append("--nonblocking")
    subprocess.run(
        [spy, "record", "-p", str(pid), "-r", str(RATE), *which, "--format", "raw", "-o", path],
        capture_output=True,
        check=False,
    )


_WAITS = ("poll", "select", "epoll_wait", "accept", "accept4", "nanosleep", "clock_nanosleep")


def _idle(frames: list[str]) -> bool:
    """A native stack of a thread that waits (py-spy --native samples those too): in a
    socket wait, a sleep or a lock wait (libc's futex wait, shown as an address)."""
    leaf = frames[-1]
    return leaf in _WAITS or (leaf.startswith("0x") and "PyThread_acquire_lock_timed" in frames)


def _starting(frames: list[str]) -> bool:
    """A stack of the server's start (its imports, numba's cache loading): not the
    bench's work, and up to 75% of the samples with PROFILE_NATIVE=1."""
    return any(f in ("_find_and_load", "compile_kernels") for f in frames)


def _fold(path: str) -> tuple[int, collections.Counter[str], collections.Counter[str]]:
    total = 0
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            n = int(count)
            frames = [frame.split(" (")[0] for frame in stack.split(";")[1:]]  # no thread
            if not frames or (NATIVE and _idle(frames)) or _starting(frames):
                continue
            total += n
            own[frames[-1]] += n
            for frame in set(frames):
                inclusive[frame] += n
    return total, own, inclusive


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "server.txt")
        recorder = threading.Thread(target=_record, args=(raw,), daemon=True)
        recorder.start()
        result = bf.bench_fast(
            records=RECORDS,
            batch_sizes=[BATCH],
            rounds=ROUNDS,
            fail_rate=float(os.environ.get("FAIL_RATE", "0")),
        )
        recorder.join(30)
        total, own, inclusive = _fold(raw)
        if os.environ.get("PROFILE_RAW"):  # keep py-spy's raw stacks there
            shutil.copy(raw, os.environ["PROFILE_RAW"])
    # Records the server saw: its mode's warm-up run and one run each round.
    ft_records = RECORDS * (sum(m == SERVER for m in bf.WARM_UP) + ROUNDS)
    us = 1e6 / RATE / ft_records

    def table(counter: collections.Counter[str]) -> list[dict[str, object]]:
        return [
            {"function": name, "share": round(n / total, 3), "us_per_record": round(n * us, 3)}
            for name, n in counter.most_common(TOP)
        ]

    print(
        json.dumps(
            {
                "batch": BATCH,
                "rounds": ROUNDS,
                "ft_on_records": ft_records,
                "server_cpu_us_per_record": round(1e6 * _CPU_S[0] / ft_records, 3),
                "server_gil_us_per_record": round(total * us, 3),
                "ratios": {
                    k: v
                    for k, v in result["batch_sizes"][str(BATCH)].items()
                    if k.startswith("ratio")
                },
                "own": table(own),
                "inclusive": table(inclusive),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
