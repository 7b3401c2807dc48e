"""The numba kernels of tree mode by range (ftlayer.core.rangeacks): a batch of events
applied to one range's ack values, and the completions they make, each one loop over
the events where the numpy version makes some twenty passes and a temporary array per
pass (a sink's settle applies a batch's held acks at once: 180,000 events of four
ranges in a 200,000-record batch).

Loaded by rangeacks on first use (importing numba takes a while); compiled once and
cached on disk beside this file (numba's `cache=True`; `make` compiles them), so a
server starting on a fresh machine loads machine code. `nogil`: they run while other
threads of the server take the GIL.
"""

from __future__ import annotations

from typing import Final

import numpy as np
from numba import njit

from ftlayer.rangeroots import DELTA_BITS

from .rangetable import COMPLETED, PENDING

__all__ = ["apply_events", "distinct_heads", "mark_pending", "scan_events"]

_SHIFT: Final = np.uint64(DELTA_BITS)
_DELTA_MASK: Final = np.uint64((1 << DELTA_BITS) - 1)
_PENDING: Final = np.uint8(PENDING)
_COMPLETED: Final = np.uint8(COMPLETED)
# ftlayer.rangeroots.emission_ids' mix (splitmix64's finalizer), in uint64 throughout:
# numba makes a float of a uint64 mixed with a signed integer.
_GOLDEN: Final = np.uint64(0x9E3779B97F4A7C15)
_MIX1: Final = np.uint64(0xBF58476D1CE4E5B9)
_MIX2: Final = np.uint64(0x94D049BB133111EB)
_S30: Final = np.uint64(30)
_S27: Final = np.uint64(27)
_S31: Final = np.uint64(31)
_ZERO: Final = np.uint64(0)
_ONE: Final = np.uint64(1)
_RANGE_HEAD: Final = np.uint64(1 << (63 - DELTA_BITS))
"""The least head (`root >> DELTA_BITS`) of a range root: bit 63 set."""


@njit(cache=True, nogil=True)
def distinct_heads(roots: np.ndarray, out: np.ndarray) -> int:
    """The distinct heads (`root >> DELTA_BITS`: the range bit and number) of the range
    roots among `roots`, into `out`; returns how many, or -1 when there are more than
    `out` holds. Events come in runs of one range (a task's rows of a partition), so
    a head like the last one costs one comparison."""
    found = 0
    last = _ZERO
    for i in range(len(roots)):
        head = roots[i] >> _SHIFT
        if head < _RANGE_HEAD or head == last:
            continue
        last = head
        known = False
        for j in range(found):
            if out[j] == head:
                known = True
                break
        if known:
            continue
        if found == len(out):
            return -1
        out[found] = head
        found += 1
    return found


@njit(cache=True, nogil=True)
def mark_pending(roots: np.ndarray, head: np.uint64, state: np.ndarray, found: np.ndarray) -> None:
    """Set `found` for each root of the range `head` names (scan_events) whose record
    is pending in it."""
    n = np.uint64(len(state))
    for i in range(len(roots)):
        root = roots[i]
        if (root >> _SHIFT) == head:
            delta = root & _DELTA_MASK
            if delta < n and state[delta] == _PENDING:
                found[i] = True


@njit(cache=True, nogil=True)
def scan_events(
    roots: np.ndarray,
    values: np.ndarray,
    head: np.uint64,
    state: np.ndarray,
    taken: np.ndarray,
    counts: np.ndarray,
) -> None:
    """Mark in `taken` the events whose root is of the range whose roots' top bits
    (`root >> DELTA_BITS`) are `head`, and count among them into `counts`: [0] those
    beyond the range, [1] those of a record not pending in it, [2] zero values of
    pending records (exclusions), [3] the events of pending records."""
    n = np.uint64(len(state))
    for i in range(len(roots)):
        root = roots[i]
        if (root >> _SHIFT) != head:
            continue
        taken[i] = True
        delta = root & _DELTA_MASK
        if delta >= n:
            counts[0] += 1
        elif state[delta] != _PENDING:
            counts[1] += 1
        else:
            if values[i] == _ZERO:
                counts[2] += 1
            counts[3] += 1


@njit(cache=True, nogil=True)
def apply_events(
    roots: np.ndarray,
    values: np.ndarray,
    head: np.uint64,
    acc: np.ndarray,
    state: np.ndarray,
    seeds: np.ndarray,
) -> tuple[int, int]:
    """XOR the events of pending records of the range `head` names (scan_events) into
    their ack values, then complete every record an event named whose ack value equals
    its emission id under its seed (none without a seed); returns (events applied,
    records completed). All events are applied before any record is checked, so a
    record named twice is checked on its final value, and completed once."""
    n = np.uint64(len(state))
    applied = 0
    for i in range(len(roots)):
        root = roots[i]
        if (root >> _SHIFT) != head:
            continue
        delta = root & _DELTA_MASK
        if delta < n and state[delta] == _PENDING:
            acc[delta] ^= values[i]
            applied += 1
    completed = 0
    for i in range(len(roots)):
        root = roots[i]
        if (root >> _SHIFT) != head:
            continue
        delta = root & _DELTA_MASK
        if delta >= n or state[delta] != _PENDING:
            continue
        seed = seeds[delta]
        if seed == _ZERO:
            continue
        z = (root ^ seed) + _GOLDEN
        z = (z ^ (z >> _S30)) * _MIX1
        z = (z ^ (z >> _S27)) * _MIX2
        z = z ^ (z >> _S31)
        if z == _ZERO:
            z = _ONE
        if acc[delta] == z:
            state[delta] = _COMPLETED
            completed += 1
    return applied, completed
