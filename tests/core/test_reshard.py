"""A savepoint of an FT layer of two shards (one part per shard), restored into three
shards, into one and into two, on real LMDB stores (ftlayer.checkpoint.reshard).

What a user notices: FT layers opened on the restored data dirs, each in its place,
replay exactly the records that were incomplete in either part, each from the shard
its partition maps to at the new count and under a root of that shard; a dead letter
stays a dead letter with its causes, a record waiting for its backoff keeps its retry
count and due time; the new query's starting offsets put each partition where its own
shard's checkpoint was; a savepoint with a part missing is a clear error.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from ftlayer.acking.handlers import Persister
from ftlayer.causes import Cause, FailKind
from ftlayer.checkpoint.reshard import find_parts, part_name, restore_cluster
from ftlayer.checkpoint.savepoint import create_savepoint
from ftlayer.core import FailCause, FTLayer
from ftlayer.errors import ConfigError, StateConflict
from ftlayer.persistence import LmdbStorage
from ftlayer.policy import RetryPolicy
from ftlayer.registration import SourceRegistration
from ftlayer.shards import ShardPlace, claim, partition_shard, shard_of

SOURCE = 5
PARTITIONS = 6
PER_PARTITION = 30
WALL = 1000.0


class Shard:
    """One shard of a two-shard FT layer on LMDB, with records of its own partitions:
    2 in 3 complete, 1 in 6 fails (waits for its backoff), 1 poison record per
    partition is dead-lettered, the rest pending."""

    def __init__(self, path: Path, index: int) -> None:
        self.place = ShardPlace(index, 2)
        self.storage = LmdbStorage(path)
        claim(self.storage, self.place, str(path))
        self.ft = FTLayer(self.storage, shard=self.place, wall_clock=lambda: WALL)
        self.ft.register_source(
            SourceRegistration(SOURCE, "forward", PARTITIONS, retry=RetryPolicy(1, 60_000, 60_000))
        )
        self.partitions = [p for p in range(PARTITIONS) if partition_shard(SOURCE, p, 2) == index]
        self.incomplete: set[bytes] = set()
        self.dead: set[bytes] = set()
        self.waiting: set[bytes] = set()
        for p in self.partitions:
            payloads = [f"p{p}-o{o}".encode() for o in range(PER_PARTITION)]
            anchors = Persister(self.ft, source_id=SOURCE, shards=2).persist(
                payloads, topics="t", partitions=p, offsets=np.arange(PER_PARTITION)
            )
            i = np.arange(PER_PARTITION)
            done = i % 3 != 0
            self.ft.xor(anchors.roots[done], anchors.ids[done])
            failing = i % 6 == 0
            self.ft.fail(anchors.roots[failing], Cause(FailKind.ERROR, "map", "E: once"))
            poison = i == 3
            self.ft.fail(
                anchors.roots[poison], Cause(FailKind.ERROR, "map", "E: poison", final=True)
            )
            named = np.array(payloads, dtype=object)
            self.waiting |= set(named[failing].tolist())
            self.dead |= set(named[poison].tolist())
            self.incomplete |= set(named[~done].tolist()) - self.dead
        # The newest complete checkpoint of query q: this shard's partitions, at 25.
        position = {"kafka": {"t": {str(p): 25 for p in self.partitions}}, "replay": 0}
        self.storage.put_meta(
            "checkpoint/q/7",
            json.dumps({"id": 7, "query": "q", "state": "complete", "position": position}).encode(),
        )


@pytest.fixture
def saved(tmp_path: Path) -> Iterator[tuple[Path, list[Shard]]]:
    shards = [Shard(tmp_path / f"live{i}", i) for i in (0, 1)]
    for shard in shards:
        part = create_savepoint(
            shard.storage, tmp_path / "sp", part_name("cl", shard.place.index, 2)
        )
        assert (part.shard, part.shards) == (shard.place.index, 2)
    yield tmp_path / "sp", shards
    for shard in shards:
        shard.storage.close()


@pytest.mark.parametrize("count", [3, 1, 2])
def test_a_two_shard_savepoint_restores_into_another_number_of_shards(
    saved: tuple[Path, list[Shard]], tmp_path: Path, count: int
) -> None:
    savepoints, shards = saved
    targets = [tmp_path / f"new{j}" for j in range(count)]
    result = restore_cluster(savepoints, "cl", targets)
    assert [s.shard for s in result.shards] == list(range(count))
    assert len(result.parts) == 2
    incomplete = set().union(*(s.incomplete for s in shards))
    dead = set().union(*(s.dead for s in shards))
    waiting = set().union(*(s.waiting for s in shards))
    assert result.stored_records == len(incomplete) + len(dead)
    replayed: list[bytes] = []
    letters: list[bytes] = []
    for j, target in enumerate(targets):
        with LmdbStorage(target) as storage:
            place = ShardPlace(j, count)
            claim(storage, place, str(target))  # as `ftlayer serve --shard j` does
            ft = FTLayer(storage, shard=place, wall_clock=lambda: WALL + 1)
            # Every record is its partition's shard's, at the new count.
            for _seqs, batch, _replay_seqs in storage.scan():
                assert (partition_shard(batch.source_ids, batch.partitions, count) == j).all()
            # A record waiting for its backoff still waits, with its retry count.
            assert ft.waiting_replays == len([w for w in waiting if _owner(w, count) == j])
            queued = ft.fetch_replay(0, ft.replay_cursor, source_id=SOURCE)
            replayed += queued.records.payloads
            assert (shard_of(queued.records.roots, count) == j).all()  # roots of this shard
            stats_failed = ft.stats.failed[FailCause.RECOVERY.value]
            assert stats_failed == len(storage) - ft.dead_letter_count
            found, records = ft.dead_letters()
            letters += records.payloads
            assert all(r.last_cause is not None for _seq, r in found)
            assert all(
                r.last_cause == Cause(FailKind.ERROR, "map", "E: poison", final=True)
                for _seq, r in found
            )
    # The replays now plus those waiting for their backoff are the incomplete records,
    # each once; the dead letters are the poison records, each once.
    assert sorted(letters) == sorted(dead)
    assert len(replayed) == len(set(replayed))
    assert set(replayed) | waiting == incomplete and not set(replayed) & waiting
    # The new query starts each partition where its own shard's checkpoint was.
    assert result.starting_offsets == {"q": {"t": {str(p): 25 for p in range(PARTITIONS)}}}


def _owner(payload: bytes, count: int) -> int:
    partition = int(payload.decode().split("-")[0][1:])
    return int(partition_shard(SOURCE, partition, count))


def test_a_savepoint_with_a_part_missing_or_a_target_in_use_is_refused(
    saved: tuple[Path, list[Shard]], tmp_path: Path
) -> None:
    savepoints, _shards = saved
    (savepoints / part_name("cl", 1, 2) / "manifest.json").rename(tmp_path / "moved.json")
    with pytest.raises(ConfigError, match=r"incomplete .*'cl.shard-1-of-2'.* missing"):
        find_parts(savepoints, "cl")
    (tmp_path / "moved.json").rename(savepoints / part_name("cl", 1, 2) / "manifest.json")
    with pytest.raises(ConfigError, match="restore the whole savepoint"):
        find_parts(savepoints, part_name("cl", 0, 2))
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(StateConflict, match="not an empty directory"):
        restore_cluster(savepoints, "cl", [tmp_path / "a", tmp_path / "busy", tmp_path / "c"])
    assert not (tmp_path / "a").exists()  # nothing written
    with pytest.raises(ConfigError, match="must differ"):
        restore_cluster(savepoints, "cl", [tmp_path / "a", tmp_path / "a"])
