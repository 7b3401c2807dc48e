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
is needed to keep ids unique. In a cluster of several FT-layer shards a root carries
its shard in bits 55-62 (ftlayer.shards), so two roots of one shard differ in 55
random bits; record ids and other XOR values stay 63-bit.

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


def new_ids(n: int, shard: int = 0, shards: int = 1) -> NDArray[np.uint64]:
    """`n` fresh random ids in [2, 2**63), as a uint64 array; the roots of shard
    `shard` of a cluster of `shards` > 1 have it in their bits 55-62 (ftlayer.shards),
    and 55 random bits below."""
    if n < 0:
        raise ConfigError(f"cannot generate a negative number of ids: {n}")
    if shards == 1:
        return _generator().integers(MIN_ID, 2**63, size=n, dtype=np.uint64, endpoint=False)
    if not 0 <= shard < shards <= 256:
        raise ConfigError(f"shard {shard} is not in a cluster of {shards}")
    ids = _generator().integers(MIN_ID, 2**55, size=n, dtype=np.uint64, endpoint=False)
    return ids | np.uint64(shard << 55)


def new_id() -> int:
    """One fresh random id (cold paths; hot paths call new_ids)."""
    return int(new_ids(1)[0])
