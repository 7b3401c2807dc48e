"""The server's malloc tuning (ftlayer/memtune.py): buffers of megabytes allocated and
freed over and over reuse their pages instead of faulting in fresh ones. Measured in a
process of its own (the tuning is process-wide), by its minor page faults."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

_CHILD = """
import json, resource, sys
from ftlayer.memtune import tune_malloc
tuned = tune_malloc() if sys.argv[1] == "tuned" else None
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
frame = b"x" * (2 << 20)
before = faults()
for i in range(50):  # what a PERSIST does: a frame's bytes, then a copy of its body
    body = frame[1:] + b"y"
    del body
print(json.dumps({"tuned": tuned, "faults": faults() - before}))
"""


def _faults(mode: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, check=True
    )
    result: dict[str, Any] = json.loads(out.stdout)
    return result


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_megabyte_buffers_reuse_their_pages_once_tuned() -> None:
    plain, tuned = _faults("plain"), _faults("tuned")
    assert tuned["tuned"] is True
    pages = (2 << 20) // 4096
    # Untuned, every copy of the 2 MB frame is a fresh mmap: a fault per page, each time.
    assert int(plain["faults"]) > 20 * pages
    # Tuned, the freed heap is reused: the first copies fault, the rest do not.
    assert int(tuned["faults"]) < 4 * pages
