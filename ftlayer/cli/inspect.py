"""`ftlayer inspect`: where one record stands in the server at `--server`, found by its
root or its Kafka coordinates (ftlayer.inspection).

    ftlayer inspect --server HOST:PORT[,HOST:PORT...]
                    (--root R | --topic T --partition P --offset O)
                    [--token-file F] [--tls-ca CA] [--json]

With the shards of a cluster (`--server A,B,...`, in shard order) every shard is asked,
and what each holds is shown with its shard: a record is on the shard of its source's
partition, and its replay on the same one.

R is the root as `ftlayer` logs print it (0x...), in decimal, or as Spark's `ft_root`
column shows it (a signed 64-bit integer).

A record a receiver stored (a source that cannot replay, `ftlayer ingest`) has the
upstream's name as its topic (`http:orders`, `jetstream:ORDERS`), partition 0 and its
identity upstream (a stream sequence, an HTTP record's id) as its offset: `--topic
jetstream:ORDERS --partition 0 --offset 42` finds it. The report names each record's
source (by the name it registered, where it has one) and decodes its key and value.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from typing import Any, Final

from ftlayer.client import FTClient
from ftlayer.errors import ConfigError
from ftlayer.inspection import InspectedRecord, Inspection, RecordQuery, RecordState
from ftlayer.registration import ingest_source_id

from .common import on_server, on_shards

_WAIT_S = 5.0
"""How long the command retries a refused connection."""
_U64_MAX: Final = (1 << 64) - 1
_I64_MIN: Final = -(1 << 63)
_VALUE_CHARS: Final = 200
"""How much of a record's value `inspect` shows."""


def run(args: argparse.Namespace) -> int:
    if "," not in args.server:
        return on_server(args, _WAIT_S, lambda client: run_on(args, client))
    query = query_of(args)
    found = on_shards(args, _WAIT_S, lambda client: (client.inspect(query), source_names(client)))
    merged = Inspection(
        query,
        tuple(record for one, _ in found for record in one.records),
        any(one.retired for one, _ in found),
    )
    names = {sid: name for _, known in found for sid, name in known.items()}
    shards = [shard for shard, (one, _) in enumerate(found) for _ in one.records]
    if args.json:
        out = _json(merged, names)
        for shown, shard in zip(out["records"], shards, strict=True):
            shown["shard"] = shard
        print(json.dumps(out, sort_keys=True))
    else:
        print(describe(merged, shards, names))
    return 0


def source_names(client: FTClient) -> dict[int, str]:
    """The names of the sources the server knows (`ft.sourceName`, a receiver's
    `--source`), by source id; unnamed sources are left out."""
    return {
        int(sid): str(spec["name"])
        for sid, spec in client.status().sources.items()
        if spec.get("name") is not None
    }


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "inspect", help="find one record: where it is, its attempts, causes, size and key"
    )
    parser.add_argument(
        "--server",
        required=True,
        help="HOST:PORT of the FT-layer server; HOST:PORT,... for the shards of a cluster",
    )
    parser.add_argument("--token-file", default=None, help="file holding the auth token")
    parser.add_argument("--tls-ca", default=None, help="TLS, trusting this CA file")
    parser.add_argument(
        "--root", default=None, help="its root: 0x hex, decimal, or Spark's signed ft_root"
    )
    parser.add_argument(
        "--topic", default=None, help="its Kafka topic (with --partition, --offset)"
    )
    parser.add_argument("--partition", type=int, default=None, help="its Kafka partition")
    parser.add_argument("--offset", type=int, default=None, help="its Kafka offset")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")


def parse_root(text: str) -> int:
    """A root as the logs (0x...), a user (decimal) or Spark's ft_root column (a signed
    int64) write it; ConfigError otherwise."""
    try:
        value = int(text, 0)
    except ValueError:
        raise ConfigError(f"--root takes 0x hex or a decimal integer, got {text!r}") from None
    if _I64_MIN <= value < 0:
        value += 1 << 64  # ft_root holds the u64's bits as a signed int64
    if not 0 <= value <= _U64_MAX:
        raise ConfigError(f"a root is a 64-bit integer, got {text!r}")
    return value


def query_of(args: argparse.Namespace) -> RecordQuery:
    coordinates = (args.topic, args.partition, args.offset)
    if args.root is not None and any(c is not None for c in coordinates):
        raise ConfigError("give --root, or --topic, --partition and --offset: not both")
    if args.root is not None:
        return RecordQuery(root=parse_root(args.root))
    if any(c is None for c in coordinates):
        raise ConfigError("give --root, or all of --topic, --partition and --offset")
    try:
        return RecordQuery(topic=args.topic, partition=args.partition, offset=args.offset)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def run_on(args: argparse.Namespace, client: FTClient) -> int:
    """`ftlayer inspect` on a connected client: a readable report, or one JSON object
    last (with the record's key decoded where its payload is an ftkafka one)."""
    found = client.inspect(query_of(args))
    names = source_names(client)
    if args.json:
        print(json.dumps(_json(found, names), sort_keys=True))
    else:
        print(describe(found, names=names))
    return 0


def _json(found: Inspection, names: dict[int, str]) -> dict[str, Any]:
    out = found.to_json()
    out["verdict"] = found.verdict
    for shown, record in zip(out["records"], found.records, strict=True):
        shown["source"] = names.get(record.source_id)
        shown["ingested"] = _ingested(record, names)
        shown.update(_key_of(record))
        shown.update(_value_of(record))
    return out


def _ingested(record: InspectedRecord, names: dict[int, str]) -> bool:
    """Whether a receiver stored the record (a source that cannot replay): its topic is
    then the upstream's name and its offset the record's identity there."""
    name = names.get(record.source_id)
    return name is not None and ingest_source_id(name) == record.source_id


def _text(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "0x" + data.hex()


def _value_of(record: InspectedRecord) -> dict[str, Any]:
    """The value from an ftkafka payload (utf-8 text, else hex; its first
    _VALUE_CHARS characters) and value_bytes; {} when the reply holds only the
    payload's start or the payload is not one (`_key_of` says why)."""
    from ftlayer.errors import SourceError
    from ftlayer.payloads import decode_payloads

    if not record.payload_bytes or len(record.payload) < record.payload_bytes:
        return {}
    try:
        _, values, _, _ = decode_payloads([record.payload])
    except SourceError:
        return {}
    value = values[0].as_py()
    if value is None:
        return {"value": None, "value_bytes": None}
    return {"value": _text(value)[:_VALUE_CHARS], "value_bytes": len(value)}


def _key_of(record: InspectedRecord) -> dict[str, Any]:
    """The Kafka key and timestamp from an ftkafka payload: key (utf-8 text, else
    hex), key_bytes, timestamp_ms; {"key_error": why} for a payload that is not one."""
    from ftlayer.errors import SourceError
    from ftlayer.payloads import decode_key

    if not record.payload_bytes:  # an ftkafka payload is never empty: by reference
        return {"key_error": "its bytes are in Kafka (stored by reference, not copied in)"}
    try:
        key, timestamp_ms = decode_key(record.payload)
    except SourceError as exc:
        return {"key_error": str(exc)}
    if key is None:
        return {"key": None, "key_bytes": None, "timestamp_ms": timestamp_ms}
    text = _text(key)
    return {"key": text, "key_bytes": len(key), "timestamp_ms": timestamp_ms}


def _when(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return dt.datetime.fromtimestamp(seconds, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


_STATE_TEXT: Final = {
    RecordState.PENDING: "pending: its tree is in flight",
    RecordState.QUEUED: "queued for replay",
    RecordState.WAITING: "waiting for its backoff before it is replayed",
    RecordState.DEAD_LETTER: "dead-lettered: its retries are spent",
}


def describe(
    found: Inspection, shards: list[int] | None = None, names: dict[int, str] | None = None
) -> str:
    """The readable report of `ftlayer inspect` (`shards`: the shard of each record,
    with several; `names`: the sources' names by id)."""
    asked = found.query.describe()
    if not found.records:
        if found.retired:
            return (
                f"{asked}: failed recently; its record goes on under a new root "
                "(inspect it by its topic, partition and offset)"
            )
        return (
            f"{asked}: unknown or completed (the FT layer holds no such record: its tree "
            "completed, or it never reached this FT layer)"
        )
    lines = [f"{asked}: {len(found.records)} records found"] if len(found.records) > 1 else []
    for i, record in enumerate(found.records):
        lines += _describe_record(record, None if shards is None else shards[i], names or {})
    return "\n".join(lines)


def _describe_record(
    record: InspectedRecord, shard: int | None, names: dict[int, str]
) -> list[str]:
    key = _key_of(record)
    value = _value_of(record)
    if not record.payload_bytes:
        key_text = str(key["key_error"])
    elif "key_error" in key:
        key_text = f"key not readable ({key['key_error']})"
    elif key["key"] is None:
        key_text = "no key"
    else:
        key_text = f"key {key['key']!r} ({key['key_bytes']} bytes)"
    if "value" in value:
        shown = "no value" if value["value"] is None else f"value {value['value']!r}"
        key_text += f", {shown}" + (f" ({value['value_bytes']} bytes)" if value["value"] else "")
    name = names.get(record.source_id)
    where = (
        f"record {record.offset} of upstream {record.topic}"  # a receiver stored it
        if _ingested(record, names)
        else f"record {record.topic}-{record.partition} offset {record.offset}"
    )
    lines = [
        f"{where} (source "
        + (str(record.source_id) if name is None else f"{name} (id {record.source_id})")
        + ", "
        + ("" if shard is None else f"shard {shard}, ")
        + f"seq {record.seq}): {_STATE_TEXT[record.state]}",
        f"  root {record.root:#x}" if record.root else "  no root (a dead letter's tree is over)",
        f"  payload {record.payload_bytes:,} bytes, {key_text}",
    ]
    if record.state is RecordState.QUEUED:
        parts = ", ".join(str(p) for p in record.replay_partitions)
        since = record.queued_since  # None: queued as it was stored (a receiver's record)
        lines.append(
            f"  replay seq {record.replay_seq} for partition(s) {parts}"
            + ("" if since is None else f", queued since {_when(since)}")
        )
    if record.state is RecordState.WAITING:
        lines.append(f"  replayed after {_when(record.due)}")
    if record.barrier_hold:
        lines.append("  held at its batch's barrier: completes when that batch is done")
    history = record.history
    if history is None:
        lines.append("  never failed")
        return lines
    attempts = history["attempts"]
    lines.append(
        f"  {attempts} failed attempt{'' if attempts == 1 else 's'}, "
        f"first {_when(history['first_failed'])}, "
        f"last {_when(history['last_failed'])}"
        + (f", dead since {_when(history['dead_at'])}" if history.get("dead_at") else "")
        + (f", requeued {history['requeued']} times" if history.get("requeued") else "")
    )
    for n, cause in enumerate(history["causes"], start=1):
        if n == 5 and history.get("omitted"):
            lines.append(f"    ... {history['omitted']} failures not kept ...")
        text = cause["kind"] + (" (final)" if cause.get("final") else "")
        text += " (final if repeated)" if cause.get("final_if_repeated") else ""
        if cause["step"]:
            text += f" in {cause['step']}"
        if cause["error"]:
            text += f": {cause['error']}"
        lines.append(f"    {_when(cause['at'])}  {text}")
    return lines
