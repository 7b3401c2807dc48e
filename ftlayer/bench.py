"""Benchmarks: each measures ftlayer and, in the same run, the baseline it is judged by.

- acker: XOR updates per second through AckerTable on batched events, against a naive
  one-event-at-a-time dict loop on the same events; and the memory per pending root of
  a bare table and of the FT layer's own. Targets: >= 3,000,000 updates/s, >= 3x the
  naive loop, <= 64 bytes per pending root in the FT layer's table.
- persist: source records per second through persist -> complete -> delete on LMDB
  (FTLayer on LmdbStorage), against raw py-lmdb put + delete of the same payloads in the
  same batches. Targets: >= 250,000 records/s and >= 0.5x raw LMDB.
- server: XOR updates and records per second through a real `ftlayer serve` over
  loopback from client processes, against the in-process core on the same sizes.
  Targets: >= 1,500,000 XOR updates/s and >= 150,000 records/s. Also, in the shape of
  a Spark job (two task slots persisting 50,000-record chunks of a 200,000-record
  micro-batch while a sink completes the batch before), how long each persist and
  each XOR frame takes: what one connection's work costs the others (`mixed`).
- checkpoint: a micro-batch job's records per second with a checkpoint at every batch
  against none, in paired rounds; checkpoint times against pending roots. Target:
  >= 0.95x without.
- pipeline (ftlayer.integration.harness.benchpipe): the demo pipeline on Spark, FT on
  against FT off.

Each returns a dict of figures; the CLI prints it as one JSON object on the last line.
Figures are wall-clock rates on whatever else the machine is doing: compare the ratio,
which both sides of one run share.
"""

from __future__ import annotations

import gc
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
from numpy.typing import NDArray

from ftlayer.acking.acker import AckerTable
from ftlayer.acking.handlers import FTChannel
from ftlayer.acking.ids import new_ids
from ftlayer.core import FTLayer
from ftlayer.persistence.lmdb_storage import LmdbStorage
from ftlayer.persistence.memory import MemoryStorage
from ftlayer.records import RecordBatch

ACKER_TARGET_RATE = 3_000_000
ACKER_TARGET_RATIO = 3.0
FT_TABLE_TARGET_BYTES = 64
PERSIST_TARGET_RATE = 250_000
PERSIST_TARGET_RATIO = 0.5


def _machine() -> dict[str, Any]:
    return {"python": platform.python_version(), "cpus": os.cpu_count(), "numpy": np.__version__}


def _cpu_times() -> tuple[int, int] | None:
    """(steal, total) CPU ticks since boot from /proc/stat; None where there is none."""
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            fields = [int(x) for x in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal [guest guest_nice: within user]
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def _steal_percent(before: tuple[int, int] | None) -> float | None:
    """The share of CPU time the hypervisor took from this VM since `before`: on a
    shared machine, runs with much steal measure the neighbours as well."""
    after = _cpu_times()
    if before is None or after is None or after[1] <= before[1]:
        return None
    return round(100 * (after[0] - before[0]) / (after[1] - before[1]), 1)


def _timed(fn: Callable[[], object]) -> float:
    gc.collect()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def tree_events(
    roots: int, depth: int, seed: int = 7
) -> tuple[NDArray[np.uint64], NDArray[np.uint64], NDArray[np.uint64], NDArray[np.uint64]]:
    """A workload of `roots` trees, each a chain of `depth` tasks after its source.

    Returns (roots, first ack values, event roots, event values). Events are the ones
    handlers send: each task acks its input XOR its output; the sink acks the last
    output. They are interleaved across trees in random order (seeded), the worst case
    for memory locality.
    """
    root_ids = new_ids(roots)
    ids = [new_ids(roots) for _ in range(depth + 1)]
    event_roots = np.tile(root_ids, depth + 1)
    event_values = np.concatenate([ids[j] ^ ids[j + 1] for j in range(depth)] + [ids[depth]])
    order = np.random.default_rng(seed).permutation(len(event_roots))
    return root_ids, ids[0], event_roots[order], event_values[order]


def bench_acker(roots: int = 1_000_000, depth: int = 3, batch: int = 65_536) -> dict[str, Any]:
    """XOR updates/s: AckerTable on batches against a naive dict loop, same events."""
    root_ids, first, event_roots, event_values = tree_events(roots, depth)
    n_events = len(event_roots)

    table = AckerTable()
    add_s = _timed(lambda: table.add(root_ids, first))
    memory_per_root = table.memory_bytes() / roots
    completed = 0

    def batched() -> None:
        nonlocal completed
        for lo in range(0, n_events, batch):
            completed += len(
                table.xor(event_roots[lo : lo + batch], event_values[lo : lo + batch]).completed
            )

    batched_s = _timed(batched)
    if completed != roots or len(table):
        raise AssertionError(f"acker bench: {completed} of {roots} trees completed")

    naive: dict[int, int] = dict(zip(root_ids.tolist(), first.tolist(), strict=True))
    roots_list, values_list = event_roots.tolist(), event_values.tolist()
    naive_done: list[int] = []

    def one_at_a_time() -> None:
        for root, value in zip(roots_list, values_list, strict=True):
            current = naive.get(root)
            if current is None:
                continue
            current ^= value
            if current == 0:
                del naive[root]
                naive_done.append(root)
            else:
                naive[root] = current

    naive_s = _timed(one_at_a_time)
    if len(naive_done) != roots:
        raise AssertionError("acker bench: the naive loop disagrees")

    rate, naive_rate = n_events / batched_s, n_events / naive_s
    ft_memory = ft_table_bytes_per_pending_root(roots)
    return {
        "bench": "acker",
        "roots": roots,
        "events": n_events,
        "batch": batch,
        "updates_per_s": round(rate),
        "naive_updates_per_s": round(naive_rate),
        "ratio_vs_naive": round(rate / naive_rate, 2),
        "add_roots_per_s": round(roots / add_s),
        "memory_bytes_per_pending_root": round(memory_per_root, 1),
        "ftlayer_table_bytes_per_pending_root": ft_memory["churned"],
        "ftlayer_table_bytes_per_pending_root_filled": ft_memory["filled"],
        "targets": {
            "updates_per_s": ACKER_TARGET_RATE,
            "ratio_vs_naive": ACKER_TARGET_RATIO,
            "ftlayer_table_bytes_per_pending_root": FT_TABLE_TARGET_BYTES,
        },
        "meets_targets": rate >= ACKER_TARGET_RATE
        and rate / naive_rate >= ACKER_TARGET_RATIO
        and ft_memory["churned"] <= FT_TABLE_TARGET_BYTES,
        "machine": _machine(),
    }


def ft_table_bytes_per_pending_root(roots: int, batch: int = 65_536) -> dict[str, float]:
    """Bytes per pending root of the FT layer's own acker table (`FTLayer.acker`, as
    the server makes it), counting every array it holds (`memory_bytes`: the rows of
    root, ack value and record locator, and the hash index). "filled": after `roots`
    roots were added in batches, as persist adds them; "churned": after each of those
    completed and a new root took its place, batch by batch, as in a running server
    (its index has then dropped deleted slots at least once)."""
    table = FTLayer(MemoryStorage()).acker
    ids = new_ids(2 * roots)
    locators: dict[str, NDArray[Any]] = {
        "seq": np.arange(1, 2 * roots + 1, dtype=np.uint64),
        "offset": np.arange(2 * roots, dtype=np.int64),
        "partition": np.zeros(2 * roots, dtype=np.int32),
        "topic": np.zeros(2 * roots, dtype=np.uint32),
    }

    def add(lo: int, hi: int) -> None:
        table.add(ids[lo:hi], ids[lo:hi], **{name: v[lo:hi] for name, v in locators.items()})

    for lo in range(0, roots, batch):
        add(lo, min(roots, lo + batch))
    filled = table.memory_bytes() / roots
    for lo in range(0, roots, batch):
        hi = min(roots, lo + batch)
        table.xor(ids[lo:hi], ids[lo:hi])
        add(roots + lo, roots + hi)
    if len(table) != roots:
        raise AssertionError(f"table bench: {len(table)} pending, expected {roots}")
    return {"filled": round(filled, 1), "churned": round(table.memory_bytes() / roots, 1)}


def bench_persist(
    records: int = 1_000_000,
    payload_bytes: int = 100,
    batch: int = 10_000,
    sync: bool = True,
    directory: str | None = None,
    rounds: int = 3,
) -> dict[str, Any]:
    """Records/s through persist -> complete -> delete on LMDB, against raw py-lmdb.

    Both sides keep one batch in flight: batch i is completed (deleted) after batch
    i + 1 was persisted, as in a pipeline whose trees finish a little after they start,
    and both commit one write transaction per put and one per delete. The two sides
    alternate for `rounds` rounds on fresh environments and the medians are reported,
    so a slow spell of the disk (fsync) does not land on one side only.
    """
    batches, offsets = _payload_batches(records, payload_bytes, batch)
    ft_times: list[float] = []
    raw_times: list[float] = []
    with tempfile.TemporaryDirectory(dir=directory, prefix="ftlayer-bench-") as tmp:
        for r in range(rounds):
            ft_times.append(_persist_through_ftlayer(Path(tmp) / f"ft{r}", batches, offsets, sync))
            raw_times.append(_persist_raw_lmdb(Path(tmp) / f"raw{r}", batches, sync))
    rate = records / float(np.median(ft_times))
    raw_rate = records / float(np.median(raw_times))
    return {
        "bench": "persist",
        "records": records,
        "payload_bytes": payload_bytes,
        "batch": batch,
        "sync": sync,
        "rounds": rounds,
        "records_per_s": round(rate),
        "raw_lmdb_records_per_s": round(raw_rate),
        "ratio_vs_raw_lmdb": round(rate / raw_rate, 3),
        "records_per_s_each_round": [round(records / t) for t in ft_times],
        "raw_lmdb_records_per_s_each_round": [round(records / t) for t in raw_times],
        "targets": {
            "records_per_s": PERSIST_TARGET_RATE,
            "ratio_vs_raw_lmdb": PERSIST_TARGET_RATIO,
        },
        "meets_targets": rate >= PERSIST_TARGET_RATE and rate / raw_rate >= PERSIST_TARGET_RATIO,
        "machine": _machine(),
    }


def _payload_batches(
    records: int, payload_bytes: int, batch: int
) -> tuple[list[list[bytes]], list[NDArray[np.int64]]]:
    """`records` payloads of `payload_bytes` random bytes in batches of `batch`, with
    their offsets (0, 1, 2, ...)."""
    payload = os.urandom(payload_bytes)
    starts = range(0, records, batch)
    batches = [[payload] * min(batch, records - lo) for lo in starts]
    offsets = [
        np.arange(lo, lo + len(b), dtype=np.int64) for lo, b in zip(starts, batches, strict=True)
    ]
    return batches, offsets


def _persist_and_complete(
    channel: FTChannel,
    batches: list[list[bytes]],
    offsets: list[NDArray[np.int64]],
    partition: int = 0,
) -> None:
    """Persist every batch (Kafka partition `partition` of topic "bench"), completing
    batch i (the sink's acks: one XOR per record) once batch i + 1 is persisted: one
    batch in flight."""
    in_flight: tuple[NDArray[np.uint64], NDArray[np.uint64]] | None = None
    for payloads, offs in zip(batches, offsets, strict=True):
        n = len(payloads)
        roots, ids = new_ids(n), new_ids(n)
        channel.persist(
            RecordBatch.build(roots, payloads, topics="bench", partitions=partition, offsets=offs),
            ids,
        )
        if in_flight is not None:
            channel.xor(*in_flight)
        in_flight = (roots, ids)
    if in_flight is not None:
        channel.xor(*in_flight)


def _persist_through_ftlayer(
    path: Path, batches: list[list[bytes]], offsets: list[NDArray[np.int64]], sync: bool
) -> float:
    storage = LmdbStorage(path, sync=sync)
    ft = FTLayer(storage, timeout_s=3600)

    seconds = _timed(lambda: _persist_and_complete(ft, batches, offsets))
    if len(storage) or ft.current_stats().completed != sum(len(b) for b in batches):
        raise AssertionError("persist bench: not every record completed")
    storage.close()
    return seconds


def _persist_raw_lmdb(path: Path, batches: list[list[bytes]], sync: bool) -> float:
    env = lmdb.open(str(path), map_size=1 << 34, sync=sync, metasync=sync)

    def delete(keys: list[bytes]) -> None:
        with env.begin(write=True) as txn:
            for key in keys:
                txn.delete(key)

    def run() -> None:
        next_key = 1
        in_flight: list[bytes] | None = None
        for payloads in batches:
            keys = np.arange(next_key, next_key + len(payloads), dtype=">u8").view("V8").tolist()
            next_key += len(payloads)
            with env.begin(write=True) as txn:
                txn.cursor().putmulti(zip(keys, payloads, strict=True), append=True)
            if in_flight is not None:
                delete(in_flight)
            in_flight = keys
        if in_flight is not None:
            delete(in_flight)

    seconds = _timed(run)
    env.close()
    return seconds


SERVER_TARGET_XOR_RATE = 1_500_000
SERVER_TARGET_RECORD_RATE = 150_000
_SERVER_BENCH_DEPTH = 3


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
        raise ValueError(f"clients must be at least 1, got {clients}")
    if mixed_batches < 0:
        raise ValueError(f"mixed_batches must be at least 0, got {mixed_batches}")
    per_tree = _SERVER_BENCH_DEPTH + 1
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
    acker = bench_acker(roots=roots_each * clients, depth=_SERVER_BENCH_DEPTH, batch=xor_batch)
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

    from ftlayer.client import FTClient
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
                    target=_server_bench_client,
                    args=(
                        f"{host}:{port}",
                        i,
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
                for worker in workers:
                    worker.join(timeout=30)
                    if worker.is_alive():
                        worker.terminate()
            with FTClient(f"{host}:{port}", name="bench-status") as client:
                status = client.status()
                # Completed records leave LMDB in the background (the deleter thread):
                # the storage must end empty, or the bench lost track of something.
                deadline = time.monotonic() + 120
                while status["stored_records"] and time.monotonic() < deadline:
                    time.sleep(0.1)
                    status = client.status()
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
    """Seconds from the barrier (every client ready) until every client reported."""
    barrier.wait(timeout=600)
    start = time.perf_counter()
    for _ in range(clients):
        name, error = results.get(timeout=600)
        if error is not None:
            raise AssertionError(f"server bench client failed in {name}: {error}")
        if name != phase:
            raise AssertionError(f"server bench: expected {phase}, got {name}")
    return time.perf_counter() - start


def _server_bench_client(
    address: str,
    index: int,
    roots: int,
    records: int,
    payload_bytes: int,
    batch: int,
    xor_batch: int,
    barrier: Any,
    results: Any,
) -> None:
    """One client process of bench_server: set up, then the two timed phases."""
    from ftlayer.client import FTClient

    phase = "setup"
    try:
        with FTClient(address, name=f"bench-{index}") as client:
            root_ids, first, event_roots, event_values = tree_events(
                roots, _SERVER_BENCH_DEPTH, seed=index
            )
            # Each client reads a partition of its own, as a source's tasks do: a record
            # at another's coordinates would take that one over (ftlayer.core.takeover).
            for lo in range(0, roots, 65_536):
                hi = min(roots, lo + 65_536)
                client.persist(
                    RecordBatch.build(
                        root_ids[lo:hi],
                        [b"x"] * (hi - lo),
                        topics="bench-trees",
                        partitions=index,
                        offsets=np.arange(lo, hi, dtype=np.int64),
                    ),
                    first[lo:hi],
                )
            batches, offsets = _payload_batches(records, payload_bytes, batch)
            n_events = len(event_roots)

            phase = "xor"
            barrier.wait(timeout=600)
            for lo in range(0, n_events, xor_batch):
                client.xor(event_roots[lo : lo + xor_batch], event_values[lo : lo + xor_batch])
            results.put((phase, None))

            phase = "persist"
            barrier.wait(timeout=600)
            _persist_and_complete(client, batches, offsets, partition=index)
            results.put((phase, None))
    except BaseException as exc:
        results.put((phase, repr(exc)))
        barrier.abort()
        raise


MIXED_BATCH_RECORDS = 200_000
MIXED_CHUNK_RECORDS = 50_000
MIXED_PERSISTERS = 2
MIXED_PAYLOAD_BYTES = 40
MIXED_XOR_BATCH = 65_536


def mixed_server_run(batches: int, directory: str | None = None) -> dict[str, list[float]]:
    """A Spark job's shape against a fresh server (with its journal): micro-batches of
    MIXED_BATCH_RECORDS records of MIXED_PAYLOAD_BYTES, read from one Kafka partition
    per MIXED_CHUNK_RECORDS by MIXED_PERSISTERS task slots (client processes, one
    connection each, persisting their partitions' chunks one after the other), while
    a sink (a client process of its own) completes the micro-batch before by XOR
    frames of MIXED_XOR_BATCH events (one per record, as a tree-mode sink's acks).
    Every micro-batch starts when the last one's persists and the acks of the one
    before are done; the last one is completed after, untimed.

    Returns the samples: `persist_s` (each persist's round trip), `xor_s` (each XOR
    frame's), `batch_s` (each micro-batch's wall time). What one connection's request
    makes the others wait shows in them: a persist waits for the storage only, an XOR
    frame for nothing but the core."""
    import multiprocessing

    from ftlayer.client import FTClient
    from ftlayer.server import FTServer

    ctx = multiprocessing.get_context("spawn")
    parties = MIXED_PERSISTERS + 1  # the task slots and the sink
    samples: dict[str, list[float]] = {"persist_s": [], "xor_s": [], "batch_s": []}
    with tempfile.TemporaryDirectory(dir=directory, prefix="ftlayer-bench-mixed-") as tmp:
        server = FTServer(Path(tmp) / "data", timeout_s=3600).start()
        try:
            address = "{}:{}".format(*server.address)
            barrier = ctx.Barrier(parties + 1)
            results = ctx.Queue()
            workers = [
                ctx.Process(
                    target=_mixed_client,
                    args=(address, slot, batches, barrier, results),
                    daemon=True,
                )
                for slot in range(parties)
            ]
            for worker in workers:
                worker.start()
            try:
                for _ in range(batches + 1):  # the last round only completes
                    barrier.wait(timeout=600)
                    start = time.perf_counter()
                    barrier.wait(timeout=600)
                    samples["batch_s"].append(time.perf_counter() - start)
                for _ in range(parties):
                    name, found, error = results.get(timeout=600)
                    if error is not None:
                        raise AssertionError(f"mixed server bench: {name} failed: {error}")
                    samples[name] += found
            finally:
                for worker in workers:
                    worker.join(timeout=30)
                    if worker.is_alive():
                        worker.terminate()
            samples["batch_s"].pop()  # the untimed last completion
            with FTClient(address, name="bench-status") as client:
                status = client.status()
                deadline = time.monotonic() + 120
                while status["stored_records"] and time.monotonic() < deadline:
                    time.sleep(0.1)
                    status = client.status()
        finally:
            server.stop()
    expected = batches * MIXED_BATCH_RECORDS
    if status["completed"] != expected or status["pending"] or status["stored_records"]:
        raise AssertionError(
            f"mixed server bench: {status['completed']} completed, {status['pending']} "
            f"pending, {status['stored_records']} still stored; expected {expected}, 0 and 0"
        )
    return samples


def _mixed_batch(batch: int, partition: int) -> tuple[NDArray[np.uint64], NDArray[np.uint64]]:
    """The roots and emission ids of one partition's chunk of micro-batch `batch`, the
    same in every process that asks (seeded): the sink completes what the slots persisted
    without being sent it."""
    rng = np.random.default_rng((batch, partition))
    ids = rng.integers(2, 2**64 - 1, size=(2, MIXED_CHUNK_RECORDS), dtype=np.uint64)
    return ids[0], ids[1]


def _mixed_client(address: str, slot: int, batches: int, barrier: Any, results: Any) -> None:
    """One process of mixed_server_run: task slot `slot` (it persists the partitions
    p with p % MIXED_PERSISTERS == slot) or, as slot MIXED_PERSISTERS, the sink."""
    from ftlayer.client import FTClient

    name = "xor_s" if slot == MIXED_PERSISTERS else "persist_s"
    partitions = MIXED_BATCH_RECORDS // MIXED_CHUNK_RECORDS
    payloads = [b"p" * MIXED_PAYLOAD_BYTES] * MIXED_CHUNK_RECORDS
    times: list[float] = []
    try:
        with FTClient(address, name=f"bench-mixed-{slot}") as client:
            for batch in range(batches + 1):
                barrier.wait(timeout=600)
                if name == "persist_s" and batch < batches:
                    for partition in range(slot, partitions, MIXED_PERSISTERS):
                        roots, ids = _mixed_batch(batch, partition)
                        offsets = np.arange(
                            batch * MIXED_CHUNK_RECORDS,
                            (batch + 1) * MIXED_CHUNK_RECORDS,
                            dtype=np.int64,
                        )
                        records = RecordBatch.build(
                            roots,
                            payloads,
                            topics="bench-mixed",
                            partitions=partition,
                            offsets=offsets,
                        )
                        start = time.perf_counter()
                        client.persist(records, ids)
                        times.append(time.perf_counter() - start)
                elif name == "xor_s" and batch > 0:
                    chunks = [_mixed_batch(batch - 1, p) for p in range(partitions)]
                    roots = np.concatenate([r for r, _ in chunks])
                    ids = np.concatenate([i for _, i in chunks])
                    for lo in range(0, len(roots), MIXED_XOR_BATCH):
                        hi = lo + MIXED_XOR_BATCH
                        start = time.perf_counter()
                        client.xor(roots[lo:hi], ids[lo:hi])
                        if batch < batches:  # the last completion is not timed
                            times.append(time.perf_counter() - start)
                barrier.wait(timeout=600)
        results.put((name, times, None))
    except BaseException as exc:
        results.put((name, [], repr(exc)))
        barrier.abort()
        raise


def _mixed_figures(runs: list[dict[str, list[float]]], batches: int) -> dict[str, Any]:
    """The pooled samples of mixed_server_run's rounds, in milliseconds."""

    def ms(name: str) -> dict[str, float]:
        values = np.array([v for run in runs for v in run[name]], dtype=np.float64) * 1e3
        return {
            "median": round(float(np.median(values)), 2),
            "p90": round(float(np.percentile(values, 90)), 2),
            "max": round(float(values.max()), 2),
        }

    batch_ms = ms("batch_s")
    return {
        "batches": batches,
        "rounds": len(runs),
        "batch_records": MIXED_BATCH_RECORDS,
        "chunk_records": MIXED_CHUNK_RECORDS,
        "persisters": MIXED_PERSISTERS,
        "payload_bytes": MIXED_PAYLOAD_BYTES,
        "xor_batch": MIXED_XOR_BATCH,
        "persist_ms": ms("persist_s"),
        "xor_ms": ms("xor_s"),
        "batch_ms": batch_ms,
        "records_per_s": round(MIXED_BATCH_RECORDS / (batch_ms["median"] / 1e3)),
    }


CHECKPOINT_TARGET_RATIO = 0.95
_CHECKPOINT_QUERY = "bench"


def bench_checkpoint(
    batches: int = 10,
    batch: int = 20_000,
    rounds: int = 60,
    payload_bytes: int = 100,
    pending_points: tuple[int, ...] = (0, 10_000, 100_000, 1_000_000),
    directory: str | None = None,
) -> dict[str, Any]:
    """Throughput with a checkpoint at every micro-batch against none, and checkpoint
    time against the number of pending roots, through a real `ftlayer serve` process.

    One client (this process) plays a micro-batch job: batch i persists `batch`
    records (topic "bench", partition 0, consecutive offsets) and the sink completes
    batch i - 1 (one batch in flight, as a pipeline has). With checkpoints, batch i is
    preceded by CHECKPOINT_BEGIN of its end position (what ftkafka's partitions()
    sends), which also completes the last batch found complete (Spark's commit(end)
    of the batch before, which ftkafka sends with the next BEGIN: Spark plans the
    next batch right after it): one request per batch, as in a Spark job. `rounds`
    pairs of rounds, one without and one with checkpoints, run on one server in the
    order AB BA AB ..., short, so drift of the machine hits both alike; the ratio is
    records/s with over records/s without, over all rounds. The spread of the pairs'
    own ratios shows how steady the machine was, and `cpu_steal_percent` how much CPU
    a hypervisor took meanwhile (Linux; the per-batch cost of checkpoints is mostly
    latency, which grows with it).

    Then, for each count in `pending_points`, roots that never complete are added until
    that many are pending and 5 checkpoints are taken: the client's round trip of
    CHECKPOINT_BEGIN (the server replies at once; the copy is taken before the core's
    next change or by the writer thread, which then writes the snapshot), the time
    until CHECKPOINT_DONE reports it complete (written), the copy's time under the
    server's lock (the only part that stops events), the write time and the
    snapshot's size, as medians.
    """
    from ftlayer.client import FTClient
    from ftlayer.integration.harness.ftprocess import FTServerProcess

    if rounds < 1 or batches < 2 or batch < 1:
        raise ValueError(
            f"need rounds >= 1, batches >= 2, batch >= 1; got {rounds}, {batches}, {batch}"
        )
    payload = os.urandom(payload_bytes)
    with tempfile.TemporaryDirectory(dir=directory, prefix="ftlayer-bench-checkpoint-") as tmp:
        server = FTServerProcess(Path(tmp) / "data", "--timeout-s", "3600").start()
        try:
            with FTClient(server.address, name="bench-checkpoint") as client:
                offset = 0
                seconds = {False: 0.0, True: 0.0}
                pair_ratios: list[float] = []
                done: dict[str, Any] | None = None  # the last checkpointed batch, complete
                cpu_before = _cpu_times()
                for pair in range(rounds):
                    took: dict[bool, float] = {}
                    for checkpoints in (False, True) if pair % 2 == 0 else (True, False):
                        gc.collect()
                        began = time.perf_counter()
                        offset, done = _checkpoint_bench_round(
                            client, batches, batch, payload, offset, checkpoints, done
                        )
                        took[checkpoints] = time.perf_counter() - began
                        seconds[checkpoints] += took[checkpoints]
                    pair_ratios.append(took[False] / took[True])
                steal = _steal_percent(cpu_before)
                if done is not None:
                    _bench_checkpoint_call(client, False, done)
                status = client.status()
                if status["pending"] or status["completed"] != 2 * rounds * batches * batch:
                    raise AssertionError(
                        f"checkpoint bench: {status['completed']} completed and "
                        f"{status['pending']} pending, expected "
                        f"{2 * rounds * batches * batch} and 0"
                    )
                completed_checkpoints = status["checkpoints"][_CHECKPOINT_QUERY]["completed"]
                by_pending = _checkpoint_times(client, pending_points, offset)
        finally:
            server.stop()
    records = rounds * batches * batch
    without, with_ = records / seconds[False], records / seconds[True]
    ratio = with_ / without
    return {
        "bench": "checkpoint",
        "batches_per_round": batches,
        "batch": batch,
        "rounds": rounds,
        "payload_bytes": payload_bytes,
        "records_per_s_without_checkpoints": round(without),
        "records_per_s_with_checkpoints": round(with_),
        "ratio_with_vs_without": round(ratio, 3),
        "pair_ratios": _spread(pair_ratios),
        "cpu_steal_percent": steal,
        "checkpoints_completed": completed_checkpoints,
        "checkpoint_time_by_pending": by_pending,
        "target": {"ratio_with_vs_without": CHECKPOINT_TARGET_RATIO},
        "meets_target": ratio >= CHECKPOINT_TARGET_RATIO,
        "machine": _machine(),
    }


def _spread(ratios: list[float]) -> dict[str, Any]:
    """Min, median, max of the pairs' ratios and a 95% interval for their geometric
    mean (normal approximation on the logs): how far the machine's noise leaves the
    overall ratio uncertain."""
    logs = np.log(np.asarray(ratios, dtype=np.float64))
    half = 1.96 * float(logs.std(ddof=1)) / np.sqrt(len(logs)) if len(logs) > 1 else 0.0
    centre = float(logs.mean())
    return {
        "pairs": len(ratios),
        "min": round(min(ratios), 3),
        "median": round(float(np.median(ratios)), 3),
        "max": round(max(ratios), 3),
        "geometric_mean_95ci": [
            round(float(np.exp(centre - half)), 3),
            round(float(np.exp(centre + half)), 3),
        ],
    }


def _checkpoint_bench_round(
    client: Any,
    batches: int,
    batch: int,
    payload: bytes,
    offset: int,
    checkpoints: bool,
    done: dict[str, Any] | None,
) -> tuple[int, dict[str, Any] | None]:
    """One round of the micro-batch job. `done` is the position of the last
    checkpointed batch, done but not reported complete yet: Spark's commit of a batch
    goes with the next BEGIN, in the next checkpointed round if this one has none.
    Returns the next offset and the `done` for the next round."""
    in_flight: tuple[NDArray[np.uint64], NDArray[np.uint64]] | None = None
    previous: dict[str, Any] | None = None
    payloads = [payload] * batch
    for _ in range(batches):
        end = {"kafka": {"bench": {"0": offset + batch}}, "replay": 0}
        if checkpoints:
            _bench_checkpoint_call(client, True, end, complete=done)
            done = None
        roots, ids = new_ids(batch), new_ids(batch)
        offsets = np.arange(offset, offset + batch, dtype=np.int64)
        client.persist(
            RecordBatch.build(roots, payloads, topics="bench", partitions=0, offsets=offsets), ids
        )
        if in_flight is not None:
            client.xor(*in_flight)
            if checkpoints:  # that batch is complete: ftkafka's commit(end) defers to here
                done = previous
        in_flight, previous, offset = (roots, ids), end, offset + batch
    if in_flight is not None:
        client.xor(*in_flight)
        if checkpoints:
            done = previous
    return offset, done


def _bench_checkpoint_call(
    client: Any,
    begin: bool,
    position: dict[str, Any],
    complete: dict[str, Any] | None = None,
) -> dict[str, Any]:
    answer: dict[str, Any] = client.checkpoint(
        begin=begin,
        query=_CHECKPOINT_QUERY,
        position=position,
        sources=[0],
        mode="unaligned",
        complete=complete,
    )
    return answer


def _checkpoint_times(
    client: Any, pending_points: tuple[int, ...], offset: int
) -> list[dict[str, Any]]:
    """Median checkpoint figures at each pending count (roots that never complete)."""
    found: list[dict[str, Any]] = []
    pending = 0
    for target in sorted(pending_points):
        while pending < target:
            n = min(65_536, target - pending)
            offsets = np.arange(offset, offset + n, dtype=np.int64)
            client.persist(
                RecordBatch.build(
                    new_ids(n), [b"x"] * n, topics="stuck", partitions=0, offsets=offsets
                )
            )
            pending, offset = pending + n, offset + n
        rtts, durations, copies, writes, sizes = [], [], [], [], []
        for _ in range(5):
            position = {"kafka": {"bench": {"0": offset}}, "replay": 0}
            offset += 1  # a new barrier each time
            began = time.perf_counter()
            _bench_checkpoint_call(client, True, position)
            rtts.append(time.perf_counter() - began)
            done = _bench_checkpoint_call(client, False, position)
            while done["state"] != "complete":  # its snapshot is still being written
                time.sleep(0.001)
                done = _bench_checkpoint_call(client, False, position)
            durations.append(time.perf_counter() - began)
            copies.append(done["copy_s"])  # taken after the reply to BEGIN (lazily)
            writes.append(done["write_s"])
            sizes.append(done["size_bytes"])
        found.append(
            {
                "pending_roots": pending,
                "begin_round_trip_ms": round(1000 * float(np.median(rtts)), 2),
                "until_complete_ms": round(1000 * float(np.median(durations)), 2),
                "copy_under_lock_ms": round(1000 * float(np.median(copies)), 3),
                "write_ms": round(1000 * float(np.median(writes)), 2),
                "snapshot_bytes": int(np.median(sizes)),
                "bytes_per_pending_root": round(float(np.median(sizes)) / pending, 1)
                if pending
                else None,
            }
        )
    return found
