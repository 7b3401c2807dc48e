"""The acker table: root id -> ack value, updated by XOR events.

Invariant (Storm's acker): every record id of a tree is XOR-ed into its root's ack
value exactly twice, once when the record is emitted and once when it is processed
(acked). A root is complete the first time its ack value returns to 0 after an event;
it is then removed, so it is reported complete exactly once. A set of events whose ids
do not all pair up reaches 0 by accident with probability 2**-64 (docs/guarantees.md).

Operations and costs (n = events in a batch, m = pending roots):
- add(roots, values): register pending roots with their initial ack values (the XOR
  of the ids their source emitted; 0 when the source sends those as events). O(n).
- xor(roots, values): apply a batch of XOR events; returns the roots completed by the
  batch and the roots of events that were dropped because their root is not pending
  (late events for a completed or failed root). O(n), vectorized.
- xor_one(root, value): the same for one event (cold paths, tests).
- remove(roots): forget pending roots (they failed); returns those that were
  pending, with the owner's columns (Removed). O(n).
- lookup(name, roots): which roots are pending, and an owner's column for them. O(n).
- set_column(name, slots, values): set an owner's column of roots just added.

The table's owner may add columns of its own (the FT layer keeps each root's record
locator there: storage seq, Kafka offset, partition, topic), so one table lookup serves
both the XOR and the persistence bookkeeping; xor() and remove() hand back those
columns for the roots they take out.

A batch is applied as one update: a root is complete when its value is 0 after the
whole batch. For a correct event stream this is exactly the one-at-a-time rule,
because a tree's ack value can only reach 0 at its last event (the events of a tree
form a connected graph over its ids; no proper subset of them XORs to 0 barring the
2**-64 collision). With late or duplicated events the batch rule may miss a completion
the one-at-a-time rule would report; the root then times out and is replayed: a
duplicate, never a loss.

Layout: a U64Map (ftlayer/acking/u64map.py): the uint64 ack value plus the owner's columns,
at load factor at most 1/2. A bare table is 16 bytes a slot: 33.6 bytes per pending
root at 1,000,000 roots. The FT layer's table, with the record locator, is 40 bytes a
slot: 83.9 bytes per pending root at 1,000,000 (`ftlayer bench acker` reports both).
Not thread-safe: one thread owns a table (the FT-layer core serializes access).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, DTypeLike, NDArray

from ftlayer.acking.u64map import U64Map

_EMPTY_U64: NDArray[np.uint64] = np.zeros(0, dtype=np.uint64)


Columns = dict[str, NDArray[Any]]


@dataclass(frozen=True, slots=True)
class XorResult:
    """What one batch of XOR events did."""

    completed: NDArray[np.uint64]
    """Roots whose ack value returned to 0, each once, in no particular order."""
    dropped: NDArray[np.uint64]
    """Roots of events that were ignored because the root is not pending."""
    columns: Columns = field(default_factory=dict)
    """The owner's columns of the completed roots, aligned with `completed`."""


@dataclass(frozen=True, slots=True)
class Removed:
    """Roots taken out of the table without completing, with the owner's columns."""

    roots: NDArray[np.uint64]
    columns: Columns


class AckerTable:
    """Pending roots and their ack values; see the module docstring for the contract."""

    def __init__(
        self,
        capacity: int = 1024,
        columns: Mapping[str, DTypeLike] | None = None,
        *,
        track_live: bool = False,
        mirror: Sequence[str] = (),
    ) -> None:
        """`track_live`: enumerate pending roots (roots, items, snapshot, live_columns)
        in O(pending) rather than O(capacity), for 6 bytes more per slot; `mirror`:
        owner columns (or "root") that live_columns and snapshot read with one
        sequential copy (U64Map)."""
        if columns and "ack" in columns:
            raise ValueError("the column name 'ack' is the table's own")
        self._owned = list(columns or {})
        self._map = U64Map(
            {"ack": np.uint64, **(columns or {})},
            capacity,
            key_name="root",
            track_live=track_live,
            mirror=mirror,
        )
        self.completed_total = 0
        self.dropped_events_total = 0

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, root: object) -> bool:
        return root in self._map

    @property
    def capacity(self) -> int:
        return self._map.capacity

    def memory_bytes(self) -> int:
        """Bytes held by the table's arrays."""
        return self._map.memory_bytes()

    def value(self, root: int) -> int | None:
        """The current ack value of a pending root, None if it is not pending."""
        slot = self._map.find_one(root)
        return None if slot < 0 else int(self._map.columns["ack"][slot])

    def roots(self) -> NDArray[np.uint64]:
        """Every pending root (a copy)."""
        return self._map.keys[self._map.live_slots()]

    def items(self) -> tuple[NDArray[np.uint64], NDArray[np.uint64]]:
        """Every pending root and its ack value (copies), for snapshots."""
        live = self._map.live_slots()
        return self._map.keys[live], self._map.columns["ack"][live].astype(np.uint64)

    def snapshot(self, *names: str) -> dict[str, NDArray[Any]]:
        """Every pending root ("root"), its ack value ("ack") and the named owner
        columns, as copies in one order: a consistent picture for checkpoints."""
        return self._map.live_view("root", "ack", *names)

    def live_columns(self, *names: str, copy: bool = True) -> dict[str, NDArray[Any]]:
        """The named owner columns of every pending root, in one order: copies, or
        with `copy=False` possibly read-only views valid until the table changes."""
        return self._map.live_view(*names, copy=copy)

    def add(
        self, roots: ArrayLike, values: ArrayLike | None = None, **columns: ArrayLike
    ) -> NDArray[np.intp]:
        """Register pending roots with initial ack values (default 0) and values of the
        owner's columns (default 0); returns their slots, for set_column.

        Raises ValueError, and changes nothing, if a root is reserved (0 or 1), already
        pending, or repeated in the batch.
        """
        if values is not None:
            columns["ack"] = np.asarray(values, dtype=np.uint64)
        return self._map.insert(roots, **columns)

    def set_column(self, name: str, slots: NDArray[np.intp], values: ArrayLike) -> None:
        """Set an owner's column for roots just added (slots from add)."""
        self._map.set_column(name, slots, values)

    def lookup(self, name: str, roots: ArrayLike) -> tuple[NDArray[np.bool_], NDArray[Any]]:
        """(pending mask, column `name` of the pending ones) for a batch of roots."""
        slots = self._map.find(np.ascontiguousarray(roots, dtype=np.uint64))
        pending = slots >= 0
        return pending, self._map.columns[name][slots[pending]]

    def _take(self, slots: NDArray[np.intp]) -> Columns:
        return {name: self._map.columns[name][slots] for name in self._owned}

    def xor(self, roots: ArrayLike, values: ArrayLike) -> XorResult:
        """Apply a batch of XOR events (root, value); see the module docstring."""
        keys = np.ascontiguousarray(roots, dtype=np.uint64)
        vals = np.ascontiguousarray(values, dtype=np.uint64)
        if len(vals) != len(keys):
            raise ValueError(f"xor: {len(keys)} roots but {len(vals)} values")
        if len(keys) == 0:
            return XorResult(_EMPTY_U64, _EMPTY_U64, self._take(np.zeros(0, np.intp)))
        slots = self._map.find(keys)
        known = slots >= 0
        dropped = _EMPTY_U64
        if not bool(known.all()):
            dropped = keys[~known]
            self.dropped_events_total += len(dropped)
            slots, vals = slots[known], vals[known]
        ack: NDArray[np.uint64] = self._map.columns["ack"]  # type: ignore[assignment]
        np.bitwise_xor.at(ack, slots, vals)
        zero = slots[ack[slots] == 0]
        if len(zero) == 0:
            return XorResult(_EMPTY_U64, dropped, self._take(zero))
        if len(zero) > 1:
            # A root with several events in the batch appears several times: keep one.
            # The ack cells of completed roots are free, so they serve as scratch.
            marks = np.arange(1, len(zero) + 1, dtype=np.uint64)
            ack[zero] = marks
            zero = zero[ack[zero] == marks]
        completed = self._map.keys[zero]
        taken = self._take(zero)
        self._map.delete_slots(zero)
        self.completed_total += len(zero)
        return XorResult(completed, dropped, taken)

    def xor_one(self, root: int, value: int) -> bool:
        """Apply one XOR event (cold paths); True if it completed its root."""
        result = self.xor(np.array([root], dtype=np.uint64), np.array([value], dtype=np.uint64))
        return len(result.completed) == 1

    def remove(self, roots: ArrayLike) -> Removed:
        """Forget pending roots (failed ones); returns those that were pending, each
        once, with the owner's columns."""
        keys = np.ascontiguousarray(roots, dtype=np.uint64)
        slots = self._map.find(keys)
        slots = np.unique(slots[slots >= 0])
        removed = Removed(self._map.keys[slots], self._take(slots))
        self._map.delete_slots(slots)
        return removed


__all__ = ["AckerTable", "Removed", "XorResult"]
