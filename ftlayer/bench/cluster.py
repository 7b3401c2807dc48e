"""`ftlayer bench cluster`: an FT layer of N shards, for each N asked (1 and 2 by
default) in one run, clients included: aggregate records/s persisted and completed,
XOR updates/s, and what the servers spend per record.

For each shard count N, in rounds that alternate the order of the counts: N `ftlayer
serve --shard I --shards N` processes (integration.harness.ftprocess) on fresh data
dirs, as deployed (acker journal on, an fsync per commit), fed over loopback by
`clients` client processes. Client i reads Kafka partition i of source 0, so it talks
to the one shard that owns that partition, (0 + i) mod N (ftlayer.shards), and draws
that shard's roots: as a source's task reads one partition and its records' acks go to
their roots' shard. Total work is the same at every N. The phases are those of
`ftlayer bench server` (ftlayer.bench.server):

- xor: each client persists its trees' roots (not timed), then sends their XOR events
  (trees of a source and 3 tasks, interleaved) in frames of `xor_batch`; every tree
  completes.
- persist: each client persists batches of `batch` records of `payload_bytes` and
  completes batch i (one XOR frame) after batch i + 1 was persisted.

A phase is timed from the moment every client is ready until the last one reports.
The servers' CPU (utime + stime of /proc/<pid>/stat) and bytes written to storage
(/proc/<pid>/io; integration.harness.benchcost) are read when every client is ready
and again once the phase's completed records have left storage (the deleter thread
removes them after completion): all their work for the phase's records. Each client
reports its own CPU for the phase.

Per shard count (`by_shards`, medians over the rounds): `records_per_s`,
`xor_updates_per_s`, `server_cpu_s_per_million_records` (the persist phase, every
server), `server_cpu_s_per_million_xor_updates`, `server_write_bytes_per_record`,
`client_cpu_s_per_million_records`, `cpu_busy_share` (servers' and clients' CPU over
wall time x cores: near 1, the machine's cores were the limit), `machine_busy_share`
(the same for every process of the machine, from /proc/stat: a shared machine's
neighbours take cores too), `store_commits_per_1000_records` (the servers' write
transactions, an fsync each: shards that each serve fewer clients share fewer
commits) and `server_peak_rss_bytes` (the largest server's). Top level: `ratio`
(records/s at the largest count over the smallest), `xor_ratio`,
`cpu_per_record_ratio` (server CPU per record, largest count over smallest), their
`targets` (ratio >= 1.3 and cpu_per_record_ratio <= 1.15, set for 1 and 2 shards on a
2-core machine), and `limit`: what bounds the ratio, read from `cpu_busy_share` and
`machine_busy_share`. Servers and clients share the machine's cores, so shards scale only
while cores are free for them; below that, a shard waits on its commits (an fsync
each, one batch in flight per client), and shards wait side by side.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftlayer.errors import ConfigError

from .clients import BENCH_DEPTH, WAIT_S, bench_client
from .timing import _cpu_times, _join, _machine, _steal_percent

__all__ = ["CLUSTER_TARGET_CPU_PER_RECORD_RATIO", "CLUSTER_TARGET_RATIO", "bench_cluster"]

CLUSTER_TARGET_RATIO = 1.3
CLUSTER_TARGET_CPU_PER_RECORD_RATIO = 1.15


@dataclass(frozen=True)
class _Phase:
    seconds: float
    server_cpu_s: float
    server_write_bytes: int | None
    client_cpu_s: float
    machine_busy_share: float | None
    """The share of the machine's CPU time busy (anyone's) during the phase."""
    store_commits: int
    """Write transactions the servers' stores committed in the phase (an fsync each)."""


def _machine_ticks() -> tuple[int, int] | None:
    """(idle + iowait, total) CPU ticks of the machine since boot, from /proc/stat."""
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            fields = [int(x) for x in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return fields[3] + fields[4], sum(fields[:8])


def bench_cluster(
    shard_counts: tuple[int, ...] = (1, 2),
    records: int = 1_000_000,
    events: int = 2_000_000,
    clients: int = 4,
    payload_bytes: int = 100,
    batch: int = 10_000,
    xor_batch: int = 65_536,
    rounds: int = 3,
    directory: str | None = None,
) -> dict[str, Any]:
    """The figures of the module docstring; `records` and `events` are totals, split
    evenly over the clients."""
    counts = tuple(sorted(set(shard_counts)))
    if len(counts) < 2 or counts[0] < 1:
        raise ConfigError(
            f"the cluster bench compares two shard counts or more (such as 1,2), got "
            f"{','.join(map(str, shard_counts))}"
        )
    if clients < counts[-1]:
        raise ConfigError(
            f"every shard needs a client: {clients} clients for {counts[-1]} shards "
            "(each client reads one partition, on one shard)"
        )
    if rounds < 1:
        raise ConfigError(f"rounds must be at least 1, got {rounds}")
    roots_each = max(1, events // clients // (BENCH_DEPTH + 1))
    records_each = max(1, records // clients)
    n_events = roots_each * (BENCH_DEPTH + 1) * clients
    n_records = records_each * clients
    runs: dict[int, list[tuple[_Phase, _Phase, int]]] = {n: [] for n in counts}
    cpu_before = _cpu_times()
    for number in range(rounds):
        for n in counts if number % 2 == 0 else counts[::-1]:
            runs[n].append(
                _cluster_run(
                    n, clients, roots_each, records_each, payload_bytes, batch, xor_batch, directory
                )
            )
    steal = _steal_percent(cpu_before)
    cpus = os.cpu_count() or 1
    by_shards = {
        str(n): _figures(runs[n], n_events, n_records, cpus) for n in counts
    }  # fmt: skip
    low, high = by_shards[str(counts[0])], by_shards[str(counts[-1])]
    ratio = high["records_per_s"] / low["records_per_s"]
    cpu_ratio = (
        high["server_cpu_s_per_million_records"] / low["server_cpu_s_per_million_records"]
        if low["server_cpu_s_per_million_records"]
        else None
    )
    return {
        "bench": "cluster",
        "shards": list(counts),
        "clients": clients,
        "records": n_records,
        "events": n_events,
        "payload_bytes": payload_bytes,
        "batch": batch,
        "xor_batch": xor_batch,
        "rounds": rounds,
        "by_shards": by_shards,
        "ratio": round(ratio, 3),
        "xor_ratio": round(high["xor_updates_per_s"] / low["xor_updates_per_s"], 3),
        "cpu_per_record_ratio": None if cpu_ratio is None else round(cpu_ratio, 3),
        "targets": {
            "ratio": CLUSTER_TARGET_RATIO,
            "cpu_per_record_ratio": CLUSTER_TARGET_CPU_PER_RECORD_RATIO,
        },
        "meets_targets": ratio >= CLUSTER_TARGET_RATIO
        and cpu_ratio is not None
        and cpu_ratio <= CLUSTER_TARGET_CPU_PER_RECORD_RATIO,
        "limit": _limit(counts[-1], clients, cpus, high),
        "cpu_steal_percent": steal,
        "machine": _machine(),
    }


def _figures(
    runs: list[tuple[_Phase, _Phase, int]], n_events: int, n_records: int, cpus: int
) -> dict[str, Any]:
    """One shard count's medians over its rounds."""
    xor = [x for x, _, _ in runs]
    persist = [p for _, p, _ in runs]
    writes = [p.server_write_bytes for p in persist]
    busy = [(p.server_cpu_s + p.client_cpu_s) / (p.seconds * cpus) for p in persist]
    machine = [p.machine_busy_share for p in persist]

    def med(values: list[float]) -> float:
        return statistics.median(values)

    return {
        "records_per_s": round(n_records / med([p.seconds for p in persist])),
        "xor_updates_per_s": round(n_events / med([x.seconds for x in xor])),
        "server_cpu_s_per_million_records": round(
            med([p.server_cpu_s for p in persist]) * 1e6 / n_records, 3
        ),
        "server_cpu_s_per_million_xor_updates": round(
            med([x.server_cpu_s for x in xor]) * 1e6 / n_events, 3
        ),
        "server_write_bytes_per_record": None
        if None in writes
        else round(med([float(w or 0) for w in writes]) / n_records, 1),
        "client_cpu_s_per_million_records": round(
            med([p.client_cpu_s for p in persist]) * 1e6 / n_records, 3
        ),
        "cpu_busy_share": round(med(busy), 3),
        "machine_busy_share": None
        if None in machine
        else round(med([float(m or 0) for m in machine]), 3),
        "store_commits_per_1000_records": round(
            med([float(p.store_commits) for p in persist]) * 1000 / n_records, 2
        ),
        "server_cpu_share": round(
            med([p.server_cpu_s / (p.server_cpu_s + p.client_cpu_s) for p in persist]), 3
        ),
        "server_peak_rss_bytes": max(rss for _, _, rss in runs),
    }


def _limit(shards: int, clients: int, cpus: int, figures: dict[str, Any]) -> str:
    """What bounds the ratio, read from the largest shard count's figures: the cores
    when they were busy (by the bench or by other processes of the machine), else the
    waits (each client has one batch in flight, and a shard's commit ends with an
    fsync)."""
    busy, server_share = figures["cpu_busy_share"], figures["server_cpu_share"]
    machine = figures["machine_busy_share"]
    shared = (
        f"{cpus} cores shared by {clients} client processes and {shards} server processes; "
        f"at {shards} shards they kept {busy:.0%} of the cores busy in the persist phase "
        f"(servers {server_share:.0%} of that CPU, clients {1 - server_share:.0%})"
    )
    if machine is not None:
        others = max(0.0, machine - busy)
        shared += f", other processes of the machine {others:.0%}"
        busy = max(busy, machine)
    if busy >= 0.8:
        return (
            f"the cores: {shared}. A shard, one Python process, uses about one core "
            "at most, so N shards reach N times one shard only with N cores free for the "
            "servers beside the clients"
        )
    return (
        f"waiting, not the cores: {shared}. Each client keeps one batch in flight and "
        "each shard's commit ends with an fsync, so a shard's rate is bound by its commit "
        "latency; more shards commit side by side, until the disk or the cores are full"
    )


def _cluster_run(
    shards: int,
    clients: int,
    roots_each: int,
    records_each: int,
    payload_bytes: int,
    batch: int,
    xor_batch: int,
    directory: str | None,
) -> tuple[_Phase, _Phase, int]:
    """One round at `shards` shards on fresh servers: (xor phase, persist phase, the
    largest server's peak resident memory in bytes)."""
    import multiprocessing

    from ftlayer.integration.harness.ftprocess import FTServerProcess

    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(dir=directory, prefix="ftlayer-bench-cluster-") as tmp:
        servers: list[FTServerProcess] = []
        try:
            for index in range(shards):
                place = ["--shard", str(index), "--shards", str(shards)] if shards > 1 else []
                server = FTServerProcess(
                    Path(tmp) / f"shard{index}", "--tree-timeout-s", "3600", *place
                )
                servers.append(server.start())
            addresses = [s.address for s in servers]
            pids = [int(s.pid or 0) for s in servers]
            barrier = ctx.Barrier(clients + 1)
            results = ctx.Queue()
            workers = [
                ctx.Process(
                    target=bench_client,
                    args=(
                        addresses[index % shards],
                        index,
                        shards,
                        roots_each,
                        records_each,
                        payload_bytes,
                        batch,
                        xor_batch,
                        barrier,
                        results,
                    ),
                    daemon=True,
                )
                for index in range(clients)
            ]
            for worker in workers:
                worker.start()
            try:
                xor = _phase(pids, addresses, barrier, results, clients, "xor")
                persist = _phase(pids, addresses, barrier, results, clients, "persist")
            finally:
                _join(workers)
            rss = max(_peak_rss(pid) for pid in pids)
            statuses = [_status(a) for a in addresses]
        finally:
            for server in servers:
                server.stop()
    expected = (roots_each + records_each) * clients
    completed = sum(s.completed for s in statuses)
    if completed != expected or any(s.pending or s.stored_records for s in statuses):
        raise AssertionError(
            f"cluster bench at {shards} shards: {completed} completed, "
            f"{sum(s.pending for s in statuses)} pending, "
            f"{sum(s.stored_records for s in statuses)} still stored; expected {expected}, 0, 0"
        )
    return xor, persist, rss


def _phase(
    pids: list[int], addresses: list[str], barrier: Any, results: Any, clients: int, name: str
) -> _Phase:
    """One timed phase: every client ready, the servers' usage read, go; until every
    client reported and the servers' storage is empty again."""
    from ftlayer.integration.harness.benchcost import usage

    barrier.wait(timeout=WAIT_S)  # every client ready
    commits = sum(_status(a).store_commits for a in addresses)
    before = [usage(pid) for pid in pids]
    ticks = _machine_ticks()
    barrier.wait(timeout=WAIT_S)  # go
    start = time.perf_counter()
    client_cpu_s = 0.0
    for _ in range(clients):
        phase, error, cpu_s = results.get(timeout=WAIT_S)
        if error is not None:
            raise AssertionError(f"cluster bench client failed in {phase}: {error}")
        if phase != name:
            raise AssertionError(f"cluster bench: expected {name}, got {phase}")
        client_cpu_s += cpu_s
    seconds = time.perf_counter() - start
    ticks_after = _machine_ticks()
    machine_busy = (
        None
        if ticks is None or ticks_after is None or ticks_after[1] <= ticks[1]
        else 1 - (ticks_after[0] - ticks[0]) / (ticks_after[1] - ticks[1])
    )
    for address in addresses:
        _drained(address)
    after = [usage(pid) for pid in pids]
    written = [
        None if b.write_bytes is None or a.write_bytes is None else a.write_bytes - b.write_bytes
        for b, a in zip(before, after, strict=True)
    ]
    return _Phase(
        seconds=seconds,
        server_cpu_s=sum(a.cpu_s - b.cpu_s for b, a in zip(before, after, strict=True)),
        server_write_bytes=None if None in written else sum(w or 0 for w in written),
        client_cpu_s=client_cpu_s,
        machine_busy_share=machine_busy,
        store_commits=sum(_status(a).store_commits for a in addresses) - commits,
    )


def _status(address: str) -> Any:
    from ftlayer.client import FTClient

    with FTClient(address, name="bench-cluster-status") as client:
        return client.status()


def _drained(address: str, timeout_s: float = 120.0) -> None:
    """Wait until the server at `address` stores no record (its deletes done)."""
    deadline = time.monotonic() + timeout_s
    while _status(address).stored_records and time.monotonic() < deadline:
        time.sleep(0.05)


def _peak_rss(pid: int) -> int:
    """The process's peak resident memory (VmHWM), in bytes; 0 if unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
