"""The HTTP receiver (`ftlayer ingest http`, integration.receivers.http) against a real
`ftlayer serve`: a 200 means the records are durable in the FT layer and queued for the
source's readers, each in the partition its key routes it to; a record sent again with
its id is stored once; bad requests get a clear 4xx and store nothing; at the source's
limit of pending records it answers 503 with Retry-After until its reader caught up."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from serverproc import Server, StartServer, queued_records

from ftlayer.client import FTClient
from ftlayer.integration.receivers import ingest_source_id
from ftlayer.partitioners.key_hashes import kafka_key_hash

pytestmark = pytest.mark.integration

PARTITIONS = 3
MAX_PENDING = 8


@pytest.fixture
def receiver(start_server: StartServer) -> Iterator[tuple[Server, str]]:
    """A server and an `ftlayer ingest http` process for sources orders (by key) and
    clicks (round robin), on a free port; yields (server, its HOST:PORT)."""
    server = start_server()
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "ftlayer.cli", "ingest", "http",
            "--server", server.address, "--source", "orders", "--partitions", str(PARTITIONS),
            "--port", "0", "--max-pending", str(MAX_PENDING), "--max-body-bytes", "2000",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    assert line.startswith("ftlayer ingest http on http://"), line
    address = line.split("http://", 1)[1].split("/", 1)[0]
    try:
        yield server, address
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


def _post(address: str, path: str, body: bytes, kind: str, **headers: str) -> tuple[int, Any, Any]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", path, body, {"Content-Type": kind, **headers})
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read()), reply.getheader("Retry-After")
    finally:
        conn.close()


def _queued(client: FTClient, source_id: int) -> dict[int, list[tuple[bytes, bytes]]]:
    """Per partition, the (key, value) of each record its reader would fetch."""
    return queued_records(client, source_id, PARTITIONS)


def test_a_200_means_stored_and_queued_by_key_and_a_resent_id_is_stored_once(
    receiver: tuple[Server, str],
) -> None:
    server, address = receiver
    records = [{"key": f"order-{i}", "value": {"n": i}, "id": i} for i in range(5)]
    status, body, _ = _post(
        address, "/sources/orders", json.dumps(records).encode(), "application/json"
    )
    assert (status, body) == (200, {"stored": 5, "duplicates": 0})
    # The client did not see the 200 and sends again, with one more: that one is new.
    again = [*records[3:], {"key": "order-5", "value": {"n": 5}, "id": 5}]
    status, body, _ = _post(
        address, "/sources/orders", json.dumps(again).encode(), "application/json"
    )
    assert (status, body) == (200, {"stored": 1, "duplicates": 2})
    status, body, _ = _post(
        address, "/sources/orders", b"\x00raw", "application/octet-stream",
        **{"Ftlayer-Key": "order-6", "Ftlayer-Id": "6"},
    )  # fmt: skip
    assert (status, body) == (200, {"stored": 1, "duplicates": 0})
    with server.client() as client:
        queued = _queued(client, ingest_source_id("orders"))
        stats = client.status()
    assert (stats.ingested, stats.ingest_duplicates) == (7, 2)
    everything = sorted(kv for kvs in queued.values() for kv in kvs)
    assert everything == sorted(
        [(f"order-{i}".encode(), json.dumps({"n": i}).encode()) for i in range(6)]
        + [(b"order-6", b"\x00raw")]
    )
    for p, kvs in queued.items():  # where Kafka's default partitioner puts their keys
        assert all((kafka_key_hash(k) & 0x7FFFFFFF) % PARTITIONS == p for k, _ in kvs)


def test_bad_requests_get_a_clear_4xx_and_store_nothing(receiver: tuple[Server, str]) -> None:
    server, address = receiver
    one = json.dumps({"key": "k", "value": 1}).encode()
    cases = [
        ("/sources/payments", one, "application/json", 404, "no source"),
        ("/sources/orders", one, "text/plain", 415, "content type"),
        ("/sources/orders", b"x" * 2001, "application/json", 413, "over 2000"),
        ("/sources/orders", b"{not json", "application/json", 400, "not JSON"),
        ("/sources/orders", b'{"key": 1, "value": 2}', "application/json", 400, "key is a string"),
        ("/sources/orders", b'{"value": 2}', "application/json", 400, "routes by key"),
        ("/sources/orders", b'{"key": "k", "value": 2, "id": -3}', "application/json", 400, "id"),
    ]
    for path, body, kind, expected, says in cases:
        status, reply, _ = _post(address, path, body, kind)
        assert status == expected and says in reply["error"], (path, kind, status, reply)
    with server.client() as client:
        status = client.status()
    assert status.ingested == 0 and status.stored_records == 0


def test_at_its_limit_the_source_answers_503_until_its_reader_caught_up(
    receiver: tuple[Server, str],
) -> None:
    server, address = receiver
    batch = [{"key": f"k{i}", "value": i, "id": i} for i in range(MAX_PENDING)]
    status, body, _ = _post(
        address, "/sources/orders", json.dumps(batch).encode(), "application/json"
    )
    assert (status, body["stored"]) == (200, MAX_PENDING)
    late = json.dumps({"key": "late", "value": 0, "id": 99}).encode()
    status, body, retry_after = _post(address, "/sources/orders", late, "application/json")
    assert status == 503 and retry_after == "1" and "limit" in body["error"]
    source_id = ingest_source_id("orders")
    with server.client() as client:
        assert client.status().ingested == MAX_PENDING  # the late record was not stored
        # The source's reader takes the records in and its step acks them: complete.
        hi = client.status().replay_cursor_of([source_id])
        for p in range(PARTITIONS):
            records = client.fetch_replay(0, hi, source_id=source_id, partition=p).records
            client.xor(records.roots, np.zeros(len(records), np.uint64))
        assert client.status().pending_of(source_id) == 0
    # The receiver looks again at most 0.2 s later: then it takes records again.
    for _ in range(50):
        status, body, _ = _post(address, "/sources/orders", late, "application/json")
        if status == 200:
            break
        time.sleep(0.05)
    assert (status, body) == (200, {"stored": 1, "duplicates": 0})


def test_a_shard_that_does_not_answer_gets_a_quick_503_and_nothing_is_lost(
    start_server: StartServer, tmp_path: Any
) -> None:
    """With one of two shards killed, a POST is answered 503 with Retry-After within
    seconds (not after the client's 60 s reconnect window), the receiver says which
    shard it waits for, and once the shard is back the same POST is stored."""
    shards = [start_server(tmp_path / f"s{i}", "--shard", str(i), "--shards", "2") for i in (0, 1)]
    log = tmp_path / "receiver.log"
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "ftlayer.cli", "ingest", "http",
            "--server", ",".join(s.address for s in shards), "--source", "orders",
            "--partitions", str(PARTITIONS), "--port", "0",
        ],
        stdout=subprocess.PIPE,
        stderr=log.open("wb"),
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert line.startswith("ftlayer ingest http on http://"), line
        address = line.split("http://", 1)[1].split("/", 1)[0]
        body = json.dumps([{"key": f"k{i}", "value": i, "id": i} for i in range(20)]).encode()
        shards[1].kill()
        began = time.monotonic()
        status, reply, retry_after = _post(address, "/sources/orders", body, "application/json")
        waited = time.monotonic() - began
        assert status == 503 and retry_after is not None, (status, reply)
        assert waited < 10, f"the 503 took {waited:.1f} s"
        assert f"shard 1 of the FT layer, at {shards[1].address}, does not answer" in (
            log.read_text()
        )
        port = shards[1].address.rsplit(":", 1)[1]
        shards[1] = start_server(
            shards[1].data_dir, "--shard", "1", "--shards", "2", "--port", port
        )
        deadline = time.monotonic() + 60
        while True:
            status, reply, _ = _post(address, "/sources/orders", body, "application/json")
            if status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert (status, reply) == (200, {"stored": 20, "duplicates": 0}), log.read_text()
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
