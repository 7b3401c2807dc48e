"""Batch ranges: a barrier-mode batch read by reference, as one offset range per partition.

With barrier completion and `ft.persist=reference`, a source persists nothing per
record. At the barrier its driver registers the batch's new records as one Kafka offset
range per partition (`register`, BATCH_RANGES), and every row carries its record's
range root (ftlayer.rangeroots). The contract:

- `register` stores each range (meta `range/<number>`, one transaction) before it
  returns the range numbers, so a range is durable before a row of it is emitted. A
  range registered again (the same batch planned again: a driver restart, a re-run)
  gets its number back and counts once.
- An open range's records are pending without an entry each: `lowest_offsets` holds
  the group offset of a partition at its lowest open range's start, and
  `pending_counts` counts them for flow control.
- `complete`: a batch of these sources is done up to a barrier position: every open
  range wholly below it completes (its records counted completed, its meta deleted by
  the store's next write transaction: staged, so a barrier costs no commit of its
  own; a crash before that write leaves the ranges open, and the next done barrier,
  past them too, completes them). A range with failures noted and not applied yet
  (ftlayer.core.failnotes) completes all its other records and stays open, `held`,
  for them: pending, and its lowest one the group offset, until they are records of
  their own (`complete_held`, once the notes are applied).
  A range left behind by a batch planned differently (a restart) is below a later
  barrier too, so it completes with it: Spark processed every offset below a done
  barrier. Ranges do not time out: Kafka and Spark's offset log re-read an unfinished
  batch when its query runs again.
- `materialize`: an event naming range roots (a FAIL, a HOLD of a loop, a sink's held
  ack) first turns each into a record of its own, stored by reference with its key
  unknown (ftlayer.records.KEY_UNKNOWN) and pending under that same root (the persist
  room), so the event then applies as to any root: a failed one is replayed once its
  source copied its bytes in (which gives the key its replay partition needs,
  ftlayer.core.fills), a held one stays past its batch. Each offset materializes once:
  a second event for it names a root that is no longer pending (late). A range root of
  no open range is left alone (the event counts as unknown).
- Recovery: the open ranges come back from their meta, and which offsets were
  materialized from the stored records (`note_stored`).
- `inspect`: a record pending as part of a range shows as pending, held to its
  batch's barrier (barrier mode), with nothing stored (seq 0).
- `sort_out`: an XOR event of value 0 for a range root says its offset is no record of
  the range (the reader's word for a record a loop fed back: it runs under its own
  tree's root); it is excluded, counted neither persisted nor completed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ftlayer.errors import ConfigError
from ftlayer.inspection import InspectedRecord, RecordQuery, RecordState
from ftlayer.rangeroots import MAX_RANGE, decode, encode, is_range_root
from ftlayer.records import KEY_UNKNOWN, RecordBatch

from .persist import persist
from .rangetable import RANGE_META_PREFIX, BatchRange, OpenRanges, RangeAcks
from .state import CoreState

__all__ = [
    "RANGE_META_PREFIX",
    "BatchRange",
    "OpenRanges",
    "complete",
    "complete_held",
    "lowest_offsets",
    "materialize",
    "note_stored",
    "pending_counts",
    "register",
    "tag_batch",
]


def _key(number: int) -> str:
    return f"{RANGE_META_PREFIX}{number}"


def register(
    s: CoreState, ranges: Sequence[tuple[int, str, int, int, int]], *, tree: bool = False
) -> list[int]:
    """Open (source id, topic, partition, start, end) ranges; returns their numbers in
    order (0 for an empty range, which needs none). Durable on return. With `tree`,
    their records complete one by one with their trees (ftlayer.core.rangeacks). A
    range opened again (its batch planned again) gets its number back."""
    numbers: list[int] = []
    new: dict[int, BatchRange] = {}
    for source_id, topic, partition, start, end in ranges:
        if end <= start:
            numbers.append(0)
            continue
        if end - start > MAX_RANGE or start < 0:
            raise ConfigError(
                f"a batch range holds 1 to {MAX_RANGE} offsets from 0 on, got "
                f"{topic}-{partition} [{start}, {end})"
            )
        number = s.ranges.find(source_id, topic, partition, start, end, tree=tree)
        if not number:
            twin = [
                n
                for n, r in new.items()
                if (r.source_id, r.topic, r.partition, r.start)
                == (source_id, topic, partition, start)
            ]
            number = twin[0] if twin else s.ranges.allocate(set(new))
            r = BatchRange(number, source_id, topic, partition, start, end)
            if tree:  # its batch, for the timeouts, is the one its next barrier begins
                r.acks = RangeAcks.new(len(r), s.clock())
            new[number] = r
        numbers.append(number)
    if new:
        s.changing()
        s.storage.update_meta({_key(n): r.to_json() for n, r in new.items()})
        s.ranges.by_number.update(new)
        for r in new.values():
            s.stats.persisted += len(r)
            s.meters.ranged(r.source_id, len(r))
            if r.acks is not None and s.journal is not None:  # ops before it are not its
                s.journal.range_open(r.number)
    return numbers


def tag_batch(s: CoreState, source_ids: Iterable[int]) -> None:
    """A batch of these sources begins (its barrier): their tree-mode ranges that
    belong to no batch yet (opened for it just before) belong to it, so its heartbeats
    hold their timeouts off."""
    sources = set(source_ids)
    for r in s.ranges.by_number.values():
        if r.acks is not None and r.acks.batch is None and r.source_id in sources:
            r.acks.batch = s.leases.tag(r.source_id)


def complete(
    s: CoreState, source_ids: Iterable[int], kafka: Mapping[str, Mapping[Any, int]]
) -> int:
    """The batches of `source_ids` are done up to the barrier `kafka` ({topic:
    {partition: offset}}): complete every open range of theirs wholly below it.
    Returns how many records completed."""
    sources = set(source_ids)
    done = [
        r
        for r in s.ranges.by_number.values()
        if r.acks is None
        and r.held is None
        and r.source_id in sources
        and r.end <= _offset(kafka, r.topic, r.partition)
    ]
    if not done:
        return 0
    s.changing()
    noted = _noted_offsets(s, {r.number for r in done})
    completed = 0
    gone: list[BatchRange] = []
    for r in done:
        held = noted.get(r.number)
        if held:  # its noted failures wait for their bytes (ftlayer.core.failnotes)
            before = r.pending
            r.held = held
            completed += _completed(s, r, before - r.pending)
        else:
            gone.append(r)
            completed += _completed(s, r, r.pending)
    _drop(s, gone)
    return completed


def complete_held(s: CoreState) -> int:
    """Ranges whose batch was done but for noted failures (`BatchRange.held`) complete
    once every such offset is a record of its own (the notes applied). Returns how
    many ranges completed."""
    gone = [r for r in s.ranges.by_number.values() if r.held is not None and not r.pending]
    if gone:
        s.changing()
        _drop(s, gone)
    return len(gone)


def _completed(s: CoreState, r: BatchRange, n: int) -> int:
    """Count `n` records of range `r` completed at its batch's barrier."""
    s.meters.range_completed(s.persistence.topic_number(r.source_id, r.topic), n)
    s.stats.completed += n
    s.stats.barrier_released += n  # they entered a batch that is done
    return n


def _drop(s: CoreState, gone: list[BatchRange]) -> None:
    """Forget these ranges. Staged, not committed: their meta deletes ride on the
    store's next write (the next batch's BATCH_RANGES, or the server's flush of an
    idle store). A crash before it leaves them open, and the next done barrier of
    their sources, which is past them, completes them again: nothing is lost, no
    record is replayed."""
    if not gone:
        return
    s.storage.stage_meta({}, [_key(r.number) for r in gone])
    for r in gone:
        del s.ranges.by_number[r.number]


def _noted_offsets(s: CoreState, numbers: set[int]) -> dict[int, set[int]]:
    """The offsets of noted failures (ftlayer.core.failnotes) in these ranges."""
    if not s.noted_keys:
        return {}
    keys = np.fromiter(s.noted_keys, dtype=np.uint64, count=len(s.noted_keys))
    found, deltas = decode(keys)
    out: dict[int, set[int]] = {}
    for number in numbers:
        mine = deltas[found == number]
        if len(mine):
            out[number] = set((s.ranges.by_number[number].start + mine.astype(np.int64)).tolist())
    return out


def _offset(kafka: Mapping[str, Mapping[Any, int]], topic: str, partition: int) -> int:
    offsets = kafka.get(topic, {})
    found = offsets.get(partition, offsets.get(str(partition)))
    return -1 if found is None else int(found)


def materialize(s: CoreState, roots: NDArray[np.uint64]) -> None:
    """Range roots of open ranges among `roots` that are not pending become records of
    their own, pending under that root (see the module docstring)."""
    if not len(s.ranges):
        return
    ranged = is_range_root(roots)
    if not bool(ranged.any()):
        return
    candidates = np.unique(roots[ranged])
    pending = s.acker.lookup("seq", candidates)[0]
    candidates = candidates[~pending]
    if not len(candidates):
        return
    numbers, deltas = decode(candidates)
    rows: list[int] = []
    ranges: list[BatchRange] = []
    for i, (number, delta) in enumerate(zip(numbers.tolist(), deltas.tolist(), strict=True)):
        r = s.ranges.by_number.get(number)
        if r is None or delta >= len(r) or not _unfinished(r, r.start + delta):
            continue
        rows.append(i)
        ranges.append(r)
    if not rows:
        return
    offsets = [r.start + int(deltas[i]) for i, r in zip(rows, ranges, strict=True)]
    batch = RecordBatch.build(
        candidates[rows],
        [b""] * len(rows),
        source_ids=[r.source_id for r in ranges],
        key_hashes=np.full(len(rows), KEY_UNKNOWN, dtype=np.int64),
        has_key=np.zeros(len(rows), dtype=np.bool_),
        topics=[r.topic for r in ranges],
        partitions=[r.partition for r in ranges],
        offsets=offsets,
        references=True,
    )
    persist(s, batch, counted=False)  # counted persisted when its range opened
    for r, offset in zip(ranges, offsets, strict=True):
        r.leave((offset,))


def _unfinished(r: BatchRange, offset: int) -> bool:
    return bool(r.unfinished(np.array([offset], dtype=np.int64))[0])


def sort_out(
    s: CoreState, roots: ArrayLike, values: ArrayLike
) -> tuple[NDArray[np.uint64], NDArray[np.uint64]]:
    """XOR events with their range roots sorted out: those with value 0 exclude their
    offset from its range (no record of its own: a record a loop fed back, which runs
    under its tree's root; counted neither persisted nor completed), the others are
    materialized. Returns the events left to apply."""
    keys = np.ascontiguousarray(roots, dtype=np.uint64)
    vals = np.ascontiguousarray(values, dtype=np.uint64)
    ranged = is_range_root(keys)
    if not bool(ranged.any()):
        return keys, vals
    excluded = ranged & (vals == 0)
    if bool(excluded.any()):
        _exclude(s, keys[excluded])
        keys, vals = keys[~excluded], vals[~excluded]
    materialize(s, keys)
    return keys, vals


def _exclude(s: CoreState, roots: NDArray[np.uint64]) -> None:
    numbers, deltas = decode(roots)
    for number, delta in zip(numbers.tolist(), deltas.tolist(), strict=True):
        r = s.ranges.by_number.get(number)
        if r is not None and delta < len(r) and _unfinished(r, r.start + delta):
            r.leave((r.start + delta,))
            s.stats.persisted -= 1
            s.meters.ranged(r.source_id, -1)


def note_stored(s: CoreState, batch: RecordBatch) -> None:
    """Stored records found at recovery: those inside an open range of their source
    were materialized."""
    if not len(s.ranges) or not len(batch):
        return
    for r in s.ranges.by_number.values():
        rows = (
            (batch.source_ids == r.source_id)
            & (batch.partitions == r.partition)
            & (batch.offsets >= r.start)
            & (batch.offsets < r.end)
        )
        if bool(rows.any()):
            for row in np.flatnonzero(rows).tolist():
                if batch.topics[row] == r.topic:
                    r.leave((int(batch.offsets[row]),))


def inspect(s: CoreState, query: RecordQuery) -> tuple[InspectedRecord, ...]:
    """A record `query` names that is pending as part of an open range (by its range
    root or its coordinates): pending, held to its batch's barrier, nothing stored."""
    for r in s.ranges.by_number.values():
        if query.root is not None:
            if not is_range_root([query.root])[0]:
                return ()
            numbers, deltas = decode([query.root])
            if int(numbers[0]) != r.number or int(deltas[0]) >= len(r):
                continue
            offset = r.start + int(deltas[0])
        elif (query.topic, query.partition) == (r.topic, r.partition) and (
            r.start <= int(query.offset or 0) < r.end
        ):
            offset = int(query.offset or 0)
        else:
            continue
        if not _unfinished(r, offset):  # a record of its own (or a tree that completed)
            continue
        return (
            InspectedRecord(
                state=RecordState.PENDING,
                root=int(encode(r.number, r.start, [offset])[0]),
                seq=0,
                source_id=r.source_id,
                topic=r.topic,
                partition=r.partition,
                offset=offset,
                payload_bytes=0,
                has_key=False,
                key_hash=KEY_UNKNOWN,
                barrier_hold=r.acks is None,
            ),
        )
    return ()


def lowest_offsets(s: CoreState, topics: Sequence[str] | None) -> dict[str, dict[int, int]]:
    """{topic: {partition: the lowest start of an open range}}."""
    out: dict[str, dict[int, int]] = {}
    wanted = None if topics is None else set(topics)
    for r in s.ranges.by_number.values():
        first = r.lowest_pending()
        if first is not None and (wanted is None or r.topic in wanted):
            lowest = out.setdefault(r.topic, {})
            lowest[r.partition] = min(first, lowest.get(r.partition, first))
    return out


def pending_counts(s: CoreState) -> dict[int, int]:
    """{source id: records pending in its open ranges}."""
    out: dict[int, int] = {}
    for r in s.ranges.by_number.values():
        out[r.source_id] = out.get(r.source_id, 0) + r.pending
    return out
