"""Retries, backoff and dead letters through a real `ftlayer serve` (issue 12, parts 1,
2 and 5): FAIL carries causes, a record waits its backoff, its retry count and due time
survive a SIGKILL of the server, dead letters are listed, requeued and purged over the
wire and by `ftlayer dead-letters`, and bad requests get clear errors."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
from fixture_types import MakeTopic
from serverproc import Server, StartServer

from ftlayer.acking.handlers import Persister
from ftlayer.causes import Cause, Causes, FailKind
from ftlayer.cli import main
from ftlayer.client import FTClient
from ftlayer.inspection import RecordQuery, RecordState
from ftlayer.integration.harness.kafka import produce
from ftlayer.integration.source.deadletters import dead_letter_messages
from ftlayer.payloads import encode_payloads
from ftlayer.policy import RetryPolicy
from ftlayer.registration import SourceRegistration
from ftlayer.wire import (
    BadRequest,
    ErrorCode,
    Frame,
    FrameReader,
    Kind,
    decode_error,
    encode_auth,
    encode_dead_letters,
    encode_frame,
    encode_hello,
)

SOURCE = 11


def _register(client: FTClient, policy: RetryPolicy) -> None:
    client.register_source(SourceRegistration(SOURCE, "forward", 2, retry=policy.to_json()))


def _persist_pending(client: FTClient, n: int) -> np.ndarray:
    """n records persisted and emitted, their trees open (ack value = the emission id)."""
    persister = Persister(client, source_id=SOURCE)
    return persister.persist(
        [b"record-%d" % i for i in range(n)],
        topics="events",
        partitions=np.arange(n) % 2,
        offsets=np.arange(n),
    ).roots


BACKOFF_MS = 15_000


def _due_of_record_1(client: FTClient) -> float:
    """When record 1 (events, partition 1, offset 1), waiting for its backoff, is due."""
    found = client.inspect(RecordQuery(topic="events", partition=1, offset=1)).records
    assert [r.state for r in found] == [RecordState.WAITING], found
    assert found[0].due is not None
    return found[0].due


def _wait(predicate, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_fail_causes_travel_to_the_dead_letter_and_its_operations_work(
    start_server: StartServer,
) -> None:
    server = start_server()
    with server.client() as client:
        _register(client, RetryPolicy(max_retries=1, backoff_ms=0, backoff_max_ms=0))
        roots = _persist_pending(client, 4)
        causes = Causes(
            (
                Cause(FailKind.ERROR, "map(parse)", "JSONDecodeError: Expecting value"),
                Cause(FailKind.SINK, "kafka sink to 'out'", "MessageSizeTooLargeError: big"),
            ),
            np.array([0, 1], dtype=np.uint16),
        )
        assert client.fail(roots[:2], causes) == 2
        replay = client.fetch_replay(0, client.status().replay_cursor_of([SOURCE]), SOURCE)
        assert sorted(replay.records.offsets.tolist()) == [0, 1]
        again = Causes.one(Cause(FailKind.ERROR, "map(parse)", "JSONDecodeError: again"), 2)
        assert client.fail(replay.records.roots, again) == 2
        status = client.status()
        assert (status.dead_lettered, status.dead_letters, status.pending) == (2, 2, 2)
        listed = client.dead_letters({"cause": "error"})
        assert [letter["attempts"] for letter in listed.letters] == [2, 2]
        first = listed.letters[0]
        assert [c["error"] for c in first["causes"]] == [
            "JSONDecodeError: Expecting value",
            "JSONDecodeError: again",
        ]
        assert first["causes"][0]["step"] == "map(parse)"
        assert listed.records.payloads == [b"record-0", b"record-1"]
        sink_first = client.dead_letters({"partition": 1})
        assert sink_first.letters[0]["causes"][0]["kind"] == "sink"
        # Requeue one: it is replayed again, then completes.
        assert client.dead_letter_op("requeue", {"seqs": [first["seq"]]}) == 1
        replay = client.fetch_replay(0, client.status().replay_cursor_of([SOURCE]), SOURCE)
        records = replay.records
        (root,) = [r for r, o in zip(records.roots, records.offsets, strict=True) if o == 0]
        client.xor([root], [7])
        client.xor([root], [7])
        status = client.status()
        assert (status.dead_letters, status.dead_letters_requeued, status.completed) == (1, 1, 1)
        # Purge the other for good.
        assert client.dead_letter_op("purge", {"partition": 1}) == 1
        assert client.status().dead_letters == 0
        # Bad requests: a clear error, the connection goes on.
        with pytest.raises(BadRequest, match="unknown fail cause 'nonsense'"):
            client.dead_letters({"cause": "nonsense"})
        with pytest.raises(BadRequest, match="unknown dead-letter filter fields"):
            client.dead_letter_op("purge", {"topic": "x"})
        with pytest.raises(BadRequest, match="DEAD_LETTERS must be"):
            encode_dead_letters(1, "delete", {})
        assert client.status().pending == 2


def _raw_request(server: Server, frame: bytes) -> tuple[int, str]:
    """Send one frame after the handshake on a raw connection; the ERROR reply's code
    and message."""
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        raw.sendall(encode_hello(1, bytes(16), "raw") + encode_auth(2, bytes(32)))
        reader = FrameReader()
        frames: list[Frame] = []
        raw.sendall(frame)
        while len(frames) < 3:
            data = raw.recv(65536)
            assert data, f"the server closed after {frames}"
            frames += reader.feed(data)
    assert [f.kind for f in frames[:2]] == [Kind.CHALLENGE, Kind.WELCOME]
    reply = decode_error(frames[2])
    return reply.code, reply.message


def test_an_unknown_cause_encoding_is_a_clear_error(start_server: StartServer) -> None:
    server = start_server()
    body = struct.pack("<IQ", 1, 5) + struct.pack("<H", 1) + struct.pack("<BBH", 9, 0, 0)
    body += struct.pack("<H", 0) + struct.pack("<H", 0)
    code, message = _raw_request(server, encode_frame(Kind.FAIL, 99, body))
    assert code == ErrorCode.BAD_REQUEST and "unknown encoding: kind 9" in message
    body = struct.pack("<IQ", 1, 5) + struct.pack("<H", 1) + struct.pack("<BBH", 1, 0, 0)
    body += struct.pack("<H", 0) + struct.pack("<H", 3)
    code, message = _raw_request(server, encode_frame(Kind.FAIL, 98, body))
    assert code == ErrorCode.MALFORMED_FRAME and "cause index 3 beyond its 1 causes" in message


def test_retry_counts_and_due_times_survive_a_sigkill_of_the_server(
    start_server: StartServer,
) -> None:
    # Records 0 and 2 stay pending throughout: a tree timeout longer than the test's
    # four backoffs (up to a minute on a loaded machine), or theirs would fail them,
    # and their replays would move the replay cursor the test reads record 1's from.
    timeout = ("--tree-timeout-s", "600")
    server = start_server(None, *timeout)
    # Longer than a restart of the server takes on a loaded machine (seconds).
    policy = RetryPolicy(max_retries=3, backoff_ms=BACKOFF_MS, backoff_max_ms=BACKOFF_MS)
    with server.client() as client:
        _register(client, policy)
        roots = _persist_pending(client, 3)
        failed_at = time.time()
        client.fail(roots[[1]], Cause(FailKind.EXPLICIT, "enrich", "FailException: later"))
        answered_at = time.time()
        status = client.status()
        assert (status.retry_waiting, status.replay_cursor_of([SOURCE])) == (1, 0)
        due = _due_of_record_1(client)  # the backoff, less up to 20% of jitter
        backoff_s = BACKOFF_MS / 1000
        assert failed_at + 0.8 * backoff_s <= due <= answered_at + backoff_s, (failed_at, due)
    server.kill()
    server = start_server(server.data_dir, *timeout)
    with server.client() as client:
        status = client.status()
        # Record 1 still waits for its backoff (12 to 15 s after its failure); records
        # 0 and 2 were pending at the kill: restored from the journal as they were, not
        # replayed.
        assert status.retry_waiting == 1
        assert (status.recovered_pending, status.failed["recovery"]) == (3, 0)
        cursor = status.replay_cursor_of([SOURCE])
        assert len(client.fetch_replay(0, cursor, SOURCE)) == 0
        # The due time itself survived (not the backoff started again at the restart),
        # and the record is queued once it has passed, not before.
        assert _due_of_record_1(client) == due
        _wait(lambda: client.status().retry_waiting == 0, 60)
        assert time.time() >= due
        replay = client.fetch_replay(cursor, client.status().replay_cursor_of([SOURCE]), SOURCE)
        assert replay.records.offsets.tolist() == [1]
        # Its count was kept: one failure before the kill; three more make it dead.
        for _ in range(3):
            client.fail(replay.records.roots, Cause(FailKind.ERROR, "enrich", "E: x"))
            if client.status().dead_letters:
                break
            _wait(lambda: client.status().retry_waiting == 0, 60)
            cursor = client.status().replay_cursor_of([SOURCE])
            replay = client.fetch_replay(cursor - 1, cursor, SOURCE)
        (letter,) = client.dead_letters().letters
        assert letter["attempts"] == 4
        assert [c["kind"] for c in letter["causes"]] == ["explicit", "error", "error", "error"]


def test_the_dead_letters_command_lists_shows_requeues_and_purges(
    start_server: StartServer,
) -> None:
    server = start_server()
    with server.client() as client:
        _register(client, RetryPolicy(max_retries=0, backoff_ms=0, backoff_max_ms=0))
        roots = _persist_pending(client, 3)
        client.fail(roots, Cause(FailKind.ERROR, "map(parse)", "ValueError: not a number"))

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "ftlayer.cli", "dead-letters", *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=60)

    listed = cli("list", "--server", server.address, "--json")
    assert listed.returncode == 0, listed.stderr
    letters = json.loads(listed.stdout.strip().splitlines()[-1])["letters"]
    assert [(x["offset"], x["attempts"], x["last_cause"]["kind"]) for x in letters] == [
        (0, 1, "error"),
        (1, 1, "error"),
        (2, 1, "error"),
    ]
    table = cli("list", "--server", server.address, "--partition", "1")
    assert table.returncode == 0 and "ValueError: not a number" in table.stdout
    shown = cli("show", str(letters[1]["seq"]), "--server", server.address, "--json")
    detail = json.loads(shown.stdout.strip().splitlines()[-1])
    assert detail["payload_bytes"] == len(b"record-1") and detail["offset"] == 1
    assert detail["causes"][0]["step"] == "map(parse)"
    requeued = cli("requeue", "--server", server.address, "--partition", "0", "--json")
    assert json.loads(requeued.stdout.strip().splitlines()[-1]) == {"requeued": 2}
    purged = cli("purge", "--server", server.address, "--cause", "error", "--json")
    assert json.loads(purged.stdout.strip().splitlines()[-1]) == {"purged": 1}
    bad = cli("list", "--server", server.address, "--cause", "nonsense")
    assert bad.returncode == 2 and "unknown fail cause 'nonsense'" in bad.stderr
    with server.client() as client:
        status = client.status()
        assert (status.dead_letters, status.pending) == (0, 2)


def test_the_dead_letters_command_reads_a_dead_letter_topic(
    start_server: StartServer,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Dead letters as a source's driver delivers them, read back by `--topic`.
    server = start_server()
    values = [b"order %d" % i for i in range(3)]
    payloads = encode_payloads([b"k-%d" % i for i in range(3)], values, [1_700_000_000_000] * 3)
    with server.client() as client:
        _register(client, RetryPolicy(max_retries=0, backoff_ms=0, backoff_max_ms=0))
        roots = (
            Persister(client, source_id=SOURCE)
            .persist(payloads, topics="events", partitions=0, offsets=np.arange(3))
            .roots
        )
        client.fail(roots, Cause(FailKind.ERROR, "map(parse)", "ValueError: bad order"))
        listed = client.dead_letters()
        assert client.dead_letter_op("purge", {}) == 3  # the driver delivered them
    topic = make_topic(1)
    produce(kafka_bootstrap, topic, dead_letter_messages(listed.letters, listed.records))
    on_topic = ["--server", server.address, "--topic", topic, "--bootstrap", kafka_bootstrap]

    assert main(["dead-letters", "list", *on_topic, "--json"]) == 0
    letters = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["letters"]
    assert [(x["seq"], x["offset"], x["attempts"]) for x in letters] == [
        ("0:0", 0, 1),
        ("0:1", 1, 1),
        ("0:2", 2, 1),
    ]
    assert main(["dead-letters", "show", "0:1", *on_topic]) == 0
    shown = capsys.readouterr().out
    assert '  key:   "k-1"\n  value: "order 1"\n  1 attempt, ' in shown, shown
    assert main(["dead-letters", "requeue", *on_topic, "--seq", "0:2"]) == 0
    assert capsys.readouterr().out.strip() == "1 dead letter requeued"
    with server.client() as client:
        assert client.status().replay_queue == 1
