"""The mixed phase of `ftlayer bench server`: a Spark job's shape against a fresh
server (two task slots persisting a micro-batch's chunks while a sink completes the
micro-batch before), and how long each persist and each XOR frame takes: what one
connection's work costs the others."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ftlayer.records import RecordBatch

from .timing import _drained_status, _join

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
                _join(workers)
            samples["batch_s"].pop()  # the untimed last completion
            status = _drained_status(address)
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
