"""`ftlayer bench NAME`: a benchmark against its baseline (ftlayer.bench; `pipeline` in
ftlayer.integration.harness, loaded only when it runs), printed as a table or one JSON
object last; `bench report` runs them all and writes the benchmarks page
(ftlayer.benchreport)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ftlayer.errors import ConfigError

from .common import int_list, non_negative_int, positive_int, print_table, rate


def add_parser(commands: Any) -> None:
    bench = commands.add_parser("bench", help="run a benchmark against its baseline")
    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")

    acker = benches.add_parser("acker", help="XOR updates/s: AckerTable vs a naive dict loop")
    acker.add_argument("--roots", type=positive_int, default=1_000_000, help="pending roots")
    acker.add_argument("--depth", type=positive_int, default=3, help="tasks per tree")
    acker.add_argument("--batch", type=positive_int, default=65_536, help="events per batch")
    acker.add_argument("--json", action="store_true", help="print one JSON object last")

    persist = benches.add_parser(
        "persist", help="records/s through persist -> complete -> delete vs raw LMDB"
    )
    persist.add_argument("--records", type=positive_int, default=1_000_000)
    persist.add_argument("--payload-bytes", type=positive_int, default=100)
    persist.add_argument("--batch", type=positive_int, default=10_000)
    persist.add_argument("--no-sync", action="store_true", help="no fsync per commit (both sides)")
    persist.add_argument("--dir", default=None, help="where the LMDB files go (default: tmp)")
    persist.add_argument("--rounds", type=positive_int, default=3, help="alternating rounds")
    persist.add_argument("--json", action="store_true", help="print one JSON object last")

    server = benches.add_parser(
        "server", help="XOR updates/s and records/s through the real server, client processes"
    )
    server.add_argument("--records", type=positive_int, default=1_000_000, help="in total")
    server.add_argument("--events", type=positive_int, default=2_000_000, help="in total")
    server.add_argument("--clients", type=positive_int, default=2, help="client processes")
    server.add_argument(
        "--rounds", type=positive_int, default=2, help="alternating rounds, journal off/on"
    )
    server.add_argument(
        "--mixed-batches",
        type=non_negative_int,
        default=4,
        help="200,000-record micro-batches of the mixed phase per round (0: none)",
    )
    server.add_argument("--dir", default=None, help="where the LMDB files go (default: tmp)")
    server.add_argument("--json", action="store_true", help="print one JSON object last")

    cluster = benches.add_parser(
        "cluster",
        help="records/s and XOR updates/s of an FT layer of 1 and 2 shards (server processes "
        "and client processes), and the servers' CPU per record",
    )
    cluster.add_argument(
        "--shards",
        type=int_list,
        default=[1, 2],
        help="the shard counts to compare, comma-separated (default 1,2)",
    )
    cluster.add_argument("--records", type=positive_int, default=1_000_000, help="in total")
    cluster.add_argument("--events", type=positive_int, default=2_000_000, help="in total")
    cluster.add_argument(
        "--clients",
        type=positive_int,
        default=4,
        help="client processes, each on one partition and so on one shard (default 4)",
    )
    cluster.add_argument(
        "--rounds", type=positive_int, default=3, help="rounds, the shard counts alternating"
    )
    cluster.add_argument("--dir", default=None, help="where the LMDB files go (default: tmp)")
    cluster.add_argument("--json", action="store_true", help="print one JSON object last")

    checkpoint = benches.add_parser(
        "checkpoint",
        help="records/s with a checkpoint every batch vs none; checkpoint time vs pending",
    )
    checkpoint.add_argument("--batches", type=positive_int, default=10, help="per round")
    checkpoint.add_argument("--batch", type=positive_int, default=20_000, help="records")
    checkpoint.add_argument("--rounds", type=positive_int, default=60, help="pairs of rounds")
    checkpoint.add_argument(
        "--pending",
        default="0,10000,100000,1000000",
        help="comma-separated pending-root counts to time checkpoints at",
    )
    checkpoint.add_argument("--dir", default=None, help="where the LMDB files go (default: tmp)")
    checkpoint.add_argument("--json", action="store_true", help="print one JSON object last")

    ingest = benches.add_parser(
        "ingest",
        help="records/s of JetStream receivers storing in a real FT layer vs a bare consumer",
    )
    ingest.add_argument("--messages", type=positive_int, default=200_000, help="in the stream")
    ingest.add_argument("--payload-bytes", type=positive_int, default=100)
    ingest.add_argument("--batch", type=positive_int, default=1000, help="messages a fetch")
    ingest.add_argument("--rounds", type=positive_int, default=1, help="medians over rounds")
    ingest.add_argument("--dir", default=None, help="where the data goes (default: tmp)")
    ingest.add_argument("--json", action="store_true", help="print one JSON object last")

    pipeline = benches.add_parser(
        "pipeline", help="the demo pipeline on Spark: FT on vs off, replays vs task retries"
    )
    pipeline.add_argument(
        "--records", type=positive_int, default=None, help="100,000 (--fast: 400,000)"
    )
    pipeline.add_argument(
        "--fast",
        action="store_true",
        help="a vectorized pipeline at full speed, FT off / tree / barrier alternating per "
        "batch size, against a bare Kafka consumer",
    )
    pipeline.add_argument(
        "--batch-sizes",
        type=int_list,
        default=[10_000, 50_000, 200_000],
        help="--fast: maxOffsetsPerTrigger values, comma-separated",
    )
    pipeline.add_argument("--partitions", type=positive_int, default=4)
    pipeline.add_argument(
        "--fail-rate",
        type=rate,
        default=None,
        help="flaky share (0..1): 0.001 in the failure runs; --fast: the share each FT-on "
        "run fails once and replays (default 0)",
    )
    pipeline.add_argument(
        "--persist",
        choices=("reference", "payload"),
        default="reference",
        help="ft.persist of the FT-on runs: where each record is in Kafka, or its bytes too",
    )
    pipeline.add_argument(
        "--tree-ranges",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--fast: the tree-mode runs read their batches as ranges (ft.treeRanges, the "
        "default); --no-tree-ranges: they store a reference per record",
    )
    pipeline.add_argument("--rounds", type=positive_int, default=2, help="alternating pairs")
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
        help="comma-separated benches to run (default: all of acker, persist, server, "
        "cluster, checkpoint, pipeline, pipeline-fast, pipeline-fast-failures)",
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


def run(args: argparse.Namespace) -> int:
    if args.bench == "report":
        return _report(args)
    result = _run_bench(args)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        rows = {k: v for k, v in result.items() if k not in ("bench", "machine")}
        print_table(f"ftlayer bench {result['bench']}", rows)
        if "server_cpu_us_per_record" in result:
            print(_server_cost(result))
    return 0


def _server_cost(result: dict[str, Any]) -> str:
    """The pipeline benches' summary line: the FT-layer server's cost per record."""
    cpu, written = result["server_cpu_us_per_record"], result["lmdb_bytes_per_record"]
    cpu_text = "no CPU figure" if cpu is None else f"{cpu:g} µs of CPU"
    written_text = (
        "no write figure (/proc/<pid>/io not readable)"
        if written is None
        else f"{written:g} bytes written"
    )
    failing = f", fail rate {result['fail_rate']:g}" if result["bench"] == "pipeline-fast" else ""
    return (
        f"ftlayer bench {result['bench']}: the FT-layer server in barrier mode: {cpu_text} "
        f"and {written_text} per record (ft.persist {result['persist']}{failing})"
    )


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        counts = ()
    if not counts or min(counts) < 0:
        raise ConfigError(f"--pending takes comma-separated counts >= 0, got {text!r}")
    return counts


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
            fail_rate=args.fail_rate or 0.0,
            persist=args.persist,
            tree_ranges=args.tree_ranges,
        )
    if args.bench == "pipeline":
        from ftlayer.integration.harness.benchpipe import bench_pipeline

        return bench_pipeline(
            records=args.records or 100_000,
            partitions=args.partitions,
            fail_rate=0.001 if args.fail_rate is None else args.fail_rate,
            rounds=args.rounds,
            observe=args.observe,
            persist=args.persist,
        )
    if args.bench == "ingest":
        return bench.bench_ingest(
            messages=args.messages,
            payload_bytes=args.payload_bytes,
            batch=args.batch,
            rounds=args.rounds,
            directory=args.dir,
        )
    if args.bench == "checkpoint":
        return bench.bench_checkpoint(
            batches=args.batches,
            batch=args.batch,
            rounds=args.rounds,
            pending_points=_counts(args.pending),
            directory=args.dir,
        )
    if args.bench == "cluster":
        return bench.bench_cluster(
            shard_counts=tuple(args.shards),
            records=args.records,
            events=args.events,
            clients=args.clients,
            rounds=args.rounds,
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
    parser = argparse.ArgumentParser(prog="ftlayer")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return _run_bench(parser.parse_args(["bench", *argv]))
