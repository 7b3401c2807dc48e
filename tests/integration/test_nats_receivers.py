"""The NATS receivers (`ftlayer ingest jetstream`, `ftlayer ingest nats`,
integration.receivers.nats) as processes between a real nats-server with JetStream and a
real `ftlayer serve`: every message of a stream lands in the FT layer once, queued in
the partition its key routes it to; a receiver SIGKILLed mid-stream and started again
loses none and stores none twice (the stream's redeliveries are dropped); at the
source's limit of pending records the receiver stops fetching and the stream keeps the
rest; a core NATS receiver SIGKILLed loses what it had not stored (measured), and one
stopped with SIGTERM stores everything it received; bad input gets a clear error."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from serverproc import Server, StartServer, queued_records, stop_process

from ftlayer.client import FTClient
from ftlayer.integration.harness.broker import free_port
from ftlayer.integration.harness.nats import (
    NatsServer,
    add_stream,
    consumer_info,
    publish,
    wait_stream_messages,
)
from ftlayer.integration.receivers import ingest_source_id
from ftlayer.partitioners.key_hashes import kafka_key_hash
from ftlayer.status import Status

pytestmark = pytest.mark.integration

PARTITIONS = 3
DEADLINE_S = 30.0

StartReceiver = Callable[..., subprocess.Popen[bytes]]


@pytest.fixture
def start_receiver(tmp_path: Path) -> Iterator[StartReceiver]:
    """`start_receiver(kind, *args)`: an `ftlayer ingest KIND` process, once it printed
    its "ftlayer ingest KIND on" line, its log in `receiver-<n>.log` of the test's
    directory; the finalizer stops (or kills) every one."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(kind: str, *args: str) -> subprocess.Popen[bytes]:
        with (tmp_path / f"receiver-{len(procs)}.log").open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "ftlayer.cli", "ingest", kind, *args],
                stdout=subprocess.PIPE,
                stderr=log,
            )
        procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert line.startswith(f"ftlayer ingest {kind} on nats://"), line
        return proc

    yield start
    for proc in procs:
        stop_process(proc)


def _wait(what: str, condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {DEADLINE_S} s: {what}"
        time.sleep(0.02)


def _status(server: Server) -> Status:
    with server.client() as client:
        return client.status()


def _queued(client: FTClient, source: str) -> dict[int, list[tuple[bytes, bytes]]]:
    return queued_records(client, ingest_source_id(source), PARTITIONS)


def _complete_all(client: FTClient, source: str) -> int:
    """Read every queued record of `source` as its reader would and ack it: complete."""
    source_id = ingest_source_id(source)
    hi = client.status().replay_cursor_of([source_id])
    n = 0
    for p in range(PARTITIONS):
        records = client.fetch_replay(0, hi, source_id=source_id, partition=p).records
        client.xor(records.roots, np.zeros(len(records), np.uint64))
        n += len(records)
    return n


def _drained(url: str, stream: str) -> bool:
    """Whether the stream's consumer delivered every message and has all acks."""
    info = asyncio.run(consumer_info(url, stream, "ftlayer"))
    return info.num_pending == 0 and info.num_ack_pending == 0


def _values(n: int) -> list[bytes]:
    return [b"message-%06d" % i for i in range(n)]


def _jetstream_args(server: Server, nats: NatsServer, stream: str, *extra: str) -> list[str]:
    return [
        "--server", server.address, "--nats", nats.url, "--stream", stream,
        "--source", stream.lower(), "--partitions", str(PARTITIONS), *extra,
    ]  # fmt: skip


def test_every_jetstream_message_is_stored_once_and_queued_by_key(
    start_server: StartServer, nats_server: NatsServer, start_receiver: StartReceiver
) -> None:
    server, url = start_server(), nats_server.url
    asyncio.run(add_stream(url, "EXACT", ["exact.>"]))
    subjects = ["exact.eu", "exact.us", "exact.asia"]
    published = {s: _values(500) for s in subjects}
    for subject, values in published.items():
        asyncio.run(publish(url, subject, values))
    asyncio.run(wait_stream_messages(url, "EXACT", 1500))
    start_receiver("jetstream", *_jetstream_args(server, nats_server, "EXACT", "--batch", "200"))
    _wait("1,500 ingested", lambda: _status(server).ingested >= 1500)
    _wait("every message acked", lambda: _drained(url, "EXACT"))  # acked after stored
    with server.client() as client:
        queued = _queued(client, "exact")
        status = client.status()
    assert (status.ingested, status.ingest_duplicates) == (1500, 0)
    assert status.pending_of(ingest_source_id("exact")) == 1500
    found = sorted(kv for kvs in queued.values() for kv in kvs)
    assert found == sorted((s.encode(), v) for s, values in published.items() for v in values)
    for p, kvs in queued.items():  # the key is the subject: routed as Kafka would
        assert all((kafka_key_hash(k) & 0x7FFFFFFF) % PARTITIONS == p for k, _ in kvs)


def test_a_receiver_killed_mid_stream_loses_nothing_and_stores_nothing_twice(
    start_server: StartServer, nats_server: NatsServer, start_receiver: StartReceiver
) -> None:
    """Killed while it stores a batch or before it acked it, the receiver leaves the
    batch unacknowledged: the stream redelivers it after ack_wait, the FT layer drops
    what it stored already. Killed again until a redelivery was dropped."""
    n = 20_000
    server, url = start_server(), nats_server.url
    asyncio.run(add_stream(url, "KILLS", ["kills"]))
    asyncio.run(publish(url, "kills", _values(n)))
    asyncio.run(wait_stream_messages(url, "KILLS", n))
    args = _jetstream_args(server, nats_server, "KILLS", "--batch", "500", "--ack-wait", "1")
    args += ["--max-pending", str(n)]
    kills = 0
    while kills < 8 and _status(server).ingest_duplicates == 0:
        before = _status(server).ingested
        assert before < n, "the stream was consumed before the kills"
        proc = start_receiver("jetstream", *args)
        _wait("a batch stored", lambda: _status(server).ingested > before)  # noqa: B023
        proc.kill()  # at a random point of its loop: fetch, store, ack
        proc.wait(10)
        kills += 1
    start_receiver("jetstream", *args)  # takes the rest, and the redeliveries
    _wait(f"{n} ingested", lambda: _status(server).ingested >= n)
    _wait("every message acked", lambda: _drained(url, "KILLS"))
    with server.client() as client:
        queued = _queued(client, "kills")
        status = client.status()
    values = sorted(v for kvs in queued.values() for _, v in kvs)
    assert values == _values(n)  # 0 lost, 0 stored twice
    assert status.ingested == n and status.ingest_duplicates > 0
    print(f"\n{kills} kills: {status.ingest_duplicates} redelivered records dropped")


def test_at_its_limit_the_receiver_stops_fetching_and_the_stream_keeps_the_rest(
    start_server: StartServer, nats_server: NatsServer, start_receiver: StartReceiver
) -> None:
    n, limit, batch = 3000, 500, 100
    server, url = start_server(), nats_server.url
    asyncio.run(add_stream(url, "HOLD", ["hold"]))
    asyncio.run(publish(url, "hold", _values(n)))
    asyncio.run(wait_stream_messages(url, "HOLD", n))
    start_receiver(
        "jetstream",
        *_jetstream_args(server, nats_server, "HOLD", "--batch", str(batch)),
        "--max-pending", str(limit),
    )  # fmt: skip

    def held() -> bool:
        info = asyncio.run(consumer_info(url, "HOLD", "ftlayer"))
        return _status(server).ingested >= limit and info.num_ack_pending == 0

    _wait("the source at its limit", held)
    source_id = ingest_source_id("hold")
    stored = _status(server).ingested
    info = asyncio.run(consumer_info(url, "HOLD", "ftlayer"))
    assert limit <= stored <= limit + batch
    assert info.num_pending == n - stored > 0  # still in the stream, not delivered
    # The source's reader completes what is pending: the receiver takes more, never
    # holding more than the limit and one batch pending.
    with server.client() as client:
        deadline = time.monotonic() + DEADLINE_S
        completed = 0
        while completed < n:
            assert time.monotonic() < deadline, f"{completed} of {n} completed"
            assert client.status().pending_of(source_id) <= limit + batch
            completed += _complete_all(client, "hold")
        assert client.status().ingested == n and completed == n


def test_stores_that_fail_while_the_ft_layer_is_down_come_again_and_the_receiver_goes_on(
    start_server: StartServer,
    nats_server: NatsServer,
    start_receiver: StartReceiver,
    tmp_path: Path,
) -> None:
    """The FT layer SIGKILLed under a JetStream receiver storing at full speed, and
    started again on its data dir 3 s later: the stores in flight fail (the receiver
    waits 1 s for a server, --reconnect-s 1), their messages are not acknowledged and come
    again; the receiver does not exit, and every message is stored once. Killed again
    until a store failed."""
    n = 30_000
    port = str(free_port())
    server, url = start_server(None, "--port", port), nats_server.url
    asyncio.run(add_stream(url, "OUTAGE", ["outage"]))
    asyncio.run(publish(url, "outage", _values(n)))
    asyncio.run(wait_stream_messages(url, "OUTAGE", n))
    args = _jetstream_args(server, nats_server, "OUTAGE", "--batch", "1000")
    proc = start_receiver("jetstream", *args, "--max-pending", str(n), "--reconnect-s", "1")
    log = tmp_path / "receiver-0.log"
    outages = 0
    while outages < 10 and "come again" not in log.read_text():
        before = _status(server).ingested
        assert before < n, "the stream was stored before a store failed"
        _wait("a batch stored", lambda: _status(server).ingested > before)  # noqa: B023
        server.kill()
        time.sleep(3.0)  # past the receiver's reconnect window: its store fails
        server = start_server(server.data_dir, "--port", port)
        outages += 1
    assert "come again" in log.read_text(), f"no store failed in {outages} outages"
    _wait("every message acked", lambda: _drained(url, "OUTAGE"))  # acked once stored
    assert proc.poll() is None, log.read_text()[-2000:]
    with server.client() as client:
        values = sorted(v for kvs in _queued(client, "outage").values() for _, v in kvs)
    assert values == _values(n)  # 0 lost, 0 stored twice
    print(f"\n{outages} outages until a store failed; the receiver went on")


def _publisher(url: str, subject: str, n: int, per_s: float) -> tuple[threading.Thread, list[int]]:
    """Publishes message-i for i < n at `per_s` in a thread; sent[0] counts them."""
    sent = [0]

    def values() -> Iterator[bytes]:
        for i, value in enumerate(_values(n)):
            sent[0] = i  # message i is being published
            yield value
        sent[0] = n

    thread = threading.Thread(
        target=lambda: asyncio.run(publish(url, subject, values(), per_s=per_s))
    )
    thread.start()
    return thread, sent


def test_a_killed_core_nats_receiver_loses_only_what_it_had_not_stored(
    start_server: StartServer,
    nats_server: NatsServer,
    start_receiver: StartReceiver,
    record_property: Callable[[str, object], None],
) -> None:
    per_s, flush_messages, flush_ms = 2000, 200, 50
    server = start_server()
    proc = start_receiver(
        "nats", "--server", server.address, "--nats", nats_server.url, "--subject", "core.kill",
        "--source", "core", "--partitions", str(PARTITIONS),
        "--flush-messages", str(flush_messages), "--flush-ms", str(flush_ms),
    )  # fmt: skip
    thread, sent = _publisher(nats_server.url, "core.kill", 6000, per_s)
    _wait("1,000 stored", lambda: _status(server).ingested >= 1000)
    proc.kill()
    published = sent[0]  # messages 0 .. published-1 were published before the kill
    proc.wait(10)
    thread.join(DEADLINE_S)
    with server.client() as client:
        values = sorted(v for kvs in _queued(client, "core").values() for _, v in kvs)
    stored = len(values)
    assert values == _values(stored)  # a prefix: no gap, no duplicate
    lost = published - stored
    print(
        f"\ncore NATS receiver SIGKILLed at {per_s} msg/s (flush {flush_messages} messages "
        f"or {flush_ms} ms): {published} published, {stored} stored, {lost} lost"
    )
    record_property("core_nats_lost_at_kill", lost)
    # What it can lose: its buffer (<= flush_messages or flush_ms of traffic), what came
    # during the store in progress, and what was in its socket and client queue.
    assert 0 <= lost <= flush_messages + per_s * 0.5


def test_a_stopped_core_nats_receiver_stores_everything_it_received(
    start_server: StartServer, nats_server: NatsServer, start_receiver: StartReceiver
) -> None:
    server = start_server()
    proc = start_receiver(
        "nats", "--server", server.address, "--nats", nats_server.url, "--subject", "core.stop",
        "--source", "stopped", "--partitions", str(PARTITIONS), "--flush-ms", "10000",
    )  # fmt: skip
    asyncio.run(publish(nats_server.url, "core.stop", _values(2500)))
    proc.terminate()  # the buffer (flushed every 1,000 or 10 s) is stored before it exits
    assert proc.wait(DEADLINE_S) == 0
    with server.client() as client:
        values = sorted(v for kvs in _queued(client, "stopped").values() for _, v in kvs)
    assert values == _values(2500)


def _ingest_fails(*args: str) -> tuple[float, str]:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "ftlayer.cli", "ingest", *args],
        capture_output=True,
        timeout=DEADLINE_S,
    )
    assert done.returncode == 2, done
    return time.monotonic() - start, done.stderr.decode()


def test_bad_input_gets_a_clear_error_within_seconds(
    start_server: StartServer, nats_server: NatsServer
) -> None:
    server = start_server()
    common = ["--source", "bad", "--partitions", "1"]
    _, error = _ingest_fails(
        "jetstream", "--server", server.address, "--nats", nats_server.url, "--stream", "NONE",
        *common,
    )  # fmt: skip
    assert "no JetStream stream 'NONE'" in error, error
    took, error = _ingest_fails(
        "nats", "--server", server.address, "--nats", "nats://127.0.0.1:1", "--subject", "x",
        *common,
    )  # fmt: skip
    assert "NATS server at nats://127.0.0.1:1" in error and took < 10, (took, error)
    took, error = _ingest_fails(
        "nats", "--server", "127.0.0.1:1", "--nats", nats_server.url, "--subject", "x", *common
    )
    assert "FT layer at 127.0.0.1:1" in error and took < 10, (took, error)
