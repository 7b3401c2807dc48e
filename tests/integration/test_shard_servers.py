"""Servers as the shards of a cluster: `ftlayer serve --shard I --shards N` keeps its
place in its data dir, STATUS reports it, and `ftlayer status` shows a cluster's
shards in order, then their sums."""

from __future__ import annotations

import json
import subprocess
import sys
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
