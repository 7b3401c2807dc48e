"""Where the CPU of the FT-off vectorized pipeline goes (docs/benchmarks.md, "Where FT
on spends its time at full speed"): `ftlayer bench pipeline --fast`'s pipeline (ftkafka
-> map_batches -> filter_batches -> a counting ft_foreach_batch, 400,000 records of 40
bytes, 200,000 per batch) and, after each run, the bench's bare consumer. Per run: the
summed Spark triggerExecution of the batches, the CPU seconds of every process this one
started but the broker (the JVM and its Python workers), per process too, and the
consumer's wall and CPU seconds. CPU seconds hold up on a busy machine where wall
seconds do not.

    .venv/bin/python scripts/pipeline_cpu.py [RUNS]
"""

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ftlayer.integration.harness.benchfast as bf
from ftlayer.integration.ftcolumns import FTSettings
from ftlayer.integration.harness.broker import TansuBroker
from ftlayer.integration.harness.kafka import create_topic, produce
from ftlayer.integration.sinks import ft_foreach_batch
from ftlayer.integration.source import register
from ftlayer.integration.spark import local_spark
from ftlayer.integration.tasks import FTTasks

N = 400_000
RUNS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
TICK = os.sysconf("SC_CLK_TCK")


def _read(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode(errors="replace")


def cpu_by_process(exclude: set[int]) -> dict[str, float]:
    """CPU seconds so far of this process and of every descendant not in `exclude`."""
    children: dict[int, list[tuple[int, float, str]]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat, cmd = _read(f"/proc/{pid}/stat"), _read(f"/proc/{pid}/cmdline")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        cpu = (int(fields[11]) + int(fields[12])) / TICK
        children.setdefault(int(fields[1]), []).append((int(pid), cpu, cmd.replace("\0", " ")))
    found = {"this process": sum(os.times()[:2])}
    todo = [os.getpid()]
    while todo:
        for pid, cpu, cmd in children.get(todo.pop(), []):
            if pid in exclude:
                continue
            kind = "jvm" if "java" in cmd else cmd.split()[-1] if "pyspark" in cmd else cmd[:40]
            found[f"{kind} #{pid}"] = cpu
            todo.append(pid)
    return found


def spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(v - before.get(k, 0.0), 2) for k, v in after.items()}


with tempfile.TemporaryDirectory() as tmp, TansuBroker(log_path=Path(tmp) / "b.log") as broker:
    create_topic(broker.bootstrap, "t", 4)
    produce(broker.bootstrap, "t", ((None, bf._value(i)) for i in range(N)), timeout=600)
    brokers = {int(p) for p in filter(str.isdigit, os.listdir("/proc"))
               if "tansu" in _read(f"/proc/{p}/cmdline")}  # fmt: skip
    spark = local_spark(master="local[2,64]", app_name="pipeline-cpu")
    register(spark)
    settings = FTSettings(enabled=False)
    tasks = FTTasks(settings, on_error="fail-task")
    for run in range(RUNS):
        df = (
            spark.readStream.format("ftkafka")
            .option("kafka.bootstrap.servers", broker.bootstrap)
            .option("subscribe", "t")
            .option("startingOffsets", "earliest")
            .option("maxOffsetsPerTrigger", "200000")
            .option("ft.sourceName", f"run-{run}")
            .load()
        )
        measured = tasks.map_batches(df, bf._measure, "value binary, size int")
        kept = tasks.filter_batches(measured, bf._long)
        counted = [0]

        def count(batch: Any, _epoch: int, counted: list[int] = counted) -> None:
            counted[0] += batch.count()

        before = cpu_by_process(brokers)
        query = (
            kept.writeStream.foreachBatch(ft_foreach_batch(count, settings))
            .option("checkpointLocation", f"{tmp}/checkpoint-{run}")
            .trigger(processingTime="0 seconds")
            .start()
        )
        while counted[0] < bf._expected(N):
            time.sleep(0.02)
        pipeline = spent(before, cpu_by_process(brokers))
        query.stop()
        progress = [json.loads(p.json) for p in query.recentProgress]
        trigger_s = sum(
            p["durationMs"]["triggerExecution"] for p in progress if p.get("numInputRows", 0)
        ) / 1000  # fmt: skip
        before, started = cpu_by_process(brokers), time.perf_counter()
        bf._bare_consumer(broker.bootstrap, "t", 4, N)
        consumer_wall = time.perf_counter() - started
        consumer = spent(before, cpu_by_process(brokers))
        print(json.dumps({
            "run": run,
            "off_trigger_s": round(trigger_s, 2),
            "off_cpu_s": round(sum(pipeline.values()), 2),
            "off_cpu_by_process": {k: v for k, v in pipeline.items() if v >= 0.05},
            "consumer_wall_s": round(consumer_wall, 2),
            "consumer_cpu_s": round(sum(consumer.values()), 2),
            "off_vs_consumer_by_trigger": round(consumer_wall / trigger_s, 3),
        }), flush=True)  # fmt: skip
    spark.stop()
