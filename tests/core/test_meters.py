"""Meters: per-source counters and the complete latency (persist to completion)."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from manual_clock import Clock

from ftlayer.acking.ids import new_ids
from ftlayer.causes import Cause
from ftlayer.core import FTLayer, ReplayQueue
from ftlayer.core.meters import (
    CAPACITY,
    EDGES_S,
    EXPORTED_EDGES_S,
    RESOLUTION_S,
    LatencyHistogram,
    Meters,
    PersistTimes,
)
from ftlayer.persistence import MemoryStorage
from ftlayer.policy import RetryPolicy
from ftlayer.records import RecordBatch

_NEXT_OFFSET = itertools.count()


def _records(n: int, source: int = 7, topic: str = "orders") -> RecordBatch:
    """n new records, at offsets no earlier call used (a record read again would take
    the earlier copy over: ftlayer.core.takeover)."""
    first = next(_NEXT_OFFSET) * 1_000_000
    return RecordBatch.build(
        new_ids(n),
        [b"v%d" % i for i in range(n)],
        source_ids=source,
        topics=topic,
        partitions=np.zeros(n, dtype=np.int32),
        offsets=np.arange(first, first + n),
    )


def _emit(ft: FTLayer, batch: RecordBatch) -> np.ndarray:
    ids = new_ids(len(batch))
    ft.persist(batch, ids)
    return ids


def test_the_ring_reaches_past_the_top_bucket_edge() -> None:
    # A record older than the ring is counted above the top edge: it must be.
    assert EDGES_S[-1] < CAPACITY * RESOLUTION_S
    assert set(EXPORTED_EDGES_S) <= set(EDGES_S.tolist())
    assert bool(np.all(np.diff(EDGES_S) > 0))


@settings(max_examples=60, deadline=None)
@given(
    calls=st.lists(
        st.tuples(st.integers(1, 50), st.floats(0.0, 0.01, allow_nan=False)),
        min_size=1,
        max_size=60,
    ),
    capacity=st.integers(1, 16),
    resolution=st.sampled_from([0.0, 0.002]),
)
def test_the_ring_gives_each_seq_its_persist_calls_time_or_nan_past_its_reach(
    calls: list[tuple[int, float]], capacity: int, resolution: float
) -> None:
    ring = PersistTimes(capacity, resolution)
    kept: list[tuple[int, float]] = []  # the model: entries not coalesced
    seq, now = 1, 0.0
    truth: list[tuple[int, float]] = []  # (seq, the time of its persist call)
    for size, step in calls:
        now += step
        ring.add(seq, now)
        if not kept or now - kept[-1][1] >= resolution:
            kept.append((seq, now))
        truth += [(s, now) for s in range(seq, seq + size)]
        seq += size
    kept = kept[-capacity:]
    seqs = np.array([s for s, _ in truth], dtype=np.uint64)
    rng = np.random.default_rng(len(truth))
    order = rng.permutation(len(seqs))
    found = ring.times_of(seqs[order])
    for (s, at), got in zip([truth[i] for i in order.tolist()], found.tolist(), strict=True):
        entries = [t for first, t in kept if first <= s]
        if s < kept[0][0]:
            assert math.isnan(got)
        else:
            # Its call's time, or an earlier call's within the resolution.
            assert got == entries[-1] and at - resolution <= got <= at
    assert ring.oldest == kept[0][1]


@settings(max_examples=80, deadline=None)
@given(
    latencies=st.lists(st.floats(0.0, 150.0, allow_nan=False), min_size=1, max_size=300),
    q=st.sampled_from([0.5, 0.9, 0.99]),
)
def test_a_quantile_lies_in_the_bucket_of_the_true_one(latencies: list[float], q: float) -> None:
    values = np.array(latencies)
    histogram = LatencyHistogram()
    histogram.counts += np.bincount(
        np.searchsorted(EDGES_S, values, side="left"), minlength=len(EDGES_S) + 1
    )
    estimate = histogram.quantile(q)
    assert estimate is not None
    true = float(np.sort(values)[math.ceil(q * len(values)) - 1])  # Prometheus' rank
    bucket = int(np.searchsorted(EDGES_S, true, side="left"))
    if bucket == len(EDGES_S):
        assert estimate == EDGES_S[-1]
    else:
        lower = float(EDGES_S[bucket - 1]) if bucket else 0.0
        assert lower <= estimate <= EDGES_S[bucket]
        assert estimate <= true * 1.28 + 1e-4 and true <= estimate * 1.28 + 1e-4


def test_complete_latency_is_persist_to_completion_per_source() -> None:
    clock = Clock(100.0)
    ft = FTLayer(MemoryStorage(), timeout_s=30, clock=clock)
    fast, slow = _records(40, source=1, topic="a"), _records(10, source=2, topic="b")
    fast_ids, slow_ids = _emit(ft, fast), _emit(ft, slow)
    clock.now += 0.004
    ft.xor(fast.roots, fast_ids)
    clock.now += 2.0
    ft.xor(slow.roots, slow_ids)
    stats = ft.current_stats()
    a, b = stats.by_source["1"], stats.by_source["2"]
    assert a["persisted"] == a["completed"] == 40 and b["completed"] == 10
    assert a["complete_latency"]["count"] == 40
    assert math.isclose(a["complete_latency"]["sum_s"], 40 * 0.004, rel_tol=1e-6)
    assert 0.004 / 1.28 <= a["complete_latency"]["p50_s"] <= 0.004 * 1.28
    assert 2.004 / 1.28 <= b["complete_latency"]["p99_s"] <= 2.004 * 1.28
    # Together: the 99th percentile is one of the slow ones, the median a fast one.
    total = stats.complete_latency
    assert total["count"] == 50 and total["p50_s"] < 0.01 and total["p99_s"] > 1.5


def test_replays_count_as_completed_but_not_in_the_latency() -> None:
    clock, wall = Clock(), Clock(1000.0)
    ft = FTLayer(
        MemoryStorage(),
        timeout_s=30,
        clock=clock,
        wall_clock=wall,
        retry=RetryPolicy(max_retries=1, backoff_ms=0, backoff_max_ms=0),
    )
    batch = _records(4)
    ids = _emit(ft, batch)
    ft.fail(batch.roots[:2], Cause())
    clock.now += 1.0
    ft.xor(batch.roots[2:], ids[2:])  # first attempts: 1 s
    replays = ft.fetch_replay(0, ft.replay_cursor).records
    assert len(replays) == 2
    clock.now += 50.0
    # A replay's root waits at ack value 0 until its source emits it: emit and ack one.
    emission = new_ids(1)
    ft.xor(replays.roots[1:], emission)
    ft.xor(replays.roots[1:], emission)
    ft.fail(replays.roots[:1], Cause())  # its retry spent: a dead letter
    stats = ft.current_stats()
    source = stats.by_source["7"]
    assert stats.completed == 3 and source["completed"] == 3
    assert source["failed"] == {"explicit": 3, "timeout": 0, "recovery": 0, "source-expired": 0}
    assert source["replayed"] == stats.replayed == 2
    assert source["dead_lettered"] == stats.dead_lettered == 1
    latency = stats.complete_latency
    assert latency["count"] == 2 and math.isclose(latency["sum_s"], 2.0)
    assert latency["p99_s"] <= 1.28


def test_records_recovered_at_the_start_are_not_measured() -> None:
    storage, clock = MemoryStorage(), Clock()
    first = FTLayer(storage, timeout_s=30, clock=clock)
    first.persist(_records(3))
    again = FTLayer(storage, timeout_s=30, clock=clock)  # a restart: recovery replays all
    replays = again.fetch_replay(0, again.replay_cursor).records
    emission = new_ids(len(replays))
    again.xor(replays.roots, emission)
    fresh = _records(2)
    fresh_ids = _emit(again, fresh)
    clock.now += 0.5
    again.xor(replays.roots, emission)
    again.xor(fresh.roots, fresh_ids)
    stats = again.current_stats()
    assert stats.completed == 5 and stats.failed["recovery"] == 3
    assert stats.complete_latency["count"] == 2
    assert stats.by_source["7"]["failed"]["recovery"] == 3


def test_a_tree_older_than_the_ring_counts_above_the_top_edge() -> None:
    clock = Clock()
    ft = FTLayer(MemoryStorage(), timeout_s=1000, clock=clock)
    # A ring of two entries at most one a minute reaches back 120 s (the real one: 131 s).
    ft.meters = Meters(capacity=2, resolution_s=60.0)
    old = _records(1)
    old_ids = _emit(ft, old)
    for _ in range(3):
        clock.now += 60.0
        ft.persist(_records(1))
    clock.now += 1.0
    ft.xor(old.roots, old_ids)  # 181 s after its persist
    histogram = ft.meters.by_source(ft.persistence.number_sources())[7].latency
    assert histogram.count == 1 and int(histogram.counts[-1]) == 1
    assert histogram.exported()[-1] == (math.inf, 1) and histogram.exported()[-2] == (100.0, 0)
    assert histogram.quantile(0.5) == 100.0


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(
        st.one_of(
            st.lists(st.integers(1, 3), min_size=1, max_size=8).map(lambda s: ("append", s)),
            st.tuples(st.just("prune"), st.integers(0, 40), st.sampled_from([None, 1, 2, 3])),
        ),
        max_size=25,
    )
)
def test_the_replay_queue_counts_each_sources_entries(steps: list[tuple[Any, ...]]) -> None:
    queue = ReplayQueue()
    for step in steps:
        if step[0] == "append":
            sources = np.array(step[1], dtype=np.uint32)
            n = len(sources)
            seqs = queue.reserve(n, lambda _next: None)
            ids = new_ids(n)
            queue.append(seqs, ids, seqs, sources, np.zeros(n, dtype=np.int32))
        else:
            queue.prune(step[1], step[2])
        column = queue.columns()["source_id"]
        ids, counts = np.unique(column, return_counts=True)
        expected = dict(zip(ids.tolist(), counts.tolist(), strict=True))
        assert queue.counts() == expected


@settings(max_examples=80, deadline=None)
@given(
    calls=st.lists(
        st.tuples(st.integers(1, 40), st.floats(0.0, 3.0, allow_nan=False)),
        min_size=1,
        max_size=40,
    ),
    capacity=st.integers(1, 12),
    picks=st.lists(st.integers(0, 10**6), max_size=200),
    later=st.floats(0.0, 200.0, allow_nan=False),
)
def test_completions_land_in_the_bucket_of_their_own_latency(
    calls: list[tuple[int, float]], capacity: int, picks: list[int], later: float
) -> None:
    """The histogram of a batch of completions (any order, a ring wrapped or not) is
    what one latency per record gives: now minus its persist call's time, and a record
    older than the ring above the top edge."""
    meters = Meters(capacity, 0.0)
    seq, now = 1, 0.0
    for size, step in calls:
        now += step
        meters.persisted(np.zeros(size, dtype=np.uint32), seq, now)
        seq += size
    done = np.unique(np.array([1 + p % (seq - 1) for p in picks], dtype=np.uint64))
    done = done[np.random.default_rng(len(done)).permutation(len(done))]
    end = now + later
    meters.completed(done, np.zeros(len(done), dtype=np.int32), None, end)
    got = meters.by_source(np.zeros(1, dtype=np.uint32))
    times = meters.persist_times.times_of(done)
    known = np.maximum(end - times[~np.isnan(times)], 0.0)
    expected = np.bincount(np.searchsorted(EDGES_S, known, side="left"), minlength=len(EDGES_S) + 1)
    expected[-1] += int(np.isnan(times).sum())
    if not len(done):
        assert got.get(0) is None or got[0].latency.count == 0
        return
    latency = got[0].latency
    assert latency.counts.tolist() == expected.tolist()
    older = int(np.isnan(times).sum()) * max(0.0, end - meters.persist_times.oldest)
    assert math.isclose(latency.sum_s, float(known.sum()) + older, rel_tol=1e-9, abs_tol=1e-9)
