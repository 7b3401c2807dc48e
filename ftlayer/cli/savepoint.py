"""`ftlayer savepoint create | list | restore` (ftlayer.checkpoint.savepoint): save a
stopped server's data dir or have a running server save its own store, list the
savepoints of a directory, restore one into a new data dir (with `--partitions N`,
every stored record re-routed by its source's partitioner)."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from typing import Any

from ftlayer.errors import ConfigError

from .common import on_server


def add_parser(commands: Any) -> None:
    savepoint = commands.add_parser(
        "savepoint", help="create, list and restore savepoints of an FT layer's state"
    )
    actions = savepoint.add_subparsers(dest="savepoint", required=True, metavar="ACTION")
    create = actions.add_parser(
        "create", help="save a stopped server's data dir, or have a running server save"
    )
    source = create.add_mutually_exclusive_group(required=True)
    source.add_argument("--data-dir", help="the data dir of a stopped server")
    source.add_argument("--server", help="HOST:PORT of a running server: it writes the savepoint")
    create.add_argument("--token-file", default=None, help="with --server: the auth token file")
    create.add_argument("--tls-ca", default=None, help="with --server: TLS, trusting this CA file")
    create.add_argument(
        "--dir",
        required=True,
        help="the savepoints directory (with --server: an absolute path on the server's host)",
    )
    create.add_argument("--name", default=None, help="default: savepoint-<UTC time>-<random>")
    create.add_argument("--json", action="store_true", help="print one JSON object last")
    listing = actions.add_parser("list", help="list the savepoints in a directory")
    listing.add_argument("--dir", required=True, help="the savepoints directory")
    listing.add_argument("--json", action="store_true", help="print one JSON object last")
    restore = actions.add_parser("restore", help="restore a savepoint into a new data dir")
    restore.add_argument("name", help="the savepoint's name")
    restore.add_argument("--dir", required=True, help="the savepoints directory")
    restore.add_argument("--data-dir", required=True, help="the new data dir (new or empty)")
    restore.add_argument(
        "--partitions", default=None, help="replay every source into N partitions (rescale)"
    )
    restore.add_argument("--json", action="store_true", help="print one JSON object last")


def run(args: argparse.Namespace) -> int:
    from ftlayer.checkpoint import savepoint

    if args.savepoint == "create":
        if args.server is not None:
            created = _savepoint_online(args)
        else:
            for flag in ("token_file", "tls_ca"):
                if getattr(args, flag) is not None:
                    raise ConfigError(f"--{flag.replace('_', '-')} goes with --server only")
            created = savepoint.create_savepoint_from_data_dir(
                args.data_dir, args.dir, args.name
            ).as_dict()
        if args.json:
            print(json.dumps(created, sort_keys=True))
        else:
            _print_created(created)
        return 0
    if args.savepoint == "list":
        found = savepoint.list_savepoints(args.dir)
        if args.json:
            print(json.dumps({"savepoints": [s.as_dict() for s in found]}, sort_keys=True))
        else:
            _print_savepoints(args.dir, found)
        return 0
    partitions = None if args.partitions is None else _partitions_option(args.partitions)
    result = savepoint.restore_savepoint(args.dir, args.name, args.data_dir, partitions=partitions)
    if args.json:
        print(json.dumps(result.as_dict(), sort_keys=True))
        return 0
    dead = sum(result.dead_letters.values())
    print(
        f"restored savepoint {args.name} into {result.data_dir}: {result.replayed_records:,} "
        f"stored records replayed when `ftlayer serve --data-dir {result.data_dir}` starts"
        + (f", {dead:,} dead letter{'' if dead == 1 else 's'} kept as dead letters" if dead else "")
    )
    for sid, spec in result.sources.items():
        counts = result.replays.get(sid, {})
        spread = ", ".join(f"{p}: {n:,}" for p, n in counts.items()) or "none"
        print(
            f"source {sid} ({spec['partitioner']}, {spec['num_partitions']} partitions): "
            f"replays per partition: {spread}"
        )
    for query, offsets in result.starting_offsets.items():
        text = json.dumps(offsets, separators=(",", ":"))
        print(f"query {query}: start the new query with startingOffsets '{text}'")
    return 0


_SAVEPOINT_WAIT_S = 2.0
"""How long `savepoint create --server` retries a refused connection (as `status`)."""


def _savepoint_online(args: argparse.Namespace) -> dict[str, Any]:
    """SAVEPOINT to the running server at --server; the savepoint it created."""
    if not os.path.isabs(args.dir):
        raise ConfigError(
            f"with --server, --dir is a directory on the server's host and must be an "
            f"absolute path, got {args.dir!r}"
        )
    return on_server(args, _SAVEPOINT_WAIT_S, lambda client: client.savepoint(args.dir, args.name))


def _print_created(created: dict[str, Any]) -> None:
    """The summary of a created savepoint (Savepoint.as_dict)."""
    print(
        f"savepoint {created['name']} created in {created['path']}: "
        f"{created['stored_records']:,} stored records"
    )
    for sid, spec in created["sources"].items():
        print(f"source {sid}: {spec['partitioner']}, {spec['num_partitions']} partitions")
    for query, position in created["positions"].items():
        print(f"query {query}: position {json.dumps(position, sort_keys=True)}")


def _partitions_option(text: str) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise ConfigError(f"--partitions must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise ConfigError(f"--partitions must be an integer >= 1, got {text!r}")
    return value


def _print_savepoints(directory: str, found: Sequence[Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    if not found:
        print(f"no savepoints in {directory}")
        return
    table = Table(title=f"savepoints in {directory}")
    table.add_column("name")
    table.add_column("created", no_wrap=True)
    table.add_column("stored records", justify="right")
    table.add_column("sources")
    for s in found:
        sources = ", ".join(
            f"{sid} {spec.get('partitioner')}/{spec.get('num_partitions')}"
            for sid, spec in s.sources.items()
        )
        table.add_row(s.name, s.created_at, f"{s.stored_records:,}", sources or "none")
    Console().print(table)
