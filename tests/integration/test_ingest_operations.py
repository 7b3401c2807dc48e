"""Operating sources that cannot replay (issue 30), on real parts: a real `ftlayer
serve`, receivers as processes of their own (`ftlayer ingest http|jetstream`) on a real
nats-server, the `ftingest` source on local Spark, the operator's commands.

- A stalled sink holds the receivers at their limit and loses nothing: while the sink
  waits, the JetStream consumer keeps the rest (num_pending > 0), the HTTP receiver
  answers 503 with Retry-After, and the FT layer's pending records of each source stay
  within the limit and one batch; once the sink resumes, every message reaches it once.
- Poison records end as dead letters the operator finds with `ftlayer dead-letters
  list` (their upstream, identity and cause) and `ftlayer inspect` (the source's name,
  the state, the key and value); after the fix `ftlayer dead-letters requeue` puts them
  back and they complete; STATUS and /metrics count what was ingested.
- Records ingested and not read yet (queued) and records in flight survive `ftlayer
  savepoint create` and `restore` into a new data dir: a query on the restored FT layer
  reads each once, and a redelivery of one after the restore is still dropped.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from fixture_types import MakeTopic
from pyspark import cloudpickle
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming.query import StreamingQuery
from serverproc import Server, StartServer

from ftlayer.errors import FailException
from ftlayer.integration.ftcolumns import FTSettings
from ftlayer.integration.harness.nats import NatsServer, consumer_info
from ftlayer.integration.harness.upstreams import HttpUpstream, JetStreamUpstream
from ftlayer.integration.receivers import Message, Receiver
from ftlayer.integration.sinks import ft_foreach_batch
from ftlayer.integration.tasks import FTTasks
from ftlayer.registration import ingest_source_id

pytestmark = pytest.mark.integration
cloudpickle.register_pickle_by_value(sys.modules[__name__])

PARTITIONS = 2
SCHEMA = "id long, topic string"
DEADLINE_S = 90.0


def events(n: int) -> list[tuple[bytes, bytes]]:
    """Event i: key k<i mod 31>, value the JSON number i (as the upstreams send them)."""
    return [(b"k%d" % (i % 31), b"%d" % i) for i in range(n)]


class StallingSink:
    """A foreachBatch function on the driver: collects the rows of each batch, but first
    waits while the file `stall` exists (a sink that stopped answering)."""

    def __init__(self, stall: Path) -> None:
        self.stall = stall
        self.rows: list[tuple[int, str]] = []
        self.stalled_batches = 0

    def __call__(self, batch: DataFrame, epoch_id: int) -> None:
        if self.stall.exists():
            self.stalled_batches += 1
        while self.stall.exists():
            time.sleep(0.05)
        self.rows.extend((int(r[0]), str(r[1])) for r in batch.collect())


def make_step(bug: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A step that fails every record whose value is a multiple of 100 while the file
    `bug` exists (a bug, fixed by deleting the file)."""

    def step(row: dict[str, Any]) -> dict[str, Any]:
        i = int(row["value"])
        if i % 100 == 0 and os.path.exists(bug):
            raise FailException(f"record {i}: no price for its currency")
        return {"id": i, "topic": row["topic"]}

    return step


def start_query(
    spark: SparkSession,
    server: Server,
    sources: Sequence[str],
    sink: Callable[[DataFrame, int], None],
    checkpoint: Path,
    step: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    max_per_batch: int = 500,
    options: dict[str, str] | None = None,
) -> StreamingQuery:
    settings = FTSettings(server.address)
    source = (
        spark.readStream.format("ftingest")
        .option("subscribe", ",".join(sources))
        .option("ft.address", server.address)
        .option("ft.completion", "tree")
        .option("ft.maxRetries", "1")
        .option("ft.retryBackoffMs", "50")
        .option("maxOffsetsPerTrigger", str(max_per_batch))
        .options(**(options or {}))
        .load()
    )
    step = step or (lambda row: {"id": int(row["value"]), "topic": row["topic"]})
    return (
        FTTasks(settings)
        .map(source, step, SCHEMA)
        .writeStream.foreachBatch(ft_foreach_batch(sink, settings))
        .option("checkpointLocation", str(checkpoint))
        .trigger(processingTime="200 milliseconds")
        .start()
    )


def wait_for(what: str, predicate: Callable[[], bool], query: StreamingQuery | None) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not predicate():
        if query is not None and query.exception() is not None:
            raise AssertionError(f"the query failed: {query.exception()}")
        assert time.monotonic() < deadline, f"not within {DEADLINE_S} s: {what}"
        time.sleep(0.1)


def ftlayer(*args: str) -> str:
    """Run `ftlayer ARGS`; its stdout (exit 0 asserted)."""
    done = subprocess.run(
        [sys.executable, "-m", "ftlayer.cli", *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def ftlayer_json(*args: str) -> Any:
    return json.loads(ftlayer(*args, "--json").splitlines()[-1])


def test_a_stalled_sink_holds_the_receivers_at_the_limit_and_loses_nothing(
    spark: SparkSession, start_server: StartServer, nats_server: NatsServer, tmp_path: Path
) -> None:
    n, limit, fetch = 4000, 1000, 1000  # fetch: the JetStream receiver's --batch default
    server = start_server(None, "--tree-timeout-s", "120")
    stream = f"HOLD{uuid.uuid4().hex[:6].upper()}"
    web, js = f"web-{stream.lower()}", f"js-{stream.lower()}"
    stall = tmp_path / "stall"
    stall.touch()
    sink = StallingSink(stall)
    common: dict[str, Any] = {"workdir": tmp_path, "max_pending": limit}
    with (
        HttpUpstream(server.address, web, PARTITIONS, events(n), chunk=250, **common) as http,
        JetStreamUpstream(
            server.address, js, PARTITIONS, events(n), nats_url=nats_server.url, stream=stream,
            **common,
        ) as jet,
    ):  # fmt: skip
        http.start()
        jet.start()
        query = start_query(
            spark, server, [web, js], sink, tmp_path / "checkpoint", max_per_batch=2000
        )
        try:
            with server.client() as client:

                def held() -> bool:
                    status = client.status()
                    info = asyncio.run(consumer_info(nats_server.url, stream, jet.durable))
                    return (
                        sink.stalled_batches > 0
                        and http.busy > 0
                        and status.pending_of(ingest_source_id(web)) >= limit
                        and status.pending_of(ingest_source_id(js)) >= limit
                        and info.num_ack_pending == 0
                    )

                wait_for("both receivers at their limit behind the stalled sink", held, query)
                for _ in range(10):  # held there, for a while
                    status = client.status()
                    info = asyncio.run(consumer_info(nats_server.url, stream, jet.durable))
                    assert limit <= status.pending_of(ingest_source_id(js)) <= limit + fetch
                    assert limit <= status.pending_of(ingest_source_id(web)) <= limit + http.chunk
                    assert (info.num_pending or 0) > 0 and not jet.done  # the stream keeps the rest
                    assert http.acked < n and not sink.rows
                    time.sleep(0.2)
                assert http.retry_after == {1.0}  # every 503 said when to come again
                busy = http.busy
                stall.unlink()  # the sink answers again
                wait_for("every message at the sink", lambda: len(sink.rows) >= 2 * n, query)

                def settled() -> bool:
                    status = client.status()
                    return http.done and jet.done and status.stored_records == 0

                wait_for("every message acknowledged upstream, every tree complete", settled, None)
                status = client.status()
        finally:
            query.stop()
    for topic in (f"http:{web}", f"jetstream:{stream}"):
        ids = sorted(i for i, row_topic in sink.rows if row_topic == topic)
        assert ids == list(range(n)), topic  # each once, 0 lost
    assert status.ingested == 2 * n and status.stored_records == 0
    print(f"\nstalled sink: {busy} answers 503, {status.ingest_duplicates} copies dropped")


@pytest.mark.parametrize("where", ["store", "topic"])
def test_poison_records_are_dead_letters_the_operator_lists_inspects_and_requeues(
    spark: SparkSession,
    start_server: StartServer,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    tmp_path: Path,
    where: str,
) -> None:
    """Dead letters kept in the store (the default: ftingest reads no Kafka), or written
    to a dead-letter topic (kafka.bootstrap.servers with ft.deadLetterTopic)."""
    n = 1000
    server = start_server(None, "--http-port", "0", "--tree-timeout-s", "60")
    name = f"orders-{uuid.uuid4().hex[:6]}"
    source_id = ingest_source_id(name)
    bug = tmp_path / "bug"
    bug.touch()
    poison = list(range(0, n, 100))
    sink = StallingSink(tmp_path / "never")
    options, in_topic = {}, []
    if where == "topic":
        dead_topic = make_topic(1)
        options = {"kafka.bootstrap.servers": kafka_bootstrap, "ft.deadLetterTopic": dead_topic}
        in_topic = ["--topic", dead_topic, "--bootstrap", kafka_bootstrap]
    with HttpUpstream(server.address, name, PARTITIONS, events(n), workdir=tmp_path) as http:
        http.start()
        step = make_step(str(bug))
        query = start_query(
            spark, server, [name], sink, tmp_path / "checkpoint", step=step, options=options
        )
        try:
            with server.client() as client:

                def settled() -> bool:
                    status = client.status()
                    held = status.dead_letters if where == "store" else status.dead_lettered
                    return (
                        http.done
                        and status.pending == 0
                        and held == len(poison)
                        and status.stored_records == (len(poison) if where == "store" else 0)
                    )

                wait_for("the poison records dead-lettered, the rest complete", settled, query)
                status = client.status()
                assert (status.ingested, status.ingest_duplicates) == (n, 0)
                metrics = _metrics(server)
                assert metrics["ftlayer_records_ingested_total"] == n
                assert metrics["ftlayer_ingest_duplicates_total"] == 0

                # Step 1: the operator lists them: source, upstream, identity, cause.
                server_at = ("--server", server.address)
                listed = ftlayer_json("dead-letters", "list", *server_at, *in_topic)
                letters = listed["letters"]
                assert sorted(x["offset"] for x in letters) == poison
                for letter in letters:
                    assert letter["source_id"] == source_id
                    assert letter["topic"] == f"http:{name}"
                    assert letter["last_cause"]["kind"] == "explicit"
                    assert "no price for its currency" in letter["last_cause"]["error"]
                shown = ftlayer("dead-letters", "list", *server_at, *in_topic)
                assert "no price for its currency" in shown
                if where == "store":
                    assert all(letter["source"] == name for letter in letters)
                    assert f"{name} ({source_id})" in shown

                    # Step 2: inspect one by its upstream and identity.
                    at = ("--topic", f"http:{name}", "--partition", "0", "--offset", "300")
                    found = ftlayer_json("inspect", *server_at, *at)
                    (record,) = found["records"]
                    assert found["verdict"] == "dead-letter" and record["source"] == name
                    assert (record["key"], record["value"], record["ingested"]) == (
                        "k21", "300", True
                    )  # fmt: skip
                    text = ftlayer("inspect", *server_at, *at)
                    assert f"record 300 of upstream http:{name} (source {name}" in text, text
                    assert "dead-lettered" in text and "value '300'" in text, text

                # Step 3: the fix, then requeue (the source by its name): they complete.
                bug.unlink()
                by_source = ["--source", name]
                requeued = ftlayer_json(
                    "dead-letters", "requeue", *server_at, *in_topic, *by_source
                )
                assert requeued["requeued"] == len(poison)

                def done() -> bool:
                    status = client.status()
                    return bool(status.pending == 0 and status.stored_records == 0)

                wait_for("the requeued records complete", done, query)
                status = client.status()
        finally:
            query.stop()
    assert sorted(i for i, _ in sink.rows) == list(range(n))  # each once
    assert status.dead_letters == 0 and status.dead_letters_requeued == len(poison)


def _metrics(server: Server) -> dict[str, float]:
    """The samples of /metrics labelled only by shard, by name."""
    assert server.http_url is not None
    text = urllib.request.urlopen(server.http_url.rstrip("/") + "/metrics").read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or "{" not in line:
            continue
        name, rest = line.split("{", 1)
        labels, value = rest.rsplit("} ", 1)
        if labels == 'shard="0"':
            out[name] = float(value)
    return out


def test_queued_and_in_flight_records_survive_a_savepoint_and_are_read_once(
    spark: SparkSession, start_server: StartServer, tmp_path: Path
) -> None:
    n = 2000
    server = start_server(None, "--tree-timeout-s", "120")
    name = f"clicks-{uuid.uuid4().hex[:6]}"
    source_id = ingest_source_id(name)
    upstream = "jetstream:CLICKS"
    batch = [Message(k, v, identity=i) for i, (k, v) in enumerate(events(n))]
    stall = tmp_path / "stall"
    stall.touch()
    sink = StallingSink(stall)
    with Receiver(server.address, name, partitions=PARTITIONS) as receiver:
        receiver.store(batch[: n // 2], upstream)
        query = start_query(spark, server, [name], sink, tmp_path / "checkpoint-1")
        try:
            wait_for(
                "a batch in flight at the stalled sink", lambda: sink.stalled_batches > 0, query
            )
            receiver.store(batch[n // 2 :], upstream)  # queued: the query waits
            with server.client() as client:
                status = client.status()
            assert status.pending_of(source_id) == n and status.replay_queue > 0
            saved = ftlayer_json(
                "savepoint", "create", "--server", server.address,
                "--dir", str(tmp_path / "savepoints"), "--name", "clicks",
            )  # fmt: skip
            assert saved["stored_records"] == n
        finally:
            stall.unlink()
            query.stop()
    server.kill()
    ftlayer(
        "savepoint", "restore", "clicks", "--dir", str(tmp_path / "savepoints"),
        "--data-dir", str(tmp_path / "restored"),
    )  # fmt: skip
    restored = start_server(tmp_path / "restored", "--tree-timeout-s", "120")
    sink = StallingSink(tmp_path / "never")
    query = start_query(spark, restored, [name], sink, tmp_path / "checkpoint-2")
    try:
        with restored.client() as client:
            wait_for("every record read", lambda: client.status().pending == 0, query)
            wait_for("every row at the sink", lambda: len(sink.rows) >= n, query)
            with Receiver(restored.address, name, partitions=PARTITIONS) as again:
                again.store(batch[:10], upstream)  # a redelivery after the restore
            status = client.status()
    finally:
        query.stop()
    assert sorted(i for i, _ in sink.rows) == list(range(n))  # each once, 0 lost
    assert (status.ingested, status.ingest_duplicates, status.pending) == (0, 10, 0)
