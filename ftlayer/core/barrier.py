"""Completion at the barrier: the barrier of a micro-batch as one more acker participant.

A source registered with completion "barrier" sends no XOR events per step: its tasks
and sinks only fail records. Each root that enters a batch (persisted from Kafka,
fetched as a replay, or continued by a loop) gets a *barrier hold*: a random non-zero
value B XOR-ed into its ack value (a persist's initial value is its hold; a replay's
and a loop continuation's is drawn by the FT layer), and (root, B) joins the open
holds of its source. When the query's batch is done (CHECKPOINT_DONE: Spark runs one
batch at a time, and the FT layer hears of a batch's end before the next one reads),
every open hold of the query's sources is released in one vectorized XOR:

- a root nobody else holds returns to 0 and completes, as any tree does;
- a root that failed meanwhile is no longer pending (its record waits as a replay
  under a fresh root, which gets a hold of its own when a batch fetches it): its
  release is dropped;
- a root that a step or sink holds past the batch (a loop record in transit, anchored
  by XOR as in tree mode) keeps that value and completes by XOR when its holder acks.

So the barrier is a bulk acknowledgement, and failures stay per record. `OpenHolds`
keeps the holds per source, as chunks of arrays (appends are O(1), the release is one
concatenation), and knows which replay roots hold already, so a range fetched twice
(Spark re-running a batch) is held once.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from numpy.typing import NDArray

__all__ = ["OpenHolds"]

_EMPTY: NDArray[np.uint64] = np.zeros(0, dtype=np.uint64)


class OpenHolds:
    """The barrier holds not yet released, per source id."""

    def __init__(self) -> None:
        self._roots: dict[int, list[NDArray[np.uint64]]] = {}
        self._values: dict[int, list[NDArray[np.uint64]]] = {}
        self._held: dict[int, set[int]] = {}  # per source: replay and loop roots held
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def add(self, source_id: int, roots: NDArray[np.uint64], values: NDArray[np.uint64]) -> None:
        if len(roots):
            self._roots.setdefault(source_id, []).append(roots)
            self._values.setdefault(source_id, []).append(values)
            self.count += len(roots)

    def columns(self) -> dict[str, NDArray[np.uint64]]:
        """Copies of every open hold: "source" (the source id per hold), "root", "value"
        (a journal base holds them, ftlayer.core.journal)."""
        sources: list[NDArray[np.uint64]] = []
        for source_id, chunks in self._roots.items():
            for chunk in chunks:
                sources.append(np.full(len(chunk), source_id, dtype=np.uint64))
        if not sources:
            return {"source": _EMPTY, "root": _EMPTY, "value": _EMPTY}
        return {
            "source": np.concatenate(sources),
            "root": np.concatenate([c for chunks in self._roots.values() for c in chunks]),
            "value": np.concatenate([c for chunks in self._values.values() for c in chunks]),
        }

    def new_roots(self, source_id: int, roots: NDArray[np.uint64]) -> NDArray[np.bool_]:
        """Which of these replay roots of `source_id` hold nothing yet; they are marked
        as held from now on (until their source's release)."""
        held = self._held.setdefault(source_id, set())
        listed = roots.tolist()
        if held.isdisjoint(listed):  # the usual fetch: replays new to this batch
            held.update(listed)
            return np.ones(len(listed), dtype=np.bool_)
        fresh = ~np.fromiter(map(held.__contains__, listed), np.bool_, len(listed))
        held.update(roots[fresh].tolist())
        return fresh

    def roots_of(self, source_id: int) -> NDArray[np.uint64]:
        """The roots of `source_id`'s open holds."""
        chunks = self._roots.get(source_id, [])
        return np.concatenate(chunks) if chunks else _EMPTY

    def discard(self, roots: NDArray[np.uint64]) -> int:
        """Drop every open hold of these roots, under any key (a tree-mode range read
        again: the held acks of the earlier read, ftlayer.core.rangeacks); returns how
        many were dropped."""
        dropped = 0
        for key, chunks in self._roots.items():
            values = self._values[key]
            for i, chunk in enumerate(chunks):
                gone = np.isin(chunk, roots)
                if bool(gone.any()):
                    chunks[i], values[i] = chunk[~gone], values[i][~gone]
                    dropped += int(np.count_nonzero(gone))
        self.count -= dropped
        return dropped

    def release(self, source_ids: Iterable[int]) -> tuple[NDArray[np.uint64], NDArray[np.uint64]]:
        """Every open hold of these sources, (roots, values), removed."""
        roots: list[NDArray[np.uint64]] = []
        values: list[NDArray[np.uint64]] = []
        for source_id in source_ids:
            roots += self._roots.pop(source_id, [])
            values += self._values.pop(source_id, [])
            self._held.pop(source_id, None)
        if not roots:
            return _EMPTY, _EMPTY
        all_roots = np.concatenate(roots)
        self.count -= len(all_roots)
        return all_roots, np.concatenate(values)
