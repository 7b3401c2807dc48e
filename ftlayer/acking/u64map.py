"""U64Map: a hash map from uint64 ids to fixed-width columns, operated on whole arrays.

The FT layer's acker table maps random 64-bit ids to a few numbers each, and is read
and written a batch of ids at a time. A Python dict would cost a Python object or two
per id and a Python-level loop per batch; this map keeps ids and values in numpy
arrays and does every operation with a handful of vectorized passes.

Layout, two levels:
- Rows: the keys and every column in dense arrays, the live keys in rows
  [0, len) in no particular order. Deleting swap-removes: the last live rows move into
  the holes. Reading a column for every live key (live_view) is a slice.
- Index: an int32 array of slots, each the row of a key (EMPTY, DELETED: none). Open
  addressing with linear probing from the key's home slot (Fibonacci hashing:
  multiply by 2**64 / phi, keep the top bits); a probe compares the key through its
  row. Capacity a power of two, load (live + deleted slots) at most 1/2; the index
  grows, or is rebuilt to drop deleted slots, before an insert would pass it.

Invariants:
- Keys are ids in [2, 2**64) (ids are drawn from there: 0 and 1 are refused on
  insert and never found).
- Every live key has exactly one index slot, which holds its row; the index holds no
  other row. A key's slot lies on its probe path before any EMPTY slot.
- insert() is all or nothing: a reserved key or a key repeated in the batch raises
  ConfigError, a key already present StateConflict, and the map is left as it was.

Costs, n = ids in a batch: find, insert, delete are O(n) expected: the probing is one
numba loop per batch (ftlayer/acking/u64kernels.py; a probe is short at load 1/2),
the rest a few numpy passes. Rows and slots are
handles valid until the next change (a delete moves rows, an insert may move slots).
Memory per live key: the key and the column widths per row, at most 1.25 rows a key
once the map has grown (rows_for), plus 4 bytes per index slot, 2 to 4 slots a key
(4 to 8 when keys churn: a churning index doubles rather than rebuild too often).
Not thread-safe: one thread owns a map.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import numpy as np
from numpy.typing import ArrayLike, DTypeLike, NDArray

from ftlayer.errors import ConfigError, StateConflict

EMPTY = -1
DELETED = -2
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MAX_LOAD = 0.5
_MIN_ROWS = 16
_T = TypeVar("_T", bound=np.generic)


def rows_for(n: int) -> int:
    """Rows for n keys: the smallest of 4, 5, 6 or 7 times a power of two that holds
    them (at least 16), so rows are at most 1.25 times the keys they were sized for
    and a growth adds at least a seventh."""
    n = max(n, _MIN_ROWS)
    step = 1 << max(0, (n - 1).bit_length() - 3)
    return -(-n // step) * step


def capacity_for(n: int) -> int:
    """Smallest power of two >= 16 that holds n keys at load factor 1/2."""
    need = max(16, 2 * max(n, 1))
    return 1 << (need - 1).bit_length()


class U64Map:
    """uint64 id -> named fixed-width columns; see the module docstring."""

    def __init__(
        self, columns: Mapping[str, DTypeLike], capacity: int = 1024, *, key_name: str = "id"
    ) -> None:
        """`capacity`: keys to make room for up front; `key_name`: what live_view
        calls the keys."""
        self.key_name = key_name
        self._dtypes = {name: np.dtype(dtype) for name, dtype in columns.items()}
        if key_name in self._dtypes:
            raise ConfigError(f"column name {key_name!r} names the keys")
        self._live = 0
        rows = rows_for(capacity)
        self.keys: NDArray[np.uint64] = np.zeros(rows, dtype=np.uint64)
        self.columns: dict[str, NDArray[np.generic]] = {
            name: np.zeros(rows, dtype=dtype) for name, dtype in self._dtypes.items()
        }
        self._alloc_index(capacity_for(capacity))

    def _alloc_index(self, cap: int) -> None:
        self._index: NDArray[np.int32] = np.full(cap, EMPTY, dtype=np.int32)
        self._mask = cap - 1
        self._shift = np.uint64(64 - (cap.bit_length() - 1))
        self._deleted = 0

    def __len__(self) -> int:
        return self._live

    def __contains__(self, key: object) -> bool:
        return isinstance(key, int) and self.find_one(key) >= 0

    @property
    def capacity(self) -> int:
        """Index slots."""
        return len(self._index)

    @property
    def rows(self) -> int:
        """Rows allocated (live ones first)."""
        return len(self.keys)

    def memory_bytes(self) -> int:
        """Bytes held by the map's arrays: rows (keys, columns) and index."""
        columns = sum(column.nbytes for column in self.columns.values())
        return int(self.keys.nbytes + columns + self._index.nbytes)

    def live_view(self, *names: str, copy: bool = True) -> dict[str, NDArray[np.generic]]:
        """The named columns (`key_name`: the keys) of every live key, in row order:
        copies, or with `copy=False` read-only views valid until the next insert or
        delete."""
        found: dict[str, NDArray[np.generic]] = {}
        for name in names:
            column = self._column(name)[: self._live]  # a view of its own
            if copy:
                column = column.copy()
            else:
                column.flags.writeable = False
            found[name] = column
        return found

    def _column(self, name: str) -> NDArray[np.generic]:
        return self.keys if name == self.key_name else self.columns[name]

    def set_column(self, name: str, rows: NDArray[np.intp], values: ArrayLike) -> None:
        """Set column `name` at live `rows`."""
        self.columns[name][rows] = values

    # ---- lookup ----------------------------------------------------------------

    def _home(self, keys: NDArray[np.uint64]) -> NDArray[np.intp]:
        return ((keys * _GOLDEN) >> self._shift).astype(np.intp)

    def find(self, keys: NDArray[np.uint64]) -> NDArray[np.intp]:
        """The row of each key, -1 where it is absent."""
        return self.find_slots(keys)[1]

    def find_slots(self, keys: NDArray[np.uint64]) -> tuple[NDArray[np.intp], NDArray[np.intp]]:
        """(index slot, row) of each key, -1 and -1 where it is absent."""
        k = np.ascontiguousarray(keys, dtype=np.uint64)
        slots = np.empty(len(k), dtype=np.intp)
        rows = np.empty(len(k), dtype=np.intp)
        _kernels().find_slots(self._index, self.keys, k, self._shift, self._mask, slots, rows)
        return slots, rows

    def find_one(self, key: int) -> int:
        """The row of one key, -1 if absent (cold paths)."""
        if not 2 <= key < 2**64:
            return -1
        k = np.uint64(key)
        slot = int(self._home(np.array([k], dtype=np.uint64))[0])
        while True:
            row = int(self._index[slot])
            if row >= 0 and self.keys[row] == k:
                return row
            if row == EMPTY:
                return -1
            slot = (slot + 1) & self._mask

    # ---- insert and delete -------------------------------------------------------

    def insert(self, keys: ArrayLike, **values: ArrayLike) -> NDArray[np.intp]:
        """Add new keys with their column values (missing columns are zero); returns
        their rows. No change, and ConfigError on a reserved or repeated key,
        StateConflict on a present one."""
        k = np.ascontiguousarray(keys, dtype=np.uint64)
        unknown = set(values) - set(self._dtypes)
        if unknown:
            raise ConfigError(f"unknown columns {sorted(unknown)}; have {sorted(self._dtypes)}")
        for name, column in values.items():
            if np.ndim(column) and len(np.asarray(column)) != len(k):
                raise ConfigError(f"{len(k)} keys but {len(np.asarray(column))} {name!r} values")
        n = len(k)
        if n == 0:
            return np.zeros(0, dtype=np.intp)
        if bool((k <= 1).any()):
            bad = int(k[k <= 1][0])
            raise ConfigError(f"{self.key_name} {bad} is reserved (ids are drawn from [2, 2**64))")
        self._reserve(n)
        rows = np.arange(self._live, self._live + n, dtype=np.intp)
        self.keys[rows[0] : rows[-1] + 1] = k  # past the live rows: scratch until committed
        # New keys only go to empty slots, past every slot their probe could find first:
        # a key already present, or earlier in the batch, is met on the way (and the
        # slots claimed so far are emptied again).
        slots = np.empty(n, dtype=np.intp)
        kind, at = _kernels().place(
            self._index, self.keys, k, rows, self._shift, self._mask, self._live, slots
        )
        if kind:
            key = int(k[at])
            if kind == _kernels().PRESENT:
                raise StateConflict(f"{self.key_name} {key:#x} is already present")
            raise ConfigError(f"{self.key_name} {key:#x} is repeated in the batch")
        for name, column in self.columns.items():
            column[rows[0] : rows[-1] + 1] = values.get(name, 0)
        self._live += n
        return rows

    def delete(self, slots: NDArray[np.intp]) -> None:
        """Delete the keys at index `slots` (distinct live slots, from find_slots). The
        last live rows move into the rows they leave, so rows of other keys change."""
        if not len(slots):
            return
        rows = self._index[slots].astype(np.intp)
        self._index[slots] = DELETED
        self._deleted += len(slots)
        end = self._live - len(slots)
        # Rows at or past the new end that stay live fill the holes before it.
        gone_tail = np.zeros(len(slots), dtype=np.bool_)
        gone_tail[rows[rows >= end] - end] = True
        moving = end + np.flatnonzero(~gone_tail)
        holes = rows[rows < end]
        if len(holes):
            self._index[self._slots_of_rows(moving)] = holes
            self.keys[holes] = self.keys[moving]
            for column in self.columns.values():
                column[holes] = column[moving]
        self._live = end

    def _slots_of_rows(self, rows: NDArray[np.intp]) -> NDArray[np.intp]:
        """The index slot of each live row: on its key's probe path, the slot that
        holds the row."""
        out = np.empty(len(rows), dtype=np.intp)
        r = np.ascontiguousarray(rows, dtype=np.intp)
        _kernels().slots_of_rows(self._index, self.keys, r, self._shift, self._mask, out)
        return out

    def _reserve(self, n: int) -> None:
        """Make room for n more keys: rows grow to rows_for(len + n), and the index
        grows or is rebuilt without deleted slots so load stays <= 1/2.

        An index rebuild that would leave it more than 1/4 full doubles it instead:
        then at least as many inserts as live keys pass before the next rebuild, so
        rebuilds cost O(1) moves per insert even when keys churn (deleted slots are
        not reused: every new key goes past any copy already in the table, so placing it
        meets the copy; u64kernels.place)."""
        live = self._live
        if live + n > len(self.keys):
            grown = rows_for(live + n)
            self.keys = _regrown(self.keys, live, grown)
            for name, column in self.columns.items():
                self.columns[name] = _regrown(column, live, grown)
        cap = len(self._index)
        if live + self._deleted + n <= cap * _MAX_LOAD:
            return
        new_cap = max(cap, capacity_for(live + n))
        if self._deleted and (live + n) * 4 > new_cap:
            new_cap *= 2
        self._alloc_index(new_cap)
        slots = np.empty(live, dtype=np.intp)  # distinct keys: placed without a meeting
        _kernels().place(
            self._index,
            self.keys,
            self.keys[:live],
            np.arange(live),
            self._shift,
            self._mask,
            live,
            slots,
        )


_KERNELS: Any = None


def _kernels() -> Any:
    """ftlayer.acking.u64kernels, imported on first use (numba's import takes a while)."""
    global _KERNELS
    if _KERNELS is None:
        from ftlayer.acking import u64kernels

        _KERNELS = u64kernels
    return _KERNELS


def compile_kernels() -> None:
    """Compile U64Map's numba kernels (ftlayer.acking.u64kernels), or load them from
    numba's cache, with the types U64Map calls them with: `make` runs this once, so no
    server start waits for it."""
    for keys in (
        np.array([5, 7], dtype=np.uint64),
        np.frombuffer(np.array([5, 7], np.uint64).tobytes(), np.uint64),
    ):
        # Keys decoded off the wire are read-only arrays, which numba types apart.
        table = U64Map({"ack": np.uint64}, 16)
        table.insert(keys)
        table.delete(table.find_slots(keys[:1])[0])
        # The acker's XOR (ftlayer.acking.acker), of values as read off the wire too.
        rows = np.zeros(2, dtype=np.intp)
        _kernels().xor_rows(table.columns["ack"], rows, keys, np.empty(2, dtype=np.intp))


def _regrown(column: NDArray[_T], live: int, rows: int) -> NDArray[_T]:
    grown = np.zeros(rows, dtype=column.dtype)
    grown[:live] = column[:live]
    return grown
