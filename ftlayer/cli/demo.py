"""`ftlayer demo`: the main job end to end on an embedded broker, an FT-layer process
and local Spark, or with `--cluster` a Spark standalone cluster and an FT layer of 2
shards with a token and TLS (ftlayer.integration.harness.demo, loaded only when it
runs), with a live table of its progress and its own verdict; exits 0 only if nothing
was lost and every produced record completed. `--shards N` runs the FT layer as N
shards, and `--kill-shard` SIGKILLs one of them midway and starts it again. `--source
http|jetstream` runs the pipeline on a source that cannot replay (receivers storing
into the FT layer, the `ftingest` source; ftlayer.integration.harness.demoingest), and
`--kill-receiver` SIGKILLs a receiver midway and starts it again."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ftlayer.shards import MAX_SHARDS

from .common import count, port, positive_float, positive_int, print_table, rate


def add_parser(commands: Any) -> None:
    demo = commands.add_parser("demo", help="run the main job end to end and check it")
    demo.add_argument("--records", type=positive_int, default=100_000, help="events produced")
    demo.add_argument("--fail-rate", type=rate, default=0.01, help="flaky share (0..1)")
    demo.add_argument("--partitions", type=positive_int, default=4, help="topic partitions")
    demo.add_argument(
        "--kill-workers", type=count, default=0, help="Python workers to SIGKILL meanwhile"
    )
    demo.add_argument(
        "--poison-rate", type=rate, default=0.0, help="share of events that always fail (0..1)"
    )
    demo.add_argument(
        "--max-retries",
        type=count,
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
        "--persist",
        choices=("reference", "payload"),
        default="reference",
        help="ft.persist: the FT layer stores where each event is in Kafka, or its bytes too",
    )
    demo.add_argument(
        "--tree-ranges",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ft.treeRanges: tree mode reads its batches as ranges (the default; section "
        "4.10); --no-tree-ranges: it stores a reference per record",
    )
    demo.add_argument(
        "--http-port",
        type=port,
        default=None,
        help="the FT layer's status page and /metrics on this loopback port, shard I's on "
        "this port + I (default: off)",
    )
    demo.add_argument(
        "--cluster",
        action="store_true",
        help="Spark standalone (a master and two workers, each a process of its own) and "
        "an FT layer with a token and TLS, instead of local Spark",
    )
    demo.add_argument(
        "--kill-worker",
        action="store_true",
        help="with --cluster: SIGKILL one worker with its executor and Python workers midway",
    )
    demo.add_argument(
        "--shards",
        type=positive_int,
        default=None,
        help="the FT layer as this many shards, each an `ftlayer serve` process with its own "
        "data dir and port (default: 1; 2 with --cluster)",
    )
    demo.add_argument(
        "--kill-shard",
        action="store_true",
        help="with --shards 2 or more: SIGKILL the last shard once a third of the events were "
        "persisted, and start it again on its data dir --outage-s later",
    )
    demo.add_argument(
        "--outage-s",
        type=positive_float,
        default=20.0,
        help="with --kill-shard: seconds the killed shard stays down (default 20)",
    )
    demo.add_argument(
        "--max-offsets-per-trigger",
        type=positive_int,
        default=20_000,
        help="the source's maxOffsetsPerTrigger: events per micro-batch at most (default 20,000)",
    )
    demo.add_argument(
        "--source",
        choices=("kafka", "http", "jetstream"),
        default="kafka",
        help="where the events come from: a Kafka topic (ftkafka), or an upstream that cannot "
        "replay whose receivers store them in the FT layer (ftingest): webhooks POSTed to "
        "`ftlayer ingest http`, or a JetStream stream read by `ftlayer ingest jetstream`",
    )
    demo.add_argument(
        "--kill-receiver",
        action="store_true",
        help="with --source http|jetstream: SIGKILL a receiver once a third of the events were "
        "acknowledged upstream, and start another in its place",
    )
    demo.add_argument("--workdir", default=None, help="keep logs and data here (default: tmp)")
    demo.add_argument("--json", action="store_true", help="print one JSON object last")


def run(args: argparse.Namespace) -> int:
    if args.source != "kafka":
        return _run_ingest(args)
    if args.kill_receiver:
        raise SystemExit("ftlayer demo: --kill-receiver needs --source http or jetstream")
    if args.kill_worker and not args.cluster:
        raise SystemExit("ftlayer demo: --kill-worker needs --cluster")
    if args.cluster and args.kill_workers:
        raise SystemExit(
            "ftlayer demo: --kill-workers kills Python workers of local Spark; "
            "with --cluster, use --kill-worker"
        )
    shards = args.shards if args.shards is not None else 2 if args.cluster else 1
    if shards > MAX_SHARDS:
        raise SystemExit(f"ftlayer demo: --shards is at most {MAX_SHARDS}, got {shards}")
    if args.http_port and args.http_port + shards - 1 > 65535:
        raise SystemExit(
            f"ftlayer demo: shard I serves its page on --http-port + I: {args.http_port} + "
            f"{shards - 1} is past port 65535"
        )
    if args.kill_shard and shards < 2:
        raise SystemExit(
            f"ftlayer demo: --kill-shard kills one of several FT-layer shards while the others "
            f"go on: it needs --shards 2 or more (got {shards})"
        )
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

    layer = "the FT layer" if shards == 1 else f"the FT layer ({shards} shards)"
    if args.cluster:
        kills = "a Spark worker killed midway" if args.kill_worker else "no worker killed"
        parts = f"{layer} with a token and TLS, and a Spark standalone cluster (2 workers)"
    else:
        kills, parts = f"{args.kill_workers} worker kills", f"{layer} and Spark"
    if args.kill_shard:
        kills += f", FT-layer shard {shards - 1} killed midway and down {args.outage_s:g} s"
    console.print(
        f"ftlayer demo: {args.records:,} events, {args.partitions} partitions, "
        f"fail rate {args.fail_rate:g}, poison rate {args.poison_rate:g} (max retries "
        f"{args.max_retries}), {kills}, {args.completion} mode, "
        f"persist {args.persist}; starting Tansu, {parts} ...",
        soft_wrap=True,
    )
    if args.http_port:
        pages = [f"http://127.0.0.1:{args.http_port + shard}/" for shard in range(shards)]
        linked = f"?shards={','.join(pages)}" if shards > 1 else ""  # each page links the others
        for shard, page in enumerate(pages):
            console.print(
                f"ftlayer demo: the FT layer's status page"
                f"{f' (shard {shard})' if shards > 1 else ''}: {page}{linked} (metrics: "
                f"{page}metrics)",
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
            persist=args.persist,
            tree_ranges=args.tree_ranges,
            http_port=args.http_port,
            workdir=args.workdir,
            cluster=args.cluster,
            kill_worker=args.kill_worker,
            shards=shards,
            kill_shard=args.kill_shard,
            outage_s=args.outage_s,
            max_per_trigger=args.max_offsets_per_trigger,
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
            f"poison events, group lag at the end {result.extra.get('group_lag_at_end')}"
            + (
                f", {result.extra.get('executors')} executors, {result.workers_killed} "
                "workers killed"
                if args.cluster
                else ""
            )
            + (
                f", {result.extra.get('shard_kills')} of 1 FT-layer shard kills"
                if args.kill_shard
                else ""
            ),
            soft_wrap=True,
        )
    console.print(f"ftlayer demo: Spark's log is in {result.extra['spark_log']}", soft_wrap=True)
    return _summary(console, args, summary, result.ok)


def _summary(console: Any, args: argparse.Namespace, summary: dict[str, Any], ok: bool) -> int:
    """Print the summary last, alone on its line of stdout (even when stderr is the same
    file); the exit code."""
    console.file.flush()
    if args.json:
        print(json.dumps(summary, sort_keys=True), flush=True)
    else:
        print_table("ftlayer demo: summary", summary)
    return 0 if ok else 1


def _run_ingest(args: argparse.Namespace) -> int:
    """The demo on a source that cannot replay (`--source http|jetstream`)."""
    refused = [
        flag
        for flag, given in (
            ("--cluster", args.cluster),
            ("--kill-workers", args.kill_workers),
            ("--kill-worker", args.kill_worker),
            ("--shards", args.shards not in (None, 1)),
            ("--kill-shard", args.kill_shard),
            ("--poison-rate", args.poison_rate > 0),
        )
        if given
    ]
    if refused:
        raise SystemExit(
            f"ftlayer demo: --source {args.source} runs on local Spark and one FT layer: "
            f"{', '.join(refused)} go with --source kafka"
        )
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table

    from ftlayer.integration.harness.demoingest import run_ingest_demo

    console = Console(stderr=True)
    names = ("produced", "acked_upstream", "ingested", "completed", "pending", "replayed")

    def view(progress: dict[str, Any]) -> Table:
        table = Table(title=f"ftlayer demo ({args.source})", show_header=True)
        for name in names:
            table.add_column(name.replace("_", " "), justify="right")
        table.add_row(*(f"{progress.get(k, 0):,}" for k in names))
        return table

    receiver = f"ftlayer ingest {args.source}"
    console.print(
        f"ftlayer demo: {args.records:,} events from {args.source} through a {receiver} "
        f"receiver, {args.partitions} partitions, fail rate {args.fail_rate:g}, "
        f"{'a receiver killed midway' if args.kill_receiver else 'no receiver killed'}, "
        f"{args.completion} mode; starting Tansu, the FT layer, "
        f"{'NATS, ' if args.source == 'jetstream' else ''}the receiver and Spark ...",
        soft_wrap=True,
    )
    with Live(view({"produced": args.records}), console=console, refresh_per_second=4) as live:
        result = run_ingest_demo(
            args.source,
            records=args.records,
            fail_rate=args.fail_rate,
            partitions=args.partitions,
            kill_receiver=args.kill_receiver,
            completion=args.completion,
            http_port=args.http_port,
            workdir=args.workdir,
            max_per_trigger=args.max_offsets_per_trigger,
            on_progress=lambda progress: live.update(view(progress)),
            on_kill=lambda line: live.console.print(f"ftlayer demo: {line}", soft_wrap=True),
        )
    if not console.is_terminal:
        console.line()
    summary = result.as_dict()
    if not result.ok:
        console.print(
            f"ftlayer demo: FAILED: lost {result.lost} of {result.extra['acked_upstream']} "
            f"acknowledged upstream ({result.produced} sent), completed {result.completed}, "
            f"{result.pending_at_end} trees still pending, receivers killed "
            f"{result.extra['receivers_killed']}",
            soft_wrap=True,
        )
    return _summary(console, args, summary, result.ok)
