"""What the `ftlayer` commands share: argument types (each refuses a bad value with a
usage error naming it), the client of `--server`, and the key/value table of
`status`, `demo` and the benches."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from ftlayer.client import FTClient, read_token_file
from ftlayer.errors import ConfigError

T = TypeVar("T")


def positive_int(text: str) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    return 0 if text.strip() == "0" else positive_int(text)


def int_list(text: str) -> list[int]:
    """Comma-separated positive integers."""
    return [positive_int(part) for part in text.split(",") if part.strip()] or [positive_int("")]


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite positive number, got {value}")
    return value


def non_negative_float(text: str) -> float:
    return 0.0 if text.strip() in ("0", "0.0") else positive_float(text)


def buckets(text: str) -> int:
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"need at least 2 buckets, got {text!r}")
    return value


def rate(text: str) -> float:
    value = positive_float(text) if text.strip() not in ("0", "0.0") else 0.0
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text!r}")
    return value


def count(text: str) -> int:
    return 0 if text.strip() == "0" else positive_int(text)


def port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"not a port (0 to 65535): {text!r}")
    return int(text)


def client(args: argparse.Namespace, reconnect_s: float) -> FTClient:
    """An FTClient of `--server`, with `--token-file` and `--tls-ca`."""
    token = None if args.token_file is None else read_token_file(args.token_file)
    return FTClient(args.server, token=token, tls=args.tls_ca or False, reconnect_s=reconnect_s)


def on_server(args: argparse.Namespace, reconnect_s: float, call: Callable[[FTClient], T]) -> T:
    """`call` on a client of `--server` (see `client`); ConfigError naming the server if
    it cannot be reached."""
    try:
        with client(args, reconnect_s) as connected:
            return call(connected)
    except OSError as exc:
        raise ConfigError(f"cannot reach the FT-layer server at {args.server}: {exc}") from None


def on_shards(
    args: argparse.Namespace, reconnect_s: float, call: Callable[[FTClient], T]
) -> list[T]:
    """`call` on each server `--server` names: one, or the shards of a cluster in shard
    order (`HOST:PORT,HOST:PORT,...`), each checked first to stand where the list puts
    it (ConfigError naming the first that does not, before any call)."""
    addresses = [address.strip() for address in args.server.split(",")]
    if len(addresses) == 1:
        return [on_server(args, reconnect_s, call)]
    if not all(addresses) or len(set(addresses)) != len(addresses):
        raise ConfigError(f"--server lists a shard twice or has an empty entry: {args.server!r}")
    ones = [argparse.Namespace(**{**vars(args), "server": address}) for address in addresses]
    for index, one in enumerate(ones):
        status = on_server(one, reconnect_s, lambda client: client.status())
        if (status.shard, status.shards) != (index, len(addresses)):
            raise ConfigError(
                f"{one.server} is shard {status.shard} of {status.shards}, but --server names "
                f"it as shard {index} of {len(addresses)}: list every shard of the cluster, "
                "in shard order"
            )
    return [on_server(one, reconnect_s, call) for one in ones]


def print_table(title: str, rows: Mapping[str, Any]) -> None:
    """Key/value rows as a rich table: nested dicts become key.sub rows (an empty one
    "none"), ints get commas."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=False)
    for key, text in _flat_rows(rows):
        table.add_row(key, text)
    Console().print(table)


def _flat_rows(rows: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    for key, value in rows.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            yield from _flat_rows(value, f"{name}.")
        elif isinstance(value, Mapping):
            yield name, "none"
        elif isinstance(value, int) and not isinstance(value, bool):
            yield name, f"{value:,}"
        else:
            yield name, str(value)
