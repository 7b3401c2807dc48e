"""The persistence layer: pending roots -> their stored source records.

A PersistenceStorage keeps records durably under storage sequence numbers (seq); this
layer keeps the in-memory index from each pending root id to its record's seq and the
Kafka coordinates that completion reports, so neither completion nor deletion reads
the storage back.

- persist(batch): store the batch (one storage transaction), then index its roots.
- complete(roots): drop the roots from the index, delete their records (one storage
  transaction), and return their Kafka coordinates. Roots not pending are skipped.
- take(roots): drop failing roots from the index; their records stay stored.
- retag(seqs, batch, new_roots, replay_seqs): stored records are tracked under new
  roots and queued for replay (storage.set_roots, then index them).

The index is a U64Map (root -> seq, offset, partition, topic number): a few numpy
passes per batch and no Python object per record. 64 bytes per pending root at most.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from ftlayer.persistence.base import PersistenceStorage
from ftlayer.records import RecordBatch
from ftlayer.u64map import U64Map


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

    def __init__(self, storage: PersistenceStorage) -> None:
        self.storage = storage
        self._index = U64Map(
            {"seq": np.uint64, "offset": np.int64, "partition": np.int32, "topic": np.uint32},
            key_name="root",
        )
        self._topics: list[str] = []
        self._topic_numbers: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, root: object) -> bool:
        return root in self._index

    def seq_of(self, root: int) -> int | None:
        """The storage seq of a pending root's record, None if the root is not pending."""
        slot = self._index.find_one(root)
        return None if slot < 0 else int(self._index.columns["seq"][slot])

    def persist(self, batch: RecordBatch) -> NDArray[np.uint64]:
        """Store the batch durably, then track its roots; returns the storage seqs."""
        seqs = self.storage.put(batch)
        self.track(batch.roots, seqs, batch)
        return seqs

    def track(
        self, roots: NDArray[np.uint64], seqs: NDArray[np.uint64], batch: RecordBatch
    ) -> None:
        """Index records that are stored at `seqs` under `roots`."""
        self._index.insert(
            roots,
            seq=seqs,
            offset=batch.offsets,
            partition=batch.partitions,
            topic=self._numbers_of(batch.topics),
        )

    def complete(self, roots: NDArray[np.uint64]) -> Completed:
        """Forget pending roots and delete their records; returns their coordinates."""
        slots = self._index.find(roots)
        found = slots >= 0
        if not bool(found.all()):
            roots, slots = roots[found], slots[found]
        columns = self._index.columns
        seqs = columns["seq"][slots].astype(np.uint64)
        topic_numbers = columns["topic"][slots]
        done = Completed(
            roots=roots,
            topics=self._names_of(topic_numbers),
            partitions=columns["partition"][slots].astype(np.int32),
            offsets=columns["offset"][slots].astype(np.int64),
        )
        self._index.delete_slots(slots)
        if len(seqs):
            self.storage.delete(seqs)
        return done

    def take(self, roots: NDArray[np.uint64]) -> tuple[NDArray[np.uint64], NDArray[np.uint64]]:
        """Stop tracking roots (they failed); returns (the roots that were pending, the
        seqs of their records, which stay stored)."""
        slots = self._index.find(roots)
        found = slots >= 0
        roots, slots = roots[found], np.unique(slots[found])
        seqs = self._index.columns["seq"][slots].astype(np.uint64)
        roots = self._index.keys[slots]
        self._index.delete_slots(slots)
        return roots, seqs

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

    def _numbers_of(self, topics: Sequence[str]) -> NDArray[np.uint32]:
        if not topics:
            return np.zeros(0, dtype=np.uint32)
        first = topics[0]
        if first not in self._topic_numbers:
            self._topic_numbers[first] = len(self._topics)
            self._topics.append(first)
        if isinstance(topics, list) and topics.count(first) == len(topics):
            return np.full(len(topics), self._topic_numbers[first], dtype=np.uint32)
        numbers = self._topic_numbers
        for topic in set(topics) - numbers.keys():
            numbers[topic] = len(self._topics)
            self._topics.append(topic)
        return np.fromiter((numbers[t] for t in topics), dtype=np.uint32, count=len(topics))

    def _names_of(self, numbers: NDArray[np.generic]) -> list[str]:
        if len(numbers) and bool((numbers == numbers[0]).all()):
            return [self._topics[int(numbers[0])]] * len(numbers)
        topics = self._topics
        return [topics[i] for i in numbers.tolist()]
