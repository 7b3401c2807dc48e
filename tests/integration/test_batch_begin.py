"""BATCH_BEGIN on a real `ftlayer serve` process: a micro-batch's ranges, barrier and
replays in one request (docs/protocol.md 5.20), what the ftkafka driver sends once per
batch and shard where it sent BATCH_RANGES, CHECKPOINT_BEGIN and FETCH_REPLAY."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from serverproc import StartServer

from ftlayer.acking.handlers import Persister
from ftlayer.client import FTClient
from ftlayer.registration import SourceRegistration
from ftlayer.server import FTServer
from ftlayer.wire import Kind

ORDERS, CLICKS = 9, 10


def _position(offset: int, replay: int) -> dict[str, Any]:
    return {"kafka": {"orders": {"0": offset}}, "replay": replay}


def _failed(client: FTClient, source_id: int, payloads: list[bytes]) -> None:
    """`payloads` stored as source `source_id`'s records, failed: in its replay queue."""
    anchors = Persister(client, source_id=source_id).persist(
        payloads, topics="orders", partitions=np.zeros(len(payloads)), offsets=None
    )
    assert client.fail(anchors.roots) == len(payloads)


def test_a_batch_begins_in_one_request_with_its_ranges_barrier_and_replays(
    start_server: StartServer,
) -> None:
    """One BATCH_BEGIN opens the batch's range (stored: STATUS counts it), completes the
    barrier before and begins the batch's (the checkpoints say so), and brings back the
    replays of the source named, not another's; sent again (a reconnect's retry), it
    gives the same range number and checkpoint, as each of the three requests does.
    Nothing else is sent."""
    server = start_server()
    with server.client() as client:
        for source in (ORDERS, CLICKS):
            client.register_source(SourceRegistration(source, "rebalance", 1))
        _failed(client, ORDERS, [b"order-%d" % i for i in range(3)])
        _failed(client, CLICKS, [b"click-%d" % i for i in range(2)])
        hi = client.status()["replay_cursor"]
        first = client.checkpoint(
            begin=True, query="job", position=_position(0, 0), sources=[ORDERS]
        )
        sent = dict(client.requests_sent)

        def begin() -> Any:
            return client.begin_batch(
                query="job",
                position=_position(10, hi),
                sources=[ORDERS],
                complete=_position(0, 0),
                ranges=[(ORDERS, "orders", 0, 0, 10), (ORDERS, "orders", 1, 4, 4)],
                replays=(0, hi),
                replay_sources=[ORDERS],
            )

        started = begin()
        requests = {k: n - sent.get(k, 0) for k, n in client.requests_sent.items()}
        status = client.status()
        again = begin()
    assert {k: n for k, n in requests.items() if n} == {Kind.BATCH_BEGIN: 1}
    number, empty = started.range_numbers
    assert number > 0 and empty == 0 and status["open_ranges"] == 1
    assert (started.checkpoint.id, started.checkpoint.state) == (first["id"] + 1, "begun")
    assert started.checkpoint.completed is not None
    assert (started.checkpoint.completed.id, started.checkpoint.completed.state) == (
        first["id"],
        "complete",
    )
    assert sorted(bytes(p) for p in started.replays.records.payloads) == [
        b"order-0",
        b"order-1",
        b"order-2",
    ]
    assert set(started.replays.records.source_ids.tolist()) == {ORDERS}
    assert again.range_numbers == started.range_numbers
    assert again.checkpoint.id == started.checkpoint.id


def test_replays_that_do_not_fit_the_reply_are_fetched_after_it(tmp_path: Path) -> None:
    """A 64 KiB frame limit and 10 KB payloads: BATCH_BEGUN carries the first replays
    and says how far; begin_batch fetches the rest from there, and every replay comes
    back once."""
    payloads = [bytes([i]) * 10_000 for i in range(30)]
    with FTServer(tmp_path / "data", max_frame=65_536) as server:
        host, port = server.address
        with FTClient(f"{host}:{port}") as client:
            client.register_source(SourceRegistration(ORDERS, "rebalance", 1))
            for lo in range(0, 30, 5):
                _failed(client, ORDERS, payloads[lo : lo + 5])
            hi = client.status()["replay_cursor"]
            started = client.begin_batch(
                query="job",
                position=_position(0, hi),
                sources=[ORDERS],
                replays=(0, hi),
                replay_sources=[ORDERS],
            )
            pages = client.requests_sent[Kind.FETCH_REPLAY]
    assert pages >= 4  # 300 KB of replays, at most about six rows a frame
    assert started.replays.replay_seqs.tolist() == list(range(1, 31))
    assert sorted(bytes(p) for p in started.replays.records.payloads) == sorted(payloads)
