"""FTLayer: completion, explicit and timeout failures, replay, recovery, bad input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from manual_clock import Clock

from ftlayer.acking.ids import new_ids
from ftlayer.core import FailCause, FTLayer, RetiredRoots, SourceConfig
from ftlayer.core.queries import _min_per_partition
from ftlayer.errors import (
    ConfigError,
    NotAnLmdbEnvironment,
    PartitioningError,
    StateConflict,
    StorageError,
)
from ftlayer.partitioners import create_partitioner, kafka_key_hashes
from ftlayer.persistence import Completed, LmdbStorage, MemoryStorage, PersistenceStorage
from ftlayer.records import RecordBatch
from ftlayer.registration import SourceRegistration


def _records(
    n: int, *, keyed: bool = True, partitions: int = 4, first_offset: int = 100
) -> RecordBatch:
    keys = [f"user-{i}".encode() for i in range(n)]
    hashes, has_key = kafka_key_hashes(keys)
    return RecordBatch.build(
        new_ids(n),
        [b"payload-%d" % i for i in range(n)],
        key_hashes=hashes if keyed else None,
        has_key=has_key if keyed else None,
        topics="orders",
        partitions=np.arange(n) % partitions,
        offsets=np.arange(first_offset, first_offset + n),
    )


def _emit(ft: FTLayer, batch: RecordBatch) -> np.ndarray:
    """Persist with the emission ids as first ack values; returns those ids."""
    ids = new_ids(len(batch))
    ft.persist(batch, ids)
    return ids


def test_tree_completes_and_its_record_is_deleted(storage: PersistenceStorage) -> None:
    ft = FTLayer(storage, timeout_s=30)
    seen: list[Completed] = []
    ft.add_completion_listener(seen.append)
    batch = _records(5)
    ids = _emit(ft, batch)
    assert len(storage) == 5 and len(ft) == 5
    # Each record is processed by one task that emits one child; the child is acked.
    child = new_ids(5)
    ft.xor(batch.roots, ids ^ child)
    assert len(storage) == 5 and not seen  # the children are still in flight
    ft.xor(batch.roots[:3], child[:3])
    assert len(storage) == 2
    # Completions come in no particular order, each with its own coordinates.
    assert len(seen) == 1
    done = sorted(
        zip(seen[0].offsets.tolist(), seen[0].partitions.tolist(), seen[0].topics, strict=True)
    )
    assert done == [(100, 0, "orders"), (101, 1, "orders"), (102, 2, "orders")]
    ft.xor(batch.roots[3:], child[3:])
    assert len(storage) == 0 and len(ft) == 0
    stats = ft.current_stats()
    assert (stats.persisted, stats.completed, stats.pending) == (5, 5, 0)


def test_explicit_fail_replays_the_same_bytes_under_a_new_root(
    storage: PersistenceStorage,
) -> None:
    ft = FTLayer(storage, default_source=SourceConfig.named("kafka-hash", 4))
    batch = _records(4)
    ids = _emit(ft, batch)
    assert ft.fail(batch.roots[[1]]) == 1
    replay = ft.fetch_replay(0, ft.replay_cursor)
    assert replay.replay_seqs.tolist() == [1]
    assert replay.records.payloads == [b"payload-1"]
    assert replay.records.offsets.tolist() == [101]
    new_root = int(replay.records.roots[0])
    assert new_root != int(batch.roots[1]) and new_root in ft.acker
    assert ft.retries(new_root) == 1
    # Late events of the failed tree are dropped and counted, never re-created.
    ft.xor(batch.roots[[1]], ids[[1]])
    assert int(batch.roots[1]) not in ft.acker
    assert ft.current_stats().late_events == 1
    # The replayed record is emitted again under its new root and completes.
    emit_id = int(new_ids(1)[0])
    ft.xor_one(new_root, emit_id)
    assert ft.xor_one(new_root, emit_id) is True
    assert len(storage) == 3
    assert ft.current_stats().failed[FailCause.EXPLICIT.value] == 1


def test_timeout_fails_a_silent_tree_within_the_bound(storage: PersistenceStorage) -> None:
    clock = Clock()
    ft = FTLayer(storage, timeout_s=10, buckets=3, clock=clock)
    batch = _records(2)
    ids = _emit(ft, batch)
    ft.xor(batch.roots[:1], ids[:1])  # record 0 completes, record 1 is dropped silently
    for t in np.arange(0.5, 20.0, 0.5):
        clock.now = float(t)
        ft.tick()
        if ft.replay_cursor:
            break
    # Timeout T = 10 s with 3 buckets: between 10 s and 15 s (plus one tick of 0.5 s).
    assert 10.0 <= clock.now <= 15.5
    replay = ft.fetch_replay(0, ft.replay_cursor)
    assert replay.records.offsets.tolist() == [101]
    assert ft.current_stats().failed[FailCause.TIMEOUT.value] == 1
    assert len(storage) == 1


def test_a_completed_roots_old_timeout_never_fails_its_new_tree(
    storage: PersistenceStorage,
) -> None:
    """A root persisted again after its tree completed is a new tree: the first tree's
    timeout entry, still in the buckets, must not fail it before its own T."""
    clock = Clock()
    ft = FTLayer(storage, timeout_s=10, buckets=3, clock=clock)
    first = _records(1)
    ids = _emit(ft, first)
    ft.xor(first.roots, ids)  # complete at t = 0
    clock.now = 9.0
    again = RecordBatch.build(first.roots, [b"again"], topics="orders", partitions=0, offsets=5)
    _emit(ft, again)  # the same root, a new tree, at t = 9
    for t in np.arange(9.5, 19.0, 0.5):  # the first tree's entry expires by t = 15
        clock.now = float(t)
        ft.tick()
    assert ft.replay_cursor == 0 and int(first.roots[0]) in ft.acker
    for t in np.arange(19.0, 25.0, 0.5):  # the new tree's own T: between 19 and 24
        clock.now = float(t)
        ft.tick()
    assert ft.current_stats().failed[FailCause.TIMEOUT.value] == 1
    assert ft.fetch_replay(0, ft.replay_cursor).records.payloads == [b"again"]


def test_a_replay_waiting_to_be_read_never_times_out_and_times_out_once_fetched(
    storage: PersistenceStorage,
) -> None:
    """A stalled or stopped query leaves its replays in the queue: they must not time
    out (and be requeued, again and again) merely because nobody read them. Once a
    source fetches them their timeout runs; a range fetched twice (a batch Spark runs
    again) times each record out once, from the second fetch: that one gave the
    records fresh roots (ftlayer.core.takeover)."""
    clock = Clock()
    ft = FTLayer(storage, timeout_s=10, buckets=3, clock=clock)
    batch = _records(4)
    _emit(ft, batch)
    ft.fail(batch.roots)
    for t in np.arange(0.5, 100.0, 0.5):  # ten timeouts long, unread
        clock.now = float(t)
        ft.tick()
    stats = ft.current_stats()
    assert stats.failed == {"explicit": 4, "timeout": 0, "recovery": 0, "source-expired": 0}
    assert stats.pending == 4 and ft.replay_cursor == 4
    first = ft.fetch_replay(0, ft.replay_cursor)  # read at t = 99.5
    clock.now = 101.0
    again = ft.fetch_replay(0, ft.replay_cursor)  # read again, at t = 101
    assert again.records.offsets.tolist() == first.records.offsets.tolist()
    assert not set(again.records.roots.tolist()) & set(first.records.roots.tolist())
    for t in np.arange(101.5, 116.5, 0.5):  # expired by 101 + 15 s
        clock.now = float(t)
        ft.tick()
    stats = ft.current_stats()
    assert stats.failed["timeout"] == 4 and stats.pending == 4 and ft.replay_cursor == 8
    assert stats.taken_over == 4


def test_pending_roots_are_counted_per_source_even_when_two_sources_read_one_topic(
    storage: PersistenceStorage,
) -> None:
    ft = FTLayer(storage, default_source=SourceConfig.named("forward", 4))
    a = RecordBatch.build(
        new_ids(5), [b"a"] * 5, source_ids=1, topics="orders", partitions=0, offsets=np.arange(5)
    )
    b = RecordBatch.build(
        new_ids(3), [b"b"] * 3, source_ids=2, topics="orders", partitions=0, offsets=[7, 2, 9]
    )
    ids_a, _ids_b = _emit(ft, a), _emit(ft, b)
    assert ft.pending_by_source() == {1: 5, 2: 3}
    # Completion takes a tree out; a failed record waiting as a replay still counts.
    ft.xor(a.roots[:2], ids_a[:2])
    ft.fail(a.roots[2:4])
    assert ft.pending_by_source() == {1: 3, 2: 3}
    assert len(ft.fetch_replay(0, ft.replay_cursor, source_id=1)) == 2
    # One topic read by both: its lowest pending offset is over both sources.
    assert ft.lowest_pending_offsets(["orders"]) == {"orders": {0: 2}}
    ft.xor(a.roots[4:], ids_a[4:])
    assert ft.pending_by_source() == {1: 2, 2: 3}
    assert ft.current_stats().pending == 5


def test_a_root_that_failed_recently_cannot_be_persisted_again(
    storage: PersistenceStorage,
) -> None:
    clock = Clock()
    ft = FTLayer(storage, timeout_s=10, clock=clock)  # failed roots are known for 2T
    batch = _records(3)
    _emit(ft, batch)
    assert ft.fail(batch.roots[[1]]) == 1
    clock.now = 19.0
    reuse = _records(2, first_offset=200).with_roots(
        np.array([new_ids(1)[0], batch.roots[1]], np.uint64)
    )
    with pytest.raises(StateConflict, match="repeated root"):
        ft.persist(reuse)
    assert len(storage) == 3 and len(ft) == 3  # nothing stored, nothing pending
    clock.now = 31.0  # past 2T * 1.5: forgotten
    ft.persist(reuse)
    assert len(ft) == 5


def test_retired_roots_are_known_between_ttl_and_ttl_times_one_and_a_half() -> None:
    retired = RetiredRoots(10.0, start=0.0)
    roots = new_ids(1000)
    retired.add(roots[:500], now=1.0)
    retired.add(roots[500:], now=6.0)
    assert retired.known(roots, now=14.9).all()  # each known for at least 10 s
    assert not retired.known(new_ids(1000), now=14.9).any()
    assert retired.known(roots, now=15.0)[500:].all()  # at most 15 s: the first half is gone
    assert not retired.known(roots, now=15.0)[:500].any()
    assert not retired.known(roots, now=20.0).any() and len(retired) == 0


def test_fetch_replay_is_repeatable_until_the_replay_completes() -> None:
    """The same range gives the same records; fetched again (a re-run) under fresh
    roots, so the earlier run's emission and events cannot hold the new tree."""
    ft = FTLayer(MemoryStorage(), default_source=SourceConfig.named("forward", 4))
    batch = _records(6)
    _emit(ft, batch)
    ft.fail(batch.roots[[0, 2, 5]])
    first = ft.fetch_replay(0, 3)
    again = ft.fetch_replay(0, 3)
    assert first.replay_seqs.tolist() == again.replay_seqs.tolist() == [1, 2, 3]
    assert first.records.offsets.tolist() == again.records.offsets.tolist()
    assert not set(first.records.roots.tolist()) & set(again.records.roots.tolist())
    assert first.partitions.tolist() == [0, 2, 1]  # forward: the original partitions
    assert ft.fetch_replay(1, 2).records.offsets.tolist() == [102]
    assert ft.fetch_replay(0, 3, partition=1).records.offsets.tolist() == [105]
    latest = ft.fetch_replay(0, 3)
    assert len(ft) == 6 and ft.current_stats().taken_over == 3 + 1 + 1 + 3
    emit = int(new_ids(1)[0])
    ft.xor_one(int(latest.records.roots[0]), emit)
    ft.xor_one(int(latest.records.roots[0]), emit)
    assert ft.fetch_replay(0, 3).records.offsets.tolist() == [102, 105]
    assert ft.prune_replay(2) == 2
    with pytest.raises(StateConflict, match="pruned"):
        ft.fetch_replay(0, 3)
    assert ft.fetch_replay(2, 3).records.offsets.tolist() == [105]


def test_pruning_one_source_keeps_the_other_sources_replays() -> None:
    ft = FTLayer(MemoryStorage(), default_source=SourceConfig.named("forward", 4))
    a = _records(4)
    b = RecordBatch.build(
        new_ids(4), [b"b"] * 4, source_ids=9, topics="other", partitions=0, offsets=None
    )
    _emit(ft, a)
    _emit(ft, b)
    ft.fail(a.roots[:2])  # replay seqs 1, 2 (source 0)
    ft.fail(b.roots[:2])  # replay seqs 3, 4 (source 9)
    assert ft.current_stats().replay_queue == 4
    assert ft.prune_replay(4, source_id=0) == 2  # source 0's two; source 9's stay
    assert ft.current_stats().replay_queue == 2
    assert len(ft.fetch_replay(0, 4, source_id=9)) == 2  # below 0's pruned point: fine
    with pytest.raises(StateConflict, match="of source 0 starts before its pruned point 4"):
        ft.fetch_replay(0, 4, source_id=0)
    assert ft.prune_replay(4) == 2  # every source
    assert ft.current_stats().replay_queue == 0


def test_broadcast_replays_to_every_partition() -> None:
    ft = FTLayer(MemoryStorage(), default_source=SourceConfig.named("broadcast", 3))
    batch = _records(2)
    _emit(ft, batch)
    ft.fail(batch.roots[[1]])
    replay = ft.fetch_replay(0, ft.replay_cursor)
    assert replay.partitions.tolist() == [0, 1, 2]
    assert replay.replay_seqs.tolist() == [1, 1, 1]
    assert set(replay.records.roots.tolist()) == {int(replay.records.roots[0])}


def test_recovery_replays_every_record_pending_at_the_crash(tmp_path: Path) -> None:
    store = LmdbStorage(tmp_path / "ft")
    ft = FTLayer(store)
    batch = _records(10)
    ids = _emit(ft, batch)
    ft.xor(batch.roots[:4], ids[:4])  # 4 complete before the crash
    ft.fail(batch.roots[[4]])  # 1 is already queued for replay
    cursor_before = ft.replay_cursor
    store.close()  # the process is gone; its acker table with it

    store = LmdbStorage(tmp_path / "ft")
    recovered = FTLayer(store)
    stats = recovered.current_stats()
    assert stats.failed[FailCause.RECOVERY.value] == 6 and stats.pending == 6
    replay = recovered.fetch_replay(cursor_before, recovered.replay_cursor)
    assert sorted(replay.records.offsets.tolist()) == list(range(104, 110))
    assert replay.replay_seqs.min() > cursor_before  # replay seqs are never reused
    assert len(store) == 6
    store.close()


def test_persist_refuses_bad_batches_and_writes_nothing(storage: PersistenceStorage) -> None:
    ft = FTLayer(storage, default_source=SourceConfig.named("kafka-hash", 4))
    ok = _records(3)
    _emit(ft, ok)
    with pytest.raises(StateConflict, match="already"):
        ft.persist(ok.take(np.array([0])))
    with pytest.raises(PartitioningError, match="no key"):
        ft.persist(_records(3, keyed=False))
    reserved = _records(2).with_roots(np.array([5, 0], dtype=np.uint64))
    with pytest.raises(ConfigError, match="reserved"):
        ft.persist(reserved)
    assert len(storage) == 3 and len(ft) == 3


def test_a_storage_failure_leaves_no_pending_root(storage: PersistenceStorage) -> None:
    ft = FTLayer(storage)
    storage.close()
    batch = _records(2)
    with pytest.raises(StorageError):
        ft.persist(batch)
    assert len(ft) == 0 and ft.current_stats().persisted == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"timeout_s": 0}, "timeout must be a positive"),
        ({"timeout_s": -5.0}, "timeout must be a positive"),
        ({"timeout_s": float("inf")}, "timeout must be a positive, finite"),
        ({"buckets": 1}, "at least 2 buckets"),
    ],
)
def test_bad_timeouts_are_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        FTLayer(MemoryStorage(), **kwargs)  # type: ignore[arg-type]


def test_registered_sources_route_recovered_records_after_a_restart(tmp_path: Path) -> None:
    # Keys whose murmur2 partition out of 4 differs from the partition the record came
    # from: the recovered replay must follow the registered partitioner, not forward.
    storage = LmdbStorage(tmp_path / "db")
    ft = FTLayer(storage)
    ft.register_source(SourceRegistration(0, "kafka-hash", 4))
    batch = _records(40)
    ft.persist(batch, new_ids(len(batch)))
    storage.close()

    storage = LmdbStorage(tmp_path / "db")
    try:
        restarted = FTLayer(storage)
        replay = restarted.fetch_replay(0, 2**63)
        expected = create_partitioner("kafka-hash").targets(replay.records, 4)[1]
        assert len(replay) == len(batch)
        assert replay.partitions.tolist() == expected.tolist()
        assert replay.partitions.tolist() != replay.records.partitions.tolist()
    finally:
        storage.close()


def test_a_bad_registration_changes_nothing(storage: PersistenceStorage) -> None:
    ft = FTLayer(storage)
    ft.register_source(SourceRegistration(3, "forward", 2))
    with pytest.raises(ConfigError, match="does not take options"):
        ft.register_source(SourceRegistration(3, "forward", 2, {"colour": "red"}))
    with pytest.raises(PartitioningError, match="unknown replay partitioner"):
        ft.register_source(SourceRegistration(3, "nope", 2))
    with pytest.raises(ConfigError, match="at least 1 partition"):
        ft.register_source(SourceRegistration(3, "forward", 0))
    for layer in (ft, FTLayer(storage)):  # also as stored, for a restarted FT layer
        config = layer.source_config(3)
        assert config is not None
        assert (config.partitioner.name, config.num_partitions) == ("forward", 2)


def test_a_key_group_source_with_more_partitions_than_key_groups_persists_nothing() -> None:
    """Such a record could never be replayed: refused when persisted, not when it fails."""
    ft = FTLayer(
        MemoryStorage(), default_source=SourceConfig.named("key-group", 8, max_parallelism=4)
    )
    with pytest.raises(ConfigError, match="exceeds max_parallelism"):
        ft.persist(_records(2))
    assert len(ft) == 0 and len(ft.storage) == 0


def test_unknown_partitioner_is_refused() -> None:
    with pytest.raises(PartitioningError, match="unknown replay partitioner"):
        SourceConfig.named("fields-by-magic", 4)


def test_a_directory_that_is_not_lmdb_is_refused_untouched(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(NotAnLmdbEnvironment, match=str(tmp_path)):
        LmdbStorage(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


class RefusingStorage(MemoryStorage):
    """A storage whose writes can be made to fail, as a full disk would."""

    refuse = False

    def set_roots(self, *args: object, **kwargs: object) -> None:  # type: ignore[override]
        if self.refuse:
            raise StorageError("disk full")
        super().set_roots(*args, **kwargs)  # type: ignore[arg-type]


def test_a_failure_that_cannot_be_queued_stays_pending_and_times_out_later() -> None:
    clock = Clock()
    storage = RefusingStorage()
    ft = FTLayer(storage, timeout_s=10, buckets=2, clock=clock)
    batch = _records(1)
    _emit(ft, batch)
    storage.refuse = True
    with pytest.raises(StorageError, match="disk full"):
        ft.fail(batch.roots)
    assert int(batch.roots[0]) in ft.acker  # not lost: still pending
    clock.now = 10.0
    ft.tick()  # 2 buckets, T = 10 s: the root expires at the second rotation
    clock.now = 20.0
    with pytest.raises(StorageError, match="disk full"):
        ft.tick()  # the timeout tries again, and is set up to try once more
    storage.refuse = False
    for now in (30.0, 40.0):
        clock.now = now
        ft.tick()
    replay = ft.fetch_replay(0, ft.replay_cursor)
    assert replay.records.payloads == [b"payload-0"] and len(storage) == 1


def test_every_listener_hears_of_a_completion_even_if_one_raises() -> None:
    ft = FTLayer(MemoryStorage())
    heard: list[int] = []

    def broken(done: Completed) -> None:
        raise RuntimeError("commit failed")

    ft.add_completion_listener(broken)
    ft.add_completion_listener(lambda done: heard.extend(done.offsets.tolist()))
    batch = _records(1)
    ids = _emit(ft, batch)
    with pytest.raises(RuntimeError, match="commit failed"):
        ft.xor(batch.roots, ids)
    assert heard == [100] and len(ft.storage) == 0


def test_deferred_deletes_leave_completed_records_until_flushed(tmp_path: Path) -> None:
    storage = LmdbStorage(tmp_path / "db")
    try:
        ft = FTLayer(storage, defer_deletes=True)
        batch = _records(6)
        ids = _emit(ft, batch)
        ft.xor(batch.roots[:4], ids[:4])
        assert ft.stats.completed == 4 and len(ft) == 2
        assert len(storage) == 6 and ft.persistence.marked == 4
        assert ft.flush_deletes() == 4
        assert len(storage) == 2 and ft.persistence.marked == 0
        # What a crash leaves marked is recovered and replayed: a duplicate, not a loss.
        ft.xor(batch.roots[4:5], ids[4:5])
        assert len(storage) == 2
        recovered = FTLayer(storage).fetch_replay(0, 2**63)
        assert sorted(recovered.records.payloads) == sorted(batch.payloads[4:])
    finally:
        storage.close()


def test_deferred_deletes_ride_on_the_next_persist(tmp_path: Path) -> None:
    """The records completed since the last persist are deleted in the next persist's
    transaction (one commit for both), and only completed ones."""
    with LmdbStorage(tmp_path / "db") as storage:
        ft = FTLayer(storage, defer_deletes=True)
        first = _records(6)
        ids = _emit(ft, first)
        ft.xor(first.roots[:4], ids[:4])
        assert len(storage) == 6 and ft.persistence.marked == 4
        second = RecordBatch.build(new_ids(3), [b"later"] * 3, topics="orders")
        ft.persist(second)
        assert ft.persistence.marked == 0
        assert len(storage) == 2 + 3  # the 4 completed went with the persist
        pending = ft.fetch_replay(0, 2**63)  # nothing failed: no replays
        assert len(pending) == 0
        ft.fail(np.concatenate([first.roots[4:], second.roots]))
        replayed = ft.fetch_replay(0, 2**63)
        assert sorted(replayed.records.payloads) == sorted(first.payloads[4:] + [b"later"] * 3)


def test_lowest_pending_offsets_never_pass_an_incomplete_record(
    storage: PersistenceStorage,
) -> None:
    ft = FTLayer(storage)
    orders = _records(12)  # partitions i % 4, offsets 100 + i
    other = RecordBatch.build(
        new_ids(3), [b"x", b"y", b"z"], topics="clicks", partitions=0, offsets=[7, 5, 9]
    )
    ids, other_ids = _emit(ft, orders), _emit(ft, other)
    assert ft.lowest_pending_offsets() == {
        "orders": {0: 100, 1: 101, 2: 102, 3: 103},
        "clicks": {0: 5},
    }
    # Complete partition 0's first record and partition 1 entirely; fail one in 2.
    done = np.array([0, 1, 5, 9])
    ft.xor(orders.roots[done], ids[done])
    ft.xor(other.roots[1:2], other_ids[1:2])
    ft.fail(orders.roots[2:3])  # replayed under a new root, still pending at offset 102
    assert ft.lowest_pending_offsets(["orders"]) == {"orders": {0: 104, 2: 102, 3: 103}}
    assert ft.lowest_pending_offsets(["clicks", "unknown"]) == {"clicks": {0: 7}}
    ft.xor(orders.roots[[4, 8]], ids[[4, 8]])
    assert 0 not in ft.lowest_pending_offsets()["orders"]


@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.integers(0, 3),
            st.one_of(st.integers(0, 40), st.integers(0, 2**31 - 1)),  # small, or sorted
            st.integers(0, 2**62),
        ),
        min_size=1,
        max_size=60,
    )
)
def test_min_per_partition_is_the_minimum_of_each_topic_and_partition(
    rows: list[tuple[int, int, int]],
) -> None:
    """Against a dict: one topic or several, a dense table or (huge partitions) a sort."""
    topics, partitions, values = (np.array(c) for c in zip(*rows, strict=True))
    found = _min_per_partition(
        topics.astype(np.uint32), partitions.astype(np.int32), values.astype(np.int64)
    )
    model: dict[tuple[int, int], int] = {}
    for t, p, v in rows:
        model[t, p] = min(v, model.get((t, p), v))
    got = {(int(t), int(p)): int(v) for t, p, v in zip(*found, strict=True)}
    assert got == model and len(found[0]) == len(model)


def test_a_source_with_its_own_timeout_times_out_on_its_own_clock(tmp_path: Path) -> None:
    clock = Clock()
    storage = LmdbStorage(tmp_path / "db")
    try:
        ft = FTLayer(storage, timeout_s=100.0, buckets=3, clock=clock)
        ft.register_source(SourceRegistration(7, "forward", 4, timeout_s=4.0))
        quick = RecordBatch.build(
            new_ids(3), [b"q"] * 3, source_ids=7, topics="t", partitions=0, offsets=None
        )
        slow = _records(3)  # source 0: the FT layer's 100 s
        _emit(ft, quick)
        _emit(ft, slow)
        for now in np.arange(0.5, 6.5, 0.5):  # 4 s * (1 + 1/2) = 6 s at most
            clock.now = float(now)
            ft.tick()
            if now < 4.0:
                assert ft.stats.failed["timeout"] == 0
        assert ft.stats.failed["timeout"] == 3  # the quick source's three, only
        assert all(int(r) in ft.acker for r in slow.roots)
        # The replays keep their source's timeout, counted from their fetch; the
        # registration survives a restart.
        for now in np.arange(6.5, 13.0, 0.5):  # not fetched: not timed
            clock.now = float(now)
            ft.tick()
        assert ft.stats.failed["timeout"] == 3
        assert len(ft.fetch_replay(0, ft.replay_cursor, source_id=7)) == 3  # at 12.5 s
        for now in np.arange(13.0, 19.0, 0.5):  # expired by 12.5 + 6 s
            clock.now = float(now)
            ft.tick()
        assert ft.stats.failed["timeout"] == 6
        config = FTLayer(storage, timeout_s=100.0, clock=clock).source_config(7)
        assert config is not None and config.timeout_s == 4.0
        with pytest.raises(ConfigError, match="timeout"):
            ft.register_source(SourceRegistration(8, "forward", 1, timeout_s=0.0))
    finally:
        storage.close()


def test_each_source_has_its_own_replay_cursor_that_never_goes_back(tmp_path: Path) -> None:
    storage = LmdbStorage(tmp_path / "db")
    try:
        ft = FTLayer(storage, default_source=SourceConfig.named("forward", 4))
        a = _records(4)
        b = RecordBatch.build(
            new_ids(4), [b"b"] * 4, source_ids=9, topics="other", partitions=0, offsets=None
        )
        _emit(ft, a)
        _emit(ft, b)
        assert ft.replay_cursor_of(0) == ft.replay_cursor_of(9) == 0
        ft.fail(a.roots[:3])  # seqs 1..3, source 0
        assert (ft.replay_cursor_of(0), ft.replay_cursor_of(9)) == (3, 0)
        ft.fail(b.roots[:1])  # seq 4, source 9
        assert (ft.replay_cursor_of(0), ft.replay_cursor_of(9), ft.replay_cursor) == (3, 4, 4)
        stats = ft.current_stats()
        assert stats.replay_cursors == {"0": 3, "9": 4} and stats.replay_cursor_at_start == 0
    finally:
        storage.close()
    # After a restart every source starts from the global cursor, which is never behind
    # what a source reported; the recovered records move their sources' cursors on.
    storage = LmdbStorage(tmp_path / "db")
    try:
        restarted = FTLayer(storage, default_source=SourceConfig.named("forward", 4))
        assert restarted.replay_cursor_of(77) == 4  # a source with nothing since the start
        assert restarted.replay_cursor_of(0) > 4 and restarted.replay_cursor_of(9) > 4
        replay = restarted.fetch_replay(4, restarted.replay_cursor_of(9), source_id=9)
        assert len(replay) == 4  # all of source 9's stored records, recovered
    finally:
        storage.close()
