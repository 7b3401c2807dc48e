"""`ftlayer bench pipeline`: the demo's pipeline with FT on against FT off, in one run.

One embedded Tansu broker, one FT-layer process (`ftlayer serve`) and one local Spark
session (`local[2,64]`: two task threads; a failed task may be retried 63 times, which
Spark's own handling of the failure runs below needs) serve every phase. The events
are the demo's (`integration.harness.demo.event`), produced once to an input topic; the
pipeline is the demo's (ftkafka source -> parse -> enrich -> filter -> Kafka sink),
each phase writing to its own output topic and checkpoint.

1. Throughput. After an untimed warm-up run, `rounds` alternating triples of runs, FT
   off, FT on in tree mode and FT on in barrier mode (`ft.completion`), without
   failures. A run is timed from the query's start until every expected output is in its
   topic (and, FT on, no tree is pending). Reported: the median records/s of each and
   the ratios on/off (target >= 0.9 in tree mode, >= 0.95 in barrier mode), the
   complete latency of each FT-on run where the server measures it
   (`integration.harness.benchlatency`), and the FT-layer server process's CPU and
   storage writes per record over the timed runs of each mode
   (`integration.harness.benchcost`; barrier mode's at the top level). With `observe`,
   each round also runs barrier mode with `ft.replayColumn` and `ft_observe` at the
   source and before the sink (integration.observe): its ratio to barrier mode is the
   cost of ftlayer's figures in Spark's progress. And barrier mode with `ft_observe` at
   the source and the Kafka sink inside the query's plan (`ft_kafka_stream`,
   integration.kafkastream: acked and failed rows in the progress too) instead of the
   foreachBatch sink: its ratio to barrier mode, and the rows its progress says it acked
   (the expected outputs, when the progress of every batch is still in
   `recentProgress`). And barrier mode with the tasks observed (`FTTasks(settings,
   observe=True)`, integration.tasks.observed: each step's records, outputs and failures
   by cause in the progress): its ratio to barrier mode, and the records its parse
   step's progress says it read (the source's records, when every batch is still in
   `recentProgress`).
2. Failures. The same pipeline where enrich fails a `fail_rate` share of the events
   the first time it sees each (first sight = an O_EXCL marker file), once under
   ftlayer (FailException: that record's tree fails and is replayed) and once under
   Spark's own handling (FT off, the exception fails the task, Spark retries it and
   the retry reads the whole input partition again). Every enrich call is counted (one
   byte appended to a per-process file, so calls in failed task attempts count too).
   Reported per side: records processed again per failed record, (calls - events) /
   failed events; target for ftlayer <= 1.05.

Every FT-on run has `ft.persist` = `persist`; every run is followed by a pause of a
second (the server's deferred deletes of the run: `benchcost.SETTLE_S`).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ftlayer.client import FTClient
from ftlayer.errors import ConfigError, FailException
from ftlayer.integration.ftcolumns import FTSettings
from ftlayer.integration.harness.benchcost import ServerCost
from ftlayer.integration.harness.benchlatency import LatencyRun, complete_latency
from ftlayer.integration.harness.broker import TansuBroker
from ftlayer.integration.harness.demo import (
    ENRICHED_SCHEMA,
    PARSED_SCHEMA,
    event,
    is_flaky,
    keep,
    make_enrich,
    parse,
    passes_filter,
    stop_when_idle,
)
from ftlayer.integration.harness.ftprocess import FTServerProcess
from ftlayer.integration.harness.kafka import create_topic, end_offsets, produce

__all__ = ["bench_pipeline"]

PIPELINE_TARGET_RATIO = 0.9
PIPELINE_TARGET_RATIO_BARRIER = 0.95
PIPELINE_TARGET_REPROCESSED = 1.05


class _Counted:
    """Wraps enrich: every call appends one byte to a file of this process first."""

    def __init__(self, inner: Callable[[dict[str, Any]], dict[str, Any]], directory: str) -> None:
        self.inner = inner
        self.directory = directory
        self._fd: int | None = None
        self._pid = -1

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._fd = os.open(
                os.path.join(self.directory, f"calls-{self._pid}"),
                os.O_WRONLY | os.O_CREAT | os.O_APPEND,
            )
        assert self._fd is not None
        os.write(self._fd, b".")
        return self.inner(row)

    def __getstate__(self) -> dict[str, Any]:
        return {"inner": self.inner, "directory": self.directory}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["inner"], state["directory"])  # type: ignore[misc]


def _spark_enrich(flaky_dir: str, fail_rate: float) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """enrich whose first-sight failures are plain exceptions: Spark's own handling."""
    inner = make_enrich(flaky_dir, fail_rate)

    def enrich(row: dict[str, Any]) -> dict[str, Any]:
        try:
            return inner(row)
        except FailException as exc:
            raise RuntimeError(str(exc)) from None

    return enrich


def _calls(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.glob("calls-*"))


def _observed_acked(query: Any) -> int:
    """The rows the in-plan sink acked, summed over the query's recent progress."""
    return sum(
        int(p["observedMetrics"]["ftlayer.sink"]["acked"])
        for p in query.recentProgress
        if "ftlayer.sink" in (p["observedMetrics"] or {})
    )


def _observed_parsed(query: Any) -> int:
    """The records the observed parse step read, summed over the query's recent progress."""
    name = "ftlayer.step.map(parse)"
    return sum(
        int(p["observedMetrics"][name]["records"])
        for p in query.recentProgress
        if name in (p["observedMetrics"] or {})
    )


def bench_pipeline(
    records: int = 100_000,
    partitions: int = 4,
    fail_rate: float = 0.001,
    rounds: int = 2,
    max_per_trigger: int = 50_000,
    deadline_s: float = 900.0,
    observe: bool = False,
    persist: str = "reference",
) -> dict[str, Any]:
    """See the module docstring; returns the figures."""
    from ftlayer.integration.kafkastream import ft_kafka_stream
    from ftlayer.integration.observe import ft_observe
    from ftlayer.integration.sinks import ft_kafka_sink
    from ftlayer.integration.source import register
    from ftlayer.integration.spark import local_spark
    from ftlayer.integration.tasks import FTTasks

    if records < 1 or partitions < 1 or rounds < 1 or not 0 < fail_rate < 1:
        raise ConfigError("need records, partitions, rounds >= 1 and 0 < fail_rate < 1")
    if persist not in ("reference", "payload"):
        raise ConfigError(f"persist is 'reference' or 'payload', not {persist!r}")
    users = 1_000
    expected = sum(1 for i in range(records) if passes_filter(i))
    with (
        tempfile.TemporaryDirectory(prefix="ftlayer-bench-pipeline-") as tmp,
        TansuBroker(log_path=Path(tmp) / "broker.log") as broker,
    ):
        work = Path(tmp)
        bootstrap = broker.bootstrap
        source_topic = "bench-events"
        create_topic(bootstrap, source_topic, partitions)
        produce(bootstrap, source_topic, (event(i, users) for i in range(records)), timeout=600)
        with FTServerProcess(work / "ft", "--tree-timeout-s", "60") as server:
            spark = local_spark(master="local[2,64]", app_name="ftlayer-bench-pipeline")
            register(spark)
            runs = 0
            timed: list[LatencyRun] = []
            cost = ServerCost(server.pid)

            def run(
                ft: bool,
                enrich: Callable[[dict[str, Any]], dict[str, Any]],
                completion: str = "tree",
                round_: int | None = None,
                observed: bool = False,
                in_plan: bool = False,
                steps_observed: bool = False,
            ) -> float:
                """One run; with `round_`, a timed one whose latency is reported."""
                nonlocal runs
                runs += 1
                out = f"bench-out-{runs}"
                if ft and round_ is not None:
                    timed.append(LatencyRun(out, completion, max_per_trigger, round_))
                create_topic(bootstrap, out, partitions)
                settings = FTSettings(server.address) if ft else FTSettings(enabled=False)
                tasks = FTTasks(
                    settings,
                    on_error="fail-record" if ft else "fail-task",
                    observe=steps_observed,
                )
                reader = (
                    spark.readStream.format("ftkafka")
                    .option("kafka.bootstrap.servers", bootstrap)
                    .option("subscribe", source_topic)
                    .option("maxOffsetsPerTrigger", str(max_per_trigger))
                    .option("ft.sourceName", out)  # each run replays only its own records
                )
                if ft:
                    reader = (
                        reader.option("ft.address", server.address)
                        .option("ft.partitioner", "kafka-hash")
                        .option("ft.completion", completion)
                        .option("ft.persist", persist)
                        .option("ft.replayColumn", str(observed).lower())
                    )
                source = reader.load()
                if observed:
                    source = ft_observe(source, "ftlayer.source")
                parsed = tasks.map(source, parse, PARSED_SCHEMA)
                kept = tasks.filter(tasks.map(parsed, enrich, ENRICHED_SCHEMA), keep)
                if observed and not in_plan:
                    kept = ft_observe(kept, "ftlayer.sink")
                with cost.run(completion if ft and round_ is not None else None, records):
                    started = time.perf_counter()
                    writer = (
                        ft_kafka_stream(kept, bootstrap, out, settings)
                        if in_plan
                        else kept.writeStream.foreachBatch(ft_kafka_sink(bootstrap, out, settings))
                    )
                    query = (
                        writer.option("checkpointLocation", str(work / f"checkpoint-{runs}"))
                        .trigger(processingTime="200 milliseconds")
                        .start()
                    )
                    try:
                        _wait_for_outputs(
                            query, bootstrap, out, expected, server.address, ft, deadline_s
                        )
                        elapsed = time.perf_counter() - started
                    finally:
                        stop_when_idle(query)
                if in_plan:
                    in_plan_acked.append(_observed_acked(query))
                if steps_observed:
                    steps_parsed.append(_observed_parsed(query))
                return elapsed

            plain = make_enrich(str(work / "never"), 0.0)
            run(True, plain)  # warm-up: JIT, Python workers, Kafka producers
            off_s, on_s, barrier_s, observed_s, in_plan_s, steps_s = [], [], [], [], [], []
            in_plan_acked: list[int] = []
            steps_parsed: list[int] = []
            for r in range(rounds):
                off_s.append(run(False, plain))
                on_s.append(run(True, plain, "tree", r))
                barrier_s.append(run(True, plain, "barrier", r))
                if observe:
                    observed_s.append(run(True, plain, "barrier", observed=True))
                    in_plan_s.append(run(True, plain, "barrier", observed=True, in_plan=True))
                    steps_s.append(run(True, plain, "barrier", steps_observed=True))

            reprocessed: dict[str, float] = {}
            flaky_events = sum(1 for i in range(records) if is_flaky(i, fail_rate))
            for name, ft in (("ftlayer", True), ("spark", False)):
                flaky_dir, calls_dir = work / f"flaky-{name}", work / f"calls-{name}"
                flaky_dir.mkdir()
                calls_dir.mkdir()
                inner = (
                    make_enrich(str(flaky_dir), fail_rate)
                    if ft
                    else _spark_enrich(str(flaky_dir), fail_rate)
                )
                run(ft, _Counted(inner, str(calls_dir)))
                failed = len(list(flaky_dir.iterdir()))
                reprocessed[name] = round((_calls(calls_dir) - records) / max(1, failed), 3)
                reprocessed[f"{name}_failed_events"] = failed
            with FTClient(server.address) as client:
                status = client.status()
    off_rate = records / statistics.median(off_s)
    on_rate = records / statistics.median(on_s)
    barrier_rate = records / statistics.median(barrier_s)
    ratio = on_rate / off_rate
    barrier_ratio = barrier_rate / off_rate
    observed: dict[str, Any] = {}
    if observed_s:  # ft_observe at the source and the sink, against the same runs without
        observed_rate = records / statistics.median(observed_s)
        observed = {
            "ft_on_barrier_observed_records_per_s": round(observed_rate),
            "ratio_observed_vs_barrier": round(observed_rate / barrier_rate, 3),
            "ft_on_barrier_observed_seconds": [round(s, 2) for s in observed_s],
        }
    if in_plan_s:  # ft_observe at the source, ft_kafka_stream: the sink in the plan
        in_plan_rate = records / statistics.median(in_plan_s)
        observed |= {
            "ft_on_barrier_in_plan_records_per_s": round(in_plan_rate),
            "ratio_in_plan_vs_barrier": round(in_plan_rate / barrier_rate, 3),
            "ft_on_barrier_in_plan_seconds": [round(s, 2) for s in in_plan_s],
            "in_plan_observed_acked": in_plan_acked,
            "expected_outputs": expected,
        }
    if steps_s:  # FTTasks(observe=True): every step's figures in the progress
        steps_rate = records / statistics.median(steps_s)
        observed |= {
            "ft_on_barrier_steps_observed_records_per_s": round(steps_rate),
            "ratio_steps_observed_vs_barrier": round(steps_rate / barrier_rate, 3),
            "ft_on_barrier_steps_observed_seconds": [round(s, 2) for s in steps_s],
            "steps_observed_parse_records": steps_parsed,
        }
    return {
        **observed,
        "bench": "pipeline",
        "records": records,
        "partitions": partitions,
        "rounds": rounds,
        "fail_rate": fail_rate,
        "flaky_events": flaky_events,
        "ft_off_records_per_s": round(off_rate),
        "ft_on_records_per_s": round(on_rate),
        "ratio_on_vs_off": round(ratio, 3),
        "ft_on_barrier_records_per_s": round(barrier_rate),
        "ratio_barrier_vs_off": round(barrier_ratio, 3),
        "ft_off_seconds": [round(s, 2) for s in off_s],
        "ft_on_seconds": [round(s, 2) for s in on_s],
        "ft_on_barrier_seconds": [round(s, 2) for s in barrier_s],
        "persist": persist,
        **cost.figures(["barrier"]),
        **cost.by_mode({"tree": ["tree"], "barrier": ["barrier"]}),
        "reprocessed_per_failed_ftlayer": reprocessed["ftlayer"],
        "reprocessed_per_failed_spark": reprocessed["spark"],
        "failed_events_ftlayer": reprocessed["ftlayer_failed_events"],
        "failed_events_spark": reprocessed["spark_failed_events"],
        "ft_failed_explicit": status["failed"]["explicit"],
        "ft_timeouts": status["failed"]["timeout"],
        "max_offsets_per_trigger": max_per_trigger,
        "complete_latency": complete_latency(status, source_topic, timed),
        "targets": {
            "ratio_on_vs_off": PIPELINE_TARGET_RATIO,
            "ratio_barrier_vs_off": PIPELINE_TARGET_RATIO_BARRIER,
            "reprocessed_per_failed_ftlayer": PIPELINE_TARGET_REPROCESSED,
        },
        "meets_targets": ratio >= PIPELINE_TARGET_RATIO
        and barrier_ratio >= PIPELINE_TARGET_RATIO_BARRIER
        and reprocessed["ftlayer"] <= PIPELINE_TARGET_REPROCESSED,
    }


def _wait_for_outputs(
    query: Any,
    bootstrap: str,
    topic: str,
    expected: int,
    address: str,
    ft: bool,
    deadline_s: float,
) -> None:
    """Until `expected` records are in `topic` and (FT on) nothing is pending."""
    deadline = time.monotonic() + deadline_s
    with FTClient(address, name="bench-pipeline") as client:
        while True:
            if query.exception() is not None:
                raise RuntimeError(f"the bench query failed: {query.exception()}")
            written = sum(end_offsets(bootstrap, topic).values())
            if written >= expected and (not ft or client.status()["pending"] == 0):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"bench pipeline: {written} of {expected} outputs after {deadline_s:g} s"
                )
            time.sleep(0.1)
