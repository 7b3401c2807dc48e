"""`ftlayer dead-letters list | show | requeue | purge`: the dead letters a server keeps.

A dead letter is a record whose retries are spent (ftlayer.core.retries). Without a
dead-letter topic it stays in the FT layer's store until purged; with one, until the
source's driver delivered it there. These commands work on the ones in the store:

    ftlayer dead-letters list    --server HOST:PORT [filters] [--limit N] [--json]
    ftlayer dead-letters show    SEQ --server HOST:PORT [--json]
    ftlayer dead-letters requeue --server HOST:PORT [filters] [--json]
    ftlayer dead-letters purge   --server HOST:PORT [filters] [--json]

Filters: --source ID, --partition P, --cause explicit|error|sink|timeout (the kind of
the last failure), --since T, --until T (dead-lettered at or after, before; epoch
seconds or ISO 8601), --seq S (repeatable). `requeue` replays the matching records
now with a fresh retry budget (after a fix is deployed); a requeued record that fails
again comes back with its whole history. `purge` deletes them for good.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from typing import Any

from ftlayer.causes import FailKind
from ftlayer.client import FTClient
from ftlayer.errors import ConfigError
from ftlayer.records import RecordBatch

__all__ = ["add_parser", "run"]


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "dead-letters", help="list, show, requeue or purge the dead letters a server keeps"
    )
    actions = parser.add_subparsers(dest="dead_letters", required=True, metavar="ACTION")
    for name, help_text in (
        ("list", "list the dead letters that match the filters"),
        ("show", "show one dead letter with its whole history"),
        ("requeue", "replay the matching dead letters now (after a fix)"),
        ("purge", "delete the matching dead letters for good"),
    ):
        action = actions.add_parser(name, help=help_text)
        if name == "show":
            action.add_argument("seq", type=int, help="the dead letter's seq (from list)")
        action.add_argument("--server", required=True, help="HOST:PORT of the FT-layer server")
        action.add_argument("--token-file", default=None, help="file holding the auth token")
        action.add_argument("--tls-ca", default=None, help="TLS, trusting this CA file")
        if name != "show":
            action.add_argument("--source", type=int, default=None, help="a source id")
            action.add_argument("--partition", type=int, default=None, help="a Kafka partition")
            action.add_argument(
                "--cause", default=None, help="explicit, error, sink or timeout (last failure)"
            )
            action.add_argument("--since", default=None, help="dead-lettered at or after")
            action.add_argument("--until", default=None, help="dead-lettered before")
            action.add_argument("--seq", type=int, action="append", default=None)
        if name == "list":
            action.add_argument("--limit", type=int, default=None, help="at most N")
        action.add_argument("--json", action="store_true", help="print one JSON object last")


def _time(text: str | None, flag: str) -> float | None:
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ConfigError(f"{flag} takes epoch seconds or ISO 8601, got {text!r}") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


def _where(args: argparse.Namespace) -> dict[str, Any]:
    if getattr(args, "seq", None) is not None and args.dead_letters == "show":
        return {"seqs": [args.seq]}
    where: dict[str, Any] = {}
    if args.source is not None:
        where["source_id"] = args.source
    if args.partition is not None:
        where["partition"] = args.partition
    if args.cause is not None:
        try:
            where["cause"] = FailKind.from_label(args.cause).label
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    for name in ("since", "until"):
        value = _time(getattr(args, name), f"--{name}")
        if value is not None:
            where[name] = value
    if args.seq:
        where["seqs"] = sorted(set(args.seq))
    return where


def _describe(letter: dict[str, Any], records: RecordBatch, i: int) -> dict[str, Any]:
    causes = letter["causes"]
    last = causes[-1] if causes else None
    return {
        "seq": letter["seq"],
        "source_id": letter["source_id"],
        "topic": records.topics[i],
        "partition": int(records.partitions[i]),
        "offset": int(records.offsets[i]),
        "attempts": letter["attempts"],
        "first_failed": letter["first_failed"],
        "last_failed": letter["last_failed"],
        "dead_at": letter["dead_at"],
        "requeued": letter["requeued"],
        "last_cause": last,
        "causes": causes,
        "causes_omitted": letter["omitted"],
        "payload_bytes": len(records.payloads[i]),
    }


def run(args: argparse.Namespace, client: FTClient) -> int:
    """The command on a connected client; prints a table, or one JSON object last."""
    action = args.dead_letters
    if action in ("requeue", "purge"):
        count = client.dead_letter_op(action, _where(args))
        key = "requeued" if action == "requeue" else "purged"
        print(json.dumps({key: count}) if args.json else f"{count:,} dead letters {key}")
        return 0
    limit = getattr(args, "limit", None)
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be at least 1, got {limit}")
    listed = client.dead_letters(_where(args), limit)
    letters = [_describe(x, listed.records, i) for i, x in enumerate(listed.letters)]
    if action == "show":
        if not letters:
            raise ConfigError(f"no dead letter has seq {args.seq}")
        print(json.dumps(letters[0], sort_keys=True) if args.json else _show(letters[0]))
        return 0
    if args.json:
        print(json.dumps({"letters": letters, "more": listed.more}, sort_keys=True))
    else:
        _print_list(letters, listed.more)
    return 0


def _when(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return dt.datetime.fromtimestamp(seconds, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _cause_text(cause: dict[str, Any] | None) -> str:
    if cause is None:
        return "-"
    text = cause["kind"] + (" (final)" if cause.get("final") else "")
    if cause["step"]:
        text += f" in {cause['step']}"
    return f"{text}: {cause['error']}" if cause["error"] else text


def _show(letter: dict[str, Any]) -> str:
    lines = [
        f"dead letter {letter['seq']}: {letter['topic']}-{letter['partition']} "
        f"offset {letter['offset']} (source {letter['source_id']}), "
        f"{letter['payload_bytes']:,} payload bytes",
        f"  {letter['attempts']} attempts, first failed {_when(letter['first_failed'])}, "
        f"last {_when(letter['last_failed'])}, dead since {_when(letter['dead_at'])} UTC"
        + (f", requeued {letter['requeued']} times" if letter["requeued"] else ""),
    ]
    for n, cause in enumerate(letter["causes"], start=1):
        if n == 5 and letter["causes_omitted"]:
            lines.append(f"  ... {letter['causes_omitted']} failures not kept ...")
        lines.append(f"  {_when(cause['at'])}  {_cause_text(cause)}")
    return "\n".join(lines)


def _print_list(letters: list[dict[str, Any]], more: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{len(letters):,} dead letters" + (" (more match)" if more else ""))
    for column in ("seq", "source", "topic-partition@offset", "attempts", "dead since", "cause"):
        table.add_column(column)
    for x in letters:
        table.add_row(
            str(x["seq"]),
            str(x["source_id"]),
            f"{x['topic']}-{x['partition']}@{x['offset']}",
            str(x["attempts"]),
            _when(x["dead_at"]),
            _cause_text(x["last_cause"]),
        )
    Console(width=200).print(table)
