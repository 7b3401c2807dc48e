"""`ftlayer demo --source http|jetstream`: the demo's pipeline on a source that cannot
replay, end to end on real parts, with its own verdict.

The events of the Kafka demo (integration.harness.demo: keyed JSON, 1% flaky in
enrich, about 3 in 97 dropped by the filter) come from an upstream that cannot replay
(integration.harness.upstreams): webhooks POSTed to `ftlayer ingest http` receivers,
or a JetStream stream read by `ftlayer ingest jetstream` receivers. The receivers store
them in the FT layer (a real `ftlayer serve`) before they acknowledge them upstream,
and the query reads them with the `ftingest` source:

    ftingest source -> parse (JSON) -> enrich (flaky) -> filter -> Kafka sink

(the sink's topic on an embedded Tansu broker). With `kill_receiver`, once a third of
the events were acknowledged upstream, a receiver is SIGKILLed and another started in
its place a second later: the webhook sender sends what was not answered 200 again,
JetStream redelivers what was not acknowledged, and the FT layer drops the second
copies of what the dead receiver had stored (the records' ids, or their stream
sequences).

The verdict counts against what was acknowledged upstream (`acked_upstream`: the
events whose upstream was told they are safe): `lost` is the acknowledged events that
passed the filter and are not in the output topic; `duplicates_at_sink` the extra
copies there. It exits 0 only with every event acknowledged upstream, lost = 0, no
tree pending, `completed` = the events the sink accounts for, and the receiver killed
when asked.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Final

from ftlayer.client import FTClient
from ftlayer.integration.harness.broker import TansuBroker
from ftlayer.integration.harness.demo import (
    DemoError,
    DemoResult,
    close_spark_log,
    demo_workdir,
    event,
    passes_filter,
    spark_log_path,
    start_pipeline,
    stop_when_idle,
)
from ftlayer.integration.harness.demoshards import start_shards
from ftlayer.integration.harness.kafka import create_topic, read_all
from ftlayer.integration.harness.upstreams import HttpUpstream, JetStreamUpstream, Upstream
from ftlayer.status import Status

__all__ = ["INGEST_SOURCES", "run_ingest_demo"]

INGEST_SOURCES: Final = ("http", "jetstream")
_SOURCE_NAME: Final = "demo-events"


def run_ingest_demo(
    source: str,
    records: int = 100_000,
    fail_rate: float = 0.01,
    partitions: int = 4,
    *,
    kill_receiver: bool = False,
    receivers: int = 1,
    users: int = 1_000,
    max_per_trigger: int = 20_000,
    ft_timeout_s: float = 20.0,
    deadline_s: float = 900.0,
    workdir: str | None = None,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    on_kill: Callable[[str], None] | None = None,
    completion: str = "barrier",
    http_port: int | None = None,
) -> DemoResult:
    """Run the demo on `source` ("http" or "jetstream"; module docstring)."""
    from ftlayer.integration.source import register
    from ftlayer.integration.spark import local_spark

    if source not in INGEST_SOURCES:
        raise DemoError(f"source must be one of {INGEST_SOURCES}, got {source!r}")
    if records < 1 or partitions < 1 or receivers < 1 or not 0 <= fail_rate <= 1:
        raise DemoError("need records >= 1, partitions >= 1, receivers >= 1, 0 <= fail_rate <= 1")
    started = time.monotonic()
    spark_log = spark_log_path(workdir)
    events = [event(i, users) for i in range(records)]
    with (
        demo_workdir(workdir) as work,
        TansuBroker(log_path=work / "broker.log") as broker,
        contextlib.ExitStack() as parts,
    ):
        sink_topic = "demo-enriched"
        create_topic(broker.bootstrap, sink_topic, partitions)
        serve_args = ["--tree-timeout-s", str(ft_timeout_s)]
        (server,) = start_shards(parts, work, 1, serve_args, http_port)
        upstream: Upstream
        common: dict[str, Any] = {"workdir": work, "receivers": receivers}
        if source == "http":
            upstream = HttpUpstream(server.address, _SOURCE_NAME, partitions, events, **common)
        else:
            from ftlayer.integration.harness.nats import NatsServer

            nats = parts.enter_context(NatsServer(work / "nats", log_path=work / "nats.log"))
            upstream = JetStreamUpstream(
                server.address, _SOURCE_NAME, partitions, events,
                nats_url=nats.url, stream=f"demo{uuid.uuid4().hex[:6]}", **common,
            )  # fmt: skip
        parts.enter_context(upstream)
        upstream.start()  # the receivers register the source
        spark = local_spark(master="local[2,8]", app_name="ftlayer-demo", log_file=spark_log)
        spark.sparkContext.setLogLevel("WARN")
        stop = threading.Event()
        killer = threading.Thread(
            target=_kill_receiver_midway,
            args=(upstream, records, stop, on_kill),
            name="receiver-killer",
            daemon=True,
        )
        query = None
        try:
            register(spark)
            options = {
                "subscribe": _SOURCE_NAME,
                "ft.address": server.address,
                "maxOffsetsPerTrigger": str(max_per_trigger),
                "ft.maxRetries": "10",
                "ft.completion": completion,
            }
            query = start_pipeline(
                spark, options, sink_topic, work / "checkpoint", work / "flaky", fail_rate,
                source_format="ftingest", sink_bootstrap=broker.bootstrap,
            )  # fmt: skip
            (work / "flaky").mkdir(exist_ok=True)
            if kill_receiver:
                killer.start()
            status = _wait_until_settled(query, server.address, upstream, deadline_s, on_progress)
        finally:
            stop.set()
            if killer.is_alive():
                killer.join(60)
            if query is not None:
                stop_when_idle(query)
            spark.stop()
            close_spark_log(spark_log)
        acked = upstream.acked
        outputs = read_all(broker.bootstrap, sink_topic, timeout=120)
    found = [json.loads(r.value)["id"] for r in outputs if r.value is not None]
    distinct = set(found)
    # The events acknowledged upstream are the first `acked`: both senders go in order.
    expected = {i for i in range(min(acked, records)) if passes_filter(i)}
    dropped = min(acked, records) - len(expected)
    failed = status.failed
    return DemoResult(
        produced=records,
        completed=status.completed,
        lost=len(expected - distinct),
        replayed=sum(int(v) for v in failed.values()),
        failed_explicit=int(failed.get("explicit", 0)),
        timeouts=int(failed.get("timeout", 0)),
        duplicates_at_sink=len(found) - len(distinct),
        seconds=round(time.monotonic() - started, 1),
        expected_outputs=len(expected),
        outputs_at_sink=len(found),
        trees_completed=status.completed,
        workers_killed=0,
        pending_at_end=status.pending,
        extra={
            "source": source,
            "acked_upstream": acked,
            "receivers": receivers,
            "kill_receiver": kill_receiver,
            "receivers_killed": upstream.receivers_killed,
            "ingested": status.ingested,
            # Second copies the FT layer dropped: what a killed receiver had stored and
            # its upstream sent again.
            "ingest_duplicates": status.ingest_duplicates,
            "partitions": partitions,
            "fail_rate": fail_rate,
            "completion": completion,
            "completed_at_sink": len(distinct & expected) + dropped,
            "persisted_again": status.persisted - records,
            "cluster": "local",
            "shards": 1,
        },
    )


def _kill_receiver_midway(
    upstream: Upstream,
    records: int,
    stop: threading.Event,
    on_kill: Callable[[str], None] | None,
) -> None:
    """Once a third of the events were acknowledged upstream, SIGKILL receiver 0 and
    start another in its place."""
    while not stop.is_set() and upstream.acked < records // 3:
        time.sleep(0.1)
    if stop.is_set():
        return
    pids = upstream.receiver_pids()
    upstream.kill_receiver(0)
    if on_kill is not None:
        on_kill(f"receiver (pid {pids[0] if pids else '?'}) SIGKILLed and started again")


def _wait_until_settled(
    query: Any,
    address: str,
    upstream: Upstream,
    deadline_s: float,
    on_progress: Callable[[dict[str, Any]], None] | None,
) -> Status:
    """Poll until every event was acknowledged upstream, the FT layer ingested them
    all and holds no pending tree (twice in a row), or the deadline; the last STATUS."""
    deadline = time.monotonic() + deadline_s
    settled = 0
    with FTClient(address, reconnect_s=30.0) as client:
        while True:
            if query.exception() is not None:
                raise DemoError(f"the streaming query failed: {query.exception()}")
            error = getattr(upstream, "error", None)
            if error is not None:
                raise DemoError(f"the upstream's sender failed: {error!r}")
            status = client.status()
            acked = upstream.acked
            if on_progress is not None:
                on_progress(
                    {
                        "produced": len(upstream.events),
                        "acked_upstream": acked,
                        "ingested": status.ingested,
                        "completed": status.completed,
                        "pending": status.pending,
                        "replayed": sum(int(v) for v in status.failed.values()),
                    }
                )
            done = upstream.done and status.ingested >= len(upstream.events) and status.pending == 0
            settled = settled + 1 if done else 0
            if settled >= 2 or time.monotonic() > deadline:
                return status
            time.sleep(0.5)
