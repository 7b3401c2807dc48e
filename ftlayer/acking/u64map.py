"""U64Map: a hash map from uint64 ids to fixed-width columns, operated on whole arrays.

The FT layer's hot tables (the acker's ack values, the persistence index) map random
64-bit ids to a few numbers each, and are read and written a batch of ids at a time.
A Python dict would cost a Python object or two per id and a Python-level loop per
batch; this map keeps ids and values in numpy arrays and does every operation with a
handful of vectorized passes.

Invariants:
- Keys are ids in [2, 2**64): 0 marks an empty slot and 1 a deleted one (ids are drawn
  from [2, 2**64) for this reason). Reserved keys are refused on insert and never found.
- Open addressing with linear probing, Fibonacci hashing (multiply by 2**64 / phi, keep
  the top bits), capacity a power of two, load (live + deleted slots) at most 1/2; the
  table grows, or is rebuilt to drop deleted slots, before an insert would pass it.
- insert() is all or nothing: a reserved key, a key already present or a key repeated
  in the batch raises ValueError and leaves the map as it was.

Costs, n = ids in a batch: find, insert, delete are O(n) expected, in a few numpy
passes each (probing rounds shrink geometrically at load 1/2). Memory: 8 bytes for the
key plus the column widths, per slot; at most twice that per live key.

live_slots() scans the whole table, O(capacity), unless the map is made with
track_live: then it keeps the live slots as a dense list (4 + 2 bytes more per slot),
maintained in O(n) per insert and delete, and enumerates them in O(live). A table
that churns is up to 8 times larger than its live keys, so an owner that enumerates
often (the FT layer's checkpoints, every micro-batch) tracks. Columns named in
`mirror` (and the keys, if `key_name` is named) are also kept in list order (their
width per half slot), so reading them for every live key (live_view) is one
sequential copy instead of a gather across the table.
Not thread-safe: one thread owns a map.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from numpy.typing import ArrayLike, DTypeLike, NDArray

EMPTY = np.uint64(0)
DELETED = np.uint64(1)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MAX_LOAD = 0.5


def capacity_for(n: int) -> int:
    """Smallest power of two >= 16 that holds n keys at load factor 1/2."""
    need = max(16, 2 * max(n, 1))
    return 1 << (need - 1).bit_length()


class U64Map:
    """uint64 id -> named fixed-width columns; see the module docstring."""

    def __init__(
        self,
        columns: Mapping[str, DTypeLike],
        capacity: int = 1024,
        *,
        key_name: str = "id",
        track_live: bool = False,
        mirror: Sequence[str] = (),
    ) -> None:
        self.key_name = key_name
        self._dtypes = {name: np.dtype(dtype) for name, dtype in columns.items()}
        unknown = set(mirror) - set(self._dtypes) - {key_name}
        if unknown or (mirror and not track_live):
            raise ValueError(
                f"mirror needs track_live and known columns (or {key_name!r}), got {list(mirror)}"
            )
        self._live = 0
        self._track = track_live
        self._mirrored = tuple(mirror)
        self._alloc(capacity_for(capacity))

    def _alloc(self, cap: int) -> None:
        self.keys: NDArray[np.uint64] = np.zeros(cap, dtype=np.uint64)
        self.columns: dict[str, NDArray[np.generic]] = {
            name: np.zeros(cap, dtype=dtype) for name, dtype in self._dtypes.items()
        }
        self._mask = cap - 1
        self._shift = np.uint64(64 - (cap.bit_length() - 1))
        self._deleted = 0
        self._live_cache: NDArray[np.intp] | None = None
        if self._track:
            # The live slots as a dense list (first _live entries, in no order) and
            # each live slot's place in it, so deletes swap-remove in O(deleted).
            self._list: NDArray[np.int32] = np.zeros(cap // 2, dtype=np.int32)
            self._pos: NDArray[np.int32] = np.zeros(cap, dtype=np.int32)
            # Mirrored columns: a second copy in list order, so reading them for every
            # live key is a sequential pass instead of a gather from the whole table.
            self._dense: dict[str, NDArray[np.generic]] = {
                name: np.zeros(cap // 2, dtype=self._dtypes.get(name, np.uint64))
                for name in self._mirrored
            }

    def __len__(self) -> int:
        return self._live

    def __contains__(self, key: object) -> bool:
        return isinstance(key, int) and self.find_one(key) >= 0

    @property
    def capacity(self) -> int:
        return len(self.keys)

    def memory_bytes(self) -> int:
        """Bytes held by the map's arrays."""
        tracking = 0
        if self._track:
            tracking = self._list.nbytes + self._pos.nbytes
            tracking += sum(d.nbytes for d in self._dense.values())
        return int(self.keys.nbytes + sum(c.nbytes for c in self.columns.values()) + tracking)

    def live_slots(self) -> NDArray[np.intp]:
        """The slots of every live key (read-only). With track_live, O(live) and in no
        particular order; otherwise ascending, from a scan of the whole table,
        O(capacity). Either is kept until the next insert or delete, so readers that
        follow each other with no change between (a checkpoint's completion and the
        next barrier's snapshot) share it."""
        if self._live_cache is None:
            if self._track:
                live = np.sort(self._list[: self._live]).astype(np.intp)
            else:
                live = np.flatnonzero(self.keys > DELETED)
            live.flags.writeable = False
            self._live_cache = live
        return self._live_cache

    def live_view(self, *names: str, copy: bool = True) -> dict[str, NDArray[np.generic]]:
        """Copies of the named columns (`key_name`: the keys) for every live key, in
        one (unspecified) order: mirrored ones by a sequential copy (`copy=False`:
        read-only views, valid until the next insert or delete), the others by a
        gather through the live slots (in list order if tracked)."""
        if not self._track:
            live = self.live_slots()
            return {name: self._column(name)[live] for name in names}
        found: dict[str, NDArray[np.generic]] = {}
        slots: NDArray[np.int32] | None = None
        for name in names:
            if name in self._dense:
                dense = self._dense[name][: self._live]
                if copy:
                    dense = dense.copy()
                else:
                    dense = dense.view()
                    dense.flags.writeable = False
                found[name] = dense
                continue
            if slots is None:
                slots = self._list[: self._live]
            found[name] = self._column(name)[slots]
        return found

    def _column(self, name: str) -> NDArray[np.generic]:
        return self.keys if name == self.key_name else self.columns[name]

    def set_column(self, name: str, slots: NDArray[np.intp], values: ArrayLike) -> None:
        """Set column `name` at live `slots` (its mirror too)."""
        self.columns[name][slots] = values
        if name in self._mirrored:
            self._dense[name][self._pos[slots]] = values

    # ---- lookup ----------------------------------------------------------------

    def _home(self, keys: NDArray[np.uint64]) -> NDArray[np.intp]:
        return ((keys * _GOLDEN) >> self._shift).astype(np.intp)

    def find(self, keys: NDArray[np.uint64]) -> NDArray[np.intp]:
        """The slot of each key, -1 where it is absent."""
        out = np.full(len(keys), -1, dtype=np.intp)
        table, mask = self.keys, self._mask
        slot = self._home(keys)
        found = table[slot]
        hit = found == keys
        valid = keys > DELETED
        hit &= valid
        out[hit] = slot[hit]
        go = ~hit & valid & (found != EMPTY)
        if not bool(go.any()):
            return out
        idx = np.flatnonzero(go)
        while True:
            k = keys[idx]
            slot = (slot[go] + 1) & mask
            found = table[slot]
            hit = found == k
            out[idx[hit]] = slot[hit]
            go = ~hit & (found != EMPTY)
            if not bool(go.any()):
                return out
            idx = idx[go]

    def find_one(self, key: int) -> int:
        """The slot of one key, -1 if absent (cold paths)."""
        if not 2 <= key < 2**64:
            return -1
        k = np.uint64(key)
        slot = int(self._home(np.array([k], dtype=np.uint64))[0])
        while True:
            found = self.keys[slot]
            if found == k:
                return slot
            if found == EMPTY:
                return -1
            slot = (slot + 1) & self._mask

    # ---- insert and delete -------------------------------------------------------

    def insert(self, keys: ArrayLike, **values: ArrayLike) -> NDArray[np.intp]:
        """Add new keys with their column values (missing columns are zero); returns
        their slots. ValueError, and no change, on a reserved, present or repeated key."""
        k = np.ascontiguousarray(keys, dtype=np.uint64)
        unknown = set(values) - set(self._dtypes)
        if unknown:
            raise ValueError(f"unknown columns {sorted(unknown)}; have {sorted(self._dtypes)}")
        for name, column in values.items():
            if np.ndim(column) and len(np.asarray(column)) != len(k):
                raise ValueError(f"{len(k)} keys but {len(np.asarray(column))} {name!r} values")
        if len(k) == 0:
            return np.zeros(0, dtype=np.intp)
        self._live_cache = None
        if bool((k <= DELETED).any()):
            bad = int(k[k <= DELETED][0])
            raise ValueError(f"{self.key_name} {bad} is reserved (ids are drawn from [2, 2**64))")
        self._reserve(len(k))
        slots = self._place(k)
        # New keys only go to empty slots, past every slot their probe could find first:
        # a key already present, or repeated in the batch, is found at another slot than
        # the one just claimed. A key placed at its home slot found it empty, so no copy
        # of it can be in the table: only displaced keys need the check.
        displaced = np.flatnonzero(slots != self._home(k))
        found = self.find(k[displaced])
        wrong = found != slots[displaced]
        if bool(wrong.any()):
            self.keys[slots] = DELETED  # undo the whole batch
            self._deleted += len(slots)
            first = int(np.flatnonzero(wrong)[0])
            key = int(k[displaced[first]])
            if not bool(np.isin(found[first], slots)):
                raise ValueError(f"{self.key_name} {key:#x} is already present")
            raise ValueError(f"{self.key_name} {key:#x} is repeated in the batch")
        for name, column in self.columns.items():
            column[slots] = values.get(name, 0)
        if self._track:
            end = self._live + len(k)
            self._list[self._live : end] = slots
            self._pos[slots] = np.arange(self._live, end, dtype=np.int32)
            for name in self._mirrored:
                self._dense[name][self._live : end] = (
                    k if name == self.key_name else values.get(name, 0)
                )
        self._live += len(k)
        return slots

    def delete_slots(self, slots: NDArray[np.intp]) -> None:
        """Delete the keys at `slots` (distinct live slots, e.g. from find)."""
        self.keys[slots] = DELETED
        if self._track and len(slots):
            self._unlist(slots)
        self._live -= len(slots)
        self._deleted += len(slots)
        self._live_cache = None

    def _unlist(self, slots: NDArray[np.intp]) -> None:
        """Swap-remove `slots` from the live list: the entries past the new end that
        stay live move into the holes the removed ones leave before it."""
        end = self._live - len(slots)
        places = self._pos[slots]
        gone_tail = np.zeros(len(slots), dtype=np.bool_)
        gone_tail[places[places >= end] - end] = True
        moving = end + np.flatnonzero(~gone_tail)
        movers = self._list[moving]
        holes = places[places < end]
        self._list[holes] = movers
        self._pos[movers] = holes
        for dense in self._dense.values():
            dense[holes] = dense[moving]

    def _place(self, keys: NDArray[np.uint64]) -> NDArray[np.intp]:
        """Claim an empty slot for each key (capacity reserved). Deleted slots are not
        reused: that keeps every new key past any copy already in the table, so one
        find() after placing detects duplicates, and rebuilds reclaim deleted slots."""
        table, mask = self.keys, self._mask
        out = np.empty(len(keys), dtype=np.intp)
        idx = np.arange(len(keys), dtype=np.intp)
        slot = self._home(keys)
        while len(idx):
            free = table[slot] == EMPTY
            cand = idx[free]
            cslot = slot[free]
            # Several keys may want one empty slot: each writes its index there (the slot
            # is empty, so the key cell is scratch) and the one whose index stuck wins.
            marks = cand.astype(np.uint64)
            table[cslot] = marks
            won = table[cslot] == marks
            table[cslot[won]] = keys[cand[won]]
            out[cand[won]] = cslot[won]
            placed = np.zeros(len(idx), dtype=np.bool_)
            placed[np.flatnonzero(free)[won]] = True
            idx = idx[~placed]
            slot = (slot[~placed] + 1) & mask
        return out

    def _reserve(self, n: int) -> None:
        """Grow, or rebuild without deleted slots, so n more keys keep load <= 1/2.

        A rebuild that would leave the table more than 1/4 full doubles it instead:
        then at least as many inserts as live keys pass before the next rebuild, so
        rebuilds cost O(1) moves per insert even when keys churn (deleted slots are not
        reused, see _place)."""
        cap = len(self.keys)
        if self._live + self._deleted + n <= cap * _MAX_LOAD:
            return
        # A tracked map keeps its list order, which its mirrors share.
        live = self._list[: self._live].astype(np.intp) if self._track else self.live_slots()
        keys = self.keys[live]
        columns = {name: column[live] for name, column in self.columns.items()}
        # Views of the old arrays: _alloc makes new ones, so no copy is needed.
        dense = {name: d[: self._live] for name, d in self._dense.items()} if self._track else {}
        new_cap = max(cap, capacity_for(self._live + n))
        if self._deleted and (self._live + n) * 4 > new_cap:
            new_cap *= 2
        self._alloc(new_cap)
        slots = self._place(keys)
        for name, column in columns.items():
            self.columns[name][slots] = column
        if self._track:
            self._list[: len(slots)] = slots
            self._pos[slots] = np.arange(len(slots), dtype=np.int32)
            for name, values in dense.items():
                self._dense[name][: len(values)] = values
