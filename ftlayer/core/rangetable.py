"""The open batch ranges (the data; ftlayer.core.ranges has what the core does with
them): each range's number, source, Kafka coordinates and the offsets that became
records of their own, loaded from their meta entries (`range/<number>`); a range of
tree mode also has its records' ack values, states and read seeds (`RangeAcks`,
ftlayer.core.rangeacks)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

import numpy as np
from numpy.typing import NDArray

from ftlayer.errors import ConfigError
from ftlayer.persistence.base import PersistenceStorage
from ftlayer.rangeroots import MAX_NUMBER

__all__ = [
    "COMPLETED",
    "GONE",
    "PENDING",
    "RANGE_META_PREFIX",
    "BatchRange",
    "OpenRanges",
    "RangeAcks",
]

RANGE_META_PREFIX: Final = "range/"
TREE: Final = "tree"
"""The mode a tree-mode range's meta entry ends with (a barrier-mode one has none)."""

PENDING: Final = 0
COMPLETED: Final = 1
GONE: Final = 2
"""A tree-mode range record's states: pending as part of its range, its tree
complete, or gone from it (materialized: a record of its own; or excluded)."""


@dataclass(slots=True)
class RangeAcks:
    """Tree completion of a range's records (ftlayer.core.rangeacks): per record the
    XOR of the events that named its range root so far (complete when it equals the
    record's emission id, ftlayer.rangeroots.emission_ids, under the seed of the read
    that emitted it), its state, and that seed (0: not read since the range opened or
    the FT layer started); in memory."""

    opened_at: float
    """The core's clock when the range opened: its records' latency and timeout start."""
    acc: NDArray[np.uint64]
    state: NDArray[np.uint8]
    seeds: NDArray[np.uint64]
    left: int
    """Records still PENDING."""
    batch: tuple[int, int] | None = None
    """The batch it opened in (ftlayer.core.leases.BatchTag): its timeouts wait while
    that batch runs."""
    postponed_until: float = 0.0
    """The core's clock until which its timeout is held off (its batch ran at its
    deadline): counted postponed again only after it."""

    @classmethod
    def new(cls, n: int, opened_at: float) -> RangeAcks:
        return cls(
            opened_at,
            np.zeros(n, np.uint64),
            np.zeros(n, np.uint8),
            np.zeros(n, np.uint64),
            n,
        )


@dataclass(slots=True)
class BatchRange:
    """One open range: Kafka [start, end) of (topic, partition), read by `source_id`."""

    number: int
    source_id: int
    topic: str
    partition: int
    start: int
    end: int
    materialized: set[int] = field(default_factory=set)
    """Offsets that became records of their own (an event named them); a tree-mode
    range has them as GONE in its `acks` instead."""
    acks: RangeAcks | None = None
    """Tree mode's ack values; None: a barrier-mode range, complete with its batch."""
    held: set[int] | None = None
    """A barrier-mode range whose batch is done but for these offsets, failures noted
    and not applied yet (ftlayer.core.failnotes): every other offset of it completed
    at the barrier, and the range completes once they are records of their own. In
    memory: after a restart the range is open again, and completes with the next done
    barrier past it."""

    def __len__(self) -> int:
        return self.end - self.start

    @property
    def pending(self) -> int:
        """Records still pending as part of the range."""
        if self.acks is not None:
            return self.acks.left
        if self.held is not None:
            return len(self.held - self.materialized)
        return len(self) - len(self.materialized)

    def lowest_pending(self) -> int | None:
        """The lowest offset pending as part of the range (None: none is)."""
        if self.held is not None:
            return min(self.held - self.materialized, default=None)
        if self.acks is None:
            return self.start if self.pending else None
        if not self.acks.left:
            return None
        return self.start + int(np.argmin(self.acks.state != PENDING))

    def unfinished(self, offsets: NDArray[np.int64]) -> NDArray[np.bool_]:
        """Per offset (each in the range): still pending as part of it, neither
        materialized nor (tree mode) complete."""
        if self.acks is not None:
            pending: NDArray[np.bool_] = self.acks.state[offsets - self.start] == PENDING
            return pending
        if self.held is not None:
            held, done = self.held, self.materialized
            return np.fromiter(
                (o in held and o not in done for o in offsets.tolist()), np.bool_, len(offsets)
            )
        if not self.materialized:
            return np.ones(len(offsets), dtype=np.bool_)
        done = self.materialized  # a lookup per row, not an array of the whole set
        return np.fromiter((o not in done for o in offsets.tolist()), np.bool_, len(offsets))

    def leave(self, offsets: Iterable[int]) -> None:
        """These offsets (pending in the range) became records of their own, or are
        excluded from it."""
        if self.acks is None:
            self.materialized.update(offsets)
            return
        at = np.fromiter(offsets, dtype=np.int64) - self.start
        if len(at):
            self.acks.left -= int(np.count_nonzero(self.acks.state[at] == PENDING))
            self.acks.state[at] = GONE

    def to_json(self) -> bytes:
        body: list[object] = [self.source_id, self.topic, self.partition, self.start, self.end]
        if self.acks is not None:
            body.append(TREE)
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, number: int, raw: bytes, now: float = 0.0) -> BatchRange:
        """A range as its meta holds it; a tree-mode range's records all pending again
        (their acks lived in memory), opened at `now`, none read."""
        source_id, topic, partition, start, end, *mode = json.loads(raw)
        r = cls(number, int(source_id), str(topic), int(partition), int(start), int(end))
        if mode == [TREE]:
            r.acks = RangeAcks.new(len(r), now)
        elif mode:
            raise ValueError(f"range {number}'s meta has an unknown mode {mode!r}")
        return r


class OpenRanges:
    """The open ranges by number, and the next number to try."""

    def __init__(
        self,
        storage: PersistenceStorage,
        numbers: tuple[int, int] = (1, MAX_NUMBER),
        now: float = 0.0,
    ) -> None:
        """The ranges stored in `storage` of this shard's `numbers`; a tree-mode range's
        records pending again from `now` on (the core's clock)."""
        self.by_number: dict[int, BatchRange] = {}
        for key in storage.meta_keys(RANGE_META_PREFIX):
            raw = storage.get_meta(key)
            if raw is not None:
                number = int(key[len(RANGE_META_PREFIX) :])
                self.by_number[number] = BatchRange.from_json(number, raw, now)
        self._first, self._last = numbers  # this shard's numbers (ftlayer.shards)
        mine = [n for n in self.by_number if self._first <= n <= self._last]
        self._next = max(mine, default=self._first - 1) + 1
        if self._next > self._last:
            self._next = self._first

    def __len__(self) -> int:
        return len(self.by_number)

    def find(
        self, source_id: int, topic: str, partition: int, start: int, end: int, *, tree: bool
    ) -> int:
        """The number of this exact open range of this mode (`tree`), or 0 (a range
        whose batch is done, `held`, is never planned again)."""
        for number, r in self.by_number.items():
            if r.held is None and (
                r.source_id,
                r.topic,
                r.partition,
                r.start,
                r.end,
                r.acks is not None,
            ) == (
                source_id,
                topic,
                partition,
                start,
                end,
                tree,
            ):
                return number
        return 0

    def allocate(self, taken: set[int]) -> int:
        """A number of this shard's that no open range (nor `taken`) has, going round
        from its first."""
        size = self._last - self._first + 1
        if len(self.by_number) + len(taken) >= size:
            raise ConfigError(f"more than {size} batch ranges are open")
        while True:
            number = self._next
            self._next = self._first if self._next >= self._last else self._next + 1
            if number not in self.by_number and number not in taken:
                return number
