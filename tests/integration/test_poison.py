"""Poison records on real parts (issue 12, part 5): the Tansu broker, a real `ftlayer
serve`, local Spark.

- 50,000 events, 1 in 1,000 always failing (poison) and 1% failing once: every poison
  event lands in the dead-letter topic after exactly maxRetries + 1 attempts, each with
  its cause, the gaps between its attempts following the backoff schedule; every other
  event reaches the sink; the consumer group's committed offsets reach the end offsets
  while the job runs; nothing is lost.
- Dead letters kept in the store are requeued after the "fix" and complete.
- Bad input: a dead-letter topic that does not exist is an error at query start.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fixture_types import MakeTopic
from kafka import KafkaConsumer, TopicPartition
from pyspark import cloudpickle
from pyspark.errors.exceptions.captured import StreamingQueryException
from pyspark.sql import DataFrame, SparkSession
from querywait import wait_for
from serverproc import Server, StartServer

from ftlayer.client import FTClient
from ftlayer.errors import FailException
from ftlayer.integration.ftcolumns import FTSettings
from ftlayer.integration.harness.kafka import end_offsets, produce, read_all
from ftlayer.integration.sinks import ft_foreach_batch
from ftlayer.integration.source.deadletters import history_of
from ftlayer.integration.tasks import FTTasks
from ftlayer.policy import RetryPolicy

cloudpickle.register_pickle_by_value(sys.modules[__name__])

SCHEMA = "id long, value binary"
MAX_RETRIES = 3
BACKOFF_MS, BACKOFF_MAX_MS = 400, 1200
TRIGGER_S = 0.25


def is_poison(i: int) -> bool:
    return i % 1000 == 7


def fails_once(i: int) -> bool:
    return zlib.crc32(i.to_bytes(8, "little")) % 100 == 0 and not is_poison(i)


def make_step(marks: str, fixed: str | None = None) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """Poison events always fail (until the file `fixed` exists); the fails-once events
    fail on first sight (an O_EXCL marker, across Python workers)."""

    def step(row: dict[str, Any]) -> dict[str, Any]:
        event_id = int(row["key"])
        if is_poison(event_id) and not (fixed is not None and os.path.exists(fixed)):
            raise FailException(f"event {event_id} is poison")
        if fails_once(event_id):
            try:
                os.close(os.open(os.path.join(marks, str(event_id)), os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                raise FailException(f"event {event_id}: upstream timed out")
        return {"id": event_id, "value": row["value"]}

    return step


class Collected:
    """The ids a foreachBatch sink wrote, on the driver."""

    def __init__(self) -> None:
        self.ids: list[int] = []

    def __call__(self, batch: DataFrame, epoch_id: int) -> None:
        self.ids.extend(row.id for row in batch.select("id").collect())


def longest_batch_s(query: Any) -> float:
    """The longest of the query's batches (Spark's triggerExecution; its last 100)."""
    durations = [int(p["durationMs"]["triggerExecution"]) for p in query.recentProgress]
    return max(durations, default=0) / 1000


def group_offsets(bootstrap: str, group: str, topic: str) -> dict[int, tuple[int, int]]:
    """Per partition: (end offset, the group's committed offset)."""
    ends = end_offsets(bootstrap, topic)
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    try:
        return {p: (e, consumer.committed(TopicPartition(topic, p)) or 0) for p, e in ends.items()}
    finally:
        consumer.close(autocommit=False)


def group_lag(bootstrap: str, group: str, topic: str) -> int:
    return sum(end - done for end, done in group_offsets(bootstrap, group, topic).values())


def test_poison_events_are_dead_lettered_with_their_causes_and_the_rest_flows(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
) -> None:
    n = 50_000
    server: Server = start_server(None, "--tree-timeout-s", "60")
    settings = FTSettings(server.address)
    topic, dead_topic = make_topic(4), make_topic(1)
    group = f"poison-{uuid.uuid4().hex[:8]}"
    # Every event carries a Kafka header, which the dead-letter topic must keep.
    events = [(str(i).encode(), b"v%d" % i, [("trace", b"t%d" % i)]) for i in range(n)]
    produce(kafka_bootstrap, topic, events)
    marks = tmp_path / "marks"
    marks.mkdir()
    source = (
        spark.readStream.format("ftkafka")
        .option("kafka.bootstrap.servers", kafka_bootstrap)
        .option("subscribe", topic)
        .option("maxOffsetsPerTrigger", "20000")
        .option("ft.address", server.address)
        .option("kafka.group.id", group)
        .option("ft.maxRetries", str(MAX_RETRIES))
        .option("ft.retryBackoffMs", str(BACKOFF_MS))
        .option("ft.retryBackoffMaxMs", str(BACKOFF_MAX_MS))
        .option("ft.deadLetterTopic", dead_topic)
        .load()
    )
    tasks = FTTasks(settings)
    stepped = tasks.map(source, make_step(str(marks)), SCHEMA)
    collected = Collected()
    query = (
        stepped.writeStream.foreachBatch(ft_foreach_batch(collected, settings))
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(processingTime=f"{int(TRIGGER_S * 1000)} milliseconds")
        .start()
    )
    poison = {i for i in range(n) if is_poison(i)}
    try:
        with FTClient(server.address) as client:

            def settled() -> bool:
                status = client.status()
                return (
                    status.persisted >= n
                    and status.pending == 0
                    and status.dead_letters == 0
                    and status.dead_lettered == len(poison)
                )

            wait_for("every tree to complete or be dead-lettered", settled, 240, query)
            try:
                wait_for(
                    "the group lag to reach 0",
                    lambda: group_lag(kafka_bootstrap, group, topic) == 0,
                    30,
                    query,
                )
            except AssertionError as exc:
                shown = group_offsets(kafka_bootstrap, group, topic)
                raise AssertionError(f"{exc}; (end, committed) by partition: {shown}") from None
            status = client.status()
            longest_s = longest_batch_s(query)
    finally:
        query.stop()
    assert status.dead_lettered == len(poison) == 50
    # Every other event reached the sink; no poison event did.
    assert set(collected.ids) == set(range(n)) - poison
    # Every poison event is in the dead-letter topic, key and value as read, with its
    # history: maxRetries + 1 attempts, each with its cause, spaced by the backoff.
    letters = read_all(kafka_bootstrap, dead_topic, timeout=60)
    by_id = {int(r.key): r for r in letters}  # a crash could write one twice: not here
    assert set(by_id) == poison and len(letters) == len(poison)
    steps = [RetryPolicy(MAX_RETRIES, BACKOFF_MS, BACKOFF_MAX_MS).step_s(k) for k in (1, 2, 3)]
    for event_id, record in by_id.items():
        assert record.value == b"v%d" % event_id
        assert record.headers[0] == ("trace", b"t%d" % event_id)  # the original, first
        history = history_of(record.headers)
        assert (history["topic"], int(history["offset"]) >= 0) == (topic, True)
        assert int(history["attempts"]) == MAX_RETRIES + 1
        causes = history["causes"]
        assert [c["kind"] for c in causes] == ["explicit"] * (MAX_RETRIES + 1)
        assert all(f"event {event_id} is poison" in c["error"] for c in causes)
        assert all(c["step"].startswith("map(step)") for c in causes)
        times = [c["at"] for c in causes]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        for attempt, (gap, step) in enumerate(zip(gaps, steps, strict=True)):
            # Not before the backoff; after it, at most the ticker's release (0.5 s), the
            # batch running then, a trigger interval and the replay's batch up to the
            # record: two of the query's longest batches (10 s at least). The first
            # failure of a record read by reference (a batch range's row) also waits for
            # its bytes, which the driver copies in behind the next trigger, so it is
            # replayed a trigger later (user guide 4.10): one batch more.
            batches = 3 if attempt == 0 else 2
            late = max(10.0, 0.5 + TRIGGER_S + batches * longest_s)
            assert 0.8 * step <= gap <= step + late, (event_id, times, longest_s)


@pytest.mark.parametrize("where", ["store", "topic"])
def test_dead_letters_are_requeued_after_the_fix_and_complete(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
    where: str,
) -> None:
    """Dead letters kept in the store, or written to a dead-letter topic, are put back
    by `ftlayer dead-letters requeue` once the fix is deployed, and complete."""
    n = 3000
    server: Server = start_server()
    settings = FTSettings(server.address)
    topic = make_topic(2)
    dead_topic = make_topic(1) if where == "topic" else None
    events = [(str(i).encode(), b"v%d" % i, [("trace", b"t%d" % i)]) for i in range(n)]
    produce(kafka_bootstrap, topic, events)
    marks, fixed = tmp_path / "marks", tmp_path / "fixed"
    marks.mkdir()
    reader = (
        spark.readStream.format("ftkafka")
        .option("kafka.bootstrap.servers", kafka_bootstrap)
        .option("subscribe", topic)
        .option("includeHeaders", "true")
        .option("ft.address", server.address)
        .option("ft.maxRetries", "1")
        .option("ft.retryBackoffMs", "100")
    )
    if dead_topic is not None:
        reader = reader.option("ft.deadLetterTopic", dead_topic)
    stepped = FTTasks(settings).map(reader.load(), make_step(str(marks), str(fixed)), SCHEMA)
    collected = Collected()
    query = (
        stepped.writeStream.foreachBatch(ft_foreach_batch(collected, settings))
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(processingTime="250 milliseconds")
        .start()
    )
    poison = {i for i in range(n) if is_poison(i)}
    try:
        with FTClient(server.address) as client:

            def all_dead() -> bool:
                status = client.status()
                held = status.dead_letters if dead_topic is None else status.dead_lettered
                return (
                    held == len(poison)
                    and status.pending == 0
                    and (dead_topic is None or status.dead_letters == 0)
                )

            wait_for("the poison events to be dead letters", all_dead, 120, query)
            assert not poison & set(collected.ids)
            fixed.touch()  # the fix is deployed
            command = [sys.executable, "-m", "ftlayer.cli", "dead-letters", "requeue"]
            command += ["--server", server.address, "--json"]
            if dead_topic is not None:
                command += ["--topic", dead_topic, "--bootstrap", kafka_bootstrap]
            done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
            assert done.returncode == 0, done.stderr
            assert json.loads(done.stdout.strip().splitlines()[-1]) == {"requeued": len(poison)}
            wait_for(
                "the requeued events to complete",
                lambda: client.status().pending == 0 and poison <= set(collected.ids),
                60,
                query,
            )
            status = client.status()
            assert status.dead_letters == 0 and status.dead_letters_requeued == len(poison)
    finally:
        query.stop()
    assert set(collected.ids) == set(range(n))


def test_a_dead_letter_topic_that_does_not_exist_is_an_error_at_query_start(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    ft_server: Server,
    tmp_path: Path,
) -> None:
    topic = make_topic(1)
    query = (
        spark.readStream.format("ftkafka")
        .option("kafka.bootstrap.servers", kafka_bootstrap)
        .option("subscribe", topic)
        .option("ft.address", ft_server.address)
        .option("ft.deadLetterTopic", "no-such-dead-letters")
        .load()
        .writeStream.format("noop")
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .start()
    )
    with pytest.raises(
        StreamingQueryException,
        match=r"ft\.deadLetterTopic: topic .no-such-dead-letters. does not exist",
    ):
        query.awaitTermination(600)  # the error ends it; a bound for a hang only
    query.stop()


def make_broken_step(marker: str, always: bool) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A step whose code is broken on one executor: every record of the first task that
    runs it (the one that creates `marker`) raises ImportError, as a module missing
    from one worker's environment would; with `always`, every record of every task."""

    def step(row: dict[str, Any]) -> dict[str, Any]:
        from pyspark import TaskContext

        context = TaskContext.get()
        task = f"{context.stageId()}-{context.partitionId()}" if context else "driver"
        if always:
            raise ImportError("No module named 'ujson'")
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
            with open(marker, "w") as f:
                f.write(task)
        except FileExistsError:
            pass
        with open(marker) as f:
            if f.read() == task:
                raise ImportError("No module named 'ujson'")
        return {"id": int(row["key"]), "value": row["value"]}

    return step


@pytest.mark.parametrize("always", [False, True], ids=["one-executor", "every-executor"])
def test_a_batch_wide_import_error_is_retried_once_before_it_dead_letters(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
    always: bool,
) -> None:
    """A programming error that fails every record of a task alike (ImportError here)
    is likely to repeat, but may be one executor's: its records are retried once, in a
    later batch (another task), whatever ft.maxRetries allows, and dead-lettered only if
    that retry fails the same way. One executor's: nothing is dead-lettered and every
    event reaches the sink. Every executor's: every event is dead-lettered after
    exactly 2 attempts, not maxRetries + 1."""
    n = 400
    server: Server = start_server()
    settings = FTSettings(server.address)
    topic = make_topic(2)
    produce(kafka_bootstrap, topic, [(str(i).encode(), b"v%d" % i) for i in range(n)])
    source = (
        spark.readStream.format("ftkafka")
        .option("kafka.bootstrap.servers", kafka_bootstrap)
        .option("subscribe", topic)
        .option("ft.address", server.address)
        .option("ft.maxRetries", "10")
        .option("ft.retryBackoffMs", "100")
        .load()
    )
    stepped = FTTasks(settings).map(
        source, make_broken_step(str(tmp_path / "broken"), always), SCHEMA
    )
    collected = Collected()
    query = (
        stepped.writeStream.foreachBatch(ft_foreach_batch(collected, settings))
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(processingTime="250 milliseconds")
        .start()
    )
    try:
        with FTClient(server.address) as client:
            wait_for(
                "every tree to complete or be dead-lettered",
                lambda: client.status().persisted >= n and client.status().pending == 0,
                120,
                query,
            )
            status = client.status()
            letters = client.dead_letters({}, 1000).letters
    finally:
        query.stop()
    failed = status.failed["explicit"]
    if always:
        assert status.dead_lettered == n and not collected.ids
        assert failed == 2 * n  # each event: its first failure and the one retry
        assert {letter["attempts"] for letter in letters} == {2}
        assert all("ImportError" in c["error"] for x in letters for c in x["causes"])
    else:
        assert status.dead_lettered == 0 and sorted(collected.ids) == list(range(n))
        assert 2 <= failed < n  # the broken task's records, retried once and then fine
