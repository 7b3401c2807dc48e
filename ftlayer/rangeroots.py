"""Range roots: a record of a batch range named by its offset, not by a drawn id.

In barrier mode with `ft.persist=reference` a source persists nothing per record: at
the barrier it registers its batch as one offset range per Kafka partition (BATCH_RANGES,
ftlayer.core.ranges), and the FT layer answers each range's *number*. Every row the
reader emits then carries, as its `ft_root`, the record's range root:

    bit 63       bits 40-62           bits 0-39
    1            the range number     offset - the range's start

A drawn root never has bit 63 set (ftlayer.acking.ids), so the two kinds never meet.
A step or sink fails a row exactly as it fails any other (FAIL with its root); the FT
layer finds the range by its number and the record by its offset.

In tree mode a range's records complete one by one, each when its tree does. A reader
of a range draws a random *seed* and tells the FT layer (RANGE_READ) before it emits
a row; each row then carries its *emission id* (`emission_ids`): a mix of its range
root and the seed, never 0. The FT layer computes the same id where it needs it, so
it starts no ack value per record: a record is complete when the XOR of the events
naming its range root equals its emission id (ftlayer.core.rangeacks).

Limits: range numbers are 1 to 2**23 - 1 (numbers of completed ranges are used again),
and a range holds at most 2**40 offsets. Nothing here imports the core: executors
compute range roots with this module alone.
"""

from __future__ import annotations

from typing import Final

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ftlayer.errors import ConfigError

__all__ = [
    "DELTA_BITS",
    "MAX_NUMBER",
    "MAX_RANGE",
    "RANGE_BIT",
    "decode",
    "emission_ids",
    "encode",
    "is_range_root",
]

RANGE_BIT: Final = 1 << 63
DELTA_BITS: Final = 40
MAX_RANGE: Final = 1 << DELTA_BITS
"""The most offsets one range may hold."""
MAX_NUMBER: Final = (1 << 23) - 1
_DELTA_MASK: Final = np.uint64(MAX_RANGE - 1)
_NUMBER_MASK: Final = np.uint64(MAX_NUMBER)
_U64: Final = (1 << 64) - 1
# splitmix64's finalizer (Steele, Lea and Flood, 2014): every input bit reaches every
# output bit, so the ids of neighbouring roots share no pattern.
_GOLDEN: Final = np.uint64(0x9E3779B97F4A7C15)
_MIX1: Final = np.uint64(0xBF58476D1CE4E5B9)
_MIX2: Final = np.uint64(0x94D049BB133111EB)


def encode(number: int, start: int, offsets: ArrayLike) -> NDArray[np.uint64]:
    """The range roots of `offsets` (each in [start, start + 2**40)) of range `number`."""
    if not 1 <= number <= MAX_NUMBER:
        raise ConfigError(f"a range number is 1 to {MAX_NUMBER}, got {number}")
    delta = np.asarray(offsets, dtype=np.int64) - np.int64(start)
    if len(delta) and (int(delta.min()) < 0 or int(delta.max()) >= MAX_RANGE):
        raise ConfigError(
            f"offsets {int(delta.min()) + start} to {int(delta.max()) + start} are not all in "
            f"range {number}, which starts at {start} and holds at most {MAX_RANGE} offsets"
        )
    head = np.uint64(RANGE_BIT | (number << DELTA_BITS))
    return delta.astype(np.uint64) | head


def is_range_root(roots: ArrayLike) -> NDArray[np.bool_]:
    """Per root: a range root (bit 63 set)."""
    return (np.asarray(roots, dtype=np.uint64) >> np.uint64(63)).astype(np.bool_)


def decode(roots: ArrayLike) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """(range numbers, offsets from each range's start) of range roots."""
    array = np.asarray(roots, dtype=np.uint64)
    numbers = (array >> np.uint64(DELTA_BITS)) & _NUMBER_MASK
    return numbers.astype(np.int64), (array & _DELTA_MASK).astype(np.int64)


def emission_ids(seed: int | NDArray[np.uint64], roots: ArrayLike) -> NDArray[np.uint64]:
    """The emission id of each range root read under `seed` (one for all, or one per
    root; tree mode: the `ft_id` its reader emits the row with, and what the XOR of
    the row's events must equal for its tree to be complete); never 0."""
    mix = np.uint64(seed & _U64) if isinstance(seed, int) else np.asarray(seed, np.uint64)
    z = np.asarray(roots, dtype=np.uint64) ^ mix
    z = z + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    z = z ^ (z >> np.uint64(31))
    z[z == 0] = 1
    return z
