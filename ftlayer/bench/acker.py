"""`ftlayer bench acker`: XOR updates per second through AckerTable on batched events,
against a naive one-event-at-a-time dict loop on the same events; and the memory per
pending root of a bare table and of the FT layer's own."""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from ftlayer.acking.acker import AckerTable
from ftlayer.acking.ids import new_ids
from ftlayer.core import FTLayer
from ftlayer.persistence.memory import MemoryStorage

from .timing import _machine, _timed

ACKER_TARGET_RATE = 3_000_000
ACKER_TARGET_RATIO = 3.0
FT_TABLE_TARGET_BYTES = 64


def tree_events(
    roots: int, depth: int, seed: int = 7, shard: int = 0, shards: int = 1
) -> tuple[NDArray[np.uint64], NDArray[np.uint64], NDArray[np.uint64], NDArray[np.uint64]]:
    """A workload of `roots` trees, each a chain of `depth` tasks after its source.

    Returns (roots, first ack values, event roots, event values). Events are the ones
    handlers send: each task acks its input XOR its output; the sink acks the last
    output. They are interleaved across trees in random order (seeded), the worst case
    for memory locality. The roots are shard `shard`'s of a cluster of `shards`.
    """
    root_ids = new_ids(roots, shard, shards)
    ids = [new_ids(roots) for _ in range(depth + 1)]
    event_roots = np.tile(root_ids, depth + 1)
    event_values = np.concatenate([ids[j] ^ ids[j + 1] for j in range(depth)] + [ids[depth]])
    order = np.random.default_rng(seed).permutation(len(event_roots))
    return root_ids, ids[0], event_roots[order], event_values[order]


def bench_acker(roots: int = 1_000_000, depth: int = 3, batch: int = 65_536) -> dict[str, Any]:
    """XOR updates/s: AckerTable on batches against a naive dict loop, same events."""
    root_ids, first, event_roots, event_values = tree_events(roots, depth)
    n_events = len(event_roots)

    table = AckerTable()
    add_s = _timed(lambda: table.add(root_ids, first))
    memory_per_root = table.memory_bytes() / roots
    completed = 0

    def batched() -> None:
        nonlocal completed
        for lo in range(0, n_events, batch):
            completed += len(
                table.xor(event_roots[lo : lo + batch], event_values[lo : lo + batch]).completed
            )

    batched_s = _timed(batched)
    if completed != roots or len(table):
        raise AssertionError(f"acker bench: {completed} of {roots} trees completed")

    naive: dict[int, int] = dict(zip(root_ids.tolist(), first.tolist(), strict=True))
    roots_list, values_list = event_roots.tolist(), event_values.tolist()
    naive_done: list[int] = []

    def one_at_a_time() -> None:
        for root, value in zip(roots_list, values_list, strict=True):
            current = naive.get(root)
            if current is None:
                continue
            current ^= value
            if current == 0:
                del naive[root]
                naive_done.append(root)
            else:
                naive[root] = current

    naive_s = _timed(one_at_a_time)
    if len(naive_done) != roots:
        raise AssertionError("acker bench: the naive loop disagrees")

    rate, naive_rate = n_events / batched_s, n_events / naive_s
    ft_memory = ft_table_bytes_per_pending_root(roots)
    return {
        "bench": "acker",
        "roots": roots,
        "events": n_events,
        "batch": batch,
        "updates_per_s": round(rate),
        "naive_updates_per_s": round(naive_rate),
        "ratio_vs_naive": round(rate / naive_rate, 2),
        "add_roots_per_s": round(roots / add_s),
        "memory_bytes_per_pending_root": round(memory_per_root, 1),
        "ftlayer_table_bytes_per_pending_root": ft_memory["churned"],
        "ftlayer_table_bytes_per_pending_root_filled": ft_memory["filled"],
        "targets": {
            "updates_per_s": ACKER_TARGET_RATE,
            "ratio_vs_naive": ACKER_TARGET_RATIO,
            "ftlayer_table_bytes_per_pending_root": FT_TABLE_TARGET_BYTES,
        },
        "meets_targets": rate >= ACKER_TARGET_RATE
        and rate / naive_rate >= ACKER_TARGET_RATIO
        and ft_memory["churned"] <= FT_TABLE_TARGET_BYTES,
        "machine": _machine(),
    }


def ft_table_bytes_per_pending_root(roots: int, batch: int = 65_536) -> dict[str, float]:
    """Bytes per pending root of the FT layer's own acker table (`FTLayer.acker`, as
    the server makes it), counting every array it holds (`memory_bytes`: the rows of
    root, ack value and record locator, and the hash index). "filled": after `roots`
    roots were added in batches, as persist adds them; "churned": after each of those
    completed and a new root took its place, batch by batch, as in a running server
    (its index has then dropped deleted slots at least once)."""
    table = FTLayer(MemoryStorage()).acker
    ids = new_ids(2 * roots)
    locators: dict[str, NDArray[Any]] = {
        "seq": np.arange(1, 2 * roots + 1, dtype=np.uint64),
        "offset": np.arange(2 * roots, dtype=np.int64),
        "partition": np.zeros(2 * roots, dtype=np.int32),
        "topic": np.zeros(2 * roots, dtype=np.uint32),
    }

    def add(lo: int, hi: int) -> None:
        table.add(ids[lo:hi], ids[lo:hi], **{name: v[lo:hi] for name, v in locators.items()})

    for lo in range(0, roots, batch):
        add(lo, min(roots, lo + batch))
    filled = table.memory_bytes() / roots
    for lo in range(0, roots, batch):
        hi = min(roots, lo + batch)
        table.xor(ids[lo:hi], ids[lo:hi])
        add(roots + lo, roots + hi)
    if len(table) != roots:
        raise AssertionError(f"table bench: {len(table)} pending, expected {roots}")
    return {"filled": round(filled, 1), "churned": round(table.memory_bytes() / roots, 1)}
