"""The acker journal (issue 14, part 2): after a crash of the FT-layer process, only the
trees that really failed are replayed; the rest are restored as they were."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftlayer.acking.ids import new_ids
from ftlayer.causes import Cause, FailKind
from ftlayer.core import FTLayer
from ftlayer.core.journal import Journal
from ftlayer.core.retries import RetryPolicy
from ftlayer.errors import ConfigError
from ftlayer.persistence import LmdbStorage, MemoryStorage
from ftlayer.records import RecordBatch
from ftlayer.registration import SourceRegistration

TREE, BARRIER = 31, 32


def _records(n: int, source: int = TREE, first_offset: int = 0) -> RecordBatch:
    return RecordBatch.build(
        new_ids(n),
        [b"r%d" % i for i in range(n)],
        source_ids=source,
        topics="events",
        partitions=np.arange(n) % 2,
        offsets=np.arange(first_offset, first_offset + n),
    )


class Process:
    """An FT layer as a server runs it (LMDB, deferred deletes, a journal), which can be
    killed: the store is closed without flushing the deletes, the journal's file is
    dropped as the kernel would close it, and a new process recovers from both."""

    def __init__(self, data: Path, **kwargs: object) -> None:
        self.data = data
        self.kwargs = kwargs
        self.storage = LmdbStorage(data)
        self.ft = FTLayer(
            self.storage,
            timeout_s=60,
            defer_deletes=True,
            journal=Journal(data / "journal"),
            **kwargs,  # type: ignore[arg-type]
        )

    def kill(self) -> None:
        journal = self.ft.journal
        assert journal is not None
        journal.close()
        self.storage.close()

    def restart(self) -> FTLayer:
        self.kill()
        self.__init__(self.data, **self.kwargs)  # type: ignore[misc]
        return self.ft


def _register(ft: FTLayer) -> None:
    ft.register_source(SourceRegistration(TREE, "forward", 2))
    ft.register_source(SourceRegistration(BARRIER, "forward", 2, completion="barrier"))


def test_after_a_kill_live_trees_are_restored_and_complete_and_none_is_replayed(
    tmp_path: Path,
) -> None:
    proc = Process(tmp_path)
    ft = proc.ft
    _register(ft)
    batch = _records(100)
    emitted = new_ids(100)
    ft.persist(batch, emitted)
    children = new_ids(100)
    ft.xor(batch.roots[:60], emitted[:60] ^ children[:60])  # a step anchored children
    ft.xor(batch.roots[:40], children[:40])  # and a sink acked 40 of them: complete
    assert ft.current_stats().completed == 40
    ft = proc.restart()
    stats = ft.current_stats()
    assert stats.failed["recovery"] == 0  # nothing replayed
    assert stats.recovered_pending == 60 and stats.recovered_completed == 40
    assert len(ft) == 60 and len(ft.storage) == 60
    # The live trees go on where they were: the events still to come complete them.
    ft.xor(batch.roots[40:60], children[40:60])
    ft.xor(batch.roots[60:], emitted[60:])
    assert len(ft) == 0 and ft.current_stats().completed == 60
    assert ft.queued_replays == 0


def test_a_persist_whose_journal_write_was_lost_is_replayed_nothing_else(tmp_path: Path) -> None:
    proc = Process(tmp_path)
    ft = proc.ft
    _register(ft)
    first, second = _records(10), _records(5, first_offset=10)
    ft.persist(first, new_ids(10))
    journal = ft.journal
    assert journal is not None
    cut_at = journal.segment_bytes  # the process dies between LMDB's commit and the journal
    ft.persist(second, new_ids(5))
    segment = tmp_path / "journal" / f"seg-{journal.segment:012d}"
    proc.kill()
    os.truncate(segment, cut_at + 7)  # and the write was cut short, too
    ft = Process(tmp_path).ft
    stats = ft.current_stats()
    assert stats.recovered_pending == 10
    assert stats.failed["recovery"] == 5  # the five the journal does not know: replayed
    replay = ft.fetch_replay(0, ft.replay_cursor_of(TREE), source_id=TREE)
    assert sorted(replay.records.offsets.tolist()) == [10, 11, 12, 13, 14]


def test_a_barrier_batch_running_at_the_kill_stays_pending_for_its_barrier(
    tmp_path: Path,
) -> None:
    proc = Process(tmp_path)
    ft = proc.ft
    _register(ft)
    batch = _records(20, BARRIER)
    ft.persist(batch, new_ids(20))
    ft.fail(batch.roots[[3]], Cause(FailKind.EXPLICIT, "enrich", "FailException: x"))
    ft = proc.restart()
    stats = ft.current_stats()
    assert stats.failed["recovery"] == 0 and stats.recovered_pending == 20
    assert ft.open_holds == 19  # the failed one waits as a replay, holding nothing
    assert ft.release_barrier([BARRIER]) == 19
    replay = ft.fetch_replay(0, ft.replay_cursor_of(BARRIER), source_id=BARRIER)
    assert replay.records.offsets.tolist() == [3]
    assert ft.release_barrier([BARRIER]) == 1 and len(ft) == 0


@pytest.mark.parametrize("base", [False, True], ids=["segments", "base"])
def test_the_replay_queue_and_its_prune_points_come_back_as_they_were(
    tmp_path: Path, base: bool
) -> None:
    """Read back from the journal's segments or from a base (its queue copy), the
    queue is the same: the same entries, counted per source, pruned by the batch that
    takes them in."""
    proc = Process(tmp_path)
    ft = proc.ft
    _register(ft)
    batch = _records(6)
    ft.persist(batch, new_ids(6))
    ft.fail(batch.roots[:2], Cause(FailKind.EXPLICIT, "s", "E: a"))  # replay seqs 1, 2
    taken = ft.fetch_replay(0, 2, source_id=TREE)
    emitted = new_ids(2)
    ft.xor(taken.records.roots, emitted)  # in flight in a batch that finished:
    ft.prune_replay(2, TREE)  # its checkpoint pruned them
    ft.fail(batch.roots[2:4], Cause(FailKind.EXPLICIT, "s", "E: b"))  # seqs 3, 4: queued
    queued = ft.fetch_replay(2, 4, source_id=TREE)
    if base:
        ft.write_journal_base()
    ft = proc.restart()
    assert ft.current_stats().failed["recovery"] == 0
    assert ft.replay_start_of(TREE) == 2  # a new query starts after what was taken in
    again = ft.fetch_replay(2, ft.replay_cursor_of(TREE), source_id=TREE)
    # The same replays under the same replay seqs and roots: a batch run again after the
    # restart reads what it read before.
    assert again.replay_seqs.tolist() == queued.replay_seqs.tolist() == [3, 4]
    assert again.records.roots.tolist() == queued.records.roots.tolist()
    ft.xor(taken.records.roots, emitted)  # the finished batch's replays complete
    assert len(ft) == 4 and ft.queued_replays == 2
    assert ft.queued_replays_by_source() == {TREE: 2}
    assert ft.prune_replay(4, TREE) == 2  # the batch that took them in is checkpointed
    assert ft.queued_replays == 0 and ft.queued_replays_by_source() == {}


def test_a_record_waiting_for_its_backoff_still_waits_after_a_kill(tmp_path: Path) -> None:
    proc = Process(tmp_path)
    ft = proc.ft
    ft.register_source(
        SourceRegistration(
            TREE,
            "forward",
            2,
            retry=RetryPolicy(max_retries=5, backoff_ms=60_000, backoff_max_ms=60_000),
        )
    )
    batch = _records(3)
    ft.persist(batch, new_ids(3))
    ft.fail(batch.roots[:1], Cause(FailKind.EXPLICIT, "s", "E: later"))
    assert ft.waiting_replays == 1
    ft = proc.restart()
    stats = ft.current_stats()
    assert stats.failed["recovery"] == 0 and stats.recovered_pending == 3
    assert ft.waiting_replays == 1 and ft.queued_replays == 0


def test_a_base_truncates_the_journal_and_recovery_reads_base_and_later_segments(
    tmp_path: Path,
) -> None:
    proc = Process(tmp_path)
    ft = proc.ft
    _register(ft)
    batch = _records(50)
    emitted = new_ids(50)
    ft.persist(batch, emitted)
    ft.xor(batch.roots[:10], emitted[:10])
    journal = ft.journal
    assert journal is not None
    old_segment = journal.segment
    ft.write_journal_base()
    files = sorted(os.listdir(tmp_path / "journal"))
    assert f"seg-{old_segment:012d}" not in files  # truncated
    assert f"base-{journal.segment:012d}" in files
    ft.xor(batch.roots[10:20], emitted[10:20])  # after the base
    ft = proc.restart()
    assert ft.current_stats().recovered_pending == 30
    # The 20 completed trees' deletes were still staged: 10 completed after the base
    # (their "gone" records are in its segment), 10 before it (stored before the base,
    # not pending at it).
    assert ft.current_stats().recovered_completed == 20
    ft.xor(batch.roots[20:], emitted[20:])
    ft.flush_deletes()
    assert len(ft) == 0 and len(ft.storage) == 0


def test_a_journal_that_outgrows_its_limit_writes_its_own_base(tmp_path: Path) -> None:
    storage = LmdbStorage(tmp_path)
    ft = FTLayer(storage, journal=Journal(tmp_path / "journal", max_segment_bytes=4096))
    batch = _records(200)
    emitted = new_ids(200)
    ft.persist(batch, emitted)
    for i in range(200):
        ft.xor(batch.roots[i : i + 1], emitted[i : i + 1] ^ np.uint64(5))  # never complete
    journal = ft.journal
    assert journal is not None and journal.bases_written >= 1
    size = sum(os.path.getsize(tmp_path / "journal" / n) for n in os.listdir(tmp_path / "journal"))
    assert size < 3 * 4096 + 200 * 40  # segments and one base, not the whole history


def test_journal_base_bytes_sets_when_a_checkpoint_writes_a_base(tmp_path: Path) -> None:
    storage = LmdbStorage(tmp_path)
    ft = FTLayer(storage, journal=Journal(tmp_path / "journal"))
    batch = _records(50)
    ft.persist(batch, new_ids(50))
    assert not ft.journal_base_due()  # the default: once the journal grew by 1 MiB
    every = FTLayer(MemoryStorage(), journal=Journal(tmp_path / "j2"), journal_base_bytes=0)
    assert every.journal_base_due()  # 0: at every checkpoint
    assert not FTLayer(MemoryStorage(), journal_base_bytes=0).journal_base_due()  # no journal
    with pytest.raises(ConfigError, match="journal_base_bytes"):
        FTLayer(MemoryStorage(), journal_base_bytes=-1)
    storage.close()


def test_a_journal_from_before_a_reboot_is_not_trusted_and_everything_is_replayed(
    tmp_path: Path,
) -> None:
    proc = Process(tmp_path)
    ft = proc.ft
    _register(ft)
    ft.persist(_records(8), new_ids(8))
    proc.kill()
    (tmp_path / "journal" / "boot_id").write_text("another-boot")
    ft = Process(tmp_path).ft
    stats = ft.current_stats()
    assert stats.recovered_pending == 0 and stats.failed["recovery"] == 8
    assert len(ft) == 8  # nothing lost: every record replayed


def test_a_corrupt_gone_record_never_completes_a_tree(tmp_path: Path) -> None:
    proc = Process(tmp_path)
    ft = proc.ft
    _register(ft)
    batch = _records(4)
    emitted = new_ids(4)
    ft.persist(batch, emitted)
    ft.xor(batch.roots[:2], emitted[:2])  # two complete: a "gone" record
    journal = ft.journal
    assert journal is not None
    segment = tmp_path / "journal" / f"seg-{journal.segment:012d}"
    proc.kill()
    data = bytearray(segment.read_bytes())
    data[-1] ^= 0xFF  # a flipped bit in the gone record's roots
    segment.write_bytes(bytes(data))
    ft = Process(tmp_path).ft
    stats = ft.current_stats()
    # Not taken as complete: restored pending (their ack value is 0, their events are
    # in the journal), so they time out and are replayed; never lost.
    assert stats.recovered_completed == 0
    assert len(ft.storage) == 4


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    steps=st.lists(
        st.tuples(st.sampled_from(["persist", "ack", "step", "fail", "base"]), st.integers(0, 99)),
        min_size=1,
        max_size=30,
    ),
    cut=st.integers(0, 64),
)
def test_no_record_is_lost_and_only_records_the_journal_lost_are_replayed(
    tmp_path_factory: pytest.TempPathFactory, steps: list[tuple[str, int]], cut: int
) -> None:
    """Random persists, acks, anchoring steps, fails and bases, then a kill that may cut
    the journal's last bytes: every record pending at the kill is still stored and
    pending (restored or replayed); with the whole journal, nothing but failed trees is
    replayed and every restored root completes with exactly the events it lacked."""
    data = tmp_path_factory.mktemp("journal-prop")
    proc = Process(data)
    ft = proc.ft
    _register(ft)
    owed: dict[int, int] = {}  # pending root -> the XOR still needed to complete it
    offset_of: dict[int, int] = {}
    offset = 0
    for op, pick in steps:
        if op == "persist":
            batch = _records(3, first_offset=offset)
            offset += 3
            emitted = new_ids(3)
            ft.persist(batch, emitted)
            owed.update(zip(batch.roots.tolist(), emitted.tolist(), strict=True))
            offset_of.update(zip(batch.roots.tolist(), batch.offsets.tolist(), strict=True))
        elif owed:
            root = sorted(owed)[pick % len(owed)]
            if op == "ack":
                ft.xor_one(root, owed.pop(root))
            elif op == "step":
                child = int(new_ids(1)[0])
                ft.xor_one(root, owed[root] ^ child)
                owed[root] = child
            elif op == "fail":
                ft.fail(np.array([root], dtype=np.uint64), Cause(FailKind.EXPLICIT, "s", "E: x"))
                del owed[root]
            else:
                ft.write_journal_base()
    journal = ft.journal
    assert journal is not None
    segment = data / "journal" / f"seg-{journal.segment:012d}"
    proc.kill()
    size = segment.stat().st_size
    os.truncate(segment, max(0, size - cut))
    ft = Process(data).ft
    stats = ft.current_stats()
    stored = len(ft.storage)
    assert len(ft) == stored  # every stored record is pending again
    assert stats.recovered_pending + stats.failed["recovery"] == stored
    # Nothing lost: every record whose tree was pending at the kill is still stored.
    offsets = {o for _s, b, _r in ft.storage.scan() for o in b.offsets.tolist()}
    assert {offset_of[root] for root in owed} <= offsets
    pending, _ = ft.acker.lookup("seq", np.array(sorted(owed), dtype=np.uint64))
    restored = [r for r, p in zip(sorted(owed), pending.tolist(), strict=True) if p]
    if cut == 0:  # the whole journal: every live tree restored, and only failed ones replay
        assert len(restored) == len(owed) and stats.failed["recovery"] == 0
        for root in restored:
            assert ft.xor_one(root, owed[root])  # exactly what it lacked completes it


def test_a_failed_journal_write_drops_the_journal_and_fails_no_request(tmp_path: Path) -> None:
    proc = Process(tmp_path)
    ft = proc.ft
    _register(ft)
    batch = _records(6)
    emitted = new_ids(6)
    ft.persist(batch, emitted)
    journal = ft.journal
    assert journal is not None and journal._fd is not None
    os.close(journal._fd)  # the next write fails, as on a full disk
    ft.xor(batch.roots[:2], emitted[:2])  # applied, and not refused
    assert journal.broken is not None and len(ft) == 4
    assert not [n for n in os.listdir(tmp_path / "journal") if n.startswith("seg-")]
    ft = proc.restart()  # no journal to trust: every stored record is replayed
    assert ft.current_stats().failed["recovery"] == 6  # the 2 deletes were still staged
    # A base starts the journal again: the next kill restores what it knows.
    ft.write_journal_base()
    assert ft.journal is not None and ft.journal.broken is None
    ft = proc.restart()
    assert ft.current_stats().recovered_pending == 6 and ft.current_stats().failed["recovery"] == 0


def test_a_base_with_nothing_pending_and_no_events_since_recovers(tmp_path: Path) -> None:
    """A server killed right after a checkpoint of an idle stream: the base holds no
    root and its segment no record (this once crashed the restart)."""
    proc = Process(tmp_path)
    ft = proc.ft
    _register(ft)
    batch = _records(3)
    emitted = new_ids(3)
    ft.persist(batch, emitted)
    ft.xor(batch.roots, emitted)
    ft.flush_deletes()
    ft.write_journal_base()  # nothing pending: an empty base, and nothing after it
    ft = proc.restart()
    assert len(ft) == 0 and ft.current_stats().failed["recovery"] == 0
    ft.persist(_records(2, first_offset=10), new_ids(2))
    ft = proc.restart()
    assert ft.current_stats().recovered_pending == 2
