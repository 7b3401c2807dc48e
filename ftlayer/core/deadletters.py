"""Dead-letter admin: the records whose retries are spent, and what an operator does
with them.

A dead letter is a stored record with root 0 and the replay seq DEAD_LETTER; its retry
record (ftlayer.core.retries) holds its history and causes. It is not pending: no
timeout, no replay, not counted against flow control, and a Kafka group offset may
pass it (the record is kept here, or in the dead-letter topic). Operations:

- `dead_letters(where, limit)`: the matching letters, oldest first, with their records
  (read a chunk at a time; only letters that pass the retry-record filters are read).
- `requeue_dead_letters(where)`: back for replay now (after a fix), each under a new
  root with a fresh retry budget and its history kept.
- `restore_dead_letters(batch, history)`: letters taken back from a dead-letter topic,
  stored again under fresh roots and queued like a requeue.
- `purge_dead_letters(where, delivered=)`: deleted for good (an operator's purge, or the
  dead-letter topic confirmed them).

Every operation is all or nothing towards the store: a requeue whose write fails
leaves the letters as they were; a restore whose queueing fails leaves the records
pending and timed (a replay, never a loss).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Final

import numpy as np

from ftlayer.errors import ConfigError
from ftlayer.records import RecordBatch

from .failure import enqueue
from .persist import check_new_roots, pend_while_storing, stored_meanwhile
from .retries import DeadLetterFilter, RetryRecord
from .state import CoreState
from .takeover import chunk_groups

__all__ = [
    "DEAD_LETTER_CHUNK",
    "dead_letters",
    "purge_dead_letters",
    "requeue_dead_letters",
    "restore_dead_letters",
]

DEAD_LETTER_CHUNK: Final = 1024
"""Dead letters are read from storage this many at a time."""


def dead_letters(
    s: CoreState, where: DeadLetterFilter | None = None, limit: int | None = None
) -> tuple[list[tuple[int, RetryRecord]], RecordBatch]:
    """The dead letters that match `where` (oldest first, at most `limit`): their storage
    seqs with their retry records, and their stored records (with root 0)."""
    where = where or DeadLetterFilter()
    # The retry record decides all but the partition; the stored records are read a
    # chunk at a time, only for letters that pass that far.
    anywhere = dataclasses.replace(where, partition=None)
    seqs = [seq for seq in sorted(s.book.dead) if anywhere.matches(seq, s.book.dead[seq], 0)]
    chosen: list[tuple[int, RetryRecord]] = []
    batches: list[RecordBatch] = []
    for start in range(0, len(seqs), DEAD_LETTER_CHUNK):
        chunk = seqs[start : start + DEAD_LETTER_CHUNK]
        batch = s.storage.get(np.array(chunk, dtype=np.uint64))
        rows = np.arange(len(chunk), dtype=np.intp)
        if where.partition is not None:
            rows = np.flatnonzero(batch.partitions == where.partition)
        if limit is not None:
            rows = rows[: limit - len(chosen)]
        chosen += [(chunk[i], s.book.dead[chunk[i]]) for i in rows.tolist()]
        batches.append(batch.take(rows) if len(rows) < len(chunk) else batch)
        if limit is not None and len(chosen) >= limit:
            break
    if not batches:
        return chosen, s.storage.get(np.zeros(0, dtype=np.uint64))
    return chosen, batches[0] if len(batches) == 1 else RecordBatch.concat(batches)


def requeue_dead_letters(s: CoreState, where: DeadLetterFilter) -> int:
    """Put the matching dead letters back for replay now: each gets a new root and a
    replay seq; its history stays, and its retries count afresh. Returns how many."""
    chosen, batch = dead_letters(s, where)
    if not chosen:
        return 0
    s.changing()
    seqs = np.array([seq for seq, _ in chosen], dtype=np.uint64)
    roots = s.new_roots(len(seqs))
    records: dict[int, RetryRecord] = {}
    for seq, record in chosen:
        records[seq] = record.requeued_copy()
    old_meta = s.book.stage(records)
    try:
        s.persistence.retag(seqs, roots, np.zeros(len(seqs), dtype=np.uint64))
    except BaseException:
        s.book.unstage(old_meta)
        raise
    s.book.commit(records)
    locators = s.persistence.locators(batch)
    s.acker.add(roots, None, seq=seqs, **locators)
    s.marks.read(chunk_groups(locators["topic"], locators["partition"], locators["offset"]))
    if s.journal is not None:
        s.journal.add(roots)
    enqueue(s, roots, seqs, batch)
    s.stats.dead_letters_requeued += len(seqs)
    return len(seqs)


def restore_dead_letters(s: CoreState, batch: RecordBatch, history: Sequence[RetryRecord]) -> int:
    """Dead letters taken back from a dead-letter topic: stored again under the fresh
    roots of `batch`, with their history (`history[i]` for record i), and queued for
    replay now with a fresh retry budget. Returns how many."""
    n = len(batch)
    if len(history) != n:
        raise ConfigError(f"{n} records but {len(history)} histories")
    if not n:
        return 0
    s.changing()
    check_new_roots(s, batch)
    locators = s.persistence.locators(batch)
    # Not persistence.persist: the marked deletes stay marked, for the deleter of a
    # server (its own transactions) or the next persist.
    seqs = pend_while_storing(s, batch, None, locators, lambda: s.storage.put(batch))
    stored_meanwhile(s, seqs)
    if s.journal is not None:
        s.journal.add(batch.roots)
    s.marks.read(chunk_groups(locators["topic"], locators["partition"], locators["offset"]))
    records: dict[int, RetryRecord] = {}
    for seq, source_id, record in zip(
        seqs.tolist(), batch.source_ids.tolist(), history, strict=True
    ):
        records[seq] = record.requeued_copy(int(source_id))
    old_meta = s.book.stage(records)
    try:
        enqueue(s, batch.roots, seqs, batch)
    except BaseException:
        s.book.unstage(old_meta)
        s.track(batch.roots, seqs, batch.source_ids)  # the timeout retries it
        raise
    s.book.commit(records)
    s.stats.persisted += n
    s.meters.persisted(batch.source_ids, int(seqs[0]), s.clock())
    s.stats.dead_letters_requeued += n
    return n


def purge_dead_letters(s: CoreState, where: DeadLetterFilter, *, delivered: bool = False) -> int:
    """Delete the matching dead letters for good. Returns how many."""
    chosen, _batch = dead_letters(s, where)
    if not chosen:
        return 0
    s.changing()
    seqs = [seq for seq, _ in chosen]
    s.book.forget(seqs)  # staged: committed by the delete's transaction
    s.storage.delete(np.array(seqs, dtype=np.uint64))
    if delivered:
        s.stats.dead_letters_delivered += len(seqs)
    else:
        s.stats.dead_letters_purged += len(seqs)
    return len(seqs)
