"""Parked failures: FAILs for another shard of the cluster, which their sender could not
reach, kept by this shard until the source's driver delivers them.

In barrier mode a task fails a row by naming its root (a range root, or a replayed
record's root) to the shard that owns it. When that shard does not answer, the task
parks the FAIL on another shard instead (FAIL_PARKED) and goes on, so a batch never
waits for a shard that died under it. The driver delivers every parked failure of a
shard to it (a FAIL, as the task would have sent it) before it sends that shard a
barrier again, and only then drops it here (PARKED drop): a failure is delivered at
least once, and a second delivery is harmless (the root is no longer pending: counted
dropped), so no record is lost and none replayed twice.

The contract:

- `park` stores the entry (meta `parked/<owner>/<seq>`, its value the sender's idea
  of the owner's store id and FAIL's body) with the next seq (meta `parked-seq`) in
  one transaction, committed (synced) before it returns: once the sender has the
  answer, the failure survives this shard's crash.
- `listed` returns the oldest entries, in seq order; `drop` deletes entries by seq in
  one transaction (seqs that are not there are ignored). Seqs never repeat.
- `counts` gives, per owner shard, the entries and the roots they name (STATUS
  `parked`), kept in memory and rebuilt from the meta when the store opens.
- A store that holds parked failures is refused a savepoint (`refuse_savepoint`):
  a restore would keep failures of stores that no longer exist, or lose them; the
  driver (or `ftlayer savepoint create`, which drains first) delivers them first.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Final

from ftlayer.errors import CorruptData, StateConflict
from ftlayer.persistence.base import PersistenceStorage
from ftlayer.wire.parked import ParkedFailure

__all__ = ["PARKED_META_PREFIX", "ParkedFailures"]

PARKED_META_PREFIX: Final = "parked/"
_NEXT_SEQ_KEY: Final = "parked-seq"
_U8: Final = struct.Struct("<B")
_U64: Final = struct.Struct("<Q")


def _key(owner: int, seq: int) -> str:
    return f"{PARKED_META_PREFIX}{owner:03d}/{seq:016x}"


def _seq_of(key: str) -> int:
    """The seq a parked entry's key names; -1 for a key that names none (_read then
    reports the entry as corrupt)."""
    try:
        return int(key.rsplit("/", 1)[1], 16)
    except (ValueError, IndexError):
        return -1


class ParkedFailures:
    """The parked failures a shard keeps for the others (module docstring). Not
    thread-safe: the server calls it under its core lock."""

    def __init__(self, storage: PersistenceStorage) -> None:
        self.storage = storage
        raw = storage.get_meta(_NEXT_SEQ_KEY)
        self._next = 1 if raw is None else int(_U64.unpack(raw)[0])
        self._counts: dict[int, list[int]] = {}  # owner -> [entries, roots]
        for entry in self._read(storage.meta_keys(PARKED_META_PREFIX)):
            self._count(entry, +1)
            self._next = max(self._next, entry.seq + 1)

    def park(self, entry: ParkedFailure) -> int:
        """Store `entry` (its seq is drawn here); returns its seq once committed."""
        seq = self._next
        store = entry.store_id.encode()
        value = _U8.pack(len(store)) + store + entry.body
        self.storage.update_meta({_key(entry.owner, seq): value, _NEXT_SEQ_KEY: _U64.pack(seq + 1)})
        self._next = seq + 1
        self._count(ParkedFailure(seq, entry.owner, entry.store_id, entry.body), +1)
        return seq

    def listed(self, limit: int) -> tuple[list[ParkedFailure], bool]:
        """The oldest `limit` entries (by seq) and whether there are more."""
        keys = self.storage.meta_keys(PARKED_META_PREFIX)
        keys.sort(key=_seq_of)  # seq order, across owners
        return self._read(keys[:limit]), len(keys) > limit

    def drop(self, seqs: Iterable[int]) -> int:
        """Delete the entries with these seqs; returns how many were there."""
        wanted = {int(s) for s in seqs}
        if not wanted:
            return 0
        keys = [
            key
            for key in self.storage.meta_keys(PARKED_META_PREFIX)
            if _seq_of(key) in wanted  # the key names the seq: read only those wanted
        ]
        found = self._read(keys)
        if found:
            self.storage.update_meta({}, [_key(e.owner, e.seq) for e in found])
            for entry in found:
                self._count(entry, -1)
        return len(found)

    def counts(self) -> dict[int, tuple[int, int]]:
        """Per owner shard: (entries, roots) parked here."""
        return {owner: (n, roots) for owner, (n, roots) in sorted(self._counts.items()) if n}

    @property
    def total(self) -> int:
        return sum(n for n, _ in self._counts.values())

    def refuse_savepoint(self) -> None:
        """StateConflict while failures are parked here (module docstring)."""
        if self.total:
            shown = ", ".join(f"shard {o}: {r} roots" for o, (_, r) in self.counts().items())
            raise StateConflict(
                f"this shard keeps {self.total} parked failures of other shards ({shown}): "
                "a savepoint would lose them; deliver them first (the running query's "
                "driver does at its next batch, `ftlayer savepoint create --server` with "
                "every shard's address does before it saves)"
            )

    def _count(self, entry: ParkedFailure, sign: int) -> None:
        counted = self._counts.setdefault(entry.owner, [0, 0])
        counted[0] += sign
        counted[1] += sign * entry.roots
        if counted[0] <= 0:
            del self._counts[entry.owner]

    def _read(self, keys: list[str]) -> list[ParkedFailure]:
        entries = []
        for key in keys:
            value = self.storage.get_meta(key)
            if value is None:
                continue
            try:
                owner_text, seq_text = key[len(PARKED_META_PREFIX) :].split("/")
                owner, seq = int(owner_text), int(seq_text, 16)
                size = value[0]
                store_id = bytes(value[1 : 1 + size]).decode()
                body = bytes(value[1 + size :])
            except (ValueError, IndexError, UnicodeDecodeError) as exc:
                raise CorruptData(f"bad parked failure entry {key!r}: {exc}") from None
            entries.append(ParkedFailure(seq, owner, store_id, body))
        return entries
