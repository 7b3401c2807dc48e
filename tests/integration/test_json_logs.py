"""`ftlayer serve --log-format json` (issue 16, part 6): every stderr line of a real
server is one JSON object, and the lines of a timeout, a dead letter and a refused
request name the source, partition, offsets and roots concerned."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from serverproc import StartServer

from ftlayer.acking.handlers import Persister
from ftlayer.causes import Cause, FailKind
from ftlayer.inspection import RecordQuery
from ftlayer.policy import RetryPolicy
from ftlayer.registration import SourceRegistration

SOURCE = 31


def _lines(log: Path) -> list[dict[str, Any]]:
    """Every line of the server's stderr, each parsed as JSON (a line that is not JSON
    fails the test)."""
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def _wait_for(log: Path, predicate: Any, timeout_s: float = 60.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while True:
        found = [line for line in _lines(log) if predicate(line)]
        if found:
            return found
        assert time.monotonic() < deadline, f"no such log line in {log.read_text()[-3000:]}"
        time.sleep(0.1)


def test_failure_lines_are_json_and_name_what_failed(start_server: StartServer) -> None:
    server = start_server(None, "--log-format", "json", "--tree-timeout-s", "1")
    with server.client() as client:
        client.register_source(
            SourceRegistration(
                SOURCE, "forward", 2, retry=RetryPolicy(max_retries=1, backoff_ms=0).to_json()
            )
        )
        persister = Persister(client, source_id=SOURCE)
        anchors = persister.persist(
            [b"a", b"b", b"c"], topics="clicks", partitions=[0, 1, 1], offsets=[70, 71, 72]
        )
        roots = [hex(int(r)) for r in anchors.roots]

        # A dead letter at once (a final cause): its line names the seq, offset and root.
        final = Cause(FailKind.ERROR, "map(parse)", "ValueError: x", final=True)
        client.fail(anchors.roots[:1], final)
        (dead,) = _wait_for(server.log, lambda x: "dead-lettered" in x["message"])
        assert (dead["level"], dead["logger"]) == ("WARNING", "ftlayer.core")
        assert (dead["source_id"], dead["topic"], dead["partition"]) == (SOURCE, "clicks", 0)
        assert (dead["offsets"], dead["roots"], dead["attempts"]) == ([70], roots[:1], 1)
        assert (dead["kind"], dead["step"], dead["error"]) == (
            "error",
            "map(parse)",
            "ValueError: x",
        )
        (seq,) = dead["seqs"]
        assert client.dead_letters({}).letters[0]["seq"] == seq

        # The two others time out (T = 1 s): one line for their partition.
        timeouts = _wait_for(server.log, lambda x: x.get("cause") == "timeout")
        assert timeouts[0]["message"] == "trees failed (timeout): queued for replay"
        assert [(x["partition"], x["offsets"], x["count"]) for x in timeouts] == [(1, [71, 72], 2)]
        (timeout,) = timeouts
        assert timeout["level"] == "WARNING" and sorted(timeout["roots"]) == sorted(roots[1:])
        # ... with the roots they now go on under, which inspect finds.
        for new_root in timeout["new_roots"]:
            (found,) = client.inspect(RecordQuery(root=int(new_root, 16))).records
            assert found.offset in (71, 72)

        # A refused request: its line names the peer, request and error code.
        with pytest.raises(ValueError):
            client.persist(persister_batch_with_repeated_root(anchors.roots[1]))
        (refused,) = _wait_for(server.log, lambda x: x.get("code") == 102)
        assert refused["kind"] == 0x10 and refused["request_id"] > 0 and refused["peer"]

    # Every line, the start and the connections too, parsed as JSON above; all have
    # the five keys of a line.
    lines = _lines(server.log)
    assert lines and all({"time", "level", "logger", "message"} <= set(x) for x in lines)
    assert any(x["message"].startswith("serving ") for x in lines)


def persister_batch_with_repeated_root(root: np.uint64) -> Any:
    """A PERSIST of a root that is pending already: refused (ERROR 102)."""
    from ftlayer.records import RecordBatch

    return RecordBatch.build(np.array([root], dtype=np.uint64), [b"again"], source_ids=SOURCE)
