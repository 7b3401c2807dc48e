"""Servers as the shards of a cluster: `ftlayer serve --shard I --shards N` keeps its
place in its data dir, STATUS reports it, and `ftlayer status` shows a cluster's
shards in order, then their sums."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from serverproc import Server, StartServer

from ftlayer import rangeroots
from ftlayer.acking.handlers import Persister
from ftlayer.acking.ids import new_ids
from ftlayer.causes import Cause, FailKind
from ftlayer.client import ConnectionLost, FTClient, RequestRejected, ServerError
from ftlayer.client.channel import BatchingChannel
from ftlayer.client.sharded import ShardedChannel
from ftlayer.errors import SourceError
from ftlayer.integration.source import parse_options
from ftlayer.integration.source.cluster import ShardClients
from ftlayer.integration.source.parking import Parking
from ftlayer.records import RecordBatch
from ftlayer.registration import SourceRegistration
from ftlayer.shards import partition_shard, shard_of
from ftlayer.status import Status
from ftlayer.wire.messages import SINK_KEY_BIT


def _status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ftlayer.cli", "status", "--wait-s", "2", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_shards_report_their_place_and_status_sums_them(
    start_server: StartServer, tmp_path: Path
) -> None:
    shards = [
        start_server(tmp_path / f"shard{i}", "--shard", str(i), "--shards", "2") for i in (0, 1)
    ]
    for i, server in enumerate(shards):
        with server.client() as client:
            client.register_source(SourceRegistration(7, "forward", 2))
            n = 3 + i
            client.persist(_records(n, shard=i, partition=(i - 7) % 2))  # its own partition
            status = client.status()
            assert (status.shard, status.shards, len(status.store_id)) == (i, 2, 16)
    assert shards[0].client().status().store_id != shards[1].client().status().store_id
    both = ",".join(s.address for s in shards)
    shown = _status("--server", both, "--json")
    assert shown.returncode == 0, shown.stderr
    reply = json.loads(shown.stdout.splitlines()[-1])
    assert [(s["address"], s["shard"], s["persisted"]) for s in reply["shards"]] == [
        (shards[0].address, 0, 3),
        (shards[1].address, 1, 4),
    ]
    assert (reply["total"]["persisted"], reply["total"]["pending"]) == (7, 7)
    text = _status("--server", both)
    assert text.returncode == 0 and "ftlayer status: all 2 shards" in text.stdout
    # Listed out of order: refused, naming the shard.
    swapped = _status("--server", f"{shards[1].address},{shards[0].address}")
    assert swapped.returncode == 2
    assert f"{shards[1].address} is shard 1 of 2, but --server names it as shard 0" in (
        swapped.stderr
    )


def _records(n: int, shard: int, partition: int) -> RecordBatch:
    return RecordBatch.build(
        new_ids(n, shard, 2),
        [b"x"] * n,
        source_ids=7,
        topics="t",
        partitions=partition,
        offsets=np.arange(n),
    )


def test_a_shard_refuses_what_another_shard_owns(start_server: StartServer, tmp_path: Path) -> None:
    """Each event goes to the shard its root names, each record to the shard of its
    partition (source 7: partition 0 is shard 1's, partition 1 shard 0's): anything
    else is refused, named, and changes nothing."""
    server = start_server(tmp_path / "shard1", "--shard", "1", "--shards", "2")
    with server.client() as client:
        client.register_source(SourceRegistration(7, "forward", 2))
        with pytest.raises(RequestRejected, match="partition 1 of source 7 belongs to shard 0"):
            client.persist(_records(2, shard=1, partition=1))
        with pytest.raises(RequestRejected, match=r"root 0x[0-9a-f]+ is shard 0's"):
            client.persist(_records(2, shard=0, partition=0))
        mine = _records(2, shard=1, partition=0)
        client.persist(mine)
        other = new_ids(1, 0, 2)
        with pytest.raises(RequestRejected, match=f"root {int(other[0]):#x} is shard 0's"):
            client.xor(other, other)
        outside = np.array([(5 << 55) | 99], dtype=np.uint64)
        with pytest.raises(RequestRejected, match="outside this cluster of 2 shards"):
            client.fail(outside)
        with pytest.raises(RequestRejected, match="belongs to shard 0"):
            client.register_ranges([(7, "t", 1, 0, 10)])
        (number,) = client.register_ranges([(7, "t", 0, 0, 10)])
        assert number >> 15 == 1  # a range number of shard 1
        assert client.fail(mine.roots[:1]) == 1  # its own: failed, replayed
        replays = client.fetch_replay(0, 2**62, source_id=7)
        assert len(replays) == 1 and int(replays.records.roots[0]) >> 55 == 1
        assert client.status().pending == 2 + 10


def test_a_data_dir_refuses_to_serve_another_place(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(tmp_path / "shard1", "--shard", "1", "--shards", "2")
    store_id = server.client().status().store_id
    server.proc.terminate()
    server.proc.wait(10)
    wrong = subprocess.run(
        [
            sys.executable,
            "-m",
            "ftlayer.cli",
            "serve",
            "--data-dir",
            str(tmp_path / "shard1"),
            "--shard",
            "0",
            "--shards",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert wrong.returncode != 0
    assert "holds the records of shard 1 of 2, not of shard 0 of 3" in wrong.stderr
    again = start_server(tmp_path / "shard1", "--shard", "1", "--shards", "2")
    assert again.client().status().store_id == store_id  # the same store, its id kept


def test_a_sharded_channel_sends_each_record_and_event_to_its_shard(
    start_server: StartServer, tmp_path: Path
) -> None:
    """Records of partitions 0-3 of source 7 persisted through one ShardedChannel land
    on their partitions' shards; XORs of roots of both shards in one call complete
    each tree on its shard, and a fail of roots of both shards fails each there."""
    servers = [start_server(tmp_path / f"s{i}", "--shard", str(i), "--shards", "2") for i in (0, 1)]
    channel = ShardedChannel([BatchingChannel(s.client()) for s in servers])
    with channel:
        channel.register_source(SourceRegistration(7, "forward", 4))
        persister = Persister(channel, source_id=7, shards=2)
        anchors = persister.persist(
            [b"a", b"b", b"c", b"d", b"e", b"f"],
            topics="t",
            partitions=[0, 1, 2, 3, 0, 1],
            offsets=[0, 0, 0, 0, 1, 1],
        )
        owners = partition_shard(7, [0, 1, 2, 3, 0, 1], 2)
        assert (shard_of(anchors.roots, 2) == owners).all()
        assert [channel.status(i).persisted for i in (0, 1)] == [3, 3]
        channel.xor(anchors.roots[:4], anchors.ids[:4])  # two trees on each shard
        channel.fail(anchors.roots[4:], Cause(FailKind.EXPLICIT, "step", "E: x"))
        channel.flush()
        for i in (0, 1):
            status = channel.status(i)
            assert (status.completed, status.failed["explicit"]) == (2, 1), i
        assert sum(len(channel.fetch_replay(i, 0, 2**62, source_id=7)) for i in (0, 1)) == 2


def test_a_sink_settle_does_not_wait_for_a_shard_that_is_down(
    start_server: StartServer, tmp_path: Path
) -> None:
    """A batch sink's acks held on both shards under one key, then shard 1 SIGKILLed:
    the settle acks shard 0's trees at once instead of waiting for shard 1 (its
    clients' reconnect_s is 60 s); shard 1, started again on its data dir, times out
    its held trees and replays them: nothing lost. (The tree timeout, 10 s, leaves the
    hold after the persist room on a loaded machine: at 2 s, and once at 5 s, a CI run
    with every core busy saw shard 1's trees time out before their hold.)"""
    flags = ("--shards", "2", "--tree-timeout-s", "10")
    servers = [start_server(tmp_path / f"s{i}", "--shard", str(i), *flags) for i in (0, 1)]
    channel = ShardedChannel([BatchingChannel(s.client()) for s in servers])
    key = SINK_KEY_BIT | 12345
    with channel:
        channel.register_source(SourceRegistration(7, "forward", 4))
        anchors = Persister(channel, source_id=7, shards=2).persist(
            [b"r"] * 8, topics="t", partitions=[0, 1, 2, 3] * 2, offsets=[0] * 4 + [1] * 4
        )
        on = shard_of(anchors.roots, 2)
        assert channel.sink_hold(key, anchors.roots, anchors.ids) == 8
        servers[1].kill()
        began = time.monotonic()
        assert channel.sink_settle(key) == int((on == 0).sum())
        settle_s = time.monotonic() - began
        assert settle_s < 5, settle_s
        assert channel.status(0).completed == int((on == 0).sum())
    again = start_server(tmp_path / "s1", "--shard", "1", *flags)
    with again.client() as client:
        deadline = time.monotonic() + 60
        while (status := client.status()).failed.get("timeout", 0) < int((on == 1).sum()):
            assert time.monotonic() < deadline, status.to_json()
            time.sleep(0.2)
        replays = client.fetch_replay(0, 2**62, source_id=7)
    assert len(replays) == int((on == 1).sum())  # every held tree of shard 1 replayed
    print(f"a settle with shard 1 down took {settle_s:.2f} s")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ftlayer.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_inspect_and_dead_letters_work_across_the_shards(
    start_server: StartServer, tmp_path: Path
) -> None:
    """Records of partitions 0-3 of source 7 through both shards, two of them poison
    (dead letters, one on each shard), one pending: `ftlayer inspect --server A,B`
    finds a record on its shard, `ftlayer dead-letters --server A,B` lists both shards'
    dead letters as SHARD/SEQ, shows and requeues one by that name, purges the rest."""
    servers = [start_server(tmp_path / f"s{i}", "--shard", str(i), "--shards", "2") for i in (0, 1)]
    both = ",".join(s.address for s in servers)
    channel = ShardedChannel([BatchingChannel(s.client()) for s in servers])
    with channel:
        channel.register_source(SourceRegistration(7, "forward", 4))
        partitions = [0, 1, 2, 3]
        anchors = Persister(channel, source_id=7, shards=2).persist(
            [b"ok-0", b"poison-1", b"poison-2", b"pending-3"],
            topics="t",
            partitions=partitions,
            offsets=[10, 11, 12, 13],
        )
        channel.xor(anchors.roots[:1], anchors.ids[:1])
        channel.fail(anchors.roots[1:3], Cause(FailKind.ERROR, "map", "E: poison", final=True))
        channel.flush()
    owner = [int(s) for s in partition_shard(7, partitions, 2)]
    assert sorted({owner[1], owner[2]}) == [0, 1]  # a dead letter on each shard

    found = _cli(
        "inspect", "--server", both, "--topic", "t", "--partition", "3", "--offset", "13", "--json"
    )
    assert found.returncode == 0, found.stderr
    shown = json.loads(found.stdout.splitlines()[-1])
    assert shown["verdict"] == "pending"
    assert [r["shard"] for r in shown["records"]] == [owner[3]]
    text = _cli("inspect", "--server", both, "--topic", "t", "--partition", "3", "--offset", "13")
    assert f"shard {owner[3]}" in text.stdout

    listed = _cli("dead-letters", "list", "--server", both, "--json")
    assert listed.returncode == 0, listed.stderr
    letters = json.loads(listed.stdout.splitlines()[-1])["letters"]
    assert sorted((x["shard"], x["partition"]) for x in letters) == sorted(
        (owner[p], p) for p in (1, 2)
    )
    assert all(x["seq"].startswith(f"{x['shard']}/") for x in letters)
    first = next(x for x in letters if x["partition"] == 1)
    show = _cli("dead-letters", "show", first["seq"], "--server", both, "--json")
    assert show.returncode == 0, show.stderr
    assert json.loads(show.stdout.splitlines()[-1])["offset"] == 11
    requeued = _cli("dead-letters", "requeue", "--server", both, "--seq", first["seq"], "--json")
    assert json.loads(requeued.stdout.splitlines()[-1]) == {"requeued": 1}
    purged = _cli("dead-letters", "purge", "--server", both, "--json")
    assert json.loads(purged.stdout.splitlines()[-1]) == {"purged": 1}
    assert [s.client().status().dead_letters for s in servers] == [0, 0]
    # A seq without its shard, or shards out of order: one-line errors.
    bare = _cli("dead-letters", "show", "3", "--server", both)
    assert bare.returncode == 2 and "SHARD/SEQ" in bare.stderr
    swapped = _cli("dead-letters", "list", "--server", f"{servers[1].address},{servers[0].address}")
    assert swapped.returncode == 2 and "is shard 1 of 2, but --server names it" in swapped.stderr


# ---- parked failures (ftlayer.core.parked, integration/source/parking.py) -------------

SOURCE = 7
"""Partition p of source 7 is on shard (7 + p) mod 2: partition 0 on shard 1."""


def _shard_flags(i: int, ports: list[str]) -> tuple[str, ...]:
    return ("--port", ports[i], "--shard", str(i), "--shards", "2")


def _two_shards(start_server: StartServer, tmp_path: Path) -> tuple[list[Server], list[str]]:
    """Two shards on ports of their own (a restart keeps its address)."""
    ports = []
    for _ in (0, 1):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            ports.append(str(probe.getsockname()[1]))
    servers = [start_server(tmp_path / f"s{i}", *_shard_flags(i, ports)) for i in (0, 1)]
    return servers, ports


def _parking(servers: list[Server]) -> tuple[Parking, list[str]]:
    """The driver's parking over these shards, and the stores it knows."""
    options = parse_options(
        {
            "subscribe": "t",
            "kafka.bootstrap.servers": "localhost:1",
            "ft.address": ",".join(s.address for s in servers),
            "ft.connectTimeoutMs": "1000",
        }
    )
    shards = ShardClients(options)
    shards.check_places()
    return Parking(shards), list(shards.store_ids)


def _settle(parking: Parking, stores: list[str]) -> list[Status | None]:
    statuses, _ = parking.shards.statuses()
    return parking.settle(statuses, stores)


def _open_range(server: Server, n: int) -> np.ndarray:
    """A barrier-mode source on both shards' registry and a batch range of n records of
    partition 0 open on shard 1; its range roots."""
    with server.client() as client:
        client.register_source(SourceRegistration(SOURCE, "forward", 2, completion="barrier"))
        (number,) = client.register_ranges([(SOURCE, "t", 0, 100, 100 + n)])
    return rangeroots.encode(number, 100, np.arange(100, 100 + n))


def _fail_with_shard1_down(servers: list[Server], roots: np.ndarray) -> float:
    """SIGKILL shard 1, then fail `roots` through a task's channel: the seconds the
    flush took (parked on shard 0)."""
    channels = [BatchingChannel(FTClient(s.address, reconnect_s=60.0)) for s in servers]
    channel = ShardedChannel(channels)
    for c in channels:
        c.park_after_s = 0.5
    with channel:
        servers[1].kill()
        began = time.monotonic()
        cause = Cause(FailKind.EXPLICIT, "step", "ValueError: no")
        channel.fail(roots, cause)
        channel.flush()
        return time.monotonic() - began


def test_a_fail_for_a_shard_that_is_down_is_parked_and_delivered_once(
    start_server: StartServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Shard 1 SIGKILLed with a batch range open: a task's FAIL of 3 of its rows is
    parked on shard 0 within the grace instead of waiting 60 s, and survives shard 0's
    SIGKILL. Shard 1 back while shard 0 is down: held (its failures may be on shard 0).
    Both back: the driver delivers them; a crash between the delivery and the drop
    delivers them twice, and shard 1 still fails each record once."""
    servers, ports = _two_shards(start_server, tmp_path)
    roots = _open_range(servers[1], 10)[[2, 5, 7]]
    with servers[0].client() as client:
        client.register_source(SourceRegistration(SOURCE, "forward", 2, completion="barrier"))
    parking, stores = _parking(servers)
    took = _fail_with_shard1_down(servers, roots)
    assert took < 5, took
    with servers[0].client() as client:
        assert client.status().parked == {"1": {"entries": 1, "roots": 3}}
    # Shard 1 is down: suspect, nothing delivered; shard 0's STATUS counts them.
    statuses = _settle(parking, stores)
    assert statuses[1] is None and 1 in parking.suspect
    # The keeper dies and comes back: its parked failures are in its LMDB.
    servers[0].kill()
    servers[1] = start_server(tmp_path / "s1", *_shard_flags(1, ports))
    statuses = _settle(parking, stores)  # shard 0 down, shard 1 back: held
    assert statuses == [None, None] and parking.shards.held == {1}
    servers[0] = start_server(tmp_path / "s0", *_shard_flags(0, ports))
    with servers[0].client() as client:
        assert client.status().parked_for(1) == 3
    # The driver dies between the FAIL at shard 1 and the drop at shard 0 ...
    real_drop = parking._drop

    def crash(keeper: int, seqs: list[int]) -> int:
        raise SourceError("the driver died here")

    parking._drop = crash  # type: ignore[method-assign]
    statuses = _settle(parking, stores)
    assert statuses[1] is None and parking.shards.held == {1}  # not clear: not dropped
    # ... and a new look delivers them again, then drops them.
    parking._drop = real_drop  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, "ftlayer.source"):
        statuses = _settle(parking, stores)
    assert statuses[1] is not None and not parking.shards.held and not parking.suspect
    assert "delivered 3 failures of shard 1" in caplog.text
    with servers[0].client() as client:
        assert client.status().parked == {}
    with servers[1].client() as client:
        status = client.status()
    assert status.failed["explicit"] == 3  # once each, though delivered twice
    # Stored by reference, each waits for its bytes (which give its replay partition).
    assert status.unfilled == 3, status.to_json()
    assert status.late_events + status.unknown_events == 3, status.to_json()
    print(f"a FAIL with its shard down was parked in {took:.2f} s")


def test_parked_failures_of_a_lost_store_are_dropped(
    start_server: StartServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Shard 1 SIGKILLed and started on an empty data dir (another store): the failures
    parked for its old store are dropped undelivered, logged; it is not held."""
    servers, ports = _two_shards(start_server, tmp_path)
    roots = _open_range(servers[1], 4)
    parking, stores = _parking(servers)
    _fail_with_shard1_down(servers, roots)
    servers[1] = start_server(tmp_path / "s1-new", *_shard_flags(1, ports))
    with caplog.at_level(logging.WARNING, "ftlayer.source"):
        statuses = _settle(parking, stores)
    assert statuses[1] is not None and not parking.shards.held
    assert parking.dropped == 4 and parking.delivered == 0
    assert "dropped 4 failures parked for shard 1" in caplog.text
    assert f"its store {stores[1]}, which it lost" in caplog.text
    with servers[0].client() as client:
        assert client.status().parked == {}
    with servers[1].client() as client:
        assert client.status().failed.get("explicit", 0) == 0


def test_a_savepoint_is_refused_while_failures_are_parked_and_all_down_fails(
    start_server: StartServer, tmp_path: Path
) -> None:
    """A shard keeping parked failures refuses a savepoint (it would lose them). With no
    shard answering, a FAIL is not parked: it waits for its shard (reconnect_s) and
    fails."""
    flags = ("--shards", "2")
    servers = [start_server(tmp_path / f"s{i}", "--shard", str(i), *flags) for i in (0, 1)]
    roots = _open_range(servers[1], 2)
    _fail_with_shard1_down(servers, roots)
    with servers[0].client() as client, pytest.raises(ServerError, match="parked failures"):
        client.savepoint(None)
    servers[0].kill()
    channels = [BatchingChannel(FTClient(s.address, reconnect_s=1.0)) for s in servers]
    for c in channels:
        c.park_after_s = 0.2
    channel = ShardedChannel(channels)
    channel.fail(roots)
    with pytest.raises(ConnectionLost):
        channel.flush()


def test_the_driver_fails_only_once_no_shard_answered_for_the_reconnect_timeout(
    start_server: StartServer, tmp_path: Path
) -> None:
    """One shard down: the driver's STATUS round names it down and goes on, however
    long. Both down: it goes on until no shard answered for ft.reconnectTimeoutMs,
    then a SourceError names the option."""
    servers, _ports = _two_shards(start_server, tmp_path)
    options = parse_options(
        {
            "subscribe": "t",
            "kafka.bootstrap.servers": "localhost:1",
            "ft.address": ",".join(s.address for s in servers),
            "ft.connectTimeoutMs": "1000",
            "ft.reconnectTimeoutMs": "2000",
        }
    )
    shards = ShardClients(options)
    shards.check_places()
    servers[1].kill()
    began = time.monotonic()
    while time.monotonic() - began < 4.0:  # twice the timeout, one shard answering
        statuses, _ = shards.statuses()
        assert statuses[0] is not None and statuses[1] is None
        assert set(shards.down) == {1}
        time.sleep(0.2)
    servers[0].kill()
    statuses, _ = shards.statuses()  # both down: not yet an error
    assert statuses == [None, None]
    with pytest.raises(SourceError, match=r"no shard of the FT layer .*\(ft\.reconnectTimeoutMs\)"):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            shards.statuses()
            time.sleep(0.2)
    assert time.monotonic() - began >= 4.0 + 2.0
