"""What the FT columns and the tree-mode sink cost in Spark itself, without Kafka or the
FT layer (docs/benchmarks.md, "Where FT on spends its time at full speed"): the
bench's vectorized pipeline (two mapInArrow steps, then a count) over a cached static
DataFrame shaped like the ftkafka source's rows, in micro-batches of BATCH rows:

- plain: no FT columns (FT off);
- +cols: two more int64 columns carried through both steps (ft_root, ft_id);
- +cols +cache: the same, the batch persisted first (the tree-mode sink's cache);
- +cols +sink: and the tree-mode sink's ack as it was: one more job over the cached
  FT columns running a Python function (mapInArrow, counting), then unpersist;
- +cols +sink driver: the ack as it is now: the cached FT columns by `toArrow()`.

Medians of ROUNDS alternating rounds, µs per record of wall time and of CPU (this
process and its descendants: the JVM and the Python workers).

    .venv/bin/python scripts/spark_costs.py [BATCH] [ROUNDS] [BATCHES]
"""

import os
import statistics
import sys
import time
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import functions as F

from ftlayer.integration.spark import local_spark

BATCH = int(sys.argv[1]) if len(sys.argv) > 1 else 50_000
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 5
BATCHES = int(sys.argv[3]) if len(sys.argv) > 3 else 4
FT = ["ft_root", "ft_id"]


def mapper(cols: bool) -> Any:
    def run(batches: Any) -> Any:
        for b in batches:
            values = b.column("value")
            arrays, names = [values, pc.binary_length(values)], ["value", "size"]
            if cols:
                arrays += [b.column("ft_root"), b.column("ft_id")]
                names += FT
            yield pa.RecordBatch.from_arrays(arrays, names=names)

    return run


def keep(batches: Any) -> Any:
    for b in batches:
        yield b.filter(pc.greater(b.column("size"), 20))


def count_rows(batches: Any) -> Any:
    n = 0
    for b in batches:
        n += b.num_rows
    yield pa.RecordBatch.from_pydict({"rows": [n]})


def tree_cpu() -> float:
    """CPU seconds of this process and its descendants (the JVM, the Python workers)."""
    procs: dict[int, tuple[int, float]] = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            ticks = sum(int(x) for x in fields[11:15])
            procs[int(pid)] = (int(fields[1]), ticks / os.sysconf("SC_CLK_TCK"))
    total = 0.0
    for pid, (_, seconds) in procs.items():
        up = pid
        while up in procs and up > 1 and up != os.getpid():
            up = procs[up][0]
        if up == os.getpid():
            total += seconds
    return total


def main() -> None:
    spark = local_spark(master="local[2,64]", app_name="ftlayer-spark-costs")
    base = (
        spark.range(0, BATCH, numPartitions=4)
        .select(
            F.lit(None).cast("binary").alias("key"),
            F.concat(
                F.format_string("%08d|", "id"),
                F.when(F.col("id") % 10 > 0, F.lit("x" * 31)).otherwise(F.lit("")),
            )
            .cast("binary")
            .alias("value"),
            F.lit("bench-fast").alias("topic"),
            F.lit(0).cast("int").alias("partition"),
            F.col("id").alias("offset"),
            F.current_timestamp().alias("timestamp"),
            (F.rand(1) * 9.0e18).cast("long").alias("ft_root"),
            (F.rand(2) * 9.0e18).cast("long").alias("ft_id"),
        )
        .cache()
    )
    base.count()
    plain_in = base.drop(*FT)
    out = "value binary, size int"
    out_ft = out + ", ft_root long, ft_id long"

    def plain() -> None:
        for _ in range(BATCHES):
            plain_in.mapInArrow(mapper(False), out).mapInArrow(keep, out).count()

    def cols() -> None:
        for _ in range(BATCHES):
            base.mapInArrow(mapper(True), out_ft).mapInArrow(keep, out_ft).drop(*FT).count()

    def cols_sink() -> None:
        for _ in range(BATCHES):
            df = base.mapInArrow(mapper(True), out_ft).mapInArrow(keep, out_ft).persist()
            df.drop(*FT).count()
            df.select(*FT).mapInArrow(count_rows, "rows long").collect()
            df.unpersist()

    def cols_cache_only() -> None:
        for _ in range(BATCHES):
            df = base.mapInArrow(mapper(True), out_ft).mapInArrow(keep, out_ft).persist()
            df.drop(*FT).count()
            df.unpersist()

    def cols_sink_driver() -> None:
        for _ in range(BATCHES):
            df = base.mapInArrow(mapper(True), out_ft).mapInArrow(keep, out_ft).persist()
            df.drop(*FT).count()
            table = df.select(*FT).toArrow()
            assert table.num_rows > 0
            df.unpersist()

    variants = {
        "plain": plain,
        "+cols": cols,
        "+cols +cache": cols_cache_only,
        "+cols +sink": cols_sink,
        "+cols +sink driver": cols_sink_driver,
    }
    for fn in variants.values():
        fn()  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(ROUNDS):
        for name, fn in variants.items():
            started, used = time.perf_counter(), tree_cpu()
            fn()
            seconds[name].append(time.perf_counter() - started)
            cpu[name].append(tree_cpu() - used)
    records = BATCH * BATCHES
    print("µs per record: wall, CPU (medians)")
    for name, s in seconds.items():
        wall = statistics.median(s) / records * 1e6
        used = statistics.median(cpu[name]) / records * 1e6
        print(f"{name:26} {wall:7.2f} {used:7.2f}  {[round(x, 2) for x in cpu[name]]}")


if __name__ == "__main__":
    main()
