"""Tree mode by range (ftlayer.core.rangeacks): a batch range's records complete one by
one, each when the XOR of the events naming its range root equals its emission id
(ftlayer.rangeroots.emission_ids), with no acker entry, stored record or delete each;
late and foreign events never complete one; a record whose tree does not complete times
out and is replayed; a failed one is replayed as in barrier mode."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from manual_clock import Clock

from ftlayer import rangeroots
from ftlayer.acking.ids import new_ids
from ftlayer.causes import Cause, FailKind
from ftlayer.core import FTLayer
from ftlayer.core.retries import RetryPolicy
from ftlayer.core.sinkholds import SINK_KEY_BIT
from ftlayer.persistence import LmdbStorage, MemoryStorage, PersistenceStorage
from ftlayer.registration import SourceRegistration

SOURCE = 9
TOPIC = "orders"
TIMEOUT_S = 30.0
FAILED = Cause(FailKind.EXPLICIT, "enrich", "FailException: no")


def _layer(storage: PersistenceStorage, clock: Clock | None = None) -> FTLayer:
    ft = FTLayer(
        storage,
        timeout_s=TIMEOUT_S,
        clock=clock or Clock(),
        wall_clock=Clock(1000.0),
        seed=1,
    )
    ft.register_source(
        SourceRegistration(SOURCE, "forward", 4, retry=RetryPolicy(5, 0, 1), completion="tree")
    )
    return ft


def _emitted(
    ft: FTLayer, number: int, start: int, offsets: list[int], seed: int = 0x5EED
) -> tuple[np.ndarray, np.ndarray]:
    """What a reader of these (consecutive) offsets does: announce its seed, then emit
    each row with its range root and emission id."""
    roots = rangeroots.encode(number, start, offsets)
    ft.read_range(int(roots[0]), len(offsets), seed)
    return roots, rangeroots.emission_ids(seed, roots)


def _fill_all(ft: FTLayer) -> None:
    wanted = ft.unfilled(SOURCE)
    n = len(wanted)
    ft.fill(
        wanted.seqs,
        [b"record-%d" % o for o in wanted.records.offsets.tolist()],
        np.ones(n, dtype=np.bool_),
        (np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.bool_)),
    )


def _replayed_offsets(ft: FTLayer) -> list[int]:
    found = ft.fetch_replay(0, ft.replay_cursor_of(SOURCE), source_id=SOURCE)
    return sorted(found.records.offsets.tolist())


def test_a_records_tree_completes_it_alone_and_its_range_closes_with_the_last(
    storage: PersistenceStorage,
) -> None:
    clock = Clock()
    ft = _layer(storage, clock)
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 2, 100, 110)], tree=True)
    roots, ids = _emitted(ft, number, 100, list(range(100, 110)))
    children = new_ids(10)
    # A map step emits one child per record; nothing is complete before its sink acks.
    ft.xor(roots, ids ^ children)
    assert ft.pending_by_source() == {SOURCE: 10} and ft.current_stats().completed == 0
    # The sink acks the children of the first three: those three complete, no others.
    ft.xor(roots[:3], children[:3])
    assert ft.current_stats().completed == 3 and ft.pending_by_source() == {SOURCE: 7}
    assert ft.lowest_pending_offsets([TOPIC]) == {TOPIC: {2: 103}}
    assert len(storage) == 0 and len(ft) == 0  # no stored record, no acker entry
    # A barrier of the source does not complete a tree-mode range.
    assert ft.complete_ranges([SOURCE], {TOPIC: {2: 110}}) == 0
    clock.now = 2.0
    ft.xor(roots[3:], children[3:])
    assert ft.current_stats().completed == 10 and ft.pending_by_source() == {}
    assert ft.current_stats().open_ranges == 0 and ft.lowest_pending_offsets([TOPIC]) == {}
    # The complete latency counts from the range's opening: three at 0 s, seven at 2 s.
    latency = ft.current_stats().complete_latency
    assert latency["count"] == 10 and latency["sum_s"] == pytest.approx(14.0)


def test_late_doubled_and_foreign_events_never_complete_a_record(
    storage: PersistenceStorage,
) -> None:
    ft = _layer(storage)
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 0, 0, 4)], tree=True)
    roots, ids = _emitted(ft, number, 0, [0, 1, 2, 3])
    ft.xor(roots[:1], ids[:1])  # record 0: a filter dropped it, its tree is complete
    assert ft.current_stats().completed == 1
    late = ft.current_stats().late_events
    ft.xor(roots[:1], ids[:1])  # the same event again (a retried task): late, dropped
    assert ft.current_stats().late_events == late + 1
    assert ft.current_stats().completed == 1
    # An event sent twice cancels itself: record 1 stays pending, and times out.
    ft.xor(np.repeat(roots[1:2], 2), np.repeat(ids[1:2], 2))
    assert ft.pending_by_source() == {SOURCE: 3}
    # Another read's id (a late event of an earlier read) does not complete one either.
    ft.xor(roots[2:3], rangeroots.emission_ids(0x5EED ^ 1, roots[2:3]))
    assert ft.pending_by_source() == {SOURCE: 3}
    # An offset past the range's end is no record of it.
    unknown = ft.current_stats().unknown_events
    ft.xor(rangeroots.encode(number, 0, [9]), np.ones(1, dtype=np.uint64))
    assert ft.current_stats().unknown_events == unknown + 1


def test_a_failed_record_leaves_its_range_and_is_replayed_its_range_events_late(
    storage: PersistenceStorage,
) -> None:
    ft = _layer(storage)
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 1, 50, 60)], tree=True)
    roots, ids = _emitted(ft, number, 50, list(range(50, 60)))
    assert ft.fail(roots[4:5], FAILED) == 1
    assert ft.fail(roots[4:5], FAILED) == 0  # a second fail of the same row: late
    _fill_all(ft)
    assert _replayed_offsets(ft) == [54]
    # Its range root's events are late now; the others complete as before.
    late = ft.current_stats().late_events
    ft.xor(roots, ids)
    assert ft.current_stats().late_events == late + 1
    assert ft.current_stats().completed == 9 and ft.current_stats().open_ranges == 0
    # Only the replay is pending, under a root of its own.
    assert ft.pending_by_source() == {SOURCE: 1}
    # A record that completed cannot fail any more.
    assert ft.fail(roots[:1], FAILED) == 0


def test_records_whose_trees_do_not_complete_time_out_while_no_batch_runs(
    storage: PersistenceStorage,
) -> None:
    clock = Clock()
    ft = _layer(storage, clock)
    # The driver opens the batch's ranges, then its barrier begins the batch, which
    # its heartbeats lease for a minute.
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 0, 0, 6)], tree=True)
    ft.batch_began([SOURCE])
    ft.heartbeat([SOURCE], 60.0)
    roots, ids = _emitted(ft, number, 0, list(range(6)))
    ft.xor(roots[:4], ids[:4])
    assert 0 < ft.tick_delay() <= TIMEOUT_S
    clock.now = TIMEOUT_S + 1  # timed out, but its batch still runs: postponed
    ft.tick()
    assert ft.current_stats().failed["timeout"] == 0
    assert ft.current_stats().timeouts_postponed == 2  # its two pending records
    ft.tick()  # within the same rotation of the timeouts: not counted again
    assert ft.current_stats().timeouts_postponed == 2
    assert 0 < ft.tick_delay() < TIMEOUT_S  # looked at again, not in a busy loop
    ft.batch_done([SOURCE])
    ft.tick()
    assert ft.current_stats().failed["timeout"] == 2
    _fill_all(ft)
    assert _replayed_offsets(ft) == [4, 5]
    assert ft.current_stats().open_ranges == 0


def test_a_restart_makes_a_tree_ranges_records_pending_again_so_none_is_lost(
    tmp_path: Path,
) -> None:
    """Without a journal the ack values live in memory only: after a restart every
    record of an open tree-mode range is pending again, unread (with one, see
    test_rangeacks_journal): events of the reads before complete nothing, and
    what a read after it does not complete times out and is replayed (duplicates,
    never a loss)."""
    storage = LmdbStorage(tmp_path / "ft")
    ft = _layer(storage)
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 3, 0, 5)], tree=True)
    roots, ids = _emitted(ft, number, 0, list(range(5)))
    ft.xor(roots[:2], ids[:2])
    storage.close()
    storage = LmdbStorage(tmp_path / "ft")
    clock = Clock(5.0)
    ft = _layer(storage, clock)
    assert ft.pending_by_source() == {SOURCE: 5}
    ft.xor(roots[2:3], ids[2:3])  # an event of the read before the restart
    assert ft.pending_by_source() == {SOURCE: 5}
    # The same batch planned again gets the same range; its re-run reads three.
    assert ft.register_ranges([(SOURCE, TOPIC, 3, 0, 5)], tree=True) == [number]
    again, again_ids = _emitted(ft, number, 0, [2, 3, 4], seed=77)
    ft.xor(again, again_ids)
    assert ft.pending_by_source() == {SOURCE: 2}
    clock.now = 5.0 + TIMEOUT_S
    ft.tick()
    _fill_all(ft)
    assert _replayed_offsets(ft) == [0, 1]
    storage.close()


def test_a_read_again_starts_its_records_trees_over(storage: PersistenceStorage) -> None:
    """A batch computed twice (a sink's two actions) or a task retried reads its records
    again under a new seed: the events of the earlier read, which came before, are
    undone, and the new read's complete every record not complete before; the
    earlier read's ids complete nothing any more."""
    ft = _layer(storage)
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 0, 0, 6)], tree=True)
    roots, first_ids = _emitted(ft, number, 0, list(range(6)), seed=1)
    children = new_ids(6)
    ft.xor(roots[:2], first_ids[:2])  # complete
    ft.xor(roots[2:], first_ids[2:] ^ children[2:])  # half way, when the read ends
    _, second_ids = _emitted(ft, number, 0, list(range(6)), seed=2)
    assert ft.current_stats().completed == 2
    ft.xor(roots[2:], first_ids[2:])  # as if the earlier read had completed them
    assert ft.pending_by_source() == {SOURCE: 4}
    ft.xor(roots[2:], first_ids[2:])  # undone again
    ft.xor(roots[2:], second_ids[2:])
    assert ft.current_stats().completed == 6 and ft.pending_by_source() == {}
    # The range closed with its last record: events naming it are dropped, counted.
    assert ft.current_stats().open_ranges == 0
    ft.xor(roots[:2], second_ids[:2])
    assert ft.current_stats().unknown_events == 2 and ft.current_stats().completed == 6


def test_a_record_no_read_announced_completes_nothing(storage: PersistenceStorage) -> None:
    ft = _layer(storage)
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 0, 0, 3)], tree=True)
    roots = rangeroots.encode(number, 0, [0, 1, 2])
    ft.xor(roots, rangeroots.emission_ids(0, roots))
    assert ft.pending_by_source() == {SOURCE: 3}
    assert ft.read_range(int(roots[0]), 3, 9) == 3


def test_a_barrier_range_and_a_tree_range_of_the_same_records_are_two(
    storage: PersistenceStorage,
) -> None:
    ft = _layer(storage)
    (barrier,) = ft.register_ranges([(SOURCE, TOPIC, 0, 0, 5)])
    (tree,) = ft.register_ranges([(SOURCE, TOPIC, 0, 0, 5)], tree=True)
    assert barrier != tree
    first = int(rangeroots.encode(barrier, 0, [0])[0])
    assert ft.read_range(first, 5, 9) == 0  # a barrier-mode range has no reads


@settings(max_examples=40, deadline=None)
@given(
    fanouts=st.lists(st.integers(0, 3), min_size=1, max_size=30),
    order=st.randoms(use_true_random=False),
    pieces=st.integers(1, 6),
    withheld=st.sets(st.integers(0, 29), max_size=5),
)
def test_a_record_completes_exactly_when_the_last_event_of_its_tree_is_in(
    fanouts: list[int], order: object, pieces: int, withheld: set[int]
) -> None:
    """Each record's tree (a step emitting `fanout` children, a sink acking each) sent
    in any order and any split into XOR batches: the records whose every event came in
    are complete, the others (an event `withheld`) pending, never the other way."""
    import random

    assert isinstance(order, random.Random)
    ft = _layer(MemoryStorage())
    n = len(fanouts)
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 0, 1000, 1000 + n)], tree=True)
    roots, ids = _emitted(ft, number, 1000, list(range(1000, 1000 + n)))
    events: list[tuple[int, int, int]] = []  # (record, root, value)
    for i, fanout in enumerate(fanouts):
        children = new_ids(fanout)
        step = int(ids[i]) ^ int(np.bitwise_xor.reduce(children)) if fanout else int(ids[i])
        events.append((i, int(roots[i]), step))
        events += [(i, int(roots[i]), int(c)) for c in children]
    missing = {i for i in withheld if i < n}
    sent = [e for e in events if not (e[0] in missing and e[2] == events_last(events, e[0]))]
    order.shuffle(sent)
    for k in range(pieces):
        piece = sent[k::pieces]
        if piece:
            ft.xor(
                np.array([r for _, r, _ in piece], dtype=np.uint64),
                np.array([v for _, _, v in piece], dtype=np.uint64),
            )
    assert ft.current_stats().completed == n - len(missing)
    assert ft.pending_by_source() == ({SOURCE: len(missing)} if missing else {})
    assert ft.current_stats().open_ranges == (1 if missing else 0)


def events_last(events: list[tuple[int, int, int]], record: int) -> int:
    """The value of the last event of `record`'s tree (the one withheld)."""
    return [v for i, _, v in events if i == record][-1]


@pytest.mark.parametrize("n", [1, 1000])
def test_emission_ids_are_never_zero_and_differ_by_salt(n: int) -> None:
    roots = rangeroots.encode(7, 0, np.arange(n))
    a, b = rangeroots.emission_ids(1, roots), rangeroots.emission_ids(3, roots)
    assert (a != 0).all() and (b != 0).all()
    assert len(np.unique(a)) == n and not (a == b).any()


def test_a_batch_sinks_held_acks_complete_range_records_when_its_write_is_done(
    storage: PersistenceStorage,
) -> None:
    """A batch sink holds its rows' acks until its write is done (SINK_HOLD, then
    SINK_SETTLE): only then do the records complete; a refused write fails them."""
    ft = _layer(storage)
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 0, 0, 8)], tree=True)
    roots, ids = _emitted(ft, number, 0, list(range(8)))
    children = new_ids(8)
    ft.xor(roots, ids ^ children)
    written, refused = SINK_KEY_BIT | 1, SINK_KEY_BIT | 2
    assert ft.sink_hold(written, roots[:4], children[:4]) == 4
    assert ft.sink_hold(refused, roots[4:], children[4:]) == 4
    assert ft.current_stats().completed == 0  # held, not applied
    assert ft.sink_settle(written) == 4
    assert ft.current_stats().completed == 4 and ft.pending_by_source() == {SOURCE: 4}
    assert ft.sink_settle(refused, FAILED) == 4  # the write was refused: they fail
    assert ft.current_stats().failed["explicit"] == 4
    _fill_all(ft)
    assert _replayed_offsets(ft) == [4, 5, 6, 7]
    assert ft.current_stats().open_ranges == 0


def test_a_second_read_drops_the_sink_acks_held_for_the_first(
    storage: PersistenceStorage,
) -> None:
    """A batch sink that runs two actions (count, then collect) has its steps hold acks
    for the rows of both reads: the second read drops the first's, and the settle
    completes every record."""
    ft = _layer(storage)
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 0, 0, 4)], tree=True)
    key = SINK_KEY_BIT | 7
    for seed in (1, 2):  # the two actions
        roots, ids = _emitted(ft, number, 0, [0, 1, 2, 3], seed=seed)
        children = new_ids(4)
        ft.xor(roots, ids ^ children)
        ft.sink_hold(key, roots, children)
    assert ft.open_holds == 4
    assert ft.sink_settle(key) == 4
    assert ft.current_stats().completed == 4 and ft.pending_by_source() == {}


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=3),
    unread=st.integers(-1, 2),
    batches=st.lists(
        st.lists(
            st.tuples(
                st.integers(0, 3),  # the range (3: a root of no range, the acker's)
                st.integers(0, 7),  # the offset from its start (past its end: unknown)
                st.sampled_from(["emission", "other", "zero"]),
            ),
            max_size=25,
        ),
        min_size=1,
        max_size=4,
    ),
)
def test_range_events_follow_the_contract_in_any_mix(
    sizes: list[int], unread: int, batches: list[list[tuple[int, int, str]]]
) -> None:
    """XOR batches mixing several ranges' events, events past a range's end, events of
    records no longer pending, doubled events, exclusions (value 0), a range no read
    announced, and roots of no range: what completes, what stays pending, which ranges
    stay open and every count are those of the contract (the module docstring), written
    out plainly here one event at a time. (Once a range closed, its roots are no
    range's: none is sent.)"""
    ft = _layer(MemoryStorage())
    opened = [(SOURCE, TOPIC, p, 100, 100 + n) for p, n in enumerate(sizes)]
    numbers = ft.register_ranges(opened, tree=True)
    ids: list[np.ndarray] = []
    for p, (number, n) in enumerate(zip(numbers, sizes, strict=True)):
        roots = rangeroots.encode(number, 100, np.arange(100, 100 + n))
        seed = 0 if p == unread else 0x5EED + p  # a range no read announced
        if seed:
            ft.read_range(int(roots[0]), n, seed)
        ids.append(rangeroots.emission_ids(seed, roots) if seed else np.zeros(n, np.uint64))
    acc = [[0] * n for n in sizes]
    state = [["pending"] * n for n in sizes]
    expected = {"completed": 0, "late": 0, "unknown": 0, "events": 0, "excluded": 0}
    foreign = int(new_ids(1)[0])
    counted = ("completed", "late_events", "unknown_events", "xor_events", "persisted")
    before = {name: getattr(ft.current_stats(), name) for name in counted}
    for batch in batches:
        roots_list, values_list = [], []
        for which, delta, kind in batch:
            if which >= len(sizes):  # the acker table's, where no root is pending
                roots_list.append(foreign)
                values_list.append(1 + delta)
                expected["unknown"] += 1
                continue
            if "pending" not in state[which]:
                continue  # its range closed: its roots are no range's any more
            roots_list.append(int(rangeroots.encode(numbers[which], 0, [delta])[0]))
            value = 0 if kind == "zero" else 7 + delta if kind == "other" else None
            if value is None:
                value = int(ids[which][delta]) if delta < sizes[which] else 5
            values_list.append(value)
        # The contract, range by range: count the unknown and late events, exclude the
        # zeros' records, XOR the rest in, then complete each record named whose value
        # is its emission id (a read announced).
        for p, n in enumerate(sizes):
            mine = [
                (int(rangeroots.decode([r])[1][0]), v)
                for r, v in zip(roots_list, values_list, strict=True)
                if rangeroots.is_range_root([r])[0]
                and int(rangeroots.decode([r])[0][0]) == numbers[p]
            ]
            live = []
            for delta, value in mine:
                if delta >= n:
                    expected["unknown"] += 1
                elif state[p][delta] != "pending":
                    expected["late"] += 1
                else:
                    live.append((delta, value))
            for delta, value in live:
                if value == 0 and state[p][delta] == "pending":
                    state[p][delta] = "gone"
                    expected["excluded"] += 1
            live = [(d, v) for d, v in live if state[p][d] == "pending"]
            for delta, value in live:
                acc[p][delta] ^= value
                expected["events"] += 1
            for delta, _value in live:
                if (
                    state[p][delta] == "pending"
                    and ids[p][delta]
                    and acc[p][delta] == ids[p][delta]
                ):
                    state[p][delta] = "complete"
                    expected["completed"] += 1
        ft.xor(np.array(roots_list, dtype=np.uint64), np.array(values_list, dtype=np.uint64))
        stats = ft.current_stats()
        now = {name: getattr(stats, name) - before[name] for name in counted}
        assert now["completed"] == expected["completed"]
        assert now["late_events"] == expected["late"]
        assert now["unknown_events"] == expected["unknown"]
        assert now["xor_events"] >= expected["events"]  # and the acker table's
        assert now["persisted"] == -expected["excluded"]
        pending = sum(row.count("pending") for row in state)
        assert ft.pending_by_source().get(SOURCE, 0) == pending
        assert stats.open_ranges == sum(1 for row in state if "pending" in row)
