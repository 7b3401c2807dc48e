"""Barrier checkpoints (ftlayer.checkpoint): aligned and unaligned completion, pruning,
group offsets, the acker journal's base written at a barrier where one is due, failed
writes, recovery after a kill, and what a restarted FT layer knows of them.

Real LMDB and a real journal on disk throughout; batches carry Kafka coordinates
(topic "orders", partition i % 2, offset i) so positions mean what they mean in a
Spark job.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlayer.acking.ids import new_ids
from ftlayer.checkpoint import (
    CHECKPOINT_PREFIX,
    SNAPSHOT_PREFIX,
    CheckpointCoordinator,
    CheckpointMode,
    CheckpointState,
    decode_snapshot,
    encode_snapshot,
)
from ftlayer.core import FTLayer, recovery
from ftlayer.core.journal import Journal
from ftlayer.errors import ConfigError, CorruptData, PositionError, StorageError
from ftlayer.persistence import LmdbStorage, MemoryStorage
from ftlayer.records import RecordBatch

ALIGNED, UNALIGNED = CheckpointMode.ALIGNED, CheckpointMode.UNALIGNED
SOURCES = [7]


@pytest.fixture
def storage(tmp_path: Path) -> Iterator[LmdbStorage]:
    with LmdbStorage(tmp_path / "ft") as store:
        yield store


@pytest.fixture
def base_at_every_barrier(monkeypatch: pytest.MonkeyPatch) -> None:
    """The journal is due a base at every barrier (journal_base_due: it has grown by at
    least 0 bytes), so every checkpoint owes one."""
    monkeypatch.setattr(recovery, "JOURNAL_BASE_MIN_BYTES", 0)
    monkeypatch.setattr(recovery, "_BASE_BYTES_PER_ROOT", 0)


def journaled(storage: LmdbStorage, directory: Path, **kwargs: Any) -> FTLayer:
    """An FT layer with an acker journal in `directory`/journal, as a server runs it."""
    return FTLayer(storage, journal=Journal(directory / "journal"), **kwargs)


def journal_files(directory: Path) -> list[str]:
    """The journal's bases and segments, in order."""
    return sorted(n for n in os.listdir(directory / "journal") if n[:4] in ("base", "seg-"))


def base_state(directory: Path, k: int | None) -> dict[str, Any]:
    """Journal base k as written, in the canonical form of `_normal`."""
    assert k is not None
    return _normal(decode_snapshot((directory / "journal" / f"base-{k:012d}").read_bytes()))


def records(lo: int, hi: int) -> RecordBatch:
    """Offsets lo..hi-1 of topic "orders", partition offset % 2, source 7."""
    offsets = np.arange(lo, hi)
    return RecordBatch.build(
        new_ids(hi - lo),
        [b"e%d" % o for o in offsets],
        topics="orders",
        partitions=offsets % 2,
        offsets=offsets,
        source_ids=7,
    )


def emit(ft: FTLayer, batch: RecordBatch) -> np.ndarray:
    ids = new_ids(len(batch))
    ft.persist(batch, ids)
    return ids


def position(p0: int, p1: int, replay: int = 0) -> dict[str, Any]:
    return {"kafka": {"orders": {"0": p0, "1": p1}}, "replay": replay}


def test_unaligned_completes_at_once_and_commits_the_lowest_pending_offset(
    storage: LmdbStorage,
) -> None:
    ft = FTLayer(storage)
    cps = CheckpointCoordinator(ft)
    batch = records(0, 10)  # partition 0: offsets 0 2 4 6 8; partition 1: 1 3 5 7 9
    ids = emit(ft, batch)
    barrier = position(10, 11)
    begun = cps.begin("q", barrier, SOURCES, UNALIGNED)
    assert begun.state is CheckpointState.BEGUN and begun.pending_roots == 10
    cps.write_pending()
    done = np.flatnonzero(batch.offsets != 4)
    ft.xor(batch.roots[done], ids[done])  # offset 4 stays in flight
    completed = cps.done("q", barrier, SOURCES, UNALIGNED)
    assert completed.state is CheckpointState.COMPLETE
    assert completed.commit_offsets == {"orders": {0: 4, 1: 11}}
    assert completed.alignment_wait_s == 0.0


def test_aligned_waits_until_every_root_before_the_barrier_is_complete(
    storage: LmdbStorage,
) -> None:
    ft = FTLayer(storage)
    cps = CheckpointCoordinator(ft)
    first, second = records(0, 10), records(10, 20)
    first_ids = emit(ft, first)
    barrier1 = position(10, 11)
    cps.begin("q", barrier1, SOURCES, ALIGNED)
    cps.write_pending()
    second_ids = emit(ft, second)  # the next batch: after the barrier
    rest = np.flatnonzero(first.offsets != 4)
    ft.xor(first.roots[rest], first_ids[rest])
    ft.xor(second.roots, second_ids)
    answer = cps.done("q", barrier1, SOURCES, ALIGNED, now=100.0)
    assert answer.state is CheckpointState.ALIGNING
    assert answer.commit_offsets is None  # nothing completed before: nothing to commit
    assert cps.poll(now=101.0) == 0
    # Offset 4 fails: its replay keeps offset 4 and still holds the barrier.
    ft.fail(first.roots[first.offsets == 4])
    assert cps.poll(now=102.0) == 0
    replay = ft.fetch_replay(0, ft.replay_cursor)
    ft.xor(replay.records.roots, np.zeros(1, np.uint64) + 5)  # emitted (ack value 5)
    assert cps.poll(now=103.0) == 0
    ft.xor(replay.records.roots, np.zeros(1, np.uint64) + 5)  # and acked
    assert cps.poll(now=104.5) == 1
    done = cps.last_complete("q")
    assert done is not None and done.state is CheckpointState.COMPLETE
    assert done.commit_offsets == {"orders": {0: 10, 1: 11}}
    assert done.alignment_wait_s == pytest.approx(4.5)


def test_an_aligning_checkpoint_answers_with_the_last_completed_offsets(
    storage: LmdbStorage,
) -> None:
    ft = FTLayer(storage)
    cps = CheckpointCoordinator(ft)
    a = records(0, 4)
    emit_a = emit(ft, a)
    cps.begin("q", position(4, 5), SOURCES, ALIGNED)
    cps.write_pending()
    ft.xor(a.roots, emit_a)
    assert cps.done("q", position(4, 5), SOURCES, ALIGNED).state is CheckpointState.COMPLETE
    b = records(4, 8)
    emit(ft, b)  # never acked
    cps.begin("q", position(8, 9), SOURCES, ALIGNED)
    cps.write_pending()
    answer = cps.done("q", position(8, 9), SOURCES, ALIGNED)
    assert answer.state is CheckpointState.ALIGNING
    assert answer.commit_offsets == {"orders": {0: 4, 1: 5}}


def test_checkpoints_complete_in_order(storage: LmdbStorage) -> None:
    ft = FTLayer(storage)
    cps = CheckpointCoordinator(ft)
    a = records(0, 2)
    a_ids = emit(ft, a)
    cps.begin("q", position(2, 3), SOURCES, ALIGNED)
    cps.begin("q", position(2, 3, replay=0), SOURCES, ALIGNED)  # the same barrier
    cps.begin("q", position(4, 5), SOURCES, ALIGNED)
    cps.write_pending()
    cps.done("q", position(2, 3), SOURCES, ALIGNED)
    cps.done("q", position(4, 5), SOURCES, ALIGNED)
    assert cps.last_complete("q") is None
    ft.xor(a.roots, a_ids)
    assert cps.poll() == 2
    last = cps.last_complete("q")
    assert last is not None and last.id == 2


def test_a_commit_that_never_arrived_does_not_hold_later_checkpoints(
    storage: LmdbStorage,
) -> None:
    ft = FTLayer(storage)
    cps = CheckpointCoordinator(ft)
    cps.begin("q", position(1, 1), SOURCES, UNALIGNED)
    cps.begin("q", position(2, 2), SOURCES, UNALIGNED)
    cps.write_pending()
    # The FT layer was unreachable when Spark committed the first batch.
    answer = cps.done("q", position(2, 2), SOURCES, UNALIGNED)
    assert answer.state is CheckpointState.COMPLETE and answer.id == 2
    assert cps.status()["q"]["completed"] == 2 and cps.status()["q"]["open"] == []


def test_complete_prunes_the_replays_the_batch_took_in(storage: LmdbStorage) -> None:
    ft = FTLayer(storage)
    cps = CheckpointCoordinator(ft)
    batch = records(0, 6)
    emit(ft, batch)
    ft.fail(batch.roots[:3])
    barrier = position(6, 7, replay=ft.replay_cursor)
    cps.begin("q", barrier, SOURCES, UNALIGNED)
    cps.write_pending()
    completed = cps.done("q", barrier, SOURCES, UNALIGNED)
    assert completed.pruned == 3
    assert ft.current_stats().replay_queue == 0
    assert ft.replay_start_of(7) == 3


@pytest.mark.usefixtures("base_at_every_barrier")
def test_the_journal_base_is_the_state_at_the_barrier(storage: LmdbStorage, tmp_path: Path) -> None:
    ft = journaled(storage, tmp_path)
    cps = CheckpointCoordinator(ft)
    batch = records(0, 8)
    ids = emit(ft, batch)
    ft.xor(batch.roots[:2], ids[:2])  # complete
    ft.xor(batch.roots[2:4], np.array([11, 12], np.uint64))  # partly acked
    ft.fail(batch.roots[4:5])  # queued for replay, retried once
    roots, acks = ft.acker.items()
    expected = dict(zip(roots.tolist(), acks.tolist(), strict=True))
    seqs_at_barrier = sorted(ft.acker.snapshot("seq")["seq"].tolist())
    begun = cps.begin("q", position(8, 9, ft.replay_cursor), SOURCES, UNALIGNED)
    ft.xor(batch.roots[5:8], ids[5:8])  # after the barrier: not in the base
    assert cps.write_pending() == 1
    assert begun.journal_base is not None
    assert journal_files(tmp_path) == [
        f"base-{begun.journal_base:012d}",
        f"seg-{begun.journal_base:012d}",
    ]
    raw = (tmp_path / "journal" / f"base-{begun.journal_base:012d}").read_bytes()
    assert begun.size_bytes == len(raw) and begun.write_s is not None
    snap = decode_snapshot(raw)
    got = dict(zip(snap["acker.root"].tolist(), snap["acker.ack"].tolist(), strict=True))
    assert got == expected and len(got) == 6
    assert sorted(snap["acker.seq"].tolist()) == seqs_at_barrier
    assert snap["queue.replay_seq"].tolist() == [1]
    assert snap["retries.count"].tolist() == [1]
    # Nothing else is stored for the checkpoint but its record.
    assert storage.meta_keys(SNAPSHOT_PREFIX) == []


def test_a_barrier_with_no_base_due_copies_and_writes_nothing(
    storage: LmdbStorage, tmp_path: Path
) -> None:
    """A small journal (less than a base's worth since the last one) is due no base: the
    checkpoint copies nothing, writes nothing and completes at once."""
    ft = journaled(storage, tmp_path)
    cps = CheckpointCoordinator(ft)
    batch = records(0, 8)
    ids = emit(ft, batch)
    begun = cps.begin("q", position(8, 9), SOURCES, UNALIGNED)
    ft.xor(batch.roots, ids)
    assert not cps.has_writes and cps.write_pending() == 0
    done = cps.done("q", position(8, 9), SOURCES, UNALIGNED)
    assert done is begun and done.state is CheckpointState.COMPLETE
    assert done.commit_offsets == {"orders": {0: 8, 1: 9}}
    assert (done.copy_s, done.write_s, done.size_bytes, done.journal_base) == (0, 0, 0, None)
    assert [n for n in journal_files(tmp_path) if n.startswith("base")] == []


def _normal(state: dict[str, np.ndarray]) -> dict[str, list[Any]]:
    """A snapshot's arrays in a canonical order, for comparing."""
    order = np.argsort(state["acker.root"])
    found = {name: state[name][order].tolist() for name in ("acker.root", "acker.ack")}
    columns = [state[n].tolist() for n in sorted(state) if n.startswith("queue.")]
    found["queue"] = sorted(zip(*columns, strict=True))
    retries = zip(state["retries.root"].tolist(), state["retries.count"].tolist(), strict=True)
    found["retries"] = sorted(retries)
    return found


CHANGES = {
    "persist": lambda ft, batch, ids: emit(ft, records(100, 104)),
    "xor": lambda ft, batch, ids: ft.xor(batch.roots[:3], ids[:3]),
    "fail": lambda ft, batch, ids: ft.fail(batch.roots[3:5]),
    "tick": lambda ft, batch, ids: [ft.tick(now=1e6 * k) for k in range(1, 5)],  # time out
    "prune_replay": lambda ft, batch, ids: ft.prune_replay(ft.replay_cursor),
}


@pytest.mark.usefixtures("base_at_every_barrier")
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_the_copy_owed_at_a_barrier_is_taken_before_any_change(
    storage: LmdbStorage, tmp_path: Path, change: str
) -> None:
    """The barrier copies nothing at once (its reply does not wait for the copy); the
    first change after it, whatever it is, takes the copy first, so the journal base
    written is the state at the barrier."""
    ft = journaled(storage, tmp_path, timeout_s=30.0)
    cps = CheckpointCoordinator(ft)
    batch = records(0, 8)
    ids = emit(ft, batch)
    ft.fail(batch.roots[6:8])  # a replay queue and retry counts to copy
    ft.xor(batch.roots[:1], np.array([5], np.uint64))  # a changed ack value
    at_barrier = _normal(ft.state_snapshot(journal_base=False))
    begun = cps.begin("q", position(8, 9, ft.replay_cursor), SOURCES, UNALIGNED)
    CHANGES[change](ft, batch, ids)
    assert _normal(ft.state_snapshot(journal_base=False)) != at_barrier  # the change changed it
    cps.write_pending()
    assert base_state(tmp_path, begun.journal_base) == at_barrier
    assert begun.pending_roots == len(at_barrier["acker.root"]) == 8


@pytest.mark.usefixtures("base_at_every_barrier")
def test_checkpoints_begun_with_no_change_between_share_one_copy(
    storage: LmdbStorage, tmp_path: Path
) -> None:
    ft = journaled(storage, tmp_path)
    cps = CheckpointCoordinator(ft)
    emit(ft, records(0, 4))
    first = cps.begin("q", position(4, 5), SOURCES, UNALIGNED)
    second = cps.begin("other", position(4, 5), SOURCES, ALIGNED)
    emit(ft, records(4, 6))
    assert cps.write_pending() == 1  # one base for both
    assert first.journal_base == second.journal_base
    assert len(base_state(tmp_path, first.journal_base)["acker.root"]) == 4
    assert first.copy_s == second.copy_s
    assert first.size_bytes == second.size_bytes > 0


def test_a_restarted_layer_goes_on_numbering_and_keeps_the_newest_records(
    tmp_path: Path,
) -> None:
    with LmdbStorage(tmp_path / "ft") as storage:
        ft = FTLayer(storage)
        cps = CheckpointCoordinator(ft, retain=2)
        for n in range(1, 6):
            cps.begin("q", position(n, n), SOURCES, UNALIGNED)
            cps.write_pending()
            cps.done("q", position(n, n), SOURCES, UNALIGNED)
            cps.write_pending()
        assert len(storage.meta_keys(CHECKPOINT_PREFIX)) == 2
    with LmdbStorage(tmp_path / "ft") as storage:
        cps = CheckpointCoordinator(FTLayer(storage), retain=2)
        last = cps.last_complete("q")
        assert last is not None and last.id == 5
        assert last.commit_offsets == {"orders": {0: 5, 1: 5}}
        again = cps.done("q", position(5, 5), SOURCES, UNALIGNED)  # Spark commits again
        assert again.id == 5 and again.state is CheckpointState.COMPLETE
        assert cps.begin("q", position(6, 6), SOURCES, UNALIGNED).id == 6
        cps.done("q", position(6, 6), SOURCES, UNALIGNED)
        cps.write_pending()
        # The records stored before the restart count towards `retain`.
        assert storage.meta_keys(CHECKPOINT_PREFIX) == [
            f"{CHECKPOINT_PREFIX}q/{n:012d}" for n in (5, 6)
        ]


@pytest.mark.usefixtures("base_at_every_barrier")
def test_a_position_never_begun_is_begun_at_completion(
    storage: LmdbStorage, tmp_path: Path
) -> None:
    ft = journaled(storage, tmp_path)
    cps = CheckpointCoordinator(ft)
    answer = cps.done("q", position(3, 3), SOURCES, UNALIGNED)
    # Its journal base is not written yet: it completes on the poll after the write.
    assert answer.state is CheckpointState.ALIGNING
    cps.write_pending()
    assert cps.poll() == 1


class FailingWrites:
    """Injected write failures: the next `times` writes of `store` raise StorageError
    (nothing of them is stored, as with a failed LMDB transaction)."""

    def __init__(self, store: LmdbStorage, monkeypatch: pytest.MonkeyPatch) -> None:
        self.times = 0
        self._write = store.update_meta
        monkeypatch.setattr(store, "update_meta", self._update_meta)

    def _update_meta(self, puts: Any, deletes: Any = ()) -> None:
        if self.times:
            self.times -= 1
            raise StorageError("injected: no space left on device")
        self._write(puts, deletes)


class FailingBases:
    """Injected journal-base write failures: the next `times` bases `ft` writes raise
    OSError before anything is written (as a full disk does)."""

    def __init__(self, ft: FTLayer, monkeypatch: pytest.MonkeyPatch) -> None:
        assert ft.journal is not None
        self.times = 0
        self._write = ft.journal.write_base
        monkeypatch.setattr(ft.journal, "write_base", self._write_base)

    def _write_base(self, k: int, blob: bytes) -> None:
        if self.times:
            self.times -= 1
            raise OSError(errno.ENOSPC, "injected: no space left on device")
        self._write(k, blob)


@pytest.fixture
def snapshots(tmp_path: Path) -> Iterator[LmdbStorage]:
    """A store of checkpoint records of its own, as the server has."""
    with LmdbStorage(tmp_path / "checkpoints", sync=False) as store:
        yield store


@pytest.mark.usefixtures("base_at_every_barrier")
@pytest.mark.parametrize("mode", [UNALIGNED, ALIGNED])
def test_a_failed_base_write_holds_completion_and_is_retried(
    storage: LmdbStorage,
    snapshots: LmdbStorage,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    mode: CheckpointMode,
) -> None:
    """Checkpoint 1's journal base fails to write once: it stays incomplete and the group
    holds, the next write stores the base, and it and every later checkpoint
    complete, moving the group offsets. The journal keeps only the newest base."""
    ft = journaled(storage, tmp_path)
    cps = CheckpointCoordinator(ft, retain=2, record_store=snapshots)
    fail = FailingBases(ft, monkeypatch)
    batch = records(0, 4)
    ids = emit(ft, batch)
    first = cps.begin("q", position(2, 3), SOURCES, mode)
    fail.times = 1
    assert cps.write_pending() == 0
    ft.xor(batch.roots, ids)
    answer = cps.done("q", position(2, 3), SOURCES, mode)
    assert answer.state is CheckpointState.ALIGNING and answer.commit_offsets is None
    assert cps.has_writes  # the server's writer comes back for it
    assert cps.write_pending() == 1  # the retry
    assert cps.poll() == 1
    assert first.state is CheckpointState.COMPLETE and first.size_bytes > 0
    assert first.commit_offsets == {"orders": {0: 2, 1: 3}}
    last = first
    for n in (4, 6):
        last = cps.begin("q", position(n, n + 1), SOURCES, mode)
        cps.write_pending()
        completed = cps.done("q", position(n, n + 1), SOURCES, mode)
        assert completed.state is CheckpointState.COMPLETE
        assert completed.commit_offsets == {"orders": {0: n, 1: n + 1}}
    cps.write_pending()
    assert journal_files(tmp_path)[0] == f"base-{last.journal_base:012d}"
    assert snapshots.meta_keys(CHECKPOINT_PREFIX) == [
        f"{CHECKPOINT_PREFIX}q/{n:012d}" for n in (2, 3)
    ]
    assert cps.status()["q"]["completed"] == 3 and not cps.has_writes


@pytest.mark.usefixtures("base_at_every_barrier")
def test_a_base_that_keeps_failing_is_superseded_by_the_next_barriers(
    storage: LmdbStorage,
    snapshots: LmdbStorage,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two failed base writes in a row: checkpoint 1's base is superseded by checkpoint
    2's, and 2's by 3's (only the newest copy is kept); 1 completes with the write
    that stores 3's, and the records of the checkpoints completed meanwhile are
    stored too."""
    ft = journaled(storage, tmp_path)
    cps = CheckpointCoordinator(ft, record_store=snapshots)
    fail = FailingBases(ft, monkeypatch)
    batch = records(0, 8)
    ids = emit(ft, batch)
    cps.begin("q", position(2, 3), SOURCES, UNALIGNED)
    fail.times = 2
    assert cps.write_pending() == 0
    ft.xor(batch.roots[:4], ids[:4])  # offsets 0 to 3 complete
    cps.begin("q", position(4, 5), SOURCES, UNALIGNED)
    assert cps.write_pending() == 0  # 2's copy supersedes 1's, and its write fails
    first = cps.done("q", position(2, 3), SOURCES, UNALIGNED)
    assert first.state is CheckpointState.ALIGNING and first.superseded
    assert cps.status()["q"]["open"][0]["superseded"] is True
    cps.begin("q", position(8, 9), SOURCES, UNALIGNED)
    assert cps.write_pending() == 1  # 3's base, which covers 1 and 2
    assert cps.poll() == 1
    assert first.state is CheckpointState.COMPLETE
    assert first.commit_offsets == {"orders": {0: 2, 1: 3}}
    second = cps.done("q", position(4, 5), SOURCES, UNALIGNED)
    third = cps.done("q", position(8, 9), SOURCES, UNALIGNED)
    assert second.state is third.state is CheckpointState.COMPLETE
    assert second.superseded and not third.superseded
    assert first.size_bytes == second.size_bytes == third.size_bytes > 0
    assert third.commit_offsets == {"orders": {0: 4, 1: 5}}  # offsets 4 to 7 pending
    cps.write_pending()
    assert [n for n in journal_files(tmp_path) if n.startswith("base")] == [
        f"base-{third.journal_base:012d}"
    ]
    assert snapshots.meta_keys(CHECKPOINT_PREFIX) == [
        f"{CHECKPOINT_PREFIX}q/{n:012d}" for n in (1, 2, 3)
    ]


class Process:
    """An FT layer and its coordinator as a server runs them (LMDB, a journal, a store
    of checkpoint records), which can be killed: nothing is flushed or written on the
    way out, the journal's file is dropped as the kernel would close it, and a new
    process recovers from what is on disk."""

    def __init__(self, data: Path) -> None:
        self.data = data
        self.storage = LmdbStorage(data / "ft")
        self.records = LmdbStorage(data / "checkpoints", sync=False)
        self.ft = journaled(self.storage, data, timeout_s=60)
        self.checkpoints = CheckpointCoordinator(self.ft, record_store=self.records)

    def kill(self) -> None:
        assert self.ft.journal is not None
        self.ft.journal.close()
        self.records.close()
        self.storage.close()

    def restart(self) -> FTLayer:
        self.kill()
        self.__init__(self.data)  # type: ignore[misc]
        return self.ft


def test_recovery_after_a_kill_starts_from_the_base_written_at_a_checkpoint(
    tmp_path: Path,
) -> None:
    """Checkpoint -> kill -> restart: the journal was truncated at the base the
    checkpoint wrote, and the new FT layer restores from it (and the segment after it)
    every pending root with its ack value, the replay queue and the retry counts;
    nothing is replayed."""
    proc = Process(tmp_path)
    ft, cps = proc.ft, proc.checkpoints
    journal = ft.journal
    assert journal is not None
    # Completed traffic grows the journal until it is due a base.
    offset = 0
    while journal.segment_bytes < recovery.JOURNAL_BASE_MIN_BYTES:
        done = records(offset, offset + 5000)
        ft.xor(done.roots, emit(ft, done))
        offset += 5000
    batch = records(offset, offset + 8)
    ids = emit(ft, batch)
    ft.xor(batch.roots[:2], np.array([11, 12], np.uint64))  # partly acked
    ft.fail(batch.roots[2:4])  # queued for replay
    barrier = position(offset + 8, offset + 9)
    begun = cps.begin("q", barrier, SOURCES, UNALIGNED)
    assert begun.owes_base
    ft.xor(batch.roots[4:5], ids[4:5])  # after the barrier: in the segment after the base
    cps.write_pending()
    assert cps.done("q", barrier, SOURCES, UNALIGNED).state is CheckpointState.COMPLETE
    k = begun.journal_base
    assert k is not None and journal_files(tmp_path) == [f"base-{k:012d}", f"seg-{k:012d}"]
    expected = _normal(ft.state_snapshot(journal_base=False))
    assert len(expected["acker.root"]) == 7 and len(expected["queue"]) == 2

    ft = proc.restart()
    stats = ft.current_stats()
    assert stats.failed["recovery"] == 0 and stats.recovered_pending == 7
    assert _normal(ft.state_snapshot(journal_base=False)) == expected
    last = proc.checkpoints.last_complete("q")
    assert last is not None and last.id == begun.id


@pytest.mark.usefixtures("base_at_every_barrier")
def test_a_kill_while_base_writes_fail_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The base a checkpoint owes cannot be written, and the process is killed: the
    journal still holds the older base and every segment since, so the restart
    restores the same state (the base only truncates the journal)."""
    proc = Process(tmp_path)
    ft, cps = proc.ft, proc.checkpoints
    batch = records(0, 8)
    ids = emit(ft, batch)
    cps.begin("q", position(2, 3), SOURCES, UNALIGNED)
    cps.write_pending()  # the first base: written
    ft.xor(batch.roots[:3], ids[:3])
    ft.fail(batch.roots[3:5])
    fail = FailingBases(ft, monkeypatch)
    fail.times = 1
    second = cps.begin("q", position(8, 9), SOURCES, UNALIGNED)
    ft.xor(batch.roots[5:6], np.array([3], np.uint64))  # after the barrier
    assert cps.write_pending() == 0
    assert cps.done("q", position(8, 9), SOURCES, UNALIGNED).state is CheckpointState.ALIGNING
    assert f"base-{second.journal_base:012d}" not in journal_files(tmp_path)
    expected = _normal(ft.state_snapshot(journal_base=False))

    ft = proc.restart()
    stats = ft.current_stats()
    assert stats.failed["recovery"] == 0 and stats.recovered_pending == 5
    assert _normal(ft.state_snapshot(journal_base=False)) == expected


def test_state_copies_an_older_store_holds_are_deleted_at_start(tmp_path: Path) -> None:
    """A data dir may hold per-query "snapshot/" entries in either store: a coordinator
    starting on it deletes them and keeps the checkpoint records."""
    old = {f"{SNAPSHOT_PREFIX}q/{n:012d}": encode_snapshot({}) for n in (1, 2)}
    with (
        LmdbStorage(tmp_path / "ft") as storage,
        LmdbStorage(tmp_path / "checkpoints", sync=False) as snapshots,
    ):
        cps = CheckpointCoordinator(FTLayer(storage), record_store=snapshots)
        cps.done("q", position(1, 1), SOURCES, UNALIGNED)
        cps.write_pending()
        storage.update_meta(old)
        snapshots.update_meta(old)
    with (
        LmdbStorage(tmp_path / "ft") as storage,
        LmdbStorage(tmp_path / "checkpoints", sync=False) as snapshots,
    ):
        cps = CheckpointCoordinator(FTLayer(storage), record_store=snapshots)
        assert storage.meta_keys(SNAPSHOT_PREFIX) == snapshots.meta_keys(SNAPSHOT_PREFIX) == []
        last = cps.last_complete("q")
        assert last is not None and last.id == 1
        assert cps.begin("q", position(2, 2), SOURCES, UNALIGNED).id == 2


def test_a_failed_record_write_is_retried(
    storage: LmdbStorage, snapshots: LmdbStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write that carries a completed checkpoint's record to the store of records
    fails: the next one stores it, and a restarted layer knows it."""
    ft = FTLayer(storage)
    cps = CheckpointCoordinator(ft, record_store=snapshots)
    fail = FailingWrites(snapshots, monkeypatch)
    cps.begin("q", position(2, 2), SOURCES, UNALIGNED)
    cps.write_pending()
    cps.done("q", position(2, 2), SOURCES, UNALIGNED)
    fail.times = 1
    assert cps.write_pending() == 0
    assert snapshots.meta_keys(CHECKPOINT_PREFIX) == []
    assert cps.has_writes
    cps.write_pending()
    assert snapshots.meta_keys(CHECKPOINT_PREFIX) == [f"{CHECKPOINT_PREFIX}q/{1:012d}"]
    # The FT layer's store never committed its staged copy: the restart reads this one.
    restarted = CheckpointCoordinator(FTLayer(MemoryStorage()), record_store=snapshots)
    last = restarted.last_complete("q")
    assert last is not None and last.id == 1


@pytest.mark.parametrize("query", ["", "a/b", "x" * 201, "tab\there", 5, None])
def test_bad_query_names_are_refused(storage: LmdbStorage, query: Any) -> None:
    cps = CheckpointCoordinator(FTLayer(storage))
    with pytest.raises(ConfigError, match="query name"):
        cps.begin(query, position(1, 1), SOURCES, UNALIGNED)


@pytest.mark.parametrize(
    "bad",
    [
        [],
        {"kafka": [], "replay": 0},
        {"kafka": {}, "replay": -1},
        {"kafka": {}, "replay": True},
        {"kafka": {"t": {"x": 1}}, "replay": 0},
        {"kafka": {"t": {"0": -1}}, "replay": 0},
        {"kafka": {"t": {"0": 1.5}}, "replay": 0},
        {"kafka": {}, "replay": 0, "extra": 1},
        {"kafka": {"t": {"0": 1}}},
        {"replay": 0},
    ],
)
def test_bad_positions_are_refused(storage: LmdbStorage, bad: Any) -> None:
    cps = CheckpointCoordinator(FTLayer(storage))
    with pytest.raises(PositionError, match=r"position|offset"):
        cps.begin("q", bad, SOURCES, UNALIGNED)
    assert storage.meta_keys(SNAPSHOT_PREFIX) == []


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ConfigError, match="aligned"):
        CheckpointMode.named("exactly")


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 30),
    acked=st.sets(st.integers(0, 29)),
    barrier=st.tuples(st.integers(0, 32), st.integers(0, 32)),
)
def test_aligned_offsets_never_pass_a_pending_root(
    tmp_path_factory: pytest.TempPathFactory,
    n: int,
    acked: set[int],
    barrier: tuple[int, int],
) -> None:
    """Property: a completed aligned checkpoint's offsets never pass a pending root,
    and an unaligned one's never pass one either (nor the barrier)."""
    with LmdbStorage(tmp_path_factory.mktemp("ft")) as storage:
        ft = FTLayer(storage)
        cps = CheckpointCoordinator(ft)
        batch = records(0, n)
        ids = emit(ft, batch)
        done = np.array(sorted(i for i in acked if i < n), dtype=np.intp)
        ft.xor(batch.roots[done], ids[done])
        pending = {(int(p), int(o)) for p, o in zip(batch.partitions, batch.offsets, strict=True)}
        pending -= {(int(batch.partitions[i]), int(batch.offsets[i])) for i in done}
        for mode, query in ((ALIGNED, "a"), (UNALIGNED, "u")):
            where = position(*barrier)
            cps.begin(query, where, SOURCES, mode)
            cps.write_pending()
            answer = cps.done(query, where, SOURCES, mode)
            if answer.state is CheckpointState.COMPLETE:
                assert answer.commit_offsets is not None
                for p, committed in answer.commit_offsets["orders"].items():
                    assert committed <= barrier[p]
                    assert all(o >= committed for q, o in pending if q == p)
            else:
                assert mode is ALIGNED
                assert any(o < barrier[p] for p, o in pending)


@pytest.mark.parametrize(
    "raw", [b"", b"garbage", b"FTSNAP1\n\xff\xff\xff\xff{}", b"FTSNAP1\n\x02\x00\x00\x00[]x"]
)
def test_a_damaged_snapshot_is_a_clear_error(raw: bytes) -> None:
    with pytest.raises(CorruptData, match="snapshot"):
        decode_snapshot(raw)
