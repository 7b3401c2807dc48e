"""The in-memory persistence storage: the `PersistenceStorage` contract, nothing durable.

For tests, demos and pipelines that accept losing pending records when the FT-layer
process dies. Records are kept encoded exactly as LMDB stores them (layout in `base`),
in a dict from seq to value, so both storages share one codec and one behaviour, and
a record costs its encoded bytes plus one dict entry.

Seqs start at 1 and are never reused within the storage's life. The dict is filled in
seq order and `set_roots` replaces values in place, so iterating it is seq order and
`scan` needs no sort.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping, Sequence
from itertools import repeat

import numpy as np
from numpy.typing import NDArray

from ftlayer.errors import StorageError
from ftlayer.records import RecordBatch

from .base import (
    MetaValue,
    PersistenceStorage,
    Seqs,
    as_seqs,
    check_batch_size,
    check_retag_columns,
    check_stored,
    decode_records,
    encode_meta_key,
    encode_records,
    retag_records,
)

# A small int key and its dict slot (hash, key, value pointers, index), per record.
_ENTRY_OVERHEAD = sys.getsizeof(2**40) + 4 * 8


class MemoryStorage(PersistenceStorage):
    """Source records in a dict; same contract as `LmdbStorage`, lost when the process ends."""

    def __init__(self) -> None:
        self._values: dict[int, bytes] = {}
        self._meta: dict[bytes, bytes] = {}
        self._next_seq = 1
        self._closed = False

    def __repr__(self) -> str:
        state = " (closed)" if self._closed else ""
        return f"MemoryStorage({len(self._values)} records){state}"

    def put(self, batch: RecordBatch) -> NDArray[np.uint64]:
        self._check_open()
        n = len(batch)
        first = self._next_seq
        seqs = np.arange(first, first + n, dtype=np.uint64)
        if n == 0:
            return seqs
        values = encode_records(batch)
        self._values.update(zip(range(first, first + n), values, strict=True))
        self._next_seq = first + n
        return seqs

    def delete(self, seqs: Seqs) -> int:
        self._check_open()
        before = len(self._values)
        for _ in map(self._values.pop, as_seqs(seqs).tolist(), repeat(None)):
            pass
        return before - len(self._values)

    def get(self, seqs: Seqs) -> RecordBatch:
        self._check_open()
        seq_array = as_seqs(seqs)
        values = list(map(self._values.get, seq_array.tolist()))
        check_stored(seq_array, values)
        return decode_records(values)[0]  # type: ignore[arg-type]  # checked: no None

    def set_roots(
        self,
        seqs: Seqs,
        roots: NDArray[np.uint64] | Sequence[int],
        replay_seqs: NDArray[np.uint64] | Sequence[int],
    ) -> None:
        self._check_open()
        seq_array, root_array, replay_array = check_retag_columns(seqs, roots, replay_seqs)
        keys = seq_array.tolist()
        old = list(map(self._values.get, keys))
        check_stored(seq_array, old)
        new = retag_records(old, root_array, replay_array)  # type: ignore[arg-type]
        self._values.update(zip(keys, new, strict=True))

    def scan(
        self, batch_size: int = 65536
    ) -> Iterator[tuple[NDArray[np.uint64], RecordBatch, NDArray[np.uint64]]]:
        self._check_open()
        check_batch_size(batch_size)
        return self._scan(batch_size)

    def _scan(
        self, batch_size: int
    ) -> Iterator[tuple[NDArray[np.uint64], RecordBatch, NDArray[np.uint64]]]:
        # A snapshot of the seqs, so that the caller may write while iterating.
        snapshot = list(self._values)
        for start in range(0, len(snapshot), batch_size):
            self._check_open()
            values = self._values
            seqs = [seq for seq in snapshot[start : start + batch_size] if seq in values]
            if seqs:
                batch, replay_seqs = decode_records([values[seq] for seq in seqs])
                yield np.array(seqs, dtype=np.uint64), batch, replay_seqs

    def get_meta(self, key: str) -> bytes | None:
        self._check_open()
        return self._meta.get(encode_meta_key(key))

    def put_meta(self, key: str, value: bytes) -> None:
        self._check_open()
        raw_key = encode_meta_key(key)
        if not isinstance(value, bytes | bytearray | memoryview):
            raise TypeError(f"meta values are bytes, got {type(value).__name__}")
        self._meta[raw_key] = bytes(value)

    def delete_meta(self, key: str) -> bool:
        self._check_open()
        return self._meta.pop(encode_meta_key(key), None) is not None

    def update_meta(self, puts: Mapping[str, MetaValue], deletes: Sequence[str] = ()) -> None:
        self._check_open()
        raw_puts = {encode_meta_key(key): value for key, value in puts.items()}
        raw_deletes = [encode_meta_key(key) for key in deletes]
        for value in raw_puts.values():
            if not isinstance(value, bytes | bytearray | memoryview):
                raise TypeError(f"meta values are bytes, got {type(value).__name__}")
        for key in raw_deletes:
            self._meta.pop(key, None)
        self._meta.update((key, bytes(value)) for key, value in raw_puts.items())

    def meta_keys(self, prefix: str = "") -> list[str]:
        self._check_open()
        raw = prefix.encode()
        return [key.decode() for key in sorted(self._meta) if key.startswith(raw)]

    @property
    def next_seq(self) -> int:
        self._check_open()
        return self._next_seq

    def __len__(self) -> int:
        self._check_open()
        return len(self._values)

    def size_bytes(self) -> int:
        """Approximate memory held: the encoded records and meta values, plus dict entries."""
        self._check_open()
        records = sum(map(sys.getsizeof, self._values.values()))
        meta = sum(len(key) + len(value) for key, value in self._meta.items())
        return records + len(self._values) * _ENTRY_OVERHEAD + meta

    def sync(self) -> None:
        self._check_open()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._values = {}
            self._meta = {}

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError("memory storage is closed")
