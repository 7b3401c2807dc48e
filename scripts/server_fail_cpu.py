"""CPU per record of a real `ftlayer serve` on barrier mode's failure path with
`ft.persist=reference`, without Spark: the requests the fast bench's pipeline sends at
1% failures, in the order the ftkafka source and the task wrappers send them. Per
micro-batch of PER_BATCH records (200,000) over 4 partitions: the driver's brief STATUS (its replay
cursor), its filler's UNFILLED of the last batch's failed records, CHECKPOINT_BEGIN
(the barrier, completing the batch before), BATCH_RANGES, and one FETCH_REPLAY of the
batch's replays for all partitions (the planner's, integration/source/given.py); the
filler's FILL (40-byte values, keys known), after the barrier as in the pipeline, whose
Kafka reads take longer than the trigger's planning; then two task clients (two task
slots) each FAIL FAIL_PCT% of their two partitions' new rows (by range root) in pieces
of PIECE rows, a request per partition. The server's CPU (user +
system, from /proc, a second after the last batch so its deferred deletes are in)
over BATCHES micro-batches after three of warm-up, per record, and per request kind
the requests per batch and their handlers' CPU per record (STATUS `requests`), and the
store's commits per batch.

With BACKOFF_MS (default 0: none) the failed records wait that long before they are
queued: the server's ticker queues them (the fast bench's pipeline waits 500 ms), so
its CPU, and every server thread's, is printed too.

    [PER_BATCH=10000] [FAIL_PCT=1] [PIECE=10000] [BACKOFF_MS=0] \
        .venv/bin/python scripts/server_fail_cpu.py [BATCHES]
"""

import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from proc_cpu import print_requests, user_sys

from ftlayer import rangeroots
from ftlayer.causes import Cause, FailKind
from ftlayer.client import FTClient
from ftlayer.integration.harness.benchcost import thread_usage
from ftlayer.integration.harness.ftprocess import FTServerProcess
from ftlayer.policy import RetryPolicy
from ftlayer.registration import SourceRegistration

BATCHES = int(sys.argv[1]) if len(sys.argv) > 1 else 10
FAIL_PCT = float(os.environ.get("FAIL_PCT", "1"))
PIECE = int(os.environ.get("PIECE", "10000"))  # rows per FAIL request, as a task's events
PER_BATCH = int(os.environ.get("PER_BATCH", "200000"))  # records per micro-batch
BACKOFF_MS = int(os.environ.get("BACKOFF_MS", "0"))  # each failed record's wait
PARTITIONS, SOURCE, TOPIC = 4, 11, "t"
FAILED = Cause(FailKind.EXPLICIT, "map", "FailException: bench")


def main() -> None:
    per_partition = PER_BATCH // PARTITIONS
    rng = np.random.default_rng(7)
    with tempfile.TemporaryDirectory() as tmp:
        server = FTServerProcess(Path(tmp) / "data", "--tree-timeout-s", "120").start()
        try:
            pid = server.pid
            assert pid is not None
            driver = FTClient(server.address, name="driver")
            driver.register_source(
                SourceRegistration(
                    SOURCE,
                    "forward",
                    PARTITIONS,
                    retry=RetryPolicy(3, BACKOFF_MS, BACKOFF_MS),
                    completion="barrier",
                )
            )
            clients = [FTClient(server.address, name=f"task-{i}") for i in range(2)]
            offsets = [0] * PARTITIONS
            previous: list[dict[str, object] | None] = [None]
            listed: list[Any] = [None]
            cursor = [0]

            def task(client: FTClient, parts: list[int], numbers: list[int]):
                for p in parts:
                    chosen = rng.choice(per_partition, int(per_partition * FAIL_PCT / 100), False)
                    roots = rangeroots.encode(numbers[p], offsets[p], offsets[p] + np.sort(chosen))
                    for k in range(0, len(roots), PIECE):
                        client.fail(roots[k : k + PIECE], FAILED)

            def fill() -> None:
                """The filler's copy of the last batch's failed records (UNFILLED came
                before the barrier, FILL comes after it: Kafka's reads take longer)."""
                wanted = listed[0]
                n = len(wanted)
                if n:
                    driver.fill(
                        wanted.seqs,
                        np.ones(n, np.bool_),
                        [b"%039d" % o for o in wanted.records.offsets.tolist()],
                        (wanted.records.offsets.astype(np.int64) * 31, np.ones(n, np.bool_)),
                    )

            def micro_batch() -> None:
                hi = driver.brief_status().replay_cursor_of([SOURCE])  # as the driver asks
                listed[0] = driver.unfilled(SOURCE)  # the filler, behind the trigger
                ends = {str(p): offsets[p] + per_partition for p in range(PARTITIONS)}
                end = {"kafka": {TOPIC: ends}, "replay": hi}
                driver.checkpoint(
                    begin=True, query="q", position=end, sources=[SOURCE], complete=previous[0]
                )
                numbers = driver.register_ranges(
                    [
                        (SOURCE, TOPIC, p, offsets[p], offsets[p] + per_partition)
                        for p in range(PARTITIONS)
                    ]
                )
                if hi > cursor[0]:  # the planner hands the replays to the readers
                    driver.fetch_replay(cursor[0], hi, SOURCE)
                fill()
                threads = [
                    threading.Thread(target=task, args=(clients[i], [2 * i, 2 * i + 1], numbers))
                    for i in range(2)
                ]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                for p in range(PARTITIONS):
                    offsets[p] += per_partition
                previous[0], cursor[0] = end, hi

            for _ in range(3):
                micro_batch()
            time.sleep(1)
            status = driver.status()
            costs, commits = status.requests, status.store_commits
            threads = thread_usage(pid)
            began, started = user_sys(pid), time.perf_counter()
            for _ in range(BATCHES):
                micro_batch()
            wall = time.perf_counter() - started
            time.sleep(1)
            ended = user_sys(pid)
            user, system = ended[0] - began[0], ended[1] - began[1]
            used = user + system
            status = driver.status()
            n = BATCHES * PER_BATCH
            print(
                f"barrier, reference, {FAIL_PCT:g}% failed: server CPU {used / n * 1e6:.3f} µs "
                f"per record (user {user / n * 1e6:.3f}, system {system / n * 1e6:.3f}), wall "
                f"{wall / n * 1e6:.3f} µs per record, store commits per "
                f"batch {(status.store_commits - commits) / BATCHES:.1f}"
            )
            print_requests(costs, status.requests, BATCHES, n)
            after = thread_usage(pid)
            print(
                "  threads (µs per record): "
                + ", ".join(
                    f"{name} {(after[name] - threads.get(name, 0.0)) / n * 1e6:.4f}"
                    for name in sorted(after)
                    if after[name] > threads.get(name, 0.0)
                )
            )
        finally:
            server.stop()


if __name__ == "__main__":
    main()
