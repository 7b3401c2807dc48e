"""The class-data archive the test suite's JVMs start from (Makefile `unit`).

Run with ``JAVA_TOOL_OPTIONS=-XX:ArchiveClassesAtExit=FILE``: a local Spark session
goes through the paths the tests take (Arrow, pandas and Python UDFs, a shuffle, a
Python streaming data source under a checkpointed query with foreachBatch), then stops
cleanly, and the JVM writes every class it loaded to FILE at its exit. Every Spark JVM
of the suite (drivers, and a standalone cluster's master, workers and executors) then
maps FILE (``-XX:SharedArchiveFile``) instead of loading and verifying those classes
from the jars again: measured here, a session's start and first jobs take 8 s of CPU
instead of 14 s. A JVM whose class path does not match the archive's starts without it.
"""

import contextlib
import sys
import tempfile

import pandas as pd
from pyspark import SparkContext
from pyspark.sql import functions as F
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition

from ftlayer.integration.spark import local_spark


class _Range(InputPartition):
    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end


class _Reader(DataSourceStreamReader):
    def __init__(self) -> None:
        self.at = 0

    def initialOffset(self) -> dict:
        return {"at": 0}

    def latestOffset(self) -> dict:
        self.at += 100
        return {"at": self.at}

    def partitions(self, start: dict, end: dict) -> list:
        mid = (start["at"] + end["at"]) // 2
        return [_Range(start["at"], mid), _Range(mid, end["at"])]

    def read(self, partition: _Range):
        for i in range(partition.start, partition.end):
            yield (i, f"v{i}")

    def commit(self, end: dict) -> None:
        pass


class _Source(DataSource):
    @classmethod
    def name(cls) -> str:
        return "cdswarm"

    def schema(self) -> str:
        return "id long, value string"

    def streamReader(self, schema):
        return _Reader()


def main() -> None:
    spark = local_spark(app_name="ftlayer-jvm-cds", fast_start=True)
    spark.dataSource.register(_Source)
    frame = spark.createDataFrame(pd.DataFrame({"k": [i % 7 for i in range(500)], "v": range(500)}))

    @F.pandas_udf("long")
    def doubled(v: pd.Series) -> pd.Series:
        return v * 2

    frame.groupBy("k").agg(F.sum(doubled("v")).alias("s")).join(frame, "k").count()
    frame.rdd.map(lambda r: r.v).sum()
    frame.groupBy("k").applyInPandas(lambda p: p.head(1), frame.schema).count()
    seen = []
    with tempfile.TemporaryDirectory() as checkpoint:
        query = (
            spark.readStream.format("cdswarm")
            .load()
            .withColumn("n", F.udf(lambda s: len(s), "int")("value"))
            .writeStream.option("checkpointLocation", checkpoint)
            .foreachBatch(lambda df, batch: seen.append(df.count()))
            .trigger(processingTime="100 milliseconds")
            .start()
        )
        while len(seen) < 3:
            query.awaitTermination(0.5)
        query.stop()
    gateway = SparkContext._gateway
    assert gateway is not None
    jvm = gateway.proc  # the JVM's process (pyspark's launch_gateway)
    spark.stop()
    # Exit the JVM itself, and wait: PySpark kills it when this process exits, before
    # it wrote the archive (which takes seconds).
    with contextlib.suppress(Exception):  # the call never returns
        gateway.jvm.System.exit(0)
    jvm.wait(600)
    print(f"warmed: {sum(seen)} streamed rows", file=sys.stderr)


if __name__ == "__main__":
    main()
