"""The fixed cost per micro-batch of a real `ftlayer serve` in barrier mode with
`ft.persist=reference`, without Spark: the requests the ftkafka source's driver sends
per batch at 0 failures, in its order. Per micro-batch of PER_BATCH records (10,000 by
default) over 4 partitions: STATUS (its replay cursor and pending roots; BRIEF=0 asks
for the full reply, as `ftlayer status` does), BATCH_RANGES (the batch's offset range
per partition, stored before any row is emitted), CHECKPOINT_BEGIN (the barrier,
completing the batch before) and one HEARTBEAT (the lease of the running batch).

Over BATCHES micro-batches (500 by default) after ten of warm-up, it reports from
/proc/<pid> the server's CPU (user + system) and the bytes it wrote (`write_bytes` of
/proc/<pid>/io: what reached the page cache for the disk, LMDB's pages, its meta page
and any log or journal file), per batch and per record; the store's commits per batch
(STATUS `store_commits`); and per request kind the requests per batch and their
handlers' CPU per record (STATUS `requests`). The server's log goes to a file (its
stderr), so its log lines count in the bytes written.

    .venv/bin/python scripts/server_batch_cost.py [BATCHES]
    PER_BATCH=200000 BRIEF=0 .venv/bin/python scripts/server_batch_cost.py 100
    PAUSE_S=0.8 .venv/bin/python scripts/server_batch_cost.py 20

PAUSE_S: seconds each batch runs (after its HEARTBEAT, before the next STATUS), as a
real batch does: what the server does meanwhile (its flush of staged writes on an
idle store) counts too.
"""

import os
import sys
import tempfile
import time
from pathlib import Path

from proc_cpu import print_requests, user_sys

from ftlayer.client import FTClient
from ftlayer.integration.harness.ftprocess import FTServerProcess
from ftlayer.policy import RetryPolicy
from ftlayer.registration import SourceRegistration

BATCHES = int(sys.argv[1]) if len(sys.argv) > 1 else 500
PER_BATCH = int(os.environ.get("PER_BATCH", "10000"))
BRIEF = os.environ.get("BRIEF", "1") != "0"
PAUSE_S = float(os.environ.get("PAUSE_S", "0"))  # the time a batch runs, between requests
PARTITIONS, SOURCE, TOPIC = 4, 11, "t"


def _write_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/{pid}/io has no write_bytes")


def _status(client: FTClient):  # type: ignore[no-untyped-def]
    status = getattr(client, "brief_status", None)
    return status() if BRIEF and status is not None else client.status()


def main() -> None:
    per_partition = PER_BATCH // PARTITIONS
    with tempfile.TemporaryDirectory() as tmp:
        server = FTServerProcess(Path(tmp) / "data", "--tree-timeout-s", "120").start()
        try:
            pid = server.pid
            assert pid is not None
            driver = FTClient(server.address, name="driver")
            driver.register_source(
                SourceRegistration(
                    SOURCE, "forward", PARTITIONS, retry=RetryPolicy(3, 0, 0), completion="barrier"
                )
            )
            heartbeat = FTClient(server.address, name="heartbeat")
            offsets = [0] * PARTITIONS
            previous: list[dict[str, object] | None] = [None]

            def micro_batch() -> None:
                hi = _status(driver).replay_cursor_of([SOURCE])
                ends = {str(p): offsets[p] + per_partition for p in range(PARTITIONS)}
                end = {"kafka": {TOPIC: ends}, "replay": hi}
                driver.register_ranges(
                    [
                        (SOURCE, TOPIC, p, offsets[p], offsets[p] + per_partition)
                        for p in range(PARTITIONS)
                    ]
                )
                driver.checkpoint(
                    begin=True, query="q", position=end, sources=[SOURCE], complete=previous[0]
                )
                heartbeat.heartbeat([SOURCE], 30.0)
                if PAUSE_S:
                    time.sleep(PAUSE_S)
                for p in range(PARTITIONS):
                    offsets[p] += per_partition
                previous[0] = end

            for _ in range(10):
                micro_batch()
            time.sleep(1)
            status = driver.status()
            costs, commits = status.requests, status.store_commits
            began, started, written = user_sys(pid), time.perf_counter(), _write_bytes(pid)
            for _ in range(BATCHES):
                micro_batch()
            wall = time.perf_counter() - started
            time.sleep(1)
            ended, wrote = user_sys(pid), _write_bytes(pid) - written
            user, system = ended[0] - began[0], ended[1] - began[1]
            used = user + system
            status = driver.status()
            n = BATCHES * PER_BATCH
            print(
                f"barrier, reference, {PER_BATCH:,}-record batches, "
                f"{'brief' if BRIEF else 'full'} STATUS: server CPU {used / n * 1e6:.3f} µs "
                f"per record, {used / BATCHES * 1e3:.2f} ms per batch (user "
                f"{user / n * 1e6:.3f}, system {system / n * 1e6:.3f} µs per record); wall "
                f"{wall / BATCHES * 1e3:.2f} ms per batch; written {wrote / BATCHES:,.0f} "
                f"bytes per batch, {wrote / n:.2f} per record; store commits per batch "
                f"{(status.store_commits - commits) / BATCHES:.2f}"
            )
            print_requests(costs, status.requests, BATCHES, n)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
