"""A barrier-mode batch's replays, fetched once by its planner and handed to its input
partitions (integration.source.given), on real parts: a real broker, a real FT-layer
server, the ftkafka stream reader's own planning and read (no Spark needed for these
steps), failures sent as a task's wrapper sends them."""

from __future__ import annotations

import numpy as np
from fixture_types import MakeTopic
from pyspark.sql.datasource import ReadAllAvailable
from serverproc import Server

from ftlayer.causes import Cause, FailKind
from ftlayer.client import FTClient
from ftlayer.integration.ftcolumns import ROOT_COLUMN
from ftlayer.integration.harness.kafka import produce, wait_until
from ftlayer.integration.source import FTKafkaStreamReader, parse_options, source_schema

PARTITIONS, N = 3, 60
FAILED = Cause(FailKind.EXPLICIT, "enrich", "FailException: lookup failed")


def _rows(reader: FTKafkaStreamReader, parts: list) -> list[tuple[int, bytes, int]]:
    """(input partition, value, root) of every row the batch's readers yield."""
    rows = []
    for part in parts:
        for batch in reader.read(part):
            values = batch.column("value").to_pylist()
            roots = batch.column(ROOT_COLUMN).to_numpy().astype(np.uint64).tolist()
            rows += [(part.partition, v, r) for v, r in zip(values, roots, strict=True)]
    return rows


def _requests(client: FTClient, kind: str) -> int:
    cost = client.status().requests.get(kind)
    return 0 if cost is None else cost.count


def test_a_barrier_batchs_replays_take_one_fetch_and_each_reaches_its_partition(
    kafka_bootstrap: str, make_topic: MakeTopic, ft_server: Server
) -> None:
    """Records of three partitions fail in one batch (by their range roots, as a task
    does); once the driver copied them in, the next batch takes each replay in, in the
    input partition its key routes it to (its own: Kafka's partitioner), fetched for
    the whole batch by its planner in the one request that begins it (BATCH_BEGIN), with
    no FETCH_REPLAY of its own and none by its readers."""
    topic = make_topic(PARTITIONS)
    produce(kafka_bootstrap, topic, [(b"k%d" % i, b"value-%d" % i) for i in range(N)])
    options = parse_options(
        {
            "kafka.bootstrap.servers": kafka_bootstrap,
            "subscribe": topic,
            "ft.address": ft_server.address,
            "ft.retryBackoffMs": "0",
        }
    )
    assert options.completion == "barrier" and options.persist == "reference"  # defaults
    reader = FTKafkaStreamReader(options, source_schema(True, completion="barrier"))
    client = FTClient(ft_server.address)
    try:
        start = reader.initialOffset()
        end = reader.latestOffset(start, ReadAllAvailable())
        parts = reader.partitions(start, end)
        first = _rows(reader, parts)
        assert len(first) == N
        failed = [(p, v, r) for p, v, r in first if int(v.split(b"-")[1]) % 4 == 0]
        assert {p for p, _, _ in failed} == set(range(PARTITIONS))
        client.fail(np.array([r for _, _, r in failed], dtype=np.uint64), FAILED)
        reader.commit(end)
        before = _requests(client, "FETCH_REPLAY"), _requests(client, "BATCH_BEGIN")
        # The next trigger has its filler copy their bytes in (which queues them) while
        # it plans; the one after takes them in.
        reader.latestOffset(end, ReadAllAvailable())
        wait_until(lambda: client.status().unfilled == 0, 30, "the failed records copied in")
        second_end = reader.latestOffset(end, ReadAllAvailable())
        second = reader.partitions(end, second_end)
        planned = _requests(client, "FETCH_REPLAY"), _requests(client, "BATCH_BEGIN")
        replays = _rows(reader, second)
        read = _requests(client, "FETCH_REPLAY")
    finally:
        reader.stop()
        client.close()
    assert sorted((p, v) for p, v, _ in replays) == sorted((p, v) for p, v, _ in failed)
    # The planner's one request, for every partition: its barrier and its replays.
    assert (planned[0] - before[0], planned[1] - before[1]) == (0, 1)
    assert read == planned[0]  # the readers asked for nothing
