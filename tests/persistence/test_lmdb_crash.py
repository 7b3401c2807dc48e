"""A process killed while it writes to an LMDB store (SIGKILL, at a random moment)
loses nothing that was stored and brings back nothing that was deleted: the store it
leaves holds exactly what the memory storage holds after the same operations, up to
the last one the process reported committed, or the one after it (committed, not yet
reported). Operations are chunked puts, deletes of most of a batch and of scattered
records (so chunks compact), retags, and deletes staged onto a put; crash_workload.py
runs them.

The seed of each run is drawn afresh (FTLAYER_CRASH_SEED fixes it) and shown on failure.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from crash_workload import CHUNK_BYTES, Workload, stored_rows

from ftlayer.persistence.lmdb_storage import LmdbStorage

BASE_SEED = int(os.environ.get("FTLAYER_CRASH_SEED", time.time_ns() % 2**32))
WORKLOAD = Path(__file__).with_name("crash_workload.py")
START_DEADLINE_S = 60.0


@pytest.mark.parametrize("run", range(4))
def test_a_killed_writer_loses_nothing_stored_and_revives_nothing_deleted(
    tmp_path: Path, run: int
) -> None:
    seed = BASE_SEED + run
    chooser = random.Random(seed)
    path = tmp_path / "store"
    errors = tmp_path / "stderr.txt"
    with errors.open("w") as stderr:
        child = subprocess.Popen(
            [sys.executable, str(WORKLOAD), str(path), str(seed)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    try:
        assert child.stdout is not None
        target = chooser.randint(3, 25)
        deadline = time.monotonic() + START_DEADLINE_S
        reported = -1
        while reported < target:
            line = child.stdout.readline()
            assert line, f"seed {seed}: the workload ended: {errors.read_text()}"
            reported = int(line)
            assert time.monotonic() < deadline, f"seed {seed}: too slow"
        time.sleep(chooser.uniform(0, 0.05))  # often inside the next step's transaction
        child.send_signal(signal.SIGKILL)
        child.wait()
        last = ([reported] + [int(x) for x in child.stdout.read().split()])[-1]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL, f"seed {seed}: {errors.read_text()}"
    # What the model holds after the last step reported, and after the one after it.
    replay = Workload(seed)
    for _ in range(last + 1):
        replay.step()
    states = [(stored_rows(replay.model), replay.model.next_seq)]
    replay.step()
    states.append((stored_rows(replay.model), replay.model.next_seq))
    with LmdbStorage(path, chunk_bytes=CHUNK_BYTES) as storage:
        found = stored_rows(storage)
        assert (found, storage.next_seq) in states, (
            f"seed {seed}: after step {last} the store holds {len(found)} records up to "
            f"seq {storage.next_seq - 1}; the model {len(states[0][0])} or, a step later, "
            f"{len(states[1][0])}"
        )
        assert len(storage) == len(found)
