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


_SETTLE = """
import gc, json, sys
from ftlayer.memtune import settle_heap
settle_heap().join(60)
from ftlayer.acking import u64kernels
from ftlayer.persistence import kernels
loaded = {
    f.__name__: len(f.signatures)
    for f in (u64kernels.find_slots, u64kernels.place, u64kernels.slots_of_rows, kernels.prefixed)
}
print(json.dumps({"loaded": loaded, "frozen": gc.get_freeze_count()}))
"""


def test_settle_heap_loads_the_servers_kernels_before_any_request_and_freezes_the_heap() -> None:
    """`ftlayer serve` runs it at start: the first PERSIST no longer waits for numba
    (measured: 293 ms for a fresh server's first 10,000-record persist, 15 ms with it),
    and the start-up heap is left out of the collector's full collections."""
    out = subprocess.run(
        [sys.executable, "-c", _SETTLE], capture_output=True, text=True, check=True
    )
    settled = json.loads(out.stdout)
    # The kernels that take arrays off the wire, for writable and read-only ones (numba
    # types them apart), and slots_of_rows, which takes the table's own.
    assert settled["loaded"] == {"find_slots": 2, "place": 2, "slots_of_rows": 1, "prefixed": 2}
    assert settled["frozen"] > 10_000  # the modules' objects, numba's among them
