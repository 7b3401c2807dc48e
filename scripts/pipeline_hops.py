"""What each Spark hop of a vectorized pipeline costs with FT off (docs/benchmarks/
profile.md): the bench's 400,000 records in 200,000-record micro-batches read by the
ftkafka source (FT off) and counted by ft_foreach_batch, through five shapes: the
source alone, a plain select, one FTTasks.map_batches, map_batches then filter_batches
as separate mapInArrow steps, and both in one mapInArrow; a bare kafka-python consumer
in the same rounds. Medians of ROUNDS alternating rounds, Spark's triggerExecution.

    .venv/bin/python scripts/pipeline_hops.py [ROUNDS]
"""

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

import ftlayer.integration.harness.benchfast as bf
from ftlayer.integration.ftcolumns import FTSettings
from ftlayer.integration.harness.broker import TansuBroker
from ftlayer.integration.harness.demo import stop_when_idle
from ftlayer.integration.harness.kafka import create_topic, produce
from ftlayer.integration.sinks import ft_foreach_batch
from ftlayer.integration.source import register
from ftlayer.integration.spark import local_spark
from ftlayer.integration.tasks import FTTasks

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 2
RECORDS, BATCH = 400_000, 200_000


def fused(batches):
    for b in batches:
        v = b.column("value")
        s = pc.binary_length(v)
        out = pa.RecordBatch.from_arrays([v, s], names=["value", "size"])
        yield out.filter(pc.greater(s, 20))


with tempfile.TemporaryDirectory() as tmp, TansuBroker(log_path=Path(tmp) / "b.log") as broker:
    bs, topic = broker.bootstrap, "t"
    create_topic(bs, topic, 4)
    produce(bs, topic, ((None, bf._value(i)) for i in range(RECORDS)), timeout=600)
    spark = local_spark(master="local[2,64]", app_name="hops")
    register(spark)
    settings = FTSettings(enabled=False)
    tasks = FTTasks(settings, on_error="fail-task", fuse=False)
    n = [0]

    def run(shape):
        n[0] += 1
        df = (
            spark.readStream.format("ftkafka")
            .option("kafka.bootstrap.servers", bs)
            .option("subscribe", topic)
            .option("startingOffsets", "earliest")
            .option("maxOffsetsPerTrigger", str(BATCH))
            .option("ft.sourceName", f"h{n[0]}")
            .load()
        )
        exp = RECORDS
        if shape == "map":
            df = tasks.map_batches(df, bf._measure, "value binary, size int")
        elif shape in ("map+filter",):
            df = tasks.filter_batches(
                tasks.map_batches(df, bf._measure, "value binary, size int"), bf._long
            )
            exp = bf._expected(RECORDS)
        elif shape == "fused":
            df = df.mapInArrow(fused, "value binary, size int")
            exp = bf._expected(RECORDS)
        elif shape == "select":
            df = df.select("value")
        counted = [0]

        def count(d, e):
            counted[0] += d.count()

        q = (
            df.writeStream.foreachBatch(ft_foreach_batch(count, settings))
            .option("checkpointLocation", f"{tmp}/cp{n[0]}")
            .trigger(processingTime="0 seconds")
            .start()
        )
        while counted[0] < exp:
            if q.exception():
                raise RuntimeError(q.exception())
            time.sleep(0.02)
        s = bf._processing_s(q, RECORDS)
        ph = {}
        for p in q.recentProgress:
            d = json.loads(p.json)
            if d.get("numInputRows", 0) > 0:
                for k, v in d["durationMs"].items():
                    ph[k] = ph.get(k, 0) + v
        stop_when_idle(q)
        return s, ph

    run("map+filter")
    shapes = ["source", "select", "map", "map+filter", "fused"]
    res = {s: [] for s in shapes}
    cons = []
    for _ in range(ROUNDS):
        cons.append(bf._bare_consumer(bs, topic, 4, RECORDS))
        for s in shapes:
            sec, ph = run(s)
            res[s].append(sec)
            print(
                s,
                round(sec, 2),
                {k: ph[k] for k in ("addBatch", "latestOffset", "commitOffsets", "walCommit")},
                flush=True,
            )
    c = statistics.median(cons)
    print("consumer", [round(x, 2) for x in cons])
    for s in shapes:
        m = statistics.median(res[s])
        print(f"{s:12} {m:.2f} s  off/consumer {c / m:.3f}")
