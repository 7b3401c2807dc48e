"""The persistence layer: the stored source records of pending roots.

A PersistenceStorage keeps records durably under storage sequence numbers (seq). This
layer says what the FT layer keeps in memory about each pending root's record, its
locator: the storage seq and the Kafka coordinates that completion reports (offset,
partition, topic number). The locator lives as extra columns of the acker table
(LOCATOR_COLUMNS), so one vectorized lookup per batch serves both the XOR bookkeeping
and this layer, and neither completion nor deletion reads the storage back. A topic
number names a (source id, topic) pair: completion reports the topic, and counting a
column of topic numbers counts pending roots per source (`number_sources`), with no
column more per root.

- persist(batch): store the batch in one storage transaction; returns the seqs. With
  `defer_deletes=True`, the deletes of the records marked since the last persist go
  in the same transaction (`stage_deletes`): one commit, one fsync.
- locators(batch): the locator columns for the batch (the seq column is set after
  the storage confirmed the put).
- topic_numbers(topics), topic_names(numbers), number_sources(): what the topic
  numbers stand for.
- complete(roots, locators): delete the records (one storage transaction) and return
  the roots with their Kafka coordinates. With `defer_deletes=True` the records are
  only marked for deletion: the next persist deletes them (in process), or
  `flush_deletes()` / `take_marked()` (a server's deleter thread, which deletes them in
  transactions of its own; `mark_again` for those whose delete failed), so
  completions never wait for LMDB. A marked record that a crash leaves in storage is recovered
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

from ftlayer.persistence.base import MetaOfSeqs, PersistenceStorage
from ftlayer.records import RecordBatch

#: What the acker table keeps per pending root for this layer.
LOCATOR_COLUMNS: Mapping[str, DTypeLike] = {
    "seq": np.uint64,
    "offset": np.int64,
    "partition": np.int32,
    "topic": np.uint32,  # the number of the record's (source id, topic)
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
        # Per topic number: its topic and its source id; and the number of each pair.
        self._topics: list[str] = []
        self._sources: list[int] = []
        self._topic_numbers: dict[tuple[int, str], int] = {}

    def persist(
        self,
        batch: RecordBatch,
        meta: MetaOfSeqs | None = None,
        replay_seqs: NDArray[np.uint64] | None = None,
    ) -> NDArray[np.uint64]:
        """Store the batch durably (with `meta` and `replay_seqs`, as
        `PersistenceStorage.put` does); returns the storage seqs. With defer_deletes,
        the records marked for deletion go with it (`stage_deletes`: the LMDB store
        deletes them in the batch's transaction, one commit and one fsync for both)."""
        self.stage_marked()
        return self.storage.put(batch, meta, replay_seqs)

    def stage_marked(self, at_most: int | None = None) -> None:
        """Stage the deletes of the records marked for deletion (defer_deletes), so the
        store's next write transaction commits them; nothing when more than `at_most`
        are marked (they are the deleter's)."""
        marked = self.marked
        if marked and (at_most is None or marked <= at_most):
            self.storage.stage_deletes(self.take_marked())

    def locators(self, batch: RecordBatch) -> dict[str, NDArray[Any]]:
        """The locator columns of a batch, but its seqs (set once stored)."""
        return {
            "offset": batch.offsets,
            "partition": batch.partitions,
            "topic": self._numbers_of(batch.source_ids, batch.topics),
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

    def discard(self, seqs: NDArray[np.uint64]) -> None:
        """Delete stored records no root tracks (a persist that failed after its write),
        or, with defer_deletes, mark them like completed ones."""
        if len(seqs):
            if self.defer_deletes:
                self._marked.append(seqs)
            else:
                self.storage.delete(seqs)

    def mark_again(self, seqs: NDArray[np.uint64]) -> None:
        """Seqs from take_marked whose delete failed: marked again, first in line."""
        if len(seqs):
            self._marked.insert(0, seqs)

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
        """The numbers of the known topics among `topics`, of every source that read
        them (unknown topics are skipped)."""
        wanted = set(topics)
        known = [n for (_, t), n in self._topic_numbers.items() if t in wanted]
        return np.asarray(sorted(known), dtype=np.uint32)

    def topic_number(self, source_id: int, topic: str) -> int:
        """The number of (source id, topic), given one if it has none yet."""
        return self._number((source_id, topic))

    def topic_names(self, numbers: NDArray[Any]) -> list[str]:
        """The topic names of locator topic numbers."""
        return self._names_of(numbers)

    def number_sources(self) -> NDArray[np.uint32]:
        """The source id of every topic number, indexed by the number."""
        return np.asarray(self._sources, dtype=np.uint32)

    def _numbers_of(self, source_ids: NDArray[Any], topics: Sequence[str]) -> NDArray[np.uint32]:
        if not topics:
            return np.zeros(0, dtype=np.uint32)
        first = (int(source_ids[0]), topics[0])
        if (
            isinstance(topics, list)
            and topics.count(first[1]) == len(topics)
            and bool((source_ids == first[0]).all())
        ):
            return np.full(len(topics), self._number(first), dtype=np.uint32)
        pairs = list(zip(source_ids.tolist(), topics, strict=True))
        return np.fromiter(
            (self._number(pair) for pair in pairs), dtype=np.uint32, count=len(pairs)
        )

    def _number(self, pair: tuple[int, str]) -> int:
        number = self._topic_numbers.get(pair)
        if number is None:
            number = self._topic_numbers[pair] = len(self._topics)
            self._sources.append(pair[0])
            self._topics.append(pair[1])
        return number

    def _names_of(self, numbers: NDArray[Any]) -> list[str]:
        if len(numbers) and bool((numbers == numbers[0]).all()):
            return [self._topics[int(numbers[0])]] * len(numbers)
        topics = self._topics
        return [topics[i] for i in numbers.tolist()]
