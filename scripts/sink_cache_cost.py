"""What the tree-mode sink's one computation costs (docs/benchmarks/profile.md): the
fast bench's fused step (map + filter in one mapInArrow) over a cached static DataFrame
with the FT columns, in micro-batches of BATCH rows, then: a count (FT off: no FT
columns; +cols: with them), the batch cached and counted and its FT columns read by
`toArrow()` (what `ft_foreach_batch` does in tree mode), the same with MEMORY_ONLY, with
`localCheckpoint(eager=True)` instead of the cache, and computed twice (no cache).
Medians of ROUNDS alternating rounds, µs per record of wall time and of CPU (this
process and its descendants).

    .venv/bin/python scripts/sink_cache_cost.py [BATCH] [ROUNDS]
"""

import os
import statistics
import sys
import time

import pyarrow as pa
import pyarrow.compute as pc
from pyspark import StorageLevel
from pyspark.sql import functions as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spark_costs import tree_cpu

from ftlayer.integration.spark import local_spark

BATCH = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
BATCHES = 2
FT = ["ft_root", "ft_id"]


def fused(cols):
    def run(batches):
        for b in batches:
            v = b.column("value")
            s = pc.binary_length(v)
            arrays, names = [v, s], ["value", "size"]
            if cols:
                arrays += [b.column("ft_root"), b.column("ft_id")]
                names += FT
            out = pa.RecordBatch.from_arrays(arrays, names=names)
            yield out.filter(pc.greater(s, 20))

    return run


spark = local_spark(master="local[2,64]", app_name="sinkcost")
base = (
    spark.range(0, BATCH, numPartitions=4)
    .select(
        F.concat(
            F.format_string("%08d|", "id"),
            F.when(F.col("id") % 10 > 0, F.lit("x" * 31)).otherwise(F.lit("")),
        )
        .cast("binary")
        .alias("value"),
        (F.rand(1) * 9.0e18).cast("long").alias("ft_root"),
        (F.rand(2) * 9.0e18).cast("long").alias("ft_id"),
    )
    .cache()
)
base.count()
plain_in = base.drop(*FT)
out, out_ft = "value binary, size int", "value binary, size int, ft_root long, ft_id long"


def plain():
    for _ in range(BATCHES):
        plain_in.mapInArrow(fused(False), out).count()


def cols():
    for _ in range(BATCHES):
        base.mapInArrow(fused(True), out_ft).drop(*FT).count()


def cache():
    for _ in range(BATCHES):
        df = base.mapInArrow(fused(True), out_ft).persist()
        df.drop(*FT).count()
        assert df.select(*FT).toArrow().num_rows > 0
        df.unpersist()


def mem_only():
    for _ in range(BATCHES):
        df = base.mapInArrow(fused(True), out_ft).persist(StorageLevel.MEMORY_ONLY)
        df.drop(*FT).count()
        assert df.select(*FT).toArrow().num_rows > 0
        df.unpersist()


def local_cp():
    for _ in range(BATCHES):
        df = base.mapInArrow(fused(True), out_ft).localCheckpoint(eager=True)
        df.drop(*FT).count()
        assert df.select(*FT).toArrow().num_rows > 0


def twice():
    for _ in range(BATCHES):
        df = base.mapInArrow(fused(True), out_ft)
        df.drop(*FT).count()
        assert df.select(*FT).toArrow().num_rows > 0


variants = {
    "plain": plain,
    "+cols": cols,
    "+cache+toArrow": cache,
    "+memonly+toArrow": mem_only,
    "+localCheckpoint": local_cp,
    "computed twice": twice,
}
for fn in variants.values():
    fn()
sec = {n: [] for n in variants}
cpu = {n: [] for n in variants}
for _ in range(ROUNDS):
    for n, fn in variants.items():
        s, c = time.perf_counter(), tree_cpu()
        fn()
        sec[n].append(time.perf_counter() - s)
        cpu[n].append(tree_cpu() - c)
rec = BATCH * BATCHES
for n in variants:
    wall = statistics.median(sec[n]) / rec * 1e6
    used = statistics.median(cpu[n]) / rec * 1e6
    print(f"{n:22} wall {wall:6.2f} cpu {used:6.2f} µs/rec")
