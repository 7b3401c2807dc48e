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
timestamp (timestamp), and with FT on `ft_root` and in tree mode `ft_id` (LongType: the
u64 root and record id of the row's anchor, as int64 bits; a barrier-mode row has no
record id: see `ftlayer.integration.ftcolumns`), and under `ft.replayColumn`
`ft_replay` (boolean: the row is a replayed record).
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

With an FT layer of several shards (`ft.address` HOST:PORT,HOST:PORT,..., in shard
order; .cluster) `replay` is a list, a cursor per shard (each numbers its own
replays), and the batch takes in S.replay[i] < seq <= E.replay[i] of every shard i::

    {"kafka": {"orders": {"0": 120, "1": 98}}, "replay": [42, 17]}

A query keeps the shards it started with: offsets with another number of cursors
than ft.address has shards are a ConfigError. With FT on, the offsets also name the
store each cursor counts in, `"stores": [...]`, one STATUS `store_id` per shard: a
shard that answers with another store lost its data dir, and the next batch moves its
partitions back to their committed group offsets (a batch whose end offset of a
partition is below its start reads nothing of it) and takes in none of its replays
(.rewind).

A batch has one input partition per (topic, Kafka partition), always listed, in the
order of `subscribe` and then by partition; for one topic the Spark input partition
index is the Kafka partition. The input partition of (topic, p) reads Kafka [S, E) of
(topic, p), then the replays its topic's replay partitioner routed to partition p:
`fetch_replay(S.replay, E.replay, source_id, p)` (of each shard, with several). In
barrier mode the planner fetches them, once per shard and source right after the
batch's barrier, and hands each input partition its rows (.given: the plan carries
at most 4 MiB of them; beyond that, or from a shard whose fetch failed, each reader
fetches its own). A replayed record thus re-enters in a later batch, in the input
partition its partitioner chose, with its original topic, partition, offset, key,
value and timestamp, under a new root.

## What read() does, per input partition (on an executor)

1. Read Kafka [start, end) of the partition with kafka-python (assign/seek, large fetch
   sizes). If no record arrives for `kafkaConsumer.pollTimeoutMs`, fail with
   SourceError naming the partition and how far it got: never a hang.
2. FT on: persist each polled chunk, in pieces of at most 10,000 records
   (`PERSIST_PIECE_RECORDS`: Spark's steps downstream work on one piece while the next
   is persisted), through this process's shared BatchingChannel (`Persister.persist`,
   which returns only once the FT layer confirmed), and only then yield it as a
   pyarrow.RecordBatch. Two threads of the reader's own keep the wait short: one
   fetches and decodes the next chunks, one persists the next piece while this one is
   handed to Spark (at most one persisted piece waits to be yielded). Each record is
   stored with a compact payload (`encode_payloads`: key or null, value or null,
   timestamp), its Kafka coordinates, and its key hash (Kafka's murmur2;
   `portable_hash` under `spark-hash`).
   A record that a loop sink fed back (Kafka header `ftlayer-anchor`, see
   integration.sinks) is not persisted: its tree's source record is. It is emitted
   under the root in its header with a fresh id, and one XOR event acks the id it was
   in transit under and anchors the fresh one, so the tree goes on.
   A batch range (barrier mode, `ft.persist=reference`; tree mode too with
   `ft.treeRanges`) persists nothing: each polled chunk is yielded whole as it comes,
   as with FT off, its rows under range roots (ftlayer.rangeroots) that name their
   records by offset. A tree-mode range's read first announces a random seed
   (RANGE_READ), and each row's `ft_id` is its emission id under it
   (ftlayer.core.rangeacks): a read again (a retried task, a batch computed twice)
   starts the records' trees over under its own seed.
3. FT on: take this partition's replays (handed over by the planner, or fetched),
   send each one's emission XOR event
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
ListOffsets(latest), which Tansu answers short of the end; the fetched batch is not
decoded (`.columnar.probe_consumer`): with kafka-python's decoding, and its poll()
waiting out its timeout, each look took 55 ms and 5 ms of CPU, now about 3 ms and 2.
An idle query looks at most every idleProbeIntervalMs (Spark asks every
spark.sql.streaming.pollingDelay, 10 ms). The replay cursor comes from
the FT layer's status (`replay_cursors`, per source). A partition added to a topic
while the query runs enters one batch later, from its earliest offset. Calls to Kafka
and the FT layer are retried with doubling backoff and then fail with SourceError: an
unreachable broker or FT layer is an error within seconds, not a hang.

`maxOffsetsPerTrigger` caps the Kafka records of a batch, split over partitions in
proportion to their backlog: exactly that many when more wait (where Spark's Kafka
source rounds each share down and leaves the difference to a batch of a few records of
its own), and, as there, at least one record for each partition with a backlog, so a
batch may exceed the cap by fewer records than there are partitions. It also caps the
number of replay seqs a batch takes in.

`ft.maxPendingRecords` (FT on) is flow control per source (and per shard), as Storm's
max.spout.pending: a batch takes in new Kafka records of a topic only while its
source's pending trees (in flight, or replays waiting to be read; STATUS
`pending_by_source`, read with the replay cursor) plus those records stay within the
limit. Replays are always taken in. See `driver.py` and docs/user-guide.md section 6.7.

`ft.heartbeatMs` (FT on): from a batch's barrier until Spark asks for the next batch
(or the query stops), the driver's heartbeat thread keeps a lease on the running batch
in the FT layer, which meanwhile does not time out the batch's trees: a batch slower
than the tree timeout costs no replays. When the driver dies mid-batch, the heartbeats
stop and those trees wait for the source's next barrier (the restarted query runs the
batch again, and that run completes them), timing out only if none comes within the
server's `--lapsed-batch-timeout-s` (ftlayer.core.leases); a source stopped cleanly
sends a zero lease, and its trees time out as usual (heartbeat.py).

## Options

Declared once, with their types, defaults and meaning, in `OPTIONS` of
`ftlayer.integration.source.options` (docs/user-guide.md section 3.1 shows the same
table). Every bad option raises ConfigError naming the option and the value, on the driver:
option syntax at `load()` (in `schema()`), what needs the broker (a topic or partition
that does not exist) when the query starts, before any batch.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from ftlayer.errors import ConfigError, SourceError
from ftlayer.integration.ftcolumns import (
    COMPLETION_METADATA,
    HEADERS_TYPE,
    ID_COLUMN,
    REPLAY_COLUMN,
    ROOT_COLUMN,
)
from ftlayer.position import KafkaOffsets, Position

from .driver import Offset, SourceDriver
from .ingest import IngestDriver
from .options import SourceOptions, parse_options
from .reader import FTKafkaPartition, read_partition
from .rewind import replay_bounds, same_stores

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = [
    "FTIngestDataSource",
    "FTKafkaDataSource",
    "FTKafkaPartition",
    "FTKafkaStreamReader",
    "SourceError",
    "parse_options",
    "register",
    "source_schema",
]


def source_schema(
    ft_on: bool,
    include_headers: bool = False,
    completion: str = "tree",
    replay_column: bool = False,
) -> StructType:
    """The rows of an ftkafka source: the Kafka record (with its headers under
    includeHeaders), and its anchor with FT on (and `ft_replay` under ft.replayColumn).
    In barrier mode the anchor is `ft_root` alone, whose metadata says so
    (COMPLETION_METADATA): a wrapper or sink downstream knows it has nothing to ack."""
    fields = [
        StructField("key", BinaryType()),
        StructField("value", BinaryType()),
        StructField("topic", StringType()),
        StructField("partition", IntegerType()),
        StructField("offset", LongType()),
        StructField("timestamp", TimestampType()),
    ]
    if include_headers:
        fields.append(StructField("headers", HEADERS_TYPE))
    if ft_on:
        if completion == "tree":
            fields += [StructField(ROOT_COLUMN, LongType()), StructField(ID_COLUMN, LongType())]
        else:
            metadata = {COMPLETION_METADATA: completion}
            fields.append(StructField(ROOT_COLUMN, LongType(), metadata=metadata))
        if replay_column:
            fields.append(StructField(REPLAY_COLUMN, BooleanType(), nullable=False))
    return StructType(fields)


class FTKafkaDataSource(DataSource):
    """`spark.readStream.format("ftkafka")`; see the module docstring."""

    ingest = False

    @classmethod
    def name(cls) -> str:
        return "ftkafka"

    def schema(self) -> StructType:
        # Spark calls this at load(): every option is checked here, before any query.
        options = parse_options(self.options, ingest=self.ingest)
        return source_schema(
            options.ft_on, options.include_headers, options.completion, options.replay_column
        )

    def streamReader(self, schema: StructType) -> FTKafkaStreamReader:
        options = parse_options(self.options, ingest=self.ingest)
        expected = source_schema(
            options.ft_on, options.include_headers, options.completion, options.replay_column
        )
        if schema != expected:
            raise ConfigError(
                f"{self.name()}'s schema is fixed by its options: {expected.simpleString()}, "
                f"got {schema.simpleString()}"
            )
        return FTKafkaStreamReader(options, schema)


class FTIngestDataSource(FTKafkaDataSource):
    """`spark.readStream.format("ftingest")`: what receivers stored in the FT layer
    (.ingest)."""

    ingest = True

    @classmethod
    def name(cls) -> str:
        return "ftingest"


def register(spark: SparkSession) -> None:
    """Make `spark.readStream.format("ftkafka")` and `format("ftingest")` available in
    this session."""
    spark.dataSource.register(FTKafkaDataSource)
    spark.dataSource.register(FTIngestDataSource)


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
        self._driver: SourceDriver | None = None
        self._initial: Offset | None = None
        self._target: Offset | None = None
        self._available: Offset | None = None
        self._deferred_commit: Position | None = None
        self._completed: Position | None = None  # the last barrier this reader completed
        # (start, until): latestOffset found nothing new after `start`, and looks again
        # only once `until` (time.monotonic()) has passed (idleProbeIntervalMs).
        self._idle: tuple[Offset, float] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Only the configuration travels to executors, never driver connections.
        return {"options": self.options, "schema": self.schema}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._configure(state["options"], state["schema"])

    # ---- driver: offsets ----------------------------------------------------------

    def _driver_side(self) -> SourceDriver:
        if self._driver is None:
            kind = IngestDriver if self.options.ingest else SourceDriver
            driver = kind(self.options, self.source_ids)
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
        driver = self._driver_side()
        if self.options.ft_on and self.options.persist == "reference":
            # Records that failed by reference (a batch range's) are routed for replay
            # once their bytes are in: copied now, the failures of the runs before are
            # among the replays this run reads, as stored ones are.
            driver.fill_failed(sorted(set(driver.source_ids.values())))
        self._target = driver.available(None)

    def latestOffset(self, start: Offset, limit: ReadLimit) -> Offset:
        idle = self._idle
        if idle is not None and start == idle[0] and time.monotonic() < idle[1]:
            return start  # idle, and looked less than idleProbeIntervalMs ago
        self._idle = None
        driver = self._driver_side()
        driver.batch_done()  # Spark asks for the next batch only once the last one is done
        self._complete_deferred()  # only if no batch was planned after the last commit
        driver.deliver_dead_letters()
        available = driver.available(start)
        if self._target is not None:
            available = _cap(available, self._target, start)
        self._available = available
        max_rows = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        end = driver.limited(start, available, max_rows)
        if start is not None and driver.parse(end) == driver.parse(start):
            self._complete_start(driver, start)  # idle: no batch, so no commit() soon
            if self.options.idle_probe_s > 0:
                self._idle = (start, time.monotonic() + self.options.idle_probe_s)
        return end

    def reportLatestOffset(self) -> Offset | None:
        return self._available

    def partitions(self, start: Offset, end: Offset) -> Sequence[FTKafkaPartition]:
        driver = self._driver_side() if self.options.ft_on else None
        parse = Position.parse if driver is None else driver.parse
        first, barrier = parse(start), parse(end)
        replay_lo, replay_hi = replay_bounds(first, barrier)
        parts: list[FTKafkaPartition] = []
        busy = any(hi > lo for lo, hi in zip(replay_lo, replay_hi, strict=True))
        for topic in self.options.topics:
            ends = barrier.kafka.get(topic, {})
            for p in sorted(ends):
                hi = ends[p]
                # A partition new in this batch starts empty, and so does one whose end is
                # below its start: its shard lost its store, it goes back (.rewind).
                lo = min(first.offset(topic, p, hi), hi)
                busy |= hi > lo
                parts.append(
                    FTKafkaPartition(topic, p, lo, hi, self.source_ids[topic], replay_lo, replay_hi)
                )
        if driver is not None and barrier.cursors is not None:
            # Spark logged `end` before planning the batch: it is barrier n. One request
            # per shard begins it: by range, the batch's records are one offset range
            # per partition, stored by the FT layer before any row of them is emitted;
            # the commit of batch n - 1, which Spark made just before, completes first;
            # in barrier mode its replays come back, fetched once for every partition
            # (after the barrier: a replay's hold belongs to the batch running when it
            # is fetched).
            done, self._deferred_commit = self._deferred_commit, None
            parts, answers = driver.begin_batch(parts, barrier, done)
            if answers.answered:  # the batch is open: its timeouts follow heartbeats
                driver.batch_running()
            if done is not None:
                self._commit_group(driver, answers.completed_offsets())
        return parts if busy else []

    def commit(self, end: Offset) -> None:
        # Spark calls this once batch `end` is done, one batch late: the batch never
        # runs again. The FT layer completes (or starts aligning) its checkpoint,
        # drops the replay queue entries the batch took in (per source: other queries'
        # entries stay) and answers the group offsets the checkpoint allows (never past
        # an incomplete record); with kafka.group.id they are committed. Spark plans
        # the next batch right after this call (partitions()), so with FT on the
        # completion rides on that batch's CHECKPOINT_BEGIN: one round trip for both.
        driver = self._driver_side()
        position = driver.parse(end)
        if self.options.ft_on and position.cursors is not None:
            self._deferred_commit = position
            return
        self._commit_group(driver, position.offsets())

    def _complete_deferred(self) -> None:
        """Complete a deferred commit on its own (no batch was planned after it)."""
        done, self._deferred_commit = self._deferred_commit, None
        if done is not None:
            driver = self._driver_side()
            self._commit_group(driver, driver.checkpoint(done, begin=False).commit_offsets())

    def _complete_start(self, driver: SourceDriver, start: Offset) -> None:
        """Spark asks for the next batch only once the batch that ends at `start` is
        done (its commit-log entry written), but it calls commit() for that batch only
        when it plans the next one: on a stream gone idle, the last batch's checkpoint
        would wait for new data, and so would the group offsets (say, past records
        dead-lettered in that batch). Complete it now, once (the FT layer answers a
        second completion of one barrier with the same checkpoint)."""
        if not self.options.ft_on:
            return
        position = driver.parse(start)
        if position.cursors is None or position == self._completed:
            return
        self._completed = position
        self._commit_group(driver, driver.checkpoint(position, begin=False).commit_offsets())

    def _commit_group(self, driver: SourceDriver, offsets: KafkaOffsets | None) -> None:
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
            # Spark hands back the partitions planPartitions made: another is a bug, not input.
            raise TypeError(f"ftkafka cannot read {partition!r}")
        return read_partition(self.options, self.schema, partition)


def _cap(available: Offset, target: Offset, start: Offset) -> Offset:
    """`available` no further than `target` (Trigger.AvailableNow's fixed end), and
    never behind `start`: Spark fixes the target before it asks for the initial offset,
    so with startingOffsets=latest the start may already be past the target. A
    partition `available` puts behind `start` goes back (its shard lost its store,
    .rewind) and stays so; a cursor of another store than the target's or the start's
    is not capped by theirs."""
    now, goal, begin = (Position.parse(p, sharded=True) for p in (available, target, start))
    kafka = now.offsets()
    for topic, partitions in kafka.items():
        for p, end in partitions.items():
            # A partition the target does not know appeared later: it sits at its
            # earliest offset (see SourceDriver.available), with nothing to read.
            capped = min(end, goal.offset(topic, p, end))
            if end >= begin.offset(topic, p, end):
                partitions[p] = max(capped, begin.offset(topic, p, capped))
    cursors = now.cursors
    if cursors is not None and goal.cursors is not None:
        cursors = tuple(
            max(min(at, most) if to_goal else at, least) if from_start else at
            for at, most, least, to_goal, from_start in zip(
                cursors,
                goal.cursors,
                begin.cursors or (0,) * len(cursors),
                same_stores(goal, now),
                same_stores(begin, now),
                strict=True,
            )
        )
    return Position.at(kafka, cursors, now.stores).to_json()
