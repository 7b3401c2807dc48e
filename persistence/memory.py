"""The in-memory persistence storage: the `PersistenceStorage` contract, nothing durable.

For tests, demos and pipelines that accept losing pending records when the FT-layer
process dies. Records are kept encoded exactly as LMDB stores them (layout in `base`),
in a dict from seq to value, so both storages share one codec and one behaviour, and
a record costs its encoded bytes plus one dict entry.

Seqs start at 1 and are never reused within the storage's life. The dict is filled in
seq order and `set_roots` replaces values in place, so iterating it is seq order and
`scan` needs no sort.

The arguments of every verb are checked by `PersistenceStorage` (base) before they
reach the hooks here, as for LMDB.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from itertools import repeat

import numpy as np
from numpy.typing import NDArray

from ftlayer.errors import StorageError
from ftlayer.records import RecordBatch

from .base import (
    MetaOfSeqs,
    MetaValue,
    PersistenceStorage,
    check_replay_column,
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

    def put(
        self,
        batch: RecordBatch,
        meta: MetaOfSeqs | None = None,
        replay_seqs: NDArray[np.uint64] | None = None,
    ) -> NDArray[np.uint64]:
        replay_array = check_replay_column(batch, replay_seqs)
        self._check_open()
        n = len(batch)
        first = self._next_seq
        seqs = np.arange(first, first + n, dtype=np.uint64)
        if n == 0:
            return seqs
        values = encode_records(batch, replay_array)
        if meta is not None:
            entries = [(encode_meta_key(k), bytes(v)) for k, v in meta(seqs).items()]
            self._meta.update(entries)
        self._values.update(zip(range(first, first + n), values, strict=True))
        self._next_seq = first + n
        return seqs

    def _delete(self, seqs: NDArray[np.uint64], meta_deletes: Sequence[bytes] = ()) -> int:
        before = len(self._values)
        for _ in map(self._values.pop, seqs.tolist(), repeat(None)):
            pass
        for key in meta_deletes:
            self._meta.pop(key, None)
        return before - len(self._values)

    def _get(self, seq_array: NDArray[np.uint64]) -> RecordBatch:
        values = list(map(self._values.get, seq_array.tolist()))
        check_stored(seq_array, values)
        return decode_records(values)[0]  # type: ignore[arg-type]  # checked: no None

    def _set_roots(
        self,
        seq_array: NDArray[np.uint64],
        root_array: NDArray[np.uint64],
        replay_array: NDArray[np.uint64],
    ) -> None:
        keys = seq_array.tolist()
        old = list(map(self._values.get, keys))
        check_stored(seq_array, old)
        new = retag_records(old, root_array, replay_array)  # type: ignore[arg-type]
        self._values.update(zip(keys, new, strict=True))

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

    def _get_meta(self, key: bytes) -> bytes | None:
        return self._meta.get(key)

    def _put_meta(self, key: bytes, value: MetaValue) -> None:
        self._meta[key] = bytes(value)

    def _delete_meta(self, key: bytes) -> bool:
        return self._meta.pop(key, None) is not None

    def _update_meta(
        self, puts: Sequence[tuple[bytes, MetaValue]], deletes: Sequence[bytes]
    ) -> None:
        for key in deletes:
            self._meta.pop(key, None)
        self._meta.update((key, bytes(value)) for key, value in puts)

    def _meta_keys(self, prefix: bytes) -> list[str]:
        return [key.decode() for key in sorted(self._meta) if key.startswith(prefix)]

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
