"""The FT layer's counters: what it persisted, completed and failed (by cause) since it
started, and the state of its replay queue, as `ftlayer status` shows them; per source
and with the complete latency from ftlayer.core.meters."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["FTStats", "FailCause"]


class FailCause(enum.Enum):
    EXPLICIT = "explicit"
    TIMEOUT = "timeout"
    RECOVERY = "recovery"
    SOURCE_EXPIRED = "source-expired"


@dataclass(slots=True)
class FTStats:
    """Counters of one FT layer since it started (pending and queue are current)."""

    persisted: int = 0
    completed: int = 0
    pending: int = 0
    failed: dict[str, int] = field(default_factory=lambda: {c.value: 0 for c in FailCause})
    replay_queue: int = 0
    replayed: int = 0
    """Failed records that entered the replay queue (each got a replay seq)."""
    replay_cursor: int = 0
    replay_cursors: dict[str, int] = field(default_factory=dict)
    """Per source id (as a string, JSON's way): its highest replay seq. A source that
    has none since the start reads `replay_cursor_at_start` (see replay_cursor_of)."""
    replay_cursor_at_start: int = 0
    replay_pruned: dict[str, int] = field(default_factory=dict)
    """Per source id (as a string; "*" for a prune of every source): the replay seq its
    queue entries were pruned up to. A new query of that source starts its replay
    cursor there, so it takes every queued replay of its source that no finished batch
    took in (those queued before it started, and those a restart recovered)."""
    retry_waiting: int = 0
    """Failed records waiting for their backoff before they enter the replay queue."""
    unfilled: int = 0
    """Failed records stored by reference whose bytes their source has not copied in
    (ftlayer.core.fills)."""
    filled: int = 0
    """Records stored by reference whose bytes their source copied in, since the start."""
    ingested: int = 0
    """Records receivers stored for sources that cannot replay (ftlayer.core.ingest)."""
    ingest_duplicates: int = 0
    """Second copies of ingested records an upstream sent again, dropped."""
    open_ranges: int = 0
    """Batch ranges open now: a barrier-mode batch read by reference, one offset range
    per partition, whose records complete with their batch (ftlayer.core.ranges)."""
    dead_lettered: int = 0
    """Records dead-lettered since the start (their retries spent, or a final cause)."""
    dead_letters: int = 0
    """Dead letters stored now (not yet delivered to a dead-letter topic, nor purged)."""
    dead_letters_delivered: int = 0
    dead_letters_purged: int = 0
    dead_letters_requeued: int = 0
    barrier_holds: int = 0
    """Barrier holds open now: roots in a batch of a barrier-mode source still running."""
    barrier_released: int = 0
    """Barrier holds released (ftlayer.core.barrier): roots that entered a batch of a
    barrier-mode source, whose batch is done."""
    recovered_pending: int = 0
    """Records found pending at start whose trees the journal knew: restored as they
    were, not replayed (ftlayer.core.journal)."""
    recovered_completed: int = 0
    """Records found at start whose trees the journal knew complete: deleted, not
    replayed."""
    timeouts_postponed: int = 0
    """Roots whose timeout expired while their batch was still running (open and
    leased by its driver's heartbeats) and was postponed, counted per postponement
    (ftlayer.core.leases)."""
    batches_running: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per source id (as a string) with an open batch: `running_s` since its barrier and
    `lease_s`, the time its heartbeat lease has left (0: none, or lapsed)."""
    taken_over: int = 0
    """Pending roots retired because their record was persisted again (a re-read: a
    task retried, a speculative attempt, a batch run again; ftlayer.core.takeover):
    the new root covers the record, the old one is not replayed."""
    late_events: int = 0
    unknown_events: int = 0
    xor_events: int = 0
    complete_latency: dict[str, Any] = field(
        default_factory=lambda: {"count": 0, "sum_s": 0.0, "p50_s": None, "p99_s": None}
    )
    """Persist to completion of trees that completed on their first attempt: count,
    sum_s, p50_s, p99_s (ftlayer.core.meters)."""
    by_source: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per source id (a string): persisted, completed, failed by cause, replayed,
    dead_lettered, replay_queue and complete_latency (SourceMeters.figures, written by
    ftlayer.status.SourceFigures)."""

    def to_json(self) -> dict[str, Any]:
        """Every field, as a copy of plain JSON values (what dataclasses.asdict gives,
        for a fraction of its cost: the leaves are numbers, strings and None)."""
        return {name: _plain(getattr(self, name)) for name in _FIELDS}


def _plain(value: Any) -> Any:
    if type(value) is dict:
        return {k: _plain(v) for k, v in value.items()}
    if type(value) is list:
        return [_plain(v) for v in value]
    return value


_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(FTStats))
