"""Savepoints: user-triggered copies of the FT layer's state that never expire and
restore into a new deployment, also with another partition count.

What a savepoint holds. The FT layer's durable state is its LMDB store: every record
whose tree is not complete (stored until completion), and the meta entries: the
source registrations (`sources`: per source id its replay partitioner, partition count,
options and tree timeout), the replay seq counter (`next_replay_seq`), and the barrier
checkpoints of each query (`checkpoint/<query>/<id>` records and `snapshot/<query>/<id>`
state snapshots, ftlayer.checkpoint). A savepoint is a directory::

    <savepoints dir>/<name>/manifest.json   what is in it (below), as JSON
    <savepoints dir>/<name>/data/data.mdb   a compacted LMDB copy of the whole store

The manifest holds `format` (1), `name`, `created_at` (UTC, ISO 8601), `source_data_dir`,
`stored_records`, `sources` (the registrations), `next_replay_seq`, `data_bytes` and
`data_sha256` (the size and SHA-256 of data.mdb, checked by every restore and fetch),
`savepoint_id` (random, shared by the parts one command saves together; null for a
part saved alone), `shard` and `shards` (the store's place), `ftlayer_version` and
`positions`: per checkpoint query name, the position of its newest complete checkpoint,
if it has one. That batch ran: every Kafka record below the position was read and
persisted, so it either completed or is in the savepoint, and a restored query that
starts there loses nothing. A position is lowered to the start of every batch range
of its partitions still open in the copy: a tree-mode range's pending records are in
the FT layer's memory, not in its store, so the restored query reads them again. (A
later checkpoint that is only begun may belong to a batch that never ran.)
Every fact in it is read from the copy, not from the live store, so it describes
exactly what the savepoint holds. Nothing ever deletes a savepoint but its user.

Creating one (`create_savepoint`, on an open `LmdbStorage`):

1. Check the name (letters, digits, `.`, `_`, `-`) and that no savepoint has it.
2. Copy the store with LMDB's compacting copy into a hidden staging directory
   `<savepoints dir>/.<name>.partial-<random>/data`: LMDB copies from one read
   transaction, so a running server's writers go on and the copy is the state at its
   start.
3. Read the copy: stored records, registrations, replay seq, checkpoint positions; hash it.
4. Write manifest.json; fsync the data file, the manifest and the directories.
5. Rename the staging directory to `<name>`: a savepoint appears whole or not at all
   (an interrupted create leaves only a hidden `.partial` directory, which `list`
   ignores).

A running `ftlayer serve` calls `create_savepoint` on its own store when a client sends
SAVEPOINT (FTClient.savepoint), after it deleted its completed records (ftlayer.server,
step 8): into a directory on its own host, or into its spool, from where
`ftlayer savepoint create --server` fetches it into a directory on the client's host
(ftlayer.checkpoint.fetch).
`create_savepoint_from_data_dir` does the same for the data dir of a stopped server.
It refuses a data dir that another process has open: a running `ftlayer serve` keeps
persisting and completing records, so a copy taken behind its back would not match
the job's position. LMDB allows several processes on one store, so the check is
LMDB's own: every process with the environment open holds a shared fcntl lock on byte
0 of lock.mdb, and an exclusive lock on it is granted only when no other process does.

Restoring one (`restore_savepoint`) into a new data dir, which must not exist or be
empty:

1. Load the manifest; check the target, and the data file against the manifest
   (`check_data`: its size and SHA-256, so a truncated copy is refused by name).
2. Copy data.mdb into a staging directory beside the target.
3. Open the copy. With `partitions=N`, set every registered source's partition count
   to N. Then route every stored record as the FT layer's recovery will (a dry run of
   ftlayer.core.recovery's routing), so a partition count a partitioner refuses (key-group
   beyond max_parallelism, forward below a record's original partition) is a clear
   error now instead of a server that cannot start. Count the replays per source and
   partition, and the dead letters per source apart (recovery does not replay them).
4. Delete the checkpoint records and snapshots: they describe the old job's Spark
   checkpoint, and the restored job starts a new one. Their positions stay in the
   manifest. Delete the open batch ranges too: the restored query reads their records
   again from those positions, which are at or below their starts.
5. Close, fsync, and rename the staging directory to the target.

When `ftlayer serve --data-dir <target>` starts, recovery replays every stored record
but the dead letters under a new root, routed by its source's partitioner with the
restored partition count: under `key-group`, each record goes to the partition that
owns its key group at the new count, where its key's state now lives. A new query of
the same sources (same `ft.sourceName` and topics) takes all those replays in its first
batch (a record still waiting for its retry backoff, at the end of the backoff). A dead
letter is restored as a dead letter, with its retry record: it is not replayed, and
`ftlayer dead-letters` delivers, requeues or purges it as before the savepoint; its
routing is checked at the new partition count too, since a requeue routes it. The
manifest's positions give the Kafka `startingOffsets` that new query should use
(`RestoreResult.starting_offsets`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from ftlayer import __version__
from ftlayer.checkpoint import (
    CHECKPOINT_PREFIX,
    CHECKPOINT_STORE_DIR,
    SNAPSHOT_PREFIX,
    CheckpointState,
)
from ftlayer.core import REPLAY_SEQ_META_KEY, SOURCES_META_KEY, SourceConfig
from ftlayer.core.rangetable import RANGE_META_PREFIX
from ftlayer.core.retries import DEAD_LETTER
from ftlayer.core.sinkmarks import MARK_META_PREFIX
from ftlayer.errors import (
    ConfigError,
    CorruptData,
    FTLayerError,
    NotAnLmdbEnvironment,
    PartitioningError,
    PositionError,
    StateConflict,
    StorageError,
)
from ftlayer.partitioners import KeyGroupPartitioner
from ftlayer.partitioners.key_groups import check_max_parallelism
from ftlayer.persistence import LmdbStorage
from ftlayer.persistence import lmdb_storage as _lmdb_storage
from ftlayer.position import EARLIEST, KafkaOffsets, Position
from ftlayer.records import RecordBatch
from ftlayer.shards import CLUSTER_META_PREFIX, SHAPE_META_KEY, ShardPlace

__all__ = [
    "FORMAT",
    "RestoreResult",
    "Savepoint",
    "check_data",
    "create_savepoint",
    "create_savepoint_from_data_dir",
    "default_name",
    "file_sha256",
    "kafka_offsets_of",
    "list_savepoints",
    "load_savepoint",
    "new_savepoint_id",
    "open_stopped_store",
    "restore_savepoint",
    "store_place",
]

log = logging.getLogger("ftlayer.checkpoint.savepoint")

FORMAT: Final = 1
MANIFEST: Final = "manifest.json"
DATA: Final = "data"

_DATA_FILE: Final = "data.mdb"
_LOCK_FILE: Final = "lock.mdb"
_HASH_CHUNK: Final = 1 << 20
_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True, slots=True)
class Savepoint:
    """One savepoint as its manifest describes it; `path` is its directory."""

    name: str
    path: Path
    created_at: str
    source_data_dir: str
    stored_records: int
    sources: dict[str, dict[str, Any]]
    """The source registrations: per source id (a string) its partitioner spec."""
    next_replay_seq: int
    positions: dict[str, Any]
    """Per checkpoint query name: the position of its newest complete checkpoint."""
    data_bytes: int
    ftlayer_version: str
    format: int = FORMAT
    shard: int = 0
    shards: int = 1
    """The saved store's place: shard `shard` of `shards` (a cluster's savepoint has a
    part per shard, ftlayer.checkpoint.reshard)."""
    savepoint_id: str | None = None
    """Shared by the parts of a cluster's savepoint saved by one command (None: a part
    saved alone, or written before ids)."""
    data_sha256: str | None = None
    """The SHA-256 of data.mdb, hex (None: written before checksums)."""

    @property
    def data_dir(self) -> Path:
        return self.path / DATA

    def manifest(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "name": self.name,
            "created_at": self.created_at,
            "source_data_dir": self.source_data_dir,
            "stored_records": self.stored_records,
            "sources": self.sources,
            "next_replay_seq": self.next_replay_seq,
            "positions": self.positions,
            "data_bytes": self.data_bytes,
            "ftlayer_version": self.ftlayer_version,
            "shard": self.shard,
            "shards": self.shards,
            "savepoint_id": self.savepoint_id,
            "data_sha256": self.data_sha256,
        }

    def as_dict(self) -> dict[str, Any]:
        return {**self.manifest(), "path": str(self.path)}


@dataclass(frozen=True, slots=True)
class RestoreResult:
    """What `restore_savepoint` wrote, and what the new job needs to know."""

    savepoint: Savepoint
    data_dir: Path
    stored_records: int
    sources: dict[str, dict[str, Any]]
    """The registrations as restored (partition counts rewritten with `partitions`)."""
    partitions: int | None
    replays: dict[str, dict[int, int]]
    """Per source id: how many replays recovery will queue for each partition (dead
    letters are not replayed: they are counted in `dead_letters`)."""
    dead_letters: dict[str, int]
    """Per source id with any: how many stored records are dead letters, restored as
    dead letters."""
    starting_offsets: dict[str, dict[str, dict[str, int]]]
    """Per checkpoint query name: the ftkafka `startingOffsets` ({topic: {partition:
    offset}}) for the restored job; partitions beyond the savepoint's get -2."""
    dropped_checkpoint_entries: int

    @property
    def replayed_records(self) -> int:
        """The stored records recovery replays: all but the dead letters."""
        return sum(n for per_partition in self.replays.values() for n in per_partition.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "savepoint": self.savepoint.name,
            "data_dir": str(self.data_dir),
            "stored_records": self.stored_records,
            "sources": self.sources,
            "partitions": self.partitions,
            "replays": {sid: {str(p): n for p, n in c.items()} for sid, c in self.replays.items()},
            "dead_letters": self.dead_letters,
            "starting_offsets": self.starting_offsets,
            "dropped_checkpoint_entries": self.dropped_checkpoint_entries,
        }


# ---- create ------------------------------------------------------------------------


def create_savepoint(
    storage: LmdbStorage,
    savepoints_dir: str | os.PathLike[str],
    name: str | None = None,
    *,
    checkpoint_records: LmdbStorage | None = None,
    savepoint_id: str | None = None,
) -> Savepoint:
    """Write a savepoint of the open `storage` to `<savepoints_dir>/<name>` (steps in
    the module docstring); `name` defaults to `savepoint-<UTC time>-<random>`. The
    positions come from the checkpoint records in `storage` and, if given, in
    `checkpoint_records` (a stopped server's checkpoint record store, which may hold newer
    ones: see `create_savepoint_from_data_dir`).

    Only reads `storage` (one LMDB read transaction), so a running server may call it
    while it serves. ConfigError for a bad name or a savepoints directory that is a
    file, StateConflict for a name that exists; StorageError if the copy or a file cannot be written
    (disk full, no permission); a failed create leaves no savepoint behind (its
    staging directory is removed)."""
    root = Path(savepoints_dir)
    name = default_name() if name is None else name
    _check_name(name)
    # Step 1.
    final = root / name
    if root.exists() and not root.is_dir():
        raise ConfigError(f"the savepoints directory {root} exists and is not a directory")
    if final.exists():
        raise StateConflict(f"a savepoint named {name!r} already exists in {root}")
    staging = root / f".{name}.partial-{secrets.token_hex(4)}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
    except OSError as exc:
        raise _write_error(name, root, exc) from None
    try:
        # Step 2.
        storage.copy_to(staging / DATA, compact=True)
        # Step 3.
        with LmdbStorage(staging / DATA) as copy:
            stored = len(copy)
            sources = _registrations(copy)
            next_replay_seq = _next_replay_seq(copy)
            positions = _newest_positions(copy, checkpoint_records)
            place = store_place(copy)
        (staging / DATA / _LOCK_FILE).unlink(missing_ok=True)  # opening the copy made it
        savepoint = Savepoint(
            name=name,
            path=final,
            created_at=datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            source_data_dir=os.path.abspath(storage.path),
            stored_records=stored,
            sources=sources,
            next_replay_seq=next_replay_seq,
            positions=positions,
            data_bytes=(staging / DATA / _DATA_FILE).stat().st_size,
            ftlayer_version=__version__,
            shard=place.index,
            shards=place.count,
            savepoint_id=savepoint_id,
            data_sha256=file_sha256(staging / DATA / _DATA_FILE),
        )
        # Step 4.
        _write_json(staging / MANIFEST, savepoint.manifest())
        _fsync(staging / DATA / _DATA_FILE)
        _fsync(staging / DATA)
        _fsync(staging)
        # Step 5. rename() refuses a non-empty target: a savepoint of the same name
        # created meanwhile is never overwritten.
        try:
            staging.rename(final)
        except OSError as exc:
            raise StateConflict(
                f"a savepoint named {name!r} already exists in {root} ({exc.strerror})"
            ) from None
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, OSError):  # disk full, no permission: say where
            raise _write_error(name, root, exc) from None
        raise
    try:
        _fsync(root)
    except OSError as exc:
        raise StorageError(
            f"savepoint {name!r} was written to {final}, but {root} could not be synced "
            f"({exc.strerror or exc}): an OS crash may still lose it"
        ) from None
    return savepoint


def _write_error(name: str, root: Path, exc: OSError) -> StorageError:
    where = f" ({exc.filename})" if exc.filename else ""
    return StorageError(
        f"could not write savepoint {name!r} in {root}: {exc.strerror or exc}{where}; "
        "no savepoint was created"
    )


def create_savepoint_from_data_dir(
    data_dir: str | os.PathLike[str],
    savepoints_dir: str | os.PathLike[str],
    name: str | None = None,
    savepoint_id: str | None = None,
) -> Savepoint:
    """`create_savepoint` on the data dir of a stopped FT-layer server (see
    `open_stopped_store` for what is refused). The positions also come from the
    checkpoint records in its record store (`<data dir>/checkpoints`): a server
    killed before its main store committed the newest record has it only there."""
    if name is not None:  # checked before the store is opened, too
        _check_name(name)
        if (Path(savepoints_dir) / name).exists():
            raise StateConflict(f"a savepoint named {name!r} already exists in {savepoints_dir}")
    with open_stopped_store(data_dir) as storage:
        record_store = Path(data_dir) / CHECKPOINT_STORE_DIR
        if not (record_store / _DATA_FILE).is_file():
            return create_savepoint(storage, savepoints_dir, name, savepoint_id=savepoint_id)
        with LmdbStorage(record_store, sync=False) as records:
            return create_savepoint(
                storage,
                savepoints_dir,
                name,
                checkpoint_records=records,
                savepoint_id=savepoint_id,
            )


def open_stopped_store(data_dir: str | os.PathLike[str]) -> LmdbStorage:
    """Open the existing ftlayer store at `data_dir`, which no other process may have
    open. NotAnLmdbEnvironment if `data_dir` holds no ftlayer store (nothing is
    created); StorageError if another process (a running `ftlayer serve`) or this
    process has it open."""
    path = os.fspath(data_dir)
    if not os.path.isfile(os.path.join(path, _DATA_FILE)):
        what = "does not exist" if not os.path.exists(path) else f"holds no {_DATA_FILE}"
        raise NotAnLmdbEnvironment(f"{path} is not an ftlayer data dir: it {what}")
    _refuse_if_open_elsewhere(path)
    return LmdbStorage(path)


def _refuse_if_open_elsewhere(path: str) -> None:
    """StorageError if some process has the LMDB environment at `path` open."""
    if _lmdb_storage.is_open_in_process(path):
        # Checked first, and not by the lock: closing our descriptor of lock.mdb would
        # release every fcntl lock this process holds on it, LMDB's own included.
        raise StorageError(f"the ftlayer store at {path} is open in this process")
    lock_file = os.path.join(path, _LOCK_FILE)
    try:
        fd = os.open(lock_file, os.O_RDWR)
    except FileNotFoundError:
        return  # LMDB creates lock.mdb on open: nobody has had it open here
    except OSError as exc:
        raise StorageError(f"cannot check whether {path} is in use: {exc}") from exc
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)
    except OSError:
        raise StorageError(
            f"the ftlayer store at {path} is open in another process (is `ftlayer serve "
            "--data-dir` still running on it?); stop that server first: a savepoint of "
            "a data dir in use would not match its job's position"
        ) from None
    else:
        fcntl.lockf(fd, fcntl.LOCK_UN, 1, 0)
    finally:
        os.close(fd)


# ---- list --------------------------------------------------------------------------


def list_savepoints(savepoints_dir: str | os.PathLike[str]) -> list[Savepoint]:
    """Every savepoint in `savepoints_dir`, oldest first. Directories without a
    manifest (and hidden ones: creates in progress or interrupted) are not savepoints;
    a savepoint whose manifest cannot be read is logged and left out. ConfigError if
    the directory does not exist."""
    root = Path(savepoints_dir)
    if not root.is_dir():
        raise ConfigError(f"no savepoints directory {root}")
    found = []
    for entry in sorted(root.iterdir()):
        if entry.name.startswith(".") or not (entry / MANIFEST).is_file():
            continue
        try:
            found.append(_read_manifest(entry))
        except CorruptData as exc:
            log.warning("skipping %s: %s", entry, exc)
    return sorted(found, key=lambda s: (s.created_at, s.name))


def load_savepoint(savepoints_dir: str | os.PathLike[str], name: str) -> Savepoint:
    """The savepoint `name` in `savepoints_dir`; ConfigError naming the ones there if
    there is none of that name."""
    root = Path(savepoints_dir)
    _check_name(name)
    path = root / name
    if not (path / MANIFEST).is_file():
        there = [s.name for s in list_savepoints(root)] if root.is_dir() else []
        listing = ", ".join(there) if there else "none"
        raise ConfigError(f"no savepoint named {name!r} in {root}; savepoints there: {listing}")
    return _read_manifest(path)


def _read_manifest(path: Path) -> Savepoint:
    try:
        raw = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        if not isinstance(raw, dict):
            raise CorruptData("not a JSON object")
        if raw.get("format") != FORMAT:
            raise CorruptData(
                f"savepoint {path} has format {raw.get('format')!r}; this version of "
                f"ftlayer reads format {FORMAT}"
            )
        return Savepoint(
            name=str(raw["name"]),
            path=path,
            created_at=str(raw["created_at"]),
            source_data_dir=str(raw["source_data_dir"]),
            stored_records=int(raw["stored_records"]),
            sources=dict(raw["sources"]),
            next_replay_seq=int(raw["next_replay_seq"]),
            positions=dict(raw["positions"]),
            data_bytes=int(raw["data_bytes"]),
            ftlayer_version=str(raw["ftlayer_version"]),
            format=FORMAT,
            shard=int(raw.get("shard", 0)),
            shards=int(raw.get("shards", 1)),
            savepoint_id=_optional_str(raw.get("savepoint_id")),
            data_sha256=_optional_str(raw.get("data_sha256")),
        )
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise CorruptData(f"the manifest of savepoint {path} is unreadable: {exc!r}") from None


# ---- restore -----------------------------------------------------------------------


def restore_savepoint(
    savepoints_dir: str | os.PathLike[str],
    name: str,
    data_dir: str | os.PathLike[str],
    *,
    partitions: int | None = None,
) -> RestoreResult:
    """Restore savepoint `name` into `data_dir` (new or empty) for `ftlayer serve
    --data-dir` (steps in the module docstring). With `partitions`, every registered
    source replays into that many partitions. With nothing written: ConfigError for
    an unknown name, StateConflict for a non-empty target, PartitioningError for a
    partition count that a source's partitioner or a stored record refuses, and
    CorruptData for an incomplete savepoint or a registration it cannot read."""
    # Step 1.
    savepoint = load_savepoint(savepoints_dir, name)
    if partitions is not None and (
        isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1
    ):
        raise ConfigError(f"partitions must be an integer >= 1, got {partitions!r}")
    target = Path(data_dir)
    _check_empty_target(target)
    source_file = check_data(savepoint)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.restore-{secrets.token_hex(4)}"
    staging.mkdir()
    try:
        # Step 2.
        shutil.copyfile(source_file, staging / _DATA_FILE)
        _fsync(staging / _DATA_FILE)
        with LmdbStorage(staging) as storage:
            # Step 3.
            stored = len(storage)
            if stored != savepoint.stored_records:  # paranoid: a damaged copy
                raise StorageError(
                    f"savepoint {savepoint.path} holds {stored} records, its manifest "
                    f"says {savepoint.stored_records}: the savepoint is damaged"
                )
            sources = _registrations(storage)
            if partitions is not None:
                sources = {
                    sid: {**spec, "num_partitions": partitions} for sid, spec in sources.items()
                }
                storage.update_meta(
                    {SOURCES_META_KEY: json.dumps(sources, sort_keys=True).encode()}
                )
            replays, dead_letters = _dry_run_recovery(storage, sources, partitions)
            # Step 4.
            checkpoint_keys = storage.meta_keys(CHECKPOINT_PREFIX)
            # A new store: its place and id come from the server started on it.
            storage.update_meta(
                {},
                [
                    *checkpoint_keys,
                    *storage.meta_keys(SNAPSHOT_PREFIX),
                    *storage.meta_keys(CLUSTER_META_PREFIX),
                    *storage.meta_keys(MARK_META_PREFIX),  # the sinks' marks of old batches
                    # Open batch ranges: the restored query reads their records again
                    # from the starting offsets, which are at or below their starts.
                    *storage.meta_keys(RANGE_META_PREFIX),
                ],
            )
        # Step 5.
        _fsync(staging)
        _check_empty_target(target)
        if target.exists():
            target.rmdir()
        staging.rename(target)
        _fsync(target.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    offsets = {
        query: offsets
        for query, position in savepoint.positions.items()
        if (offsets := _starting_offsets(position, partitions)) is not None
    }
    return RestoreResult(
        savepoint=savepoint,
        data_dir=target,
        stored_records=stored,
        sources=sources,
        partitions=partitions,
        replays=replays,
        dead_letters=dead_letters,
        starting_offsets=offsets,
        dropped_checkpoint_entries=len(checkpoint_keys),
    )


def check_data(savepoint: Savepoint) -> Path:
    """The data file of `savepoint`, checked against its manifest: there, of its
    `data_bytes`, and of its `data_sha256` (where the manifest has one). CorruptData
    naming the savepoint otherwise (a part cut short by a copy, or damaged)."""
    data = savepoint.data_dir / _DATA_FILE
    if not data.is_file():
        raise CorruptData(f"savepoint {savepoint.path} has no {DATA}/{_DATA_FILE}: incomplete")
    size = data.stat().st_size
    if size != savepoint.data_bytes:
        raise CorruptData(
            f"savepoint {savepoint.path}: {DATA}/{_DATA_FILE} has {size:,} bytes, its "
            f"manifest says {savepoint.data_bytes:,}: it is truncated or damaged"
        )
    if savepoint.data_sha256 is not None and file_sha256(data) != savepoint.data_sha256:
        raise CorruptData(
            f"savepoint {savepoint.path}: {DATA}/{_DATA_FILE} does not match the SHA-256 "
            "in its manifest: it is damaged"
        )
    return data


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes, hex."""
    digest = hashlib.sha256()
    with path.open("rb") as data:
        while chunk := data.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def new_savepoint_id() -> str:
    return secrets.token_hex(8)


def _optional_str(value: object) -> str | None:
    return None if value is None else str(value)


def _check_empty_target(target: Path) -> None:
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise StateConflict(
            f"cannot restore into {target}: it exists and is not an empty directory; "
            "restore into a new data dir"
        )


def _dry_run_recovery(
    storage: LmdbStorage, sources: Mapping[str, Mapping[str, Any]], partitions: int | None
) -> tuple[dict[str, dict[int, int]], dict[str, int]]:
    """Route every stored record as FTLayer recovery will, with fresh partitioners
    from `sources`; returns per source id the replays per target partition, and per
    source id the dead letters (which recovery leaves as they are, but which a requeue
    routes the same way, so they are routed here too). PartitioningError naming the
    source if its partitioner refuses the partition count or a record."""
    configs: dict[int, SourceConfig] = {}
    for sid, spec in sources.items():
        configs[int(sid)] = _config_of(sid, spec)
    counts: dict[str, dict[int, int]] = {}
    dead: Counter[str] = Counter()
    for _seqs, batch, replay_seqs in storage.scan():
        is_dead = replay_seqs == DEAD_LETTER
        for source_id in np.unique(batch.source_ids).tolist():
            of_source = batch.source_ids == source_id
            rows = batch.take(np.flatnonzero(of_source))
            targets = _targets(rows, configs.get(int(source_id)), int(source_id), partitions)
            replayed = targets[~is_dead[of_source]]
            dead[str(source_id)] += int(np.count_nonzero(is_dead & of_source))
            per_source = counts.setdefault(str(source_id), {})
            for partition, n in zip(*np.unique(replayed, return_counts=True), strict=True):
                per_source[int(partition)] = per_source.get(int(partition), 0) + int(n)
    replays = {sid: dict(sorted(c.items())) for sid, c in sorted(counts.items())}
    return replays, {sid: n for sid, n in sorted(dead.items()) if n}


def _config_of(sid: str, spec: Mapping[str, Any]) -> SourceConfig:
    """The SourceConfig of a registration (its partition count maybe the restore's);
    PartitioningError naming the source if its partitioner cannot take that count (with
    no record to route), CorruptData if the registration is not one."""
    where = f"source {sid} ({spec.get('partitioner')!r}, {spec.get('num_partitions')} partitions)"
    try:
        config = SourceConfig.named(
            spec["partitioner"],
            spec["num_partitions"],
            spec.get("timeout_s"),
            **dict(spec.get("options") or {}),
        )
        if isinstance(config.partitioner, KeyGroupPartitioner):
            check_max_parallelism(config.partitioner.max_parallelism, config.num_partitions)
    except FTLayerError as exc:  # its partitioner refuses the partition count
        raise PartitioningError(f"{where} cannot be restored: {exc}") from None
    except (KeyError, TypeError) as exc:  # not a registration this version wrote
        raise CorruptData(f"{where} cannot be restored: {exc}") from None
    return config


def _targets(
    rows: RecordBatch, config: SourceConfig | None, source_id: int, partitions: int | None
) -> NDArray[np.int32]:
    if config is None:  # recovery sends records of unregistered sources back home
        beyond = rows.partitions >= partitions if partitions is not None else None
        if beyond is not None and bool(beyond.any()):
            raise PartitioningError(
                f"source {source_id} has no registered replay partitioner, so its records "
                f"replay into their original partitions, and {int(beyond.sum())} of them "
                f"came from partitions >= {partitions}, which a job with {partitions} "
                "partitions does not have"
            )
        return rows.partitions
    try:
        return config.partitioner.targets(rows, config.num_partitions)[1]
    except FTLayerError as exc:
        raise PartitioningError(
            f"source {source_id} cannot replay its stored records into "
            f"{config.num_partitions} partitions: {exc}"
        ) from None


# ---- positions and starting offsets ------------------------------------------------


def _newest_positions(*stores: LmdbStorage | None) -> dict[str, Any]:
    """Per query, the position of its newest complete checkpoint in any of `stores`.

    Checkpoint records are `checkpoint/<query>/<id>` with a JSON object value
    (ftlayer.checkpoint.Checkpoint.to_json). Newest means the highest id: the value's
    int `id`, else the key's last part. Records that are not complete (`state` other
    than "complete") or have no `position` are skipped, as are unreadable ones."""
    newest: dict[str, tuple[tuple[int, str], Any]] = {}
    found = (
        (key, store.get_meta(key))
        for store in stores
        if store is not None
        for key in store.meta_keys(CHECKPOINT_PREFIX)
    )
    for key, raw in found:
        try:
            value = json.loads(raw.decode()) if raw is not None else None
        except (UnicodeDecodeError, ValueError):
            continue
        if not isinstance(value, dict) or value.get("position") is None:
            continue
        if value.get("state", CheckpointState.COMPLETE.value) != CheckpointState.COMPLETE.value:
            continue
        query, _sep, checkpoint = key[len(CHECKPOINT_PREFIX) :].rpartition("/")
        query = str(value.get("query") or query or checkpoint)
        rank = (_checkpoint_number(value, checkpoint), key)
        if query not in newest or rank > newest[query][0]:
            newest[query] = (rank, value["position"])
    positions = {query: position for query, (_rank, position) in sorted(newest.items())}
    for store in stores:
        if store is not None:
            _below_open_ranges(store, positions)
    return positions


def _below_open_ranges(store: LmdbStorage, positions: dict[str, Any]) -> None:
    """Lower each position to the start of every open batch range of its partitions in
    `store`: a range is open while a record of it is pending, and a tree-mode range's
    records stay pending past their batch's checkpoint (their trees complete one by
    one), in memory only. A savepoint does not hold them, so a restored query reads
    them again from Kafka: from the range's start (the records of it that completed
    come again too: duplicates, nothing lost)."""
    for key in store.meta_keys(RANGE_META_PREFIX):
        raw = store.get_meta(key)
        try:
            _source, topic, partition, start, *_rest = json.loads(raw or b"")
        except (ValueError, TypeError):
            continue
        for position in positions.values():
            kafka = position.get("kafka") if isinstance(position, dict) else None
            at = kafka.get(topic) if isinstance(kafka, dict) else None
            if isinstance(at, dict) and str(partition) in at and int(start) < at[str(partition)]:
                at[str(partition)] = int(start)


def _checkpoint_number(value: Mapping[str, Any], checkpoint: str) -> int:
    number = value.get("id")
    if isinstance(number, int) and not isinstance(number, bool):
        return number
    return int(checkpoint) if checkpoint.isdigit() else -1


def kafka_offsets_of(position: Any) -> KafkaOffsets | None:
    """The Kafka offsets in a checkpoint position, {topic: {partition: offset}}, or None
    if it holds none or is not one. Accepts a position (ftlayer.position's JSON form) as
    an object or as its text, and bare Kafka offsets {topic: {partition: offset}}."""
    if isinstance(position, str):
        try:
            position = json.loads(position)
        except ValueError:
            return None
    if isinstance(position, dict) and "kafka" not in position:
        position = {"kafka": position}
    try:
        offsets = Position.parse(position).offsets()
    except PositionError:
        return None
    return offsets or None


def _starting_offsets(position: Any, partitions: int | None) -> dict[str, dict[str, int]] | None:
    """The ftkafka `startingOffsets` JSON object for a restored query: the position's
    offsets, and -2 (earliest) for partitions below `partitions` it has none of."""
    offsets = kafka_offsets_of(position)
    if offsets is None:
        return None
    starting: dict[str, dict[str, int]] = {}
    for topic, per_partition in sorted(offsets.items()):
        count = max(partitions or 0, max(per_partition, default=-1) + 1)
        starting[topic] = {str(p): per_partition.get(p, EARLIEST) for p in range(count)}
    return starting


# ---- helpers -----------------------------------------------------------------------


def _registrations(storage: LmdbStorage) -> dict[str, dict[str, Any]]:
    raw = storage.get_meta(SOURCES_META_KEY)
    if not raw:
        return {}
    sources = json.loads(raw.decode())
    if not isinstance(sources, dict):
        raise StorageError(f"{storage.path}: the source registrations are not a JSON object")
    return {str(k): dict(v) for k, v in sorted(sources.items(), key=lambda kv: int(kv[0]))}


def store_place(storage: LmdbStorage) -> ShardPlace:
    """The store's place in its cluster (ftlayer.shards; a store of one server: 0 of 1)."""
    raw = storage.get_meta(SHAPE_META_KEY)
    if raw is None:
        return ShardPlace()
    try:
        return ShardPlace.from_json(json.loads(raw))
    except ValueError as exc:
        raise CorruptData(f"{storage.path}: bad {SHAPE_META_KEY} entry: {exc}") from None


def _next_replay_seq(storage: LmdbStorage) -> int:
    raw = storage.get_meta(REPLAY_SEQ_META_KEY)
    return int(raw.decode()) if raw else 1


def default_name() -> str:
    return f"savepoint-{datetime.now(UTC):%Y%m%dT%H%M%SZ}-{secrets.token_hex(3)}"


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(
            f"bad savepoint name {name!r}: use 1 to 128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )


def _write_json(path: Path, value: Mapping[str, Any]) -> None:
    with path.open("w", encoding="utf-8") as out:
        json.dump(value, out, indent=2, sort_keys=True)
        out.write("\n")
        out.flush()
        os.fsync(out.fileno())


def _fsync(path: Path) -> None:
    """fsync a file or a directory (a directory's entries: a rename in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
