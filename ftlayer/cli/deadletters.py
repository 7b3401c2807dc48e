"""`ftlayer dead-letters list | show | requeue | purge` (ftlayer.deadletters) on the
server at `--server`, or on the shards of a cluster (`--server A,B,...`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, TypeVar

from ftlayer.client import FTClient

from .common import on_server, on_shards

T = TypeVar("T")

_WAIT_S = 5.0
"""How long the command retries a refused connection."""


def add_parser(commands: Any) -> None:
    from ftlayer import deadletters

    deadletters.add_parser(commands)


def run(args: argparse.Namespace) -> int:
    from ftlayer import deadletters

    addresses = [address.strip() for address in args.server.split(",")]
    if len(addresses) == 1:
        return on_server(args, _WAIT_S, lambda client: deadletters.run(args, client))
    on_shards(args, _WAIT_S, lambda client: None)  # each shard where --server puts it

    def on(shard: int, call: Callable[[FTClient], T]) -> T:
        one = argparse.Namespace(**{**vars(args), "server": addresses[shard]})
        return on_server(one, _WAIT_S, call)

    return deadletters.run_sharded(args, len(addresses), on)
