"""Where the FT task wrappers and the sink's ack spend their time per record, in process
(docs/benchmarks.md, "Where FT on spends its time at full speed"): the bench's
vectorized pipeline (benchfast: map_batches -> filter_batches -> the tree-mode sink's
ack) run on Arrow batches shaped as Spark hands them to a Python worker (10,000 rows
each, the source's columns), FT off / barrier / tree, against a real `ftlayer serve`.
The source records are persisted first (timed apart) so that tree-mode events land on
pending roots as in a real run. Per step: µs per record of this process, and of the
server's CPU (/proc, 10 ms ticks: 0.05 µs per record at 200,000), medians of ROUNDS
alternating rounds. Barrier holds are never released here, so the server's figures
leave out barrier mode's deletes.

    .venv/bin/python scripts/profile_tasks.py [ROUNDS] [RECORDS]
"""

import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
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
from ftlayer.integration.tasks import _with_ft_fields
from ftlayer.integration.tasks.results import Failures, run_batch_fn, run_batch_predicate
from ftlayer.integration.tasks.runners import filter_partition, map_partition
from ftlayer.payloads import encode_payloads
from ftlayer.registration import SourceRegistration

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
RECORDS = int(sys.argv[2]) if len(sys.argv) > 2 else 200_000
ARROW_BATCH = 10_000  # spark.sql.execution.arrow.maxRecordsPerBatch
PAYLOAD = StructType([StructField("value", BinaryType()), StructField("size", IntegerType())])
PAYLOAD_ARROW = to_arrow_schema(PAYLOAD, timezone="UTC")


class Server:
    """The FT-layer server process: its address and CPU seconds so far."""

    def __init__(self, process: FTServerProcess) -> None:
        self.address = process.address
        self.pid = process.pid

    def cpu(self) -> float:
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def applied(self) -> None:
        """Returns once the server applied what was sent before (a STATUS round trip,
        then a moment for the deferred work)."""
        with FTClient(self.address) as client:
            client.status()
        time.sleep(0.2)


def source_batches(mode: str, persister: Persister | None) -> list[Any]:
    ft = mode != "off"
    struct = source_schema(ft, completion=mode if ft else "tree")
    schema = to_arrow_schema(struct, timezone="UTC")
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
            anchors = persister.persist(
                payloads, topics="bench-fast", partitions=0, offsets=offsets
            )
            columns.append(pa.array(to_signed(anchors.roots)))
            if len(schema) > len(columns):  # tree mode's ft_id (barrier rows carry ft_root)
                columns.append(pa.array(to_signed(anchors.ids)))
        batches.append(pa.RecordBatch.from_arrays(columns, schema=schema))
    return batches


def steps(settings: FTSettings, mode: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The map_batches and filter_batches partition functions of the bench."""
    ft = mode != "off"
    struct = _with_ft_fields(PAYLOAD, False, like=source_schema(True, completion=mode))
    out_schema = to_arrow_schema(struct if ft else PAYLOAD, timezone="UTC")

    def measure(payload: Any, failures: Failures) -> Any:
        return run_batch_fn(_measure, payload, PAYLOAD_ARROW, "fail-record", failures)

    def keep(payload: Any, failures: Failures) -> Any:
        return run_batch_predicate(_long, payload, "fail-record", failures)

    mapper = map_partition(settings, measure, out_schema, False, "map_batches")
    return mapper, filter_partition(settings, keep, "filter_batches")


def main() -> None:
    own: dict[str, dict[str, list[float]]] = {}
    server_cpu: dict[str, dict[str, list[float]]] = {}
    with (
        tempfile.TemporaryDirectory() as tmp,
        FTServerProcess(Path(tmp) / "ft", "--tree-timeout-s", "600") as process,
    ):
        server = Server(process)
        source_id = 0
        for _ in range(ROUNDS):
            for mode in ("off", "barrier", "tree"):
                ft = mode != "off"
                settings = FTSettings(server.address) if ft else FTSettings(enabled=False)

                def timed(
                    step: str,
                    run: Callable[[Iterator[Any]], Any],
                    batches: list[Any],
                    mode: str = mode,
                ) -> list[Any]:
                    cpu, started = server.cpu(), time.perf_counter()
                    out = list(run(iter(batches)))
                    elapsed = time.perf_counter() - started
                    if mode != "off":
                        server.applied()
                    own.setdefault(mode, {}).setdefault(step, []).append(elapsed / RECORDS * 1e6)
                    server_cpu.setdefault(mode, {}).setdefault(step, []).append(
                        (server.cpu() - cpu) / RECORDS * 1e6
                    )
                    return out

                persister = None
                if ft:
                    source_id += 1
                    with FTClient(server.address) as client:
                        client.register_source(
                            SourceRegistration(source_id, "forward", 1, completion=mode)
                        )
                    persister = Persister(
                        settings.channel(), source_id=source_id, barrier=mode == "barrier"
                    )
                read = lambda _, m=mode, p=persister: source_batches(m, p)  # noqa: E731
                batches = timed("persist", read, [])
                mapper, keep = steps(settings, mode)
                kept = timed("filter_batches", keep, timed("map_batches", mapper, batches))
                if mode == "tree":
                    ft_only = [b.select(["ft_root", "ft_id"]) for b in kept]
                    ack = lambda b, s=settings: [settle_batches(b, s, ack=True)]  # noqa: E731
                    timed("sink ack", ack, ft_only)
                    deadline = time.monotonic() + 60
                    with FTClient(server.address) as client:
                        while client.status()["pending"] and time.monotonic() < deadline:
                            time.sleep(0.05)
    print(f"µs per record, medians of {ROUNDS} rounds of {RECORDS} records")
    for title, figures in (("this process", own), ("the FT-layer server's CPU", server_cpu)):
        print(title)
        for mode, row in figures.items():
            print(f"  {mode:8}", {k: round(statistics.median(v), 3) for k, v in row.items()})


if __name__ == "__main__":
    main()
