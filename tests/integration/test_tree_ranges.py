"""Tree mode by range on real parts (a real broker, a real FT-layer server, the ftkafka
source's own driver and reader, no Spark): a tree-mode batch read by reference is one
offset range per partition in the FT layer, stored before any row is emitted, with
nothing stored per record; each row carries its range root and its emission id, and
its record completes when its tree does; a failed row is replayed with its bytes; a
second read of the same records (a batch computed twice, a task retried) starts their
trees over."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from fixture_types import MakeTopic
from serverproc import Server, StartServer

from ftlayer import rangeroots
from ftlayer.causes import Cause, FailKind
from ftlayer.client import FTClient
from ftlayer.core.sinkholds import SINK_KEY_BIT
from ftlayer.integration.harness.kafka import produce
from ftlayer.integration.source import parse_options, source_schema
from ftlayer.integration.source.driver import SourceDriver
from ftlayer.integration.source.options import SourceOptions
from ftlayer.integration.source.reader import FTKafkaPartition, read_partition
from ftlayer.payloads import decode_payloads

pytestmark = pytest.mark.integration

N = 40


def _options(bootstrap: str, topic: str, server: Server, **extra: str) -> SourceOptions:
    """A tree-mode source by range (ft.treeRanges) reading `topic`."""
    return parse_options(
        {
            "kafka.bootstrap.servers": bootstrap,
            "subscribe": topic,
            "ft.address": server.address,
            "ft.completion": "tree",
            "ft.treeRanges": "true",
            **extra,
        }
    )


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
    options = _options(kafka_bootstrap, topic, ft_server, **{"ft.retryBackoffMs": "0"})
    assert options.persist == "reference" and options.by_range
    source_id = options.source_ids()[topic]
    driver = SourceDriver(options, options.source_ids())
    client = FTClient(ft_server.address)
    try:
        driver.start()  # registers the source
        before = client.status()
        planned = [FTKafkaPartition(topic, p, 0, ends[p], source_id, 0, 0) for p in (0, 1)]
        parts = driver.open_ranges(planned)
        assert all(p.range_number > 0 for p in parts)
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
            assert len(set(ids.tolist())) == len(ids) and 0 not in ids
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


def test_a_second_read_of_a_range_starts_its_records_trees_over(
    kafka_bootstrap: str, make_topic: MakeTopic, ft_server: Server
) -> None:
    """A batch computed twice (a sink that counts, then collects) or a task retried
    reads its range again: the second read's rows complete the records the first one
    left half way, and the first read's ids complete nothing any more."""
    topic = make_topic(1)
    produce(kafka_bootstrap, topic, [(b"k", b"v%d" % i) for i in range(6)], partition=0)
    options = _options(kafka_bootstrap, topic, ft_server)
    source_id = options.source_ids()[topic]
    driver = SourceDriver(options, options.source_ids())
    client = FTClient(ft_server.address)
    schema = source_schema(True)
    try:
        driver.start()
        before = client.status().completed
        (part,) = driver.open_ranges([FTKafkaPartition(topic, 0, 0, 6, source_id, 0, 0)])
        first = pa.Table.from_batches(list(read_partition(options, schema, part)))
        roots, first_ids = _unsigned(first.column("ft_root")), _unsigned(first.column("ft_id"))
        children = np.arange(1, 7, dtype=np.uint64) << np.uint64(20)
        client.xor(roots[:2], first_ids[:2])  # the first read's trees of two complete
        client.xor(roots[2:], first_ids[2:] ^ children[2:])  # the others half way
        second = pa.Table.from_batches(list(read_partition(options, schema, part)))
        second_ids = _unsigned(second.column("ft_id"))
        assert not np.isin(second_ids, first_ids).any()  # a seed of its own
        client.xor(roots[2:], children[2:])  # the first read's sink: completes nothing
        assert client.status().completed - before == 2
        client.xor(roots[2:], children[2:])  # (undone)
        client.xor(roots[2:], second_ids[2:])
        status = client.status()
        assert status.completed - before == 6 and status.pending_by_source == {}
    finally:
        driver.close()
        client.close()


def test_a_sigkill_of_the_ft_layer_keeps_every_range_records_tree(
    kafka_bootstrap: str, make_topic: MakeTopic, start_server: StartServer
) -> None:
    """The FT layer is SIGKILLed with a range's records in every state: two complete,
    two half way through their trees, two whose acks a batch sink holds, two only
    read. The restarted server (same data dir and port) has four of them done, the
    others pending; the half-way ones complete with their last events, the sink's
    settle completes its two, the last two with the events of the read before the
    kill; nothing is replayed and nothing times out."""
    topic = make_topic(1)
    produce(kafka_bootstrap, topic, [(b"k", b"v%d" % i) for i in range(8)], partition=0)
    server = start_server()
    options = _options(kafka_bootstrap, topic, server)
    source_id = options.source_ids()[topic]
    driver = SourceDriver(options, options.source_ids())
    schema = source_schema(True)
    try:
        driver.start()
        (part,) = driver.open_ranges([FTKafkaPartition(topic, 0, 0, 8, source_id, 0, 0)])
        rows = pa.Table.from_batches(list(read_partition(options, schema, part)))
        roots, ids = _unsigned(rows.column("ft_root")), _unsigned(rows.column("ft_id"))
        children = np.arange(1, 9, dtype=np.uint64) << np.uint64(24)
        sink = SINK_KEY_BIT | 41
        with server.client() as client:
            client.xor(roots[:2], ids[:2])
            client.xor(roots[2:6], ids[2:6] ^ children[2:6])
            assert client.sink_hold(sink, roots[4:6], children[4:6]) == 2
            assert client.status().completed == 2
        server.kill()
        port = server.address.rsplit(":", 1)[1]
        server = start_server(server.data_dir, "--port", port)
        with server.client() as client:
            assert client.status().pending_by_source == {str(source_id): 6}
            client.xor(roots[2:4], children[2:4])
            assert client.sink_settle(sink) == 2
            client.xor(roots[6:], ids[6:])
            status = client.status()
            assert status.completed == 6 and status.pending_by_source == {}
            assert status.failed["recovery"] == 0 and status.failed["timeout"] == 0
            assert status.open_ranges == 0 and status.stored_records == 0
    finally:
        driver.close()
