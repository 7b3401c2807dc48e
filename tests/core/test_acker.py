"""AckerTable: XOR completion, dropped events, growth, and a model-based property."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlayer.acking.acker import AckerTable
from ftlayer.acking.ids import new_ids
from ftlayer.acking.u64map import DELETED, U64Map


def _u64(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.uint64)


def test_root_completes_when_value_returns_to_zero() -> None:
    table = AckerTable()
    table.add(_u64([10]), _u64([0b101]))
    assert table.xor(_u64([10]), _u64([0b100])).completed.size == 0
    assert table.value(10) == 0b001
    result = table.xor(_u64([10]), _u64([0b001]))
    assert result.completed.tolist() == [10]
    assert 10 not in table and len(table) == 0


def test_events_for_completed_roots_are_dropped_not_recreated() -> None:
    table = AckerTable()
    table.add(_u64([7]), _u64([3]))
    assert table.xor_one(7, 3) is True
    result = table.xor(_u64([7, 7]), _u64([1, 2]))
    assert result.completed.size == 0
    assert result.dropped.tolist() == [7, 7]
    assert len(table) == 0 and table.dropped_events_total == 2
    assert table.xor_one(7, 9) is False
    assert 7 not in table


def test_reserved_and_repeated_roots_are_refused_and_change_nothing() -> None:
    table = AckerTable()
    table.add(_u64([5]), _u64([1]))
    for roots in ([0], [1], [5], [9, 9]):
        with pytest.raises(ValueError, match="root"):
            table.add(_u64(roots), _u64([4] * len(roots)))
        assert len(table) == 1 and table.value(5) == 1 and 9 not in table
    # Reserved keys must never match the empty/deleted markers on lookup.
    assert table.xor(_u64([0, 1]), _u64([1, 1])).dropped.tolist() == [0, 1]


def test_remove_returns_only_pending_roots() -> None:
    table = AckerTable()
    table.add(_u64([2, 3, 4]))
    assert sorted(table.remove(_u64([3, 3, 99])).roots.tolist()) == [3]
    assert sorted(table.roots().tolist()) == [2, 4]


def test_growth_and_tombstone_churn_keep_every_root() -> None:
    table = AckerTable(capacity=4)
    live: dict[int, int] = {}
    for _ in range(50):
        roots, vals = new_ids(300), new_ids(300)
        table.add(roots, vals)
        live.update(zip(roots.tolist(), vals.tolist(), strict=True))
        gone = list(live)[:250]
        res = table.xor(_u64(gone), _u64([live[r] for r in gone]))
        assert sorted(res.completed.tolist()) == sorted(gone)
        for r in gone:
            del live[r]
    assert len(table) == len(live)
    keys, vals = table.items()
    assert dict(zip(keys.tolist(), vals.tolist(), strict=True)) == live
    # 15,000 roots went through, at most 2,800 at once. Deleted slots are reclaimed by
    # rebuilds: at most twice the 8,192 slots that 2,800 live roots need at load 1/2
    # (a churning table doubles rather than rebuild too often), where keeping them
    # would need 32,768.
    assert table.capacity <= 16384


def test_memory_per_pending_root_at_one_million() -> None:
    table = AckerTable()
    table.add(new_ids(1_000_000))
    assert len(table) == 1_000_000
    # Two uint64 arrays at load factor <= 1/2: at most 32 bytes per root plus
    # power-of-two slack (2**21 slots for 10**6 roots: 33.6 bytes per root).
    assert table.memory_bytes() / 1_000_000 < 34


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.lists(st.integers(2, 60), max_size=8)),
        st.tuples(
            st.just("xor"), st.lists(st.tuples(st.integers(0, 62), st.integers(1, 7)), max_size=12)
        ),
        st.tuples(st.just("remove"), st.lists(st.integers(0, 62), max_size=6)),
    ),
    max_size=40,
)


@pytest.mark.parametrize("track_live", [False, True])
@settings(max_examples=300, deadline=None)
@given(operations=ops)
def test_matches_a_dict_model(operations: list[tuple[str, list]], track_live: bool) -> None:  # type: ignore[type-arg]
    """Random add / xor / remove sequences behave exactly like the obvious dict model
    (for batches with no root passing through 0 twice, the batch rule is this model's),
    with the live roots tracked in a list or found by scanning the table."""
    table = AckerTable(capacity=2, track_live=track_live)
    model: dict[int, int] = {}
    for op, arg in operations:
        if op == "add":
            fresh = [r for r in dict.fromkeys(arg) if r not in model]
            table.add(_u64(fresh), _u64([r * 3 for r in fresh]))
            model.update({r: r * 3 for r in fresh})
        elif op == "xor":
            roots = [r for r, _ in arg]
            res = table.xor(_u64(roots), _u64([v for _, v in arg]))
            expected_dropped = [r for r in roots if r not in model]
            touched: dict[int, int] = {}
            for r, v in arg:
                if r in model:
                    touched[r] = touched.get(r, model[r]) ^ v
            done = sorted(r for r, v in touched.items() if v == 0)
            for r, v in touched.items():
                if v == 0:
                    del model[r]
                else:
                    model[r] = v
            assert sorted(res.completed.tolist()) == done
            assert sorted(res.dropped.tolist()) == sorted(expected_dropped)
        else:
            removed = table.remove(_u64(arg))
            assert sorted(removed.roots.tolist()) == sorted({r for r in arg if r in model})
            for r in arg:
                model.pop(r, None)
        assert len(table) == len(model)
        assert sorted(table.roots().tolist()) == sorted(model)
    keys, vals = table.items()
    assert dict(zip(keys.tolist(), vals.tolist(), strict=True)) == model


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.integers(2, 400), max_size=40)), max_size=30))
def test_tracked_live_slots_are_the_live_slots_of_the_table(
    steps: list[tuple[bool, list[int]]],
) -> None:
    """A map that tracks its live slots lists exactly the slots a scan of the table
    finds, through inserts, deletes, growth and rebuilds, and their keys are the
    ones inserted and not deleted; live_view gives every live key once with its own
    values, mirrored (the keys, a column also after set_column) or not."""
    table = U64Map({"v": np.uint64, "w": np.int64}, capacity=2, track_live=True, mirror=["w", "id"])
    model: set[int] = set()
    for insert, keys in steps:
        if insert:
            fresh = [k for k in dict.fromkeys(keys) if k not in model]
            slots = table.insert(_u64(fresh), v=_u64(fresh))
            table.set_column("w", slots, -np.array(fresh, dtype=np.int64))
            model.update(fresh)
        else:
            slots = table.find(_u64(sorted(set(keys))))
            table.delete_slots(slots[slots >= 0])
            model.difference_update(keys)
        live = table.live_slots()
        assert sorted(live.tolist()) == np.flatnonzero(table.keys > DELETED).tolist()
        assert sorted(table.keys[live].tolist()) == sorted(model)
        assert (table.columns["v"][live] == table.keys[live]).all()
        view = table.live_view("id", "v", "w")  # mirrored, gathered, mirrored
        assert sorted(view["id"].tolist()) == sorted(model)
        assert (view["v"] == view["id"]).all()
        assert (-view["w"] == view["id"].astype(np.int64)).all()
        views = table.live_view("id", "w", copy=False)
        assert not views["w"].flags.writeable
        assert (views["id"] == view["id"]).all() and (views["w"] == view["w"]).all()


def test_mirroring_needs_tracking_and_known_columns() -> None:
    with pytest.raises(ValueError, match="mirror"):
        U64Map({"v": np.uint64}, mirror=["v"])
    with pytest.raises(ValueError, match="mirror"):
        U64Map({"v": np.uint64}, track_live=True, mirror=["nope"])


def test_tracking_live_roots_costs_six_bytes_per_slot() -> None:
    plain, tracked = AckerTable(), AckerTable(track_live=True)
    for table in (plain, tracked):
        table.add(new_ids(100_000))
    assert tracked.capacity == plain.capacity
    assert tracked.memory_bytes() - plain.memory_bytes() == 6 * plain.capacity
