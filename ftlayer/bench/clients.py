"""The client process of `ftlayer bench server` and `ftlayer bench cluster`: one
Kafka partition's worth of trees and records, on the shard that owns the partition,
through two timed phases (xor, persist), each started by the parent over a barrier."""

from __future__ import annotations

import time
from typing import Any, Final

import numpy as np

from ftlayer.records import RecordBatch

from .acker import tree_events
from .persist import _payload_batches, _persist_and_complete

__all__ = ["BENCH_DEPTH", "WAIT_S", "bench_client"]

BENCH_DEPTH: Final = 3
"""Tasks per tree, as in the acker bench."""
WAIT_S: Final = 600.0


def bench_client(
    address: str,
    index: int,
    shards: int,
    roots: int,
    records: int,
    payload_bytes: int,
    batch: int,
    xor_batch: int,
    barrier: Any,
    results: Any,
) -> None:
    """One client process: partition `index` of source 0, on its shard (of `shards`);
    set up, then the two timed phases. Before each phase it waits at `barrier` twice
    (ready, then go: the parent reads the servers' usage in between) and afterwards
    puts (phase, error or None, the client's CPU seconds in the phase) on `results`.
    Each client reads a partition of its own, as a source's tasks do: a record at
    another's coordinates would take that one over (ftlayer.core.takeover)."""
    from ftlayer.client import FTClient

    shard = index % shards  # (source id 0 + partition) mod shards: ftlayer.shards
    phase = "setup"
    try:
        with FTClient(address, name=f"bench-{index}") as client:
            root_ids, first, event_roots, event_values = tree_events(
                roots, BENCH_DEPTH, seed=index, shard=shard, shards=shards
            )
            for lo in range(0, roots, 65_536):
                hi = min(roots, lo + 65_536)
                client.persist(
                    RecordBatch.build(
                        root_ids[lo:hi],
                        [b"x"] * (hi - lo),
                        topics="bench-trees",
                        partitions=index,
                        offsets=np.arange(lo, hi, dtype=np.int64),
                    ),
                    first[lo:hi],
                )
            batches, offsets = _payload_batches(records, payload_bytes, batch)

            phase = "xor"
            barrier.wait(timeout=WAIT_S)
            barrier.wait(timeout=WAIT_S)
            began = time.process_time()
            for lo in range(0, len(event_roots), xor_batch):
                client.xor(event_roots[lo : lo + xor_batch], event_values[lo : lo + xor_batch])
            results.put((phase, None, time.process_time() - began))

            phase = "persist"
            barrier.wait(timeout=WAIT_S)
            barrier.wait(timeout=WAIT_S)
            began = time.process_time()
            _persist_and_complete(
                client, batches, offsets, partition=index, shard=shard, shards=shards
            )
            results.put((phase, None, time.process_time() - began))
    except BaseException as exc:
        results.put((phase, repr(exc), 0.0))
        barrier.abort()
        raise
