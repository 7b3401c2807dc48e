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
- `server_requests` (given a way to read the server's STATUS `requests`): per request
  kind, how many the measured runs sent per 1,000 records and the CPU their handlers
  spent, in µs per record (ftlayer.server.requestcosts): where the CPU went. Work done
  off the requests' threads (the deleter, the checkpoint writer, idle wake-ups) is the
  difference to `server_cpu_us_per_record`. And `store_commits_per_1000_records`: the
  write transactions the server's store committed (an fsync each).
- `server_threads` (with `threads=True`): the CPU of each of the server's threads, by
  the name the system knows it by (ftlayer.threadnames: `ftl-conn` the connections'
  threads, `ftl-ticker`, `ftl-deleter`, ...; threads of one name summed), in µs per
  record, from /proc/<pid>/task/*/schedstat; `exited` is the CPU of threads that ended
  during a run (the process's total less its live threads'), with the rounding of
  the two clocks.

`ServerCost.run(key, records)` measures one run under `key` (a mode, or a batch size
and a mode); `figures(keys)` gives both figures over the runs of those keys.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "COMMITS",
    "SETTLE_S",
    "ServerCost",
    "Usage",
    "server_requests",
    "thread_usage",
    "usage",
]

SETTLE_S = 1.0
"""After each run, before its end is read: the server's deferred deletes of the run."""
_TICK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class Usage:
    cpu_s: float
    """user + system CPU seconds of the process (all its threads)"""
    write_bytes: int | None
    """bytes it caused to be written to storage; None: /proc/<pid>/io is not readable"""


def thread_usage(pid: int) -> dict[str, float]:
    """CPU seconds so far of process `pid`'s live threads, by name (summed per name)."""
    found: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            name = (task / "comm").read_text().strip()
            ns = int((task / "schedstat").read_text().split()[0])
            found[name] = found.get(name, 0.0) + ns / 1e9
    return found


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


Requests = Mapping[str, tuple[int, float]]
"""Per request kind: (requests answered, their handlers' CPU seconds) so far; and under
`COMMITS`, the store's commits (CPU 0)."""
COMMITS = "store commits"


def server_requests(address: str) -> Requests:
    """The server at `address`'s STATUS `requests`, as (count, CPU seconds) by kind,
    and its store's commits (`COMMITS`)."""
    from ftlayer.client import FTClient

    with FTClient(address, name="bench-cost") as client:
        status = client.status()
    found = {kind: (cost.count, cost.cpu_s) for kind, cost in status.requests.items()}
    found[COMMITS] = (status.store_commits, 0.0)
    return found


@dataclass(frozen=True, slots=True)
class _Run:
    key: Hashable
    records: int
    cpu_s: float
    write_bytes: int | None
    requests: Requests
    """The run's own requests (the difference over it)."""
    threads: Mapping[str, float] = field(default_factory=dict)
    """CPU seconds by thread name over the run (with `threads=True`)"""


def _thread_difference(
    after: Mapping[str, float], before: Mapping[str, float], cpu_s: float
) -> dict[str, float]:
    """Each thread name's CPU seconds over a run, and `exited`: the process's CPU over
    it (`cpu_s`) less its live threads' (threads that ended during the run; at least
    0). Nothing when the threads were not read."""
    if not after:
        return {}
    found = {name: s - before.get(name, 0.0) for name, s in after.items()}
    found = {name: s for name, s in found.items() if s > 0}
    found["exited"] = max(0.0, cpu_s - sum(found.values()))
    return found


def _difference(after: Requests, before: Requests) -> Requests:
    """The requests of a run: `after` less `before`, and less the STATUS that read
    `before` (counted once answered; its CPU, a fraction of a millisecond, stays in)."""
    found = {}
    for kind, (n, cpu) in after.items():
        n_before, cpu_before = before.get(kind, (0, 0.0))
        n -= n_before + (kind == "STATUS")
        if n > 0:
            found[kind] = (n, cpu - cpu_before)
    return found


class ServerCost:
    """The server process `pid`'s CPU and writes over measured runs (module docstring)."""

    def __init__(
        self,
        pid: int | None,
        settle_s: float = SETTLE_S,
        requests: Callable[[], Requests] | None = None,
        threads: bool = False,
    ) -> None:
        if pid is None:
            raise ValueError("the FT-layer server process is not running")
        self.pid = pid
        self.settle_s = settle_s
        self._requests = requests
        self._threads = threads
        self.runs: list[_Run] = []

    @contextlib.contextmanager
    def run(self, key: Hashable | None, records: int) -> Iterator[None]:
        """Around one run: waits `settle_s` after it; with a `key`, records the server's
        usage from the start to then as a run of `records` records under `key`. A run
        that raises is not recorded."""
        before = usage(self.pid) if key is not None else None
        threads_before = thread_usage(self.pid) if key is not None and self._threads else {}
        requests_before = self._requests() if key is not None and self._requests else {}
        yield
        time.sleep(self.settle_s)
        if before is None:
            return
        after = usage(self.pid)
        threads_after = thread_usage(self.pid) if self._threads else {}
        requests = _difference(self._requests(), requests_before) if self._requests else {}
        written = (
            None
            if before.write_bytes is None or after.write_bytes is None
            else after.write_bytes - before.write_bytes
        )
        cpu_s = after.cpu_s - before.cpu_s
        threads = _thread_difference(threads_after, threads_before, cpu_s)
        self.runs.append(_Run(key, records, cpu_s, written, requests, threads))

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
        by_kind: dict[str, list[float]] = {}
        for r in runs:
            for kind, (n, cpu_s) in r.requests.items():
                totals = by_kind.setdefault(kind, [0, 0.0])
                totals[0] += n
                totals[1] += cpu_s
        commits = by_kind.pop(COMMITS, [0, 0.0])[0]
        requests = {
            kind: {
                "per_1000_records": round(n * 1000 / records, 3),
                "cpu_us_per_record": round(cpu_s * 1e6 / records, 4),
            }
            for kind, (n, cpu_s) in sorted(by_kind.items(), key=lambda item: -item[1][1])
        }
        by_thread: dict[str, float] = {}
        for r in runs:
            for name, cpu_s in r.threads.items():
                by_thread[name] = by_thread.get(name, 0.0) + cpu_s
        threads = {
            name: round(cpu_s * 1e6 / records, 4)
            for name, cpu_s in sorted(by_thread.items(), key=lambda item: -item[1])
        }
        return {
            **({"server_requests": requests} if self._requests else {}),
            **({"server_threads": threads} if self._threads else {}),
            **(
                {"store_commits_per_1000_records": round(commits * 1000 / records, 3)}
                if self._requests
                else {}
            ),
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
            for figure in (
                "server_cpu_us_per_record",
                "lmdb_bytes_per_record",
                "server_requests",
                "server_threads",
                "store_commits_per_1000_records",
            )
            if any(figure in f for f in found.values())
        }
