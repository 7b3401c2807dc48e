"""Sinks: a record is acked only once its write is done, and failed when the write failed.

A sink is the terminal task of a tree: acking a row XORs its id into its root (every
anchor of a multi-anchored row, see integration.tasks), and the root completes once
every branch of its tree has been acked. Both sinks here are functions for
`writeStream.foreachBatch` and do their FT work on the executors, vectorized per Arrow
batch, through each Python worker's shared BatchingChannel, flushed at the end of
each partition. Nothing but a per-partition count comes back to the driver.

`ft_foreach_batch(fn, settings)`: the user's foreachBatch function under FT.

0. Tree mode, rows straight from FTTasks map and filter steps over an ftkafka
   source: those steps send the acks of the rows they produce under a key of this
   call, held by the FT layer, and after `fn` the key is settled: acked when `fn`
   returned, failed when it raised (integration.sinkhold). Steps 1, 3 and 5 are
   skipped: nothing is cached or read back.
1. Persist the micro-batch DataFrame. Every computation of an FT task sends XOR
   events with fresh ids, so a batch computed twice (once by `fn`, once again for
   the acks, or by two actions inside `fn`) leaves its trees unbalanced: they would
   time out and be replayed for ever. The cache makes `fn` and the acks read one
   computation. A cached partition that is evicted and recomputed costs a timeout
   and a replay of its roots (a duplicate, never a loss). In barrier mode (the
   source's ft_root column says so) there is nothing to ack and tasks send no XOR
   events, so the batch is not cached: a second computation (to fail the roots when
   `fn` raised, or a second action inside `fn`) persists its records again under new
   roots, which the barrier completes or the failure replays.
2. Call `fn(batch without the FT columns, epoch_id)`.
3. If it returned: ack every row (the cached rows' FT columns, read on the driver).
4. If it raised: fail every root of the batch (they are replayed), then, with
   `on_error="fail-and-raise"` (the default), re-raise: the query stops, as Spark's own
   foreachBatch does, and nothing is lost. A sink that keeps failing (a bug, a
   broker down) must not spin silently through replays. With "fail-and-continue"
   the error is logged and the query goes on with the next batch; the replays bring
   the records back. If the roots cannot even be read (the batch's own computation
   is what failed), they are left to time out, which also replays them.
5. Unpersist.

The idempotent mode (`key=[columns]`), for exactly-once output where the sink allows
it. A *content key* names an output row: the same when the row is produced again, by
a replay or by a batch Spark runs again after a restart, and different for different
rows. Source coordinates (topic, partition, offset) plus an output index, or an event
id, are such keys; the ft_root and ft_id columns are not (a replay gets new ones).
`fn` then gets one row per key in the batch (`dropDuplicates` on the key), and must
write idempotently on the key: an upsert or an insert-if-absent (a database's primary
key, a document id, a compacted topic's key).
Every row of the batch is acked after `fn` returned, the dropped duplicates too (a
duplicate left unacked would time out and be replayed for ever). So a record written
and then replayed, because its ack was lost, its tree failed elsewhere, or the query
restarted before the batch was committed, is written again under the same key: the
sink's table holds each output once.

Acks on the driver: `settle` collects the cached FT columns with `toArrow()` (16
bytes per row, 24 and up for a multi-anchored row, into the driver; Spark converts
them to Arrow in the JVM, so the job needs no Python worker) and sends the events
through the driver's channel. A job over the cached rows running a Python function
(mapInArrow) on the executors, which the sink did before, sent the same events from
where the rows are, but costs a Python-worker job per micro-batch: measured on 2
cores, 0.2-0.4 s of CPU per batch against 0.06 s for `toArrow`, while computing and
sending the events is about 0.1 µs per row (docs/benchmarks.md, "Where FT on spends
its time at full speed"). A micro-batch's ids must then fit in the driver's memory
(16 MB per million rows).

`ft_kafka_sink(bootstrap_servers, topic, settings)`: writes the `key` (optional) and
`value` columns (binary or string) with a kafka-python producer tuned for throughput
(acks=all, linger 5 ms, 1 MB batches), one per partition: creating one is cheap next
to a partition's writes, and a producer shared across tasks would carry a fatal error
(a fenced idempotent producer, say) into every later batch. One job per micro-batch. Per Arrow
batch every row is sent, the producer flushed, and each row's future checked: a row
is acked only if the broker confirmed its write; a row whose write failed (send
raised, the broker answered an error, or the delivery timeout expired) has its roots
failed and replayed. When a send times out waiting for metadata or buffer space, the
rest of the batch is failed without trying, since each further send would wait as
long. Failures never fail the Spark task (a retried task would write the confirmed
rows twice); the sink reports them on the driver: with "fail-and-raise" it raises
`SinkError` after acking and failing, with "fail-and-continue" it logs. The same
partial-write rule holds when FT is off, except that a failed write always raises,
since nothing could replay the record.

A task that Spark retries after its worker died writes only the rows its dead attempt
had not written (`resume=True`, the default; integration.resume): each record carries
an `ftlayer-write` header naming the batch's write job, the Spark partition and the
row's index, and the retry reads back what the topic holds since the batch began and
skips each row written there with the same content. A skipped row counts as written
(acked in tree mode; `SinkResult.skipped` counts it). With FT on, a batch that Spark
runs again after a driver restart resumes the same way: the batch's write job and
start offsets are kept in the FT layer (SINK_MARK) under the query's id, the topic and
the batch id, and each task of the run again skips what the dead run wrote.

`ft_kafka_stream` (integration.kafkastream) runs the same partition function inside
the streaming query's plan, without resume, and observes its summary rows in each
batch's progress.

Loops (`ft_kafka_sink(..., loop=True)`, after FLIP-16): the sink writes into a topic
that a source of the same pipeline reads, and the records' trees go on across the
loop instead of completing. Each record gets a fresh in-transit id and the Kafka
header `ftlayer-anchor` (LOOP_HEADER: its root and that id, signed with the pipeline's
loop key, FTSettings.loop_secret; a header not signed with it starts a new tree at the
source, so a copied or forged header never lets a record flow untracked). Once the
broker confirmed
the write, one XOR event per row acks the row and anchors the record in transit; the
`ftkafka` source that reads it back persists nothing, acks the in-transit id and
emits the record under the same root with a fresh id. So a tree is tracked across
iterations and completes only when its last iteration is acked; a record in transit
at a barrier keeps its root pending, so it belongs to that checkpoint. A failed write
fails the row's root, and a failure anywhere in a later iteration replays the
original source record, which runs the loop again: state updated along the loop must
be idempotent on a content key (e.g. record id and iteration). Rows with several
anchors (from an aggregate) are refused (ConfigError).

FT off: `ft_foreach_batch` calls `fn` directly (no cache, no job, no connection) and
lets its errors propagate; the Kafka sink only writes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Final, Literal, cast, get_args

import numpy as np
import pyarrow as pa
from kafka import KafkaProducer
from kafka.errors import KafkaError, KafkaTimeoutError
from numpy.typing import NDArray
from pyspark.sql import DataFrame
from pyspark.sql.types import BinaryType, StringType

from ftlayer.acking.handlers import TaskHandler
from ftlayer.acking.ids import new_ids
from ftlayer.causes import Cause, FailKind
from ftlayer.client.sharded import ShardedChannel
from ftlayer.errors import ConfigError, FTLayerError

from .ftcolumns import (
    HEADERS_TYPE,
    LOOP_HEADER,
    FTSettings,
    completes_at_barrier,
    loop_header,
    missing_ft_columns,
)
from .resume import (
    WRITE_HEADER,
    ResumePoint,
    already_written,
    marked,
    resume_point,
    tag_prefix,
    written_before,
)
from .sinkhold import HOLD_PROPERTY, held_steps, hold_value, new_sink_key
from .tasks import EXTRA_ANCHORS_COLUMN, ft_columns_of, read_anchors

__all__ = [
    "DEFAULT_PRODUCER_CONFIG",
    "FTForeachBatch",
    "FTKafkaSink",
    "SinkError",
    "SinkOnError",
    "SinkResult",
    "ft_foreach_batch",
    "ft_kafka_sink",
    "settle",
]

log = logging.getLogger(__name__)

SinkOnError = Literal["fail-and-raise", "fail-and-continue"]

DEFAULT_PRODUCER_CONFIG: Final[Mapping[str, Any]] = {
    "client_id": "ftlayer-kafka-sink",
    "acks": "all",
    "linger_ms": 5,
    "batch_size": 1 << 20,
    "max_block_ms": 10_000,
    "request_timeout_ms": 15_000,
    "delivery_timeout_ms": 30_000,
    "bootstrap_timeout_ms": 10_000,
}
# Beyond the delivery timeout every future has resolved; the margin covers scheduling.
_FLUSH_MARGIN_S: Final = 5.0
_NO_PARENTS: Final = np.zeros(0, dtype=np.intp)
_SUMMARY_SCHEMA: Final = (
    "written long, failed long, error string, failed_by map<string,long>, skipped long"
)
"""One row per partition of a Kafka sink's write: rows written (confirmed), rows whose
write failed, the first error, the failed rows per error type (the type of the error
the FT layer got as their cause: an Arrow batch's first), and the rows written already
by an earlier attempt or run, which a resumed write skipped (counted written too)."""
_OWN_HEADERS: Final = frozenset({LOOP_HEADER, WRITE_HEADER})


class SinkError(FTLayerError):
    """Rows of a micro-batch were not written; with FT on their roots were failed."""


@dataclass(frozen=True, slots=True)
class SinkResult:
    """What a sink did with one micro-batch: rows acked (written), rows failed."""

    epoch_id: int
    acked: int
    failed: int
    error: str | None = None
    at_barrier: bool = False
    """Barrier mode: the rows written complete at the batch's barrier (`acked` is 0:
    the sink sent nothing and did not count them)."""
    held: bool = False
    """The steps that produced the rows held their acks (integration.sinkhold); the
    counts are the FT layer's: acks XOR-ed (a row per single-anchored row), roots failed."""
    skipped: int = 0
    """Kafka sink: rows found written already by an earlier attempt of their task, or by
    the batch's run before a driver restart, and not written again (counted in
    `acked`: integration.resume)."""


def _check_on_error(on_error: str) -> SinkOnError:
    if on_error not in get_args(SinkOnError):
        raise ConfigError(f"on_error must be one of {get_args(SinkOnError)}, got {on_error!r}")
    return cast(SinkOnError, on_error)


def _check_ft_columns(df: DataFrame, settings: FTSettings) -> tuple[str, ...]:
    present = ft_columns_of(df.columns)
    missing = missing_ft_columns(df.schema) if settings.enabled else []
    if missing:
        raise ConfigError(
            f"FT is on but the sink's DataFrame has no {' / '.join(missing)} column "
            f"(it has {df.columns}): were they dropped by a select upstream?"
        )
    if not settings.enabled and present:
        raise ConfigError(
            f"FT is off but the sink's DataFrame has FT columns {list(present)}: the "
            "source, tasks and sinks of a pipeline must share one FTSettings"
        )
    return present


# ---- ft_foreach_batch ----------------------------------------------------------------


def settle_batches(
    batches: Iterable[Any], settings: FTSettings, *, ack: bool, cause: Cause | None = None
) -> int:
    """Ack (or fail the roots of, with `cause`) every row of these Arrow batches of FT
    columns, through this process's channel, flushed before it returns; returns the
    rows."""
    channel = settings.channel()
    handler = TaskHandler(channel)
    rows = 0
    for batch in batches:
        anchors = read_anchors(batch)
        failed = None if ack else np.ones(len(anchors), dtype=np.bool_)
        handler.process(anchors, _NO_PARENTS, failed, cause)
        rows += len(anchors)
    handler.flush()
    channel.flush()
    return rows


def settle(df: DataFrame, settings: FTSettings, *, ack: bool, cause: Cause | None = None) -> int:
    """Ack (or fail the roots of, with `cause`) every row of `df`; returns the rows. The
    FT columns come to the driver as Arrow (`toArrow`: one job, no Python worker) and
    the events leave from the driver's channel (module docstring, "Acks on the driver")."""
    table = df.select(*ft_columns_of(df.columns)).toArrow()
    return settle_batches(table.to_batches(), settings, ack=ack, cause=cause)


class FTForeachBatch:
    """A foreachBatch function that acks a batch after `fn` returned (module docstring).

    `last_result` holds what the last call did, for tests and monitoring.
    """

    def __init__(
        self,
        fn: Callable[[DataFrame, int], object],
        settings: FTSettings,
        on_error: SinkOnError = "fail-and-raise",
        key: Sequence[str] | None = None,
    ) -> None:
        self.fn = fn
        self.settings = settings
        self.on_error = _check_on_error(on_error)
        self.key = _check_key(key)
        self.last_result: SinkResult | None = None

    def __call__(self, df: DataFrame, epoch_id: int) -> None:
        ft_columns = _check_ft_columns(df, self.settings)
        missing = [column for column in self.key if column not in df.columns]
        if missing:
            raise ConfigError(
                f"the sink's content key names columns {missing} that its DataFrame "
                f"does not have (it has {df.columns})"
            )
        if not self.settings.enabled:
            self.fn(self._deduplicated(df), epoch_id)
            return
        # Step 1: one computation of the batch for fn and for the acks. In barrier mode
        # there are no acks: a computation done again (only to fail the roots when fn
        # raised) sends no XOR events that could unbalance a tree, so nothing is cached.
        at_barrier = completes_at_barrier(df.schema)
        steps = None if at_barrier else held_steps(df.sparkSession)
        if steps is not None:  # the steps that produce the rows hold their acks
            self._call_holding(df, epoch_id, ft_columns, steps)
            return
        batch = df if at_barrier else df.persist()
        try:
            try:
                # Step 2: the user's write (one row per content key, with a key).
                self.fn(self._deduplicated(batch.drop(*ft_columns)), epoch_id)
            except Exception as exc:
                # Step 4: its failure fails every root of the batch.
                self._fail_all(
                    epoch_id,
                    exc,
                    lambda cause: settle(batch, self.settings, ack=False, cause=cause),
                )
                if self.on_error == "fail-and-raise":
                    raise
                log.warning("foreachBatch %d failed; its roots will be replayed: %r", epoch_id, exc)
                return
            # Step 3: done: ack every row (barrier mode: the batch's barrier does).
            if at_barrier:
                self.last_result = SinkResult(epoch_id, acked=0, failed=0, at_barrier=True)
                return
            acked = settle(batch, self.settings, ack=True)
            self.last_result = SinkResult(epoch_id, acked=acked, failed=0)
        finally:
            # Step 5.
            if not at_barrier:
                batch.unpersist()

    def _call_holding(
        self, df: DataFrame, epoch_id: int, ft_columns: Sequence[str], steps: list[str]
    ) -> None:
        """Steps 2-4 with the acks held by the steps (integration.sinkhold): `fn`'s jobs
        carry the sink's key, and the key is settled after it."""
        key = new_sink_key()
        context = df.sparkSession.sparkContext
        channel = self.settings.channel()
        before = context.getLocalProperty(HOLD_PROPERTY)
        context.setLocalProperty(HOLD_PROPERTY, hold_value(key, steps))
        try:
            self.fn(self._deduplicated(df.drop(*ft_columns)), epoch_id)
        except Exception as exc:
            self._fail_all(epoch_id, exc, lambda cause: channel.sink_settle(key, cause), held=True)
            if self.on_error == "fail-and-raise":
                raise
            log.warning("foreachBatch %d failed; its roots will be replayed: %r", epoch_id, exc)
            return
        finally:
            context.setLocalProperty(HOLD_PROPERTY, before)  # type: ignore[arg-type]
        acked = channel.sink_settle(key)
        self.last_result = SinkResult(epoch_id, acked=acked, failed=0, held=True)

    def _deduplicated(self, df: DataFrame) -> DataFrame:
        return df.dropDuplicates(list(self.key)) if self.key else df

    def _fail_all(
        self, epoch_id: int, exc: Exception, fail: Callable[[Cause], int], held: bool = False
    ) -> None:
        """`fn` raised `exc`: fail every root of the batch (`fail(cause)`: from the cached
        rows, or the held acks' roots), and say so on the exception and in last_result."""
        try:
            cause = Cause.of_exception(exc, "ft_foreach_batch", FailKind.SINK).clipped()
            failed = fail(cause)
        except Exception as settle_exc:
            exc.add_note(
                f"ftlayer: the batch's roots could not be failed ({settle_exc!r}); "
                "they time out and are replayed"
            )
            self.last_result = SinkResult(epoch_id, 0, 0, repr(exc), held=held)
            return
        exc.add_note(f"ftlayer: the {failed} rows of batch {epoch_id} were failed for replay")
        self.last_result = SinkResult(epoch_id, acked=0, failed=failed, error=repr(exc), held=held)


def ft_foreach_batch(
    fn: Callable[[DataFrame, int], object],
    settings: FTSettings,
    *,
    on_error: SinkOnError = "fail-and-raise",
    key: Sequence[str] | None = None,
) -> FTForeachBatch:
    """Wrap `fn(batch_df, epoch_id)` for `writeStream.foreachBatch`: see the module
    docstring for when rows are acked and failed. With `key` (the idempotent mode),
    `fn` gets one row per content key, and must write idempotently on that key."""
    return FTForeachBatch(fn, settings, on_error, key)


def _check_key(key: Sequence[str] | None) -> tuple[str, ...]:
    if key is None:
        return ()
    if isinstance(key, str) or not key or not all(isinstance(k, str) and k for k in key):
        raise ConfigError(f"key must be a non-empty list of column names, got {key!r}")
    return tuple(key)


# ---- the Kafka sink ----------------------------------------------------------------------


def _as_bytes(batch: Any, column: str | None) -> list[bytes | None]:
    if column is None:
        return [None] * batch.num_rows
    values = batch.column(column)
    if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
        values = values.cast(pa.binary())
    return cast(list[bytes | None], values.to_pylist())


def _headers(batch: Any, column: str) -> list[list[tuple[str, bytes | None]]]:
    """Each row's Kafka headers from its headers column, without the loop header (a
    loop sink sets its own) and without a write tag (this sink's write sets its own)."""
    return [
        [(h["key"], h["value"]) for h in (row or ()) if h["key"] not in _OWN_HEADERS]
        for row in batch.column(column).to_pylist()
    ]


def _send_all(
    producer: Any,
    topic: str,
    keys: list[bytes | None],
    values: list[bytes | None],
    wait_s: float,
    headers: list[list[tuple[str, bytes | None]]] | None = None,
) -> tuple[NDArray[np.bool_], BaseException | None]:
    """Send every row, flush, and return which writes the broker confirmed."""
    futures: list[Any] = []
    error: BaseException | None = None
    for i, (key, value) in enumerate(zip(keys, values, strict=True)):
        try:
            extra = {} if headers is None else {"headers": headers[i]}
            futures.append(producer.send(topic, key=key, value=value, **extra))
        except KafkaTimeoutError as exc:
            error = exc  # no metadata or no buffer space: every further send waits as long
            break
        except (KafkaError, TypeError, ValueError, AssertionError) as exc:
            futures.append(None)  # this record only (too large, bad key type, ...)
            error = error or exc
    try:
        producer.flush(timeout=wait_s)
    except KafkaTimeoutError as exc:
        error = error or exc
    confirmed = np.zeros(len(values), dtype=np.bool_)
    for i, future in enumerate(futures):
        if future is not None and future.is_done:
            if future.succeeded():
                confirmed[i] = True
            else:
                error = error or future.exception
    return confirmed, error


def _kafka_partition(
    settings: FTSettings,
    bootstrap: str,
    topic: str,
    key_column: str | None,
    value_column: str,
    config: Mapping[str, Any],
    loop: bool = False,
    headers_column: str | None = None,
    resume: ResumePoint | None = None,
) -> Callable[[Iterator[Any]], Iterator[Any]]:
    wait_s = config["delivery_timeout_ms"] / 1000 + _FLUSH_MARGIN_S
    secret = settings.loop_secret or b""  # FTKafkaSink refuses a loop sink without one

    def run(batches: Iterator[Any]) -> Iterator[Any]:
        from pyspark import TaskContext

        context = TaskContext.get()
        partition = context.partitionId() if context is not None else 0
        prefix = done = None
        if resume is not None:
            prefix = tag_prefix(resume.write_id, partition)
            if resume.must_resume(context):
                done = written_before(bootstrap, topic, resume, partition, config)
        channel = settings.channel() if settings.enabled else None
        handler = TaskHandler(channel) if channel is not None else None
        producer: Any = None
        written = failed = index = skipped = 0
        first_error: BaseException | None = None
        failed_by: dict[str, int] = {}
        try:
            for batch in batches:
                n = batch.num_rows
                anchors = read_anchors(batch) if channel is not None else None
                in_transit = new_ids(n) if loop else None  # loop mode: ids of records sent
                try:
                    if producer is None:
                        producer = KafkaProducer(bootstrap_servers=bootstrap, **config)
                    keys, values = _as_bytes(batch, key_column), _as_bytes(batch, value_column)
                    headers = None if headers_column is None else _headers(batch, headers_column)
                    # The one header this sink adds to each row: its loop anchor, or its
                    # write tag (integration.resume).
                    tags: list[tuple[str, bytes]] | None = None
                    if anchors is not None and in_transit is not None:
                        tags = [
                            (LOOP_HEADER, loop_header(root, child, secret))
                            for root, child in zip(
                                anchors.roots.tolist(), in_transit.tolist(), strict=True
                            )
                        ]
                    elif prefix is not None:
                        tags = [
                            (WRITE_HEADER, prefix + i.to_bytes(8, "big"))
                            for i in range(index, index + n)
                        ]
                    skip = None
                    if tags is not None:
                        own = headers or [[] for _ in range(n)]
                        if done:
                            skip = already_written(done, keys, values, own)
                        headers = [[*kept, tag] for kept, tag in zip(own, tags, strict=True)]
                    confirmed, error = _send_unless(
                        producer, topic, keys, values, wait_s, headers, skip
                    )
                    skipped += 0 if skip is None else int(skip.sum())
                except KafkaError as exc:  # no producer: the broker cannot be reached
                    confirmed, error = np.zeros(n, dtype=np.bool_), exc
                index += n
                first_error = first_error or error
                ok = int(confirmed.sum())
                written, failed = written + ok, failed + n - ok
                cause = None if error is None else _sink_cause(topic, error)
                _count_failed(failed_by, error, n - ok)
                if anchors is not None and in_transit is not None:
                    _loop_events(channel, anchors, in_transit, confirmed, cause)
                elif anchors is not None and handler is not None:
                    failed_rows = None if ok == n else ~confirmed
                    handler.process(anchors, _NO_PARENTS, failed_rows, cause)
        finally:
            if producer is not None:
                producer.close(timeout=0)  # flushed already; what is left has failed
        if handler is not None and channel is not None:
            handler.flush()
            channel.flush()
        if done is not None:
            log.warning(
                "Kafka sink to %r: %s of partition %d skipped %d of %d rows its "
                "earlier attempt had written",
                topic,
                "batch re-run" if resume is not None and resume.rerun else "task retry",
                partition,
                skipped,
                index,
            )
        yield pa.RecordBatch.from_pydict(
            {
                "written": pa.array([written], type=pa.int64()),
                "failed": pa.array([failed], type=pa.int64()),
                "error": pa.array([None if first_error is None else repr(first_error)]),
                "failed_by": pa.array([list(failed_by.items())], type=_FAILED_BY_TYPE),
                "skipped": pa.array([skipped], type=pa.int64()),
            }
        )

    return run


def _send_unless(
    producer: Any,
    topic: str,
    keys: list[bytes | None],
    values: list[bytes | None],
    wait_s: float,
    headers: list[list[tuple[str, bytes | None]]] | None,
    skip: NDArray[np.bool_] | None,
) -> tuple[NDArray[np.bool_], BaseException | None]:
    """`_send_all` of the rows not in `skip`; a skipped row counts as confirmed (an
    earlier attempt's write of it was)."""
    if skip is None:
        return _send_all(producer, topic, keys, values, wait_s, headers)
    send = np.flatnonzero(~skip).tolist()
    confirmed = skip.copy()
    if send:
        some, error = _send_all(
            producer,
            topic,
            [keys[i] for i in send],
            [values[i] for i in send],
            wait_s,
            None if headers is None else [headers[i] for i in send],
        )
        confirmed[send] = some
        return confirmed, error
    return confirmed, None


_FAILED_BY_TYPE: Final = pa.map_(pa.string(), pa.int64())


def _count_failed(failed_by: dict[str, int], error: BaseException | None, rows: int) -> None:
    """Count `rows` failed writes under their error's type (the summary's failed_by)."""
    if rows:
        kind = "unknown" if error is None else type(error).__name__
        failed_by[kind] = failed_by.get(kind, 0) + rows


def _loop_events(
    channel: Any,
    anchors: Any,
    in_transit: NDArray[np.uint64],
    confirmed: NDArray[np.bool_],
    cause: Cause | None = None,
) -> None:
    """Loop mode: a row whose write was confirmed is acked and its record in transit
    anchored in one event per row, (root, row id ^ in-transit id): the tree goes on
    through Kafka. A row whose write failed has its root failed (replayed)."""
    if confirmed.any():
        channel.xor(anchors.roots[confirmed], anchors.ids[confirmed] ^ in_transit[confirmed])
    if not confirmed.all():
        channel.fail(anchors.roots[~confirmed], cause)


def _sink_cause(topic: str, error: BaseException) -> Cause:
    """The cause of rows whose write the broker refused (or that timed out)."""
    return Cause.of_exception(error, f"kafka sink to {topic!r}", FailKind.SINK).clipped()


def check_loop(loop: bool, settings: FTSettings) -> None:
    """ConfigError unless a loop sink (`loop`) can run under `settings`."""
    if loop and not settings.enabled:
        raise ConfigError("a loop sink needs FT on: its records carry their tree's root")
    if loop and settings.loop_secret is None:
        raise ConfigError(
            "a loop sink signs its loop headers with the pipeline's loop key: give the "
            "FT layer's token (option ft.tokenFile) or a key (option ft.loopKeyFile or "
            "FTSettings(loop_key=...))"
        )


def kafka_columns(
    df: DataFrame,
    key_column: str | None,
    value_column: str,
    headers_column: str | None,
    loop: bool,
) -> tuple[list[str], str | None]:
    """The data columns a Kafka sink writes from `df` (key, value, headers), and its
    headers column if `df` has it; ConfigError for a column of the wrong type."""
    data_columns = [c for c in (key_column, value_column) if c is not None]
    types = {f.name: f.dataType for f in df.schema.fields}
    for column in data_columns:
        if not isinstance(types.get(column), BinaryType | StringType):
            found = types[column].simpleString() if column in types else "missing"
            raise ConfigError(f"Kafka sink column {column!r} must be binary or string: {found}")
    headers = headers_column if headers_column in types else None
    if headers is not None and types[headers] != HEADERS_TYPE:
        raise ConfigError(
            f"Kafka sink column {headers!r} must be {HEADERS_TYPE.simpleString()} "
            f"(the ftkafka source's headers), got {types[headers].simpleString()}"
        )
    if headers is not None:
        data_columns.append(headers)
    if loop and EXTRA_ANCHORS_COLUMN in df.columns:
        raise ConfigError(
            f"a loop sink writes rows with one anchor, but this DataFrame has "
            f"{EXTRA_ANCHORS_COLUMN} (multi-anchored rows, from an aggregate): loop "
            "the records before aggregating them"
        )
    return data_columns, headers


class FTKafkaSink:
    """A foreachBatch function writing rows to a Kafka topic (module docstring)."""

    def __init__(
        self,
        bootstrap_servers: str,
        topic: str,
        settings: FTSettings,
        *,
        key_column: str | None = "key",
        value_column: str = "value",
        on_error: SinkOnError = "fail-and-raise",
        producer_config: Mapping[str, Any] | None = None,
        loop: bool = False,
        headers_column: str | None = "headers",
        resume: bool = True,
    ) -> None:
        check_loop(loop, settings)
        self.loop = loop
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic
        self.settings = settings
        self.key_column = key_column
        self.value_column = value_column
        self.headers_column = headers_column
        self.on_error = _check_on_error(on_error)
        self.producer_config = {**DEFAULT_PRODUCER_CONFIG, **(producer_config or {})}
        self.resume = resume and not loop
        self.last_result: SinkResult | None = None

    def _resume_point(self, df: DataFrame, epoch_id: int) -> ResumePoint | None:
        """The batch's resume point (integration.resume): a new one, or with FT on,
        the one its run before a driver restart stored in the FT layer."""
        point = resume_point(self.bootstrap_servers, self.topic, self.producer_config, epoch_id)
        if point is None or not self.settings.enabled:
            return point
        query = df.sparkSession.sparkContext.getLocalProperty("sql.streaming.queryId")
        if not query:  # not a streaming query's batch: nothing runs it again
            return point
        name = f"kafka/{query}/{self.topic}"
        try:
            return marked(point, partial(_sink_mark, self.settings, name, epoch_id))
        except (FTLayerError, OSError) as exc:
            log.warning(
                "Kafka sink to %r: batch %d's resume point is not in the FT layer (run "
                "again after a driver restart, it writes again): %r",
                self.topic,
                epoch_id,
                exc,
            )
            return point

    def __call__(self, df: DataFrame, epoch_id: int) -> None:
        ft_columns = _check_ft_columns(df, self.settings)
        data_columns, headers_column = kafka_columns(
            df, self.key_column, self.value_column, self.headers_column, self.loop
        )
        run = _kafka_partition(
            self.settings,
            self.bootstrap_servers,
            self.topic,
            self.key_column,
            self.value_column,
            self.producer_config,
            self.loop,
            headers_column,
            self._resume_point(df, epoch_id) if self.resume else None,
        )
        summary = df.select(*data_columns, *ft_columns).mapInArrow(run, _SUMMARY_SCHEMA).collect()
        written = sum(int(row.written) for row in summary)
        failed = sum(int(row.failed) for row in summary)
        error = next((row.error for row in summary if row.error is not None), None)
        skipped = sum(int(row.skipped) for row in summary)
        self.last_result = SinkResult(
            epoch_id, acked=written, failed=failed, error=error, skipped=skipped
        )
        if not failed:
            return
        fate = "their roots were failed for replay" if self.settings.enabled else "FT is off"
        message = (
            f"{failed} of {written + failed} rows of batch {epoch_id} were not written to "
            f"Kafka topic {self.topic!r} ({fate}); first error: {error}"
        )
        if self.on_error == "fail-and-raise" or not self.settings.enabled:
            raise SinkError(message)
        log.warning("%s", message)


def _sink_mark(
    settings: FTSettings, sink: str, batch: int, mark: Mapping[str, Any]
) -> tuple[Mapping[str, Any], bool]:
    """SINK_MARK on the FT layer (its first shard, with several)."""
    channel = settings.channel()
    first = channel.channels[0] if isinstance(channel, ShardedChannel) else channel
    found = first.client.sink_mark(sink, batch, mark)
    return found.mark, found.first


def ft_kafka_sink(
    bootstrap_servers: str,
    topic: str,
    settings: FTSettings,
    *,
    key_column: str | None = "key",
    value_column: str = "value",
    on_error: SinkOnError = "fail-and-raise",
    producer_config: Mapping[str, Any] | None = None,
    loop: bool = False,
    headers_column: str | None = "headers",
    resume: bool = True,
) -> FTKafkaSink:
    """A foreachBatch function writing `key_column`/`value_column` to `topic`; rows are
    acked once the broker confirmed them, failed (replayed) otherwise. With
    `loop=True` the topic is one a source of the pipeline reads: each record carries
    its tree's root in a Kafka header and its tree goes on (module docstring). A
    `headers_column` the DataFrame has (the ftkafka source's `headers` under
    includeHeaders) is written as each record's Kafka headers. With `resume` (the
    default; not for loop sinks) each record also carries an `ftlayer-write` header,
    and a task Spark retries skips the rows its dead attempt had written
    (integration.resume)."""
    return FTKafkaSink(
        bootstrap_servers,
        topic,
        settings,
        key_column=key_column,
        value_column=value_column,
        on_error=on_error,
        producer_config=producer_config,
        loop=loop,
        headers_column=headers_column,
        resume=resume,
    )
