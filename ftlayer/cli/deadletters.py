"""`ftlayer dead-letters list | show | requeue | purge` (ftlayer.deadletters) on the
server at `--server`."""

from __future__ import annotations

import argparse
from typing import Any

from .common import on_server

_WAIT_S = 5.0
"""How long the command retries a refused connection."""


def add_parser(commands: Any) -> None:
    from ftlayer import deadletters

    deadletters.add_parser(commands)


def run(args: argparse.Namespace) -> int:
    from ftlayer import deadletters

    return on_server(args, _WAIT_S, lambda client: deadletters.run(args, client))
