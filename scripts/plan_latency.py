"""The ftkafka driver's planning of a barrier-mode batch, timed: a real Tansu broker, a
real `ftlayer serve` process and the ftkafka stream reader's own calls (no Spark), as
Spark makes them per micro-batch: latestOffset (its brief STATUS), commit of the batch
before, partitions (the batch's ranges, its barrier with the completion of the batch
before, its replays: BATCH_BEGIN), the rows read, and 1% of them failed by range root
as a task's wrapper does. Per batch: the wall time of
latestOffset and of commit and partitions (the trigger's path before the first task starts), the
requests the driver sent, and the server process's CPU.

    .venv/bin/python scripts/plan_latency.py [BATCHES] [RECORDS_PER_BATCH] [PAUSE_MS]

PAUSE_MS (default 0): a sleep between batches, as a batch's run leaves between them.
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from pyspark.sql.datasource import ReadAllAvailable

from ftlayer.causes import Cause, FailKind
from ftlayer.client import FTClient
from ftlayer.integration.ftcolumns import ROOT_COLUMN
from ftlayer.integration.harness.benchcost import usage
from ftlayer.integration.harness.broker import TansuBroker
from ftlayer.integration.harness.ftprocess import FTServerProcess
from ftlayer.integration.harness.kafka import create_topic, produce
from ftlayer.integration.source import FTKafkaStreamReader, parse_options, source_schema

BATCHES = int(sys.argv[1]) if len(sys.argv) > 1 else 40
PER_BATCH = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
PAUSE_S = float(sys.argv[3]) / 1000 if len(sys.argv) > 3 else 0.0
PARTITIONS = 4
FAILED = Cause(FailKind.EXPLICIT, "map", "FailException: plan_latency")


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="ftlayer-plan-latency-"))
    with TansuBroker() as broker, FTServerProcess(work / "ft") as server:
        create_topic(broker.bootstrap, "plan", PARTITIONS)
        options = parse_options(
            {
                "kafka.bootstrap.servers": broker.bootstrap,
                "subscribe": "plan",
                "ft.address": server.address,
                "ft.retryBackoffMs": "0",
            }
        )
        reader = FTKafkaStreamReader(options, source_schema(True, completion="barrier"))
        client = FTClient(server.address)
        rng = np.random.default_rng(7)
        latest_ms: list[float] = []
        plan_ms: list[float] = []
        start = reader.initialOffset()
        try:
            for batch in range(BATCHES + 2):
                values = [(b"k%d" % i, b"v-%d-%d" % (batch, i)) for i in range(PER_BATCH)]
                produce(broker.bootstrap, "plan", values)
                time.sleep(PAUSE_S)
                if batch == 2:  # two batches of warm-up
                    cpu_before, sent = usage(server.pid).cpu_s, server_requests(client)
                began = time.perf_counter()
                end = reader.latestOffset(start, ReadAllAvailable())
                planned = time.perf_counter()
                if batch:  # Spark commits the batch before once it logged this one's end
                    reader.commit(start)
                parts = reader.partitions(start, end)
                done = time.perf_counter()
                roots = np.concatenate(
                    [
                        rows.column(ROOT_COLUMN).to_numpy().astype(np.uint64)
                        for part in parts
                        for rows in reader.read(part)
                    ]
                    or [np.zeros(0, np.uint64)]
                )
                failing = roots[rng.random(len(roots)) < 0.01]
                if len(failing):
                    client.fail(failing, FAILED)
                start = end
                if batch >= 2:
                    latest_ms.append((planned - began) * 1000)
                    plan_ms.append((done - planned) * 1000)
            cpu_ms = (usage(server.pid).cpu_s - cpu_before) * 1000 / BATCHES
            served = server_requests(client)
            requests = {
                k: ((n - sent.get(k, (0, 0.0))[0]) / BATCHES, (c - sent.get(k, (0, 0.0))[1]))
                for k, (n, c) in served.items()
            }
            n, c = requests["STATUS"]
            requests["STATUS"] = (n - 1 / BATCHES, c)  # the count's own, before
        finally:
            reader.stop()
            client.close()
    print(
        f"{BATCHES} batches of {PER_BATCH} records, {PAUSE_S * 1000:g} ms apart: "
        f"latestOffset {statistics.median(latest_ms):.2f} ms, "
        f"partitions {statistics.median(plan_ms):.2f} ms (medians), "
        f"server CPU {cpu_ms:.2f} ms a batch; requests a batch (their handlers' CPU, ms "
        "each): "
        + ", ".join(
            f"{k} {n:.2f} ({c * 1000 / (n * BATCHES):.2f})"
            for k, (n, c) in sorted(requests.items())
            if n > 0
        )
    )


def server_requests(client: FTClient) -> dict[str, tuple[int, float]]:
    """The requests the server served so far and their handlers' CPU seconds, by kind
    (its STATUS's counts, this STATUS not included)."""
    return {kind: (cost.count, cost.cpu_s) for kind, cost in client.status().requests.items()}


if __name__ == "__main__":
    main()
