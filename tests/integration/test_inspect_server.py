"""`ftlayer inspect` against a real `ftlayer serve` (issue 16, part 4): a record found by
root and by Kafka coordinates while pending, waiting for its backoff, queued for
replay and dead-lettered, with its attempts, causes, payload size and key; a completed
one is "unknown or completed"; bad arguments are clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import numpy as np
from serverproc import Server, StartServer

from ftlayer.acking.handlers import Persister
from ftlayer.causes import Cause, FailKind
from ftlayer.client import FTClient
from ftlayer.inspection import RecordQuery, RecordState
from ftlayer.payloads import encode_payloads
from ftlayer.policy import JITTER, RetryPolicy
from ftlayer.registration import SourceRegistration

SOURCE = 21
TOPIC = "payments"


def _inspect(server: Server, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "ftlayer.cli", "inspect", "--server", server.address, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def _inspect_json(server: Server, *args: str) -> dict[str, Any]:
    done = _inspect(server, *args, "--json")
    assert done.returncode == 0, done.stderr
    found: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return found


def _persist(client: FTClient, n: int) -> tuple[np.ndarray, np.ndarray]:
    """n ftkafka-encoded records at offsets 40.. of partitions 0 and 1, trees open:
    (roots, emission ids); XOR-ing a record's id completes its tree."""
    keys = [b"card-%d" % i for i in range(n)]
    payloads = encode_payloads(keys, [b"x" * 50] * n, np.full(n, 1_700_000_000_000))
    persister = Persister(client, source_id=SOURCE)
    anchors = persister.persist(
        payloads,
        topics=TOPIC,
        partitions=np.arange(n) % 2,
        offsets=np.arange(40, 40 + n),
        key_hashes=np.arange(n),
        has_key=np.ones(n, dtype=np.bool_),
    )
    return anchors.roots, anchors.ids


def test_inspect_follows_one_record_through_the_server(start_server: StartServer) -> None:
    server = start_server()
    at = ("--topic", TOPIC, "--partition", "1", "--offset", "41")
    with server.client() as client:
        policy = RetryPolicy(max_retries=1, backoff_ms=600_000, backoff_max_ms=600_000)
        client.register_source(SourceRegistration(SOURCE, "forward", 2, retry=policy.to_json()))
        roots, ids = _persist(client, 3)
        root = int(roots[1])

        # Pending, by root (as the logs print it, and as Spark's signed ft_root) and by
        # coordinates: the same record, with its size and its key.
        by_root = _inspect_json(server, "--root", hex(root))
        as_spark = root - (1 << 64) if root >= 1 << 63 else root  # ft_root is an int64
        signed = _inspect_json(server, "--root", str(as_spark))
        by_place = _inspect_json(server, *at)
        assert by_root["records"] == signed["records"] == by_place["records"]
        (record,) = by_root["records"]
        assert by_root["verdict"] == "pending" and record["state"] == "pending"
        assert (record["topic"], record["partition"], record["offset"]) == (TOPIC, 1, 41)
        assert record["key"] == "card-1" and record["key_bytes"] == 6
        assert record["payload_bytes"] == 14 + 6 + 50  # the ftkafka header, key, value
        assert record["history"] is None and record["root"] == root

        # Failed with a cause: waiting for its long backoff, under a new root.
        cause = Cause(FailKind.ERROR, "map(enrich)", "KeyError: 'merchant'")
        assert client.fail([root], cause) == 1
        waiting = _inspect_json(server, *at)
        (record,) = waiting["records"]
        assert record["state"] == "waiting" and record["root"] != root
        backoff = record["due"] - record["history"]["last_failed"]
        assert 600 * (1 - JITTER) <= backoff <= 600
        assert record["history"]["causes"][0]["error"] == "KeyError: 'merchant'"
        assert _inspect_json(server, "--root", hex(root))["verdict"] == "retired"
        text = _inspect(server, *at).stdout
        assert "waiting for its backoff" in text and "error in map(enrich)" in text

        # Failed again, past max_retries: a dead letter, found by coordinates.
        assert client.fail([record["root"]], Cause(FailKind.TIMEOUT)) == 1
        (dead,) = _inspect_json(server, *at)["records"]
        assert dead["state"] == "dead-letter" and dead["root"] == 0
        assert dead["history"]["attempts"] == 2
        assert dead["seq"] == client.dead_letters({}).letters[0]["seq"]
        text = _inspect(server, *at).stdout
        assert "dead-lettered" in text and "key 'card-1'" in text

        # Requeued from the dead letters with no backoff: queued for replay.
        client.register_source(
            SourceRegistration(SOURCE, "forward", 2, retry=RetryPolicy(max_retries=3).to_json())
        )
        assert client.dead_letter_op("requeue", {"seqs": [dead["seq"]]}) == 1
        queued = client.inspect(RecordQuery(topic=TOPIC, partition=1, offset=41))
        (record_q,) = queued.records
        assert record_q.state is RecordState.QUEUED
        assert record_q.replay_seq == client.status().replay_cursor_of([SOURCE])
        assert record_q.replay_partitions == (1,)
        assert record_q.history is not None and record_q.history["requeued"] == 1

        # A record whose tree completed: unknown or completed.
        client.xor(roots[:1], ids[:1])
        gone = _inspect(server, "--root", str(int(roots[0])))
        assert gone.returncode == 0 and "unknown or completed" in gone.stdout
        assert (
            _inspect_json(server, "--topic", TOPIC, "--partition", "0", "--offset", "40")["verdict"]
            == "unknown or completed"
        )

    # Bad arguments: a clear error, exit 2.
    both = _inspect(server, "--root", "1", "--topic", TOPIC)
    assert both.returncode == 2 and "not both" in both.stderr
    half = _inspect(server, "--topic", TOPIC, "--offset", "3")
    assert half.returncode == 2 and "all of --topic, --partition and --offset" in half.stderr
