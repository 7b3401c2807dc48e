"""Throughput of LmdbStorage against raw py-lmdb: put then delete of many records.

Not a test (pytest does not collect it): run it by hand on a quiet machine,

    .venv/bin/python tests/persistence/bench_storage.py [--records N] [--no-sync]

Each round stores N records of 100-byte payloads in batches of 10,000 (one transaction
per batch) and then deletes them in the same batches, three ways:

- raw-payload: py-lmdb putmulti(append=True) of 8-byte big-endian keys and the bare
  payloads, then txn.delete per key: the least any LMDB store of these records costs.
- raw-encoded: the same with our encoded values (header + topic + payload) built before
  the clock starts: what LMDB itself costs for the bytes LmdbStorage writes.
- LmdbStorage: put(batch) and delete(seqs), encoding included, from the default 64 MiB map.

Rounds are interleaved so that load from other processes hits every variant alike; the
median of the rounds is printed, as wall-clock and as CPU records/s.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence

import lmdb
import numpy as np

from ftlayer.persistence.base import encode_records
from ftlayer.persistence.lmdb_storage import LmdbStorage
from ftlayer.records import RecordBatch

BATCH = 10_000
Timing = tuple[float, float, float, float]  # put wall, put cpu, delete wall, delete cpu


def make_batches(records: int) -> list[RecordBatch]:
    rng = np.random.default_rng(7)
    return [
        RecordBatch.build(
            rng.integers(1, 2**63, BATCH, dtype=np.uint64),
            [os.urandom(100) for _ in range(BATCH)],
            topics="events",
            key_hashes=rng.integers(-(2**63), 2**63 - 1, BATCH, dtype=np.int64),
            partitions=rng.integers(0, 12, BATCH, dtype=np.int32),
            offsets=np.arange(BATCH),
            source_ids=1,
        )
        for _ in range(records // BATCH)
    ]


def clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def raw(path: str, values: Sequence[Sequence[bytes]], sync: bool) -> Timing:
    env = lmdb.open(path, map_size=1 << 34, max_dbs=3, sync=sync)
    db = env.open_db(b"records")
    key_batches = [
        np.arange(1 + i * BATCH, 1 + (i + 1) * BATCH, dtype=">u8").view("V8").tolist()
        for i in range(len(values))
    ]
    wall0, cpu0 = clocks()
    for keys, batch_values in zip(key_batches, values, strict=True):
        with env.begin(db=db, write=True) as txn:
            txn.cursor().putmulti(zip(keys, batch_values, strict=True), append=True)
    wall1, cpu1 = clocks()
    for keys in key_batches:
        with env.begin(db=db, write=True) as txn:
            sum(map(txn.delete, keys))
    wall2, cpu2 = clocks()
    env.close()
    return wall1 - wall0, cpu1 - cpu0, wall2 - wall1, cpu2 - cpu1


def ours(path: str, batches: Sequence[RecordBatch], sync: bool) -> Timing:
    storage = LmdbStorage(path, sync=sync)
    wall0, cpu0 = clocks()
    all_seqs = [storage.put(batch) for batch in batches]
    wall1, cpu1 = clocks()
    deleted = sum(storage.delete(seqs) for seqs in all_seqs)
    wall2, cpu2 = clocks()
    assert deleted == sum(map(len, batches)) and len(storage) == 0
    storage.close()
    return wall1 - wall0, cpu1 - cpu0, wall2 - wall1, cpu2 - cpu1


def in_tmp(run: Callable[[str], Timing]) -> Timing:
    directory = tempfile.mkdtemp(prefix="ftlayer-bench-")
    try:
        return run(os.path.join(directory, "store"))
    finally:
        shutil.rmtree(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-sync", dest="sync", action="store_false")
    args = parser.parse_args()
    batches = make_batches(args.records)
    n = len(batches) * BATCH
    encoded = [encode_records(batch) for batch in batches]
    variants: dict[str, Callable[[str], Timing]] = {
        "raw-payload": lambda path: raw(path, [b.payloads for b in batches], args.sync),
        "raw-encoded": lambda path: raw(path, encoded, args.sync),
        "LmdbStorage": lambda path: ours(path, batches, args.sync),
    }
    timings: dict[str, list[Timing]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, run in variants.items():
            timings[name].append(in_tmp(run))
    print(f"{n:,} records, 100-byte payloads, batches of {BATCH:,}, sync={args.sync}")
    print(f"{'records/s':22}{'put':>11}{'put cpu':>11}{'delete':>11}{'del cpu':>11}{'both':>11}")
    rates = {}
    for name, rounds in timings.items():
        put, put_cpu, delete, delete_cpu = (
            statistics.median(t[i] for t in rounds) for i in range(4)
        )
        rates[name] = (n / put, n / put_cpu, n / delete, n / delete_cpu, n / (put + delete))
        print(f"{name:22}" + "".join(f"{rate:>11,.0f}" for rate in rates[name]))
    for base in ("raw-payload", "raw-encoded"):
        ratios = [
            ours / theirs for ours, theirs in zip(rates["LmdbStorage"], rates[base], strict=True)
        ]
        print(f"{'ratio vs ' + base:22}" + "".join(f"{ratio:>11.2f}" for ratio in ratios))


if __name__ == "__main__":
    main()
