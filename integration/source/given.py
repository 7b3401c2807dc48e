"""The replays a batch takes in, fetched once by its planner and handed to its readers.

Each input partition of a batch takes in the replays its source's replay partitioner
routed to it, lo < replay seq <= hi on each shard (FTKafkaPartition.replays). A reader
can fetch its own (FETCH_REPLAY naming its source and partition), one request per
partition and shard, each on the path of a task. In barrier mode the planner has them
fetched for all of them instead, in the request that begins the batch on each shard
(BATCH_BEGIN, SourceDriver.begin_batch: one per shard, for every source of the query),
whose rows `hand_over` splits by the partition each was routed to and hands to that
partition (`FTKafkaPartition.given`), so a reader emits them without a request.

The contract:

- The fetch comes after the batch's barrier begins, in the same request (a
  barrier-mode replay's hold belongs to the batch running when it is fetched: fetched
  before, it would complete with the batch before, unprocessed), and only the rows of
  a shard whose answer counts are handed over.
- Only what the batch's readers would fetch themselves: the rows of the batch's sources
  routed to one of its partitions. A row routed to a partition the batch does not
  read (none such for Kafka, whose partitions the batch reads all) goes to the first
  partition of its source, with a warning: fetched, it is held to this batch, and
  must be emitted by it.
- At most GIVEN_MAX_BYTES of payloads in all: a batch with more hands nothing over, and
  its readers fetch as they would (a second fetch of a replay is a re-run's,
  ftlayer.core.failure.fetch_replay), so the plan Spark ships with each task stays
  small.
- A shard whose request fails, or answers from another store than the batch's
  position names, hands nothing over: its readers fetch (and fail, or not, as without
  this).
- Replays stored by reference are handed over as fetched; the reader reads their
  bytes from Kafka as after its own fetch.
- Barrier mode only: a task Spark runs again emits the replays it was handed under the
  same roots, which complete at the batch's barrier either way. In tree mode a reader
  run again fetches again, so that its replays come under fresh roots that take the
  first run's over (ftlayer.core.takeover), instead of waiting for their timeout.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Final

import numpy as np

from ftlayer.records import Payloads, ReplayRecords

from .reader import FTKafkaPartition

log = logging.getLogger("ftlayer.integration.source")

__all__ = ["GIVEN_MAX_BYTES", "hand_over"]

#: The payload bytes a planner hands over at most, over all partitions of a batch.
GIVEN_MAX_BYTES: Final = 4 * 1024 * 1024


def hand_over(
    parts: list[FTKafkaPartition], found: Sequence[ReplayRecords | None]
) -> list[FTKafkaPartition]:
    """`parts` with the replays each takes in handed over, from the rows each shard's
    BATCH_BEGIN fetched (`found`, None for a shard whose readers fetch): nothing when
    they hold more than GIVEN_MAX_BYTES of payloads (module docstring)."""
    if sum(_payload_bytes(f) for f in found if f is not None) > GIVEN_MAX_BYTES:
        return parts
    given = [None if f is None else _by_partition(f, parts) for f in found]
    return [p.with_given(given) for p in parts]


def _by_partition(
    found: ReplayRecords, parts: list[FTKafkaPartition]
) -> dict[tuple[int, int], ReplayRecords]:
    """The rows of `found` by (source id, partition) of the part that takes them in."""
    none = found.take(np.zeros(0, dtype=np.intp))
    out: dict[tuple[int, int], ReplayRecords] = {(p.source_id, p.partition): none for p in parts}
    if not len(found):
        return out
    sources = found.records.source_ids.astype(np.int64)
    targets = found.partitions.astype(np.int64)
    read = set(out)
    first: dict[int, int] = {}
    for p in parts:
        first.setdefault(p.source_id, p.partition)
    keys = sorted(set(zip(sources.tolist(), targets.tolist(), strict=True)))
    for source_id, target in keys:
        rows = np.flatnonzero((sources == source_id) & (targets == target))
        key = (source_id, target)
        if key not in read:
            key = (source_id, first[source_id])
            log.warning(
                "%d replays of source %d were routed to partition %d, which this batch "
                "does not read: partition %d takes them in",
                len(rows), source_id, target, key[1],
            )  # fmt: skip
        taken = found.take(rows)
        out[key] = taken if not len(out[key]) else ReplayRecords.concat([out[key], taken])
    return out


def _payload_bytes(found: ReplayRecords) -> int:
    payloads = found.records.payloads
    return len(payloads.blob) if isinstance(payloads, Payloads) else sum(map(len, payloads))
