"""The FT-layer server as a real `ftlayer serve` process, driven by FTClient.

Every server runs as its own process on a free loopback port with a tmp data dir, and
is stopped by the fixture's finalizer even when a test fails.
"""

from __future__ import annotations

import errno
import logging
import re
import resource
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from serverproc import Server, StartServer, read_address, serve_command, terminated

from ftlayer.acking.handlers import Anchors, Persister, TaskHandler
from ftlayer.acking.ids import new_ids
from ftlayer.causes import Cause, FailKind
from ftlayer.client import ConnectionLost, FTClient, RequestRejected, ServerStorageError
from ftlayer.core import recovery
from ftlayer.core.layer import RELEASE_AFTER_S
from ftlayer.errors import ConfigError
from ftlayer.integration.harness.kafka import wait_until
from ftlayer.partitioners import create_partitioner, kafka_key_hashes
from ftlayer.persistence import LmdbStorage
from ftlayer.policy import RetryPolicy
from ftlayer.records import RecordBatch
from ftlayer.registration import SourceRegistration
from ftlayer.server import FTServer
from ftlayer.wire import (
    AuthFailed,
    ErrorCode,
    Frame,
    FrameReader,
    Kind,
    NotAuthenticated,
    decode_error,
    encode_auth,
    encode_frame,
    encode_hello,
    encode_status_request,
    encode_xor,
)

PAYLOADS = [f"record-{i}".encode() * (i + 1) for i in range(10)]


def persist(client: FTClient, payloads: list[bytes]) -> Anchors:
    return Persister(client).persist(
        payloads, topics="events", partitions=np.arange(len(payloads)) % 3, offsets=None
    )


def sink(client: FTClient, anchors: Anchors) -> None:
    task = TaskHandler(client)
    task.process(anchors, np.zeros(0, dtype=np.intp))
    task.flush()


def test_records_complete_over_the_wire(start_server: StartServer) -> None:
    server = start_server()
    with server.client() as client:
        anchors = persist(client, PAYLOADS)
        assert client.status()["pending"] == len(PAYLOADS)
        mapped = TaskHandler(client)
        outputs = mapped.process(anchors, np.arange(len(PAYLOADS)))
        mapped.flush()
        sink(client, outputs)
        status = client.status()
    assert status["persisted"] == status["completed"] == len(PAYLOADS)
    assert status["pending"] == 0
    assert status["lmdb_size_bytes"] > 0
    assert terminated(server.proc, server.log) == 0


def test_explicit_fail_is_replayed_with_the_same_bytes(start_server: StartServer) -> None:
    server = start_server()
    with server.client() as client:
        anchors = persist(client, PAYLOADS)
        failed = np.zeros(len(PAYLOADS), dtype=np.bool_)
        failed[[2, 7]] = True
        task = TaskHandler(client)
        task.process(anchors, np.zeros(0, dtype=np.intp), failed=failed)
        task.flush()
        replay = client.fetch_replay(0, 2**63)
        status = client.status()
    assert sorted(replay.records.payloads) == sorted([PAYLOADS[2], PAYLOADS[7]])
    assert not set(replay.records.roots.tolist()) & set(anchors.roots.tolist())
    assert status["failed"]["explicit"] == 2
    assert status["completed"] == len(PAYLOADS) - 2


def test_an_idle_servers_deleter_wakes_for_the_first_completed_records(
    start_server: StartServer,
) -> None:
    """The deleter sleeps while no record completes (an idle server wakes a few times a
    minute, not every delete interval): the first records that complete after a quiet
    spell wake it, and leave the store within its interval, again and again."""
    server = start_server()
    with server.client() as client:
        for _ in range(3):
            time.sleep(1.0)  # several delete intervals with nothing to delete
            sink(client, persist(client, PAYLOADS))
            assert client.status()["completed"] % len(PAYLOADS) == 0
            # Well under the sleeping deleter's own look (10 s): only the wake does it.
            wait_until(lambda: client.status()["stored_records"] == 0, 4.0, "deletes")
        assert client.status()["deletes_pending"] == 0


def test_token_is_required_and_checked(start_server: StartServer, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_bytes(b"s3cret\n")
    server = start_server(None, "--token-file", str(token_file))
    with server.client(b"wrong") as client, pytest.raises(AuthFailed):
        client.status()
    with server.client() as client, pytest.raises(NotAuthenticated):
        client.status()
    # A client that skips the handshake altogether is refused by the server itself.
    with socket.create_connection(_host_port(server.address), timeout=5) as raw:
        raw.sendall(encode_status_request(1))
        frame, closed = _read_error_then_eof(raw)
    assert decode_error(frame).code == ErrorCode.NOT_AUTHENTICATED and closed
    with server.client(b"s3cret") as client:
        assert client.status()["pending"] == 0


def test_garbage_on_one_connection_spares_the_others(start_server: StartServer) -> None:
    server = start_server()
    with server.client() as client:
        persist(client, PAYLOADS[:3])
        before = _counters(client.status())
        with socket.create_connection(_host_port(server.address), timeout=5) as raw:
            raw.sendall(b"\x00\x00\x00\x01 this is not a frame")
            frame, closed = _read_error_then_eof(raw)
        assert frame.kind == Kind.ERROR and frame.request_id == 0 and closed
        assert decode_error(frame).code == ErrorCode.MALFORMED_FRAME
        persist(client, PAYLOADS[3:5])
        after = _counters(client.status())
    moved = {"persisted": 5, "pending": 5, "pending_by_source": {"0": 5}, "stored_records": 5}
    moved["store_commits"] = int(str(before["store_commits"])) + 1  # the second persist's
    source = before["by_source"]["0"]
    moved["by_source"] = {"0": {**source, "persisted": 5}}
    assert after == {**before, **moved}


def test_non_loopback_host_without_token_is_refused(tmp_path: Path) -> None:
    done = subprocess.run(
        serve_command(tmp_path / "data", "--host", "0.0.0.0"),
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2
    assert b"without a token" in done.stderr
    assert b"ftlayer serving" not in done.stdout


@pytest.mark.parametrize("journal", [True, False], ids=["journal", "no-journal"])
def test_sigkill_then_restart_keeps_exactly_the_incomplete(
    start_server: StartServer, journal: bool
) -> None:
    flags = () if journal else ("--no-journal",)
    server = start_server(None, *flags)
    with server.client() as client:
        anchors = persist(client, PAYLOADS)
        done = np.arange(len(PAYLOADS)) % 3 == 0
        sink(client, anchors.take(np.flatnonzero(done)))
        assert client.status()["completed"] == int(done.sum())
        # Completed records are deleted from LMDB in the background: once the server
        # says none is left to delete, the completions survive a crash.
        wait_until(lambda: client.status()["deletes_pending"] == 0, 5.0, "deletes")
        assert client.status()["stored_records"] == int((~done).sum())
    server.proc.kill()
    server.proc.wait(10)

    restarted = start_server(server.data_dir, *flags)
    incomplete = [p for p, d in zip(PAYLOADS, done, strict=True) if not d]
    with restarted.client() as client:
        status = client.status()
        replay = client.fetch_replay(0, 2**63)
        if journal:
            # The journal knew every incomplete tree: restored as it was, none replayed;
            # the events still to come complete them.
            assert status["failed"]["recovery"] == 0 and len(replay) == 0
            assert status["recovered_pending"] == status["pending"] == len(incomplete)
            sink(client, anchors.take(np.flatnonzero(~done)))
            assert client.status()["completed"] == len(incomplete)
            assert client.status()["pending"] == 0
            return
    # Without the journal (as after a machine crash) every incomplete tree is replayed.
    assert status["failed"]["recovery"] == len(incomplete)
    assert status["pending"] == status["replay_queue"] == len(incomplete)
    assert sorted(replay.records.payloads) == sorted(incomplete)
    assert sorted(replay.replay_seqs.tolist()) == list(range(1, len(incomplete) + 1))


@pytest.mark.parametrize("journal", [True, False], ids=["journal", "no-journal"])
def test_records_completed_just_before_a_crash_are_not_lost(
    start_server: StartServer, journal: bool
) -> None:
    # A long delete interval keeps the completed records marked but not yet deleted
    # when the server is killed. The journal knows their trees completed: the restarted
    # server deletes them. Without it, it replays them (duplicates).
    flags = ("--delete-interval-s", "60") + (() if journal else ("--no-journal",))
    server = start_server(None, *flags)
    with server.client() as client:
        sink(client, persist(client, PAYLOADS))
        status = client.status()
    assert status["completed"] == status["deletes_pending"] == len(PAYLOADS)
    server.kill()
    with start_server(server.data_dir, *flags[2:]).client() as client:
        replay = client.fetch_replay(0, 2**63)
        status = client.status()
    if journal:
        assert len(replay) == 0 and status["recovered_completed"] == len(PAYLOADS)
        assert status["pending"] == status["stored_records"] == 0
    else:
        assert sorted(replay.records.payloads) == sorted(PAYLOADS)


def _host_port(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def _counters(status: dict[str, object]) -> dict[str, object]:
    """The counters that say what happened to records and trees (not the connections,
    the clock, the file's size, or the requests the checks themselves make)."""
    volatile = ("connections", "uptime_s", "lmdb_size_bytes", "requests")
    return {k: v for k, v in status.items() if k not in volatile}


def _read_error_then_eof(raw: socket.socket) -> tuple[Frame, bool]:
    """The first frame the server sends on `raw`, and whether it then closed."""
    reader = FrameReader()
    frames: list[Frame] = []
    while not frames:
        data = raw.recv(65536)
        assert data, "the server closed without an ERROR"
        frames = reader.feed(data)
    closed = False
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if not raw.recv(65536):
            closed = True
            break
    return frames[0], closed


@pytest.mark.parametrize("journal", [True, False], ids=["journal", "no-journal"])
def test_a_registered_source_routes_replays_also_after_a_restart(
    start_server: StartServer, journal: bool
) -> None:
    flags = () if journal else ("--no-journal",)
    server = start_server(None, *flags)
    keys = [f"key-{i}".encode() for i in range(30)]
    hashes, has_key = kafka_key_hashes(keys)
    with server.client() as client:
        client.register_source(SourceRegistration(5, "kafka-hash", 3))
        with pytest.raises(RequestRejected, match="unknown replay partitioner 'nope'"):
            client.register_source(SourceRegistration(5, "nope", 3))
        anchors = Persister(client, source_id=5).persist(
            PAYLOADS * 3,
            topics="events",
            partitions=np.zeros(30),  # all came from partition 0: forward would say 0
            offsets=None,
            key_hashes=hashes,
            has_key=has_key,
        )
    server.kill()

    with start_server(server.data_dir, *flags).client() as client:
        if journal:  # restored pending: they fail after the restart, and are replayed
            assert client.status()["recovered_pending"] == 30
            assert client.fail(anchors.roots) == 30
        replay = client.fetch_replay(0, 2**63, source_id=5)
    assert len(replay) == 30
    expected = create_partitioner("kafka-hash").targets(replay.records, 3)[1]
    assert replay.partitions.tolist() == expected.tolist()
    assert set(replay.partitions.tolist()) == {0, 1, 2}


def test_retired_and_unknown_kinds_are_refused_and_the_connection_goes_on(
    start_server: StartServer,
) -> None:
    """LOWEST_PENDING (0x16) and PRUNE_REPLAY (0x17) left the protocol: refused as
    unknown kinds (ERROR 3) like any other, never answered with a STATUS."""
    server = start_server()
    with _welcomed(server.address) as raw:
        raw.sendall(
            encode_frame(0x16, 3, b'["events"]')
            + encode_frame(0x17, 4, bytes(16))
            + encode_frame(0x55, 5, b"")
            + encode_status_request(6)
        )
        replies = _read_frames(raw, 4)
    assert [(f.request_id, f.kind) for f in replies] == [
        (3, Kind.ERROR),
        (4, Kind.ERROR),
        (5, Kind.ERROR),
        (6, Kind.STATUS_REPLY),
    ]
    assert {decode_error(f).code for f in replies[:3]} == {ErrorCode.UNKNOWN_KIND}


def test_calls_wait_for_a_restarting_server_then_give_up_clearly(
    start_server: StartServer, caplog: pytest.LogCaptureFixture
) -> None:
    """While it waits, the client says so once (the outage is shorter than the warning
    interval), naming the server and until when it retries; and again once it is back."""
    server = start_server()
    port = server.address.rsplit(":", 1)[1]
    restarted: list[Server] = []
    with FTClient(server.address, reconnect_s=30, name="test-client") as client:
        persist(client, PAYLOADS[:2])
        server.kill()
        restart = threading.Timer(
            1.0, lambda: restarted.append(start_server(server.data_dir, "--port", port))
        )
        restart.start()
        with caplog.at_level(logging.WARNING, logger="ftlayer.client"):
            status = client.status()  # reconnects with backoff until the server is back
        restart.join()
    assert restarted and status["recovered_pending"] == 2  # the journal knew both
    warned = [r.getMessage() for r in caplog.records if r.name == "ftlayer.client"]
    assert len(warned) == 2, warned
    retrying = re.fullmatch(
        rf"test-client: cannot reach the FT-layer server at {re.escape(server.address)} "
        r"\(.+\); retrying until (\d\d:\d\d:\d\d) \((\d+) s more\), then the call fails",
        warned[0],
    )
    assert retrying is not None, warned[0]
    assert 25 <= int(retrying[2]) <= 30
    assert warned[1] == f"test-client: reached the FT-layer server at {server.address} again"
    restarted[0].kill()
    with (
        FTClient(server.address, reconnect_s=0.3) as client,
        pytest.raises(ConnectionLost, match=r"could not be opened \(\d+ attempts in 0.3 s\)"),
    ):
        client.status()
    # A fresh client per attempt (a heartbeat thread's) warns no more often than one.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ftlayer.client"):
        for _ in range(3):
            with pytest.raises(ConnectionLost):
                FTClient(server.address, reconnect_s=0.3, name="test-beat").status()
    beats = [r.getMessage() for r in caplog.records if "test-beat" in r.getMessage()]
    assert len(beats) == 1 and "cannot reach" in beats[0], beats


def test_a_client_idle_across_a_restart_persists_and_xors_at_its_next_call(
    start_server: StartServer,
) -> None:
    """A Python worker's connection, idle while the FT layer was killed and restarted,
    is not used blindly: the next persist (not idempotent, so never resent) and XOR
    reconnect first instead of failing with ConnectionLost."""
    server = start_server()
    port = server.address.rsplit(":", 1)[1]
    with FTClient(server.address) as client:
        persist(client, PAYLOADS[:2])
        server.kill()
        restarted = start_server(server.data_dir, "--port", port)
        time.sleep(0.2)  # the kernel has seen the old server's sockets close
        anchors = Persister(client).persist(PAYLOADS[2:5], topics="t", partitions=0, offsets=None)
        restarted.kill()
        restarted = start_server(server.data_dir, "--port", port)
        time.sleep(0.2)
        client.xor(anchors.roots, anchors.ids)
        status = client.status()
    # After the second restart: the 2 + 3 records were restored from the journal under
    # their roots, so the XOR for three of them completed those; no call broke.
    assert status["failed"]["recovery"] == 0 and status["recovered_pending"] == 5
    assert status["completed"] == 3 and status["pending"] == 2
    assert status["late_events"] == 0
    restarted.kill()


def test_a_replay_larger_than_a_frame_comes_back_in_pages(tmp_path: Path) -> None:
    # A 64 KiB frame limit and 10 KB payloads: about six records fit one REPLAY frame.
    payloads = [bytes([i]) * 10_000 for i in range(30)]
    with FTServer(tmp_path / "data", max_frame=65_536) as server:
        host, port = server.address
        with FTClient(f"{host}:{port}") as client:
            client.register_source(SourceRegistration(0, "broadcast", 2))  # two rows per replay seq
            roots = []
            for lo in range(0, 30, 5):
                anchors = Persister(client).persist(
                    payloads[lo : lo + 5], topics="big", partitions=np.zeros(5), offsets=None
                )
                roots.append(anchors.roots)
            assert client.fail(np.concatenate(roots)) == 30
            sent_before = client.requests_sent[Kind.FETCH_REPLAY]
            replay = client.fetch_replay(0, 2**63)
            pages = client.requests_sent[Kind.FETCH_REPLAY] - sent_before
    assert pages > 5  # 60 rows of 10 KB cannot travel in one 64 KiB frame
    assert replay.replay_seqs.tolist() == sorted(list(range(1, 31)) * 2)
    assert sorted(bytes(p) for p in replay.records.payloads) == sorted(payloads * 2)
    assert sorted(replay.partitions.tolist()) == [0] * 30 + [1] * 30


def test_a_partitions_replays_that_fit_a_frame_come_in_one_request(tmp_path: Path) -> None:
    # Failed records routed to two partitions by key: each partition's rows fit one
    # REPLAY, so each reader asks once, also the one whose rows end before the range's
    # last replay seq (that seq is the other partition's).
    with FTServer(tmp_path / "data", max_frame=65_536) as server:
        host, port = server.address
        with FTClient(f"{host}:{port}") as client:
            client.register_source(SourceRegistration(0, "kafka-hash", 2))
            n = 40
            anchors = Persister(client).persist(
                [bytes([i]) * 1_000 for i in range(n)],
                topics="orders",
                partitions=np.zeros(n),
                offsets=None,
                key_hashes=np.arange(n),
                has_key=np.ones(n, dtype=np.bool_),
            )
            assert client.fail(anchors.roots) == n
            hi = client.status()["replay_cursor"]
            fetched, asked = [], []
            for partition in (0, 1):
                before = client.requests_sent[Kind.FETCH_REPLAY]
                fetched.append(client.fetch_replay(0, hi, 0, partition))
                asked.append(client.requests_sent[Kind.FETCH_REPLAY] - before)
    assert asked == [1, 1]
    assert all(0 < len(replay) < n for replay in fetched)
    assert [set(replay.partitions.tolist()) for replay in fetched] == [{0}, {1}]
    seqs = [seq for replay in fetched for seq in replay.replay_seqs.tolist()]
    assert sorted(seqs) == list(range(1, n + 1)) and hi == n


def test_a_full_disk_is_a_clear_error_and_loses_nothing_confirmed(
    start_server: StartServer, tmp_path: Path
) -> None:
    # The server process may write files of at most 3 MiB (RLIMIT_FSIZE), as if its
    # disk filled up: LMDB's writes then fail with EFBIG.
    limit = 3 * 1024 * 1024

    def small_disk() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    data_dir, log = tmp_path / "full", tmp_path / "full.log"
    with log.open("wb") as stderr:
        proc = subprocess.Popen(
            serve_command(data_dir), stdout=subprocess.PIPE, stderr=stderr, preexec_fn=small_disk
        )
    try:
        confirmed: list[bytes] = []
        with FTClient(read_address(proc, log)) as client:
            with pytest.raises(ServerStorageError, match="disk may be full"):
                for batch in range(1000):
                    payloads = [b"%d-%d-" % (batch, i) + b"x" * 2000 for i in range(50)]
                    persist(client, payloads)
                    confirmed += payloads
            assert len(confirmed) > 100  # some batches fit before the disk was full
            status = client.status()  # the server goes on serving
            assert status["persisted"] == status["pending"] == len(confirmed)
    finally:
        proc.kill()
        proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()
    # With room again, every confirmed record is there, pending.
    restarted = start_server(data_dir)
    with restarted.client() as client:
        status = client.status()
    restarted.kill()
    assert status["pending"] == len(confirmed)
    with LmdbStorage(data_dir) as storage:
        stored = [bytes(p) for _seqs, batch, _r in storage.scan() for p in batch.payloads]
    assert sorted(stored) == sorted(confirmed)


def test_checkpoints_over_the_wire_survive_a_restart(start_server: StartServer) -> None:
    """CHECKPOINT_BEGIN / COMPLETE against a real server: the record lands in its own
    LMDB environment, aligned completion waits for the pending record, bad requests
    are refused, and a restarted server knows the last completed checkpoint."""
    server = start_server()

    def position(offset: int) -> dict[str, Any]:
        return {"kafka": {"events": {"0": offset}}, "replay": 0}

    def call(client: FTClient, begin: bool, offset: int) -> dict[str, Any]:
        return client.checkpoint(
            begin=begin, query="job", position=position(offset), sources=[5], mode="aligned"
        )

    with server.client() as client:
        first = RecordBatch.build(
            new_ids(4), PAYLOADS[:4], topics="events", partitions=0, offsets=np.arange(4)
        )
        client.persist(first, new_ids(4))
        begun = call(client, True, 4)
        assert (begun["id"], begun["state"], begun["pending_roots"]) == (1, "begun", 4)
        answer = call(client, False, 4)
        assert answer["state"] == "aligning" and answer["commit_offsets"] is None
        time.sleep(0.6)  # more than a tick: still aligning, the records are pending
        assert call(client, False, 4)["state"] == "aligning"
        client.fail(first.roots)
        replay = client.fetch_replay(0, 2**63)
        client.xor(replay.records.roots, np.full(4, 9, np.uint64))
        client.xor(replay.records.roots, np.full(4, 9, np.uint64))  # complete
        deadline = time.monotonic() + 10
        while call(client, False, 4)["state"] != "complete":
            assert time.monotonic() < deadline, "the aligned checkpoint never completed"
            time.sleep(0.05)
        done = call(client, False, 4)
        assert done["commit_offsets"] == {"events": {"0": 4}}
        assert done["alignment_wait_s"] > 0 and done["write_s"] is not None
        with pytest.raises(RequestRejected, match="query name"):
            client.checkpoint(begin=True, query="a/b", position=position(1), sources=[5])
        with pytest.raises(RequestRejected, match="checkpoint offset"):
            client.checkpoint(
                begin=True,
                query="job",
                position={"kafka": {"e": {"0": -3}}, "replay": 0},
                sources=[5],
            )
        status = client.status()["checkpoints"]["job"]
        assert status["completed"] == 1 and status["last_complete_id"] == 1
    assert (Path(server.data_dir) / "checkpoints" / "data.mdb").exists()
    # A completed checkpoint's record is written within the writer's poll (0.25 s) on an
    # idle stream (with the next barrier's snapshot on a busy one); one completed just
    # before a kill may be lost, which only makes the restart know an older one.
    time.sleep(0.5)
    server.kill()

    with start_server(server.data_dir).client() as client:
        status = client.status()["checkpoints"]["job"]
        assert status["last_complete_id"] == 1
        assert call(client, True, 8)["id"] == 2
        answer = call(client, False, 8)
        assert answer["id"] == 2


def test_a_begin_completes_the_batch_before_in_one_round_trip(start_server: StartServer) -> None:
    """What ftkafka sends at each batch: BEGIN of barrier n that completes barrier n - 1
    (Spark's commit, made just before it plans batch n) in the same request."""
    server = start_server()

    def position(offset: int) -> dict[str, Any]:
        return {"kafka": {"events": {"0": offset}}, "replay": 0}

    with server.client() as client:
        ids = new_ids(4)
        batch = RecordBatch.build(
            new_ids(4), PAYLOADS[:4], topics="events", partitions=0, offsets=np.arange(4)
        )
        first = client.checkpoint(begin=True, query="job", position=position(4), sources=[5])
        client.persist(batch, ids)
        client.xor(batch.roots[:2], ids[:2])  # offsets 2 and 3 still pending
        second = client.checkpoint(
            begin=True, query="job", position=position(9), sources=[5], complete=position(4)
        )
        assert (second["id"], second["state"]) == (first["id"] + 1, "begun")
        completed = second["completed"]
        assert (completed["id"], completed["state"]) == (first["id"], "complete")
        assert completed["commit_offsets"] == {"events": {"0": 2}}  # the lowest pending
        with pytest.raises(ConfigError, match="BEGIN"):
            client.checkpoint(
                begin=False, query="job", position=position(9), sources=[5], complete=position(4)
            )
        assert client.status()["checkpoints"]["job"]["completed"] == 1


def test_checkpoints_go_on_completing_after_failed_journal_base_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The journal refuses to write bases (injected: a full disk) across two barriers,
    each due a base, then recovers: while it fails nothing completes and the group
    holds; then the writer's own retry completes checkpoint 1 (superseded by 2's base)
    without another barrier, and the next BEGIN completes checkpoint 2. In process, to
    inject the failure into the server's writer thread."""

    def position(offset: int) -> dict[str, Any]:
        return {"kafka": {"events": {"0": offset}}, "replay": 0}

    # Every barrier is due a base.
    monkeypatch.setattr(recovery, "JOURNAL_BASE_MIN_BYTES", 0)
    monkeypatch.setattr(recovery, "_BASE_BYTES_PER_ROOT", 0)
    with FTServer(tmp_path / "data") as server:
        assert server._ft is not None
        journal = server._ft.journal
        assert journal is not None
        write = journal.write_base
        broken = threading.Event()
        broken.set()

        def write_base(k: int, blob: bytes) -> None:
            if broken.is_set():
                raise OSError(errno.ENOSPC, "injected: no space left on device")
            write(k, blob)

        monkeypatch.setattr(journal, "write_base", write_base)
        host, port = server.address
        with FTClient(f"{host}:{port}") as client:

            def open_checkpoints() -> list[Any]:
                return list(client.status()["checkpoints"]["job"]["open"])

            ids = new_ids(4)
            batch = RecordBatch.build(
                new_ids(4), PAYLOADS[:4], topics="events", partitions=0, offsets=np.arange(4)
            )
            client.checkpoint(begin=True, query="job", position=position(4), sources=[5])
            client.persist(batch, ids)
            client.xor(batch.roots, ids)
            second = client.checkpoint(
                begin=True, query="job", position=position(9), sources=[5], complete=position(4)
            )
            held = second["completed"]
            assert (held["id"], held["state"], held["commit_offsets"]) == (1, "aligning", None)
            wait_until(lambda: open_checkpoints()[0]["superseded"], 10, "checkpoint 1 superseded")
            broken.clear()
            wait_until(
                lambda: client.status()["checkpoints"]["job"]["completed"] == 1,
                10,
                "checkpoint 1 to complete with the retried write",
            )
            first = client.status()["checkpoints"]["job"]["recent"][-1]
            assert (first["id"], first["commit_offsets"]) == (1, {"events": {"0": 4}})
            third = client.checkpoint(
                begin=True, query="job", position=position(12), sources=[5], complete=position(9)
            )
            assert third["completed"]["state"] == "complete"
            assert third["completed"]["commit_offsets"] == {"events": {"0": 9}}


# ---- the wire, hardened: raw sockets against a real server -----------------------------


def _welcomed(address: str | tuple[str, int]) -> socket.socket:
    """A raw connection that completed the handshake with a server without a token."""
    host_port = _host_port(address) if isinstance(address, str) else address
    raw = socket.create_connection(host_port, timeout=10)
    raw.sendall(encode_hello(1, bytes(16), "raw") + encode_auth(2, bytes(32)))
    assert [f.kind for f in _read_frames(raw, 2)] == [Kind.CHALLENGE, Kind.WELCOME]
    return raw


def _read_frames(raw: socket.socket, n: int) -> list[Frame]:
    """The next `n` frames the server sends on `raw` (its timeout is the deadline)."""
    reader = FrameReader()
    frames: list[Frame] = []
    while len(frames) < n:
        data = raw.recv(65536)
        assert data, f"the server closed after {len(frames)} of {n} frames: {frames}"
        frames += reader.feed(data)
    assert len(frames) == n, frames
    return frames


def _closed_within(raw: socket.socket, seconds: float) -> bool:
    """Whether the server closes `raw` within `seconds` (it sends nothing meanwhile)."""
    raw.settimeout(seconds)
    try:
        return raw.recv(65536) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_requests_before_a_bad_length_in_the_same_read_are_answered_first(
    start_server: StartServer,
) -> None:
    server = start_server()
    with server.client() as client:
        anchors = persist(client, PAYLOADS[:2])
    with _welcomed(server.address) as raw:
        # One send: a STATUS, an XOR that completes record 0, then a length below 5.
        xor = encode_xor(4, anchors.roots[:1], anchors.ids[:1])
        raw.sendall(encode_status_request(3) + xor + b"\x00\x00\x00\x02" + b"junk")
        replies = _read_frames(raw, 3)
        assert _closed_within(raw, 5)
    assert [(f.request_id, f.kind) for f in replies] == [
        (3, Kind.STATUS_REPLY),
        (4, Kind.OK),
        (0, Kind.ERROR),
    ]
    assert decode_error(replies[2]).code == ErrorCode.MALFORMED_FRAME
    with server.client() as client:
        assert client.status()["completed"] == 1


def test_a_reply_kind_or_a_second_hello_is_unexpected_whatever_its_body(
    start_server: StartServer,
) -> None:
    server = start_server()
    with _welcomed(server.address) as raw:
        raw.sendall(
            encode_frame(Kind.OK, 3, b"bad")  # a bad body for an OK
            + encode_frame(Kind.CHECKPOINT, 4, b"{not json")
            + encode_frame(Kind.ERROR, 5, b"\xff")
            + encode_frame(Kind.HELLO, 6, b"not a hello")
            + encode_status_request(7)
        )
        replies = _read_frames(raw, 5)
    assert [decode_error(f).code for f in replies[:4]] == [ErrorCode.UNEXPECTED_KIND] * 4
    assert [f.request_id for f in replies] == [3, 4, 5, 6, 7]
    assert replies[4].kind == Kind.STATUS_REPLY


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        ([encode_frame(Kind.PERSIST, 1, b"\xff" * 64)], ErrorCode.NOT_AUTHENTICATED),
        ([encode_frame(Kind.OK, 1, b"x")], ErrorCode.UNEXPECTED_KIND),
        ([encode_frame(Kind.AUTH, 1, b"short")], ErrorCode.UNEXPECTED_KIND),  # before HELLO
        ([encode_hello(1, bytes(16)), encode_hello(2, bytes(16))], ErrorCode.UNEXPECTED_KIND),
        ([encode_frame(0x16, 1, b"")], ErrorCode.UNKNOWN_KIND),
    ],
    ids=["data request", "reply kind", "auth first", "hello twice", "retired kind"],
)
def test_frames_out_of_place_before_welcome_are_refused_by_kind_then_closed(
    start_server: StartServer, frames: list[bytes], code: ErrorCode
) -> None:
    """Refused by kind before the body is decoded (a garbage PERSIST body is not
    MALFORMED_FRAME but NOT_AUTHENTICATED), and an error before WELCOME closes."""
    server = start_server()
    with socket.create_connection(_host_port(server.address), timeout=10) as raw:
        raw.sendall(b"".join(frames) + encode_status_request(9))
        replies = _read_frames(raw, len(frames))
        assert _closed_within(raw, 5)
    assert decode_error(replies[-1]).code == code
    assert replies[-1].request_id == len(frames)


def test_a_checkpoint_position_needs_its_replay_cursor(start_server: StartServer) -> None:
    server = start_server()
    with server.client() as client, pytest.raises(RequestRejected, match='"replay"'):
        client.checkpoint(begin=True, query="job", position={"kafka": {"e": {"0": 3}}}, sources=[5])


@pytest.mark.parametrize("timeout", [b"Infinity", b"1e400", b"-1"])
def test_a_source_timeout_must_be_finite_and_positive(
    start_server: StartServer, timeout: bytes
) -> None:
    server = start_server()
    config = b'{"num_partitions":1,"options":{},"partitioner":"forward","timeout_s":%s}'
    with _welcomed(server.address) as raw:
        raw.sendall(encode_frame(Kind.REGISTER_SOURCE, 3, bytes(4) + config % timeout))
        (reply,) = _read_frames(raw, 1)
    assert decode_error(reply).code == ErrorCode.BAD_REQUEST


def test_a_recently_failed_root_cannot_be_persisted_again(start_server: StartServer) -> None:
    server = start_server()
    with server.client() as client:
        batch = RecordBatch.build(new_ids(2), PAYLOADS[:2], topics="t", partitions=0, offsets=None)
        client.persist(batch)
        assert client.fail(batch.roots[:1]) == 1
        again = RecordBatch.build(batch.roots[:1], [b"x"], topics="t", partitions=0, offsets=None)
        with pytest.raises(RequestRejected, match="repeated root"):
            client.persist(again)
        status = client.status()
    assert status["persisted"] == 2 and status["stored_records"] == 2


def test_a_stalled_frame_and_an_idle_connection_are_closed_and_clients_reconnect(
    tmp_path: Path,
) -> None:
    with FTServer(tmp_path / "data", frame_timeout_s=0.5, idle_timeout_s=1.0) as server:
        host, port = server.address
        with _welcomed(server.address) as stalled:
            stalled.sendall(encode_status_request(3)[:6])  # half a frame, then nothing
            assert _closed_within(stalled, 5)
        with _welcomed(server.address) as idle:
            assert _closed_within(idle, 5)
        with FTClient(f"{host}:{port}") as client:
            anchors = persist(client, PAYLOADS[:3])
            # Wait until the server closed the idle client's connection: a second
            # client sees only itself connected.
            with FTClient(f"{host}:{port}") as other:
                wait_until(lambda: other.status()["connections"] == 1, 10.0, "idle close")
            hellos = client.requests_sent[Kind.HELLO]
            sink(client, anchors)  # XOR, not idempotent: sent on a fresh connection
            assert client.requests_sent[Kind.HELLO] == hellos + 1
            assert client.status()["completed"] == 3


def test_a_silent_connection_is_closed_after_the_handshake_timeout(tmp_path: Path) -> None:
    with (
        FTServer(tmp_path / "data", handshake_timeout_s=0.5) as server,
        socket.create_connection(server.address, timeout=10) as silent,
    ):
        assert _closed_within(silent, 5)


def test_connections_over_the_limit_are_refused_and_clients_retry(tmp_path: Path) -> None:
    with FTServer(tmp_path / "data", max_connections=2) as server:
        host, port = server.address
        first, second = _welcomed(server.address), _welcomed(server.address)
        with socket.create_connection(server.address, timeout=10) as third:
            (refused,) = _read_frames(third, 1)
            assert _closed_within(third, 5)
        assert refused.request_id == 0 and decode_error(refused).code == ErrorCode.BUSY
        threading.Timer(0.5, first.close).start()  # a place frees up while the client waits
        with FTClient(f"{host}:{port}", reconnect_s=10) as client:
            assert client.status()["connections"] == 2
        second.close()


def test_status_has_exactly_the_fields_the_spec_lists(start_server: StartServer) -> None:
    spec = (Path(__file__).parents[2] / "docs" / "protocol.md").read_text()
    section = spec[spec.index("### 6.2 STATUS_REPLY") : spec.index("### 6.3 ERROR")]
    documented = set(re.findall(r"^\| `(\w+)` \|", section, flags=re.MULTILINE))
    with start_server().client() as client:
        status = client.status()
    assert set(status) == documented
    assert set(status["failed"]) == {"explicit", "timeout", "recovery", "source-expired"}


def test_every_request_kind_is_served_by_its_own_handler(start_server: StartServer) -> None:
    """Each request kind of section 2 reaches a handler of its own: with an empty
    body, none is unknown to the server and only STATUS answers with a status."""
    server = start_server()
    kinds = [k for k in Kind if k < 0x80 and k not in (Kind.HELLO, Kind.AUTH)]
    with _welcomed(server.address) as raw:
        raw.sendall(b"".join(encode_frame(k, 10 + i, b"") for i, k in enumerate(kinds)))
        replies = _read_frames(raw, len(kinds))
    for kind, reply in zip(kinds, replies, strict=True):
        if kind == Kind.STATUS:
            assert reply.kind == Kind.STATUS_REPLY
        else:
            assert reply.kind == Kind.ERROR, (kind, reply)
            assert decode_error(reply).code in (ErrorCode.MALFORMED_FRAME, ErrorCode.BAD_REQUEST)


def test_serve_takes_the_limits_from_its_options(start_server: StartServer) -> None:
    server = start_server(
        None, "--max-connections", "3", "--idle-timeout-s", "0.5", "--frame-timeout-s", "5"
    )
    with server.client() as client:
        assert client.status()["max_connections"] == 3
    with _welcomed(server.address) as idle:
        assert _closed_within(idle, 5)


def test_a_persist_wakes_an_idle_servers_ticker_and_its_trees_time_out_in_the_bound(
    start_server: StartServer,
) -> None:
    """An idle server's ticker sleeps (with nothing pending it wakes only to look for
    idle spooled savepoint parts, every 30 s). A PERSIST wakes it to sleep until the
    rotation that times its trees out: with --tree-timeout-s 1 and 3 buckets they fail
    1 to 1.5 s after it, and STATUS shows them within seconds (not the 30 s the ticker
    slept for); then they wait for their backoff and are queued for replay."""
    server = start_server(None, "--tree-timeout-s", "1")
    batch = RecordBatch.build(
        new_ids(3), PAYLOADS[:3], source_ids=5, topics="events", partitions=0, offsets=None
    )
    with server.client() as client:
        time.sleep(1.0)  # idle: the ticker found nothing to do and sleeps
        began = time.monotonic()
        client.persist(batch, new_ids(3))
        wait_until(lambda: client.status().failed["timeout"] == 3, 20, "the timeouts")
        waited = time.monotonic() - began
        wait_until(lambda: client.status().replay_queue == 3, 10, "the replays")
    assert 1.0 <= waited <= 1.5 + 5.0, waited


def test_a_brief_status_queues_the_failed_records_whose_backoff_ended(
    start_server: StartServer,
) -> None:
    """The replay cursor a source reads before it plans a batch (brief STATUS) counts
    every failed record whose backoff has ended: the server queues them then, without
    waiting for its ticker (which queues them only RELEASE_AFTER_S after the first
    backoff's end), so a running query takes a replay in at its first batch after the
    backoff. A brief STATUS before the backoff's end queues nothing."""
    assert RELEASE_AFTER_S >= 0.5  # the ticker alone would not queue them in time
    server = start_server(None)
    roots = new_ids(3)
    batch = RecordBatch.build(
        roots, PAYLOADS[:3], source_ids=5, topics="events", partitions=0, offsets=None
    )
    with server.client() as client:
        client.register_source(SourceRegistration(5, "forward", 1, retry=RetryPolicy(3, 200, 200)))
        client.persist(batch, new_ids(3))
        failed = client.fail(roots[:2], Cause(FailKind.EXPLICIT, "map", "FailException: bad"))
        failed_at = time.monotonic()
        early = client.brief_status()
        time.sleep(max(0.0, failed_at + 0.25 - time.monotonic()))  # past the 0.2 s backoff
        cursor = client.brief_status().replay_cursor_of([5])
        asked_s = time.monotonic() - failed_at
    assert failed == 2
    assert early.replay_cursor_of([5]) == 0, "queued before its backoff ended"
    assert asked_s < 0.2 + RELEASE_AFTER_S, asked_s  # the ticker's release is not due yet
    assert cursor == 2, cursor  # both failed records, replay seqs 1 and 2


def test_heartbeats_keep_a_running_batch_from_timing_out_until_they_stop(
    start_server: StartServer,
) -> None:
    """ftkafka's driver heartbeats while its batch runs (HEARTBEAT from a client of its
    own): the batch's trees outlive three tree timeouts, STATUS shows the lease; once
    the heartbeats stop the trees time out and are queued for replay. (The lease alone:
    with --lapsed-batch-timeout-s 0, a lapsed batch is not waited for;
    tests/core/test_lapsed.py has the wait for the next barrier.)"""
    server = start_server(None, "--tree-timeout-s", "1", "--lapsed-batch-timeout-s", "0")
    position = {"kafka": {"events": {"0": 4}}, "replay": 0}
    batch = RecordBatch.build(
        new_ids(4), PAYLOADS[:4], source_ids=5, topics="events", partitions=0, offsets=None
    )
    beating = threading.Event()
    beats: list[int] = []

    def heartbeat() -> None:
        with server.client() as own:
            while beating.is_set():
                beats.append(own.heartbeat([5], 0.75))
                time.sleep(0.25)

    with server.client() as client:
        assert client.heartbeat([5], 0.75) == 0  # no batch open: nothing to lease
        client.checkpoint(begin=True, query="job", position=position, sources=[5])
        beating.set()
        thread = threading.Thread(target=heartbeat, daemon=True)
        thread.start()
        try:
            wait_until(lambda: bool(beats), 10, "the first heartbeat")
            client.persist(batch, new_ids(4))
            began = time.monotonic()
            while time.monotonic() - began < 3.5:  # three timeouts and more
                status = client.status()
                assert status.failed["timeout"] == 0 and status.pending == 4
                time.sleep(0.25)
            assert status.timeouts_postponed >= 4
            assert 0 < (status.lease_of(5) or 0) <= 0.75
        finally:
            beating.clear()
            thread.join(10)
        assert set(beats) == {1}
        wait_until(lambda: client.status().failed["timeout"] == 4, 10, "the timeouts")
        status = client.status()
        assert status.lease_of(5) == 0.0 and status.replay_queue == 4
