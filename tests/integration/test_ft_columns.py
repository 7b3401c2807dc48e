"""The FT columns a user's DataFrame carries, by completion mode: tree mode's rows carry
`ft_root` and `ft_id`; barrier mode's `ft_root` alone, whose metadata says its rows
complete at the barrier (their record ids would be 0 on every row), through Spark's
own operators and every wrapped step. A DataFrame that lost an anchor column its mode
needs is refused with an error that names it, before any query starts.

Local Spark; no query runs (schemas are resolved at plan time), so no broker or FT
layer is reached: the address only has to parse.
"""

from __future__ import annotations

import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from ftlayer.errors import ConfigError
from ftlayer.integration.ftcolumns import (
    COMPLETION_METADATA,
    FTSettings,
    completes_at_barrier,
    missing_ft_columns,
)
from ftlayer.integration.sinks import ft_foreach_batch
from ftlayer.integration.tasks import FTTasks

ADDRESS = "127.0.0.1:9"  # parsed, never connected to: no query starts


def source(spark: SparkSession, completion: str) -> DataFrame:
    return (
        spark.readStream.format("ftkafka")
        .option("kafka.bootstrap.servers", "127.0.0.1:9")
        .option("subscribe", "orders")
        .option("ft.address", ADDRESS)
        .option("ft.completion", completion)
        .load()
    )


def test_barrier_rows_carry_their_root_alone_through_spark_and_wrapped_steps(
    spark: SparkSession,
) -> None:
    tasks = FTTasks(FTSettings(ADDRESS))
    barrier, tree = source(spark, "barrier"), source(spark, "tree")
    assert [c for c in barrier.columns if c.startswith("ft_")] == ["ft_root"]
    assert [c for c in tree.columns if c.startswith("ft_")] == ["ft_root", "ft_id"]
    assert barrier.schema["ft_root"].metadata == {COMPLETION_METADATA: "barrier"}
    assert not completes_at_barrier(tree.schema)

    # Plain Spark code keeps the metadata; each wrapped step hands it on.
    shaped = barrier.where(F.col("offset") % 2 == 0).select("value", "ft_root")
    mapped = tasks.map_batches(shaped, lambda batch: batch, "value binary")
    kept = tasks.filter(mapped, lambda row: True)
    flat = tasks.flat_map(kept, lambda row: [row, row], "value binary")
    for frame in (shaped, mapped, kept, flat):
        assert completes_at_barrier(frame.schema), frame.schema
        assert "ft_id" not in frame.columns and missing_ft_columns(frame.schema) == []
    tree_mapped = tasks.map_batches(
        tree.select("value", "ft_root", "ft_id"), lambda b: b, "value binary"
    )
    assert tree_mapped.columns == ["value", "ft_root", "ft_id"]
    assert not completes_at_barrier(tree_mapped.schema)


def test_a_frame_missing_an_anchor_column_its_mode_needs_is_refused_by_name(
    spark: SparkSession,
) -> None:
    settings = FTSettings(ADDRESS)
    tasks = FTTasks(settings)
    no_id = source(spark, "tree").select("value", "ft_root")  # tree mode needs ft_id
    no_root = source(spark, "barrier").select("value")
    with pytest.raises(ConfigError, match=r"has no ft_id column"):
        tasks.map_batches(no_id, lambda batch: batch, "value binary")
    with pytest.raises(ConfigError, match=r"has no ft_root / ft_id column"):
        tasks.filter(no_root, lambda row: True)
    sink = ft_foreach_batch(lambda frame, epoch: None, settings)
    batch = spark.createDataFrame([(b"x", 1)], "value binary, ft_root long")  # no metadata
    with pytest.raises(ConfigError, match=r"sink's DataFrame has no ft_id column"):
        sink(batch, 0)
