"""Where the FT task wrappers and the sink's ack spend their time per record, in process
(docs/architecture.md, "Where FT on spends its time at full speed"): the bench's
vectorized pipeline (benchfast: map_batches -> filter_batches -> the sink's ack) run on
Arrow batches shaped as Spark hands them to a Python worker (10,000 rows each, the
source's columns), FT off / barrier / tree, against a real `ftlayer serve`. The source
records are persisted first (not timed) so that tree-mode XOR events land on pending
roots as in a real run. Per step µs per record, medians of ROUNDS alternating rounds.

    .venv/bin/python scripts/profile_tasks.py [ROUNDS] [RECORDS]
"""

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import BinaryType, IntegerType, StructField, StructType

from ftlayer.acking.handlers import Persister
from ftlayer.client import FTClient
from ftlayer.integration.ftcolumns import FTSettings, to_signed
from ftlayer.integration.harness.benchfast import _long, _measure, _value
from ftlayer.integration.harness.ftprocess import FTServerProcess
from ftlayer.integration.sinks import settle_batches
from ftlayer.integration.source import source_schema
from ftlayer.integration.source.payloads import encode_payloads
from ftlayer.integration.tasks import FTTasks
from ftlayer.integration.tasks.results import run_batch_fn, run_batch_predicate
from ftlayer.integration.tasks.runners import filter_partition, map_partition

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
RECORDS = int(sys.argv[2]) if len(sys.argv) > 2 else 200_000
ARROW_BATCH = 10_000  # spark.sql.execution.arrow.maxRecordsPerBatch
PAYLOAD = StructType([StructField("value", BinaryType()), StructField("size", IntegerType())])


def source_batches(mode: str, persister: Persister | None) -> list[Any]:
    ft = mode != "off"
    schema = to_arrow_schema(source_schema(ft, completion=mode if ft else "tree"), timezone="UTC")
    batches = []
    for lo in range(0, RECORDS, ARROW_BATCH):
        n = min(ARROW_BATCH, RECORDS - lo)
        values = [_value(i) for i in range(lo, lo + n)]
        offsets = np.arange(lo, lo + n, dtype=np.int64)
        columns = [
            pa.nulls(n, pa.binary()),
            pa.array(values, type=pa.binary()),
            pa.array(["bench-fast"] * n, type=pa.string()),
            pa.array(np.zeros(n, np.int32)),
            pa.array(offsets),
            pa.array(offsets * 1000, type=pa.timestamp("us", tz="UTC")),
        ]
        if persister is not None:
            payloads = encode_payloads([None] * n, values, offsets)
            anchors = persister.persist(payloads, topics="bench-fast", partitions=0, offsets=offsets)
            columns += [pa.array(to_signed(anchors.roots)), pa.array(to_signed(anchors.ids))]
        batches.append(pa.RecordBatch.from_arrays(columns, schema=schema))
    return batches


def out_schema(ft: bool, mode: str) -> StructType:
    struct = PAYLOAD
    if ft:
        from ftlayer.integration.tasks import _with_ft_fields

        src = source_schema(True, completion=mode)
        struct = _with_ft_fields(struct, False, like=src)
    return struct


SERVER: list[int] = []
SERVER_CPU: dict[str, dict[str, list[float]]] = {}


def server_cpu() -> float:
    """CPU seconds of the FT-layer server process so far."""
    with open(f"/proc/{SERVER[0]}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed(fn: Any, batches: list[Any], mode: str = "", step: str = "") -> tuple[list[Any], float]:
    """Runs one step over the batches; with FT on, the server's CPU for its events too
    (the channel flushed, then a STATUS round trip so the server applied them)."""
    cpu = server_cpu()
    started = time.perf_counter()
    out = list(fn(iter(batches)))
    elapsed = time.perf_counter() - started
    if mode != "off":
        from ftlayer.integration.ftcolumns import FTSettings as _S  # noqa: F401

        with FTClient(ADDRESS[0]) as client:
            client.status()
        time.sleep(0.2)
    SERVER_CPU.setdefault(mode, {}).setdefault(step, []).append(
        (server_cpu() - cpu) / RECORDS * 1e6
    )
    return out, elapsed


ADDRESS: list[str] = []


def main() -> None:
    figures: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp, FTServerProcess(Path(tmp) / "ft", "--timeout-s", "600") as server:
        SERVER.append(server.pid)
        ADDRESS.append(server.address)
        for _ in range(ROUNDS):
            for mode in ("off", "barrier", "tree"):
                ft = mode != "off"
                settings = FTSettings(server.address) if ft else FTSettings(enabled=False)
                persister = None
                if ft:
                    channel = settings.channel()
                    with FTClient(server.address) as client:
                        client.register_source(1, "forward", 1, completion=mode)
                    persister = Persister(channel, source_id=1, barrier=mode == "barrier")
                cpu = server_cpu()
                batches = source_batches(mode, persister)
                SERVER_CPU.setdefault(mode, {}).setdefault("persist", []).append(
                    (server_cpu() - cpu) / RECORDS * 1e6
                )
                from ftlayer.integration.tasks.results import Failures

                schema_out = to_arrow_schema(out_schema(ft, mode), timezone="UTC")
                payload_schema = to_arrow_schema(PAYLOAD, timezone="UTC")
                mapper = map_partition(
                    settings,
                    lambda p, f: run_batch_fn(_measure, p, payload_schema, "fail-record", f),
                    schema_out,
                    False,
                    "map_batches",
                )
                filt = filter_partition(
                    settings,
                    lambda p, f: run_batch_predicate(_long, p, "fail-record", f),
                    "filter_batches",
                )
                mapped, t_map = timed(mapper, batches, mode, "map_batches")
                kept, t_filter = timed(filt, mapped, mode, "filter_batches")
                row = figures.setdefault(mode, {})
                row.setdefault("map_batches", []).append(t_map / RECORDS * 1e6)
                row.setdefault("filter_batches", []).append(t_filter / RECORDS * 1e6)
                if mode == "tree":
                    ft_only = [b.select(["ft_root", "ft_id"]) for b in kept]
                    _, t_ack = timed(lambda b: [settle_batches(b, settings, ack=True)], ft_only, mode, "sink ack")
                    row.setdefault("sink ack", []).append(t_ack / RECORDS * 1e6)
                if ft:
                    settings.channel().flush()
                    deadline = time.monotonic() + 60
                    with FTClient(server.address) as client:
                        while mode == "tree" and client.status()["pending"] and time.monotonic() < deadline:
                            time.sleep(0.05)
        print("µs per record (median of %d rounds, %d records)" % (ROUNDS, RECORDS))
        for mode, row in figures.items():
            print(mode, {k: round(statistics.median(v), 3) for k, v in row.items()})
        print("the FT-layer server's CPU, µs per record")
        for mode, row in SERVER_CPU.items():
            print(mode, {k: round(statistics.median(v), 3) for k, v in row.items()})
        with FTClient(server.address) as client:
            status = client.status()
            print("pending", status["pending"], "completed", status.get("completed"))


if __name__ == "__main__":
    main()
