"""`ftlayer bench pipeline --fast`: the FT layer's cost in a vectorized pipeline at full
speed, and the source's ceiling against a bare Kafka consumer.

The per-record bench (`integration.harness.benchpipe`) runs the demo's Python-per-row
pipeline, slow enough that the FT layer's cost hides in it. This one runs what a user
who writes vectorized steps runs:

    ftkafka -> FTTasks.map_batches (pyarrow compute) -> FTTasks.filter_batches
            -> ft_foreach_batch (counts the rows: the cheapest sink there is)

on one embedded Tansu broker, one FT-layer process (`ftlayer serve`) and one local Spark
session (`local[2,64]`), `records` small records produced once to a topic of
`partitions` partitions. For each batch size (maxOffsetsPerTrigger), `rounds`
alternating triples of runs: FT off, FT on in tree mode, FT on in barrier mode, the
order rotated by one each round (a run's place weighs on it: see `_order`); each
run a new query (its own checkpoint and ft.sourceName, FT on with `ft.persist` =
`persist`), timed from its start until the
sink counted every expected row and (FT on) no tree is pending, after one untimed
warm-up run of each mode (`WARM_UP`), and followed by a pause of a second (the
server's deferred deletes of the run: `benchcost.SETTLE_S`); its rate is records
over the time its batches took (Spark's triggerExecution of every batch that read
records: the query's start-up, the same for every mode, is left out, since it would
only pull the ratios towards 1; the wall-clock seconds are reported too). Before each
round, one bare kafka-python consumer (assign/seek, the source's own fetch settings)
reads the whole topic; a batch size whose runs are short gets more rounds, until each
mode's timed runs add up to MIN_TIMED_S (`rounds` in its figures; the top-level server
figures count the first `rounds` rounds of each size only, so that every size weighs
the same in them). Reported per batch size: the median records/s of each mode and
the ratios tree/off, barrier/off and off/consumer; the complete latency of each
FT-on run where the server measures it (`integration.harness.benchlatency`); and the
FT-layer server process's CPU and storage writes per record over the timed runs of
each FT-on mode, and by request kind the requests per 1,000 records and their handlers'
CPU per record (`server_requests`), and each of its threads' CPU per record
(`server_threads`; `integration.harness.benchcost`), those of barrier
mode over every batch size at the top level. Each FT mode has a server of its own, so
one mode's work (a tree run's deletes, the acker journal base its events make due) is
never counted in another's runs.

With `fail_rate` > 0 the map step of the FT-on runs fails that share of the records
(picked by a hash of the record's number, `_fails`) the first time it sees each (an
O_EXCL marker file per record and run, as the demo's flaky step does; in /dev/shm
where there is one, since on a disk a marker costs up to 0.65 ms, 0.35 s of CPU in a
50,000-record task at 1%: the bench's own cost, counted as FT on's): it fails them
by a `TaskOutput.failed` mask, an explicit failure like a FailException's, and the FT
layer replays them, so each still reaches the sink once and the run ends as without
failures, its batches' rows being the records and their replays. FT-off runs fail
nothing: there a failure fails the task, and Spark retries the whole task.

Targets, with `persist` "reference": without failures, tree/off >= 0.92 and
barrier/off >= 0.97 at 50,000 and 200,000, and at most 2 bytes written to storage per
record (`lmdb_bytes_per_record`); with failures, at most 0.05 µs of server CPU per
record (`server_cpu_us_per_record`, set for 1% failures); and in every run off/consumer
>= 0.8 at the largest batch size. `targets` in the result names those that apply.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from ftlayer.client import FTClient
from ftlayer.errors import ConfigError
from ftlayer.integration.ftcolumns import FTSettings
from ftlayer.integration.harness.benchcost import ServerCost, server_requests
from ftlayer.integration.harness.benchlatency import LatencyRun, complete_latency
from ftlayer.integration.harness.broker import TansuBroker
from ftlayer.integration.harness.demo import stop_when_idle
from ftlayer.integration.harness.ftprocess import FTServerProcess
from ftlayer.integration.harness.kafka import create_topic, produce

__all__ = ["DEFAULT_BATCH_SIZES", "bench_fast"]

DEFAULT_BATCH_SIZES = (10_000, 50_000, 200_000)
TARGET_TREE = 0.92
TARGET_BARRIER = 0.97
TARGET_CONSUMER = 0.8
TARGET_SERVER_CPU_US = 0.05  # per record, barrier mode by reference, with failures (1%)
TARGET_LMDB_BYTES = 2.0  # per record, barrier mode by reference, without failures
_TARGET_SIZES = (50_000, 200_000)
_VALUE_BYTES = 40  # small records: the FT layer's cost per record is what shows


def _value(i: int) -> bytes:
    """A small record; 1 in 10 is short, and the filter drops it."""
    body = b"%08d|" % i
    return body + (b"x" * (_VALUE_BYTES - len(body)) if i % 10 else b"")


def _expected(records: int) -> int:
    return records - (records + 9) // 10


def _measure(batch: Any) -> Any:
    """map_batches' function: each value with its length, vectorized."""
    import pyarrow as pa
    import pyarrow.compute as pc

    values = batch.column("value")
    return pa.RecordBatch.from_arrays([values, pc.binary_length(values)], names=["value", "size"])


def _fails(numbers: Any, fail_rate: float) -> Any:
    """Which of the records numbered `numbers` (a numpy integer array) fail once: a
    `fail_rate` share, picked by a multiplicative hash."""
    mixed = (numbers.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(32)
    return mixed % np.uint64(1_000_000) < np.uint64(round(fail_rate * 1_000_000))


def _marks_base() -> str | None:
    """Where the failing runs' marker files go: /dev/shm (a tmpfs) where there is one,
    else the system's temporary directory."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


class _FailingMeasure:
    """map_batches' function with failures: `_measure`, failing the records `_fails`
    picks the first time it sees each (first sight: an O_EXCL marker file in
    `directory`, which holds across Python workers) with a `TaskOutput.failed` mask."""

    def __init__(self, fail_rate: float, directory: str) -> None:
        self.fail_rate = fail_rate
        self.directory = directory

    def __call__(self, batch: Any) -> Any:
        import pyarrow as pa
        import pyarrow.compute as pc

        from ftlayer.integration.tasks import TaskOutput

        out = _measure(batch)
        head = pc.binary_slice(batch.column("value"), 0, 8)  # the record's number, %08d
        numbers = pc.cast(pc.cast(head, pa.string()), pa.int64()).to_numpy()
        failed = np.zeros(batch.num_rows, dtype=np.bool_)
        for row in np.flatnonzero(_fails(numbers, self.fail_rate)):
            marker = os.path.join(self.directory, str(numbers[row]))
            try:
                os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                continue  # seen before: this is its replay
            failed[row] = True
        if not failed.any():
            return out
        kept = np.flatnonzero(~failed)
        return TaskOutput(out.take(pa.array(kept)), parents=kept, failed=failed)


def _long(batch: Any) -> Any:
    """filter_batches' predicate: drops the short values."""
    import pyarrow.compute as pc

    return pc.greater(batch.column("size"), 20)


def _bare_consumer(bootstrap: str, topic: str, partitions: int, records: int) -> float:
    """Seconds for one kafka-python consumer to read the whole topic (the source's fetch
    settings, assign/seek), counting records only."""
    from kafka import TopicPartition

    from ftlayer.integration.source.kafkaread import (
        _FETCH_MAX_BYTES,
        _MAX_POLL_RECORDS,
        _PARTITION_FETCH_MAX_BYTES,
        new_consumer,
    )

    config = {
        "fetch_max_bytes": _FETCH_MAX_BYTES,
        "max_partition_fetch_bytes": _PARTITION_FETCH_MAX_BYTES,
        "max_poll_records": _MAX_POLL_RECORDS,
        "fetch_max_wait_ms": 100,
    }
    started = time.perf_counter()
    consumer = new_consumer(bootstrap, config)
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        seen = 0
        deadline = time.monotonic() + 600
        while seen < records:
            if time.monotonic() > deadline:
                raise RuntimeError(f"bare consumer: {seen} of {records} records in 600 s")
            for batch in consumer.poll(timeout_ms=500).values():
                seen += len(batch)
        return time.perf_counter() - started
    finally:
        consumer.close(autocommit=False)


def bench_fast(
    records: int = 400_000,
    partitions: int = 4,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    rounds: int = 2,
    deadline_s: float = 900.0,
    fail_rate: float = 0.0,
    persist: str = "reference",
    tree_ranges: bool = True,
) -> dict[str, Any]:
    """See the module docstring; returns the figures. `tree_ranges`: the tree-mode runs
    read their batches as ranges (ft.treeRanges, the default); False: they store a
    reference per record."""
    from ftlayer.integration.sinks import ft_foreach_batch
    from ftlayer.integration.source import register
    from ftlayer.integration.spark import local_spark
    from ftlayer.integration.tasks import FTTasks

    if records < 1 or partitions < 1 or rounds < 1 or not batch_sizes:
        raise ConfigError("need records, partitions, rounds >= 1 and a batch size")
    if not 0 <= fail_rate < 1 or persist not in ("reference", "payload"):
        raise ConfigError("need 0 <= fail_rate < 1 and persist 'reference' or 'payload'")
    expected = _expected(records)
    failing = int(_fails(np.arange(records), fail_rate).sum()) if fail_rate else 0
    schema = "value binary, size int"
    sizes = sorted({int(b) for b in batch_sizes})
    results: dict[str, Any] = {}
    with (
        tempfile.TemporaryDirectory(prefix="ftlayer-bench-fast-") as tmp,
        tempfile.TemporaryDirectory(prefix="ftlayer-bench-fast-", dir=_marks_base()) as marks,
        TansuBroker(log_path=Path(tmp) / "broker.log") as broker,
    ):
        work = Path(tmp)
        bootstrap, topic = broker.bootstrap, "bench-fast"
        create_topic(bootstrap, topic, partitions)
        produce(bootstrap, topic, ((None, _value(i)) for i in range(records)), timeout=600)
        # A server per FT mode: one mode's work (a tree run's deletes, the journal base
        # its XOR events make due) never lands in another mode's measured window.
        with (
            FTServerProcess(work / "ft-tree", "--tree-timeout-s", "120") as tree_server,
            FTServerProcess(work / "ft-barrier", "--tree-timeout-s", "120") as barrier_server,
        ):
            servers = {"tree": tree_server, "barrier": barrier_server}
            spark = local_spark(master="local[2,64]", app_name="ftlayer-bench-fast")
            register(spark)
            runs = 0
            timed: list[LatencyRun] = []
            costs = {
                mode: ServerCost(s.pid, requests=partial(server_requests, s.address), threads=True)
                for mode, s in servers.items()
            }

            def run(max_per_trigger: int, mode: str, round_: int | None) -> tuple[float, float]:
                """One run; with `round_`, a timed one whose latency is reported."""
                nonlocal runs
                runs += 1
                ft = mode != "off"
                server, cost = servers.get(mode, tree_server), costs.get(mode, costs["tree"])
                if ft and round_ is not None:
                    timed.append(LatencyRun(f"fast-{runs}", mode, max_per_trigger, round_))
                measure: Any = _measure
                if ft and fail_rate:
                    markers = Path(tempfile.mkdtemp(prefix=f"flaky-{runs}-", dir=marks))
                    measure = _FailingMeasure(fail_rate, str(markers))
                settings = FTSettings(server.address) if ft else FTSettings(enabled=False)
                tasks = FTTasks(settings, on_error="fail-record" if ft else "fail-task")
                reader = (
                    spark.readStream.format("ftkafka")
                    .option("kafka.bootstrap.servers", bootstrap)
                    .option("subscribe", topic)
                    .option("startingOffsets", "earliest")
                    .option("maxOffsetsPerTrigger", str(max_per_trigger))
                    .option("ft.sourceName", f"fast-{runs}")
                )
                if ft:
                    reader = (
                        reader.option("ft.address", server.address)
                        .option("ft.completion", mode)
                        .option("ft.persist", persist)
                        .option("ft.treeRanges", str(tree_ranges).lower())
                    )
                measured = tasks.map_batches(reader.load(), measure, schema)
                kept = tasks.filter_batches(measured, _long)
                counted = [0]
                lock = threading.Lock()

                def count(df: Any, _epoch: int) -> None:
                    n = df.count()
                    with lock:
                        counted[0] += n

                measured_as: tuple[Any, ...] | None = None
                if ft and round_ is not None:  # rounds past `rounds` apart (_more_rounds)
                    measured_as = (max_per_trigger, mode, *(("more",) if round_ >= rounds else ()))
                with cost.run(measured_as, records):
                    started = time.perf_counter()
                    query = (
                        kept.writeStream.foreachBatch(ft_foreach_batch(count, settings))
                        .option("checkpointLocation", str(work / f"checkpoint-{runs}"))
                        .trigger(processingTime="0 seconds")
                        .start()
                    )
                    try:
                        _wait(query, counted, expected, server.address, ft, deadline_s)
                        wall = time.perf_counter() - started
                        busy = _processing_s(query, records + (failing if ft else 0))
                    finally:
                        stop_when_idle(query)
                return busy, wall

            for mode in WARM_UP:  # Python workers, the JVM's JIT of each mode's paths
                run(sizes[-1], mode, None)
            consumer_s: list[float] = []
            seconds: dict[int, dict[str, list[float]]] = {
                size: {"off": [], "tree": [], "barrier": []} for size in sizes
            }
            walls: dict[int, dict[str, list[float]]] = {
                size: {"off": [], "tree": [], "barrier": []} for size in sizes
            }
            for r in range(rounds):
                consumer_s.append(_bare_consumer(bootstrap, topic, partitions, records))
                for size in sizes:
                    for mode in _order(r):
                        busy, wall = run(size, mode, r)
                        seconds[size][mode].append(busy)
                        walls[size][mode].append(wall)
            for size in sizes:  # more rounds where runs are short (MIN_TIMED_S)
                r = rounds
                while _more_rounds(seconds[size], r, rounds):
                    for mode in _order(r):
                        busy, wall = run(size, mode, r)
                        seconds[size][mode].append(busy)
                        walls[size][mode].append(wall)
                    r += 1
            with FTClient(tree_server.address) as client:
                status = client.status()  # the complete latency: tree mode's
            with FTClient(barrier_server.address) as client:
                failed = {
                    cause: n + status["failed"][cause]
                    for cause, n in client.status()["failed"].items()
                }
    consumer_rate = records / statistics.median(consumer_s)
    per_size: dict[str, Any] = {}
    meets = True
    for size in sizes:
        rate = {mode: records / statistics.median(s) for mode, s in seconds[size].items()}
        row: dict[str, Any] = {
            "ft_off_records_per_s": round(rate["off"]),
            "ft_tree_records_per_s": round(rate["tree"]),
            "ft_barrier_records_per_s": round(rate["barrier"]),
            "ratio_tree_vs_off": round(rate["tree"] / rate["off"], 3),
            "ratio_barrier_vs_off": round(rate["barrier"] / rate["off"], 3),
            "ratio_off_vs_consumer": round(rate["off"] / consumer_rate, 3),
            "rounds": len(seconds[size]["off"]),
            "seconds": {m: [round(x, 2) for x in s] for m, s in seconds[size].items()},
            "wall_seconds": {m: [round(x, 2) for x in s] for m, s in walls[size].items()},
            **_by_mode(costs, size),
        }
        per_size[str(size)] = row
    targets = _targets(fail_rate, persist)
    for size in sizes:
        row = per_size[str(size)]
        if size in _TARGET_SIZES and "ratio_tree_vs_off" in targets:
            meets &= row["ratio_tree_vs_off"] >= TARGET_TREE
            meets &= row["ratio_barrier_vs_off"] >= TARGET_BARRIER
    largest = per_size[str(sizes[-1])]
    meets &= largest["ratio_off_vs_consumer"] >= TARGET_CONSUMER
    top = costs["barrier"].figures((size, "barrier") for size in sizes)
    for figure in ("server_cpu_us_per_record", "lmdb_bytes_per_record"):
        if figure in targets:
            meets &= top[figure] is not None and top[figure] <= targets[figure]
    results = {
        "bench": "pipeline-fast",
        "records": records,
        "partitions": partitions,
        "rounds": rounds,
        "value_bytes": _VALUE_BYTES,
        "expected_rows": expected,
        "fail_rate": fail_rate,
        "failing_records_per_ft_run": failing,
        "persist": persist,
        "tree_ranges": tree_ranges,
        **top,
        "consumer_records_per_s": round(consumer_rate),
        "consumer_seconds": [round(s, 2) for s in consumer_s],
        "batch_sizes": per_size,
        "ft_timeouts": failed["timeout"],
        "ft_failed": failed,
        "complete_latency": complete_latency(status, topic, timed),
        "targets": targets,
        "meets_targets": bool(meets),
    }
    return results


def _targets(fail_rate: float, persist: str) -> dict[str, Any]:
    """The targets that apply to a run with these options (module docstring)."""
    targets: dict[str, Any] = {"ratio_off_vs_consumer_at_largest": TARGET_CONSUMER}
    if persist != "reference":
        return targets
    if fail_rate:
        targets["server_cpu_us_per_record"] = TARGET_SERVER_CPU_US
    else:
        targets["ratio_tree_vs_off"] = TARGET_TREE
        targets["ratio_barrier_vs_off"] = TARGET_BARRIER
        targets["at_batch_sizes"] = list(_TARGET_SIZES)
        targets["lmdb_bytes_per_record"] = TARGET_LMDB_BYTES
    return targets


def _by_mode(costs: dict[str, ServerCost], size: int) -> dict[str, dict[str, Any]]:
    """Both server figures of one batch size, per FT mode (each mode's own server),
    over every round it ran."""
    found = {
        mode: cost.figures([(size, mode), (size, mode, "more")]) for mode, cost in costs.items()
    }
    return {
        f"{figure}_by_mode": {mode: f[figure] for mode, f in found.items()}
        for figure in (
            "server_cpu_us_per_record",
            "lmdb_bytes_per_record",
            "server_requests",
            "server_threads",
            "store_commits_per_1000_records",
        )
        if any(figure in f for f in found.values())
    }


MIN_TIMED_S = 10.0
"""A batch size whose runs are short gets rounds beyond `rounds` until every mode's
timed runs add up to this many seconds (at most MAX_ROUNDS_FACTOR times `rounds`, and
at least 6 rounds allowed): a run of 400,000 records at 200,000 a batch is two batches
and 2 s, and a round's runs differ by up to 10% from one round to the next, so the
median of two rounds said 0.92 to 1.0 for the same code; the median of five or six
holds within a few hundredths. The figures of a size say how many rounds it ran."""

MAX_ROUNDS_FACTOR = 3


def _more_rounds(seconds: dict[str, list[float]], done: int, rounds: int) -> bool:
    """Whether a batch size whose modes took `seconds` in `done` rounds runs another."""
    cap = max(MAX_ROUNDS_FACTOR * rounds, 6)
    return done < cap and min(sum(s) for s in seconds.values()) < MIN_TIMED_S


_MODES = ("off", "tree", "barrier")
WARM_UP = _MODES
"""The untimed runs first, one per mode at the largest batch size: the JVM keeps
compiling the paths of each mode for several runs (a mode run first after a warm-up of
another paid for it), and a mode's first run starts its Python workers' imports."""


def _order(round_: int) -> tuple[str, ...]:
    """The modes of round `round_`, rotated by one each round: a run's place in the
    round (after the previous query's clean-up, the server's deferred deletes, the
    JVM's collections) weighs on it, and rotating spreads that over the modes."""
    shift = round_ % len(_MODES)
    return _MODES[shift:] + _MODES[:shift]


def _processing_s(query: Any, records: int) -> float:
    """The seconds the query's batches that read records took (Spark's triggerExecution,
    from its progress reports): the run without the query's start, which is the same
    for FT on and off and would only pull the ratios towards 1. The last batch's report
    comes just after its sink returned: waited for."""
    deadline = time.monotonic() + 60
    while True:
        total_ms = rows = 0
        for progress in query.recentProgress:
            data = progress if isinstance(progress, dict) else json.loads(progress.json)
            if data.get("numInputRows", 0) > 0:
                total_ms += int(data["durationMs"]["triggerExecution"])
                rows += int(data["numInputRows"])
        if rows >= records:
            return total_ms / 1000
        if time.monotonic() > deadline:
            raise RuntimeError(f"bench fast: progress reports cover {rows} of {records} rows")
        time.sleep(0.05)


_PENDING_POLL_S = 0.1
"""How often the wait below asks the server, once the sink counted every row."""


def _pending(client: FTClient) -> int:
    """The roots pending at the server, by its brief STATUS (what the source's driver
    reads per batch): the wait below polls it every `_PENDING_POLL_S` until a run's last
    barrier. Each poll costs the server CPU (0.1 to 0.4 ms, the whole reply with its
    meters, checkpoints and request costs some 0.8 ms) that is counted in the run's
    server figures though no pipeline sends it: hence the brief reply, and a poll a
    tenth of a second rather than one per sink count."""
    return sum(client.brief_status().pending_by_source.values())


def _wait(
    query: Any, counted: list[int], expected: int, address: str, ft: bool, deadline_s: float
) -> None:
    """Until the sink counted `expected` rows and (FT on) nothing is pending."""
    deadline = time.monotonic() + deadline_s
    asked = 0.0  # when `_pending` was last polled
    with FTClient(address, name="bench-fast") as client:
        while True:
            if query.exception() is not None:
                raise RuntimeError(f"the bench query failed: {query.exception()}")
            if counted[0] >= expected and (not ft or time.monotonic() - asked >= _PENDING_POLL_S):
                asked = time.monotonic()
                if not ft or not _pending(client):
                    if counted[0] != expected:
                        raise RuntimeError(f"bench fast: {counted[0]} rows, expected {expected}")
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"bench fast: {counted[0]} of {expected} rows after {deadline_s:g} s"
                )
            time.sleep(0.02)
