"""Record ids: random 63-bit integers, generated in batches.

A RecordId is (root id, record id). The root id names the source record a record
descends from (new on every replay); the record id names the record itself. Both are
drawn uniformly from [2, 2**63): 0 marks "no id" on the wire, and 0 and 1 are
reserved (the acker table refuses both as roots), so neither is ever handed out. The
top bit is never set in a drawn id: a root with it set is a range root, which names a
record of a batch range by its offset (ftlayer.rangeroots).

Why random and 63 bits: a tree is complete when the XOR of all ids sent for it returns
to 0. With ids independent and uniform, a set of ids that should not cancel does so with
probability 2**-63 per check (docs/guarantees.md), and no coordination between processes
is needed to keep ids unique.

Generators are per process and re-seeded from os.urandom after fork, so forked Spark
workers never draw the same ids.
"""

from __future__ import annotations

import os
import threading

import numpy as np
from numpy.typing import NDArray

from ftlayer.errors import ConfigError

#: Smallest id ever generated; 0 and 1 are reserved (0: no id).
MIN_ID = 2

_state = threading.local()


def _generator() -> np.random.Generator:
    gen: np.random.Generator | None = getattr(_state, "gen", None)
    if gen is None or getattr(_state, "pid", None) != os.getpid():
        gen = np.random.Generator(np.random.PCG64(int.from_bytes(os.urandom(16), "little")))
        _state.gen = gen
        _state.pid = os.getpid()
    return gen


def new_ids(n: int) -> NDArray[np.uint64]:
    """`n` fresh random ids in [2, 2**63), as a uint64 array."""
    if n < 0:
        raise ConfigError(f"cannot generate a negative number of ids: {n}")
    ids = _generator().integers(MIN_ID, 2**63, size=n, dtype=np.uint64, endpoint=False)
    return ids


def new_id() -> int:
    """One fresh random id (cold paths; hot paths call new_ids)."""
    return int(new_ids(1)[0])
