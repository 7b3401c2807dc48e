"""Task wrappers on real parts: a real `ftlayer serve`, real local Spark (local[2,4]).

Input DataFrames are built as the ftkafka source builds them: every record is first
persisted with the FT layer (Persister over an FTClient), and the rows carry the
returned root and id in ft_root / ft_id. What the tests check is what a user sees:
the server's counters (pending, completed, failed, replay queue), the replayed
records' bytes, and the rows that reach the sink.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark import TaskContext, cloudpickle
from pyspark.sql import DataFrame, SparkSession
from serverproc import Server, StartServer

from ftlayer.acking.handlers import Anchors, Persister
from ftlayer.client import FTClient
from ftlayer.errors import FailException
from ftlayer.inspection import RecordQuery
from ftlayer.integration.ftcolumns import ID_COLUMN, ROOT_COLUMN, FTSettings, to_signed
from ftlayer.integration.harness.kafka import wait_until
from ftlayer.integration.sinks import ft_foreach_batch
from ftlayer.integration.tasks import (
    EXTRA_ANCHORS_COLUMN,
    FTTasks,
    TaskOutput,
    anchor_columns,
    read_anchors,
)

# Spark's Python workers cannot import this module: ship its functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

N = 2000
SCHEMA = "n long, k long, text string"
# Each table's records are other records than the last one's: a record persisted again
# at the same offset would take the earlier copy over (ftlayer.core.takeover).
_FIRST_OFFSETS = itertools.count(0, 1_000_000)


def source_table(client: FTClient, n: int, tag: str = "record") -> pa.Table:
    """n records persisted with the FT layer, as a source emits them: payload columns
    plus the ft_root / ft_id the Persister returned. Every call reads new offsets."""
    payloads = [f"{tag}-{i}".encode() for i in range(n)]
    first = next(_FIRST_OFFSETS)
    anchors = Persister(client, source_id=1).persist(
        payloads, topics="in", partitions=np.arange(n) % 2, offsets=first + np.arange(n)
    )
    return pa.table(
        {
            "n": pa.array(np.arange(n), type=pa.int64()),
            "payload": pa.array(payloads, type=pa.binary()),
            ROOT_COLUMN: to_signed(anchors.roots),
            ID_COLUMN: to_signed(anchors.ids),
        }
    )


def source_frame(spark: SparkSession, client: FTClient, n: int = N) -> DataFrame:
    return spark.createDataFrame(source_table(client, n))


def decode(row: dict[str, Any]) -> dict[str, Any]:
    return {"n": row["n"], "k": row["n"] % 10, "text": row["payload"].decode()}


def collect_sink(settings: FTSettings, out: list[dict[str, Any]]) -> Any:
    return ft_foreach_batch(lambda df, _: out.extend(r.asDict() for r in df.collect()), settings)


def replayed_payloads(client: FTClient) -> list[bytes]:
    status = client.status()
    replay = client.fetch_replay(0, status["replay_cursor"])
    return sorted(replay.records.payloads)


u64 = st.integers(2, 2**64 - 1)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.tuples(u64, u64), min_size=1, max_size=4), max_size=20))
def test_anchors_round_trip_through_the_ft_columns(rows: list[list[tuple[int, int]]]) -> None:
    offsets = np.cumsum([0] + [len(pairs) for pairs in rows])
    flat = [pair for pairs in rows for pair in pairs]
    anchors = Anchors(
        offsets.astype(np.int64),
        np.array([r for r, _ in flat], dtype=np.uint64),
        np.array([i for _, i in flat], dtype=np.uint64),
    )
    names = [ROOT_COLUMN, ID_COLUMN, EXTRA_ANCHORS_COLUMN]
    batch = pa.RecordBatch.from_arrays(anchor_columns(anchors, multi=True), names=names)

    back = read_anchors(batch)
    assert [back.pairs(i) for i in range(len(back))] == rows
    if all(len(pairs) == 1 for pairs in rows):  # single-anchored columns read the same
        single = pa.RecordBatch.from_arrays(anchor_columns(anchors, multi=False), names=names[:2])
        assert [read_anchors(single).pairs(i) for i in range(len(rows))] == rows
    # A null extra-anchors list (a single-anchored row in a union) means "no extras".
    nulls = batch.set_column(2, EXTRA_ANCHORS_COLUMN, pa.nulls(len(rows), batch.column(2).type))
    firsts = read_anchors(nulls)
    assert [firsts.pairs(i) for i in range(len(rows))] == [pairs[:1] for pairs in rows]


def test_map_filter_sink_chain_completes_every_tree_in_a_streaming_query(
    spark: SparkSession, ft_server: Server, tmp_path: Path
) -> None:
    client = ft_server.client()
    table = source_table(client, N)
    (tmp_path / "in").mkdir()  # tmp_path holds the server's files too
    for part in range(2):  # two files: the stream reads them as its input
        pq.write_table(table.slice(part * N // 2, N // 2), tmp_path / "in" / f"{part}.parquet")
    schema = spark.createDataFrame(table.slice(0, 0)).schema
    stream = spark.readStream.schema(schema).parquet(str(tmp_path / "in"))
    settings = FTSettings(ft_server.address)
    tasks = FTTasks(settings)
    kept = tasks.filter(tasks.map(stream, decode, SCHEMA), lambda r: r["n"] % 3 != 0)
    out: list[dict[str, Any]] = []
    query = (
        kept.writeStream.foreachBatch(collect_sink(settings, out))
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    # Ends by itself (availableNow); the bound is for a hang, not for a loaded machine.
    assert query.awaitTermination(600), "the query did not end"

    assert query.exception() is None
    assert sorted(r["n"] for r in out) == [i for i in range(N) if i % 3 != 0]
    assert all(r["text"] == f"record-{r['n']}" for r in out)
    assert {ROOT_COLUMN, ID_COLUMN} & set(out[0]) == set()  # the sink's fn never sees them
    status = client.status()
    # Dropped records' trees complete too: the filter acks what it drops.
    assert (status["pending"], status["completed"]) == (0, N)
    assert status["failed"] == {"explicit": 0, "timeout": 0, "recovery": 0, "source-expired": 0}
    assert status["unknown_events"] == status["late_events"] == 0


def test_fail_exception_fails_only_that_records_tree(
    spark: SparkSession, ft_server: Server
) -> None:
    client = ft_server.client()
    df = source_frame(spark, client)
    bad = set(range(5, N, 100))  # 1 %

    def parse(row: dict[str, Any]) -> Iterator[dict[str, Any]]:
        yield decode(row)
        if row["n"] in bad:  # midway: the output already yielded must not leave
            raise FailException(f"record {row['n']} is malformed")
        yield {**decode(row), "k": -1}

    settings = FTSettings(ft_server.address)
    out: list[dict[str, Any]] = []
    collect_sink(settings, out)(FTTasks(settings).flat_map(df, parse, SCHEMA), 0)

    assert sorted({r["n"] for r in out}) == sorted(set(range(N)) - bad)
    assert len(out) == 2 * (N - len(bad))
    status = client.status()
    assert status["completed"] == N - len(bad)
    assert status["failed"]["explicit"] == len(bad)
    assert status["replay_queue"] == status["pending"] == len(bad)
    assert replayed_payloads(client) == sorted(f"record-{i}".encode() for i in bad)


def test_batch_forms_give_the_record_forms_output_and_complete(
    spark: SparkSession, ft_server: Server
) -> None:
    client = ft_server.client()
    settings = FTSettings(ft_server.address)
    tasks = FTTasks(settings)
    fail_every = 50

    def twice_but_fail_some(batch: pa.RecordBatch) -> TaskOutput:
        n = batch.column("n").to_numpy()
        failed = n % fail_every == 0
        parents = np.repeat(np.flatnonzero(~failed), 2)
        rows = pa.table(
            {
                "n": pc.take(batch.column("n"), pa.array(parents)),
                "k": pa.array(n[parents] % 10),
                "text": pc.cast(pc.take(batch.column("payload"), pa.array(parents)), pa.string()),
            }
        )
        return TaskOutput(rows, parents=parents, failed=failed)

    vectorized = tasks.filter_batches(
        tasks.map_batches(source_frame(spark, client), twice_but_fail_some, SCHEMA),
        lambda b: pc.not_equal(pc.bit_wise_and(b.column("n"), 1), 1),
    )
    by_record = tasks.filter(
        tasks.flat_map(
            source_frame(spark, client),
            lambda r: [] if r["n"] % fail_every == 0 else [decode(r)] * 2,
            SCHEMA,
        ),
        lambda r: r["n"] % 2 == 0,
    )
    out_vectorized: list[dict[str, Any]] = []
    out_by_record: list[dict[str, Any]] = []
    collect_sink(settings, out_vectorized)(vectorized, 0)
    collect_sink(settings, out_by_record)(by_record, 1)

    def key(r: dict[str, Any]) -> tuple[int, str]:
        return (r["n"], r["text"])

    assert sorted(out_vectorized, key=key) == sorted(out_by_record, key=key)
    assert len(out_vectorized) == 2 * len([i for i in range(0, N, 2) if i % fail_every])
    status = client.status()
    failed = len(range(0, N, fail_every))  # only the batch form fails them
    assert status["completed"] == 2 * N - failed
    assert status["failed"]["explicit"] == status["pending"] == failed


def test_records_a_plain_spark_filter_drops_time_out_and_are_replayed(
    spark: SparkSession, start_server: StartServer
) -> None:
    server = start_server(None, "--tree-timeout-s", "2")
    client = server.client()
    settings = FTSettings(server.address)
    mapped = FTTasks(settings).map(source_frame(spark, client), decode, SCHEMA)
    buggy = mapped.where("n % 97 != 0")  # drops rows without acking them
    collect_sink(settings, [])(buggy, 0)
    dropped = sorted(f"record-{i}".encode() for i in range(0, N, 97))

    assert client.status()["completed"] == N - len(dropped)
    wait_until(
        lambda: client.status()["failed"]["timeout"] == len(dropped),
        timeout=15,
        what="the dropped records' trees to time out",
    )
    status = client.status()
    assert status["completed"] == N - len(dropped)
    assert status["replay_queue"] == len(dropped)
    assert replayed_payloads(client) == dropped


def test_on_error_fail_record_vs_fail_task(spark: SparkSession, ft_server: Server) -> None:
    client = ft_server.client()
    settings = FTSettings(ft_server.address)
    n = 400
    bad = set(range(7, n, 50))  # in every partition

    def buggy(row: dict[str, Any]) -> dict[str, Any]:
        if row["n"] in bad:
            raise ValueError(f"cannot parse record {row['n']}")
        return decode(row)

    # fail-record (default): the job succeeds; only the raising records' trees fail.
    out: list[dict[str, Any]] = []
    collect_sink(settings, out)(
        FTTasks(settings).map(source_frame(spark, client, n), buggy, SCHEMA), 0
    )
    assert len(out) == n - len(bad)
    status = client.status()
    assert (status["completed"], status["failed"]["explicit"]) == (n - len(bad), len(bad))

    # fail-task, permanent error (here in one partition): Spark runs the task 4 times,
    # then the job (in a streaming query, the query) fails. Nothing was failed
    # explicitly: the records of the failed partition wait for their timeout.
    fail_task = FTTasks(settings, on_error="fail-task")
    before = client.status()

    def buggy_in_first_half(row: dict[str, Any]) -> dict[str, Any]:
        return buggy(row) if row["n"] < n // 2 else decode(row)

    mapped = fail_task.map(source_frame(spark, client, n), buggy_in_first_half, SCHEMA)
    with pytest.raises(Exception, match="cannot parse record 7"):
        mapped.collect()
    status = client.status()
    assert status["failed"] == before["failed"]
    assert status["pending"] == before["pending"] + n

    # fail-task, transient error: the first attempt fails after processing its whole
    # partition; its events never left the task, so the retry completes every tree.
    def flaky(row: dict[str, Any]) -> dict[str, Any]:
        context = TaskContext.get()
        if row["n"] == n - 1 and context is not None and context.attemptNumber() == 0:
            raise ConnectionError("the lookup service hiccuped")
        return decode(row)

    before = client.status()
    out = []
    collect_sink(settings, out)(fail_task.map(source_frame(spark, client, n), flaky, SCHEMA), 2)
    status = client.status()
    assert len(out) == n
    assert status["completed"] - before["completed"] == n
    assert status["failed"] == before["failed"]


def test_aggregate_completes_only_when_all_its_inputs_trees_do(
    spark: SparkSession, ft_server: Server
) -> None:
    client = ft_server.client()
    settings = FTSettings(ft_server.address)
    tasks = FTTasks(settings)
    n = 600

    def split(row: dict[str, Any]) -> list[dict[str, Any]]:
        return [{**decode(row), "text": "agg"}, {**decode(row), "text": "side"}]

    # Each record has two branches, routed by a plain `where` (each row goes to exactly
    # one branch): one into the per-key sum, one to a second sink.
    branches = tasks.flat_map(source_frame(spark, client, n), split, SCHEMA).persist()

    def total(key: tuple[Any, ...], rows: pa.Table) -> pa.Table:
        return pa.table({"k": [key[0].as_py()], "total": [pc.sum(rows.column("n")).as_py()]})

    sums = tasks.aggregate(
        branches.where("text = 'agg'"), "k", total, "k long, total long", num_partitions=2
    )
    labelled = tasks.map(sums, lambda r: {"label": f"k={r['k']}: {r['total']}"}, "label string")
    assert EXTRA_ANCHORS_COLUMN in labelled.columns  # a map keeps the multi-anchoring

    out: list[dict[str, Any]] = []
    collect_sink(settings, out)(labelled, 0)
    assert sorted(r["label"] for r in out) == sorted(
        f"k={k}: {sum(range(k, n, 10))}" for k in range(10)
    )
    # Every aggregate is acked, but every root still has its side branch open.
    status = client.status()
    assert (status["completed"], status["pending"]) == (0, n)

    collect_sink(settings, [])(branches.where("text = 'side' and n % 2 = 0"), 1)
    assert (client.status()["completed"], client.status()["pending"]) == (n // 2, n // 2)
    collect_sink(settings, [])(branches.where("text = 'side' and n % 2 = 1"), 2)
    status = client.status()
    assert (status["completed"], status["pending"]) == (n, 0)
    assert status["failed"]["explicit"] == status["failed"]["timeout"] == 0
    branches.unpersist()


def test_failing_an_aggregate_fails_only_the_roots_it_involves(
    spark: SparkSession, ft_server: Server
) -> None:
    client = ft_server.client()
    settings = FTSettings(ft_server.address)
    tasks = FTTasks(settings)
    n = 600

    def count(key: tuple[Any, ...], rows: pa.Table) -> pa.Table | TaskOutput:
        k = key[0].as_py()
        if k == 3:
            raise FailException("the sum for key 3 cannot be trusted")
        out = pa.table({"k": [k], "count": [rows.num_rows]})
        if k == 5:  # one bad input: only its tree fails, the aggregate goes on
            return TaskOutput(out, failed=pc.equal(rows.column("n"), 15))
        return out

    keyed = tasks.map(source_frame(spark, client, n), decode, SCHEMA)
    out: list[dict[str, Any]] = []
    counts = tasks.aggregate(keyed, "k", count, "k long, count long", num_partitions=2)
    # Small Arrow batches: every group spans several of them.
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "7")
    try:
        collect_sink(settings, out)(counts, 0)
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")

    assert sorted((r["k"], r["count"]) for r in out) == [(k, n // 10) for k in range(10) if k != 3]
    failed = [i for i in range(n) if i % 10 == 3] + [15]
    status = client.status()
    assert status["completed"] == n - len(failed)
    assert status["failed"]["explicit"] == status["replay_queue"] == len(failed)
    assert replayed_payloads(client) == sorted(f"record-{i}".encode() for i in failed)


def test_ft_off_gives_the_same_output_without_ft_columns_or_events(
    spark: SparkSession, ft_server: Server
) -> None:
    client = ft_server.client()
    table = source_table(client, N)

    def stats(key: tuple[Any, ...], rows: pa.Table) -> pa.Table:
        n = rows.column("n")
        return pa.table({"k": [key[0].as_py()], "count": [len(n)], "total": [pc.sum(n).as_py()]})

    def decode_null_nines(row: dict[str, Any]) -> dict[str, Any]:
        out = decode(row)
        return {**out, "k": None if out["k"] == 9 else out["k"]}

    def run(settings: FTSettings, df: DataFrame) -> list[Any]:
        tasks = FTTasks(settings)
        mapped = tasks.map(df, decode_null_nines, SCHEMA)
        kept = tasks.filter_batches(mapped, lambda b: b.column("n").to_numpy() % 7 != 0)
        kept = tasks.filter(kept, lambda r: r["n"] % 11 != 0)
        sums = tasks.aggregate(kept, "k", stats, "k long, count long, total long", num_partitions=2)
        out: list[Any] = []
        ft_foreach_batch(lambda d, _: out.extend(d.collect()), settings)(sums, 0)
        return sorted(out, key=lambda r: (r["k"] is None, r["k"] or 0))

    on = run(FTSettings(ft_server.address), spark.createDataFrame(table))
    before = client.status()
    assert (before["completed"], before["pending"]) == (N, 0)
    off_settings = FTSettings(ft_server.address, enabled=False)
    plain = spark.createDataFrame(table.drop_columns([ROOT_COLUMN, ID_COLUMN]))
    off = run(off_settings, plain)
    after = client.status()

    kept = [i for i in range(N) if i % 7 and i % 11]
    assert off == on
    groups = [[i for i in kept if i % 10 == k] for k in range(10)]
    assert [tuple(r) for r in on] == [
        (None if k == 9 else k, len(group), sum(group)) for k, group in enumerate(groups)
    ]
    assert FTTasks(off_settings).map(plain, decode, SCHEMA).columns == ["n", "k", "text"]
    for counter in ("xor_events", "persisted", "unknown_events", "completed"):
        assert after[counter] == before[counter], counter
    assert after["connections"] <= before["connections"]  # FT off opens none


def test_a_float_with_a_fraction_for_an_integer_column_fails_instead_of_truncating(
    spark: SparkSession, ft_server: Server
) -> None:
    # pyarrow would write 3.5 as 3 in a long column without a word.
    client = ft_server.client()
    settings = FTSettings(ft_server.address)
    n = 40

    def halves(row: dict[str, Any]) -> dict[str, Any]:
        out = decode(row)
        if row["n"] == 3:
            out["k"] = 3.5
        elif row["n"] == 4:
            out["k"] = 4.0  # a whole float converts exactly: fine
        return out

    got: list[dict[str, Any]] = []
    collect_sink(settings, got)(
        FTTasks(settings).map(source_frame(spark, client, n), halves, SCHEMA), 0
    )
    assert sorted(r["n"] for r in got) == [i for i in range(n) if i != 3]
    assert next(r["k"] for r in got if r["n"] == 4) == 4
    status = client.status()
    assert (status["completed"], status["failed"]["explicit"]) == (n - 1, 1)

    with pytest.raises(Exception, match=r"cannot hold 3\.5: it would be truncated"):
        FTTasks(settings, on_error="fail-task").map(
            source_frame(spark, client, n), halves, SCHEMA
        ).collect()


def _map_in_arrow_nodes(df: DataFrame) -> int:
    plan = df._jdf.queryExecution().executedPlan().toString()
    return plan.count("MapInArrow")


def test_fused_steps_give_the_rows_events_and_failures_of_separate_ones(
    spark: SparkSession, start_server: StartServer, tmp_path: Path
) -> None:
    # map -> flat_map (fails some records, fans out) -> filter_batches -> filter: fused
    # into one mapInArrow by default, one per step with fuse=False; the user sees the
    # same rows, the same completed and failed trees and the same replays either way.
    def run(fuse: bool) -> tuple[list[tuple[int, str]], dict[str, Any], list[bytes], int]:
        server = start_server(tmp_path / f"data-{fuse}")
        client = server.client()
        settings = FTSettings(server.address)
        tasks = FTTasks(settings, fuse=fuse)

        def fan_out(row: dict[str, Any]) -> list[dict[str, Any]]:
            if row["n"] % 37 == 0:
                raise FailException("a poison record")
            return [row, {**row, "k": -row["k"]}]

        mapped = tasks.map(source_frame(spark, client), decode, SCHEMA)
        fanned = tasks.flat_map(mapped, fan_out, SCHEMA)
        even = tasks.filter_batches(fanned, lambda b: pc.equal(pc.bit_wise_and(b["n"], 1), 0))
        kept = tasks.filter(even, lambda r: r["n"] % 3 != 0)
        out: list[dict[str, Any]] = []
        collect_sink(settings, out)(kept, 0)
        rows = sorted((r["n"] * 10 + r["k"], r["text"]) for r in out)
        return rows, client.status(), replayed_payloads(client), _map_in_arrow_nodes(kept)

    fused_rows, fused_status, fused_replays, fused_nodes = run(True)
    rows, status, replays, nodes = run(False)

    assert (fused_nodes, nodes) == (1, 4)
    poison = [i for i in range(N) if i % 37 == 0]
    expected = sorted(
        (i * 10 + sign * (i % 10), f"record-{i}")
        for i in range(0, N, 2)
        if i % 3 and i % 37
        for sign in (1, -1)
    )
    assert fused_rows == rows == expected
    assert fused_replays == replays == sorted(f"record-{i}".encode() for i in poison)
    for figures in (fused_status, status):
        assert (figures["completed"], figures["failed"]["explicit"]) == (
            N - len(poison),
            len(poison),
        )
        assert figures["pending"] == len(poison)  # queued for replay
        assert figures["unknown_events"] == figures["late_events"] == 0


def test_a_chain_ends_at_anything_between_its_steps_and_its_first_result_stays_usable(
    spark: SparkSession, ft_server: Server
) -> None:
    client = ft_server.client()
    settings = FTSettings(ft_server.address)
    tasks = FTTasks(settings)
    mapped = tasks.map(source_frame(spark, client), decode, SCHEMA)
    fused = tasks.filter(mapped, lambda r: r["n"] % 2 == 0)
    after_plain = tasks.filter(mapped.where("n >= 0"), lambda r: r["n"] % 2 == 0)
    observed = tasks.filter(mapped, lambda r: r["n"] % 2 == 0, observe=True)

    assert _map_in_arrow_nodes(fused) == 1
    assert _map_in_arrow_nodes(after_plain) == 2
    assert _map_in_arrow_nodes(observed) == 2
    out: list[dict[str, Any]] = []
    collect_sink(settings, out)(mapped, 0)  # the first step on its own
    assert sorted(r["n"] for r in out) == list(range(N))
    assert client.status()["completed"] == N


def test_a_failure_names_the_step_and_its_function_for_every_kind_of_step(
    spark: SparkSession, ft_server: Server
) -> None:
    # Causes (inspect, dead letters, logs) tell two filters or two batch maps apart.
    client = ft_server.client()
    settings = FTSettings(ft_server.address)
    tasks = FTTasks(settings)
    table = source_table(client, 40)

    def keep_small(batch: pa.RecordBatch) -> Any:
        if 7 in batch.column("n").to_pylist():
            raise ValueError("a batch with record 7")
        return pc.less(batch.column("n"), 1000)

    def not_eleven(row: dict[str, Any]) -> bool:
        if row["n"] == 11:
            raise FailException("record 11")
        return True

    def sizes(batch: pa.RecordBatch) -> pa.RecordBatch:
        if 13 in batch.column("n").to_pylist():
            raise ValueError("a batch with record 13")
        return batch

    n_payload = "n long, payload binary"
    steps = {
        7: lambda df: tasks.filter_batches(df, keep_small),
        11: lambda df: tasks.filter(df, not_eleven),
        13: lambda df: tasks.map_batches(df, sizes, n_payload),
    }
    for record, step in steps.items():
        one = spark.createDataFrame(table.slice(record, 1))
        collect_sink(settings, [])(step(one), 0)
    replay = client.fetch_replay(0, client.status()["replay_cursor"]).records
    found = {}
    for root, payload in zip(replay.roots.tolist(), replay.payloads, strict=True):
        (inspected,) = client.inspect(RecordQuery(root=root)).records
        assert inspected.history is not None
        found[int(payload.decode().split("-")[1])] = inspected.history["causes"][0]["step"]
    assert found == {
        7: "filter_batches(keep_small)",
        11: "filter(not_eleven)",
        13: "map_batches(sizes)",
    }
