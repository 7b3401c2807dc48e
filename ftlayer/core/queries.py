"""Queries: what the core can tell without changing anything.

- `lowest_pending_offsets`: per topic and partition, the lowest Kafka offset of a
  pending root: a consumer group never commits past it (the checkpoint of every
  micro-batch asks, so it is O(pending) with a dense table, no sort).
- `pending_by_source`: pending roots per source (flow control), by counting the topic
  number column, with no column more per root.
- `inspect`: where one record is (pending, queued, waiting or a dead letter), with its
  history: a diagnostic, O(pending + dead letters) for a lookup by coordinates.
- `current_stats`: the counters with the current state filled in (STATUS).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from ftlayer.inspection import InspectedRecord, Inspection, RecordQuery, RecordState

from . import failnotes, ranges
from .deadletters import DEAD_LETTER_CHUNK
from .fills import counts_by_source
from .holding import open_holds_pending
from .meters import total_latency
from .state import EMPTY_U64, CoreState
from .stats import FTStats

__all__ = ["current_stats", "inspect", "lowest_pending_offsets", "pending_by_source"]


def lowest_pending_offsets(
    s: CoreState, topics: Sequence[str] | None = None
) -> dict[str, dict[int, int]]:
    """{topic: {partition: the lowest Kafka offset of a pending root}}, over every
    pending root (replayed ones keep their original offset), for `topics` only if
    given. A partition with nothing pending is absent. Records persisted without an
    offset (negative) are ignored."""
    if not len(s.acker):  # barrier mode by reference: only open ranges, no entry each
        return ranges.lowest_offsets(s, topics)
    cols = s.acker.live_columns("topic", "partition", "offset", copy=False)
    topic, partition = cols["topic"], cols["partition"]
    offsets = cols["offset"].astype(np.int64, copy=False)
    keep = offsets >= 0
    if topics is not None:
        wanted = s.persistence.topic_numbers(topics)
        keep &= topic == wanted[0] if len(wanted) == 1 else np.isin(topic, wanted)
    if not bool(keep.all()):
        topic, partition, offsets = topic[keep], partition[keep], offsets[keep]
    result = ranges.lowest_offsets(s, topics)  # open batch ranges hold their start
    if not len(offsets):
        return result
    topic_nums, partitions, lowest = _min_per_partition(topic, partition, offsets)
    names = s.persistence.topic_names(topic_nums.astype(np.uint32))
    for name, p, offset in zip(names, partitions.tolist(), lowest.tolist(), strict=True):
        lowest_of = result.setdefault(name, {})  # two sources may read one topic
        lowest_of[p] = min(offset, lowest_of.get(p, offset))
    return result


def pending_by_source(s: CoreState) -> dict[int, int]:
    """{source id: its pending roots}, sources with none left out: records in flight and
    records waiting in the replay queue alike."""
    numbers = s.acker.live_columns("topic", copy=False)["topic"]
    result = ranges.pending_counts(s)  # records of open batch ranges
    if not len(numbers):
        return result
    sources = s.persistence.number_sources()
    counts = np.bincount(numbers, minlength=len(sources))
    for number in np.flatnonzero(counts).tolist():
        source = int(sources[number])
        result[source] = result.get(source, 0) + int(counts[number])
    return result


def inspect(s: CoreState, query: RecordQuery) -> Inspection:
    """The records `query` names and where each is (ftlayer.inspection): by root, the
    pending root (or whether it failed recently); by Kafka coordinates, every pending
    root and every dead letter at them."""
    found: list[tuple[int, int]] = []  # (root, seq)
    retired = False
    if query.root is not None:
        key = np.array([query.root], dtype=np.uint64)
        if query.root > 1 and len(s.acker):
            pending, seqs = s.acker.lookup("seq", key)
            if bool(pending[0]):
                found.append((query.root, int(seqs[0])))
        if not found and len(s.retired):
            retired = bool(s.retired.known(key, s.clock())[0])
    else:
        found += _pending_at(s, query)
        found += [(0, seq) for seq in _dead_letters_at(s, query)]
    in_range = ranges.inspect(s, query) if not found else ()
    if in_range:
        return Inspection(query, in_range, False)
    if not found:
        return Inspection(query, (), retired)
    seqs = np.array([seq for _, seq in found], dtype=np.uint64)
    batch = s.storage.get(seqs)
    queue = s.queue.columns() if len(s.queue) else None
    held = s.holds.columns()["root"] if len(s.holds) else EMPTY_U64
    records = []
    for i, (root, seq) in enumerate(found):
        history = s.book.get(seq)
        state, replay_seq, since, due = RecordState.PENDING, None, None, None
        parts: tuple[int, ...] = ()
        if seq in s.book.dead:
            state = RecordState.DEAD_LETTER
        elif s.book.waiting_root(seq) == root:
            state, due = RecordState.WAITING, None if history is None else history.due
        elif queue is not None:
            entries = (queue["root"] == root) & (queue["seq"] == seq)
            if bool(entries.any()):
                state = RecordState.QUEUED
                replay_seq = int(queue["replay_seq"][entries][0])
                parts = tuple(int(p) for p in queue["partition"][entries].tolist())
                if history is not None:
                    since = max(history.last_failed, history.due)
        records.append(
            InspectedRecord(
                state=state,
                root=root,
                seq=seq,
                source_id=int(batch.source_ids[i]),
                topic=batch.topics[i],
                partition=int(batch.partitions[i]),
                offset=int(batch.offsets[i]),
                payload_bytes=len(batch.payloads[i]),
                has_key=bool(batch.has_key[i]),
                key_hash=int(batch.key_hashes[i]),
                replay_seq=replay_seq,
                replay_partitions=parts,
                queued_since=since,
                due=due,
                barrier_hold=bool(root) and bool(np.any(held == root)),
                history=None if history is None else history.to_json(),
                payload=bytes(batch.payloads[i]),
            )
        )
    return Inspection(query, tuple(records), retired)


def _pending_at(s: CoreState, query: RecordQuery) -> list[tuple[int, int]]:
    """(root, seq) of the pending roots at the query's Kafka coordinates."""
    numbers = s.persistence.topic_numbers([str(query.topic)])
    if not len(numbers) or not len(s.acker):
        return []
    live = s.acker.live_columns("root", "seq", "topic", "partition", "offset", copy=False)
    hit = (live["offset"] == query.offset) & (live["partition"] == query.partition)
    hit &= np.isin(live["topic"], numbers)
    return list(zip(live["root"][hit].tolist(), live["seq"][hit].tolist(), strict=True))


def _dead_letters_at(s: CoreState, query: RecordQuery) -> list[int]:
    """The seqs of the dead letters at the query's Kafka coordinates."""
    seqs = sorted(s.book.dead)
    hits: list[int] = []
    for start in range(0, len(seqs), DEAD_LETTER_CHUNK):
        chunk = seqs[start : start + DEAD_LETTER_CHUNK]
        batch = s.storage.get(np.array(chunk, dtype=np.uint64))
        rows = (batch.offsets == query.offset) & (batch.partitions == query.partition)
        hits += [chunk[i] for i in np.flatnonzero(rows).tolist() if batch.topics[i] == query.topic]
    return hits


def current_stats(s: CoreState) -> FTStats:
    """The counters, with the current state filled in: pending roots, the replay queue's
    length and cursors, open holds, running batches, per-source meters."""
    stats = s.stats
    stats.pending = len(s.acker) + sum(ranges.pending_counts(s).values())
    stats.replay_queue = len(s.queue)
    stats.replay_cursor = s.queue.cursor
    stats.replay_cursors = s.queue.cursors()
    stats.replay_cursor_at_start = s.queue.cursor_at_start
    stats.replay_pruned = s.queue.pruned()
    stats.retry_waiting = s.book.waiting
    stats.unfilled = len(s.unfilled)
    stats.open_ranges = len(s.ranges)
    stats.dead_letters = len(s.book.dead)
    stats.barrier_holds = open_holds_pending(s)
    stats.timeouts_postponed = s.timeouts.postponed
    stats.batches_running = s.leases.status(s.clock())
    by_source = s.meters.by_source(s.persistence.number_sources())
    queued = s.queue.counts()
    unfilled = _unfilled_counts(s)
    stats.by_source = {
        str(k): meters.figures(queued.get(k, 0), unfilled.get(k, 0)).to_json()
        for k, meters in by_source.items()
    }
    stats.complete_latency = total_latency(by_source).summary().to_json()
    return stats


def brief_stats(s: CoreState) -> dict[str, Any]:
    """What the brief STATUS reply holds of the core (ftlayer.status.BriefStatus): the
    replay cursors and prune points, the pending roots and the unfilled records per
    source, each by source id as a string. O(pending), as `pending_by_source`; none of
    `current_stats`' meters."""
    queue = s.queue
    return {
        "replay_cursors": queue.cursors(),
        "replay_cursor_at_start": queue.cursor_at_start,
        "replay_pruned": queue.pruned(),
        "pending_by_source": {str(k): n for k, n in pending_by_source(s).items()},
        "unfilled_by_source": {str(k): n for k, n in _unfilled_counts(s).items() if n},
    }


def _unfilled_counts(s: CoreState) -> dict[int, int]:
    """Per source id: its failed records stored by reference whose bytes it has not
    copied in yet, and its noted failures (ftlayer.core.failnotes), which it copies
    in the same way."""
    counts = counts_by_source(s)
    for source_id, n in failnotes.counts(s).items():
        counts[source_id] = counts.get(source_id, 0) + n
    return counts


_DENSE_CELLS: Final = 1 << 20
_EMPTY_CELL: Final = int(np.iinfo(np.int64).max)


def _min_per_partition(
    topics: NDArray[Any], partitions: NDArray[Any], values: NDArray[np.int64]
) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
    """(topic, partition, the minimum value) of each distinct (topic, partition). Topic
    numbers are dense and partitions small, so a table indexed by (topic, partition)
    and np.minimum.at do it in O(n); a sort when the table would be large (or a
    partition is negative)."""
    t_lo, t_hi = int(topics.min()), int(topics.max())
    width = int(partitions.max()) + 1
    cells = (t_hi - t_lo + 1) * width
    if int(partitions.min()) >= 0 and cells <= _DENSE_CELLS:
        # Cells from the lowest topic on; with one topic (a checkpoint asks for its
        # query's) the partition alone is the cell.
        cell = partitions if t_lo == t_hi else (topics.astype(np.intp) - t_lo) * width + partitions
        table = np.full(cells, _EMPTY_CELL, dtype=np.int64)
        np.minimum.at(table, cell, values)
        present = np.flatnonzero(table != _EMPTY_CELL)
        return present // width + t_lo, present % width, table[present]
    t = topics.astype(np.int64, copy=False)
    p = partitions.astype(np.int64, copy=False)
    order = np.lexsort((p, t))
    t, p, values = t[order], p[order], values[order]
    starts = np.flatnonzero(np.r_[True, (t[1:] != t[:-1]) | (p[1:] != p[:-1])])
    return t[starts], p[starts], np.minimum.reduceat(values, starts)
