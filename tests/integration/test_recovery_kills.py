"""Recovery, proven by killing things (issue 5, section 3).

A real streaming job (kill_job.py: ftkafka source -> FTTasks.map -> ft_kafka_sink, on
``local[2,4]``, its query checkpointed in a directory) runs in a process group of its
own against the real Tansu broker and a real ``ftlayer serve`` process, while a thread
produces records. Each test SIGKILLs, five times at random moments:

- `driver`: the job's whole process group (the driver's Python process, its Spark JVM
  and every PySpark worker), then starts the job again on the same checkpoint
  directory; Spark runs the batch whose offsets it had logged but not committed again;
- `ft-layer`: the ``ftlayer serve`` process, then starts it again on the same data
  directory and port; the job's clients reconnect and Spark retries the tasks that
  lost their connection;
- `both`: the two at once, then restarts the FT layer and the job.

Then production stops, and the test waits until the job's commits cover every
produced record and the FT layer holds no pending tree. It reads the whole output
topic and checks what a user would notice: every produced record has its output there
(lost = 0, nothing invented), and the extra copies stay within what the kills explain.
The three tests share one stream (the module-scoped `streams` fixture): one job, one
FT-layer data directory, one input and one output topic, since starting Spark is most
of the cost. Each test begins and ends settled, so it counts only the copies its own
kills added; a test that fails leaves the stream to be started afresh for the next.

## The bound on duplicates

Produced values are unique (b"e%06d"), so duplicates = outputs - distinct outputs.
A kill adds copies only of records in flight at it. Let B be the records of the
batches Spark had logged but not committed at the kill (from the checkpoint:
`offsets/<n>` without `commits/<n>`; per batch, the Kafka records between its start
and end offsets plus the width of its replay seq range, which bounds the replays it
took in). Then per kill:

- driver: Spark runs the batches of B again after the restart, under the same batch
  ids, and `ft_kafka_sink` resumes them (integration/resume.py): before a batch
  writes, its write id and start offsets are kept in the FT layer (SINK_MARK), and
  every task of the run again reads back what the dead run wrote under them and skips
  those rows by content. A row is then written twice only if it was in flight at the
  kill (sent by the dead run and appended by the broker after the run again had read
  back; the design allows at most 1 % of B), or if its record is replayed: a root of
  the dead run that timed out before the run again took its record in (each replay
  writes once more; R_k, the records that entered the replay queue from this kill to
  the next, or to the end). A record outside B belongs to a committed batch: its tree
  completed before Spark committed the batch. Bound: ceil(|B| / 100) + R_k.
  (P, the FT layer's `pending` right after the kill, is printed: the dead run's held
  roots, which the run again releases or, after a restart longer than the tree
  timeout, replays, and which R_k counts then.)
- ft-layer: the restarted server restores from its acker journal (ftlayer.core.journal)
  every tree the journal knows, as it was, and replays under a new root (its
  `failed.recovery`, R) only the records whose journal write died with the process:
  persists in flight at the kill, which belong to the running batches, so R <= |B|
  (asserted per kill; before the journal, R was every record stored at the kill,
  pending or completed and not yet deleted). One more copy each. A Spark task that
  lost its connection is retried and writes its rows again; they all belong to B.
  Such a task may also have persisted records in the restarted server before it
  failed: their roots time out there or are taken over by the retry's re-read (F, the
  restarted server's `failed.timeout`, read when it is killed again or at the end;
  roots still pending then are in the next R instead). Bound: |B| + R + F <= 2|B| + F.
  (P cannot be read once the server is dead; the journal restores those roots.)
- both: the dead run's roots are recovered instead of timing out, and B runs again.
  Bound: |B| + R + F, as for the FT layer. Here F also counts recovered records that
  waited in the replay queue longer than the tree timeout while the job restarted:
  they are requeued without a copy, which only loosens the bound.

A test asserts its duplicates <= the sum of its kills' bounds and prints every figure
(run with ``-s``), and records each kill's as a test property (`kill_<n>`): the records
in flight, the duplicates among them, the replays and the bound. A root in flight at
two kills is counted at both: the sum is an upper bound, not an estimate.

## The stall after a driver kill

A thread reads the FT layer's `completed` counter every 0.1 s, and the job prints when
its Python, its SparkSession and its query started, and each batch's progress
(kill_job.py). Each driver kill's stall is split by phase (`stall_phases`): the
restart (the test waits for the dead processes), the process start, the JVM and
SparkSession, the query's restart from its checkpoint, its first batch (the batch
run again, with Spark's phases of that trigger), and the first completion of a tree.
All but the last are Spark's and Python's start-up, the first batch's mostly its
Python workers' imports; the FT layer's part of them is its requests. The last is
the FT layer's: the test asserts trees complete again at most FT_WAIT_S (10 s)
after the restarted query's first batch, so no lease, timeout or reconnect of the
FT layer's holds them longer.

These tests found that a Python worker idle at an FT-layer kill kept its dead
connection and failed its first persist or XOR after the restart, so that tasks of
later batches failed too, and one task used 3 of its 4 attempts; the client now
replaces such a connection before sending (commit 70152bc,
`tests/integration/test_server.py::test_a_client_idle_across_a_restart_persists_and_xors_at_its_next_call`).

## Kill moments

They come from `random.Random(seed)`, a fresh seed per test unless the environment
variable KILL_SEED sets one; every failure names it. A kill comes a random 0-1.5 s
after one of two events since the last restart (the test's start for the first kill),
drawn per kill:

- `persisting` (60%): the FT layer's `persisted` counter grew, so a batch is running
  and has records in flight: the kill lands while its records are read, persisted,
  mapped, written or acked, or just after. After a driver restart this is the re-run
  of the batch the last kill interrupted.
- `committed` (40%): the job committed a batch: the kill lands between batches, while
  Spark plans the next one, or early in it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from jobproc import JOB, Job
from kafka import KafkaProducer

from ftlayer.client import FTClient
from ftlayer.errors import FTLayerError
from ftlayer.integration.harness.broker import free_port
from ftlayer.integration.harness.ftprocess import FTServerProcess
from ftlayer.integration.harness.kafka import (
    create_topic,
    read_all,
    wait_progressing,
)

KILLS = 5
PARTITIONS = 4
TREE_TIMEOUT_S = 20
MAX_OFFSETS_PER_TRIGGER = 500
TRIGGER_MS = 300
# The producer thread: CHUNK records every CHUNK_INTERVAL_S seconds (about 50/s).
CHUNK = 5
CHUNK_INTERVAL_S = 0.1
# Kill moments (module docstring).
KILL_DELAY_S = (0.0, 1.5)
PERSISTING_KILLS = 0.6
# The FT layer stays down this long before its restart (executors wait 10 s for it).
FT_DOWN_S = (0.0, 1.0)
START_STALL_S = 120.0
"""Waits for the job (its start, a batch) fail after this long without progress: no
new line of the job's reports, no new batch logged or committed, no record persisted.
How long a JVM's start or a backlog takes depends on the machine and its load."""
SETTLE_STALL_S = 150.0
SAMPLE_S = 0.1
IN_FLIGHT_SHARE = 0.01
"""A driver kill's rows in flight, written again by the batch's run again: at most this
share of the batches in flight (module docstring)."""
FT_WAIT_S = 10.0
"""After a driver kill, trees complete again at most this long after the restarted
query's first batch: no wait of the FT layer's (a lease, a timeout) is longer."""
OUTPUT_PREFIX = b"out-"


def value_of(i: int) -> bytes:
    return b"e%06d" % i


# ---- the query's checkpoint directory ------------------------------------------------------


def _batch_ids(directory: Path) -> list[int]:
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


@dataclass(frozen=True)
class Checkpoint:
    """Spark's offset and commit logs of the job's query, as its files hold them."""

    path: Path

    def logged(self) -> list[int]:
        return _batch_ids(self.path / "offsets")

    def committed(self) -> int:
        """The last committed batch id, -1 if none."""
        ids = _batch_ids(self.path / "commits")
        return ids[-1] if ids else -1

    def uncommitted_since(self, committed: int) -> list[int]:
        return [b for b in self.logged() if b > committed]

    def end_offset(self, batch: int) -> dict[str, Any]:
        """The ftkafka end offset of `batch`: line 3 of offsets/<batch> (a version
        line, the batch metadata, then one line per source)."""
        lines = (self.path / "offsets" / str(batch)).read_text().splitlines()
        offset: dict[str, Any] = json.loads(lines[2])
        return offset

    def kafka_read(self, batch: int) -> int:
        """Kafka records up to the end of `batch` (the topic starts at offset 0)."""
        if batch < 0:
            return 0
        kafka = self.end_offset(batch)["kafka"]
        return sum(int(o) for partitions in kafka.values() for o in partitions.values())

    def kafka_ranges(self, batch: int) -> list[tuple[int, int, int]]:
        """The Kafka records `batch` takes in, as (partition, start, end) of its one
        topic."""
        end = self.end_offset(batch)["kafka"]
        start = self.end_offset(batch - 1)["kafka"] if batch > 0 else {}
        return [
            (int(p), int(start.get(topic, {}).get(p, 0)), int(o))
            for topic, partitions in end.items()
            for p, o in partitions.items()
        ]

    def records_of(self, batch: int) -> int:
        """An upper bound of the records `batch` takes in: its Kafka records and the
        width of its replay seq range (batch 0 starts at offset 0 and replay seq 0)."""
        end = self.end_offset(batch)
        start = self.end_offset(batch - 1) if batch > 0 else {"kafka": {}, "replay": 0}
        kafka = 0
        for topic, partitions in end["kafka"].items():
            before = start["kafka"].get(topic, {})
            kafka += sum(int(o) - int(before.get(p, 0)) for p, o in partitions.items())
        return kafka + int(end.get("replay", 0)) - int(start.get("replay", 0))


# ---- the parts of the stream ---------------------------------------------------------------


class Feeder:
    """Produces value_of(0), value_of(1), ... to a topic from a thread while started,
    CHUNK records every CHUNK_INTERVAL_S seconds; `produced` counts the records the
    broker confirmed (acks=all), across starts."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.produced = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kill-test-feeder", daemon=True)
        self._thread.start()

    def stop(self) -> int:
        """Stop producing; returns how many records were produced in all."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)
            assert not self._thread.is_alive(), "the producer thread did not stop"
            self._thread = None
        if self.error is not None:
            raise AssertionError(f"producing failed: {self.error!r}") from self.error
        return self.produced

    def _run(self) -> None:
        try:
            producer = KafkaProducer(bootstrap_servers=self.bootstrap, acks="all", linger_ms=5)
            try:
                while not self._stop.wait(CHUNK_INTERVAL_S):
                    ids = range(self.produced, self.produced + CHUNK)
                    futures = [
                        producer.send(self.topic, key=b"k%d" % (i % 97), value=value_of(i))
                        for i in ids
                    ]
                    producer.flush(30)
                    for future in futures:
                        future.get(30)
                    self.produced += CHUNK
            finally:
                producer.close(5)
        except BaseException as exc:  # reported by stop()
            self.error = exc


@dataclass
class Stream:
    """The job, its FT layer and its topics, shared by the tests of this module."""

    bootstrap: str
    source_topic: str
    sink_topic: str
    server: FTServerProcess
    job: Job
    checkpoint: Checkpoint
    feeder: Feeder
    client: FTClient
    """The test's own client of the FT layer, for its status (an idempotent call: it
    reconnects by itself after a restart)."""
    duplicates: int = 0
    """Duplicates in the output topic when the stream last settled."""
    settled: bool = True
    """False while a test runs; a test that failed leaves the stream unusable."""


def start_stream(bootstrap: str, workdir: Path) -> Stream:
    workdir.mkdir(parents=True, exist_ok=True)
    source_topic, sink_topic = (f"recovery-kills-{uuid.uuid4().hex[:10]}" for _ in range(2))
    create_topic(bootstrap, source_topic, PARTITIONS)
    create_topic(bootstrap, sink_topic, PARTITIONS)
    server = FTServerProcess(
        workdir / "ft-data",
        *("--port", str(free_port()), "--tree-timeout-s", str(TREE_TIMEOUT_S)),
        log_path=workdir / "ft.log",
    ).start()
    checkpoint = Checkpoint(workdir / "checkpoint")
    (workdir / "job").mkdir()
    command = [sys.executable, str(JOB), "--bootstrap", bootstrap]
    command += ["--source-topic", source_topic, "--sink-topic", sink_topic]
    command += ["--ft-address", server.address, "--checkpoint", str(checkpoint.path)]
    command += ["--workdir", str(workdir / "job")]
    command += ["--max-offsets-per-trigger", str(MAX_OFFSETS_PER_TRIGGER)]
    command += ["--trigger-ms", str(TRIGGER_MS)]
    job = Job(command, workdir / "job")
    job.start()
    client = FTClient(server.address, name="test-recovery-kills")
    feeder = Feeder(bootstrap, source_topic)
    return Stream(bootstrap, source_topic, sink_topic, server, job, checkpoint, feeder, client)


def stop_stream(stream: Stream) -> None:
    with contextlib.suppress(Exception):
        stream.feeder.stop()
    if stream.job.alive():
        stream.job.kill()
    stream.client.close()
    stream.server.stop()


@pytest.fixture(scope="module")
def streams(
    kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[], Stream]]:
    """A function giving the shared stream, started on first use, and started afresh
    if the test before left it unsettled (it failed)."""
    current: list[Stream] = []

    def get() -> Stream:
        if current and not current[0].settled:
            stop_stream(current.pop())
        if not current:
            current.append(start_stream(kafka_bootstrap, tmp_path_factory.mktemp("kills")))
        current[0].settled = False
        return current[0]

    yield get
    if current:
        stop_stream(current[0])


class Completions:
    """The FT layer's `completed` counter against the wall clock: a thread with a client
    of its own reads it every SAMPLE_S seconds while started (reads that fail while the
    server is down are skipped)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kill-test-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
            self._thread = None

    def _run(self) -> None:
        with FTClient(self.address, name="test-recovery-kills-sampler", reconnect_s=1.0) as client:
            while not self._stop.wait(SAMPLE_S):
                with contextlib.suppress(FTLayerError, OSError):
                    self.samples.append((time.time(), int(client.status()["completed"])))

    def first_after(self, at: float) -> float | None:
        """The wall-clock time of the first sample after `at` whose count is above the
        last one read by `at`; None if there is none yet."""
        before = [n for t, n in self.samples if t <= at]
        base = before[-1] if before else 0
        return next((t for t, n in self.samples if t > at and n > base), None)


# ---- kills ---------------------------------------------------------------------------------


@dataclass
class KillRecord:
    """What was in flight at one kill, and the copies it may add (module docstring)."""

    kind: str
    when: str
    delay_s: float
    uncommitted: list[int]
    batch_records: int
    pending_after: int = 0
    """The FT layer's pending roots right after a driver kill (0 when it died too)."""
    recovered: int = 0
    """The restarted FT layer's failed.recovery (0 when it was not killed)."""
    timed_out: int = 0
    """Roots the FT layer failed by timeout since its last restart, read right before
    it was killed (0 when it was not killed)."""
    killed_at: float = 0.0
    """Wall-clock time of the kill."""
    restarted_at: float = 0.0
    """Wall-clock time the killed job was started again (0 when it was not killed)."""
    ranges: list[tuple[int, int, int]] = field(default_factory=list)
    """The Kafka records of the batches in flight (partition, start, end)."""
    replayed_at_kill: int = 0
    """The FT layer's `replayed` counter right before the kill."""
    replays: int = 0
    """Driver kills: the records that entered the replay queue from this kill until the
    next one (or the end): each may be written once more."""
    duplicates: int = 0
    """Duplicates at the sink of the Kafka records of the batches in flight."""
    phases: dict[str, Any] = field(default_factory=dict)
    """The stall after a driver kill, by phase (`stall_phases`)."""

    @property
    def bound(self) -> int:
        if self.kind == "driver":
            return math.ceil(self.batch_records * IN_FLIGHT_SHARE) + self.replays
        return self.batch_records + self.pending_after + self.recovered + self.timed_out


@dataclass
class Run:
    kind: str
    seed: int
    kills: list[KillRecord] = field(default_factory=list)
    began: float = field(default_factory=time.monotonic)

    def note(self) -> str:
        return f"kind {self.kind}, seed {self.seed} (rerun with KILL_SEED={self.seed})"


def job_progress(stream: Stream) -> tuple[int, int, int]:
    """What changes while the job works: its reports' size and its logged and committed
    batches (the Spark checkpoint)."""
    checkpoint = stream.checkpoint
    logged = checkpoint.logged()
    return stream.job.stdout.stat().st_size, logged[-1] if logged else -1, checkpoint.committed()


def wait_for_commit_after(stream: Stream, committed: int, what: str) -> None:
    def progressed() -> bool:
        stream.job.check()
        return stream.checkpoint.committed() > committed

    wait_progressing(progressed, lambda: job_progress(stream), START_STALL_S, what)


def persisted(stream: Stream) -> int:
    """The FT layer's count of persisted source records, since it started."""
    return int(stream.client.status()["persisted"])


@dataclass
class Marks:
    """Where the stream was at the last restart (or at the test's start): its last
    committed batch and the FT layer's persisted and failed.timeout counters."""

    committed: int
    persisted: int
    timed_out: int


def marks_of(stream: Stream) -> Marks:
    status = stream.client.status()
    return Marks(
        stream.checkpoint.committed(), int(status["persisted"]), int(status["failed"]["timeout"])
    )


def kill_and_restart(run: Run, rng: random.Random, stream: Stream, marks: Marks) -> Marks:
    """Wait for a random moment (module docstring), kill (run.kind), restart; returns
    the new marks."""
    job, checkpoint = stream.job, stream.checkpoint
    driver, ft = run.kind in ("driver", "both"), run.kind in ("ft-layer", "both")
    if rng.random() < PERSISTING_KILLS:
        when = "persisting"

        def persisting() -> bool:
            job.check()
            return persisted(stream) > marks.persisted

        wait_progressing(
            persisting, lambda: job_progress(stream), START_STALL_S, "records persisted"
        )
    else:
        when = "committed"
        what = f"a batch committed after batch {marks.committed}"
        wait_for_commit_after(stream, marks.committed, what)
    delay = rng.uniform(*KILL_DELAY_S)
    time.sleep(delay)
    job.check()
    committed = checkpoint.committed()
    before = stream.client.status()
    timed_out = int(before["failed"]["timeout"]) - marks.timed_out if ft else 0
    killed_at = time.time()
    if driver and ft:  # both SIGKILLs sent back to back, in a random order
        server_pid = stream.server.pid
        assert server_pid is not None
        signals = [job.send_kill, lambda: os.kill(server_pid, signal.SIGKILL)]
        rng.shuffle(signals)
        for send in signals:
            send()
    if driver:
        job.kill()
    if ft:
        stream.server.kill()
    uncommitted = checkpoint.uncommitted_since(committed)
    record = KillRecord(
        run.kind,
        when,
        round(delay, 2),
        uncommitted,
        sum(checkpoint.records_of(b) for b in uncommitted),
        timed_out=timed_out,
        killed_at=killed_at,
        ranges=[r for b in uncommitted for r in checkpoint.kafka_ranges(b)],
        replayed_at_kill=int(before["replayed"]),
    )
    if ft:
        time.sleep(rng.uniform(*FT_DOWN_S))
        stream.server.stop()  # closes the dead process's pipe
        stream.server.start()  # the same data dir and port
        record.recovered = int(stream.client.status()["failed"]["recovery"])
    else:
        time.sleep(0.3)  # let the server see the dead connections go
        record.pending_after = int(stream.client.status()["pending"])
    marks = marks_of(stream)
    if driver:
        record.restarted_at = time.time()
        job.start()
    run.kills.append(record)
    print(
        f"  kill {len(run.kills)} at {time.monotonic() - run.began:.0f} s: {record}, "
        f"bound {record.bound}",
        flush=True,
    )
    return marks


def stall_phases(
    kill: KillRecord, reports: list[dict[str, Any]], completions: Completions, until: float
) -> dict[str, Any]:
    """The stall after a driver kill, by phase, in seconds: `restart_s` from the kill
    until the job was started again (the test waits for its processes to be gone);
    `process_s` until its Python ran (`began_at`); `session_s` until its SparkSession
    was up (the JVM); `query_s` until its query was started from the checkpoint;
    `first_batch_s` until Spark reported the first batch that took in records (the
    batch run again), with Spark's phases of that trigger (`first_batch_ms`);
    `first_completion_s` until the FT layer's `completed` grew; `stall_s` from the kill
    to that completion. A phase that did not end before `until` (the next kill) is
    left out."""
    phases: dict[str, Any] = {"restart_s": round(kill.restarted_at - kill.killed_at, 1)}
    start = next((r for r in reports if r.get("began_at", 0) >= kill.restarted_at), None)
    if start is None or start["started_at"] > until:
        return phases
    phases["process_s"] = round(start["began_at"] - kill.restarted_at, 1)
    phases["session_s"] = round(start["spark_at"] - start["began_at"], 1)
    phases["query_s"] = round(start["started_at"] - start["spark_at"], 1)
    batch = next((r for r in reports if "batch" in r and r["at"] >= start["started_at"]), None)
    if batch is None or batch["at"] > until:
        return phases
    phases["first_batch_s"] = round(batch["at"] - start["started_at"], 1)
    phases["first_batch_ms"] = batch["duration_ms"]
    completed = completions.first_after(start["began_at"])
    if completed is None or completed > until:
        return phases
    phases["first_completion_s"] = round(completed - batch["at"], 1)
    phases["stall_s"] = round(completed - kill.killed_at, 1)
    return phases


def wait_settled(stream: Stream, produced: int) -> dict[str, Any]:
    """Until, twice in a row, no batch is in flight, the committed batches cover every
    produced record and the FT layer has no pending tree; returns its status."""
    status: dict[str, Any] = {}
    streak = [0]
    checkpoint = stream.checkpoint

    def settled() -> bool:
        stream.job.check()
        committed = checkpoint.committed()
        done = not checkpoint.uncommitted_since(committed)
        done = done and checkpoint.kafka_read(committed) >= produced
        if done:
            status.update(stream.client.status())
            done = status["pending"] == 0
        streak[0] = streak[0] + 1 if done else 0
        return streak[0] >= 2

    def progress() -> tuple[tuple[int, int, int], Any]:
        return job_progress(stream), status.get("pending")

    what = "every record read and every tree complete"
    wait_progressing(settled, progress, SETTLE_STALL_S, what, 0.25)
    return status


@pytest.fixture
def seed() -> int:
    return int(os.environ.get("KILL_SEED") or random.SystemRandom().randrange(2**32))


@pytest.mark.parametrize("kind", ["ft-layer", "driver", "both"])
def test_kills_lose_nothing_and_duplicate_only_what_was_in_flight(
    kind: str,
    seed: int,
    streams: Callable[[], Stream],
    record_property: Callable[[str, object], None],
) -> None:
    run = Run(kind, seed)
    print(f"\n{run.note()}", flush=True)
    stream = streams()
    rng = random.Random(seed)
    completions = Completions(stream.server.address)
    completions.start()
    try:
        marks = marks_of(stream)
        stream.feeder.start()
        for _ in range(KILLS):
            marks = kill_and_restart(run, rng, stream, marks)
        # The last restart is up and working before production stops.
        what = "a batch committed after the last restart"
        wait_for_commit_after(stream, marks.committed, what)
        produced = stream.feeder.stop()
        status = wait_settled(stream, produced)
        outputs = [r.value for r in read_all(stream.bootstrap, stream.sink_topic, timeout=60)]
        inputs = read_all(stream.bootstrap, stream.source_topic, timeout=60)
    except BaseException as exc:
        exc.add_note(run.note())
        raise
    finally:
        completions.stop()

    counts = Counter(outputs)
    expected = {OUTPUT_PREFIX + value_of(i) for i in range(produced)}
    lost = len(expected - counts.keys())
    invented = sorted(v for v in counts.keys() - expected if v is not None)[:5]
    duplicates = len(outputs) - len(counts) - stream.duplicates
    stream.duplicates += duplicates
    stream.settled = True
    value_at = {(r.partition, r.offset): r.value for r in inputs}
    reports = stream.job.reports()
    for i, k in enumerate(run.kills):
        following = run.kills[i + 1] if i + 1 < len(run.kills) else None
        if kind == "driver":  # the FT layer's counters run on: it is not restarted
            k.replays = int(following.replayed_at_kill if following else status["replayed"])
            k.replays -= k.replayed_at_kill
        in_flight = {value_at.get((p, o)) for p, start, end in k.ranges for o in range(start, end)}
        k.duplicates = sum(max(0, counts[OUTPUT_PREFIX + v] - 1) for v in in_flight if v)
        if k.restarted_at:
            until = following.killed_at if following else math.inf
            k.phases = stall_phases(k, reports, completions, until)
        figures = {
            "in_flight": k.batch_records,
            "duplicates": k.duplicates,
            "replays": k.replays,
            "bound": k.bound,
            **k.phases,
        }
        record_property(f"kill_{i + 1}", json.dumps(figures))
        print(f"  kill {i + 1} ({k.when}): {json.dumps(figures)}", flush=True)
    # F of the last restarted FT layer (ft-layer, both): its timeouts up to now.
    timed_out = int(status["failed"]["timeout"]) - marks.timed_out if kind != "driver" else 0
    bound = sum(k.bound for k in run.kills) + timed_out
    record_property("duplicates", duplicates)
    record_property("duplicate_bound", bound)
    print(
        f"  {kind}: produced {produced} in all, lost {lost}, duplicates {duplicates}, "
        f"bound {bound} (batch records {sum(k.batch_records for k in run.kills)}, "
        f"pending {sum(k.pending_after for k in run.kills)}, "
        f"replays {sum(k.replays for k in run.kills)}, "
        f"recovered {sum(k.recovered for k in run.kills)}, "
        f"timed out {sum(k.timed_out for k in run.kills) + timed_out}); at the end failed "
        f"{status['failed']}; {time.monotonic() - run.began:.0f} s",
        flush=True,
    )
    note = run.note()
    assert lost == 0, f"{lost} of {produced} records have no output; {note}"
    assert not invented, f"outputs of records never produced: {invented}; {note}"
    for k in run.kills:  # the journal replays only what was in transit (docstring)
        assert k.recovered <= k.batch_records, (
            f"the restarted FT layer replayed {k.recovered} records, more than the "
            f"{k.batch_records} of the batches running at the kill: {k}; {note}"
        )
    assert duplicates <= bound, (
        f"{duplicates} duplicates, more than the {bound} the kills explain: "
        f"{[(k.uncommitted, k.bound) for k in run.kills]}; {note}"
    )
    for k in run.kills:  # no wait of the FT layer's in the stall after a driver kill
        ft_wait = k.phases.get("first_completion_s", 0.0)
        assert ft_wait <= FT_WAIT_S, (
            f"trees completed again {ft_wait} s after the first batch of the restarted "
            f"query: {k.phases}; {note}"
        )
