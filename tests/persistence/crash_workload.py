"""A seeded storage workload, run by a process that is killed (test_lmdb_crash.py) and
replayed on the memory storage to know what each step left.

`Workload(seed).step(storage)` decides the next operation from the seed and from what
its own model (a MemoryStorage) holds, applies it to the model and to `storage`. So a
workload run on LMDB and the same workload run on nothing but the model agree step by
step. Steps are big enough (thousands of records over many small chunks) that a kill
often lands inside a transaction.

Run as a script (`python crash_workload.py PATH SEED`), it opens an LmdbStorage at PATH
and prints the number of every step once its transaction committed, until killed.
"""

from __future__ import annotations

import sys

import numpy as np
from numpy.typing import NDArray

from ftlayer.persistence.base import PersistenceStorage
from ftlayer.persistence.lmdb_storage import LmdbStorage
from ftlayer.persistence.memory import MemoryStorage
from ftlayer.records import RecordBatch

CHUNK_BYTES = 16 * 1024


class Workload:
    """The operations of one seed; see the module docstring."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.model = MemoryStorage()
        self.held = np.zeros(0, dtype=np.uint64)  # the seqs stored, increasing
        self.batches: list[NDArray[np.uint64]] = []

    def step(self, storage: PersistenceStorage | None = None) -> None:
        """One operation, on the model and (if given) on `storage`."""
        stores = [self.model] if storage is None else [self.model, storage]
        held = self.held
        kind = self.rng.choice(["put", "put", "complete", "scatter", "retag", "staged"])
        gone = np.zeros(0, dtype=np.uint64)
        if kind == "complete" and len(held):  # most of one batch, as a tree-mode flush
            seqs = self.batches[self.rng.integers(len(self.batches))]
            gone = seqs[self.rng.random(len(seqs)) < 0.9]
            for store in stores:
                store.delete(gone)
        elif kind == "scatter" and len(held):  # a scattered tenth of everything
            gone = held[self.rng.random(len(held)) < 0.1]
            for store in stores:
                store.delete(gone)
        elif kind == "retag" and len(held):
            seqs = self.rng.choice(held, size=min(len(held), 50), replace=False)
            roots = self.rng.integers(2, 2**63, len(seqs), dtype=np.uint64)
            for store in stores:
                store.set_roots(seqs, roots, seqs)
        else:  # a put; "staged": with the deletes of completed records in its transaction
            batch = self.batch()
            if kind == "staged":
                gone = held[self.rng.random(len(held)) < 0.3]
            for store in stores:
                store.stage_deletes(gone)
                seqs = store.put(batch)
            self.batches.append(seqs)
            held = np.concatenate([held, seqs])
        self.held = np.setdiff1d(held, gone)

    def batch(self) -> RecordBatch:
        n = int(self.rng.integers(1, 3000))
        sizes = self.rng.integers(0, 200, n)
        payloads = [self.rng.bytes(int(size)) for size in sizes]
        return RecordBatch.build(
            self.rng.integers(2, 2**63, n, dtype=np.uint64),
            payloads,
            topics=[["orders", "événements"][i] for i in self.rng.integers(0, 2, n)],
            offsets=self.rng.integers(0, 2**40, n),
            key_hashes=self.rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64),
        )


def stored_rows(storage: PersistenceStorage) -> dict[int, tuple[object, ...]]:
    """Every stored record by seq, as a comparable tuple (tags included)."""
    found: dict[int, tuple[object, ...]] = {}
    for seqs, batch, replay_seqs in storage.scan():
        for i, seq in enumerate(seqs.tolist()):
            found[seq] = (
                int(batch.roots[i]),
                int(replay_seqs[i]),
                int(batch.key_hashes[i]),
                batch.topics[i],
                int(batch.offsets[i]),
                bytes(batch.payloads[i]),
            )
    return found


def main(path: str, seed: int) -> None:
    workload = Workload(seed)
    with LmdbStorage(path, chunk_bytes=CHUNK_BYTES) as storage:
        step = 0
        while True:
            workload.step(storage)
            print(step, flush=True)
            step += 1


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
