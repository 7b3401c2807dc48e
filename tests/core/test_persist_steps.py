"""A persist in three steps (issue 15): begin_persist (checks, roots reserved), the
storage write outside the core's lock, end_persist (the roots pending). Whatever
happens between the steps, a record is never half-persisted: until the end nothing but
a persist of the same roots notices it, a failed write leaves nothing behind, and a
crash after the write replays the stored records instead of losing them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ftlayer.acking.ids import new_ids
from ftlayer.core import FTLayer, PersistTicket
from ftlayer.core.journal import Journal
from ftlayer.errors import StateConflict, StorageError
from ftlayer.persistence import LmdbStorage
from ftlayer.records import RecordBatch


def _records(n: int, first_offset: int = 0, tag: bytes = b"r") -> RecordBatch:
    return RecordBatch.build(
        new_ids(n),
        [tag + b"%d" % (first_offset + i) for i in range(n)],
        topics="events",
        partitions=0,
        offsets=np.arange(first_offset, first_offset + n),
    )


class Process:
    """An FT layer as the server runs it (LMDB, deferred deletes, a journal) that can
    be killed: the store closes without flushing the deletes, the journal's file is
    closed as the kernel would, and a new process recovers from both."""

    def __init__(self, data: Path) -> None:
        self.data = data
        self.storage = LmdbStorage(data)
        self.ft = FTLayer(
            self.storage, timeout_s=60, defer_deletes=True, journal=Journal(data / "journal")
        )

    def kill(self) -> None:
        journal = self.ft.journal
        assert journal is not None
        journal.close()
        self.storage.close()

    def restart(self) -> FTLayer:
        self.kill()
        self.__init__(self.data)  # type: ignore[misc]
        return self.ft


def test_a_persist_begun_is_invisible_until_it_ends_but_its_roots_are_taken(
    tmp_path: Path,
) -> None:
    with LmdbStorage(tmp_path / "db") as storage:
        ft = FTLayer(storage, defer_deletes=True)
        batch = _records(5)
        emitted = new_ids(5)
        ticket = ft.begin_persist(batch, emitted)
        # A second persist of the same roots is refused, in one step or in three.
        with pytest.raises(StateConflict, match="already present"):
            ft.begin_persist(batch, emitted)
        with pytest.raises(StateConflict, match="already present"):
            ft.persist(batch.take(np.arange(2)))
        seqs = storage.put(batch)
        # Stored, not pending: events and fails for its roots are dropped as unknown,
        # and a checkpoint's state does not hold them.
        assert len(ft) == 0 and len(storage) == 5
        assert ft.fail(batch.roots) == 0
        assert not len(ft.xor(batch.roots, emitted).completed)
        assert ft.current_stats().unknown_events == 5 + 5
        assert len(ft.state_snapshot()["acker.root"]) == 0
        ft.end_persist(ticket, seqs)
        assert len(ft) == 5 and ft.current_stats().persisted == 5
        done = ft.xor(batch.roots, emitted)  # the acks that come after the OK
        assert sorted(done.completed.tolist()) == sorted(batch.roots.tolist())
        assert ft.flush_deletes() == 5 and len(storage) == 0


def test_a_failed_storage_write_leaves_no_root_behind(tmp_path: Path) -> None:
    with LmdbStorage(tmp_path / "db") as storage:
        ft = FTLayer(storage, defer_deletes=True)
        ft.persist(_records(2))
        batch = _records(4, first_offset=2)
        ticket = ft.begin_persist(batch)
        storage._next_seq = 1  # as if another writer had taken the seqs: the put fails
        with pytest.raises(StorageError, match="already taken"):
            storage.put(batch)
        ft.abort_persist(ticket)
        storage._next_seq = 3
        assert len(storage) == len(ft) == 2
        ft.persist(batch)  # the same roots are free again
        assert len(storage) == len(ft) == 6


def test_the_in_process_persist_stores_nothing_when_its_write_fails(tmp_path: Path) -> None:
    with LmdbStorage(tmp_path / "db") as storage:
        ft = FTLayer(storage)
        first = _records(3)
        ft.persist(first)
        storage._next_seq = 1  # the next put finds its seqs taken
        again = _records(3, first_offset=3)
        with pytest.raises(StorageError, match="already taken"):
            ft.persist(again)
        storage._next_seq = 4
        assert len(ft) == len(storage) == 3
        ft.persist(again)  # nothing of the failed persist is left: its roots are free
        assert len(ft) == len(storage) == 6


def test_a_kill_after_the_storage_write_replays_the_records_also_past_a_base(
    tmp_path: Path,
) -> None:
    """The journal base written while a persist's records are stored but not pending
    must not take them for records completed before the base (done_before_base): they
    are replayed."""
    proc = Process(tmp_path)
    ft = proc.ft
    earlier = _records(4)
    emitted = new_ids(4)
    ft.persist(earlier, emitted)
    ft.xor(earlier.roots[:2], emitted[:2])  # two complete, their deletes still marked
    batch = _records(6, first_offset=4)
    ticket = ft.begin_persist(batch)
    proc.storage.put(batch)
    ft.write_journal_base()  # the state now: the batch is stored, not pending
    assert isinstance(ticket, PersistTicket)
    ft = proc.restart()  # killed before end_persist
    stats = ft.current_stats()
    assert stats.failed["recovery"] == 6  # the batch: replayed, under new roots
    assert stats.recovered_pending == 2 and stats.recovered_completed == 2
    replay = ft.fetch_replay(0, 2**63)
    assert sorted(replay.records.payloads) == sorted(batch.payloads)
    assert len(ft.storage) == len(ft) == 8


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["begin", "store", "end", "abort", "ack", "fail", "base", "tick"]),
            st.integers(0, 99),
        ),
        min_size=1,
        max_size=40,
    )
)
@example(  # a base while a persist begun before an ended one is still under way
    steps=[("begin", 0), ("begin", 0), ("store", 0), ("end", 0), ("ack", 0), ("base", 0)]
)
def test_persists_interleaved_with_everything_else_lose_nothing_across_a_kill(
    tmp_path_factory: pytest.TempPathFactory, steps: list[tuple[str, int]]
) -> None:
    """Several persists at different steps at once, interleaved with acks, fails, ticks
    and journal bases, then a kill: every record whose persist ended (its OK) is still
    stored unless its tree completed; every record stored by a persist that had not
    ended is replayed; nothing of a persist that stored nothing is there; and every
    tree that was live is restored and completes with exactly the acks it lacked."""
    data = tmp_path_factory.mktemp("persist-steps")
    proc = Process(data)
    ft = proc.ft
    begun: list[tuple[PersistTicket, np.ndarray]] = []
    stored: list[tuple[PersistTicket, np.ndarray, np.ndarray]] = []
    owed: dict[int, int] = {}  # pending root -> the XOR that completes it
    payload_of: dict[int, bytes] = {}
    unstored: set[bytes] = set()  # begun and aborted, or never stored
    failed: set[bytes] = set()
    offset = 0
    for op, pick in steps:
        if op == "begin":
            batch = _records(3, first_offset=offset)
            offset += 3
            emitted = new_ids(3)
            begun.append((ft.begin_persist(batch, emitted), emitted))
            payload_of.update(zip(batch.roots.tolist(), batch.payloads, strict=True))
        elif op in ("store", "abort") and begun:
            ticket, emitted = begun.pop(pick % len(begun))
            if op == "store":
                stored.append((ticket, emitted, proc.storage.put(ticket.batch)))
            else:
                ft.abort_persist(ticket)
                unstored.update(ticket.batch.payloads)
        elif op == "end" and stored:
            ticket, emitted, seqs = stored.pop(pick % len(stored))
            ft.end_persist(ticket, seqs)
            owed.update(zip(ticket.batch.roots.tolist(), emitted.tolist(), strict=True))
        elif op in ("ack", "fail") and owed:
            root = sorted(owed)[pick % len(owed)]
            if op == "ack":
                assert ft.xor_one(root, owed.pop(root))
            else:
                assert ft.fail(np.array([root], dtype=np.uint64)) == 1
                del owed[root]  # replayed under a new root: still stored
                failed.add(payload_of[root])
        elif op == "base":
            ft.write_journal_base()
        elif op == "tick":
            ft.tick()
    unstored.update(p for ticket, _ in begun for p in ticket.batch.payloads)
    in_flight = [p for ticket, _, _ in stored for p in ticket.batch.payloads]
    ft = proc.restart()
    stats = ft.current_stats()
    payloads = {bytes(p) for _s, b, _r in ft.storage.scan() for p in b.payloads}
    assert len(ft) == len(ft.storage) == len(payloads)
    assert {payload_of[root] for root in owed} | failed <= payloads
    assert set(in_flight) <= payloads
    assert not unstored & payloads
    # Only the records whose persist had not ended are replayed by the recovery.
    assert stats.failed["recovery"] == len(in_flight)
    for root, value in owed.items():
        assert ft.xor_one(root, value)
    proc.kill()
