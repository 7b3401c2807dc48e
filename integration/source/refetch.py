"""Records stored by reference, read back from Kafka at their coordinates.

With `ft.persist=reference` the FT layer keeps where each record is, not its bytes
(ftlayer.core.fills). When a record fails, its bytes are wanted: the driver's filler copies them
into the FT layer behind its next trigger (.filling), and a reader that
fetched a replay before that reads it here itself. Both read with `read_at`, which
gives each record's payload exactly as the reader would have persisted it (the same
`encode_payloads`), or says Kafka no longer has it.

"No longer has it" is decided only on what Kafka answers: an offset below the
partition's log start (retention, DeleteRecords), missing inside a range Kafka
returned (compaction), at or past the partition's log end as a fetch reports it (its
high watermark: a topic deleted and made again, as a broker that creates topics on
demand can do right after a delete, or a log cut by an unclean leader election), or a
topic absent from two topic listings that name others. A
broker that cannot be reached, or metadata that lists the topic without the partition,
is an error (KafkaError or SourceError), never "gone": the records stay unfilled and
are asked for again.

Nearby failed offsets of one partition are read in one range (gaps up to
`GAP_OFFSETS`), so a batch with many failures costs a few sequential fetches, not one
seek per record; the log starts of every partition read come from one topic listing
and one ListOffsets request; and the driver reads with one consumer it keeps
(`refetch_consumer`), since a new consumer's listing waits a tenth of a second.
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

from .columnar import RecordColumns
from .kafkaread import new_consumer, read_config, read_kafka, user_headers
from .options import SourceOptions

__all__ = ["GAP_OFFSETS", "read_at", "refetch_consumer"]

GAP_OFFSETS: Final = 20_000
"""Failed offsets of one partition closer than this are read in one range."""
_LISTINGS: Final = 2  # a topic is gone only if absent from this many listings
_LISTING_PAUSE_S: Final = 0.5


Keys = tuple[NDArray[np.int64], NDArray[np.bool_]]
"""Key hashes and has_key per record, as the source's replay partitioner hashes keys."""


def refetch_consumer(options: SourceOptions) -> Any:
    """A consumer for `read_at`, which a caller that reads again and again (the driver,
    at every trigger with failures) keeps: a new consumer's topic listing waits about a
    tenth of a second (kafka-python refreshes metadata again so soon after its
    bootstrap), a listing some time after the last one costs a round trip."""
    config: dict[str, Any] = {"request_timeout_ms": 30_000, **read_config(options)}
    return new_consumer(options.bootstrap, config)


def read_at(
    options: SourceOptions, records: RecordBatch, consumer: Any = None
) -> tuple[NDArray[np.bool_], list[bytes], Keys]:
    """Per record: whether Kafka still has it at (topic, partition, offset), its payload
    as the ftkafka reader persists it (b"" where not found), and its key hash. With
    `consumer` (`refetch_consumer`), read with it and leave it open; else with one
    made for this call."""
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
    own = consumer is None
    if own:
        consumer = refetch_consumer(options)
    try:
        starts = _log_starts(options, consumer, list(groups))
        wanted = {}
        for place, rows in groups.items():
            start = starts[place]
            if start is not None:  # else the topic is gone
                offsets = records.offsets[rows]
                wanted[place] = np.unique(offsets[offsets >= start])
        bytes_at = _read_places(options, consumer, wanted)
        for place, rows in groups.items():
            got_at = bytes_at.get(place, {})
            for row, offset in zip(rows, records.offsets[rows].tolist(), strict=True):
                got = got_at.get(offset)
                if got is not None:
                    found[row] = True
                    payloads[row], hashes[row], has_key[row] = got
    finally:
        if own:
            consumer.close(autocommit=False)
        else:
            # A kept consumer asks no metadata of these topics until its next call: Tansu
            # would make a deleted topic again on that refresh, and the "gone" check
            # above would never see it gone.
            consumer.unsubscribe()
    return found, payloads, (hashes, has_key)


def key_hashes(options: SourceOptions, keys: Sequence[bytes | None]) -> Keys:
    """The key hashes the source's replay partitioner routes by, as the reader stores
    them: portable_hash for spark-hash (None is a key too), else Kafka's murmur2."""
    if options.partitioner == "spark-hash":
        return spark_key_hashes(keys), np.ones(len(keys), dtype=np.bool_)
    return kafka_key_hashes(keys)


def _read_places(
    options: SourceOptions, consumer: Any, wanted: dict[tuple[str, int], NDArray[np.int64]]
) -> dict[tuple[str, int], dict[int, tuple[bytes, int, bool]]]:
    """The payloads and key hashes Kafka still has at the offsets wanted of each
    (topic, partition) (sorted, at or past its log start), by offset."""
    out: dict[tuple[str, int], dict[int, tuple[bytes, int, bool]]] = {}
    for (topic, partition), offsets in wanted.items():
        got = out[topic, partition] = {}
        for run in _runs(offsets):
            run_range = _Range(topic, partition, int(run[0]), int(run[-1]) + 1)
            for chunk in read_kafka(options, run_range, consumer, to_log_end=True):
                hit = np.flatnonzero(np.isin(chunk.offsets, run))
                if len(hit):
                    got.update(_payloads_at(options, chunk, hit))
    return out


def _payloads_at(
    options: SourceOptions, chunk: RecordColumns, hit: NDArray[np.intp]
) -> Iterator[tuple[int, tuple[bytes, int, bool]]]:
    """(offset, (payload as the reader persists it, key hash, has key)) of the `hit`
    rows of a polled chunk."""
    keys = chunk.keys.take(hit).to_pylist()
    values = chunk.values.take(hit).to_pylist()
    headers = None
    if options.keeps_headers:
        every = user_headers(chunk.header_lists())
        headers = [every[i] for i in hit.tolist()]
    encoded = encode_payloads(keys, values, chunk.timestamps[hit], headers)
    hashes, has_key = key_hashes(options, keys)
    return zip(
        chunk.offsets[hit].tolist(),
        zip(encoded, hashes.tolist(), has_key.tolist(), strict=True),
        strict=True,
    )


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


def _log_starts(
    options: SourceOptions, consumer: Any, places: Sequence[tuple[str, int]]
) -> dict[tuple[str, int], int | None]:
    """The log start offset of each (topic, partition), None for those whose topic no
    longer exists (absent from two listings that name other topics): one listing and
    one ListOffsets request for them all. A partition missing from a topic that exists
    (metadata still arriving: Kafka never removes a partition) is an error."""
    topics: set[str] = set()
    for attempt in range(_LISTINGS):
        topics = consumer.topics()
        if not topics:
            # No topic at all: more likely metadata that did not arrive than a
            # cluster emptied; "gone" must rest on an answer, so ask again later.
            raise SourceError(
                f"Kafka at {options.bootstrap} listed no topics: cannot tell whether "
                f"{', '.join(sorted({t for t, _ in places}))} still exist"
            )
        if all(topic in topics for topic, _ in places) or attempt + 1 == _LISTINGS:
            break
        time.sleep(_LISTING_PAUSE_S)
    wanted: list[TopicPartition] = []
    for topic, partition in places:
        if topic not in topics:
            continue
        partitions = consumer.partitions_for_topic(topic) or set()
        if partition not in partitions:
            raise SourceError(
                f"Kafka at {options.bootstrap} lists topic {topic!r} without partition "
                f"{partition} (partitions {sorted(partitions)}): asked again later"
            )
        wanted.append(TopicPartition(topic, partition))
    found = consumer.beginning_offsets(wanted) if wanted else {}
    return {
        (topic, partition): (
            int(found[TopicPartition(topic, partition)]) if topic in topics else None
        )
        for topic, partition in places
    }
