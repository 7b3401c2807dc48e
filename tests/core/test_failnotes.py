"""Failures of batch-range rows noted at their FAIL and applied together
(ftlayer.core.failnotes): what a batch's tasks fail is failed exactly as `fail` would
have failed it, never completed by its barrier, and survives a kill of the process
through the journal; a machine restart replays the open batches whole."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from manual_clock import Clock

from ftlayer import rangeroots
from ftlayer.causes import Cause, FailKind
from ftlayer.core import FTLayer
from ftlayer.core.failnotes import NOTE_MAX_AGE_S
from ftlayer.core.journal import Journal
from ftlayer.core.retries import RetryPolicy
from ftlayer.errors import StorageError
from ftlayer.persistence import LmdbStorage
from ftlayer.registration import SourceRegistration

SOURCE = 9
TOPIC = "orders"
START = 1000
FAILED = Cause(FailKind.EXPLICIT, "enrich", "FailException: no")


class Server:
    """An FT layer as the server runs it (LMDB, a journal), killed without warning."""

    def __init__(self, data: Path, backoff_ms: int = 0, wall: Clock | None = None) -> None:
        self.data, self.backoff_ms = data, backoff_ms
        self.wall = wall or Clock(5000.0)
        self.clock = Clock()
        self.storage = LmdbStorage(data / "store")
        self.ft = FTLayer(
            self.storage,
            timeout_s=30,
            clock=self.clock,
            wall_clock=self.wall,
            seed=1,
            defer_deletes=True,
            journal=Journal(data / "journal"),
        )
        policy = RetryPolicy(5, backoff_ms, max(backoff_ms, 1))
        self.ft.register_source(
            SourceRegistration(SOURCE, "forward", 4, retry=policy, completion="barrier")
        )

    def kill(self) -> None:
        assert self.ft.journal is not None
        self.ft.journal.close()
        self.storage.close()

    def restart(self) -> FTLayer:
        self.kill()
        self.__init__(self.data, self.backoff_ms, self.wall)  # type: ignore[misc]
        return self.ft


def _roots(number: int, offsets: list[int]) -> np.ndarray:
    return rangeroots.encode(number, START, offsets)


def _unfilled(ft: FTLayer) -> list[int]:
    return sorted(ft.unfilled(SOURCE).records.offsets.tolist())


def _replayed(ft: FTLayer) -> list[int]:
    found = ft.fetch_replay(0, ft.replay_cursor_of(SOURCE), source_id=SOURCE)
    return sorted(found.records.offsets.tolist())


def _fill(ft: FTLayer) -> None:
    wanted = ft.unfilled(SOURCE)
    n = len(wanted)
    ft.fill(
        wanted.seqs,
        [b"r%d" % o for o in wanted.records.offsets.tolist()],
        np.ones(n, dtype=np.bool_),
        (np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.bool_)),
    )


def test_a_batch_s_failures_are_noted_then_filled_and_failed_together_never_completed(
    tmp_path: Path,
) -> None:
    server = Server(tmp_path)
    ft = server.ft
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 1, START, START + 100)])
    # Two tasks' FAILs: answered with the count `fail` gives, nothing failed yet.
    assert ft.note_failures(_roots(number, [1003, 1007, 1003]), FAILED) == 2
    assert ft.note_failures(_roots(number, [1050]), FAILED) == 1
    assert ft.has_noted
    assert ft.current_stats().failed["explicit"] == 0
    # UNFILLED lists them at once, by range root: their source copies them in.
    wanted = ft.unfilled(SOURCE)
    assert wanted.records.offsets.tolist() == [1003, 1007, 1050]
    assert wanted.seqs.tolist() == _roots(number, [1003, 1007, 1050]).tolist()
    assert ft.brief_stats()["unfilled_by_source"] == {str(SOURCE): 3}
    # The barrier: every other row completes; the range waits for the noted ones, so
    # the group offset stays at the first of them.
    assert ft.complete_ranges([SOURCE], {TOPIC: {1: START + 100}}) == 97
    assert ft.pending_by_source() == {SOURCE: 3}
    assert ft.lowest_pending_offsets([TOPIC]) == {TOPIC: {1: 1003}}
    assert ft.open_ranges == 1
    # The fill applies them with their bytes: failed, replayed with those bytes, none
    # stored by reference, and the range gone.
    _fill(ft)
    assert not ft.has_noted and ft.open_ranges == 0
    assert ft.current_stats().failed["explicit"] == 3
    assert ft.current_stats().filled == 3
    assert _unfilled(ft) == []
    found = ft.fetch_replay(0, ft.replay_cursor_of(SOURCE), source_id=SOURCE).records
    assert sorted(zip(found.offsets.tolist(), list(found.payloads), strict=True)) == [
        (1003, b"r1003"),
        (1007, b"r1007"),
        (1050, b"r1050"),
    ]
    assert ft.lowest_pending_offsets([TOPIC]) == {TOPIC: {1: 1003}}  # replays pending


def test_a_barrier_before_the_fill_completes_the_rest_and_a_late_fail_is_unknown(
    tmp_path: Path,
) -> None:
    """A range whose batch is done but for noted rows: a FAIL naming a row that
    completed is not noted; it applies the notes first (which completes the range once
    they are records), and its row is late (its root is known no more)."""
    server = Server(tmp_path)
    ft = server.ft
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 1, START, START + 10)])
    assert ft.note_failures(_roots(number, [1002]), FAILED) == 1
    assert ft.complete_ranges([SOURCE], {TOPIC: {1: START + 10}}) == 9
    assert ft.open_ranges == 1 and _unfilled(ft) == [1002]
    assert ft.note_failures(_roots(number, [1004]), FAILED) == 0  # completed: late
    assert not ft.has_noted and ft.open_ranges == 0
    assert _unfilled(ft) == [1002]  # stored by reference: listed by its seq
    assert ft.unfilled(SOURCE).seqs.tolist() != _roots(number, [1002]).tolist()
    _fill(ft)
    assert _replayed(ft) == [1002]
    assert ft.current_stats().failed["explicit"] == 1


def test_a_fill_of_rows_applied_meanwhile_or_gone_from_the_source_loses_none(
    tmp_path: Path,
) -> None:
    """The fill names rows by range root: those a request applied meanwhile are left
    to be filled by their seqs; a row the source no longer has is applied by
    reference and becomes a source-expired dead letter at its own fill."""
    server = Server(tmp_path)
    ft = server.ft
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 1, START, START + 10)])
    ft.note_failures(_roots(number, [1001, 1002]), FAILED)
    wanted = ft.unfilled(SOURCE)
    ft.apply_noted()  # a request of another kind came between UNFILLED and FILL
    n = len(wanted)
    keys = (np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.bool_))
    assert ft.fill(wanted.seqs, [b"x"] * n, np.ones(n, dtype=np.bool_), keys).filled == 0
    assert _unfilled(ft) == [1001, 1002]
    _fill(ft)
    assert _replayed(ft) == [1001, 1002]
    # A row Kafka no longer has, filled by range root.
    ft.note_failures(_roots(number, [1005, 1006]), FAILED)
    wanted = ft.unfilled(SOURCE)
    assert wanted.records.offsets.tolist() == [1005, 1006]
    found = np.array([True, False])
    keys = (np.zeros(2, dtype=np.int64), np.zeros(2, dtype=np.bool_))
    assert ft.fill(wanted.seqs, [b"r1005", b""], found, keys).filled == 1
    assert not ft.has_noted
    wanted = ft.unfilled(SOURCE)
    assert wanted.records.offsets.tolist() == [1006]
    ft.fill(wanted.seqs, [b""], np.array([False]), (keys[0][:1], keys[1][:1]))
    assert ft.current_stats().failed["source-expired"] == 1
    assert [o for o in _replayed(ft) if o >= 1005] == [1005]


def test_a_fail_that_names_a_noted_row_again_meets_it_failed(tmp_path: Path) -> None:
    """As with `fail`: a second event for a row is late (it was failed under a new
    root), and the rest of its FAIL is failed at once."""
    server = Server(tmp_path)
    ft = server.ft
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 1, START, START + 100)])
    assert ft.note_failures(_roots(number, [1001, 1002]), FAILED) == 2
    assert ft.note_failures(_roots(number, [1002, 1009]), FAILED) == 1  # 1002: late
    assert not ft.has_noted
    assert _unfilled(ft) == [1001, 1002, 1009]


def test_noted_failures_survive_a_kill_and_are_failed_by_the_recovery(tmp_path: Path) -> None:
    server = Server(tmp_path)
    ft = server.ft
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 1, START, START + 100)])
    ft.note_failures(_roots(number, [1010, 1020]), FAILED)
    ft.note_failures(_roots(number, [1030]), Cause(FailKind.SINK, "sink", "refused"))
    ft = server.restart()  # killed before any request applied them
    assert _unfilled(ft) == [1010, 1020, 1030]
    assert ft.complete_ranges([SOURCE], {TOPIC: {1: START + 100}}) == 97
    # Their causes came back with them (the dead-letter and log lines name them).
    causes = {ft.retry_record(int(s)).last_cause.kind for s in ft.unfilled(SOURCE).seqs}
    assert causes == {FailKind.EXPLICIT, FailKind.SINK}
    # Applied once: a second kill does not fail them again.
    ft = server.restart()
    assert _unfilled(ft) == [1010, 1020, 1030]


def test_notes_pending_when_a_journal_base_truncates_the_journal_survive_a_kill(
    tmp_path: Path,
) -> None:
    server = Server(tmp_path)
    ft = server.ft
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 1, START, START + 100)])
    ft.note_failures(_roots(number, [1010, 1020]), FAILED)
    ft.write_journal_base()  # the segment that held the notes is deleted
    ft.note_failures(_roots(number, [1030]), FAILED)
    assert ft.has_noted
    ft = server.restart()
    assert _unfilled(ft) == [1010, 1020, 1030]


def test_notes_applied_before_a_kill_are_not_applied_again(tmp_path: Path) -> None:
    server = Server(tmp_path)
    ft = server.ft
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 1, START, START + 100)])
    ft.note_failures(_roots(number, [1010, 1020]), FAILED)
    assert ft.apply_noted() == 2
    ft = server.restart()
    assert _unfilled(ft) == [1010, 1020]
    assert len(ft.storage) == 2  # one stored record each, not two
    # The range completes and its number is used again (by another partition's batch,
    # at the same offsets): the old notes must not name its rows.
    assert ft.complete_ranges([SOURCE], {TOPIC: {1: START + 100}}) == 98
    ft.flush_staged()
    ft = server.restart()
    (again,) = ft.register_ranges([(SOURCE, TOPIC, 2, START, START + 100)])
    assert again == number
    ft = server.restart()
    assert ft.unfilled(SOURCE).records.partitions.tolist() == [1, 1]
    assert ft.complete_ranges([SOURCE], {TOPIC: {2: START + 100}}) == 100


def test_after_a_machine_restart_the_open_batches_are_replayed_whole(tmp_path: Path) -> None:
    """The journal written before the reboot may have lost its notes: every row of an
    open range that is not a record yet is failed ("recovery": duplicates, nothing
    lost)."""
    server = Server(tmp_path)
    ft = server.ft
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 1, START, START + 40)])
    ft.fail(_roots(number, [1005]), FAILED)  # applied: a record of its own
    ft.note_failures(_roots(number, [1006]), FAILED)
    server.kill()
    (tmp_path / "journal" / "boot_id").write_text("another-boot")
    ft = Server(tmp_path).ft
    assert _unfilled(ft) == list(range(START, START + 40))
    # 39 rows of the range, and the stored record (replayed as every stored one is).
    assert ft.current_stats().failed["recovery"] == 40
    assert ft.complete_ranges([SOURCE], {TOPIC: {1: START + 40}}) == 0


def test_a_record_s_backoff_counts_from_its_fail_not_from_when_it_was_applied(
    tmp_path: Path,
) -> None:
    wall = Clock(5000.0)
    server = Server(tmp_path, backoff_ms=1000, wall=wall)
    ft = server.ft
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 1, START, START + 100)])
    ft.note_failures(_roots(number, [1001, 1002]), FAILED)
    wall.now += 0.95
    ft.apply_noted()
    _fill(ft)
    wall.now = 5001.0  # a backoff of at most 1 s after the FAIL has ended
    ft.tick()
    assert _replayed(ft) == [1001, 1002]


def test_a_tick_applies_notes_no_request_applied(tmp_path: Path) -> None:
    server = Server(tmp_path)
    ft = server.ft
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 1, START, START + 100)])
    ft.note_failures(_roots(number, [1001]), FAILED)
    ft.tick()
    assert ft.has_noted  # not yet NOTE_MAX_AGE_S old
    server.clock.now += NOTE_MAX_AGE_S
    ft.tick()
    assert not ft.has_noted and _unfilled(ft) == [1001]


def test_without_a_journal_to_write_a_fail_is_applied_at_once(tmp_path: Path) -> None:
    server = Server(tmp_path)
    ft = server.ft
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 1, START, START + 100)])
    ft.note_failures(_roots(number, [1001]), FAILED)
    journal = ft.journal
    assert journal is not None and journal._fd is not None
    os.close(journal._fd)  # the next write fails, as on a full disk
    assert ft.note_failures(_roots(number, [1002]), FAILED) == 1
    assert not ft.has_noted  # the note's write broke the journal: all applied
    assert _unfilled(ft) == [1001, 1002]
    assert ft.note_failures(_roots(number, [1003]), FAILED) == 1
    assert not ft.has_noted and _unfilled(ft) == [1001, 1002, 1003]


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    fails=st.lists(
        st.tuples(
            st.lists(st.integers(0, 29), min_size=1, max_size=8),
            st.sampled_from([FailKind.EXPLICIT, FailKind.SINK]),
            st.booleans(),  # a request of another kind comes after it (STATUS)
        ),
        min_size=1,
        max_size=6,
    ),
    kill=st.booleans(),
    fill_first=st.booleans(),
)
def test_noting_fails_as_failing_at_once_does(
    tmp_path_factory: object,
    fails: list[tuple[list[int], FailKind, bool]],
    kill: bool,
    fill_first: bool,
) -> None:
    """Any FAILs of a batch, noted (and applied between requests, or recovered after a
    kill, or filled by range root before or after the barrier) or failed at once: the
    same answers, the same records failed, and the same replays with their bytes."""
    base = tmp_path_factory.mktemp("notes")  # type: ignore[attr-defined]
    noted, direct = Server(base / "noted"), Server(base / "direct")
    ranges = [(SOURCE, TOPIC, 1, START, START + 30)]
    (number,) = noted.ft.register_ranges(ranges)
    assert direct.ft.register_ranges(ranges) == [number]
    for offsets, kind, then_apply in fails:
        roots = _roots(number, [START + o for o in offsets])
        cause = Cause(kind, "step", "error")
        assert noted.ft.note_failures(roots, cause) == direct.ft.fail(roots, cause)
        if then_apply:
            noted.ft.apply_noted()
    ft = noted.restart() if kill else noted.ft
    if fill_first:
        _fill(ft)
        _fill(direct.ft)
    done = ft.complete_ranges([SOURCE], {TOPIC: {1: START + 30}})
    assert done == direct.ft.complete_ranges([SOURCE], {TOPIC: {1: START + 30}})
    assert _unfilled(ft) == _unfilled(direct.ft)
    _fill(ft)
    _fill(direct.ft)
    assert _unfilled(ft) == [] and ft.open_ranges == 0 and not ft.has_noted
    replays = [
        sorted(x.fetch_replay(0, x.replay_cursor_of(SOURCE), source_id=SOURCE).records.payloads)
        for x in (ft, direct.ft)
    ]
    assert replays[0] == replays[1]
    if not kill:  # counts are the process's own
        assert ft.current_stats().failed == direct.ft.current_stats().failed
    noted.kill()
    direct.kill()


def test_noted_rows_filled_before_their_backoff_ends_are_replayed_when_it_does(
    tmp_path: Path,
) -> None:
    """Filled by range root while their backoff runs: stored with their bytes, they
    wait for it, and the tick that ends it queues them (bytes and all)."""
    wall = Clock(5000.0)
    server = Server(tmp_path, backoff_ms=1000, wall=wall)
    ft = server.ft
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 1, START, START + 100)])
    ft.note_failures(_roots(number, [1001, 1002]), FAILED)
    wall.now += 0.5
    _fill(ft)
    assert not ft.has_noted and _unfilled(ft) == []
    ft.tick()
    assert _replayed(ft) == []  # the backoff runs from the FAIL: 0.5 s left at least
    wall.now = 5001.0
    ft.tick()
    found = ft.fetch_replay(0, ft.replay_cursor_of(SOURCE), source_id=SOURCE).records
    assert sorted(found.payloads) == [b"r1001", b"r1002"]
    # After a restart they are still there, with their bytes (none by reference).
    ft = server.restart()
    assert _unfilled(ft) == [] and _replayed(ft) == [1001, 1002]


@pytest.mark.parametrize("backoff_ms", [0, 500])
def test_filled_rows_due_at_once_are_stored_queued_in_one_write(
    tmp_path: Path, backoff_ms: int
) -> None:
    """Rows whose backoff is over when their bytes come (none, or it ran out while the
    source read them) are stored with their bytes and their replay seqs in one write:
    one commit, queued on return, and queued after a restart."""
    wall = Clock(5000.0)
    server = Server(tmp_path, backoff_ms=backoff_ms, wall=wall)
    ft = server.ft
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 1, START, START + 100)])
    ft.note_failures(_roots(number, [1001, 1002]), FAILED)
    wall.now += 1.0  # longer than the backoff with its jitter
    commits = server.storage.commits
    _fill(ft)
    assert server.storage.commits == commits + 1
    assert not ft.has_noted and _unfilled(ft) == [] and _replayed(ft) == [1001, 1002]
    assert ft.current_stats().failed["explicit"] == 2
    ft = server.restart()
    assert _unfilled(ft) == [] and _replayed(ft) == [1001, 1002]


def test_a_fill_queues_the_rows_whose_backoff_ended_and_leaves_the_others_waiting(
    tmp_path: Path,
) -> None:
    """One fill of rows failed at different times: those whose backoff ended are
    stored queued, the others wait for theirs; each failure applied once."""
    wall = Clock(5000.0)
    server = Server(tmp_path, backoff_ms=1000, wall=wall)
    ft = server.ft
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 1, START, START + 100)])
    ft.note_failures(_roots(number, [1001, 1003]), FAILED)  # due by 5001.0
    wall.now = 5000.5
    ft.note_failures(_roots(number, [1002]), FAILED)  # due at 5001.3 at the earliest
    wall.now = 5001.1
    _fill(ft)
    assert not ft.has_noted and _unfilled(ft) == [] and _replayed(ft) == [1001, 1003]
    stats = ft.current_stats()
    assert stats.failed["explicit"] == 3
    assert (stats.late_events, stats.unknown_events) == (0, 0)  # none failed twice
    ft = server.restart()  # queued and waiting as they were
    assert _unfilled(ft) == [] and _replayed(ft) == [1001, 1003]
    wall.now = 5002.0
    ft.tick()
    assert _replayed(ft) == [1001, 1002, 1003]


def test_a_fail_of_fresh_range_rows_and_other_roots_fails_every_one_once(
    tmp_path: Path,
) -> None:
    """One FAIL names a replayed record's root and a fresh range row (no backoff, by
    reference): both fail, each once; none is left pending, none failed twice."""
    server = Server(tmp_path)
    ft = server.ft
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 1, START, START + 100)])
    ft.fail(_roots(number, [1001]), FAILED)
    _fill(ft)
    first = ft.replay_cursor_of(SOURCE)
    replay = ft.fetch_replay(0, first, source_id=SOURCE).records
    assert replay.offsets.tolist() == [1001]
    ft.fail(np.concatenate([replay.roots, _roots(number, [1002])]), FAILED)
    stats = ft.current_stats()
    assert stats.failed["explicit"] == 3
    assert (stats.late_events, stats.unknown_events) == (0, 0)
    _fill(ft)
    again = ft.fetch_replay(first, ft.replay_cursor_of(SOURCE), source_id=SOURCE).records
    assert sorted(again.offsets.tolist()) == [1001, 1002]


def test_filled_rows_that_cannot_be_queued_yet_are_queued_by_a_later_tick(
    tmp_path: Path,
) -> None:
    """The fill stored the rows with their bytes, but they could not be queued (their
    routing failed, before the write and again after it): the failure stays applied
    once, and the rows wait a second for the ticker, which queues them once routing
    works again."""
    wall = Clock(5000.0)
    server = Server(tmp_path, wall=wall)
    ft = server.ft
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 1, START, START + 100)])
    ft.note_failures(_roots(number, [1001, 1002]), FAILED)
    state = ft._s
    route = state.route

    def refuse(*args: object, **kwargs: object) -> None:
        raise StorageError("partitioner unavailable")

    state.route = refuse  # type: ignore[method-assign]
    _fill(ft)
    assert not ft.has_noted and _unfilled(ft) == [] and _replayed(ft) == []
    state.route = route  # type: ignore[method-assign]
    wall.now += 1.0
    ft.tick()
    assert _replayed(ft) == [1001, 1002]
    assert ft.current_stats().failed["explicit"] == 2


def test_a_fill_the_store_refuses_applies_nothing_and_the_next_applies_once(
    tmp_path: Path,
) -> None:
    """Rows due at once are stored queued, their replay seqs in the write that stores
    them: when the store refuses that write (a full disk), nothing of the failure is
    applied (the notes stay, nothing is queued or counted), and the next fill, once
    the store takes writes again, applies it once."""
    wall = Clock(5000.0)
    server = Server(tmp_path, wall=wall)
    ft = server.ft
    (number,) = ft.register_ranges([(SOURCE, TOPIC, 1, START, START + 100)])
    ft.note_failures(_roots(number, [1001, 1002]), FAILED)
    storage = server.storage
    put = storage.put

    def refuse(*args: object, **kwargs: object) -> None:
        raise StorageError("disk full")

    storage.put = refuse  # type: ignore[method-assign]
    with pytest.raises(StorageError, match="disk full"):
        _fill(ft)
    assert ft.has_noted and _unfilled(ft) == [1001, 1002]
    assert ft.current_stats().failed["explicit"] == 0
    storage.put = put  # type: ignore[method-assign]
    _fill(ft)
    assert not ft.has_noted and _unfilled(ft) == [] and _replayed(ft) == [1001, 1002]
    assert ft.current_stats().failed["explicit"] == 2
    # Queued in that one write: a restart finds them queued, with their bytes.
    ft = server.restart()
    assert _unfilled(ft) == [] and _replayed(ft) == [1001, 1002]
