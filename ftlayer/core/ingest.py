"""Records of a source that cannot replay, taken in by a receiver: the FT layer is their
write-ahead log.

A receiver (a process of its own) takes records from an upstream that cannot seek (a
NATS JetStream consumer, NATS core subjects, HTTP webhooks), stores them here with
INGEST, and acknowledges them upstream only once `ingest` returned: from then on the
FT layer's store is their durable copy, and nothing upstream keeps them. Each record
becomes what a failed Kafka record becomes once it is due for a replay: stored with its
bytes under a root of its own, pending (untimed until its source fetches it), and
queued in the replay queue under a replay seq, routed to a partition by its source's
replay partitioner. The source's Spark reader takes the queue in deterministic ranges
of replay seqs, as the ftkafka source takes its replays (FETCH_REPLAY), and the
records complete, fail, retry, dead-letter and leave the store as any record does.

Redelivery. An upstream that redelivers what was not acknowledged (JetStream, after a
receiver died between the store and its ack) sends a record again. A record that
names its identity upstream (its `offsets` entry >= 0, e.g. JetStream's stream
sequence, unique within its `topics` entry, e.g. the stream's name) is taken once per
`window_s`: a second copy within the window is dropped and counted (`duplicates`). The
identities are stored with the records they came with, in the same transaction (meta
`ingest/<first seq, 20 digits>`: the ingest time and, per (source, upstream name), the
identities), so a restarted FT layer still drops the second copies; entries older
than the window are deleted with a later write. A record with identity -1 is always
taken (an upstream that never redelivers, or one without identities).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from ftlayer.errors import ConfigError
from ftlayer.records import RecordBatch

from .ingestids import INGEST_META_PREFIX, IngestResult
from .queueing import reserve_replay_seqs
from .state import CoreState

__all__ = ["ingest"]


def ingest(s: CoreState, batch: RecordBatch) -> IngestResult:
    """Store a receiver's records (with their bytes) durably and queue them for their
    source's reader (module docstring); second copies of records ingested within the
    window are dropped. Durable on return."""
    if batch.any_references:
        raise ConfigError("ingested records carry their bytes: none may be stored by reference")
    for source_id in np.unique(batch.source_ids).tolist():
        if s.source_config(int(source_id)) is None:
            raise ConfigError(f"source {source_id} is not registered (REGISTER_SOURCE first)")
    ids = s.ingest_ids
    ids.load(s.storage)
    now = s.wall()
    keep = ids.fresh(batch, now)
    duplicates = int((~keep).sum())
    if duplicates:
        batch = batch.take(np.flatnonzero(keep))
    n = len(batch)
    if not n:
        s.stats.ingest_duplicates += duplicates
        return IngestResult(0, duplicates)
    roots = s.new_roots(n)
    batch = batch.with_roots(roots)
    index, partitions = s.route(batch)
    expired = ids.expired(now)
    if expired:
        s.storage.stage_meta({}, expired)
    entry = ids.entry(batch, now)
    written: list[tuple[str, bytes]] = []

    def meta(seqs: NDArray[np.uint64]) -> dict[str, bytes]:
        if entry is None:
            return {}
        written[:] = [(f"{INGEST_META_PREFIX}{int(seqs[0]):020d}", entry)]
        return dict(written)

    s.changing()
    replay_seqs = reserve_replay_seqs(s, n)
    # Stored queued, in one write: durable, found again at start.
    seqs = s.persistence.persist(batch, meta, replay_seqs)
    for key, raw in written:
        ids.add(key, raw)
    s.acker.add(roots, None, seq=seqs, **s.persistence.locators(batch))
    if s.journal is not None:
        s.journal.add(roots)
    s.queue.append(
        replay_seqs[index], roots[index], seqs[index], batch.source_ids[index], partitions
    )
    s.meters.persisted(batch.source_ids, int(seqs[0]), s.clock())
    s.stats.persisted += n
    s.stats.ingested += n
    s.stats.ingest_duplicates += duplicates
    return IngestResult(n, duplicates)
