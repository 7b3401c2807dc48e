"""The bytes of records stored by reference: what `PersistenceStorage.fill` stores, and
how every read of such a record gets them (persistence.base's contract, "Records
stored by reference").

A record stored by reference (flag bit 1, `RecordBatch.references`) has no payload: its
bytes are in its source, at its coordinates. `fill` stores the bytes of such records
later (a failed record's, copied from its source so that its retries and its dead
letter do not depend on the source's retention), in one transaction, as one meta value
per `fill` call under `fillb/<first seq>` (FILL_BATCH_PREFIX, the seq as 20 decimal
digits; `FillBatch`): the count n, then n seqs (u64, ascending), n key hashes (i64), n
key flags (u8: 0 no key, 1 a key, 2 none given: the record's own stands), n payload
ends (i64), then the payloads back to back. From then on `get` and `scan` return the
record with its bytes and without the flag, and with that key where its key was
unknown (KEY_UNKNOWN). Deleting a record takes it out of its batch; the batch's value
is deleted with its last record, in the same transaction (`emptied` names the values a
delete empties; where the storage stages deletes, both ride on its next write). A value
a crash leaves behind its deleted records is dropped at the next `drop_stale_fills`.
Values under `fill/<seq>` (FILL_META_PREFIX: one record each, a byte 1 and its key or a
byte 0, then its payload), which stores written by earlier versions hold, are read and
deleted the same way.

`Fills` keeps, per storage, which seq's bytes are in which value (read from the meta
entries on first use, leaving out records no longer stored), how many records each
value still holds, and the values decoded lately. It reaches the storage only through
its meta and read hooks (`FillHost`), so this module imports nothing of the storage.
"""

from __future__ import annotations

import struct
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from itertools import repeat
from typing import Final, Protocol

import numpy as np
from numpy.typing import NDArray

from ftlayer.errors import CorruptData
from ftlayer.records import Payloads, RecordBatch

__all__ = ["FILL_BATCH_PREFIX", "FILL_META_PREFIX", "FillBatch", "FillHost", "Fills"]

FILL_META_PREFIX: Final = "fill/"
"""Meta keys of the bytes of one record stored by reference (stores of earlier
versions; `fill` writes batches, FILL_BATCH_PREFIX)."""
FILL_BATCH_PREFIX: Final = "fillb/"
"""Meta keys of the bytes one `fill` stored for records stored by reference."""
_FILL_KEY: Final = struct.Struct("<cqB")
"""A one-record fill's head (stores of earlier versions): b"\x01", key hash, has_key."""
_BATCH_PREFIX: Final = FILL_BATCH_PREFIX.encode()
_CACHED: Final = 64
_NO_KEY: Final = 2


class FillHost(Protocol):
    """What `Fills` needs of its storage: its meta and read hooks."""

    def _meta_keys(self, prefix: bytes) -> list[str]: ...
    def _get_metas(self, keys: Sequence[bytes]) -> list[bytes | None]: ...
    def _update_meta(
        self, puts: Sequence[tuple[bytes, bytes]], deletes: Sequence[bytes]
    ) -> None: ...
    def _stage_meta(
        self, puts: Sequence[tuple[bytes, bytes]], deletes: Sequence[bytes]
    ) -> None: ...
    def _stored_mask(self, seqs: NDArray[np.uint64]) -> NDArray[np.bool_]: ...


class Fills:
    """One storage's fill values (module docstring). Thread-safe."""

    def __init__(self, host: FillHost) -> None:
        self._host = host
        self._lock = threading.Lock()
        self._index: dict[int, bytes] | None = None  # seq -> the key of its value
        self._live: dict[bytes, int] = {}  # key -> records of it still stored
        self._cache: dict[bytes, FillBatch] = {}

    def index(self) -> dict[int, bytes]:
        """Seq -> the meta key holding the bytes `fill` stored for it."""
        index = self._index
        if index is None:
            found: dict[int, bytes] = {}
            for key, seqs in self.values():
                found.update(dict.fromkeys(seqs.tolist(), key))
            if found:  # a batch lists its deleted records too
                seqs = np.fromiter(found, np.uint64, len(found))
                for seq in seqs[~self._host._stored_mask(seqs)].tolist():
                    del found[seq]
            with self._lock:
                if self._index is None:
                    self._index = found
                    self._live = {}
                    for key in found.values():
                        self._live[key] = self._live.get(key, 0) + 1
                index = self._index
        return index

    def values(self) -> Iterator[tuple[bytes, NDArray[np.uint64]]]:
        """(meta key, the seqs it holds bytes of) of every fill value stored."""
        host = self._host
        for name in host._meta_keys(FILL_META_PREFIX.encode()):
            yield name.encode(), np.array([int(name[len(FILL_META_PREFIX) :])], np.uint64)
        keys = [name.encode() for name in host._meta_keys(_BATCH_PREFIX)]
        for key, raw in zip(keys, host._get_metas(keys), strict=True):
            if raw is not None:
                yield key, FillBatch.decode(bytes(raw)).seqs

    def store(
        self,
        seqs: NDArray[np.uint64],
        payloads: Sequence[bytes],
        keys: tuple[NDArray[np.int64], NDArray[np.bool_]] | None,
        *,
        staged: bool = False,
    ) -> None:
        """Store the bytes of records `seqs` (stored by reference, not filled yet, each
        once) as one value, in one transaction (`staged`: with the storage's next)."""
        index = self.index()
        batch = FillBatch.of(seqs, payloads, keys)
        key = _BATCH_PREFIX + b"%020d" % int(batch.seqs[0])
        value = [(key, batch.encode())]  # a key made here: no check
        if staged:
            self._host._stage_meta(value, [])
        else:
            self._host._update_meta(value, [])
        with self._lock:
            index.update(dict.fromkeys(seqs.tolist(), key))
            self._live[key] = len(seqs)
            self._cached()[key] = batch

    def filled_in(self, seqs: NDArray[np.uint64], batch: RecordBatch) -> RecordBatch:
        """`batch` (the records `seqs`) with the bytes stored for its records stored by
        reference: one dict lookup per such record, then a vectorized step per value."""
        filled = self.index()
        if not filled:
            return batch
        rows = np.flatnonzero(batch.reference_mask)
        by_key: dict[bytes, list[int]] = {}
        for row, key in zip(rows.tolist(), map(filled.get, seqs[rows].tolist()), strict=True):
            if key is not None:
                by_key.setdefault(key, []).append(row)
        if not by_key:
            return batch
        found = self._batches(list(by_key))
        out_rows: list[NDArray[np.intp]] = []
        payloads: list[bytes] = []
        key_hashes: list[NDArray[np.int64]] = []
        has_key: list[NDArray[np.bool_]] = []
        for key, at_list in by_key.items():
            fill_batch = found.get(key)
            if fill_batch is None:  # deleted meanwhile: not filled
                continue
            at = np.asarray(at_list, dtype=np.intp)
            positions, here = fill_batch.positions(seqs[at])
            at, positions = at[here], positions[here]
            if not len(at):
                continue
            out_rows.append(at)
            payloads += fill_batch.payloads_at(positions)
            flags = fill_batch.flags[positions]
            own = flags == _NO_KEY  # no key given: the record's own (unknown stays so)
            key_hashes.append(np.where(own, batch.key_hashes[at], fill_batch.key_hashes[positions]))
            has_key.append(np.where(own, batch.has_key[at], flags.astype(np.bool_)))
        if not out_rows:
            return batch
        all_rows = np.concatenate(out_rows)
        order = np.argsort(all_rows, kind="stable")
        return batch.with_payloads(
            all_rows[order],
            [payloads[i] for i in order.tolist()],
            (np.concatenate(key_hashes)[order], np.concatenate(has_key)[order]),
        )

    def emptied(self, seqs: NDArray[np.uint64]) -> list[bytes]:
        """The keys of the values whose every record is among `seqs`: what `forget`
        of them would delete (nothing changes), for a delete of those records to
        delete in its own transaction."""
        filled = self.index()
        if not filled:
            return []
        with self._lock:
            counts = Counter(map(filled.get, np.unique(seqs).tolist()))
            return [key for key, n in counts.items() if key is not None and self._live[key] == n]

    def forget(
        self, seqs: NDArray[np.uint64], *, staged: bool, deleted: Sequence[bytes] = ()
    ) -> None:
        """Take `seqs` (records deleted) out of their values: a value whose last record
        went is deleted (staged: with the storage's next write), but for those in
        `deleted` (deleted already, with the records: `emptied`)."""
        filled = self.index()
        if not filled:
            return
        deletes: list[bytes] = []
        listed = seqs.tolist()
        with self._lock:  # a seq given twice is taken out once (the second pop finds none)
            counts = Counter(map(filled.pop, listed, repeat(None, len(listed))))
            for key, n in counts.items():
                if key is None:  # not filled
                    continue
                left = self._live[key] - n
                if left:
                    self._live[key] = left
                else:
                    del self._live[key]
                    self._cache.pop(key, None)
                    deletes.append(key)
        if deleted:
            done = set(deleted)
            deletes = [key for key in deletes if key not in done]
        if deletes:
            if staged:
                self._host._stage_meta([], deletes)
            else:
                self._host._update_meta([], deletes)

    def drop_stale(self) -> int:
        """Delete the values none of whose records is stored any more; returns how many
        records' bytes went."""
        stale: list[bytes] = []
        dropped = 0
        for key, seqs in self.values():
            if not bool(self._host._stored_mask(seqs).any()):
                stale.append(key)
                dropped += len(seqs)
        if stale:
            self._host._update_meta([], stale)
            with self._lock:
                for key in stale:
                    self._cache.pop(key, None)
        return dropped

    def _batches(self, keys: list[bytes]) -> dict[bytes, FillBatch]:
        """The values of `keys` still stored, decoded (from the cache, or read)."""
        with self._lock:
            cache = self._cached()
            found = {key: cache[key] for key in keys if key in cache}
        wanted = [key for key in keys if key not in found]
        for key, raw in zip(wanted, self._host._get_metas(wanted), strict=True):
            if raw is not None:
                found[key] = (
                    FillBatch.decode(bytes(raw))
                    if key.startswith(_BATCH_PREFIX)
                    else FillBatch.of_one(int(key[len(FILL_META_PREFIX) :]), bytes(raw))
                )
        with self._lock:
            self._cached().update((key, found[key]) for key in wanted if key in found)
        return found

    def _cached(self) -> dict[bytes, FillBatch]:
        """The cache, trimmed to the latest _CACHED values (called under the lock)."""
        while len(self._cache) > _CACHED:
            del self._cache[next(iter(self._cache))]
        return self._cache


class FillBatch:
    """The bytes one `fill` stored (the module docstring's layout): its seqs
    ascending, with each record's key hash, key flag and payload."""

    __slots__ = ("blob", "ends", "flags", "key_hashes", "seqs")

    def __init__(
        self,
        seqs: NDArray[np.uint64],
        key_hashes: NDArray[np.int64],
        flags: NDArray[np.uint8],
        ends: NDArray[np.int64],
        blob: bytes,
    ) -> None:
        self.seqs, self.key_hashes, self.flags, self.ends, self.blob = (
            seqs,
            key_hashes,
            flags,
            ends,
            blob,
        )

    @classmethod
    def of(
        cls,
        seqs: NDArray[np.uint64],
        payloads: Sequence[bytes],
        keys: tuple[NDArray[np.int64], NDArray[np.bool_]] | None,
    ) -> FillBatch:
        n = len(seqs)
        key_hashes = np.zeros(n, np.int64) if keys is None else keys[0].astype(np.int64)
        flags = np.full(n, _NO_KEY, np.uint8) if keys is None else keys[1].astype(np.uint8)
        if isinstance(payloads, Payloads) and (n < 2 or bool((seqs[1:] > seqs[:-1]).all())):
            # In seq order already, in one buffer: taken as they are.
            return cls(
                seqs.astype(np.uint64), key_hashes, flags, payloads.ends, bytes(payloads.blob)
            )
        order = np.argsort(seqs, kind="stable")
        ordered = [payloads[i] for i in order.tolist()]
        lengths = np.fromiter(map(len, ordered), dtype=np.int64, count=n)
        return cls(
            seqs[order].astype(np.uint64),
            key_hashes[order],
            flags[order],
            np.cumsum(lengths),
            b"".join(ordered),
        )

    @classmethod
    def of_one(cls, seq: int, value: bytes) -> FillBatch:
        """A one-record fill value of an earlier version (FILL_META_PREFIX)."""
        if value[:1] == b"\x01":
            _, key_hash, has_key = _FILL_KEY.unpack_from(value)
            payload, flag = value[_FILL_KEY.size :], int(bool(has_key))
        else:
            key_hash, payload, flag = 0, value[1:], _NO_KEY
        return cls(
            np.array([seq], np.uint64),
            np.array([key_hash], np.int64),
            np.array([flag], np.uint8),
            np.array([len(payload)], np.int64),
            payload,
        )

    def encode(self) -> bytes:
        n = len(self.seqs)
        return b"".join(
            (
                struct.pack("<I", n),
                self.seqs.astype("<u8").tobytes(),
                self.key_hashes.astype("<i8").tobytes(),
                self.flags.astype(np.uint8).tobytes(),
                self.ends.astype("<i8").tobytes(),
                self.blob,
            )
        )

    @classmethod
    def decode(cls, raw: bytes) -> FillBatch:
        try:
            (n,) = struct.unpack_from("<I", raw)
            at = 4
            seqs = np.frombuffer(raw, "<u8", n, at).astype(np.uint64)
            at += 8 * n
            key_hashes = np.frombuffer(raw, "<i8", n, at).astype(np.int64)
            at += 8 * n
            flags = np.frombuffer(raw, np.uint8, n, at).copy()
            at += n
            ends = np.frombuffer(raw, "<i8", n, at).astype(np.int64)
            at += 8 * n
            blob = raw[at:]
            if n and int(ends[-1]) != len(blob):
                raise ValueError(f"payloads of {int(ends[-1])} bytes, {len(blob)} stored")
        except (struct.error, ValueError) as exc:
            raise CorruptData(f"bad fill batch: {exc}") from None
        return cls(seqs, key_hashes, flags, ends, blob)

    def positions(self, seqs: NDArray[np.uint64]) -> tuple[NDArray[np.intp], NDArray[np.bool_]]:
        """Where each of `seqs` is in this value, and whether it is here at all."""
        at = np.minimum(np.searchsorted(self.seqs, seqs), len(self.seqs) - 1)
        return at, self.seqs[at] == seqs

    def payloads_at(self, positions: NDArray[np.intp]) -> list[bytes]:
        """The payloads at these positions (of `positions`), in their order."""
        ends = self.ends[positions].tolist()
        starts = np.where(positions > 0, self.ends[positions - 1], 0).tolist()
        blob = self.blob
        return [blob[start:end] for start, end in zip(starts, ends, strict=True)]
