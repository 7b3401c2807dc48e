"""AckerTable: XOR completion, dropped events, growth, and a model-based property."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ftlayer.acking.acker import AckerTable
from ftlayer.acking.ids import new_ids
from ftlayer.acking.u64map import DELETED, EMPTY, U64Map, rows_for
from ftlayer.core import FTLayer
from ftlayer.errors import ConfigError
from ftlayer.persistence import MemoryStorage


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
    # 2**20 rows of root and ack value (16 bytes) and an index of 2**21 4-byte slots.
    assert table.memory_bytes() == 2**20 * 16 + 2**21 * 4


def test_the_ft_layers_table_holds_a_million_pending_roots_in_64_bytes_each() -> None:
    """The table as the FT layer makes it, filled as persist fills it (batches of
    65,536), then churned (every root completed and replaced): at most 64 bytes per
    pending root, every array counted."""
    table = FTLayer(MemoryStorage()).acker
    batch, n = 65_536, 1_000_000
    roots = new_ids(2 * n)
    locators = {
        "seq": np.arange(1, 2 * n + 1, dtype=np.uint64),
        "offset": np.arange(2 * n, dtype=np.int64),
        "partition": np.zeros(2 * n, dtype=np.int32),
        "topic": np.zeros(2 * n, dtype=np.uint32),
    }

    def add(lo: int, hi: int) -> None:
        table.add(roots[lo:hi], roots[lo:hi], **{k: v[lo:hi] for k, v in locators.items()})

    order = np.argsort(roots)

    def seqs_of(some: np.ndarray) -> np.ndarray:
        return locators["seq"][order[np.searchsorted(roots, some, sorter=order)]]

    for lo in range(0, n, batch):
        add(lo, min(n, lo + batch))
    assert len(table) == n
    assert table.memory_bytes() / n <= 64
    for lo in range(0, n, batch):
        hi = min(n, lo + batch)
        done = table.xor(roots[lo:hi], roots[lo:hi])
        assert sorted(done.completed.tolist()) == sorted(roots[lo:hi].tolist())
        assert (done.columns["seq"] == seqs_of(done.completed)).all()
        add(n + lo, n + hi)
    assert len(table) == n
    assert table.memory_bytes() / n <= 64
    snap = table.snapshot("seq")
    assert sorted(snap["root"].tolist()) == sorted(roots[n:].tolist())
    assert (snap["seq"] == seqs_of(snap["root"])).all()
    assert (snap["ack"] == snap["root"]).all()


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.lists(st.integers(2, 60), max_size=8)),
        st.tuples(
            st.just("xor"), st.lists(st.tuples(st.integers(0, 62), st.integers(1, 7)), max_size=12)
        ),
        st.tuples(st.just("remove"), st.lists(st.integers(0, 62), max_size=6)),
        st.tuples(st.just("lookup"), st.lists(st.integers(0, 62), max_size=6)),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(operations=ops)
def test_matches_a_dict_model(operations: list[tuple[str, list]]) -> None:  # type: ignore[type-arg]
    """Random add / xor / remove / lookup sequences behave exactly like the obvious
    dict model (for batches with no root passing through 0 twice, the batch rule is
    this model's), and each root keeps its owner's column through the rows that
    deletes move."""
    table = AckerTable(capacity=2, columns={"seq": np.uint64})
    model: dict[int, int] = {}
    for op, arg in operations:
        if op == "add":
            fresh = [r for r in dict.fromkeys(arg) if r not in model]
            slots = table.add(_u64(fresh), _u64([r * 3 for r in fresh]))
            table.set_column("seq", slots, _u64([r + 1000 for r in fresh]))
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
            assert (res.columns["seq"] == res.completed + 1000).all()
            assert sorted(res.dropped.tolist()) == sorted(expected_dropped)
        elif op == "remove":
            removed = table.remove(_u64(arg))
            assert sorted(removed.roots.tolist()) == sorted({r for r in arg if r in model})
            assert (removed.columns["seq"] == removed.roots + 1000).all()
            for r in arg:
                model.pop(r, None)
        else:
            pending, seqs = table.lookup("seq", _u64(arg))
            assert pending.tolist() == [r in model for r in arg]
            assert seqs.tolist() == [r + 1000 for r in arg if r in model]
        assert len(table) == len(model)
        assert sorted(table.roots().tolist()) == sorted(model)
    keys, vals = table.items()
    assert dict(zip(keys.tolist(), vals.tolist(), strict=True)) == model
    view = table.snapshot("seq")
    assert (view["seq"] == view["root"] + 1000).all()
    assert dict(zip(view["root"].tolist(), view["ack"].tolist(), strict=True)) == model


def _check_layout(table: U64Map, model: dict[int, int]) -> None:
    """The map's two levels agree with each other and with the model: the live rows
    hold exactly the model's keys with their values, the index holds each live row
    once (and no other), every key is found at its row, absent keys are not, and the
    deleted slots are counted."""
    live = len(model)
    assert len(table) == live
    index = table._index
    used = index[index >= 0]
    assert sorted(used.tolist()) == list(range(live))
    assert int(np.count_nonzero(index == DELETED)) == table._deleted
    assert table._deleted + live <= table.capacity // 2
    keys = table.keys[:live]
    assert sorted(keys.tolist()) == sorted(model)
    assert (table.columns["v"][:live] == _u64([model[k] for k in keys.tolist()])).all()
    slots, rows = table.find_slots(keys)
    assert rows.tolist() == list(range(live))
    assert (index[slots] == rows).all()
    absent = _u64([k for k in range(2, 70) if k not in model])
    assert (table.find(absent) == -1).all()
    assert all(table.find_one(k) == row for k, row in zip(keys.tolist(), range(live), strict=True))


map_steps = st.lists(
    st.tuples(
        st.sampled_from(["insert", "delete", "bad insert"]),
        st.lists(st.integers(2, 69), max_size=40),
    ),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(steps=map_steps)
# Deletes fill the index with deleted slots, then an insert rebuilds it at its size.
@example(
    steps=[("insert", list(range(2, 8))), ("delete", list(range(2, 8))), ("insert", [8, 9, 10])]
)
def test_u64map_rows_and_index_follow_a_dict_model(steps: list[tuple[str, list[int]]]) -> None:
    """Random inserts and deletes from a tiny map (so rows grow, the index grows and
    is rebuilt, and deletes swap-remove rows at the end and in the middle), and
    inserts that must be refused (a key present or repeated): the map matches a
    dict model after every step, refused inserts change nothing, and live_view gives
    every live key once with its own values."""
    table = U64Map({"v": np.uint64, "w": np.int64}, capacity=2)
    model: dict[int, int] = {}
    for kind, keys in steps:
        if kind == "insert":
            fresh = [k for k in dict.fromkeys(keys) if k not in model]
            rows = table.insert(_u64(fresh), v=_u64([k * 7 for k in fresh]))
            table.set_column("w", rows, -np.array(fresh, dtype=np.int64))
            model.update({k: k * 7 for k in fresh})
        elif kind == "bad insert":
            fresh = [k for k in dict.fromkeys(keys) if k not in model]
            present = [k for k in keys if k in model]
            if present:
                bad = fresh + present[:1]
            elif fresh:
                bad = fresh + fresh[-1:]
            else:
                continue
            rows_before = table.keys[: len(table)].copy()
            with pytest.raises(ValueError, match=r"already present|repeated"):
                table.insert(_u64(bad), v=_u64([k * 7 for k in bad]))
            assert (table.keys[: len(table)] == rows_before).all()
        else:
            slots, _ = table.find_slots(_u64(sorted(set(keys))))
            table.delete(slots[slots >= 0])
            for k in keys:
                model.pop(k, None)
        _check_layout(table, model)
        view = table.live_view("id", "v", "w")
        assert sorted(view["id"].tolist()) == sorted(model)
        assert (view["v"] == view["id"] * 7).all()
        assert (-view["w"] == view["id"].astype(np.int64)).all()
        views = table.live_view("id", "w", copy=False)
        assert not views["w"].flags.writeable
        assert (views["id"] == view["id"]).all() and (views["w"] == view["w"]).all()


def test_rows_grow_by_at_most_a_quarter_and_at_least_a_seventh() -> None:
    sizes = [rows_for(n) for n in range(1, 5000)]
    assert all(n <= r <= max(16, 1.25 * n) for n, r in zip(range(1, 5000), sizes, strict=True))
    steps = sorted(set(sizes))
    assert all(b >= a * 8 / 7 for a, b in itertools.pairwise(steps))
    assert rows_for(1_000_000) == 2**20


def test_the_index_never_points_at_an_empty_marker_row() -> None:
    """EMPTY and DELETED are negative, so they never name a row: a key equal to the
    one in the last row is not found through a deleted slot (negative indices wrap)."""
    table = U64Map({"v": np.uint64}, capacity=16)
    table.insert(_u64(list(range(2, 18))))
    assert table.rows == 16 and EMPTY < 0 and DELETED < 0
    last = int(table.keys[15])
    slots, _ = table.find_slots(_u64([k for k in range(2, 18) if k != last]))
    table.delete(slots)
    assert table.find(_u64([last])).tolist() == [0]
    assert table.find(_u64([k for k in range(2, 18) if k != last])).tolist() == [-1] * 15


def test_column_names_of_the_table_are_its_own() -> None:
    with pytest.raises(ConfigError, match="ack"):
        AckerTable(columns={"ack": np.uint64})
    with pytest.raises(ConfigError, match="root"):
        AckerTable(columns={"root": np.uint64})
