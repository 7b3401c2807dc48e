"""LMDB's chunked layout (issue 15): a persisted batch is one LMDB value, and the store
still behaves record by record, exactly like the memory storage.

- A hypothesis property drives LmdbStorage (with chunks small enough that batches split
  and deletes compact them) and MemoryStorage, the model, through the same random
  operations; every answer and every state must agree, and the chunks keep the space
  rule of the module docstring.
- A write that fails midway leaves nothing of itself, also after a reopen.
- A store written by the previous layout (one LMDB value per record) opens with every
  record intact.
- A few records kept from many batches do not keep the batches' bytes on disk.

What a killed process leaves behind is tested in test_lmdb_crash.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_storage_contract import Row, make_batch, rows_of, rows_strategy

from ftlayer.errors import StorageError
from ftlayer.persistence.base import (
    PersistenceStorage,
    RecordNotStored,
    encode_chunk,
    encode_records,
    retag_records,
)
from ftlayer.persistence.lmdb_layout import ChunkHead
from ftlayer.persistence.lmdb_storage import FORMAT_MARKER, LmdbStorage
from ftlayer.persistence.lmdb_writes import OVERRIDES_KEPT
from ftlayer.persistence.memory import MemoryStorage
from ftlayer.records import Payloads, RecordBatch


def stored(storage: PersistenceStorage, batch_size: int = 65536) -> dict[int, Row]:
    """Every stored record (scan), by seq, with its replay seq."""
    found: dict[int, Row] = {}
    for seqs, batch, replay_seqs in storage.scan(batch_size):
        found.update(zip(seqs.tolist(), rows_of(batch, replay_seqs), strict=True))
    return found


def got(storage: PersistenceStorage, seqs: list[int]) -> list[Row] | tuple[str, list[int]]:
    """What `get` answers: the rows, or the seqs it names as not stored."""
    try:
        return rows_of(storage.get(seqs))
    except RecordNotStored as exc:
        return ("not stored", exc.missing.tolist())


def check_chunks(storage: LmdbStorage, overrides_kept: int = OVERRIDES_KEPT) -> None:
    """The layout's invariants: every chunk holds a stored record, the counts in its
    state are right, and the compaction rules hold (at most three deleted bytes per
    stored byte; override entries for at most a quarter of the stored records, or at
    most `overrides_kept`, the store's)."""
    chunks = storage._chunks

    def heads(txn: lmdb.Transaction[bytes]) -> list[ChunkHead]:
        cursor = txn.cursor(db=chunks.index_db)
        return [chunks.head_at(txn, cursor) for _ in cursor.iternext(values=False)]

    found = storage._read(heads, db=None)
    for head in found:
        starts, ends = head.bounds(np.flatnonzero(~head.deleted))
        assert head.live == int((~head.deleted).sum()) > 0
        assert head.live_bytes == int((ends - starts).sum())
        assert 4 * head.live_bytes >= head.size
        assert len(head.overrides) <= max(head.live // 4, overrides_kept)
        assert not head.deleted[head.overrides["index"]].any()
    assert sum(head.live for head in found) == len(storage)


OPERATIONS = [
    "put",
    "delete",
    "delete_most_of_a_batch",
    "delete_all",
    "set_roots",
    "get",
    "scan",
    "stage_deletes_and_put",
    "reopen",
]


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    chunk_bytes=st.integers(60, 2000),
    batch_size=st.integers(1, 7),
    overrides_kept=st.integers(0, 3),
)
def test_chunks_behave_like_the_memory_storage(
    tmp_path_factory: pytest.TempPathFactory,
    data: st.DataObject,
    chunk_bytes: int,
    batch_size: int,
    overrides_kept: int,
) -> None:
    """Any sequence of operations gives the same answers and leaves the same records in
    LMDB (chunks of at most `chunk_bytes`, so batches split, and a few deletes make a
    chunk sparse enough to compact; a few retags, one with many overrides) as in the
    memory storage."""
    path = tmp_path_factory.mktemp("chunks") / "store"
    model = MemoryStorage()
    storage = LmdbStorage(path, chunk_bytes=chunk_bytes, overrides_kept=overrides_kept)
    batches: list[list[int]] = []
    try:
        for _ in range(data.draw(st.integers(1, 16), label="steps")):
            name = data.draw(st.sampled_from(OPERATIONS), label="operation")
            held = sorted(stored(model))
            any_seq = st.integers(0, model.next_seq + 1)
            some_seq = st.one_of(st.sampled_from(held), any_seq) if held else any_seq
            if name in ("put", "stage_deletes_and_put"):
                # (An empty put writes nothing, so staged deletes would wait on.)
                least = 1 if name == "stage_deletes_and_put" else 0
                rows = data.draw(st.lists(rows_strategy, min_size=least, max_size=30), label="rows")
                if name == "stage_deletes_and_put":
                    # Seqs handed out already, as the persistence layer stages (a seq
                    # staged before it is handed out would go with the put's record).
                    handed_out = st.integers(0, model.next_seq - 1)
                    staged = st.one_of(st.sampled_from(held), handed_out) if held else handed_out
                    gone = data.draw(st.lists(staged, max_size=6), label="staged")
                    storage.stage_deletes(gone)
                    model.delete(gone)
                seqs = storage.put(make_batch(rows)).tolist()
                assert seqs == model.put(make_batch(rows)).tolist()
                batches.append(seqs)
            elif name == "delete":
                seqs = data.draw(st.lists(some_seq, max_size=8), label="seqs")
                assert storage.delete(seqs) == model.delete(seqs)
            elif name == "delete_most_of_a_batch":
                if batches:
                    batch = data.draw(st.sampled_from(batches), label="batch")
                    keep = data.draw(st.integers(0, 3), label="keep")
                    gone = batch[keep:] if data.draw(st.booleans()) else batch[: len(batch) - keep]
                    assert storage.delete(gone) == model.delete(gone)
            elif name == "delete_all":
                assert storage.delete(held) == model.delete(held) == len(held)
            elif name == "set_roots":
                # Half the time stored seqs only, so retags take effect.
                retag = st.sampled_from(held) if held and data.draw(st.booleans()) else some_seq
                seqs = data.draw(st.lists(retag, max_size=6), label="seqs")
                # Replay seqs above 0 (a record is put with 0), so a retag always shows.
                tags = st.lists(st.integers(1, 2**64 - 1), min_size=len(seqs), max_size=len(seqs))
                roots, replays = data.draw(tags, label="roots"), data.draw(tags, label="replays")
                try:
                    model.set_roots(seqs, roots, replays)
                except RecordNotStored as exc:
                    with pytest.raises(RecordNotStored) as raised:
                        storage.set_roots(seqs, roots, replays)
                    assert raised.value.missing.tolist() == exc.missing.tolist()
                else:
                    storage.set_roots(seqs, roots, replays)
            elif name == "get":
                seqs = data.draw(st.lists(some_seq, max_size=8), label="seqs")
                assert got(storage, seqs) == got(model, seqs)
            elif name == "scan":
                assert stored(storage, batch_size) == stored(model, batch_size)
            else:
                storage.close()
                storage = LmdbStorage(path, chunk_bytes=chunk_bytes, overrides_kept=overrides_kept)
            assert len(storage) == len(model)
            assert storage.next_seq == model.next_seq
            check_chunks(storage, overrides_kept)
        assert stored(storage, batch_size) == stored(model)
        storage.close()
        storage = LmdbStorage(path, chunk_bytes=chunk_bytes, overrides_kept=overrides_kept)
        assert stored(storage, batch_size) == stored(model)
        assert storage.next_seq == model.next_seq
    finally:
        storage.close()


def sample_batch(n: int, *, start: int = 0, payload: int = 100) -> RecordBatch:
    return RecordBatch.build(
        np.arange(start + 1, start + n + 1, dtype=np.uint64),
        [i.to_bytes(4, "big") * (payload // 4) for i in range(start, start + n)],
        topics=["orders", "payments"][start % 2],
        offsets=np.arange(start, start + n),
    )


# --- all or nothing ---------------------------------------------------------------


def test_a_write_that_fails_midway_leaves_nothing_of_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delete over many chunks fails at its last one (a compaction that raises), as
    does a put carrying the same deletes staged: the chunks they changed before are as
    they were, for this store and after a reopen. The staged deletes stay staged, and
    closing the store carries them out."""
    path = tmp_path / "store"
    with LmdbStorage(path, chunk_bytes=4096) as storage:
        for start in range(0, 400, 100):
            storage.put(sample_batch(100, start=start))
        storage.set_roots([5, 150], [77, 78], [1, 2])
        before = stored(storage)
        # Every record but the last two: the first chunks go whole, the last one keeps
        # two records and compacts, and compaction fails.
        gone = np.arange(1, 399, dtype=np.uint64)

        def fail(*_: object) -> None:
            raise StorageError("disk said no")

        monkeypatch.setattr(LmdbStorage, "_compact", fail)
        with pytest.raises(StorageError, match="disk said no"):
            storage.delete(gone)
        assert stored(storage) == before and len(storage) == 400
    with LmdbStorage(path, chunk_bytes=4096) as storage:
        assert stored(storage) == before and len(storage) == 400
        storage.stage_deletes(gone)
        with pytest.raises(StorageError, match="disk said no"):
            storage.put(sample_batch(1, start=400))
        assert stored(storage) == before and storage.next_seq == 401
        assert storage.staged_deletes == len(gone)
        monkeypatch.undo()
    with LmdbStorage(path, chunk_bytes=4096) as storage:
        assert stored(storage) == {seq: before[seq] for seq in (399, 400)}
        assert len(storage) == 2 and storage.next_seq == 401
        check_chunks(storage)


# --- the previous layout ----------------------------------------------------------


def write_v1_store(path: Path, batches: list[RecordBatch]) -> dict[int, Row]:
    """A store as the previous layout wrote it: one value per record (encode_records)
    under its seq, 8 bytes big-endian, in `records`; some deleted, some retagged.
    Returns what it holds, by seq."""
    env = lmdb.open(str(path), max_dbs=3)
    expected: dict[int, Row] = {}
    with env.begin(write=True) as txn:
        records = env.open_db(b"records", txn=txn)
        meta = env.open_db(b"meta", txn=txn)
        store = env.open_db(b"ftlayer", txn=txn)
        txn.put(b"format", b"ftlayer-lmdb-v1", db=store)
        seq = 1
        for batch in batches:
            values = encode_records(batch)
            seqs = list(range(seq, seq + len(values)))
            seq += len(values)
            # Every third record was deleted, every fifth retagged for replay.
            kept = [i for i in range(len(values)) if i % 3]
            retag = [i for i in kept if i % 5 == 0]
            for i, value in zip(
                retag,
                retag_records(
                    [values[i] for i in retag],
                    np.array([1000 + seqs[i] for i in retag], dtype=np.uint64),
                    np.array([seqs[i] for i in retag], dtype=np.uint64),
                ),
                strict=True,
            ):
                values[i] = value
            for i, row in enumerate(rows_of(batch)):
                if i in kept:
                    replay = seqs[i] if i in retag else 0
                    root = 1000 + seqs[i] if i in retag else row[0]
                    expected[seqs[i]] = (root, replay, *row[2:])
                    txn.put(seqs[i].to_bytes(8, "big"), values[i], db=records)
        txn.put(b"next_seq", (seq + 5).to_bytes(8, "big"), db=store)
        txn.put(b"sources", b"{}", db=meta)
    env.close()
    return expected


def test_a_store_of_the_previous_layout_opens_with_its_records(tmp_path: Path) -> None:
    path = tmp_path / "store"
    batches = [sample_batch(40, start=40 * i, payload=8 * (i + 1)) for i in range(6)]
    expected = write_v1_store(path, batches)
    with LmdbStorage(path, chunk_bytes=1500) as storage:
        assert stored(storage, 7) == expected
        assert len(storage) == len(expected)
        assert storage.next_seq == 246  # the old high-water mark
        assert storage.get_meta("sources") == b"{}"
        some = sorted(expected)[::7]
        assert got(storage, some) == [(r[0], 0, *r[2:]) for r in map(expected.get, some)]
        with pytest.raises(RecordNotStored, match="seq 4 is not stored"):
            storage.get([4])  # deleted before the conversion: stays deleted
        check_chunks(storage)
        # It works on as a store of this layout.
        assert storage.put(sample_batch(3)).tolist() == [246, 247, 248]
        assert storage.delete(sorted(expected)[:50]) == 50
    env = lmdb.open(str(path), max_dbs=6, readonly=True, lock=False)
    with env.begin() as txn:
        assert txn.get(b"format", db=env.open_db(b"ftlayer", txn=txn, create=False)) == (
            FORMAT_MARKER
        )
        with pytest.raises(lmdb.NotFoundError):
            env.open_db(b"records", txn=txn, create=False)  # converted, then dropped
    env.close()
    with LmdbStorage(path) as storage:
        assert len(storage) == len(expected) - 50 + 3
        assert {seq: expected[seq] for seq in sorted(expected)[50:]}.items() <= (
            stored(storage).items()
        )


def test_an_empty_store_of_the_previous_layout_opens(tmp_path: Path) -> None:
    path = tmp_path / "store"
    write_v1_store(path, [])
    with LmdbStorage(path) as storage:
        assert len(storage) == 0 and storage.next_seq == 6
        assert storage.put(sample_batch(2)).tolist() == [6, 7]


# --- space ------------------------------------------------------------------------


def test_a_few_records_kept_from_many_batches_do_not_keep_the_batches(tmp_path: Path) -> None:
    """Forty 1 MiB batches, each with one record kept (a dead letter, a slow tree) and
    the rest completed: compaction leaves the kept records in small chunks, so the
    store's file stays a few MiB instead of holding forty."""
    with LmdbStorage(tmp_path / "store") as storage:
        kept = []
        for i in range(40):
            seqs = storage.put(sample_batch(8_000, start=8_000 * i, payload=120))
            kept.append(int(seqs[i * 97]))
            assert storage.delete(np.delete(seqs, i * 97)) == 7_999
        assert len(storage) == 40
        assert storage.size_bytes() < 8 * 2**20, storage.size_bytes()
        assert storage.get(kept).payloads == [
            (8_000 * i + i * 97).to_bytes(4, "big") * 30 for i in range(40)
        ]
        check_chunks(storage)


# No deadline: the first example loads the chunk layout's numba kernel (about a second
# on a busy machine); speed is the benchmarks' business.
@settings(deadline=None)
@given(
    st.lists(st.binary(max_size=40), max_size=60),
    st.lists(st.sampled_from(["in", "other-topic"]), min_size=60, max_size=60),
    st.booleans(),
)
def test_a_batch_whose_payloads_are_one_buffer_is_stored_byte_for_byte_the_same(
    payloads: list[bytes], topics: list[str], one_topic: bool
) -> None:
    # A PERSIST frame brings the payloads as one buffer (Payloads): the chunk encoder's
    # numpy path for it writes what the per-record path writes.
    n = len(payloads)
    names = ["in"] * n if one_topic else topics[:n]

    def batch(p: Any) -> RecordBatch:
        return RecordBatch.build(
            np.arange(2, 2 + n, dtype=np.uint64),
            p,
            source_ids=np.arange(n) % 3,
            key_hashes=np.arange(n) * 7,
            topics=names,
            partitions=np.arange(n) % 4,
            offsets=np.arange(n) * 11,
        )

    blob, ends = encode_chunk(batch(Payloads.of(payloads)))
    want_blob, want_ends = encode_chunk(batch(list(payloads)))
    assert blob == want_blob and ends.tolist() == want_ends.tolist()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=4),
    st.integers(0, 2**40),
    st.integers(0, 2**32),
)
def test_a_delete_in_any_order_removes_exactly_its_records(
    tmp_path_factory: pytest.TempPathFactory, spreads: list[int], base: int, seed: int
) -> None:
    """Seqs completed in the acker's order, some twice, close together or spread out
    (a mask of their span, or a sort): the records named go, the others stay."""
    from ftlayer.persistence.lmdb_layout import sorted_distinct

    rng = np.random.default_rng(seed)
    for spread in spreads:  # the helper alone, over spans dense and sparse
        n = int(rng.integers(1, 5_000))
        seqs = np.uint64(base) + rng.integers(0, n * (1 + 3 * spread), n).astype(np.uint64)
        assert sorted_distinct(seqs).tolist() == np.unique(seqs).tolist()
    with LmdbStorage(tmp_path_factory.mktemp("store") / "store") as storage:
        seqs = np.concatenate([storage.put(sample_batch(2_000, start=2_000 * i)) for i in range(3)])
        gone = rng.permutation(seqs[rng.random(len(seqs)) < 0.7])
        twice = np.concatenate([gone, gone[: len(gone) // 5]])
        assert storage.delete(twice) == len(gone)
        kept = np.setdiff1d(seqs, gone)
        assert len(storage) == len(kept)
        assert len(storage.get(kept)) == len(kept)  # each one still readable
        assert not storage.contains(gone).any()
        check_chunks(storage)
