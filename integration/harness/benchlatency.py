"""The complete latency of a pipeline bench's runs, read from the FT layer's STATUS.

Each run of `ftlayer bench pipeline` (and `--fast`) reads under its own `ft.sourceName`,
so each run is one source id in STATUS `by_source`, whose `complete_latency` holds the
persist-to-completion latency of its trees that completed on their first attempt:
`{"count", "sum_s", "p50_s", "p99_s"}` (docs/protocol.md, STATUS). A server whose STATUS
has no `by_source` does not measure it: the benches then report None, and
`ftlayer bench report` says "not measured" instead of drawing the plot.

This module is the one place the benches read the latency; nothing else depends on
the shape of STATUS's latency fields.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ftlayer.integration.source.options import source_id

__all__ = ["LatencyRun", "complete_latency"]


@dataclass(frozen=True, slots=True)
class LatencyRun:
    """One timed run of a bench: the source name it read under, and what it was."""

    source_name: str
    mode: str
    """ft.completion: "tree" or "barrier"."""
    batch_size: int
    """maxOffsetsPerTrigger."""
    round: int


def complete_latency(
    status: Mapping[str, Any], topic: str, runs: Sequence[LatencyRun]
) -> dict[str, Any] | None:
    """Per run, its complete latency from `status` (a STATUS reply, as a mapping):
    `{"runs": [{mode, batch_size, round, count, sum_s, mean_s, p50_s, p99_s}, ...]}`
    in the order of `runs`, seconds; a run that completed nothing has count 0 and
    None for the rest. None when STATUS carries no `by_source` (a server that does not
    measure the latency)."""
    by_source = status.get("by_source")
    if not isinstance(by_source, Mapping):
        return None
    found: list[dict[str, Any]] = []
    for run in runs:
        figures = by_source.get(str(source_id(run.source_name, topic)), {})
        latency = figures.get("complete_latency") or {}
        count = int(latency.get("count", 0))
        sum_s = float(latency.get("sum_s", 0.0))
        found.append(
            {
                "mode": run.mode,
                "batch_size": run.batch_size,
                "round": run.round,
                "count": count,
                "sum_s": sum_s if count else None,
                "mean_s": sum_s / count if count else None,
                "p50_s": latency.get("p50_s"),
                "p99_s": latency.get("p99_s"),
            }
        )
    return {"runs": found}
