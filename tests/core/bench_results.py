"""A results.json of `ftlayer bench report` by hand, in the shape of real runs (each
bench's result as `ftlayer bench NAME --json` printed it at small sizes), for tests that
render the report without running a bench."""

from __future__ import annotations

import copy
from typing import Any

_MACHINE = {"cpus": 2, "numpy": "2.4.6", "python": "3.11.7"}


def _latency(mode: str, size: int, round_: int, p50: float) -> dict[str, Any]:
    count = 900
    return {
        "mode": mode,
        "batch_size": size,
        "round": round_,
        "count": count,
        "sum_s": 1.4 * p50 * count,
        "mean_s": 1.4 * p50,
        "p50_s": p50,
        "p99_s": 4 * p50,
    }


_BENCHES: dict[str, dict[str, Any]] = {
    "acker": {
        "command": "ftlayer bench acker --roots 200000",
        "seconds": 2.1,
        "result": {
            "add_roots_per_s": 11426743,
            "batch": 65536,
            "bench": "acker",
            "events": 80000,
            "ftlayer_table_bytes_per_pending_root": 58.7,
            "ftlayer_table_bytes_per_pending_root_filled": 50.3,
            "machine": _MACHINE,
            "meets_targets": True,
            "memory_bytes_per_pending_root": 25.2,
            "naive_updates_per_s": 3036646,
            "ratio_vs_naive": 5.51,
            "roots": 20000,
            "targets": {
                "ftlayer_table_bytes_per_pending_root": 64,
                "ratio_vs_naive": 3.0,
                "updates_per_s": 3000000,
            },
            "updates_per_s": 16742086,
        },
    },
    "persist": {
        "command": "ftlayer bench persist --records 200000",
        "seconds": 4.0,
        "result": {
            "batch": 2000,
            "bench": "persist",
            "machine": _MACHINE,
            "meets_targets": False,
            "payload_bytes": 100,
            "ratio_vs_raw_lmdb": 0.367,
            "raw_lmdb_records_per_s": 1590081,
            "raw_lmdb_records_per_s_each_round": [1871228, 1382381],
            "records": 20000,
            "records_per_s": 582945,
            "records_per_s_each_round": [598430, 568241],
            "rounds": 2,
            "sync": False,
            "targets": {"ratio_vs_raw_lmdb": 0.5, "records_per_s": 250000},
        },
    },
    "server": {
        "command": "ftlayer bench server --records 200000 --events 400000",
        "seconds": 20.5,
        "result": {
            "batch": 10000,
            "bench": "server",
            "clients": 2,
            "events": 40000,
            "in_process_records_per_s": 164305,
            "in_process_xor_updates_per_s": 23573216,
            "journal": True,
            "journal_records_ratio": 0.49,
            "journal_xor_ratio": 0.973,
            "machine": _MACHINE,
            "meets_targets": True,
            "payload_bytes": 100,
            "records": 20000,
            "records_per_s": 173671,
            "records_ratio_vs_in_process": 1.057,
            "rounds": 1,
            "targets": {"records_per_s": 150000, "xor_updates_per_s": 1500000},
            "without_journal_records_per_s": 354649,
            "without_journal_xor_updates_per_s": 4354817,
            "xor_batch": 65536,
            "xor_ratio_vs_in_process": 0.18,
            "xor_updates_per_s": 4235527,
        },
    },
    "cluster": {
        "command": "ftlayer bench cluster --shards 1,2 --records 200000 --events 400000 --rounds 1",
        "seconds": 41.3,
        "result": {
            "batch": 10000,
            "bench": "cluster",
            "by_shards": {
                "1": {
                    "client_cpu_s_per_million_records": 2.9,
                    "cpu_busy_share": 0.71,
                    "machine_busy_share": 0.83,
                    "records_per_s": 301200,
                    "server_cpu_s_per_million_records": 2.41,
                    "server_cpu_s_per_million_xor_updates": 0.52,
                    "server_cpu_share": 0.45,
                    "server_peak_rss_bytes": 190000000,
                    "server_write_bytes_per_record": 412.5,
                    "store_commits_per_1000_records": 0.4,
                    "xor_updates_per_s": 2100400,
                },
                "2": {
                    "client_cpu_s_per_million_records": 3.1,
                    "cpu_busy_share": 0.93,
                    "machine_busy_share": 0.97,
                    "records_per_s": 355400,
                    "server_cpu_s_per_million_records": 2.63,
                    "server_cpu_s_per_million_xor_updates": 0.55,
                    "server_cpu_share": 0.46,
                    "server_peak_rss_bytes": 150000000,
                    "server_write_bytes_per_record": 420.1,
                    "store_commits_per_1000_records": 0.4,
                    "xor_updates_per_s": 2522000,
                },
            },
            "clients": 4,
            "cpu_per_record_ratio": 1.091,
            "cpu_steal_percent": 0.4,
            "events": 400000,
            "limit": "the cores: 2 cores shared by 4 client processes and 2 server processes",
            "machine": _MACHINE,
            "meets_targets": False,
            "payload_bytes": 100,
            "ratio": 1.18,
            "records": 200000,
            "rounds": 1,
            "shards": [1, 2],
            "targets": {"cpu_per_record_ratio": 1.15, "ratio": 1.3},
            "xor_batch": 65536,
            "xor_ratio": 1.201,
        },
    },
    "checkpoint": {
        "command": "ftlayer bench checkpoint --batches 5 --batch 10000 --rounds 10",
        "seconds": 15.2,
        "result": {
            "batch": 2000,
            "batches_per_round": 3,
            "bench": "checkpoint",
            "checkpoint_time_by_pending": [
                {
                    "begin_round_trip_ms": 0.19,
                    "bytes_per_pending_root": None,
                    "copy_under_lock_ms": 0.082,
                    "pending_roots": 0,
                    "snapshot_bytes": 545,
                    "until_complete_ms": 2.19,
                    "write_ms": 0.07,
                },
                {
                    "begin_round_trip_ms": 0.18,
                    "bytes_per_pending_root": 24.6,
                    "copy_under_lock_ms": 0.078,
                    "pending_roots": 1000,
                    "snapshot_bytes": 24554,
                    "until_complete_ms": 1.73,
                    "write_ms": 0.07,
                },
                {
                    "begin_round_trip_ms": 0.21,
                    "bytes_per_pending_root": 24.1,
                    "copy_under_lock_ms": 0.164,
                    "pending_roots": 10000,
                    "snapshot_bytes": 240557,
                    "until_complete_ms": 1.7,
                    "write_ms": 0.14,
                },
            ],
            "checkpoints_completed": 9,
            "cpu_steal_percent": 0.0,
            "machine": _MACHINE,
            "meets_target": True,
            "pair_ratios": {
                "geometric_mean_95ci": [0.407, 3.899],
                "max": 3.206,
                "median": 1.418,
                "min": 0.44,
                "pairs": 3,
            },
            "payload_bytes": 100,
            "ratio_with_vs_without": 1.37,
            "records_per_s_with_checkpoints": 141195,
            "records_per_s_without_checkpoints": 103054,
            "rounds": 3,
            "target": {"ratio_with_vs_without": 0.95},
        },
    },
    "pipeline": {
        "command": "ftlayer bench pipeline --records 5000 --rounds 1",
        "seconds": 94.0,
        "result": {
            "bench": "pipeline",
            "complete_latency": {
                "runs": [
                    _latency("tree", 50000, 0, 0.8),
                    _latency("barrier", 50000, 0, 1.6),
                ]
            },
            "fail_rate": 0.001,
            "failed_events_ftlayer": 2,
            "failed_events_spark": 2,
            "flaky_events": 2,
            "ft_failed_explicit": 2,
            "ft_off_records_per_s": 419,
            "ft_off_seconds": [4.78],
            "ft_on_barrier_records_per_s": 396,
            "ft_on_barrier_seconds": [5.05],
            "ft_on_records_per_s": 340,
            "ft_on_seconds": [5.88],
            "ft_timeouts": 0,
            "max_offsets_per_trigger": 50000,
            "meets_targets": False,
            "partitions": 4,
            "ratio_barrier_vs_off": 0.947,
            "ratio_on_vs_off": 0.813,
            "records": 2000,
            "reprocessed_per_failed_ftlayer": 1.0,
            "reprocessed_per_failed_spark": 164.0,
            "rounds": 1,
            "targets": {
                "ratio_barrier_vs_off": 0.95,
                "ratio_on_vs_off": 0.9,
                "reprocessed_per_failed_ftlayer": 1.05,
            },
        },
    },
    "pipeline-fast": {
        "command": "ftlayer bench pipeline --fast --records 100000 --batch-sizes 10000,50000",
        "seconds": 82.6,
        "result": {
            "batch_sizes": {
                size: {
                    "ft_barrier_records_per_s": int(rate * 0.97),
                    "ft_off_records_per_s": rate,
                    "ft_tree_records_per_s": int(rate * tree),
                    "ratio_barrier_vs_off": 0.97,
                    "ratio_off_vs_consumer": round(rate / 128805, 3),
                    "ratio_tree_vs_off": tree,
                    "rounds": 1,
                    "seconds": {"barrier": [1.73], "off": [2.42], "tree": [2.05]},
                    "wall_seconds": {"barrier": [2.82], "off": [3.52], "tree": [2.96]},
                }
                for size, rate, tree in (
                    ("10000", 8254, 0.85),
                    ("200000", 110000, 0.93),
                    ("50000", 60000, 0.91),
                )
            },
            "bench": "pipeline-fast",
            "complete_latency": {
                "runs": [
                    _latency(mode, size, 0, p50)
                    for size, p50 in ((10000, 0.05), (50000, 0.2), (200000, 0.9))
                    for mode in ("tree", "barrier")
                ]
            },
            "consumer_records_per_s": 128805,
            "consumer_seconds": [0.16],
            "expected_rows": 18000,
            "ft_failed": {"explicit": 0, "recovery": 0, "timeout": 0},
            "ft_timeouts": 0,
            "meets_targets": False,
            "partitions": 4,
            "records": 20000,
            "rounds": 1,
            "targets": {
                "at_batch_sizes": [50000, 200000],
                "ratio_barrier_vs_off": 0.95,
                "ratio_off_vs_consumer_at_largest": 0.8,
                "ratio_tree_vs_off": 0.9,
            },
            "value_bytes": 40,
        },
    },
    "pipeline-fast-failures": {
        "command": (
            "ftlayer bench pipeline --fast --fail-rate 0.01 --records 100000 --batch-sizes 50000"
        ),
        "seconds": 95.2,
        "result": {
            "batch_sizes": {
                "50000": {
                    "ft_barrier_records_per_s": 30000,
                    "ft_off_records_per_s": 60000,
                    "ft_tree_records_per_s": 28000,
                    "ratio_barrier_vs_off": 0.5,
                    "ratio_off_vs_consumer": 0.466,
                    "ratio_tree_vs_off": 0.467,
                    "seconds": {"barrier": [3.3], "off": [1.67], "tree": [3.57]},
                    "wall_seconds": {"barrier": [4.4], "off": [2.8], "tree": [4.6]},
                }
            },
            "bench": "pipeline-fast",
            "complete_latency": {"runs": []},
            "consumer_records_per_s": 128805,
            "consumer_seconds": [0.78],
            "expected_rows": 90000,
            "fail_rate": 0.01,
            "failing_records_per_ft_run": 1000,
            "ft_failed": {"explicit": 2000, "recovery": 0, "source-expired": 0, "timeout": 0},
            "ft_timeouts": 0,
            "lmdb_bytes_per_record": 71.4,
            "meets_targets": False,
            "partitions": 4,
            "persist": "reference",
            "records": 100000,
            "rounds": 1,
            "server_cpu_us_per_record": 0.725,
            "targets": {"ratio_off_vs_consumer_at_largest": 0.8, "server_cpu_us_per_record": 0.05},
            "value_bytes": 40,
        },
    },
}


def results() -> dict[str, Any]:
    """A fresh copy: tests may change it."""
    return {
        "format": 1,
        "generated_at": "2026-11-25 19:06:18 UTC",
        "quick": True,
        "machine": {
            "cpu_model": "AMD EPYC",
            "cpus": 2,
            "cpus_usable": 2,
            "memory_bytes": 25_000_000_000,
            "os": "Debian GNU/Linux 12 (bookworm)",
            "kernel": "Linux 6.1.0 x86_64",
            "python": "CPython 3.11.7",
            "spark": "4.3.0",
            "java": 'openjdk version "17.0.15" 2025-04-15',
            "numpy": "2.4.6",
            "lmdb": "1.6.2",
            "ftlayer": "0.1.0",
            "commit": "01204a24dd93",
        },
        "load_average_before": [0.3, 0.2, 0.1],
        "load_average_after": [1.9, 1.1, 0.5],
        "cpu_steal_percent": 0.2,
        "benches": copy.deepcopy(_BENCHES),
    }
