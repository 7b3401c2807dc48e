"""Servers as the shards of a cluster: `ftlayer serve --shard I --shards N` keeps its
place in its data dir, STATUS reports it, and `ftlayer status` shows a cluster's
shards in order, then their sums."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from serverproc import StartServer

from ftlayer.records import RecordBatch
from ftlayer.registration import SourceRegistration


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
            client.persist(
                RecordBatch.build(
                    np.arange(10 + 10 * i, 10 + 10 * i + n, dtype=np.uint64),
                    [b"x"] * n,
                    source_ids=7,
                    topics="t",
                    partitions=i,
                    offsets=np.arange(n),
                )
            )
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
