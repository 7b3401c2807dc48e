"""The server deleter's transactions (ftlayer.server.workers._delete_slices): bounded work each,
runs of consecutive seqs (a barrier's micro-batch) in far fewer of them than scattered
completions."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from ftlayer.server.state import _DELETE_CHUNK
from ftlayer.server.workers import _RUN_WEIGHT, _delete_slices


def _work(seqs: list[int]) -> list[float]:
    """Each record's weight, spelled out: 1 if its seq does not follow the one before."""
    return [1.0 if i == 0 or s != seqs[i - 1] + 1 else 1 / _RUN_WEIGHT for i, s in enumerate(seqs)]


@given(st.sets(st.integers(0, 400), max_size=300), st.integers(1, 12))
def test_slices_cover_every_seq_once_in_order_each_as_full_as_the_limit_allows(
    found: set[int], limit: int
) -> None:
    seqs = sorted(found)
    slices = _delete_slices(np.array(seqs, dtype=np.uint64), limit)
    assert [lo for lo, _ in slices] == ([0, *(hi for _, hi in slices[:-1])] if seqs else [])
    assert (slices[-1][1] if slices else 0) == len(seqs)
    work = _work(seqs)
    for lo, hi in slices:
        assert hi > lo
        assert sum(work[lo:hi]) <= limit + 1e-9
        if hi < len(seqs):  # the next record would not have fit
            assert sum(work[lo : hi + 1]) > limit - 1e-9


def test_a_micro_batch_of_consecutive_seqs_takes_run_weight_times_fewer_transactions() -> None:
    whole = _delete_slices(np.arange(10, 10 + 200_000, dtype=np.uint64))
    scattered = _delete_slices(np.arange(0, 20 * 50_000, 20, dtype=np.uint64))
    assert len(whole) == 2  # 200,000 side by side: one transaction per 131,072 or so
    assert [hi - lo for lo, hi in scattered] == [_DELETE_CHUNK] * 3 + [50_000 - 3 * _DELETE_CHUNK]
    assert _delete_slices(np.zeros(0, dtype=np.uint64)) == []
