"""Timeouts that follow progress (ftlayer.core.leases): a tree does not time out while
the batch carrying it is open and its driver's heartbeats lease it; once the batch is
done, or the lease lapsed and the lapsed batch's wait ended, it times out within
T*(1+1/(n-1)); trees of an earlier batch, and of sources without heartbeats, time out
as before. Most tests here turn the lapsed wait off (`lapsed_batch_timeout_s=0`) to
see the lease alone; tests/core/test_lapsed.py tests the wait, and the property here
both."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from manual_clock import Clock

from ftlayer.acking.ids import new_ids
from ftlayer.checkpoint import CheckpointCoordinator, CheckpointMode
from ftlayer.core import FTLayer
from ftlayer.core.leases import BatchLeases
from ftlayer.errors import ConfigError
from ftlayer.persistence import MemoryStorage
from ftlayer.records import RecordBatch

T = 10.0  # with 3 buckets a tree times out between 10 and 15 s after its persist
BOUND = 15.0
TICK = 0.5
SOURCE, OTHER = 7, 8


def _layer(lapsed: float = 0.0) -> tuple[FTLayer, Clock]:
    clock = Clock()
    ft = FTLayer(
        MemoryStorage(), timeout_s=T, buckets=3, clock=clock, lapsed_batch_timeout_s=lapsed
    )
    return ft, clock


_NEXT_OFFSET = itertools.count()


def _persist(ft: FTLayer, n: int, source: int = SOURCE) -> np.ndarray:
    """n records of `source` that nobody acks (their events were lost), at offsets no
    earlier call used (a record read again would take the earlier one over)."""
    first = next(_NEXT_OFFSET) * 1_000_000
    batch = RecordBatch.build(
        new_ids(n),
        [b"r"] * n,
        source_ids=source,
        topics="t",
        partitions=0,
        offsets=np.arange(first, first + n),
    )
    ft.persist(batch, new_ids(n))
    return batch.roots


def _pending(ft: FTLayer, roots: np.ndarray) -> bool:
    return all(int(r) in ft.acker for r in roots)


def _run(ft: FTLayer, clock: Clock, until: float, beat: list[int] | None = None) -> None:
    """Tick every 0.5 s up to `until`, heartbeating `beat` every 1 s (lease 3 s)."""
    while clock.now < until - 1e-9:
        clock.now = round(clock.now + TICK, 6)
        if beat is not None and clock.now % 1.0 == 0:
            ft.heartbeat(beat, 3.0)
        ft.tick()


def _until_timed_out(ft: FTLayer, clock: Clock, roots: np.ndarray, limit: float) -> float:
    """Tick until `roots` timed out (asserting by `limit`); the time they did."""
    while _pending(ft, roots):
        assert clock.now <= limit, f"not timed out by {limit} s"
        clock.now = round(clock.now + TICK, 6)
        ft.tick()
    return clock.now


def test_a_running_batch_leased_by_heartbeats_never_times_out() -> None:
    ft, clock = _layer()
    ft.batch_began([SOURCE])
    ft.heartbeat([SOURCE], 3.0)
    roots = _persist(ft, 5)
    _run(ft, clock, 3 * T + 5, beat=[SOURCE])  # a step three times the timeout, and more
    assert _pending(ft, roots)
    stats = ft.current_stats()
    assert stats.failed["timeout"] == 0 and stats.persisted == 5 and ft.replay_cursor == 0
    assert stats.timeouts_postponed >= 2 * 5  # expired twice at least, postponed each time
    assert stats.batches_running == {str(SOURCE): {"running_s": 35.0, "lease_s": 3.0}}


def test_once_the_heartbeats_stop_the_trees_time_out_within_the_bound_after_the_lease() -> None:
    ft, clock = _layer()
    ft.batch_began([SOURCE])
    roots = _persist(ft, 5)
    _run(ft, clock, 35.0, beat=[SOURCE])  # the last heartbeat at 35 s leases until 38 s
    lapsed = 38.0
    timed_out = _until_timed_out(ft, clock, roots, lapsed + BOUND + TICK)
    assert timed_out >= lapsed  # never while the lease held
    assert ft.current_stats().failed["timeout"] == 5
    assert len(ft.fetch_replay(0, ft.replay_cursor)) == 5
    assert ft.current_stats().batches_running[str(SOURCE)]["lease_s"] == 0.0


def test_a_batch_reported_done_lets_its_unfinished_trees_time_out_within_the_bound() -> None:
    ft, clock = _layer()
    ft.batch_began([SOURCE])
    roots = _persist(ft, 3)
    _run(ft, clock, 30.0, beat=[SOURCE])
    ft.batch_done([SOURCE])  # an event was lost: done, but not complete
    assert ft.heartbeat([SOURCE], 3.0) == 0  # a late heartbeat renews nothing
    timed_out = _until_timed_out(ft, clock, roots, 30.0 + BOUND + TICK)
    assert timed_out >= T
    assert ft.current_stats().batches_running == {}


def test_trees_of_an_earlier_batch_time_out_as_before_while_the_next_batch_runs() -> None:
    ft, clock = _layer()
    ft.batch_began([SOURCE])
    ft.heartbeat([SOURCE], 3.0)
    earlier = _persist(ft, 4)  # at 0 s, in batch n, which loses an event
    _run(ft, clock, 2.0, beat=[SOURCE])
    ft.batch_done([SOURCE])  # batch n done; n + 1 begins at once (one BEGIN)
    ft.batch_began([SOURCE])
    later = _persist(ft, 4)  # at 2 s, in batch n + 1, which keeps running
    timed_out = _until_timed_out_beating(ft, clock, earlier, BOUND + TICK)
    assert timed_out >= T
    _run(ft, clock, 3 * T, beat=[SOURCE])
    assert _pending(ft, later) and ft.current_stats().failed["timeout"] == 4


def _until_timed_out_beating(ft: FTLayer, clock: Clock, roots: np.ndarray, limit: float) -> float:
    while _pending(ft, roots):
        assert clock.now <= limit, f"not timed out by {limit} s"
        _run(ft, clock, clock.now + TICK, beat=[SOURCE])
    return clock.now


def test_sources_without_heartbeats_or_an_open_batch_time_out_as_before() -> None:
    ft, clock = _layer()
    ft.batch_began([SOURCE, OTHER])  # one query, two topics; only SOURCE heartbeats
    leased, unleased = _persist(ft, 2), _persist(ft, 2, OTHER)
    ft.batch_done([OTHER])
    assert ft.heartbeat([OTHER], 3.0) == 0
    ft.batch_began([OTHER])  # OTHER's next batch, never leased
    _run(ft, clock, BOUND + TICK, beat=[SOURCE])
    assert not _pending(ft, unleased[:1]) and not _pending(ft, unleased[1:])
    assert _pending(ft, leased)
    assert ft.current_stats().failed["timeout"] == 2


def test_a_replay_read_by_the_running_batch_follows_its_lease_too() -> None:
    ft, clock = _layer()
    roots = _persist(ft, 2)  # no batch open: the plain timeout
    _until_timed_out(ft, clock, roots, BOUND + TICK)
    ft.batch_began([SOURCE])
    ft.heartbeat([SOURCE], 3.0)
    replay = ft.fetch_replay(0, ft.replay_cursor, source_id=SOURCE)
    assert len(replay) == 2
    start = clock.now
    _run(ft, clock, start + 3 * T, beat=[SOURCE])
    assert _pending(ft, replay.records.roots) and ft.current_stats().failed["timeout"] == 2
    _until_timed_out(ft, clock, replay.records.roots, clock.now + 3.0 + BOUND + TICK)


def test_the_barrier_opens_the_batch_and_its_completion_closes_it() -> None:
    ft, clock = _layer()
    coordinator = CheckpointCoordinator(ft)
    position = {"kafka": {"t": {"0": 5}}, "replay": 0}
    coordinator.begin("job", position, [SOURCE], CheckpointMode.UNALIGNED)
    assert ft.heartbeat([SOURCE], 3.0) == 1
    roots = _persist(ft, 3)
    _run(ft, clock, 3 * T, beat=[SOURCE])
    assert _pending(ft, roots)
    coordinator.done("job", position, [SOURCE], CheckpointMode.UNALIGNED)
    assert ft.current_stats().batches_running == {}
    _until_timed_out(ft, clock, roots, 3 * T + BOUND + TICK)


@pytest.mark.parametrize("lease", [-1.0, float("nan"), float("inf")])
def test_a_bad_lease_is_refused(lease: float) -> None:
    ft, _ = _layer()
    ft.batch_began([SOURCE])
    with pytest.raises(ConfigError, match="lease"):
        ft.heartbeat([SOURCE], lease)


def test_a_heartbeat_leases_only_the_batch_open_now() -> None:
    leases = BatchLeases(0.0)
    assert leases.renew([SOURCE], 5.0, 0.0) == 0 and leases.tag(SOURCE) is None
    leases.began([SOURCE], 1.0)
    first = leases.tag(SOURCE)
    assert first is not None and not leases.running(first, 1.0)  # no heartbeat yet
    assert leases.renew([SOURCE, OTHER], 5.0, 2.0) == 1
    assert leases.running(first, 6.9) and not leases.running(first, 7.0)
    leases.began([SOURCE], 3.0)  # Spark plans the batch again (a restart): adopted
    again = leases.tag(SOURCE)
    assert again != first and leases.running(first, 3.5) and leases.running(again, 3.5)
    leases.renew([SOURCE], 0.0, 4.0)  # a zero lease ends it
    assert again is not None and not leases.running(again, 4.0)
    assert not leases.running(first, 4.0)


# ---- the property --------------------------------------------------------------------


@dataclass
class _Model:
    """What the FT layer should know: the open batch, the batches it adopted, its lease
    and wait, per the schedule."""

    lapsed: float
    batch: int = 0  # 0: none open
    adopted: set[int] = field(default_factory=set)
    lease_until: float = float("-inf")
    lapses: bool = False
    wait_until: float = float("-inf")
    root_batch: dict[int, int] = field(default_factory=dict)
    persisted_at: dict[int, float] = field(default_factory=dict)

    def waited_until(self) -> float:
        if self.lapses:
            return max(self.lease_until + self.lapsed, self.wait_until)
        return max(self.lease_until, self.wait_until)

    def group(self) -> set[int]:
        return {self.batch, *self.adopted} if self.batch else set()

    def running(self, batch: int, now: float) -> bool:
        return batch in self.group() and now < self.waited_until()


@settings(max_examples=150, deadline=None)
@given(
    timeout=st.floats(1.0, 30.0),
    buckets=st.integers(2, 5),
    beat_fraction=st.floats(0.05, 0.25),
    boundaries=st.lists(st.floats(0.0, 6.0), max_size=4),
    restarts=st.lists(st.floats(0.0, 8.0), max_size=3),
    persists=st.lists(st.floats(0.0, 6.0), min_size=1, max_size=10),
    stop_beats=st.floats(0.0, 8.0),
    lapsed_fraction=st.one_of(st.just(0.0), st.floats(0.0, 3.0)),
    tick_fraction=st.floats(0.01, 0.5),
    jitter=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=30),
)
def test_no_tree_times_out_while_its_batch_runs_and_every_one_does_within_the_bound(
    timeout: float,
    buckets: int,
    beat_fraction: float,
    boundaries: list[float],
    restarts: list[float],
    persists: list[float],
    stop_beats: float,
    lapsed_fraction: float,
    tick_fraction: float,
    jitter: list[float],
) -> None:
    """Batches begin (a BEGIN that also completes the batch before) at random moments,
    the driver heartbeats every `beat` seconds (lease 3 beats) until it stops, it is
    restarted at random moments (a BEGIN without a done: the batch planned again adopts
    the open one), records are persisted at random moments and never acked, and the FT
    layer is ticked at irregular moments at most d apart. Every tree times out, never
    before T after its persist, never while its batch (or the one that adopted it) is
    open and leased or within the wait after its lease lapsed (`lapsed`), and by
    max(persist, the end of that batch's lease and wait, or of the batch) +
    T*(1+1/(n-1)) + n*d."""
    clock = Clock()
    lapsed = lapsed_fraction * timeout
    ft = FTLayer(
        MemoryStorage(),
        timeout_s=timeout,
        buckets=buckets,
        clock=clock,
        lapsed_batch_timeout_s=lapsed,
    )
    beat = beat_fraction * timeout
    lease = 3 * beat
    d = tick_fraction * timeout / (buckets - 1)
    expiry = timeout * buckets / (buckets - 1)
    events: list[tuple[float, str]] = [(t * timeout, "begin") for t in boundaries]
    events += [(t * timeout, "restart") for t in restarts]
    events += [(t * timeout, "persist") for t in persists]
    stop = stop_beats * timeout
    events += [(k * beat, "beat") for k in range(int(stop / beat) + 1)]
    events.sort()
    model = _Model(lapsed)
    batches = 0
    ends: dict[int, float] = {}  # batch number -> when it stopped being waited for
    failed_at: dict[int, float] = {}
    step = 0
    while events or len(failed_at) < len(model.persisted_at):
        clock.now += d * (0.05 + 0.95 * jitter[step % len(jitter)])
        step += 1
        while events and events[0][0] <= clock.now:
            at, what = events.pop(0)
            if what in ("begin", "restart"):  # events happen at the tick that finds them
                batches += 1
                if what == "begin":
                    for b in model.group():
                        ends[b] = min(ends[b], clock.now)
                    ft.batch_done([SOURCE])
                    model.adopted, model.wait_until = set(), float("-inf")
                elif model.batch:
                    model.adopted = model.group()
                    model.wait_until = model.waited_until()
                else:
                    model.adopted, model.wait_until = set(), float("-inf")
                ft.batch_began([SOURCE])
                model.batch, model.lease_until, model.lapses = batches, float("-inf"), False
            elif what == "beat":
                if ft.heartbeat([SOURCE], lease) and model.batch:
                    model.lease_until, model.lapses = clock.now + lease, True
            else:
                root = int(_persist(ft, 1)[0])
                model.root_batch[root] = model.batch
                model.persisted_at[root] = clock.now
            for b in model.group():  # not running until a heartbeat or a wait holds it
                ends[b] = model.waited_until()
        ft.tick()
        for root, batch in model.root_batch.items():
            if root not in failed_at and root not in ft.acker:
                failed_at[root] = clock.now
                assert clock.now - model.persisted_at[root] >= timeout - 1e-9
                assert not model.running(batch, clock.now), "timed out while waited for"
        assert clock.now < 20 * (expiry + stop + lapsed + 10 * timeout), "never timed out"
    for root, at in failed_at.items():
        batch = model.root_batch[root]
        end = ends[batch] if batch else model.persisted_at[root]
        bound = max(model.persisted_at[root], end) + expiry + buckets * d
        assert at <= bound + 1e-9, (at, bound)
    assert ft.stats.failed["timeout"] == len(model.persisted_at)
