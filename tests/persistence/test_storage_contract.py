"""The PersistenceStorage contract, checked on every storage (LMDB and memory alike)."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from storage_backends import Backend

from ftlayer.errors import ConfigError, StorageError
from ftlayer.persistence.base import MAX_TOPIC_BYTES, PersistenceStorage, RecordNotStored
from ftlayer.records import RecordBatch

# One stored record as the model sees it.
Row = tuple[int, int, int, bool, int, str, int, int, bytes]
# (root, replay_seq, source_id, has_key, key_hash, topic, partition, offset, payload)

U64_MAX = 2**64 - 1
I64 = (-(2**63), 2**63 - 1)
I32 = (-(2**31), 2**31 - 1)


def make_batch(rows: list[Row]) -> RecordBatch:
    """A batch holding `rows` (their replay_seq is not part of a batch and is ignored)."""
    return RecordBatch(
        roots=np.array([r[0] for r in rows], dtype=np.uint64),
        source_ids=np.array([r[2] for r in rows], dtype=np.uint32),
        has_key=np.array([r[3] for r in rows], dtype=np.bool_),
        key_hashes=np.array([r[4] for r in rows], dtype=np.int64),
        topics=[r[5] for r in rows],
        partitions=np.array([r[6] for r in rows], dtype=np.int32),
        offsets=np.array([r[7] for r in rows], dtype=np.int64),
        payloads=[r[8] for r in rows],
    )


def rows_of(batch: RecordBatch, replay_seqs: Any = None) -> list[Row]:
    replays = [0] * len(batch) if replay_seqs is None else [int(x) for x in replay_seqs]
    return [
        (
            int(root),
            replay,
            int(source),
            bool(has_key),
            int(key_hash),
            topic,
            int(part),
            int(off),
            bytes(payload),
        )
        for root, replay, source, has_key, key_hash, topic, part, off, payload in zip(
            batch.roots,
            replays,
            batch.source_ids,
            batch.has_key,
            batch.key_hashes,
            batch.topics,
            batch.partitions,
            batch.offsets,
            batch.payloads,
            strict=True,
        )
    ]


def scanned(storage: PersistenceStorage, batch_size: int = 65536) -> dict[int, Row]:
    """Everything `scan` returns, checking chunk sizes and seq order on the way."""
    result: dict[int, Row] = {}
    last = 0
    for seqs, batch, replay_seqs in storage.scan(batch_size):
        assert seqs.dtype == np.uint64 and replay_seqs.dtype == np.uint64
        assert 0 < len(seqs) <= batch_size
        assert len(batch) == len(seqs) == len(replay_seqs)
        for seq, row in zip(seqs.tolist(), rows_of(batch, replay_seqs), strict=True):
            assert seq > last, "scan must return seqs in increasing order"
            last = seq
            result[seq] = row
    return result


def sample_rows() -> list[Row]:
    return [
        (11, 0, 1, True, -5, "orders", 0, 100, b"first"),
        (12, 0, 1, False, 0, "payments", 3, 7, b""),
        (13, 0, 2, True, 2**63 - 1, "orders", 2**31 - 1, 2**63 - 1, b"\x00\xff" * 50),
    ]


# --- put / get -------------------------------------------------------------------


def test_put_hands_out_consecutive_seqs_from_one(storage: PersistenceStorage) -> None:
    assert storage.next_seq == 1
    first = storage.put(make_batch(sample_rows()))
    second = storage.put(make_batch(sample_rows()[:1]))
    assert first.dtype == np.uint64
    assert first.tolist() == [1, 2, 3]
    assert second.tolist() == [4]
    assert storage.next_seq == 5
    assert len(storage) == 4


def test_get_returns_exactly_what_was_put(storage: PersistenceStorage) -> None:
    rows = sample_rows()
    seqs = storage.put(make_batch(rows))
    assert rows_of(storage.get(seqs)) == rows
    assert rows_of(storage.get(seqs[::-1])) == rows[::-1]
    assert rows_of(storage.get([2, 2])) == [rows[1], rows[1]]
    assert len(storage.get([])) == 0


def test_payload_bytes_and_unicode_topics_round_trip(storage: PersistenceStorage) -> None:
    payloads = [b"", b"\x00", bytes(range(256)), b"\x00" * 3, b"x" * (2 * 1024 * 1024)]
    topics = ["", "événements", "🚀-topic", "a\x00b", "é" * (MAX_TOPIC_BYTES // 2)]
    rows: list[Row] = [
        (U64_MAX, 0, 2**32 - 1, True, I64[0], topic, I32[0], I64[0], payload)
        for topic, payload in zip(topics, payloads, strict=True)
    ]
    seqs = storage.put(make_batch(rows))
    assert rows_of(storage.get(seqs)) == rows
    assert list(scanned(storage).values()) == rows


def test_topic_of_exactly_the_maximum_length_is_stored(storage: PersistenceStorage) -> None:
    row: Row = (1, 0, 0, False, 0, "t" * MAX_TOPIC_BYTES, 0, 0, b"p")
    seqs = storage.put(make_batch([row]))
    assert rows_of(storage.get(seqs)) == [row]


def test_many_topics_in_one_batch_keep_batch_order(storage: PersistenceStorage) -> None:
    rows: list[Row] = [
        (i + 1, 0, i % 3, bool(i % 2), -i, f"topic-{i % 7}", i % 5, i, f"payload {i}".encode())
        for i in range(200)
    ]
    seqs = storage.put(make_batch(rows))
    assert rows_of(storage.get(seqs)) == rows


def test_empty_batch_stores_nothing_and_uses_no_seq(storage: PersistenceStorage) -> None:
    seqs = storage.put(RecordBatch.empty())
    assert seqs.dtype == np.uint64 and len(seqs) == 0
    assert storage.next_seq == 1 and len(storage) == 0


def test_over_long_topic_stores_nothing(backend: Backend) -> None:
    storage = backend.open()
    storage.put(make_batch(sample_rows()))
    too_long: Row = (1, 0, 0, False, 0, "é" * (MAX_TOPIC_BYTES // 2 + 1), 0, 0, b"p")
    with pytest.raises(StorageError, match="65535"):
        storage.put(make_batch([sample_rows()[0], too_long]))
    assert len(storage) == 3 and storage.next_seq == 4
    storage = backend.reopen(storage)
    assert len(storage) == 3 and storage.next_seq == 4


def test_payload_that_is_not_bytes_stores_nothing(storage: PersistenceStorage) -> None:
    batch = RecordBatch.build([1, 2], [b"fine", "text"])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        storage.put(batch)
    assert len(storage) == 0 and storage.next_seq == 1


def test_get_of_a_missing_seq_names_it(storage: PersistenceStorage) -> None:
    storage.put(make_batch(sample_rows()))
    with pytest.raises(RecordNotStored, match=r"seq 7 is not stored") as raised:
        storage.get([1, 7])
    assert raised.value.missing.tolist() == [7]
    assert isinstance(raised.value, StorageError) and isinstance(raised.value, KeyError)
    with pytest.raises(RecordNotStored, match=r"seqs 0, 9 are not stored"):
        storage.get([0, 2, 9])


@pytest.mark.parametrize("bad", [[-1], [1.5], [[1, 2]]])
def test_malformed_seqs_are_a_config_error(storage: PersistenceStorage, bad: Any) -> None:
    storage.put(make_batch(sample_rows()))
    with pytest.raises(ConfigError):
        storage.get(bad)
    with pytest.raises(ConfigError):
        storage.delete(bad)
    assert len(storage) == 3


# --- delete ----------------------------------------------------------------------


def test_delete_returns_how_many_were_stored(storage: PersistenceStorage) -> None:
    storage.put(make_batch(sample_rows()))
    assert storage.delete(np.array([3, 1, 1, 99, 0], dtype=np.uint64)) == 2
    assert storage.delete([1, 3]) == 0
    assert storage.delete([]) == 0
    assert list(scanned(storage)) == [2]
    assert len(storage) == 1


def test_seqs_are_never_reused_after_everything_was_deleted(backend: Backend) -> None:
    storage = backend.open()
    storage.put(make_batch(sample_rows()))
    storage.delete([1, 2, 3])
    assert storage.put(make_batch(sample_rows()[:1])).tolist() == [4]
    storage.delete([4])
    storage = backend.reopen(storage)
    assert len(storage) == 0
    assert storage.put(make_batch(sample_rows()[:1])).tolist() == [5]


# --- set_roots -------------------------------------------------------------------


def test_set_roots_retags_and_keeps_everything_else(storage: PersistenceStorage) -> None:
    rows = sample_rows()
    storage.put(make_batch(rows))
    storage.set_roots(np.array([3, 1], dtype=np.uint64), [U64_MAX, 77], [5, 6])
    expected = {
        1: (77, 6, *rows[0][2:]),
        2: rows[1],
        3: (U64_MAX, 5, *rows[2][2:]),
    }
    assert scanned(storage) == expected
    assert storage.get([1, 3]).roots.tolist() == [77, U64_MAX]


def test_a_put_with_replay_seqs_stores_them_as_a_retag_would(backend: Backend) -> None:
    """put(..., replay_seqs) leaves what a put and a set_roots of the same roots and
    replay seqs leave, in one write, after a reopen too; mixed: 0 is not queued."""
    rows = sample_rows()
    storage = backend.open()
    storage.put(make_batch(rows), replay_seqs=np.array([9, 0, U64_MAX], dtype=np.uint64))
    expected = {
        1: (rows[0][0], 9, *rows[0][2:]),
        2: rows[1],
        3: (rows[2][0], U64_MAX, *rows[2][2:]),
    }
    assert scanned(storage) == expected
    assert scanned(backend.reopen(storage)) == expected


def test_a_put_with_a_replay_seq_count_unlike_its_records_stores_nothing(
    storage: PersistenceStorage,
) -> None:
    with pytest.raises(ConfigError, match="one replay seq per record: got 2 for 3 records"):
        storage.put(make_batch(sample_rows()), replay_seqs=np.array([1, 2], dtype=np.uint64))
    assert scanned(storage) == {}
    assert storage.put(make_batch(sample_rows()[:1])).tolist() == [1]


def test_set_roots_with_a_seq_given_twice_keeps_the_last(storage: PersistenceStorage) -> None:
    storage.put(make_batch(sample_rows()))
    storage.set_roots([2, 2], [40, 41], [1, 2])
    assert scanned(storage)[2][:2] == (41, 2)


def test_set_roots_with_a_missing_seq_writes_nothing(backend: Backend) -> None:
    storage = backend.open()
    storage.put(make_batch(sample_rows()))
    before = scanned(storage)
    with pytest.raises(RecordNotStored, match="seq 8 is not stored"):
        storage.set_roots([1, 8], [50, 51], [1, 2])
    assert scanned(storage) == before
    assert scanned(backend.reopen(storage)) == before


def test_set_roots_with_columns_of_different_lengths_is_a_config_error(
    storage: PersistenceStorage,
) -> None:
    storage.put(make_batch(sample_rows()))
    before = scanned(storage)
    with pytest.raises(ConfigError, match="2 seqs, 1 roots, 2 replay seqs"):
        storage.set_roots([1, 2], [5], [1, 2])
    assert scanned(storage) == before


# --- scan ------------------------------------------------------------------------


def test_scan_returns_every_record_in_seq_order_in_chunks(storage: PersistenceStorage) -> None:
    rows: list[Row] = [(i + 1, 0, 0, False, 0, "t", 0, i, bytes([i])) for i in range(10)]
    storage.put(make_batch(rows[:4]))
    storage.put(make_batch(rows[4:]))
    storage.delete([2, 5])
    storage.set_roots([9], [99], [3])
    chunks = [seqs.tolist() for seqs, _, _ in storage.scan(batch_size=3)]
    assert chunks == [[1, 3, 4], [6, 7, 8], [9, 10]]
    result = scanned(storage, batch_size=3)
    assert result[9] == (99, 3, *rows[8][2:])
    assert result[1] == rows[0]


def test_scan_of_an_empty_storage_yields_nothing(storage: PersistenceStorage) -> None:
    assert list(storage.scan()) == []


def test_scan_rejects_a_batch_size_below_one_at_once(storage: PersistenceStorage) -> None:
    with pytest.raises(ConfigError, match="batch_size"):
        storage.scan(batch_size=0)


def test_writing_while_scanning_is_allowed(storage: PersistenceStorage) -> None:
    storage.put(make_batch(sample_rows() * 2))
    seen = []
    for seqs, _, _ in storage.scan(batch_size=2):
        seen.extend(seqs.tolist())
        storage.delete(seqs)
    assert seen == [1, 2, 3, 4, 5, 6]
    assert len(storage) == 0


# --- meta ------------------------------------------------------------------------


def test_meta_values_are_stored_apart_from_records(storage: PersistenceStorage) -> None:
    assert storage.get_meta("checkpoint") is None
    storage.put_meta("checkpoint", b"\x00state-1")
    storage.put_meta("checkpoint", b"\x00state-2")
    storage.put_meta("é" * 255, b"")
    assert storage.get_meta("checkpoint") == b"\x00state-2"
    assert storage.get_meta("é" * 255) == b""
    assert len(storage) == 0 and list(storage.scan()) == []


def test_meta_keys_list_by_prefix_in_order_and_delete_removes_one(
    storage: PersistenceStorage,
) -> None:
    for key in ["cp/b/2", "cp/a/10", "sources", "cp/a/09", "cp"]:
        storage.put_meta(key, key.encode())
    assert storage.meta_keys("cp/") == ["cp/a/09", "cp/a/10", "cp/b/2"]
    assert storage.meta_keys("cp/a/") == ["cp/a/09", "cp/a/10"]
    assert storage.meta_keys("nothing") == []
    assert storage.meta_keys() == ["cp", "cp/a/09", "cp/a/10", "cp/b/2", "sources"]
    assert storage.delete_meta("cp/a/09") is True
    assert storage.delete_meta("cp/a/09") is False
    assert storage.get_meta("cp/a/09") is None
    assert storage.meta_keys("cp/") == ["cp/a/10", "cp/b/2"]
    assert storage.get_meta("cp/a/10") == b"cp/a/10"


def test_update_meta_puts_and_deletes_together_or_not_at_all(
    storage: PersistenceStorage,
) -> None:
    storage.put_meta("old", b"1")
    storage.update_meta({"new/a": b"a", "new/b": b"b"}, ["old", "never-there"])
    assert storage.meta_keys() == ["new/a", "new/b"]
    bad: Any = {"new/c": b"c", "new/d": "text"}
    with pytest.raises(ConfigError, match="bytes"):
        storage.update_meta(bad, ["new/a"])
    with pytest.raises(ConfigError, match="meta key"):
        storage.update_meta({"new/e": b"e"}, [""])
    assert storage.meta_keys() == ["new/a", "new/b"]


def test_a_put_stores_its_meta_entries_with_its_records_or_neither(
    storage: PersistenceStorage,
) -> None:
    def history(seqs: Any) -> dict[str, bytes]:
        return {f"retry/{seq:016x}": b"attempt %d" % seq for seq in seqs.tolist()}

    seqs = storage.put(make_batch(sample_rows()), history)
    assert storage.meta_keys("retry/") == [f"retry/{seq:016x}" for seq in seqs.tolist()]
    assert storage.get_meta(f"retry/{int(seqs[1]):016x}") == b"attempt %d" % seqs[1]
    # A bad entry: neither the records nor any entry is stored, and no seq is used.
    with pytest.raises(ConfigError, match="meta key"):
        storage.put(make_batch(sample_rows()), lambda seqs: {"ok/1": b"1", "": b"bad"})
    assert (len(storage), storage.next_seq) == (3, 4)
    assert storage.meta_keys("ok/") == []
    assert rows_of(storage.get(seqs)) == sample_rows()


@pytest.mark.parametrize("key", ["", "k" * 512, "é" * 256, b"bytes-key"])
def test_bad_meta_keys_are_a_config_error(storage: PersistenceStorage, key: Any) -> None:
    with pytest.raises(ConfigError, match="meta key"):
        storage.put_meta(key, b"v")
    with pytest.raises(ConfigError, match="meta key"):
        storage.get_meta(key)


def test_meta_value_must_be_bytes(storage: PersistenceStorage) -> None:
    text: Any = "text"
    with pytest.raises(ConfigError, match="bytes"):
        storage.put_meta("k", text)
    assert storage.get_meta("k") is None


# --- size, sync, close -----------------------------------------------------------


def test_size_grows_with_the_records(storage: PersistenceStorage) -> None:
    empty = storage.size_bytes()
    rows: list[Row] = [(i + 1, 0, 0, False, 0, "t", 0, i, b"x" * 1000) for i in range(2000)]
    storage.put(make_batch(rows))
    storage.sync()
    assert storage.size_bytes() >= empty + 2000 * 1000


def test_a_closed_storage_refuses_every_use(storage: PersistenceStorage) -> None:
    storage.put(make_batch(sample_rows()))
    storage.close()
    storage.close()
    assert storage.closed
    uses: list[Callable[[], object]] = [
        lambda: storage.put(make_batch(sample_rows())),
        lambda: storage.delete([1]),
        lambda: storage.get([1]),
        lambda: storage.set_roots([1], [2], [3]),
        lambda: storage.scan(),
        lambda: storage.get_meta("k"),
        lambda: storage.put_meta("k", b"v"),
        lambda: len(storage),
        lambda: storage.size_bytes(),
        lambda: storage.sync(),
        lambda: storage.next_seq,
    ]
    for use in uses:
        with pytest.raises(StorageError, match="closed"):
            use()


def test_closing_in_the_middle_of_a_scan_stops_it(storage: PersistenceStorage) -> None:
    storage.put(make_batch(sample_rows()))
    chunks = storage.scan(batch_size=1)
    next(chunks)
    storage.close()
    with pytest.raises(StorageError, match="closed"):
        next(chunks)


def test_context_manager_closes(backend: Backend) -> None:
    with backend.open() as storage:
        storage.put(make_batch(sample_rows()))
    assert storage.closed


# --- records stored by reference, and their bytes filled in ------------------------


def _referenced(n: int, offset: int = 100) -> RecordBatch:
    return RecordBatch.build(
        np.arange(1, n + 1, dtype=np.uint64),
        [b""] * n,
        source_ids=4,
        key_hashes=np.arange(n) * 7,
        topics="orders",
        partitions=2,
        offsets=np.arange(offset, offset + n),
        references=True,
    )


def test_a_record_stored_by_reference_comes_back_as_one_until_filled(backend: Backend) -> None:
    storage = backend.open()
    plain = storage.put(make_batch(sample_rows()[:1]))
    seqs = storage.put(_referenced(3))
    got = storage.get(seqs)
    assert got.reference_mask.tolist() == [True, True, True]
    assert list(got.payloads) == [b"", b"", b""]
    assert got.has_key.tolist() == [True, True, True]  # the key flag kept apart
    assert storage.get(plain).references is None
    # Filling a plain record, a missing seq or a record twice does nothing.
    assert storage.fill([int(plain[0]), 999, int(seqs[1])], [b"no", b"no", b"second"]) == 1
    assert storage.fill([int(seqs[1])], [b"again"]) == 0
    storage = backend.reopen(storage)
    got = storage.get(seqs)
    assert got.reference_mask.tolist() == [True, False, True]
    assert list(got.payloads) == [b"", b"second", b""]
    assert got.offsets.tolist() == [100, 101, 102]
    assert bytes(storage.get(plain).payloads[0]) == b"first"
    scanned_rows = scanned(storage)
    assert scanned_rows[int(seqs[1])][-1] == b"second"
    assert storage.filled == 1


def test_fill_records_returns_what_get_returns_after_it(backend: Backend) -> None:
    storage = backend.open()
    seqs = storage.put(_referenced(3))
    keys = (np.array([7, 8, 9], dtype=np.int64), np.array([True, False, True]))
    given = [int(seqs[2]), 999, int(seqs[0]), int(seqs[2])]  # a missing seq, one twice
    done, records = storage.fill_records(
        given, [b"c", b"x", b"a", b"c2"], (keys[0][[2, 0, 0, 2]], keys[1][[2, 0, 0, 2]])
    )
    assert done.tolist() == [int(seqs[2]), int(seqs[0])]
    assert rows_of(records) == rows_of(storage.get(done))
    assert [bytes(p) for p in records.payloads] == [b"c", b"a"]
    assert records.references is None
    # Filled before: nothing to do, nothing returned.
    assert len(storage.fill_records(seqs[:1], [b"again"])[0]) == 0


def test_staged_fill_records_read_at_once_and_last_once_flushed(backend: Backend) -> None:
    storage = backend.open()
    seqs = storage.put(_referenced(2))
    commits = storage.commits
    done, _ = storage.fill_records(seqs, [b"a", b"b"], staged=True)
    assert done.tolist() == seqs.tolist() and storage.commits == commits  # no write yet
    assert [bytes(p) for p in storage.get(seqs).payloads] == [b"a", b"b"]
    storage.flush_staged()
    storage = backend.reopen(storage)
    assert [bytes(p) for p in storage.get(seqs).payloads] == [b"a", b"b"]
    assert storage.filled == 2


@pytest.mark.parametrize("staged", [False, True])
def test_deleting_a_filled_record_deletes_its_bytes(backend: Backend, staged: bool) -> None:
    storage = backend.open()
    seqs = storage.put(_referenced(2))
    storage.fill(seqs, [b"a", b"b"])
    if staged:
        storage.stage_deletes(seqs[:1])
        storage.flush_staged()
    else:
        storage.delete(seqs[:1])
    assert storage.filled == 1
    storage = backend.reopen(storage)
    assert storage.filled == 1
    assert bytes(storage.get(seqs[1:]).payloads[0]) == b"b"
    # One fill, one value: it goes with its last record.
    assert storage.meta_keys("fillb/") == [f"fillb/{int(seqs[0]):020d}"]
    assert storage.drop_stale_fills() == 0
    storage.delete(seqs[1:])
    assert (storage.meta_keys("fillb/"), storage.filled) == ([], 0)


def test_the_bytes_of_a_fill_go_in_the_transaction_of_its_last_records_delete(
    backend: Backend,
) -> None:
    storage = backend.open()
    seqs = storage.put(_referenced(3))
    storage.fill(seqs[:2], [b"a", b"b"])  # one value for two records
    storage.fill(seqs[2:], [b"c"])  # a value of its own
    commits = storage.commits
    storage.delete(seqs[[0, 2]])  # the second value's last record, not the first's
    # Records and emptied value: one write (an fsync each where storage is durable).
    assert storage.commits == commits + backend.durable
    assert storage.meta_keys("fillb/") == [f"fillb/{int(seqs[0]):020d}"]
    storage.delete(np.concatenate([seqs[1:2], seqs[1:2]]))  # a seq given twice
    assert storage.commits == commits + 2 * backend.durable
    storage = backend.reopen(storage)
    assert (storage.meta_keys("fillb/"), storage.filled, len(storage)) == ([], 0, 0)
    assert storage.drop_stale_fills() == 0


def test_stale_bytes_of_a_deleted_record_are_dropped(backend: Backend) -> None:
    if not backend.durable:
        pytest.skip("a memory storage does not outlive the crash that leaves these")
    storage = backend.open()
    seqs = storage.put(_referenced(2))
    storage.fill(seqs, [b"a", b"b"])
    # What a crash between a record's delete and its bytes' delete leaves behind.
    # (The one-record value of an earlier version's store.)
    storage.put_meta(f"fill/{10**6:020d}", b"\x00orphan")
    storage = backend.reopen(storage)
    assert storage.filled == 2  # only records still stored count
    assert storage.drop_stale_fills() == 1
    assert storage.meta_keys("fill/") == [] and storage.filled == 2
    assert storage.drop_stale_fills() == 0


def test_the_bytes_of_an_earlier_versions_fill_are_read_and_deleted(backend: Backend) -> None:
    """Stores of earlier versions hold one value per filled record (`fill/<seq>`)."""
    if not backend.durable:
        pytest.skip("a memory storage holds no earlier version's values")
    storage = backend.open()
    seqs = storage.put(_referenced(2))
    key = struct.pack("<cqB", b"\x01", -7, 1)
    storage.put_meta(f"fill/{int(seqs[0]):020d}", key + b"old bytes")
    storage = backend.reopen(storage)
    got = storage.get(seqs)
    assert [bytes(p) for p in got.payloads] == [b"old bytes", b""]
    assert got.reference_mask.tolist() == [False, True] and storage.filled == 1
    storage.delete(seqs[:1])
    assert storage.meta_keys("fill/") == [] and storage.filled == 0


def test_fill_with_columns_of_different_lengths_is_a_config_error(
    storage: PersistenceStorage,
) -> None:
    seqs = storage.put(_referenced(2))
    with pytest.raises(ConfigError, match="one payload per seq"):
        storage.fill(seqs, [b"a"])


# --- the model property ----------------------------------------------------------

rows_strategy = st.tuples(
    st.integers(0, U64_MAX),
    st.just(0),
    st.integers(0, 2**32 - 1),
    st.booleans(),
    st.integers(*I64),
    st.one_of(st.sampled_from(["", "orders", "événements", "🚀"]), st.text(max_size=6)),
    st.integers(*I32),
    st.integers(*I64),
    st.binary(max_size=40),
)
OPERATIONS = ["put", "delete", "delete_all", "set_roots", "reopen"]


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data(), batch_size=st.integers(1, 5))
def test_storage_behaves_like_a_dict_of_seqs(
    backend: Backend, data: st.DataObject, batch_size: int
) -> None:
    """Any sequence of put/delete/set_roots/reopen leaves exactly what a dict model holds.

    Seqs for delete and set_roots are drawn half from the stored ones and half at random
    (stored or not), so both the effect and the all-or-nothing error path are exercised.
    """
    model: dict[int, Row] = {}
    next_seq = 1
    storage = backend.open()
    try:
        for _ in range(data.draw(st.integers(0, 14), label="steps")):
            name = data.draw(st.sampled_from(OPERATIONS), label="operation")
            any_seq = st.integers(0, next_seq + 1)
            some_seq = st.one_of(st.sampled_from(sorted(model)), any_seq) if model else any_seq
            if name == "put":
                rows = data.draw(st.lists(rows_strategy, max_size=8), label="rows")
                seqs = storage.put(make_batch(rows)).tolist()
                assert seqs == list(range(next_seq, next_seq + len(rows)))
                model.update(zip(seqs, rows, strict=True))
                next_seq += len(rows)
            elif name in ("delete", "delete_all"):
                if name == "delete":
                    seqs = data.draw(st.lists(some_seq, max_size=6), label="seqs")
                else:
                    seqs = list(model)
                assert storage.delete(seqs) == len(set(seqs) & model.keys())
                for seq in seqs:
                    model.pop(seq, None)
            elif name == "set_roots":
                seqs = data.draw(st.lists(some_seq, max_size=5), label="seqs")
                roots = data.draw(
                    st.lists(st.integers(0, U64_MAX), min_size=len(seqs), max_size=len(seqs))
                )
                replays = data.draw(
                    st.lists(st.integers(0, U64_MAX), min_size=len(seqs), max_size=len(seqs))
                )
                if all(seq in model for seq in seqs):
                    storage.set_roots(seqs, roots, replays)
                    for seq, root, replay in zip(seqs, roots, replays, strict=True):
                        model[seq] = (root, replay, *model[seq][2:])
                else:
                    with pytest.raises(RecordNotStored):
                        storage.set_roots(seqs, roots, replays)
            else:
                storage = backend.reopen(storage)
            assert len(storage) == len(model)
            assert storage.next_seq == next_seq
        assert scanned(storage, batch_size) == model
        # get returns batches, which carry no replay seq
        assert rows_of(storage.get(sorted(model))) == [
            (row[0], 0, *row[2:]) for _, row in sorted(model.items())
        ]
    finally:
        storage.close()
