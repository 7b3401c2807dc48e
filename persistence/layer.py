"""The persistence layer: the stored source records of pending roots.

A PersistenceStorage keeps records durably under storage sequence numbers (seq). This
layer says what the FT layer keeps in memory about each pending root's record, its
locator: the storage seq and the Kafka coordinates that completion reports (offset,
partition, topic number). The locator lives as extra columns of the acker table
(LOCATOR_COLUMNS), so one vectorized lookup per batch serves both the XOR bookkeeping
and this layer, and neither completion nor deletion reads the storage back.

- persist(batch): store the batch in one storage transaction; returns the seqs. With
  `defer_deletes=True`, the deletes of the records marked since the last persist go
  in the same transaction (`stage_deletes`): one commit, one fsync.
- locators(batch): the locator columns for the batch (the seq column is set after
  the storage confirmed the put).
- complete(roots, locators): delete the records (one storage transaction) and return
  the roots with their Kafka coordinates. With `defer_deletes=True` the records are
  only marked for deletion: the next persist deletes them, or `flush_deletes()` /
  `take_marked()` (a server's deleter thread, when no persist comes), so completions
  never wait for LMDB. A marked record that a crash leaves in storage is recovered
  and replayed: a duplicate, never a loss, since only completed records are ever
  marked.
- retag(seqs, new_roots, replay_seqs): stored records are now tracked under new roots
  and queued for replay (one storage transaction).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import DTypeLike, NDArray

from ftlayer.persistence.base import PersistenceStorage
from ftlayer.records import RecordBatch

#: What the acker table keeps per pending root for this layer.
LOCATOR_COLUMNS: Mapping[str, DTypeLike] = {
    "seq": np.uint64,
    "offset": np.int64,
    "partition": np.int32,
    "topic": np.uint32,
}


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
    """Stored records of pending roots; see the module docstring."""

    def __init__(self, storage: PersistenceStorage, *, defer_deletes: bool = False) -> None:
        self.storage = storage
        self.defer_deletes = defer_deletes
        self._marked: list[NDArray[np.uint64]] = []
        self._topics: list[str] = []
        self._topic_numbers: dict[str, int] = {}

    def persist(self, batch: RecordBatch) -> NDArray[np.uint64]:
        """Store the batch durably; returns the storage seqs. With defer_deletes, the
        records marked for deletion go with it (`stage_deletes`: the LMDB store deletes
        them in the batch's transaction, one commit and one fsync for both)."""
        if self._marked:
            self.storage.stage_deletes(self.take_marked())
        return self.storage.put(batch)

    def locators(self, batch: RecordBatch) -> dict[str, NDArray[Any]]:
        """The locator columns of a batch, but its seqs (set once stored)."""
        return {
            "offset": batch.offsets,
            "partition": batch.partitions,
            "topic": self._numbers_of(batch.topics),
        }

    def complete(
        self, roots: NDArray[np.uint64], locators: Mapping[str, NDArray[Any]]
    ) -> Completed:
        """Delete the records of completed roots; returns their coordinates."""
        seqs = locators["seq"].astype(np.uint64, copy=False)
        if len(seqs):
            if self.defer_deletes:
                self._marked.append(seqs)
            else:
                self.storage.delete(seqs)
        return Completed(
            roots=roots,
            topics=self._names_of(locators["topic"]),
            partitions=locators["partition"].astype(np.int32, copy=False),
            offsets=locators["offset"].astype(np.int64, copy=False),
        )

    @property
    def marked(self) -> int:
        """Records marked for deletion and not deleted yet (defer_deletes only)."""
        return sum(len(seqs) for seqs in self._marked)

    def take_marked(self) -> NDArray[np.uint64]:
        """Unmark and return every marked seq: the caller deletes them (see flush_deletes)."""
        marked, self._marked = self._marked, []
        return np.concatenate(marked) if marked else np.zeros(0, dtype=np.uint64)

    def flush_deletes(self) -> int:
        """Delete the marked records in one storage transaction; returns how many."""
        seqs = self.take_marked()
        if len(seqs):
            try:
                self.storage.delete(seqs)
            except BaseException:
                self._marked.insert(0, seqs)  # kept, for the next flush
                raise
        return len(seqs)

    def retag(
        self,
        seqs: NDArray[np.uint64],
        new_roots: NDArray[np.uint64],
        replay_seqs: NDArray[np.uint64],
    ) -> None:
        """Stored records are now tracked under new roots, queued for replay."""
        self.storage.set_roots(seqs, new_roots, replay_seqs)

    def topic_numbers(self, topics: Sequence[str]) -> NDArray[np.uint32]:
        """The numbers of the known topics among `topics` (unknown ones are skipped)."""
        known = [self._topic_numbers[t] for t in topics if t in self._topic_numbers]
        return np.asarray(known, dtype=np.uint32)

    def topic_names(self, numbers: NDArray[Any]) -> list[str]:
        """The topic names of locator topic numbers."""
        return self._names_of(numbers)

    def _numbers_of(self, topics: Sequence[str]) -> NDArray[np.uint32]:
        if not topics:
            return np.zeros(0, dtype=np.uint32)
        numbers = self._topic_numbers
        first = topics[0]
        if isinstance(topics, list) and topics.count(first) == len(topics):
            if first not in numbers:
                numbers[first] = len(self._topics)
                self._topics.append(first)
            return np.full(len(topics), numbers[first], dtype=np.uint32)
        for topic in dict.fromkeys(topics).keys() - numbers.keys():
            numbers[topic] = len(self._topics)
            self._topics.append(topic)
        return np.fromiter((numbers[t] for t in topics), dtype=np.uint32, count=len(topics))

    def _names_of(self, numbers: NDArray[Any]) -> list[str]:
        if len(numbers) and bool((numbers == numbers[0]).all()):
            return [self._topics[int(numbers[0])]] * len(numbers)
        topics = self._topics
        return [topics[i] for i in numbers.tolist()]
