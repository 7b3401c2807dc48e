"""The open batch ranges (the data; ftlayer.core.ranges has what the core does with
them): each range's number, source, Kafka coordinates and the offsets that became
records of their own, loaded from their meta entries (`range/<number>`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Final

from ftlayer.errors import ConfigError
from ftlayer.persistence.base import PersistenceStorage
from ftlayer.rangeroots import MAX_NUMBER

__all__ = ["RANGE_META_PREFIX", "BatchRange", "OpenRanges"]

RANGE_META_PREFIX: Final = "range/"


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
    """Offsets that became records of their own (an event named them)."""

    def __len__(self) -> int:
        return self.end - self.start

    @property
    def pending(self) -> int:
        """Records still pending as part of the range."""
        return len(self) - len(self.materialized)

    def to_json(self) -> bytes:
        body = [self.source_id, self.topic, self.partition, self.start, self.end]
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, number: int, raw: bytes) -> BatchRange:
        source_id, topic, partition, start, end = json.loads(raw)
        return cls(number, int(source_id), str(topic), int(partition), int(start), int(end))


class OpenRanges:
    """The open ranges by number, and the next number to try."""

    def __init__(
        self, storage: PersistenceStorage, numbers: tuple[int, int] = (1, MAX_NUMBER)
    ) -> None:
        self.by_number: dict[int, BatchRange] = {}
        for key in storage.meta_keys(RANGE_META_PREFIX):
            raw = storage.get_meta(key)
            if raw is not None:
                number = int(key[len(RANGE_META_PREFIX) :])
                self.by_number[number] = BatchRange.from_json(number, raw)
        self._first, self._last = numbers  # this shard's numbers (ftlayer.shards)
        mine = [n for n in self.by_number if self._first <= n <= self._last]
        self._next = max(mine, default=self._first - 1) + 1
        if self._next > self._last:
            self._next = self._first

    def __len__(self) -> int:
        return len(self.by_number)

    def find(self, source_id: int, topic: str, partition: int, start: int, end: int) -> int:
        """The number of this exact open range, or 0."""
        for number, r in self.by_number.items():
            if (r.source_id, r.topic, r.partition, r.start, r.end) == (
                source_id,
                topic,
                partition,
                start,
                end,
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
