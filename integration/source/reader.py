"""The executor side of the ftkafka source: read() of one input partition.

`FTKafkaPartition` is what the driver plans and Spark ships to an executor: Kafka
[start, end) of one (topic, partition) and the replays its source's partitioner routed
there with replay_lo < seq <= replay_hi (of each shard, with an FT layer of several:
a record's replay is queued by the shard that holds the record, whichever partition it
is routed to). `read_partition` reads the Kafka range, persists every polled chunk in
the FT layer before it yields it, then yields the partition's replays (the steps are
in ftlayer.integration.source's docstring, "What read() does"). Kafka records arrive as
columns (`.columnar`: the reader decodes kafka-python's fetches itself, with
kafka-python's own decoding for what it leaves alone), so a chunk's keys, values,
offsets and timestamps reach the Arrow batch without a Python object per record.
Nothing here imports the FT layer's core or storage: an executor talks to the FT layer
through its process's shared channel only (ftlayer.integration.ftcolumns.Channel).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray
from pyspark.sql.datasource import InputPartition
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import StructType

from ftlayer import rangeroots
from ftlayer.acking.handlers import Persister
from ftlayer.acking.ids import new_ids
from ftlayer.causes import Cause, FailKind
from ftlayer.client.sharded import ShardedChannel
from ftlayer.integration.ftcolumns import (
    ID_COLUMN,
    LOOP_HEADER,
    Channel,
    read_loop_headers,
    to_signed,
)
from ftlayer.partitioners import (
    kafka_key_hashes,
    spark_key_hashes,
)
from ftlayer.payloads import decode_payloads, encode_payload_columns, encode_payloads, headers_array
from ftlayer.records import Payloads, ReplayRecords

from .columnar import RecordColumns
from .kafkaread import read_kafka, user_headers
from .options import SourceOptions

log = logging.getLogger("ftlayer.source")

T = TypeVar("T")

SOURCE_EXPIRED: Final = Cause(
    FailKind.SOURCE_EXPIRED, "ftkafka", "Kafka no longer has the record", final=True
)

# A PERSIST frame is at most 64 MiB: persist in chunks well below that.
_PERSIST_CHUNK_BYTES: Final = 16 * 1024 * 1024
# FT on, a polled chunk is persisted and yielded in pieces of at most this many
# records: Spark's steps downstream (other processes) work on piece k while piece k + 1
# is persisted, instead of waiting for the persist of a whole poll (up to
# _MAX_POLL_RECORDS) before their first row. Spark's own Arrow batches downstream are
# 10,000 rows (spark.sql.execution.arrow.maxRecordsPerBatch).
PERSIST_PIECE_RECORDS: Final = 10_000


class FTKafkaPartition(InputPartition):
    """One input partition of a batch: Kafka [start, end) of (topic, partition), and the
    replays of its source routed to `partition` with replay_lo < seq <= replay_hi, on
    each shard of the FT layer (a number: the cursor of an FT layer of one shard; a
    sequence: one per shard, in shard order). `range_number`: the FT layer's number of
    [start, end) as a batch range (ft.persist=reference): its rows carry range roots
    and nothing is persisted (0: none, each record is persisted). `given`:
    per shard, the replays the planner fetched for this partition (None: the reader
    fetches that shard's; integration.source.given)."""

    def __init__(
        self,
        topic: str,
        partition: int,
        start: int,
        end: int,
        source_id: int,
        replay_lo: int | Sequence[int],
        replay_hi: int | Sequence[int],
        range_number: int = 0,
        given: Sequence[ReplayRecords | None] | None = None,
    ) -> None:
        super().__init__((topic, partition))
        self.topic = topic
        self.partition = partition
        self.start = start
        self.end = end
        self.source_id = source_id
        self.replay_lo = (replay_lo,) if isinstance(replay_lo, int) else tuple(replay_lo)
        self.replay_hi = (replay_hi,) if isinstance(replay_hi, int) else tuple(replay_hi)
        if len(self.replay_lo) != len(self.replay_hi):
            raise ValueError(f"replay cursors of different shards: {replay_lo}, {replay_hi}")
        self.range_number = range_number
        self.given = None if given is None else tuple(given)

    def with_range(self, range_number: int) -> FTKafkaPartition:
        """This input partition with the FT layer's number of its batch range."""
        return self._with(range_number, self.given)

    def with_given(
        self, given: Sequence[Mapping[tuple[int, int], ReplayRecords] | None]
    ) -> FTKafkaPartition:
        """This input partition with the replays the planner fetched for it: per shard,
        the rows by (source id, partition), None for a shard its reader fetches."""
        key = (self.source_id, self.partition)
        mine = [None if rows is None else rows.get(key) for rows in given]
        return self._with(self.range_number, mine)

    def _with(
        self, range_number: int, given: Sequence[ReplayRecords | None] | None
    ) -> FTKafkaPartition:
        return FTKafkaPartition(
            self.topic,
            self.partition,
            self.start,
            self.end,
            self.source_id,
            self.replay_lo,
            self.replay_hi,
            range_number,
            given,
        )

    def given_for(self, shard: int) -> ReplayRecords | None:
        """The replays of `shard` the planner fetched for this partition, or None."""
        return None if self.given is None or shard >= len(self.given) else self.given[shard]

    def replays(self) -> list[tuple[int, int, int]]:
        """(shard, lo, hi) of each shard with replays to take in: lo < replay seq <= hi."""
        return [
            (shard, lo, hi)
            for shard, (lo, hi) in enumerate(zip(self.replay_lo, self.replay_hi, strict=True))
            if hi > lo
        ]

    def __repr__(self) -> str:
        lo, hi = self.replay_lo, self.replay_hi
        return (
            f"FTKafkaPartition({self.topic}-{self.partition} [{self.start}, {self.end}) "
            f"replay ({lo[0] if len(lo) == 1 else lo}, {hi[0] if len(hi) == 1 else hi}]"
            + (f" range {self.range_number})" if self.range_number else ")")
        )


KeyHashes = Callable[[Sequence[bytes | None]], tuple[NDArray[np.int64], NDArray[np.bool_]]]
Anchored = tuple[
    RecordColumns,
    "list[list[tuple[str, bytes | None]]] | None",
    "tuple[NDArray[np.int64], NDArray[np.int64]] | None",
]
"""A chunk, its kept user headers, and its (ft_root, ft_id) columns."""


def read_partition(
    options: SourceOptions, schema: StructType, part: FTKafkaPartition
) -> Iterator[Any]:
    """read() of one input partition: see "What read() does" in the module docstring."""
    arrow_schema = to_arrow_schema(schema, timezone="UTC")
    channel = options.ft.channel() if options.ft_on else None
    barrier = options.completion == "barrier"
    persister = (
        None
        if channel is None
        else Persister(channel, source_id=part.source_id, barrier=barrier, shards=options.ft.shards)
    )
    loop_secret = options.ft.loop_secret  # derived once per partition, not per chunk
    key_hashes: KeyHashes = (
        _spark_key_hashes if options.partitioner == "spark-hash" else kafka_key_hashes
    )
    mark_replays = options.replay_column and persister is not None  # the ft_replay column
    by_reference = options.persist == "reference"  # where each record is, not its bytes
    ranged = persister is not None and part.range_number > 0  # nothing persisted at all
    # Steps 1 and 2: the Kafka range, each chunk persisted before it is yielded. With FT
    # on, a thread fetches and decodes the next chunks while another persists the next
    # piece, and this generator yields pieces whose persist was confirmed: the FT
    # layer's fsync of piece k + 1 overlaps the hand-over of piece k to Spark. A batch
    # range persists nothing (but a looped record), so it has no wait to overlap: its
    # chunks go as FT off's do, whole (a read-ahead thread and 10,000-record pieces
    # cost it 0.12 us of CPU per record, about a third of the reader's).
    chunks = read_kafka(options, part)
    seed = _RangeSeed(channel, part) if ranged and not barrier and channel is not None else None
    anchoring = _Anchoring(
        options, part, persister, channel, key_hashes, loop_secret, by_reference, ranged, seed
    )
    pieces = (
        anchoring.each(chunks)
        if persister is None or ranged
        else _prefetched(anchoring.each(_pieces(_prefetched(chunks))), depth=1)
    )
    for chunk, kept, anchors in pieces:
        n = len(chunk)
        yield _arrow_batch(
            arrow_schema,
            chunk.keys,
            chunk.values,
            _repeated(part.topic, n),
            np.full(n, part.partition, dtype=np.int32),
            chunk.offsets,
            chunk.timestamps,
            headers_array(kept) if kept is not None and options.include_headers else None,
            anchors,
            False if mark_replays else None,
        )
    if channel is None or persister is None:
        return
    # Step 3: this partition's replays (of each shard), emitted again under their
    # replay roots.
    for shard, lo, hi in part.replays():
        given = part.given_for(shard)
        if given is not None:  # fetched by the planner (integration.source.given)
            replay = given
        elif isinstance(channel, ShardedChannel):
            replay = channel.fetch_replay(shard, lo, hi, part.source_id, part.partition)
        else:
            replay = channel.fetch_replay(lo, hi, part.source_id, part.partition)
        if len(replay) and replay.records.any_references:
            replay = _read_back(options, channel, replay)
        if len(replay):
            records = replay.records
            emitted = persister.emit_replays(records.roots)
            keys_r, values_r, timestamps_r, headers_r = decode_payloads(records.payloads)
            yield _arrow_batch(
                arrow_schema,
                keys_r,
                values_r,
                records.topics,
                replay.partitions if options.ingest else records.partitions,
                records.offsets,
                timestamps_r,
                headers_array(headers_r) if options.include_headers else None,
                (to_signed(emitted.roots), to_signed(emitted.ids)),
                True if mark_replays else None,
            )
    # Step 4: the emission events of the replays (and anything else buffered) go now.
    channel.flush()


@dataclass(frozen=True)
class _Anchoring:
    """Step 2 of read(): a chunk's (ft_root, ft_id) columns, its records persisted
    first where they must be."""

    options: SourceOptions
    part: FTKafkaPartition
    persister: Persister | None
    channel: Channel | None
    key_hashes: KeyHashes
    loop_secret: bytes | None
    by_reference: bool
    ranged: bool
    seed: _RangeSeed | None
    """Tree mode by range: this read's seed of its rows' ids; None: barrier mode, or no
    range."""

    def each(self, chunks: Iterator[RecordColumns]) -> Generator[Anchored, None, None]:
        """Each chunk, its user headers kept (or None) and its FT columns (None: FT
        off); closing this closes `chunks` (a read-ahead thread below stops with it)."""
        keeps = self.options.keeps_headers
        try:
            for chunk in chunks:
                kept = user_headers(chunk.header_lists()) if keeps else None
                yield chunk, kept, self.anchors(chunk, kept)
        finally:
            if isinstance(chunks, Generator):
                chunks.close()

    def anchors(
        self, chunk: RecordColumns, kept: list[list[tuple[str, bytes | None]]] | None
    ) -> tuple[NDArray[np.int64], NDArray[np.int64]] | None:
        n = len(chunk)
        if self.persister is None or self.channel is None:
            return None
        if self.ranged and chunk.headers is None:
            return self._range_anchors(chunk)
        if chunk.headers is None:
            # The usual chunk: no record has a Kafka header, so none was looped, and
            # every record starts a tree; its payloads are built column-wise (none by
            # reference: the FT layer stores where each record is).
            columns = (
                _no_payloads(n)
                if self.by_reference
                else encode_payload_columns(chunk.keys, chunk.values, chunk.timestamps)
            )
            hashes = _key_hashes_of(chunk.keys, self.key_hashes)
            return _persist(
                self.persister, self.part, columns, chunk.offsets, *hashes, self.by_reference
            )
        keys, values = chunk.keys.to_pylist(), chunk.values.to_pylist()
        loop_roots, loop_ids, refused = read_loop_headers(chunk.headers, self.loop_secret)
        if refused:
            log.warning(
                "%d records of %s-%d carry an %s header that is not signed with this "
                "pipeline's loop key (copied or forged): each starts a tree of its own",
                refused, self.part.topic, self.part.partition, LOOP_HEADER,
            )  # fmt: skip
        if self.ranged and not loop_roots.any():
            return self._range_anchors(chunk)
        if not loop_roots.any():  # no loop record: every record starts a tree
            payloads = (
                _no_payloads(n)
                if self.by_reference
                else encode_payloads(keys, values, chunk.timestamps, kept)
            )
            return _persist(
                self.persister,
                self.part,
                payloads,
                chunk.offsets,
                *self.key_hashes(keys),
                self.by_reference,
            )
        return _persist_or_continue(
            self.persister,
            self.channel,
            self.part,
            self.key_hashes,
            keys,
            values,
            chunk.offsets,
            chunk.timestamps,
            kept,
            loop_roots,
            loop_ids,
            self.by_reference,
            self.part.range_number,
            self.seed,
        )

    def _range_anchors(self, chunk: RecordColumns) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """A batch range's chunk (by reference): the FT layer has the range; each row's
        root names its record by its offset (ftlayer.rangeroots), and in tree mode its
        id is its emission id, which the FT layer computes too."""
        roots = rangeroots.encode(self.part.range_number, self.part.start, chunk.offsets)
        return to_signed(roots), _range_ids(self.seed, roots)


def _read_back(options: SourceOptions, channel: Channel, replay: ReplayRecords) -> ReplayRecords:
    """Replays fetched before their source copied their bytes into the FT layer (stored
    by reference): read from Kafka at their coordinates. Those Kafka no longer has
    fail, final (`source-expired`: dead letters) and are not emitted."""
    from .refetch import read_at  # only when a replay lacks its bytes

    records = replay.records
    rows = np.flatnonzero(records.reference_mask)
    found, payloads, _ = read_at(options, records.take(rows))
    if not found.all():
        gone = rows[~found]
        channel.fail(records.roots[gone], SOURCE_EXPIRED)
        log.warning(
            "%d replayed records are no longer in Kafka (retention, compaction or a "
            "deleted topic): dead letters with the cause source-expired",
            len(gone),
        )
    records = records.with_payloads(
        rows[found], [p for p, f in zip(payloads, found, strict=True) if f]
    )
    keep = np.ones(len(records), dtype=np.bool_)
    keep[rows[~found]] = False
    replay = ReplayRecords(replay.replay_seqs, replay.partitions, records)
    return replay if keep.all() else replay.take(np.flatnonzero(keep))


def _pieces(chunks: Iterator[RecordColumns]) -> Generator[RecordColumns, None, None]:
    """Each chunk in pieces of at most PERSIST_PIECE_RECORDS records (slices: no copy)."""
    for chunk in chunks:
        n = len(chunk)
        if n <= PERSIST_PIECE_RECORDS:
            yield chunk
            continue
        for lo in range(0, n, PERSIST_PIECE_RECORDS):
            yield chunk.slice(lo, min(n, lo + PERSIST_PIECE_RECORDS))


def _prefetched(chunks: Generator[T, None, None], depth: int = 2) -> Generator[T, None, None]:
    """`chunks`, taken ahead by a thread of its own (at most `depth` items waiting):
    the Kafka fetch and decode of chunk k+1 runs while chunk k's persist waits for the
    FT layer's fsync (a socket wait, which releases the GIL), and the persist of piece
    k+1 while piece k is handed to Spark. An error of the thread is raised here, where
    the item it failed at would have been taken; closing this generator early stops
    the thread and closes `chunks` (and with it the consumer)."""
    slots: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: tuple[str, Any]) -> bool:
        while not stop.is_set():
            try:
                slots.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def pump() -> None:
        try:
            for chunk in chunks:
                if not put(("chunk", chunk)):
                    return
            put(("end", None))
        except BaseException as exc:  # handed to the reader, raised there
            put(("error", exc))
        finally:
            chunks.close()

    thread = threading.Thread(target=pump, name="ftkafka-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            kind, item = slots.get()
            if kind == "chunk":
                yield item
            elif kind == "error":
                raise item
            else:
                return
    finally:
        stop.set()
        thread.join(timeout=30)


def _persist_or_continue(
    persister: Persister,
    channel: Channel,
    part: FTKafkaPartition,
    key_hashes: KeyHashes,
    keys: list[bytes | None],
    values: list[bytes | None],
    offsets: NDArray[np.int64],
    timestamps: NDArray[np.int64],
    headers: list[list[tuple[str, bytes | None]]] | None,
    loop_roots: NDArray[np.uint64],
    loop_ids: NDArray[np.uint64],
    by_reference: bool,
    range_number: int = 0,
    seed: _RangeSeed | None = None,
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """The (ft_root, ft_id) columns of a chunk holding records a loop fed back (step 2):
    the others are persisted as new trees; a looped record starts none: one XOR event
    acks the id it was in transit under and anchors a fresh id under its root."""
    roots, ids = np.zeros(len(keys), np.int64), np.zeros(len(keys), np.int64)
    fresh = np.flatnonzero(loop_roots == 0)
    if len(fresh) and range_number:  # a batch range: the fresh records' range roots
        fresh_roots = rangeroots.encode(range_number, part.start, offsets[fresh])
        roots[fresh], ids[fresh] = to_signed(fresh_roots), _range_ids(seed, fresh_roots)
    elif len(fresh):
        keys_f = [keys[i] for i in fresh.tolist()]
        payloads = (
            _no_payloads(len(fresh))
            if by_reference
            else encode_payloads(
                keys_f,
                [values[i] for i in fresh.tolist()],
                timestamps[fresh],
                None if headers is None else [headers[i] for i in fresh.tolist()],
            )
        )
        roots[fresh], ids[fresh] = _persist(
            persister, part, payloads, offsets[fresh], *key_hashes(keys_f), by_reference
        )
    looped = np.flatnonzero(loop_roots)
    if range_number:  # these offsets are no records of the range: they run under a loop
        skipped = rangeroots.encode(range_number, part.start, offsets[looped])
        channel.xor(skipped, np.zeros(len(skipped), dtype=np.uint64))
    if persister.barrier:  # the transit is released; a barrier hold takes its place
        channel.hold(loop_roots[looped], loop_ids[looped])
        roots[looped] = to_signed(loop_roots[looped])  # ids stay 0
        return roots, ids
    new = new_ids(len(looped))
    channel.xor(loop_roots[looped], loop_ids[looped] ^ new)
    roots[looped], ids[looped] = to_signed(loop_roots[looped]), to_signed(new)
    return roots, ids


class _RangeSeed:
    """Tree mode by range: the seed of this read's row ids, drawn and announced to the
    FT layer (RANGE_READ, for the partition's whole range) before the first row is
    emitted: from then on only this read's rows can complete the range's records
    (ftlayer.core.rangeacks)."""

    def __init__(self, channel: Channel, part: FTKafkaPartition) -> None:
        self.channel, self.part, self.seed = channel, part, 0

    def ids(self, roots: NDArray[np.uint64]) -> NDArray[np.uint64]:
        if not self.seed:
            part = self.part
            first = rangeroots.encode(part.range_number, part.start, [part.start])
            seed = int(new_ids(1)[0])
            self.channel.read_range(int(first[0]), part.end - part.start, seed)
            self.seed = seed
        return rangeroots.emission_ids(self.seed, roots)


def _range_ids(seed: _RangeSeed | None, roots: NDArray[np.uint64]) -> NDArray[np.int64]:
    """The ft_id column of a batch range's rows: their emission ids under this read's
    seed in tree mode, 0 in barrier mode."""
    if seed is None:
        return np.zeros(len(roots), dtype=np.int64)
    return to_signed(seed.ids(roots))


def _no_payloads(n: int) -> Payloads:
    """The payloads of n records stored by reference: none."""
    return Payloads(b"", np.zeros(n, dtype=np.int64))


def _spark_key_hashes(keys: Sequence[bytes | None]) -> tuple[NDArray[np.int64], NDArray[np.bool_]]:
    """spark-hash replays by portable_hash of the key, for which None is a key too."""
    return spark_key_hashes(keys), np.ones(len(keys), dtype=np.bool_)


def _key_hashes_of(keys: Any, key_hashes: KeyHashes) -> tuple[NDArray[np.int64], NDArray[np.bool_]]:
    """The key hashes of a chunk's Arrow key column: none to compute for an unkeyed
    topic's chunk (every key null), which is the usual case."""
    n = len(keys)
    if keys.null_count == n:
        return np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.bool_)
    return key_hashes(keys.to_pylist())


def _persist(
    persister: Persister,
    part: FTKafkaPartition,
    payloads: Sequence[bytes],
    offsets: NDArray[np.int64],
    hashes: NDArray[np.int64],
    has_key: NDArray[np.bool_],
    by_reference: bool = False,
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Persist one polled chunk in PERSIST frames of about 16 MiB of payloads (a frame
    holds at most 64 MiB); returns the (ft_root, ft_id) columns once the FT layer
    confirmed every frame. `by_reference`: the payloads are empty, the records stored
    by reference."""
    sizes = (
        payloads.lengths
        if isinstance(payloads, Payloads)
        else np.fromiter(map(len, payloads), dtype=np.int64, count=len(payloads))
    )
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
            references=by_reference,
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
    headers: Any,
    anchors: tuple[Any, Any] | None,
    replayed: bool | None = None,
) -> Any:
    columns = [
        keys,
        values,
        topics if isinstance(topics, pa.Array) else pa.array(topics, type=pa.string()),
        pa.array(np.asarray(partitions, dtype=np.int32), type=pa.int32()),
        pa.array(np.asarray(offsets, dtype=np.int64), type=pa.int64()),
        pa.array(timestamps_ms * 1000, type=pa.timestamp("us", tz="UTC")),
    ]
    if headers is not None:
        columns.append(headers)
    if anchors is not None:  # a barrier-mode row has no record id (always 0): no ft_id
        columns.append(pa.array(anchors[0], type=pa.int64()))
        if ID_COLUMN in arrow_schema.names:
            columns.append(pa.array(anchors[1], type=pa.int64()))
    if replayed is not None:  # ft.replayColumn: every row of a batch alike
        columns.append(pa.array(np.full(len(timestamps_ms), replayed), type=pa.bool_()))
    return pa.RecordBatch.from_arrays(columns, schema=arrow_schema)


def _repeated(text: str, n: int) -> Any:
    """A string array of `n` times `text`, built from two buffers."""
    raw = text.encode("utf-8")
    offsets = np.arange(n + 1, dtype=np.int32) * np.int32(len(raw))
    return pa.Array.from_buffers(
        pa.string(), n, [None, pa.py_buffer(offsets), pa.py_buffer(raw * n)]
    )
