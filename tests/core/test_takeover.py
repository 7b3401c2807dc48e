"""Re-reads take over (ftlayer.core.takeover): a record persisted again, or a replay
fetched again, retires its earlier root without a replay, and the record stays covered
by a live root at every moment."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from manual_clock import Clock
from numpy.typing import NDArray

from ftlayer.acking.handlers import Persister
from ftlayer.acking.ids import new_ids
from ftlayer.causes import Cause, FailKind
from ftlayer.core import FTLayer
from ftlayer.core.retries import RetryPolicy
from ftlayer.core.takeover import ReadMarks, chunk_groups
from ftlayer.errors import StorageError
from ftlayer.persistence import Completed, LmdbStorage, MemoryStorage, PersistenceStorage
from ftlayer.persistence.base import MetaOfSeqs
from ftlayer.records import RecordBatch
from ftlayer.registration import SourceRegistration

SOURCE = 5
T = 10.0  # tree timeout; 3 buckets: a root expires between T and 1.5 T after tracking


def _layer(
    storage: PersistenceStorage,
    clock: Clock,
    *,
    completion: str = "tree",
    partitioner: str = "forward",
    retry: RetryPolicy | None = None,
) -> FTLayer:
    ft = FTLayer(storage, timeout_s=T, clock=clock, wall_clock=clock)
    ft.register_source(
        SourceRegistration(
            SOURCE,
            partitioner,
            2,
            completion=completion,
            retry=retry or RetryPolicy(max_retries=-1, backoff_ms=0, backoff_max_ms=0),
        )
    )
    return ft


def _read(offsets: list[int] | NDArray[np.int64], partition: int = 0) -> RecordBatch:
    """A chunk of partition `partition` under fresh roots, as a task attempt reads it."""
    offs = np.asarray(offsets, dtype=np.int64)
    return RecordBatch.build(
        new_ids(len(offs)),
        [b"event-%d-%d" % (partition, o) for o in offs.tolist()],
        source_ids=SOURCE,
        topics="events",
        partitions=partition,
        offsets=offs,
    )


def _persist(ft: FTLayer, batch: RecordBatch) -> NDArray[np.uint64]:
    """Persist with the emission ids as first ack values (the Persister's way)."""
    ids = new_ids(len(batch))
    ft.persist(batch, ids)
    return ids


def _heard(ft: FTLayer) -> list[tuple[int, int]]:
    """(partition, offset) of every completion notice, as they come."""
    heard: list[tuple[int, int]] = []

    def listen(done: Completed) -> None:
        heard.extend(zip(done.partitions.tolist(), done.offsets.tolist(), strict=True))

    ft.add_completion_listener(listen)
    return heard


def _timeouts(ft: FTLayer, clock: Clock, until: float) -> None:
    while clock.now < until:
        clock.now += 0.5
        ft.tick()


def test_a_reread_retires_the_earlier_roots_without_replay_or_completion_notice(
    storage: PersistenceStorage,
) -> None:
    clock = Clock()
    ft = _layer(storage, clock)
    heard = _heard(ft)
    dead = _read([0, 1, 2, 3])
    dead_ids = _persist(ft, dead)  # the attempt that dies: it sends nothing
    ft.xor(dead.roots[:1], dead_ids[:1] ^ new_ids(1))  # but one event got out
    clock.now = 2.0
    retry = _read([0, 1, 2, 3])
    retry_ids = _persist(ft, retry)
    stats = ft.current_stats()
    assert stats.taken_over == 4 and len(ft) == 4 and len(storage) == 4
    assert not heard  # the offsets are still pending, under the retry's roots
    assert ft.lowest_pending_offsets() == {"events": {0: 0}}
    # The dead attempt's events are late now, never applied to anything.
    ft.xor(dead.roots, dead_ids)
    assert ft.current_stats().late_events == 4 and len(ft) == 4
    ft.xor(retry.roots, retry_ids)
    assert sorted(heard) == [(0, 0), (0, 1), (0, 2), (0, 3)] and len(storage) == 0
    _timeouts(ft, clock, 4 * T)
    assert ft.current_stats().failed == {
        "explicit": 0,
        "timeout": 0,
        "recovery": 0,
        "source-expired": 0,
    }
    assert ft.replay_cursor == 0 and ft.fetch_replay(0, 0).records.offsets.tolist() == []


def test_only_the_coordinates_read_again_are_taken_over(storage: PersistenceStorage) -> None:
    clock = Clock()
    ft = _layer(storage, clock)
    _persist(ft, _read([0, 1, 2], partition=0))
    _persist(ft, _read([0, 1, 2], partition=1))  # another partition: not a re-read
    _persist(ft, _read([3, 4], partition=0))
    assert ft.current_stats().taken_over == 0
    _persist(ft, _read([2, 3], partition=0))  # a retry of a chunk from offset 2 on
    assert ft.current_stats().taken_over == 2 and len(ft) == 8
    other = RecordBatch.build(  # the same topic, read by another source
        new_ids(2), [b"x", b"y"], source_ids=SOURCE + 1, topics="events", offsets=[0, 1]
    )
    _persist(ft, other)
    no_offset = RecordBatch.build(
        new_ids(2), [b"x", b"y"], source_ids=SOURCE, topics="events", offsets=[-1, -1]
    )
    _persist(ft, no_offset)
    _persist(ft, no_offset.with_roots(new_ids(2)))  # no coordinates: nothing taken over
    assert ft.current_stats().taken_over == 2 and len(ft) == 14


def test_a_rerun_that_dies_too_leaves_its_records_to_time_out_and_be_replayed(
    storage: PersistenceStorage,
) -> None:
    clock = Clock()
    ft = _layer(storage, clock)
    heard = _heard(ft)
    _persist(ft, _read([10, 11, 12]))
    clock.now = 8.0  # the retry starts before the first attempt's timeout
    _persist(ft, _read([10, 11, 12]))  # and dies as well
    _timeouts(ft, clock, 8.0 + 1.5 * T)
    stats = ft.current_stats()
    assert stats.taken_over == 3 and stats.failed["timeout"] == 3 and len(ft) == 3
    replay = ft.fetch_replay(0, ft.replay_cursor, source_id=SOURCE, partition=0)
    assert replay.records.offsets.tolist() == [10, 11, 12] and not heard
    ft.xor(replay.records.roots, np.zeros(3, np.uint64) ^ (e := new_ids(3)))
    ft.xor(replay.records.roots, e)
    assert sorted(heard) == [(0, 10), (0, 11), (0, 12)] and len(storage) == 0


@pytest.mark.parametrize("completion", ["tree", "barrier"])
def test_another_record_at_reused_coordinates_takes_nothing_over(
    storage: PersistenceStorage, completion: str
) -> None:
    """A topic recreated, or a new cluster after a savepoint restore, starts its
    offsets again: a record there is another record, though its coordinates are
    those of a pending one. Only the same bytes at the same coordinates take over
    (at persist in tree mode, at the timeout in barrier mode)."""
    clock = Clock()
    ft = _layer(storage, clock, completion=completion)
    _persist(ft, _read([0, 1]))
    _timeouts(ft, clock, 0.8 * T)
    recreated = RecordBatch.build(
        new_ids(2), [b"other-0", b"other-1"], source_ids=SOURCE, topics="events", offsets=[0, 1]
    )
    _persist(ft, recreated)
    assert ft.current_stats().taken_over == 0 and len(ft) == 4
    _timeouts(ft, clock, 1.6 * T)  # the first records' timeout, not the others'
    stats = ft.current_stats()
    assert stats.taken_over == 0 and stats.failed["timeout"] == 2
    replays = ft.fetch_replay(0, ft.replay_cursor, source_id=SOURCE, partition=0)
    assert sorted(replays.records.payloads) == [b"event-0-0", b"event-0-1"]


class RefusingPuts(MemoryStorage):
    """A storage whose puts can be made to fail, as a full disk would."""

    refuse = False

    def put(
        self,
        batch: RecordBatch,
        meta: MetaOfSeqs | None = None,
        replay_seqs: NDArray[np.uint64] | None = None,
    ) -> NDArray[np.uint64]:
        if self.refuse:
            raise StorageError("disk full")
        return super().put(batch, meta, replay_seqs)


def test_a_reread_that_cannot_be_stored_takes_nothing_over() -> None:
    clock = Clock()
    storage = RefusingPuts()
    ft = _layer(storage, clock)
    first = _read([0, 1])
    _persist(ft, first)
    storage.refuse = True
    with pytest.raises(StorageError, match="disk full"):
        _persist(ft, _read([0, 1]))
    assert all(int(r) in ft.acker for r in first.roots) and len(storage) == 2
    storage.refuse = False
    _persist(ft, _read([0, 1]))  # the source tries again: now it takes over
    assert ft.current_stats().taken_over == 2 and len(ft) == 2 and len(storage) == 2


def test_a_failed_records_attempts_go_on_across_a_takeover(storage: PersistenceStorage) -> None:
    """A poison record re-read by a retried task keeps its count: it is dead-lettered
    after its retries, not retried for ever."""
    clock = Clock()
    ft = _layer(storage, clock, retry=RetryPolicy(max_retries=2, backoff_ms=0, backoff_max_ms=0))
    poison = Cause(FailKind.ERROR, "enrich", "ValueError: poison")
    first = _read([7])
    _persist(ft, first)
    ft.fail(first.roots, poison)  # attempt 1; its replay waits in the queue
    again = _read([7])
    _persist(ft, again)  # the task is retried: it reads offset 7 again
    assert ft.retries(int(again.roots[0])) == 1 and ft.current_stats().taken_over == 1
    assert ft.fetch_replay(0, ft.replay_cursor).records.offsets.tolist() == []  # taken over
    ft.fail(again.roots, poison)  # attempt 2
    replay = ft.fetch_replay(1, ft.replay_cursor).records
    assert replay.offsets.tolist() == [7] and ft.retries(int(replay.roots[0])) == 2
    ft.fail(replay.roots, poison)  # attempt 3: the retries are spent
    assert ft.dead_letter_count == 1 and len(ft) == 0
    letter = ft.retry_record(ft.dead_letters()[0][0][0])
    assert letter is not None and letter.attempts == 3
    assert len(storage) == 1  # only the dead letter: the copies taken over are deleted


def test_a_barrier_mode_reread_takes_nothing_over(storage: PersistenceStorage) -> None:
    """Barrier mode lets a batch be computed twice (two actions on an uncached batch):
    both computations are live, so a failure in the first must still replay its
    record. Both copies' roots complete at the barrier."""
    clock = Clock()
    ft = _layer(storage, clock, completion="barrier")
    heard = _heard(ft)
    first = _read([0, 1, 2])
    _persist(ft, first)
    _persist(ft, _read([0, 1, 2]))  # the batch computed a second time
    assert ft.open_holds == 6 and ft.current_stats().taken_over == 0
    ft.fail(first.roots[[1]], Cause(FailKind.SINK, "sink", "KafkaTimeoutError: write"))
    assert ft.release_barrier([SOURCE]) == 5
    assert sorted(heard) == [(0, 0), (0, 0), (0, 1), (0, 2), (0, 2)]
    replay = ft.fetch_replay(0, ft.replay_cursor, source_id=SOURCE, partition=0)
    assert replay.records.offsets.tolist() == [1]


def test_a_barrier_mode_copy_that_times_out_under_a_newer_one_retires_without_replay(
    storage: PersistenceStorage,
) -> None:
    """A dead attempt's roots wait for their batch's barrier, which comes only after
    the retry: a slow batch lets them time out first. The retry's copies of their
    records are pending then, so they retire instead of being replayed."""
    clock = Clock()
    ft = _layer(storage, clock, completion="barrier")
    heard = _heard(ft)
    _persist(ft, _read([0, 1, 2]))  # the attempt that dies
    _persist(ft, _read([7]))  # another task's record, in flight as long
    _timeouts(ft, clock, 0.8 * T)
    _persist(ft, _read([0, 1, 2]))  # its retry
    _timeouts(ft, clock, 1.6 * T)  # past the first copies' timeout, not the retry's
    stats = ft.current_stats()
    assert stats.taken_over == 3 and stats.failed["timeout"] == 1 and len(ft) == 4
    assert ft.fetch_replay(0, ft.replay_cursor).records.offsets.tolist() == [7]
    ft.release_barrier([SOURCE])  # the retry's copies, and the replay it took in
    assert sorted(heard) == [(0, 0), (0, 1), (0, 2), (0, 7)] and len(storage) == 0


def test_a_tree_mode_replay_fetched_again_completes_through_the_rerun(
    storage: PersistenceStorage,
) -> None:
    """The dead run sent its replays' emissions and part of their trees: the re-run's
    fetch gives the records fresh roots, so its own tree completes them."""
    clock = Clock()
    ft = _layer(storage, clock)
    heard = _heard(ft)
    batch = _read([0, 1])
    _persist(ft, batch)
    ft.fail(batch.roots, Cause(FailKind.EXPLICIT, "enrich", "FailException: flaky"))
    persister = Persister(ft, source_id=SOURCE)
    dead = ft.fetch_replay(0, 2, source_id=SOURCE, partition=0).records
    dead_anchors = persister.emit_replays(dead.roots)  # its emission XOR reached the FT layer
    child = new_ids(2)
    ft.xor(dead_anchors.roots, dead_anchors.ids ^ child)  # and its first step's acks
    clock.now = 5.0
    rerun = ft.fetch_replay(0, 2, source_id=SOURCE, partition=0).records
    assert rerun.offsets.tolist() == [0, 1]
    assert not set(rerun.roots.tolist()) & set(dead.roots.tolist())
    anchors = persister.emit_replays(rerun.roots)
    child = new_ids(2)
    ft.xor(anchors.roots, anchors.ids ^ child)
    ft.xor(anchors.roots, child)
    assert sorted(heard) == [(0, 0), (0, 1)] and len(ft) == 0
    ft.xor(dead_anchors.roots, child)  # the dead run's last events, late
    stats = ft.current_stats()
    assert stats.late_events == 2 and stats.taken_over == 2 and stats.failed["timeout"] == 0


def test_a_broadcast_replay_fetched_again_keeps_its_root(storage: PersistenceStorage) -> None:
    """Each partition's copy of a broadcast replay is a child of one root: a fresh
    root for one partition's re-run would leave the other copies untracked."""
    clock = Clock()
    ft = _layer(storage, clock, partitioner="broadcast")
    batch = _read([4])
    _persist(ft, batch)
    ft.fail(batch.roots)
    first = ft.fetch_replay(0, 1, source_id=SOURCE, partition=1).records
    again = ft.fetch_replay(0, 1, source_id=SOURCE, partition=1).records
    assert first.roots.tolist() == again.roots.tolist()
    assert ft.current_stats().taken_over == 0


def test_a_recovered_record_read_again_from_kafka_is_not_replayed_too(tmp_path: Path) -> None:
    """After an FT-layer restart every stored record waits as a replay; a query that
    reads those offsets again from Kafka (the re-run of its last batch) takes them over,
    so each is processed once, not twice."""
    clock = Clock()
    ft = _layer(LmdbStorage(tmp_path / "ft"), clock)
    _persist(ft, _read([0, 1, 2, 3]))
    ft.storage.close()
    ft = _layer(LmdbStorage(tmp_path / "ft"), clock)
    assert ft.current_stats().failed["recovery"] == 4 and ft.replay_cursor == 4
    _persist(ft, _read([2, 3, 4, 5]))
    assert ft.current_stats().taken_over == 2
    replays = ft.fetch_replay(0, ft.replay_cursor, source_id=SOURCE, partition=0)
    assert replays.records.offsets.tolist() == [0, 1]
    ft.storage.close()


def test_read_marks_flag_a_chunk_that_starts_at_or_below_its_partitions_mark() -> None:
    marks = ReadMarks()
    topics = np.zeros(4, np.uint32)

    def read(partitions: list[int], offsets: list[int]) -> list[tuple[int, int, list[int]]]:
        groups = chunk_groups(topics[: len(offsets)], np.array(partitions), np.array(offsets))
        return [(g.topic, g.partition, g.offsets.tolist()) for g in marks.read(groups)]

    assert read([0, 0, 0], [0, 1, 2]) == []
    assert read([0, 0, 0], [3, 4, 5]) == []
    assert read([1, 0, 1], [0, 6, 1]) == []  # two partitions in one chunk, both new
    assert read([0, 0], [5, 9]) == [(0, 0, [5, 9])]
    assert read([1, 1, 0], [1, 2, 10]) == [(0, 1, [1, 2])]
    assert read([0, 0], [-1, 11]) == []  # no offset: no coordinates
    assert read([0, 1], [-1, -1]) == []
    assert len(marks) == 2


# ---- the property -------------------------------------------------------------------


@dataclass
class Model:
    """What the test knows: the ranges read, which copies of which records were left
    incomplete and when, and when each record was read or fetched again."""

    ft: FTLayer
    clock: Clock
    next_offset: list[int] = field(default_factory=lambda: [0, 0])
    last_range: list[list[int]] = field(default_factory=lambda: [[], []])
    replay_seen: list[int] = field(default_factory=lambda: [0, 0])
    last_replay_range: list[tuple[int, int] | None] = field(default_factory=lambda: [None, None])
    step: int = 0
    abandoned: list[tuple[int, float, int, int, int]] = field(default_factory=list)
    """(step, time, partition, offset, root) of every copy its attempt left
    incomplete."""
    again: dict[tuple[int, int], list[tuple[int, float]]] = field(default_factory=dict)
    """(step, time) of every re-read or re-fetch of each (partition, offset)."""

    def reread(self, partition: int, offsets: list[int]) -> None:
        """These records were read again now: an abandoned copy of one of them that
        cannot have timed out yet (tracked less than T ago) is taken over at once."""
        for o in offsets:
            self.again.setdefault((partition, o), []).append((self.step, self.clock.now))
        rows = set(offsets)
        for step, at, p, o, root in self.abandoned:
            if p == partition and o in rows and step < self.step and self.clock.now < at + T:
                assert root not in self.ft.acker, f"({p}, {o}) read again, not taken over"

    def left(self, partition: int, offsets: list[int], roots: NDArray[np.uint64]) -> None:
        self.abandoned += [
            (self.step, self.clock.now, partition, o, r)
            for o, r in zip(offsets, roots.tolist(), strict=True)
        ]

    def rescued(self, step: int, at: float, partition: int, offset: int, _root: int) -> bool:
        """Read again by a later step before its timeout could fire (T after `at`)."""
        return any(s > step and t < at + T for s, t in self.again.get((partition, offset), []))


def _run_copy(
    ft: FTLayer, roots: NDArray[np.uint64], ids: NDArray[np.uint64], outcome: str
) -> None:
    """One attempt's tree over its records (a map step and a sink): complete, fail
    (the map step raised FailException), die after the map step's events got out, or
    die with nothing sent."""
    child = new_ids(len(roots))
    if outcome in ("complete", "partial"):
        ft.xor(roots, ids ^ child)
    if outcome == "complete":
        ft.xor(roots, child)
    if outcome == "fail":
        ft.fail(roots, Cause(FailKind.EXPLICIT, "map", "FailException: flaky"))


outcomes = st.sampled_from(["complete", "complete", "fail", "partial", "dead"])
steps = st.one_of(
    st.tuples(st.just("read"), st.integers(0, 1), st.integers(1, 3), outcomes),
    st.tuples(st.just("retry"), st.integers(0, 1), st.just(0), outcomes),
    st.tuples(st.just("replay"), st.integers(0, 1), st.just(0), outcomes),
    st.tuples(st.just("replay_again"), st.integers(0, 1), st.just(0), outcomes),
    st.tuples(st.just("wait"), st.just(0), st.sampled_from([1, 3, 6]), st.just("")),
)


def _step(m: Model, kind: str, partition: int, n: int, outcome: str) -> None:
    """One step: an attempt reads a new range or its partition's last range again (a
    retried task), fetches its partition's new replays or the last ones again (a
    re-run), and completes its trees or dies; or time passes."""
    ft, clock = m.ft, m.clock
    m.step += 1
    if kind in ("read", "retry"):
        if kind == "read":
            offsets = list(range(m.next_offset[partition], m.next_offset[partition] + n))
            m.next_offset[partition] += n
            m.last_range[partition] = offsets
        else:
            offsets = m.last_range[partition]
        if offsets:
            batch = _read(offsets, partition)
            ids = _persist(ft, batch)
            if kind == "retry":
                m.reread(partition, offsets)
            _run_copy(ft, batch.roots, ids, outcome)
            if outcome in ("partial", "dead"):
                m.left(partition, offsets, batch.roots)
    elif kind in ("replay", "replay_again"):
        if kind == "replay":
            m.last_replay_range[partition] = (m.replay_seen[partition], ft.replay_cursor)
            m.replay_seen[partition] = ft.replay_cursor
        span = m.last_replay_range[partition]
        if span is None:
            return
        records = ft.fetch_replay(*span, source_id=SOURCE, partition=partition).records
        offsets = records.offsets.tolist()
        if kind == "replay_again":
            m.reread(partition, offsets)
        if offsets:
            emission = new_ids(len(records))
            ft.xor(records.roots, emission)  # Persister.emit_replays: the emission goes out
            _run_copy(ft, records.roots, emission, outcome)
            if outcome in ("partial", "dead"):
                m.left(partition, offsets, records.roots)
    else:
        clock.now += n
        ft.tick()


def _one_live_root_each(m: Model, completed: set[tuple[int, int]]) -> None:
    """Every record read so far completed or is pending, and under one root only."""
    live = m.ft.acker.live_columns("partition", "offset")
    pending = list(zip(live["partition"].tolist(), live["offset"].tolist(), strict=True))
    assert len(pending) == len(set(pending)), "a record pending under two roots"
    for partition in (0, 1):
        for o in range(m.next_offset[partition]):
            assert (partition, o) in completed or (partition, o) in set(pending), (partition, o)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(steps, min_size=1, max_size=40))
def test_rereads_under_random_interleavings_lose_nothing_and_add_no_replay(
    plan: list[tuple[str, int, int, str]],
) -> None:
    clock = Clock()
    ft = _layer(MemoryStorage(), clock)
    completed: set[tuple[int, int]] = set()
    ft.add_completion_listener(
        lambda done: completed.update(
            zip(done.partitions.tolist(), done.offsets.tolist(), strict=True)
        )
    )
    m = Model(ft, clock)
    for kind, partition, n, outcome in plan:
        _step(m, kind, partition, n, outcome)
        _one_live_root_each(m, completed)
    # A copy left incomplete is replayed (times out) only if nothing read its record
    # again within T: a re-read adds no replay.
    unrescued = sum(1 for copy in m.abandoned if not m.rescued(*copy))
    assert ft.current_stats().failed["timeout"] <= unrescued
    # Drain: whatever is left times out, is replayed and completes.
    for _ in range(5):
        if not len(ft):
            break
        _timeouts(ft, clock, clock.now + 1.6 * T)
        for partition in (0, 1):
            _step(m, "replay", partition, 0, "complete")
    assert len(ft) == 0 and len(ft.storage) == 0
    assert completed == {(p, o) for p in (0, 1) for o in range(m.next_offset[p])}
