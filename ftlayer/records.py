"""Persisted source records, as columns.

The FT layer never deserializes a record: it keeps the raw payload bytes and the few
fields the fault-tolerance logic needs (the blueprint's "semi-deserialized" record):

| column      | dtype   | meaning                                                        |
|-------------|---------|----------------------------------------------------------------|
| roots       | uint64  | the root id the record is tracked under (new on every replay)  |
| source_ids  | uint32  | which source emitted it (replays go back to that source)       |
| key_hashes  | int64   | the stored key hash the hash/key-group partitioners replay by  |
| has_key     | bool    | False for a record without a key (no hash partitioning)        |
| topics      | str     | Kafka coordinates: topic ...                                   |
| partitions  | int32   | ... partition (the source partition the record first entered)  |
| offsets     | int64   | ... and offset (-1: none; the coordinates identify a record)   |
| payloads    | bytes   | the raw record bytes, opaque to the FT layer                   |
| references  | bool    | True: the payload is not stored (empty here); the record is    |
|             |         | where its coordinates say (`ft.persist=reference`)             |

Batches are columnar so the hot paths (persist, delete, replay) work on arrays, not on
one Python object per record; only topics are a Python list, and payloads are one too
unless they are `Payloads`: every payload in one buffer with their lengths, as a source
that builds them column-wise (the ftkafka reader) and the PERSIST frame carry them, so
the persist path makes no bytes object per record until something asks for one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence, Sized
from dataclasses import dataclass
from typing import Final, overload

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ftlayer.errors import ConfigError

KEY_UNKNOWN: Final = -(2**63)
"""The key hash of a record whose key the FT layer does not know yet (has_key False): a
record of a batch range, stored by reference when an event named it; its source tells
the key when it copies the bytes in (ftlayer.core.ranges, ftlayer.core.fills)."""

U64 = NDArray[np.uint64]
I64 = NDArray[np.int64]
I32 = NDArray[np.int32]


class Payloads(Sequence[bytes]):
    """Payloads in one buffer: payload i is `blob[ends[i - 1]:ends[i]]`. A read-only
    sequence of bytes (each item sliced on demand, `list()` in one numpy call when
    the lengths are equal), whose `blob` and `lengths` go onto the wire and into
    storage as they are."""

    __slots__ = ("_blob", "_ends", "_list")

    def __init__(self, blob: bytes, lengths: NDArray[np.integer]) -> None:
        ends = np.cumsum(lengths, dtype=np.int64)
        if (int(ends[-1]) if len(ends) else 0) != len(blob) or (
            len(lengths) and int(np.min(lengths)) < 0
        ):
            raise ConfigError(
                f"payload lengths add up to {int(ends[-1]) if len(ends) else 0} bytes, "
                f"the buffer has {len(blob)}"
            )
        self._blob = blob
        self._ends = ends
        self._list: list[bytes] | None = None

    @classmethod
    def of(cls, payloads: Sequence[bytes]) -> Payloads:
        if isinstance(payloads, Payloads):
            return payloads
        lengths = np.fromiter(map(len, payloads), dtype=np.int64, count=len(payloads))
        return cls(b"".join(payloads), lengths)

    @property
    def blob(self) -> bytes:
        return self._blob

    @property
    def ends(self) -> NDArray[np.int64]:
        """Where each payload ends in `blob`."""
        return self._ends

    @property
    def lengths(self) -> NDArray[np.int64]:
        return np.diff(self._ends, prepend=np.int64(0))

    def __len__(self) -> int:
        return len(self._ends)

    @overload
    def __getitem__(self, index: int) -> bytes: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[bytes]: ...
    def __getitem__(self, index: int | slice) -> bytes | Sequence[bytes]:
        if isinstance(index, slice):
            lo, hi, step = index.indices(len(self._ends))
            if step != 1:
                return self.as_list()[index]
            hi = max(lo, hi)
            if (lo, hi) == (0, len(self._ends)):
                return self
            start = int(self._ends[lo - 1]) if lo else 0
            end = int(self._ends[hi - 1]) if hi else 0
            return Payloads(self._blob[start:end], self.lengths[lo:hi])
        n = len(self._ends)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError("payload index out of range")
        start = int(self._ends[index - 1]) if index else 0
        return self._blob[start : int(self._ends[index])]

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.as_list())

    def take(self, positions: NDArray[np.intp]) -> Sequence[bytes]:
        """The payloads at `positions` (an integer index array), in that order: from the
        list if one was made, else gathered into one new buffer (no bytes object per
        payload)."""
        if self._list is not None:
            listed = self._list
            return [listed[i] for i in positions.tolist()]
        lengths = self.lengths[positions]
        if not len(lengths):
            return Payloads(b"", lengths)
        ends = np.cumsum(lengths)
        # Byte i of the new buffer comes from blob[i + shift of its payload].
        shift = self._ends[positions] - ends
        at = np.arange(int(ends[-1]), dtype=np.int64) + np.repeat(shift, lengths)
        return Payloads(np.frombuffer(self._blob, dtype=np.uint8)[at].tobytes(), lengths)

    def as_list(self) -> list[bytes]:
        """One bytes object per payload (made once, then kept)."""
        if self._list is None:
            self._list = _split(self._blob, self.lengths)
        return self._list

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Payloads):
            return self._blob == other._blob and np.array_equal(self._ends, other._ends)
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return self.as_list() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Payloads({len(self)} payloads, {len(self._blob)} bytes)"


def _split(blob: bytes, lengths: NDArray[np.int64]) -> list[bytes]:
    """The payloads: one bytes object each, sliced from `blob`."""
    n = len(lengths)
    if n == 0:
        return []
    width = int(lengths[0])
    if width and bool((lengths == width).all()):
        # Equal lengths (common: fixed-size records): numpy cuts them in one call.
        same: list[bytes] = np.frombuffer(blob, dtype=f"V{width}").tolist()
        return same
    ends = np.cumsum(lengths, dtype=np.int64).tolist()
    return [blob[start:end] for start, end in zip([0, *ends[:-1]], ends, strict=True)]


@dataclass(frozen=True, slots=True)
class RecordBatch:
    """A batch of semi-deserialized source records; every column has the same length."""

    roots: NDArray[np.uint64]
    source_ids: NDArray[np.uint32]
    key_hashes: NDArray[np.int64]
    has_key: NDArray[np.bool_]
    topics: Sequence[str]
    partitions: NDArray[np.int32]
    offsets: NDArray[np.int64]
    payloads: Sequence[bytes]
    references: NDArray[np.bool_] | None = None
    """True for a record stored by reference (its payload empty: the bytes are at its
    coordinates in its source); None: no record is."""

    def __post_init__(self) -> None:
        n = len(self.roots)
        if self.references is not None and len(self.references) != n:
            raise ConfigError(
                f"RecordBatch column 'references' has {len(self.references)} entries, roots has {n}"
            )
        columns: dict[str, Sized] = {
            "source_ids": self.source_ids,
            "key_hashes": self.key_hashes,
            "has_key": self.has_key,
            "topics": self.topics,
            "partitions": self.partitions,
            "offsets": self.offsets,
            "payloads": self.payloads,
        }
        for name, column in columns.items():
            if len(column) != n:
                raise ConfigError(
                    f"RecordBatch column {name!r} has {len(column)} entries, roots has {n}"
                )

    def __len__(self) -> int:
        return len(self.roots)

    @property
    def reference_mask(self) -> NDArray[np.bool_]:
        """Per record: stored by reference (its bytes are not in the FT layer)."""
        if self.references is None:
            return np.zeros(len(self.roots), dtype=np.bool_)
        return self.references

    @property
    def key_unknown(self) -> NDArray[np.bool_]:
        """Per record: its key is not known yet (KEY_UNKNOWN)."""
        unknown: NDArray[np.bool_] = (self.key_hashes == KEY_UNKNOWN) & ~self.has_key
        return unknown

    @property
    def any_references(self) -> bool:
        return self.references is not None and bool(self.references.any())

    @classmethod
    def build(
        cls,
        roots: Sequence[int] | NDArray[np.uint64],
        payloads: Sequence[bytes],
        *,
        source_ids: ArrayLike = 0,
        key_hashes: ArrayLike | None = None,
        has_key: ArrayLike | None = None,
        topics: Sequence[str] | str = "",
        partitions: ArrayLike = 0,
        offsets: ArrayLike | None = None,
        references: ArrayLike | None = None,
    ) -> RecordBatch:
        """Build a batch from sequences or arrays; scalars broadcast to every record.

        Without key_hashes no record has a key; without offsets no record has a Kafka
        offset (-1): a record's coordinates identify it (a record persisted again at
        the same coordinates takes the earlier copy over, ftlayer.core.takeover), so
        none are made up. `references` (a scalar or a column): records stored by
        reference, whose payloads are empty.
        """
        n = len(roots)
        roots_a = np.asarray(roots, dtype=np.uint64)
        if key_hashes is None:
            hashes_a = np.zeros(n, dtype=np.int64)
            has_key_a = np.zeros(n, dtype=np.bool_) if has_key is None else np.asarray(has_key)
        else:
            hashes_a = np.asarray(key_hashes, dtype=np.int64)
            has_key_a = np.ones(n, dtype=np.bool_) if has_key is None else np.asarray(has_key)
        return cls(
            roots=roots_a,
            source_ids=_column(source_ids, n).astype(np.uint32, copy=False),
            key_hashes=hashes_a,
            has_key=has_key_a.astype(np.bool_, copy=False),
            topics=[topics] * n if isinstance(topics, str) else list(topics),
            partitions=_column(partitions, n).astype(np.int32, copy=False),
            offsets=np.full(n, -1, dtype=np.int64) if offsets is None else _column(offsets, n),
            payloads=payloads if isinstance(payloads, Payloads) else list(payloads),
            references=_flags(references, n),
        )

    def take(self, index: NDArray[np.intp] | NDArray[np.bool_]) -> RecordBatch:
        """The records at `index` (an integer index array or a boolean mask), in that order."""
        positions: NDArray[np.intp] = (
            np.flatnonzero(index) if index.dtype == np.bool_ else index  # type: ignore[assignment]
        )
        pos_list = positions.tolist()
        payloads = self.payloads
        taken = (
            payloads.take(positions)
            if isinstance(payloads, Payloads)
            else [payloads[i] for i in pos_list]
        )
        return RecordBatch(
            roots=self.roots[positions],
            source_ids=self.source_ids[positions],
            key_hashes=self.key_hashes[positions],
            has_key=self.has_key[positions],
            topics=[self.topics[i] for i in pos_list],
            partitions=self.partitions[positions],
            offsets=self.offsets[positions],
            payloads=taken,
            references=None if self.references is None else self.references[positions],
        )

    def with_roots(self, roots: NDArray[np.uint64]) -> RecordBatch:
        """The same records tracked under other root ids (what a replay does)."""
        return RecordBatch(
            roots=np.asarray(roots, dtype=np.uint64),
            source_ids=self.source_ids,
            key_hashes=self.key_hashes,
            has_key=self.has_key,
            topics=self.topics,
            partitions=self.partitions,
            offsets=self.offsets,
            payloads=self.payloads,
            references=self.references,
        )

    def with_payloads(
        self,
        rows: NDArray[np.intp],
        payloads: Sequence[bytes],
        keys: tuple[NDArray[np.int64], NDArray[np.bool_]] | None = None,
    ) -> RecordBatch:
        """The same records with the payloads of `rows` given (the bytes of records
        stored by reference, read from their source): those rows are references no
        more. `keys`: their (key hashes, has_key), set where the key was unknown."""
        merged: Sequence[bytes]
        if len(rows) == len(self) and len(payloads) == len(rows) and _in_order(rows):
            merged = payloads  # every row's, in order
        else:
            merged = list(self.payloads)
            for row, payload in zip(rows.tolist(), payloads, strict=True):
                merged[row] = payload
        references = self.reference_mask.copy()
        references[rows] = False
        key_hashes, has_key = self.key_hashes, self.has_key
        if keys is not None:
            unknown = self.key_unknown[rows]
            if bool(unknown.any()):
                key_hashes, has_key = key_hashes.copy(), has_key.copy()
                key_hashes[rows[unknown]] = keys[0][unknown]
                has_key[rows[unknown]] = keys[1][unknown]
        return RecordBatch(
            roots=self.roots,
            source_ids=self.source_ids,
            key_hashes=key_hashes,
            has_key=has_key,
            topics=self.topics,
            partitions=self.partitions,
            offsets=self.offsets,
            payloads=merged,
            references=references if references.any() else None,
        )

    @classmethod
    def empty(cls) -> RecordBatch:
        return cls.build(np.zeros(0, dtype=np.uint64), [])

    @classmethod
    def concat(cls, batches: Sequence[RecordBatch]) -> RecordBatch:
        """The records of `batches`, one after the other."""
        if len(batches) == 1:
            return batches[0]
        if not batches:
            return cls.empty()
        return RecordBatch(
            roots=np.concatenate([b.roots for b in batches]),
            source_ids=np.concatenate([b.source_ids for b in batches]),
            key_hashes=np.concatenate([b.key_hashes for b in batches]),
            has_key=np.concatenate([b.has_key for b in batches]),
            topics=[t for b in batches for t in b.topics],
            partitions=np.concatenate([b.partitions for b in batches]),
            offsets=np.concatenate([b.offsets for b in batches]),
            payloads=[p for b in batches for p in b.payloads],
            references=(
                np.concatenate([b.reference_mask for b in batches])
                if any(b.references is not None for b in batches)
                else None
            ),
        )


@dataclass(frozen=True, slots=True)
class ReplayRecords:
    """Replayed records fetched from the queue: each row re-enters `partitions[i]`."""

    replay_seqs: NDArray[np.uint64]
    partitions: NDArray[np.int32]
    records: RecordBatch
    """The stored records, with `roots` set to the root ids they are now tracked under."""

    def __len__(self) -> int:
        return len(self.replay_seqs)

    def take(self, index: NDArray[np.intp]) -> ReplayRecords:
        return ReplayRecords(
            self.replay_seqs[index], self.partitions[index], self.records.take(index)
        )

    @classmethod
    def concat(cls, pages: Sequence[ReplayRecords]) -> ReplayRecords:
        """The rows of `pages`, one after the other (pages of one fetch)."""
        if len(pages) == 1:
            return pages[0]
        return cls(
            np.concatenate([p.replay_seqs for p in pages] or [np.zeros(0, np.uint64)]),
            np.concatenate([p.partitions for p in pages] or [np.zeros(0, np.int32)]),
            RecordBatch.concat([p.records for p in pages]),
        )


def _flags(value: ArrayLike | None, n: int) -> NDArray[np.bool_] | None:
    """A bool column from a sequence or a scalar; None (no record set) stays None."""
    if value is None:
        return None
    column = np.asarray(value, dtype=np.bool_)
    column = np.full(n, bool(column), dtype=np.bool_) if column.ndim == 0 else column
    return column if column.any() else None


def _column(value: ArrayLike, n: int) -> NDArray[np.int64]:
    """A column of n integers from a sequence, or a scalar repeated n times."""
    column = np.asarray(value, dtype=np.int64)
    return np.full(n, column, dtype=np.int64) if column.ndim == 0 else column


def _in_order(rows: NDArray[np.intp]) -> bool:
    """Whether `rows` is 0, 1, ..., len(rows) - 1."""
    return not len(rows) or (int(rows[0]) == 0 and bool((np.diff(rows) == 1).all()))
