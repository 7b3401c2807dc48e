"""A ticker that sleeps until `FTLayer.tick_delay` (the server's, ftlayer.server.workers)
misses nothing: driven only at the moments it names, the core times every root out
inside the timeout's bound, queues every failed record at most RELEASE_AFTER_S after
its backoff's end, and drops the stale sink holds, as a ticker that never sleeps
would."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from manual_clock import Clock

from ftlayer.acking.ids import new_ids
from ftlayer.causes import Cause, FailKind
from ftlayer.core import FTLayer
from ftlayer.core.layer import RELEASE_AFTER_S
from ftlayer.core.retries import RetryPolicy
from ftlayer.core.sinkholds import SINK_KEY_BIT
from ftlayer.persistence import MemoryStorage
from ftlayer.records import RecordBatch
from ftlayer.registration import SourceRegistration

SOURCE = 3
SLACK = 0.001  # the server's ticker wakes this long after the work it sleeps until
WALL = 1000.0  # the wall clock runs this far ahead of the monotonic one
CAUSE = Cause(FailKind.EXPLICIT, "enrich", "FailException: lookup timed out")


class _SleepyTicker:
    """The core, and a ticker that ticks only when `tick_delay` says (plus SLACK)."""

    def __init__(self, timeout: float, buckets: int, backoff_ms: int) -> None:
        self.clock, self.wall = Clock(), Clock(WALL)
        self.ft = FTLayer(
            MemoryStorage(),
            timeout_s=timeout,
            buckets=buckets,
            clock=self.clock,
            wall_clock=self.wall,
            seed=7,
        )
        policy = RetryPolicy(max_retries=100, backoff_ms=backoff_ms, backoff_max_ms=backoff_ms)
        self.ft.register_source(SourceRegistration(SOURCE, "forward", 2, retry=policy))
        self.ticks: list[float] = []
        self.wake = float("inf")  # when the ticker wakes next

    def move(self, now: float) -> None:
        self.clock.now, self.wall.now = now, now + WALL

    def changed(self) -> None:
        """After a request: as the server's `_wake_workers`, wake the ticker to sleep
        again if its work came sooner than it sleeps (by more than 2 * SLACK)."""
        delay = self.ft.tick_delay()
        if self.wake - self.clock.now > delay + 2 * SLACK:
            self.wake = self.clock.now + max(delay, 0.0) + SLACK

    def sleep_until(self, end: float, on_tick: Callable[[], None]) -> None:
        """Tick at every moment the ticker wakes before `end`, calling on_tick after."""
        while self.wake <= end:
            self.move(self.wake)
            self.ft.tick()
            self.ticks.append(self.wake)
            on_tick()
            self.wake = self.clock.now + max(self.ft.tick_delay(), 0.0) + SLACK
        self.move(end)


@settings(max_examples=150, deadline=None)
@given(
    timeout=st.floats(1.0, 30.0),
    buckets=st.integers(2, 5),
    backoff_ms=st.integers(0, 5000),
    steps=st.lists(
        st.tuples(st.floats(0.0, 1.0), st.sampled_from(["persist", "fail", "hold"])),
        min_size=1,
        max_size=25,
    ),
)
def test_a_ticker_sleeping_until_tick_delay_times_out_queues_and_drops_on_time(
    timeout: float, buckets: int, backoff_ms: int, steps: list[tuple[float, str]]
) -> None:
    """Records persisted at random moments, some failed by a task and some held by a
    sink that never settles: each root that is not failed times out between T and
    T*(1+1/(n-1)) after its persist (n milliseconds at most past it), each failed
    record is queued for replay at most RELEASE_AFTER_S (and the ticker's slack)
    after its backoff's end (never before), and the sink's holds go at the first
    rotation after their roots are gone. The ticker wakes only for that work: never
    while nothing is pending or waiting."""
    t = _SleepyTicker(timeout, buckets, backoff_ms)
    ft = t.ft
    # Each rotation comes SLACK late and the next is due an interval after it
    # (ftlayer.acking.rotating: n * d for ticks at most d late).
    bound = timeout * (1 + 1 / (buckets - 1)) + buckets * SLACK + 1e-9
    persisted: dict[int, tuple[int, float]] = {}  # root -> (seq, persisted at)
    failed: set[int] = set()  # failed by the task
    timed_out: dict[int, float] = {}
    held_at: list[float] = []
    holds_gone_at: list[float] = []
    released_by: list[tuple[float, float]] = []  # (tick, latest due released by it)
    last_tick = [0.0]

    def due_times() -> list[float]:
        """Backoff ends (monotonic) of every record that failed so far."""
        out = []
        for seq, _ in persisted.values():
            record = ft.retry_record(seq)
            if record is not None and record.attempts:
                out.append(record.due - WALL)
        return out

    def observe() -> None:
        now = t.clock.now
        roots = np.fromiter(persisted, dtype=np.uint64, count=len(persisted))
        pending = ft.acker.lookup("ack", roots)[0]
        for root, live in zip(roots.tolist(), pending.tolist(), strict=True):
            if not live and root not in failed and root not in timed_out:
                timed_out[root] = now
        dues = due_times()
        # Queued for replay: every record whose backoff ended by now, and no other.
        assert ft.waiting_replays == sum(due > now for due in dues), (now, dues)
        ended = [due for due in dues if last_tick[0] < due <= now]
        if ended:
            released_by.append((now, min(ended)))
        if held_at and not holds_gone_at and not ft.open_holds:
            holds_gone_at.append(now)
        last_tick[0] = now

    now = 0.0
    for gap, kind in steps:
        now += gap * timeout
        t.sleep_until(now, observe)
        pending = [r for r in persisted if r not in failed and r not in timed_out]
        if kind == "persist" or not pending or (kind == "hold" and held_at):
            roots = new_ids(2)
            first = len(persisted) + 1  # MemoryStorage numbers records 1, 2, ...
            ft.persist(
                RecordBatch.build(
                    roots,
                    [b"a", b"b"],
                    source_ids=SOURCE,
                    topics="orders",
                    partitions=[0, 1],
                    offsets=[first, first + 1],
                )
            )
            for i, root in enumerate(roots.tolist()):
                persisted[root] = (first + i, now)
        elif kind == "fail":
            ft.fail(np.array(pending[:1], dtype=np.uint64), CAUSE)
            failed.add(pending[0])
        else:
            values = np.arange(1, len(pending) + 1, dtype=np.uint64)
            ft.sink_hold(SINK_KEY_BIT | 1, np.array(pending, dtype=np.uint64), values)
            held_at.append(now)
        t.changed()
    end = now + 3 * bound + backoff_ms / 1000 + timeout
    t.sleep_until(end, observe)

    for root, (_, at) in persisted.items():
        if root in failed:
            continue
        assert root in timed_out, "a root never timed out"
        waited = timed_out[root] - at
        assert timeout <= waited <= bound, (waited, timeout, bound)
    for tick, due in released_by:  # queued at the first tick after its due time
        assert tick - due <= RELEASE_AFTER_S + 2 * SLACK + 1e-9, (tick, due)
    assert ft.waiting_replays == 0
    assert ft.queued_replays == len(persisted)
    if held_at:
        # Dropped at the first rotation after the sink's key is a timeout old and its
        # roots are gone: the last root's timeout, then at most a rotation interval.
        assert holds_gone_at, "the stale sink holds were never dropped"
        interval = timeout / (buckets - 1)
        latest = max(held_at[0] + timeout, max(timed_out.values(), default=0.0))
        assert holds_gone_at[0] <= latest + interval + SLACK + 1e-9
    # Nothing left to do: the ticker sleeps (no wake in the last third of the run).
    assert ft.tick_delay() == float("inf") or ft.open_holds
    assert not [tick for tick in t.ticks if tick > end - bound] or ft.open_holds
