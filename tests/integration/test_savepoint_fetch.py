"""A savepoint of shards on different hosts lands whole on the client's host: two real
`ftlayer serve --shard I --shards 2` processes, their data dirs in two temp directories
standing for two hosts, and the savepoints directory only on the client's side.

`ftlayer savepoint create --server A,B --dir D` has each shard save its store into its
spool and fetches each part over the FT-layer connection in chunks, checked against the
part's SHA-256 (ftlayer.checkpoint.fetch). What a user notices is checked: every part in
D, nothing left in the servers' spools, a restore of D into 2 and into 1 shards that
recovers every stored record; a cut connection or a full disk leaves no savepoint at
all; and `restore` refuses, by name, a part missing, parts of two savepoints mixed and
a truncated part.
"""

from __future__ import annotations

import errno
import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from serverproc import Server, StartServer

from ftlayer.acking.ids import new_ids
from ftlayer.checkpoint import fetch
from ftlayer.checkpoint.fetch import SPOOL_DIR, fetch_part
from ftlayer.checkpoint.savepoint import file_sha256, list_savepoints
from ftlayer.cli import main, serve
from ftlayer.client import FTClient, RequestRejected
from ftlayer.errors import StorageError
from ftlayer.records import RecordBatch
from ftlayer.registration import SourceRegistration
from ftlayer.shards import partition_shard

SOURCE = 7
PARTITIONS = 4
RECORDS = 1_500  # per shard
PAYLOAD = 4096  # bytes: a part of about 6 MB, several 4 MiB chunks with the default
LONG_TIMEOUT = ("--tree-timeout-s", "600")  # the records stay pending


def start_shards(start_server: StartServer, tmp_path: Path) -> list[Server]:
    """Two shards, each on its own "host" (a temp directory of its own), each holding
    RECORDS pending records of its own partitions."""
    servers = [
        start_server(
            tmp_path / f"host{i}" / "data", "--shard", str(i), "--shards", "2", *LONG_TIMEOUT
        )
        for i in (0, 1)
    ]
    own = {i: [p for p in range(PARTITIONS) if partition_shard(SOURCE, p, 2) == i] for i in (0, 1)}
    for i, server in enumerate(servers):
        with server.client() as client:
            client.register_source(SourceRegistration(SOURCE, "forward", PARTITIONS))
            partitions = np.resize(np.array(own[i], dtype=np.int32), RECORDS)
            payloads = [bytes([i + 1]) * PAYLOAD] * RECORDS
            batch = RecordBatch.build(
                new_ids(RECORDS, i, 2),
                payloads,
                source_ids=SOURCE,
                topics="t",
                partitions=partitions,
                offsets=np.arange(RECORDS),
            )
            client.persist(batch)
    return servers


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, Any, str]:
    """`ftlayer` in this process: (exit code, the last stdout line as JSON or None, stderr)."""
    code = main(list(args))
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    return code, json.loads(lines[-1]) if code == 0 and lines else None, err


def spooled(server: Server) -> list[str]:
    spool = server.data_dir / SPOOL_DIR
    return sorted(p.name for p in spool.iterdir()) if spool.is_dir() else []


def test_a_savepoint_of_shards_on_two_hosts_is_fetched_whole_and_restores(
    start_server: StartServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    servers = start_shards(start_server, tmp_path)
    addresses = ",".join(s.address for s in servers)
    client_dir = tmp_path / "client" / "savepoints"
    code, created, err = cli(
        capsys, "savepoint", "create", "--server", addresses, "--dir", str(client_dir),
        "--name", "sp", "--json",
    )  # fmt: skip
    assert code == 0, err
    parts = created["parts"]
    assert [(p["name"], p["shard"], p["stored_records"]) for p in parts] == [
        ("sp.shard-0-of-2", 0, RECORDS),
        ("sp.shard-1-of-2", 1, RECORDS),
    ]
    # Both parts on the client's side, whole, of one savepoint; the spools emptied.
    assert len({p["savepoint_id"] for p in parts}) == 1
    for part in parts:
        data = client_dir / part["name"] / "data" / "data.mdb"
        assert Path(part["path"]).parent == client_dir
        assert data.stat().st_size == part["data_bytes"] > 4 << 20  # more than one chunk
        assert file_sha256(data) == part["data_sha256"]
    assert [spooled(s) for s in servers] == [[], []]
    assert [s.name for s in list_savepoints(client_dir)] == [p["name"] for p in parts]
    for server in servers:
        server.proc.terminate()
        assert server.proc.wait(15) == 0

    # Restored into 2 shards and into 1: every stored record recovered.
    two = [tmp_path / "new" / f"d{i}" for i in (0, 1)]
    code, restored, err = cli(
        capsys, "savepoint", "restore", "sp", "--dir", str(client_dir),
        "--data-dir", ",".join(map(str, two)), "--json",
    )  # fmt: skip
    assert code == 0, err
    assert [s["stored_records"] for s in restored["shards"]] == [RECORDS, RECORDS]
    one = tmp_path / "new" / "single"
    code, restored, err = cli(
        capsys, "savepoint", "restore", "sp", "--dir", str(client_dir), "--data-dir", str(one),
        "--json",
    )  # fmt: skip
    assert code == 0, err
    assert restored["stored_records"] == 2 * RECORDS
    server = start_server(one, "--shards", "1", *LONG_TIMEOUT)
    with server.client() as client:
        assert client.status().failed["recovery"] == 2 * RECORDS

    # Bad input, each refused by name, with nothing restored.
    def refused(directory: Path, *expected: str) -> None:
        """Restored into as many shards (part by part) and into 3 (records moved)."""
        for count in (2, 3):
            target = tmp_path / "refused" / directory.name
            code, _reply, err = cli(
                capsys, "savepoint", "restore", "sp", "--dir", str(directory),
                "--data-dir", ",".join(f"{target}{i}" for i in range(count)),
            )  # fmt: skip
            assert code == 2
            for text in expected:
                assert text in err, err
            refused_dir = tmp_path / "refused"
            assert not refused_dir.exists() or not any(refused_dir.iterdir())

    missing = tmp_path / "missing"
    shutil.copytree(client_dir, missing)
    shutil.rmtree(missing / "sp.shard-1-of-2")
    refused(missing, "incomplete", "sp.shard-1-of-2", "missing")

    mixed = tmp_path / "mixed"
    shutil.copytree(client_dir, mixed)
    other = json.loads((mixed / "sp.shard-1-of-2" / "manifest.json").read_text())
    other["savepoint_id"] = "0123456789abcdef"  # as a part of another `create` says
    (mixed / "sp.shard-1-of-2" / "manifest.json").write_text(json.dumps(other))
    refused(mixed, "mixes parts of different savepoints", "sp.shard-1-of-2 of 0123456789abcdef")

    truncated = tmp_path / "truncated"
    shutil.copytree(client_dir, truncated)
    data = truncated / "sp.shard-0-of-2" / "data" / "data.mdb"
    size = data.stat().st_size
    with data.open("r+b") as cut:
        cut.truncate(size // 2)
    refused(truncated, "sp.shard-0-of-2", "truncated", f"{size // 2:,} bytes")

    damaged = tmp_path / "damaged"
    shutil.copytree(client_dir, damaged)
    data = damaged / "sp.shard-1-of-2" / "data" / "data.mdb"
    with data.open("r+b") as flip:
        flip.seek(size // 3)
        byte = flip.read(1)
        flip.seek(size // 3)
        flip.write(bytes([byte[0] ^ 0xFF]))
    refused(damaged, "sp.shard-1-of-2", "SHA-256")


def test_a_cut_connection_leaves_no_savepoint_on_the_client(
    start_server: StartServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Shard 1 dies while its part is fetched, after shard 0's part arrived whole: the
    command fails naming shard 1's part and how far it got, and removes shard 0's part
    too (a savepoint is whole or absent)."""
    servers = start_shards(start_server, tmp_path)
    real_fetch = fetch.fetch_part

    class Dying:
        """Shard 1's client, whose server is SIGKILLed after the first chunk."""

        def __init__(self, client: FTClient) -> None:
            self.client, self.address, self.chunks = client, client.address, 0

        def savepoint(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
            return self.client.savepoint(*args, **kwargs)

        def read_savepoint(self, name: str, offset: int, length: int) -> bytes:
            self.chunks += 1
            if self.chunks == 2:
                servers[1].kill()
            return self.client.read_savepoint(name, offset, length)

        def release_savepoint(self, name: str) -> None:
            self.client.release_savepoint(name)

    def fetch_part_dying(client: FTClient, directory: str, name: str, **kwargs: Any) -> Any:
        if name.endswith("shard-1-of-2"):
            return real_fetch(Dying(client), directory, name, **kwargs)
        return real_fetch(client, directory, name, **kwargs)

    monkeypatch.setattr(fetch, "fetch_part", fetch_part_dying)
    client_dir = tmp_path / "client" / "savepoints"
    code, _reply, err = cli(
        capsys, "savepoint", "create", "--server", ",".join(s.address for s in servers),
        "--dir", str(client_dir), "--name", "sp",
    )  # fmt: skip
    assert code == 2
    assert f"savepoint part 'sp.shard-1-of-2' from {servers[1].address}" in err, err
    assert f"after {fetch.CHUNK_BYTES:,} of" in err and "no savepoint was written" in err
    assert list(client_dir.iterdir()) == []  # neither part, nor a .partial directory


def test_a_full_disk_leaves_no_savepoint_and_says_so(
    start_server: StartServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = start_server(tmp_path / "host0" / "data", *LONG_TIMEOUT)
    with server.client() as client:
        client.register_source(SourceRegistration(SOURCE, "forward", PARTITIONS))
        client.persist(
            RecordBatch.build(
                new_ids(100), [b"y" * 100] * 100, source_ids=SOURCE, topics="t",
                partitions=0, offsets=np.arange(100),
            )
        )  # fmt: skip

    def no_space(_fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fetch.os, "fsync", no_space)
    client_dir = tmp_path / "client"
    with server.client() as client, pytest.raises(StorageError) as failed:
        fetch_part(client, client_dir, "sp")
    assert "could not write savepoint part 'sp'" in str(failed.value)
    assert "No space left on device" in str(failed.value)
    assert list(client_dir.iterdir()) == []
    # The server still serves, and the next savepoint replaces its spooled copy.
    monkeypatch.undo()
    with server.client() as client:
        saved = fetch_part(client, client_dir, "sp", chunk_bytes=1000)
        with pytest.raises(RequestRejected, match="no savepoint part 'sp'"):
            client.read_savepoint("sp", 0, 10)  # released
    assert saved.stored_records == 100 and spooled(server) == []


def test_a_spooled_part_nobody_reads_is_deleted_after_the_spool_idle_time(
    start_server: StartServer, tmp_path: Path
) -> None:
    """A fetch given up (its client died) leaves the part in the server's spool: the
    server deletes it once nobody read it for --spool-idle-s, and a part being read
    stays however long its fetch takes."""
    assert serve.SPOOL_IDLE_DEFAULT_S == fetch.SPOOL_IDLE_S  # the CLI's default is the server's
    server = start_server(tmp_path / "data", *LONG_TIMEOUT, "--spool-idle-s", "2")
    with server.client() as client:
        client.register_source(SourceRegistration(SOURCE, "forward", PARTITIONS))
        client.persist(
            RecordBatch.build(
                new_ids(50), [b"z" * 100] * 50, source_ids=SOURCE, topics="t",
                partitions=0, offsets=np.arange(50),
            )
        )  # fmt: skip
        manifest = client.savepoint(None, "given-up")
        assert spooled(server) == ["given-up"]
        # Read slowly, a chunk a second, for twice the idle time: the part stays.
        received = 0
        for _ in range(4):
            received += len(client.read_savepoint("given-up", received, 1000))
            time.sleep(1.0)
        assert spooled(server) == ["given-up"] and received == 4000
        # Then nobody reads it: gone within the idle time and a check.
        deadline = time.monotonic() + 10
        while spooled(server) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert spooled(server) == [], "the idle part is still in the spool"
        with pytest.raises(RequestRejected, match="nobody read it for --spool-idle-s"):
            client.read_savepoint("given-up", received, 1000)
    assert int(manifest["data_bytes"]) > received
    assert "deleted the savepoint part 'given-up'" in server.log.read_text()
