"""The `ftlayer` command line.

    ftlayer bench acker   [--roots N] [--depth K] [--batch B] [--json]
    ftlayer bench persist [--records N] [--payload-bytes P] [--batch B] [--no-sync]
                          [--dir D] [--json]
    ftlayer version

Every bench prints a table of its figures; with --json it prints one JSON object as
its last line instead. `serve`, `status` and `demo` arrive with the FT-layer process
and the Spark integration.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from ftlayer import __version__
from ftlayer.errors import FTLayerError


def _positive_int(text: str) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ftlayer",
        description="A Storm-style acker and replay layer for PySpark Structured Streaming.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("version", help="print the version")

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
    return parser


def _print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"ftlayer bench {result['bench']}", show_header=False)
    for key, value in result.items():
        if key not in ("bench", "machine"):
            table.add_row(
                key,
                f"{value:,}"
                if isinstance(value, int) and not isinstance(value, bool)
                else str(value),
            )
    Console().print(table)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "version":
            print(__version__)
            return 0
        from ftlayer import bench

        if args.bench == "acker":
            result = bench.bench_acker(roots=args.roots, depth=args.depth, batch=args.batch)
        else:
            result = bench.bench_persist(
                records=args.records,
                payload_bytes=args.payload_bytes,
                batch=args.batch,
                sync=not args.no_sync,
                directory=args.dir,
                rounds=args.rounds,
            )
    except FTLayerError as exc:
        print(f"ftlayer: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        _print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
