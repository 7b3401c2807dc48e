"""Tree mode by range on real parts (a real broker, a real FT-layer server, the ftkafka
source's own driver and reader, no Spark): a tree-mode batch read by reference is one
offset range per partition in the FT layer, stored before any row is emitted, with
nothing stored per record; each row carries its range root and its emission id, and
its record completes when its tree does; a failed row is replayed with its bytes; a
batch planned again starts its incomplete records over."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from fixture_types import MakeTopic
from serverproc import Server

from ftlayer import rangeroots
from ftlayer.causes import Cause, FailKind
from ftlayer.client import FTClient
from ftlayer.integration.harness.kafka import produce
from ftlayer.integration.source import parse_options, source_schema
from ftlayer.integration.source.driver import SourceDriver
from ftlayer.integration.source.reader import FTKafkaPartition, read_partition
from ftlayer.payloads import decode_payloads

pytestmark = pytest.mark.integration

N = 40


def _unsigned(column: pa.ChunkedArray) -> np.ndarray:
    return np.asarray(column.to_numpy(), dtype=np.int64).view(np.uint64)


def test_a_tree_mode_batch_is_ranges_whose_rows_complete_with_their_trees(
    kafka_bootstrap: str, make_topic: MakeTopic, ft_server: Server
) -> None:
    topic = make_topic(2)
    records = [(b"k%d" % i, b"value-%d" % i) for i in range(N)]
    for p in (0, 1):
        produce(kafka_bootstrap, topic, records[p * N // 2 : (p + 1) * N // 2], partition=p)
    ends = {0: N // 2, 1: N // 2}
    options = parse_options(
        {
            "kafka.bootstrap.servers": kafka_bootstrap,
            "subscribe": topic,
            "ft.address": ft_server.address,
            "ft.completion": "tree",
            "ft.retryBackoffMs": "0",
        }
    )
    assert options.persist == "reference" and options.by_range  # the defaults
    source_id = options.source_ids()[topic]
    driver = SourceDriver(options, options.source_ids())
    client = FTClient(ft_server.address)
    try:
        driver.start()  # registers the source
        before = client.status()
        planned = [FTKafkaPartition(topic, p, 0, ends[p], source_id, 0, 0) for p in (0, 1)]
        parts = driver.open_ranges(planned)
        assert all(p.range_number > 0 and p.range_salt != 0 for p in parts)
        schema = source_schema(True)
        tables = [pa.Table.from_batches(list(read_partition(options, schema, p))) for p in parts]
        table = pa.concat_tables(tables)
        assert table.num_rows == N
        # Nothing stored per record: the ranges are the FT layer's whole state of them.
        status = client.status()
        assert status.stored_records == before.stored_records
        assert status.pending_by_source == {str(source_id): N}
        for part, rows in zip(parts, tables, strict=True):
            roots, ids = _unsigned(rows.column("ft_root")), _unsigned(rows.column("ft_id"))
            offsets = np.asarray(rows.column("offset").to_numpy())
            assert (roots == rangeroots.encode(part.range_number, 0, offsets)).all()
            assert (ids == rangeroots.emission_ids(part.range_salt, roots)).all()
        roots, ids = _unsigned(table.column("ft_root")), _unsigned(table.column("ft_id"))
        # A step emits a child per row; a sink acks all but the first two children;
        # a step fails the first row.
        children = np.arange(1, N + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        client.xor(roots, ids ^ children)
        client.xor(roots[2:], children[2:])
        client.fail(roots[:1], Cause(FailKind.EXPLICIT, "enrich", "FailException: no"))
        status = client.status()
        assert status.completed - before.completed == N - 2
        assert status.failed["explicit"] - before.failed["explicit"] == 1
        # The failed row is replayed with its bytes, copied in from Kafka by the driver.
        assert driver.fill_failed([source_id]) == 1
        status = client.status()
        replay = client.fetch_replay(0, status.replay_cursor_of([source_id]), source_id)
        _, values, _, _ = decode_payloads(replay.records.payloads)
        first = table.slice(0, 1)
        assert values.to_pylist() == first.column("value").to_pylist()
        # Pending: the second row, whose tree never completed (it times out), and the
        # failed one's replay.
        assert client.status().pending_by_source == {str(source_id): 2}
    finally:
        driver.close()
        client.close()


def test_a_batch_planned_again_gets_its_ranges_back_with_new_salts(
    kafka_bootstrap: str, make_topic: MakeTopic, ft_server: Server
) -> None:
    """A re-run of a batch (its driver restarted) reads the same ranges: their numbers
    come back with new salts, so the ids the earlier run's rows carried complete
    nothing, and the re-run's rows complete the records not complete before. An
    earlier run's event that comes after the re-run began leaves its record to time
    out (replayed: a duplicate, never a loss)."""
    topic = make_topic(1)
    produce(kafka_bootstrap, topic, [(b"k", b"v%d" % i) for i in range(6)], partition=0)
    options = parse_options(
        {
            "kafka.bootstrap.servers": kafka_bootstrap,
            "subscribe": topic,
            "ft.address": ft_server.address,
            "ft.completion": "tree",
        }
    )
    source_id = options.source_ids()[topic]
    driver = SourceDriver(options, options.source_ids())
    client = FTClient(ft_server.address)
    try:
        driver.start()
        before = client.status().completed
        plan = [FTKafkaPartition(topic, 0, 0, 6, source_id, 0, 0)]
        (first,) = driver.open_ranges(plan)
        old_roots = rangeroots.encode(first.range_number, 0, np.arange(6))
        old_ids = rangeroots.emission_ids(first.range_salt, old_roots)
        client.xor(old_roots[:2], old_ids[:2])  # the earlier run completed two
        (again,) = driver.open_ranges(plan)
        assert again.range_number == first.range_number
        assert again.range_salt not in (0, first.range_salt)
        client.xor(old_roots[2:4], old_ids[2:4])  # late events of the earlier run
        assert client.status().completed - before == 2
        table = pa.Table.from_batches(list(read_partition(options, source_schema(True), again)))
        client.xor(_unsigned(table.column("ft_root")), _unsigned(table.column("ft_id")))
        status = client.status()
        # Two before the re-run, two by it (4 and 5); 2 and 3 wait for their timeout.
        assert status.completed - before == 4
        assert status.pending_by_source == {str(source_id): 2}
        assert status.late_events == 2  # the re-run's rows of the two complete before
    finally:
        driver.close()
        client.close()
