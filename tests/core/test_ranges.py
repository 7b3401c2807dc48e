"""Batch ranges (ftlayer.core.ranges): a barrier-mode batch read by reference is one
offset range per partition; its records are pending without an entry each, complete
with their batch, and a record an event names (a fail, a loop's hold) becomes a record
of its own, replayed once its source copied its bytes (and so its key) in."""

from __future__ import annotations

import shutil
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
from ftlayer.errors import ConfigError
from ftlayer.persistence import LmdbStorage, MemoryStorage, PersistenceStorage
from ftlayer.registration import SourceRegistration

SOURCE = 9
TOPIC = "orders"
FAILED = Cause(FailKind.EXPLICIT, "enrich", "FailException: no")


def _layer(
    storage: PersistenceStorage, partitioner: str = "forward", backoff_ms: int = 0
) -> FTLayer:
    ft = FTLayer(storage, timeout_s=30, clock=Clock(), wall_clock=Clock(1000.0), seed=1)
    ft.register_source(
        SourceRegistration(
            SOURCE,
            partitioner,
            4,
            retry=RetryPolicy(5, backoff_ms, max(backoff_ms, 1)),
            completion="barrier",
        )
    )
    return ft


def _bytes(offset: int) -> bytes:
    return b"record-%d" % offset


def _fill_all(ft: FTLayer, key_hash: int = 0, has_key: bool = False) -> None:
    """What the driver does: copy every unfilled record's bytes (and key) in."""
    wanted = ft.unfilled(SOURCE)
    n = len(wanted)
    ft.fill(
        wanted.seqs,
        [_bytes(o) for o in wanted.records.offsets.tolist()],
        np.ones(n, dtype=np.bool_),
        (np.full(n, key_hash, dtype=np.int64), np.full(n, has_key, dtype=np.bool_)),
    )


def _replays(ft: FTLayer) -> list[tuple[int, int, bytes]]:
    found = ft.fetch_replay(0, ft.replay_cursor_of(SOURCE), source_id=SOURCE)
    return sorted(
        zip(
            found.records.offsets.tolist(),
            found.partitions.tolist(),
            [bytes(p) for p in found.records.payloads],
            strict=True,
        )
    )


def test_a_batch_is_one_range_per_partition_pending_until_its_barrier_is_done(
    storage: PersistenceStorage,
) -> None:
    ft = _layer(storage)
    numbers = ft.register_ranges(
        [(SOURCE, TOPIC, 0, 100, 150), (SOURCE, TOPIC, 1, 7, 7), (SOURCE, TOPIC, 2, 0, 20)]
    )
    assert numbers[1] == 0 and numbers[0] and numbers[2] and numbers[0] != numbers[2]
    # Planned again (a driver restart): the same numbers, counted once.
    assert ft.register_ranges([(SOURCE, TOPIC, 0, 100, 150)]) == [numbers[0]]
    stats = ft.current_stats()
    assert (stats.persisted, stats.open_ranges, len(ft)) == (70, 2, 0)
    assert len(storage) == 0  # nothing stored per record
    assert ft.pending_by_source() == {SOURCE: 70}
    assert ft.lowest_pending_offsets([TOPIC]) == {TOPIC: {0: 100, 2: 0}}
    # A barrier below a range's end leaves it open; the batch's barrier completes it.
    assert ft.complete_ranges([SOURCE], {TOPIC: {0: 120, 2: 20}}) == 20
    assert ft.lowest_pending_offsets([TOPIC]) == {TOPIC: {0: 100}}
    assert ft.complete_ranges([SOURCE + 1], {TOPIC: {0: 150}}) == 0  # another source's
    assert ft.complete_ranges([SOURCE], {TOPIC: {"0": 150}}) == 50
    stats = ft.current_stats()
    assert (stats.completed, stats.open_ranges, ft.pending_by_source()) == (70, 0, {})
    assert stats.by_source[str(SOURCE)]["completed"] == 70


def test_a_failed_record_of_a_range_is_replayed_once_its_bytes_and_key_are_in(
    storage: PersistenceStorage,
) -> None:
    ft = _layer(storage, partitioner="kafka-hash")
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 1, 1000, 1100)])
    roots = rangeroots.encode(number, 1000, [1003, 1050])
    assert ft.fail(roots, FAILED) == 2
    # Failed, but not queued: its key (so its replay partition) is not known yet.
    assert ft.replay_cursor_of(SOURCE) == 0 and ft.current_stats().unfilled == 2
    # A second fail of the same row (a retried task) changes nothing.
    assert ft.fail(roots[:1], FAILED) == 0
    assert ft.current_stats().failed["explicit"] == 2
    _fill_all(ft, key_hash=6, has_key=True)  # kafka-hash: (6 & 0x7fffffff) % 4 = 2
    assert _replays(ft) == [(1003, 2, _bytes(1003)), (1050, 2, _bytes(1050))]
    # The batch's barrier completes the other 98; the failed two are pending as replays.
    assert ft.complete_ranges([SOURCE], {TOPIC: {1: 1100}}) == 98
    assert ft.lowest_pending_offsets([TOPIC]) == {TOPIC: {1: 1003}}
    # A fail naming the range after it completed is unknown: nothing happens.
    assert ft.fail(rangeroots.encode(number, 1000, [1004]), FAILED) == 0


def test_a_keyless_record_of_a_key_partitioned_source_is_a_dead_letter_not_an_error(
    storage: PersistenceStorage,
) -> None:
    ft = _layer(storage, partitioner="kafka-hash")
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 0, 0, 10)])
    ft.fail(rangeroots.encode(number, 0, [4]), FAILED)
    _fill_all(ft, has_key=False)
    _, records = ft.dead_letters()
    assert records.offsets.tolist() == [4] and list(records.payloads) == [_bytes(4)]
    assert ft.current_stats().unfilled == 0 and ft.replay_cursor_of(SOURCE) == 0


def test_a_loops_hold_keeps_a_range_record_past_its_batch(storage: PersistenceStorage) -> None:
    ft = _layer(storage)
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 0, 0, 10)])
    root = rangeroots.encode(number, 0, [3])
    transit = new_ids(1)
    assert ft.hold(root, transit) == 1  # the loop sink sends it round
    assert ft.complete_ranges([SOURCE], {TOPIC: {0: 10}}) == 9
    assert len(ft) == 1 and ft.lowest_pending_offsets() == {TOPIC: {0: 3}}
    # The loop reads it back in a later batch, whose barrier completes it.
    ft.batch_began([SOURCE])
    ft.hold(root, transit)
    ft.release_barrier([SOURCE])
    assert len(ft) == 0 and len(storage) == 0


def test_ranges_and_their_failed_records_survive_a_restart(tmp_path: Path) -> None:
    storage = LmdbStorage(tmp_path / "ft")
    ft = _layer(storage)
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 3, 500, 600)])
    roots = rangeroots.encode(number, 500, [510, 520])
    ft.fail(roots, FAILED)
    storage.close()
    storage = LmdbStorage(tmp_path / "ft")
    ft = _layer(storage)
    assert ft.current_stats().open_ranges == 1
    assert ft.pending_by_source() == {SOURCE: 100}
    # Materialized once: the same rows failing again after the restart add nothing.
    ft.fail(roots, FAILED)
    assert ft.pending_by_source() == {SOURCE: 100}
    _fill_all(ft)
    assert [r[0] for r in _replays(ft)] == [510, 520]  # forward: partition 3
    assert ft.complete_ranges([SOURCE], {TOPIC: {3: 600}}) == 98
    storage.close()


def _backoff_layer(storage: PersistenceStorage, wall: Clock) -> FTLayer:
    """A layer whose source (kafka-hash, barrier mode) waits 1 s before each replay."""
    ft = FTLayer(storage, timeout_s=30, clock=Clock(), wall_clock=wall, seed=1)
    policy = RetryPolicy(5, 1_000, 1_000)
    ft.register_source(
        SourceRegistration(SOURCE, "kafka-hash", 4, retry=policy, completion="barrier")
    )
    return ft


@pytest.mark.parametrize("restart", [False, True], ids=["running", "restarted"])
def test_a_range_rows_backoff_that_ends_before_its_fill_waits_for_its_key(
    restart: bool, tmp_path: Path
) -> None:
    """A failed range row's backoff usually ends before its source's next batch copies
    its bytes and key in: it waits, unqueued, and its fill routes it to its key's
    partition, once; also when the FT layer restarted in between."""
    path = tmp_path / "ft"
    storage = LmdbStorage(path)
    wall = Clock(1000.0)
    ft = _backoff_layer(storage, wall)
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 1, 1000, 1100)])
    assert ft.fail(rangeroots.encode(number, 1000, [1003, 1050, 1070]), FAILED) == 3
    if restart:
        storage.close()
        storage = LmdbStorage(path)
        ft = _backoff_layer(storage, wall)
    wall.now += 5.0  # every backoff ended
    ft.tick()
    assert ft.replay_cursor_of(SOURCE) == 0  # no key yet, so no partition: not queued
    assert len(ft.unfilled(SOURCE)) == 3
    _fill_all(ft, key_hash=7, has_key=True)  # kafka-hash: 7 % 4 = 3
    assert _replays(ft) == [(o, 3, _bytes(o)) for o in (1003, 1050, 1070)]
    ft.tick()
    assert len(_replays(ft)) == 3  # queued once
    # A row filled before its backoff ends goes by its key when the backoff ends.
    assert ft.fail(rangeroots.encode(number, 1000, [1080]), FAILED) == 1
    _fill_all(ft, key_hash=7, has_key=True)
    assert len(_replays(ft)) == 3
    wall.now += 5.0
    ft.tick()
    assert _replays(ft)[-1] == (1080, 3, _bytes(1080))
    storage.close()


@pytest.mark.parametrize("restart", [False, True], ids=["running", "restarted"])
def test_rows_filled_during_their_backoff_are_queued_by_their_keys_when_it_ends(
    restart: bool, tmp_path: Path
) -> None:
    """Rows filled while their backoff lasts (each with its own key and bytes) are
    queued when it ends, each to its key's partition with the bytes its fill brought,
    once: from what the fill kept in memory, with no read of the store, or, after a
    restart, from the store."""
    path = tmp_path / "ft"
    storage = LmdbStorage(path)
    wall = Clock(1000.0)
    ft = _backoff_layer(storage, wall)
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 2, 500, 600)])
    failed = [503, 510, 544, 571, 599]
    assert ft.fail(rangeroots.encode(number, 500, failed), FAILED) == len(failed)
    wanted = ft.unfilled(SOURCE)
    offsets = wanted.records.offsets.tolist()
    keys = np.array([o % 7 for o in offsets], dtype=np.int64)  # kafka-hash: key % 4
    ft.fill(wanted.seqs, [_bytes(o) for o in offsets], np.ones(len(offsets), np.bool_),
            (keys, np.ones(len(offsets), np.bool_)))  # fmt: skip
    assert ft.replay_cursor_of(SOURCE) == 0  # still in their backoff
    if restart:
        storage.close()
        storage = LmdbStorage(path)
        ft = _backoff_layer(storage, wall)
    reads = []
    get = storage.get
    storage.get = lambda seqs: reads.append(len(seqs)) or get(seqs)  # type: ignore[method-assign]
    wall.now += 5.0  # every backoff ended
    ft.tick()
    assert _replays(ft) == sorted((o, o % 7 % 4, _bytes(o)) for o in failed)
    assert reads == ([len(failed)] if restart else [])
    ft.tick()
    assert len(_replays(ft)) == len(failed)  # queued once
    storage.close()


@settings(max_examples=30, deadline=None)
@given(
    fails=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 49)), min_size=1, max_size=40),
    filled=st.sets(st.integers(0, 39)),
    limit=st.integers(1, 50),
)
def test_unfilled_answers_a_failures_rows_from_memory_as_the_store_holds_them(
    fails: list[tuple[int, int]],
    filled: set[int],
    limit: int,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """UNFILLED lists a first failure's range rows from the records that failure kept
    in memory: column for column the records the store holds, and the seqs a
    restart lists, however the rows failed (FAILs of several rows over three ranges)
    and whichever were filled since."""
    path = tmp_path_factory.mktemp("unfilled") / "ft"
    storage = LmdbStorage(path)
    ft = _layer(storage, partitioner="kafka-hash")
    numbers = ft.register_ranges([(SOURCE, TOPIC, p, 100 * p, 100 * p + 50) for p in range(3)])
    for at in range(0, len(fails), 7):  # a task's FAIL names several rows
        rows = fails[at : at + 7]
        ft.fail(
            np.concatenate(
                [rangeroots.encode(numbers[p], 100 * p, [100 * p + o]) for p, o in rows]
            ),
            FAILED,
        )
    wanted = ft.unfilled(SOURCE)
    some = np.array(sorted(i for i in filled if i < len(wanted)), dtype=np.intp)
    ft.fill(
        wanted.seqs[some],
        [_bytes(o) for o in wanted.records.offsets[some].tolist()],
        np.ones(len(some), dtype=np.bool_),
        (np.full(len(some), 5, dtype=np.int64), np.ones(len(some), dtype=np.bool_)),
    )
    from_memory = ft.unfilled(SOURCE, limit)
    if len(from_memory):  # answered from memory
        assert ft._s.unfilled.kept(from_memory.seqs.tolist()) is not None
    # The records those seqs name in the store, and those a restart lists.
    a, b = from_memory.records, storage.get(from_memory.seqs)
    for column in ("roots", "source_ids", "key_hashes", "has_key", "partitions", "offsets"):
        assert getattr(a, column).tolist() == getattr(b, column).tolist(), column
    assert list(a.topics) == list(b.topics)
    assert list(a.payloads) == list(b.payloads)
    assert a.reference_mask.tolist() == b.reference_mask.tolist()
    storage.close()
    storage = LmdbStorage(path)
    ft = _layer(storage, partitioner="kafka-hash")
    assert ft.unfilled(SOURCE, limit).seqs.tolist() == from_memory.seqs.tolist()
    storage.close()


def test_a_barriers_completion_rides_on_the_next_write_and_a_kill_before_it_loses_nothing(
    tmp_path: Path,
) -> None:
    storage = LmdbStorage(tmp_path / "ft")
    ft = _layer(storage)
    ft.register_ranges([(SOURCE, TOPIC, 0, 0, 100)])
    commits = storage.commits
    assert ft.complete_ranges([SOURCE], {TOPIC: {0: 100}}) == 100
    assert storage.commits == commits  # no commit of its own: staged
    killed = tmp_path / "killed"
    killed.mkdir()
    shutil.copy(tmp_path / "ft" / "data.mdb", killed / "data.mdb")  # what a kill leaves
    ft.register_ranges([(SOURCE, TOPIC, 0, 100, 200)])
    assert storage.commits == commits + 1  # the next batch's ranges carried it
    storage.close()
    # Killed before that write: the range is open again, its records pending (none
    # failed), and the next done barrier, past it too, completes it.
    after = _layer(LmdbStorage(killed))
    stats = after.current_stats()
    assert (stats.open_ranges, sum(stats.failed.values())) == (1, 0)
    assert after.pending_by_source() == {SOURCE: 100}
    assert after.complete_ranges([SOURCE], {TOPIC: {0: 200}}) == 100
    assert after.pending_by_source() == {}
    after.storage.close()
    # Restarted after it: only the next batch's range is open.
    again = _layer(LmdbStorage(tmp_path / "ft"))
    assert again.lowest_pending_offsets([TOPIC]) == {TOPIC: {0: 100}}
    assert again.current_stats().open_ranges == 1
    again.storage.close()


def test_a_range_rows_first_failure_is_stored_at_once_with_its_history(tmp_path: Path) -> None:
    """The record and its retry record are durable when fail returns: after a restart
    it waits out its backoff, its key unknown until its bytes come, then replays."""
    storage = LmdbStorage(tmp_path / "ft")
    ft = _layer(storage, partitioner="kafka-hash", backoff_ms=60_000)
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 2, 0, 10)])
    assert ft.fail(rangeroots.encode(number, 0, [4, 7]), FAILED) == 2
    storage.close()
    storage = LmdbStorage(tmp_path / "ft")
    ft = _layer(storage, partitioner="kafka-hash", backoff_ms=60_000)
    wanted = ft.unfilled(SOURCE)
    assert wanted.records.offsets.tolist() == [4, 7]
    assert bool(wanted.records.key_unknown.all()) and ft.waiting_replays == 2
    for seq in wanted.seqs.tolist():
        record = ft.retry_record(seq)
        assert record is not None and record.attempts == 1 and record.last_cause == FAILED
        assert 1000.0 + 30 <= record.due <= 1000.0 + 60  # the backoff, less its jitter
    _fill_all(ft, key_hash=5, has_key=True)  # kafka-hash: 5 % 4 = 1
    assert ft.release_due(now=1000.0 + 61) == 2
    assert _replays(ft) == [(4, 1, _bytes(4)), (7, 1, _bytes(7))]
    storage.close()


def test_bad_ranges_are_refused(storage: PersistenceStorage) -> None:
    ft = _layer(storage)
    with pytest.raises(ConfigError, match="batch range holds"):
        ft.register_ranges([(SOURCE, TOPIC, 0, 0, rangeroots.MAX_RANGE + 1)])
    with pytest.raises(ConfigError, match="range number"):
        rangeroots.encode(0, 0, [1])
    with pytest.raises(ConfigError, match="not all in range"):
        rangeroots.encode(1, 10, [9])


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 30), min_size=1, max_size=4),
    fails=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 29)), max_size=25),
    restart=st.booleans(),
)
def test_every_record_of_a_range_completes_once_or_is_replayed_once(
    sizes: list[int],
    fails: list[tuple[int, int]],
    restart: bool,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """However rows of a batch fail (twice, across a restart), each record of its ranges
    either completes with its batch or is replayed, exactly once; nothing is lost."""
    path = tmp_path_factory.mktemp("ranges") / "ft"
    storage: PersistenceStorage = LmdbStorage(path) if restart else MemoryStorage()
    ft = _layer(storage)
    ranges = [(SOURCE, TOPIC, p, 100 * p, 100 * p + n) for p, n in enumerate(sizes)]
    numbers = ft.register_ranges(ranges)
    picked = {(p, o) for p, o in fails if p < len(sizes) and o < sizes[p]}
    for p, o in sorted(picked) * 2:  # each fail sent twice (a retried task)
        ft.fail(rangeroots.encode(numbers[p], 100 * p, [100 * p + o]), FAILED)
    if restart:
        storage.close()
        storage = LmdbStorage(path)
        ft = _layer(storage)
    _fill_all(ft)
    end = {TOPIC: {p: 100 * p + n for p, n in enumerate(sizes)}}
    completed = ft.complete_ranges([SOURCE], end)
    replayed = _replays(ft)
    assert completed == sum(sizes) - len(picked)
    assert sorted((part, off) for off, part, _ in replayed) == sorted(
        (p, 100 * p + o) for p, o in picked
    )
    assert all(payload == _bytes(off) for off, _, payload in replayed)
    assert ft.current_stats().open_ranges == 0
    storage.close()


def test_inspect_finds_a_record_pending_in_a_range_by_root_or_coordinates(
    storage: PersistenceStorage,
) -> None:
    from ftlayer.inspection import RecordQuery, RecordState

    ft = _layer(storage)
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 2, 40, 60)])
    root = int(rangeroots.encode(number, 40, [45])[0])
    by_place = ft.inspect(RecordQuery(topic=TOPIC, partition=2, offset=45))
    by_root = ft.inspect(RecordQuery(root=root))
    for found in (by_place, by_root):
        (record,) = found.records
        assert (record.state, record.root, record.offset, record.seq) == (
            RecordState.PENDING,
            root,
            45,
            0,
        )
        assert record.barrier_hold
    assert ft.inspect(RecordQuery(topic=TOPIC, partition=2, offset=60)).records == ()
    # Failed, it is a record of its own: inspect shows that one.
    ft.fail([root], FAILED)
    (record,) = ft.inspect(RecordQuery(topic=TOPIC, partition=2, offset=45)).records
    assert record.seq > 0 and record.root != root


def test_a_zero_xor_says_an_offset_is_no_record_of_its_range(storage: PersistenceStorage) -> None:
    """A record a loop fed back is read in a range but runs under its own tree's root:
    the reader's XOR of 0 for its range root leaves it out of the range's counts."""
    ft = _layer(storage)
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 0, 0, 10)])
    looped = rangeroots.encode(number, 0, [7, 8])
    ft.xor(looped, np.zeros(2, dtype=np.uint64))
    ft.xor(looped, np.zeros(2, dtype=np.uint64))  # a retried task: counted once
    assert ft.current_stats().persisted == 8 and ft.pending_by_source() == {SOURCE: 8}
    assert len(storage) == 0 and ft.current_stats().xor_events == 0
    assert ft.complete_ranges([SOURCE], {TOPIC: {0: 10}}) == 8


def test_first_failures_are_one_retry_entry_until_each_changes_or_goes(tmp_path: Path) -> None:
    """The rows one FAIL names share one retry entry (a group); a record that fails
    again gets one of its own, and the group goes with its last record; each state
    reads the same after a restart."""
    storage = LmdbStorage(tmp_path / "ft")
    ft = _layer(storage)
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 0, 0, 10)])
    assert ft.fail(rangeroots.encode(number, 0, [2, 3, 4]), FAILED) == 3
    assert storage.meta_keys("retry/") == [] and len(storage.meta_keys("retryg/")) == 1
    storage.close()
    storage = LmdbStorage(tmp_path / "ft")
    ft = _layer(storage)
    wanted = ft.unfilled(SOURCE)
    seq_of = dict(zip(wanted.records.offsets.tolist(), wanted.seqs.tolist(), strict=True))
    _fill_all(ft)
    replays = ft.fetch_replay(0, ft.replay_cursor_of(SOURCE), source_id=SOURCE)
    by_offset = dict(
        zip(replays.records.offsets.tolist(), replays.records.roots.tolist(), strict=True)
    )
    for offset in (2, 3, 4):
        record = ft.retry_record(seq_of[offset])
        assert record is not None and (record.attempts, record.last_cause) == (1, FAILED)
    # The replay of offset 3 fails again: an entry of its own, attempt 2.
    again = Cause(FailKind.EXPLICIT, "enrich", "FailException: again")
    assert ft.fail([by_offset[3]], again) == 1
    assert storage.meta_keys("retry/") == [f"retry/{seq_of[3]:016x}"]
    second = ft.retry_record(seq_of[3])
    assert second is not None and second.attempts == 2 and second.last_cause == again
    # Offsets 2 and 4 complete (their batch's barrier): the group goes with them.
    ft.release_barrier([SOURCE])
    ft.flush_deletes()
    ft.flush_staged()
    assert storage.meta_keys("retryg/") == []
    assert ft.retry_record(seq_of[2]) is None and ft.retry_record(seq_of[3]) is not None
    storage.close()
    storage = LmdbStorage(tmp_path / "ft")
    ft = _layer(storage)
    assert ft.retry_record(seq_of[2]) is None
    restored = ft.retry_record(seq_of[3])
    assert restored is not None and restored.attempts == 2
    storage.close()


def test_a_barrier_s_completed_replays_leave_the_store_with_the_next_batch_s_ranges(
    tmp_path: Path,
) -> None:
    """A server's barrier stages the deletes of the few stored records it completed
    (a batch's replays): they ride on the next batch's BATCH_RANGES commit, so its
    deleter needs no transaction of its own."""
    storage = LmdbStorage(tmp_path / "ft")
    ft = FTLayer(storage, timeout_s=30, clock=Clock(), wall_clock=Clock(1000.0), seed=1,
                 defer_deletes=True)  # fmt: skip
    ft.register_source(SourceRegistration(SOURCE, "forward", 4, completion="barrier"))
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 0, 0, 10)])
    ft.fail(rangeroots.encode(number, 0, [2, 7]), FAILED)
    _fill_all(ft)
    assert ft.complete_ranges([SOURCE], {TOPIC: {0: 10}}) == 8
    ft.batch_began([SOURCE])  # the next batch takes the replays in
    assert len(_replays(ft)) == 2 and len(storage) == 2
    ft.release_barrier([SOURCE])  # its barrier completes them
    ft.complete_ranges([SOURCE], {TOPIC: {0: 10}})
    assert ft.persistence.marked == 0  # nothing for a deleter
    assert len(ft) == 0 and len(storage) == 2  # staged, not committed yet
    ft.register_ranges([(SOURCE, TOPIC, 0, 10, 20)])
    assert len(storage) == 0
    storage.close()
