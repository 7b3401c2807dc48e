"""Kafka helpers for tests, the demo and benchmarks: create topics, produce, read back.

All three talk to a real broker with kafka-python and are written for speed against
the embedded Tansu broker:

- `create_topic` returns only once a metadata request shows every partition with a
  leader, so a producer started right after it never sees an unknown topic.
- `produce` uses kafka-python's default partitioner, so a keyed record lands in
  ``murmur2(key) & 0x7fffffff % partitions``, exactly as with the Java client. Tests
  of the hash replay partitioners rely on that.
- `read_all` reads every partition by assign/seek, never through a consumer group
  (group joins are slow against Tansu and nothing needs a group here), with raised
  fetch sizes. It reads up to the end offsets captured when it starts, so records
  produced meanwhile are not returned, and it gives up with `KafkaHelperError` at
  its deadline instead of hanging.

Every call opens its own client and closes it before returning: these are cold-path
helpers, and a leaked client thread would outlive the broker it talks to.

kafka-python 3 warns when one step of a client's event loop takes over 0.1 s ("Task
... is blocking the event loop"). The helpers' producer does that by design on a large
produce (a bench's 400,000 records: the sender completes a whole batch's futures in one
step), and nothing else polls its event loop, so nothing waits on it: those warnings,
from the helpers' own network thread only, are dropped (`_HelperSlowSteps`). Every
other client's pass.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import KafkaError

from ftlayer.errors import FTLayerError

__all__ = [
    "ClusterInfo",
    "KafkaHelperError",
    "KafkaRecord",
    "RecordPosition",
    "cluster_info",
    "create_topic",
    "end_offsets",
    "produce",
    "read_all",
    "wait_progressing",
    "wait_until",
]

_CLIENT_ID = "ftlayer-helper"
# A helper producer's I/O thread, as kafka-python names it (client id + suffix).
_NETWORK_THREAD = f"{_CLIENT_ID}-network-thread"
# Large enough that one fetch returns a whole test topic; Tansu serves it in one go.
_FETCH_MAX_BYTES = 64 * 1024 * 1024
_PARTITION_FETCH_MAX_BYTES = 16 * 1024 * 1024
_PRODUCE_BATCH_BYTES = 512 * 1024
# kafka-python's poll() returns early only with records: an empty fetch (a partition
# at its end) keeps it waiting for its whole timeout, so poll in short slices.
_POLL_SECONDS = 0.05


class _HelperSlowSteps(logging.Filter):
    """Drops kafka-python's slow-step warnings of the helpers' own network thread."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.threadName == _NETWORK_THREAD
            and "blocking the event loop" in record.getMessage()
        )


logging.getLogger("kafka.net.selector").addFilter(_HelperSlowSteps())


class KafkaHelperError(FTLayerError):
    """A Kafka helper could not finish: broker unreachable, deadline passed, bad topic."""


class RecordPosition(NamedTuple):
    """Where the broker stored a produced record."""

    partition: int
    offset: int


Headers = Sequence[tuple[str, bytes]]
"""Kafka headers of one record: (key, value) pairs."""


@dataclass(frozen=True, slots=True)
class KafkaRecord:
    """One record read back from Kafka, with its coordinates; timestamp in epoch ms."""

    topic: str
    partition: int
    offset: int
    timestamp: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...] = ()


@dataclass(frozen=True, slots=True)
class ClusterInfo:
    """What a metadata request says about the cluster."""

    cluster_id: str | None
    brokers: tuple[str, ...]


def wait_until(
    condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.02
) -> None:
    """Poll `condition` until it holds; raise `KafkaHelperError` naming `what` at the deadline.

    The condition is always evaluated at least once, and once more at the deadline.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise KafkaHelperError(f"timed out after {timeout:.1f} s waiting for {what}")
        time.sleep(interval)


def wait_progressing(
    condition: Callable[[], bool],
    progress: Callable[[], object],
    stall_s: float,
    what: str,
    interval: float = 0.1,
) -> None:
    """Poll `condition` until it holds, while `progress()` keeps changing: raise
    `KafkaHelperError` naming `what` once `progress()` has returned the same value for
    `stall_s` seconds. For waits whose length depends on the machine's speed and load (a
    JVM's start, a backlog worked off), where only a stall is an error.
    """
    last, since = progress(), time.monotonic()
    while not condition():
        now, seen = time.monotonic(), progress()
        if seen != last:
            last, since = seen, now
        elif now - since >= stall_s:
            raise KafkaHelperError(
                f"waiting for {what}: no progress for {stall_s:.1f} s (stuck at {seen!r})"
            )
        time.sleep(interval)


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def _admin(bootstrap: str, timeout: float) -> Any:
    """An admin client; its constructor already does a metadata request (bootstrap)."""
    try:
        return KafkaAdminClient(
            bootstrap_servers=bootstrap,
            client_id=_CLIENT_ID,
            bootstrap_timeout_ms=_ms(timeout),
            request_timeout_ms=_ms(timeout),
        )
    except KafkaError as exc:
        raise KafkaHelperError(f"cannot reach Kafka at {bootstrap}: {exc!r}") from exc


def cluster_info(bootstrap: str, timeout: float = 5.0) -> ClusterInfo:
    """Ask the broker at `bootstrap` for its cluster id and brokers (a real Kafka request)."""
    admin = _admin(bootstrap, timeout)
    try:
        described = admin.describe_cluster()
    except KafkaError as exc:
        raise KafkaHelperError(f"metadata request to {bootstrap} failed: {exc!r}") from exc
    finally:
        admin.close()
    brokers = tuple(f"{b['host']}:{b['port']}" for b in described["brokers"])
    return ClusterInfo(cluster_id=described.get("cluster_id"), brokers=brokers)


def create_topic(bootstrap: str, name: str, partitions: int, timeout: float = 10.0) -> None:
    """Create topic `name` with `partitions` partitions (replication 1).

    Returns once a metadata request shows every partition with a leader. Raises
    `KafkaHelperError` if the topic exists already or is not ready within `timeout`.
    """
    if partitions < 1:
        raise KafkaHelperError(f"a topic needs at least one partition, got {partitions}")
    admin = _admin(bootstrap, timeout)
    try:
        admin.create_topics(
            {name: {"num_partitions": partitions, "replication_factor": 1}},
            timeout_ms=_ms(timeout),
        )
        admin.wait_for_topics([name], timeout_ms=_ms(timeout))
        described = admin.describe_topics([name])
    except KafkaError as exc:
        raise KafkaHelperError(f"cannot create topic {name!r} on {bootstrap}: {exc!r}") from exc
    finally:
        admin.close()
    found = len(described[0]["partitions"]) if described else 0
    if found != partitions:
        # Paranoid check: a pre-existing topic or a broker default must not silently
        # change the partition count every hash-partitioning test depends on.
        raise KafkaHelperError(f"topic {name!r} has {found} partitions, wanted {partitions}")


def produce(
    bootstrap: str,
    topic: str,
    records: Iterable[tuple[bytes | None, bytes] | tuple[bytes | None, bytes, Headers]],
    timeout: float = 30.0,
    partition: int | None = None,
) -> list[RecordPosition]:
    """Produce `(key, value)` or `(key, value, headers)` records to `topic`; return each
    one's position, in input order.

    With `partition`, every record goes to that partition.

    Keyed records are placed by kafka-python's default partitioner (Kafka's murmur2);
    records without a key go to a partition of its choosing. Every record is
    acknowledged by the broker (acks=all) before this returns.
    """
    deadline = time.monotonic() + timeout
    try:
        producer = KafkaProducer(
            bootstrap_servers=bootstrap,
            client_id=_CLIENT_ID,
            bootstrap_timeout_ms=_ms(timeout),
            acks="all",
            linger_ms=5,
            batch_size=_PRODUCE_BATCH_BYTES,
            max_block_ms=_ms(timeout),
        )
    except KafkaError as exc:
        raise KafkaHelperError(f"cannot reach Kafka at {bootstrap}: {exc!r}") from exc
    try:
        futures = [
            producer.send(
                topic,
                key=record[0],
                value=record[1],
                partition=partition,
                headers=list(record[2]) if len(record) > 2 else None,
            )
            for record in records
        ]
        producer.flush(timeout=max(0.0, deadline - time.monotonic()))
        positions = []
        for future in futures:
            metadata = future.get(timeout=max(0.001, deadline - time.monotonic()))
            positions.append(RecordPosition(metadata.partition, metadata.offset))
        return positions
    except KafkaError as exc:
        raise KafkaHelperError(f"producing to {topic!r} on {bootstrap} failed: {exc!r}") from exc
    finally:
        producer.close(timeout=max(0.0, deadline - time.monotonic()))


def _consumer(bootstrap: str, timeout: float) -> Any:
    try:
        return KafkaConsumer(
            bootstrap_servers=bootstrap,
            client_id=_CLIENT_ID,
            group_id=None,
            enable_auto_commit=False,
            bootstrap_timeout_ms=_ms(timeout),
            request_timeout_ms=_ms(timeout),
            fetch_max_bytes=_FETCH_MAX_BYTES,
            max_partition_fetch_bytes=_PARTITION_FETCH_MAX_BYTES,
            fetch_max_wait_ms=20,
            max_poll_records=100_000,
        )
    except KafkaError as exc:
        raise KafkaHelperError(f"cannot reach Kafka at {bootstrap}: {exc!r}") from exc


def _partitions(consumer: Any, topic: str, timeout: float) -> list[int]:
    found: set[int] = set()

    def known() -> bool:
        found.update(consumer.partitions_for_topic(topic) or ())
        return bool(found)

    wait_until(known, timeout, f"metadata of topic {topic!r}")
    return sorted(found)


def _high_watermarks(
    consumer: Any, tps: Sequence[Any], deadline: float, what: str
) -> dict[Any, int]:
    """Poll the assigned `tps` until a fetch response has reported each one's high watermark.

    Records polled meanwhile are dropped: callers seek where their reading starts after.
    """
    marks: dict[Any, int] = {}
    while len(marks) < len(tps):
        left = deadline - time.monotonic()
        if left <= 0:
            missing = sorted(tp.partition for tp in tps if tp not in marks)
            raise KafkaHelperError(f"no fetch response for partitions {missing} of {what}")
        consumer.poll(timeout_ms=_ms(min(left, _POLL_SECONDS)))
        for tp in tps:
            mark = consumer.highwater(tp)
            if mark is not None and tp not in marks:
                marks[tp] = int(mark)
                consumer.pause(tp)
    return marks


def end_offsets(bootstrap: str, topic: str, timeout: float = 10.0) -> dict[int, int]:
    """The end offset (offset of the next record to be written) of every partition of `topic`.

    Taken from the high watermark of a Fetch, not from ListOffsets: Tansu answers
    ListOffsets(latest) with the base offset of the last record batch + 1, which is
    short of the end whenever that batch holds more than one record.
    """
    deadline = time.monotonic() + timeout
    consumer = _consumer(bootstrap, timeout)
    try:
        tps = [TopicPartition(topic, p) for p in _partitions(consumer, topic, timeout)]
        consumer.assign(tps)
        # A lower bound of the end, so each fetch returns at most the last batch.
        for tp, offset in consumer.end_offsets(tps, timeout_ms=_ms(timeout)).items():
            consumer.seek(tp, offset)
        marks = _high_watermarks(consumer, tps, deadline, f"topic {topic!r}")
        return {tp.partition: marks[tp] for tp in tps}
    except KafkaError as exc:
        raise KafkaHelperError(f"cannot find the end offsets of {topic!r}: {exc!r}") from exc
    finally:
        consumer.close(autocommit=False)


def read_all(
    bootstrap: str,
    topic: str,
    partitions: Sequence[int] | None = None,
    timeout: float = 30.0,
) -> list[KafkaRecord]:
    """Read every record of `topic` (or of the given partitions) from the beginning.

    Stops at the end offsets found when it starts (the high watermark of the first
    fetch of each partition; see `end_offsets`), so records produced meanwhile are not
    returned. Returns records ordered by (partition, offset). Raises `KafkaHelperError`
    if they have not all arrived within `timeout` seconds, naming how far each
    partition got.
    """
    deadline = time.monotonic() + timeout
    consumer = _consumer(bootstrap, timeout)
    try:
        chosen = _partitions(consumer, topic, timeout) if partitions is None else partitions
        tps = [TopicPartition(topic, p) for p in chosen]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends: dict[Any, int] = {}
        remaining = set(tps)
        records: list[KafkaRecord] = []
        while remaining:
            left = deadline - time.monotonic()
            if left <= 0:
                progress = {
                    tp.partition: f"{consumer.position(tp)}/{ends.get(tp, '?')}" for tp in tps
                }
                raise KafkaHelperError(
                    f"read_all({topic!r}) timed out after {timeout:.1f} s; "
                    f"position/end per partition: {progress}"
                )
            polled = consumer.poll(timeout_ms=_ms(min(left, _POLL_SECONDS)))
            for tp in remaining - ends.keys():
                mark = consumer.highwater(tp)
                if mark is not None:
                    ends[tp] = int(mark)
            for tp, batch in polled.items():
                end = ends[tp]
                records.extend(
                    KafkaRecord(
                        topic=r.topic,
                        partition=r.partition,
                        offset=r.offset,
                        timestamp=r.timestamp,
                        key=r.key,
                        value=r.value,
                        headers=tuple((h[0], h[1]) for h in (r.headers or ())),
                    )
                    for r in batch
                    if r.offset < end
                )
            # Offsets may have gaps (transaction markers), so compare positions, not counts.
            done = {tp for tp in remaining if tp in ends and consumer.position(tp) >= ends[tp]}
            if done:
                consumer.pause(*done)
                remaining -= done
        records.sort(key=lambda r: (r.partition, r.offset))
        return records
    except KafkaError as exc:
        raise KafkaHelperError(f"reading {topic!r} from {bootstrap} failed: {exc!r}") from exc
    finally:
        consumer.close(autocommit=False)
