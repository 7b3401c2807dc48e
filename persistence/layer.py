"""The persistence layer: pending roots -> their stored source records.

A PersistenceStorage keeps records durably under storage sequence numbers (seq); this
layer keeps the in-memory index from each pending root id to its record's seq and the
Kafka coordinates that completion reports, so neither completion nor deletion reads
the storage back.

- persist(batch): store the batch (one storage transaction), then index its roots.
- complete(roots): drop the roots from the index, delete their records, and return
  their Kafka coordinates (roots that are not pending are skipped).
- retag(old_roots, new_roots, replay_seqs): a failed record stays stored but is now
  tracked under a new root and queued for replay (storage.set_roots, then re-index).

The index is a RotatingHashMap; this base class never rotates it. TimeoutPersistenceLayer
(persistence/timeout.py) rotates it to fail roots that stay pending too long.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from ftlayer.persistence.base import PersistenceStorage
from ftlayer.records import RecordBatch
from ftlayer.rotating import ExpiryCallback, RotatingHashMap

#: What the index keeps per pending root: (seq, topic, partition, offset).
IndexEntry = tuple[int, str, int, int]


@dataclass(frozen=True, slots=True)
class Completed:
    """Roots whose trees completed, with the Kafka coordinates of their source records."""

    roots: NDArray[np.uint64]
    topics: Sequence[str]
    partitions: NDArray[np.int32]
    offsets: NDArray[np.int64]

    def __len__(self) -> int:
        return len(self.roots)


class PersistenceLayer:
    """Index of pending roots over a storage; see the module docstring."""

    def __init__(
        self,
        storage: PersistenceStorage,
        *,
        buckets: int = 2,
        on_expire: ExpiryCallback[int, IndexEntry] | None = None,
        timeout_s: float | None = None,
        start: float = 0.0,
    ) -> None:
        self.storage = storage
        self._index: RotatingHashMap[int, IndexEntry] = RotatingHashMap(
            buckets, on_expire, timeout_s=timeout_s, start=start
        )

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, root: object) -> bool:
        return root in self._index

    def seq_of(self, root: int) -> int | None:
        entry = self._index.get(root)
        return None if entry is None else entry[0]

    def persist(self, batch: RecordBatch) -> NDArray[np.uint64]:
        """Store the batch durably, then track its roots; returns the storage seqs."""
        seqs = self.storage.put(batch)
        self._index.put_many(
            batch.roots.tolist(),
            zip(
                seqs.tolist(),
                batch.topics,
                batch.partitions.tolist(),
                batch.offsets.tolist(),
                strict=True,
            ),
        )
        return seqs

    def track(
        self, roots: NDArray[np.uint64], seqs: NDArray[np.uint64], batch: RecordBatch
    ) -> None:
        """Index records that are already stored (recovery, retag)."""
        self._index.put_many(
            roots.tolist(),
            zip(
                seqs.tolist(),
                batch.topics,
                batch.partitions.tolist(),
                batch.offsets.tolist(),
                strict=True,
            ),
        )

    def complete(self, roots: NDArray[np.uint64]) -> Completed:
        """Forget pending roots and delete their records; returns their coordinates."""
        popped = self._index.pop_many(roots.tolist())
        entries = [e for e in popped if e is not None]
        if len(entries) < len(roots):
            roots = roots[np.fromiter((e is not None for e in popped), np.bool_, len(popped))]
        if not entries:
            return _no_completions()
        seqs, topics, partitions, offsets = zip(*entries, strict=True)
        self.storage.delete(np.fromiter(seqs, dtype=np.uint64, count=len(seqs)))
        return Completed(
            roots=roots,
            topics=list(topics),
            partitions=np.fromiter(partitions, dtype=np.int32, count=len(partitions)),
            offsets=np.fromiter(offsets, dtype=np.int64, count=len(offsets)),
        )

    def take(self, roots: NDArray[np.uint64]) -> tuple[NDArray[np.uint64], NDArray[np.uint64]]:
        """Stop tracking roots (failing them); returns (roots that were pending, their seqs)."""
        entries = self._index.pop_many(roots.tolist())
        found = np.fromiter((e is not None for e in entries), dtype=np.bool_, count=len(entries))
        seqs = np.fromiter((e[0] for e in entries if e is not None), dtype=np.uint64)
        return roots[found], seqs

    def retag(
        self,
        seqs: NDArray[np.uint64],
        batch: RecordBatch,
        new_roots: NDArray[np.uint64],
        replay_seqs: NDArray[np.uint64],
    ) -> None:
        """Track the stored records `batch` (at `seqs`) under new roots, queued for replay."""
        self.storage.set_roots(seqs, new_roots, replay_seqs)
        self.track(new_roots, seqs, batch)


def _no_completions() -> Completed:
    return Completed(
        roots=np.zeros(0, dtype=np.uint64),
        topics=[],
        partitions=np.zeros(0, dtype=np.int32),
        offsets=np.zeros(0, dtype=np.int64),
    )
