"""`ftlayer ingest KIND`: a receiver of a source that cannot replay, as a process of its
own (integration.receivers). `ftlayer ingest http` serves webhooks
(integration.receivers.http): it prints "ftlayer ingest http on URL" once it listens,
then serves until SIGTERM or SIGINT and exits 0. `ftlayer ingest jetstream` and
`ftlayer ingest nats` (integration.receivers.nats) print "ftlayer ingest jetstream on
URL stream S" / "ftlayer ingest nats on URL subject S" once they consume, then run until
SIGTERM or SIGINT (finishing the batch in hand, or storing what they received) and
exit 0. Each first checks that the FT layer answers (within a few seconds)."""

from __future__ import annotations

import argparse
import asyncio
import signal
import threading
from typing import Any

from ftlayer.client import FTClient, read_token_file
from ftlayer.errors import FTLayerError

from .common import port, positive_float, positive_int

_PROBE_RECONNECT_S = 3.0  # how long a receiver looks for its FT layer at start


def add_parser(commands: Any) -> None:
    ingest = commands.add_parser(
        "ingest",
        help="run a receiver of a source that cannot replay (HTTP webhooks, NATS JetStream, "
        "core NATS)",
    )
    kinds = ingest.add_subparsers(dest="kind", required=True, metavar="KIND")
    http = kinds.add_parser("http", help="take records POSTed to /sources/<name>")
    _source_arguments(http, several=True)
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
    _ft_arguments(http)

    jetstream = kinds.add_parser(
        "jetstream", help="store a JetStream stream's messages, acknowledging them once stored"
    )
    _nats_arguments(jetstream)
    jetstream.add_argument("--stream", required=True, help="the JetStream stream")
    jetstream.add_argument(
        "--subject", default=None, help="a new consumer's filter subject (default: the stream's)"
    )
    jetstream.add_argument(
        "--durable", default="ftlayer", help="the durable pull consumer, shared by its receivers"
    )
    jetstream.add_argument(
        "--batch", type=positive_int, default=1000, help="messages fetched and stored at once"
    )
    jetstream.add_argument(
        "--ack-wait",
        type=positive_float,
        default=30.0,
        help="a new consumer's seconds before it redelivers an unacknowledged message",
    )
    jetstream.add_argument(
        "--max-pending",
        type=positive_int,
        default=100_000,
        help="the source's pending records before the receiver stops fetching",
    )
    _source_arguments(jetstream, several=False)
    _ft_arguments(jetstream)

    core = kinds.add_parser(
        "nats", help="store core NATS messages of a subject (a crash loses the unstored ones)"
    )
    _nats_arguments(core)
    core.add_argument("--subject", required=True, help="the subject (wildcards allowed)")
    core.add_argument("--queue", default=None, help="a queue group, to share the subject")
    core.add_argument(
        "--flush-messages",
        type=positive_int,
        default=1000,
        help="store once this many messages are buffered",
    )
    core.add_argument("--flush-ms", type=positive_int, default=50, help="store at least this often")
    _source_arguments(core, several=False)
    _ft_arguments(core)


def _source_arguments(parser: Any, *, several: bool) -> None:
    parser.add_argument(
        "--server",
        required=True,
        help="HOST:PORT of the FT layer (of each shard, in shard order: HOST:PORT,HOST:PORT)",
    )
    parser.add_argument(
        "--source",
        action="append" if several else "store",
        required=True,
        help="the source's name (its query's ft.sourceName)"
        + ("; repeat for several" if several else ""),
    )
    parser.add_argument(
        "--partitions", type=positive_int, required=True, help="the source's partitions"
    )
    parser.add_argument(
        "--partitioner",
        default="kafka-hash",
        choices=("kafka-hash", "spark-hash", "rebalance"),
        help="routes records to partitions: by key (kafka-hash, spark-hash) or round robin",
    )


def _ft_arguments(parser: Any) -> None:
    parser.add_argument("--token-file", default=None, help="file holding the FT layer's token")
    parser.add_argument("--tls-ca", default=None, help="connect with TLS, trusting this CA file")
    parser.add_argument(
        "--reconnect-s",
        type=positive_float,
        default=60.0,
        help="how long a store waits for an FT layer that does not answer before it fails "
        "(its records are not acknowledged upstream and come again)",
    )


def _nats_arguments(parser: Any) -> None:
    parser.add_argument("--nats", required=True, help="the NATS server's URL, nats://HOST:PORT")
    parser.add_argument(
        "--key-header",
        default=None,
        help="a record's key is this NATS header's value (default, or without it: the subject)",
    )
    parser.add_argument(
        "--nats-token-file", default=None, help="file holding the NATS server's token"
    )
    parser.add_argument(
        "--nats-tls-ca", default=None, help="connect to NATS with TLS, trusting this CA file"
    )


def run(args: argparse.Namespace) -> int:
    token = None if args.token_file is None else read_token_file(args.token_file)
    _probe(args.server, token, args.tls_ca)
    if args.kind == "http":
        return _run_http(args, token)
    return _run_nats(args, token)


def _probe(addresses: str, token: bytes | None, tls_ca: str | None) -> None:
    """Fail within seconds, naming the FT layer (the shard), when it does not answer."""
    for address in (a.strip() for a in addresses.split(",") if a.strip()):
        try:
            with FTClient(
                address, token, tls=tls_ca or False, reconnect_s=_PROBE_RECONNECT_S, name="ingest"
            ) as client:
                client.status()
        except FTLayerError as exc:
            raise FTLayerError(f"the FT layer at {address} does not answer: {exc}") from None


def _run_http(args: argparse.Namespace, token: bytes | None) -> int:
    from ftlayer.integration.receivers import Receiver
    from ftlayer.integration.receivers.http import HttpReceiver

    receivers = {
        name: Receiver(
            args.server,
            name,
            partitions=args.partitions,
            partitioner=args.partitioner,
            max_pending=args.max_pending,
            token=token,
            tls_ca=args.tls_ca,
            reconnect_s=args.reconnect_s,
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


def _run_nats(args: argparse.Namespace, token: bytes | None) -> int:
    from ftlayer.integration.receivers import Receiver
    from ftlayer.integration.receivers.nats import JetStreamReceiver, NatsReceiver

    nats_token = None
    if args.nats_token_file is not None:
        nats_token = read_token_file(args.nats_token_file).decode()
    with Receiver(
        args.server,
        args.source,
        partitions=args.partitions,
        partitioner=args.partitioner,
        max_pending=getattr(args, "max_pending", 100_000),
        token=token,
        tls_ca=args.tls_ca,
        reconnect_s=args.reconnect_s,
        name=f"ingest-{args.kind}-{args.source}",
    ) as receiver:
        consumer: JetStreamReceiver | NatsReceiver
        if args.kind == "jetstream":
            consumer = JetStreamReceiver(
                receiver,
                args.nats,
                args.stream,
                subject=args.subject,
                durable=args.durable,
                batch=args.batch,
                ack_wait_s=args.ack_wait,
                key_header=args.key_header,
                token=nats_token,
                tls_ca=args.nats_tls_ca,
            )
            banner = f"ftlayer ingest jetstream on {args.nats} stream {args.stream}"
        else:
            consumer = NatsReceiver(
                receiver,
                args.nats,
                args.subject,
                queue=args.queue,
                flush_messages=args.flush_messages,
                flush_ms=args.flush_ms,
                key_header=args.key_header,
                token=nats_token,
                tls_ca=args.nats_tls_ca,
            )
            banner = f"ftlayer ingest nats on {args.nats} subject {args.subject}"

        async def consume() -> None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            await consumer.run(stop, ready=lambda: print(banner, flush=True))

        asyncio.run(consume())
    return 0
