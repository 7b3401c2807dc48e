"""The ftkafka reader's own record decoding (`ftlayer.integration.source.columnar`):
what it yields is what kafka-python yields, for any records.

kafka-python is the oracle throughout. Without a broker: record batches built by
kafka-python's own encoder (what its producer sends), then damaged at random, are taken
by kafka-python's PartitionRecords and by ColumnarPartitionRecords; both give the same
records, the same fetch position and leader epoch, or the same error. On the Tansu
broker: arbitrary records (keys None, empty or bytes; values; headers; timestamps),
produced uncompressed and gzip-compressed, read by `read_partition` with FT off equal
what a plain kafka-python consumer reads, and the uncompressed ones took the fast path.
"""

from __future__ import annotations

import collections
import contextlib
import struct
import uuid
from collections.abc import Iterator
from typing import Any

import crc32c
import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka import KafkaProducer, TopicPartition
from kafka.consumer.fetcher import Fetcher, IsolationLevel
from kafka.record import MemoryRecords
from kafka.record.default_records import DefaultRecordBatchBuilder

from ftlayer.integration.harness.kafka import create_topic, read_all
from ftlayer.integration.source import columnar, parse_options, source_schema
from ftlayer.integration.source.columnar import (
    ColumnarPartitionRecords,
    RecordColumns,
    decode_record_batches,
)
from ftlayer.integration.source.reader import FTKafkaPartition, read_partition

maybe_bytes = st.none() | st.binary(max_size=40)
header_key = st.text(st.characters(exclude_categories=("Cs",)), max_size=6)
header = st.tuples(header_key, maybe_bytes)
timestamp = st.integers(0, 2**45)
record = st.tuples(maybe_bytes, maybe_bytes, st.lists(header, max_size=3), timestamp)
# What kafka-python's producer sends: a key or a value (or both), header values bytes.
produced = st.tuples(
    maybe_bytes,
    maybe_bytes,
    st.lists(st.tuples(header_key, st.binary(max_size=20)), max_size=3),
    st.none() | timestamp,
).filter(lambda r: r[0] is not None or r[1] is not None)
TP = TopicPartition("t", 0)


def batch_bytes(
    records: list[Any], base_offset: int, log_append_time: bool = False, producer_id: int = -1
) -> bytes:
    """One uncompressed record batch of magic 2, as kafka-python's producer builds it
    (transactional with a `producer_id`)."""
    builder = DefaultRecordBatchBuilder(
        magic=2,
        compression_type=0,
        is_transactional=producer_id >= 0,
        producer_id=producer_id,
        producer_epoch=0 if producer_id >= 0 else -1,
        base_sequence=0 if producer_id >= 0 else -1,
        batch_size=2**30,
    )
    for i, (key, value, headers, stamp) in enumerate(records):
        builder.append(i, timestamp=stamp, key=key, value=value, headers=headers)
    raw = bytearray(builder.build())
    struct.pack_into(">q", raw, 0, base_offset)
    if log_append_time:  # as a broker with LogAppendTime rewrites it
        raw[22] |= 0x08
        struct.pack_into(">I", raw, 17, crc32c.crc32c(bytes(raw[21:])))
    return bytes(raw)


def taken(part: Any, n: int | None) -> Any:
    """(records as columns, error type, fetch position, leader epoch) of one partition's
    fetch, taken from PartitionRecords `part` as poll(max_records=n) takes it."""
    items: list[Any] = []
    error = None
    while part:
        try:
            items += part.take(n)
        except Exception as exc:
            error = type(exc)
            break
    columns = RecordColumns.of_polled(items) if items else RecordColumns.of_records([])
    return as_lists(columns), error, part.next_fetch_offset, part.leader_epoch


def as_lists(c: RecordColumns) -> tuple[Any, ...]:
    return (
        c.keys.to_pylist(),
        c.values.to_pylist(),
        c.offsets.tolist(),
        c.timestamps.tolist(),
        c.header_lists(),
    )


def both(
    raw: bytes, fetch_offset: int, check_crcs: bool = True, chunk: int = 3, **extra: Any
) -> Any:
    records = MemoryRecords(raw)
    theirs = Fetcher.PartitionRecords(fetch_offset, TP, records, check_crcs=check_crcs, **extra)
    ours = ColumnarPartitionRecords(
        fetch_offset, TP, MemoryRecords(raw), check_crcs=check_crcs, chunk_records=chunk, **extra
    )
    return taken(theirs, None), taken(ours, 1)


batches = st.lists(st.lists(record, min_size=1, max_size=8), min_size=1, max_size=4)


@settings(deadline=None)  # the first example may compile the kernels
@given(batches, st.integers(0, 40), st.booleans(), st.integers(1, 5), st.integers(0, 60))
def test_the_fast_path_yields_what_kafka_python_yields(
    groups: list[list[Any]], skip: int, log_append: bool, chunk: int, cut: int
) -> None:
    raw, base = b"", 100
    for group in groups:
        raw += batch_bytes(group, base, log_append)
        base += len(group) + 2  # a gap between batches, as compaction leaves
    raw += raw[:cut]  # the start of a batch the fetch size cut off
    fetch_offset = 100 + skip
    assert decode_record_batches(raw, from_offset=fetch_offset) is not None
    theirs, ours = both(raw, fetch_offset, chunk=chunk)
    assert ours == theirs


@settings(deadline=None)
@given(
    batches,
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=3),
    st.booleans(),
)
def test_damaged_bytes_give_kafka_pythons_records_or_its_error(
    groups: list[list[Any]], flips: list[tuple[int, int]], check_crcs: bool
) -> None:
    raw = bytearray(b"".join(batch_bytes(g, 10 * i) for i, g in enumerate(groups)))
    for at, byte in flips:
        raw[at % len(raw)] = byte
    theirs, ours = both(bytes(raw), 0, check_crcs)
    assert ours == theirs


def test_compressed_control_and_legacy_batches_are_left_to_kafka_python() -> None:
    plain = batch_bytes([(b"k", b"v", [], 5)], 0)
    compressed = bytearray(plain)
    compressed[22] |= 0x01
    control = bytearray(plain)
    control[22] |= 0x20
    legacy = bytearray(plain)
    legacy[16] = 1
    for raw in (compressed, control, legacy):
        assert decode_record_batches(bytes(raw), from_offset=0, check_crcs=False) is None
    damaged = bytearray(plain)
    damaged[-1] ^= 0xFF
    assert decode_record_batches(bytes(damaged), from_offset=0) is None  # CRC
    theirs, ours = both(bytes(damaged), 0)
    assert ours == theirs and ours[1] is not None  # kafka-python's CorruptRecordError


Aborted = collections.namedtuple("Aborted", ["producer_id", "first_offset"])


def test_read_committed_skips_an_aborted_transaction_as_kafka_python_does() -> None:
    committed = batch_bytes([(b"a", b"1", [], 5)], 0, producer_id=7)
    aborted = batch_bytes([(b"b", b"2", [], 6)], 1, producer_id=8)
    plain = batch_bytes([(b"c", b"3", [], 7)], 2)
    raw = committed + aborted + plain
    assert decode_record_batches(raw, from_offset=0, transactional_ok=False) is None
    assert decode_record_batches(raw, from_offset=0) is not None  # read_uncommitted
    for level, kept in ((IsolationLevel.READ_COMMITTED, [b"a", b"c"]),
                        (IsolationLevel.READ_UNCOMMITTED, [b"a", b"b", b"c"])):  # fmt: skip
        theirs, ours = both(raw, 0, isolation_level=level, aborted_transactions=[Aborted(8, 1)])
        assert ours == theirs and ours[0][0] == kept


@contextlib.contextmanager
def fast_path_calls() -> Iterator[list[bool]]:
    """Whether each fetch the reader decoded took the fast path."""
    calls: list[bool] = []
    real = columnar.decode_record_batches

    def spy(*args: Any, **kwargs: Any) -> Any:
        found = real(*args, **kwargs)
        calls.append(found is not None)
        return found

    columnar.decode_record_batches = spy
    try:
        yield calls
    finally:
        columnar.decode_record_batches = real


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(produced, min_size=1, max_size=60),
    st.sampled_from([None, "gzip"]),
    st.sampled_from([100, 16384]),
)
def test_read_partition_reads_what_kafka_python_reads(
    kafka_bootstrap: str, records: list[Any], compression: str | None, batch_size: int
) -> None:
    if compression is not None:  # kafka-python sends a batch that gzip cannot shrink as is
        records = [*records, (b"k", bytes(4000), [], None)]
    topic = f"columnar-{uuid.uuid4().hex[:12]}"
    create_topic(kafka_bootstrap, topic, 1)
    producer = KafkaProducer(
        bootstrap_servers=kafka_bootstrap,
        compression_type=compression,
        batch_size=batch_size,
        linger_ms=5,
        acks="all",
    )
    try:
        for key, value, headers, stamp in records:
            producer.send(
                topic, key=key, value=value, headers=headers, timestamp_ms=stamp, partition=0
            )
        producer.flush(timeout=30)
    finally:
        producer.close()
    expected = read_all(kafka_bootstrap, topic)
    assert len(expected) == len(records)
    options = parse_options(
        {"kafka.bootstrap.servers": kafka_bootstrap, "subscribe": topic, "includeHeaders": "true"}
    )
    part = FTKafkaPartition(topic, 0, 0, len(records), 0, 0, 0)
    with fast_path_calls() as fast:
        table = pa.Table.from_batches(
            list(read_partition(options, source_schema(False, include_headers=True), part))
        )
    assert table.column("key").to_pylist() == [r.key for r in expected]
    assert table.column("value").to_pylist() == [r.value for r in expected]
    assert table.column("offset").to_pylist() == [r.offset for r in expected]
    assert table.column("topic").to_pylist() == [topic] * len(expected)
    assert table.column("partition").to_pylist() == [0] * len(expected)
    stamps_us = table.column("timestamp").cast(pa.int64()).to_pylist()
    assert stamps_us == [r.timestamp * 1000 for r in expected]
    headers = [
        [(h["key"], h["value"]) for h in found] for found in table.column("headers").to_pylist()
    ]
    assert headers == [list(r.headers) for r in expected]
    assert fast and all(fast) == (compression is None)  # gzip: kafka-python decoded
