"""The acker journal: ack values that survive a crash of the FT-layer process.

The store (LMDB, fsync'ed) already keeps every record that is not complete, under its
current root, with its replay seq and retry record. What it does not keep are the ack
values, so without more a restart can only replay every stored record, including trees
that live tasks were about to complete. The journal keeps the rest, cheaply:

- a *base*: the state at one moment (every pending root with its ack value, the replay
  queue, its prune points, the open barrier holds, the open tree-mode ranges' arrays):
  the state snapshot (`FTLayer.state_snapshot`), written to `base-<k>` by the server's
  checkpoint writer when a base was due at a barrier, or by the core itself when no
  checkpoint came for `max_segment_bytes` of journal;
- *segments* `seg-<k>`: what happened to the ack values since base k, appended as it is
  applied, one os.write per request (no user-space buffer, no fsync: a killed process
  keeps what it wrote, the kernel has it): XOR events and first ack values (`xor`),
  roots that became pending with ack value 0 (`add`: requeued records waiting to be
  emitted again), roots whose trees completed or were taken over (`gone`), barrier
  holds drawn (`hold`) and released (`release`), replay queue prunes (`prune`), and
  failures of batch-range rows noted but not applied yet (`note`,
  ftlayer.core.failnotes: their roots, causes and time, with a checksum) and the
  moment they were (`notes_applied`); and what happened to tree-mode ranges
  (ftlayer.core.rangeacks), kept in order because a read starts its records over:
  a range opened (`range_open`), a read and its seed (`range_read`), events applied
  to the ranges' arrays (`range_xor`). A sink's released holds of range roots become
  range events in that order too.

A snapshot that is to be a base starts a new segment (`rotate`, under the core's lock,
at the moment the state is copied), so base k plus segments k, k+1, ... is the state
now. Once base k is written, older segments and bases are deleted: the journal is
truncated at a checkpoint once it has grown by about a base's size (at least 1 MiB;
ftlayer.core.recovery.journal_base_due), so a checkpoint per micro-batch does not write a base per
micro-batch, and recovery reads about twice a base at most.

Recovery (`Journal.recover`) reads the newest complete base and the segments from its
number on, and gives per root: its ack value (the XOR of the base's and every later
pair of that root; root ids are random and never reused, so pairs of other roots do
not mix in), whether it is gone, and the open holds per source. Recovery (ftlayer.core.recovery)
then restores each stored record whose root the journal knows (pending, with its ack
value; in the replay queue under its old replay seq if no finished batch took it in),
deletes the stored records of trees that completed (their delete was still staged),
and replays only the records the journal does not know (their persist's journal write
was lost with the process).

What it cannot survive is the loss of the page cache: after a machine crash the
journal may miss its tail or hold garbage. It is then not read at all (the boot id the
journal was written under differs from the running kernel's) and recovery replays
every stored record, as it did before the journal: duplicates, nothing lost. A record
the journal reads back with a bad header or checksum ends the reading of its segment
and of every later one; a root whose events were cut off that way stays pending with
a wrong ack value and times out (a replay), and a tree is only ever taken as complete
from a `gone` record whose checksum holds.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from ftlayer.causes import Cause, Causes
from ftlayer.errors import ConfigError, CorruptData, StorageError
from ftlayer.rangeroots import is_range_root

from .statecodec import decode_snapshot

__all__ = ["JOURNAL_DIR", "RANGE_OPEN", "RANGE_READ", "RANGE_XOR", "Journal", "JournalState"]

JOURNAL_DIR: Final = "journal"
"""The journal's directory inside a server's data dir."""

log = logging.getLogger(__name__)

_MAGIC: Final = 0x4A4C  # "JL"
_HEADER: Final = struct.Struct("<HBBIQ")  # magic, type, reserved, count, aux
_XOR: Final = 1  # count pairs: roots, values
_ADD: Final = 2  # count roots, ack value 0
_GONE: Final = 3  # count roots; aux: crc32 of the roots
_HOLD: Final = 4  # count pairs; aux: source id
_RELEASE: Final = 5  # count source ids
_PRUNE: Final = 6  # count 0 (every source) or 1 source id; aux: upto
_NOTE: Final = 7  # count words: n, table bytes, time, n roots, the causes; aux: crc32
_NOTE_HEAD: Final = 3  # the words before the roots
_APPLIED: Final = 8  # count 0: every note before it was applied
_RANGE_OPEN: Final = 9  # count 1: a tree-mode range's number
_RANGE_READ: Final = 10  # count 3: first range root, records, seed
_RANGE_XOR: Final = 11  # count pairs: range roots, values
_LAST_KIND: Final = _RANGE_XOR
_PAIRS: Final = (_XOR, _HOLD, _RANGE_XOR)  # records of count (root, value) pairs
RANGE_OPEN: Final = _RANGE_OPEN
RANGE_READ: Final = _RANGE_READ
RANGE_XOR: Final = _RANGE_XOR
_SEG = re.compile(r"^seg-(\d{12})$")
_BASE = re.compile(r"^base-(\d{12})$")
_BOOT_FILE: Final = "boot_id"
_EMPTY: NDArray[np.uint64] = np.zeros(0, dtype=np.uint64)
DEFAULT_MAX_SEGMENT_BYTES: Final = 256 << 20


def boot_id() -> str:
    """The running kernel's boot id ('' where there is none: then every restart counts
    as a reboot, which only costs the full replay)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


@dataclass
class JournalState:
    """What a journal read back: the ack value of every root it knows, the roots gone,
    the open holds, the replay queue of its base, the prune points."""

    roots: NDArray[np.uint64] = field(default_factory=lambda: _EMPTY)  # sorted, unique
    acks: NDArray[np.uint64] = field(default_factory=lambda: _EMPTY)
    gone: NDArray[np.uint64] = field(default_factory=lambda: _EMPTY)  # sorted, unique
    holds: dict[int, tuple[NDArray[np.uint64], NDArray[np.uint64]]] = field(default_factory=dict)
    queue: dict[str, NDArray[Any]] = field(default_factory=dict)  # the base's, if any
    pruned: dict[int | None, int] = field(default_factory=dict)
    base: int | None = None
    base_next_seq: int = 0  # the store's next seq when the base was taken
    base_seqs: NDArray[np.uint64] = field(default_factory=lambda: _EMPTY)  # pending then, sorted
    # Stored at or past base_next_seq by persists that had ended by the base (sorted).
    base_ended: NDArray[np.uint64] = field(default_factory=lambda: _EMPTY)
    notes: list[tuple[NDArray[np.uint64], Causes, float]] = field(default_factory=list)
    """Failures noted (ftlayer.core.failnotes), in order: (roots, causes, wall time)."""
    range_ops: list[tuple[int, NDArray[np.uint64]]] = field(default_factory=list)
    """What happened to tree-mode ranges since the base, in order (ftlayer.core.rangeacks
    applies it again): (RANGE_OPEN, [number]), (RANGE_READ, [first root, records, seed]),
    (RANGE_XOR, roots then values); a sink's released holds of range roots are
    RANGE_XOR ops at their release."""
    ranges: dict[str, NDArray[Any]] = field(default_factory=dict)
    """The base's tree-mode ranges (`tranges.*` columns), if any."""
    segments: int = 0
    records: int = 0
    truncated: str | None = None  # why reading stopped early, if it did

    def known(self, roots: NDArray[np.uint64]) -> tuple[NDArray[np.bool_], NDArray[np.uint64]]:
        """(whether the journal knows each root, its ack value where it does)."""
        return _lookup(self.roots, self.acks, roots)

    def done_before_base(self, seqs: NDArray[np.uint64]) -> NDArray[np.bool_]:
        """Records stored before the base that were not pending at it: their trees
        completed (or were taken over) before the base, and their "gone" records went
        with the segments the base truncated. (The caller leaves out records with a
        retry record: a dead letter requeued since would look the same.)"""
        older = seqs < np.uint64(self.base_next_seq)
        if len(self.base_ended):
            older |= _member(self.base_ended, seqs)
        if not len(self.base_seqs):
            return older
        return np.asarray(older & ~_member(self.base_seqs, seqs), dtype=np.bool_)

    def is_gone(self, roots: NDArray[np.uint64]) -> NDArray[np.bool_]:
        return _member(self.gone, roots)


class Journal:
    """Append-only segments and bases in one directory; see the module docstring.

    Not thread-safe for appends (the core's lock serializes them); `write_base` may run
    in another thread while appends go on (it writes a file of its own and deletes only
    files older than its base)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_segment_bytes: int = DEFAULT_MAX_SEGMENT_BYTES,
    ) -> None:
        if max_segment_bytes < 1:
            raise ConfigError(f"max_segment_bytes must be positive, got {max_segment_bytes}")
        self.directory = os.fspath(directory)
        self.max_segment_bytes = max_segment_bytes
        os.makedirs(self.directory, exist_ok=True)
        self._fd: int | None = None
        self.segment = 0
        self.segment_bytes = 0
        self.bytes_written = 0
        self.bases_written = 0
        self.broken: str | None = None
        """Why appends stopped (a write failed: a full disk), until the next rotate."""
        self._trusted = self._same_boot()

    # ---- recovery ------------------------------------------------------------------

    def recover(self) -> JournalState | None:
        """What the journal holds, or None when it cannot be trusted (written before a
        reboot) or holds nothing; then opens a fresh segment for appending. Call once,
        before any append."""
        if self._fd is not None:
            raise StorageError("the journal is already open for appending")
        state: JournalState | None = None
        segs, bases = self._files()
        if not self._trusted:
            if segs or bases:
                log.warning(
                    "the FT-layer journal in %s was written before the machine restarted: "
                    "it may have lost writes, so it is not read, and every stored record and "
                    "every record of an open batch range is replayed (duplicates, nothing lost)",
                    self.directory,
                )
        elif segs or bases:
            state = self._read(segs, bases)
        newest = max([*segs, *bases, 0])
        self._open(newest + 1)
        self._delete_older_than(newest + 1)
        self._write_boot_id()
        return state

    def _read(self, segs: list[int], bases: list[int]) -> JournalState:
        state = JournalState()
        pairs_roots: list[NDArray[np.uint64]] = []
        pairs_values: list[NDArray[np.uint64]] = []
        gone: list[NDArray[np.uint64]] = []
        holds: dict[int, list[tuple[NDArray[np.uint64], NDArray[np.uint64]]]] = {}
        for k in sorted(bases, reverse=True):
            base = self._read_base(k)
            if base is not None:
                state.base = k
                if "journal.next_seq" in base:
                    state.base_next_seq = int(base["journal.next_seq"][0])
                    state.base_seqs = np.sort(base["acker.seq"])
                    if "journal.ended_seqs" in base:
                        state.base_ended = np.sort(base["journal.ended_seqs"])
                pairs_roots.append(base["acker.root"])
                pairs_values.append(base["acker.ack"])
                for source, root, value in _holds_of(base):
                    holds.setdefault(source, []).append((root, value))
                state.queue = {
                    name[len("queue.") :]: column
                    for name, column in base.items()
                    if name.startswith("queue.")
                }
                if "replay.next_seq" in base:
                    state.queue["next_seq"] = base["replay.next_seq"]
                state.pruned = _pruned_of(base)
                state.ranges = {
                    name: column for name, column in base.items() if name.startswith("tranges.")
                }
                break
        first = 0 if state.base is None else state.base
        for k in sorted(s for s in segs if s >= first):
            if state.truncated is not None:
                break
            state.segments += 1
            with open(self._path("seg", k), "rb") as f:
                data = f.read()
            offset = 0
            while offset < len(data):
                parsed = _parse(data, offset)
                if isinstance(parsed, str):
                    state.truncated = f"segment {k} at byte {offset}: {parsed}"
                    break
                kind, count, aux, payload, offset = parsed
                state.records += 1
                if kind == _XOR:
                    pairs_roots.append(payload[:count])
                    pairs_values.append(payload[count:])
                elif kind in (_RANGE_OPEN, _RANGE_XOR):
                    state.range_ops.append((kind, payload))
                elif kind == _RANGE_READ:
                    state.range_ops.append((kind, payload))
                    _discard_held(holds, int(payload[0]), int(payload[1]))
                elif kind == _ADD:
                    pairs_roots.append(payload)
                    pairs_values.append(np.zeros(count, dtype=np.uint64))
                elif kind == _GONE:
                    gone.append(payload)
                elif kind == _HOLD:
                    holds.setdefault(aux, []).append((payload[:count], payload[count:]))
                elif kind == _RELEASE:
                    for released in payload.tolist():
                        for root, value in holds.pop(int(released), []):
                            ranged = is_range_root(root)
                            if bool(ranged.any()):  # a sink's acks of tree-mode range records
                                both = np.concatenate([root[ranged], value[ranged]])
                                state.range_ops.append((_RANGE_XOR, both))
                                root, value = root[~ranged], value[~ranged]
                            pairs_roots.append(root)
                            pairs_values.append(value)
                elif kind == _PRUNE:
                    which = None if count == 0 else int(payload[0])
                    state.pruned[which] = max(state.pruned.get(which, 0), aux)
                elif kind == _NOTE:
                    note = _read_note(payload)
                    if isinstance(note, str):
                        state.truncated = f"segment {k}, before byte {offset}: {note}"
                        break
                    state.notes.append(note)
                elif kind == _APPLIED:
                    state.notes.clear()
        if state.truncated is not None:
            log.warning(
                "the FT-layer journal ends early (%s): later events are lost, and "
                "their trees time out (replays, nothing lost)",
                state.truncated,
            )
        state.roots, state.acks = _xor_reduce(pairs_roots, pairs_values)
        state.gone = np.unique(np.concatenate(gone)) if gone else _EMPTY
        state.holds = {
            source: (np.concatenate([r for r, _ in chunks]), np.concatenate([v for _, v in chunks]))
            for source, chunks in holds.items()
            if chunks
        }
        return state

    def _read_base(self, k: int) -> dict[str, NDArray[Any]] | None:
        try:
            with open(self._path("base", k), "rb") as f:
                return decode_snapshot(f.read())
        except (OSError, ValueError) as exc:
            log.warning("ignoring the unreadable journal base %d: %s", k, exc)
            return None

    # ---- appending -------------------------------------------------------------------

    def xor(self, roots: NDArray[np.uint64], values: NDArray[np.uint64]) -> None:
        """XOR events applied (or first ack values of roots now pending)."""
        if len(roots):
            self._append(_XOR, len(roots), 0, roots, values)

    def add(self, roots: NDArray[np.uint64]) -> None:
        """Roots now pending with ack value 0."""
        if len(roots):
            self._append(_ADD, len(roots), 0, roots)

    def gone(self, roots: NDArray[np.uint64]) -> None:
        """Roots whose trees completed (or were taken over): their records are deleted."""
        if len(roots):
            roots = np.ascontiguousarray(roots, dtype=np.uint64)
            self._append(_GONE, len(roots), zlib.crc32(roots.tobytes()), roots)

    def hold(self, source_id: int, roots: NDArray[np.uint64], values: NDArray[np.uint64]) -> None:
        if len(roots):
            self._append(_HOLD, len(roots), source_id, roots, values)

    def release(self, source_ids: Iterable[int]) -> None:
        ids = np.array(sorted({int(s) for s in source_ids}), dtype=np.uint64)
        if len(ids):
            self._append(_RELEASE, len(ids), 0, ids)

    def prune(self, upto: int, source_id: int | None) -> None:
        if source_id is None:
            self._append(_PRUNE, 0, upto)
        else:
            self._append(_PRUNE, 1, upto, np.array([source_id], dtype=np.uint64))

    def range_open(self, number: int) -> None:
        """A tree-mode range opened under `number` (ops on an earlier range of that
        number, before this record, are not this one's)."""
        self._append(_RANGE_OPEN, 1, 0, np.array([number], dtype=np.uint64))

    def range_read(self, first: int, n: int, seed: int) -> None:
        """A read of `n` records of a tree-mode range from the range root `first` on,
        under `seed` (ftlayer.core.rangeacks.read)."""
        self._append(_RANGE_READ, 3, 0, np.array([first, n, seed], dtype=np.uint64))

    def range_xor(self, roots: NDArray[np.uint64], values: NDArray[np.uint64]) -> None:
        """XOR events applied to tree-mode ranges' ack values."""
        if len(roots):
            self._append(_RANGE_XOR, len(roots), 0, roots, values)

    def note(self, roots: NDArray[np.uint64], causes: Causes, at: float) -> None:
        """Failures noted, not applied yet (ftlayer.core.failnotes); `at`: wall time."""
        n = len(roots)
        table = json.dumps([c.to_json() for c in causes.table], separators=(",", ":")).encode()
        tail = causes.index.astype("<u2", copy=False).tobytes() + table
        tail += bytes(-len(tail) % 8)
        head = np.array([n, len(table), 0], dtype=np.uint64)
        head[2:3] = np.array([at], dtype=np.float64).view(np.uint64)
        payload = np.concatenate(
            [head, np.ascontiguousarray(roots, dtype=np.uint64), np.frombuffer(tail, np.uint64)]
        )
        self._append(_NOTE, len(payload), zlib.crc32(payload.tobytes()), payload)

    def notes_applied(self) -> None:
        """Every note so far was applied: a restart reads none of them."""
        self._append(_APPLIED, 0, 0)

    @property
    def trusted(self) -> bool:
        """False when the journal was written before the machine restarted: `recover`
        did not read it, and what it held may be lost."""
        return self._trusted

    @property
    def wants_base(self) -> bool:
        """Whether the segment outgrew max_segment_bytes: the owner should write a base."""
        return self.segment_bytes >= self.max_segment_bytes

    def _append(self, kind: int, count: int, aux: int, *arrays: NDArray[np.uint64]) -> None:
        fd = self._fd
        if fd is None:
            if self.broken is not None:
                return
            raise StorageError("the journal is not open (call recover() first)")
        parts: list[Any] = [_HEADER.pack(_MAGIC, kind, 0, count, aux)]
        parts += [np.ascontiguousarray(a, dtype=np.uint64) for a in arrays]
        size = sum(memoryview(p).nbytes for p in parts)
        try:
            written = os.writev(fd, parts)
        except OSError as exc:
            self._break(str(exc))
            return
        if written != size:  # a full disk: the record is cut, so nothing after it counts
            self._break(f"it took {written} of {size} bytes")
            return
        self.segment_bytes += size
        self.bytes_written += size

    def _break(self, why: str) -> None:
        """A write failed (a full disk): the request it belongs to was applied, so it
        must not fail. The journal is dropped instead (every file deleted, which also
        frees room), so a crash from now on replays every stored record (duplicates,
        nothing lost), until the next rotate starts it again from a base."""
        self.broken = why
        log.error(
            "could not write the FT-layer journal in %s (%s): it is dropped; until the "
            "next checkpoint writes a base, a crash replays every stored record "
            "(duplicates, nothing lost)",
            self.directory,
            why,
        )
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(OSError):
            self.clear()

    # ---- bases and truncation ----------------------------------------------------------

    def rotate(self) -> int:
        """Start segment k+1 at this moment (the caller copies the state now, under the
        same lock); returns its number, the base number of that state. A broken journal
        starts again here: base k+1 plus what follows is the whole state."""
        try:
            self._open(self.segment + 1)
        except OSError as exc:
            if self.broken is None:
                self._break(str(exc))
            return self.segment + 1
        self.broken = None
        return self.segment

    def write_base(self, k: int, blob: bytes) -> None:
        """Write base k (an encoded state snapshot taken when segment k began), then
        delete the older segments and bases. Atomic: a crash leaves base k whole or
        absent. May run outside the core's lock."""
        path = self._path("base", k)
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
        self.bases_written += 1
        self._delete_older_than(k)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def clear(self) -> None:
        """Delete every segment and base (a store restored from a savepoint: its roots
        are not the journal's)."""
        self.close()
        for name in os.listdir(self.directory):
            if _SEG.match(name) or _BASE.match(name) or name.endswith(".tmp"):
                os.unlink(os.path.join(self.directory, name))

    # ---- files -----------------------------------------------------------------------

    def _open(self, k: int) -> None:
        fd = os.open(self._path("seg", k), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self.segment, self.segment_bytes = fd, k, 0

    def _path(self, kind: str, k: int) -> str:
        return os.path.join(self.directory, f"{kind}-{k:012d}")

    def _files(self) -> tuple[list[int], list[int]]:
        segs: list[int] = []
        bases: list[int] = []
        for name in os.listdir(self.directory):
            if m := _SEG.match(name):
                segs.append(int(m.group(1)))
            elif m := _BASE.match(name):
                bases.append(int(m.group(1)))
        return segs, bases

    def _delete_older_than(self, k: int) -> None:
        """Segments and bases below k (never the open segment), and the newest base
        below k only if base k exists."""
        has_base = os.path.exists(self._path("base", k))
        segs, bases = self._files()
        for s in segs:
            if s < k and s != self.segment and has_base:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._path("seg", s))
        for b in bases:
            if b < k and has_base:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._path("base", b))

    def _same_boot(self) -> bool:
        path = os.path.join(self.directory, _BOOT_FILE)
        try:
            with open(path, encoding="ascii") as f:
                written = f.read().strip()
        except FileNotFoundError:
            return True  # a new journal: nothing to distrust
        current = boot_id()
        return bool(current) and written == current

    def _write_boot_id(self) -> None:
        path = os.path.join(self.directory, _BOOT_FILE)
        with open(path + ".tmp", "w", encoding="ascii") as f:
            f.write(boot_id())
        os.replace(path + ".tmp", path)


def _parse(data: bytes, offset: int) -> tuple[int, int, int, NDArray[np.uint64], int] | str:
    """One record at `offset`: (type, count, aux, payload, next offset), or why not."""
    end = offset + _HEADER.size
    if end > len(data):
        return "a cut header"
    magic, kind, _reserved, count, aux = _HEADER.unpack_from(data, offset)
    if magic != _MAGIC or not _XOR <= kind <= _LAST_KIND:
        return "a bad header"
    words = 2 * count if kind in _PAIRS else count
    stop = end + 8 * words
    if stop > len(data):
        return "a cut record"
    payload = np.frombuffer(data, dtype=np.uint64, count=words, offset=end)
    if kind in (_GONE, _NOTE) and zlib.crc32(payload.tobytes()) != aux:
        return "a bad checksum"
    return kind, count, aux, payload, stop


def _discard_held(
    holds: dict[int, list[tuple[NDArray[np.uint64], NDArray[np.uint64]]]], first: int, n: int
) -> None:
    """A read of range roots [first, first + n) starts their trees over: the acks a sink
    held for an earlier read of them go (as `OpenHolds.discard` does live)."""
    lo, hi = np.uint64(first), np.uint64(first + n)
    for chunks in holds.values():
        for i, (root, value) in enumerate(chunks):
            keep = (root < lo) | (root >= hi)
            if not bool(keep.all()):
                chunks[i] = (root[keep], value[keep])


def _read_note(payload: NDArray[np.uint64]) -> tuple[NDArray[np.uint64], Causes, float] | str:
    """A `note` record's (roots, causes, time), or why it cannot be read."""
    if len(payload) < _NOTE_HEAD:
        return "a cut note"
    n, table_bytes = int(payload[0]), int(payload[1])
    at = float(payload[2:3].view(np.float64)[0])
    tail = payload[_NOTE_HEAD + n :].tobytes()
    if len(payload) < _NOTE_HEAD + n or len(tail) < 2 * n + table_bytes:
        return "a cut note"
    try:
        table = tuple(Cause.from_json(c) for c in json.loads(tail[2 * n : 2 * n + table_bytes]))
        index = np.frombuffer(tail, dtype="<u2", count=n).astype(np.uint16)
        causes = Causes(table, index)
    except (ValueError, TypeError, KeyError, ConfigError, CorruptData) as exc:
        return f"a note's causes: {exc}"
    return payload[_NOTE_HEAD : _NOTE_HEAD + n].copy(), causes, at


def _xor_reduce(
    roots: list[NDArray[np.uint64]], values: list[NDArray[np.uint64]]
) -> tuple[NDArray[np.uint64], NDArray[np.uint64]]:
    """(sorted unique roots, the XOR of each root's values)."""
    if not roots:
        return _EMPTY, _EMPTY
    r = np.concatenate(roots)
    v = np.concatenate(values)
    if not len(r):  # records, all empty (a base with nothing pending, say)
        return _EMPTY, _EMPTY
    order = np.argsort(r, kind="stable")
    r, v = r[order], v[order]
    starts = np.flatnonzero(np.r_[True, r[1:] != r[:-1]])
    return r[starts], np.bitwise_xor.reduceat(v, starts) if len(v) else v


def _member(keys: NDArray[np.uint64], values: NDArray[np.uint64]) -> NDArray[np.bool_]:
    """Whether each of `values` is in the sorted `keys`."""
    if not len(keys):
        return np.zeros(len(values), dtype=np.bool_)
    at = np.minimum(np.searchsorted(keys, values), len(keys) - 1)
    return np.asarray(keys[at] == values, dtype=np.bool_)


def _lookup(
    keys: NDArray[np.uint64], values: NDArray[np.uint64], roots: NDArray[np.uint64]
) -> tuple[NDArray[np.bool_], NDArray[np.uint64]]:
    if not len(keys):
        return np.zeros(len(roots), dtype=np.bool_), np.zeros(len(roots), dtype=np.uint64)
    at = np.minimum(np.searchsorted(keys, roots), len(keys) - 1)
    found = keys[at] == roots
    return found, np.where(found, values[at], np.uint64(0))


def _holds_of(
    base: dict[str, NDArray[Any]],
) -> list[tuple[int, NDArray[np.uint64], NDArray[np.uint64]]]:
    sources = base.get("holds.source")
    if sources is None or not len(sources):
        return []
    roots, values = base["holds.root"], base["holds.value"]
    return [
        (int(s), roots[sources == s], values[sources == s]) for s in np.unique(sources).tolist()
    ]


def _pruned_of(base: dict[str, NDArray[Any]]) -> dict[int | None, int]:
    sources = base.get("pruned.source")
    if sources is None:
        return {}
    uptos = base["pruned.upto"]
    # Source -1 stands for "every source" (None).
    return {
        (None if int(s) < 0 else int(s)): int(u)
        for s, u in zip(sources.tolist(), uptos.tolist(), strict=True)
    }
