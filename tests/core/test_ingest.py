"""Records of a source that cannot replay, taken in by a receiver (ftlayer.core.ingest,
INGEST): stored with their bytes and queued for their source's reader, partitioned by
its replay partitioner; they complete and leave the store as any record; an upstream's
second copy of a record is dropped within the window, also after a restart; a restart
loses none that was not read yet."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from manual_clock import Clock

from ftlayer.acking.ids import new_ids
from ftlayer.client import FTClient
from ftlayer.core import FTLayer
from ftlayer.errors import ConfigError
from ftlayer.persistence import LmdbStorage, PersistenceStorage
from ftlayer.records import RecordBatch
from ftlayer.registration import SourceRegistration
from ftlayer.server import FTServer

SOURCE = 12
PARTITIONS = 3
STREAM = "jetstream:ORDERS"


def _received(ids: list[int], stream: str = STREAM) -> RecordBatch:
    """What a receiver sends: each message's bytes, its key's hash, its identity."""
    n = len(ids)
    return RecordBatch.build(
        new_ids(n),
        [b"message-%d" % i for i in ids],
        source_ids=SOURCE,
        key_hashes=np.array(ids, dtype=np.int64) * 7919,
        topics=stream,
        partitions=0,
        offsets=np.array(ids, dtype=np.int64),
    )


def _layer(
    storage: PersistenceStorage, wall: Clock | None = None, window_s: float = 600
) -> FTLayer:
    ft = FTLayer(
        storage,
        timeout_s=30,
        clock=Clock(),
        wall_clock=wall or Clock(1000.0),
        ingest_window_s=window_s,
    )
    ft.register_source(SourceRegistration(SOURCE, "kafka-hash", PARTITIONS))
    return ft


def _queued(ft: FTLayer, lo: int = 0) -> dict[int, list[bytes]]:
    """Per target partition, the payloads a reader of each partition fetches."""
    hi = ft.replay_cursor_of(SOURCE)
    found: dict[int, list[bytes]] = {}
    for p in range(PARTITIONS):
        fetched = ft.fetch_replay(lo, hi, source_id=SOURCE, partition=p)
        found[p] = [bytes(x) for x in fetched.records.payloads]
    return found


def test_ingested_records_are_queued_by_partition_and_leave_the_store_once_complete(
    tmp_path: Path,
) -> None:
    storage = LmdbStorage(tmp_path / "ft")
    ft = _layer(storage)
    result = ft.ingest(_received(list(range(30))))
    assert (result.taken, result.duplicates) == (30, 0)
    stats = ft.current_stats()
    assert (stats.ingested, stats.pending, len(storage)) == (30, 30, 30)
    queued = _queued(ft)
    assert all(queued.values()), queued  # every partition has some
    assert sorted(p for ps in queued.values() for p in ps) == sorted(
        b"message-%d" % i for i in range(30)
    )
    # Routed as the kafka-hash partitioner routes their keys: each to one partition.
    hi = ft.replay_cursor_of(SOURCE)
    for p in range(PARTITIONS):
        fetched = ft.fetch_replay(0, hi, source_id=SOURCE, partition=p)
        hashes = fetched.records.key_hashes
        assert ((hashes & 0x7FFFFFFF) % PARTITIONS == p).all() or not len(hashes)
        # A reader's step acks them (its trees complete): they leave the store.
        ft.xor(fetched.records.roots, np.zeros(len(fetched.records), np.uint64))
    ft.flush_deletes()
    assert ft.current_stats().pending == 0 and len(storage) == 0
    storage.close()


def test_an_ingest_is_one_write_and_its_records_are_queued_after_a_restart(
    tmp_path: Path,
) -> None:
    """The records, their identities and their replay seqs go in one commit (the
    receiver's acknowledgement waits for it): a restart finds them queued as they were."""
    storage = LmdbStorage(tmp_path / "ft")
    ft = _layer(storage)
    commits = storage.commits
    assert ft.ingest(_received(list(range(12)))).taken == 12
    assert storage.commits == commits + 1
    before = _queued(ft)
    storage.close()
    storage = LmdbStorage(tmp_path / "ft")
    ft = _layer(storage)
    assert _queued(ft) == before
    storage.close()


def test_a_second_copy_is_dropped_within_the_window_also_after_a_restart(
    tmp_path: Path,
) -> None:
    wall = Clock(1000.0)
    storage = LmdbStorage(tmp_path / "ft")
    ft = _layer(storage, wall)
    assert ft.ingest(_received([1, 2, 3])).taken == 3
    # Redelivered (the receiver died before its ack), with one new message, and one
    # message twice in one request: only the new one is taken, once.
    again = ft.ingest(_received([2, 3, 4, 4]))
    assert (again.taken, again.duplicates) == (1, 3)
    # Another upstream's identities are its own.
    assert ft.ingest(_received([1], stream="jetstream:PAYMENTS")).taken == 1
    # A message without an identity (-1) is always taken.
    anonymous = _received([9, 9])
    anonymous = RecordBatch.build(
        anonymous.roots,
        list(anonymous.payloads),
        source_ids=SOURCE,
        key_hashes=anonymous.key_hashes,
        topics="http",
        partitions=0,
        offsets=np.full(2, -1),
    )
    assert ft.ingest(anonymous).taken == 2
    storage.close()
    # After a restart: the same identities are still dropped, and the records not read
    # yet are queued again, none lost.
    storage = LmdbStorage(tmp_path / "ft")
    ft = _layer(storage, wall)
    assert ft.ingest(_received([1, 4])).taken == 0
    queued = sorted(p for ps in _queued(ft).values() for p in ps)
    ingested = [b"message-1", b"message-2", b"message-3", b"message-4", b"message-1"]
    assert queued == sorted([*ingested, b"message-9", b"message-9"])
    assert ft.current_stats().ingest_duplicates == 2
    # Past the window an identity is new again, and the old entries leave the store.
    wall.now += 601
    assert ft.ingest(_received([1])).taken == 1
    assert len(storage.meta_keys("ingest/")) == 1
    storage.close()


def test_records_by_reference_or_of_an_unknown_source_are_refused(tmp_path: Path) -> None:
    storage = LmdbStorage(tmp_path / "ft")
    ft = _layer(storage)
    by_reference = RecordBatch.build(
        new_ids(1), [b""], source_ids=SOURCE, topics="t", offsets=[1], references=True
    )
    with pytest.raises(ConfigError, match="carry their bytes"):
        ft.ingest(by_reference)
    unknown = RecordBatch.build(new_ids(1), [b"x"], source_ids=99, topics="t", offsets=[1])
    with pytest.raises(ConfigError, match="source 99 is not registered"):
        ft.ingest(unknown)
    assert len(storage) == 0 and ft.current_stats().ingested == 0
    with pytest.raises(ConfigError, match="ingest_window_s"):
        FTLayer(storage, ingest_window_s=0)
    storage.close()


def test_ingest_over_the_wire(tmp_path: Path) -> None:
    with FTServer(tmp_path / "data") as server, FTClient("{}:{}".format(*server.address)) as c:
        c.register_source(SourceRegistration(SOURCE, "kafka-hash", PARTITIONS))
        assert c.ingest(_received([5, 6, 7])) == 3
        assert c.ingest(_received([6, 7, 8])) == 1
        status = c.status()
        assert (status.ingested, status.ingest_duplicates, status.pending) == (4, 2, 4)
        replays = c.fetch_replay(0, status.replay_cursor_of([SOURCE]), source_id=SOURCE)
        assert sorted(bytes(p) for p in replays.records.payloads) == [
            b"message-5",
            b"message-6",
            b"message-7",
            b"message-8",
        ]
