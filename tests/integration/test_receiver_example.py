"""The user guide's own-receiver example (section 6.13, `spool_receiver.py`), run as
written against a real `ftlayer serve`: every line of the files dropped into its spool
directory is stored once and queued by key, each file is deleted (acknowledged) only
after its records are durable, and a file dropped again (a receiver that died between
its store and its delete) adds no second copy."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from serverproc import StartServer

from ftlayer.client import FTClient
from ftlayer.payloads import decode_payloads
from ftlayer.registration import ingest_source_id

pytestmark = pytest.mark.integration

GUIDE = Path(__file__).parents[2] / "docs" / "user-guide.md"
PARTITIONS = 2


def example() -> str:
    """The guide's code block that starts with `# spool_receiver.py`."""
    blocks = re.findall(r"```python\n(# spool_receiver\.py.*?)```", GUIDE.read_text(), re.S)
    assert len(blocks) == 1, "the user guide has one spool_receiver.py example"
    return str(blocks[0])


def drop(spool: Path, name: str, first: int, n: int) -> None:
    """A JSON-lines file of records first..first+n-1, written whole then renamed in."""
    lines = [json.dumps({"key": f"k{i % 7}", "n": i}) for i in range(first, first + n)]
    part = spool / f".{name}.part"
    part.write_text("\n".join(lines) + "\n")
    part.rename(spool / name)


def test_the_guides_receiver_stores_every_line_once_and_deletes_only_after(
    start_server: StartServer, tmp_path: Path
) -> None:
    code = example()
    assert 25 <= len(code.splitlines()) <= 40  # about 30 lines, as the guide says
    script = tmp_path / "spool_receiver.py"
    script.write_text(code)
    spool = tmp_path / "spool"
    spool.mkdir()
    server = start_server()
    source_id = ingest_source_id("spooled")
    drop(spool, "a.jsonl", 0, 300)
    drop(spool, "b.jsonl", 300, 200)
    command = [sys.executable, str(script), str(spool), server.address, "spooled", str(PARTITIONS)]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE)
    try:
        with FTClient(server.address) as client:
            deadline = time.monotonic() + 60
            while list(spool.glob("*.jsonl")) or client.status().ingested < 500:
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                assert time.monotonic() < deadline, "the receiver did not take the files"
                time.sleep(0.1)
            drop(spool, "a.jsonl", 0, 300)  # the same file again: no second copy
            while list(spool.glob("*.jsonl")):
                assert time.monotonic() < deadline, "the receiver did not take the file again"
                time.sleep(0.1)
            status = client.status()
            hi = status.replay_cursor_of([source_id])
            stored: dict[int, int] = {}
            for p in range(PARTITIONS):
                records = client.fetch_replay(0, hi, source_id=source_id, partition=p).records
                keys, values, _, _ = decode_payloads(records.payloads)
                for key, value in zip(keys.to_pylist(), values.to_pylist(), strict=True):
                    n = json.loads(value)["n"]
                    assert key == b"k%d" % (n % 7)
                    stored[n] = stored.get(n, 0) + 1
    finally:
        proc.terminate()
        proc.wait(10)
    assert status.ingested == 500 and status.ingest_duplicates == 300
    assert stored == dict.fromkeys(range(500), 1)
