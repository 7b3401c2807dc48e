"""The on-disk layout of an LMDB store: its sub-databases, its chunks, a chunk's head.

One LMDB environment (a directory holding data.mdb and lock.mdb) with five named
sub-databases:

| sub-database | key                             | value                                   |
|--------------|---------------------------------|-----------------------------------------|
| `chunks`     | chunk key: a seq, 8 bytes BE    | the chunk's records, back to back       |
| `index`      | chunk key                       | its seqs and where each record ends     |
| `state`      | chunk key                       | which records are deleted; tag overrides |
| `meta`       | UTF-8 meta key                  | the caller's bytes (`put_meta`)         |
| `ftlayer`    | `format`                        | the format marker                       |
|              | `next_seq`, `records`           | seq high-water mark; stored records     |

(`next_seq` and `records` are 8 bytes big-endian.)

Chunks
------
A `put` stores its batch as one chunk: one LMDB value holding the records back to back,
each in the record layout of `base`, under the seq of its first record (a batch of more
than `chunk_bytes`, 1 MiB by default, becomes several chunks of whole records; a record
larger than that is a chunk of its own). LMDB's cost is per value, not per byte, so a
batch costs a few B-tree operations however many records it holds, and deleting a
whole batch as few. Beside the records, two small values: the chunk's index, written
with it and never changed, and its state, rewritten by every delete and retag (a bit
per record and the override table: a write touches a few bytes per record of the
chunk, not the chunk). All integers little-endian, no padding:

| value  | field      | type                  | meaning                                      |
|--------|------------|-----------------------|----------------------------------------------|
| index  | count      | u32                   | records in the chunk, deleted ones included   |
|        | flags      | u32                   | bit 0: seqs listed, else key, key + 1, ...    |
|        | seqs       | count x u64           | with flag bit 0 only: the seqs, increasing    |
|        | ends       | count x u32           | where each record ends in the chunk           |
| state  | live       | u32                   | records still stored                          |
|        | overrides  | u32                   | entries in the override table                 |
|        | live_bytes | u64                   | bytes of the records still stored             |
|        | deleted    | ceil(count / 8) bytes | bit i (least significant first): i deleted    |
|        | override   | overrides x 20 bytes  | u32 index, u64 root, u64 replay_seq; by index |

Invariants
----------
- A chunk's seqs lie between its key and the next chunk's key, so the chunk of a seq is
  the last one keyed at or below it (`seek_floor`), and key order is seq order.
- Big-endian keys sort in seq order, and seqs only grow, so a new chunk goes at the
  right edge of the B-trees (`Chunks.add`: `append=True` skips the key search, and
  refuses a key that is not above the last one).
- A chunk's three values exist together: added, replaced and dropped together.
- A state agrees with itself: `live` counts the records not deleted, `live_bytes` their
  bytes, and the override table has at most one entry per record, increasing by index,
  none for a deleted record. Which writes change a state, and when a chunk is compacted
  or dropped, is the write path's (lmdb_writes).

Format versions: the marker is `ftlayer-lmdb-v2`. A v1 store (one LMDB value per
record in a `records` sub-database, written by earlier versions) is converted when
opened (lmdb_open); earlier versions refuse a v2 store, naming its format.

Costs: decoding a head is a few numpy calls over its chunk's records (an end and a bit
per record, and a seq only for a chunk that lists them); `ChunkHead.locate` is one
subtraction per seq for a chunk of consecutive seqs, a binary search for one that lists
them; `Chunks.spans` costs one cursor seek per chunk it meets, not one per seq.

Threads: nothing here locks. A `ChunkHead` belongs to the transaction that decoded it,
and `Chunks` works inside its caller's transaction (lmdb_env runs those, one writer at
a time).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any, Final, NamedTuple

import lmdb
import numpy as np
from numpy.typing import NDArray

from ftlayer.errors import StorageError

__all__ = [
    "CHUNKS_DB",
    "DATA_FILE",
    "FORMAT_KEY",
    "FORMAT_MARKER",
    "INDEX_DB",
    "MAX_CHUNK",
    "MAX_DBS",
    "MAX_SEQ",
    "META_DB",
    "NEXT_SEQ_KEY",
    "RECORDS_DB",
    "STATE_DB",
    "STORED_KEY",
    "STORE_DB",
    "V1_MARKER",
    "ChunkHead",
    "Chunks",
    "chunk_key",
    "distinct_last",
    "firsts",
    "seek_floor",
    "stored_count",
]

FORMAT_MARKER: Final = b"ftlayer-lmdb-v2"

V1_MARKER: Final = b"ftlayer-lmdb-v1"
RECORDS_DB: Final = b"records"  # v1: one value per record (converted on open)
CHUNKS_DB: Final = b"chunks"
INDEX_DB: Final = b"index"
STATE_DB: Final = b"state"
META_DB: Final = b"meta"
STORE_DB: Final = b"ftlayer"
FORMAT_KEY: Final = b"format"
NEXT_SEQ_KEY: Final = b"next_seq"
STORED_KEY: Final = b"records"
MAX_DBS: Final = 6
DATA_FILE: Final = "data.mdb"

_INDEX: Final = struct.Struct("<II")  # count, flags
_STATE: Final = struct.Struct("<IIQ")  # live, overrides, live_bytes
_OVERRIDE: Final = np.dtype([("index", "<u4"), ("root", "<u8"), ("replay_seq", "<u8")])
_LISTED: Final = 1  # index flags bit 0: the chunk's seqs are listed
MAX_CHUNK: Final = 0xFFFFFFFF  # record ends are u32
MAX_SEQ: Final = 2**64 - 1


class ChunkHead:
    """A chunk's head (layout in the module docstring), decoded; changed, then encoded.

    `seqs` (uint64), `ends` (int64: where each record ends in the chunk) and `deleted`
    (bool) have one entry per record of the chunk, `overrides` one per retagged record.
    The seqs of a chunk that does not list them are made only when asked for.
    """

    __slots__ = ("_seqs", "deleted", "ends", "key", "listed", "live", "live_bytes", "overrides")

    def __init__(
        self,
        key: int,
        seqs: NDArray[np.uint64] | None,
        ends: NDArray[np.int64],
        deleted: NDArray[np.bool_],
        overrides: NDArray[np.void],
        *,
        listed: bool,
        live: int,
        live_bytes: int,
    ) -> None:
        self.key = key
        self._seqs = seqs
        self.ends = ends
        self.deleted = deleted
        self.overrides = overrides
        self.listed = listed
        self.live = live
        self.live_bytes = live_bytes

    @classmethod
    def new(
        cls, key: int, ends: NDArray[np.int64], seqs: NDArray[np.uint64] | None = None
    ) -> ChunkHead:
        """The head of a chunk as written: records ending at `ends`, none deleted, with
        `seqs` (increasing, from `key` on) or else key, key + 1, ..."""
        count = len(ends)
        if int(ends[-1]) > MAX_CHUNK:
            raise StorageError(
                f"a record of {int(ends[-1]):,} bytes is more than the {MAX_CHUNK:,} the "
                "record layout allows; nothing was stored"
            )
        listed = seqs is not None and (int(seqs[0]) != key or int(seqs[-1]) - key != count - 1)
        return cls(
            key,
            seqs if listed else None,
            ends.astype(np.int64, copy=False),
            np.zeros(count, dtype=np.bool_),
            np.zeros(0, dtype=_OVERRIDE),
            listed=listed,
            live=count,
            live_bytes=int(ends[-1]),
        )

    @classmethod
    def decode(cls, key: int, index: bytes | memoryview, state: bytes | memoryview) -> ChunkHead:
        """The head of chunk `key` from its index and state values."""
        count, flags = _INDEX.unpack_from(index)
        live, n_overrides, live_bytes = _STATE.unpack_from(state)
        listed = bool(flags & _LISTED)
        mask_bytes = (count + 7) // 8
        if len(index) != _INDEX.size + (12 if listed else 4) * count or len(state) != (
            _STATE.size + mask_bytes + n_overrides * _OVERRIDE.itemsize
        ):
            raise StorageError(f"the head of chunk {key} is malformed: storage corrupt")
        at = _INDEX.size
        seqs = None
        if listed:
            seqs = np.frombuffer(index, dtype="<u8", count=count, offset=at).astype(np.uint64)
            at += 8 * count
        ends = np.frombuffer(index, dtype="<u4", count=count, offset=at).astype(np.int64)
        mask = np.frombuffer(state, dtype=np.uint8, count=mask_bytes, offset=_STATE.size)
        deleted = np.unpackbits(mask, count=count, bitorder="little").view(np.bool_)
        overrides = np.frombuffer(
            state, dtype=_OVERRIDE, count=n_overrides, offset=_STATE.size + mask_bytes
        ).copy()
        return cls(
            key, seqs, ends, deleted, overrides, listed=listed, live=live, live_bytes=live_bytes
        )

    def encode_index(self) -> bytes:
        fixed = _INDEX.pack(len(self.ends), _LISTED if self.listed else 0)
        seqs = self.seqs.astype("<u8").tobytes() if self.listed else b""
        return fixed + seqs + self.ends.astype("<u4").tobytes()

    def encode_state(self) -> bytes:
        tally = _STATE.pack(self.live, len(self.overrides), self.live_bytes)
        mask = np.packbits(self.deleted, bitorder="little")
        return tally + mask.tobytes() + self.overrides.tobytes()

    @property
    def seqs(self) -> NDArray[np.uint64]:
        """The chunk's seqs, increasing."""
        if self._seqs is None:
            self._seqs = np.arange(self.key, self.key + len(self.ends), dtype=np.uint64)
        return self._seqs

    @property
    def last(self) -> int:
        """The chunk's last seq (stored or not)."""
        return int(self.seqs[-1]) if self.listed else self.key + len(self.ends) - 1

    @property
    def size(self) -> int:
        """The chunk's bytes."""
        return int(self.ends[-1])

    def bounds(self, positions: NDArray[np.intp]) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """Where the records `positions` start and end in the chunk."""
        ends = self.ends[positions]
        starts = np.where(positions > 0, self.ends[positions - 1], 0)
        return starts, ends

    def locate(self, seqs: NDArray[np.uint64]) -> tuple[NDArray[np.intp], NDArray[np.bool_]]:
        """The positions of `seqs` (between the key and the last seq) in the chunk, and
        which of them are records stored (in the chunk and not deleted)."""
        count = len(self.ends)
        if self.listed:
            positions = np.searchsorted(self.seqs, seqs).clip(max=count - 1)
            here = self.seqs[positions] == seqs
        else:
            positions = (seqs - np.uint64(self.key)).astype(np.intp)
            here = positions < count
            positions = positions.clip(max=count - 1)
        return positions, here & ~self.deleted[positions]

    def remove(self, positions: NDArray[np.intp]) -> None:
        """Mark the stored records `positions` (distinct) deleted."""
        starts, ends = self.bounds(positions)
        self.deleted[positions] = True
        self.live -= len(positions)
        self.live_bytes -= int((ends - starts).sum())
        if not self.live:  # every record gone: so are their overrides
            self.overrides = self.overrides[:0]
        elif len(self.overrides):
            self.overrides = self.overrides[~np.isin(self.overrides["index"], positions)]

    def retag(
        self, positions: NDArray[np.intp], roots: NDArray[np.uint64], replays: NDArray[np.uint64]
    ) -> None:
        """Give the records `positions` (distinct) these tags (override entries)."""
        new = np.empty(len(positions), dtype=_OVERRIDE)
        new["index"] = positions
        new["root"] = roots
        new["replay_seq"] = replays
        merged = np.concatenate([self.overrides, new])
        _, newest = distinct_last(merged["index"])
        self.overrides = merged[newest]

    def tags_of(
        self, positions: NDArray[np.intp]
    ) -> tuple[NDArray[np.intp], NDArray[np.uint64], NDArray[np.uint64]]:
        """Which of `positions` have an override entry, and its root and replay seq."""
        if not len(self.overrides):
            empty = np.zeros(0, dtype=np.uint64)
            return np.zeros(0, dtype=np.intp), empty, empty
        index = self.overrides["index"]
        at = np.searchsorted(index, positions).clip(max=len(index) - 1)
        tagged = np.flatnonzero(index[at] == positions)
        entries = self.overrides[at[tagged]]
        return tagged, entries["root"].astype(np.uint64), entries["replay_seq"].astype(np.uint64)


class Chunks(NamedTuple):
    """The sub-databases of the chunks (see the module docstring), and what is done to
    a chunk there."""

    records_db: lmdb._Database
    index_db: lmdb._Database
    state_db: lmdb._Database

    def add(self, txn: lmdb.Transaction[Any], head: ChunkHead, data: bytes | memoryview) -> bool:
        """Store a new chunk, keyed above every other; False (nothing written) if not."""
        key = chunk_key(head.key)
        if not txn.put(key, data, append=True, db=self.records_db):
            return False  # append=True refuses a key that is not above the last one
        txn.put(key, head.encode_index(), append=True, db=self.index_db)
        txn.put(key, head.encode_state(), append=True, db=self.state_db)
        return True

    def replace(self, txn: lmdb.Transaction[Any], head: ChunkHead, data: bytes) -> None:
        key = chunk_key(head.key)
        txn.put(key, data, db=self.records_db)
        txn.put(key, head.encode_index(), db=self.index_db)
        txn.put(key, head.encode_state(), db=self.state_db)

    def drop(self, txn: lmdb.Transaction[Any], key: int) -> None:
        for db in self:
            txn.delete(chunk_key(key), db=db)

    def records_of(self, txn: lmdb.Transaction[Any], head: ChunkHead) -> bytes | memoryview:
        """The value of `head`'s chunk (a view into the map in a buffers transaction)."""
        data: bytes | memoryview | None = txn.get(chunk_key(head.key), db=self.records_db)
        if data is None or len(data) != head.size:
            raise StorageError(
                f"the records of chunk {head.key} are missing or of the wrong size: storage corrupt"
            )
        return data

    def head_at(self, txn: lmdb.Transaction[Any], cursor: lmdb.Cursor[Any]) -> ChunkHead:
        """The head of the chunk an index cursor is on."""
        key = cursor.key()
        state = txn.get(key, db=self.state_db)
        if state is None:
            raise StorageError(f"chunk {bytes(key).hex()} has no state: storage corrupt")
        return ChunkHead.decode(int.from_bytes(key, "big"), cursor.value(), state)

    def spans(
        self, txn: lmdb.Transaction[Any], seqs: NDArray[np.uint64]
    ) -> Iterator[tuple[ChunkHead, int, int]]:
        """The chunks that `seqs` (sorted, distinct) may be in, with the range [lo, hi)
        of `seqs` between each one's key and last seq."""
        cursor = txn.cursor(db=self.index_db)
        i, n = 0, len(seqs)
        while i < n:
            seq = int(seqs[i])
            if seek_floor(cursor, seq) is not None:
                head = self.head_at(txn, cursor)
                if seq <= head.last:
                    hi = int(np.searchsorted(seqs, head.last, side="right"))
                    yield head, i, hi
                    i = hi
                    continue
            # seq is in no chunk: go on from the next chunk's key.
            if seq == MAX_SEQ or not cursor.set_range(chunk_key(seq + 1)):
                return
            i = int(np.searchsorted(seqs, int.from_bytes(cursor.key(), "big")))


def firsts(ordered: NDArray[Any]) -> NDArray[np.bool_]:
    """Which entries of `ordered` (sorted) differ from the one before."""
    first = np.ones(len(ordered), dtype=np.bool_)
    first[1:] = ordered[1:] != ordered[:-1]
    return first


def sorted_distinct(seqs: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """The distinct `seqs`, increasing. The seqs a batch's completions free lie close
    together (mostly every seq of a span, in the acker's order), so where they fill at
    least a quarter of their span they are marked in a mask of it and read back in
    order: 1.1 ms for 200,000 seqs, against 9 for a sort (which costs as much on
    sorted input). Scattered seqs are sorted. Seqs already increasing (the server's
    deleter hands the store slices of its own sorted_distinct) come back as they are."""
    n = len(seqs)
    if n < 1024:
        return np.unique(seqs)
    if bool((seqs[1:] > seqs[:-1]).all()):
        return seqs
    lo = int(seqs.min())
    span = int(seqs.max()) - lo + 1
    if span > 4 * n:
        ordered = np.sort(seqs)
        return ordered[firsts(ordered)]
    mask = np.zeros(span, dtype=np.bool_)
    mask[(seqs - np.uint64(lo)).astype(np.intp)] = True
    return np.flatnonzero(mask).astype(np.uint64) + np.uint64(lo)


def distinct_last(values: NDArray[Any]) -> tuple[NDArray[Any], NDArray[np.intp]]:
    """The distinct `values`, increasing, and where each occurs last in `values`.

    (np.unique would do, but numpy 2 finds distinct values by hashing, several times
    slower than this sort on the seqs of a batch.)"""
    order = np.argsort(values, kind="stable")  # equal values keep their order
    ordered = values[order]
    last = np.ones(len(values), dtype=np.bool_)
    last[:-1] = ordered[1:] != ordered[:-1]
    return ordered[last], order[last]


def seek_floor(cursor: lmdb.Cursor[Any], seq: int) -> int | None:
    """The last key at or below `seq`, the cursor left on it; None if there is none."""
    key = chunk_key(seq)
    if cursor.set_range(key):
        if cursor.key() == key:
            return seq
        if not cursor.prev():
            return None
    elif not cursor.last():
        return None
    return int.from_bytes(cursor.key(), "big")


def chunk_key(seq: int) -> bytes:
    """The LMDB key of a seq: 8 bytes big-endian, so byte order is seq order."""
    return seq.to_bytes(8, "big")


def stored_count(store: lmdb._Database, txn: lmdb.Transaction[bytes]) -> int:
    """The count of stored records."""
    raw = txn.get(STORED_KEY, db=store)
    return 0 if raw is None else int.from_bytes(raw, "big")
