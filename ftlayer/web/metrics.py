"""The FT layer's Prometheus metrics, read at scrape time.

`FTCollector.collect` takes one `Observation` (the STATUS reply and the latency
histograms, copied together under the server's lock) and turns it into metric families:
the core counts nothing for Prometheus on its hot path, and a scrape costs what a STATUS
request costs. Names follow Prometheus' conventions: the `ftlayer_` prefix, `_total` on
counters, base units (seconds, bytes) in the name, a `source` label (the source id, as
STATUS names it) where the figure is kept per source, and `query` (a checkpoint query,
the source's `ft.sourceName`) on checkpoint figures. Every metric, the process's own
included, carries `shard`: the server's place in its cluster (STATUS `shard`; "0" for
a server alone), so the scrapes of a cluster's shards add up and never collide. The
table of every metric is in docs/user-guide.md, section 6.9; counters restart from 0
when the server restarts, as Prometheus' rate() expects.

The families that count roots are named for roots (the glossary's word); their former
"trees" names (`DEPRECATED_NAMES`) are still served, as copies whose help text starts
"Deprecated: use <new name>.", so dashboards and alerts keep working until they move.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from ftlayer.core.meters import LatencyHistogram

from .observation import Observation

__all__ = ["DEPRECATED_NAMES", "FTCollector", "families", "registry"]

_CAUSES = ("explicit", "timeout", "recovery", "source-expired")

DEPRECATED_NAMES: dict[str, str] = {
    "ftlayer_trees_completed": "ftlayer_roots_completed",
    "ftlayer_trees_failed": "ftlayer_roots_failed",
    "ftlayer_pending_trees": "ftlayer_pending_roots",
    "ftlayer_last_checkpoint_pending_trees": "ftlayer_last_checkpoint_pending_roots",
}
"""{old family name: new family name}: each old name is still served as a copy of the
new family (counters get `_total` appended on the wire, under either name)."""


class FTCollector(Collector):
    """Collects the metrics of one server and of its process (CPU, memory, files), each
    with the server's `shard`; `observe` is FTServer.observe."""

    def __init__(self, observe: Callable[[], Observation]) -> None:
        self._observe = observe
        self._process = ProcessCollector(registry=None)

    def collect(self) -> Iterator[Metric]:
        observation = self._observe()
        yield from families(observation)
        yield from _with_shard(self._process.collect(), observation.status)


def registry(observe: Callable[[], Observation]) -> CollectorRegistry:
    """A registry of the FT layer's metrics and this process's."""
    found = CollectorRegistry(auto_describe=False)
    found.register(FTCollector(observe))
    return found


def families(observation: Observation) -> list[Metric]:
    """Every FT-layer metric family of one observation."""
    status = observation.status
    by_source: Mapping[str, Mapping[str, Any]] = status["by_source"]
    pending: Mapping[str, int] = status["pending_by_source"]
    sources = sorted({*by_source, *pending}, key=_source_order)
    out: list[Metric] = []

    def per_source(metric: CounterMetricFamily | GaugeMetricFamily, key: str) -> None:
        for source in sources:
            metric.add_metric([source], by_source.get(source, {}).get(key, 0))
        out.append(metric)

    per_source(
        CounterMetricFamily(
            "ftlayer_records_persisted",
            "Source records persisted (stored before their source emitted them).",
            labels=["source"],
        ),
        "persisted",
    )
    per_source(
        CounterMetricFamily(
            "ftlayer_roots_completed",
            "Roots completed (their ack value returned to 0), replays included.",
            labels=["source"],
        ),
        "completed",
    )
    failed = CounterMetricFamily(
        "ftlayer_roots_failed",
        "Roots failed, by cause: explicit (a fail event), timeout, recovery (at start), "
        "source-expired (stored by reference, gone from its source).",
        labels=["source", "cause"],
    )
    for source in sources:
        counts = by_source.get(source, {}).get("failed", {})
        for cause in _CAUSES:
            failed.add_metric([source, cause], counts.get(cause, 0))
    out.append(failed)
    per_source(
        CounterMetricFamily(
            "ftlayer_records_replayed",
            "Failed records that entered the replay queue (after their backoff).",
            labels=["source"],
        ),
        "replayed",
    )
    per_source(
        CounterMetricFamily(
            "ftlayer_records_dead_lettered",
            "Records dead-lettered: their retries spent, or a final cause.",
            labels=["source"],
        ),
        "dead_lettered",
    )
    pending_roots = GaugeMetricFamily(
        "ftlayer_pending_roots",
        "Roots whose tree is not complete: in flight, or waiting as a replay.",
        labels=["source"],
    )
    for source in sources:
        pending_roots.add_metric([source], pending.get(source, 0))
    out.append(pending_roots)
    per_source(
        GaugeMetricFamily(
            "ftlayer_replay_queue_entries",
            "Replay queue entries not pruned yet (one per target partition).",
            labels=["source"],
        ),
        "replay_queue",
    )
    per_source(
        GaugeMetricFamily(
            "ftlayer_unfilled_records",
            "Failed records stored by reference whose bytes the source has not copied in.",
            labels=["source"],
        ),
        "unfilled",
    )
    parked = GaugeMetricFamily(
        "ftlayer_parked_failures",
        "Roots of another shard's failures this shard keeps because that shard could not "
        "be reached, by owner shard, until the source's driver delivers them.",
        labels=["shard"],
    )
    for owner, counts in sorted(status.get("parked", {}).items()):
        parked.add_metric([owner], counts["roots"])
    out.append(parked)
    latency = HistogramMetricFamily(
        "ftlayer_complete_latency_seconds",
        "Persist to completion of trees that completed on their first attempt.",
        labels=["source"],
    )
    for source in sources:
        histogram = observation.latency.get(source, LatencyHistogram())
        latency.add_metric(
            [source],
            [(_le(edge), count) for edge, count in histogram.exported()],
            sum_value=histogram.sum_s,
        )
    out.append(latency)
    out += _totals(status)
    out += _requests(status["requests"])
    out += _checkpoints(status["checkpoints"])
    out.append(InfoMetricFamily("ftlayer", "The server's version.", {"version": status["version"]}))
    return _with_shard(out + _deprecated(out), status)


def _with_shard(found: Iterable[Metric], status: Mapping[str, Any]) -> list[Metric]:
    """The families with the server's shard as a label on every sample."""
    shard = str(status["shard"])
    out = list(found)
    for family in out:
        family.samples = [s._replace(labels={**s.labels, "shard": shard}) for s in family.samples]
    return out


def _requests(requests: Mapping[str, Mapping[str, Any]]) -> list[Metric]:
    """Requests answered and their handlers' CPU, by kind (ftlayer.server.requestcosts)."""
    count = CounterMetricFamily(
        "ftlayer_requests", "Requests answered since the server started.", labels=["kind"]
    )
    cpu = CounterMetricFamily(
        "ftlayer_request_cpu_seconds",
        "CPU seconds the server's handlers of these requests spent.",
        labels=["kind"],
    )
    for kind, cost in requests.items():
        count.add_metric([kind], cost["count"])
        cpu.add_metric([kind], cost["cpu_s"])
    return [count, cpu]


def _deprecated(current: list[Metric]) -> list[Metric]:
    """The families of `DEPRECATED_NAMES` under their old names: the same samples, help
    text "Deprecated: use <new name>. ..." (a counter's new name with its `_total`)."""
    new_to_old = {new: old for old, new in DEPRECATED_NAMES.items()}
    out: list[Metric] = []
    for family in current:
        old = new_to_old.get(family.name)
        if old is None:
            continue
        shown = family.name + ("_total" if family.type == "counter" else "")
        copy = Metric(old, f"Deprecated: use {shown}. {family.documentation}", family.type)
        for sample in family.samples:
            copy.add_sample(
                old + sample.name.removeprefix(family.name), sample.labels, sample.value
            )
        out.append(copy)
    return out


def _totals(status: Mapping[str, Any]) -> list[Metric]:
    """The figures kept for the whole server."""
    gauges = (
        ("ftlayer_retry_waiting_records", "retry_waiting", "Failed records in their backoff."),
        ("ftlayer_dead_letters", "dead_letters", "Dead letters stored now."),
        ("ftlayer_barrier_holds", "barrier_holds", "Barrier holds open now."),
        ("ftlayer_open_batch_ranges", "open_ranges", "Batch ranges open now."),
        ("ftlayer_stored_records", "stored_records", "Records in LMDB."),
        ("ftlayer_deletes_pending_records", "deletes_pending", "Completed, not deleted yet."),
        ("ftlayer_store_size_bytes", "lmdb_size_bytes", "Size of the LMDB data file."),
        ("ftlayer_connections", "connections", "Client connections being served."),
        ("ftlayer_max_connections", "max_connections", "The connection limit."),
        ("ftlayer_replay_cursor", "replay_cursor", "The highest replay seq handed out."),
        ("ftlayer_tree_timeout_seconds", "timeout_s", "The server's tree timeout T."),
    )
    counters = (
        ("ftlayer_xor_events", "xor_events", "XOR events received."),
        ("ftlayer_store_commits", "store_commits", "Write transactions the store committed."),
        ("ftlayer_records_filled", "filled", "Bytes of records stored by reference copied in."),
        ("ftlayer_records_ingested", "ingested", "Records receivers stored (no replay)."),
        ("ftlayer_ingest_duplicates", "ingest_duplicates", "Ingested copies dropped."),
        ("ftlayer_barrier_holds_released", "barrier_released", "Barrier holds released."),
        ("ftlayer_dead_letters_delivered", "dead_letters_delivered", "Delivered to a topic."),
        ("ftlayer_dead_letters_purged", "dead_letters_purged", "Dead letters purged."),
        ("ftlayer_dead_letters_requeued", "dead_letters_requeued", "Put back for replay."),
        ("ftlayer_timeouts_postponed", "timeouts_postponed", "Timeouts of running batches."),
        ("ftlayer_recovered_pending", "recovered_pending", "Restored from the journal."),
        ("ftlayer_recovered_completed", "recovered_completed", "Known complete at start."),
    )
    out: list[Metric] = [GaugeMetricFamily(n, h, value=status[k]) for n, k, h in gauges]
    out += [CounterMetricFamily(n, h, value=status[k]) for n, k, h in counters]
    dropped = CounterMetricFamily(
        "ftlayer_dropped_events",
        "XOR events and fails for roots not pending: late (failed recently) or unknown.",
        labels=["reason"],
    )
    dropped.add_metric(["late"], status["late_events"])
    dropped.add_metric(["unknown"], status["unknown_events"])
    out.append(dropped)
    return out


def _checkpoints(checkpoints: Mapping[str, Mapping[str, Any]]) -> list[Metric]:
    """Per checkpoint query: the count, the open ones, the last completed one's figures."""
    completed = CounterMetricFamily(
        "ftlayer_checkpoints_completed", "Checkpoints completed.", labels=["query"]
    )
    open_now = GaugeMetricFamily(
        "ftlayer_checkpoints_open", "Checkpoints begun, not complete.", labels=["query"]
    )
    last = {
        "duration_s": GaugeMetricFamily(
            "ftlayer_last_checkpoint_duration_seconds",
            "The last completed checkpoint: barrier to completion.",
            labels=["query"],
        ),
        "alignment_wait_s": GaugeMetricFamily(
            "ftlayer_last_checkpoint_alignment_wait_seconds",
            "The last completed checkpoint: done to complete (aligned mode; 0 unaligned).",
            labels=["query"],
        ),
        "copy_s": GaugeMetricFamily(
            "ftlayer_last_checkpoint_copy_seconds",
            "The last completed checkpoint: its state copy under the lock.",
            labels=["query"],
        ),
        "write_s": GaugeMetricFamily(
            "ftlayer_last_checkpoint_write_seconds",
            "The last completed checkpoint: its snapshot write.",
            labels=["query"],
        ),
        "size_bytes": GaugeMetricFamily(
            "ftlayer_last_checkpoint_size_bytes",
            "The last completed checkpoint: its snapshot's size.",
            labels=["query"],
        ),
        "pending_roots": GaugeMetricFamily(
            "ftlayer_last_checkpoint_pending_roots",
            "The last completed checkpoint: pending roots at its barrier.",
            labels=["query"],
        ),
    }
    last_id = GaugeMetricFamily(
        "ftlayer_last_checkpoint_id", "The last completed checkpoint's id.", labels=["query"]
    )
    for query, found in checkpoints.items():
        completed.add_metric([query], found["completed"])
        open_now.add_metric([query], len(found["open"]))
        done = [c for c in found["recent"] if c["state"] == "complete"]
        if done:
            checkpoint = done[-1]
            last_id.add_metric([query], checkpoint["id"])
            for key, metric in last.items():
                metric.add_metric([query], checkpoint.get(key) or 0)
    return [completed, open_now, last_id, *last.values()]


def _le(edge: float) -> str:
    """A bucket bound as Prometheus writes it (`+Inf`, `0.0025`, `100.0`)."""
    return "+Inf" if edge == float("inf") else repr(edge)


def _source_order(source: str) -> tuple[int, str]:
    return (int(source), source) if source.isdigit() else (1 << 64, source)
