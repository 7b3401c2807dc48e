"""The numba kernels of U64Map's probing (ftlayer/acking/u64map.py): find, place, and
the slot of a row, each one pass over the batch with one probe loop per key, where the
numpy versions make a few passes and a temporary array per probing round; and the
acker's XOR of a batch of events into their rows (`xor_rows`, ftlayer/acking/acker.py).

Loaded by u64map on first use (importing numba takes a while); compiled once and
cached on disk beside this file (numba's `cache=True`; `make` compiles them), so a
server starting on a fresh machine loads machine code. `nogil`: they run while other
threads of the server take the GIL.
"""

from __future__ import annotations

from typing import Final

import numpy as np
from numba import njit

__all__ = ["OK", "PRESENT", "REPEATED", "find_slots", "place", "slots_of_rows", "xor_rows"]

_GOLDEN: Final = np.uint64(0x9E3779B97F4A7C15)
_EMPTY: Final = -1

OK: Final = 0
PRESENT: Final = 1
REPEATED: Final = 2


@njit(cache=True, nogil=True)
def find_slots(
    index: np.ndarray,
    stored: np.ndarray,
    keys: np.ndarray,
    shift: np.uint64,
    mask: int,
    slots: np.ndarray,
    rows: np.ndarray,
) -> None:
    """The (index slot, row) of each key into `slots` and `rows`, -1 where absent."""
    for i in range(len(keys)):
        key = keys[i]
        slot = np.intp((key * _GOLDEN) >> shift)
        while True:
            row = index[slot]
            if row == _EMPTY:
                slots[i] = -1
                rows[i] = -1
                break
            if row >= 0 and stored[row] == key:
                slots[i] = slot
                rows[i] = row
                break
            slot = (slot + 1) & mask


@njit(cache=True, nogil=True)
def place(
    index: np.ndarray,
    stored: np.ndarray,
    keys: np.ndarray,
    rows: np.ndarray,
    shift: np.uint64,
    mask: int,
    first_new_row: int,
    slots: np.ndarray,
) -> tuple[int, int]:
    """Claim the first empty slot on each key's probe path for its row (`stored[rows]`
    already holds the keys), into `slots`. A key met on the way is a copy already
    there (PRESENT: its row is below `first_new_row`) or earlier in the batch
    (REPEATED): the slots claimed so far are emptied again and (kind, i) returned for
    the i-th key; (OK, 0) when every key was placed."""
    for i in range(len(keys)):
        key = keys[i]
        slot = np.intp((key * _GOLDEN) >> shift)
        while True:
            row = index[slot]
            if row == _EMPTY:
                index[slot] = rows[i]
                slots[i] = slot
                break
            if row >= 0 and stored[row] == key:
                for j in range(i):
                    index[slots[j]] = _EMPTY
                return (PRESENT if row < first_new_row else REPEATED), i
            slot = (slot + 1) & mask
    return OK, 0


@njit(cache=True, nogil=True)
def slots_of_rows(
    index: np.ndarray,
    stored: np.ndarray,
    rows: np.ndarray,
    shift: np.uint64,
    mask: int,
    slots: np.ndarray,
) -> None:
    """The index slot of each live row into `slots`: on its key's probe path, the slot
    that holds the row."""
    for i in range(len(rows)):
        row = rows[i]
        slot = np.intp((stored[row] * _GOLDEN) >> shift)
        while index[slot] != row:
            slot = (slot + 1) & mask
        slots[i] = slot


@njit(cache=True, nogil=True)
def xor_rows(ack: np.ndarray, rows: np.ndarray, values: np.ndarray, done: np.ndarray) -> int:
    """XOR each event's value into its row's cell of `ack` (a row may have several
    events); then the batch position of one event of each row whose cell came to 0
    into `done`, each row once; returns how many. Those cells are left at 1 (a mark
    that the row was counted): the caller removes their rows."""
    for i in range(len(rows)):
        ack[rows[i]] ^= values[i]
    n = 0
    for i in range(len(rows) - 1, -1, -1):
        row = rows[i]
        if ack[row] == 0:
            ack[row] = 1
            done[n] = i
            n += 1
    return n
