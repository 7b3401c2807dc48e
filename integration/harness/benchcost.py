"""The FT-layer server's own cost in the pipeline benches, per record, from /proc.

The benches start the server as a child process (`integration.harness.ftprocess`), so
its costs are those of one process, read before a run's query starts and again
`SETTLE_S` after the run ended (its query stopped; the server's deferred deletes of the
run land in that second):

- `server_cpu_us_per_record`: the CPU the server process spent (utime + stime of
  /proc/<pid>/stat, every thread, in clock ticks of os.sysconf("SC_CLK_TCK")), in µs,
  over the records the measured runs read from Kafka (a run's records, not its
  replays: a replay's cost is its record's).
- `lmdb_bytes_per_record`: the bytes the server process wrote to storage (write_bytes
  of /proc/<pid>/io: the page-cache pages it dirtied, each counted once until written
  back; its LMDB store, and its acker journal and log when it writes them), over the
  same records. None where /proc/<pid>/io cannot be read.

`ServerCost.run(key, records)` measures one run under `key` (a mode, or a batch size
and a mode); `figures(keys)` gives both figures over the runs of those keys.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["SETTLE_S", "ServerCost", "Usage", "usage"]

SETTLE_S = 1.0
"""After each run, before its end is read: the server's deferred deletes of the run."""
_TICK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class Usage:
    cpu_s: float
    """user + system CPU seconds of the process (all its threads)"""
    write_bytes: int | None
    """bytes it caused to be written to storage; None: /proc/<pid>/io is not readable"""


def usage(pid: int) -> Usage:
    """The CPU and storage writes of process `pid` so far (OSError: it is gone)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu_s = (int(fields[11]) + int(fields[12])) / _TICK
    written: int | None = None
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            name, _, value = line.partition(":")
            if name == "write_bytes":
                written = int(value)
    return Usage(cpu_s, written)


@dataclass(frozen=True, slots=True)
class _Run:
    key: Hashable
    records: int
    cpu_s: float
    write_bytes: int | None


class ServerCost:
    """The server process `pid`'s CPU and writes over measured runs (module docstring)."""

    def __init__(self, pid: int | None, settle_s: float = SETTLE_S) -> None:
        if pid is None:
            raise ValueError("the FT-layer server process is not running")
        self.pid = pid
        self.settle_s = settle_s
        self.runs: list[_Run] = []

    @contextlib.contextmanager
    def run(self, key: Hashable | None, records: int) -> Iterator[None]:
        """Around one run: waits `settle_s` after it; with a `key`, records the server's
        usage from the start to then as a run of `records` records under `key`. A run
        that raises is not recorded."""
        before = usage(self.pid) if key is not None else None
        yield
        time.sleep(self.settle_s)
        if before is None:
            return
        after = usage(self.pid)
        written = (
            None
            if before.write_bytes is None or after.write_bytes is None
            else after.write_bytes - before.write_bytes
        )
        self.runs.append(_Run(key, records, after.cpu_s - before.cpu_s, written))

    def figures(self, keys: Iterable[Hashable]) -> dict[str, Any]:
        """`server_cpu_us_per_record` and `lmdb_bytes_per_record` over the runs of
        `keys` (None: no such run; the bytes also when /proc/<pid>/io was not read)."""
        wanted = set(keys)
        runs = [r for r in self.runs if r.key in wanted]
        records = sum(r.records for r in runs)
        if not records:
            return {"server_cpu_us_per_record": None, "lmdb_bytes_per_record": None}
        cpu = sum(r.cpu_s for r in runs) * 1e6 / records
        written = [r.write_bytes for r in runs]
        return {
            "server_cpu_us_per_record": round(cpu, 3),
            "lmdb_bytes_per_record": (
                None
                if any(w is None for w in written)
                else round(sum(w for w in written if w is not None) / records, 1)
            ),
        }

    def by_mode(self, keys: dict[str, Iterable[Hashable]]) -> dict[str, dict[str, Any]]:
        """Per name (a mode), its keys' figures, as two dicts keyed by figure:
        {"server_cpu_us_per_record": {mode: ...}, "lmdb_bytes_per_record": {mode: ...}}."""
        found = {name: self.figures(k) for name, k in keys.items()}
        return {
            f"{figure}_by_mode": {name: f[figure] for name, f in found.items()}
            for figure in ("server_cpu_us_per_record", "lmdb_bytes_per_record")
        }
