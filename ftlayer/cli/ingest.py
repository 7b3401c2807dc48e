"""`ftlayer ingest KIND`: a receiver of a source that cannot replay, as a process of its
own (integration.receivers). `ftlayer ingest http` serves webhooks
(integration.receivers.http): it prints "ftlayer ingest http on URL" once it listens,
then serves until SIGTERM or SIGINT and exits 0."""

from __future__ import annotations

import argparse
import signal
import threading
from typing import Any

from ftlayer.client import read_token_file

from .common import port, positive_int


def add_parser(commands: Any) -> None:
    ingest = commands.add_parser(
        "ingest", help="run a receiver of a source that cannot replay (HTTP webhooks)"
    )
    kinds = ingest.add_subparsers(dest="kind", required=True, metavar="KIND")
    http = kinds.add_parser("http", help="take records POSTed to /sources/<name>")
    http.add_argument("--server", required=True, help="HOST:PORT of the FT layer")
    http.add_argument(
        "--source",
        action="append",
        required=True,
        help="a source's name (its query's ft.sourceName); repeat for several",
    )
    http.add_argument(
        "--partitions", type=positive_int, required=True, help="the source's partitions"
    )
    http.add_argument(
        "--partitioner",
        default="kafka-hash",
        choices=("kafka-hash", "spark-hash", "rebalance"),
        help="routes records to partitions: by key (kafka-hash, spark-hash) or round robin",
    )
    http.add_argument("--host", default="127.0.0.1", help="address to listen on")
    http.add_argument("--port", type=port, default=8080, help="port to listen on (0: any free)")
    http.add_argument(
        "--max-pending",
        type=positive_int,
        default=100_000,
        help="pending records per source before 503",
    )
    http.add_argument(
        "--max-body-bytes", type=positive_int, default=1 << 20, help="largest body taken (else 413)"
    )
    http.add_argument("--token-file", default=None, help="file holding the FT layer's token")
    http.add_argument("--tls-ca", default=None, help="connect with TLS, trusting this CA file")


def run(args: argparse.Namespace) -> int:
    from ftlayer.integration.receivers import Receiver
    from ftlayer.integration.receivers.http import HttpReceiver

    token = None if args.token_file is None else read_token_file(args.token_file)
    receivers = {
        name: Receiver(
            args.server,
            name,
            partitions=args.partitions,
            partitioner=args.partitioner,
            max_pending=args.max_pending,
            token=token,
            tls_ca=args.tls_ca,
            name=f"ingest-http-{name}",
        )
        for name in args.source
    }
    server = HttpReceiver(receivers, args.host, args.port, args.max_body_bytes).start()
    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopped.set())
    host, port = server.address
    print(f"ftlayer ingest http on http://{host}:{port}/sources/", flush=True)
    stopped.wait()
    server.stop()
    for receiver in receivers.values():
        receiver.close()
    return 0
