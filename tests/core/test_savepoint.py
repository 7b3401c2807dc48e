"""Savepoints on real LMDB stores on disk: create, list, restore (also rescaled), the
errors a user can run into, and the `ftlayer savepoint` command line.

What a user notices is checked: an FT layer opened on a restored data dir replays
exactly the records that were incomplete when the savepoint was taken, each into the
partition its key group belongs to at the new partition count; nothing a savepoint
holds changes after it was taken; a mistake is a one-line error that changes nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import lmdb
import numpy as np
import pytest

from ftlayer.acking.handlers import Persister
from ftlayer.checkpoint import CheckpointCoordinator, CheckpointMode
from ftlayer.checkpoint.savepoint import (
    RestoreResult,
    create_savepoint,
    create_savepoint_from_data_dir,
    kafka_offsets_of,
    list_savepoints,
    load_savepoint,
    open_stopped_store,
    restore_savepoint,
)
from ftlayer.cli import main
from ftlayer.core import FailCause, FTLayer
from ftlayer.errors import (
    ConfigError,
    NotAnLmdbEnvironment,
    PartitioningError,
    StateConflict,
    StorageError,
)
from ftlayer.partitioners import (
    DEFAULT_MAX_PARALLELISM,
    assign_key_groups,
    kafka_key_hashes,
    key_group_partitions,
)
from ftlayer.persistence import LmdbStorage
from ftlayer.registration import SourceRegistration
from ftlayer.shards import ShardPlace, claim

KEYED = 7  # a key-group source
FORWARD = 9  # a forward source
N = 4  # partitions when the savepoint is taken


def keys_of(n: int, prefix: str = "user") -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(n)]


def key_group_partition(keys: list[bytes], partitions: int) -> list[int]:
    """Where the key-group partitioner puts each key at `partitions` partitions,
    computed from the key bytes (not from anything stored)."""
    hashes, _ = kafka_key_hashes(keys)
    groups = assign_key_groups(hashes, DEFAULT_MAX_PARALLELISM)
    placed: list[int] = key_group_partitions(groups, DEFAULT_MAX_PARALLELISM, partitions).tolist()
    return placed


class Job:
    """An FT layer on LMDB with a key-group and a forward source, some of whose records
    completed, some failed (queued for replay), the rest pending."""

    def __init__(self, path: Path) -> None:
        self.storage = LmdbStorage(path)
        self.ft = FTLayer(self.storage)
        self.ft.register_source(SourceRegistration(KEYED, "key-group", N))
        self.ft.register_source(SourceRegistration(FORWARD, "forward", N))
        self.payload_key: dict[bytes, bytes] = {}
        self.incomplete: set[bytes] = set()

    def run(self, n: int, prefix: str, source_id: int = KEYED) -> None:
        """Persist n keyed records; complete 2 in 3, fail 1 in 6, leave the rest."""
        keys = keys_of(n, prefix)
        payloads = [b"payload-" + k for k in keys]
        hashes, has_key = kafka_key_hashes(keys)
        anchors = Persister(self.ft, source_id=source_id).persist(
            payloads,
            topics="orders",
            partitions=key_group_partition(keys, N),
            offsets=np.arange(n),
            key_hashes=hashes,
            has_key=has_key,
        )
        done = np.arange(n) % 3 != 0
        self.ft.xor(anchors.roots[done], anchors.ids[done])
        self.ft.fail(anchors.roots[np.arange(n) % 6 == 0])
        self.payload_key.update(zip(payloads, keys, strict=True))
        self.incomplete |= {p for p, d in zip(payloads, done.tolist(), strict=True) if not d}

    def close(self) -> None:
        self.storage.close()


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    made = Job(tmp_path / "data")
    made.run(240, "a")
    made.run(60, "f", source_id=FORWARD)
    yield made
    made.close()


def replayed(data_dir: Path) -> tuple[dict[bytes, int], dict[bytes, int]]:
    """Open an FT layer on `data_dir` as `ftlayer serve` does: every stored record is
    recovered and queued. Returns payload -> target partition, per (keyed, forward)."""
    with LmdbStorage(data_dir) as storage:
        ft = FTLayer(storage)
        assert ft.stats.failed[FailCause.RECOVERY.value] == len(storage)
        found = []
        for source_id in (KEYED, FORWARD):
            replay = ft.fetch_replay(0, ft.replay_cursor, source_id=source_id)
            targets = dict(zip(replay.records.payloads, replay.partitions.tolist(), strict=True))
            assert len(targets) == len(replay), "a record was queued twice"
            found.append(targets)
        return found[0], found[1]


def digest(path: Path) -> str:
    return hashlib.sha256((path / "data" / "data.mdb").read_bytes()).hexdigest()


# ---- create, list, restore -----------------------------------------------------------


def test_restore_with_twice_the_partitions_replays_every_stored_record_by_key_group(
    job: Job, tmp_path: Path
) -> None:
    savepoints = tmp_path / "savepoints"
    created = create_savepoint(job.storage, savepoints, "before-rescale")
    stored = len(job.storage)
    assert created.stored_records == stored == len(job.incomplete)
    assert created.sources == {
        str(KEYED): {
            "partitioner": "key-group",
            "num_partitions": N,
            "options": {},
            "timeout_s": None,
        },
        str(FORWARD): {
            "partitioner": "forward",
            "num_partitions": N,
            "options": {},
            "timeout_s": None,
        },
    }
    assert created.next_replay_seq == job.ft.replay_cursor + 1 > 1
    assert created.source_data_dir == str((tmp_path / "data").absolute())
    assert created.positions == {}
    # The job goes on after the savepoint: that must not show in it.
    job.run(120, "b")
    assert len(job.storage) > stored

    result = restore_savepoint(
        savepoints, "before-rescale", tmp_path / "rescaled", partitions=2 * N
    )

    assert result.stored_records == stored
    assert {s["num_partitions"] for s in result.sources.values()} == {2 * N}
    keyed, forward = replayed(tmp_path / "rescaled")
    saved = sorted(p for p in job.incomplete if p.startswith(b"payload-a"))
    assert sorted(keyed) == saved, "records lost or invented"
    expected = dict(
        zip(saved, key_group_partition([job.payload_key[p] for p in saved], 2 * N), strict=True)
    )
    assert keyed == expected
    assert set(keyed.values()) == set(range(2 * N))
    # Doubling splits each old partition in two: a key never moves to another's half.
    at_n = dict(
        zip(saved, key_group_partition([job.payload_key[p] for p in saved], N), strict=True)
    )
    assert all(keyed[p] // 2 == at_n[p] for p in saved)
    # Forward replays each record into the partition it came from.
    assert set(forward) == {p for p in job.incomplete if p.startswith(b"payload-f")}
    # The restore said beforehand how many replays each partition would get.
    assert result.replays == {
        str(KEYED): dict(sorted(Counter(keyed.values()).items())),
        str(FORWARD): dict(sorted(Counter(forward.values()).items())),
    }
    assert result.dead_letters == {} and result.replayed_records == stored


def test_restore_without_partitions_keeps_the_partition_counts(job: Job, tmp_path: Path) -> None:
    store_id = claim(job.storage, ShardPlace(1, 2), "job")  # the saved job's shard
    create_savepoint(job.storage, tmp_path / "sp", "same")
    result = restore_savepoint(tmp_path / "sp", "same", tmp_path / "copy")
    # A new store: any place can claim it, and it gets an id of its own.
    with LmdbStorage(tmp_path / "copy") as restored:
        assert claim(restored, ShardPlace(0, 3), "copy") != store_id
    assert result.partitions is None
    assert {s["num_partitions"] for s in result.sources.values()} == {N}
    keyed, _forward = replayed(tmp_path / "copy")
    saved = sorted(p for p in job.incomplete if p.startswith(b"payload-a"))
    assert keyed == dict(
        zip(saved, key_group_partition([job.payload_key[p] for p in saved], N), strict=True)
    )


def test_savepoints_never_change_or_expire(job: Job, tmp_path: Path) -> None:
    savepoints = tmp_path / "sp"
    first = create_savepoint(job.storage, savepoints, "first")
    before = digest(first.path)
    manifest = (first.path / "manifest.json").read_text()
    job.run(60, "c")
    for i in range(3):
        create_savepoint(job.storage, savepoints)  # default names
        restore_savepoint(savepoints, "first", tmp_path / f"restored-{i}", partitions=N + i)
    listed = list_savepoints(savepoints)
    assert len(listed) == 4 and listed[0].name == "first"
    assert all(s.name.startswith("savepoint-") for s in listed[1:])
    assert [s.stored_records for s in listed] == sorted(s.stored_records for s in listed)
    # Restoring reads the savepoint, never writes it: the same bytes, no lock file.
    assert digest(first.path) == before
    assert (first.path / "manifest.json").read_text() == manifest
    assert sorted(p.name for p in (first.path / "data").iterdir()) == ["data.mdb"]
    assert load_savepoint(savepoints, "first") == first


def test_list_shows_only_whole_savepoints(
    job: Job, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    savepoints = tmp_path / "sp"
    create_savepoint(job.storage, savepoints, "good")
    (savepoints / ".bad.partial-0000" / "data").mkdir(parents=True)  # an interrupted create
    (savepoints / "notes").mkdir()
    (savepoints / "broken").mkdir()
    (savepoints / "broken" / "manifest.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="ftlayer.checkpoint.savepoint"):
        assert [s.name for s in list_savepoints(savepoints)] == ["good"]
    assert "broken" in caplog.text
    with pytest.raises(ConfigError, match="no savepoints directory"):
        list_savepoints(tmp_path / "nowhere")


def barrier(
    checkpoints: CheckpointCoordinator,
    query: str,
    offsets: dict[str, dict[str, int]],
    *,
    done: bool = True,
) -> None:
    """A barrier checkpoint of `query` at `offsets`, as the ftkafka source makes one:
    begun when Spark plans the batch, and completed (unaligned) when it is done."""
    position = {"kafka": offsets, "replay": 0}
    if done:
        checkpoints.done(query, position, [KEYED], CheckpointMode.UNALIGNED)
    else:
        checkpoints.begin(query, position, [KEYED], CheckpointMode.UNALIGNED)
    checkpoints.write_pending()  # the snapshot; a complete checkpoint then completes
    checkpoints.poll()
    checkpoints.write_pending()


def test_positions_are_the_newest_complete_checkpoint_of_each_query(
    job: Job, tmp_path: Path
) -> None:
    checkpoints = CheckpointCoordinator(job.ft)
    barrier(checkpoints, "orders-job", {"orders": {"0": 10, "1": 7}})
    barrier(checkpoints, "orders-job", {"orders": {"0": 40, "1": 9}})
    # Only begun: its batch may never have run, so its position may skip records.
    barrier(checkpoints, "orders-job", {"orders": {"0": 55, "1": 12}}, done=False)
    barrier(checkpoints, "audit", {"audit": {"0": 3}})
    job.storage.put_meta("checkpoint/broken/000000000001", b"\xff not json")
    records = job.storage.meta_keys("checkpoint/")

    created = create_savepoint(job.storage, tmp_path / "sp", "with-positions")
    assert created.positions == {
        "audit": {"kafka": {"audit": {"0": 3}}, "replay": 0},
        "orders-job": {"kafka": {"orders": {"0": 40, "1": 9}}, "replay": 0},
    }
    result = restore_savepoint(tmp_path / "sp", "with-positions", tmp_path / "new", partitions=5)
    # Partitions the savepoint has no position of start at -2 (earliest).
    assert result.starting_offsets == {
        "audit": {"audit": {"0": 3, "1": -2, "2": -2, "3": -2, "4": -2}},
        "orders-job": {"orders": {"0": 40, "1": 9, "2": -2, "3": -2, "4": -2}},
    }
    # The restored job starts a new Spark checkpoint: the old records and snapshots
    # are gone from the restored store, and its FT layer numbers checkpoints afresh.
    assert result.dropped_checkpoint_entries == len(records)
    with LmdbStorage(tmp_path / "new") as restored:
        assert restored.meta_keys("checkpoint/") == restored.meta_keys("snapshot/") == []
        fresh = CheckpointCoordinator(FTLayer(restored))
        assert fresh.last_complete("orders-job") is None
    # The live store keeps them.
    assert job.storage.meta_keys("checkpoint/") == records


def test_positions_go_back_to_the_start_of_every_open_range_of_their_partitions(
    job: Job, tmp_path: Path
) -> None:
    """A tree-mode range stays open past its batch's checkpoint while a record of it is
    pending, and its records' trees live in memory, not in the store a savepoint
    copies: a restored query must read them again, from the range's start."""
    checkpoints = CheckpointCoordinator(job.ft)
    job.ft.register_ranges([(FORWARD, "orders", 0, 30, 50)], tree=True)
    job.ft.register_ranges([(FORWARD, "orders", 1, 2, 9)], tree=True)
    barrier(checkpoints, "orders-job", {"orders": {"0": 50, "1": 9}})
    created = create_savepoint(job.storage, tmp_path / "sp", "with-open-ranges")
    assert created.positions == {
        "orders-job": {"kafka": {"orders": {"0": 30, "1": 2}}, "replay": 0}
    }
    result = restore_savepoint(tmp_path / "sp", "with-open-ranges", tmp_path / "new")
    assert result.starting_offsets == {"orders-job": {"orders": {"0": 30, "1": 2}}}
    with LmdbStorage(tmp_path / "new") as restored:  # not replayed on top of the re-read
        assert restored.meta_keys("range/") == []


def test_kafka_offsets_of_takes_the_shapes_a_position_can_have() -> None:
    assert kafka_offsets_of({"kafka": {"t": {"0": 5}}, "replay": 1}) == {"t": {0: 5}}
    assert kafka_offsets_of('{"kafka": {"t": {"1": 2}}}') == {"t": {1: 2}}
    assert kafka_offsets_of({"t": {"0": 5, "3": 1}}) == {"t": {0: 5, 3: 1}}
    for opaque in (None, 7, "barrier-7", {"kafka": {}}, {"t": 5}, {"t": {"x": 1}}, []):
        assert kafka_offsets_of(opaque) is None


# ---- a stopped server's data dir -------------------------------------------------------


HOLDER = """
import sys
from ftlayer.persistence import LmdbStorage
storage = LmdbStorage(sys.argv[1])
print("open", flush=True)
sys.stdin.read()
storage.close()
"""


@dataclass
class Holder:
    """Another process that has the job's data dir open, as a running server does."""

    path: Path
    proc: subprocess.Popen[str]

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        assert self.proc.wait(10) == 0


@pytest.fixture
def held_elsewhere(job: Job) -> Iterator[Holder]:
    path = Path(job.storage.path)
    job.close()
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "open\n"
    yield Holder(path, proc)
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


def test_a_data_dir_open_in_another_process_is_refused_until_it_closes(
    held_elsewhere: Holder, job: Job, tmp_path: Path
) -> None:
    with pytest.raises(StorageError, match="open in another process"):
        create_savepoint_from_data_dir(held_elsewhere.path, tmp_path / "sp", "busy")
    assert not (tmp_path / "sp").exists()
    held_elsewhere.stop()
    created = create_savepoint_from_data_dir(held_elsewhere.path, tmp_path / "sp", "busy")
    assert created.stored_records == len(job.incomplete)


def test_a_stopped_servers_data_dir_is_saved(job: Job, tmp_path: Path) -> None:
    stored = len(job.storage)
    path = Path(job.storage.path)
    job.close()
    created = create_savepoint_from_data_dir(path, tmp_path / "sp", "offline")
    assert created.stored_records == stored
    with open_stopped_store(path) as reopened:  # our check released what it locked
        assert len(reopened) == stored


def test_a_stopped_servers_newest_checkpoint_record_may_be_in_its_snapshot_store(
    job: Job, tmp_path: Path
) -> None:
    """A server killed after the checkpoint writer stored a record in
    `<data dir>/checkpoints` but before its main store committed the staged copy:
    the savepoint's position is the newer one."""
    path = Path(job.storage.path)

    def record(checkpoint_id: int, offset: int) -> dict[str, bytes]:
        position = {"kafka": {"orders": {"0": offset}}, "replay": 0}
        value = {"query": "q", "id": checkpoint_id, "state": "complete", "position": position}
        return {f"checkpoint/q/{checkpoint_id:012d}": json.dumps(value).encode()}

    job.storage.update_meta(record(1, 10))
    job.close()
    with LmdbStorage(path / "checkpoints", sync=False) as snapshots:
        snapshots.update_meta({**record(1, 10), **record(2, 25)})
    created = create_savepoint_from_data_dir(path, tmp_path / "sp", "after-kill")
    assert created.positions == {"q": {"kafka": {"orders": {"0": 25}}, "replay": 0}}


def test_a_store_open_in_this_process_is_refused_and_keeps_its_lock(
    job: Job, tmp_path: Path
) -> None:
    path = Path(job.storage.path)
    with pytest.raises(StorageError, match="open in this process"):
        create_savepoint_from_data_dir(path, tmp_path / "sp")
    # Another process still sees the store in use: the refusal released no lock of it.
    probe = (
        "import sys\nfrom ftlayer.checkpoint.savepoint import open_stopped_store\n"
        "try:\n    open_stopped_store(sys.argv[1])\nexcept Exception as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, str(path)], capture_output=True, text=True, check=True
    ).stdout
    assert "open in another process" in out
    assert len(job.storage) > 0  # and the store works on


@pytest.mark.parametrize("kind", ["missing", "files", "foreign-lmdb", "file"])
def test_a_data_dir_that_is_not_an_ftlayer_store_is_refused_untouched(
    tmp_path: Path, kind: str
) -> None:
    path = tmp_path / "not-ours"
    if kind == "files":
        path.mkdir()
        (path / "notes.txt").write_text("hello")
    elif kind == "foreign-lmdb":
        env = lmdb.open(str(path))
        with env.begin(write=True) as txn:
            txn.put(b"k", b"v")
        env.close()
    elif kind == "file":
        path.write_text("hello")
    before = sorted(p.name for p in path.iterdir()) if path.is_dir() else None
    with pytest.raises(NotAnLmdbEnvironment):
        create_savepoint_from_data_dir(path, tmp_path / "sp", "x")
    assert (sorted(p.name for p in path.iterdir()) if path.is_dir() else None) == before
    assert path.exists() == (kind != "missing")
    assert not (tmp_path / "sp").exists()


# ---- errors --------------------------------------------------------------------------


def test_an_existing_name_is_refused_and_the_savepoint_kept(job: Job, tmp_path: Path) -> None:
    first = create_savepoint(job.storage, tmp_path / "sp", "daily")
    before = digest(first.path)
    job.run(30, "d")
    with pytest.raises(StateConflict, match="a savepoint named 'daily' already exists"):
        create_savepoint(job.storage, tmp_path / "sp", "daily")
    assert digest(first.path) == before
    assert [p.name for p in (tmp_path / "sp").iterdir()] == ["daily"]  # no staging left


def test_a_savepoints_dir_that_is_a_file_is_a_clear_error(job: Job, tmp_path: Path) -> None:
    not_a_dir = tmp_path / "sp"
    not_a_dir.write_text("notes\n")
    with pytest.raises(ConfigError, match=r"savepoints directory .*/sp exists and is not a dir"):
        create_savepoint(job.storage, not_a_dir, "daily")
    with pytest.raises(StorageError, match=r"could not write savepoint 'daily' .*Not a directory"):
        create_savepoint(job.storage, not_a_dir / "below", "daily")
    assert not_a_dir.read_text() == "notes\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "sp"]  # nothing else made


@pytest.mark.parametrize("name", ["", "../escape", ".hidden", "a/b", "x" * 129, "sp 1"])
def test_bad_names_are_refused(job: Job, tmp_path: Path, name: str) -> None:
    with pytest.raises(ConfigError, match="bad savepoint name"):
        create_savepoint(job.storage, tmp_path / "sp", name)
    assert not (tmp_path / "escape").exists()


def test_restore_errors_write_nothing(job: Job, tmp_path: Path) -> None:
    savepoints = tmp_path / "sp"
    create_savepoint(job.storage, savepoints, "one")
    with pytest.raises(ConfigError, match=r"no savepoint named 'two' in .*: one$"):
        restore_savepoint(savepoints, "two", tmp_path / "new")

    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "data.mdb").write_bytes(b"somebody's data")
    with pytest.raises(StateConflict, match="not an empty directory"):
        restore_savepoint(savepoints, "one", occupied)
    assert (occupied / "data.mdb").read_bytes() == b"somebody's data"

    # Key groups are never split: no more partitions than max_parallelism (128).
    with pytest.raises(PartitioningError, match=f"source {KEYED} .*exceeds max_parallelism 128"):
        restore_savepoint(savepoints, "one", tmp_path / "new", partitions=129)
    # Forward cannot send a record from partition 3 back to a job with 2 partitions.
    with pytest.raises(PartitioningError, match=f"source {FORWARD} cannot replay"):
        restore_savepoint(savepoints, "one", tmp_path / "new", partitions=2)
    for bad in (0, -1, True):
        with pytest.raises(ConfigError, match="partitions must be an integer >= 1"):
            restore_savepoint(savepoints, "one", tmp_path / "new", partitions=bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "occupied", "sp"]

    # An empty directory is a fine target.
    (tmp_path / "empty").mkdir()
    assert isinstance(restore_savepoint(savepoints, "one", tmp_path / "empty"), RestoreResult)


# ---- the command line ------------------------------------------------------------------


def last_json(capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert isinstance(result, dict)
    return result


def test_cli_create_list_restore(
    job: Job, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stored = len(job.storage)
    barrier(CheckpointCoordinator(job.ft), "orders-job", {"orders": {"0": 12}})
    data, savepoints = Path(job.storage.path), str(tmp_path / "sp")
    job.close()

    assert (
        main(
            [
                "savepoint",
                "create",
                "--data-dir",
                str(data),
                "--dir",
                savepoints,
                "--name",
                "nightly",
                "--json",
            ]
        )
        == 0
    )
    created = last_json(capsys)
    assert (created["name"], created["stored_records"]) == ("nightly", stored)

    assert main(["savepoint", "list", "--dir", savepoints]) == 0
    table = capsys.readouterr().out
    assert "nightly" in table and f"{stored:,}" in table and f"{KEYED} key-group/{N}" in table
    assert main(["savepoint", "list", "--dir", savepoints, "--json"]) == 0
    assert [s["name"] for s in last_json(capsys)["savepoints"]] == ["nightly"]  # type: ignore[attr-defined]

    new = tmp_path / "new"
    argv = ["savepoint", "restore", "nightly", "--dir", savepoints, "--data-dir", str(new)]
    assert main([*argv, "--partitions", str(2 * N)]) == 0
    out = capsys.readouterr().out
    assert f"{stored:,} stored records" in out
    assert f"source {KEYED} (key-group, {2 * N} partitions)" in out
    assert (
        """startingOffsets '{"orders":{"0":12,"1":-2,"2":-2,"3":-2,"4":-2,"5":-2,"6":-2,"7":-2}}'"""
        in out
    )
    keyed, _ = replayed(new)
    assert set(keyed.values()) == set(range(2 * N))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["restore", "nope", "--data-dir", "{tmp}/x"], "no savepoint named 'nope'"),
        (["restore", "sp", "--data-dir", "{tmp}/data"], "not an empty directory"),
        (
            ["restore", "sp", "--data-dir", "{tmp}/x", "--partitions", "many"],
            "--partitions must be",
        ),
        (["restore", "sp", "--data-dir", "{tmp}/x", "--partitions", "0"], "--partitions must be"),
        (["create", "--data-dir", "{tmp}/nothing"], "is not an ftlayer data dir"),
        (["create", "--data-dir", "{tmp}/data", "--name", "sp"], "already exists"),
    ],
)
def test_cli_errors_are_one_line_and_exit_2(
    job: Job,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    message: str,
) -> None:
    create_savepoint(job.storage, tmp_path / "sps", "sp")
    job.close()
    capsys.readouterr()
    filled = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(["savepoint", *filled, "--dir", str(tmp_path / "sps")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("ftlayer: ") and message in captured.err
    assert captured.err.count("\n") == 1
    assert not (tmp_path / "x").exists()


def test_cli_refuses_the_data_dir_of_a_running_process(
    held_elsewhere: Holder, tmp_path: Path
) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ftlayer.cli",
            "savepoint",
            "create",
            "--data-dir",
            str(held_elsewhere.path),
            "--dir",
            str(tmp_path / "sp"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "open in another process" in done.stderr and "ftlayer serve" in done.stderr
    assert done.stderr.count("\n") == 1


def test_a_savepoint_keeps_retry_counts_due_times_and_dead_letters_apart_from_replays(
    tmp_path: Path,
) -> None:
    from ftlayer.causes import Cause, FailKind
    from ftlayer.policy import RetryPolicy

    store = LmdbStorage(tmp_path / "live")
    ft = FTLayer(store, wall_clock=lambda: 1000.0)
    ft.register_source(SourceRegistration(5, "forward", 2, retry=RetryPolicy(1, 60_000, 60_000)))
    roots = (
        Persister(ft, source_id=5)
        .persist([b"a", b"b", b"c"], topics="t", partitions=[0, 1, 0], offsets=[0, 0, 1])
        .roots
    )
    ft.fail(roots[[0]], Cause(FailKind.ERROR, "map", "ValueError: x"))  # waits 48-60 s
    ft.fail(roots[[1]], Cause(FailKind.ERROR, "map", "ValueError: y", final=True))  # dead
    waiting = ft.retry_record(1)
    assert waiting is not None and ft.dead_letter_count == 1
    create_savepoint(store, tmp_path / "savepoints", "with-retries")
    store.close()
    result = restore_savepoint(tmp_path / "savepoints", "with-retries", tmp_path / "restored")
    # The dead letter (b, from partition 1) is stored but not replayed: it is counted
    # apart, and stays a dead letter. a (waiting) and c (pending) replay into partition 0.
    assert result.stored_records == 3
    assert result.replays == {"5": {0: 2}} and result.replayed_records == 2
    assert result.dead_letters == {"5": 1}
    assert result.as_dict()["dead_letters"] == {"5": 1}
    restored = LmdbStorage(tmp_path / "restored")
    again = FTLayer(restored, wall_clock=lambda: 1001.0)
    kept = again.retry_record(1)
    assert kept is not None and (kept.attempts, kept.due) == (1, waiting.due)
    assert again.waiting_replays == 1 and again.dead_letter_count == 1
    letters, records = again.dead_letters()
    assert records.payloads == [b"b"] and letters[0][1].last_cause == Cause(
        FailKind.ERROR, "map", "ValueError: y", final=True
    )
    restored.close()
