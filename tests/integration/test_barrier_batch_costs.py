"""What a barrier-mode batch by reference costs the FT-layer server, and that the cuts
lose nothing, on a real `ftlayer serve` process driven as the ftkafka source's driver
drives it (no Spark): one store commit per batch (BATCH_RANGES; the completion a
CHECKPOINT_BEGIN carries rides on the next write), the brief STATUS the driver reads,
and SIGKILLs between the folded writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from serverproc import Server, StartServer

from ftlayer.client import FTClient
from ftlayer.policy import RetryPolicy
from ftlayer.registration import SourceRegistration
from ftlayer.server import FTServer, handlers
from ftlayer.wire import Kind, MalformedFrame, StatusRequest

SOURCE, TOPIC, PARTITIONS, PER_PARTITION = 11, "t", 4, 2_500


class _Driver:
    """The driver's requests of one batch after another: BATCH_RANGES, then
    CHECKPOINT_BEGIN of the batch completing the one before."""

    def __init__(self) -> None:
        self.batch = 0
        self.done: dict[str, Any] | None = None  # the last barrier begun

    def ranges(self, n: int) -> list[tuple[int, str, int, int, int]]:
        lo, hi = n * PER_PARTITION, (n + 1) * PER_PARTITION
        return [(SOURCE, TOPIC, p, lo, hi) for p in range(PARTITIONS)]

    def barrier(self, n: int) -> dict[str, Any]:
        ends = {str(p): (n + 1) * PER_PARTITION for p in range(PARTITIONS)}
        return {"kafka": {TOPIC: ends}, "replay": 0}

    def open(self, client: FTClient) -> list[int]:
        """BATCH_RANGES of the next batch: stored when it returns."""
        return client.register_ranges(self.ranges(self.batch))

    def begin(self, client: FTClient) -> None:
        """CHECKPOINT_BEGIN of the batch just opened, completing the one before."""
        end = self.barrier(self.batch)
        client.checkpoint(begin=True, query="q", position=end, sources=[SOURCE], complete=self.done)
        self.done = end
        self.batch += 1


def _register(client: FTClient) -> None:
    client.register_source(
        SourceRegistration(
            SOURCE, "forward", PARTITIONS, retry=RetryPolicy(3, 0, 0), completion="barrier"
        )
    )


def _restart(server: Server, start_server: StartServer) -> Server:
    server.kill()
    return start_server(server.data_dir)


def test_a_batch_costs_one_store_commit(ft_server: Server) -> None:
    driver = _Driver()
    with ft_server.client() as client:
        _register(client)
        driver.open(client)
        driver.begin(client)
        before = client.status().store_commits
        batches = 6
        for _ in range(batches):
            driver.open(client)
            driver.begin(client)
        commits = client.status().store_commits - before
        status = client.status()
    # One per batch (its ranges, with the completion of the batch before them); a
    # second would take the server's flush of an idle store (2 s of nothing).
    assert batches <= commits <= batches + 1
    assert status.open_ranges == PARTITIONS  # the last batch's
    assert status.completed == batches * PARTITIONS * PER_PARTITION


def test_a_kill_between_the_folded_writes_loses_nothing(start_server: StartServer) -> None:
    server = start_server()
    driver = _Driver()
    with server.client() as client:
        _register(client)
        numbers = driver.open(client)
    # Killed right after BATCH_RANGES answered: the ranges were stored before it.
    server = _restart(server, start_server)
    with server.client() as client:
        _register(client)
        status = client.status()
        assert status.open_ranges == PARTITIONS
        assert status.pending_of(SOURCE) == PARTITIONS * PER_PARTITION
        assert client.register_ranges(driver.ranges(0)) == numbers  # the same ones
        driver.begin(client)  # batch 0 runs
        driver.open(client)  # batch 1's ranges, stored with nothing of batch 0's end
        driver.begin(client)  # batch 0 done: its ranges complete (staged)
        assert client.status().open_ranges == PARTITIONS
    # Killed before any write carried that completion (unless the server's flush of
    # an idle store came first, 2 s on): batch 0's ranges are open again, and their
    # records pending, not failed, not queued for replay.
    server = _restart(server, start_server)
    with server.client() as client:
        _register(client)
        status = client.status()
        batches = status.open_ranges // PARTITIONS
        assert status.open_ranges in (PARTITIONS, 2 * PARTITIONS)
        assert status.pending_of(SOURCE) == batches * PARTITIONS * PER_PARTITION
        assert (status.replay_queue, sum(status.failed.values())) == (0, 0)
        # The next done barrier is past them too: both batches complete with it.
        driver.open(client)
        driver.begin(client)
        status = client.status()
        assert status.open_ranges == PARTITIONS
        assert status.completed == batches * PARTITIONS * PER_PARTITION
        assert status.pending_of(SOURCE) == PARTITIONS * PER_PARTITION
    # Killed after the next BATCH_RANGES: it carried the completion.
    with server.client() as client:
        driver.open(client)
    server = _restart(server, start_server)
    with server.client() as client:
        _register(client)
        status = client.status()
        assert status.open_ranges == 2 * PARTITIONS  # batches 2 and 3, nothing older
        assert status.pending_of(SOURCE) == 2 * PARTITIONS * PER_PARTITION
        assert (status.replay_queue, sum(status.failed.values())) == (0, 0)


def test_the_brief_status_is_the_drivers_part_of_the_whole(ft_server: Server) -> None:
    driver = _Driver()
    with ft_server.client() as client:
        _register(client)
        for _ in range(3):
            driver.open(client)
            driver.begin(client)
        brief = client.brief_status()
        whole = client.status()
        assert client.store_id == whole.store_id
    # The same answers as the whole reply (but the uptime, read a moment apart).
    as_whole = whole.brief().to_json()
    assert {**brief.to_json(), "uptime_s": 0} == {**as_whole, "uptime_s": 0}
    assert brief.pending_of(SOURCE) == PARTITIONS * PER_PARTITION
    assert brief.replay_cursor_of([SOURCE]) == whole.replay_cursor_of([SOURCE])
    # None of the heavy sections (BriefStatus.from_json refuses keys it does not know).
    assert not {"checkpoints", "sources", "requests", "by_source"} & set(brief.to_json())
    assert whole.checkpoints["q"].completed == 2


def test_a_server_without_the_brief_status_gets_the_whole_one_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that predates the flags byte refuses it as a trailing byte (ERROR 1):
    the client asks it for the whole reply, then and from then on."""

    def decode_old(frame: Any) -> StatusRequest:
        if frame.body:
            raise MalformedFrame(f"STATUS body has {len(frame.body)} trailing bytes")
        return StatusRequest()

    monkeypatch.setattr(handlers, "decode_status_request", decode_old)
    with FTServer(tmp_path / "data") as server:
        host, port = server.address
        with FTClient(f"{host}:{port}") as client:
            _register(client)
            first, second = client.brief_status(), client.brief_status()
            sent = client.requests_sent[Kind.STATUS]
            whole = client.status()
    assert sent == 3  # one refused, then the whole reply twice
    assert first.store_id == second.store_id == whole.store_id
    assert first.timeout_s == whole.timeout_s and first.pending_of(SOURCE) == 0
