"""Bounded retries with backoff, and dead letters: what the FT layer remembers of a
record's failures.

Every failure of a record (an explicit fail with its cause, or a timeout) is one
attempt. After attempt n the record waits `RetryPolicy.delay_s(n)` before it enters
the replay queue (it gets its replay seq only then, so a batch's replay range stays
fixed); after attempt max_retries + 1, or at once for a failure marked final, it is
dead-lettered: its tree completes (group offsets move on) but the record stays stored,
with its history, until the dead-letter topic confirmed it or a user purged it.

The history of each record that failed (`RetryRecord`: attempts, first and last failure
time, the due time of its next replay, the causes, when it was dead-lettered) is kept
by storage seq in the store's meta entries under RETRY_PREFIX, written in the same
transaction as the record's new root, so retry counts and due times survive an
FT-layer SIGKILL and a savepoint restore (a savepoint copies the meta entries). Times
are wall-clock seconds (time.time()), so a due time means the same after a restart.

First failures stored as one entry (`FreshGroup`): a batch range's rows that one FAIL
names fail for the first time together (ftlayer.core.rangefail): one source, one
cause, one failure time; only their due times differ (the backoff's jitter). Their
retry records are one meta entry, a *group*, under RETRY_GROUP_PREFIX + its first seq
as 16 hex digits: the source id, the cause, the failure time and each seq's due time.
The group entry is binary, all little-endian: a format byte (1), the source id (u32),
the failure time (f64), the length of the cause's JSON (u32) and the count n (u32),
the cause's JSON, then the n seqs (u64) and their n due times (f64); a JSON object
(`{"source_id", "at", "cause", "seqs", "due"}`), as stores of earlier versions hold,
is read too.
The book gives a grouped record as the RetryRecord it stands for (`FreshGroup.record`),
and takes it out of its group when it changes (a second failure, a dead letter: it gets
an entry of its own) or goes (completed, purged): the group's entry is written again
without it, in the same transaction as the change, and deleted with its last record. A
record named both by an entry of its own and by a group is the entry of its own's.

Waiting for the backoff, in memory: a record that waits alone is an entry (due time,
seq, root) of a heap; the records of a first failure begin waiting together (a
*wave*, `wait_many`), one heap entry for them all with their due times, seqs and
roots as arrays in due order, from which `due` takes the ended ones by a binary
search. `due` returns them in (due time, seq, root) order across both; an entry whose
seq no longer waits under its root (completed, purged, waiting again) is skipped.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import json
import struct
from collections import Counter, deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, Final

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ftlayer.causes import Cause, FailKind
from ftlayer.errors import ConfigError, CorruptData
from ftlayer.persistence.base import PersistenceStorage
from ftlayer.policy import IMMEDIATE, RetryPolicy

__all__ = [
    "DEAD_LETTER",
    "IMMEDIATE",
    "RETRY_GROUP_PREFIX",
    "RETRY_PREFIX",
    "DeadLetterFilter",
    "FreshGroup",
    "RetryBook",
    "RetryPolicy",
    "RetryRecord",
]

RETRY_PREFIX: Final = "retry/"
"""Meta keys of the retry records: RETRY_PREFIX + the storage seq as 16 hex digits."""
DEAD_LETTER: Final = 0xFFFF_FFFF_FFFF_FFFF
"""The replay seq a dead-lettered record is stored with (its root is 0): never a real
replay seq, so recovery knows it is not to be replayed."""
KEPT_CAUSES: Final = 16
"""A record keeps the causes of its first 4 and its last 12 failures (and the count of
those left out between): enough to see how it started and how it goes on."""
_FIRST_CAUSES: Final = 4


@dataclass(slots=True)
class RetryRecord:
    """What the FT layer knows of one stored record's failures (see the module doc)."""

    source_id: int
    attempts: int = 0
    """Failed attempts so far (requeues from the dead letters included)."""
    first_failed: float = 0.0
    last_failed: float = 0.0
    due: float = 0.0
    """Wall-clock time its next replay may start (0: at once)."""
    causes: list[tuple[float, Cause]] = field(default_factory=list)
    omitted: int = 0
    """Causes left out between the first and the last ones kept."""
    dead_at: float | None = None
    requeued: int = 0
    budget_from: int = 0
    """`attempts` when it was last requeued: its retries count from there."""

    @property
    def failures(self) -> int:
        """Failures that count against max_retries: those since the last requeue."""
        return self.attempts - self.budget_from

    def add_failure(self, when: float, cause: Cause) -> None:
        if not self.attempts:
            self.first_failed = when
        self.attempts += 1
        self.last_failed = when
        self.causes.append((when, cause))
        if len(self.causes) > KEPT_CAUSES:
            del self.causes[_FIRST_CAUSES]
            self.omitted += 1

    def copy(self) -> RetryRecord:
        """A copy to change (the book's own changes only once its write succeeded)."""
        return dataclasses.replace(self, causes=list(self.causes))

    def requeued_copy(self, source_id: int | None = None) -> RetryRecord:
        """A copy for a dead letter put back for replay: not dead, due at once, its
        retry budget counted afresh from now; its history kept."""
        return dataclasses.replace(
            self,
            source_id=self.source_id if source_id is None else source_id,
            causes=list(self.causes),
            dead_at=None,
            due=0.0,
            requeued=self.requeued + 1,
            budget_from=self.attempts,
        )

    @property
    def last_cause(self) -> Cause | None:
        return self.causes[-1][1] if self.causes else None

    def to_json(self) -> dict[str, Any]:
        return {
            "source_id": self.source_id,
            "attempts": self.attempts,
            "first_failed": self.first_failed,
            "last_failed": self.last_failed,
            "due": self.due,
            "causes": [{"at": at, **cause.to_json()} for at, cause in self.causes],
            "omitted": self.omitted,
            "dead_at": self.dead_at,
            "requeued": self.requeued,
            "budget_from": self.budget_from,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RetryRecord:
        """Strict: CorruptData unless `data` is what to_json wrote (counts are ints, times
        are numbers, never bools or strings)."""
        try:
            causes = [
                (_number(c["at"]), Cause.from_json({k: v for k, v in c.items() if k != "at"}))
                for c in data["causes"]
            ]
            dead_at = data.get("dead_at")
            return cls(
                source_id=_integer(data["source_id"]),
                attempts=_integer(data["attempts"]),
                first_failed=_number(data["first_failed"]),
                last_failed=_number(data["last_failed"]),
                due=_number(data["due"]),
                causes=causes,
                omitted=_integer(data.get("omitted", 0)),
                dead_at=None if dead_at is None else _number(dead_at),
                requeued=_integer(data.get("requeued", 0)),
                budget_from=_integer(data.get("budget_from", 0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptData(f"bad retry record {dict(data)!r}: {exc}") from None

    def encode(self) -> bytes:
        return json.dumps(self.to_json(), separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True)
class DeadLetterFilter:
    """Which dead letters an operation takes: every field None matches all."""

    source_id: int | None = None
    partition: int | None = None
    kind: FailKind | None = None
    """The kind of the record's last failure."""
    since: float | None = None
    until: float | None = None
    """Dead-lettered at or after `since` and before `until` (wall clock)."""
    seqs: frozenset[int] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in ("source_id", "partition", "since", "until"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.kind is not None:
            out["cause"] = self.kind.label
        if self.seqs is not None:
            out["seqs"] = sorted(self.seqs)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DeadLetterFilter:
        """Strict: ConfigError naming what is wrong."""
        allowed = {"source_id", "partition", "cause", "since", "until", "seqs"}
        unknown = set(data) - allowed
        if unknown:
            raise ConfigError(f"unknown dead-letter filter fields {sorted(unknown)}")

        def number(name: str, kind: type) -> Any:
            value = data.get(name)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"dead-letter filter {name} must be a number, got {value!r}")
            if kind is int and not isinstance(value, int):
                raise ConfigError(f"dead-letter filter {name} must be an integer, got {value!r}")
            return value

        seqs = data.get("seqs")
        if seqs is not None and not (
            isinstance(seqs, list) and all(type(s) is int and s >= 0 for s in seqs)
        ):
            raise ConfigError(
                f"dead-letter filter seqs must be non-negative integers, got {seqs!r}"
            )
        cause = data.get("cause")
        return cls(
            source_id=number("source_id", int),
            partition=number("partition", int),
            kind=None if cause is None else FailKind.from_label(str(cause)),
            since=number("since", float),
            until=number("until", float),
            seqs=None if seqs is None else frozenset(seqs),
        )

    def matches(self, seq: int, record: RetryRecord, partition: int) -> bool:
        if self.seqs is not None and seq not in self.seqs:
            return False
        if self.source_id is not None and record.source_id != self.source_id:
            return False
        if self.partition is not None and partition != self.partition:
            return False
        last = record.last_cause
        if self.kind is not None and (last is None or last.kind != self.kind):
            return False
        at = record.dead_at or 0.0
        if self.since is not None and at < self.since:
            return False
        return not (self.until is not None and at >= self.until)


# ---- first failures stored as one entry (groups) -----------------------------------

RETRY_GROUP_PREFIX: Final = "retryg/"
_GROUP_FORMAT: Final = 1
_GROUP_HEAD: Final = struct.Struct("<BIdII")  # format, source id, at, cause bytes, n
_POPS_BEFORE_SPLIT: Final = 32  # RetryBook.due: more due than this, one pass


class FreshGroup:
    """Records that failed for the first time together (module docstring)."""

    __slots__ = ("at", "cause", "dues", "key", "source_id")

    def __init__(
        self, key: str, source_id: int, cause: Cause, at: float, dues: dict[int, float]
    ) -> None:
        self.key = key
        self.source_id = source_id
        self.cause = cause
        self.at = at
        self.dues = dues
        """seq -> due time of its first replay (0: at once)."""

    @classmethod
    def new(
        cls, source_id: int, cause: Cause, at: float, seqs: list[int], dues: list[float]
    ) -> FreshGroup:
        return cls(group_key(seqs[0]), source_id, cause, at, dict(zip(seqs, dues, strict=True)))

    def record(self, seq: int) -> RetryRecord:
        """The retry record `seq` stands for."""
        return RetryRecord(
            self.source_id, 1, self.at, self.at, self.dues[seq], [(self.at, self.cause)]
        )

    def without(self, seqs: Iterable[int]) -> bytes | None:
        """The entry once `seqs` left (None: none is left: delete it)."""
        gone = set(seqs)
        left = {seq: due for seq, due in self.dues.items() if seq not in gone}
        return self.encode(left) if left else None

    def encode(self, dues: dict[int, float] | None = None) -> bytes:
        """The entry (module docstring, "The group entry"), of `dues` (default: the
        group's)."""
        dues = self.dues if dues is None else dues
        n = len(dues)
        cause = json.dumps(self.cause.to_json(), separators=(",", ":")).encode()
        return b"".join(
            (
                _GROUP_HEAD.pack(_GROUP_FORMAT, self.source_id, self.at, len(cause), n),
                cause,
                np.fromiter(dues, np.uint64, n).astype("<u8", copy=False).tobytes(),
                np.fromiter(dues.values(), np.float64, n).astype("<f8", copy=False).tobytes(),
            )
        )

    @classmethod
    def decode(cls, key: str, raw: bytes) -> FreshGroup:
        """Strict: CorruptData unless `raw` is what encode wrote (or, from a store of
        an earlier version, the JSON entry it wrote)."""
        if raw[:1] == b"{":
            return cls._decode_json(key, raw)
        try:
            head = _GROUP_HEAD.size
            if len(raw) < head:
                raise ValueError(f"{len(raw)} bytes, shorter than its head")
            version, source_id, at, cause_len, n = _GROUP_HEAD.unpack_from(raw)
            if version != _GROUP_FORMAT:
                raise ValueError(f"format {version}, not {_GROUP_FORMAT}")
            if len(raw) != head + cause_len + 16 * n:
                raise ValueError(f"{len(raw)} bytes, not those of {n} records")
            cause = Cause.from_json(json.loads(raw[head : head + cause_len]))
            at_seqs = head + cause_len
            seqs = np.frombuffer(raw, "<u8", n, at_seqs).tolist()
            dues = np.frombuffer(raw, "<f8", n, at_seqs + 8 * n).tolist()
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptData(f"bad retry group {key}: {exc}") from None
        return cls(key, source_id, cause, at, dict(zip(seqs, dues, strict=True)))

    @classmethod
    def _decode_json(cls, key: str, raw: bytes) -> FreshGroup:
        try:
            data: Any = json.loads(raw)
            seqs, dues = data["seqs"], data["due"]
            if not (isinstance(seqs, list) and isinstance(dues, list) and len(seqs) == len(dues)):
                raise ValueError("seqs and due times do not pair up")
            if not all(type(s) is int for s in seqs) or not all(
                isinstance(d, int | float) and not isinstance(d, bool) for d in dues
            ):
                raise ValueError("a seq or a due time is not a number")
            source_id, at = data["source_id"], data["at"]
            if type(source_id) is not int or isinstance(at, bool):
                raise ValueError("bad source id or time")
            return cls(
                key,
                source_id,
                Cause.from_json(data["cause"]),
                float(at),
                {int(s): float(d) for s, d in zip(seqs, dues, strict=True)},
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptData(f"bad retry group {key}: {exc}") from None


def group_key(first_seq: int) -> str:
    return f"{RETRY_GROUP_PREFIX}{first_seq:016x}"


def _key(seq: int) -> str:
    return f"{RETRY_PREFIX}{seq:016x}"


class RetryBook:
    """The retry records by storage seq, loaded from and written to the store's meta
    entries; the records waiting for their backoff (a heap by due time); and the
    dead letters. Writes are staged (`PersistenceStorage.stage_meta`): the caller's
    next write (the records' new roots) commits them in the same transaction."""

    def __init__(self, storage: PersistenceStorage) -> None:
        self._storage = storage
        self._records: dict[int, RetryRecord] = {}
        self._grouped: dict[int, FreshGroup] = {}  # seq -> the group it is in
        self._waiting: list[tuple[float, int, int]] = []  # (due, seq, root): a heap
        # Records that began waiting together (wait_many): (first due not taken, number,
        # wave), a heap; each wave's records in due order.
        self._waves: list[tuple[float, int, _Wave]] = []
        self._waves_made = 0
        self._waiting_roots: dict[int, int] = {}  # seq -> root it waits under
        self.dead: dict[int, RetryRecord] = {}
        for key in storage.meta_keys(RETRY_PREFIX):
            raw = storage.get_meta(key)
            if raw is None:
                continue
            seq = int(key[len(RETRY_PREFIX) :], 16)
            record = RetryRecord.from_json(json.loads(raw))
            self._records[seq] = record
            if record.dead_at is not None:
                self.dead[seq] = record
        for key in storage.meta_keys(RETRY_GROUP_PREFIX):
            raw = storage.get_meta(key)
            if raw is None:
                continue
            group = FreshGroup.decode(key, raw)
            for seq in [s for s in group.dues if s in self._records]:
                del group.dues[seq]  # an entry of its own is newer
            self._grouped.update(dict.fromkeys(group.dues, group))

    def __len__(self) -> int:
        return len(self._records) + len(self._grouped)

    def get(self, seq: int) -> RetryRecord | None:
        record = self._records.get(seq)
        if record is None and (group := self._grouped.get(seq)) is not None:
            return group.record(seq)
        return record

    def seqs(self) -> list[int]:
        return [*self._records, *self._grouped]

    def attempts(self, seqs: list[int]) -> list[int]:
        """The failed attempts of each of `seqs` (0: never failed), without making the
        retry record a group member stands for (its first failure: 1)."""
        records, grouped = self._records, self._grouped
        return [
            record.attempts if (record := records.get(seq)) is not None else int(seq in grouped)
            for seq in seqs
        ]

    # ---- first failures, as groups --------------------------------------------------------

    def add_groups(self, groups: Iterable[FreshGroup]) -> None:
        """These groups' entries were written (with their records): the book's now."""
        for group in groups:
            self._grouped.update(dict.fromkeys(group.dues, group))

    def _ungroup(
        self, seqs: Iterable[int], *, before: bool
    ) -> tuple[dict[str, bytes | None], dict[str, bytes]]:
        """The group entries once `seqs` left their groups (None: deleted), and, with
        `before`, their entries now (for `unstage`); memory unchanged. A group all of
        whose records leave (the usual end: a FAIL's records complete at one barrier)
        is deleted without a pass over its records."""
        listed = list(dict.fromkeys(seqs))  # each once
        found = list(map(self._grouped.get, listed))
        counts = _counts(found)  # per group, how many of its records leave
        new: dict[str, bytes | None] = {}
        partial = {group for group, n in counts.items() if n != len(group.dues)}
        gone: dict[FreshGroup, set[int]] = {group: set() for group in partial}
        if partial:
            for seq, group in zip(listed, found, strict=True):
                if group in gone:
                    gone[group].add(seq)
        for group in counts:
            new[group.key] = group.without(gone[group]) if group in gone else None
        old = {group.key: group.encode() for group in counts} if before else {}
        return new, old

    def _leave_groups(self, seqs: Iterable[int]) -> None:
        listed = list(dict.fromkeys(seqs))
        left = list(map(self._grouped.pop, listed, repeat(None, len(listed))))
        counts = _counts(left)
        for group, n in counts.items():
            if n == len(group.dues):  # every one left: the group is gone
                group.dues = {}
            else:
                dues = group.dues
                for seq, was in zip(listed, left, strict=True):
                    if was is group:
                        del dues[seq]

    # ---- durable writes (staged) -------------------------------------------------------

    def stage(self, records: Mapping[int, RetryRecord]) -> dict[str, bytes | None]:
        """Stage these records' new values (a grouped one leaves its group); returns the
        old ones (for `unstage`)."""
        old: dict[str, bytes | None] = {}
        for seq in records:
            previous = self._records.get(seq)
            old[_key(seq)] = None if previous is None else previous.encode()
        groups, before = self._ungroup(records, before=True)
        puts: dict[str, bytes] = {_key(seq): r.encode() for seq, r in records.items()}
        puts.update({k: v for k, v in groups.items() if v is not None})
        self._storage.stage_meta(puts, [k for k, v in groups.items() if v is None])
        old.update(before)
        return old

    def unstage(self, old: Mapping[str, bytes | None]) -> None:
        """Put back what `stage` replaced (the write it was for failed)."""
        puts = {k: v for k, v in old.items() if v is not None}
        deletes = [k for k, v in old.items() if v is None]
        self._storage.stage_meta(puts, deletes)

    def commit(self, records: Mapping[int, RetryRecord]) -> None:
        """The staged records are the book's now (their write succeeded)."""
        self._leave_groups(records)
        for seq, record in records.items():
            self._records[seq] = record
            if record.dead_at is not None:
                self.dead[seq] = record
            else:
                self.dead.pop(seq, None)

    def forget(self, seqs: ArrayLike) -> list[int]:
        """Drop the records of these seqs (completed, or purged): staged deletes.
        Returns the seqs that had one."""
        listed = self._known(seqs)
        records = self._records
        gone = [seq for seq in listed if seq in records] if records else []
        for seq in gone:
            del records[seq]
            self.dead.pop(seq, None)
            self._waiting_roots.pop(seq, None)
        grouped = (
            (listed if not gone else [seq for seq in listed if seq in self._grouped])
            if self._grouped
            else []
        )
        groups: dict[str, bytes | None] = {}
        if grouped:
            groups = self._ungroup(grouped, before=False)[0]
            self._leave_groups(grouped)
            deque(map(self._waiting_roots.pop, grouped, repeat(None, len(grouped))), maxlen=0)
        if gone or groups:
            self._storage.stage_meta(
                {k: v for k, v in groups.items() if v is not None},
                [_key(seq) for seq in gone] + [k for k, v in groups.items() if v is None],
            )
        return gone + grouped

    def _known(self, seqs: ArrayLike) -> list[int]:
        """The seqs among `seqs` that have a record or are in a group, in their order.
        Most completions have none (a tree that never failed), so the work goes by the
        smaller side: a lookup per seq for fewer seqs than the book holds; else the
        book's seqs as an array, and every seq looked for in it in one vectorized step
        (a completed micro-batch of 200,000 seqs, with 2,000 records failed or
        dead-lettered in the book: about 1 ms, against 15 ms a lookup per seq)."""
        array = np.asarray(seqs, dtype=np.uint64)
        size = len(self)
        if not size or not len(array):
            return []
        if len(array) <= size:
            listed = array.tolist()
            if not self._records:  # the usual book at a barrier: first failures only
                grouped = self._grouped
                return [s for s in listed if s in grouped]
            return [s for s in listed if s in self._records or s in self._grouped]
        known = np.fromiter(itertools.chain(self._records, self._grouped), np.uint64, size)
        return array[np.isin(array, known)].tolist()  # type: ignore[no-any-return]

    # ---- waiting for the backoff ---------------------------------------------------------

    def wait(self, seq: int, root: int, due: float) -> None:
        self._waiting_roots[seq] = root
        heapq.heappush(self._waiting, (due, seq, root))

    def wait_many(self, seqs: ArrayLike, roots: ArrayLike, dues: ArrayLike) -> None:
        """`wait` for each (seq, root, due), as one wave (a failure's records): one heap
        entry for them all, their due times, seqs and roots as arrays in that order,
        of which `due` takes the ended ones by a binary search."""
        seq_array = np.asarray(seqs, dtype=np.uint64)
        if not len(seq_array):
            return
        root_array = np.asarray(roots, dtype=np.uint64)
        due_array = np.asarray(dues, dtype=np.float64)
        self._waiting_roots.update(zip(seq_array.tolist(), root_array.tolist(), strict=True))
        order = np.lexsort((root_array, seq_array, due_array))
        self._push_wave(_Wave(due_array[order], seq_array[order], root_array[order]))

    def _push_wave(self, wave: _Wave) -> None:
        self._waves_made += 1
        heapq.heappush(self._waves, (float(wave.dues[wave.taken]), self._waves_made, wave))

    @property
    def waiting(self) -> int:
        return len(self._waiting_roots)

    def next_due(self) -> float | None:
        self._drop_stale()
        heap, waves = self._waiting, self._waves
        if not waves:
            return heap[0][0] if heap else None
        return min(heap[0][0], waves[0][0]) if heap else waves[0][0]

    def due(self, now: float) -> list[tuple[int, int]]:
        """(seq, root) of the waiting records due by `now`, no longer waiting, in (due
        time, seq, root) order."""
        entries = self._due_entries(now)
        waves = self._waves
        if waves and waves[0][0] <= now:
            runs = [entries] if entries else []
            while waves and waves[0][0] <= now:
                wave = heapq.heappop(waves)[2]
                end = int(np.searchsorted(wave.dues, now, side="right"))
                lo, wave.taken = wave.taken, end
                runs.append(
                    list(
                        zip(
                            wave.dues[lo:end].tolist(),
                            wave.seqs[lo:end].tolist(),
                            wave.roots[lo:end].tolist(),
                            strict=True,
                        )
                    )
                )
                if end < len(wave.dues):
                    self._push_wave(wave)
            entries = runs[0] if len(runs) == 1 else sorted(itertools.chain(*runs))
        out: list[tuple[int, int]] = []
        roots = self._waiting_roots
        for _due, seq, root in entries:
            if roots.get(seq) == root:
                del roots[seq]
                out.append((seq, root))
        return out

    def _due_entries(self, now: float) -> list[tuple[float, int, int]]:
        """The entries of the heap of single waits due by `now`, in order, taken off it."""
        heap = self._waiting
        entries: list[tuple[float, int, int]] = []
        while heap and heap[0][0] <= now:
            if len(entries) == _POPS_BEFORE_SPLIT and len(heap) > _POPS_BEFORE_SPLIT:
                # Many are due: taken out in one pass and the heap made again, instead
                # of a pop of O(log n) each.
                entries += sorted(entry for entry in heap if entry[0] <= now)
                heap[:] = [entry for entry in heap if entry[0] > now]
                heapq.heapify(heap)
                break
            entries.append(heapq.heappop(heap))
        return entries

    def is_waiting(self, seq: int) -> bool:
        return seq in self._waiting_roots

    def waiting_root(self, seq: int) -> int | None:
        """The root record `seq` waits for its backoff under (None: not waiting)."""
        return self._waiting_roots.get(seq)

    def _drop_stale(self) -> None:
        """Drop the first entries that no longer wait (completed, purged, or waiting
        under another root since), of the heap and of the first waves."""
        heap, roots = self._waiting, self._waiting_roots
        while heap and roots.get(heap[0][1]) != heap[0][2]:
            heapq.heappop(heap)
        waves = self._waves
        while waves:
            wave = waves[0][2]
            at, n = wave.taken, len(wave.dues)
            while at < n and roots.get(int(wave.seqs[at])) != int(wave.roots[at]):
                at += 1
            if at == wave.taken:
                return
            heapq.heappop(waves)
            wave.taken = at
            if at < n:
                self._push_wave(wave)

    def waiting_items(self) -> Iterator[tuple[int, int, float]]:
        """(seq, root, due) of every waiting record."""
        roots = self._waiting_roots
        for due, seq, root in self._waiting:
            if roots.get(seq) == root:
                yield seq, root, due
        for _first, _number, wave in self._waves:
            lo = wave.taken
            for due, seq, root in zip(
                wave.dues[lo:].tolist(),
                wave.seqs[lo:].tolist(),
                wave.roots[lo:].tolist(),
                strict=True,
            ):
                if roots.get(seq) == root:
                    yield seq, root, due


class _Wave:
    """Records that began waiting together (`RetryBook.wait_many`): due times, seqs and
    roots in (due, seq, root) order; `taken`: how many `due` took (or found stale)."""

    __slots__ = ("dues", "roots", "seqs", "taken")

    def __init__(
        self, dues: NDArray[np.float64], seqs: NDArray[np.uint64], roots: NDArray[np.uint64]
    ) -> None:
        self.dues = dues
        self.seqs = seqs
        self.roots = roots
        self.taken = 0


def _counts(groups: list[FreshGroup | None]) -> dict[FreshGroup, int]:
    """How many times each group is named (None: a seq in no group, left out)."""
    counts = Counter(groups)
    counts.pop(None, None)
    return counts  # type: ignore[return-value]


def _integer(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CorruptData(f"expected an integer, got {value!r}")
    return value


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CorruptData(f"expected a number, got {value!r}")
    return float(value)
