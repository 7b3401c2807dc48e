"""Records entering the replay queue: their replay seqs, and the queue's memory of them.

A record is queued for replay once its replay seq is stored with it: by a retag of a
stored record (`failure.enqueue`), or in the very write that stores it (`put` with
replay seqs: a failed row whose bytes its source copied in after its backoff ended,
ftlayer.core.rangefail; a record a receiver ingests, ftlayer.core.ingest). Both reserve
the seqs first (`reserve_replay_seqs`: the counter rides on that write) and, once the
write committed, put the records where the source's next fetch finds them
(`queue_stored`). A write that fails leaves the reserved seqs unused, a gap in the
queue's numbering that no reader misses (replay seqs are never reused).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from ftlayer.records import RecordBatch

from .replay import REPLAY_SEQ_META_KEY
from .state import CoreState

__all__ = ["queue_stored", "reserve_replay_seqs"]


def reserve_replay_seqs(s: CoreState, n: int) -> NDArray[np.uint64]:
    """The next n replay seqs. The counter is staged (PersistenceStorage.stage_meta),
    so it commits in the transaction of the write that gives the records their replay
    seqs, which every caller makes next: stored no later than any record uses one,
    without a commit of its own."""
    return s.queue.reserve(
        n,
        lambda next_seq: s.storage.stage_meta({REPLAY_SEQ_META_KEY: str(next_seq).encode()}),
    )


def queue_stored(
    s: CoreState,
    roots: NDArray[np.uint64],
    seqs: NDArray[np.uint64],
    batch: RecordBatch,
    replay_seqs: NDArray[np.uint64],
    route: tuple[NDArray[np.intp], NDArray[np.int32]],
) -> None:
    """Records stored under `roots` with their `replay_seqs` (aligned with `seqs` and
    `batch`) enter the replay queue, each in the partitions `route` (CoreState.route
    of `batch`: record index, target partition) names; they are counted replayed, and
    kept with their bytes for the fetch (ReplayQueue.records). Memory only."""
    index, partitions = route
    s.queue.append(
        replay_seqs[index], roots[index], seqs[index], batch.source_ids[index], partitions
    )
    s.queue.records.add(seqs, batch, replay_seqs)
    s.stats.replayed += len(seqs)
    s.meters.replayed(batch.source_ids)
