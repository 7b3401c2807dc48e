"""Records stored by reference, read back from Kafka at their coordinates.

With `ft.persist=reference` the FT layer keeps where each record is, not its bytes
(ftlayer.core.fills). When a record fails, its bytes are wanted: the driver copies them
into the FT layer at its next trigger (`SourceDriver.fill_failed`), and a reader that
fetched a replay before that reads it here itself. Both read with `read_at`, which
gives each record's payload exactly as the reader would have persisted it (the same
`encode_payloads`), or says Kafka no longer has it.

"No longer has it" is decided only on what Kafka answers: an offset below the
partition's log start (retention, DeleteRecords), missing inside a range Kafka
returned (compaction), or a topic absent from two topic listings that name others. A
broker that cannot be reached, or metadata that lists the topic without the partition,
is an error (KafkaError or SourceError), never "gone": the records stay unfilled and
are asked for again.

Nearby failed offsets of one partition are read in one range (gaps up to
`GAP_OFFSETS`), so a batch with many failures costs a few sequential fetches, not one
seek per record.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any, Final, NamedTuple

import numpy as np
from kafka import TopicPartition
from numpy.typing import NDArray

from ftlayer.errors import SourceError
from ftlayer.partitioners import kafka_key_hashes, spark_key_hashes
from ftlayer.payloads import encode_payloads
from ftlayer.records import RecordBatch

from .kafkaread import new_consumer, read_kafka, user_headers
from .options import SourceOptions

__all__ = ["GAP_OFFSETS", "read_at"]

GAP_OFFSETS: Final = 20_000
"""Failed offsets of one partition closer than this are read in one range."""
_LISTINGS: Final = 2  # a topic is gone only if absent from this many listings
_LISTING_PAUSE_S: Final = 0.5


Keys = tuple[NDArray[np.int64], NDArray[np.bool_]]
"""Key hashes and has_key per record, as the source's replay partitioner hashes keys."""


def read_at(
    options: SourceOptions, records: RecordBatch
) -> tuple[NDArray[np.bool_], list[bytes], Keys]:
    """Per record: whether Kafka still has it at (topic, partition, offset), its payload
    as the ftkafka reader persists it (b"" where not found), and its key hash."""
    n = len(records)
    found = np.zeros(n, dtype=np.bool_)
    payloads = [b""] * n
    hashes, has_key = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.bool_)
    if not n:
        return found, payloads, (hashes, has_key)
    places = list(zip(records.topics, records.partitions.tolist(), strict=True))
    groups: dict[tuple[str, int], list[int]] = {}
    for row, place in enumerate(places):
        groups.setdefault(place, []).append(row)
    for (topic, partition), rows in groups.items():
        offsets = records.offsets[rows]
        bytes_at = _read_partition(options, topic, partition, offsets)
        for row, offset in zip(rows, offsets.tolist(), strict=True):
            got = bytes_at.get(offset)
            if got is not None:
                found[row] = True
                payloads[row], hashes[row], has_key[row] = got
    return found, payloads, (hashes, has_key)


def key_hashes(options: SourceOptions, keys: Sequence[bytes | None]) -> Keys:
    """The key hashes the source's replay partitioner routes by, as the reader stores
    them: portable_hash for spark-hash (None is a key too), else Kafka's murmur2."""
    if options.partitioner == "spark-hash":
        return spark_key_hashes(keys), np.ones(len(keys), dtype=np.bool_)
    return kafka_key_hashes(keys)


def _read_partition(
    options: SourceOptions, topic: str, partition: int, offsets: NDArray[np.int64]
) -> dict[int, tuple[bytes, int, bool]]:
    """The payloads and key hashes Kafka still has at `offsets` of one partition, by
    offset."""
    start = _log_start(options, topic, partition)
    if start is None:
        return {}
    wanted = np.unique(offsets[offsets >= start])
    out: dict[int, tuple[bytes, int, bool]] = {}
    for run in _runs(wanted):
        for chunk in read_kafka(options, _Range(topic, partition, int(run[0]), int(run[-1]) + 1)):
            hit = np.flatnonzero(np.isin(chunk.offsets, run))
            if not len(hit):
                continue
            index = hit.tolist()
            keys = chunk.keys.take(hit).to_pylist()
            values = chunk.values.take(hit).to_pylist()
            headers = None
            if options.keeps_headers:
                every = user_headers(chunk.header_lists())
                headers = [every[i] for i in index]
            encoded = encode_payloads(keys, values, chunk.timestamps[hit], headers)
            hashes, has_key = key_hashes(options, keys)
            out.update(
                zip(
                    chunk.offsets[hit].tolist(),
                    zip(encoded, hashes.tolist(), has_key.tolist(), strict=True),
                    strict=True,
                )
            )
    return out


class _Range(NamedTuple):
    topic: str
    partition: int
    start: int
    end: int


def _runs(offsets: NDArray[np.int64]) -> Iterator[NDArray[np.int64]]:
    """Sorted offsets in runs whose neighbours are less than GAP_OFFSETS apart."""
    if not len(offsets):
        return
    cuts = np.flatnonzero(np.diff(offsets) >= GAP_OFFSETS) + 1
    yield from np.split(offsets, cuts)


def _log_start(options: SourceOptions, topic: str, partition: int) -> int | None:
    """The log start offset of a partition; None if its topic no longer exists (absent
    from two listings that name other topics). A partition missing from a topic that
    exists (metadata still arriving: Kafka never removes a partition) is an error."""
    config: dict[str, Any] = {"request_timeout_ms": 30_000, **options.kafka_config}
    consumer = new_consumer(options.bootstrap, config)
    try:
        for attempt in range(_LISTINGS):
            topics = consumer.topics()
            if topic in topics:
                break
            if not topics:
                # No topic at all: more likely metadata that did not arrive than a
                # cluster emptied; "gone" must rest on an answer, so ask again later.
                raise SourceError(
                    f"Kafka at {options.bootstrap} listed no topics: cannot tell whether "
                    f"{topic}-{partition} still exists"
                )
            if attempt + 1 == _LISTINGS:
                return None
            time.sleep(_LISTING_PAUSE_S)
        partitions = consumer.partitions_for_topic(topic) or set()
        if partition not in partitions:
            raise SourceError(
                f"Kafka at {options.bootstrap} lists topic {topic!r} without partition "
                f"{partition} (partitions {sorted(partitions)}): asked again later"
            )
        tp = TopicPartition(topic, partition)
        return int(consumer.beginning_offsets([tp])[tp])
    finally:
        consumer.close(autocommit=False)
