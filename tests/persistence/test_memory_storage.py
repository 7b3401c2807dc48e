"""What only the memory storage promises beyond the contract: a size that tracks its records."""

from __future__ import annotations

from ftlayer.persistence.memory import MemoryStorage
from ftlayer.records import RecordBatch


def test_size_shrinks_when_records_are_deleted() -> None:
    with MemoryStorage() as storage:
        empty = storage.size_bytes()
        seqs = storage.put(RecordBatch.build(range(1, 1001), [b"x" * 500] * 1000))
        full = storage.size_bytes()
        assert full >= empty + 1000 * 500
        storage.delete(seqs)
        assert storage.size_bytes() == empty


def test_storages_are_independent() -> None:
    with MemoryStorage() as first, MemoryStorage() as second:
        first.put(RecordBatch.build([1], [b"a"]))
        first.put_meta("k", b"v")
        assert len(second) == 0 and second.next_seq == 1 and second.get_meta("k") is None
