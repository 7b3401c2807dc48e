"""A Kafka sink task that Spark runs again writes only what its dead attempt did not.

Spark retries a task whose Python worker or executor died, and the retry computes the
same partition from the same source range. Without help a Kafka sink then writes the
whole partition again: every row the dead attempt had already written becomes a
duplicate in the topic (`ftlayer demo --kill-workers 2` counted up to 4,034 of 20,000
when a kill hit a sink writer). Kafka transactions would fence the dead attempt and
abort its writes, but the broker must drop aborted records for readers, which the
embedded test broker (Tansu) does not; and a transaction still leaves the retry to
write everything again. The sink resumes instead:

1. On the driver, before each batch's write job, the sink takes the topic's end
   offsets (`end_offsets`) and draws a write id (8 random bytes). Both go into the
   job's closure, so every attempt of every task of that job sees the same ones.
2. Each row is written with one more Kafka header, `ftlayer-write`: the write id, the
   Spark partition id and the row's index within the partition (`WriteTag`).
3. An attempt that is not its task's first (`TaskContext.attemptNumber() > 0`) first
   reads the topic from the job's start offsets to its current end and counts, for its
   own write id and partition, the rows written by content: a digest of each row's
   key, value and own headers (`written_rows`). It then skips each row whose content
   is among them, one row per copy written, wherever the row stands in the partition
   (`already_written`), and writes the rest. A skipped row counts as written: its
   write was confirmed by the broker to the dead attempt, so in tree mode it is acked.

What it relies on, and why nothing is lost when that does not hold: the retry skips
a row only if a record with the same content (key, value, headers) is in the topic
under the same write id and partition and no other row of the retry was skipped for
that record: only if the row it would write is there. So for each content the topic
ends with as many copies as the retry computed, or as the dead attempt wrote if that
was more. Matching by content, not by place, keeps a retry that computes other rows
than the dead attempt did (a record failed on its first sight there and passes now, a
replay set that differs, a non-deterministic step) from writing again every row
after the first difference: it writes only the rows the dead attempt did not. A
speculative attempt racing the first one may write a row both write (a duplicate, as
without resuming). Rows the dead attempt sent but the broker never appended are not
in the topic, so they are written.

4. A batch run again after a *driver* restart resumes the same way. With FT on, the
   driver stores its write id and start offsets in the FT layer before the batch
   writes (`marked`: SINK_MARK, ftlayer.core.sinkmarks), under the sink's name (the
   query's id, which Spark keeps across restarts from the same checkpoint, and the
   topic) and the batch id. The FT layer keeps the first mark of a batch: a restarted
   driver running the batch again gets the dead run's back, and every task of that
   run, its first attempt too, reads back and skips what the dead run wrote.

What it costs: on the driver one ListOffsets request per batch and, with FT on, one
SINK_MARK (a synced write in the FT layer); per row a 20-byte header; a retry, and
each task of a batch run again, reads the topic's records written since its batch
began (the whole batch's output at most) once and digests each row it would write.
Not covered: with FT off, or when the FT layer cannot be reached before the batch
writes, a batch run again after a driver restart draws a new write id and writes
again, as Spark's own Kafka sink does (`ft_foreach_batch(..., key=...)` is the
exactly-once path for sinks that can upsert). Loop sinks (`loop=True`) do not
resume: their records carry their attempt's roots, which a retry's copy cannot share.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

import numpy as np
from kafka import KafkaConsumer, TopicPartition
from kafka.errors import KafkaError
from numpy.typing import NDArray

from ftlayer.errors import FTLayerError

__all__ = [
    "WRITE_HEADER",
    "ResumeError",
    "ResumePoint",
    "WriteTag",
    "already_written",
    "client_config",
    "end_offsets",
    "is_retry",
    "marked",
    "new_write_id",
    "resume_consumer",
    "resume_point",
    "row_digest",
    "tag_prefix",
    "written_before",
    "written_rows",
]

log = logging.getLogger(__name__)

WRITE_HEADER: Final = "ftlayer-write"
_TAG: Final = struct.Struct(">8sIQ")  # write id, Spark partition id, row index
# The security and protocol settings a producer's config shares with a consumer's.
_SHARED_PREFIXES: Final = ("security_", "sasl_", "ssl_")
_SHARED_KEYS: Final = frozenset({"api_version", "bootstrap_timeout_ms"})
_FETCH_MAX_BYTES: Final = 32 * 1024 * 1024
_PARTITION_FETCH_MAX_BYTES: Final = 16 * 1024 * 1024
_POLL_MS: Final = 200


class ResumeError(FTLayerError):
    """A retried sink task could not read back what its dead attempt wrote."""


class WriteTag(NamedTuple):
    """What the `ftlayer-write` header of a written row says."""

    write_id: bytes
    partition: int
    row: int

    def encode(self) -> bytes:
        return _TAG.pack(self.write_id, self.partition, self.row)

    @classmethod
    def decode(cls, raw: bytes | None) -> WriteTag | None:
        if raw is None or len(raw) != _TAG.size:
            return None
        return cls(*_TAG.unpack(raw))


_WRITE_ID_BYTES: Final = 8


def new_write_id() -> bytes:
    return os.urandom(_WRITE_ID_BYTES)


def tag_prefix(write_id: bytes, partition: int) -> bytes:
    """The first 12 bytes of every tag of one partition of one write job: a row's tag
    is this plus its index as 8 big-endian bytes."""
    return _TAG.pack(write_id, partition, 0)[:12]


def is_retry(context: Any) -> bool:
    """Whether a Spark TaskContext is not its task's first attempt. (A Python worker's
    TaskContext has no stage attempt number: a task that runs again in a new attempt of
    its stage, after a lost shuffle output, counts as a first attempt and writes all.)"""
    return context is not None and int(context.attemptNumber()) > 0


def row_digest(
    key: bytes | None, value: bytes | None, headers: Iterable[tuple[str, bytes | None]] = ()
) -> bytes:
    """A 16-byte digest of what a row writes (None and empty kept apart)."""
    h = hashlib.blake2b(digest_size=16)
    for part in (key, value):
        if part is None:
            h.update(b"\xff\xff\xff\xff")
        else:
            h.update(len(part).to_bytes(4, "big"))
            h.update(part)
    for name, raw in headers:
        encoded = name.encode()
        h.update(len(encoded).to_bytes(4, "big"))
        h.update(encoded)
        h.update(b"\xff\xff\xff\xff" if raw is None else len(raw).to_bytes(4, "big"))
        h.update(raw or b"")
    return h.digest()


def client_config(producer_config: Mapping[str, Any]) -> dict[str, Any]:
    """The consumer settings a sink's producer config implies (security, protocol)."""
    return {
        k: v
        for k, v in producer_config.items()
        if k.startswith(_SHARED_PREFIXES) or k in _SHARED_KEYS
    }


def resume_consumer(bootstrap: str, config: Mapping[str, Any]) -> Any:
    """A consumer without a group, with the producer config's security settings."""
    return KafkaConsumer(
        bootstrap_servers=bootstrap,
        client_id="ftlayer-sink-resume",
        enable_auto_commit=False,
        fetch_max_bytes=_FETCH_MAX_BYTES,
        max_partition_fetch_bytes=_PARTITION_FETCH_MAX_BYTES,
        fetch_max_wait_ms=100,
        **client_config(config),
    )


def end_offsets(consumer: Any, topic: str) -> dict[int, int]:
    """The topic's end offset per partition (raises KafkaError if the broker does not
    answer, ResumeError if the topic has no partitions)."""
    partitions = consumer.partitions_for_topic(topic)
    if not partitions:
        raise ResumeError(f"Kafka topic {topic!r} has no partitions (does it exist?)")
    tps = [TopicPartition(topic, p) for p in sorted(partitions)]
    return {tp.partition: int(offset) for tp, offset in consumer.end_offsets(tps).items()}


def written_rows(
    bootstrap: str,
    topic: str,
    start: Mapping[int, int],
    write_id: bytes,
    partition: int,
    config: Mapping[str, Any],
    *,
    deadline_s: float = 120.0,
) -> Counter[bytes]:
    """The digests of the rows written under (`write_id`, `partition`) since `start`,
    each with its number of copies, read up to the topic's end offsets at the call.
    Raises ResumeError when the read does not finish within `deadline_s` (the caller
    then writes everything: duplicates, never a loss)."""
    consumer = resume_consumer(bootstrap, config)
    try:
        listed = end_offsets(consumer, topic)
        tps = [TopicPartition(topic, p) for p in listed]
        consumer.assign(tps)
        for tp in tps:
            consumer.seek(tp, start.get(tp.partition, 0))
        # The end of a partition: the high watermark of its first fetch (the dead
        # attempt's writes were in before this read began). Not the listed end alone:
        # a broker may list less than it holds (Tansu lists its last batch's base).
        ends: dict[TopicPartition, int | None] = dict.fromkeys(tps)
        todo = set(tps)
        found: Counter[bytes] = Counter()
        limit = time.monotonic() + deadline_s
        while todo:
            if time.monotonic() > limit:
                raise ResumeError(
                    f"reading back topic {topic!r} for a retried sink task did not end "
                    f"within {deadline_s:.0f} s"
                )
            for records in consumer.poll(timeout_ms=_POLL_MS).values():
                for record in records:
                    _collect(record, write_id, partition, found)
            for tp in list(todo):
                high = consumer.highwater(tp)
                if high is None:
                    continue
                end = ends[tp]
                if end is None:
                    end = ends[tp] = max(int(high), listed[tp.partition])
                if consumer.position(tp) >= end:
                    todo.discard(tp)
                    consumer.pause(tp)
        return found
    except KafkaError as exc:
        raise ResumeError(f"reading back topic {topic!r} failed: {exc!r}") from exc
    finally:
        consumer.close()


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """What every attempt of one batch's write job shares to resume: the batch's write
    id and the topic's end offsets before the batch wrote (`resume_point`); `rerun`:
    the batch runs again after a driver restart, under the write id and start offsets
    of its run before (`marked`), so every task resumes, its first attempt too."""

    write_id: bytes
    start: Mapping[int, int]
    rerun: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "write_id": self.write_id.hex(),
            "start": {str(p): int(offset) for p, offset in self.start.items()},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, rerun: bool) -> ResumePoint:
        """ResumeError if `data` is not a `to_json` of one."""
        try:
            write_id = bytes.fromhex(data["write_id"])
            start = {int(p): int(offset) for p, offset in data["start"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ResumeError(f"not a sink's resume point: {data!r}"[:300]) from exc
        if len(write_id) != _WRITE_ID_BYTES or any(o < 0 for o in start.values()):
            raise ResumeError(f"not a sink's resume point: {data!r}"[:300])
        return cls(write_id, start, rerun)

    def must_resume(self, context: Any) -> bool:
        """Whether a task of the write job reads back what was written before it: a
        retried attempt, or any attempt of a batch run again."""
        return self.rerun or is_retry(context)


def marked(
    point: ResumePoint, mark: Callable[[Mapping[str, Any]], tuple[Mapping[str, Any], bool]]
) -> ResumePoint:
    """`point`, or, when the batch ran before a driver restart, that run's: `mark`
    stores a point for the batch unless one is stored, and answers the stored one and
    whether it was this one (FTClient.sink_mark). A run before left its mark: the batch
    resumes its writes (`rerun`)."""
    stored, first = mark(point.to_json())
    if first:
        return point
    return ResumePoint.from_json(stored, rerun=True)


def resume_point(
    bootstrap: str, topic: str, producer_config: Mapping[str, Any], epoch_id: int
) -> ResumePoint | None:
    """The driver's step before a batch writes: a fresh write id and the topic's end
    offsets now; None (the batch writes without resuming) when the broker does not
    answer."""
    # A client per batch, closed at once: a client kept open for the next batch would
    # outlive the query (nothing tells a foreachBatch function it ended), and its
    # background thread would go on trying to reach the broker.
    consumer: Any = None
    try:
        consumer = resume_consumer(bootstrap, producer_config)
        start = end_offsets(consumer, topic)
    except (KafkaError, ResumeError) as exc:
        log.warning(
            "Kafka sink to %r: batch %d writes without resuming (a retried task writes "
            "its partition again): %r",
            topic,
            epoch_id,
            exc,
        )
        return None
    finally:
        if consumer is not None:
            consumer.close()
    return ResumePoint(new_write_id(), start)


def written_before(
    bootstrap: str, topic: str, resume: ResumePoint, partition: int, config: Mapping[str, Any]
) -> Counter[bytes]:
    """What an earlier attempt of this partition wrote (`written_rows`; nothing if that
    cannot be read: the retry then writes every row again, duplicates but nothing
    lost)."""
    try:
        return written_rows(bootstrap, topic, resume.start, resume.write_id, partition, config)
    except ResumeError as exc:
        log.warning("Kafka sink to %r: writing partition %d again: %s", topic, partition, exc)
        return Counter()


def already_written(
    done: Counter[bytes],
    keys: Sequence[bytes | None],
    values: Sequence[bytes | None],
    headers: Sequence[Sequence[tuple[str, bytes | None]]],
) -> NDArray[np.bool_] | None:
    """Which of these rows an earlier attempt wrote: each row whose digest `done` still
    counts, taking one copy off the count (so a copy is matched once, by this batch of
    rows or a later one of the same partition); None if none."""
    skip = np.zeros(len(values), dtype=np.bool_)
    for i in range(len(values)):
        digest = row_digest(keys[i], values[i], headers[i])
        copies = done.get(digest, 0)
        if copies:
            skip[i] = True
            if copies == 1:
                del done[digest]
            else:
                done[digest] = copies - 1
    return skip if skip.any() else None


def _collect(record: Any, write_id: bytes, partition: int, found: Counter[bytes]) -> None:
    tag: WriteTag | None = None
    own: list[tuple[str, bytes | None]] = []
    for name, raw in record.headers or ():
        if name == WRITE_HEADER:
            tag = WriteTag.decode(raw)
        else:
            own.append((name, raw))
    if tag is not None and tag.write_id == write_id and tag.partition == partition:
        found[row_digest(record.key, record.value, own)] += 1
