"""The ftkafka reader's threads on real parts (a real broker, a real FT-layer server,
the reader itself, no Spark): with FT on it persists a partition's records piece by
piece in a thread of its own while it hands earlier pieces to Spark. What a user
relies on: no row leaves the reader before the FT layer has its record; a reader
closed early (a cancelled task, a query stopped) persisted only a bounded read-ahead
and leaves no thread behind; and an FT layer that dies under it fails the read with
an error naming it, never a hang or a row without its record."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pyarrow as pa
import pytest
from fixture_types import MakeTopic
from serverproc import Server, StartServer

from ftlayer.client import FTClient
from ftlayer.client.channel import close_shared_channels
from ftlayer.errors import FTLayerError
from ftlayer.integration.harness.kafka import produce, wait_until
from ftlayer.integration.source import parse_options, source_schema
from ftlayer.integration.source.driver import SourceDriver
from ftlayer.integration.source.options import SourceOptions
from ftlayer.integration.source.reader import (
    PERSIST_PIECE_RECORDS,
    FTKafkaPartition,
    read_partition,
)

pytestmark = pytest.mark.integration

N = 3 * PERSIST_PIECE_RECORDS + 5_000  # more than the read-ahead can hold


def _threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "ftkafka-prefetch"]


def _setup(
    kafka_bootstrap: str, make_topic: MakeTopic, server: Server, **extra: str
) -> tuple[SourceOptions, FTKafkaPartition]:
    topic = make_topic(1)
    values = ((b"k%d" % i, b"value-%d" % i) for i in range(N))
    produce(kafka_bootstrap, topic, values, timeout=120.0, partition=0)
    options = parse_options(
        {
            "kafka.bootstrap.servers": kafka_bootstrap,
            "subscribe": topic,
            "ft.address": server.address,
            "ft.completion": "tree",  # every record persisted (no batch range)
            **extra,
        }
    )
    source_id = options.source_ids()[topic]
    driver = SourceDriver(options, options.source_ids())
    try:
        driver.start()  # registers the source
    finally:
        driver.close()
    return options, FTKafkaPartition(topic, 0, 0, N, source_id, 0, 0)


def test_a_reader_emits_only_persisted_records_and_closed_early_leaves_no_thread(
    kafka_bootstrap: str, make_topic: MakeTopic, ft_server: Server
) -> None:
    options, part = _setup(kafka_bootstrap, make_topic, ft_server)
    schema = source_schema(True)
    with FTClient(ft_server.address) as client:
        before = client.status().persisted
        rows = read_partition(options, schema, part)
        first = next(rows)
        assert 0 < first.num_rows <= PERSIST_PIECE_RECORDS
        # Every row handed out has its record in the FT layer already, and the reader
        # persists ahead of what it handed out by a bounded read-ahead only: the
        # piece waiting for Spark and the one being persisted.
        time.sleep(1.0)
        ahead = client.status().persisted - before
        assert first.num_rows <= ahead <= first.num_rows + 2 * PERSIST_PIECE_RECORDS < N
        rows.close()  # a cancelled task: Spark closes the generator
        wait_until(lambda: not _threads(), 10, "the reader's threads to end")
        # A reader that runs to the end hands out every record once, in offset order,
        # each persisted before the reader returned.
        before = client.status().persisted
        table = pa.Table.from_batches(list(read_partition(options, schema, part)))
        assert table.column("offset").to_pylist() == list(range(N))
        assert table.column("value")[N - 1].as_py() == b"value-%d" % (N - 1)
        assert client.status().persisted - before == N
        roots = table.column("ft_root").to_pylist()
        assert len(set(roots)) == N and 0 not in roots
    assert not _threads()


def test_a_reader_whose_ft_layer_dies_mid_read_fails_naming_it(
    kafka_bootstrap: str, make_topic: MakeTopic, start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(tmp_path / "ft")
    options, part = _setup(kafka_bootstrap, make_topic, server, **{"ft.reconnectTimeoutMs": "1000"})
    rows = read_partition(options, source_schema(True), part)
    handed = next(rows).num_rows
    try:
        server.kill()
        began = time.monotonic()
        with pytest.raises(FTLayerError, match=server.address.split(":")[-1]):
            handed += sum(batch.num_rows for batch in rows)
        # Raised after about ft.reconnectTimeoutMs of retries, not a hang; and what
        # was handed out before stays what was persisted before the kill.
        assert time.monotonic() - began < 30
        assert handed < N
        wait_until(lambda: not _threads(), 10, "the reader's threads to end")
    finally:
        rows.close()
        close_shared_channels()
