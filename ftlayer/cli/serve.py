"""`ftlayer serve`: run the FT-layer server (ftlayer.server) on an LMDB data dir until
SIGTERM or SIGINT, logging to stderr as text or JSON lines (ftlayer.logs)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any

from ftlayer.client import read_token_file
from ftlayer.errors import ConfigError

from .common import (
    buckets,
    non_negative_float,
    non_negative_int,
    port,
    positive_float,
    positive_int,
)


class _DeprecatedSpelling(argparse.Action):
    """Stores the value; warns on stderr when the option came under its old spelling
    (the last of its option strings)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if option_string == self.option_strings[-1]:
            print(
                f"ftlayer serve: {option_string} is deprecated: use {self.option_strings[0]}",
                file=sys.stderr,
            )
        setattr(namespace, self.dest, values)


LAPSED_DEFAULT_S = 600.0
"""ftlayer.core.leases.DEFAULT_LAPSED_S (a test checks they agree), not imported: building
the parser loads no core."""
SPOOL_IDLE_DEFAULT_S = 900.0
"""ftlayer.checkpoint.fetch.SPOOL_IDLE_S, likewise."""


def add_parser(commands: Any) -> None:
    serve = commands.add_parser("serve", help="run the FT-layer server on an LMDB data dir")
    serve.add_argument("--data-dir", required=True, help="the LMDB directory (created if missing)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    serve.add_argument("--port", type=port, default=0, help="TCP port (default: 0, any free)")
    serve.add_argument(
        "--tree-timeout-s",
        "--timeout-s",
        dest="timeout_s",
        type=positive_float,
        default=30.0,
        action=_DeprecatedSpelling,
        help="tree timeout T (--timeout-s: a deprecated spelling)",
    )
    serve.add_argument("--buckets", type=buckets, default=3, help="rotating buckets n (>= 2)")
    serve.add_argument(
        "--lapsed-batch-timeout-s",
        type=non_negative_float,
        default=LAPSED_DEFAULT_S,
        help="the trees of a batch whose driver stopped heartbeating (it died mid-batch) "
        "wait this long for the restarted driver's run of the batch before they time out "
        f"and are replayed (default {LAPSED_DEFAULT_S:g}; 0: time out at the tree timeout)",
    )
    serve.add_argument(
        "--spool-idle-s",
        type=positive_float,
        default=SPOOL_IDLE_DEFAULT_S,
        help="a savepoint part this server spooled for a client to fetch (`ftlayer "
        "savepoint create --server`) is deleted once nobody read it for this long "
        f"(default {SPOOL_IDLE_DEFAULT_S:g})",
    )
    serve.add_argument(
        "--shard",
        type=non_negative_int,
        default=0,
        help="this server's place in a cluster of --shards FT-layer shards (default 0)",
    )
    serve.add_argument(
        "--shards",
        type=positive_int,
        default=1,
        help="how many shards the cluster has (default 1); the data dir keeps both",
    )
    serve.add_argument("--token-file", default=None, help="file holding the auth token")
    serve.add_argument("--tls-cert", default=None, help="PEM certificate (chain): serve TLS")
    serve.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    serve.add_argument(
        "--handshake-timeout-s",
        type=positive_float,
        default=10.0,
        help="a connection's handshake (TLS included) must end within this (default 10)",
    )
    serve.add_argument(
        "--frame-timeout-s",
        type=positive_float,
        default=30.0,
        help="a frame must be received whole within this of its first byte (default 30)",
    )
    serve.add_argument(
        "--idle-timeout-s",
        type=positive_float,
        default=600.0,
        help="close a connection that sent nothing for this long (default 600)",
    )
    serve.add_argument(
        "--max-connections",
        type=positive_int,
        default=1024,
        help="connections served at once; more get ERROR 103 (default 1024)",
    )
    serve.add_argument(
        "--delete-interval-s",
        type=positive_float,
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
        "--journal-base-bytes",
        type=non_negative_int,
        default=None,
        help="a checkpoint writes a journal base once the journal grew by this many bytes "
        "since the last one (default: 1 MiB or 24 bytes per pending root, the larger; "
        "smaller: shorter recoveries, more writes; 0: at every checkpoint)",
    )
    serve.add_argument(
        "--http-port",
        type=port,
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


def run(args: argparse.Namespace) -> int:
    from ftlayer.logs import configure
    from ftlayer.memtune import settle_heap, tune_malloc
    from ftlayer.server import FTServer
    from ftlayer.shards import ShardPlace

    # Flags first: a bad one ends the command before it touches logging or malloc.
    if args.http_port is None and (args.http_public or args.http_host != "127.0.0.1"):
        raise ConfigError("--http-host and --http-public go with --http-port")
    shard = ShardPlace(args.shard, args.shards)
    token = None if args.token_file is None else read_token_file(args.token_file)
    configure(args.log_format, sys.stderr)
    tune_malloc()  # frames and chunks of megabytes, many a second (ftlayer/memtune.py)
    server = FTServer(
        args.data_dir,
        host=args.host,
        port=args.port,
        timeout_s=args.timeout_s,
        buckets=args.buckets,
        lapsed_batch_timeout_s=args.lapsed_batch_timeout_s,
        spool_idle_s=args.spool_idle_s,
        token=token,
        handshake_timeout_s=args.handshake_timeout_s,
        frame_timeout_s=args.frame_timeout_s,
        idle_timeout_s=args.idle_timeout_s,
        max_connections=args.max_connections,
        delete_interval_s=args.delete_interval_s,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        journal=not args.no_journal,
        journal_base_bytes=args.journal_base_bytes,
        http_port=args.http_port,
        http_host=args.http_host,
        http_public=args.http_public,
        shard=shard,
    )
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    with server:
        settle_heap()  # kernels loaded, start-up heap frozen (ftlayer/memtune.py)
        host, port = server.address
        # Parsers take the address up to the first space (ftlayer.integration.harness.ftprocess).
        print(
            f"ftlayer serving on {host}:{port}{' (TLS)' if server.serves_tls else ''}", flush=True
        )
        if server.http_url is not None:
            print(f"ftlayer http on {server.http_url}", flush=True)
        stop.wait()  # a signal's handler sets it
    return 0
