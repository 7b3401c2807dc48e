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
    ftlayer savepoint create  --server HOST:PORT[,...] [--token-file F] [--tls-ca CA]
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

`serve` prints "ftlayer serving on HOST:PORT" once it listens (" (TLS)" after the
address when it serves TLS; with --http-port, then "ftlayer http on URL"), then serves
until SIGTERM or SIGINT and exits 0. A token file holds the token's bytes (one
trailing newline is ignored); serving on a non-loopback host needs one. `demo` runs
the main job on an embedded broker, an FT-layer process and local Spark
(ftlayer.integration.harness.demo) and exits 0 only if nothing was lost and every
produced record completed; 1 otherwise. `savepoint create` saves the data dir of a
stopped server (`--data-dir`) or has a running server save its own store and fetches
it into --dir on this host (`--server`).

One module per command (`serve`, `status`, `demo`, `bench`, `savepoint`, `deadletters`,
`inspect`, `ingest`), each with its `add_parser` and `run`; `common` holds what they share. This
module builds the argparse tree and dispatches. Only `demo` and `bench` load the
harness (ftlayer.integration.harness), and only when they run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, Protocol

from ftlayer import __version__
from ftlayer.errors import FTLayerError

from . import bench, deadletters, demo, ingest, inspect, savepoint, serve, status

__all__ = ["main"]


class _Command(Protocol):
    """A command's module."""

    def add_parser(self, commands: Any) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


# In the order `ftlayer --help` lists them (after `version`).
_COMMANDS: dict[str, _Command] = {
    "serve": serve,
    "status": status,
    "demo": demo,
    "savepoint": savepoint,
    "dead-letters": deadletters,
    "inspect": inspect,
    "ingest": ingest,
    "bench": bench,
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ftlayer",
        description="A Storm-style acker and replay layer for PySpark Structured Streaming.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("version", help="print the version")
    for command in _COMMANDS.values():
        command.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "version":
        print(__version__)
        return 0
    try:
        return _COMMANDS[args.command].run(args)
    except FTLayerError as exc:
        print(f"ftlayer: {exc}", file=sys.stderr)
        return 2
