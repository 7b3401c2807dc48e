"""Records kept in memory as the store holds them, so a later step need not read them.

A failure's records pass through several requests (ftlayer.core.rangefail stores them,
UNFILLED lists them, FILL copies their bytes in, the ticker queues them once their
backoff ends), each of which would read them back from the store. `KeptRecords` keeps
the records one step wrote (a batch, a *block*, and each seq's row in it), so the next
step takes them from memory. The caller keeps a record only while the store holds it
exactly so, and discards it when that stops being true (a new write of the record);
`kept` answers only when every seq asked for is kept, else the caller reads the store.

At most `limit` records, and blocks of at most `max_bytes` payload bytes, are held
(`keep` keeps nothing past either); blocks no seq keeps any more are dropped once
there are many of them, or when a new one would pass `max_bytes`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from itertools import pairwise, repeat
from typing import Final

import numpy as np

from ftlayer.records import Payloads, RecordBatch

__all__ = ["DEFAULT_MAX_BYTES", "KeptRecords"]

_BLOCKS_PRUNED_AT: Final = 256  # blocks held: drop those no seq keeps
DEFAULT_MAX_BYTES: Final = 32 << 20
"""The payload bytes of the blocks held, at most (records by reference have none)."""


class KeptRecords:
    """Records by storage seq, kept as the batches (blocks) they came in."""

    __slots__ = ("_blocks", "_bytes", "_kept", "_limit", "_max_bytes", "_next_block", "_rows")

    def __init__(self, limit: int, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        # seq -> the number of the block holding its record (`_blocks`), and its row
        self._kept: dict[int, int] = {}
        self._rows: dict[int, int] = {}
        self._blocks: dict[int, tuple[RecordBatch, int]] = {}  # with its payload bytes
        self._bytes = 0  # of the blocks held
        self._next_block = 0
        self._limit = limit
        self._max_bytes = max_bytes

    @property
    def held_bytes(self) -> int:
        """The payload bytes of the blocks held."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, seqs: Sequence[int], records: RecordBatch) -> None:
        """`records`, stored under `seqs` (aligned), are stored exactly so: `kept` may
        answer from them. Nothing is kept past the limit."""
        n = len(seqs)
        if n != len(records):
            raise ValueError(f"keep: {n} seqs but {len(records)} records")
        if not n or len(self._kept) + n > self._limit:
            return
        size = _payload_bytes(records)
        if not self._kept:
            self._blocks.clear()  # every one kept before is gone
            self._bytes = 0
        elif len(self._blocks) >= _BLOCKS_PRUNED_AT or self._bytes + size > self._max_bytes:
            held = set(self._kept.values())
            self._blocks = {b: kept for b, kept in self._blocks.items() if b in held}
            self._bytes = sum(size for _, size in self._blocks.values())
        if self._bytes + size > self._max_bytes:
            return
        block = self._next_block
        self._next_block += 1
        self._blocks[block] = (records, size)
        self._bytes += size
        self._kept.update(zip(seqs, repeat(block, n), strict=True))
        self._rows.update(zip(seqs, range(n), strict=True))

    def kept(self, seqs: Sequence[int]) -> RecordBatch | None:
        """The records of `seqs`, in their order, if every one is kept; else None (the
        caller reads them from the store)."""
        n = len(seqs)
        if not n or not self._kept:
            return None
        blocks = np.fromiter(map(self._kept.get, seqs, repeat(-1, n)), np.int64, n)
        if bool((blocks < 0).any()):
            return None
        rows = np.fromiter(map(self._rows.__getitem__, seqs), np.intp, n)
        # One take per run of seqs kept in the same block, in the order asked.
        starts = [0, *(np.flatnonzero(np.diff(blocks)) + 1).tolist(), n]
        return RecordBatch.concat(
            [self._blocks[int(blocks[lo])][0].take(rows[lo:hi]) for lo, hi in pairwise(starts)]
        )

    def discard(self, seq: int) -> None:
        if self._kept.pop(seq, None) is not None:
            del self._rows[seq]

    def discard_many(self, seqs: Iterable[int]) -> None:
        """`discard` for each seq, in one pass (kept or not)."""
        if not self._kept:
            return
        listed = seqs if isinstance(seqs, list) else list(seqs)
        deque(map(self._kept.pop, listed, repeat(None, len(listed))), maxlen=0)
        deque(map(self._rows.pop, listed, repeat(None, len(listed))), maxlen=0)


def _payload_bytes(records: RecordBatch) -> int:
    payloads = records.payloads
    return len(payloads.blob) if isinstance(payloads, Payloads) else sum(map(len, payloads))
