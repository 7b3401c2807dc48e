"""A running server's savepoint part, brought over the wire into a savepoints directory
on the client's host (`ftlayer savepoint create --server A,B,... --dir D`).

Why over the wire. The shards of a cluster run on different hosts; had each written its
part into a directory on its own disk, the savepoint would lie in pieces across
machines and `restore` would need them gathered by hand. Instead each server writes its
part into its spool (`<data dir>/savepoint-spool/<name>`, the same compacted LMDB copy
and manifest as any savepoint, ftlayer.checkpoint.savepoint), and the client copies it
into its own `--dir`, so one directory holds every part of a savepoint.

Fetching one part (`fetch_part`):

1. Check the name and that `<dir>/<name>` does not exist; make the hidden staging
   directory `<dir>/.<name>.partial-<random>/data`.
2. SAVEPOINT with "dir" null: the server deletes the completed records, replaces
   whatever its spool held by this part, and replies with its manifest (its
   `data_bytes`, `data_sha256` and `savepoint_id`).
3. SAVEPOINT_READ chunk after chunk (`chunk_bytes` each, ftlayer.wire.parts) into the
   staging data file, hashing as they come. A chunk shorter than asked for before
   `data_bytes`, or bytes past it, mean the spooled file is not what the manifest says.
4. Check the size and the SHA-256 against the manifest; write the manifest; fsync the
   data file, the manifest and the directories.
5. Rename the staging directory to `<name>`, then SAVEPOINT_READ with `release`: the
   server deletes its spooled copy.

A cut connection, a full disk or a checksum that does not match stops the fetch with
an error that names the part, the server and how far it got; the staging directory is
removed, so no savepoint appears (`list` ignores `.partial` directories, and a restore
refuses a part whose data file does not match its manifest, `check_data`). The spooled
copy stays on the server until the next SAVEPOINT or a release: one part at a time,
and at most `ftlayer serve --spool-idle-s` (15 minutes) after its last read: a fetch
that was given up (its client died, its host went away) does not keep a copy of the
store on the server's disk (`expire_spooled`, from the server's ticker).
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, Protocol, TypeVar

from ftlayer.errors import CorruptData, FTLayerError, StateConflict, StorageError
from ftlayer.persistence import LmdbStorage

from .savepoint import (
    DATA,
    MANIFEST,
    Savepoint,
    _check_name,
    _fsync,
    _write_json,
    create_savepoint,
    load_savepoint,
)

__all__ = [
    "CHUNK_BYTES",
    "SPOOL_DIR",
    "SPOOL_IDLE_S",
    "PartFetchFailed",
    "PartReader",
    "expire_spooled",
    "fetch_part",
    "read_spooled",
    "release_spooled",
    "spool_part",
]

SPOOL_DIR: Final = "savepoint-spool"
"""The server's spool, inside its data dir: at most one part, waiting to be fetched."""
SPOOL_IDLE_S: Final = 900.0
"""How long a spooled part is kept after it was made or last read (the default of
`ftlayer serve --spool-idle-s`)."""
CHUNK_BYTES: Final = 4 << 20
"""The bytes one SAVEPOINT_READ asks for: large enough that the round trips cost little,
small enough for a frame of any configured size above it."""
_DATA_FILE: Final = "data.mdb"
T = TypeVar("T")
log = logging.getLogger("ftlayer.checkpoint.fetch")


# ---- the server's side -------------------------------------------------------------


def spool_part(
    storage: LmdbStorage, name: str | None, savepoint_id: str | None = None
) -> Savepoint:
    """Step 2 on the server: a savepoint of `storage` into its spool, replacing what the
    spool held (a part never fetched or released)."""
    spool = Path(storage.path) / SPOOL_DIR
    if spool.exists():
        shutil.rmtree(spool)
    return create_savepoint(storage, spool, name, savepoint_id=savepoint_id)


def read_spooled(data_dir: str | os.PathLike[str], name: str, offset: int, length: int) -> bytes:
    """Step 3 on the server: `length` bytes at `offset` of the spooled part `name`'s
    data file (fewer at its end). StateConflict if the spool does not hold it."""
    path = _spooled(data_dir, name)
    with path.open("rb") as data:
        data.seek(offset)
        chunk = data.read(length)
    os.utime(path.parent.parent)  # read just now: not idle (expire_spooled)
    return chunk


def expire_spooled(data_dir: str | os.PathLike[str], idle_s: float, now: float) -> list[str]:
    """Delete the spooled parts neither made nor read in the last `idle_s` seconds
    (their directory's mtime, which `read_spooled` sets) as of `now` (time.time());
    returns their names. A part being fetched is read every few seconds, so only a
    fetch given up leaves one this old."""
    spool = Path(data_dir) / SPOOL_DIR
    try:
        parts = list(spool.iterdir())
    except FileNotFoundError:
        return []
    expired = []
    for part in parts:
        try:
            idle = now - part.stat().st_mtime
        except FileNotFoundError:  # released meanwhile
            continue
        if idle > idle_s:
            shutil.rmtree(part, ignore_errors=True)
            expired.append(part.name)
            log.warning(
                "deleted the savepoint part %r from this server's spool: nobody read it "
                "for %.0f s (--spool-idle-s %g); a client that still wants it must "
                "create the savepoint again",
                part.name,
                idle,
                idle_s,
            )
    return expired


def release_spooled(data_dir: str | os.PathLike[str], name: str) -> None:
    """Step 5 on the server: delete the spooled part `name` (StateConflict if absent)."""
    _spooled(data_dir, name)
    shutil.rmtree(Path(data_dir) / SPOOL_DIR / name)


def _spooled(data_dir: str | os.PathLike[str], name: str) -> Path:
    _check_name(name)  # a name, never a path
    path = Path(data_dir) / SPOOL_DIR / name / DATA / _DATA_FILE
    if not path.is_file():
        raise StateConflict(
            f"this server's spool holds no savepoint part {name!r}: it was released, a "
            "later SAVEPOINT replaced it, or nobody read it for --spool-idle-s; create "
            "the savepoint again"
        )
    return path


# ---- the client's side -------------------------------------------------------------


class PartReader(Protocol):
    """What `fetch_part` needs of a client (FTClient has it)."""

    address: str

    def savepoint(
        self, directory: str | None, name: str | None = None, *, savepoint_id: str | None = None
    ) -> dict[str, Any]: ...

    def read_savepoint(self, name: str, offset: int, length: int) -> bytes: ...

    def release_savepoint(self, name: str) -> None: ...


def fetch_part(
    client: PartReader,
    savepoints_dir: str | os.PathLike[str],
    name: str,
    *,
    savepoint_id: str | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> Savepoint:
    """Have the server behind `client` save its store as `name` and copy that part into
    `savepoints_dir` on this host (steps in the module docstring). StateConflict if
    `name` exists there; StorageError naming the part if this host cannot write it
    (disk full, no permission); CorruptData if the bytes do not match the manifest;
    PartFetchFailed (the cause chained) if the server cannot finish: a cut connection,
    an error reply. Whatever fails, no savepoint `name` is left behind."""
    root = Path(savepoints_dir)
    # Step 1.
    _check_name(name)
    final = root / name
    if root.exists() and not root.is_dir():
        raise StorageError(f"the savepoints directory {root} exists and is not a directory")
    if final.exists():
        raise StateConflict(f"a savepoint named {name!r} already exists in {root}")
    staging = root / f".{name}.partial-{secrets.token_hex(4)}"
    fetch = _Fetch(client, name)
    try:
        try:
            (staging / DATA).mkdir(parents=True)
        except OSError as exc:
            raise fetch.write_error(root, exc) from None
        # Step 2.
        manifest = fetch.remote(lambda: client.savepoint(None, name, savepoint_id=savepoint_id))
        manifest = {key: value for key, value in manifest.items() if key != "path"}
        fetch.total = int(manifest["data_bytes"])
        # Step 3.
        digest = hashlib.sha256()
        try:
            out = (staging / DATA / _DATA_FILE).open("wb")
        except OSError as exc:
            raise fetch.write_error(root, exc) from None
        with out:
            while fetch.received <= fetch.total:
                chunk = fetch.remote(
                    lambda: client.read_savepoint(name, fetch.received, chunk_bytes)
                )
                if not chunk:
                    break
                digest.update(chunk)
                try:
                    out.write(chunk)
                except OSError as exc:
                    raise fetch.write_error(root, exc) from None
                fetch.received += len(chunk)
                if len(chunk) < chunk_bytes:
                    break
            try:
                out.flush()
                os.fsync(out.fileno())
            except OSError as exc:
                raise fetch.write_error(root, exc) from None
        # Step 4.
        if fetch.received != fetch.total or digest.hexdigest() != manifest.get("data_sha256"):
            raise CorruptData(
                f"{fetch.where}: received {fetch.received:,} bytes with SHA-256 "
                f"{digest.hexdigest()}, its manifest says {fetch.total:,} bytes with "
                f"{manifest.get('data_sha256')}; no savepoint was written"
            )
        try:
            _write_json(staging / MANIFEST, manifest)
            _fsync(staging / DATA)
            _fsync(staging)
            # Step 5.
            staging.rename(final)
        except OSError as exc:
            raise fetch.write_error(root, exc) from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    try:
        _fsync(root)
    except OSError as exc:
        raise StorageError(
            f"savepoint part {name!r} was written to {final}, but {root} could not be "
            f"synced ({exc.strerror or exc}): an OS crash may still lose it"
        ) from None
    try:
        client.release_savepoint(name)
    except FTLayerError as exc:  # the part is here whole; the spool keeps a copy
        log.warning(
            "%s is saved in %s, but the server did not release its spooled copy (%s): "
            "it stays there until the next savepoint",
            fetch.where,
            final,
            exc,
        )
    return load_savepoint(root, name)


class PartFetchFailed(FTLayerError):
    """The server could not hand over its part (a cut connection, an error reply); the
    message names the part, the server and the bytes received; nothing was written."""


class _Fetch:
    """One part's fetch: what it is and how far it got, for its errors."""

    def __init__(self, client: PartReader, name: str) -> None:
        self.where = f"savepoint part {name!r} from {client.address}"
        self.received = 0
        self.total: int | None = None

    def remote(self, call: Callable[[], T]) -> T:
        try:
            return call()
        except FTLayerError as exc:
            if self.total is None:
                progress = "before any of its data"
            else:
                progress = f"after {self.received:,} of {self.total:,} bytes"
            raise PartFetchFailed(
                f"fetching {self.where} failed {progress}: {exc}; no savepoint was written"
            ) from exc

    def write_error(self, root: Path, exc: OSError) -> StorageError:
        at = f" ({exc.filename})" if exc.filename else ""
        return StorageError(
            f"could not write {self.where} into {root}: {exc.strerror or exc}{at}; "
            "no savepoint was written"
        )
