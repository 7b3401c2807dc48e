"""CPU per record of a real `ftlayer serve` under the fast bench's persist traffic,
without Spark: two client threads (each its own connection, as two task slots) persist
200,000-record micro-batches of 4 partitions in pieces of PIECE records (40-byte
values, one in ten short, encoded as the ftkafka reader does), with a CHECKPOINT_BEGIN
per micro-batch that completes the one before (what ftkafka sends); in tree mode each
piece's ids are XOR-ed back at once (a sink's acks). The server's CPU (user + system,
from /proc, a second after the last batch so its deferred deletes are in) over
BATCHES micro-batches after three of warm-up, per record. PERF=1 records the server
with `perf record -g` into /tmp/server-persist.perf meanwhile.

    .venv/bin/python scripts/server_persist_cpu.py [barrier|tree] [BATCHES]
"""

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from ftlayer.acking.handlers import Persister
from ftlayer.client import FTClient
from ftlayer.integration.harness.ftprocess import FTServerProcess
from ftlayer.payloads import encode_payload_columns
from ftlayer.registration import SourceRegistration

MODE = sys.argv[1] if len(sys.argv) > 1 else "barrier"
BATCHES = int(sys.argv[2]) if len(sys.argv) > 2 else 10
PIECE = int(os.environ.get("PIECE", "10000"))
PER_BATCH, PARTITIONS, SOURCE = 200_000, 4, 11
TICK = os.sysconf("SC_CLK_TCK")


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def main() -> None:
    values = [b"%08d|" % i + (b"x" * 31 if i % 10 else b"") for i in range(PIECE)]
    columns = encode_payload_columns(
        pa.nulls(PIECE, pa.binary()), pa.array(values, pa.binary()), np.zeros(PIECE, np.int64)
    )
    no_keys = np.zeros(PIECE, np.int64), np.zeros(PIECE, np.bool_)
    per_partition = PER_BATCH // PARTITIONS
    with tempfile.TemporaryDirectory() as tmp:
        server = FTServerProcess(Path(tmp) / "data", "--tree-timeout-s", "120").start()
        try:
            pid = server.pid
            assert pid is not None
            driver = FTClient(server.address, name="driver")
            driver.register_source(
                SourceRegistration(SOURCE, "forward", PARTITIONS, completion=MODE)
            )
            clients = [FTClient(server.address, name=f"task-{i}") for i in range(2)]
            offsets = [0] * PARTITIONS
            previous: list[dict[str, object] | None] = [None]

            def task(client: FTClient, partitions: list[int]) -> None:
                persister = Persister(client, source_id=SOURCE, barrier=MODE == "barrier")
                for p in partitions:
                    for k in range(0, per_partition, PIECE):
                        first = offsets[p] + k
                        anchors = persister.persist(
                            columns,
                            topics="t",
                            partitions=p,
                            offsets=np.arange(first, first + PIECE, dtype=np.int64),
                            key_hashes=no_keys[0],
                            has_key=no_keys[1],
                        )
                        if MODE == "tree":
                            client.xor(anchors.roots, anchors.ids)

            def micro_batch() -> None:
                ends = {str(p): offsets[p] + per_partition for p in range(PARTITIONS)}
                end = {"kafka": {"t": ends}, "replay": 0}
                driver.checkpoint(
                    begin=True, query="q", position=end, sources=[SOURCE], complete=previous[0]
                )
                threads = [
                    threading.Thread(target=task, args=(clients[i], [2 * i, 2 * i + 1]))
                    for i in range(2)
                ]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                for p in range(PARTITIONS):
                    offsets[p] += per_partition
                previous[0] = end

            for _ in range(3):
                micro_batch()
            perf = None
            if os.environ.get("PERF"):
                perf = subprocess.Popen(
                    ["perf", "record", "-F", "2000", "-g", "-p", str(pid), "-o",
                     "/tmp/server-persist.perf"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )  # fmt: skip
                time.sleep(1)
            time.sleep(1)
            began, started = _cpu(pid), time.perf_counter()
            for _ in range(BATCHES):
                micro_batch()
            ends = {str(p): offsets[p] for p in range(PARTITIONS)}
            driver.checkpoint(
                begin=True,
                query="q",
                position={"kafka": {"t": ends}, "replay": 0},
                sources=[SOURCE],
                complete=previous[0],
            )
            wall = time.perf_counter() - started
            time.sleep(1)
            used = _cpu(pid) - began
            if perf is not None:
                perf.send_signal(2)
                perf.wait()
            n = BATCHES * PER_BATCH
            print(
                f"{MODE}, pieces of {PIECE}: server CPU {used / n * 1e6:.3f} µs per record, "
                f"wall {wall / n * 1e6:.3f} µs per record, pending {driver.status()['pending']}"
            )
        finally:
            server.stop()


if __name__ == "__main__":
    main()
