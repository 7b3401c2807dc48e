"""LmdbStorage shared by threads (issue 15): puts at once share one transaction (group
commit) and each gets its own seqs or its own error; reads never wait for a write
transaction; map growth waits for the reads running."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest

from ftlayer.errors import StorageError
from ftlayer.persistence.lmdb_storage import LmdbStorage
from ftlayer.records import RecordBatch


def batch_of(n: int, *, start: int = 0, payload_size: int = 40) -> RecordBatch:
    return RecordBatch.build(
        np.arange(start + 2, start + n + 2, dtype=np.uint64),
        [i.to_bytes(4, "big") * (payload_size // 4) for i in range(start, start + n)],
        topics="orders",
        partitions=np.arange(start, start + n, dtype=np.int32) % 4,
    )


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(0.005)


def _last_txn(storage: LmdbStorage) -> int:
    return int(storage._live_env().info()["last_txnid"])


class Puts:
    """Puts started in threads of their own; their results (seqs or the error)."""

    def __init__(self, storage: LmdbStorage, batches: list[RecordBatch]) -> None:
        self.results: list[Any] = [None] * len(batches)
        self.threads = [
            threading.Thread(target=self._put, args=(storage, i, batch))
            for i, batch in enumerate(batches)
        ]
        for thread in self.threads:
            thread.start()

    def _put(self, storage: LmdbStorage, i: int, batch: RecordBatch) -> None:
        try:
            self.results[i] = storage.put(batch)
        except BaseException as exc:  # compared by the test
            self.results[i] = exc

    def join(self) -> list[Any]:
        for thread in self.threads:
            thread.join(60)
            assert not thread.is_alive()
        return self.results


def test_puts_at_once_share_one_transaction_and_each_gets_its_own_seqs(tmp_path: Path) -> None:
    with LmdbStorage(tmp_path / "store") as storage:
        storage.put(batch_of(10))
        batches = [batch_of(1_000, start=10 + 1_000 * k) for k in range(4)]
        before = _last_txn(storage)
        with storage._lock:  # a write transaction of someone else runs meanwhile
            puts = Puts(storage, batches)
            wait_until(lambda: len(storage._queued) == 4, "four puts queued")
        results = puts.join()
        assert _last_txn(storage) == before + 1  # one commit (and one fsync) for all
        assert sorted(int(seqs[0]) for seqs in results) == [11, 1_011, 2_011, 3_011]
        for batch, seqs in zip(batches, results, strict=True):
            assert seqs.tolist() == list(range(int(seqs[0]), int(seqs[0]) + 1_000))
            assert storage.get(seqs).payloads == batch.payloads
        assert len(storage) == 4_010 and storage.next_seq == 4_011
    with LmdbStorage(tmp_path / "store") as storage:  # durable: the next_seq too
        assert len(storage) == 4_010 and storage.next_seq == 4_011


def test_a_failed_group_commit_fails_every_put_and_stores_nothing_of_them(
    tmp_path: Path,
) -> None:
    with LmdbStorage(tmp_path / "store") as storage:
        storage.put(batch_of(2))
        with storage._lock:
            puts = Puts(storage, [batch_of(5, start=2 + 5 * k) for k in range(3)])
            wait_until(lambda: len(storage._queued) == 3, "three puts queued")
            storage._next_seq = 1  # as if another writer had taken the seqs
        results = puts.join()
        assert all(isinstance(r, StorageError) for r in results), results
        assert all("already taken" in str(r) for r in results)
        assert len(storage) == 2
        storage._next_seq = 3
        assert storage.put(batch_of(5, start=2)).tolist() == [3, 4, 5, 6, 7]


def test_reads_see_the_last_commit_while_a_write_transaction_is_open(tmp_path: Path) -> None:
    with LmdbStorage(tmp_path / "store") as storage:
        seqs = storage.put(batch_of(100))
        storage.put_meta("k", b"v1")
        inside = threading.Event()
        finish = threading.Event()

        def slow(txn: lmdb.Transaction[bytes]) -> None:
            storage._delete_in(txn, seqs[-1:])  # the last record, in this transaction
            inside.set()
            assert finish.wait(60)

        writer = threading.Thread(target=lambda: storage._write(slow, db=None))
        writer.start()
        try:
            assert inside.wait(30)
            # The write transaction is open (and holds the write lock): reads go on.
            assert len(storage) == 100
            assert storage.get(seqs[:1]).roots.tolist() == [2]
            assert storage.get_meta("k") == b"v1"
            assert sum(len(b) for _s, b, _r in storage.scan()) == 100
        finally:
            finish.set()
            writer.join(60)
        assert len(storage) == 99  # then the delete committed


def test_threads_putting_deleting_and_reading_while_the_map_grows_lose_nothing(
    tmp_path: Path,
) -> None:
    """Three threads put, one deletes what they stored, one reads all along, from a
    map of 64 KiB that has to grow many times (each resize waits for the reads).

    Every put and every delete is one batch of 500 records in one transaction, so a
    read sees a whole number of batches, and no fewer (more) than were stored before
    (by the end of) the read: puts and deletes that returned, give or take those that
    were committing while it ran (three puts, one delete)."""
    per_batch = 500
    with LmdbStorage(tmp_path / "store", map_size=64 * 1024) as storage:
        stored: list[np.ndarray] = []
        stored_lock = threading.Lock()
        returned = {"put": 0, "deleted": 0}  # records of the puts (deletes) that returned
        counts_seen: list[int] = []
        errors: list[BaseException] = []
        putting = 3
        done = threading.Event()

        def put(k: int) -> None:
            try:
                for i in range(20):
                    start = (k * 20 + i) * per_batch
                    seqs = storage.put(batch_of(per_batch, start=start, payload_size=200))
                    with stored_lock:
                        stored.append(seqs)
                        returned["put"] += len(seqs)
            except BaseException as exc:
                errors.append(exc)

        def delete() -> None:
            try:
                while not done.is_set() or stored:
                    with stored_lock:
                        seqs = stored.pop(0) if len(stored) > 10 or done.is_set() else None
                    if seqs is None:
                        time.sleep(0.001)
                        continue
                    assert storage.delete(seqs) == len(seqs)
                    with stored_lock:
                        returned["deleted"] += len(seqs)
            except BaseException as exc:
                errors.append(exc)

        def read() -> None:
            try:
                while not done.is_set():
                    with stored_lock:
                        seqs = stored[-1] if stored else None
                        put_before, deleted_before = returned["put"], returned["deleted"]
                    count = len(storage)
                    with stored_lock:
                        put_after, deleted_after = returned["put"], returned["deleted"]
                    counts_seen.append(count)
                    assert count % per_batch == 0, f"{count} records: part of a transaction"
                    assert put_before - deleted_after - per_batch <= count, count
                    assert count <= put_after + putting * per_batch - deleted_before, count
                    if seqs is not None:
                        try:
                            batch = storage.get(seqs[:5])
                        except StorageError:
                            continue  # deleted meanwhile
                        assert len(batch) == 5
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=put, args=(k,)) for k in range(putting)]
        helpers = [threading.Thread(target=delete), threading.Thread(target=read)]
        for thread in threads + helpers:
            thread.start()
        for thread in threads:
            thread.join(120)
        done.set()
        for thread in helpers:
            thread.join(120)
        assert not errors, errors
        assert max(counts_seen) > 0  # the reads ran while records were stored
        assert len(storage) == 0
        assert storage.next_seq == 1 + putting * 20 * per_batch
        assert storage.map_size > 64 * 1024


def test_closing_waits_for_a_read_of_another_thread_and_then_refuses_reads(
    tmp_path: Path,
) -> None:
    storage = LmdbStorage(tmp_path / "store")
    storage.put(batch_of(10))
    reading, finish = threading.Event(), threading.Event()
    read_chunks: list[int] = []

    def read() -> None:
        with storage._reading() as env, env.begin() as txn:  # a long read (a copy, say)
            reading.set()
            assert finish.wait(60)
            read_chunks.append(txn.stat(storage._chunks.records_db)["entries"])

    reader = threading.Thread(target=read)
    reader.start()
    assert reading.wait(30)
    closer = threading.Thread(target=storage.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive()  # the environment stays open while the read runs
    finish.set()
    reader.join(30)
    closer.join(30)
    assert not closer.is_alive() and storage.closed
    assert read_chunks == [1]  # the read saw the store whole (the 10 records: one chunk)
    with pytest.raises(StorageError, match="closed"):
        storage.get([1])
    with pytest.raises(StorageError, match="closed"):
        len(storage)
