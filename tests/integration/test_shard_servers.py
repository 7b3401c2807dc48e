"""Servers as the shards of a cluster: `ftlayer serve --shard I --shards N` keeps its
place in its data dir, STATUS reports it, and `ftlayer status` shows a cluster's
shards in order, then their sums."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from serverproc import StartServer

from ftlayer.acking.handlers import Persister
from ftlayer.acking.ids import new_ids
from ftlayer.causes import Cause, FailKind
from ftlayer.client import RequestRejected
from ftlayer.client.channel import BatchingChannel
from ftlayer.client.sharded import ShardedChannel
from ftlayer.records import RecordBatch
from ftlayer.registration import SourceRegistration
from ftlayer.shards import partition_shard, shard_of
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
    its held trees and replays them: nothing lost."""
    flags = ("--shards", "2", "--tree-timeout-s", "2")
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
