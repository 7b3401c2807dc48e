"""Every process's CPU seconds from /proc, for the measurement scripts here
(`fast_cpu.py`, `idle_cpu.py`): run as `python scripts/X.py`, they import it as
`proc_cpu` (the script's directory is first on sys.path)."""

import os
from typing import NamedTuple

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
