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
  pending. O(n).

A batch is applied as one update: a root is complete when its value is 0 after the
whole batch. For a correct event stream this is exactly the one-at-a-time rule,
because a tree's ack value can only reach 0 at its last event (the events of a tree
form a connected graph over its ids; no proper subset of them XORs to 0 barring the
2**-64 collision). With late or duplicated events the batch rule may miss a completion
the one-at-a-time rule would report; the root then times out and is replayed: a
duplicate, never a loss.

Layout: open addressing with linear probing over two parallel uint64 arrays (keys,
ack values), capacity a power of two, load factor at most 1/2, Fibonacci hashing. Key
0 marks an empty slot and 1 a deleted one, which is why ids are drawn from [2, 2**64).
At most 2 * 16 = 32 bytes of arrays per pending root (about 34 with growth slack).
Not thread-safe: one thread owns a table (the FT-layer core serializes access).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

_EMPTY = np.uint64(0)
_DELETED = np.uint64(1)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MAX_LOAD = 0.5
_EMPTY_U64: NDArray[np.uint64] = np.zeros(0, dtype=np.uint64)


@dataclass(frozen=True, slots=True)
class XorResult:
    """What one batch of XOR events did."""

    completed: NDArray[np.uint64]
    """Roots whose ack value returned to 0, each once, in no particular order."""
    dropped: NDArray[np.uint64]
    """Roots of events that were ignored because the root is not pending."""


class AckerTable:
    """Pending roots and their ack values; see the module docstring for the contract."""

    def __init__(self, capacity: int = 1024) -> None:
        self._alloc(_capacity_for(capacity))
        self._live = 0
        self.completed_total = 0
        self.dropped_events_total = 0

    def _alloc(self, cap: int) -> None:
        self._keys: NDArray[np.uint64] = np.zeros(cap, dtype=np.uint64)
        self._vals: NDArray[np.uint64] = np.zeros(cap, dtype=np.uint64)
        self._mask = cap - 1
        self._shift = np.uint64(64 - (cap.bit_length() - 1))
        self._deleted = 0

    def __len__(self) -> int:
        return self._live

    def __contains__(self, root: object) -> bool:
        return isinstance(root, int) and self._find_one(root) >= 0

    @property
    def capacity(self) -> int:
        return len(self._keys)

    def memory_bytes(self) -> int:
        """Bytes held by the table's arrays."""
        return int(self._keys.nbytes + self._vals.nbytes)

    def value(self, root: int) -> int | None:
        """The current ack value of a pending root, None if it is not pending."""
        slot = self._find_one(root)
        return None if slot < 0 else int(self._vals[slot])

    def roots(self) -> NDArray[np.uint64]:
        """Every pending root (a copy)."""
        return self._keys[self._keys > _DELETED].copy()

    def items(self) -> tuple[NDArray[np.uint64], NDArray[np.uint64]]:
        """Every pending root and its ack value (copies), for snapshots."""
        live = self._keys > _DELETED
        return self._keys[live].copy(), self._vals[live].copy()

    # ---- add -------------------------------------------------------------------

    def add(self, roots: ArrayLike, values: ArrayLike | None = None) -> None:
        """Register pending roots with initial ack values (default 0).

        Raises ValueError, and changes nothing, if a root is reserved (0 or 1), already
        pending, or repeated in the batch.
        """
        keys = np.ascontiguousarray(roots, dtype=np.uint64)
        vals = (
            np.zeros(len(keys), dtype=np.uint64)
            if values is None
            else np.ascontiguousarray(values, dtype=np.uint64)
        )
        if len(vals) != len(keys):
            raise ValueError(f"add: {len(keys)} roots but {len(vals)} values")
        if len(keys) == 0:
            return
        if bool((keys <= _DELETED).any()):
            bad = int(keys[keys <= _DELETED][0])
            raise ValueError(f"add: root id {bad} is reserved (ids are drawn from [2, 2**64))")
        self._reserve(len(keys))
        present = self._find(keys)
        if bool((present >= 0).any()):
            dup = int(keys[present >= 0][0])
            raise ValueError(f"add: root {dup:#x} is already pending")
        slots = self._insert(keys, vals)
        if not np.array_equal(self._find(keys), slots):
            # Two equal roots in one batch landed in two slots; undo the whole batch.
            self._keys[slots] = _DELETED
            self._deleted += len(slots)
            uniq, counts = np.unique(keys, return_counts=True)
            raise ValueError(f"add: root {int(uniq[counts > 1][0]):#x} repeated in the batch")
        self._live += len(keys)

    # ---- xor -------------------------------------------------------------------

    def xor(self, roots: ArrayLike, values: ArrayLike) -> XorResult:
        """Apply a batch of XOR events (root, value); see the module docstring."""
        keys = np.ascontiguousarray(roots, dtype=np.uint64)
        vals = np.ascontiguousarray(values, dtype=np.uint64)
        if len(vals) != len(keys):
            raise ValueError(f"xor: {len(keys)} roots but {len(vals)} values")
        if len(keys) == 0:
            return XorResult(_EMPTY_U64, _EMPTY_U64)
        slots = self._find(keys)
        known = slots >= 0
        dropped = _EMPTY_U64
        if not bool(known.all()):
            dropped = keys[~known]
            self.dropped_events_total += len(dropped)
            slots = slots[known]
            vals = vals[known]
        table_vals = self._vals
        np.bitwise_xor.at(table_vals, slots, vals)
        zero = slots[table_vals[slots] == 0]
        if len(zero) == 0:
            return XorResult(_EMPTY_U64, dropped)
        zero = np.unique(zero)
        completed = self._keys[zero]  # fancy indexing copies
        self._remove_slots(zero)
        self.completed_total += len(zero)
        return XorResult(completed, dropped)

    def xor_one(self, root: int, value: int) -> bool:
        """Apply one XOR event; True if it completed its root. Late events are dropped."""
        slot = self._find_one(root)
        if slot < 0:
            self.dropped_events_total += 1
            return False
        new = int(self._vals[slot]) ^ value
        self._vals[slot] = new
        if new != 0:
            return False
        self._keys[slot] = _DELETED
        self._live -= 1
        self._deleted += 1
        self.completed_total += 1
        return True

    # ---- remove ----------------------------------------------------------------

    def remove(self, roots: ArrayLike) -> NDArray[np.uint64]:
        """Forget pending roots (failed ones); returns those that were pending, each once."""
        keys = np.ascontiguousarray(roots, dtype=np.uint64)
        if len(keys) == 0:
            return _EMPTY_U64
        slots = self._find(keys)
        slots = np.unique(slots[slots >= 0])
        failed = self._keys[slots]
        self._remove_slots(slots)
        return failed

    # ---- internals ---------------------------------------------------------------

    def _remove_slots(self, slots: NDArray[np.intp]) -> None:
        self._keys[slots] = _DELETED
        self._live -= len(slots)
        self._deleted += len(slots)

    def _home(self, keys: NDArray[np.uint64]) -> NDArray[np.intp]:
        return ((keys * _GOLDEN) >> self._shift).astype(np.intp)

    def _find(self, keys: NDArray[np.uint64]) -> NDArray[np.intp]:
        """Slot of each key, -1 where absent. Reserved keys (0, 1) are never found."""
        n = len(keys)
        out = np.full(n, -1, dtype=np.intp)
        table = self._keys
        slot = self._home(keys)
        idx: NDArray[np.intp] | None = None  # None: all n keys still probing, in order
        k = keys
        while True:
            found = table[slot]
            hit = found == k
            go = ~hit & (found != _EMPTY)
            if idx is None:
                valid = k > _DELETED
                hit &= valid
                go &= valid
                out[hit] = slot[hit]
                if not bool(go.any()):
                    return out
                idx = np.flatnonzero(go)
            else:
                out[idx[hit]] = slot[hit]
                if not bool(go.any()):
                    return out
                idx = idx[go]
            k = keys[idx]
            slot = (slot[go] + 1) & self._mask

    def _find_one(self, root: int) -> int:
        if not 2 <= root < 2**64:
            return -1
        key = np.uint64(root)
        slot = int(self._home(np.array([key], dtype=np.uint64))[0])
        table = self._keys
        while True:
            found = table[slot]
            if found == key:
                return slot
            if found == _EMPTY:
                return -1
            slot = (slot + 1) & self._mask

    def _insert(self, keys: NDArray[np.uint64], vals: NDArray[np.uint64]) -> NDArray[np.intp]:
        """Place keys known to be absent; returns their slots. Capacity is reserved."""
        table, table_vals, mask = self._keys, self._vals, self._mask
        out = np.empty(len(keys), dtype=np.intp)
        idx = np.arange(len(keys), dtype=np.intp)
        slot = self._home(keys)
        reused = 0
        while len(idx):
            free = table[slot] <= _DELETED
            cand = idx[free]
            cslot = slot[free]
            # Several keys may want the same free slot: write each candidate's index into
            # the (free, so unused) value cell and keep the one whose index stuck.
            table_vals[cslot] = cand.astype(np.uint64)
            won = table_vals[cslot] == cand.astype(np.uint64)
            wslot = cslot[won]
            wcand = cand[won]
            reused += int(np.count_nonzero(table[wslot] == _DELETED))
            table[wslot] = keys[wcand]
            table_vals[wslot] = vals[wcand]
            out[wcand] = wslot
            placed = np.zeros(len(idx), dtype=np.bool_)
            placed[np.flatnonzero(free)[won]] = True
            idx = idx[~placed]
            slot = (slot[~placed] + 1) & mask
        self._deleted -= reused
        return out

    def _reserve(self, n: int) -> None:
        """Grow or rehash so that n more keys keep the load factor at most 1/2."""
        cap = len(self._keys)
        if self._live + self._deleted + n <= cap * _MAX_LOAD:
            return
        new_cap = max(cap, _capacity_for(self._live + n))
        keys, vals = self.items()
        self._alloc(new_cap)
        self._insert(keys, vals)


def _capacity_for(n: int) -> int:
    """Smallest power of two >= 16 that holds n keys at load factor 1/2."""
    need = max(16, int(np.ceil(max(n, 1) / _MAX_LOAD)))
    return 1 << (need - 1).bit_length()
