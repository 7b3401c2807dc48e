"""The `ftlayer` command line.

    ftlayer serve  --data-dir DIR [--host 127.0.0.1] [--port P] [--timeout-s T] [--no-journal]
                   [--buckets N] [--token-file F] [--tls-cert C --tls-key K]
                   [--delete-interval-s S] [--handshake-timeout-s S] [--frame-timeout-s S]
                   [--idle-timeout-s S] [--max-connections N] [--log-format text|json]
                   [--http-port P [--http-host H] [--http-public]]
    ftlayer status --server HOST:PORT [--token-file F] [--tls-ca CA] [--wait-s S] [--json]
    ftlayer demo   [--records N] [--fail-rate F] [--partitions P] [--kill-workers K]
                   [--poison-rate R] [--max-retries M] [--completion tree|barrier]
                   [--http-port P] [--workdir D] [--json]
    ftlayer bench acker   [--roots N] [--depth K] [--batch B] [--json]
    ftlayer bench persist [--records N] [--payload-bytes P] [--batch B] [--no-sync]
                          [--dir D] [--json]
    ftlayer bench server  [--records N] [--events E] [--clients C] [--rounds R]
                          [--mixed-batches M] [--dir D] [--json]
    ftlayer bench checkpoint [--batches N] [--batch B] [--rounds R] [--pending P,...]
                             [--dir D] [--json]
    ftlayer bench pipeline [--records N] [--partitions P] [--fail-rate F] [--rounds R]
                           [--fast [--batch-sizes B,B,...]] [--observe]
                           [--json]
    ftlayer bench report [--quick] [--benches NAME,...] [--out DIR]
    ftlayer bench report --from RESULTS_JSON [--out DIR]
    ftlayer savepoint create  --data-dir DIR --dir SAVEPOINTS [--name NAME] [--json]
    ftlayer savepoint create  --server HOST:PORT [--token-file F] [--tls-ca CA]
                              --dir SAVEPOINTS [--name NAME] [--json]
    ftlayer savepoint list    --dir SAVEPOINTS [--json]
    ftlayer savepoint restore NAME --dir SAVEPOINTS --data-dir NEWDIR [--partitions N] [--json]
    ftlayer dead-letters list|show|requeue|purge --server HOST:PORT [--token-file F]
                   [--tls-ca CA] [--source ID] [--partition P] [--cause KIND]
                   [--since T] [--until T] [--seq S ...] [--limit N] [--json]
    ftlayer inspect --server HOST:PORT (--root R | --topic T --partition P --offset O)
                   [--token-file F] [--tls-ca CA] [--json]
    ftlayer version

Every bench prints a table of its figures; with --json it prints one JSON object as
its last line instead, as does `status`. `bench report` runs every bench
(ftlayer.benchreport) and writes DIR/benchmarks.md (default: docs) with its plots and
raw figures in DIR/benchmarks/; `--from` redraws them from a saved results.json
without running a bench; it exits 1 if a bench failed.

`serve` prints "ftlayer serving on HOST:PORT" once it listens (with --http-port, then
"ftlayer http on URL"), then serves until SIGTERM or SIGINT and exits 0. A token file
holds the token's bytes (one trailing newline is ignored); serving on a non-loopback
host needs one. `demo` runs the main job on an embedded broker, an FT-layer process and
local Spark (ftlayer.integration.harness.demo) and exits 0 only if nothing was lost and
every produced record completed; 1 otherwise. `savepoint create` saves the data dir of
a stopped server (`--data-dir`) or has a running server save its own store
(`--server`; then --dir is an absolute path on the server's host).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from ftlayer import __version__
from ftlayer.client import FTClient, read_token_file
from ftlayer.errors import ConfigError, FTLayerError


def _positive_int(text: str) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    return 0 if text.strip() == "0" else _positive_int(text)


def _int_list(text: str) -> list[int]:
    """Comma-separated positive integers."""
    return [_positive_int(part) for part in text.split(",") if part.strip()] or [_positive_int("")]


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite positive number, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    return 0.0 if text.strip() in ("0", "0.0") else _positive_float(text)


def _buckets(text: str) -> int:
    value = _positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"need at least 2 buckets, got {text!r}")
    return value


def _rate(text: str) -> float:
    value = _positive_float(text) if text.strip() not in ("0", "0.0") else 0.0
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text!r}")
    return value


def _count(text: str) -> int:
    return 0 if text.strip() == "0" else _positive_int(text)


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"not a port (0 to 65535): {text!r}")
    return int(text)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ftlayer",
        description="A Storm-style acker and replay layer for PySpark Structured Streaming.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("version", help="print the version")

    serve = commands.add_parser("serve", help="run the FT-layer server on an LMDB data dir")
    serve.add_argument("--data-dir", required=True, help="the LMDB directory (created if missing)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    serve.add_argument("--port", type=_port, default=0, help="TCP port (default: 0, any free)")
    serve.add_argument("--timeout-s", type=_positive_float, default=30.0, help="tree timeout T")
    serve.add_argument("--buckets", type=_buckets, default=3, help="rotating buckets n (>= 2)")
    serve.add_argument("--token-file", default=None, help="file holding the auth token")
    serve.add_argument("--tls-cert", default=None, help="PEM certificate (chain): serve TLS")
    serve.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    serve.add_argument(
        "--handshake-timeout-s",
        type=_positive_float,
        default=10.0,
        help="a connection's handshake (TLS included) must end within this (default 10)",
    )
    serve.add_argument(
        "--frame-timeout-s",
        type=_positive_float,
        default=30.0,
        help="a frame must be received whole within this of its first byte (default 30)",
    )
    serve.add_argument(
        "--idle-timeout-s",
        type=_positive_float,
        default=600.0,
        help="close a connection that sent nothing for this long (default 600)",
    )
    serve.add_argument(
        "--max-connections",
        type=_positive_int,
        default=1024,
        help="connections served at once; more get ERROR 103 (default 1024)",
    )
    serve.add_argument(
        "--delete-interval-s",
        type=_positive_float,
        default=0.2,
        help="completed records are deleted within S, or once 16,384 wait (default 0.2)",
    )
    serve.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="stderr log lines as text, or one JSON object per line for log shippers",
    )
    serve.add_argument(
        "--no-journal",
        action="store_true",
        help="keep no acker journal: a restart replays every stored record (as a machine "
        "crash does either way)",
    )
    serve.add_argument(
        "--http-port",
        type=_port,
        default=None,
        help="serve /metrics (Prometheus) and the status page on this port (default: off)",
    )
    serve.add_argument(
        "--http-host",
        default="127.0.0.1",
        help="address of the HTTP port (default: loopback; else it needs the token and TLS, "
        "or --http-public)",
    )
    serve.add_argument(
        "--http-public",
        action="store_true",
        help="serve the HTTP port (read-only) to anyone who reaches it, without the token",
    )

    status = commands.add_parser("status", help="show an FT-layer server's counters")
    status.add_argument("--server", required=True, help="HOST:PORT of the server")
    status.add_argument("--token-file", default=None, help="file holding the auth token")
    status.add_argument("--tls-ca", default=None, help="connect with TLS, trusting this CA file")
    status.add_argument(
        "--wait-s",
        type=_non_negative_float,
        default=2.0,
        help="how long to retry a refused connection (default 2)",
    )
    status.add_argument("--json", action="store_true", help="print one JSON object last")

    demo = commands.add_parser("demo", help="run the main job end to end and check it")
    demo.add_argument("--records", type=_positive_int, default=100_000, help="events produced")
    demo.add_argument("--fail-rate", type=_rate, default=0.01, help="flaky share (0..1)")
    demo.add_argument("--partitions", type=_positive_int, default=4, help="topic partitions")
    demo.add_argument(
        "--kill-workers", type=_count, default=0, help="Python workers to SIGKILL meanwhile"
    )
    demo.add_argument(
        "--poison-rate", type=_rate, default=0.0, help="share of events that always fail (0..1)"
    )
    demo.add_argument(
        "--max-retries",
        type=_count,
        default=10,
        help="ft.maxRetries: replays of a failed event before it is dead-lettered",
    )
    demo.add_argument(
        "--completion",
        choices=("tree", "barrier"),
        default="barrier",
        help="ft.completion: trees complete by XOR events (tree) or at the batch's end",
    )
    demo.add_argument(
        "--http-port",
        type=_port,
        default=None,
        help="the FT layer's status page and /metrics on this loopback port (default: off)",
    )
    demo.add_argument("--workdir", default=None, help="keep logs and data here (default: tmp)")
    demo.add_argument("--json", action="store_true", help="print one JSON object last")
    _add_savepoint_parser(commands)
    from ftlayer import deadletters

    deadletters.add_parser(commands)
    from ftlayer import inspection

    inspection.add_parser(commands)

    bench = commands.add_parser("bench", help="run a benchmark against its baseline")
    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")

    acker = benches.add_parser("acker", help="XOR updates/s: AckerTable vs a naive dict loop")
    acker.add_argument("--roots", type=_positive_int, default=1_000_000, help="pending roots")
    acker.add_argument("--depth", type=_positive_int, default=3, help="tasks per tree")
    acker.add_argument("--batch", type=_positive_int, default=65_536, help="events per batch")
    acker.add_argument("--json", action="store_true", help="print one JSON object last")

    persist = benches.add_parser(
        "persist", help="records/s through persist -> complete -> delete vs raw LMDB"
    )
    persist.add_argument("--records", type=_positive_int, default=1_000_000)
    persist.add_argument("--payload-bytes", type=_positive_int, default=100)
    persist.add_argument("--batch", type=_positive_int, default=10_000)
    persist.add_argument("--no-sync", action="store_true", help="no fsync per commit (both sides)")
    persist.add_argument("--dir", default=None, help="where the LMDB files go (default: tmp)")
    persist.add_argument("--rounds", type=_positive_int, default=3, help="alternating rounds")
    persist.add_argument("--json", action="store_true", help="print one JSON object last")

    server = benches.add_parser(
        "server", help="XOR updates/s and records/s through the real server, client processes"
    )
    server.add_argument("--records", type=_positive_int, default=1_000_000, help="in total")
    server.add_argument("--events", type=_positive_int, default=2_000_000, help="in total")
    server.add_argument("--clients", type=_positive_int, default=2, help="client processes")
    server.add_argument(
        "--rounds", type=_positive_int, default=2, help="alternating rounds, journal off/on"
    )
    server.add_argument(
        "--mixed-batches",
        type=_non_negative_int,
        default=4,
        help="200,000-record micro-batches of the mixed phase per round (0: none)",
    )
    server.add_argument("--dir", default=None, help="where the LMDB files go (default: tmp)")
    server.add_argument("--json", action="store_true", help="print one JSON object last")

    checkpoint = benches.add_parser(
        "checkpoint",
        help="records/s with a checkpoint every batch vs none; checkpoint time vs pending",
    )
    checkpoint.add_argument("--batches", type=_positive_int, default=10, help="per round")
    checkpoint.add_argument("--batch", type=_positive_int, default=20_000, help="records")
    checkpoint.add_argument("--rounds", type=_positive_int, default=60, help="pairs of rounds")
    checkpoint.add_argument(
        "--pending",
        default="0,10000,100000,1000000",
        help="comma-separated pending-root counts to time checkpoints at",
    )
    checkpoint.add_argument("--dir", default=None, help="where the LMDB files go (default: tmp)")
    checkpoint.add_argument("--json", action="store_true", help="print one JSON object last")

    pipeline = benches.add_parser(
        "pipeline", help="the demo pipeline on Spark: FT on vs off, replays vs task retries"
    )
    pipeline.add_argument(
        "--records", type=_positive_int, default=None, help="100,000 (--fast: 400,000)"
    )
    pipeline.add_argument(
        "--fast",
        action="store_true",
        help="a vectorized pipeline at full speed, FT off / tree / barrier alternating per "
        "batch size, against a bare Kafka consumer",
    )
    pipeline.add_argument(
        "--batch-sizes",
        type=_int_list,
        default=[10_000, 50_000, 200_000],
        help="--fast: maxOffsetsPerTrigger values, comma-separated",
    )
    pipeline.add_argument("--partitions", type=_positive_int, default=4)
    pipeline.add_argument("--fail-rate", type=_rate, default=0.001, help="flaky share (0..1)")
    pipeline.add_argument("--rounds", type=_positive_int, default=2, help="alternating pairs")
    pipeline.add_argument(
        "--observe",
        action="store_true",
        help="also run barrier mode with ft_observe, with ft_observe and ft_kafka_stream, and "
        "with FTTasks(observe=True) (ftlayer's figures in Spark's progress)",
    )
    pipeline.add_argument("--json", action="store_true", help="print one JSON object last")

    report = benches.add_parser(
        "report", help="run every bench and write docs/benchmarks.md with plots (matplotlib)"
    )
    report.add_argument(
        "--quick", action="store_true", help="small sizes: minutes, figures indicative only"
    )
    report.add_argument(
        "--benches",
        default=None,
        help="comma-separated benches to run (default: all): "
        "acker,persist,server,checkpoint,pipeline,pipeline-fast",
    )
    report.add_argument(
        "--out", default="docs", help="write OUT/benchmarks.md and OUT/benchmarks/ (default docs)"
    )
    report.add_argument(
        "--from",
        dest="from_json",
        default=None,
        help="render from this results.json instead of running the benches",
    )
    return parser


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        counts = ()
    if not counts or min(counts) < 0:
        raise ConfigError(f"--pending takes comma-separated counts >= 0, got {text!r}")
    return counts


def _print_table(title: str, rows: dict[str, Any]) -> None:
    """Key/value rows as a rich table; nested dicts become key.sub rows, ints get commas."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=False)
    for key, value in rows.items():
        items = value.items() if isinstance(value, dict) else [(None, value)]
        for sub, item in items:
            text = (
                f"{item:,}" if isinstance(item, int) and not isinstance(item, bool) else str(item)
            )
            table.add_row(key if sub is None else f"{key}.{sub}", text)
    Console().print(table)


def _serve(args: argparse.Namespace) -> int:
    from ftlayer.logs import configure
    from ftlayer.memtune import settle_heap, tune_malloc
    from ftlayer.server import FTServer

    configure(args.log_format, sys.stderr)
    tune_malloc()  # frames and chunks of megabytes, many a second (ftlayer/memtune.py)
    token = None if args.token_file is None else read_token_file(args.token_file)
    if args.http_port is None and (args.http_public or args.http_host != "127.0.0.1"):
        raise ConfigError("--http-host and --http-public go with --http-port")
    server = FTServer(
        args.data_dir,
        host=args.host,
        port=args.port,
        timeout_s=args.timeout_s,
        buckets=args.buckets,
        token=token,
        handshake_timeout_s=args.handshake_timeout_s,
        frame_timeout_s=args.frame_timeout_s,
        idle_timeout_s=args.idle_timeout_s,
        max_connections=args.max_connections,
        delete_interval_s=args.delete_interval_s,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        journal=not args.no_journal,
        http_port=args.http_port,
        http_host=args.http_host,
        http_public=args.http_public,
    )
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    with server:
        settle_heap()  # kernels loaded, start-up heap frozen (ftlayer/memtune.py)
        host, port = server.address
        print(f"ftlayer serving on {host}:{port}", flush=True)
        if server.http_url is not None:
            print(f"ftlayer http on {server.http_url}", flush=True)
        while not stop.wait(1.0):
            pass
    return 0


def _client(args: argparse.Namespace, reconnect_s: float) -> FTClient:
    """An FTClient of `--server`, with `--token-file` and `--tls-ca`."""
    token = None if args.token_file is None else read_token_file(args.token_file)
    return FTClient(args.server, token=token, tls=args.tls_ca or False, reconnect_s=reconnect_s)


def _status(args: argparse.Namespace) -> int:
    try:
        with _client(args, args.wait_s) as client:
            status = client.status()
    except OSError as exc:
        raise ConfigError(f"cannot reach the FT-layer server at {args.server}: {exc}") from None
    shown = status.to_json()
    if args.json:
        print(json.dumps(shown, sort_keys=True))
        return 0
    checkpoints = shown.pop("checkpoints")
    by_source = shown.pop("by_source")
    latency = shown.pop("complete_latency")
    rows: dict[str, Any] = {}
    for key, value in shown.items():
        rows[key] = value
        if key == "completed":  # the latency of what completed, next to it
            rows["complete_latency"] = {
                "p50": _milliseconds(latency["p50_s"]),
                "p99": _milliseconds(latency["p99_s"]),
                "trees": latency["count"],
            }
    _print_table(f"ftlayer status {args.server}", rows)
    _print_sources(by_source, status.pending_by_source)
    _print_checkpoints(checkpoints)
    return 0


def _milliseconds(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:,.2f} ms"


def _print_sources(by_source: dict[str, Any], pending: Any) -> None:
    """One row per source: its counters, pending trees, replay queue and latency."""
    from rich.console import Console
    from rich.table import Table

    if not by_source:
        return
    table = Table(title="per source (complete latency: persist to completion, first attempts)")
    headers = ("source", "persisted", "completed", "failed", "replayed", "dead-lettered")
    for header in (*headers, "pending", "replay queue", "p50", "p99"):
        table.add_column(header, justify="right")
    for source, figures in by_source.items():
        latency = figures["complete_latency"]
        table.add_row(
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
    console.width = max(console.width, 120)
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


def _demo(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table

    from ftlayer.integration.harness.demo import run_demo

    console = Console(stderr=True)

    def view(progress: dict[str, Any]) -> Table:
        table = Table(title="ftlayer demo", show_header=True)
        names = ("produced", "read", "persisted", "completed", "pending", "replayed")
        for name in (*names, "dead-lettered"):
            table.add_column(name, justify="right")
        replayed = sum(progress.get("failed", {}).values())
        table.add_row(
            *(f"{progress.get(k, 0):,}" for k in ("produced", "read", "persisted")),
            *(f"{progress.get(k, 0):,}" for k in ("completed", "pending")),
            f"{replayed:,}",
            f"{progress.get('dead_lettered', 0):,}",
        )
        return table

    console.print(
        f"ftlayer demo: {args.records:,} events, {args.partitions} partitions, "
        f"fail rate {args.fail_rate:g}, poison rate {args.poison_rate:g} (max retries "
        f"{args.max_retries}), {args.kill_workers} worker kills; starting Tansu, the FT "
        "layer and Spark ..."
    )
    if args.http_port:
        console.print(
            f"ftlayer demo: the FT layer's status page: http://127.0.0.1:{args.http_port}/ "
            f"(metrics: http://127.0.0.1:{args.http_port}/metrics)",
            soft_wrap=True,
        )
    with Live(view({"produced": args.records}), console=console, refresh_per_second=4) as live:
        result = run_demo(
            records=args.records,
            fail_rate=args.fail_rate,
            partitions=args.partitions,
            kill_workers=args.kill_workers,
            poison_rate=args.poison_rate,
            max_retries=args.max_retries,
            completion=args.completion,
            http_port=args.http_port,
            workdir=args.workdir,
            on_progress=lambda progress: live.update(view(progress)),
            on_kill=lambda line: live.console.print(f"ftlayer demo: {line}", soft_wrap=True),
        )
    if not console.is_terminal:
        console.line()  # rich ends its last frame without a newline when not on a terminal
    summary = result.as_dict()
    if not result.ok:
        console.print(
            f"ftlayer demo: FAILED: lost {result.lost}, completed {result.completed} of "
            f"{result.produced}, {result.pending_at_end} trees still pending, dead-lettered "
            f"{result.extra.get('dead_lettered')} of {result.extra.get('poison_events')} "
            f"poison events, group lag at the end {result.extra.get('group_lag_at_end')}",
            soft_wrap=True,
        )
    console.print(f"ftlayer demo: Spark's log is in {result.extra['spark_log']}", soft_wrap=True)
    console.file.flush()
    # Last, and alone on its line of stdout, even when stderr is the same file.
    if args.json:
        print(json.dumps(summary, sort_keys=True), flush=True)
    else:
        _print_table("ftlayer demo: summary", summary)
    return 0 if result.ok else 1


def _add_savepoint_parser(commands: Any) -> None:
    savepoint = commands.add_parser(
        "savepoint", help="create, list and restore savepoints of an FT layer's state"
    )
    actions = savepoint.add_subparsers(dest="savepoint", required=True, metavar="ACTION")
    create = actions.add_parser(
        "create", help="save a stopped server's data dir, or have a running server save"
    )
    source = create.add_mutually_exclusive_group(required=True)
    source.add_argument("--data-dir", help="the data dir of a stopped server")
    source.add_argument("--server", help="HOST:PORT of a running server: it writes the savepoint")
    create.add_argument("--token-file", default=None, help="with --server: the auth token file")
    create.add_argument("--tls-ca", default=None, help="with --server: TLS, trusting this CA file")
    create.add_argument(
        "--dir",
        required=True,
        help="the savepoints directory (with --server: an absolute path on the server's host)",
    )
    create.add_argument("--name", default=None, help="default: savepoint-<UTC time>-<random>")
    create.add_argument("--json", action="store_true", help="print one JSON object last")
    listing = actions.add_parser("list", help="list the savepoints in a directory")
    listing.add_argument("--dir", required=True, help="the savepoints directory")
    listing.add_argument("--json", action="store_true", help="print one JSON object last")
    restore = actions.add_parser("restore", help="restore a savepoint into a new data dir")
    restore.add_argument("name", help="the savepoint's name")
    restore.add_argument("--dir", required=True, help="the savepoints directory")
    restore.add_argument("--data-dir", required=True, help="the new data dir (new or empty)")
    restore.add_argument(
        "--partitions", default=None, help="replay every source into N partitions (rescale)"
    )
    restore.add_argument("--json", action="store_true", help="print one JSON object last")


def _savepoint(args: argparse.Namespace) -> int:
    from ftlayer.checkpoint import savepoint

    if args.savepoint == "create":
        if args.server is not None:
            created = _savepoint_online(args)
        else:
            for flag in ("token_file", "tls_ca"):
                if getattr(args, flag) is not None:
                    raise ConfigError(f"--{flag.replace('_', '-')} goes with --server only")
            created = savepoint.create_savepoint_from_data_dir(
                args.data_dir, args.dir, args.name
            ).as_dict()
        if args.json:
            print(json.dumps(created, sort_keys=True))
        else:
            _print_created(created)
        return 0
    if args.savepoint == "list":
        found = savepoint.list_savepoints(args.dir)
        if args.json:
            print(json.dumps({"savepoints": [s.as_dict() for s in found]}, sort_keys=True))
        else:
            _print_savepoints(args.dir, found)
        return 0
    partitions = None if args.partitions is None else _partitions_option(args.partitions)
    result = savepoint.restore_savepoint(args.dir, args.name, args.data_dir, partitions=partitions)
    if args.json:
        print(json.dumps(result.as_dict(), sort_keys=True))
        return 0
    print(
        f"restored savepoint {args.name} into {result.data_dir}: {result.stored_records:,} "
        f"stored records, replayed when `ftlayer serve --data-dir {result.data_dir}` starts"
    )
    for sid, spec in result.sources.items():
        counts = result.replays.get(sid, {})
        spread = ", ".join(f"{p}: {n:,}" for p, n in counts.items()) or "none"
        print(
            f"source {sid} ({spec['partitioner']}, {spec['num_partitions']} partitions): "
            f"replays per partition: {spread}"
        )
    for query, offsets in result.starting_offsets.items():
        text = json.dumps(offsets, separators=(",", ":"))
        print(f"query {query}: start the new query with startingOffsets '{text}'")
    return 0


_SAVEPOINT_WAIT_S = 2.0
"""How long `savepoint create --server` retries a refused connection (as `status`)."""


def _savepoint_online(args: argparse.Namespace) -> dict[str, Any]:
    """SAVEPOINT to the running server at --server; the savepoint it created."""
    if not os.path.isabs(args.dir):
        raise ConfigError(
            f"with --server, --dir is a directory on the server's host and must be an "
            f"absolute path, got {args.dir!r}"
        )
    try:
        with _client(args, _SAVEPOINT_WAIT_S) as client:
            return client.savepoint(args.dir, args.name)
    except OSError as exc:
        raise ConfigError(f"cannot reach the FT-layer server at {args.server}: {exc}") from None


def _print_created(created: dict[str, Any]) -> None:
    """The summary of a created savepoint (Savepoint.as_dict)."""
    print(
        f"savepoint {created['name']} created in {created['path']}: "
        f"{created['stored_records']:,} stored records"
    )
    for sid, spec in created["sources"].items():
        print(f"source {sid}: {spec['partitioner']}, {spec['num_partitions']} partitions")
    for query, position in created["positions"].items():
        print(f"query {query}: position {json.dumps(position, sort_keys=True)}")


def _partitions_option(text: str) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise ConfigError(f"--partitions must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise ConfigError(f"--partitions must be an integer >= 1, got {text!r}")
    return value


def _print_savepoints(directory: str, found: Sequence[Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    if not found:
        print(f"no savepoints in {directory}")
        return
    table = Table(title=f"savepoints in {directory}")
    table.add_column("name")
    table.add_column("created", no_wrap=True)
    table.add_column("stored records", justify="right")
    table.add_column("sources")
    for s in found:
        sources = ", ".join(
            f"{sid} {spec.get('partitioner')}/{spec.get('num_partitions')}"
            for sid, spec in s.sources.items()
        )
        table.add_row(s.name, s.created_at, f"{s.stored_records:,}", sources or "none")
    Console().print(table)


def _run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """The result of `ftlayer bench NAME ...` (parsed), as --json prints it."""
    from ftlayer import bench

    if args.bench == "acker":
        return bench.bench_acker(roots=args.roots, depth=args.depth, batch=args.batch)
    if args.bench == "pipeline" and args.fast:
        from ftlayer.integration.harness.benchfast import bench_fast

        return bench_fast(
            records=args.records or 400_000,
            partitions=args.partitions,
            batch_sizes=args.batch_sizes,
            rounds=args.rounds,
        )
    if args.bench == "pipeline":
        from ftlayer.integration.harness.benchpipe import bench_pipeline

        return bench_pipeline(
            records=args.records or 100_000,
            partitions=args.partitions,
            fail_rate=args.fail_rate,
            rounds=args.rounds,
            observe=args.observe,
        )
    if args.bench == "checkpoint":
        return bench.bench_checkpoint(
            batches=args.batches,
            batch=args.batch,
            rounds=args.rounds,
            pending_points=_counts(args.pending),
            directory=args.dir,
        )
    if args.bench == "server":
        return bench.bench_server(
            records=args.records,
            events=args.events,
            clients=args.clients,
            directory=args.dir,
            rounds=args.rounds,
            mixed_batches=args.mixed_batches,
        )
    return bench.bench_persist(
        records=args.records,
        payload_bytes=args.payload_bytes,
        batch=args.batch,
        sync=not args.no_sync,
        directory=args.dir,
        rounds=args.rounds,
    )


def _report(args: argparse.Namespace) -> int:
    """`ftlayer bench report`: run the benches (or read --from), write the page."""
    from pathlib import Path

    from ftlayer import benchreport

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError(
            "ftlayer bench report draws its plots with matplotlib, which is not installed: "
            "pip install 'ftlayer[bench]'"
        ) from None
    out = Path(args.out)
    if args.from_json is not None:
        if args.quick or args.benches is not None:
            raise ConfigError("--from renders saved results; --quick and --benches run benches")
        results = benchreport.load_results(Path(args.from_json))
        benchreport.save_results(results, out)
        page = benchreport.render(results, out)
    else:
        names = None if args.benches is None else _bench_names(args.benches)
        results = benchreport.run_report(out, _bench_result, quick=args.quick, names=names)
        page = out / "benchmarks.md"
    print(f"ftlayer bench report: wrote {page} and its plots in {out / 'benchmarks'}")
    failed = {name: e["error"] for name, e in results["benches"].items() if "error" in e}
    for name, error in failed.items():
        print(f"ftlayer bench report: {name} failed: {error}", file=sys.stderr)
    return 1 if failed else 0


def _bench_names(text: str) -> list[str]:
    from ftlayer.benchreport import BENCHES

    known = [b.name for b in BENCHES]
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = sorted(set(names) - set(known))
    if not names or unknown:
        raise ConfigError(f"--benches takes some of {','.join(known)}; got {text!r}")
    return names


def _bench_result(argv: list[str]) -> dict[str, Any]:
    """What `ftlayer bench *argv --json` prints, as a dict."""
    return _run_bench(_parser().parse_args(["bench", *argv]))


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "version":
            print(__version__)
            return 0
        if args.command == "serve":
            return _serve(args)
        if args.command == "status":
            return _status(args)
        if args.command == "demo":
            return _demo(args)
        if args.command == "savepoint":
            return _savepoint(args)
        if args.command in ("dead-letters", "inspect"):
            from ftlayer import deadletters, inspection

            run = deadletters.run if args.command == "dead-letters" else inspection.run
            try:
                with _client(args, 5.0) as client:
                    return run(args, client)
            except OSError as exc:
                raise ConfigError(
                    f"cannot reach the FT-layer server at {args.server}: {exc}"
                ) from None
        if args.bench == "report":
            return _report(args)
        result = _run_bench(args)
    except FTLayerError as exc:
        print(f"ftlayer: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        rows = {k: v for k, v in result.items() if k not in ("bench", "machine")}
        _print_table(f"ftlayer bench {result['bench']}", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
