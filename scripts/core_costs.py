"""CPU of the FT-layer core's calls, in this process, per call kind (LMDB with fsync, as
the server runs it; INFO logging to /dev/null), for two paths of the fast bench:

- `tree`: tree mode by reference. Per micro-batch of 200,000 records, 20 PERSISTs of
  10,000 keyless records (replayed `forward`, as the bench's) stored by reference with
  their first ack values, each followed by its
  sink's SINK_HOLD of their acks, then the SINK_SETTLE that completes them all, then the
  deletes.
- `tree-ranges`: tree mode by range (ftlayer.core.rangeacks). Per micro-batch of
  200,000 records, one BATCH_RANGES of 4 partitions (tree), a RANGE_READ per partition
  (its reader's seed), then per 10,000-record piece the filter's XOR of the acks of
  the 1 row in 10 it drops and the sink's SINK_HOLD of the other rows' acks (range
  roots and emission ids), then the SINK_SETTLE that completes them all, then the
  deletes (none).
- `failures`: barrier mode by reference at 1% failures. Per micro-batch of BATCH
  records over 4 partitions (ranges, no record stored): the driver's UNFILLED and FILL
  of the last batch's failures, a FETCH_REPLAY per partition, BATCH_RANGES, a FAIL per
  partition of 1% of its range roots, then the barrier (COMPLETE, RELEASE, PRUNE) and
  the deletes.

Process CPU per record over BATCHES micro-batches after one (tree) or two (failures) of
warm-up, and per call kind the calls per batch and their CPU; with -p, the functions
that take the most time under cProfile (PROFILE_SORT=cumtime to sort by time
with callees, PROFILE_LINES=N for more than 40).

With JOURNAL=1 the core keeps an acker journal, as `ftlayer serve` does. With
PAUSE_MS the script sleeps that long before each call (not counted): each call then
runs cold, as a server's request does between other work, instead of right after the
last one with the caches warm; with PAUSE_SPIN=1 the pause is spent on the CPU (a
loop reading the clock) instead of asleep.

    [JOURNAL=1] [PAUSE_MS=2 [PAUSE_SPIN=1]] .venv/bin/python scripts/core_costs.py \
        tree|tree-ranges [BATCHES] [-p]
    [JOURNAL=1] [PAUSE_MS=2 [PAUSE_SPIN=1]] .venv/bin/python scripts/core_costs.py \
        failures [BATCH] [BATCHES] [-p]
"""

import collections
import cProfile
import logging
import os
import pstats
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ftlayer import rangeroots
from ftlayer.acking.ids import new_ids
from ftlayer.causes import Cause, FailKind
from ftlayer.core import FTLayer
from ftlayer.core.retries import RetryPolicy
from ftlayer.persistence import LmdbStorage
from ftlayer.records import Payloads, RecordBatch
from ftlayer.registration import SourceRegistration

SOURCE, TOPIC, PARTITIONS = 9, "orders", 4
FAILED = Cause(FailKind.EXPLICIT, "map", "FailException: bench")
PROFILE = "-p" in sys.argv
PAUSE_S = float(os.environ.get("PAUSE_MS", "0")) / 1000
SPIN = os.environ.get("PAUSE_SPIN") == "1"  # the pause on the CPU, not asleep
JOURNALED = bool(os.environ.get("JOURNAL"))
ARGS = [a for a in sys.argv[1:] if a != "-p"]
cpu: collections.defaultdict[str, float] = collections.defaultdict(float)
calls: collections.Counter[str] = collections.Counter()
spun = [0.0]  # CPU seconds of the PAUSE_SPIN pauses


def timed(name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if PAUSE_S and SPIN:
        spin_began, until = time.process_time(), time.perf_counter() + PAUSE_S
        while time.perf_counter() < until:  # awake, but away from the core's code
            pass
        spun[0] += time.process_time() - spin_began  # not the core's: left out of the total
    elif PAUSE_S:
        time.sleep(PAUSE_S)  # the call comes cold, as a request does
    began = time.process_time()
    try:
        return fn(*args, **kwargs)
    finally:
        cpu[name] += time.process_time() - began
        calls[name] += 1


def tree(ft: FTLayer, batch: int, offset: int) -> int:
    key = 0x8000_0000_0000_0000 | (offset + 1)
    piece = 10_000
    for p in range(200_000 // piece):
        roots, ids = new_ids(piece), new_ids(piece)
        records = RecordBatch.build(
            roots,
            Payloads(b"", np.zeros(piece, dtype=np.int64)),  # by reference, as on the wire
            source_ids=SOURCE,
            topics=TOPIC,
            partitions=np.full(piece, p % PARTITIONS),
            offsets=np.arange(offset, offset + piece),
            key_hashes=np.zeros(piece, np.int64),  # keyless, as the bench's records
            has_key=np.zeros(piece, np.bool_),
            references=True,
        )
        offset += piece
        timed("PERSIST", ft.persist, records, ids)
        timed("SINK_HOLD", ft.sink_hold, key, roots, ids)
    timed("SINK_SETTLE", ft.sink_settle, key)
    timed("DELETES", ft.flush_deletes)
    return offset


def tree_ranges(ft: FTLayer, batch: int, offset: int) -> int:
    key = 0x8000_0000_0000_0000 | (offset + 1)
    piece, per = 10_000, 200_000 // PARTITIONS
    opened = [(SOURCE, TOPIC, p, offset, offset + per) for p in range(PARTITIONS)]
    numbers = timed("BATCH_RANGES", ft.register_ranges, opened, tree=True)
    seeds = [int(s) | 1 for s in new_ids(PARTITIONS)]  # one read per partition
    for p in range(PARTITIONS):
        first = rangeroots.encode(numbers[p], offset, [offset])
        timed("RANGE_READ", ft.read_range, int(first[0]), per, seeds[p])
    for k in range(200_000 // piece):
        p = k % PARTITIONS
        start = offset + (k // PARTITIONS) * piece
        roots = rangeroots.encode(numbers[p], offset, np.arange(start, start + piece))
        ids = rangeroots.emission_ids(seeds[p], roots)
        dropped = np.zeros(piece, dtype=np.bool_)
        dropped[::10] = True  # the bench's filter drops 1 record in 10: acked at once
        timed("XOR", ft.xor, roots[dropped], ids[dropped])
        timed("SINK_HOLD", ft.sink_hold, key, roots[~dropped], ids[~dropped])
    timed("SINK_SETTLE", ft.sink_settle, key)
    timed("DELETES", ft.flush_deletes)
    return offset + per


class Failures:
    def __init__(self, ft: FTLayer, batch: int) -> None:
        self.ft, self.batch = ft, batch
        self.rng = np.random.default_rng(1)
        self.ends = [0] * PARTITIONS
        self.cursor = 0

    def __call__(self) -> None:
        ft, rng = self.ft, self.rng
        ft.batch_began([SOURCE])
        wanted = timed("UNFILLED", ft.unfilled, SOURCE)
        n = len(wanted)
        if n:
            keys = (rng.integers(0, 2**31, n, dtype=np.int64), np.ones(n, np.bool_))
            timed("FILL", ft.fill, wanted.seqs, [b"x" * 40] * n, np.ones(n, np.bool_), keys)
        hi = ft.replay_cursor_of(SOURCE)
        for p in range(PARTITIONS):
            timed("FETCH_REPLAY", ft.fetch_replay, self.cursor, hi, source_id=SOURCE, partition=p)
        self.cursor = hi
        per = self.batch // PARTITIONS
        opened = [(SOURCE, TOPIC, p, self.ends[p], self.ends[p] + per) for p in range(PARTITIONS)]
        numbers = timed("BATCH_RANGES", ft.register_ranges, opened)
        for p, number in enumerate(numbers):
            roots = rangeroots.encode(
                number, self.ends[p], np.arange(self.ends[p], self.ends[p] + per)
            )
            failing = roots[rng.random(len(roots)) < 0.01]
            if len(failing):  # with a journal noted, as the server does (failnotes)
                timed("FAIL", ft.note_failures if JOURNALED else ft.fail, failing, FAILED)
            self.ends[p] += per
        kafka = {TOPIC: {p: self.ends[p] for p in range(PARTITIONS)}}
        timed("COMPLETE", ft.complete_ranges, [SOURCE], kafka)
        timed("RELEASE", ft.release_barrier, [SOURCE])
        ft.batch_done([SOURCE])
        timed("PRUNE", ft.prune_replay, self.cursor, SOURCE)
        timed("DELETES", ft.flush_deletes)


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=open("/dev/null", "w"))  # noqa: SIM115
    path = ARGS[0] if ARGS else "tree"
    if path in ("tree", "tree-ranges"):
        batch, batches, warm = 200_000, int(ARGS[1]) if len(ARGS) > 1 else 5, 1
    else:
        batch = int(ARGS[1]) if len(ARGS) > 1 else 200_000
        batches, warm = int(ARGS[2]) if len(ARGS) > 2 else 10, 2
    with tempfile.TemporaryDirectory(prefix="ftlayer-core-costs-") as tmp:
        journal = None
        if JOURNALED:  # the server's acker journal, as `ftlayer serve` keeps it
            from ftlayer.core.journal import Journal

            journal = Journal(f"{tmp}/journal")
        ft = FTLayer(
            LmdbStorage(f"{tmp}/store"), timeout_s=120, seed=1, defer_deletes=True, journal=journal
        )
        completion = "barrier" if path == "failures" else "tree"
        retry = RetryPolicy(5, 0, 1)
        # The bench's: keyless records replayed `forward` (tree); range rows by key hash.
        partitioner = "kafka-hash" if path == "failures" else "forward"
        ft.register_source(
            SourceRegistration(SOURCE, partitioner, PARTITIONS, retry=retry, completion=completion)
        )
        step = Failures(ft, batch) if path == "failures" else None
        persisting = tree_ranges if path == "tree-ranges" else tree
        offset = 0
        profile = cProfile.Profile() if PROFILE else None
        for b in range(batches + warm):
            if b == warm:
                cpu.clear()
                spun[0] = 0.0
                calls.clear()
                began = time.process_time()
                if profile is not None:
                    profile.enable()
            if step is None:
                offset = persisting(ft, batch, offset)
            else:
                step()
        if profile is not None:
            profile.disable()
        spent = time.process_time() - began - spun[0]
    records = batch * batches
    print(f"{path}: {spent * 1e6 / records:.3f} us of CPU per record, batches of {batch:,}")
    for name in cpu:
        per_call = cpu[name] * 1e3 / calls[name]
        print(
            f"  {name:13s} {calls[name] / batches:5.1f} per batch {per_call:8.3f} ms each "
            f"{cpu[name] * 1e6 / records:.4f} us per record"
        )
    if profile is not None:
        order = os.environ.get("PROFILE_SORT", "tottime")  # or cumtime
        lines = int(os.environ.get("PROFILE_LINES", "40"))
        pstats.Stats(profile).sort_stats(order).print_stats(lines)


main()
