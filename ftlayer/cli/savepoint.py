"""`ftlayer savepoint create | list | restore` (ftlayer.checkpoint.savepoint): save a
stopped server's data dir or have a running server save its own store, list the
savepoints of a directory, restore one into a new data dir (with `--partitions N`,
every stored record re-routed by its source's partitioner).

With `--server`, each running server saves its store into its spool and this command
fetches the part over the FT-layer connection into `--dir` on this host
(ftlayer.checkpoint.fetch), so shards on different hosts make one savepoint directory.
The shards of a cluster (`--server A,B,...` or `--data-dir D0,D1,...`, in shard order)
each save a part of one savepoint, `<name>.shard-<i>-of-<N>`; `restore NAME --data-dir
D0,D1,...` restores it into as many shards as it names data dirs, also another number
than it was saved from (ftlayer.checkpoint.reshard)."""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ftlayer.client import FTClient
from ftlayer.errors import ConfigError

from .common import on_server, on_shards


def add_parser(commands: Any) -> None:
    savepoint = commands.add_parser(
        "savepoint", help="create, list and restore savepoints of an FT layer's state"
    )
    actions = savepoint.add_subparsers(dest="savepoint", required=True, metavar="ACTION")
    create = actions.add_parser(
        "create", help="save a stopped server's data dir, or have a running server save"
    )
    source = create.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--data-dir",
        help="the data dir of a stopped server (D0,D1,...: of the shards of a cluster)",
    )
    source.add_argument(
        "--server",
        help="HOST:PORT of a running server, which saves its store for this command to "
        "fetch (HOST:PORT,...: the shards of a cluster, in shard order, a part each)",
    )
    create.add_argument("--token-file", default=None, help="with --server: the auth token file")
    create.add_argument("--tls-ca", default=None, help="with --server: TLS, trusting this CA file")
    create.add_argument(
        "--dir",
        required=True,
        help="the savepoints directory, on this host (with --server, each server's part "
        "is fetched into it over the FT-layer connection)",
    )
    create.add_argument("--name", default=None, help="default: savepoint-<UTC time>-<random>")
    create.add_argument("--json", action="store_true", help="print one JSON object last")
    listing = actions.add_parser("list", help="list the savepoints in a directory")
    listing.add_argument("--dir", required=True, help="the savepoints directory")
    listing.add_argument("--json", action="store_true", help="print one JSON object last")
    restore = actions.add_parser("restore", help="restore a savepoint into a new data dir")
    restore.add_argument("name", help="the savepoint's name")
    restore.add_argument("--dir", required=True, help="the savepoints directory")
    restore.add_argument(
        "--data-dir",
        required=True,
        help="the new data dir (new or empty); D0,D1,...: one per shard of the restored "
        "FT layer, in shard order, as many as it has shards",
    )
    restore.add_argument(
        "--partitions", default=None, help="replay every source into N partitions (rescale)"
    )
    restore.add_argument("--json", action="store_true", help="print one JSON object last")


def run(args: argparse.Namespace) -> int:
    from ftlayer.checkpoint import reshard, savepoint

    if args.savepoint == "create":
        if args.server is not None:
            parts = _savepoint_online(args)
        else:
            for flag in ("token_file", "tls_ca"):
                if getattr(args, flag) is not None:
                    raise ConfigError(f"--{flag.replace('_', '-')} goes with --server only")
            dirs = _listed(args.data_dir, "--data-dir")
            parts = [
                p.as_dict() for p in reshard.create_parts_from_data_dirs(dirs, args.dir, args.name)
            ]
        if args.json:
            print(json.dumps(parts[0] if len(parts) == 1 else {"parts": parts}, sort_keys=True))
        else:
            for created in parts:
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
    targets = _listed(args.data_dir, "--data-dir")
    if len(targets) > 1 or len(reshard.find_parts(args.dir, args.name)) > 1:
        return _restore_cluster(args, targets, partitions)
    result = savepoint.restore_savepoint(args.dir, args.name, targets[0], partitions=partitions)
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


def _savepoint_online(args: argparse.Namespace) -> list[dict[str, Any]]:
    """SAVEPOINT to each running server --server names (several: the shards of a
    cluster, in shard order), each part fetched into --dir on this host
    (ftlayer.checkpoint.fetch) and named as the part of its server's place
    (ftlayer.checkpoint.reshard.part_name), several with one savepoint id. If one part
    cannot be fetched, the parts fetched before it are removed: a savepoint is whole
    or absent."""
    from ftlayer.checkpoint.fetch import fetch_part
    from ftlayer.checkpoint.reshard import part_name
    from ftlayer.checkpoint.savepoint import default_name, new_savepoint_id

    name = default_name() if args.name is None else args.name
    several = len(args.server.split(",")) > 1
    savepoint_id = new_savepoint_id() if several else None  # a part saved alone has none
    fetched: list[Path] = []

    def save(client: FTClient) -> dict[str, Any]:
        status = client.status()
        part = part_name(name, status.shard, status.shards)
        saved = fetch_part(client, args.dir, part, savepoint_id=savepoint_id)
        fetched.append(saved.path)
        return saved.as_dict()

    try:
        if several:
            _deliver_parked(args)
        return on_shards(args, _SAVEPOINT_WAIT_S, save)
    except BaseException:
        for path in fetched:
            shutil.rmtree(path, ignore_errors=True)
        raise


def _deliver_parked(args: argparse.Namespace) -> None:
    """Deliver the failures the shards keep parked for one another to their owners
    (ftlayer.client.drain) before any part is saved: a shard that keeps some refuses a
    savepoint, and its owner's part would miss them."""
    from ftlayer.client.drain import drain
    from ftlayer.wire import Fail

    def fail_at(owner: int, fail: Fail) -> int:
        return on_server(ones[owner], _SAVEPOINT_WAIT_S, lambda c: c.fail(fail.roots, fail.causes))

    ones = [
        argparse.Namespace(**{**vars(args), "server": address.strip()})
        for address in args.server.split(",")
    ]
    statuses = [on_server(one, _SAVEPOINT_WAIT_S, lambda c: c.status()) for one in ones]
    keepers = [i for i, status in enumerate(statuses) if status.parked]
    if not keepers:
        return
    done = drain(
        keepers,
        lambda k: on_server(ones[k], _SAVEPOINT_WAIT_S, lambda c: c.parked()),
        lambda o, fail: on_server(
            ones[o], _SAVEPOINT_WAIT_S, lambda c: c.fail(fail.roots, fail.causes)
        ),
        lambda k, seqs: on_server(ones[k], _SAVEPOINT_WAIT_S, lambda c: c.drop_parked(seqs)),
        {i: status.store_id for i, status in enumerate(statuses)},
    )
    for owner, roots in sorted(done.delivered.items()):
        print(f"delivered {roots} failures parked for shard {owner} before saving")
    for owner, roots in sorted(done.dropped.items()):
        print(f"dropped {roots} failures parked for a lost store of shard {owner}")


def _listed(text: str, flag: str) -> list[str]:
    entries = [entry.strip() for entry in text.split(",")]
    if not all(entries):
        raise ConfigError(f"{flag} has an empty entry: {text!r}")
    return entries


def _restore_cluster(args: argparse.Namespace, targets: list[str], partitions: int | None) -> int:
    from ftlayer.checkpoint.reshard import restore_cluster

    result = restore_cluster(args.dir, args.name, targets, partitions=partitions)
    if args.json:
        print(json.dumps(result.as_dict(), sort_keys=True))
        return 0
    count = len(result.shards)
    print(
        f"restored savepoint {args.name} of {len(result.parts)} shard(s) into {count} "
        f"shard(s): {result.stored_records:,} stored records"
    )
    for shard in result.shards:
        dead = sum(shard.dead_letters.values())
        print(
            f"shard {shard.shard}: {shard.stored_records:,} stored records"
            + (f" ({dead:,} dead letters)" if dead else "")
            + f"; start it with `ftlayer serve --data-dir {shard.data_dir} --shard "
            f"{shard.shard} --shards {count}`"
        )
    for query, offsets in result.starting_offsets.items():
        text = json.dumps(offsets, separators=(",", ":"))
        print(f"query {query}: start the new query with startingOffsets '{text}'")
    return 0


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
