"""The records of queued replays kept in memory (ftlayer.core.replay.QueuedRecords): a
reader that fetches replays gets the records the store holds, whether they come from
memory or from the store, across fills, second failures, prunes, a full memory and
a restart."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from manual_clock import Clock

from ftlayer.acking.ids import new_ids
from ftlayer.causes import Cause, FailKind
from ftlayer.core import FTLayer, replay
from ftlayer.core.replay import QueuedRecords
from ftlayer.core.retries import RetryPolicy
from ftlayer.persistence import LmdbStorage, MemoryStorage, PersistenceStorage
from ftlayer.records import KEY_UNKNOWN, RecordBatch, ReplayRecords
from ftlayer.registration import SourceRegistration

SOURCE = 5
FAILED = Cause(FailKind.EXPLICIT, "enrich", "FailException: no")


def _layer(storage: PersistenceStorage) -> FTLayer:
    ft = FTLayer(storage, timeout_s=30, clock=Clock(), wall_clock=Clock(1000.0), seed=3)
    ft.register_source(SourceRegistration(SOURCE, "forward", 2, retry=RetryPolicy(100, 0, 0)))
    return ft


def _by_reference(n: int, first_offset: int, *, keyed: bool = False) -> RecordBatch:
    """Records stored by reference, their keys unknown (as a batch range's), or
    `keyed` as the source's driver knows them (queued before their bytes come)."""
    offsets = np.arange(first_offset, first_offset + n)
    return RecordBatch.build(
        new_ids(n),
        [b""] * n,
        source_ids=SOURCE,
        topics="orders",
        partitions=np.arange(n) % 2,
        offsets=offsets,
        key_hashes=offsets * 7 + 1 if keyed else np.full(n, KEY_UNKNOWN, np.int64),
        has_key=np.full(n, keyed),
        references=True,
    )


def _source_bytes(offset: int) -> bytes:
    return b"record-at-%d" % offset


def _fill_all(ft: FTLayer) -> None:
    """The source's driver: every unfilled record's bytes, keyed by its offset."""
    wanted = ft.unfilled(SOURCE)
    offsets = wanted.records.offsets
    found = np.ones(len(offsets), np.bool_)
    keys = (offsets * 7 + 1, found)
    ft.fill(wanted.seqs, [_source_bytes(o) for o in offsets.tolist()], found, keys)


def _check_replays(got: ReplayRecords) -> None:
    """Each replay is its record, as the source holds it and as the fill keyed it."""
    records = got.records
    offsets = records.offsets.tolist()
    assert list(records.payloads) == [_source_bytes(o) for o in offsets]
    assert not records.reference_mask.any()
    assert records.key_hashes.tolist() == [o * 7 + 1 for o in offsets]
    assert records.has_key.all()
    assert set(records.topics) <= {"orders"}
    assert (records.source_ids == SOURCE).all()
    assert records.partitions.tolist() == [o % 2 for o in (np.array(offsets) - 100).tolist()]


@settings(max_examples=30, deadline=None)
@given(
    rounds=st.lists(
        st.tuples(
            st.lists(st.integers(0, 9), max_size=10),  # new records that fail
            st.lists(st.integers(0, 40), max_size=6),  # replays that fail again
            st.booleans(),  # the round's batch is checkpointed (its replays pruned)
        ),
        min_size=1,
        max_size=5,
    ),
    kept=st.sampled_from([1, 3, 250_000]),
)
def test_fetched_replays_are_their_stored_records(
    rounds: list[tuple[list[int], list[int], bool]], kept: int
) -> None:
    """Rounds of a batch: new records fail, the source fills their bytes in, a reader
    fetches the replays, some of which fail again (read back from the store, then
    queued again), and maybe the batch's checkpoint prunes what it took in. Every
    fetch returns exactly the queued replays of its range, each its own record, as
    the store has it, however few records memory keeps."""
    patch = pytest.MonkeyPatch()
    patch.setattr(replay, "KEPT_RECORDS", kept)
    try:
        ft = _layer(MemoryStorage())
        cursor, offset = 0, 100
        queued: list[int] = []  # offsets of the live replays since the last prune
        for fresh, again, prune in rounds:
            batch = _by_reference(10, offset)
            ids = new_ids(10)
            ft.persist(batch, ids)
            failing = sorted(set(fresh))
            ft.fail(batch.roots[failing], FAILED)
            done = [i for i in range(10) if i not in failing]
            ft.xor(batch.roots[done], ids[done])
            queued += [offset + i for i in failing]
            _fill_all(ft)
            hi = ft.replay_cursor_of(SOURCE)
            got = ft.fetch_replay(cursor, hi, source_id=SOURCE)
            _check_replays(got)
            assert sorted(got.records.offsets.tolist()) == sorted(queued)
            n = len(got.records)
            retried = sorted({i % n for i in again}) if n else []
            if retried:  # failed again: pending under new roots, queued again
                ft.fail(got.records.roots[retried], FAILED)
                refetched = ft.fetch_replay(hi, ft.replay_cursor_of(SOURCE), source_id=SOURCE)
                _check_replays(refetched)
                assert sorted(refetched.records.offsets.tolist()) == sorted(
                    got.records.offsets[retried].tolist()
                )
            # A re-run of the batch fetches the same range again: the same records,
            # but those that failed again.
            rerun = ft.fetch_replay(cursor, hi, source_id=SOURCE)
            _check_replays(rerun)
            still = np.delete(got.records.offsets, retried)
            assert sorted(rerun.records.offsets.tolist()) == sorted(still.tolist())
            if prune:
                ft.prune_replay(hi, SOURCE)
                cursor = hi
                queued = got.records.offsets[retried].tolist()
            offset += 10
    finally:
        patch.undo()


def test_memory_keeps_at_most_its_bounds_the_oldest_going_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(replay, "KEPT_RECORDS", 5)
    kept = QueuedRecords()
    for first in (10, 20, 30):
        seqs = np.arange(first, first + 3, dtype=np.uint64)
        records = RecordBatch.build(seqs, [b"p%d" % s for s in seqs.tolist()], source_ids=1)
        kept.add(seqs, records, np.arange(first, first + 3, dtype=np.uint64))
    assert len(kept) == 3  # two appends of three pass five: the older one goes
    assert kept.get(np.array([10], np.uint64)) is None
    assert kept.get(np.array([32, 20], np.uint64)) is None  # all or nothing
    got = kept.get(np.array([32, 30, 31, 30], np.uint64))
    assert got is not None and list(got.payloads) == [b"p32", b"p30", b"p31", b"p30"]
    kept.prune(31, None)  # not every entry of the append: it stays
    assert len(kept) == 3
    kept.prune(32, 2)  # another source's prune
    assert len(kept) == 3
    kept.prune(32, 1)
    assert len(kept) == 0 and kept.get(np.array([30], np.uint64)) is None


def test_records_stored_by_reference_are_read_from_the_store(tmp_path: Path) -> None:
    """A replay fetched before its source filled its bytes in comes from the store (as
    a reference); fetched again after the fill, with its bytes; and after a restart,
    with nothing in memory, from the store with its bytes."""
    storage = LmdbStorage(tmp_path / "ft")
    ft = _layer(storage)
    batch = _by_reference(4, 100, keyed=True)
    ft.persist(batch)
    ft.fail(batch.roots[[0, 2]], FAILED)
    first = ft.fetch_replay(0, ft.replay_cursor_of(SOURCE), source_id=SOURCE)
    assert first.records.reference_mask.all() and list(first.records.payloads) == [b"", b""]
    _fill_all(ft)
    again = ft.fetch_replay(0, ft.replay_cursor_of(SOURCE), source_id=SOURCE)
    _check_replays(again)
    storage.close()
    storage = LmdbStorage(tmp_path / "ft")
    ft = _layer(storage)
    restarted = ft.fetch_replay(0, ft.replay_cursor_of(SOURCE), source_id=SOURCE).records
    filled = np.flatnonzero(~restarted.reference_mask)
    assert restarted.offsets[filled].tolist() == [100, 102]
    assert [restarted.payloads[i] for i in filled] == [b"record-at-100", b"record-at-102"]
    # The two never completed: the restart failed them, and they wait for their bytes.
    assert restarted.offsets[restarted.reference_mask].tolist() == [101, 103]
    storage.close()
