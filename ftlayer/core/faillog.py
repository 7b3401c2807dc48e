"""The core's log lines about failed records, each naming what it concerns.

One line per (fate, source, topic, partition) of a requeue (ftlayer.core.layer,
ftlayer.core.failure.requeue): trees failed and queued for replay, waiting for their backoff, or
dead-lettered. Its fields (ftlayer.logs.fields) name the source, topic and partition,
the count, the Kafka offsets, the failed roots and the roots the records go on under
(0x hex, as `ftlayer inspect --root` takes them), the cause (and, for an explicit
fail, the first record's kind, step and error), and for dead letters their storage
seqs. At most ftlayer.logs.LISTED offsets, roots or seqs are listed per line.

Levels: a timeout and a dead letter are WARNING (something is wrong or lost for the
pipeline's output); an explicit fail and a recovery are INFO (user code decided, or a
restart replays). Failures are the cold path: the grouping is O(n log n) over the
failed records of the call, and skipped when INFO is off.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from ftlayer.causes import Causes
from ftlayer.logs import LISTED, fields, hex_ids
from ftlayer.records import RecordBatch

from .retries import RetryRecord

__all__ = ["log_failed", "log_requeue_error"]

log = logging.getLogger("ftlayer.core")

QUEUED: Final = 0
WAITING: Final = 1
DEAD: Final = 2
_MESSAGES: Final = {
    QUEUED: "trees failed (%s): queued for replay",
    WAITING: "trees failed (%s): waiting for their backoff before replay",
    DEAD: "records dead-lettered (last failure: %s): their retries are spent",
}


def log_failed(
    kind: str,
    old_roots: NDArray[np.uint64],
    new_roots: NDArray[np.uint64],
    seqs: NDArray[np.uint64],
    batch: RecordBatch,
    fate: NDArray[np.int8],
    causes: Causes | None,
    due: NDArray[np.float64],
    records: Mapping[int, RetryRecord],
) -> None:
    """Log a requeue's failed records (module docstring). `kind` is the FailCause value
    (explicit, timeout, recovery); the arrays are aligned with `batch`."""
    n = len(old_roots)
    if not n or not log.isEnabledFor(logging.INFO):
        return
    for rows in _groups(batch, fate):
        first = int(rows[0])
        group_fate = int(fate[first])
        extra: dict[str, Any] = {
            "source_id": int(batch.source_ids[first]),
            "topic": batch.topics[first],
            "partition": int(batch.partitions[first]),
            "cause": kind,
            "count": len(rows),
            "offsets": batch.offsets[rows[:LISTED]].tolist(),
            "roots": hex_ids(old_roots[rows[:LISTED]].tolist()),
        }
        if causes is not None and not causes.unspecified:
            cause = causes[first]
            extra.update(kind=cause.kind.label, step=cause.step, error=cause.error)
        shown = kind
        if group_fate == DEAD:
            seq = int(seqs[first])
            record = records.get(seq)
            extra["seqs"] = seqs[rows[:LISTED]].tolist()
            if record is not None:
                extra["attempts"] = record.attempts
                last = record.last_cause
                shown = kind if last is None else last.kind.label
        else:
            extra["new_roots"] = hex_ids(new_roots[rows[:LISTED]].tolist())
        if group_fate == WAITING:
            extra["due"] = round(float(due[rows].min()), 3)
        level = logging.WARNING if group_fate == DEAD or kind == "timeout" else logging.INFO
        log.log(level, _MESSAGES[group_fate], shown, extra=fields(**extra))


def _groups(batch: RecordBatch, fate: NDArray[np.int8]) -> list[NDArray[np.intp]]:
    """The rows of each (fate, source, topic, partition), in that order; the rows of
    one group in the order given."""
    n = len(batch)
    names = list(dict.fromkeys(batch.topics))
    columns = (fate, batch.source_ids, batch.partitions)
    if len(names) == 1 and all(bool((c == c[0]).all()) for c in columns):
        return [np.arange(n)]  # usual: a failure of one partition's records
    if len(names) == 1:
        topic_codes = np.zeros(n, dtype=np.int64)
    else:
        code_of = {name: i for i, name in enumerate(names)}
        topic_codes = np.fromiter((code_of[t] for t in batch.topics), np.int64, n)
    keys = (fate.astype(np.int64), batch.source_ids.astype(np.int64), topic_codes,
            batch.partitions.astype(np.int64))  # fmt: skip
    order = np.lexsort(keys[::-1])
    sorted_keys = np.stack([k[order] for k in keys])
    starts = np.flatnonzero(np.r_[True, (np.diff(sorted_keys, axis=1) != 0).any(axis=0)])
    return np.split(order, starts[1:])


def log_requeue_error(
    kind: str, roots: NDArray[np.uint64], seqs: NDArray[np.uint64], exc: BaseException
) -> None:
    """A requeue whose storage write failed: the records stay pending under these roots
    and are failed again by their timeout."""
    log.error(
        "could not requeue failed trees (%s): they stay pending and fail again at their "
        "timeout: %s",
        kind,
        exc,
        extra=fields(
            cause=kind,
            count=len(roots),
            roots=hex_ids(roots.tolist()),
            seqs=seqs[:LISTED].tolist(),
        ),
    )
