"""The pipeline benches' complete latency per run, read from a STATUS reply: a run is
found by its source id, and a server whose STATUS has no latency gives None."""

from __future__ import annotations

from typing import Any

from ftlayer.integration.harness.benchlatency import LatencyRun, complete_latency
from ftlayer.integration.source.options import source_id


def _latency(count: int, sum_s: float, p50: float | None, p99: float | None) -> dict[str, Any]:
    return {"count": count, "sum_s": sum_s, "p50_s": p50, "p99_s": p99}


def _figures(latency: dict[str, Any]) -> dict[str, Any]:
    return {
        "persisted": 10,
        "completed": latency["count"],
        "failed": {"explicit": 0, "timeout": 0, "recovery": 0, "source-expired": 0},
        "replayed": 0,
        "dead_lettered": 0,
        "replay_queue": 0,
        "complete_latency": latency,
    }


def test_each_run_gets_its_own_sources_latency() -> None:
    topic = "bench-events"
    runs = [
        LatencyRun("bench-out-2", "tree", 50_000, 0),
        LatencyRun("bench-out-3", "barrier", 50_000, 0),
        LatencyRun("bench-out-9", "tree", 50_000, 1),  # completed nothing
    ]
    status = {
        "completed": 300,
        "complete_latency": _latency(300, 30.0, 0.09, 0.4),
        "by_source": {
            str(source_id("bench-out-2", topic)): _figures(_latency(100, 5.0, 0.04, 0.2)),
            str(source_id("bench-out-3", topic)): _figures(_latency(200, 25.0, 0.1, 0.4)),
            str(source_id("bench-out-2", "another-topic")): _figures(_latency(7, 70.0, 9, 9)),
        },
    }
    found = complete_latency(status, topic, runs)
    assert found == {
        "runs": [
            {
                "mode": "tree",
                "batch_size": 50_000,
                "round": 0,
                "count": 100,
                "sum_s": 5.0,
                "mean_s": 0.05,
                "p50_s": 0.04,
                "p99_s": 0.2,
            },
            {
                "mode": "barrier",
                "batch_size": 50_000,
                "round": 0,
                "count": 200,
                "sum_s": 25.0,
                "mean_s": 0.125,
                "p50_s": 0.1,
                "p99_s": 0.4,
            },
            {
                "mode": "tree",
                "batch_size": 50_000,
                "round": 1,
                "count": 0,
                "sum_s": None,
                "mean_s": None,
                "p50_s": None,
                "p99_s": None,
            },
        ]
    }


def test_a_status_without_latency_gives_none() -> None:
    status = {"completed": 300, "pending": 0, "failed": {"explicit": 0}}
    assert complete_latency(status, "t", [LatencyRun("s", "tree", 10, 0)]) is None
