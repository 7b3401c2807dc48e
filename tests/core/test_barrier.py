"""Completion at the barrier (issue 13, part 1): a barrier-mode source's roots complete
when their batch is done, in one release, unless they failed (replayed) or something
holds them past the batch (completing by XOR, as trees do)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlayer.acking.ids import new_ids
from ftlayer.causes import Cause, FailKind
from ftlayer.checkpoint import CheckpointCoordinator, CheckpointMode
from ftlayer.core import FTLayer
from ftlayer.errors import ConfigError
from ftlayer.persistence import Completed, LmdbStorage, MemoryStorage
from ftlayer.records import RecordBatch
from ftlayer.registration import SourceRegistration

BARRIER, TREE = 21, 22


def _records(n: int, source: int = BARRIER, first_offset: int = 0) -> RecordBatch:
    return RecordBatch.build(
        new_ids(n),
        [b"r%d" % i for i in range(n)],
        source_ids=source,
        topics="events",
        partitions=np.arange(n) % 2,
        offsets=np.arange(first_offset, first_offset + n),
    )


def _layer() -> FTLayer:
    ft = FTLayer(MemoryStorage(), timeout_s=60)
    ft.register_source(SourceRegistration(BARRIER, "forward", 2, completion="barrier"))
    ft.register_source(SourceRegistration(TREE, "forward", 2))
    return ft


def _persist(ft: FTLayer, batch: RecordBatch) -> np.ndarray:
    ids = new_ids(len(batch))  # the ids the source emits: its holds in barrier mode
    ft.persist(batch, ids)
    return ids


def test_a_batch_completes_at_its_barrier_but_its_failed_records_are_replayed() -> None:
    ft = _layer()
    completed: list[Completed] = []
    ft.add_completion_listener(completed.append)
    batch = _records(10)
    _persist(ft, batch)
    tree_batch = _records(3, TREE)
    _persist(ft, tree_batch)
    assert ft.open_holds == 10 and len(ft) == 13
    ft.fail(batch.roots[[4]], Cause(FailKind.EXPLICIT, "enrich", "FailException: later"))
    # The failed root holds nothing any more: STATUS counts the 9 holds still open.
    assert ft.current_stats().barrier_holds == 9
    # Nothing completes before the barrier, not even by the tasks' silence.
    assert not completed
    assert ft.release_barrier([BARRIER]) == 9
    assert sorted(o for c in completed for o in c.offsets.tolist()) == [
        0, 1, 2, 3, 5, 6, 7, 8, 9,
    ]  # fmt: skip
    assert len(ft) == 4  # the failed record, waiting as a replay; the tree-mode three
    # The replay enters a later batch: its fetch holds it, its batch's barrier completes it.
    replay = ft.fetch_replay(0, ft.replay_cursor_of(BARRIER), source_id=BARRIER)
    assert replay.records.offsets.tolist() == [4] and ft.open_holds == 1
    assert ft.release_barrier([BARRIER]) == 1
    # Released: the 9 completed at the first barrier and the replay; the failed root's
    # hold was not released (it is no longer pending), so it is not counted.
    assert len(ft) == 3 and ft.current_stats().barrier_released == 10
    # A tree-mode source's roots are untouched by a barrier.
    assert ft.release_barrier([TREE]) == 0 and len(ft) == 3


def test_a_root_held_past_its_batch_completes_by_xor_and_a_loop_goes_on_under_a_hold() -> None:
    ft = _layer()
    batch = _records(2)
    _persist(ft, batch)
    in_transit = new_ids(1)
    ft.xor(batch.roots[:1], in_transit)  # a loop sink: record 0 goes round again
    assert ft.release_barrier([BARRIER]) == 1  # record 1; record 0 is held
    assert int(batch.roots[0]) in ft.acker
    # Read back in the next batch: the transit is released, a new hold taken.
    assert ft.hold(batch.roots[:1], in_transit) == 1
    assert int(batch.roots[0]) in ft.acker and ft.open_holds == 1
    assert ft.release_barrier([BARRIER]) == 1 and len(ft) == 0


def test_a_replay_fetched_twice_or_broadcast_is_held_once() -> None:
    ft = FTLayer(MemoryStorage(), timeout_s=60)
    ft.register_source(SourceRegistration(BARRIER, "broadcast", 3, completion="barrier"))
    batch = _records(2)
    _persist(ft, batch)
    ft.fail(batch.roots)
    ft.release_barrier([BARRIER])
    cursor = ft.replay_cursor_of(BARRIER)
    first = ft.fetch_replay(0, cursor, source_id=BARRIER)
    again = ft.fetch_replay(0, cursor, source_id=BARRIER)  # Spark runs the batch again
    assert len(first) == len(again) == 6  # 2 records x 3 partitions
    assert ft.open_holds == 2
    assert ft.release_barrier([BARRIER]) == 2 and len(ft) == 0


def test_the_done_of_a_checkpoint_releases_its_querys_holds(tmp_path: Path) -> None:
    store = LmdbStorage(tmp_path / "ft")
    ft = FTLayer(store, timeout_s=60)
    ft.register_source(SourceRegistration(BARRIER, "forward", 2, completion="barrier"))
    coordinator = CheckpointCoordinator(ft)
    position = {"kafka": {"events": {"0": 0, "1": 0}}, "replay": 0}
    coordinator.begin("q", position, [BARRIER], CheckpointMode.UNALIGNED)
    batch = _records(4)
    _persist(ft, batch)
    end = {"kafka": {"events": {"0": 2, "1": 2}}, "replay": 0}
    coordinator.begin("q", end, [BARRIER], CheckpointMode.UNALIGNED)
    coordinator.write_pending()
    assert len(ft) == 4
    done = coordinator.done("q", end, [BARRIER], CheckpointMode.UNALIGNED)
    assert len(ft) == 0 and done.commit_offsets == {"events": {0: 2, 1: 2}}
    store.close()


def test_a_barrier_registration_survives_a_restart_and_bad_modes_are_refused(
    tmp_path: Path,
) -> None:
    store = LmdbStorage(tmp_path / "ft")
    FTLayer(store).register_source(SourceRegistration(BARRIER, "forward", 2, completion="barrier"))
    store.close()
    store = LmdbStorage(tmp_path / "ft")
    ft = FTLayer(store)
    config = ft.source_config(BARRIER)
    assert config is not None and config.completion == "barrier"
    with pytest.raises(ConfigError, match="completion must be one of"):
        ft.register_source(SourceRegistration(TREE, "forward", 2, completion="eventually"))
    store.close()


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 30),
    fails=st.sets(st.integers(0, 29)),
    held=st.sets(st.integers(0, 29)),
)
def test_no_root_completes_before_its_barrier_and_failed_ones_never_complete_with_it(
    n: int, fails: set[int], held: set[int]
) -> None:
    ft = _layer()
    completed: list[int] = []
    ft.add_completion_listener(lambda done: completed.extend(done.offsets.tolist()))
    batch = _records(n)
    _persist(ft, batch)
    fails, held = {i for i in fails if i < n}, {i for i in held if i < n} - fails
    transit = {i: int(new_ids(1)[0]) for i in held}
    for i in sorted(fails):
        ft.fail(batch.roots[[i]])
    for i, t in transit.items():
        ft.xor(batch.roots[[i]], np.array([t], dtype=np.uint64))
    assert completed == []  # nothing before the barrier
    ft.release_barrier([BARRIER])
    assert sorted(completed) == sorted(set(range(n)) - fails - held)
    for i, t in transit.items():  # the holders ack: their roots complete now
        ft.xor(batch.roots[[i]], np.array([t], dtype=np.uint64))
    assert sorted(completed) == sorted(set(range(n)) - fails)
    # Every failed record waits as a replay: nothing lost.
    assert len(ft) == len(fails) and len(ft.storage) == len(fails)
