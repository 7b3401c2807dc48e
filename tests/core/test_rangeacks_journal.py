"""Tree mode by range across a kill of the FT layer (ftlayer.core.rangeacks with the
acker journal, ftlayer.core.journal): the reads, the events and a sink's held acks of
tree-mode range records are journaled, and open ranges' ack values are in a journal
base, so a restarted FT layer knows every record's tree as it was. A record that
completed before the kill is not replayed; one whose tree was under way completes with
the events still to come, without a read again; a failed one is replayed once."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from manual_clock import Clock

from ftlayer import rangeroots
from ftlayer.acking.ids import new_ids
from ftlayer.causes import Cause, FailKind
from ftlayer.core import FTLayer, rangeacks
from ftlayer.core.journal import RANGE_OPEN, RANGE_READ, RANGE_XOR, Journal, JournalState
from ftlayer.core.retries import RetryPolicy
from ftlayer.core.sinkholds import SINK_KEY_BIT
from ftlayer.persistence import LmdbStorage
from ftlayer.registration import SourceRegistration

SOURCE = 9
TOPIC = "orders"
TIMEOUT_S = 30.0
FAILED = Cause(FailKind.EXPLICIT, "enrich", "FailException: no")


class Process:
    """An FT layer as a server runs it (LMDB, a journal) that can be killed: the store
    and the journal's file closed as the kernel would, nothing flushed or written on
    the way out; a restart recovers from both on a clock `restart_at` later."""

    def __init__(self, data: Path, now: float = 0.0) -> None:
        self.data = data
        self.clock = Clock(now)
        self.storage = LmdbStorage(data)
        self.ft = FTLayer(
            self.storage,
            timeout_s=TIMEOUT_S,
            clock=self.clock,
            wall_clock=Clock(1000.0 + now),
            seed=1,
            journal=Journal(data / "journal"),
        )
        self.ft.register_source(
            SourceRegistration(SOURCE, "forward", 4, retry=RetryPolicy(5, 0, 1), completion="tree")
        )

    def restart(self, after_s: float = 5.0) -> FTLayer:
        journal = self.ft.journal
        assert journal is not None
        journal.close()
        self.storage.close()
        self.__init__(self.data, self.clock.now + after_s)  # type: ignore[misc]
        return self.ft


def _emitted(
    ft: FTLayer, number: int, offsets: list[int], seed: int = 0x5EED
) -> tuple[np.ndarray, np.ndarray]:
    """A reader of these consecutive offsets: its seed announced, its rows' roots and ids."""
    roots = rangeroots.encode(number, 0, offsets)
    ft.read_range(int(roots[0]), len(offsets), seed)
    return roots, rangeroots.emission_ids(seed, roots)


def _replayed_after_the_timeout(proc: Process) -> list[int]:
    """Tick past the tree timeout, copy the failed records' bytes in, and list the
    offsets replayed."""
    ft = proc.ft
    proc.clock.now += TIMEOUT_S + 1
    ft.tick()
    wanted = ft.unfilled(SOURCE)
    n = len(wanted)
    ft.fill(
        wanted.seqs,
        [b"record-%d" % o for o in wanted.records.offsets.tolist()],
        np.ones(n, dtype=np.bool_),
        (np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.bool_)),
    )
    found = ft.fetch_replay(0, ft.replay_cursor_of(SOURCE), source_id=SOURCE)
    return sorted(found.records.offsets.tolist())


def test_after_a_kill_a_tree_ranges_records_keep_their_trees(tmp_path: Path) -> None:
    """Records 0 and 1 completed before the kill, 2 was half way (a step's child not
    acked yet), 3 and 4 only read, 5 failed. After the restart 2 completes with its
    child's ack, 3 and 4 with the events of the read before the kill; only 5 is
    replayed, once; the range closes."""
    proc = Process(tmp_path)
    ft = proc.ft
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 3, 0, 6)], tree=True)
    roots, ids = _emitted(ft, number, list(range(6)))
    child = new_ids(1)
    ft.xor(roots[:2], ids[:2])
    ft.xor(roots[2:3], ids[2:3] ^ child)
    ft.fail(roots[5:6], FAILED)
    assert ft.current_stats().completed == 2

    ft = proc.restart()
    assert ft.pending_by_source() == {SOURCE: 4}  # 2, 3, 4 in the range; 5 stored
    ft.xor(roots[2:3], child)
    ft.xor(roots[3:5], ids[3:5])
    assert ft.current_stats().completed == 3
    assert ft.current_stats().open_ranges == 0
    assert _replayed_after_the_timeout(proc) == [5]
    assert ft.current_stats().failed["timeout"] == 0


def test_a_batch_sinks_held_acks_survive_a_kill_and_complete_at_its_settle(
    tmp_path: Path,
) -> None:
    proc = Process(tmp_path)
    ft = proc.ft
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 0, 0, 4)], tree=True)
    roots, ids = _emitted(ft, number, [0, 1, 2, 3])
    children = new_ids(4)
    ft.xor(roots, ids ^ children)
    key = SINK_KEY_BIT | 3
    assert ft.sink_hold(key, roots, children) == 4

    ft = proc.restart()
    assert ft.open_holds == 4
    assert ft.sink_settle(key) == 4  # the sink's write was done: its settle comes again
    assert ft.current_stats().completed == 4 and ft.pending_by_source() == {}
    assert _replayed_after_the_timeout(proc) == []


def test_a_read_again_before_a_kill_drops_the_earlier_reads_held_acks_after_it(
    tmp_path: Path,
) -> None:
    """A sink that counts, then collects: each action's steps hold acks of their own
    read. The second read dropped the first's held acks; the journal's reader drops
    them too, so the settle after the restart completes every record."""
    proc = Process(tmp_path)
    ft = proc.ft
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 0, 0, 4)], tree=True)
    key = SINK_KEY_BIT | 5
    for seed in (1, 2):
        roots, ids = _emitted(ft, number, [0, 1, 2, 3], seed=seed)
        children = new_ids(4)
        ft.xor(roots, ids ^ children)
        ft.sink_hold(key, roots, children)
    assert ft.open_holds == 4

    ft = proc.restart()
    assert ft.open_holds == 4
    assert ft.sink_settle(key) == 4
    assert ft.current_stats().completed == 4 and ft.pending_by_source() == {}


def test_a_journal_base_holds_the_open_ranges_and_the_segments_after_it_apply(
    tmp_path: Path,
) -> None:
    proc = Process(tmp_path)
    ft = proc.ft
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 1, 0, 6)], tree=True)
    roots, ids = _emitted(ft, number, list(range(6)))
    children = new_ids(6)
    ft.xor(roots[:2], ids[:2])
    ft.xor(roots[2:4], ids[2:4] ^ children[2:4])
    ft.write_journal_base()  # the range's arrays in the base; older segments deleted
    ft.xor(roots[2:3], children[2:3])  # record 2 completes after the base
    assert ft.current_stats().completed == 3

    ft = proc.restart()
    assert ft.pending_by_source() == {SOURCE: 3}  # 3 (half way), 4 and 5 (read)
    ft.xor(roots[3:4], children[3:4])
    ft.xor(roots[4:6], ids[4:6])
    assert ft.current_stats().completed == 3 and ft.pending_by_source() == {}
    assert _replayed_after_the_timeout(proc) == []


def test_a_second_kill_recovers_the_same_trees(tmp_path: Path) -> None:
    """The recovery journals nothing again (its ops stay in the old segments): a kill
    right after a restart finds the same state, not events applied twice."""
    proc = Process(tmp_path)
    ft = proc.ft
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 2, 0, 3)], tree=True)
    roots, ids = _emitted(ft, number, [0, 1, 2])
    children = new_ids(3)
    ft.xor(roots, ids ^ children)
    proc.restart()
    ft = proc.restart()
    ft.xor(roots, children)
    assert ft.current_stats().completed == 3 and ft.pending_by_source() == {}


def test_events_of_an_earlier_range_under_a_reused_number_are_not_the_new_ones(
    tmp_path: Path,
) -> None:
    """Range numbers go round: a journal can hold ops of a closed range whose number a
    range opened since has. Only the ops after the newest opening of a number are
    applied; the ones before could complete records the new range never read."""
    proc = Process(tmp_path)
    ft = proc.ft
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 0, 0, 3)], tree=True)
    old = rangeroots.encode(number, 0, [0, 1, 2])
    seed = 11
    state = JournalState(
        range_ops=[
            (RANGE_READ, np.array([old[0], 3, seed], dtype=np.uint64)),
            (RANGE_XOR, np.concatenate([old, rangeroots.emission_ids(seed, old)])),
            (RANGE_OPEN, np.array([number], dtype=np.uint64)),
        ]
    )
    rangeacks.recover(ft._s, state)
    assert ft.pending_by_source() == {SOURCE: 3}
    assert ft.current_stats().open_ranges == 1
