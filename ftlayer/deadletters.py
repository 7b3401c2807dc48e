"""`ftlayer dead-letters list | show | requeue | purge`: the dead letters a server keeps.

A dead letter is a record whose retries are spent (ftlayer.core.retries). Without a
dead-letter topic it stays in the FT layer's store until purged; with one, until the
source's driver delivered it there. The commands work on the ones in the store, or,
with `--topic T --bootstrap B`, on those in the dead-letter topic T:

    ftlayer dead-letters list    --server HOST:PORT [--topic T --bootstrap B] [filters]
                                 [--limit N] [--json]
    ftlayer dead-letters show    SEQ --server HOST:PORT [--topic T --bootstrap B] [--json]
    ftlayer dead-letters requeue --server HOST:PORT [--topic T --bootstrap B] [filters]
                                 [--json]
    ftlayer dead-letters purge   --server HOST:PORT [filters] [--json]

A dead letter in the store is named by its storage seq; one in a topic by its place
there, `PARTITION:OFFSET`. `show` previews the record's Kafka key and value (text
clipped to 60 characters, else the first bytes in hex, marked so). Requeuing from a
topic stores the records in the FT layer again, with their history read from their
`ftlayer-dlq-*` headers, and replays them (the topic keeps its copies: narrow the
filters, e.g. `--since`, so a second requeue does not take them again). A topic's
records leave it by its retention: `purge` works on the store only.

Filters: --source ID or NAME (the name it registered with: `ft.sourceName`, a
receiver's `--source`), --partition P, --cause explicit|error|sink|timeout (the kind of
the last failure), --since T, --until T (dead-lettered at or after, before; epoch
seconds or ISO 8601), --seq S (repeatable). `requeue` replays the matching records
now with a fresh retry budget (after a fix is deployed); a requeued record that fails
again comes back with its whole history. `purge` deletes them for good.

With the shards of a cluster (`--server A,B,...`, in shard order; `run_sharded`) each
shard keeps the dead letters of its own partitions, and numbers them by its own
storage seqs: a dead letter in the store is `SHARD/SEQ` (`1/42`). `list`, `requeue` and
`purge` go to every shard (with `--seq`, to the shards named), `show` to the one named;
dead letters requeued from a topic are stored again on the shard of their partition.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, Final, TypeVar

from ftlayer.causes import FailKind
from ftlayer.client import FTClient
from ftlayer.errors import ConfigError, StateConflict
from ftlayer.records import RecordBatch
from ftlayer.wire import DeadLetterList

__all__ = ["add_parser", "preview", "read_topic", "run", "run_sharded"]

T = TypeVar("T")
OnShard = Callable[[int, Callable[[FTClient], T]], T]
"""`on(shard, call)`: `call` on a client of that shard."""

_PREVIEW_CHARS: Final = 60
_TOPIC_TIMEOUT_S: Final = 60.0


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
            action.add_argument("seq", help="the dead letter's seq, or PARTITION:OFFSET in a topic")
        action.add_argument("--server", required=True, help="HOST:PORT of the FT-layer server")
        action.add_argument("--token-file", default=None, help="file holding the auth token")
        action.add_argument("--tls-ca", default=None, help="TLS, trusting this CA file")
        if name != "purge":
            action.add_argument("--topic", default=None, help="read this dead-letter topic")
            action.add_argument("--bootstrap", default=None, help="with --topic: its brokers")
        if name != "show":
            action.add_argument(
                "--source", default=None, help="a source: its id, or its name (status shows both)"
            )
            action.add_argument("--partition", type=int, default=None, help="a Kafka partition")
            action.add_argument(
                "--cause", default=None, help="explicit, error, sink or timeout (last failure)"
            )
            action.add_argument("--since", default=None, help="dead-lettered at or after")
            action.add_argument("--until", default=None, help="dead-lettered before")
            action.add_argument(
                "--seq", action="append", default=None, help="a seq (PARTITION:OFFSET in a topic)"
            )
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


def _store_seq(text: str) -> int:
    try:
        seq = int(text)
    except ValueError:
        raise ConfigError(f"a dead letter in the store has an integer seq, got {text!r}") from None
    if seq < 0:
        raise ConfigError(f"a seq is not negative, got {text!r}")
    return seq


def _where(args: argparse.Namespace) -> dict[str, Any]:
    if args.dead_letters == "show":
        return {"seqs": [_store_seq(args.seq)]}
    where: dict[str, Any] = {}
    if args.source is not None:
        where["source_id"] = _source_id(args.source, getattr(args, "source_names", {}))
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
        where["seqs"] = sorted({_store_seq(seq) for seq in args.seq})
    return where


def _source_id(text: str, names: Mapping[int, str]) -> int:
    """--source: a source id, or the name a source registered with."""
    if text.isdigit():
        return int(text)
    ids = [sid for sid, name in names.items() if name == text]
    if len(ids) != 1:
        known = ", ".join(sorted(set(names.values()))) or "none"
        raise ConfigError(
            f"--source {text!r} is not a source id, nor the name of one source the FT layer "
            f"knows (named sources: {known})"
        )
    return ids[0]


def _with_names(args: argparse.Namespace, client: FTClient) -> argparse.Namespace:
    """`args` with `source_names`: the names of the sources `client`'s server knows."""
    names = {
        int(sid): str(spec["name"])
        for sid, spec in client.status().sources.items()
        if spec.get("name") is not None
    }
    return argparse.Namespace(**{**vars(args), "source_names": names})


def _describe(
    letter: dict[str, Any], records: RecordBatch, i: int, names: Mapping[int, str]
) -> dict[str, Any]:
    causes = letter["causes"]
    last = causes[-1] if causes else None
    return {
        "seq": letter["seq"],
        "source_id": letter["source_id"],
        "source": names.get(letter["source_id"]),
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
    args = _with_names(args, client)
    if getattr(args, "topic", None) is not None or getattr(args, "bootstrap", None) is not None:
        return _run_on_topic(args, client)
    if action in ("requeue", "purge"):
        count = client.dead_letter_op(action, _where(args))
        key = "requeued" if action == "requeue" else "purged"
        print(json.dumps({key: count}) if args.json else f"{_dead_letters(count)} {key}")
        return 0
    limit = getattr(args, "limit", None)
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be at least 1, got {limit}")
    listed = client.dead_letters(_where(args), limit)
    letters = [
        _describe(x, listed.records, i, args.source_names) for i, x in enumerate(listed.letters)
    ]
    if action == "show":
        if not letters:
            raise ConfigError(f"no dead letter has seq {args.seq}")
        if args.json:
            print(json.dumps(letters[0], sort_keys=True))
        else:
            print(_show(letters[0], _payload_previews(listed.records.payloads[0])))
        return 0
    if args.json:
        print(json.dumps({"letters": letters, "more": listed.more}, sort_keys=True))
    else:
        _print_list(letters, listed.more)
    return 0


# ---- the shards of a cluster -------------------------------------------------------------------


def run_sharded(args: argparse.Namespace, count: int, on: OnShard[Any]) -> int:
    """The command over the `count` shards of a cluster (module docstring); `on(shard,
    call)` runs `call` on a client of that shard."""
    action = args.dead_letters
    args = on(0, partial(_with_names, args))  # every shard knows every source
    if getattr(args, "topic", None) is not None or getattr(args, "bootstrap", None) is not None:
        if action != "requeue":  # the topic's letters: no shard is asked
            return int(on(0, lambda client: _run_on_topic(args, client)))
        chosen = _chosen_from_topic(args)
        by_shard = _by_shard(chosen, count)
        total = sum(
            on(shard, partial(_restore, chosen=mine, shard=shard, shards=count))
            for shard, mine in sorted(by_shard.items())
        )
        print(json.dumps({"requeued": total}) if args.json else f"{_dead_letters(total)} requeued")
        return 0
    if action == "show":
        shard, seq = _shard_seq(args.seq, count)
        one = argparse.Namespace(**{**vars(args), "seq": str(seq)})
        return int(on(shard, lambda client: run(one, client)))
    seqs: dict[int, list[str]] = {}
    for text in args.seq or ():
        shard, seq = _shard_seq(text, count)
        seqs.setdefault(shard, []).append(str(seq))
    shards = sorted(seqs) if args.seq else list(range(count))
    wheres = {s: _where(argparse.Namespace(**{**vars(args), "seq": seqs.get(s)})) for s in shards}
    if action in ("requeue", "purge"):
        done = sum(on(s, partial(_op, action, wheres[s])) for s in shards)
        key = "requeued" if action == "requeue" else "purged"
        print(json.dumps({key: done}) if args.json else f"{_dead_letters(done)} {key}")
        return 0
    limit = getattr(args, "limit", None)
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be at least 1, got {limit}")
    letters: list[dict[str, Any]] = []
    more = False
    for s in shards:
        listed = on(s, partial(_listed, wheres[s], limit))
        more |= listed.more
        for i, letter in enumerate(listed.letters):
            shown = _describe(letter, listed.records, i, args.source_names)
            letters.append({**shown, "seq": f"{s}/{shown['seq']}", "shard": s})
    if limit is not None and len(letters) > limit:
        letters, more = letters[:limit], True
    if args.json:
        print(json.dumps({"letters": letters, "more": more}, sort_keys=True))
    else:
        _print_list(letters, more)
    return 0


def _op(action: str, where: dict[str, Any], client: FTClient) -> int:
    return client.dead_letter_op(action, where)


def _listed(where: dict[str, Any], limit: int | None, client: FTClient) -> DeadLetterList:
    return client.dead_letters(where, limit)


def _shard_seq(text: str, count: int) -> tuple[int, int]:
    """SHARD/SEQ: a dead letter in the store of a shard of a cluster of `count`."""
    shard, slash, seq = text.partition("/")
    if not slash:
        raise ConfigError(
            f"with several shards a dead letter in the store is SHARD/SEQ, as `list` shows "
            f"it, got {text!r}"
        )
    if not shard.isdigit() or int(shard) >= count:
        raise ConfigError(f"{text!r} names shard {shard!r}, not one of the {count} shards")
    return int(shard), _store_seq(seq)


def _by_shard(
    chosen: list[tuple[dict[str, Any], Any]], count: int
) -> dict[int, list[tuple[dict[str, Any], Any]]]:
    """Letters read from a topic, by the shard of their source's partition."""
    from ftlayer.shards import partition_shard

    by_shard: dict[int, list[tuple[dict[str, Any], Any]]] = {}
    for letter, record in chosen:
        shard = int(partition_shard(letter["source_id"], letter["partition"], count))
        by_shard.setdefault(shard, []).append((letter, record))
    return by_shard


# ---- dead letters in a topic ---------------------------------------------------------------


def _run_on_topic(args: argparse.Namespace, client: FTClient) -> int:
    if args.topic is None or args.bootstrap is None:
        raise ConfigError("--topic and --bootstrap go together (the dead-letter topic's brokers)")
    found = read_topic(args.bootstrap, args.topic, _TOPIC_TIMEOUT_S)
    letters = [x for x in map(_from_topic, found) if x is not None]
    if args.dead_letters == "show":
        chosen = [x for x in letters if x[0]["seq"] == _topic_seq(args.seq)]
        if not chosen:
            raise ConfigError(f"no dead letter at {args.seq} in topic {args.topic!r}")
        letter, record = chosen[0]
        if args.json:
            print(json.dumps(letter, sort_keys=True))
        else:
            print(_show(letter, _previews(record.key, record.value)))
        return 0
    chosen = _chosen_from_topic(args, letters)
    if args.dead_letters == "requeue":
        count = _restore(client, chosen)
        print(json.dumps({"requeued": count}) if args.json else f"{_dead_letters(count)} requeued")
        return 0
    limit = getattr(args, "limit", None)
    shown_letters = [x[0] for x in (chosen if limit is None else chosen[:limit])]
    more = limit is not None and len(chosen) > limit
    if args.json:
        print(json.dumps({"letters": shown_letters, "more": more}, sort_keys=True))
    else:
        _print_list(shown_letters, more)
    return 0


def _chosen_from_topic(
    args: argparse.Namespace, letters: list[tuple[dict[str, Any], Any]] | None = None
) -> list[tuple[dict[str, Any], Any]]:
    """The topic's letters (read now if not given) that the filters take."""
    if args.topic is None or args.bootstrap is None:
        raise ConfigError("--topic and --bootstrap go together (the dead-letter topic's brokers)")
    if letters is None:
        found = read_topic(args.bootstrap, args.topic, _TOPIC_TIMEOUT_S)
        letters = [x for x in map(_from_topic, found) if x is not None]
    where = _where(argparse.Namespace(**{**vars(args), "seq": None}))
    seqs = None if not args.seq else {_topic_seq(seq) for seq in args.seq}
    return [x for x in letters if _matches(x[0], where, seqs)]


def read_topic(bootstrap: str, topic: str, timeout_s: float) -> list[Any]:
    """Every record of `topic` (kafka-python ConsumerRecords), ordered by partition and
    offset, up to each partition's end when the read began (the high watermark of its
    first fetch: records produced meanwhile are left out). Assign and seek, no consumer
    group; ConfigError naming the topic if it is unknown or not read within
    `timeout_s`."""
    from kafka import KafkaConsumer, TopicPartition
    from kafka.errors import KafkaError

    deadline = time.monotonic() + timeout_s
    what = f"the dead-letter topic {topic!r} at {bootstrap}"
    try:
        consumer = KafkaConsumer(
            bootstrap_servers=bootstrap,
            client_id="ftlayer-dead-letters",
            group_id=None,
            enable_auto_commit=False,
            fetch_max_wait_ms=20,
        )
    except KafkaError as exc:
        raise ConfigError(f"cannot read {what}: {exc!r}") from None
    try:
        while not (partitions := consumer.partitions_for_topic(topic)):
            if time.monotonic() > deadline:
                raise ConfigError(f"cannot read {what}: no such topic")
            time.sleep(0.05)
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends: dict[Any, int] = {}
        records: list[Any] = []
        left = set(tps)
        while left:
            if time.monotonic() > deadline:
                raise ConfigError(f"cannot read {what} within {timeout_s:g} s")
            polled = consumer.poll(timeout_ms=50)
            for tp in left - ends.keys():
                mark = consumer.highwater(tp)
                if mark is not None:
                    ends[tp] = int(mark)
            for tp, batch in polled.items():
                records += [r for r in batch if r.offset < ends[tp]]
            # Offsets may have gaps (transaction markers): compare positions.
            done = {tp for tp in left if tp in ends and consumer.position(tp) >= ends[tp]}
            if done:
                consumer.pause(*done)
                left -= done
    except KafkaError as exc:
        raise ConfigError(f"cannot read {what}: {exc!r}") from None
    finally:
        consumer.close(autocommit=False)
    return sorted(records, key=lambda r: (r.partition, r.offset))


def _topic_seq(text: str) -> str:
    partition, _, offset = text.rpartition(":")
    try:
        return f"{int(partition or 0)}:{int(offset)}"
    except ValueError:
        raise ConfigError(f"a dead letter in a topic is PARTITION:OFFSET, got {text!r}") from None


def _from_topic(record: Any) -> tuple[dict[str, Any], Any] | None:
    """A dead-letter topic's message as `_describe` shows a letter (None: not one)."""
    from ftlayer.integration.source.deadletters import history_of

    history = history_of(record.headers or [])
    if "attempts" not in history:
        return None

    def seconds(name: str) -> float | None:
        text = history.get(name) or ""
        return int(text) / 1000 if text else None

    causes = list(history.get("causes", []))
    letter = {
        "seq": f"{record.partition}:{record.offset}",
        "source_id": int(history["source-id"]),
        "topic": history["topic"],
        "partition": int(history["partition"]),
        "offset": int(history["offset"]),
        "attempts": int(history["attempts"]),
        "first_failed": seconds("first-failed"),
        "last_failed": seconds("last-failed"),
        "dead_at": seconds("dead-at"),
        "requeued": 0,
        "last_cause": causes[-1] if causes else None,
        "causes": causes,
        "causes_omitted": 0,
        "payload_bytes": len(record.value or b""),
    }
    return letter, record


def _matches(letter: dict[str, Any], where: dict[str, Any], seqs: set[str] | None) -> bool:
    last = letter["last_cause"]
    at = letter["dead_at"] or 0.0
    return not (
        (seqs is not None and letter["seq"] not in seqs)
        or ("source_id" in where and letter["source_id"] != where["source_id"])
        or ("partition" in where and letter["partition"] != where["partition"])
        or ("cause" in where and (last is None or last["kind"] != where["cause"]))
        or ("since" in where and at < where["since"])
        or ("until" in where and at >= where["until"])
    )


def _restore(
    client: FTClient, chosen: list[tuple[dict[str, Any], Any]], shard: int = 0, shards: int = 1
) -> int:
    """Send dead letters read from a topic back to the FT layer (shard `shard` of
    `shards`: their partitions' shard), source by source."""
    import numpy as np

    from ftlayer.acking.ids import new_ids
    from ftlayer.integration.source.deadletters import DLQ_HEADER_PREFIX
    from ftlayer.partitioners import kafka_key_hashes
    from ftlayer.payloads import encode_payloads

    sources = client.status().sources
    total = 0
    for source_id in sorted({letter["source_id"] for letter, _ in chosen}):
        spec = sources.get(str(source_id))
        if spec is None:
            raise StateConflict(
                f"source {source_id} is not registered with the FT layer: start its query "
                "once, then requeue its dead letters"
            )
        mine = [(x, r) for x, r in chosen if x["source_id"] == source_id]
        keys = [r.key for _, r in mine]
        if spec["partitioner"] == "spark-hash":
            from ftlayer.integration.source.reader import _spark_key_hashes

            hashes, has_key = _spark_key_hashes(keys)
        else:
            hashes, has_key = kafka_key_hashes(keys)
        headers = [
            [(k, v) for k, v in (r.headers or []) if not k.startswith(DLQ_HEADER_PREFIX)]
            for _, r in mine
        ]
        timestamps = [
            int(dict(r.headers).get(f"{DLQ_HEADER_PREFIX}timestamp", b"0")) for _, r in mine
        ]
        payloads = encode_payloads(
            keys, [r.value for _, r in mine], np.asarray(timestamps, dtype=np.int64), headers
        )
        batch = RecordBatch.build(
            new_ids(len(mine), shard, shards),
            payloads,
            source_ids=source_id,
            key_hashes=hashes,
            has_key=has_key,
            topics=[x["topic"] for x, _ in mine],
            partitions=[x["partition"] for x, _ in mine],
            offsets=[x["offset"] for x, _ in mine],
        )
        history = [_history(x) for x, _ in mine]
        total += client.restore_dead_letters(history, batch)
    return total


def _history(letter: dict[str, Any]) -> dict[str, Any]:
    """A topic letter's history in RetryRecord's JSON form."""
    return {
        "source_id": letter["source_id"],
        "attempts": letter["attempts"],
        "first_failed": letter["first_failed"] or 0.0,
        "last_failed": letter["last_failed"] or 0.0,
        "due": 0.0,
        "causes": letter["causes"],
        "omitted": 0,
        "dead_at": letter["dead_at"],
        "requeued": 0,
        "budget_from": 0,
    }


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


_ESCAPES: Final = str.maketrans({"\t": "\\t", "\n": "\\n", "\r": "\\r"})


def preview(data: bytes | None) -> str:
    """A key or value as `show` prints it: "none"; its text in quotes when it is UTF-8
    without control characters (tabs and line breaks escaped), clipped to
    _PREVIEW_CHARS characters; else its first bytes in hex, marked "hex". The size
    follows whatever is clipped."""
    if data is None:
        return "none"
    try:
        text = data.decode("utf-8").translate(_ESCAPES)
    except UnicodeDecodeError:
        text = None
    size = f" ({len(data):,} bytes)"
    if text is not None and text.isprintable():
        clipped = len(text) > _PREVIEW_CHARS
        return f'"{text[:_PREVIEW_CHARS]}' + ('..."' + size if clipped else '"')
    shown = data[: _PREVIEW_CHARS // 2].hex()
    return f"hex {shown}" + ("..." if len(data) > _PREVIEW_CHARS // 2 else "") + size


def _previews(key: bytes | None, value: bytes | None) -> list[str]:
    return [f"  key:   {preview(key)}", f"  value: {preview(value)}"]


def _payload_previews(payload: bytes) -> list[str]:
    """The lines of `show` that preview a stored payload: its key and value (the
    ftkafka payload codec), or the payload itself when it is not an ftkafka one."""
    from ftlayer.errors import SourceError
    from ftlayer.payloads import decode_payloads

    if not payload:  # an ftkafka payload is never empty: stored by reference
        return ["  its bytes are in Kafka (stored by reference, not copied in)"]
    try:
        keys, values, _, _ = decode_payloads([payload])
    except SourceError:
        return [f"  payload (not an ftkafka record): {preview(payload)}"]
    return _previews(keys[0].as_py(), values[0].as_py())


def _dead_letters(count: int) -> str:
    return f"{count:,} dead letter" + ("" if count == 1 else "s")


def _show(letter: dict[str, Any], previews: list[str]) -> str:
    """`show`'s text: the record, `previews` (its key and value), its history."""
    attempts = letter["attempts"]
    lines = [
        f"dead letter {letter['seq']}: {letter['topic']}-{letter['partition']} "
        f"offset {letter['offset']} (source {letter['source_id']}), "
        f"{letter['payload_bytes']:,} payload bytes",
        *previews,
        f"  {attempts} attempt{'' if attempts == 1 else 's'}, first failed "
        f"{_when(letter['first_failed'])}, last {_when(letter['last_failed'])}, "
        f"dead since {_when(letter['dead_at'])} UTC"
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

    table = Table(title=_dead_letters(len(letters)) + (" (more match)" if more else ""))
    for column in ("seq", "source", "topic-partition@offset", "attempts", "dead since", "cause"):
        table.add_column(column)
    for x in letters:
        table.add_row(
            str(x["seq"]),
            str(x["source_id"]) if x.get("source") is None else f"{x['source']} ({x['source_id']})",
            f"{x['topic']}-{x['partition']}@{x['offset']}",
            str(x["attempts"]),
            _when(x["dead_at"]),
            _cause_text(x["last_cause"]),
        )
    Console(width=200).print(table)
