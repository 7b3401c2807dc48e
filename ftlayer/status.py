"""What the FT layer reports across the wire, typed: `Status` (the STATUS reply),
`BriefStatus` (the brief STATUS reply: what a source's driver reads per batch) and
`CheckpointReport` (one checkpoint, as a CHECKPOINT reply and STATUS carry it).

Each has one parser (`from_json`, strict: every documented field, of its documented
JSON type; StatusError naming the field otherwise) and one formatter (`to_json`); the
JSON is docs/protocol.md's (sections 5.6 and 6.2). Code reads the fields by name, and
the questions a source asks have typed answers (`Status.replay_cursor_of`,
`Status.replay_start_of`, `Status.pending_of`, `CheckpointReport.commit_offsets`).
Both are also read-only mappings of their JSON form, for scripts and the CLI's
`--json`.

Pure Python: an executor or a driver imports this without the FT layer's core.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ftlayer.errors import CorruptData, PositionError
from ftlayer.position import KafkaOffsets, Position, offsets_from_json, offsets_to_json

__all__ = [
    "BriefStatus",
    "CheckpointReport",
    "LatencySummary",
    "QueryCheckpoints",
    "RequestCost",
    "SourceFigures",
    "Status",
    "StatusError",
]


class StatusError(CorruptData):
    """A STATUS or CHECKPOINT reply that is not of the documented form."""


def _strict_object(data: object, cls: type, what: str) -> Mapping[str, Any]:
    """`data` as a JSON object holding no key that is not a field of dataclass `cls`
    (StatusError otherwise, naming the keys this client does not know)."""
    if not isinstance(data, Mapping):
        raise StatusError(f"{what} is a JSON object, got {data!r}"[:300])
    extra = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
    if extra:
        raise StatusError(f"{what} has fields this client does not know: {extra}")
    return data


def _field(data: Mapping[str, Any], name: str, kind: type | tuple[type, ...], what: str) -> Any:
    if name not in data:
        raise StatusError(f"{what} has no {name!r}")
    value = data[name]
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
        raise StatusError(f"{what}'s {name!r} is {value!r}, not {kind}")
    return value


def _optional(data: Mapping[str, Any], name: str, kind: type | tuple[type, ...], what: str) -> Any:
    return None if data.get(name) is None else _field(data, name, kind, what)


def _counts(data: Mapping[str, Any], name: str, what: str) -> dict[str, int]:
    value = _field(data, name, dict, what)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value.values()):
        raise StatusError(f"{what}'s {name!r} holds a value that is not an integer: {value!r}")
    return {str(k): int(v) for k, v in value.items()}


def _sources(data: Mapping[str, Any], what: str) -> dict[str, dict[str, Any]]:
    value = _field(data, "sources", dict, what)
    if not all(
        isinstance(v, dict) and isinstance(v.get("partitioner"), str) for v in value.values()
    ):
        raise StatusError(f"{what}'s 'sources' holds a registration without a partitioner")
    return {str(k): dict(v) for k, v in value.items()}


_NUMBER = (int, float)
_BATCH_FIGURES = ("running_s", "lease_s")


def _batches_running(data: Mapping[str, Any], what: str) -> dict[str, dict[str, float]]:
    value = _field(data, "batches_running", dict, what)
    for source, batch in value.items():
        if not (
            isinstance(batch, dict)
            and set(batch) == set(_BATCH_FIGURES)
            and all(
                isinstance(batch[k], _NUMBER) and not isinstance(batch[k], bool)
                for k in _BATCH_FIGURES
            )
        ):
            raise StatusError(
                f"{what}'s 'batches_running' of source {source} is {batch!r}, not "
                '{"running_s": number, "lease_s": number}'
            )
    return {str(k): {f: float(v[f]) for f in _BATCH_FIGURES} for k, v in value.items()}


@dataclass(frozen=True, slots=True)
class CheckpointReport(Mapping[str, Any]):
    """One barrier's checkpoint as the FT layer reports it (times are UNIX seconds); also a
    read-only mapping of its JSON form."""

    query: str
    id: int
    mode: str
    state: str
    """"begun" (the batch runs), "aligning" (done; roots before the barrier pending),
    "complete"."""
    position: Position
    sources: tuple[int, ...]
    begun_at: float
    done_at: float | None
    completed_at: float | None
    duration_s: float | None
    alignment_wait_s: float | None
    pending_roots: int
    replay_queue: int
    copy_s: float
    write_s: float | None
    size_bytes: int
    pruned: int
    commit_offsets: KafkaOffsets | None
    """The consumer-group offsets this checkpoint allows (set at completion)."""
    superseded: bool = False
    """The journal base copied at its barrier could not be written: it completes once a
    later base is (ftlayer.checkpoint.coordinator, "A failed write")."""
    completed: CheckpointReport | None = None
    """In a CHECKPOINT_BEGIN reply that completed the batch before: that checkpoint."""

    @classmethod
    def from_json(cls, data: object) -> CheckpointReport:
        what = "a checkpoint"
        if not isinstance(data, Mapping):
            raise StatusError(f"{what} is a JSON object, got {data!r}"[:300])
        try:
            position = Position.parse(data.get("position"), need_replay=True, what="checkpoint")
            offsets = data.get("commit_offsets")
            commit_offsets = None if offsets is None else offsets_from_json(offsets)
        except PositionError as exc:
            raise StatusError(f"{what}: {exc}") from None
        sources = _field(data, "sources", list, what)
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in sources):
            raise StatusError(f"{what}'s sources are not integers: {sources!r}")
        completed = data.get("completed")
        return cls(
            query=_field(data, "query", str, what),
            id=_field(data, "id", int, what),
            mode=_field(data, "mode", str, what),
            state=_field(data, "state", str, what),
            position=position,
            sources=tuple(sources),
            begun_at=float(_field(data, "begun_at", _NUMBER, what)),
            done_at=_optional(data, "done_at", _NUMBER, what),
            completed_at=_optional(data, "completed_at", _NUMBER, what),
            duration_s=_optional(data, "duration_s", _NUMBER, what),
            alignment_wait_s=_optional(data, "alignment_wait_s", _NUMBER, what),
            pending_roots=_field(data, "pending_roots", int, what),
            replay_queue=_field(data, "replay_queue", int, what),
            copy_s=float(_field(data, "copy_s", _NUMBER, what)),
            write_s=_optional(data, "write_s", _NUMBER, what),
            size_bytes=_field(data, "size_bytes", int, what),
            pruned=_field(data, "pruned", int, what),
            commit_offsets=commit_offsets,
            superseded=bool(_optional(data, "superseded", bool, what)),
            completed=None if completed is None else cls.from_json(completed),
        )

    def to_json(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["position"] = self.position.to_json()
        data["sources"] = list(self.sources)
        if self.commit_offsets is not None:
            data["commit_offsets"] = offsets_to_json(self.commit_offsets)
        if self.completed is None:
            del data["completed"]
        else:
            data["completed"] = self.completed.to_json()
        return data

    def __getitem__(self, key: str) -> Any:
        return self.to_json()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_json())

    def __len__(self) -> int:
        return len(self.to_json())


@dataclass(frozen=True, slots=True)
class QueryCheckpoints:
    """The checkpoints of one query (its source name) in a STATUS reply."""

    completed: int
    open: tuple[CheckpointReport, ...]
    recent: tuple[CheckpointReport, ...]
    last_complete_id: int | None

    @classmethod
    def from_json(cls, data: object, query: str) -> QueryCheckpoints:
        what = f"the checkpoints of query {query!r}"
        if not isinstance(data, Mapping):
            raise StatusError(f"{what} are a JSON object, got {data!r}"[:300])
        return cls(
            completed=_field(data, "completed", int, what),
            open=tuple(CheckpointReport.from_json(c) for c in _field(data, "open", list, what)),
            recent=tuple(CheckpointReport.from_json(c) for c in _field(data, "recent", list, what)),
            last_complete_id=_optional(data, "last_complete_id", int, what),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "completed": self.completed,
            "open": [c.to_json() for c in self.open],
            "recent": [c.to_json() for c in self.recent],
            "last_complete_id": self.last_complete_id,
        }


@dataclass(frozen=True, slots=True)
class LatencySummary:
    """The complete latency (persist to completion, first attempts only) of some trees:
    how many were measured, the sum and two quantiles, in seconds (None: none measured).
    The quantiles are estimated from histogram buckets, within 28 % (ftlayer.core.meters)."""

    count: int
    sum_s: float
    p50_s: float | None
    p99_s: float | None

    @classmethod
    def from_json(cls, data: object, what: str) -> LatencySummary:
        if not isinstance(data, Mapping):
            raise StatusError(f"{what} is a JSON object, got {data!r}"[:300])
        p50, p99 = _optional(data, "p50_s", _NUMBER, what), _optional(data, "p99_s", _NUMBER, what)
        return cls(
            count=_field(data, "count", int, what),
            sum_s=float(_field(data, "sum_s", _NUMBER, what)),
            p50_s=None if p50 is None else float(p50),
            p99_s=None if p99 is None else float(p99),
        )

    def to_json(self) -> dict[str, Any]:
        return {"count": self.count, "sum_s": self.sum_s, "p50_s": self.p50_s, "p99_s": self.p99_s}


@dataclass(frozen=True, slots=True)
class SourceFigures:
    """One source's counters since the server started, its replay queue entries now and
    its complete latency (STATUS `by_source`)."""

    persisted: int
    completed: int
    failed: Mapping[str, int]
    replayed: int
    dead_lettered: int
    replay_queue: int
    complete_latency: LatencySummary
    unfilled: int = 0
    """Failed records stored by reference whose bytes the source has not copied into
    the FT layer yet (ftlayer.core.fills)."""

    @classmethod
    def from_json(cls, data: object, source: str) -> SourceFigures:
        what = f"the figures of source {source}"
        if not isinstance(data, Mapping):
            raise StatusError(f"{what} are a JSON object, got {data!r}"[:300])
        return cls(
            persisted=_field(data, "persisted", int, what),
            completed=_field(data, "completed", int, what),
            failed=_counts(data, "failed", what),
            replayed=_field(data, "replayed", int, what),
            dead_lettered=_field(data, "dead_lettered", int, what),
            replay_queue=_field(data, "replay_queue", int, what),
            complete_latency=LatencySummary.from_json(
                _field(data, "complete_latency", dict, what), f"{what}'s complete_latency"
            ),
            unfilled=_field(data, "unfilled", int, what),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "persisted": self.persisted,
            "completed": self.completed,
            "failed": dict(self.failed),
            "replayed": self.replayed,
            "dead_lettered": self.dead_lettered,
            "replay_queue": self.replay_queue,
            "unfilled": self.unfilled,
            "complete_latency": self.complete_latency.to_json(),
        }


@dataclass(frozen=True, slots=True)
class RequestCost:
    """STATUS `requests`: how many requests of a kind were answered, and their CPU."""

    count: int
    cpu_s: float

    @classmethod
    def from_json(cls, data: object, what: str) -> RequestCost:
        if not isinstance(data, Mapping):
            raise StatusError(f"{what} is a JSON object, got {data!r}"[:300])
        return cls(
            count=_field(data, "count", int, what),
            cpu_s=float(_field(data, "cpu_s", _NUMBER, what)),
        )

    def to_json(self) -> dict[str, Any]:
        return {"count": self.count, "cpu_s": self.cpu_s}


@dataclass(frozen=True, slots=True)
class Status(Mapping[str, Any]):
    """The STATUS reply: the FT layer's counters and state (docs/protocol.md, 6.2)."""

    persisted: int
    completed: int
    pending: int
    failed: Mapping[str, int]
    """Failures by cause: explicit, timeout, recovery."""
    replay_queue: int
    replayed: int
    """Failed records that entered the replay queue since the start (a replay seq each)."""
    replay_cursor: int
    replay_cursors: Mapping[str, int]
    """Per source id (a string): the highest replay seq of its records since the start."""
    replay_cursor_at_start: int
    replay_pruned: Mapping[str, int]
    """Per source id (a string; "*": every source): where its queue rows were pruned to."""
    retry_waiting: int
    """Failed records waiting for their backoff before they enter the replay queue."""
    unfilled: int
    """Failed records stored by reference whose bytes their source has not copied into
    the FT layer yet (ftlayer.core.fills)."""
    filled: int
    """Records stored by reference whose bytes their source copied in, since the start."""
    ingested: int
    """Records receivers stored for sources that cannot replay."""
    ingest_duplicates: int
    """Second copies of ingested records (an upstream's redelivery), dropped."""
    open_ranges: int
    """Batch ranges open now (ftlayer.core.ranges)."""
    dead_lettered: int
    """Records dead-lettered since the start."""
    dead_letters: int
    """Dead letters stored now (not yet delivered to their topic, nor purged)."""
    dead_letters_delivered: int
    dead_letters_purged: int
    dead_letters_requeued: int
    barrier_holds: int
    """Barrier holds open now (roots in a running batch of a barrier-mode source)."""
    barrier_released: int
    """Barrier holds released since the start (ftlayer.core.barrier)."""
    recovered_pending: int
    """Records restored pending from the journal at start (not replayed)."""
    recovered_completed: int
    """Records the journal knew complete at start (deleted, not replayed)."""
    timeouts_postponed: int
    """Roots whose timeout was postponed because their batch was still running (its
    driver heartbeating), counted per postponement (ftlayer.core.leases)."""
    batches_running: Mapping[str, Mapping[str, float]]
    """Per source id (a string) with an open batch: `running_s` since its barrier and
    `lease_s` its heartbeat lease has left (0: none, ended or lapsed: its trees wait
    for the source's next barrier, up to the server's --lapsed-batch-timeout-s,
    ftlayer.core.leases)."""
    taken_over: int
    """Pending roots retired since the start because their record was persisted again
    (a re-read: a task retried, a speculative attempt, a batch run again)."""
    late_events: int
    unknown_events: int
    xor_events: int
    complete_latency: LatencySummary
    """Persist to completion of the trees that completed on their first attempt."""
    by_source: Mapping[str, SourceFigures]
    """Per source id (a string): its counters, replay queue and complete latency."""
    pending_by_source: Mapping[str, int]
    """Per source id (a string): its pending roots, in flight or waiting as replays;
    sources with none are absent."""
    stored_records: int
    deletes_pending: int
    lmdb_size_bytes: int
    store_commits: int
    """Write transactions the store committed since the server started (an fsync each)."""
    connections: int
    max_connections: int
    uptime_s: float
    checkpoints: Mapping[str, QueryCheckpoints]
    """Per query (a source name)."""
    sources: Mapping[str, Mapping[str, Any]]
    """Per registered source id (a string): its registration, as REGISTER_SOURCE gave
    it (partitioner, num_partitions, options, timeout_s; retry and dead_letter_topic
    where set)."""
    timeout_s: float
    buckets: int
    version: str
    shard: int
    shards: int
    """The server's place: shard `shard` of a cluster of `shards` (ftlayer.shards)."""
    store_id: str
    """Its store's id: another one after its data dir was lost and made again."""
    requests: Mapping[str, RequestCost]
    """Per request kind (its name) answered since the server started: how many, and
    the CPU seconds their handlers spent (ftlayer.server.requestcosts)."""
    parked: Mapping[str, Mapping[str, int]] = dataclasses.field(default_factory=dict)
    """Per owner shard (a string): the failures of that shard parked here because it
    could not be reached, `entries` and the `roots` they name (ftlayer.core.parked);
    shards with none are absent."""

    @classmethod
    def from_json(cls, data: object) -> Status:
        what = "the STATUS reply"
        data = _strict_object(data, cls, what)
        checkpoints = _field(data, "checkpoints", dict, what)
        return cls(
            persisted=_field(data, "persisted", int, what),
            completed=_field(data, "completed", int, what),
            pending=_field(data, "pending", int, what),
            failed=_counts(data, "failed", what),
            replay_queue=_field(data, "replay_queue", int, what),
            replayed=_field(data, "replayed", int, what),
            replay_cursor=_field(data, "replay_cursor", int, what),
            replay_cursors=_counts(data, "replay_cursors", what),
            replay_cursor_at_start=_field(data, "replay_cursor_at_start", int, what),
            replay_pruned=_counts(data, "replay_pruned", what),
            retry_waiting=_field(data, "retry_waiting", int, what),
            unfilled=_field(data, "unfilled", int, what),
            filled=_field(data, "filled", int, what),
            ingested=_field(data, "ingested", int, what),
            ingest_duplicates=_field(data, "ingest_duplicates", int, what),
            open_ranges=_field(data, "open_ranges", int, what),
            dead_lettered=_field(data, "dead_lettered", int, what),
            dead_letters=_field(data, "dead_letters", int, what),
            dead_letters_delivered=_field(data, "dead_letters_delivered", int, what),
            dead_letters_purged=_field(data, "dead_letters_purged", int, what),
            dead_letters_requeued=_field(data, "dead_letters_requeued", int, what),
            barrier_holds=_field(data, "barrier_holds", int, what),
            barrier_released=_field(data, "barrier_released", int, what),
            recovered_pending=_field(data, "recovered_pending", int, what),
            recovered_completed=_field(data, "recovered_completed", int, what),
            timeouts_postponed=_field(data, "timeouts_postponed", int, what),
            batches_running=_batches_running(data, what),
            taken_over=_field(data, "taken_over", int, what),
            late_events=_field(data, "late_events", int, what),
            unknown_events=_field(data, "unknown_events", int, what),
            xor_events=_field(data, "xor_events", int, what),
            complete_latency=LatencySummary.from_json(
                _field(data, "complete_latency", dict, what), f"{what}'s complete_latency"
            ),
            by_source={
                str(k): SourceFigures.from_json(v, str(k))
                for k, v in _field(data, "by_source", dict, what).items()
            },
            pending_by_source=_counts(data, "pending_by_source", what),
            stored_records=_field(data, "stored_records", int, what),
            deletes_pending=_field(data, "deletes_pending", int, what),
            lmdb_size_bytes=_field(data, "lmdb_size_bytes", int, what),
            store_commits=_field(data, "store_commits", int, what),
            connections=_field(data, "connections", int, what),
            max_connections=_field(data, "max_connections", int, what),
            uptime_s=float(_field(data, "uptime_s", _NUMBER, what)),
            checkpoints={
                str(q): QueryCheckpoints.from_json(c, str(q)) for q, c in checkpoints.items()
            },
            sources=_sources(data, what),
            timeout_s=float(_field(data, "timeout_s", _NUMBER, what)),
            buckets=_field(data, "buckets", int, what),
            version=_field(data, "version", str, what),
            shard=_field(data, "shard", int, what),
            shards=_field(data, "shards", int, what),
            store_id=_field(data, "store_id", str, what),
            requests={
                str(kind): RequestCost.from_json(cost, f"{what}'s requests[{kind!r}]")
                for kind, cost in _field(data, "requests", dict, what).items()
            },
            parked=_parked(data.get("parked", {}), what),
        )

    def to_json(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in ("failed", "replay_cursors", "replay_pruned", "pending_by_source"):
            data[name] = dict(data[name])
        data["batches_running"] = {k: dict(v) for k, v in self.batches_running.items()}
        data["complete_latency"] = self.complete_latency.to_json()
        data["by_source"] = {k: v.to_json() for k, v in self.by_source.items()}
        data["checkpoints"] = {q: c.to_json() for q, c in self.checkpoints.items()}
        data["sources"] = {k: dict(v) for k, v in self.sources.items()}
        data["requests"] = {k: v.to_json() for k, v in self.requests.items()}
        data["parked"] = {k: dict(v) for k, v in self.parked.items()}
        return data

    # ---- the questions a source asks ----------------------------------------------

    def replay_cursor_of(self, source_ids: Sequence[int]) -> int:
        """The highest replay seq of these sources' records (a source with none since
        the server started reads `replay_cursor_at_start`): other sources' failures do
        not move it, so they cause no empty batches."""
        return _cursor_of(self.replay_cursors, self.replay_cursor_at_start, source_ids)

    def replay_start_of(self, source_ids: Sequence[int]) -> int:
        """A new query's replay cursor: where its sources' queue rows were pruned to, so
        its first batch takes in every replay of its sources still queued."""
        return _start_of(self.replay_pruned, source_ids)

    def lease_of(self, source_id: int) -> float | None:
        """The seconds the heartbeat lease on `source_id`'s running batch has left (0:
        none, or lapsed), or None when the source has no batch running."""
        batch = self.batches_running.get(str(source_id))
        return None if batch is None else batch["lease_s"]

    def parked_for(self, shard: int) -> int:
        """The roots of shard `shard`'s failures parked on this server."""
        return int(self.parked.get(str(shard), {}).get("roots", 0))

    def pending_of(self, source_id: int) -> int:
        """The pending roots of one source: its records in flight and its replays
        waiting to be read (the ftkafka source's ft.maxPendingRecords counts these)."""
        return self.pending_by_source.get(str(source_id), 0)

    def unfilled_of(self, source_id: int) -> int:
        """Failed records of one source stored by reference whose bytes it has not
        copied in yet."""
        figures = self.by_source.get(str(source_id))
        return 0 if figures is None else figures.unfilled

    def brief(self) -> BriefStatus:
        """The fields of the brief reply (`BriefStatus`), from this whole one."""
        return BriefStatus(
            replay_cursors=self.replay_cursors,
            replay_cursor_at_start=self.replay_cursor_at_start,
            replay_pruned=self.replay_pruned,
            pending_by_source=self.pending_by_source,
            unfilled_by_source={k: f.unfilled for k, f in self.by_source.items() if f.unfilled},
            timeout_s=self.timeout_s,
            uptime_s=self.uptime_s,
            version=self.version,
            shard=self.shard,
            shards=self.shards,
            store_id=self.store_id,
            parked=self.parked,
        )

    # ---- a read-only mapping of the JSON form -----------------------------------------

    def __getitem__(self, key: str) -> Any:
        return self.to_json()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(f.name for f in dataclasses.fields(self))

    def __len__(self) -> int:
        return len(dataclasses.fields(self))


@dataclass(frozen=True, slots=True)
class BriefStatus:
    """The brief STATUS reply (docs/protocol.md 6.2, "The brief reply"): what the
    ftkafka source's driver reads once per batch (its replay cursor, its pending roots
    for flow control, the failed records whose bytes it owes, the server's place, store
    and timeout), without the heavy sections of the whole reply (checkpoints, sources,
    per-source meters, request costs). Each field means what the whole reply's field of
    the same name means (`Status`); `unfilled_by_source` is `by_source[s].unfilled` of
    the sources with any."""

    replay_cursors: Mapping[str, int]
    replay_cursor_at_start: int
    replay_pruned: Mapping[str, int]
    pending_by_source: Mapping[str, int]
    unfilled_by_source: Mapping[str, int]
    timeout_s: float
    uptime_s: float
    version: str
    shard: int
    shards: int
    store_id: str
    parked: Mapping[str, Mapping[str, int]]

    @classmethod
    def from_json(cls, data: object) -> BriefStatus:
        """Strict, as `Status.from_json`: every key of the brief reply and no other."""
        what = "the brief STATUS reply"
        data = _strict_object(data, cls, what)
        return cls(
            replay_cursors=_counts(data, "replay_cursors", what),
            replay_cursor_at_start=_field(data, "replay_cursor_at_start", int, what),
            replay_pruned=_counts(data, "replay_pruned", what),
            pending_by_source=_counts(data, "pending_by_source", what),
            unfilled_by_source=_counts(data, "unfilled_by_source", what),
            timeout_s=float(_field(data, "timeout_s", _NUMBER, what)),
            uptime_s=float(_field(data, "uptime_s", _NUMBER, what)),
            version=_field(data, "version", str, what),
            shard=_field(data, "shard", int, what),
            shards=_field(data, "shards", int, what),
            store_id=_field(data, "store_id", str, what),
            parked=_parked(_field(data, "parked", dict, what), what),
        )

    def to_json(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in ("replay_cursors", "replay_pruned", "pending_by_source", "unfilled_by_source"):
            data[name] = dict(data[name])
        data["parked"] = {k: dict(v) for k, v in self.parked.items()}
        return data

    # ---- the questions a source asks, answered as `Status` answers them -------------

    def replay_cursor_of(self, source_ids: Sequence[int]) -> int:
        """As `Status.replay_cursor_of`."""
        return _cursor_of(self.replay_cursors, self.replay_cursor_at_start, source_ids)

    def replay_start_of(self, source_ids: Sequence[int]) -> int:
        """As `Status.replay_start_of`."""
        return _start_of(self.replay_pruned, source_ids)

    def parked_for(self, shard: int) -> int:
        """As `Status.parked_for`."""
        return int(self.parked.get(str(shard), {}).get("roots", 0))

    def pending_of(self, source_id: int) -> int:
        """As `Status.pending_of`."""
        return self.pending_by_source.get(str(source_id), 0)

    def unfilled_of(self, source_id: int) -> int:
        """Failed records of one source stored by reference whose bytes it has not
        copied in yet."""
        return self.unfilled_by_source.get(str(source_id), 0)


def _cursor_of(cursors: Mapping[str, int], at_start: int, source_ids: Sequence[int]) -> int:
    return max((cursors.get(str(s), at_start) for s in source_ids), default=at_start)


def _start_of(pruned: Mapping[str, int], source_ids: Sequence[int]) -> int:
    every = pruned.get("*", 0)
    return max((max(every, pruned.get(str(s), 0)) for s in source_ids), default=every)


def _parked(value: object, what: str) -> dict[str, dict[str, int]]:
    """STATUS `parked`: {owner shard: {"entries": n, "roots": n}}."""
    if not isinstance(value, Mapping):
        raise StatusError(f"{what}'s parked is a JSON object, got {value!r}"[:300])
    out: dict[str, dict[str, int]] = {}
    for owner, counts in value.items():
        if not isinstance(counts, Mapping) or set(counts) != {"entries", "roots"}:
            raise StatusError(f"{what}'s parked[{owner!r}] is not entries and roots")
        out[str(owner)] = {k: _field(counts, k, int, what) for k in ("entries", "roots")}
    return out
