"""Every process's CPU seconds from /proc, and a server's request costs, for the
measurement scripts here (`fast_cpu.py`, `idle_cpu.py`, `server_batch_cost.py`,
`server_fail_cpu.py`): run as `python scripts/X.py`, they import it as `proc_cpu` (the
script's directory is first on sys.path)."""

import os
from collections.abc import Mapping
from typing import Any, NamedTuple

TICK = os.sysconf("SC_CLK_TCK")


class Process(NamedTuple):
    parent: int
    own_s: float
    """user + system CPU seconds of the process itself"""
    children_s: float
    """user + system CPU seconds of its children it has waited for"""
    cmdline: str


def processes() -> dict[int, Process]:
    """Every process readable now, by pid (one that ends meanwhile is left out)."""
    found: dict[int, Process] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        utime, stime, cutime, cstime = (int(x) / TICK for x in fields[11:15])
        found[int(pid)] = Process(int(fields[1]), utime + stime, cutime + cstime, cmdline)
    return found


def user_sys(pid: int) -> tuple[float, float]:
    """The user and system CPU seconds of process `pid` so far (every thread)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def print_requests(
    before: Mapping[str, Any], after: Mapping[str, Any], batches: int, records: int
) -> None:
    """Per request kind (a STATUS `requests` before and after a run): the requests per
    batch and their handlers' CPU per record and per request."""
    for kind, cost in sorted(after.items()):
        earlier = before.get(kind)
        count = cost.count - (earlier.count if earlier else 0)
        cpu_s = cost.cpu_s - (earlier.cpu_s if earlier else 0.0)
        if count:
            print(
                f"  {kind:<18} {count / batches:5.2f} per batch "
                f"{cpu_s / records * 1e6:.4f} µs per record, "
                f"{cpu_s / count * 1e6:,.0f} µs each"
            )
