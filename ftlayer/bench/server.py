"""`ftlayer bench server`: XOR updates and records per second through a real FTServer
over loopback from client processes, against the in-process core on the same sizes;
with the acker journal and without. Each round also runs the mixed bench
(ftlayer.bench.mixed)."""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from ftlayer.errors import ConfigError

from .acker import bench_acker
from .clients import BENCH_DEPTH, WAIT_S, bench_client
from .mixed import _mixed_figures, mixed_server_run
from .persist import bench_persist
from .timing import _drained_status, _join, _machine

SERVER_TARGET_XOR_RATE = 1_500_000
SERVER_TARGET_RECORD_RATE = 150_000


def bench_server(
    records: int = 1_000_000,
    events: int = 2_000_000,
    clients: int = 2,
    payload_bytes: int = 100,
    batch: int = 10_000,
    xor_batch: int = 65_536,
    directory: str | None = None,
    rounds: int = 2,
    mixed_batches: int = 4,
) -> dict[str, Any]:
    """XOR updates/s and persisted-then-completed records/s through the real server.

    The server runs with its acker journal (the default) and without, alternating,
    `rounds` times each; the figures are the medians with the journal, and the
    `journal_*_ratio`s are with / without.

    An FTServer on a fresh LMDB dir (in this process, its own threads) is fed over
    loopback TCP by `clients` client processes (multiprocessing, spawn), each with its
    own FTClient connection. `records` and `events` are totals, split evenly.

    - xor: each client first persists its roots (not timed), then sends its events
      (trees of depth 3 as in the acker bench, interleaved) in XOR frames of `xor_batch`
      events; every tree completes.
    - persist: each client persists batches of `batch` records of `payload_bytes` and
      completes batch i (one XOR frame) after batch i + 1 was persisted, as the
      persist bench does in process.

    A phase is timed from the moment every client is ready (a barrier) until the last
    one reports done. The server deletes completed records from LMDB in a background
    thread, so deletes of the XOR phase may still run during the persist phase (they
    compete with it, as they would in production); the bench then waits for the
    storage to be empty and fails if it does not get there. The in-process core
    figures of the same sizes (bench_acker, bench_persist with one round) are measured
    in the same run, after the server phases, and the ratios server/in-process reported.

    With `mixed_batches` (0: none), every round also runs `mixed_server_run` on a
    fresh server with its journal: the `mixed` figures pool the rounds' samples.
    """
    if clients < 1:
        raise ConfigError(f"clients must be at least 1, got {clients}")
    if mixed_batches < 0:
        raise ConfigError(f"mixed_batches must be at least 0, got {mixed_batches}")
    per_tree = BENCH_DEPTH + 1
    roots_each = max(1, events // clients // per_tree)
    records_each = max(1, records // clients)
    runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    mixed: list[dict[str, list[float]]] = []
    for _round in range(rounds):
        if mixed_batches:
            mixed.append(mixed_server_run(mixed_batches, directory=directory))
        for journal in (False, True):  # alternating, so drift hits both alike
            xor_s, persist_s = _server_run(
                journal,
                clients,
                roots_each,
                records_each,
                payload_bytes,
                batch,
                xor_batch,
                directory,
            )
            runs[journal].append((xor_s, persist_s))
    xor_s = statistics.median(x for x, _ in runs[True])
    persist_s = statistics.median(p for _, p in runs[True])
    plain_xor_s = statistics.median(x for x, _ in runs[False])
    plain_persist_s = statistics.median(p for _, p in runs[False])
    n_events = roots_each * per_tree * clients
    n_records = records_each * clients
    xor_rate, record_rate = n_events / xor_s, n_records / persist_s
    acker = bench_acker(roots=roots_each * clients, depth=BENCH_DEPTH, batch=xor_batch)
    persist = bench_persist(
        records=n_records,
        payload_bytes=payload_bytes,
        batch=batch,
        directory=directory,
        rounds=1,
    )
    return {
        "bench": "server",
        "clients": clients,
        "events": n_events,
        "xor_batch": xor_batch,
        "records": n_records,
        "payload_bytes": payload_bytes,
        "batch": batch,
        "xor_updates_per_s": round(xor_rate),
        "records_per_s": round(record_rate),
        "in_process_xor_updates_per_s": acker["updates_per_s"],
        "in_process_records_per_s": persist["records_per_s"],
        "xor_ratio_vs_in_process": round(xor_rate / acker["updates_per_s"], 3),
        "journal": True,
        "rounds": rounds,
        "without_journal_xor_updates_per_s": round(n_events / plain_xor_s),
        "without_journal_records_per_s": round(n_records / plain_persist_s),
        "journal_xor_ratio": round(plain_xor_s / xor_s, 3),
        "journal_records_ratio": round(plain_persist_s / persist_s, 3),
        "records_ratio_vs_in_process": round(record_rate / persist["records_per_s"], 3),
        "mixed": _mixed_figures(mixed, mixed_batches) if mixed else None,
        "targets": {
            "xor_updates_per_s": SERVER_TARGET_XOR_RATE,
            "records_per_s": SERVER_TARGET_RECORD_RATE,
        },
        "meets_targets": xor_rate >= SERVER_TARGET_XOR_RATE
        and record_rate >= SERVER_TARGET_RECORD_RATE,
        "machine": _machine(),
    }


def _server_run(
    journal: bool,
    clients: int,
    roots_each: int,
    records_each: int,
    payload_bytes: int,
    batch: int,
    xor_batch: int,
    directory: str | None,
) -> tuple[float, float]:
    """One round of bench_server on a fresh server: (xor seconds, persist seconds)."""
    import multiprocessing

    from ftlayer.server import FTServer

    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(dir=directory, prefix="ftlayer-bench-server-") as tmp:
        server = FTServer(Path(tmp) / "data", timeout_s=3600, journal=journal).start()
        try:
            host, port = server.address
            barrier = ctx.Barrier(clients + 1)
            results = ctx.Queue()
            workers = [
                ctx.Process(
                    target=bench_client,
                    args=(
                        f"{host}:{port}",
                        i,
                        1,
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
                for i in range(clients)
            ]
            for worker in workers:
                worker.start()
            try:
                xor_s = _server_phase(barrier, results, clients, "xor")
                persist_s = _server_phase(barrier, results, clients, "persist")
            finally:
                _join(workers)
            status = _drained_status(f"{host}:{port}")
        finally:
            server.stop()
    expected = roots_each * clients + records_each * clients
    if status["completed"] != expected or status["pending"] or status["stored_records"]:
        raise AssertionError(
            f"server bench: {status['completed']} completed, {status['pending']} pending, "
            f"{status['stored_records']} still stored; expected {expected}, 0 and 0"
        )
    return xor_s, persist_s


def _server_phase(barrier: Any, results: Any, clients: int, phase: str) -> float:
    """Seconds from the go (every client ready, then the second barrier) until every
    client reported (ftlayer.bench.clients)."""
    barrier.wait(timeout=WAIT_S)  # ready
    barrier.wait(timeout=WAIT_S)  # go
    start = time.perf_counter()
    for _ in range(clients):
        name, error, _cpu_s = results.get(timeout=WAIT_S)
        if error is not None:
            raise AssertionError(f"server bench client failed in {name}: {error}")
        if name != phase:
            raise AssertionError(f"server bench: expected {phase}, got {name}")
    return time.perf_counter() - start
