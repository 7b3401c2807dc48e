"""A batch sink's acks held under its key until its write is done (ftlayer.core.sinkholds):
the trees complete only when the sink settles, fail with its error when the write
failed, survive a kill of the FT layer, and a sink that never settles leaves nothing
behind once its trees have timed out."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ftlayer.acking.ids import new_ids
from ftlayer.causes import Cause, FailKind
from ftlayer.core import FTLayer
from ftlayer.core.journal import Journal
from ftlayer.core.sinkholds import SINK_KEY_BIT
from ftlayer.errors import ConfigError
from ftlayer.persistence import LmdbStorage, MemoryStorage
from ftlayer.records import RecordBatch

KEY = SINK_KEY_BIT | 0x1234
WRITE_FAILED = Cause(FailKind.SINK, "ft_foreach_batch", "OSError: the warehouse is down")


def _records(n: int, first: int = 0) -> RecordBatch:
    return RecordBatch.build(
        new_ids(n),
        [b"r%d" % i for i in range(first, first + n)],
        topics="events",
        partitions=0,
        offsets=np.arange(first, first + n),
    )


def _emitted(ft: FTLayer, n: int, first: int = 0) -> tuple[RecordBatch, np.ndarray]:
    """n records persisted, each emitted with its id (what a step's output carries
    after a hand-over): the sink's ack of a row is (root, id)."""
    batch = _records(n, first)
    ids = new_ids(n)
    ft.persist(batch, ids)
    return batch, ids


def test_held_acks_complete_the_trees_only_when_the_sink_settles() -> None:
    ft = FTLayer(MemoryStorage(), timeout_s=60)
    batch, ids = _emitted(ft, 10)
    assert ft.sink_hold(KEY, batch.roots[:6], ids[:6]) == 6  # one task's rows
    assert ft.sink_hold(KEY, batch.roots[6:], ids[6:]) == 4  # another's
    assert len(ft) == 10 and ft.current_stats().completed == 0  # nothing XOR-ed yet
    assert ft.sink_settle(KEY) == 10
    assert len(ft) == 0 and ft.current_stats().completed == 10
    assert ft.open_holds == 0 and len(ft.storage) == 0


def test_a_failed_write_fails_every_held_root_with_its_error() -> None:
    ft = FTLayer(MemoryStorage(), timeout_s=60)
    batch, ids = _emitted(ft, 5)
    ft.sink_hold(KEY, batch.roots, ids)
    assert ft.sink_settle(KEY, WRITE_FAILED) == 5
    stats = ft.current_stats()
    assert stats.failed["explicit"] == 5 and stats.completed == 0
    replay = ft.fetch_replay(0, ft.replay_cursor)
    assert sorted(replay.records.payloads) == sorted(batch.payloads)
    seqs = ft.acker.lookup("seq", replay.records.roots)[1]
    records = [ft.retry_record(int(seq)) for seq in seqs.tolist()]
    assert [r.causes[-1][1] for r in records if r is not None] == [WRITE_FAILED] * 5


def test_a_straggler_after_the_settle_is_applied_as_the_settle_was() -> None:
    ft = FTLayer(MemoryStorage(), timeout_s=60)
    batch, ids = _emitted(ft, 4)
    ft.sink_hold(KEY, batch.roots[:2], ids[:2])
    ft.sink_settle(KEY)
    assert ft.sink_hold(KEY, batch.roots[2:], ids[2:]) == 2  # a task that ended late
    assert len(ft) == 0 and ft.current_stats().completed == 4
    failed_key = KEY + 1
    other, other_ids = _emitted(ft, 3, first=4)
    ft.sink_settle(failed_key, WRITE_FAILED)
    ft.sink_hold(failed_key, other.roots, other_ids)
    assert ft.current_stats().failed["explicit"] == 3 and ft.open_holds == 0


def test_a_root_taken_over_by_a_re_read_is_dropped_at_the_settle() -> None:
    """Two actions in the sink's function read the batch twice: the re-read takes
    over the first read's roots, whose held acks then name no tree."""
    ft = FTLayer(MemoryStorage(), timeout_s=60)
    first, first_ids = _emitted(ft, 3)
    ft.sink_hold(KEY, first.roots, first_ids)
    again = RecordBatch.build(
        new_ids(3), first.payloads, topics="events", partitions=0, offsets=np.arange(3)
    )
    again_ids = new_ids(3)
    ft.persist(again, again_ids)  # the same records read again
    ft.sink_hold(KEY, again.roots, again_ids)
    assert ft.sink_settle(KEY) == 3
    stats = ft.current_stats()
    assert len(ft) == 0 and stats.unknown_events == 0 and stats.failed["timeout"] == 0


def test_held_acks_survive_a_kill_of_the_ft_layer(tmp_path: Path) -> None:
    def start() -> tuple[LmdbStorage, FTLayer]:
        storage = LmdbStorage(tmp_path / "db")
        journal = Journal(tmp_path / "journal")
        return storage, FTLayer(storage, timeout_s=60, defer_deletes=True, journal=journal)

    storage, ft = start()
    batch, ids = _emitted(ft, 6)
    ft.sink_hold(KEY, batch.roots[:3], ids[:3])
    ft.write_journal_base()  # holds in the base
    ft.sink_hold(KEY, batch.roots[3:], ids[3:])  # and in the segment after it
    assert ft.journal is not None
    ft.journal.close()
    storage.close()  # killed
    storage, ft = start()
    assert ft.current_stats().failed["recovery"] == 0 and ft.open_holds == 6
    assert ft.sink_settle(KEY) == 6
    assert len(ft) == 0
    storage.close()


def test_the_holds_of_a_sink_that_never_settles_go_once_their_trees_timed_out() -> None:
    now = [0.0]
    ft = FTLayer(MemoryStorage(), timeout_s=10, clock=lambda: now[0])
    batch, ids = _emitted(ft, 5)
    ft.sink_hold(KEY, batch.roots, ids)  # and the driver dies
    while ft.current_stats().failed["timeout"] < 5:  # replayed within the timeout bound
        assert ft.open_holds == 5  # until then a slow write still settles them
        now[0] += 0.5
        ft.tick()
    assert now[0] <= 15.5
    for _ in range(10):  # and at a rotation after that, the holds go
        now[0] += 0.5
        ft.tick()
    assert ft.open_holds == 0


@pytest.mark.parametrize("key", [0, 7, SINK_KEY_BIT - 1, 1 << 64, -1])
def test_a_key_that_could_name_a_source_is_refused(key: int) -> None:
    ft = FTLayer(MemoryStorage(), timeout_s=60)
    with pytest.raises(ConfigError, match="top bit set"):
        ft.sink_hold(key, [1], [2])
    with pytest.raises(ConfigError, match="top bit set"):
        ft.sink_settle(key)
