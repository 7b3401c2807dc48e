"""`ftlayer inspect` (ftlayer.inspection): where one record stands in the server at
`--server`, found by its root or its Kafka coordinates."""

from __future__ import annotations

import argparse
from typing import Any

from .common import on_server

_WAIT_S = 5.0
"""How long the command retries a refused connection."""


def add_parser(commands: Any) -> None:
    from ftlayer import inspection

    inspection.add_parser(commands)


def run(args: argparse.Namespace) -> int:
    from ftlayer import inspection

    return on_server(args, _WAIT_S, lambda client: inspection.run(args, client))
