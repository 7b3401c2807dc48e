"""A streaming job for test_recovery_kills.py: the driver the tests SIGKILL and restart.

``python kill_job.py --bootstrap ... --source-topic ... --sink-topic ... --ft-address ...
--checkpoint DIR --workdir DIR`` runs, on ``local[2,4]``, the pipeline a user writes:

    ftkafka source -> FTTasks.map (value -> b"out-" + value) -> ft_kafka_sink

(with `--ingest-source NAME` instead of `--source-topic`, the source is ftingest: what
receivers stored in the FT layer for source NAME)

on processing-time triggers, with the query's checkpoint in `--checkpoint`. Each output
value is the input value with a prefix, so the test can tell which source record an
output came from. Started again with the same checkpoint directory, the query goes on
from its offset log: Spark runs a batch whose offsets were logged but not committed
again, with the same offsets.

The test starts it in a session of its own (start_new_session=True): killing that
process group with SIGKILL kills this Python driver, its Spark JVM and every PySpark
Python worker at once, which is what "the driver dies" means on one machine. Spark's
scratch files and temporary directories go under `--workdir`, so a killed driver
leaves none in /tmp.

Once the query has started it prints one JSON line: its pid, how many seconds Spark
(`spark_s`) and the query (`started_s`) took to start, and the wall-clock times
(`time.time()`) of its own start (`began_at`), of the SparkSession's (`spark_at`) and
of the query's (`started_at`). Then, for each batch that took in records, one line
`{"batch": ID, "at": T, "rows": N, "duration_ms": {...}}` once its progress is
reported (`at`: the wall-clock time the job saw it; `duration_ms`: Spark's phases of
the trigger). It runs until it is killed; if the query dies, it exits 1 with the
query's exception on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ftlayer.integration.ftcolumns import FTSettings
from ftlayer.integration.sinks import ft_kafka_sink
from ftlayer.integration.source import register
from ftlayer.integration.spark import local_spark
from ftlayer.integration.tasks import FTTasks

MASTER = "local[2,4]"
OUTPUT_PREFIX = b"out-"
OUTPUT_SCHEMA = "key binary, value binary"
PROGRESS_POLL_S = 0.1


def tag(row: dict[str, Any]) -> dict[str, Any]:
    """The user's step: the output names its input (its value, with a prefix)."""
    return {"key": row["key"], "value": OUTPUT_PREFIX + row["value"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--source-topic", default=None)
    # Instead of --source-topic: read the source receivers fill (ftingest).
    parser.add_argument("--ingest-source", default=None)
    parser.add_argument("--sink-topic", required=True)
    parser.add_argument("--ft-address", required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--max-offsets-per-trigger", type=int, default=300)
    parser.add_argument("--trigger-ms", type=int, default=300)
    # The FT layer may be down for a few seconds while the test restarts it: the
    # driver's calls wait this long for it (executors wait 10 s, FTClient's default).
    parser.add_argument("--ft-reconnect-ms", type=int, default=30_000)
    args = parser.parse_args()

    began, began_at = time.monotonic(), time.time()
    workdir = Path(args.workdir)
    scratch = workdir / "spark-local"
    scratch.mkdir(parents=True, exist_ok=True)
    # Spark's JVM and PySpark also make temporary directories of their own, which a
    # SIGKILL leaves behind: keep them in the job's work dir, not in /tmp.
    os.environ["TMPDIR"] = str(scratch)
    java_options = os.environ.get("JAVA_TOOL_OPTIONS", "")  # the suite's class archive
    os.environ["JAVA_TOOL_OPTIONS"] = f"{java_options} -Djava.io.tmpdir={scratch}".strip()
    tempfile.tempdir = None  # read TMPDIR again
    spark = local_spark(
        master=MASTER,
        app_name="ftlayer-kill-job",
        conf={"spark.local.dir": str(scratch)},
        fast_start=True,
    )
    spark_s, spark_at = round(time.monotonic() - began, 1), time.time()
    register(spark)
    settings = FTSettings(args.ft_address)
    tasks = FTTasks(settings)
    if args.ingest_source is None:
        reader = (
            spark.readStream.format("ftkafka")
            .option("kafka.bootstrap.servers", args.bootstrap)
            .option("subscribe", args.source_topic)
        )
    else:  # what receivers stored (test_ingest_kills.py)
        reader = spark.readStream.format("ftingest").option("subscribe", args.ingest_source)
    source = (
        reader.option("startingOffsets", "earliest")
        .option("maxOffsetsPerTrigger", str(args.max_offsets_per_trigger))
        .option("ft.address", args.ft_address)
        .option("ft.reconnectTimeoutMs", str(args.ft_reconnect_ms))
        .load()
    )
    tagged = tasks.map(source, tag, OUTPUT_SCHEMA)
    query = (
        tagged.writeStream.foreachBatch(ft_kafka_sink(args.bootstrap, args.sink_topic, settings))
        .option("checkpointLocation", args.checkpoint)
        .trigger(processingTime=f"{args.trigger_ms} milliseconds")
        .start()
    )
    started_s = round(time.monotonic() - began, 1)
    started = {"pid": os.getpid(), "spark_s": spark_s, "started_s": started_s}
    started |= {"began_at": began_at, "spark_at": spark_at, "started_at": time.time()}
    print(json.dumps(started), flush=True)
    reported: set[int] = set()
    try:
        # awaitTermination raises StreamingQueryException if the query failed.
        # A batch's progress stays the last one until the next batch ends, hundreds of
        # milliseconds later at least: polling every PROGRESS_POLL_S sees every batch.
        while not query.awaitTermination(PROGRESS_POLL_S):
            progress = query.lastProgress
            if progress and progress["numInputRows"] and progress["batchId"] not in reported:
                reported.add(progress["batchId"])
                line = {"batch": progress["batchId"], "at": time.time()}
                line |= {"rows": progress["numInputRows"], "duration_ms": progress["durationMs"]}
                print(json.dumps(line), flush=True)
    except Exception as exc:
        print(f"the streaming query failed: {exc}", file=sys.stderr, flush=True)
        return 1
    print("the query stopped by itself", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
