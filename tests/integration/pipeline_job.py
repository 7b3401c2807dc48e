"""The demo's pipeline on `local-cluster[2,1,1024]`, as a script run in its own process.

A JVM hosts one SparkContext, and the test session's already runs on local[2,4], so a
test runs this job as ``python pipeline_job.py --bootstrap ... --ft-address ...``. It
starts Spark with two executor JVMs (each with its own Python workers), waits until both
have registered, runs ftkafka source -> parse -> flaky enrich -> filter -> Kafka sink
(the demo's user code) on processing-time triggers until every produced record was read
and the FT layer holds no pending tree; then reads the topic again in tree mode into an
`ft_foreach_batch` sink whose acks the steps hold (`held_sink_run`); and prints one JSON
object last: the executors Spark had, the driver's JVM pid, the seconds each phase took
and what the second query wrote. Each output value names
the executor JVM whose Python worker enriched it (`jvm`), so the test can tell where the
work ran.

`wait_settled` is shared with test_pipeline.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from pyspark.find_spark_home import _find_spark_home

from ftlayer.client import FTClient
from ftlayer.integration.ftcolumns import FTSettings
from ftlayer.integration.harness.demo import (
    ENRICHED_SCHEMA,
    PARSED_SCHEMA,
    keep,
    make_enrich,
    parse,
)
from ftlayer.integration.harness.kafka import wait_progressing, wait_until
from ftlayer.integration.sinks import ft_foreach_batch, ft_kafka_sink
from ftlayer.integration.source import register
from ftlayer.integration.spark import local_spark
from ftlayer.integration.tasks import FTTasks

CLUSTER = "local-cluster[2,1,1024]"


def records_read(query: Any, topic: str) -> int:
    """Kafka records of `topic` the query has taken into finished batches."""
    progress = query.lastProgress
    if not progress:
        return 0
    total = 0
    for source in progress["sources"]:
        end = source["endOffset"]
        if isinstance(end, str):
            end = json.loads(end)
        total += sum(int(o) for o in end.get("kafka", {}).get(topic, {}).values())
    return total


def wait_settled(
    query: Any, address: str, topic: str, produced: int, timeout: float
) -> dict[str, Any]:
    """Wait until the query has read all `produced` records of `topic`, the FT layer
    holds no pending tree (a failed root waiting for its replay is pending) and no batch
    is running; returns the FT layer's status. Raises at once if the query died.

    Stopping a query amid a foreachBatch call can make Spark's stream thread die of a
    StackOverflowError (its regex for interruptions recurses over the long Python
    traceback): hence the wait for an idle trigger."""
    return wait_settled_shards(query, [address], topic, produced, timeout)[0]


def wait_settled_shards(
    query: Any, addresses: list[str], topic: str, produced: int, timeout: float
) -> list[dict[str, Any]]:
    """`wait_settled` over the shards of an FT layer (in shard order): no shard holds
    a pending tree; returns each shard's status."""
    with contextlib.ExitStack() as stack:
        clients = [stack.enter_context(FTClient(a, name="test-pipeline")) for a in addresses]

        def settled() -> bool:
            if not query.isActive:
                raise AssertionError(f"the streaming query stopped: {query.exception()}")
            if records_read(query, topic) < produced or query.status["isTriggerActive"]:
                return False
            return all(client.status()["pending"] == 0 for client in clients)

        def progress() -> tuple[int, list[tuple[int, int]]]:
            counts = [client.status() for client in clients]
            return records_read(query, topic), [(c["completed"], c["pending"]) for c in counts]

        # `timeout`: how long the pipeline may make no progress (how long it takes in all
        # depends on the machine and its load).
        what = "every record read and every tree complete"
        wait_progressing(settled, progress, timeout, what, interval=0.25)
        return [client.status().to_json() for client in clients]


def executor_jvm() -> int:
    """The pid of the JVM this Python worker serves: its nearest `java` ancestor."""
    pid = os.getpid()
    while pid > 1:
        if Path(f"/proc/{pid}/comm").read_text().strip() == "java":
            return pid
        pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    raise RuntimeError(f"Python worker {os.getpid()} has no java ancestor")


def spark_home_in(workdir: Path) -> Path:
    """A SPARK_HOME of symlinks to pyspark's, under `workdir`. local-cluster's workers
    keep each executor's files and logs in $SPARK_HOME/work, which for a pip install is
    inside site-packages; with this home they stay in the job's work dir."""
    real = Path(_find_spark_home())
    home = workdir / "spark-home"
    home.mkdir(exist_ok=True)
    for entry in real.iterdir():
        if entry.name != "work" and not (home / entry.name).exists():
            (home / entry.name).symlink_to(entry)
    return home


def make_located_enrich(flaky_dir: str, fail_rate: float) -> Any:
    """The demo's flaky enrich, with the executor JVM added to each output value."""
    enrich = make_enrich(flaky_dir, fail_rate)

    def located(row: dict[str, Any]) -> dict[str, Any]:
        out = enrich(row)
        value = {**json.loads(out["value"]), "jvm": executor_jvm()}
        return {**out, "value": json.dumps(value).encode()}

    return located


def ftkafka_source(
    spark: Any, args: argparse.Namespace, options: dict[str, str] | None = None
) -> Any:
    """The job's ftkafka source over --source-topic, FT on, with `options` besides."""
    reader = (
        spark.readStream.format("ftkafka")
        .option("kafka.bootstrap.servers", args.bootstrap)
        .option("subscribe", args.source_topic)
        .option("ft.address", args.ft_address)
    )
    for name, value in (options or {}).items():
        reader = reader.option(name, value)
    return reader.load()


SPARK_START_LIMIT = "Python worker failed to connect back"
"""Spark gives a fresh Python process (its Python data source's planner) a fixed 10 s
to connect back (PythonWorkerFactory.createSimpleWorker); a machine loaded by two
other test runs can take longer. A query that dies of it before its first batch is
started again from its checkpoint, as its supervisor would."""
START_ATTEMPTS = 3


def run_settled(df: Any, sink: Any, checkpoint: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Run `df` into `sink` (foreachBatch) until every source record is settled
    (wait_settled), then stop the query; returns the FT layer's status then."""
    for attempt in range(1, START_ATTEMPTS + 1):
        query = (
            df.writeStream.foreachBatch(sink)
            .option("checkpointLocation", str(checkpoint))
            .trigger(processingTime="500 milliseconds")
            .start()
        )
        try:
            return wait_settled(
                query, args.ft_address, args.source_topic, args.records, args.timeout
            )
        except AssertionError as exc:
            died_starting = query.lastProgress is None and SPARK_START_LIMIT in str(exc)
            if not died_starting or attempt == START_ATTEMPTS:
                raise
            print(f"query start {attempt}: {SPARK_START_LIMIT}; again", file=sys.stderr)
        finally:
            with contextlib.suppress(Exception):
                query.stop()
    raise AssertionError("unreachable")


def held_sink_run(spark: Any, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """The same topic read again in tree mode, parse -> filter -> `ft_foreach_batch` whose
    function counts and then collects its batch (two actions): the sink leaves its acks
    to the steps on the executors (sink holds, integration.sinkhold). Returns the ids it
    wrote, whether it held, and the FT layer's status once settled."""
    settings = FTSettings(args.ft_address)
    tasks = FTTasks(settings)
    source = ftkafka_source(spark, args, {"ft.completion": "tree", "ft.sourceName": "held-sink"})
    kept = tasks.filter(tasks.map(source, parse, PARSED_SCHEMA), keep)
    written: list[int] = []

    def write(batch: Any, _epoch: int) -> None:
        count = batch.count()
        ids = [row["id"] for row in batch.select("id").collect()]
        assert len(ids) == count
        written.extend(ids)

    sink = ft_foreach_batch(write, settings)
    status = run_settled(kept, sink, workdir / "checkpoint-held", args)
    held = sink.last_result is not None and sink.last_result.held
    return {"ids": written, "held": held, "status": status}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--source-topic", required=True)
    parser.add_argument("--sink-topic", required=True)
    parser.add_argument("--ft-address", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--records", type=int, required=True)
    parser.add_argument("--fail-rate", type=float, default=0.01)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()

    began = time.monotonic()
    workdir = Path(args.workdir)
    (workdir / "flaky").mkdir(parents=True, exist_ok=True)
    os.environ["SPARK_HOME"] = str(spark_home_in(workdir))
    spark = local_spark(master=CLUSTER, app_name="ftlayer-local-cluster", fast_start=True)
    jsc = spark.sparkContext._jsc.sc()
    try:
        # The query must not start before both executors can take tasks.
        wait_until(lambda: jsc.getExecutorMemoryStatus().size() == 3, 180, "two executors")
        started = time.monotonic()
        register(spark)
        settings = FTSettings(args.ft_address)
        tasks = FTTasks(settings)
        parsed = tasks.map(ftkafka_source(spark, args), parse, PARSED_SCHEMA)
        enrich = make_located_enrich(str(workdir / "flaky"), args.fail_rate)
        kept = tasks.filter(tasks.map(parsed, enrich, ENRICHED_SCHEMA), keep)
        sink = ft_kafka_sink(args.bootstrap, args.sink_topic, settings)
        status = run_settled(kept, sink, workdir / "checkpoint", args)
        pipeline_s = round(time.monotonic() - started, 1)
        held_sink = held_sink_run(spark, args, workdir)
        result = {
            "executors": jsc.getExecutorMemoryStatus().size() - 1,  # the driver is listed too
            "driver_jvm": int(spark._jvm.ProcessHandle.current().pid()),
            "startup_s": round(started - began, 1),
            "pipeline_s": pipeline_s,
            "status": status,
            "held_sink": held_sink,
        }
    finally:
        spark.stop()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
