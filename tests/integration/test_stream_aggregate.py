"""FTTasks.aggregate on a streaming DataFrame (the ftkafka source), FT on and off.

Spark refuses to sort a streaming DataFrame and to group it with applyInArrow, so the
aggregate sorts each micro-batch partition in its task. Real Tansu, a real
`ftlayer serve`, local Spark: per-user sums over a stream equal the sums computed from
the produced records, and under FT every source tree completes once its aggregate row
is acked (each row is anchored to every input of its group).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from fixture_types import MakeTopic
from pyspark import cloudpickle
from pyspark.sql import SparkSession
from serverproc import StartServer

from ftlayer.integration.ftcolumns import FTSettings
from ftlayer.integration.harness.kafka import produce
from ftlayer.integration.sinks import ft_foreach_batch
from ftlayer.integration.tasks import FTTasks

cloudpickle.register_pickle_by_value(sys.modules[__name__])

N = 600


def parse(row: dict[str, Any]) -> dict[str, Any]:
    user, amount = row["value"].decode().split(":")
    return {"user": user, "amount": int(amount)}


def total(key: tuple[Any, ...], rows: pa.Table) -> pa.Table:
    return pa.table({"user": [key[0].as_py()], "total": [pc.sum(rows["amount"]).as_py()]})


@pytest.mark.parametrize("ft", [True, False], ids=["ft-on", "ft-off"])
def test_a_streaming_aggregate_sums_every_record_and_completes_every_tree(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
    ft: bool,
) -> None:
    server = start_server(None, "--tree-timeout-s", "600")
    settings = FTSettings(server.address) if ft else FTSettings(enabled=False)
    topic = make_topic(3)
    events = [(f"u{i % 7}".encode(), f"u{i % 7}:{i}".encode()) for i in range(N)]
    produce(kafka_bootstrap, topic, events)
    expected = Counter[str]()
    for i in range(N):
        expected[f"u{i % 7}"] += i

    reader = (
        spark.readStream.format("ftkafka")
        .option("kafka.bootstrap.servers", kafka_bootstrap)
        .option("subscribe", topic)
        .option("maxOffsetsPerTrigger", "250")  # several micro-batches
    )
    if ft:
        reader = reader.option("ft.address", server.address)
    tasks = FTTasks(settings)
    parsed = tasks.map(reader.load(), parse, "user string, amount long")
    totals = tasks.aggregate(parsed, "user", total, "user string, total long")
    got: list[dict[str, Any]] = []
    sink = ft_foreach_batch(lambda df, _: got.extend(r.asDict() for r in df.collect()), settings)
    query = (
        totals.writeStream.foreachBatch(sink)
        .trigger(availableNow=True)
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .start()
    )
    try:
        assert query.awaitTermination(120), "the availableNow query did not finish"
    finally:
        query.stop()

    summed = Counter[str]()
    for row in got:  # one row per user and micro-batch
        summed[row["user"]] += row["total"]
    assert summed == expected
    assert len(got) > len(expected)  # several batches, each aggregated on its own
    with server.client() as client:
        status = client.status()
    if ft:
        assert (status["persisted"], status["completed"], status["pending"]) == (N, N, 0)
    else:
        assert status["persisted"] == status["xor_events"] == 0
