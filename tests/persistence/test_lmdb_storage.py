"""What only the LMDB storage promises: durability, map growth, and never writing elsewhere."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
from pathlib import Path

import lmdb
import numpy as np
import pytest

from ftlayer.errors import ConfigError, NotAnLmdbEnvironment, StorageError
from ftlayer.persistence.lmdb_storage import FORMAT_MARKER, LmdbStorage
from ftlayer.records import RecordBatch


def batch_of(n: int, *, start: int = 0, payload_size: int = 100) -> RecordBatch:
    return RecordBatch.build(
        np.arange(start + 1, start + n + 1, dtype=np.uint64),
        [i.to_bytes(4, "big") * (payload_size // 4) for i in range(start, start + n)],
        topics="orders",
        key_hashes=np.arange(start, start + n, dtype=np.int64),
        partitions=np.arange(start, start + n, dtype=np.int32) % 4,
    )


def snapshot(path: Path) -> dict[str, str]:
    """Every file under `path` and a hash of its bytes: proof that nothing was written."""
    return {
        str(file.relative_to(path)): hashlib.sha256(file.read_bytes()).hexdigest()
        for file in sorted(path.rglob("*"))
        if file.is_file()
    }


# --- durability ------------------------------------------------------------------


def test_records_next_seq_and_meta_survive_a_reopen(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with LmdbStorage(path) as storage:
        seqs = storage.put(batch_of(50))
        storage.delete(seqs[:10])
        storage.set_roots(seqs[10:12], [900, 901], [1, 2])
        storage.put_meta("checkpoint", b"barrier-7")
        expected = [(s.tolist(), b.roots.tolist(), r.tolist()) for s, b, r in storage.scan(16)]
    with LmdbStorage(path) as storage:
        assert len(storage) == 40
        assert storage.next_seq == 51
        assert storage.get_meta("checkpoint") == b"barrier-7"
        assert [(s.tolist(), b.roots.tolist(), r.tolist()) for s, b, r in storage.scan(16)] == (
            expected
        )
        assert storage.get([11]).roots.tolist() == [900]
        assert storage.put(batch_of(1)).tolist() == [51]


def test_a_copy_holds_the_records_and_meta_and_opens_as_a_store(tmp_path: Path) -> None:
    with LmdbStorage(tmp_path / "live") as storage:
        seqs = storage.put(batch_of(50))
        storage.put_meta("sources", b"{}")
        storage.delete(seqs[:10])
        storage.copy_to(tmp_path / "copy")
        storage.put(batch_of(5, start=50))  # after the copy: not in it
        with pytest.raises(StorageError, match="not empty"):
            storage.copy_to(tmp_path / "copy")
    with LmdbStorage(tmp_path / "copy") as copy:
        assert len(copy) == 40
        assert copy.get_meta("sources") == b"{}"
        assert list(copy.get(seqs[10:]).roots) == list(range(11, 51))


def test_a_copy_taken_while_another_thread_writes_is_consistent(tmp_path: Path) -> None:
    """A copy holds one consistent state (whole batches) while another thread keeps
    writing and growing the map (a resize waits for a running copy to end)."""
    with LmdbStorage(tmp_path / "live", map_size=1 << 20) as storage:
        storage.put(batch_of(20_000))
        copies: list[BaseException | None] = []

        def copy() -> None:
            try:
                storage.copy_to(tmp_path / "copy")
                copies.append(None)
            except BaseException as exc:  # reported below
                copies.append(exc)

        thread = threading.Thread(target=copy)
        thread.start()
        for i in range(40):
            storage.put(batch_of(2_000, start=20_000 + 2_000 * i))
        thread.join()
        assert copies == [None]
        assert len(storage) == 100_000
    with LmdbStorage(tmp_path / "copy") as copy_store:
        held = len(copy_store)
        assert 20_000 <= held <= 100_000 and held % 2_000 == 0
        assert copy_store.next_seq == held + 1


_READ_META = """
import sys, lmdb
env = lmdb.open(sys.argv[1], readonly=True, lock=False, max_dbs=3)
with env.begin() as txn:
    value = txn.get(sys.argv[2].encode(), db=env.open_db(b"meta", txn=txn, create=False))
print("-" if value is None else value.decode())
"""


def _committed_meta(path: Path, key: str) -> bytes | None:
    """What another process reads of meta key `key`: the committed value."""
    out = subprocess.run(
        [sys.executable, "-c", _READ_META, str(path), key],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return None if out == "-" else out.encode()


def test_staged_meta_is_readable_at_once_and_commits_with_the_next_write(
    tmp_path: Path,
) -> None:
    path = tmp_path / "store"
    with LmdbStorage(path) as storage:
        storage.put_meta("checkpoint/q/1", b"one")
        storage.stage_meta({"checkpoint/q/2": b"two"}, ["checkpoint/q/1"])
        # Readable at once, through this store ...
        assert storage.get_meta("checkpoint/q/2") == b"two"
        assert storage.get_meta("checkpoint/q/1") is None
        assert storage.meta_keys("checkpoint/") == ["checkpoint/q/2"]
        # ... but not committed: no transaction (and no fsync) of its own.
        assert _committed_meta(path, "checkpoint/q/2") is None
        assert _committed_meta(path, "checkpoint/q/1") == b"one"
        commits = storage.commits
        storage.put(batch_of(3))  # the next write carries it
        assert storage.commits == commits + 1  # one transaction for both
        assert _committed_meta(path, "checkpoint/q/2") == b"two"
        assert _committed_meta(path, "checkpoint/q/1") is None
        storage.stage_meta({"checkpoint/q/3": b"three"})
        storage.flush_staged()
        assert _committed_meta(path, "checkpoint/q/3") == b"three"
        storage.stage_meta({"checkpoint/q/4": b"four"})
    # close() commits what is still staged.
    assert _committed_meta(path, "checkpoint/q/4") == b"four"
    with LmdbStorage(path) as storage:
        assert storage.meta_keys("checkpoint/") == [f"checkpoint/q/{i}" for i in (2, 3, 4)]


def test_a_meta_write_supersedes_what_was_staged_for_its_keys(tmp_path: Path) -> None:
    """A staged value or delete is older than a later write of the same key: it rides
    on no transaction after that write, so it never undoes it."""
    path = tmp_path / "store"
    with LmdbStorage(path) as storage:
        storage.put_meta("range/7", b"old")
        storage.stage_meta({"checkpoint/q/1": b"one"}, ["range/7", "range/8"])
        storage.update_meta({"range/7": b"new"})  # the number given to a new range
        assert _committed_meta(path, "range/7") == b"new"
        assert _committed_meta(path, "checkpoint/q/1") == b"one"  # the others rode on it
        assert storage.get_meta("range/7") == b"new"
        storage.stage_meta({"range/9": b"staged"})
        storage.delete_meta("range/9")
        storage.flush_staged()
        assert storage.get_meta("range/9") is None and _committed_meta(path, "range/9") is None
        storage.put(batch_of(1))  # nothing staged is left to undo anything
        assert _committed_meta(path, "range/7") == b"new"
    with LmdbStorage(path) as storage:
        assert storage.meta_keys("range/") == ["range/7"]


def test_staged_deletes_ride_on_the_next_put(tmp_path: Path) -> None:
    with LmdbStorage(tmp_path / "store") as storage:
        seqs = storage.put(batch_of(10))
        storage.stage_deletes(seqs[:4])
        assert len(storage) == 10  # not deleted yet: no transaction of their own
        storage.flush_staged(older_than_s=3600)  # nothing has waited that long
        assert len(storage) == 10
        more = storage.put(batch_of(5, start=10))
        assert len(storage) == 11  # the put deleted them in its transaction
        assert storage.get(seqs[4:]).roots.tolist() == list(range(5, 11))
        with pytest.raises(StorageError):
            storage.get(seqs[:1])
        storage.stage_deletes(more)
        storage.flush_staged()
        assert len(storage) == 6
        storage.stage_deletes(seqs[4:6])
    with LmdbStorage(tmp_path / "store") as storage:  # close() carried them out
        assert len(storage) == 4


def test_a_failed_write_keeps_staged_meta_staged(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with LmdbStorage(path) as storage:
        storage.put(batch_of(2))
        storage.stage_meta({"checkpoint/q/1": b"one"})
        storage._next_seq = 1  # as if another writer had taken seqs: the next put fails
        with pytest.raises(StorageError, match="already taken"):
            storage.put(batch_of(2))
        assert _committed_meta(path, "checkpoint/q/1") is None
        assert storage.get_meta("checkpoint/q/1") == b"one"
    assert _committed_meta(path, "checkpoint/q/1") == b"one"


def test_next_seq_is_the_last_key_plus_one_if_that_is_higher(tmp_path: Path) -> None:
    """The high-water mark and the last key agree; if they ever did not, no seq is reused."""
    path = tmp_path / "store"
    with LmdbStorage(path) as storage:
        storage.put(batch_of(5))
    env = lmdb.open(str(path), max_dbs=3)
    with env.begin(write=True) as txn:
        txn.put(b"next_seq", (2).to_bytes(8, "big"), db=env.open_db(b"ftlayer", txn=txn))
    env.close()
    with LmdbStorage(path) as storage:
        assert storage.next_seq == 6


def test_sync_false_still_commits_every_operation(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with LmdbStorage(path, sync=False) as storage:
        storage.put(batch_of(10))
        storage.sync()
    with LmdbStorage(path) as storage:
        assert len(storage) == 10


def test_a_missing_directory_is_created(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "store"
    with LmdbStorage(path) as storage:
        storage.put(batch_of(1))
    assert (path / "data.mdb").is_file()


def test_the_same_store_cannot_be_opened_twice_in_one_process(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with LmdbStorage(path), pytest.raises(StorageError, match="already open in this process"):
        LmdbStorage(path)
    with LmdbStorage(path) as storage:  # closing released it
        assert len(storage) == 0


# --- map growth ------------------------------------------------------------------


def test_the_map_grows_until_every_batch_fits(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with LmdbStorage(path, map_size=64 * 1024) as storage:
        for start in range(0, 30_000, 5_000):
            storage.put(batch_of(5_000, start=start))
        storage.put(batch_of(1, payload_size=3 * 1024 * 1024))
        assert len(storage) == 30_001
        all_seqs = np.arange(1, 30_001, dtype=np.uint64)
        storage.set_roots(all_seqs, all_seqs + 6, np.ones(30_000, dtype=np.uint64))
        assert storage.size_bytes() > 6_000_000
        assert storage.map_size >= storage.size_bytes()
    with LmdbStorage(path, map_size=64 * 1024) as storage:
        assert len(storage) == 30_001
        assert storage.get([30_000]).payloads == batch_of(1, start=29_999).payloads
        assert storage.get([30_000]).roots.tolist() == [30_006]
        storage.put(batch_of(100))
        assert storage.delete(np.arange(1, 30_102, dtype=np.uint64)) == 30_101


def test_bad_map_size_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="map_size"):
        LmdbStorage(tmp_path / "store", map_size=0)
    assert not (tmp_path / "store").exists()


# --- never write into something that is not ours --------------------------------


def test_a_directory_with_other_files_is_refused_untouched(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    with pytest.raises(NotAnLmdbEnvironment, match=str(tmp_path)):
        LmdbStorage(tmp_path)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    "garbage",
    [b"", b"not an lmdb file", os.urandom(64 * 1024), b"\x00" * 64 * 1024],
    ids=["empty", "text", "random", "zeros"],
)
def test_a_data_mdb_that_is_not_lmdb_is_refused_untouched(tmp_path: Path, garbage: bytes) -> None:
    (tmp_path / "data.mdb").write_bytes(garbage)
    before = snapshot(tmp_path)
    with pytest.raises(NotAnLmdbEnvironment, match=str(tmp_path)):
        LmdbStorage(tmp_path)
    assert snapshot(tmp_path) == before
    assert not (tmp_path / "lock.mdb").exists()


def test_a_regular_file_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "store"
    path.write_bytes(b"precious")
    with pytest.raises(NotAnLmdbEnvironment, match="is a file"):
        LmdbStorage(path)
    assert path.read_bytes() == b"precious"
    assert snapshot(tmp_path) == {"store": hashlib.sha256(b"precious").hexdigest()}


def test_an_lmdb_environment_of_someone_else_is_refused_untouched(tmp_path: Path) -> None:
    env = lmdb.open(str(tmp_path), max_dbs=2)
    with env.begin(write=True) as txn:
        txn.put(b"their-key", b"their-value")
    env.close()
    before = snapshot(tmp_path)
    with pytest.raises(NotAnLmdbEnvironment, match="not an ftlayer store"):
        LmdbStorage(tmp_path)
    assert snapshot(tmp_path) == before


def test_a_store_of_another_format_version_is_refused_untouched(tmp_path: Path) -> None:
    with LmdbStorage(tmp_path) as storage:
        storage.put(batch_of(3))
    env = lmdb.open(str(tmp_path), max_dbs=3)
    with env.begin(write=True) as txn:
        txn.put(b"format", b"ftlayer-lmdb-v99", db=env.open_db(b"ftlayer", txn=txn))
    env.close()
    before = snapshot(tmp_path)
    with pytest.raises(StorageError, match="ftlayer-lmdb-v99"):
        LmdbStorage(tmp_path)
    assert snapshot(tmp_path) == before


def test_an_empty_lmdb_environment_becomes_a_store(tmp_path: Path) -> None:
    """What a crash between creating the environment and its first commit leaves."""
    lmdb.open(str(tmp_path)).close()
    with LmdbStorage(tmp_path) as storage:
        storage.put(batch_of(2))
    env = lmdb.open(str(tmp_path), max_dbs=3, readonly=True)
    with env.begin() as txn:
        assert txn.get(b"format", db=env.open_db(b"ftlayer", txn=txn, create=False)) == (
            FORMAT_MARKER
        )
    env.close()


def test_an_empty_directory_becomes_a_store(tmp_path: Path) -> None:
    with LmdbStorage(tmp_path) as storage:
        assert len(storage) == 0
    assert sorted(os.listdir(tmp_path)) == ["data.mdb", "lock.mdb"]
