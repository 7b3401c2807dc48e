"""A driver restart does not turn held replays into duplicates (issue 29;
ftlayer.core.leases): the trees of a batch whose heartbeat lease lapsed (its driver
died mid-batch) wait for their source's next barrier instead of timing out after the
lease and T*(1+1/(n-1)); the restarted driver's run again of the batch takes them in
again under the same replay range and its barrier completes them (no replay, so no
second copy at the sink); with no barrier within the lapsed wait they time out and are
replayed as before (nothing lost); an FT-layer restart during the wait finds it again.

Real core, real LMDB and journal on disk, a hand-driven clock."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from manual_clock import Clock
from numpy.typing import NDArray

from ftlayer.acking.ids import new_ids
from ftlayer.causes import Cause, FailKind
from ftlayer.checkpoint import CheckpointCoordinator, CheckpointMode
from ftlayer.core import FTLayer
from ftlayer.core.journal import Journal
from ftlayer.core.leases import BatchLeases
from ftlayer.core.retries import RetryPolicy
from ftlayer.errors import ConfigError
from ftlayer.persistence import Completed, LmdbStorage
from ftlayer.records import RecordBatch
from ftlayer.registration import SourceRegistration

SOURCE = 31
T = 10.0  # 3 buckets: a tree times out between 10 and 15 s after it is tracked
BOUND = 15.0
LEASE = 3.0
TICK = 0.5
QUERY = "events"
MODE = CheckpointMode.UNALIGNED


class Process:
    """An FT layer as the server runs it (LMDB, deferred deletes, a journal, the
    checkpoint coordinator), on a hand-driven clock, which can be killed and started
    again on the same data dir."""

    def __init__(
        self, data: Path, clock: Clock, completion: str = "barrier", **kwargs: Any
    ) -> None:
        self.data, self.clock, self.completion, self.kwargs = data, clock, completion, kwargs
        self.storage = LmdbStorage(data)
        self.ft = FTLayer(
            self.storage,
            timeout_s=T,
            buckets=3,
            clock=clock,
            wall_clock=clock,
            defer_deletes=True,
            journal=Journal(data / "journal"),
            **kwargs,
        )
        self.ft.register_source(
            SourceRegistration(
                SOURCE,
                "forward",
                2,
                completion=completion,
                retry=RetryPolicy(max_retries=-1, backoff_ms=0, backoff_max_ms=0),
            )
        )
        self.coordinator = CheckpointCoordinator(self.ft)
        self.completed: list[tuple[int, int]] = []
        self.ft.add_completion_listener(self._heard)

    def _heard(self, done: Completed) -> None:
        self.completed += zip(done.partitions.tolist(), done.offsets.tolist(), strict=True)

    def restart(self) -> FTLayer:
        journal = self.ft.journal
        assert journal is not None
        journal.close()
        self.storage.close()
        self.__init__(self.data, self.clock, self.completion, **self.kwargs)  # type: ignore[misc]
        return self.ft

    def close(self) -> None:
        journal = self.ft.journal
        assert journal is not None
        journal.close()
        self.storage.close()

    # ---- what the ftkafka source's driver and tasks send -----------------------------

    def begin(self, end: int, replay: int) -> None:
        self.coordinator.begin(QUERY, _position(end, replay), [SOURCE], MODE, self.clock.now)

    def done(self, end: int, replay: int) -> None:
        self.coordinator.done(QUERY, _position(end, replay), [SOURCE], MODE, self.clock.now)

    def read(self, offsets: range) -> tuple[NDArray[np.uint64], NDArray[np.uint64]]:
        """A task reads and persists these offsets of partition 0: (their fresh roots,
        the emission ids, their first ack values: the barrier holds of barrier mode)."""
        offs = np.arange(offsets.start, offsets.stop, dtype=np.int64)
        batch = RecordBatch.build(
            new_ids(len(offs)),
            [b"event-%d" % o for o in offs.tolist()],
            source_ids=SOURCE,
            topics="events",
            partitions=0,
            offsets=offs,
        )
        ids = new_ids(len(batch))
        self.ft.persist(batch, ids)
        return batch.roots, ids

    def run(self, until: float, beat: bool) -> None:
        """Tick every 0.5 s up to `until`, heartbeating every 1 s while `beat`."""
        while self.clock.now < until - 1e-9:
            self.clock.now = round(self.clock.now + TICK, 6)
            if beat and self.clock.now % 1.0 == 0:
                self.ft.heartbeat([SOURCE], LEASE)
            self.ft.tick()

    def timed_out(self) -> int:
        return int(self.ft.current_stats().failed["timeout"])


def _position(end: int, replay: int) -> dict[str, Any]:
    return {"kafka": {"events": {"0": end}}, "replay": replay}


@pytest.fixture
def proc(tmp_path: Path) -> Any:
    p = Process(tmp_path, Clock())
    yield p
    p.close()


def _dead_batch(p: Process) -> tuple[NDArray[np.uint64], NDArray[np.uint64], int]:
    """Batch 1 reads offsets 0-9, fails 2 and 7 (queued as replays) and is done; batch 2
    takes the 2 replays and offsets 10-14 in, its driver heartbeats until 5 s and dies
    (the lease lapses at 8 s). Returns (replay roots, batch 2's read roots, replay cursor)."""
    p.begin(10, 0)
    p.ft.heartbeat([SOURCE], LEASE)
    first, _ = p.read(range(0, 10))
    p.ft.fail(first[[2, 7]], Cause(FailKind.EXPLICIT, "enrich", "FailException: x"))
    p.run(1.0, beat=True)
    cursor = p.ft.replay_cursor_of(SOURCE)
    assert cursor == 2
    p.done(10, 0)
    p.begin(15, cursor)
    p.ft.heartbeat([SOURCE], LEASE)
    replays = p.ft.fetch_replay(0, cursor, source_id=SOURCE)
    assert sorted(replays.records.offsets.tolist()) == [2, 7]
    read, _ = p.read(range(10, 15))
    p.run(5.0, beat=True)  # the last heartbeat at 5 s: leased until 8 s
    return replays.records.roots, read, cursor


def test_a_lapsed_batch_waits_for_its_rerun_whose_barrier_completes_it_without_replays(
    proc: Process,
) -> None:
    p = proc
    replay_roots, read, cursor = _dead_batch(p)
    # The driver is down for 52 s: far past the lease and the tree timeout's bound.
    p.run(60.0, beat=False)
    assert p.timed_out() == 0 and len(p.ft) == 7
    assert p.ft.current_stats().timeouts_postponed >= 7 * 3
    assert p.ft.current_stats().batches_running[str(SOURCE)]["lease_s"] == 0.0
    # The restarted driver plans the same batch again (same position), heartbeats, and
    # its tasks take in the same replay range (the same roots: still pending) and read
    # the same offsets again (new copies: barrier mode takes nothing over at persist).
    p.begin(15, cursor)
    p.ft.heartbeat([SOURCE], LEASE)
    again = p.ft.fetch_replay(0, cursor, source_id=SOURCE)
    assert sorted(again.records.roots.tolist()) == sorted(replay_roots.tolist())
    p.read(range(10, 15))
    p.run(90.0, beat=True)  # the run again is slow: nothing times out while it runs
    assert p.timed_out() == 0
    p.done(15, cursor)  # its barrier: the dead run's holds are released with its own
    assert len(p.ft) == 0 and p.timed_out() == 0
    assert p.ft.replay_cursor_of(SOURCE) == cursor  # nothing was replayed again
    assert sorted(o for _, o in p.completed if o >= 10) == sorted([*range(10, 15)] * 2)
    assert sorted(o for _, o in p.completed if o in (2, 7)) == [2, 7]
    assert p.ft.current_stats().batches_running == {}
    assert not any(int(r) in p.ft.acker for r in read)


def test_with_no_wait_the_same_restart_replays_what_the_run_again_takes_in_too(
    tmp_path: Path,
) -> None:
    """What the wait prevents (`lapsed_batch_timeout_s=0`, the behaviour before it): the
    dead run's trees time out while the driver is down, so the records it read are
    queued as replays although the run again reads them too, and the replays it took
    in are replayed again, into a later batch than the one the dead run wrote them in:
    a second copy at the sink each."""
    p = Process(tmp_path, Clock(), lapsed_batch_timeout_s=0.0)
    try:
        _, _, cursor = _dead_batch(p)
        p.run(60.0, beat=False)
        assert p.timed_out() == 7
        p.begin(15, cursor)
        assert len(p.ft.fetch_replay(0, cursor, source_id=SOURCE)) == 0
        p.read(range(10, 15))  # read again as well as queued
        p.done(15, cursor)
        later = p.ft.fetch_replay(cursor, p.ft.replay_cursor_of(SOURCE), source_id=SOURCE)
        assert sorted(later.records.offsets.tolist()) == [2, 7, 10, 11, 12, 13, 14]
    finally:
        p.close()


def test_without_a_barrier_the_fallback_replays_everything_the_lapsed_batch_held(
    tmp_path: Path,
) -> None:
    p = Process(tmp_path, Clock(), lapsed_batch_timeout_s=120.0)
    try:
        _, _, cursor = _dead_batch(p)
        p.run(8.0 + 120.0 - TICK, beat=False)  # the wait: lapsed at 8 s, 120 s more
        assert p.timed_out() == 0 and len(p.ft) == 7
        p.run(8.0 + 120.0 + BOUND + TICK, beat=False)
        assert p.timed_out() == 7  # nothing lost: every held record is queued again
        queued = p.ft.fetch_replay(cursor, p.ft.replay_cursor_of(SOURCE), source_id=SOURCE)
        assert sorted(queued.records.offsets.tolist()) == [2, 7, 10, 11, 12, 13, 14]
        # A driver back after the wait: its run again finds the old replay range's roots
        # gone (they were replayed under new ones), so it emits none of them twice.
        p.begin(15, cursor)
        assert len(p.ft.fetch_replay(0, cursor, source_id=SOURCE)) == 0
    finally:
        p.close()


def test_the_wait_survives_an_ft_layer_restart_and_ends_at_the_next_barrier(
    proc: Process,
) -> None:
    p = proc
    replay_roots, _, cursor = _dead_batch(p)
    p.run(20.0, beat=False)  # lapsed at 8 s; past the usual bound, nothing timed out
    assert p.timed_out() == 0
    ft = p.restart()  # the FT layer restarts during the wait (its leases are gone)
    stats = ft.current_stats()
    assert stats.failed["recovery"] == 0 and stats.recovered_pending == 7
    assert ft.current_stats().batches_running[str(SOURCE)]["lease_s"] == 0.0
    p.run(80.0, beat=False)  # 60 s after the restart: the wait was found again
    assert p.timed_out() == 0 and len(ft) == 7
    p.begin(15, cursor)  # the restarted driver's run again
    p.ft.heartbeat([SOURCE], LEASE)
    again = ft.fetch_replay(0, cursor, source_id=SOURCE)
    assert sorted(again.records.roots.tolist()) == sorted(replay_roots.tolist())
    p.read(range(10, 15))
    p.run(100.0, beat=True)
    p.done(15, cursor)
    assert len(ft) == 0 and p.timed_out() == 0
    assert ft.replay_cursor_of(SOURCE) == cursor


def test_after_an_ft_layer_restart_the_wait_still_ends_in_the_fallback(tmp_path: Path) -> None:
    p = Process(tmp_path, Clock(), lapsed_batch_timeout_s=60.0)
    try:
        _, _, cursor = _dead_batch(p)
        p.run(30.0, beat=False)
        p.restart()  # at 30 s: the restored trees wait 60 s from now
        p.run(90.0 - TICK, beat=False)
        assert p.timed_out() == 0
        p.run(90.0 + BOUND + TICK, beat=False)
        # Nothing lost: the records read are queued again; the replays the batch took
        # in came back queued under their own range (recovery times no queued replay:
        # the run again, whenever it comes, takes them in there).
        assert p.timed_out() == 5
        queued = p.ft.fetch_replay(cursor, p.ft.replay_cursor_of(SOURCE), source_id=SOURCE)
        assert sorted(queued.records.offsets.tolist()) == [10, 11, 12, 13, 14]
        held = p.ft.fetch_replay(0, cursor, source_id=SOURCE)
        assert sorted(held.records.offsets.tolist()) == [2, 7]
    finally:
        p.close()


def test_a_live_driver_across_an_ft_layer_restart_keeps_its_batch_leased(proc: Process) -> None:
    p = proc
    _, _, cursor = _dead_batch(p)  # (its driver is alive here: it heartbeats on)
    p.restart()
    p.run(60.0, beat=True)  # its heartbeats renew the batch found again
    assert p.timed_out() == 0
    p.done(15, cursor)  # its barrier completes it
    assert len(p.ft) == 0 and p.ft.current_stats().batches_running == {}


def test_a_lapsed_tree_mode_batch_waits_too_and_its_rerun_takes_it_over(tmp_path: Path) -> None:
    p = Process(tmp_path, Clock(), completion="tree")
    try:
        p.begin(5, 0)
        p.ft.heartbeat([SOURCE], LEASE)
        p.read(range(0, 5))  # their trees are never finished: the driver dies
        p.run(5.0, beat=True)
        p.run(60.0, beat=False)
        assert p.timed_out() == 0 and len(p.ft) == 5
        p.begin(5, 0)  # the run again reads them again: it takes the dead run's over
        p.ft.heartbeat([SOURCE], LEASE)
        roots, ids = p.read(range(0, 5))
        p.ft.xor(roots, ids)  # the run again's trees finish
        assert len(p.ft) == 0 and p.timed_out() == 0
        assert p.ft.current_stats().taken_over == 5
    finally:
        p.close()


def test_a_begin_adopts_the_open_batch_it_finds_and_a_done_ends_both() -> None:
    leases = BatchLeases(100.0)
    leases.began([SOURCE], 0.0)
    first = leases.tag(SOURCE)
    assert first is not None and not leases.running(first, 0.5)  # no heartbeat yet
    leases.renew([SOURCE], 3.0, 1.0)  # leased until 4 s, then waited for until 104 s
    assert leases.running(first, 103.9) and not leases.running(first, 104.0)
    leases.began([SOURCE], 50.0)  # the restarted driver plans the batch again
    second = leases.tag(SOURCE)
    assert second != first
    # Before its first heartbeat the new batch keeps the wait it took over.
    assert leases.running(first, 103.9) and leases.running(second, 103.9)
    assert not leases.running(first, 104.0)
    leases.renew([SOURCE], 3.0, 110.0)  # its heartbeats lease both
    assert leases.running(first, 112.0) and leases.running(second, 212.9)
    leases.done([SOURCE])
    assert not leases.running(first, 112.0) and not leases.running(second, 112.0)
    leases.began([SOURCE], 120.0)  # after a done, nothing is adopted
    assert not leases.running(first, 120.5)


def test_a_zero_lease_or_a_zero_wait_waits_for_nothing() -> None:
    leases = BatchLeases(100.0)
    leases.began([SOURCE], 0.0)
    tag = leases.tag(SOURCE)
    assert tag is not None
    leases.renew([SOURCE], 3.0, 1.0)
    leases.renew([SOURCE], 0.0, 2.0)  # the driver ends the lease itself
    assert not leases.running(tag, 2.0)
    none = BatchLeases(0.0)  # --lapsed-batch-timeout-s 0: as before the wait existed
    none.began([SOURCE], 0.0)
    tag = none.tag(SOURCE)
    assert tag is not None
    none.renew([SOURCE], 3.0, 1.0)
    assert none.running(tag, 3.9) and not none.running(tag, 4.0)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), True, "600"])
def test_a_bad_lapsed_wait_is_refused(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ConfigError, match="lapsed"):
        BatchLeases(bad)  # type: ignore[arg-type]


def test_serve_takes_the_wait_and_its_default_is_the_cores(tmp_path: Path) -> None:
    from ftlayer.cli import _parser, serve
    from ftlayer.core.leases import DEFAULT_LAPSED_S
    from ftlayer.server import FTServer

    assert serve.LAPSED_DEFAULT_S == DEFAULT_LAPSED_S
    args = _parser().parse_args(["serve", "--data-dir", "d"])
    assert args.lapsed_batch_timeout_s == DEFAULT_LAPSED_S
    args = _parser().parse_args(["serve", "--data-dir", "d", "--lapsed-batch-timeout-s", "0"])
    assert args.lapsed_batch_timeout_s == 0.0
    with FTServer(tmp_path / "data", lapsed_batch_timeout_s=45.0) as server:
        assert server.lapsed_batch_timeout_s == 45.0
        assert server._ft is not None and server._ft._s.leases.lapsed_s == 45.0
    with pytest.raises(ConfigError, match="lapsed"):
        FTServer(tmp_path / "data", lapsed_batch_timeout_s=-1.0)
