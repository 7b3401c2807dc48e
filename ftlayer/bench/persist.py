"""`ftlayer bench persist`: source records per second through persist -> complete ->
delete on LMDB (FTLayer on LmdbStorage), against raw py-lmdb put + delete of the same
payloads in the same batches."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
from numpy.typing import NDArray

from ftlayer.acking.handlers import FTChannel
from ftlayer.acking.ids import new_ids
from ftlayer.core import FTLayer
from ftlayer.persistence.lmdb_storage import LmdbStorage
from ftlayer.records import RecordBatch

from .timing import _machine, _timed

PERSIST_TARGET_RATE = 250_000
PERSIST_TARGET_RATIO = 0.5


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
    shard: int = 0,
    shards: int = 1,
) -> None:
    """Persist every batch (Kafka partition `partition` of topic "bench"), completing
    batch i (the sink's acks: one XOR per record) once batch i + 1 is persisted: one
    batch in flight. The roots are shard `shard`'s of a cluster of `shards`."""
    in_flight: tuple[NDArray[np.uint64], NDArray[np.uint64]] | None = None
    for payloads, offs in zip(batches, offsets, strict=True):
        n = len(payloads)
        roots, ids = new_ids(n, shard, shards), new_ids(n)
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
