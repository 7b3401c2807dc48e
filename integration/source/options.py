"""The options of the `ftkafka` source, each declared once.

`OPTIONS` lists every option with its name (as the user writes it; Spark passes names
lower-cased, so lookups ignore case), type, default, minimum and meaning. From that one
table come the parser (`parse_options`, which checks every option and raises
ConfigError naming the option and the value), and the option table of
docs/user-guide.md section 3.1 (`markdown_table`; `make docs` writes it, and a test
fails when the guide and this table differ).

An option renamed keeps its former spelling as an alias (`Option.aliases`): the alias is
accepted and means the same, parsing logs one deprecation warning naming the new
spelling, and giving both spellings is a ConfigError. The table shows the alias in the
option's row.

Names follow Spark's own Kafka source where they overlap (kafka.bootstrap.servers,
subscribe, startingOffsets, maxOffsetsPerTrigger, kafka.*); ftlayer's own options are
under `ft.`. Parsing needs neither Kafka nor the FT layer: what needs the broker (a
topic that does not exist) is checked when the query starts.
"""

from __future__ import annotations

import difflib
import json
import logging
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

from kafka import KafkaConsumer

from ftlayer.client import read_token_file
from ftlayer.errors import ConfigError, PartitioningError
from ftlayer.integration.ftcolumns import FTSettings
from ftlayer.partitioners import PARTITIONER_NAMES, create_partitioner
from ftlayer.policy import RetryPolicy
from ftlayer.position import EARLIEST
from ftlayer.registration import ingest_source_id

__all__ = [
    "DEFAULT_HEARTBEAT_MS",
    "DEFAULT_MAX_PENDING_RECORDS",
    "OPTIONS",
    "Option",
    "SourceOptions",
    "markdown_table",
    "parse_options",
    "source_id",
    "write_markdown_table",
]

log = logging.getLogger("ftlayer.source")

OptionType = Literal["text", "integer", "boolean", "choice", "prefix"]

DEFAULT_HEARTBEAT_MS: Final = 2000
"""ft.heartbeatMs by default: a small request every 2 s per query while a batch runs
(never more often than T/4 decides), and a dead driver's lease lapses within 6 s."""

DEFAULT_IDLE_PROBE_MS: Final = 100
"""idleProbeIntervalMs by default: an idle query looks at Kafka and the FT layer ten
times a second instead of about a hundred (each look: a ListOffsets and a Fetch, the FT
layer's status; about 1.5 ms of the driver's CPU), at the price of up to 0.1 s before
the first batch after an idle spell."""

DEFAULT_MAX_PENDING_RECORDS: Final = 1_000_000
"""ft.maxPendingRecords by default: far above what a healthy query has pending (about
one batch), so it binds only when a sink stalls or a first batch meets a large
backlog, and low enough that the FT layer's memory for a source's pending roots
(`ftlayer bench acker`: bytes per pending root of the FT layer's table) stays in the
tens of megabytes. There is no "unlimited": that is what lets a stalled sink grow the
store without bound (docs/user-guide.md, section 6.7)."""


@dataclass(frozen=True, slots=True)
class Option:
    """One option: how it is written, read and documented."""

    name: str
    """As documented; a name ending in "*" or "<option>" stands for a prefix."""
    type: OptionType
    doc: str
    """Markdown: the meaning, as the user guide's table shows it."""
    default: str | int | bool | None = None
    shown_default: str | None = None
    """The table's default column when it is not `default` itself (e.g. "required")."""
    minimum: int | None = None
    choices: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    """Former spellings, deprecated: accepted with a warning naming `name`."""

    @property
    def key(self) -> str:
        """The lower-cased name (or prefix) Spark passes."""
        return self.prefix.lower() if self.type == "prefix" else self.name.lower()

    @property
    def prefix(self) -> str:
        return self.name.split("*")[0].split("<")[0]

    def default_cell(self) -> str:
        if self.shown_default is not None:
            return self.shown_default
        if self.default is None:
            return "none"
        if isinstance(self.default, bool):
            return f"`{str(self.default).lower()}`"
        return f"`{self.default}`"


def _ms(
    name: str,
    default: int | None,
    minimum: int,
    doc: str,
    shown: str | None = None,
    aliases: tuple[str, ...] = (),
) -> Option:
    return Option(name, "integer", doc, default, shown, minimum, aliases=aliases)


OPTIONS: Final[tuple[Option, ...]] = (
    Option(
        "kafka.bootstrap.servers", "text", "the brokers, `HOST:PORT,...`", shown_default="required"
    ),
    Option("subscribe", "text", "comma-separated topics", shown_default="required"),
    Option(
        "startingOffsets",
        "text",
        "`earliest`, `latest`, or JSON giving every partition of every topic an offset, "
        'e.g. `{"orders":{"0":23,"1":-2}}` (-2 earliest, -1 latest). Only for a new query: '
        "a restarted one goes on from its checkpoint.",
        "earliest",
    ),
    Option(
        "includeHeaders",
        "boolean",
        "`true` adds the `headers` column (array of key/value structs, as in Spark's Kafka "
        "source) and keeps each record's headers with its payload in the FT layer, so a "
        "replay carries them too (`ftlayer-anchor`, the loop header, is not shown)",
        False,
    ),
    Option(
        "ft.replayColumn",
        "boolean",
        "`true` adds the FT column `ft_replay` (boolean): true on a row that is a replayed "
        "record (it failed, or a restart recovered it), false on one read from Kafka in this "
        "batch; for `ft_observe` (section 6.10). Tasks do not hand it to user code, sinks "
        "do not write it. No effect with FT off",
        False,
    ),
    Option(
        "maxOffsetsPerTrigger",
        "integer",
        "at most this many Kafka records per batch, split over partitions in proportion to "
        "their backlog (exactly this many when more wait; a partition with a backlog gets "
        "at least one), and at most this many replay seqs",
        minimum=1,
    ),
    Option(
        "ft.maxPendingRecords",
        "integer",
        "flow control, per source (each subscribed topic), as Storm's max.spout.pending: a "
        "batch takes in new Kafka records only while the source's pending trees (in flight, "
        "or replays waiting to be read) plus those records stay within this; replays are "
        "always taken in (section 6.7). With several FT-layer shards it holds on each "
        "shard, for the partitions that shard owns. No effect with FT off",
        DEFAULT_MAX_PENDING_RECORDS,
        minimum=1,
    ),
    _ms(
        "idleProbeIntervalMs",
        DEFAULT_IDLE_PROBE_MS,
        0,
        "while the query is idle (its last look at Kafka and the FT layer found nothing new), "
        "it looks again at most this often: Spark asks every "
        "`spark.sql.streaming.pollingDelay` (10 ms), and each look costs the driver a few "
        "ms of CPU. Records or replays that come in an idle spell start their batch up to "
        "this much later. `0`: look at every trigger",
    ),
    _ms(
        "kafkaConsumer.pollTimeoutMs",
        120_000,
        1,
        "an executor fails its task with `SourceError` if no record of its range arrives for "
        "this long",
    ),
    Option(
        "fetchOffset.numRetries",
        "integer",
        "retries of a failed driver call to Kafka",
        3,
        minimum=0,
    ),
    _ms(
        "fetchOffset.retryIntervalMs",
        100,
        0,
        "the first wait between those retries; it doubles",
    ),
    Option(
        "kafka.group.id",
        "text",
        "a consumer group whose committed offsets the source moves when Spark reports a batch "
        "done (section 6.4). Reading never uses the group.",
    ),
    Option(
        "kafka.*",
        "prefix",
        "passed to kafka-python's consumer with dots turned into underscores "
        "(`kafka.security.protocol`, `kafka.sasl.mechanism`, `kafka.request.timeout.ms`, ...). "
        "A name kafka-python does not know, or one the source sets itself (deserializers, "
        "auto commit, `api_version`, ...), is refused.",
        shown_default="",
    ),
    Option(
        "ft.address",
        "text",
        "`HOST:PORT` of the FT-layer server; setting it turns FT on. "
        "`HOST:PORT,HOST:PORT,...`: the shards of an FT layer of several, in shard order "
        "(section 6.12)",
    ),
    Option(
        "ft.enabled",
        "boolean",
        "`false` turns FT off: no FT columns, no connection, no FT cost",
        shown_default="true when `ft.address` is set",
    ),
    Option("ft.token", "text", "the server's token, as text"),
    Option(
        "ft.tokenFile",
        "text",
        "a file holding the token, read on the driver only (the token travels to executors "
        "inside the tasks); give this or `ft.token`, not both",
    ),
    Option(
        "ft.loopKey",
        "text",
        "the key this pipeline's loop headers are signed with (section 3.4); by default one "
        "derived from the token. A record whose `ftlayer-anchor` header is not signed with "
        "it starts a tree of its own",
        shown_default="derived from the token",
    ),
    Option(
        "ft.loopKeyFile",
        "text",
        "a file holding that key, read on the driver; give this or `ft.loopKey`, not both",
    ),
    Option(
        "ft.tlsCa",
        "text",
        "connect with TLS, trusting the CA certificates in this PEM file; the driver and every "
        "executor open it, so the path must exist on all of them",
    ),
    Option(
        "ft.partitioner",
        "choice",
        "the replay partitioner of every subscribed topic: "
        + ", ".join(f"`{p}`" for p in PARTITIONER_NAMES[:-1])
        + f" or `{PARTITIONER_NAMES[-1]}` (section 4.7)",
        "forward",
        choices=PARTITIONER_NAMES,
    ),
    Option(
        "ft.partitioner.<option>",
        "prefix",
        "an integer option of the partitioner: `ft.partitioner.max_parallelism` for "
        "`key-group` (default 128), `ft.partitioner.start` for `rebalance` (default 0)",
        shown_default="",
    ),
    Option(
        "ft.sourceName",
        "text",
        "names the FT-layer sources of this query; one source per topic, with id "
        "crc32(name, topic) (section 4.6)",
        shown_default="the subscribed topics joined by `,` (no spaces, no repeats)",
    ),
    _ms("ft.connectTimeoutMs", 2000, 1, "the driver's TCP connect timeout to the FT layer"),
    _ms(
        "ft.reconnectTimeoutMs",
        60_000,
        0,
        "how long the driver and the source's tasks retry a refused or broken connection "
        "to the FT layer, with backoff, before the query (or the task) fails with "
        "`SourceError`: a restart of the FT layer within it costs the query nothing",
    ),
    _ms(
        "ft.treeTimeoutMs",
        None,
        1,
        "this query's own tree timeout: a tree not complete between T and "
        "T·(1+1/(n\N{MINUS SIGN}1)) after its persist (a replay: after a batch read it) "
        "fails and is replayed, unless its batch is still running (`ft.heartbeatMs`; "
        "section 4.5)",
        shown="the server's `--tree-timeout-s`",
        aliases=("ft.timeoutMs",),
    ),
    _ms(
        "ft.heartbeatMs",
        DEFAULT_HEARTBEAT_MS,
        0,
        "while a batch runs, the driver tells the FT layer so this often (at least four "
        "times per tree timeout T), and the batch's trees do not time out: a batch slower "
        "than T is not replayed. If the driver dies or the query stops mid-batch, they time "
        "out within T·(1+1/(n\N{MINUS SIGN}1)) after three missed heartbeats "
        "(section 4.5). `0`: no heartbeats, a tree slower than T is replayed",
    ),
    Option(
        "ft.maxRetries",
        "integer",
        "replays of a failed record (an explicit fail, an error under `fail-record`, a "
        "refused write, a timeout) before it is dead-lettered; `-1` replays for ever "
        "(section 4.8)",
        10,
        minimum=-1,
    ),
    _ms(
        "ft.retryBackoffMs",
        500,
        0,
        "how long a failed record waits before its first replay; each further replay waits "
        "twice as long as the one before, up to `ft.retryBackoffMaxMs`, less up to 20% "
        "jitter (`0`: at once)",
    ),
    _ms("ft.retryBackoffMaxMs", 30_000, 0, "the longest wait before a replay"),
    Option(
        "ft.deadLetterTopic",
        "text",
        "the Kafka topic (on the same brokers) that dead letters are written to, key, value "
        "and headers as read plus `ftlayer-dlq-*` headers with their history; it must "
        "exist when the query starts. None: dead letters stay in the FT layer's store "
        "(`ftlayer dead-letters`)",
    ),
    Option(
        "ft.completion",
        "choice",
        "how this query's trees complete (section 4.9): `barrier` at the end of the "
        "micro-batch that carried them (every Spark operator may be used; failures and "
        "records held past the batch stay per record); `tree` by the XOR events of every "
        "wrapped step and sink (rows dropped by plain Spark operators time out and are "
        "replayed)",
        "barrier",
        choices=("tree", "barrier"),
    ),
    Option(
        "ft.persist",
        "choice",
        "what the FT layer stores of each record before Spark sees it (section 4.10): "
        "`reference` where the record is in Kafka (topic, partition, offset, key hash), "
        "its bytes copied into the FT layer only once it fails; `payload` its bytes too "
        "(for a topic whose retention may be shorter than a failure can last)",
        "reference",
        choices=("reference", "payload"),
    ),
    Option(
        "ft.treeRanges",
        "boolean",
        "tree mode with `ft.persist=reference`: the FT layer learns each batch as one "
        "offset range per partition and keeps each record's ack value in an array of its "
        "range, instead of a stored reference, an acker entry and a delete per record; "
        "false: stored references (section 4.10)",
        shown_default="true",
    ),
    Option(
        "ft.checkpointMode",
        "choice",
        "how the FT layer's checkpoint of each batch boundary completes (section 6.6): "
        "`unaligned` at once when Spark reports the batch done, group offsets at the lowest "
        "pending offset; `aligned` once no record from before the boundary is pending, group "
        "offsets then at the boundary",
        "unaligned",
        choices=("aligned", "unaligned"),
    ),
)

_BY_KEY: Final = {option.key: option for option in OPTIONS if option.type != "prefix"}
_PREFIXES: Final = tuple(option for option in OPTIONS if option.type == "prefix")
_ALIASES: Final = {a.lower(): (a, option) for option in OPTIONS for a in option.aliases}
"""{lower-cased deprecated spelling: (the spelling, its option)}."""
_UNSUPPORTED: Final = {
    "subscribepattern": "subscribe with a comma-separated list of topics",
    "assign": "subscribe with a comma-separated list of topics",
    "endingoffsets": "a streaming query (ftkafka has no batch reads)",
}


@dataclass(frozen=True, slots=True)
class SourceOptions:
    """The parsed options of one ftkafka source (see `OPTIONS`)."""

    bootstrap: str
    topics: tuple[str, ...]
    starting: str | dict[str, dict[int, int]]
    """'earliest', 'latest', or per topic and partition an offset, -2 or -1."""
    max_offsets_per_trigger: int | None
    ft: FTSettings
    partitioner: str
    """ft.partitioner; of ftingest without the option, "": its receivers' choice."""
    partitioner_options: dict[str, int]
    source_name: str
    kafka_config: dict[str, Any] = field(default_factory=dict)
    poll_timeout_s: float = 120.0
    kafka_retries: int = 3
    kafka_retry_interval_s: float = 0.1
    ft_connect_timeout_s: float = 2.0
    ft_reconnect_timeout_s: float = 60.0
    group_id: str | None = None
    """The consumer group whose committed offsets commit() moves (kafka.group.id)."""
    timeout_s: float | None = None
    """The tree timeout of this source's records (ft.treeTimeoutMs); None: the server's."""
    checkpoint_mode: str = "unaligned"
    """ft.checkpointMode: "aligned" or "unaligned" (ftlayer.checkpoint)."""
    include_headers: bool = False
    """includeHeaders: a `headers` column, and headers kept with the payloads."""
    max_pending_records: int = DEFAULT_MAX_PENDING_RECORDS
    """ft.maxPendingRecords: per source, pending trees plus new records admitted."""
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    """ft.maxRetries, ft.retryBackoffMs, ft.retryBackoffMaxMs."""
    dead_letter_topic: str | None = None
    """ft.deadLetterTopic; None: dead letters stay in the FT layer's store."""
    completion: str = "barrier"
    """ft.completion: "barrier" (the default) or "tree" (ftlayer.core.barrier)."""
    persist: str = "reference"
    """ft.persist: "reference" (the default: where each record is in Kafka) or "payload"
    (its bytes too)."""
    tree_ranges: bool = True
    """ft.treeRanges: tree mode by reference reads each batch as ranges
    (ftlayer.core.rangeacks); false: it stores a reference per record."""
    heartbeat_ms: int = DEFAULT_HEARTBEAT_MS
    """ft.heartbeatMs: how often the driver heartbeats a running batch; 0: never."""
    replay_column: bool = False
    """ft.replayColumn (FT on only): the `ft_replay` column, true on replayed rows."""
    idle_probe_s: float = DEFAULT_IDLE_PROBE_MS / 1000
    """idleProbeIntervalMs: an idle query looks for new records at most this often."""
    ingest: bool = False
    """An ftingest source (integration.source.ingest): `topics` name sources that
    receivers fill, read from the FT layer's queue only."""

    @property
    def checkpoint_query(self) -> str:
        """The query name the FT layer files this source's checkpoints under."""
        name = "".join(c if c.isprintable() and c != "/" else "_" for c in self.source_name)
        return name[:200] or "_"

    @property
    def ft_on(self) -> bool:
        return self.ft.enabled

    @property
    def by_range(self) -> bool:
        """FT on and ft.persist=reference, in barrier mode or with ft.treeRanges: a
        batch's records are one offset range per partition in the FT layer
        (ftlayer.core.ranges), nothing is persisted per record, and rows carry range
        roots (ftlayer.rangeroots); in tree mode each record completes with its tree
        (ftlayer.core.rangeacks)."""
        return (
            self.ft_on
            and self.persist == "reference"
            and (self.completion == "barrier" or self.tree_ranges)
        )

    @property
    def keeps_headers(self) -> bool:
        """Whether the FT layer keeps each record's Kafka headers with its payload: for
        the `headers` column, and for the dead-letter topic (which writes them back)."""
        return self.include_headers or (self.ft_on and self.dead_letter_topic is not None)

    def source_ids(self) -> dict[str, int]:
        if self.ingest:
            return {name: ingest_source_id(name) for name in self.topics}
        return {topic: source_id(self.source_name, topic) for topic in self.topics}


def source_id(source_name: str, topic: str) -> int:
    """The u32 source id of `topic` read under `source_name`: stable across runs and
    processes (crc32, not hash(), which is seeded per process)."""
    return zlib.crc32(f"{source_name}\x00{topic}".encode())


class _Given:
    """The user's options, looked up case-insensitively through their declarations."""

    def __init__(self, options: Mapping[str, str]) -> None:
        self.raw = {str(k).lower(): str(v) for k, v in options.items()}
        for alias, (spelled, option) in _ALIASES.items():
            if alias not in self.raw:
                continue
            if option.key in self.raw:
                raise ConfigError(
                    f"give option {option.name} or its deprecated spelling {spelled}, not both"
                )
            log.warning("option %s is deprecated: use %s (same meaning)", spelled, option.name)
            self.raw[option.key] = self.raw.pop(alias)

    def text(self, name: str) -> str | None:
        option = _BY_KEY[name.lower()]
        raw = self.raw.get(option.key)
        return option.default if raw is None else raw  # type: ignore[return-value]

    def integer(self, name: str) -> int | None:
        option = _BY_KEY[name.lower()]
        return _integer(option.name, self.raw.get(option.key), option.default, option.minimum)

    def boolean(self, name: str, default: bool) -> bool:
        option = _BY_KEY[name.lower()]
        return _boolean(option.name, self.raw.get(option.key), default)

    def choice(self, name: str) -> str:
        option = _BY_KEY[name.lower()]
        raw = self.raw.get(option.key)
        value = str(option.default) if raw is None else raw.strip()
        for choice in option.choices:
            if value.lower() == choice:
                return choice
        *others, last = option.choices
        raise ConfigError(f"option {option.name}={raw!r}: use {', '.join(others)} or {last}")

    def prefixed(self, prefix: str) -> dict[str, str]:
        """{name: value} of every given option under `prefix` (lower-cased names)."""
        low = prefix.lower()
        return {name: raw for name, raw in self.raw.items() if name.startswith(low)}


def _integer(name: str, raw: str | None, default: object, minimum: int | None) -> int | None:
    if raw is None:
        return default if isinstance(default, int) else None
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(f"option {name} must be an integer, got {raw!r}") from None
    if minimum is not None and value < minimum:
        raise ConfigError(f"option {name} must be at least {minimum}, got {raw!r}")
    return value


def _boolean(name: str, raw: str | None, default: bool) -> bool:
    if raw is None:
        return default
    if raw.strip().lower() not in ("true", "false"):
        raise ConfigError(f"option {name} must be true or false, got {raw!r}")
    return raw.strip().lower() == "true"


def parse_options(options: Mapping[str, str], *, ingest: bool = False) -> SourceOptions:
    """Check and parse the options of an ftkafka source (`ingest`: of an ftingest
    source, `_ingest_checks`); ConfigError naming the option and the value for anything
    wrong. Needs neither Kafka nor the FT layer."""
    given = _Given(options)
    what = "ftingest" if ingest else "ftkafka"
    for name, instead in _UNSUPPORTED.items():
        if name in given.raw:
            raise ConfigError(f"option {name} is not supported by {what}; use {instead}")
    for name in given.raw:
        if name not in _BY_KEY and not any(name.startswith(p.key) for p in _PREFIXES):
            raise ConfigError(_unknown_option(name, what))
    if ingest:
        _ingest_checks(given)
    bootstrap = (given.text("kafka.bootstrap.servers") or "").strip()
    if not bootstrap and not ingest:
        raise ConfigError("option kafka.bootstrap.servers is required (HOST:PORT,...)")
    subscribe = given.text("subscribe") or ""
    topics = tuple(dict.fromkeys(t.strip() for t in subscribe.split(",") if t.strip()))
    if not topics:
        needs = "source name (what its receivers were started with)" if ingest else "topic"
        raise ConfigError(f"option subscribe needs at least one {needs}, got {subscribe!r}")
    starting = _parse_starting(given.text("startingOffsets") or "")
    if isinstance(starting, dict) and set(starting) - set(topics):
        raise ConfigError(
            f"option startingOffsets names topics {sorted(set(starting) - set(topics))} "
            f"that option subscribe ({subscribe!r}) does not"
        )
    partitioner, partitioner_options = _partitioner(given)
    if ingest and _BY_KEY["ft.partitioner"].key not in given.raw:
        partitioner = ""  # the receivers' (IngestDriver.start)
    timeout_ms = given.integer("ft.treeTimeoutMs")
    return SourceOptions(
        bootstrap=bootstrap,
        topics=topics,
        starting=starting,
        max_offsets_per_trigger=given.integer("maxOffsetsPerTrigger"),
        ft=_ft_settings(given),
        partitioner=partitioner,
        partitioner_options=partitioner_options,
        source_name=(given.text("ft.sourceName") or ",".join(topics)).strip(),
        kafka_config=_kafka_config(given),
        poll_timeout_s=_required(given.integer("kafkaConsumer.pollTimeoutMs")) / 1000,
        kafka_retries=_required(given.integer("fetchOffset.numRetries")),
        kafka_retry_interval_s=_required(given.integer("fetchOffset.retryIntervalMs")) / 1000,
        ft_connect_timeout_s=_required(given.integer("ft.connectTimeoutMs")) / 1000,
        ft_reconnect_timeout_s=_required(given.integer("ft.reconnectTimeoutMs")) / 1000,
        group_id=_group_id(given),
        timeout_s=None if timeout_ms is None else timeout_ms / 1000,
        checkpoint_mode=given.choice("ft.checkpointMode"),
        include_headers=given.boolean("includeHeaders", False),
        max_pending_records=_required(given.integer("ft.maxPendingRecords")),
        retry=_retry_policy(given),
        dead_letter_topic=(given.text("ft.deadLetterTopic") or "").strip() or None,
        completion=given.choice("ft.completion"),
        persist="payload" if ingest else given.choice("ft.persist"),
        tree_ranges=given.boolean("ft.treeRanges", True),
        heartbeat_ms=_required(given.integer("ft.heartbeatMs")),
        replay_column=given.boolean("ft.replayColumn", False),
        idle_probe_s=_required(given.integer("idleProbeIntervalMs")) / 1000,
        ingest=ingest,
    )


# Options that mean nothing to ftingest, which reads what receivers stored in the FT
# layer: no Kafka consumer, no group, every record already with its bytes.
_NOT_FOR_INGEST: Final = {
    "kafka.group.id": "ftingest has no consumer group: records leave the FT layer's store "
    "when their trees complete",
    "includeheaders": "the rows of ftingest have no headers column",
    "ft.replaycolumn": "every row of ftingest comes from the FT layer's queue",
    "ft.persist": "receivers store every record with its bytes",
    "ft.enabled": "ftingest always reads from the FT layer",
}


def _ingest_checks(given: _Given) -> None:
    """What an ftingest source refuses: it needs the FT layer, reads every record its
    receivers stored (startingOffsets earliest only: any other start would leave stored
    records unread, their only copy), and takes no option of a Kafka consumer (Kafka
    serves only ft.deadLetterTopic, with kafka.bootstrap.servers)."""
    if not given.text("ft.address"):
        raise ConfigError(
            "option ft.address is required by ftingest: its records are in the FT layer"
        )
    for key, why in _NOT_FOR_INGEST.items():
        if key in given.raw:
            raise ConfigError(f"option {_BY_KEY[key].name} is not an ftingest option: {why}")
    kafka = [n for n in given.prefixed(_KAFKA_PREFIX) if n != "kafka.bootstrap.servers"]
    if kafka:
        raise ConfigError(
            f"option {kafka[0]} is not an ftingest option: ftingest reads no Kafka topic "
            "(kafka.bootstrap.servers only serves ft.deadLetterTopic)"
        )
    starting = (given.raw.get("startingoffsets") or "earliest").strip().lower()
    if starting != "earliest":
        raise ConfigError(
            f"option startingOffsets={given.raw['startingoffsets']!r}: ftingest starts at "
            "the earliest record its receivers stored (the FT layer holds their only copy), "
            "so it takes earliest only"
        )
    if given.text("ft.deadLetterTopic") and not given.text("kafka.bootstrap.servers"):
        raise ConfigError(
            "option ft.deadLetterTopic needs kafka.bootstrap.servers (the broker of the "
            "dead-letter topic)"
        )


def _unknown_option(name: str, what: str = "ftkafka") -> str:
    """The error for an option nobody declared, with the declared name nearest to it
    (a misspelling is the usual cause)."""
    message = f"unknown option {name!r} for the {what} source"
    near = difflib.get_close_matches(name.lower(), _BY_KEY, n=1, cutoff=0.75)
    return f"{message}; did you mean {_BY_KEY[near[0]].name}?" if near else message


def _retry_policy(given: _Given) -> RetryPolicy:
    """The retry options; a maximum backoff given alone caps the default initial one."""
    backoff_max = _required(given.integer("ft.retryBackoffMaxMs"))
    backoff = _required(given.integer("ft.retryBackoffMs"))
    if "ft.retrybackoffms" not in given.raw:
        backoff = min(backoff, backoff_max)
    return RetryPolicy(_required(given.integer("ft.maxRetries")), backoff, backoff_max)


def _required(value: int | None) -> int:
    assert value is not None, "an option with a default"
    return value


def _parse_starting(raw: str) -> str | dict[str, dict[int, int]]:
    text = raw.strip()
    if text.lower() in ("earliest", "latest"):
        return text.lower()
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"option startingOffsets must be earliest, latest or JSON like "
            f'{{"topic":{{"0":23,"1":-2}}}}, got {raw!r} ({exc})'
        ) from None
    if not isinstance(parsed, dict) or not parsed:
        raise ConfigError(
            f"option startingOffsets JSON must be a non-empty object of topics, got {raw!r}"
        )
    starting: dict[str, dict[int, int]] = {}
    for topic, partitions in parsed.items():
        if not isinstance(partitions, dict) or not partitions:
            raise ConfigError(
                f"option startingOffsets: topic {topic!r} needs an object of partitions "
                f"and offsets, got {partitions!r}"
            )
        offsets: dict[int, int] = {}
        for key, offset in partitions.items():
            if not key.isdigit():
                raise ConfigError(
                    f"option startingOffsets: topic {topic!r} has partition {key!r}, "
                    "which is not a partition number"
                )
            if isinstance(offset, bool) or not isinstance(offset, int) or offset < EARLIEST:
                raise ConfigError(
                    f"option startingOffsets: topic {topic!r} partition {key} has offset "
                    f"{offset!r}; use an offset >= 0, -2 (earliest) or -1 (latest)"
                )
            offsets[int(key)] = offset
        starting[topic] = offsets
    return starting


_KAFKA_PREFIX: Final = "kafka."
_PARTITIONER_PREFIX: Final = "ft.partitioner."
# kafka-python settings this source owns, or that take objects an option cannot give.
_KAFKA_OWN_OPTIONS: Final = frozenset({"kafka.bootstrap.servers", "kafka.group.id"})
_KAFKA_RESERVED: Final = frozenset(
    {
        "bootstrap_servers",
        "group_id",
        "group_instance_id",
        "key_deserializer",
        "value_deserializer",
        "enable_auto_commit",
        "auto_commit_interval_ms",
        "default_offset_commit_callback",
        "partition_assignment_strategy",
        "socket_options",
        "metric_reporters",
        "selector",
        "kafka_client",
        "ssl_context",
        "sasl_oauth_token_provider",
        "api_version",
        "consumer_timeout_ms",
    }
)
_KAFKA_INT_WITHOUT_DEFAULT: Final = frozenset({"receive_buffer_bytes", "send_buffer_bytes"})


def _kafka_config(given: _Given) -> dict[str, Any]:
    """kafka.* options as kafka-python consumer settings (kafka.request.timeout.ms ->
    request_timeout_ms), typed by kafka-python's defaults."""
    defaults: dict[str, Any] = KafkaConsumer.DEFAULT_CONFIG
    config: dict[str, Any] = {}
    for name, raw in given.prefixed(_KAFKA_PREFIX).items():
        if name in _KAFKA_OWN_OPTIONS:
            continue
        setting = name.removeprefix(_KAFKA_PREFIX).replace(".", "_")
        if setting in _KAFKA_RESERVED or setting not in defaults:
            raise ConfigError(
                f"option {name} is not a Kafka consumer setting ftkafka passes on "
                f"(as kafka-python's {setting!r})"
            )
        default = defaults[setting]
        if isinstance(default, bool):
            config[setting] = _boolean(name, raw, default)
        elif isinstance(default, int) or setting in _KAFKA_INT_WITHOUT_DEFAULT:
            config[setting] = _integer(name, raw, 0, 0)
        else:
            config[setting] = raw
    return config


def _read_secret(given: _Given, name: str, file_name: str) -> bytes | None:
    """A secret given as option `name` or in the file of option `file_name`."""
    text, path = given.text(name), given.text(file_name)
    if text is not None and path is not None:
        raise ConfigError(f"give option {name} or option {file_name}, not both")
    if text is not None:
        if not text:
            raise ConfigError(f"option {name} is empty")
        return text.encode()
    if path is None:
        return None
    try:
        return read_token_file(path)
    except ConfigError as exc:
        raise ConfigError(f"option {file_name}: {exc}") from None


def _ft_settings(given: _Given) -> FTSettings:
    address = given.text("ft.address")
    enabled = given.boolean("ft.enabled", address is not None)
    if enabled and not address:
        raise ConfigError("option ft.enabled is true but option ft.address is not set")
    if not enabled:
        return FTSettings(enabled=False)
    token = _read_secret(given, "ft.token", "ft.tokenFile")
    loop_key = _read_secret(given, "ft.loopKey", "ft.loopKeyFile")
    reconnect_s = _required(given.integer("ft.reconnectTimeoutMs")) / 1000
    try:
        return FTSettings(
            address=address,
            token=token,
            tls_ca=given.text("ft.tlsCa"),
            loop_key=loop_key,
            reconnect_s=reconnect_s,
        )
    except ConfigError as exc:
        raise ConfigError(f"option ft.address={address!r}: {exc}") from None


def _partitioner(given: _Given) -> tuple[str, dict[str, int]]:
    name = given.choice("ft.partitioner")
    partitioner_options = {
        key.removeprefix(_PARTITIONER_PREFIX): _required(_integer(key, raw, 0, 0))
        for key, raw in given.prefixed(_PARTITIONER_PREFIX).items()
    }
    try:
        create_partitioner(name, **partitioner_options)
    except (ConfigError, PartitioningError) as exc:
        raise ConfigError(f"option ft.partitioner={name!r}: {exc}") from None
    return name, partitioner_options


def _group_id(given: _Given) -> str | None:
    raw = given.text("kafka.group.id")
    if raw is None:
        return None
    if not raw.strip():
        raise ConfigError("option kafka.group.id is empty")
    return raw.strip()


# ---- the user guide's table ------------------------------------------------------------

_TABLE_BEGIN: Final = "<!-- ftkafka options: `make docs` writes this table from OPTIONS -->"
_TABLE_END: Final = "<!-- end of ftkafka options -->"


def markdown_table() -> str:
    """The option table of docs/user-guide.md section 3.1."""
    lines = ["| option | default | meaning |", "|---|---|---|"]
    lines += [
        f"| `{o.name}` | {o.default_cell()} | {o.doc}{_alias_note(o)} |".replace("|  |", "| |")
        for o in OPTIONS
    ]
    return "\n".join(lines) + "\n"


def _alias_note(option: Option) -> str:
    """The table's note on an option's deprecated spellings."""
    if not option.aliases:
        return ""
    spellings = " and ".join(f"`{alias}`" for alias in option.aliases)
    return f". Deprecated spelling: {spellings} (accepted, with a warning)"


def write_markdown_table(guide: Path, *, check: bool = False) -> bool:
    """Put `markdown_table()` between the guide's markers; returns whether the guide
    changed (with `check`, nothing is written). ConfigError if the markers are missing."""
    text = guide.read_text(encoding="utf-8")
    pattern = re.compile(re.escape(_TABLE_BEGIN) + r"\n.*?" + re.escape(_TABLE_END), re.S)
    if not pattern.search(text):
        raise ConfigError(f"{guide} has no generated option table ({_TABLE_BEGIN!r} ... )")
    new = pattern.sub(lambda _m: f"{_TABLE_BEGIN}\n{markdown_table()}{_TABLE_END}", text)
    if new != text and not check:
        guide.write_text(new, encoding="utf-8")
    return new != text
