"""The persistence storage contract: where every source record waits until its tree completes.

Before a source emits a record, the FT layer stores it here (`put`); when the record's
tree completes it is deleted (`delete`); when the tree fails, the stored record is
re-tagged with a new root id and queued for replay (`set_roots`), or a record that
enters the replay queue as it is stored is put with its replay seq. After a crash,
recovery rebuilds the FT layer's in-memory state from `scan`. So a record the source
emitted is lost only if the storage loses it.

Storage sequence numbers
------------------------
Every stored record is named by its storage sequence number, `seq`: a uint64 that the
storage hands out, starting at 1 and strictly increasing in put order. A seq is never
reused, not even after every record was deleted and, for a durable storage, not after a
restart (the storage keeps its high-water mark). Seq order is therefore put order, and
`scan` returns records in it. The root id cannot be the key: it changes on every replay.

Atomicity and errors
--------------------
Every writing operation works on a batch and is atomic: all of it is written in one
transaction, or on any error nothing is. Reading operations see committed state only.

- `StorageError`: the storage cannot do what was asked (it is closed, a topic is too
  long for the layout, the disk refused); nothing was written.
- `RecordNotStored` (a `StorageError` and a `KeyError`): `get` or `set_roots` named a seq
  that is not stored; its message names the seqs.
- `ConfigError`: an argument is malformed (columns of different lengths, a seq that is
  not a non-negative integer, `batch_size < 1`, an empty or over-long meta key, a meta
  value that is not bytes).

Arguments are checked here, once for every storage: each public verb of
`PersistenceStorage` checks its arguments (the helpers below: `as_seqs`,
`check_retag_columns`, `check_batch_size`, `encode_meta_key`, `check_meta_value`) and
that the storage is open, then calls the storage's hook of the same name (`_get`,
`_delete`, `_set_roots`, `_scan`, `_get_meta`, ...) with them checked. So every storage
raises the same error, with the same message, for the same bad argument; a storage
implements the hooks, and `put`, whose batch the codec checks.

A storage is not thread-safe: callers use it from one thread at a time.

Record value layout
-------------------
Every storage stores a record as one byte string: a 43-byte packed header, then the
topic, then the payload, untouched. All integers are little-endian; there is no padding.
The memory storage keeps one such string per record; LMDB keeps the strings of a
persisted batch back to back in one value (`encode_chunk`; lmdb_storage's chunks).

| offset    | size | field      | type | meaning                                          |
|-----------|------|------------|------|--------------------------------------------------|
| 0         | 8    | root       | u64  | root id the record is tracked under               |
| 8         | 8    | replay_seq | u64  | position in the replay queue; 0 = not queued      |
| 16        | 4    | source_id  | u32  | the source that emitted it                        |
| 20        | 1    | flags      | u8   | bit 0: the Kafka record had a key; bit 1: stored  |
|           |      |            |      | by reference (no payload: `fill` may add it)      |
| 21        | 8    | key_hash   | i64  | stored key hash (hash/key-group partitioners)     |
| 29        | 4    | partition  | i32  | Kafka partition the record first entered          |
| 33        | 8    | offset     | i64  | Kafka offset                                      |
| 41        | 2    | topic_len  | u16  | length T of the topic in bytes                    |
| 43        | T    | topic      | utf-8| Kafka topic                                       |
| 43 + T    | rest | payload    | raw  | the record bytes, opaque to the FT layer          |

Headers are built and parsed a batch at a time with numpy (`HEADER` below), so the
per-record Python work is one concatenation when storing (none for a chunk of one topic
and one payload length) and three slices when reading.

Records stored by reference
---------------------------
A record stored by reference (flag bit 1, `RecordBatch.references`) has no payload:
its bytes are in its source, at its coordinates. `fill` stores its bytes later, and
from then on `get` and `scan` return the record with them, without the flag, and with
its key where it was unknown (KEY_UNKNOWN); deleting the record deletes its bytes.
How they are stored and merged is persistence.fills.
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Final, Self

import numpy as np
from numpy.typing import NDArray

from ftlayer.errors import ConfigError, StorageError
from ftlayer.records import Payloads, RecordBatch

from .fills import Fills

HEADER: Final = np.dtype(
    [
        ("root", "<u8"),
        ("replay_seq", "<u8"),
        ("source_id", "<u4"),
        ("has_key", "u1"),
        ("key_hash", "<i8"),
        ("partition", "<i4"),
        ("offset", "<i8"),
        ("topic_len", "<u2"),
    ]
)
"""The packed record header (43 bytes); see the layout table in the module docstring."""

MetaValue = bytes | bytearray | memoryview
"""What a meta value may be given as (it is stored as bytes)."""

HEADER_SIZE: Final = HEADER.itemsize
HAS_KEY_FLAG: Final = 1
REFERENCE_FLAG: Final = 2
MAX_TOPIC_BYTES: Final = 0xFFFF
MAX_META_KEY_BYTES: Final = 511
"""LMDB's key size limit; the memory storage enforces it too so both behave alike."""

TAGS: Final = np.dtype([("root", "<u8"), ("replay_seq", "<u8")])
"""The first 16 header bytes, root and replay_seq: the only ones `set_roots` rewrites."""

Seqs = NDArray[np.uint64] | Sequence[int]
"""Storage sequence numbers: a uint64 array, or any sequence of non-negative ints."""

MetaOfSeqs = Callable[[NDArray[np.uint64]], Mapping[str, bytes]]
"""Meta entries to store with a put, given the seqs its records got (`put`)."""


class RecordNotStored(StorageError, KeyError):
    """A seq given to `get` or `set_roots` is not stored (never was, or was deleted)."""

    def __init__(self, missing: NDArray[np.uint64]) -> None:
        shown = ", ".join(str(seq) for seq in missing[:10].tolist())
        more = f" ({len(missing)} in all)" if len(missing) > 10 else ""
        verb = "seq {} is" if len(missing) == 1 else "seqs {} are"
        super().__init__(f"{verb.format(shown + more)} not stored")
        self.missing = missing

    def __str__(self) -> str:
        # KeyError would show the message quoted, as if it were the key itself.
        return str(self.args[0])


class PersistenceStorage(ABC):
    """Stores source records under storage sequence numbers; the module docstring is the spec.

    Implementations: `LmdbStorage` (durable, the default) and `MemoryStorage` (same
    contract, nothing survives the process). Use as a context manager, or call `close`.
    """

    @abstractmethod
    def put(
        self,
        batch: RecordBatch,
        meta: MetaOfSeqs | None = None,
        replay_seqs: NDArray[np.uint64] | None = None,
    ) -> NDArray[np.uint64]:
        """Store every record of `batch` in one transaction; return their seqs in batch order.

        The seqs are the next `len(batch)` numbers, consecutive. Every record is stored
        with replay_seq 0 (not queued for replay), or with its entry of `replay_seqs`
        (one per record, batch order: as if `set_roots` gave it that replay seq and its
        own root in the same transaction). An empty batch stores nothing and uses
        no seq. Raises StorageError (nothing stored, no seq used) if a topic is longer than
        65535 UTF-8 bytes, TypeError if a payload is not bytes-like, and ConfigError if
        `replay_seqs` has not one entry per record.

        `meta`, if given, is called with the seqs once they are known and the meta
        entries it returns ({key: value}, keys as for `put_meta`) are stored in the same
        transaction as the records (what belongs to the records by seq, such as their
        retry records): both are stored, or neither. It may be called more than once.
        """

    def delete(self, seqs: Seqs) -> int:
        """Delete the records `seqs` in one transaction; return how many were stored.

        Seqs that are not stored are ignored; a seq given twice counts once.
        """
        self._check_open()
        found = as_seqs(seqs)
        if not len(found):
            return 0
        # Values of filled bytes whose last record goes now go in the same transaction.
        emptied = self._fills().emptied(found)
        deleted = self._delete(found, emptied)
        self._fills().forget(found, staged=False, deleted=emptied)
        return deleted

    def get(self, seqs: Seqs) -> RecordBatch:
        """The stored records `seqs`, in that order (a seq given twice appears twice).

        Raises RecordNotStored naming every seq that is not stored.
        """
        self._check_open()
        seq_array = as_seqs(seqs)
        batch = self._get(seq_array)
        return self._filled_in(seq_array, batch) if batch.any_references else batch

    def fill(
        self,
        seqs: Seqs,
        payloads: Sequence[bytes],
        keys: tuple[NDArray[np.int64], NDArray[np.bool_]] | None = None,
    ) -> int:
        """Store the bytes of records stored by reference (read from their source), in
        one transaction; from then on they are returned with them, and (with `keys`,
        their key hashes and has_key) with their key where it was unknown. Seqs not
        stored, not stored by reference, or filled before are left alone. Returns how
        many were filled. ConfigError if the columns differ in length."""
        return len(self.fill_records(seqs, payloads, keys)[0])

    def fill_records(
        self,
        seqs: Seqs,
        payloads: Sequence[bytes],
        keys: tuple[NDArray[np.int64], NDArray[np.bool_]] | None = None,
        *,
        staged: bool = False,
        stored: RecordBatch | None = None,
    ) -> tuple[NDArray[np.uint64], RecordBatch]:
        """`fill`, returning the seqs it filled and their records as `get` now returns
        them (bytes and keys in), so a caller needs no read of its own. `staged`: the
        bytes are staged (`stage_meta`), readable at once and committed with the next
        write or `flush_staged`, which the caller owes before it calls them durable.
        `stored`: the records of `seqs` as `get` returns them, when the caller knows
        them (each stored, by reference, exactly so): nothing is read."""
        self._check_open()
        seq_array = as_seqs(seqs)
        if len(seq_array) != len(payloads) or (
            keys is not None and not len(keys[0]) == len(keys[1]) == len(seq_array)
        ):
            raise ConfigError(
                f"fill needs one payload per seq: got {len(seq_array)} seqs, "
                f"{len(payloads)} payloads"
            )
        if stored is not None:
            if len(stored) != len(seq_array):
                raise ConfigError(
                    f"fill: {len(seq_array)} seqs but {len(stored)} stored records given"
                )
            present, batch = np.arange(len(seq_array)), stored
        else:
            try:  # one read of the records; a second only when some are not stored
                present, batch = np.arange(len(seq_array)), self._get(seq_array)
            except RecordNotStored as exc:
                present = np.flatnonzero(~np.isin(seq_array, exc.missing))
                if not len(present):
                    return np.zeros(0, dtype=np.uint64), RecordBatch.empty()
                batch = self._get(seq_array[present])
        filled = self._fills().index()
        at = np.flatnonzero(batch.reference_mask)  # rows of `batch`
        if filled and len(at):
            listed = seq_array[present[at]].tolist()
            if not filled.keys().isdisjoint(listed):
                at = at[[seq not in filled for seq in listed]]
        candidates = seq_array[present[at]]
        if len(at) > 1 and not bool((candidates[1:] > candidates[:-1]).all()):
            _, first = np.unique(candidates, return_index=True)
            at = at[np.sort(first)]  # a seq given twice is filled once
        rows = present[at]  # rows of `seqs`
        if not len(rows):
            return np.zeros(0, dtype=np.uint64), RecordBatch.empty()
        if len(rows) == len(payloads):  # every one, in order: the payloads as given
            wanted: Sequence[bytes] = payloads
        else:
            wanted = [bytes(payloads[row]) for row in rows.tolist()]
        done = seq_array[rows]
        given = None if keys is None else (keys[0][rows], keys[1][rows])
        self._fills().store(done, wanted, given, staged=staged)
        return done, batch.take(at).with_payloads(np.arange(len(at)), wanted, given)

    @property
    def filled(self) -> int:
        """Records whose bytes `fill` stored, still stored."""
        self._check_open()
        return len(self._fills().index())

    def drop_stale_fills(self) -> int:
        """Delete the fill values none of whose records is stored any more (a crash
        between the records' delete and their bytes' delete); returns how many records'
        bytes went."""
        self._check_open()
        return self._fills().drop_stale()

    def set_roots(
        self,
        seqs: Seqs,
        roots: NDArray[np.uint64] | Sequence[int],
        replay_seqs: NDArray[np.uint64] | Sequence[int],
    ) -> None:
        """Rewrite the root id and replay seq of stored records, in one transaction.

        This is what failing a tree does: the record gets a new root and, with
        replay_seq > 0, a place in the replay queue (0 means not queued). Everything else
        about the record is unchanged. If a seq is given twice, its last entry wins.
        Raises RecordNotStored (nothing written) if a seq is not stored, and ConfigError
        if the three columns differ in length.
        """
        self._check_open()
        seq_array, root_array, replay_array = check_retag_columns(seqs, roots, replay_seqs)
        if len(seq_array):
            self._set_roots(seq_array, root_array, replay_array)

    def scan(
        self, batch_size: int = 65536
    ) -> Iterator[tuple[NDArray[np.uint64], RecordBatch, NDArray[np.uint64]]]:
        """Every stored record in seq order, as (seqs, batch, replay_seqs) of up to `batch_size`.

        Recovery uses it to rebuild the in-memory state. Each chunk is read consistently;
        records put or deleted while a scan is in progress may or may not appear.
        Raises ConfigError at once if batch_size < 1.
        """
        self._check_open()
        check_batch_size(batch_size)
        return self._scan_filled_in(batch_size)

    def _scan_filled_in(
        self, batch_size: int
    ) -> Iterator[tuple[NDArray[np.uint64], RecordBatch, NDArray[np.uint64]]]:
        for seqs, batch, replay_seqs in self._scan(batch_size):
            if batch.any_references:
                batch = self._filled_in(seqs, batch)
            yield seqs, batch, replay_seqs

    def get_meta(self, key: str) -> bytes | None:
        """The value stored under meta key `key`, or None."""
        self._check_open()
        return self._get_meta(encode_meta_key(key))

    def put_meta(self, key: str, value: bytes) -> None:
        """Store `value` under meta key `key` (1 to 511 UTF-8 bytes), replacing any old value.

        Meta entries live apart from the records: FT-layer state such as checkpoints.
        """
        self._check_open()
        raw_key = encode_meta_key(key)
        check_meta_value(value)
        self._put_meta(raw_key, value)

    def delete_meta(self, key: str) -> bool:
        """Remove meta key `key`; True if it was there."""
        self._check_open()
        return self._delete_meta(encode_meta_key(key))

    def update_meta(self, puts: Mapping[str, MetaValue], deletes: Sequence[str] = ()) -> None:
        """Store `puts` and remove `deletes` (absent keys are ignored) in one
        transaction: all of it happens, or (on an error) none of it."""
        self._check_open()
        self._update_meta(*encode_meta_changes(puts, deletes))

    def meta_keys(self, prefix: str = "") -> list[str]:
        """The meta keys that start with `prefix`, in byte order of their UTF-8 form."""
        self._check_open()
        return self._meta_keys(prefix.encode())

    def stage_meta(self, puts: Mapping[str, bytes], deletes: Sequence[str] = ()) -> None:
        """Like `update_meta`, but a storage may commit these with its next write
        (records, deletes or meta) rather than in a transaction of their own: not
        durable until then (or `flush_staged`), though readable at once. For small
        bookkeeping written often (checkpoint records), so it never costs a sync of
        its own."""
        self._check_open()
        self._stage_meta(*encode_meta_changes(puts, deletes))

    def flush_staged(self, older_than_s: float = 0.0) -> None:
        """Commit what `stage_meta` and `stage_deletes` left staged, if it has waited at
        least `older_than_s` (a storage that stages nothing has nothing to do)."""
        del older_than_s

    @property
    def staged_deletes(self) -> int:
        """Records whose staged delete is not committed yet."""
        return 0

    @property
    def staged_since(self) -> float | None:
        """When (time.monotonic) the oldest staged write not committed yet was staged;
        None when nothing waits (`flush_staged`)."""
        return None

    def stage_deletes(self, seqs: Seqs) -> None:
        """Like `delete`, but a storage may carry out these deletes with its next write
        (say, the next `put`) rather than in a transaction of their own. For records
        whose trees completed: until then they stay stored, and a crash before it
        replays them after the restart (duplicates, never a loss)."""
        self._check_open()
        found = as_seqs(seqs)
        if len(found):
            self._stage_deletes(found)
            self._forget_fills(found, staged=True)

    @property
    @abstractmethod
    def next_seq(self) -> int:
        """The seq the next stored record will get."""

    @abstractmethod
    def __len__(self) -> int:
        """How many records are stored."""

    @abstractmethod
    def size_bytes(self) -> int:
        """The storage's size in bytes: on disk for LMDB, approximate memory in memory."""

    @abstractmethod
    def sync(self) -> None:
        """Flush committed writes to durable storage (a no-op where nothing is durable)."""

    @property
    def commits(self) -> int:
        """Write transactions committed since the storage was opened (each an fsync
        with LMDB's default sync): what the FT layer's durability costs per request.
        0 where nothing is durable."""
        return 0

    @abstractmethod
    def close(self) -> None:
        """Release the storage. Idempotent; any other use afterwards raises StorageError."""

    @property
    @abstractmethod
    def closed(self) -> bool:
        """True once `close` was called."""

    # The hooks behind the verbs above: each is called with the storage open and its
    # arguments checked (seqs as a 1-d uint64 array, meta keys UTF-8 encoded, meta
    # values bytes-like); `delete`, `set_roots` and `stage_deletes` call theirs only
    # with at least one seq.

    @abstractmethod
    def _check_open(self) -> None:
        """Raise StorageError if the storage is closed."""

    @abstractmethod
    def _delete(self, seqs: NDArray[np.uint64], meta_deletes: Sequence[bytes] = ()) -> int:
        """Delete the records `seqs` and the meta entries `meta_deletes` in one
        transaction; how many records were stored."""

    @abstractmethod
    def _get(self, seq_array: NDArray[np.uint64]) -> RecordBatch: ...

    @abstractmethod
    def _set_roots(
        self,
        seq_array: NDArray[np.uint64],
        root_array: NDArray[np.uint64],
        replay_array: NDArray[np.uint64],
    ) -> None:
        """`set_roots` of columns of one length, at least one seq."""

    @abstractmethod
    def _scan(
        self, batch_size: int
    ) -> Iterator[tuple[NDArray[np.uint64], RecordBatch, NDArray[np.uint64]]]: ...

    @abstractmethod
    def _get_meta(self, key: bytes) -> bytes | None: ...

    @abstractmethod
    def _put_meta(self, key: bytes, value: MetaValue) -> None: ...

    @abstractmethod
    def _delete_meta(self, key: bytes) -> bool: ...

    @abstractmethod
    def _update_meta(
        self, puts: Sequence[tuple[bytes, MetaValue]], deletes: Sequence[bytes]
    ) -> None: ...

    @abstractmethod
    def _meta_keys(self, prefix: bytes) -> list[str]: ...

    def _get_metas(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Several meta values; a storage may read them at once."""
        return [self._get_meta(key) for key in keys]

    def _stage_meta(
        self, puts: Sequence[tuple[bytes, MetaValue]], deletes: Sequence[bytes]
    ) -> None:
        """This default commits at once."""
        self._update_meta(puts, deletes)

    def _stage_deletes(self, seqs: NDArray[np.uint64]) -> None:
        """This default deletes at once."""
        self._delete(seqs)

    # ---- bytes of records stored by reference (persistence.fills) ----------------------

    def _fills(self) -> Fills:
        fills: Fills | None = self.__dict__.get("_fill_values")
        if fills is None:
            fills = self.__dict__.setdefault("_fill_values", Fills(self))
        return fills

    def _filled_in(self, seqs: NDArray[np.uint64], batch: RecordBatch) -> RecordBatch:
        return self._fills().filled_in(seqs, batch)

    def _forget_fills(self, seqs: NDArray[np.uint64], *, staged: bool) -> None:
        self._fills().forget(seqs, staged=staged)

    def contains(self, seqs: Seqs) -> NDArray[np.bool_]:
        """Per seq: stored (a bool array in the order of `seqs`)."""
        self._check_open()
        seq_array = as_seqs(seqs)
        if not len(seq_array):
            return np.zeros(0, dtype=np.bool_)
        return self._stored_mask(seq_array)

    def _stored_mask(self, seqs: NDArray[np.uint64]) -> NDArray[np.bool_]:
        """Per seq: stored."""
        try:
            self._get(seqs)
        except RecordNotStored as exc:
            return ~np.isin(seqs, exc.missing)
        return np.ones(len(seqs), dtype=np.bool_)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def as_seqs(seqs: Seqs) -> NDArray[np.uint64]:
    """`seqs` as a 1-d uint64 array; ConfigError unless they are non-negative integers."""
    if isinstance(seqs, np.ndarray) and seqs.dtype == np.uint64 and seqs.ndim == 1:
        return seqs
    array = np.asarray(seqs)
    if array.ndim != 1:
        raise ConfigError(f"seqs must be one-dimensional, got shape {array.shape}")
    if array.size == 0:
        return np.zeros(0, dtype=np.uint64)
    if array.dtype.kind not in "iu" or (array.dtype.kind == "i" and bool((array < 0).any())):
        raise ConfigError(f"seqs must be non-negative integers, got {array[:5].tolist()}...")
    return array.astype(np.uint64)


def check_retag_columns(
    seqs: Seqs,
    roots: NDArray[np.uint64] | Sequence[int],
    replay_seqs: NDArray[np.uint64] | Sequence[int],
) -> tuple[NDArray[np.uint64], NDArray[np.uint64], NDArray[np.uint64]]:
    """The three `set_roots` columns as uint64 arrays; ConfigError if their lengths differ."""
    seq_array = as_seqs(seqs)
    root_array = np.asarray(roots, dtype=np.uint64)
    replay_array = np.asarray(replay_seqs, dtype=np.uint64)
    if not len(seq_array) == len(root_array) == len(replay_array):
        raise ConfigError(
            f"set_roots needs one root and one replay seq per seq: got {len(seq_array)} seqs, "
            f"{len(root_array)} roots, {len(replay_array)} replay seqs"
        )
    return seq_array, root_array, replay_array


def check_stored(seqs: NDArray[np.uint64], values: Sequence[bytes | None]) -> None:
    """Raise RecordNotStored naming the seqs whose value is None (not stored)."""
    if None in values:
        missing = np.array([value is None for value in values], dtype=np.bool_)
        raise RecordNotStored(seqs[missing])


def check_batch_size(batch_size: int) -> None:
    """ConfigError unless a scan's `batch_size` is at least 1."""
    if batch_size < 1:
        raise ConfigError(f"scan batch_size must be at least 1, got {batch_size}")


def encode_meta_key(key: str) -> bytes:
    """`key` as UTF-8; ConfigError unless it is a str of 1 to 511 bytes."""
    if not isinstance(key, str):
        raise ConfigError(f"meta keys are str, got {type(key).__name__}: {key!r}")
    encoded = key.encode("utf-8")
    if not 0 < len(encoded) <= MAX_META_KEY_BYTES:
        raise ConfigError(
            f"meta key must be 1 to {MAX_META_KEY_BYTES} UTF-8 bytes, got {len(encoded)}: "
            f"{key[:40]!r}"
        )
    return encoded


def check_meta_value(value: object) -> None:
    """ConfigError unless `value` is bytes-like (a meta value)."""
    if not isinstance(value, bytes | bytearray | memoryview):
        raise ConfigError(f"meta values are bytes, got {type(value).__name__}")


def encode_meta_changes(
    puts: Mapping[str, MetaValue], deletes: Sequence[str]
) -> tuple[list[tuple[bytes, MetaValue]], list[bytes]]:
    """The keys of `puts` and `deletes` encoded (`encode_meta_key`), then the values of
    `puts` checked (`check_meta_value`): what `update_meta` and `stage_meta` write."""
    raw_puts = [(encode_meta_key(key), value) for key, value in puts.items()]
    raw_deletes = [encode_meta_key(key) for key in deletes]
    for _, value in raw_puts:
        check_meta_value(value)
    return raw_puts, raw_deletes


def check_replay_column(
    batch: RecordBatch, replay_seqs: NDArray[np.uint64] | Sequence[int] | None
) -> NDArray[np.uint64] | None:
    """`put`'s `replay_seqs` as an array of one entry per record of `batch` (None: none
    given); ConfigError when the counts differ."""
    if replay_seqs is None:
        return None
    replay_array = np.asarray(replay_seqs, dtype=np.uint64)
    if len(replay_array) != len(batch):
        raise ConfigError(
            f"put needs one replay seq per record: got {len(replay_array)} for {len(batch)} records"
        )
    return replay_array


def encode_records(
    batch: RecordBatch, replay_seqs: NDArray[np.uint64] | None = None
) -> list[bytes]:
    """The stored value of every record in `batch` (replay_seq 0, or its entry of
    `replay_seqs`), in batch order.

    Headers are filled column by column in one structured array; for each distinct topic
    the header and topic bytes of its records become fixed-width rows, turned into one
    bytes object per record by numpy; only the payload concatenation is per record.
    """
    if len(batch) == 0:
        return []
    return list(map(operator.add, _record_prefixes(batch, None, replay_seqs), batch.payloads))


def encode_chunk(
    batch: RecordBatch, replay_seqs: NDArray[np.uint64] | None = None
) -> tuple[bytes, NDArray[np.int64]]:
    """The values of `encode_records(batch, replay_seqs)` back to back in one bytes
    object, and the end offset of each record in it: what LMDB stores a batch as (one
    chunk).

    No bytes object per record is built when the batch has one topic and payloads of
    one length (numpy writes fixed-width rows); otherwise the header-and-topic prefixes
    and the payloads are joined once. Raises TypeError if a payload is not bytes-like.
    """
    n = len(batch)
    if n == 0:
        return b"", np.zeros(0, dtype=np.int64)
    payloads = batch.payloads
    topic_bytes = _encode_topics(batch.topics)
    buffer = payloads if isinstance(payloads, Payloads) else None
    if buffer is not None:
        lengths = buffer.lengths
    else:
        lengths = np.fromiter(map(len, payloads), dtype=np.int64, count=n)
    same_length = bool((lengths == lengths[0]).all())
    if buffer is not None and len(topic_bytes) == 1 and not same_length:
        return _chunk_of_buffer(batch, buffer, next(iter(topic_bytes.values())), replay_seqs)
    if len(topic_bytes) == 1 and same_length:
        topic = next(iter(topic_bytes.values()))
        head = _headers(batch, replay_seqs)
        head["topic_len"] = len(topic)
        prefix = HEADER_SIZE + len(topic)
        width = prefix + int(lengths[0])
        rows = np.empty((n, width), dtype=np.uint8)
        rows[:, :HEADER_SIZE] = head.view(np.uint8).reshape(n, HEADER_SIZE)
        rows[:, HEADER_SIZE:prefix] = np.frombuffer(topic, dtype=np.uint8)
        joined = buffer.blob if buffer is not None else b"".join(payloads)
        rows[:, prefix:] = np.frombuffer(joined, dtype=np.uint8).reshape(n, -1)
        return rows.tobytes(), np.arange(width, width * (n + 1), width, dtype=np.int64)
    prefixes = _record_prefixes(batch, topic_bytes, replay_seqs)
    parts: list[bytes] = [b""] * (2 * n)
    parts[::2] = prefixes
    parts[1::2] = payloads
    blob = b"".join(parts)
    prefix_lengths = np.fromiter(map(len, prefixes), dtype=np.int64, count=n)
    return blob, np.cumsum(prefix_lengths + lengths)


def _chunk_of_buffer(
    batch: RecordBatch,
    payloads: Payloads,
    topic: bytes,
    replay_seqs: NDArray[np.uint64] | None = None,
) -> tuple[bytes, NDArray[np.int64]]:
    """encode_chunk of one topic's batch whose payloads are one buffer (as a PERSIST
    frame brings them): the fixed-width header-and-topic prefixes and the payload
    bytes laid out in one pass of a numba kernel (persistence/kernels.py), no bytes
    object per record."""
    from ftlayer.persistence.kernels import prefixed  # numba: imported on first use

    rows = _prefix_rows(_headers(batch, replay_seqs), topic)
    blob = np.frombuffer(payloads.blob, dtype=np.uint8)
    lengths = np.ascontiguousarray(payloads.lengths, dtype=np.int64)
    out = np.empty(rows.size + len(blob), dtype=np.uint8)
    ends = np.empty(len(rows), dtype=np.int64)
    prefixed(rows, blob, lengths, out, ends)
    return out.tobytes(), ends


def _headers(batch: RecordBatch, replay_seqs: NDArray[np.uint64] | None = None) -> NDArray[np.void]:
    """The record headers of `batch` (replay_seq 0 or `replay_seqs`; topic_len left for
    the caller)."""
    head = np.empty(len(batch), dtype=HEADER)
    head["root"] = batch.roots
    head["replay_seq"] = 0 if replay_seqs is None else replay_seqs
    head["source_id"] = batch.source_ids
    head["has_key"] = batch.has_key.astype(np.uint8)
    if batch.references is not None:
        head["has_key"] |= batch.references.astype(np.uint8) << 1
    head["key_hash"] = batch.key_hashes
    head["partition"] = batch.partitions
    head["offset"] = batch.offsets
    return head


def _record_prefixes(
    batch: RecordBatch,
    topic_bytes: dict[str, bytes] | None = None,
    replay_seqs: NDArray[np.uint64] | None = None,
) -> list[bytes]:
    """Header + topic of each record of `batch` (not empty), one bytes object each."""
    n = len(batch)
    head = _headers(batch, replay_seqs)
    if topic_bytes is None:
        topic_bytes = _encode_topics(batch.topics)
    if len(topic_bytes) == 1:
        return _prefixes(head, next(iter(topic_bytes.values())))
    codes_by_topic = {topic: code for code, topic in enumerate(topic_bytes)}
    codes = np.fromiter(map(codes_by_topic.__getitem__, batch.topics), np.intp, n)
    order = np.argsort(codes, kind="stable")
    ends = np.cumsum(np.bincount(codes, minlength=len(topic_bytes)))
    grouped = np.empty(n, dtype=object)
    start = 0
    for encoded, end in zip(topic_bytes.values(), ends.tolist(), strict=True):
        rows = order[start:end]
        grouped[rows] = _prefixes(head[rows], encoded)
        start = end
    prefixes: list[bytes] = grouped.tolist()
    return prefixes


def _encode_topics(topics: Sequence[str]) -> dict[str, bytes]:
    """Each distinct topic (in first-seen order) with its UTF-8 bytes."""
    # list.count compares by identity first, so a batch built with one topic object
    # (the usual case) is recognised without hashing every entry.
    distinct = [topics[0]] if topics.count(topics[0]) == len(topics) else dict.fromkeys(topics)
    encoded = {topic: topic.encode("utf-8") for topic in distinct}
    too_long = [topic for topic, raw in encoded.items() if len(raw) > MAX_TOPIC_BYTES]
    if too_long:
        raise StorageError(
            f"topic {too_long[0][:40]!r}... is {len(encoded[too_long[0]])} UTF-8 bytes, "
            f"more than the {MAX_TOPIC_BYTES} the record layout allows; nothing was stored"
        )
    return encoded


def _prefixes(head: NDArray[np.void], topic: bytes) -> list[bytes]:
    """Header + topic of each record in `head` (all with this topic), one bytes each."""
    rows = _prefix_rows(head, topic)
    prefixes: list[bytes] = rows.view(f"V{rows.shape[1]}").ravel().tolist()
    return prefixes


def _prefix_rows(head: NDArray[np.void], topic: bytes) -> NDArray[np.uint8]:
    """Header + topic of each record in `head` (all with this topic), as the rows of
    one uint8 array (n, HEADER_SIZE + len(topic)); sets head's topic_len."""
    n = len(head)
    head["topic_len"] = len(topic)
    rows = np.empty((n, HEADER_SIZE + len(topic)), dtype=np.uint8)
    rows[:, :HEADER_SIZE] = head.view(np.uint8).reshape(n, HEADER_SIZE)
    rows[:, HEADER_SIZE:] = np.frombuffer(topic, dtype=np.uint8)
    return rows


def decode_records(values: Sequence[bytes]) -> tuple[RecordBatch, NDArray[np.uint64]]:
    """The records stored as `values` (see the layout), and their replay seqs."""
    lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
    return decode_packed(b"".join(values), np.cumsum(lengths) - lengths, lengths)


def decode_packed(
    buffer: bytes, starts: NDArray[np.int64], lengths: NDArray[np.int64]
) -> tuple[RecordBatch, NDArray[np.uint64]]:
    """The records stored as buffer[starts[i]:starts[i] + lengths[i]] (see the layout),
    and their replay seqs.

    Vectorized: the headers gathered in one step, the topics named once per distinct
    topic (compared as rows of bytes), and the payloads sliced only when any record
    has one (records stored by reference have none): no Python step per record but
    those slices."""
    n = len(starts)
    if n and int(lengths.min()) < HEADER_SIZE:
        raise StorageError("a stored record is shorter than the record header: storage corrupt")
    data = np.frombuffer(buffer, dtype=np.uint8)
    head = np.ascontiguousarray(data[starts[:, None] + np.arange(HEADER_SIZE)])
    head = head.view(HEADER).reshape(n)
    topic_lengths = head["topic_len"].astype(np.int64)
    ends = starts + lengths
    topic_ends = starts + HEADER_SIZE + topic_lengths
    if n and bool((topic_ends > ends).any()):
        raise StorageError("a stored record's topic runs past its end: storage corrupt")
    topics = _topics(data, starts + HEADER_SIZE, topic_lengths)
    if not n or bool((topic_ends == ends).all()):
        payloads: list[bytes] = [b""] * n
    else:
        payloads = [buffer[a:b] for a, b in zip(topic_ends.tolist(), ends.tolist(), strict=True)]
    flags = head["has_key"]
    references = (flags & REFERENCE_FLAG).astype(np.bool_)
    batch = RecordBatch(
        roots=head["root"].astype(np.uint64),
        source_ids=head["source_id"].astype(np.uint32),
        key_hashes=head["key_hash"].astype(np.int64),
        has_key=(flags & HAS_KEY_FLAG).astype(np.bool_),
        topics=topics,
        partitions=head["partition"].astype(np.int32),
        offsets=head["offset"].astype(np.int64),
        payloads=payloads,
        references=references if references.any() else None,
    )
    return batch, head["replay_seq"].astype(np.uint64)


def _topics(
    buffer: NDArray[np.uint8], starts: NDArray[np.int64], lengths: NDArray[np.int64]
) -> list[str]:
    """The topic of each record, its UTF-8 bytes at buffer[starts:starts + lengths]:
    each distinct one decoded once. Records of one topic length are compared as rows
    of bytes; several lengths, one group each."""
    n = len(starts)
    topics: list[str] = [""] * n
    if not n:
        return topics
    for length in np.unique(lengths).tolist():
        same = lengths == length
        rows = np.arange(n) if bool(same.all()) else np.flatnonzero(same)
        if not length:
            continue  # topics[rows] stay ""
        names = buffer[starts[rows, None] + np.arange(length)]
        first = names[0]
        if bool((names == first).all()):
            name = first.tobytes().decode("utf-8")
            if len(rows) == n:
                return [name] * n
            for row in rows.tolist():
                topics[row] = name
            continue
        distinct, inverse = np.unique(names.view(f"V{length}").ravel(), return_inverse=True)
        decoded = [bytes(d).decode("utf-8") for d in distinct.tolist()]
        for row, which in zip(rows.tolist(), inverse.ravel().tolist(), strict=True):
            topics[row] = decoded[which]
    return topics


def retag_records(
    values: Sequence[bytes], roots: NDArray[np.uint64], replay_seqs: NDArray[np.uint64]
) -> list[bytes]:
    """`values` with root and replay_seq replaced (the first 16 bytes); the rest is kept."""
    tags = np.empty(len(values), dtype=TAGS)
    tags["root"] = roots
    tags["replay_seq"] = replay_seqs
    prefixes: list[bytes] = tags.view(f"V{TAGS.itemsize}").tolist()
    return list(map(operator.add, prefixes, [value[TAGS.itemsize :] for value in values]))
