"""Savepoints of an FT layer of several shards, restored into any number of shards.

A cluster's savepoint is one savepoint per shard, each written by its shard (or of its
stopped data dir) as ftlayer.checkpoint.savepoint writes any, named `<name>.shard-<i>-of-<N>`
(`part_name`) in the savepoints directory, its manifest saying which shard of how many
it saved (`Savepoint.shard`, `shards`). A savepoint of one server is its own single
part. Each part holds its shard's records and the positions of its shard's complete
checkpoints, which name its own partitions only: the part's records of a partition are
the ones below that partition's position that did not complete.

Restoring `name` into M data dirs (`restore_cluster`), one per shard of the new FT layer,
in shard order (`ftlayer savepoint restore NAME --data-dir D0,D1,...`):

1. Find the parts (`find_parts`): `name` itself if it is a savepoint of one server,
   else every `name.shard-<i>-of-<N>`, all N of them (ConfigError naming those missing),
   all of one savepoint (one `savepoint_id`, which the parts one command saved
   together share; parts saved one at a time have none: CorruptData naming the parts
   otherwise),
   each data file of the size and SHA-256 its manifest says (`check_data`).
   Check the targets: M new or empty directories, no two the same.
2. M = N: each part is restored into the data dir of its own shard, as one savepoint is
   (`restore_savepoint`): a shard's partitions stay its own (a partition's shard depends
   on the shard count, not on the partition count `--partitions` changes).
3. M != N: the records move. Into a staging directory per target, every stored record
   of every part goes to the shard its Kafka partition maps to among M
   (`ftlayer.shards.partition_shard`), the shard that persisted it had it been there
   from the start, with:
   - its bytes where the part has them (a failed record's bytes copied in from Kafka
     come along inside the record) or its Kafka coordinates where it was stored by
     reference;
   - a root drawn in its new shard (its shard bits: ftlayer.shards), or, for a dead
     letter, its mark (root 0, replay seq DEAD_LETTER);
   - its retry record (attempts, causes, due time, when it was dead-lettered), under
     its new storage seq.
   Every part's source registrations go to every target (with `--partitions`, their
   partition count rewritten), and every record is routed as recovery will route it
   (the dry run of `restore_savepoint`, step 3): a partition count a partitioner
   refuses is an error before anything is renamed into place. What only a running
   store needs is not carried over: replay queue seqs and the replay seq counter
   (recovery queues every record again, below), open batch ranges (their records are
   read again from the starting offsets, which are at or below their start), the
   identities of ingested records (a second copy of one from an upstream is then
   taken once more), the checkpoints, the sinks' marks, the store's place and id.
4. Rename each staging directory into place; a failure removes every target written.

When `ftlayer serve --data-dir Di --shard i --shards M` starts, recovery replays every
stored record but the dead letters under a new root of its own (a restored store has
no journal), and a new query of the same sources (ft.address naming the M shards)
takes them in with its first batches: its replay cursors start at each new store's
(nothing of the old cursors carries over: a restored FT layer is a new one). The
starting offsets of that query (`ClusterRestore.starting_offsets`) are, per
partition, the position of the newest complete checkpoint of the part that owned the
partition: every record below it either completed or is in that part.
"""

from __future__ import annotations

import json
import re
import secrets
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from ftlayer.acking.ids import new_ids
from ftlayer.core import SOURCES_META_KEY
from ftlayer.core.retries import DEAD_LETTER, RETRY_PREFIX, RetryBook, RetryRecord
from ftlayer.errors import ConfigError, CorruptData
from ftlayer.persistence import LmdbStorage
from ftlayer.position import KafkaOffsets
from ftlayer.shards import MAX_SHARDS, partition_shard

from .savepoint import (
    RestoreResult,
    Savepoint,
    _check_empty_target,
    _dry_run_recovery,
    _fsync,
    _registrations,
    _starting_offsets,
    check_data,
    create_savepoint_from_data_dir,
    default_name,
    kafka_offsets_of,
    list_savepoints,
    load_savepoint,
    new_savepoint_id,
    open_stopped_store,
    restore_savepoint,
    store_place,
)

__all__ = [
    "ClusterRestore",
    "ShardRestore",
    "create_parts_from_data_dirs",
    "find_parts",
    "part_name",
    "restore_cluster",
]

_DATA_FILE: Final = "data.mdb"
_PART: Final = re.compile(r"(?P<name>.+)\.shard-(?P<shard>\d+)-of-(?P<shards>\d+)")


def part_name(name: str, shard: int, shards: int) -> str:
    """The name of shard `shard`'s part of the savepoint `name` of a cluster of `shards`
    (`name` itself for a single server)."""
    return name if shards == 1 else f"{name}.shard-{shard}-of-{shards}"


def create_parts_from_data_dirs(
    data_dirs: Sequence[str | Path], savepoints_dir: str | Path, name: str | None = None
) -> list[Savepoint]:
    """A savepoint of each stopped data dir (`create_savepoint_from_data_dir`), each
    named as the part of its store's place (`part_name`: a cluster's shards saved one at
    a time, or together, make one savepoint); several data dirs must be the shards of
    one cluster in shard order (ConfigError naming the first that is not), and their
    parts share a savepoint id, so a restore tells them from another savepoint's."""
    name = default_name() if name is None else name
    savepoint_id = new_savepoint_id() if len(data_dirs) > 1 else None
    places = []
    for data_dir in data_dirs:
        with open_stopped_store(data_dir) as storage:
            places.append(store_place(storage))
    for index, (data_dir, place) in enumerate(zip(data_dirs, places, strict=True)):
        if len(data_dirs) > 1 and (place.index, place.count) != (index, len(data_dirs)):
            raise ConfigError(
                f"the data dir {data_dir} holds {place}, but is listed as shard {index} of "
                f"{len(data_dirs)}: list every shard's data dir, in shard order"
            )
    return [
        create_savepoint_from_data_dir(
            d, savepoints_dir, part_name(name, p.index, p.count), savepoint_id
        )
        for d, p in zip(data_dirs, places, strict=True)
    ]


@dataclass(frozen=True, slots=True)
class ShardRestore:
    """What one target shard's data dir holds after a restore."""

    shard: int
    data_dir: Path
    stored_records: int
    replays: dict[str, dict[int, int]]
    """Per source id: the replays recovery queues for each partition."""
    dead_letters: dict[str, int]

    def as_dict(self) -> dict[str, Any]:
        return {
            "shard": self.shard,
            "data_dir": str(self.data_dir),
            "stored_records": self.stored_records,
            "replays": {sid: {str(p): n for p, n in c.items()} for sid, c in self.replays.items()},
            "dead_letters": self.dead_letters,
        }


@dataclass(frozen=True, slots=True)
class ClusterRestore:
    """What `restore_cluster` wrote, and what the new query needs to know."""

    name: str
    parts: tuple[Savepoint, ...]
    shards: tuple[ShardRestore, ...]
    """One per shard of the restored FT layer, in shard order."""
    sources: dict[str, dict[str, Any]]
    partitions: int | None
    starting_offsets: dict[str, dict[str, dict[str, int]]]
    """Per checkpoint query name: the ftkafka `startingOffsets` for the new query."""

    @property
    def stored_records(self) -> int:
        return sum(shard.stored_records for shard in self.shards)

    def as_dict(self) -> dict[str, Any]:
        return {
            "savepoint": self.name,
            "from_shards": len(self.parts),
            "shards": [shard.as_dict() for shard in self.shards],
            "stored_records": self.stored_records,
            "sources": self.sources,
            "partitions": self.partitions,
            "starting_offsets": self.starting_offsets,
        }


def find_parts(savepoints_dir: str | Path, name: str) -> list[Savepoint]:
    """The parts of savepoint `name`, in shard order (step 1): ConfigError naming what
    is missing or does not fit."""
    root = Path(savepoints_dir)
    if (root / name / "manifest.json").is_file():
        single = load_savepoint(root, name)
        if single.shards != 1:
            raise ConfigError(
                f"savepoint {name!r} is part {single.shard} of a savepoint of "
                f"{single.shards} shards: restore the whole savepoint by its name without "
                "'.shard-...'"
            )
        return [single]
    if not root.is_dir():
        raise ConfigError(f"no savepoints directory {root}")
    found: dict[int, list[Savepoint]] = {}
    for saved in list_savepoints(root):
        match = _PART.fullmatch(saved.name)
        if match is None or match["name"] != name:
            continue
        if (saved.shard, saved.shards) != (int(match["shard"]), int(match["shards"])):
            raise CorruptData(
                f"savepoint {saved.name} holds shard {saved.shard} of {saved.shards}, "
                "not what its name says"
            )
        found.setdefault(saved.shards, []).append(saved)
    if not found:
        load_savepoint(root, name)  # ConfigError naming the savepoints there
    if len(found) > 1:
        raise ConfigError(
            f"savepoint {name!r} has parts of clusters of {sorted(found)} shards in {root}"
        )
    ((count, parts),) = found.items()
    have = {part.shard for part in parts}
    missing = [part_name(name, i, count) for i in range(count) if i not in have]
    if missing:
        raise ConfigError(
            f"savepoint {name!r} of {count} shards is incomplete in {root}: {missing} "
            "missing (`ftlayer savepoint create --server A,B,...` fetches every part into "
            "one directory)"
        )
    ids = {part.savepoint_id for part in parts}
    if len(ids) > 1:
        which = ", ".join(f"{part.name} of {part.savepoint_id}" for part in parts)
        raise CorruptData(
            f"savepoint {name!r} in {root} mixes parts of different savepoints ({which}): "
            "every part must come from one `ftlayer savepoint create`"
        )
    return sorted(parts, key=lambda part: part.shard)


def restore_cluster(
    savepoints_dir: str | Path,
    name: str,
    data_dirs: Sequence[str | Path],
    *,
    partitions: int | None = None,
) -> ClusterRestore:
    """Restore savepoint `name` (of one server or of a cluster) into `data_dirs`, the
    data dirs of the shards of the new FT layer in shard order (steps in the module
    docstring). Errors as `restore_savepoint`'s, with nothing left in any target."""
    # Step 1.
    parts = find_parts(savepoints_dir, name)
    targets = [Path(d) for d in data_dirs]
    if not 1 <= len(targets) <= MAX_SHARDS:
        raise ConfigError(f"a restore needs 1 to {MAX_SHARDS} data dirs, got {len(targets)}")
    if len({t.resolve() for t in targets}) != len(targets):
        raise ConfigError(f"a restore's data dirs must differ, got {[str(t) for t in targets]}")
    for target in targets:
        _check_empty_target(target)
    if len(targets) == len(parts):
        # Step 2.
        done: list[RestoreResult] = []
        try:
            for part, target in zip(parts, targets, strict=True):
                done.append(
                    restore_savepoint(savepoints_dir, part.name, target, partitions=partitions)
                )
        except BaseException:
            for result in done:
                shutil.rmtree(result.data_dir, ignore_errors=True)
            raise
        shards = tuple(
            ShardRestore(i, r.data_dir, r.stored_records, r.replays, r.dead_letters)
            for i, r in enumerate(done)
        )
        sources = done[0].sources
    else:
        shards, sources = _reshard(parts, targets, partitions)
    return ClusterRestore(
        name=name,
        parts=tuple(parts),
        shards=shards,
        sources=sources,
        partitions=partitions,
        starting_offsets=_merged_starting_offsets(parts, partitions),
    )


def _reshard(
    parts: Sequence[Savepoint], targets: Sequence[Path], partitions: int | None
) -> tuple[tuple[ShardRestore, ...], dict[str, dict[str, Any]]]:
    """Step 3 and 4: every part's records moved to their shards among len(targets)."""
    count = len(targets)
    staging = [t.parent / f".{t.name}.restore-{secrets.token_hex(4)}" for t in targets]
    reading = targets[0].parent / f".{targets[0].name}.parts-{secrets.token_hex(4)}"
    stores: list[LmdbStorage] = []
    try:
        for path in staging:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.mkdir()
            stores.append(LmdbStorage(path))
        sources: dict[str, dict[str, Any]] = {}
        for part in parts:
            source_file = check_data(part)
            copy = reading / f"shard-{part.shard}"
            copy.mkdir(parents=True)
            shutil.copyfile(source_file, copy / _DATA_FILE)  # opening writes lock.mdb
            with LmdbStorage(copy) as saved:
                _check_count(part, saved)
                _merge_sources(sources, _registrations(saved), part)
                _move_records(saved, stores, count)
            shutil.rmtree(copy)
        if partitions is not None:
            sources = {sid: {**spec, "num_partitions": partitions} for sid, spec in sources.items()}
        restored = []
        for shard, store in enumerate(stores):
            store.update_meta({SOURCES_META_KEY: json.dumps(sources, sort_keys=True).encode()})
            replays, dead = _dry_run_recovery(store, sources, partitions)
            restored.append(ShardRestore(shard, targets[shard], len(store), replays, dead))
        for store in stores:
            store.close()
        stores = []
        for path in staging:
            (path / "lock.mdb").unlink(missing_ok=True)
            _fsync(path / _DATA_FILE)
            _fsync(path)
        renamed: list[Path] = []
        try:
            for path, target in zip(staging, targets, strict=True):
                _check_empty_target(target)
                if target.exists():
                    target.rmdir()
                path.rename(target)
                renamed.append(target)
                _fsync(target.parent)
        except BaseException:
            for target in renamed:
                shutil.rmtree(target, ignore_errors=True)
            raise
        return tuple(restored), sources
    finally:
        for store in stores:
            store.close()
        for path in staging:
            shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(reading, ignore_errors=True)


def _check_count(part: Savepoint, saved: LmdbStorage) -> None:
    stored = len(saved)
    if stored != part.stored_records:  # paranoid: a damaged copy
        raise CorruptData(
            f"savepoint {part.path} holds {stored} records, its manifest says "
            f"{part.stored_records}: the savepoint is damaged"
        )


def _merge_sources(
    into: dict[str, dict[str, Any]], found: Mapping[str, dict[str, Any]], part: Savepoint
) -> None:
    """Every shard registers each source alike: a part that differs is refused."""
    for sid, spec in found.items():
        known = into.setdefault(sid, spec)
        if known != spec:
            raise CorruptData(
                f"savepoint {part.name} registers source {sid} as {spec}, another part as "
                f"{known}: the parts are not of one FT layer"
            )


def _move_records(saved: LmdbStorage, stores: Sequence[LmdbStorage], count: int) -> None:
    """Every record of `saved` into the store of its partition's shard among `count`,
    with a root of that shard (a dead letter keeps its mark) and its retry record."""
    book = RetryBook(saved)
    for seqs, batch, replay_seqs in saved.scan():
        owners = partition_shard(batch.source_ids, batch.partitions, count)
        dead = replay_seqs == DEAD_LETTER
        for shard in np.unique(owners).tolist():
            rows = np.flatnonzero(owners == shard)
            moved = batch.take(rows)
            moved = moved.with_roots(np.where(dead[rows], 0, new_ids(len(rows), shard, count)))
            records = [book.get(int(seq)) for seq in seqs[rows].tolist()]

            def retries(
                new: NDArray[np.uint64], records: list[RetryRecord | None] = records
            ) -> dict[str, bytes]:
                return {
                    f"{RETRY_PREFIX}{int(seq):016x}": record.encode()
                    for seq, record in zip(new.tolist(), records, strict=True)
                    if record is not None
                }

            new = stores[shard].put(moved, retries)
            if dead[rows].any():
                marked = new[dead[rows]]
                stores[shard].set_roots(
                    marked,
                    np.zeros(len(marked), dtype=np.uint64),
                    np.full(len(marked), DEAD_LETTER, dtype=np.uint64),
                )


def _merged_starting_offsets(
    parts: Sequence[Savepoint], partitions: int | None
) -> dict[str, dict[str, dict[str, int]]]:
    """Per query, the startingOffsets of the parts' positions together: each partition
    at its own shard's position (the lower one, should two parts name it)."""
    merged: dict[str, KafkaOffsets] = {}
    for part in parts:
        for query, position in part.positions.items():
            offsets = kafka_offsets_of(position)
            if offsets is None:
                continue
            into = merged.setdefault(query, {})
            for topic, per_partition in offsets.items():
                for p, offset in per_partition.items():
                    known = into.setdefault(topic, {}).get(p)
                    into[topic][p] = offset if known is None else min(known, offset)
    starting = {}
    for query, offsets in sorted(merged.items()):
        found = _starting_offsets({"kafka": offsets}, partitions)
        if found is not None:
            starting[query] = found
    return starting
