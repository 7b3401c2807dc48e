"""`ftlayer status`: a server's counters, settings and sources, its per-source figures
and each query's checkpoints; `--json` prints the STATUS reply as one JSON object.
Given the shards of a cluster (`--server A,B,...`, in shard order), each of them and
then their sums (`--json`: {"shards": [...], "total": {...}}).

A source is named by its id (a crc32 of its `ft.sourceName` and topic) and by the name
it registered (its `ft.sourceName`), or, for a registration without one, by the query
whose checkpoints list it.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import Any, Final

from ftlayer.errors import ConfigError
from ftlayer.status import Status

from .common import non_negative_float, on_server, print_table


def add_parser(commands: Any) -> None:
    status = commands.add_parser("status", help="show an FT-layer server's counters")
    status.add_argument(
        "--server",
        required=True,
        help="HOST:PORT of the server; HOST:PORT,HOST:PORT,... for the shards of a cluster, "
        "in shard order (each shard, then the sums)",
    )
    status.add_argument("--token-file", default=None, help="file holding the auth token")
    status.add_argument("--tls-ca", default=None, help="connect with TLS, trusting this CA file")
    status.add_argument(
        "--wait-s",
        type=non_negative_float,
        default=2.0,
        help="how long to retry a refused connection (default 2)",
    )
    status.add_argument("--json", action="store_true", help="print one JSON object last")


def run(args: argparse.Namespace) -> int:
    addresses = [a.strip() for a in args.server.split(",")]
    if len(addresses) > 1:
        return _run_shards(args, addresses)
    status = on_server(args, args.wait_s, lambda client: client.status())
    shown = status.to_json()
    if args.json:
        print(json.dumps(shown, sort_keys=True))
        return 0
    _print_status(args.server, status)
    return 0


def _run_shards(args: argparse.Namespace, addresses: list[str]) -> int:
    """Every shard's status, checked against its place in the list, then the sums."""
    statuses: list[Status] = []
    for index, address in enumerate(addresses):
        one = argparse.Namespace(**{**vars(args), "server": address})
        status = on_server(one, args.wait_s, lambda client: client.status())
        if (status.shard, status.shards) != (index, len(addresses)):
            raise ConfigError(
                f"{address} is shard {status.shard} of {status.shards}, but --server names "
                f"it as shard {index} of {len(addresses)}: list every shard of the "
                "cluster, in shard order"
            )
        statuses.append(status)
    total = _sums([s.to_json() for s in statuses])
    if args.json:
        shards = [{"address": a, **s.to_json()} for a, s in zip(addresses, statuses, strict=True)]
        print(json.dumps({"shards": shards, "total": total}, sort_keys=True))
        return 0
    for address, status in zip(addresses, statuses, strict=True):
        _print_status(f"{address} (shard {status.shard} of {status.shards})", status)
    print_table(f"ftlayer status: all {len(addresses)} shards", total)
    return 0


_SUMMED: Final = (
    "persisted",
    "completed",
    "pending",
    "replay_queue",
    "replayed",
    "retry_waiting",
    "unfilled",
    "filled",
    "open_ranges",
    "dead_lettered",
    "dead_letters",
    "barrier_holds",
    "stored_records",
    "deletes_pending",
    "lmdb_size_bytes",
    "connections",
)
"""The counters `ftlayer status` adds up over the shards of a cluster (and `failed`, by
cause)."""


def _sums(shown: list[dict[str, Any]]) -> dict[str, Any]:
    total: dict[str, Any] = {name: sum(int(s[name]) for s in shown) for name in _SUMMED}
    failed: dict[str, int] = {}
    for s in shown:
        for cause, n in s["failed"].items():
            failed[cause] = failed.get(cause, 0) + int(n)
    total["failed"] = failed
    parked: dict[str, int] = {}
    for s in shown:
        for owner, counts in s.get("parked", {}).items():
            parked[owner] = parked.get(owner, 0) + int(counts["roots"])
    total["parked"] = parked  # per owner shard: the roots other shards keep for it
    return total


def _print_status(title: str, status: Status) -> None:
    shown = status.to_json()
    checkpoints = shown.pop("checkpoints")
    by_source = shown.pop("by_source")
    latency = shown.pop("complete_latency")
    names = _source_names(checkpoints, shown.get("sources", {}))
    rows: dict[str, Any] = {}
    for key, value in shown.items():
        if key == "sources":  # each registration under its name, then its settings
            value = {s: {**spec, "name": names.get(s, "-")} for s, spec in value.items()}
        rows[key] = value
        if key == "completed":  # the latency of what completed, next to it
            rows["complete_latency"] = {
                "p50": _milliseconds(latency["p50_s"]),
                "p99": _milliseconds(latency["p99_s"]),
                "trees": latency["count"],
            }
    print_table(f"ftlayer status {title}", rows)
    _print_sources(by_source, status.pending_by_source, names)
    _print_checkpoints(checkpoints)


def _source_names(
    checkpoints: Mapping[str, Any], sources: Mapping[str, Mapping[str, Any]]
) -> dict[str, str]:
    """Source id -> name: the name it registered, else the query whose checkpoints list
    it (the ftkafka source files its checkpoints under its `ft.sourceName`)."""
    names: dict[str, str] = {}
    for query, found in checkpoints.items():
        for checkpoint in [*found["recent"], *found["open"]]:
            for source in checkpoint["sources"]:
                names[str(source)] = query
    for source, spec in sources.items():
        if spec.get("name"):
            names[str(source)] = str(spec["name"])
    return names


def _milliseconds(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:,.2f} ms"


def _print_sources(by_source: dict[str, Any], pending: Any, names: Mapping[str, str]) -> None:
    """One row per source: its name and id, its counters, pending trees, replay queue
    and latency."""
    from rich.console import Console
    from rich.table import Table

    if not by_source:
        return
    table = Table(title="per source (complete latency: persist to completion, first attempts)")
    table.add_column("name")
    headers = ("source", "persisted", "completed", "failed", "replayed", "dead-lettered")
    for header in (*headers, "pending", "replay queue", "p50", "p99"):
        table.add_column(header, justify="right")
    for source, figures in by_source.items():
        latency = figures["complete_latency"]
        table.add_row(
            names.get(source, "-"),
            source,
            *(f"{figures[k]:,}" for k in ("persisted", "completed")),
            f"{sum(figures['failed'].values()):,}",
            *(f"{figures[k]:,}" for k in ("replayed", "dead_lettered")),
            f"{pending.get(source, 0):,}",
            f"{figures['replay_queue']:,}",
            _milliseconds(latency["p50_s"]),
            _milliseconds(latency["p99_s"]),
        )
    console = Console()
    console.width = max(console.width, 132)
    console.print(table)


_CHECKPOINT_COLUMNS = (
    ("id", "id"),
    ("state", "state"),
    ("mode", "mode"),
    ("pending", "pending_roots"),
    ("bytes", "size_bytes"),
    ("copy ms", "copy_s"),
    ("write ms", "write_s"),
    ("align ms", "alignment_wait_s"),
    ("total ms", "duration_s"),
)


def _print_checkpoints(checkpoints: dict[str, Any], last: int = 5) -> None:
    """Per query, its open checkpoints and its last completed ones, one row each."""
    from rich.console import Console
    from rich.table import Table

    for query, found in checkpoints.items():
        table = Table(
            title=f"checkpoints of {query!r}: {found['completed']:,} completed "
            "(align: alignment wait; total: barrier to completion)"
        )
        for header, _ in _CHECKPOINT_COLUMNS:
            table.add_column(header, justify="right")
        for checkpoint in [*found["recent"][-last:], *found["open"]]:
            table.add_row(*(_cell(name, checkpoint.get(name)) for _, name in _CHECKPOINT_COLUMNS))
        console = Console()
        console.width = max(console.width, 110)  # nine columns: keep them readable
        console.print(table)


def _cell(name: str, value: Any) -> str:
    if value is None:
        return "-"
    if name.endswith("_s"):
        return f"{1000 * float(value):,.1f}"
    return f"{value:,}" if isinstance(value, int) else str(value)
