"""The unfilled list's memory (ftlayer.core.unfilled): the records a failure kept go
with their seqs (filled, completed, listed again), never past the cap, and come back
in the order asked for."""

from __future__ import annotations

import numpy as np

from ftlayer.acking.ids import new_ids
from ftlayer.core.unfilled import Unfilled
from ftlayer.records import KEY_UNKNOWN, RecordBatch

SOURCE = 4


def _failed(first_offset: int, n: int) -> RecordBatch:
    return RecordBatch.build(
        new_ids(n),
        [b""] * n,
        source_ids=SOURCE,
        key_hashes=np.full(n, KEY_UNKNOWN, dtype=np.int64),
        has_key=np.zeros(n, dtype=np.bool_),
        topics="orders",
        partitions=1,
        offsets=np.arange(first_offset, first_offset + n),
        references=True,
    )


def _listed(unfilled: Unfilled, seqs: list[int], records: RecordBatch) -> None:
    unfilled.add_many(seqs, [SOURCE] * len(seqs), key_unknown=True)
    unfilled.keep(seqs, records)


def test_kept_records_come_back_in_the_order_asked_and_go_with_their_seqs() -> None:
    unfilled = Unfilled()
    first, second = _failed(100, 3), _failed(200, 2)
    _listed(unfilled, [10, 11, 12], first)
    _listed(unfilled, [20, 21], second)
    both = unfilled.kept([21, 10, 20, 12])
    assert both is not None and both.offsets.tolist() == [201, 100, 200, 102]
    assert both.roots.tolist() == [
        second.roots[1],
        first.roots[0],
        *second.roots[:1],
        first.roots[2],
    ]
    assert unfilled.kept([10, 99]) is None  # one not kept: the caller reads the store
    unfilled.discard_many([10, 11])  # filled
    unfilled.discard(20)  # gone from the store
    unfilled.add(21, SOURCE)  # listed again by another failure: its record may differ
    assert unfilled.kept_count == 1 and unfilled.kept([12]) is not None
    assert unfilled.kept([21]) is None and unfilled.keys_unknown([12, 21]).tolist() == [
        True,
        False,
    ]


def test_nothing_is_kept_past_the_cap() -> None:
    unfilled = Unfilled(kept_records=4)
    _listed(unfilled, [1, 2, 3], _failed(0, 3))
    _listed(unfilled, [4, 5], _failed(10, 2))  # would pass the cap: listed, not kept
    assert unfilled.kept_count == 3 and len(unfilled) == 5
    assert unfilled.kept([4]) is None and unfilled.kept([1, 3]) is not None
