"""Records stored by reference (`ft.persist=reference`) on real parts: a real broker, a
real FT-layer server, the ftkafka source's own driver and reader (no Spark needed for
these steps). A failed record's bytes are copied from Kafka into the FT layer by the
driver; a replay fetched before that is read from Kafka by its reader; a record Kafka
no longer has (its topic deleted) becomes a dead letter with the cause source-expired,
counted in STATUS, never skipped."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from fixture_types import MakeTopic
from kafka import KafkaAdminClient
from serverproc import Server, StartServer

from ftlayer import rangeroots
from ftlayer.acking.handlers import Persister
from ftlayer.causes import Cause, FailKind
from ftlayer.client import FTClient
from ftlayer.integration.harness.broker import free_port
from ftlayer.integration.harness.kafka import create_topic, produce, wait_until
from ftlayer.integration.source import parse_options, source_schema
from ftlayer.integration.source.driver import SourceDriver
from ftlayer.integration.source.options import SourceOptions
from ftlayer.integration.source.reader import FTKafkaPartition, read_partition
from ftlayer.payloads import decode_payloads
from ftlayer.wire import Kind

N = 12


def _setup(
    kafka_bootstrap: str, make_topic: MakeTopic, server: Server
) -> tuple[str, SourceOptions, int, FTClient, SourceDriver, list[tuple[int, int]]]:
    topic = make_topic(2)
    make_topic(1)  # a cluster with a topic besides the one deleted (an empty listing is no answer)
    positions = produce(kafka_bootstrap, topic, [(b"k%d" % i, b"value-%d" % i) for i in range(N)])
    options = parse_options(
        {
            "kafka.bootstrap.servers": kafka_bootstrap,
            "subscribe": topic,
            "ft.address": server.address,
            "ft.retryBackoffMs": "0",
            "ft.completion": "tree",
        }
    )
    assert options.persist == "reference"  # the default
    source_id = options.source_ids()[topic]
    driver = SourceDriver(options, options.source_ids())
    driver.start()  # registers the source
    return (
        topic,
        options,
        source_id,
        FTClient(server.address),
        driver,
        [(p.partition, p.offset) for p in positions],
    )


def _persist_by_reference(
    client: FTClient, topic: str, source_id: int, where: list[tuple[int, int]]
) -> np.ndarray:
    """What the reader does with ft.persist=reference: the coordinates, no bytes."""
    persister = Persister(client, source_id=source_id)
    anchors = persister.persist(
        [b""] * len(where),
        topics=topic,
        partitions=[p for p, _ in where],
        offsets=[o for _, o in where],
        references=True,
    )
    return anchors.roots


def _delete(kafka_bootstrap: str, topic: str) -> None:
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    try:
        admin.delete_topics([topic])
    finally:
        admin.close()


def test_the_driver_copies_failed_records_in_and_dead_letters_those_kafka_lost(
    kafka_bootstrap: str, make_topic: MakeTopic, ft_server: Server
) -> None:
    topic, _, source_id, client, driver, where = _setup(kafka_bootstrap, make_topic, ft_server)
    try:
        roots = _persist_by_reference(client, topic, source_id, where)
        explicit = Cause(FailKind.EXPLICIT, "enrich", "FailException: lookup failed")
        client.fail(roots[:3], explicit)
        status = client.status()
        assert status.unfilled == 3 and status.by_source[str(source_id)].unfilled == 3
        # The driver's next trigger has its filler copy their bytes from Kafka.
        driver.available(None)
        assert driver.filler.wait_idle(30)
        status = client.status()
        assert (status.unfilled, status.filled) == (0, 3)
        replay = client.fetch_replay(0, status.replay_cursor_of([source_id]), source_id)
        keys, values, _, _ = decode_payloads(replay.records.payloads)
        got = sorted(zip(keys.to_pylist(), values.to_pylist(), strict=True))
        assert got == [(b"k%d" % i, b"value-%d" % i) for i in range(3)]
        # Two more fail; then the topic is deleted before the driver copies them.
        client.fail(roots[3:5], explicit)
        _delete(kafka_bootstrap, topic)
        assert driver.fill_failed([source_id]) == 0
        status = client.status()
        assert status.unfilled == 0
        assert status.failed["source-expired"] == 2
        assert status.by_source[str(source_id)].failed["source-expired"] == 2
        listed = client.dead_letters({"source_id": source_id})
        assert sorted(listed.records.offsets.tolist()) == sorted(o for _, o in where[3:5])
        assert {letter["causes"][-1]["kind"] for letter in listed.letters} == {"source-expired"}
    finally:
        driver.close()
        client.close()


def test_a_trigger_leaves_the_copying_to_the_filler_and_the_next_takes_the_rows_in(
    kafka_bootstrap: str, make_topic: MakeTopic, ft_server: Server
) -> None:
    """Failed rows of a barrier-mode batch range wait for their bytes and keys (their
    replay partition) before they are queued. A trigger that sees them does not wait
    for Kafka's reads: it asks one STATUS, and its filler copies them in behind it (its
    own client), which queues them (no backoff here); the next trigger's batch takes
    them in, its replay cursor covering them."""
    topic, _, source_id, client, driver, where = _setup(kafka_bootstrap, make_topic, ft_server)
    try:
        (number,) = client.register_ranges([(source_id, topic, 0, 0, 3)])
        failing = rangeroots.encode(number, 0, [0, 2])
        client.fail(failing, Cause(FailKind.EXPLICIT, "enrich", "FailException: no"))
        assert client.status().unfilled == 2
        sent = driver.shards.call(0, "count", lambda c: c.requests_sent.copy())
        first = driver.available(None)
        sent = driver.shards.call(0, "count", lambda c: c.requests_sent - sent)
        before = client.fetch_replay(0, driver.parse(first).cursors[0], source_id)
        assert driver.filler.wait_idle(30)
        assert client.status().unfilled == 0
        second = driver.available(first)
        replay = client.fetch_replay(0, driver.parse(second).cursors[0], source_id)
    finally:
        driver.close()
        client.close()
    assert dict(sent) == {Kind.STATUS: 1}
    assert len(before.records) == 0  # planned before the copy: not queued yet
    on_0 = {o: i for i, (p, o) in enumerate(where) if p == 0}
    _, values, _, _ = decode_payloads(replay.records.payloads)
    assert sorted(values.to_pylist()) == sorted(b"value-%d" % on_0[o] for o in (0, 2))


def test_a_failed_record_whose_topic_was_made_again_is_a_dead_letter_at_once(
    kafka_bootstrap: str, make_topic: MakeTopic, ft_server: Server
) -> None:
    """A topic deleted and made again (empty) before the driver copies its failed
    records in: Kafka's log of each partition now ends before their offsets, so they
    are gone, source-expired dead letters at that trigger, not a read that waits
    pollTimeoutMs (120 s) for records that will never come."""
    topic, _, source_id, client, driver, where = _setup(kafka_bootstrap, make_topic, ft_server)
    try:
        roots = _persist_by_reference(client, topic, source_id, where)
        client.fail(roots[:4], Cause(FailKind.EXPLICIT, "enrich", "FailException: no"))
        _delete(kafka_bootstrap, topic)
        wait_until(
            lambda: _made_again(kafka_bootstrap, topic), 20, "the topic made again after its delete"
        )
        began = time.monotonic()
        assert driver.fill_failed([source_id]) == 0
        took = time.monotonic() - began
        status = client.status()
    finally:
        driver.close()
        client.close()
    assert (status.unfilled, status.failed["source-expired"], status.dead_lettered) == (0, 4, 4)
    assert took < 30, took  # not the 120 s of pollTimeoutMs


def _made_again(kafka_bootstrap: str, topic: str) -> bool:
    """Create `topic` (2 partitions, empty); False while its delete is still under way."""
    try:
        create_topic(kafka_bootstrap, topic, 2)
    except Exception:  # the old topic still there: try again
        return False
    return True


def test_a_replay_fetched_before_its_bytes_were_copied_is_read_from_kafka(
    kafka_bootstrap: str, make_topic: MakeTopic, ft_server: Server
) -> None:
    topic, options, source_id, client, driver, where = _setup(
        kafka_bootstrap, make_topic, ft_server
    )
    try:
        roots = _persist_by_reference(client, topic, source_id, where)
        failed = [i for i, (p, _) in enumerate(where) if p == 0][:3]
        client.fail(roots[failed], Cause(FailKind.EXPLICIT, "s", "FailException: no"))
        cursor = client.status().replay_cursor_of([source_id])
        end = max(o for p, o in where if p == 0) + 1
        part = FTKafkaPartition(topic, 0, end, end, source_id, 0, cursor)
        schema = source_schema(True)
        table = pa.Table.from_batches(list(read_partition(options, schema, part)))
        assert sorted(table.column("value").to_pylist()) == sorted(b"value-%d" % i for i in failed)
        assert sorted(table.column("offset").to_pylist()) == sorted(where[i][1] for i in failed)
        # The driver has not copied them in: still unfilled.
        assert client.status().unfilled == 3
        # Kafka loses the topic: the reader emits none of them and fails each, final.
        _delete(kafka_bootstrap, topic)
        rows = list(read_partition(options, schema, part))
        assert sum(batch.num_rows for batch in rows) == 0
        wait_until(lambda: client.status().failed["source-expired"] == 3, 10, "the reader's fails")
        assert client.status().dead_lettered == 3
    finally:
        driver.close()
        client.close()


def test_a_copy_that_cannot_reach_the_ft_layer_is_logged_and_made_by_a_later_request(
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The filler's thread finds the FT layer down: it says so in the log, and the
    failed records stay unfilled (nothing is lost or skipped); once the server is
    back, the next request (a later trigger's) copies them in."""
    port = str(free_port())
    server = start_server(tmp_path / "ft", "--port", port)
    topic, _, source_id, client, driver, where = _setup(kafka_bootstrap, make_topic, server)
    try:
        roots = _persist_by_reference(client, topic, source_id, where)
        client.fail(roots[:2], Cause(FailKind.EXPLICIT, "enrich", "FailException: no"))
        client.close()
        server.kill()
        with caplog.at_level(logging.WARNING, logger="ftlayer.source"):
            driver.filler.request(0, [source_id])
            assert driver.filler.wait_idle(30)
        assert "could not copy failed records into the FT layer" in caplog.text
        server = start_server(server.data_dir, "--port", port)
        with FTClient(server.address) as again:
            assert again.status().unfilled == 2
            driver.filler.request(0, [source_id])
            assert driver.filler.wait_idle(30)
            status = again.status()
    finally:
        driver.close()
    assert (status.unfilled, status.filled) == (0, 2)
