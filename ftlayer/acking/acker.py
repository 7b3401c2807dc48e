"""The acker table: root id -> ack value, updated by XOR events.

Invariant (Storm's acker): every record id of a tree is XOR-ed into its root's ack
value exactly twice, once when the record is emitted and once when it is processed
(acked). A root is complete the first time its ack value returns to 0 after an event;
it is then removed, so it is reported complete exactly once. A set of events whose ids
do not all pair up reaches 0 by accident with probability 2**-63 (docs/guarantees.md).

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
- set_column(name, rows, values): set an owner's column of roots just added (rows from
  add).

The table's owner may add columns of its own (the FT layer keeps each root's record
locator there: storage seq, Kafka offset, partition, topic), so one table lookup serves
both the XOR and the persistence bookkeeping; xor() and remove() hand back those
columns for the roots they take out.

A batch is applied as one update: a root is complete when its value is 0 after the
whole batch. For a correct event stream this is exactly the one-at-a-time rule,
because a tree's ack value can only reach 0 at its last event (the events of a tree
form a connected graph over its ids; no proper subset of them XORs to 0 barring the
2**-63 collision). With late or duplicated events the batch rule may miss a completion
the one-at-a-time rule would report; the root then times out and is replayed: a
duplicate, never a loss.

Layout: a U64Map (ftlayer/acking/u64map.py): the roots, their uint64 ack values and the
owner's columns in dense rows (the pending roots first, in no order), and a hash index
of 4-byte slots holding rows, at load factor at most 1/2. Every column of every
pending root is one slice of its array, so enumerating them (roots, items, snapshot,
live_columns) is O(pending) sequential copies. `ftlayer bench acker` reports the bytes
per pending root, of a bare table and of the FT layer's.
Not thread-safe: one thread owns a table (the FT-layer core serializes access).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, DTypeLike, NDArray

from ftlayer.acking.u64map import U64Map, _kernels
from ftlayer.errors import ConfigError

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
        self, capacity: int = 1024, columns: Mapping[str, DTypeLike] | None = None
    ) -> None:
        """`capacity`: roots to make room for up front; `columns`: the owner's columns."""
        if columns and ("ack" in columns or "root" in columns):
            raise ConfigError("the column names 'root' and 'ack' are the table's own")
        self._owned = list(columns or {})
        self._map = U64Map({"ack": np.uint64, **(columns or {})}, capacity, key_name="root")
        self.completed_total = 0
        self.dropped_events_total = 0

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, root: object) -> bool:
        return root in self._map

    @property
    def capacity(self) -> int:
        """Slots of the hash index."""
        return self._map.capacity

    def memory_bytes(self) -> int:
        """Bytes held by the table's arrays."""
        return self._map.memory_bytes()

    def value(self, root: int) -> int | None:
        """The current ack value of a pending root, None if it is not pending."""
        row = self._map.find_one(root)
        return None if row < 0 else int(self._map.columns["ack"][row])

    def roots(self) -> NDArray[np.uint64]:
        """Every pending root (a copy)."""
        return self._map.keys[: len(self._map)].copy()

    def items(self) -> tuple[NDArray[np.uint64], NDArray[np.uint64]]:
        """Every pending root and its ack value (copies), for snapshots."""
        n = len(self._map)
        return self._map.keys[:n].copy(), self._map.columns["ack"][:n].astype(np.uint64)

    def snapshot(self, *names: str) -> dict[str, NDArray[Any]]:
        """Every pending root ("root"), its ack value ("ack") and the named owner
        columns, as copies in one order: a consistent picture for checkpoints."""
        return self._map.live_view("root", "ack", *names)

    def live_columns(self, *names: str, copy: bool = True) -> dict[str, NDArray[Any]]:
        """The named owner columns (or "root") of every pending root, in one order:
        copies, or with `copy=False` read-only views valid until the table changes."""
        return self._map.live_view(*names, copy=copy)

    def add(
        self, roots: ArrayLike, values: ArrayLike | None = None, **columns: ArrayLike
    ) -> NDArray[np.intp]:
        """Register pending roots with initial ack values (default 0) and values of the
        owner's columns (default 0); returns their rows, for set_column.

        Changes nothing and raises ConfigError if a root is reserved (0 or 1) or
        repeated in the batch, StateConflict if one is already pending.
        """
        if values is not None:
            columns["ack"] = np.asarray(values, dtype=np.uint64)
        return self._map.insert(roots, **columns)

    def set_column(self, name: str, rows: NDArray[np.intp], values: ArrayLike) -> None:
        """Set an owner's column for roots just added (rows from add, valid until the
        table changes)."""
        self._map.set_column(name, rows, values)

    def lookup(self, name: str, roots: ArrayLike) -> tuple[NDArray[np.bool_], NDArray[Any]]:
        """(pending mask, column `name` of the pending ones) for a batch of roots."""
        rows = self._map.find(np.ascontiguousarray(roots, dtype=np.uint64))
        pending = rows >= 0
        return pending, self._map.columns[name][rows[pending]]

    def _take(self, rows: NDArray[np.intp]) -> Columns:
        return {name: self._map.columns[name][rows] for name in self._owned}

    def xor(self, roots: ArrayLike, values: ArrayLike, *, count_dropped: bool = True) -> XorResult:
        """Apply a batch of XOR events (root, value); see the module docstring. With
        `count_dropped` False, events of roots not pending are left out of
        `dropped_events_total` (the caller knows why they are gone)."""
        keys = np.ascontiguousarray(roots, dtype=np.uint64)
        vals = np.ascontiguousarray(values, dtype=np.uint64)
        if len(vals) != len(keys):
            raise ConfigError(f"xor: {len(keys)} roots but {len(vals)} values")
        if len(keys) == 0:
            return XorResult(_EMPTY_U64, _EMPTY_U64, self._take(np.zeros(0, np.intp)))
        slots, rows = self._map.find_slots(keys)
        known = rows >= 0
        dropped = _EMPTY_U64
        if not bool(known.all()):
            dropped = keys[~known]
            if count_dropped:
                self.dropped_events_total += len(dropped)
            slots, rows, vals = slots[known], rows[known], vals[known]
        # One pass XORs the events into their cells, one more finds the cells at 0, each
        # root once (by its last event): a numba kernel (u64kernels.xor_rows).
        zero = np.empty(len(rows), dtype=np.intp)
        zero = zero[: _kernels().xor_rows(self._map.columns["ack"], rows, vals, zero)]
        if len(zero) == 0:
            return XorResult(_EMPTY_U64, dropped, self._take(zero))
        done = rows[zero]
        completed = self._map.keys[done]
        taken = self._take(done)
        self._map.delete(slots[zero])
        self.completed_total += len(zero)
        return XorResult(completed, dropped, taken)

    def xor_one(self, root: int, value: int) -> bool:
        """Apply one XOR event (cold paths); True if it completed its root."""
        result = self.xor(np.array([root], dtype=np.uint64), np.array([value], dtype=np.uint64))
        return len(result.completed) == 1

    def remove(self, roots: ArrayLike) -> Removed:
        """Forget pending roots (failed ones); returns those that were pending, each
        once, with the owner's columns."""
        slots, rows = self._map.find_slots(np.ascontiguousarray(roots, dtype=np.uint64))
        pending = rows >= 0
        slots, first = np.unique(slots[pending], return_index=True)
        rows = rows[pending][first]
        removed = Removed(self._map.keys[rows], self._take(rows))
        self._map.delete(slots)
        return removed


__all__ = ["AckerTable", "Removed", "XorResult"]
