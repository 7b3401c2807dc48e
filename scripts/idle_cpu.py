"""The CPU an idle ftkafka query costs, per process: a query (ftkafka -> map_batches ->
ft_foreach_batch, processingTime 0) reads 1,000 records, then nothing comes for IDLE_S
seconds, over which each process's CPU (from /proc) is measured, as a share of one
core. MODE: barrier (the default), tree or off; extra source options as NAME=VALUE.

    .venv/bin/python scripts/idle_cpu.py [IDLE_S] [MODE] [NAME=VALUE ...]
"""

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from proc_cpu import processes

from ftlayer.integration.ftcolumns import FTSettings
from ftlayer.integration.harness.broker import TansuBroker
from ftlayer.integration.harness.ftprocess import FTServerProcess
from ftlayer.integration.harness.kafka import create_topic, produce
from ftlayer.integration.sinks import ft_foreach_batch
from ftlayer.integration.source import register
from ftlayer.integration.spark import local_spark
from ftlayer.integration.tasks import FTTasks

IDLE_S = float(sys.argv[1]) if len(sys.argv) > 1 else 10.0
MODE = sys.argv[2] if len(sys.argv) > 2 else "barrier"
EXTRA = dict(arg.split("=", 1) for arg in sys.argv[3:])


def _values(batch: Any) -> Any:
    import pyarrow as pa

    return pa.RecordBatch.from_arrays([batch.column("value")], names=["value"])


def _cpu_by_process() -> dict[int, tuple[float, str]]:
    return {pid: (p.own_s, p.cmdline[:90]) for pid, p in processes().items()}


def main() -> None:
    with (
        tempfile.TemporaryDirectory() as tmp,
        TansuBroker(log_path=Path(tmp) / "broker.log") as broker,
    ):
        create_topic(broker.bootstrap, "t", 4)
        produce(broker.bootstrap, "t", ((None, b"v%d" % i) for i in range(1000)), timeout=60)
        with FTServerProcess(Path(tmp) / "ft") as server:
            spark = local_spark(master="local[2,4]", app_name="idle-cpu")
            register(spark)
            ft = MODE != "off"
            settings = FTSettings(server.address) if ft else FTSettings(enabled=False)
            reader = (
                spark.readStream.format("ftkafka")
                .option("kafka.bootstrap.servers", broker.bootstrap)
                .option("subscribe", "t")
                .option("startingOffsets", "earliest")
            )
            if ft:
                reader = reader.option("ft.address", server.address).option("ft.completion", MODE)
            for name, value in EXTRA.items():
                reader = reader.option(name, value)
            counted = [0]

            def count(df: Any, _epoch: int) -> None:
                counted[0] += df.count()

            query = (
                FTTasks(settings)
                .map_batches(reader.load(), _values, "value binary")
                .writeStream.foreachBatch(ft_foreach_batch(count, settings))
                .option("checkpointLocation", str(Path(tmp) / "checkpoint"))
                .trigger(processingTime="0 seconds")
                .start()
            )
            try:
                while counted[0] < 1000:
                    time.sleep(0.2)
                time.sleep(3)  # the last batch's commit and checkpoint
                before, started = _cpu_by_process(), time.monotonic()
                time.sleep(IDLE_S)
                after, elapsed = _cpu_by_process(), time.monotonic() - started
            finally:
                query.stop()
    rows = sorted(
        (
            (seconds - before[pid][0], pid, cmdline)
            for pid, (seconds, cmdline) in after.items()
            if pid in before and seconds - before[pid][0] > 0.005
        ),
        reverse=True,
    )
    print(f"idle {MODE} query, {elapsed:.1f} s, {EXTRA or 'default options'}:")
    for used, pid, cmdline in rows[:6]:
        print(f"{used / elapsed * 100:6.1f}% of a core  {pid} {cmdline}")


if __name__ == "__main__":
    main()
