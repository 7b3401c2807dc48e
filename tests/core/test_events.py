"""EventBuffer: the one buffer of every event path."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from ftlayer.acking.events import EventBuffer

u64s = st.lists(st.integers(2, 2**64 - 1), max_size=20).map(
    lambda xs: np.array(xs, dtype=np.uint64)
)


@given(st.lists(st.tuples(st.booleans(), u64s), max_size=10))
def test_drain_returns_everything_added_fails_apart_in_order(adds: list) -> None:
    buffer = EventBuffer()
    fails, roots = [], []
    for is_fail, ids in adds:
        if is_fail:
            buffer.add_fail(ids)
            fails += ids.tolist()
        else:
            buffer.add_xor(ids, ids ^ np.uint64(1))
            roots += ids.tolist()
    assert len(buffer) == len(fails) + len(roots)
    drained = buffer.drain()
    assert drained.fails.tolist() == fails and drained.roots.tolist() == roots
    assert (drained.values == drained.roots ^ np.uint64(1)).all()
    assert len(buffer) == 0 and len(buffer.drain().roots) == 0
