"""Properties over random topologies, event orders and failures.

A random pipeline (maps, flat_maps with fan-out 0..3, filters that emit nothing,
multi-anchored aggregates) processes random keyed source records. Each record may be
failed explicitly (FailException) or silently lost by its task. All XOR and fail events
are then delivered to the FT layer in a random order and random batches, and the clock
runs past the timeout. Then:

1. Every source record ends exactly one way: complete once, or failed and queued for
   replay (under a new root, in the replay queue).
2. No tree is reported complete before every one of its events arrived, and no tree
   with a failed or lost record completes (barring the 2**-64 XOR collision).
3. Replayed records are routed to the partition Kafka's own partitioner put the
   original in (kafka-python's murmur2), and a replay round without failures
   completes every replayed record, leaving the storage empty.

The batch may run under a heartbeat lease whose driver dies after the events
(ftlayer.core.leases): its silent trees then wait past every timeout for the source's
next barrier, and fail only once it came and its batch is done (a restarted driver),
or once the lapsed batch's wait ended with none (the fallback); 1-3 hold all the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka.partitioner.default import murmur2  # type: ignore[import-untyped]
from manual_clock import Clock
from numpy.typing import ArrayLike, NDArray

from ftlayer.acking.handlers import Anchors, Persister, TaskHandler
from ftlayer.core import FTLayer, SourceConfig
from ftlayer.partitioners import kafka_key_hashes
from ftlayer.persistence import Completed, MemoryStorage
from ftlayer.records import RecordBatch

PARTITIONS = 3
TIMEOUT = 10.0
LAPSED = 100.0
SOURCE = 0  # the Persister's default source id


@dataclass
class Capture:
    """A channel that persists at once (as a source must) but keeps events for later."""

    ft: FTLayer
    xor_roots: list[NDArray[np.uint64]] = field(default_factory=list)
    xor_values: list[NDArray[np.uint64]] = field(default_factory=list)
    fails: list[NDArray[np.uint64]] = field(default_factory=list)

    def persist(self, batch: RecordBatch, initial_values: ArrayLike | None = None) -> None:
        self.ft.persist(batch, initial_values)

    def xor(self, roots: ArrayLike, values: ArrayLike) -> object:
        self.xor_roots.append(np.asarray(roots, dtype=np.uint64))
        self.xor_values.append(np.asarray(values, dtype=np.uint64))
        return None

    def fail(self, roots: ArrayLike, causes: object = None) -> object:
        self.fails.append(np.asarray(roots, dtype=np.uint64))
        return None


stage_kinds = st.sampled_from(["map", "flat_map", "filter", "group"])


def _kafka_partition(key: bytes) -> int:
    return (murmur2(key) & 0x7FFFFFFF) % PARTITIONS


def _run_stage(
    data: st.DataObject, kind: str, records: Anchors, task: TaskHandler, doomed: set[int]
) -> Anchors:
    """One task over `records`; some inputs fail explicitly, some are silently lost."""
    n = len(records)
    fate = data.draw(
        st.lists(st.sampled_from(["ok"] * 6 + ["fail", "lost"]), min_size=n, max_size=n)
    )
    fate_a = np.array(fate, dtype=object)
    for i in np.flatnonzero(fate_a != "ok").tolist():
        doomed.update(r for r, _ in records.pairs(i))
    live = records.take(fate_a != "lost")  # a lost input is neither acked nor failed
    failed = (fate_a[fate_a != "lost"] == "fail").astype(bool)
    m = len(live)
    if kind == "group":
        k = data.draw(st.integers(1, max(1, m)))
        groups = data.draw(st.lists(st.integers(0, k - 1), min_size=m, max_size=m))
        return task.process_grouped(live, groups, k, failed=failed)
    if kind == "map":
        counts = np.ones(m, dtype=np.intp)
    elif kind == "flat_map":
        counts = np.array(data.draw(st.lists(st.integers(0, 3), min_size=m, max_size=m)))
    else:
        counts = np.array(data.draw(st.lists(st.integers(0, 1), min_size=m, max_size=m)))
    counts = counts.astype(np.intp) * ~failed
    if kind != "flat_map" and not failed.any() and data.draw(st.booleans()):
        # What the task wrappers call for a map or filter without failures.
        kept = counts.astype(np.bool_)
        if task.pass_through(live, kept):
            return live.take(kept)
    return task.process(live, np.repeat(np.arange(m), counts), failed=failed)


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_every_root_completes_once_or_is_replayed_never_early(data: st.DataObject) -> None:
    clock = Clock()
    ft = FTLayer(
        MemoryStorage(),
        timeout_s=TIMEOUT,
        default_source=SourceConfig.named("kafka-hash", PARTITIONS),
        clock=clock,
        lapsed_batch_timeout_s=LAPSED,
    )
    # The driver: none (no batch open), alive to the end, or dead after the events, then
    # back (its restart plans the batch again) or never back.
    driver = data.draw(st.sampled_from(["none", "alive", "restarted", "never back"]))
    if driver != "none":
        ft.batch_began([SOURCE])
        ft.heartbeat([SOURCE], 3.0)
    capture = Capture(ft)
    n = data.draw(st.integers(1, 25))
    keys = data.draw(st.lists(st.binary(min_size=0, max_size=12), min_size=n, max_size=n))
    hashes, has_key = kafka_key_hashes(keys)
    original_partition = [_kafka_partition(k) for k in keys]
    source = Persister(capture).persist(
        [b"value-%d" % i for i in range(n)],
        topics="in",
        partitions=original_partition,
        offsets=np.arange(n),
        key_hashes=hashes,
        has_key=has_key,
    )
    root_offset = {int(r): i for i, r in enumerate(source.roots.tolist())}

    doomed: set[int] = set()
    records = source
    # hand_over: what the integration's task wrappers run (a row with one output hands
    # its id over); the properties hold either way.
    hand_over = data.draw(st.booleans())
    for kind in data.draw(st.lists(stage_kinds, min_size=1, max_size=4)):
        task = TaskHandler(capture, hand_over=hand_over)
        records = _run_stage(data, kind, records, task, doomed)
        task.flush()
    sink = TaskHandler(capture)
    sink.process(records, np.zeros(0, dtype=np.intp))
    sink.flush()

    events_r = np.concatenate([*capture.xor_roots, np.zeros(0, np.uint64)])
    events_v = np.concatenate([*capture.xor_values, np.zeros(0, np.uint64)])
    order = np.array(data.draw(st.permutations(range(len(events_r)))), dtype=np.intp)
    events_r, events_v = events_r[order], events_v[order]
    cuts = sorted(data.draw(st.sets(st.integers(0, len(events_r)), max_size=6)))
    bounds = [0, *cuts, len(events_r)]

    completed_at: dict[int, int] = {}

    def on_complete(done: Completed) -> None:
        for root in done.roots.tolist():
            assert root not in completed_at, "a root was reported complete twice"
            completed_at[root] = delivered["upto"]

    delivered = {"upto": 0}
    ft.add_completion_listener(on_complete)
    fails = [f for f in capture.fails if len(f)]
    fail_at = data.draw(
        st.lists(st.integers(0, len(bounds) - 2), min_size=len(fails), max_size=len(fails))
    )
    for b in range(len(bounds) - 1):
        for f, at in zip(fails, fail_at, strict=True):
            if at == b:
                ft.fail(f)
        delivered["upto"] = bounds[b + 1]
        ft.xor(events_r[bounds[b] : bounds[b + 1]], events_v[bounds[b] : bounds[b + 1]])

    # 2. Never early: a root completed only once all of its events were delivered.
    last_event: dict[int, int] = {}
    for pos, root in enumerate(events_r.tolist()):
        last_event[root] = pos + 1
    for root, upto in completed_at.items():
        assert last_event.get(root, 0) <= upto
        assert root not in doomed

    # Past the timeout every silent tree fails too; after a lapsed lease, only once the
    # source's next barrier came and its batch is done, or the wait ended.
    if driver == "alive":
        ft.batch_done([SOURCE])  # its barrier: the silent trees time out after it
    silent = len(ft)
    for t in (TIMEOUT, 2 * TIMEOUT, 3 * TIMEOUT, 4 * TIMEOUT):
        clock.now = t
        ft.tick()
    if driver in ("restarted", "never back"):  # the lease lapsed at 3 s: nothing failed
        assert ft.current_stats().failed["timeout"] == 0 and len(ft) == silent
        if driver == "restarted":
            ft.batch_began([SOURCE])
            ft.heartbeat([SOURCE], 3.0)
            ft.batch_done([SOURCE])
            after = (5 * TIMEOUT, 6 * TIMEOUT, 7 * TIMEOUT)
        else:
            after = (3.0 + LAPSED, 3.0 + LAPSED + TIMEOUT, 3.0 + LAPSED + 2 * TIMEOUT)
        for t in after:
            clock.now = t
            ft.tick()

    # 1. Each source record: completed exactly once, or queued for replay.
    replay = ft.fetch_replay(0, ft.replay_cursor)
    replayed_offsets = replay.records.offsets.tolist()
    assert len(replayed_offsets) == len(set(replayed_offsets))
    completed_offsets = {root_offset[r] for r in completed_at}
    assert completed_offsets.isdisjoint(replayed_offsets)
    assert completed_offsets | set(replayed_offsets) == set(range(n))
    assert {root_offset[r] for r in root_offset if r not in doomed} == completed_offsets
    assert len(ft) == len(replayed_offsets)

    # 3. Replay partitions mirror Kafka's own partitioner.
    for offset, partition in zip(replayed_offsets, replay.partitions.tolist(), strict=True):
        assert partition == original_partition[offset]

    # A replay round with no failures completes everything.
    reemitted = Persister(ft).emit_replays(replay.records.roots)
    sink = TaskHandler(ft)
    sink.process(reemitted, np.zeros(0, np.intp))
    sink.flush()
    assert len(ft) == 0 and len(ft.storage) == 0
    assert ft.current_stats().completed == n


@settings(max_examples=200, deadline=None)
@given(
    timeout=st.floats(1.0, 60.0),
    buckets=st.integers(2, 6),
    persist_at=st.lists(st.floats(0.0, 3.0), min_size=1, max_size=12),
    tick_fraction=st.floats(0.01, 0.5),
    jitter=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=50),
)
def test_timeouts_fire_inside_the_bound(
    timeout: float,
    buckets: int,
    persist_at: list[float],
    tick_fraction: float,
    jitter: list[float],
) -> None:
    """Records persisted at random moments and never acked, with the FT layer ticked at
    irregular moments at most d apart: each fails between T and T*(1+1/(n-1)) + n*d
    after its persist (docs/guarantees.md), never earlier, and is queued for replay."""
    clock = Clock()
    clock.now = 0.0
    ft = FTLayer(MemoryStorage(), timeout_s=timeout, buckets=buckets, clock=clock)
    max_gap = tick_fraction * timeout / (buckets - 1)
    persisted: dict[int, float] = {}
    failed_at: dict[int, float] = {}
    pending_persists = sorted(p * timeout for p in persist_at)
    bound = timeout * (1 + 1 / (buckets - 1)) + buckets * max_gap
    step = 0
    while pending_persists or len(failed_at) < len(persisted):
        clock.now += max_gap * (0.05 + 0.95 * jitter[step % len(jitter)])
        step += 1
        while pending_persists and pending_persists[0] <= clock.now:
            pending_persists.pop(0)
            anchors = Persister(ft).persist(
                [b"r"], topics="t", partitions=[0], offsets=[len(persisted)]
            )
            persisted[int(anchors.roots[0])] = clock.now
        ft.tick()
        for root in persisted:
            if root not in failed_at and root not in ft.acker:
                failed_at[root] = clock.now
        assert clock.now < 10 * bound + 4 * timeout, "a root never timed out"
    for root, at in persisted.items():
        waited = failed_at[root] - at
        assert timeout <= waited <= bound + 1e-9, (waited, timeout, bound)
    assert ft.stats.failed["timeout"] >= len(persisted)
    assert len(ft.fetch_replay(0, ft.replay_cursor)) == len(persisted)
