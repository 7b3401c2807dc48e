"""Savepoints of a running FT-layer server, taken over the wire: a real `ftlayer serve`
process, the `ftlayer savepoint create --server` command and FTClient.savepoint.

What a user notices is checked: the savepoint holds exactly the records whose trees
were not complete (the completed ones are deleted first, none is lost) and the
position of the query's newest complete checkpoint; the server goes on serving while
and after it saves; a restore at twice the partitions replays exactly the incomplete
records, each into its key group's partition; a mistake is a clear error that leaves
the server serving; a connection lost mid-request says the savepoint may exist.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from serverproc import StartServer

from ftlayer.acking.ids import new_ids
from ftlayer.checkpoint.savepoint import list_savepoints, restore_savepoint
from ftlayer.client import ConnectionLost, FTClient, RequestRejected, ServerStorageError
from ftlayer.integration.harness.kafka import wait_until
from ftlayer.partitioners import (
    DEFAULT_MAX_PARALLELISM,
    assign_key_groups,
    kafka_key_hashes,
    key_group_partitions,
)
from ftlayer.records import RecordBatch
from ftlayer.registration import SourceRegistration
from ftlayer.wire import BadRequest, Kind

SOURCE = 5
N = 2  # partitions of the running job
QUERY = "orders-job"
TOPIC = "orders"


def key_group_partition(keys: list[bytes], partitions: int) -> list[int]:
    """Where the key-group partitioner puts each key, computed from the key bytes."""
    hashes, _ = kafka_key_hashes(keys)
    groups = assign_key_groups(hashes, DEFAULT_MAX_PARALLELISM)
    placed: list[int] = key_group_partitions(groups, DEFAULT_MAX_PARALLELISM, partitions).tolist()
    return placed


class Orders:
    """Keyed records read from the N partitions of `orders`, with their next offsets."""

    def __init__(self) -> None:
        self.next_offset = [0] * N
        self.key_of: dict[bytes, bytes] = {}

    def batch(self, prefix: str, n: int) -> RecordBatch:
        keys = [f"{prefix}-user-{i}".encode() for i in range(n)]
        partitions = key_group_partition(keys, N)
        offsets = []
        for partition in partitions:
            offsets.append(self.next_offset[partition])
            self.next_offset[partition] += 1
        payloads = [b"order-" + key for key in keys]
        self.key_of.update(zip(payloads, keys, strict=True))
        hashes, has_key = kafka_key_hashes(keys)
        return RecordBatch.build(
            new_ids(n),
            payloads,
            source_ids=SOURCE,
            key_hashes=hashes,
            has_key=has_key,
            topics=TOPIC,
            partitions=partitions,
            offsets=offsets,
        )

    def position(self) -> dict[str, Any]:
        """The barrier after every record read so far."""
        return {"kafka": {TOPIC: {str(p): o for p, o in enumerate(self.next_offset)}}, "replay": 0}


def run(client: FTClient, orders: Orders, prefix: str, n: int, done: np.ndarray) -> set[bytes]:
    """Persist n records and complete those where `done` (their XOR with the initial
    ids given at persist); returns the payloads left pending."""
    batch = orders.batch(prefix, n)
    ids = new_ids(n)
    client.persist(batch, ids)
    client.xor(batch.roots[done], ids[done])
    return {p for p, d in zip(batch.payloads, done.tolist(), strict=True) if not d}


def complete_checkpoint(client: FTClient, position: dict[str, Any]) -> None:
    """Barrier `position` of QUERY, begun and completed (unaligned), as ftkafka does;
    it is complete once the server wrote its snapshot."""
    args: dict[str, Any] = {"query": QUERY, "position": position, "sources": [SOURCE]}
    client.checkpoint(begin=True, mode="unaligned", **args)
    deadline = time.monotonic() + 10
    while client.checkpoint(begin=False, mode="unaligned", **args)["state"] != "complete":
        assert time.monotonic() < deadline, "the checkpoint never completed"
        time.sleep(0.05)


def ftlayer_savepoint(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ftlayer.cli", "savepoint", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def counts(client: FTClient) -> tuple[int, int, int]:
    status = client.status()
    return status["stored_records"], status["pending"], status["deletes_pending"]


def test_a_running_server_saves_exactly_its_incomplete_records_and_goes_on(
    start_server: StartServer, tmp_path: Path
) -> None:
    # The deleter is idle (an hour apart): only the savepoint's own flush deletes the
    # completed records, so the test sees that it does.
    server = start_server(None, "--tree-timeout-s", "600", "--delete-interval-s", "3600")
    savepoints = tmp_path / "savepoints"
    orders = Orders()
    with server.client() as client:
        client.register_source(SourceRegistration(SOURCE, "key-group", N))
        pending = run(client, orders, "a", 200, np.arange(200) % 5 < 3)  # 120 complete
        position = orders.position()
        complete_checkpoint(client, position)
        assert len(pending) == 80
        assert counts(client) == (200, 80, 120)  # completed, not deleted yet

        # Through the command line, as a user would; the same output as --data-dir.
        cli = ftlayer_savepoint(
            "create", "--server", server.address, "--dir", str(savepoints), "--name", "via-cli"
        )
        assert cli.returncode == 0, cli.stderr
        assert cli.stdout.splitlines() == [
            f"savepoint via-cli created in {savepoints / 'via-cli'}: 80 stored records",
            f"source {SOURCE}: key-group, {N} partitions",
            f"query {QUERY}: position {json.dumps(position, sort_keys=True)}",
        ]
        assert counts(client) == (80, 80, 0)  # the completed records were deleted first

        # The server goes on: a persist after the savepoint is stored and counted.
        later = run(client, orders, "b", 10, np.arange(10) < 4)
        status = client.status()
        assert (status["persisted"], status["completed"], status["pending"]) == (210, 124, 86)

        created = client.savepoint(str(savepoints), "via-client")
        assert counts(client) == (86, 86, 0)

    assert (created["name"], created["path"]) == ("via-client", str(savepoints / "via-client"))
    assert created["stored_records"] == 86
    saved = {s.name: s for s in list_savepoints(savepoints)}
    assert list(saved) == ["via-cli", "via-client"]
    assert saved["via-client"].as_dict() == created
    assert saved["via-cli"].stored_records == len(pending)
    for savepoint in saved.values():
        assert savepoint.positions == {QUERY: position}
        assert savepoint.source_data_dir == str(server.data_dir)
        assert list(savepoint.sources) == [str(SOURCE)]
    assert sorted(p.name for p in savepoints.iterdir()) == ["via-cli", "via-client"]

    # Restored at twice the partitions, a new server replays exactly the records that
    # were incomplete at the savepoint, each into its key group's partition at 2N.
    for name, expected in (("via-cli", pending), ("via-client", pending | later)):
        restored = tmp_path / f"restored-{name}"
        restore_savepoint(savepoints, name, restored, partitions=2 * N)
        with start_server(restored, "--tree-timeout-s", "600").client() as client:
            status = client.status()
            assert status["failed"]["recovery"] == len(expected)
            replay = client.fetch_replay(0, status["replay_cursor"], source_id=SOURCE)
        payloads = list(replay.records.payloads)
        assert sorted(payloads) == sorted(expected), f"{name}: records lost or doubled"
        keys = [orders.key_of[p] for p in payloads]
        assert replay.partitions.tolist() == key_group_partition(keys, 2 * N)


def test_savepoint_mistakes_are_clear_errors_and_the_server_goes_on(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(None, "--tree-timeout-s", "600")
    savepoints = tmp_path / "savepoints"
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a directory\n")
    orders = Orders()
    with server.client() as client:
        client.register_source(SourceRegistration(SOURCE, "key-group", N))
        run(client, orders, "a", 20, np.zeros(20, dtype=np.bool_))
        assert client.savepoint(str(savepoints), "daily")["stored_records"] == 20
        mistakes: list[tuple[str, str | None, type[Exception], str]] = [
            (str(savepoints), "daily", RequestRejected, "a savepoint named 'daily' already exists"),
            (str(a_file), "daily", RequestRejected, "notes.txt exists and is not a directory"),
            (str(a_file / "below"), None, ServerStorageError, "Not a directory"),
            (str(savepoints), "../up", RequestRejected, "bad savepoint name '../up'"),
            ("savepoints", None, BadRequest, "absolute path on the server's host"),
        ]
        for directory, name, error, message in mistakes:
            with pytest.raises(error, match=message):
                client.savepoint(directory, name)
            # The same connection goes on serving.
            run(client, orders, "more", 1, np.zeros(1, dtype=np.bool_))
        assert client.status()["pending"] == 20 + len(mistakes)
    assert a_file.read_text() == "not a directory\n"
    assert [p.name for p in savepoints.iterdir()] == ["daily"]  # no staging left behind

    # The command line: one line on stderr, exit 2.
    for argv, message in (
        (["--server", server.address, "--name", "daily"], "a savepoint named 'daily' already"),
        (["--server", server.address, "--name", "../up"], "bad savepoint name '../up'"),
        (["--data-dir", str(server.data_dir), "--tls-ca", "ca.pem"], "--tls-ca goes with --server"),
    ):
        done = ftlayer_savepoint("create", "--dir", str(savepoints), *argv)
        assert done.returncode == 2 and message in done.stderr, done.stderr
        assert done.stderr.startswith("ftlayer: ") and done.stderr.count("\n") == 1
    both = ftlayer_savepoint(
        "create", "--server", server.address, "--data-dir", "x", "--dir", str(savepoints)
    )
    assert both.returncode == 2 and "not allowed with argument" in both.stderr
    neither = ftlayer_savepoint("create", "--dir", str(savepoints))
    assert neither.returncode == 2 and "one of the arguments" in neither.stderr
    with server.client() as client:
        assert client.status()["pending"] == 25


def test_a_reply_that_never_comes_says_the_savepoint_may_exist(
    start_server: StartServer, tmp_path: Path
) -> None:
    """The server is frozen (SIGSTOP) after it got the request: no reply within the
    client's wait. The client does not resend; it says the savepoint may or may not
    exist, and once the server runs again, it does."""
    server = start_server(None, "--tree-timeout-s", "600")
    savepoints = tmp_path / "savepoints"
    client = server.client()
    with client:
        run(client, Orders(), "a", 5, np.zeros(5, dtype=np.bool_))  # connected
        server.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(ConnectionLost) as lost:
                client.savepoint(str(savepoints), "maybe", timeout_s=0.5)
        finally:
            server.proc.send_signal(signal.SIGCONT)
    message = str(lost.value)
    assert "timed out after 0.5 s" in message
    assert f"savepoint 'maybe' may or may not have been created in {savepoints}" in message
    assert f"ftlayer savepoint list --dir {savepoints}" in message
    assert client.requests_sent[Kind.SAVEPOINT] == 1  # sent once, never resent
    wait_until(
        lambda: savepoints.is_dir() and [s.name for s in list_savepoints(savepoints)] == ["maybe"],
        timeout=10,
        what="the savepoint the server was writing",
    )
    with server.client() as client:
        assert client.status()["pending"] == 5
