"""The unfilled list: failed records stored by reference whose bytes their source has
not copied in yet (ftlayer.core.fills), by source.

`Unfilled` answers what STATUS asks at every trigger (how many each source has) and
what UNFILLED asks (which, oldest first) without a walk over the other sources'. It
also knows which of them have no key yet (`keys_unknown`: a batch range's failed rows,
routed only once their fill brings the key, so nothing need read them before), and
keeps the records a first failure of range rows stored (`keep`, at most KEPT_RECORDS),
so that UNFILLED answers from memory what the store holds (`kept`): until it is
filled, or listed again by another failure, such a record is stored exactly as that
failure built it. Those kept before a restart are not: after one, UNFILLED reads the
store.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from itertools import repeat
from typing import Final

import numpy as np
from numpy.typing import NDArray

from ftlayer.records import RecordBatch

from .kept import KeptRecords

__all__ = ["KEPT_RECORDS", "Unfilled"]

KEPT_RECORDS: Final = 250_000
"""At most this many unfilled records are kept in memory (`Unfilled.keep`); the others
are read from the store."""


class Unfilled:
    """The seqs of failed records stored by reference whose bytes their source has not
    copied in yet, by source, and the records kept of them (module docstring)."""

    def __init__(self, kept_records: int = KEPT_RECORDS) -> None:
        self._source_of: dict[int, int] = {}
        self._by_source: dict[int, dict[int, None]] = {}
        # Those whose key is unknown too (stored by reference without it: a batch
        # range's row): routed only once filled, so nothing need read them before.
        self._key_unknown: set[int] = set()
        # The records a failure stored, kept as it stored them (ftlayer.core.kept).
        self._kept = KeptRecords(kept_records)

    def __len__(self) -> int:
        return len(self._source_of)

    def __contains__(self, seq: object) -> bool:
        return seq in self._source_of

    def add(self, seq: int, source_id: int, key_unknown: bool = False) -> None:
        """List `seq` of `source_id`; `key_unknown`: its stored record's key is
        unknown too (`keys_unknown`)."""
        if key_unknown:
            self._key_unknown.add(seq)
        else:
            self._key_unknown.discard(seq)
        self._unkeep(seq)  # listed again: its record may have changed
        if self._source_of.get(seq) == source_id:
            return
        self._discard(seq)
        self._source_of[seq] = source_id
        self._by_source.setdefault(source_id, {})[seq] = None

    def add_many(
        self, seqs: Sequence[int], source_ids: Sequence[int], key_unknown: bool = False
    ) -> None:
        """`add` for each pair; seqs not listed yet (a failure's new records, the
        usual case) go in by source in one dict update each, without a call per seq."""
        if len(seqs) != len(source_ids):
            raise ValueError(f"add_many: {len(seqs)} seqs but {len(source_ids)} source ids")
        source_of = self._source_of
        if not source_of.keys().isdisjoint(seqs):  # some re-listed: one at a time
            for seq, source_id in zip(seqs, source_ids, strict=True):
                self.add(seq, source_id, key_unknown)
            return
        if key_unknown:
            self._key_unknown.update(seqs)
        source_of.update(zip(seqs, source_ids, strict=True))
        groups: dict[int, Sequence[int]] = {}
        first = source_ids[0] if len(source_ids) else None
        if first is not None and list(source_ids).count(first) == len(source_ids):
            groups[first] = seqs
        elif first is not None:
            lists: dict[int, list[int]] = {}
            for seq, source_id in zip(seqs, source_ids, strict=True):
                lists.setdefault(source_id, []).append(seq)
            groups.update(lists)
        for source_id, mine in groups.items():
            self._by_source.setdefault(source_id, {}).update(dict.fromkeys(mine))

    def discard_many(self, seqs: Iterable[int]) -> None:
        """`discard` for each seq, by source in one pass each."""
        listed = seqs if isinstance(seqs, list) else list(seqs)
        if self._key_unknown:
            self._key_unknown.difference_update(listed)
        self._kept.discard_many(listed)
        sources = list(map(self._source_of.pop, listed, repeat(None, len(listed))))
        first = sources[0] if sources else None
        if first is not None and sources.count(first) == len(sources):  # one source: in C
            mine_all = self._by_source[first]
            deque(map(mine_all.pop, listed), maxlen=0)
            if not mine_all:
                del self._by_source[first]
            return
        gone: dict[int, list[int]] = {}
        for seq, source_id in zip(listed, sources, strict=True):
            if source_id is not None:
                gone.setdefault(source_id, []).append(seq)
        for source_id, mine in gone.items():
            of_source = self._by_source[source_id]
            for seq in mine:
                del of_source[seq]
            if not of_source:
                del self._by_source[source_id]

    def discard(self, seq: int) -> None:
        self._key_unknown.discard(seq)
        self._unkeep(seq)
        self._discard(seq)

    def _unkeep(self, seq: int) -> None:
        self._kept.discard(seq)

    def _discard(self, seq: int) -> None:
        source_id = self._source_of.pop(seq, None)
        if source_id is None:
            return
        mine = self._by_source[source_id]
        del mine[seq]
        if not mine:
            del self._by_source[source_id]

    def source_of(self, seq: int) -> int | None:
        return self._source_of.get(seq)

    def keys_unknown(self, seqs: Sequence[int]) -> NDArray[np.bool_]:
        """Which of `seqs` are listed with their key unknown: their replay partition
        is known only once their source fills them, so nothing routes them before."""
        unknown = self._key_unknown
        if not unknown:
            return np.zeros(len(seqs), dtype=np.bool_)
        return np.fromiter(map(unknown.__contains__, seqs), np.bool_, len(seqs))

    def of_source(self, source_id: int) -> list[int]:
        """The seqs of `source_id`, in order."""
        return sorted(self._by_source.get(source_id, ()))

    def counts(self) -> dict[int, int]:
        """Per source id with any: how many."""
        return {source_id: len(seqs) for source_id, seqs in self._by_source.items()}

    @property
    def kept_count(self) -> int:
        """How many of the listed records are kept in memory."""
        return len(self._kept)

    def keep(self, seqs: Sequence[int], records: RecordBatch) -> None:
        """`records`, listed under `seqs` (aligned), are stored exactly so: UNFILLED
        may answer from them (`kept`). Nothing is kept past KEPT_RECORDS."""
        self._kept.keep(seqs, records)

    def kept(self, seqs: Sequence[int]) -> RecordBatch | None:
        """The records of `seqs`, in their order, if every one is kept; else None (the
        caller reads them from the store)."""
        return self._kept.kept(seqs)
