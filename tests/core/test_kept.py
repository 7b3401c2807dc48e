"""Records kept in memory as the store holds them (ftlayer/core/kept.py): answered in
the order asked across the batches they came in, only when every one is kept, and
never past the record or byte limit."""

from __future__ import annotations

import numpy as np

from ftlayer.core.kept import KeptRecords
from ftlayer.records import RecordBatch


def _records(offsets: list[int], size: int = 10) -> RecordBatch:
    return RecordBatch.build(
        np.arange(1, len(offsets) + 1, dtype=np.uint64),
        [b"%0*d" % (size, o) for o in offsets],
        source_ids=3,
        topics="orders",
        offsets=offsets,
    )


def test_kept_records_answer_in_the_order_asked_and_only_when_all_are_kept() -> None:
    kept = KeptRecords(limit=100)
    kept.keep([10, 11, 12], _records([100, 110, 120]))
    kept.keep([20, 21], _records([200, 210]))
    found = kept.kept([21, 10, 12, 20])
    assert found is not None
    assert found.offsets.tolist() == [210, 100, 120, 200]
    assert [bytes(p) for p in found.payloads] == [b"%010d" % o for o in (210, 100, 120, 200)]
    assert kept.kept([10, 13]) is None  # 13 was never kept
    kept.discard_many([10, 20])
    assert kept.kept([10]) is None and kept.kept([11, 21]) is not None
    assert len(kept) == 3


def test_nothing_is_kept_past_the_record_or_byte_limit_and_room_comes_back() -> None:
    """A batch that would pass either limit is not kept (its records are read from the
    store instead); once the records of an earlier batch are gone, its bytes no longer
    count and a batch fits again."""
    kept = KeptRecords(limit=5, max_bytes=100)
    kept.keep([1, 2, 3, 4], _records([1, 2, 3, 4], size=20))  # 80 bytes
    kept.keep([5, 6], _records([5, 6], size=1))  # 6 records: past the limit
    assert kept.kept([5]) is None
    kept.keep([7], _records([7], size=30))  # 110 bytes: past the byte limit
    assert kept.kept([7]) is None and kept.held_bytes == 80
    kept.discard_many([1, 2, 3, 4])
    kept.keep([7], _records([7], size=30))
    found = kept.kept([7])
    assert found is not None and bytes(found.payloads[0]) == b"%030d" % 7
    assert kept.held_bytes == 30
