"""`ftkafka`: a PySpark streaming source that reads Kafka and persists every record in
the FT layer before Spark sees it, then feeds failed records back in as replays.

Usage::

    from ftlayer.integration.source import register
    register(spark)
    df = (spark.readStream.format("ftkafka")
          .option("kafka.bootstrap.servers", "host:9092")
          .option("subscribe", "orders,payments")
          .option("ft.address", "ft-host:7070")
          .load())

Rows: key (binary), value (binary), topic (string), partition (int), offset (long),
timestamp (timestamp), and with FT on `ft_root` and `ft_id` (LongType: the u64 root
and record id of the row's anchor, as int64 bits; see `ftlayer.integration.ftcolumns`).
With FT off there are no FT columns, no FT-layer connection and no FT cost.

## Offsets, batches and input partitions

An offset is a JSON dict::

    {"kafka": {"orders": {"0": 120, "1": 98}, "payments": {"0": 7}}, "replay": 42}

`kafka` holds, per subscribed topic and partition, the Kafka offset of the next record;
`replay` (FT on only) is the replay cursor of the query's sources (the highest replay
seq of their records, `FTLayer.replay_cursor_of`; other queries' failures do not move
it), the highest replay seq the query has taken in. Micro-batch n with start offset S
and end offset E covers the Kafka records [S, E) of every partition and the replays
with S.replay < seq <= E.replay.
Every offset is fixed on the driver before the batch runs and is written to Spark's
offset log, so a batch that Spark runs again reads the same ranges.

A batch has one input partition per (topic, Kafka partition), always listed, in the
order of `subscribe` and then by partition; for one topic the Spark input partition
index is the Kafka partition. The input partition of (topic, p) reads Kafka [S, E) of
(topic, p), then the replays its topic's replay partitioner routed to partition p:
`fetch_replay(S.replay, E.replay, source_id, p)`. A replayed record thus re-enters in
a later batch, in the input partition its partitioner chose, with its original topic,
partition, offset, key, value and timestamp, under a new root.

## What read() does, per input partition (on an executor)

1. Read Kafka [start, end) of the partition with kafka-python (assign/seek, large fetch
   sizes). If no record arrives for `kafkaConsumer.pollTimeoutMs`, fail with
   SourceError naming the partition and how far it got: never a hang.
2. FT on: persist each polled chunk through this process's shared BatchingChannel
   (`Persister.persist`, which returns only once the FT layer confirmed), and only then
   yield it as a pyarrow.RecordBatch. Each record is stored with a compact payload
   (`encode_payloads`: key or null, value or null, timestamp), its Kafka coordinates,
   and its key hash (Kafka's murmur2; `portable_hash` under `spark-hash`).
   A record that a loop sink fed back (Kafka header `ftlayer-anchor`, see
   integration.sinks) is not persisted: its tree's source record is. It is emitted
   under the root in its header with a fresh id, and one XOR event acks the id it was
   in transit under and anchors the fresh one, so the tree goes on.
3. FT on: fetch this partition's replays, send each one's emission XOR event
   (`Persister.emit_replays`), rebuild their rows from the payloads, yield them.
4. Flush the channel.

Each run of read() persists under fresh random root ids. A batch that Spark runs again
(an uncommitted batch after a restart, a retried task) therefore persists its records a
second time under other roots: the first run's trees complete or time out and are
replayed. A replay emitted twice adds a second child to its root, which then completes
only once both copies are acked. Duplicates, never a loss, never an early completion
(docs/guarantees.md, "Spark re-runs a batch").

## The driver side

The reader in the driver process resolves offsets. On its first call it checks every
subscribed topic exists (ConfigError otherwise), registers each topic's source with the
FT layer (`register_source(source_id, ft.partitioner, partition count)`; the source id
is `source_id(ft.sourceName, topic)`), and fixes the initial offset once: Spark asks
for it more than once. End offsets come from the high watermark of a Fetch, not from
ListOffsets(latest), which Tansu answers short of the end. The replay cursor comes from
the FT layer's status (`replay_cursors`, per source). A partition added to a topic
while the query runs enters one batch later, from its earliest offset. Calls to Kafka
and the FT layer are retried with doubling backoff and then fail with SourceError: an
unreachable broker or FT layer is an error within seconds, not a hang.

`maxOffsetsPerTrigger` caps the Kafka records of a batch, split over partitions in
proportion to their backlog as Spark's Kafka source does (a partition with a backlog
gets at least one record, so a batch may exceed the cap by fewer records than there
are partitions); it also caps the number of replay seqs a batch takes in.

## Options

Declared once, with their types, defaults and meaning, in `ftlayer.integration.options`
(`OPTIONS`; docs/user-guide.md section 3.1 shows the same table).
Every bad option raises ConfigError naming the option and the value, on the driver:
option syntax at `load()` (in `schema()`), what needs the broker (a topic or partition
that does not exist) when the query starts, before any batch.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeVar

import numpy as np
import pyarrow as pa
from kafka import KafkaConsumer, TopicPartition
from kafka.errors import KafkaError
from kafka.structs import OffsetAndMetadata
from numpy.typing import ArrayLike, NDArray
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import (
    BinaryType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from ftlayer.client import BatchingChannel, ConnectionLost, FTClient
from ftlayer.errors import ConfigError, FTLayerError
from ftlayer.handlers import Persister
from ftlayer.ids import new_ids
from ftlayer.partitioners import (
    kafka_key_hashes,
    spark_key_hashes,
)
from ftlayer.position import EARLIEST, LATEST, KafkaOffsets, Position, offsets_from_json

from .ftcolumns import ID_COLUMN, ROOT_COLUMN, read_loop_headers, to_signed
from .options import SourceOptions, parse_options

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = [
    "FTKafkaDataSource",
    "FTKafkaPartition",
    "FTKafkaStreamReader",
    "SourceError",
    "decode_payloads",
    "encode_payloads",
    "register",
    "source_schema",
]

T = TypeVar("T")

# An executor reads one partition, so one partition's fetch may use most of the fetch.
_FETCH_MAX_BYTES: Final = 32 * 1024 * 1024
_PARTITION_FETCH_MAX_BYTES: Final = 16 * 1024 * 1024
_MAX_POLL_RECORDS: Final = 50_000
# kafka-python's poll() returns early only with records; poll in short slices.
_POLL_SECONDS: Final = 0.05
# A PERSIST frame is at most 64 MiB: persist in chunks well below that.
_PERSIST_CHUNK_BYTES: Final = 16 * 1024 * 1024
# Driver-side Kafka calls: each attempt is bounded by this unless kafka.* says otherwise.
log = logging.getLogger("ftlayer.source")

_DRIVER_TIMEOUT_MS: Final = 1500
# Connection settings the group-commit consumer shares with the reading consumers.
_SECURITY: Final = frozenset(
    k for k in KafkaConsumer.DEFAULT_CONFIG if k.startswith(("ssl_", "sasl_", "security_"))
)


class SourceError(FTLayerError):
    """The ftkafka source cannot reach Kafka or the FT layer (after its retries), cannot
    read an offset range in time, or found Kafka or the FT layer behind its offsets."""


def source_schema(ft_on: bool) -> StructType:
    """The rows of an ftkafka source: the Kafka record, and its anchor with FT on."""
    fields = [
        StructField("key", BinaryType()),
        StructField("value", BinaryType()),
        StructField("topic", StringType()),
        StructField("partition", IntegerType()),
        StructField("offset", LongType()),
        StructField("timestamp", TimestampType()),
    ]
    if ft_on:
        fields += [StructField(ROOT_COLUMN, LongType()), StructField(ID_COLUMN, LongType())]
    return StructType(fields)


# ---- payloads ------------------------------------------------------------------------

# A persisted payload: a 14-byte little-endian header (u8 format version 1, u8 flags:
# 1 = key present, 2 = value present; i64 timestamp in epoch ms; u32 key length), then
# the key bytes, then the value bytes (the rest). The FT layer never reads it.
_HEADER: Final = np.dtype([("version", "u1"), ("flags", "u1"), ("ts", "<i8"), ("klen", "<u4")])
_HEADER_SIZE: Final = _HEADER.itemsize
_FORMAT_VERSION: Final = 1
_KEY_PRESENT: Final = 1
_VALUE_PRESENT: Final = 2


def _regions(total: int, starts: NDArray[np.int64], lengths: NDArray[np.int64]) -> Any:
    """A boolean mask of `total` bytes, True inside [starts[i], starts[i] + lengths[i])
    (regions do not overlap)."""
    marks = np.zeros(total + 1, dtype=np.int8)
    nonempty = lengths > 0
    marks[starts[nonempty]] += 1
    marks[(starts + lengths)[nonempty]] -= 1
    return np.cumsum(marks[:-1], dtype=np.int8).astype(np.bool_)


def encode_payloads(
    keys: Sequence[bytes | None], values: Sequence[bytes | None], timestamps_ms: ArrayLike
) -> list[bytes]:
    """The persisted payload of each record (None: no key, or no value; timestamps in
    epoch ms). The headers are built as one numpy array and all payloads with one join;
    the per-record Python steps are list comprehensions over what kafka-python returned."""
    n = len(keys)
    key_bytes = [k or b"" for k in keys]
    value_bytes = [v or b"" for v in values]
    klen = np.fromiter(map(len, key_bytes), dtype=np.int64, count=n)
    vlen = np.fromiter(map(len, value_bytes), dtype=np.int64, count=n)
    header = np.zeros(n, dtype=_HEADER)
    header["version"] = _FORMAT_VERSION
    header["flags"] = np.fromiter((k is not None for k in keys), np.uint8, n) * _KEY_PRESENT
    header["flags"] |= np.fromiter((v is not None for v in values), np.uint8, n) * _VALUE_PRESENT
    header["ts"] = timestamps_ms
    header["klen"] = klen
    headers = header.tobytes()
    parts: list[bytes] = [b""] * (3 * n)
    parts[0::3] = [headers[i : i + _HEADER_SIZE] for i in range(0, n * _HEADER_SIZE, _HEADER_SIZE)]
    parts[1::3] = key_bytes
    parts[2::3] = value_bytes
    blob = b"".join(parts)
    ends = np.cumsum(_HEADER_SIZE + klen + vlen).tolist()
    return [blob[s:e] for s, e in zip([0, *ends[:-1]], ends, strict=True)]


def decode_payloads(payloads: Sequence[bytes]) -> tuple[Any, Any, NDArray[np.int64]]:
    """(keys, values, timestamps_ms) from payloads made by `encode_payloads`: two
    pyarrow binary arrays (null where the record had none) and an int64 array."""
    n = len(payloads)
    sizes = np.fromiter(map(len, payloads), dtype=np.int64, count=n)
    if n and int(sizes.min()) < _HEADER_SIZE:
        raise SourceError("a replayed payload is shorter than its header: not ftkafka's")
    ends = np.cumsum(sizes)
    starts = ends - sizes
    total = int(ends[-1]) if n else 0
    blob = np.frombuffer(b"".join(payloads), dtype=np.uint8)
    header_bytes = blob[_regions(total, starts, np.full(n, _HEADER_SIZE))]
    header = header_bytes.view(_HEADER) if n else np.zeros(0, dtype=_HEADER)
    if n and bool((header["version"] != _FORMAT_VERSION).any()):
        raise SourceError(
            f"replayed payloads of format versions {sorted(set(header['version'].tolist()))}; "
            f"this ftkafka reads version {_FORMAT_VERSION}"
        )
    klen = header["klen"].astype(np.int64)
    vlen = sizes - _HEADER_SIZE - klen
    if bool((vlen < 0).any()):
        raise SourceError("a replayed payload's key length runs past its end")
    flags = header["flags"]
    keys = _binary_array(blob[_regions(total, starts + _HEADER_SIZE, klen)], klen,
                         (flags & _KEY_PRESENT) > 0)  # fmt: skip
    values = _binary_array(blob[_regions(total, starts + _HEADER_SIZE + klen, vlen)], vlen,
                           (flags & _VALUE_PRESENT) > 0)  # fmt: skip
    return keys, values, header["ts"].astype(np.int64)


def _binary_array(data: NDArray[np.uint8], lengths: NDArray[np.int64], valid: Any) -> Any:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths.astype(np.int32), out=offsets[1:])
    nulls = int(len(valid) - np.count_nonzero(valid))
    bitmap = pa.py_buffer(np.packbits(valid, bitorder="little")) if nulls else None
    return pa.Array.from_buffers(
        pa.binary(),
        len(lengths),
        [bitmap, pa.py_buffer(offsets), pa.py_buffer(data.tobytes())],
        null_count=nulls,
    )


# ---- input partitions ------------------------------------------------------------------


class FTKafkaPartition(InputPartition):
    """One input partition of a batch: Kafka [start, end) of (topic, partition), and the
    replays of its source routed to `partition` with replay_lo < seq <= replay_hi."""

    def __init__(
        self,
        topic: str,
        partition: int,
        start: int,
        end: int,
        source_id: int,
        replay_lo: int,
        replay_hi: int,
    ) -> None:
        super().__init__((topic, partition))
        self.topic = topic
        self.partition = partition
        self.start = start
        self.end = end
        self.source_id = source_id
        self.replay_lo = replay_lo
        self.replay_hi = replay_hi

    def __repr__(self) -> str:
        return (
            f"FTKafkaPartition({self.topic}-{self.partition} [{self.start}, {self.end}) "
            f"replay ({self.replay_lo}, {self.replay_hi}])"
        )


# ---- the data source ----------------------------------------------------------------------


class FTKafkaDataSource(DataSource):
    """`spark.readStream.format("ftkafka")`; see the module docstring."""

    @classmethod
    def name(cls) -> str:
        return "ftkafka"

    def schema(self) -> StructType:
        # Spark calls this at load(): every option is checked here, before any query.
        return source_schema(parse_options(self.options).ft_on)

    def streamReader(self, schema: StructType) -> FTKafkaStreamReader:
        options = parse_options(self.options)
        expected = source_schema(options.ft_on)
        if schema != expected:
            raise ConfigError(
                f"ftkafka's schema is fixed by its options: {expected.simpleString()}, "
                f"got {schema.simpleString()}"
            )
        return FTKafkaStreamReader(options, schema)


def register(spark: SparkSession) -> None:
    """Make `spark.readStream.format("ftkafka")` available in this session."""
    spark.dataSource.register(FTKafkaDataSource)


Offset = dict[str, Any]
"""A position (ftlayer.position) in its JSON form, as Spark's offset log holds it."""


class FTKafkaStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """The stream reader. Spark makes one in the driver's source process (offsets,
    partitions, commit) and one in a planner process that is pickled to executors
    (read); the constructor therefore connects to nothing."""

    def __init__(self, options: SourceOptions, schema: StructType) -> None:
        self._configure(options, schema)

    def _configure(self, options: SourceOptions, schema: StructType) -> None:
        self.options = options
        self.schema = schema
        self.source_ids = options.source_ids()
        self._driver: _Driver | None = None
        self._initial: Offset | None = None
        self._target: Offset | None = None
        self._available: Offset | None = None
        self._deferred_commit: Position | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Only the configuration travels to executors, never driver connections.
        return {"options": self.options, "schema": self.schema}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._configure(state["options"], state["schema"])

    # ---- driver: offsets ----------------------------------------------------------

    def _driver_side(self) -> _Driver:
        if self._driver is None:
            driver = _Driver(self.options, self.source_ids)
            try:
                driver.start()
            except BaseException:
                driver.close()
                raise
            self._driver = driver
        return self._driver

    def initialOffset(self) -> Offset:
        # Spark asks more than once; "latest" must not move between the answers.
        if self._initial is None:
            self._initial = self._driver_side().initial_offset()
        return self._initial

    def getDefaultReadLimit(self) -> ReadLimit:
        limit = self.options.max_offsets_per_trigger
        return ReadAllAvailable() if limit is None else ReadMaxRows(limit)

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._driver_side().available(None)

    def latestOffset(self, start: Offset, limit: ReadLimit) -> Offset:
        driver = self._driver_side()
        self._complete_deferred()  # only if no batch was planned after the last commit
        available = driver.available(start)
        if self._target is not None:
            available = _cap(available, self._target, start)
        self._available = available
        max_rows = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        return driver.limited(start, available, max_rows)

    def reportLatestOffset(self) -> Offset | None:
        return self._available

    def partitions(self, start: Offset, end: Offset) -> Sequence[FTKafkaPartition]:
        first, barrier = Position.parse(start), Position.parse(end)
        replay_hi = barrier.replay or 0
        replay_lo = replay_hi if first.replay is None else first.replay
        parts: list[FTKafkaPartition] = []
        busy = replay_hi > replay_lo
        for topic in self.options.topics:
            ends = barrier.kafka.get(topic, {})
            for p in sorted(ends):
                hi = ends[p]
                lo = first.offset(topic, p, hi)  # a partition new in this batch starts empty
                busy |= hi > lo
                parts.append(
                    FTKafkaPartition(topic, p, lo, hi, self.source_ids[topic], replay_lo, replay_hi)
                )
        if self.options.ft_on and barrier.replay is not None:
            # Spark logged `end` before planning the batch: it is barrier n. The commit
            # of batch n - 1, which Spark made just before, goes in the same request.
            driver = self._driver_side()
            done, self._deferred_commit = self._deferred_commit, None
            answer = driver.checkpoint(barrier, begin=True, complete=done)
            if done is not None:
                self._commit_group(driver, _commit_offsets((answer or {}).get("completed")))
        return parts if busy else []

    def commit(self, end: Offset) -> None:
        # Spark calls this once batch `end` is done, one batch late: the batch never
        # runs again. The FT layer completes (or starts aligning) its checkpoint,
        # drops the replay queue entries the batch took in (per source: other queries'
        # entries stay) and answers the group offsets the checkpoint allows (never past
        # an incomplete record); with kafka.group.id they are committed. Spark plans
        # the next batch right after this call (partitions()), so with FT on the
        # completion rides on that batch's CHECKPOINT_BEGIN: one round trip for both.
        position = Position.parse(end)
        if self.options.ft_on and position.replay is not None:
            self._deferred_commit = position
            return
        self._commit_group(self._driver_side(), position.offsets())

    def _complete_deferred(self) -> None:
        """Complete a deferred commit on its own (no batch was planned after it)."""
        done, self._deferred_commit = self._deferred_commit, None
        if done is not None:
            driver = self._driver_side()
            self._commit_group(driver, _commit_offsets(driver.checkpoint(done, begin=False)))

    def _commit_group(self, driver: _Driver, offsets: KafkaOffsets | None) -> None:
        if self.options.group_id is not None and offsets:
            driver.commit_group(offsets)

    def stop(self) -> None:
        if self._driver is not None:
            try:
                self._complete_deferred()
            finally:
                if self._driver is not None:
                    self._driver.close()
                self._driver = None

    # ---- executors: read ----------------------------------------------------------

    def read(self, partition: InputPartition) -> Iterator[Any]:
        if not isinstance(partition, FTKafkaPartition):
            raise TypeError(f"ftkafka cannot read {partition!r}")
        return _read_partition(self.options, self.schema, partition)


def _commit_offsets(answer: Mapping[str, Any] | None) -> KafkaOffsets | None:
    """The group offsets a checkpoint answer allows, or None."""
    offsets = None if answer is None else answer.get("commit_offsets")
    return None if offsets is None else offsets_from_json(offsets)


def _cap(available: Offset, target: Offset, start: Offset) -> Offset:
    """`available` no further than `target` (Trigger.AvailableNow's fixed end), and
    never behind `start`: Spark fixes the target before it asks for the initial offset,
    so with startingOffsets=latest the start may already be past the target."""
    now, goal, begin = Position.parse(available), Position.parse(target), Position.parse(start)
    kafka = now.offsets()
    for topic, partitions in kafka.items():
        for p, end in partitions.items():
            # A partition the target does not know appeared later: it sits at its
            # earliest offset (see _Driver.available), with nothing to read.
            capped = min(end, goal.offset(topic, p, end))
            partitions[p] = max(capped, begin.offset(topic, p, capped))
    replay = now.replay
    if replay is not None and goal.replay is not None:
        replay = max(min(replay, goal.replay), begin.replay or 0)
    return Position(kafka, replay).to_json()


# ---- the driver's connections ------------------------------------------------------------


class _Driver:
    """The driver's Kafka consumer and FT-layer client, with retries."""

    def __init__(self, options: SourceOptions, source_ids: Mapping[str, int]) -> None:
        self.options = options
        self.source_ids = source_ids
        self._consumer: Any = None
        self._ft: FTClient | None = None
        self._partition_counts: dict[str, int] = {}
        self._group: Any = None
        self._committed: dict[tuple[str, int], int] = {}

    # ---- lifecycle ----

    def start(self) -> None:
        """Check the topics exist; with FT on, register their sources."""
        self._partition_counts = self._kafka(
            "read the topics' metadata", lambda: self._topic_partitions(check_exist=True)
        )
        if self.options.ft_on:
            self._register_sources()

    def close(self) -> None:
        self._drop_consumer()
        self._drop_group_client()
        if self._ft is not None:
            self._ft.close()
            self._ft = None

    # ---- offsets ----

    def initial_offset(self) -> Offset:
        starting = self.options.starting
        counts = self._partition_counts
        tps = [TopicPartition(t, p) for t in self.options.topics for p in range(counts[t])]
        if starting == "earliest":
            kafka = self._kafka("read the earliest offsets", lambda: self._earliest(tps))
        elif starting == "latest":
            kafka = self._kafka("read the end offsets", lambda: self._ends(tps))
        else:
            assert isinstance(starting, dict)
            kafka = self._specific_offsets(starting, tps)
        return Position(kafka, self._replay_start() if self.options.ft_on else None).to_json()

    def _specific_offsets(
        self, starting: dict[str, dict[int, int]], tps: list[TopicPartition]
    ) -> KafkaOffsets:
        counts = self._partition_counts
        for topic in self.options.topics:
            wanted = set(range(counts[topic]))
            given = set(starting.get(topic, {}))
            if given - wanted:
                raise ConfigError(
                    f"option startingOffsets: topic {topic!r} has no partition "
                    f"{sorted(given - wanted)}; it has partitions 0-{counts[topic] - 1}"
                )
            if wanted - given:
                raise ConfigError(
                    f"option startingOffsets must give every partition of topic {topic!r} "
                    f"(-2 earliest, -1 latest); missing: {sorted(wanted - given)}"
                )
        earliest = self._kafka("read the earliest offsets", lambda: self._earliest(tps))
        ends = self._kafka("read the end offsets", lambda: self._ends(tps))
        kafka: KafkaOffsets = {}
        for topic in self.options.topics:
            kafka[topic] = {}
            for p, offset in starting[topic].items():
                lo, hi = earliest[topic][p], ends[topic][p]
                if offset == EARLIEST:
                    offset = lo
                elif offset == LATEST:
                    offset = hi
                elif not lo <= offset <= hi:
                    raise ConfigError(
                        f"option startingOffsets: offset {offset} of {topic}-{p} is outside "
                        f"the records Kafka holds, [{lo}, {hi}]"
                    )
                kafka[topic][p] = offset
        return kafka

    def available(self, start: Offset | None) -> Offset:
        """The end of everything readable now: the high watermark of every partition
        (a partition new since `start` at its earliest offset: it enters one batch
        later, from there) and the FT layer's replay cursor."""
        counts = self._kafka(
            "read the topics' metadata", lambda: self._topic_partitions(check_exist=False)
        )
        first = None if start is None else Position.parse(start)
        known = {} if first is None else first.kafka
        tps = [TopicPartition(t, p) for t in self.options.topics for p in range(counts[t])]
        ends = self._kafka("read the end offsets", lambda: self._ends(tps))
        new = [tp for tp in tps if tp.partition not in known.get(tp.topic, {})]
        if start is not None and new:
            earliest = self._kafka("read the earliest offsets", lambda: self._earliest(new))
            for tp in new:
                ends[tp.topic][tp.partition] = earliest[tp.topic][tp.partition]
        for topic, partitions in known.items():
            for p, offset in partitions.items():
                end = ends.get(topic, {}).get(p)
                if end is not None and end < offset:
                    raise SourceError(
                        f"Kafka's end of {topic}-{p} is {end}, behind this query's offset "
                        f"{offset}: the topic was deleted or truncated, records may be lost"
                    )
        if self.options.ft_on and counts != self._partition_counts:
            self._partition_counts = counts
            self._register_sources()
        replay = None
        if self.options.ft_on:
            replay = self._replay_cursor()
            previous = None if first is None else first.replay
            if previous is not None and replay < previous:
                raise SourceError(
                    f"the FT layer at {self.options.ft.address} has replay cursor {replay}, "
                    f"behind this query's {previous}: it is not the FT layer this query "
                    "ran with (its data directory was lost or replaced)"
                )
        return Position(ends, replay).to_json()

    def limited(self, start: Offset, available: Offset, max_rows: int | None) -> Offset:
        """`available`, cut to at most `max_rows` Kafka records split over partitions
        in proportion to their backlog (Spark's KafkaMicroBatchStream.rateLimit), and
        at most `max_rows` replay seqs."""
        now, first = Position.parse(available), Position.parse(start)
        if max_rows is None:
            return now.to_json()
        ends, starts, replay = now.offsets(), first.kafka, now.replay
        sizes = {
            (t, p): end - starts[t][p]
            for t, partitions in ends.items()
            for p, end in partitions.items()
            if p in starts.get(t, {}) and end > starts[t][p]
        }
        total = sum(sizes.values())
        if total > 0:
            for (t, p), size in sizes.items():
                share = max_rows * (size / total)
                share_rows = int(np.ceil(share)) if share < 1 else int(share)
                ends[t][p] = min(ends[t][p], starts[t][p] + share_rows)
        if replay is not None and first.replay is not None:
            replay = min(replay, first.replay + max_rows)
        return Position(ends, replay).to_json()

    # ---- replay queue ----

    def checkpoint(
        self, end: Position, *, begin: bool, complete: Position | None = None
    ) -> dict[str, Any] | None:
        """CHECKPOINT_BEGIN (barrier `end`; with `complete`, that barrier's batch is
        done and completes first, in the same request) or CHECKPOINT_COMPLETE (its
        batch is done); the FT layer's answer. A completion's "commit_offsets" are the
        group offsets the checkpoint allows: the lowest pending offsets capped at its
        barrier (unaligned), the barrier once aligned, the last aligned checkpoint's
        while aligning, or None. A failure is logged and gives None: the next batch's
        checkpoint covers this one (the FT layer completes checkpoints in order, and a
        later commit finishes the batches before it)."""

        def call(client: FTClient) -> dict[str, Any]:
            return client.checkpoint(
                begin=begin,
                query=self.options.checkpoint_query,
                position=end.to_json(),
                sources=sorted(set(self.source_ids.values())),
                mode=self.options.checkpoint_mode,
                complete=None if complete is None else complete.to_json(),
            )

        what = "begin the checkpoint" if begin else "complete the checkpoint"
        try:
            return self._ft_call(f"{what} of {self.options.checkpoint_query!r}", call)
        except SourceError as exc:
            log.warning("%s (covered by the next batch's checkpoint)", exc)
            return None

    # ---- consumer-group offsets ----

    def commit_group(self, target: Mapping[str, Mapping[int, int]]) -> dict[str, dict[int, int]]:
        """Commit these group offsets where they move forward; returns what it
        committed. A committed offset never moves back. A failed commit is logged and
        retried at the next one: the query's progress is in Spark's checkpoint, the
        group offsets only mirror it."""
        commits = {
            TopicPartition(t, p): offset
            for t, partitions in target.items()
            for p, offset in partitions.items()
            if offset > self._committed.get((t, p), -1)
        }
        if not commits:
            return {}
        try:
            self._group_client().commit(
                offsets={tp: OffsetAndMetadata(o, "", -1) for tp, o in commits.items()}
            )
        except (KafkaError, OSError) as exc:
            log.warning(
                "could not commit offsets of group %r (retried at the next batch): %r",
                self.options.group_id,
                exc,
            )
            self._drop_group_client()
            return {}
        for tp, offset in commits.items():
            self._committed[(tp.topic, tp.partition)] = offset
        return _by_topic(commits)

    def _group_client(self) -> Any:
        if self._group is None:
            self._group = KafkaConsumer(
                bootstrap_servers=self.options.bootstrap,
                group_id=self.options.group_id,
                enable_auto_commit=False,
                request_timeout_ms=_DRIVER_TIMEOUT_MS * 4,
                **{k: v for k, v in self.options.kafka_config.items() if k in _SECURITY},
            )
        return self._group

    def _drop_group_client(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            with contextlib.suppress(Exception):
                group.close(autocommit=False)

    # ---- Kafka ----

    def _kafka(self, what: str, call: Callable[[], T]) -> T:
        retries, delay = self.options.kafka_retries, self.options.kafka_retry_interval_s
        began = time.monotonic()
        for attempt in range(retries + 1):
            try:
                return call()
            except (KafkaError, OSError, _NoFetchResponse) as exc:
                self._drop_consumer()
                if attempt == retries:
                    raise SourceError(
                        f"could not {what} from Kafka at {self.options.bootstrap} "
                        f"(kafka.bootstrap.servers): {retries + 1} attempts in "
                        f"{time.monotonic() - began:.1f} s, the last failed with {exc!r}"
                    ) from exc
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    def _client(self) -> Any:
        if self._consumer is None:
            config: dict[str, Any] = {
                "bootstrap_timeout_ms": _DRIVER_TIMEOUT_MS,
                "request_timeout_ms": _DRIVER_TIMEOUT_MS,
                "fetch_max_wait_ms": 20,
                "metadata_max_age_ms": 10_000,
                "max_partition_fetch_bytes": 1024 * 1024,
                "fetch_max_bytes": 1024 * 1024,
                **self.options.kafka_config,
            }
            self._consumer = _new_consumer(self.options.bootstrap, config)
        return self._consumer

    def _drop_consumer(self) -> None:
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            with contextlib.suppress(Exception):  # a broken consumer is gone either way
                consumer.close(autocommit=False)

    def _topic_partitions(self, check_exist: bool) -> dict[str, int]:
        """The partition count of every topic. `check_exist` asks the broker for all
        topics (a metadata request; at start); otherwise the consumer's metadata cache
        answers, refreshed every metadata_max_age_ms (10 s: new partitions show up)."""
        consumer = self._client()
        if check_exist:
            existing: set[str] = consumer.topics()
            missing = [t for t in self.options.topics if t not in existing]
            if missing:
                shown = sorted(existing)[:20]
                raise ConfigError(
                    f"option subscribe: topic(s) {missing} do not exist on "
                    f"{self.options.bootstrap}; it has {len(existing)} topic(s), e.g. {shown}"
                )
        counts: dict[str, int] = {}
        for topic in self.options.topics:
            partitions = sorted(consumer.partitions_for_topic(topic) or ())
            if not partitions or partitions != list(range(len(partitions))):
                raise SourceError(
                    f"topic {topic!r} on {self.options.bootstrap} has partitions {partitions}: "
                    "deleted while the query runs?"
                )
            counts[topic] = len(partitions)
        return counts

    def _earliest(self, tps: list[TopicPartition]) -> KafkaOffsets:
        found = self._client().beginning_offsets(tps, timeout_ms=self._timeout_ms())
        return _by_topic(found)

    def _ends(self, tps: list[TopicPartition]) -> KafkaOffsets:
        """High watermarks from a Fetch. ListOffsets(latest) gives a lower bound (exact
        on Kafka, the last batch's base offset + 1 on Tansu); seeking there, one fetch
        per partition returns at most that batch, and the high watermark."""
        consumer = self._client()
        consumer.unsubscribe()  # fresh partition states: no stale high watermark
        consumer.assign(tps)
        for tp, offset in consumer.end_offsets(tps, timeout_ms=self._timeout_ms()).items():
            consumer.seek(tp, offset)
        deadline = time.monotonic() + self._timeout_ms() / 1000
        marks: dict[TopicPartition, int] = {}
        while len(marks) < len(tps):
            if time.monotonic() > deadline:
                missing = sorted(f"{tp.topic}-{tp.partition}" for tp in tps if tp not in marks)
                raise _NoFetchResponse(f"no fetch response for {missing}")
            consumer.poll(timeout_ms=int(_POLL_SECONDS * 1000))
            for tp in tps:
                mark = consumer.highwater(tp)
                if mark is not None and tp not in marks:
                    marks[tp] = int(mark)
                    consumer.pause(tp)
        return _by_topic(marks)

    def _timeout_ms(self) -> int:
        return int(self.options.kafka_config.get("request_timeout_ms", _DRIVER_TIMEOUT_MS))

    # ---- FT layer ----

    def _ft_call(self, what: str, call: Callable[[FTClient], T]) -> T:
        """A call to the FT layer. The client retries refused connections with backoff
        for ft.reconnectTimeoutMs (a restarting server is waited for), then fails."""
        ft = self.options.ft
        if self._ft is None:
            self._ft = FTClient(
                ft.address or "",
                token=ft.token,
                connect_timeout=self.options.ft_connect_timeout_s,
                request_timeout=30.0,
                name="ftkafka-driver",
                tls=ft.tls_ca or False,
                reconnect_s=self.options.ft_reconnect_timeout_s,
            )
        began = time.monotonic()
        try:
            return call(self._ft)
        except (ConnectionLost, OSError) as exc:
            self._ft.close()
            self._ft = None
            raise SourceError(
                f"could not {what}: the FT layer at {ft.address} (option ft.address) did not "
                f"answer within {time.monotonic() - began:.1f} s: {exc}"
            ) from exc

    def _register_sources(self) -> None:
        options = self.options
        for topic in options.topics:

            def register(client: FTClient, topic: str = topic) -> None:
                client.register_source(
                    self.source_ids[topic],
                    options.partitioner,
                    self._partition_counts[topic],
                    options.partitioner_options,
                    options.timeout_s,
                )

            self._ft_call(f"register the source of topic {topic!r}", register)

    def _replay_start(self) -> int:
        """A new query's replay cursor: where its sources' replay queue entries were
        pruned to (FTLayer.replay_start_of), so its first batch takes in every queued
        replay of its sources, such as those recovered after an FT-layer restart or
        restored from a savepoint."""
        status = self._ft_call("read the replay cursor", lambda client: client.status())
        pruned = status.get("replay_pruned", {})
        return max(
            max(int(pruned.get("*", 0)), int(pruned.get(str(sid), 0)))
            for sid in self.source_ids.values()
        )

    def _replay_cursor(self) -> int:
        """The highest replay seq of this query's sources (see FTLayer.replay_cursor_of):
        other queries' failures do not move it, so they cause no empty batches here."""
        status = self._ft_call("read the replay cursor", lambda client: client.status())
        cursors = status.get("replay_cursors", {})
        at_start = int(status.get("replay_cursor_at_start", status["replay_cursor"]))
        return max(int(cursors.get(str(sid), at_start)) for sid in self.source_ids.values())


class _NoFetchResponse(Exception):
    """A driver fetch for high watermarks got no answer in time (retried)."""


def _by_topic(found: Mapping[Any, Any]) -> KafkaOffsets:
    offsets: KafkaOffsets = {}
    for tp, offset in found.items():
        if offset is None:
            raise _NoFetchResponse(f"no offset for {tp.topic}-{tp.partition}")
        offsets.setdefault(tp.topic, {})[tp.partition] = int(offset)
    return offsets


def _new_consumer(bootstrap: str, config: Mapping[str, Any]) -> Any:
    return KafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=None,
        enable_auto_commit=False,
        allow_auto_create_topics=False,
        **{"client_id": "ftkafka", **config},
    )


# ---- executors ---------------------------------------------------------------------------


KeyHashes = Callable[[Sequence[bytes | None]], tuple[NDArray[np.int64], NDArray[np.bool_]]]


_Chunk = tuple[
    list[bytes | None],
    list[bytes | None],
    NDArray[np.int64],
    NDArray[np.int64],
    list[list[tuple[str, bytes]]],
]


def _read_partition(
    options: SourceOptions, schema: StructType, part: FTKafkaPartition
) -> Iterator[Any]:
    """read() of one input partition: see "What read() does" in the module docstring."""
    arrow_schema = to_arrow_schema(schema, timezone="UTC")
    channel = options.ft.channel() if options.ft_on else None
    persister = None if channel is None else Persister(channel, source_id=part.source_id)
    key_hashes: KeyHashes = (
        _spark_key_hashes if options.partitioner == "spark-hash" else kafka_key_hashes
    )
    # Steps 1 and 2: the Kafka range, each chunk persisted before it is yielded.
    for keys, values, offsets, timestamps, headers in _read_kafka(options, part):
        anchors = None
        if persister is not None and channel is not None:
            loop_roots, loop_ids = read_loop_headers(headers)
            if not loop_roots.any():  # the usual chunk: every record starts a tree
                payloads = encode_payloads(keys, values, timestamps)
                anchors = _persist(persister, part, payloads, offsets, *key_hashes(keys))
            else:
                anchors = _persist_or_continue(
                    persister,
                    channel,
                    part,
                    key_hashes,
                    keys,
                    values,
                    offsets,
                    timestamps,
                    loop_roots,
                    loop_ids,
                )
        n = len(keys)
        yield _arrow_batch(
            arrow_schema,
            pa.array(keys, type=pa.binary()),
            pa.array(values, type=pa.binary()),
            [part.topic] * n,
            np.full(n, part.partition, dtype=np.int32),
            offsets,
            timestamps,
            anchors,
        )
    if channel is None or persister is None:
        return
    # Step 3: this partition's replays, emitted again under their replay roots.
    if part.replay_hi > part.replay_lo:
        replay = channel.fetch_replay(
            part.replay_lo, part.replay_hi, part.source_id, part.partition
        )
        if len(replay):
            records = replay.records
            emitted = persister.emit_replays(records.roots)
            keys_r, values_r, timestamps_r = decode_payloads(records.payloads)
            yield _arrow_batch(
                arrow_schema,
                keys_r,
                values_r,
                records.topics,
                records.partitions,
                records.offsets,
                timestamps_r,
                (to_signed(emitted.roots), to_signed(emitted.ids)),
            )
    # Step 4: the emission events of the replays (and anything else buffered) go now.
    channel.flush()


def _persist_or_continue(
    persister: Persister,
    channel: BatchingChannel,
    part: FTKafkaPartition,
    key_hashes: KeyHashes,
    keys: list[bytes | None],
    values: list[bytes | None],
    offsets: NDArray[np.int64],
    timestamps: NDArray[np.int64],
    loop_roots: NDArray[np.uint64],
    loop_ids: NDArray[np.uint64],
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """The (ft_root, ft_id) columns of a chunk holding records a loop fed back (step 2):
    the others are persisted as new trees; a looped record starts none: one XOR event
    acks the id it was in transit under and anchors a fresh id under its root."""
    roots, ids = np.zeros(len(keys), np.int64), np.zeros(len(keys), np.int64)
    fresh = np.flatnonzero(loop_roots == 0)
    if len(fresh):
        keys_f = [keys[i] for i in fresh.tolist()]
        payloads = encode_payloads(keys_f, [values[i] for i in fresh.tolist()], timestamps[fresh])
        roots[fresh], ids[fresh] = _persist(
            persister, part, payloads, offsets[fresh], *key_hashes(keys_f)
        )
    looped = np.flatnonzero(loop_roots)
    new = new_ids(len(looped))
    channel.xor(loop_roots[looped], loop_ids[looped] ^ new)
    roots[looped], ids[looped] = to_signed(loop_roots[looped]), to_signed(new)
    return roots, ids


def _spark_key_hashes(keys: Sequence[bytes | None]) -> tuple[NDArray[np.int64], NDArray[np.bool_]]:
    """spark-hash replays by portable_hash of the key, for which None is a key too."""
    return spark_key_hashes(keys), np.ones(len(keys), dtype=np.bool_)


def _persist(
    persister: Persister,
    part: FTKafkaPartition,
    payloads: list[bytes],
    offsets: NDArray[np.int64],
    hashes: NDArray[np.int64],
    has_key: NDArray[np.bool_],
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Persist one polled chunk in PERSIST frames of about 16 MiB of payloads (a frame
    holds at most 64 MiB); returns the (ft_root, ft_id) columns once the FT layer
    confirmed every frame."""
    sizes = np.fromiter(map(len, payloads), dtype=np.int64, count=len(payloads))
    frame_of = np.cumsum(sizes) // _PERSIST_CHUNK_BYTES
    bounds = [0, *(np.flatnonzero(np.diff(frame_of)) + 1).tolist(), len(payloads)]
    roots: list[NDArray[np.uint64]] = []
    ids: list[NDArray[np.uint64]] = []
    for lo, hi in itertools.pairwise(bounds):
        anchors = persister.persist(
            payloads[lo:hi],
            topics=part.topic,
            partitions=part.partition,
            offsets=offsets[lo:hi],
            key_hashes=hashes[lo:hi],
            has_key=has_key[lo:hi],
        )
        roots.append(anchors.roots)
        ids.append(anchors.ids)
    return to_signed(np.concatenate(roots)), to_signed(np.concatenate(ids))


def _arrow_batch(
    arrow_schema: Any,
    keys: Any,
    values: Any,
    topics: Any,
    partitions: Any,
    offsets: Any,
    timestamps_ms: NDArray[np.int64],
    anchors: tuple[Any, Any] | None,
) -> Any:
    columns = [
        keys,
        values,
        pa.array(topics, type=pa.string()),
        pa.array(np.asarray(partitions, dtype=np.int32), type=pa.int32()),
        pa.array(np.asarray(offsets, dtype=np.int64), type=pa.int64()),
        pa.array(timestamps_ms * 1000, type=pa.timestamp("us", tz="UTC")),
    ]
    if anchors is not None:
        columns += [pa.array(anchors[0], type=pa.int64()), pa.array(anchors[1], type=pa.int64())]
    return pa.RecordBatch.from_arrays(columns, schema=arrow_schema)


def _read_kafka(options: SourceOptions, part: FTKafkaPartition) -> Iterator[_Chunk]:
    """Kafka [start, end) of one partition, in polled chunks of (keys, values, offsets,
    timestamps in ms, headers). SourceError if no record arrives for pollTimeoutMs."""
    if part.end <= part.start:
        return
    timeout_ms = int(options.poll_timeout_s * 1000)
    config: dict[str, Any] = {
        "bootstrap_timeout_ms": min(timeout_ms, 30_000),
        "fetch_max_bytes": _FETCH_MAX_BYTES,
        "max_partition_fetch_bytes": _PARTITION_FETCH_MAX_BYTES,
        "max_poll_records": _MAX_POLL_RECORDS,
        "fetch_max_wait_ms": 100,
        **options.kafka_config,
    }
    where = f"{part.topic}-{part.partition} [{part.start}, {part.end})"
    try:
        consumer = _new_consumer(options.bootstrap, config)
    except KafkaError as exc:
        raise SourceError(
            f"cannot reach Kafka at {options.bootstrap} to read {where}: {exc!r}"
        ) from exc
    try:
        tp = TopicPartition(part.topic, part.partition)
        consumer.assign([tp])
        consumer.seek(tp, part.start)
        position = part.start
        last_progress = time.monotonic()
        while position < part.end:
            polled = consumer.poll(timeout_ms=int(_POLL_SECONDS * 1000))
            records = [r for r in polled.get(tp, ()) if r.offset < part.end]
            # Offsets may have gaps (compaction, transaction markers): go by position.
            new_position = int(consumer.position(tp))
            if records or new_position > position:
                last_progress = time.monotonic()
            position = max(position, new_position)
            if records:
                if records[0].offset < part.start:  # paranoid: seek must not go back
                    raise SourceError(f"Kafka returned offset {records[0].offset} for {where}")
                keys = [r.key for r in records]
                values = [r.value for r in records]
                offsets = np.fromiter((r.offset for r in records), np.int64, len(records))
                stamps = np.fromiter((r.timestamp for r in records), np.int64, len(records))
                yield keys, values, offsets, stamps, [r.headers for r in records]
            elif time.monotonic() - last_progress > options.poll_timeout_s:
                raise SourceError(
                    f"reading {where} from Kafka at {options.bootstrap}: nothing arrived "
                    f"for {options.poll_timeout_s:.1f} s (kafkaConsumer.pollTimeoutMs) at "
                    f"offset {position}"
                )
    except KafkaError as exc:
        raise SourceError(f"reading {where} from Kafka at {options.bootstrap}: {exc!r}") from exc
    finally:
        consumer.close(autocommit=False)
