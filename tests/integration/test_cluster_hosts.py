"""ftlayer on a real cluster of hosts: every part on a host of its own, and hosts fail.

The hosts are Linux network namespaces on a bridge (`netns.NetnsHosts`): the driver,
the Spark standalone master, two worker hosts, the FT layer and the Kafka broker (Tansu)
each on its own address of a /24 of 10.231.0.0/16, talking over the bridge, never over
loopback.
The FT layer serves TLS with a token (a CA and a certificate naming its address, made
as docs/deploy.md makes them); the driver (`cluster_job.py`, client mode) runs the
demo's pipeline, and the executors learn of the FT layer only from the source's
options ft.address, ft.tokenFile and ft.tlsCa.

The cases share these parts and one streaming query (the `stream` fixture: starting
the driver and its executors is much of a case's cost). Each case produces events of
its own ids into the query's input topic, lets the stream flow (a batch of its events
completed), injects its failure while a batch runs, and waits until every tree of its
events completed: Spark committed a batch that reads to the end of the case's events
and the FT layer holds nothing pending, waiting or dead-lettered. It then reads the
output topic and asserts what a user would notice, on its own ids only: nothing lost
(every event that passes the filter is in the output topic, and no other) and the
duplicates at the sink within the case's bound. Each case records its figures as
properties and prints them: the records lost and duplicated, the bound, and the
seconds from its failure (and from the failure's end) until trees complete again and
until every tree of its events completed.

The bounds. A failure writes a record to the sink again only in two ways: Spark runs
the task that wrote it again, when an attempt failed (the task belongs to a batch in
flight during the failure: B, the records of the batches Spark logged and had not
committed when the failure began, or logged until it ended, read from the query's
checkpoint directory: Kafka records and the width of each batch's replay seq range);
or the FT layer replays its tree (a replay writes once: R, the records that entered
the replay queue during the case, the events that fail once on purpose, about 1 %,
included). So duplicates <= |B| + R. The first term is generous: `ft_kafka_sink`'s
retry skips what the failed attempt wrote (integration/resume.py), so only rows in
flight when an attempt failed are written twice that way.

- The FT host dies: every process on it SIGKILLed mid-stream; 20 s later `ftlayer
  serve` starts again there on the same data dir, address, token and TLS files. The
  driver's source and the tasks retry their connections meanwhile
  (ft.reconnectTimeoutMs, 60 s), so the batch running at the kill waits for the
  server; a task whose request was in flight at the kill fails, and Spark runs it
  again. The restarted server restores every tree from its acker journal, and
  replays only the records whose events died in transit. The figures count from the
  restart.
- A worker host's link is down for 30 s while its executor holds a task, then up
  again: its executor, Python workers, Kafka clients and FT clients reach nothing, and
  nothing reaches them. Spark's timeouts are longer (spark.network.timeout, 120 s, for
  the executor's heartbeats; the master's spark.worker.timeout, 60 s), the FT clients
  retry for ft.reconnectTimeoutMs (60 s) and wait 120 s for a reply, and no tree of a
  batch whose driver heartbeats times out: the batch waits for the cut executor, the
  query rides the cut out and keeps that executor (asserted: Spark's log names no
  lost executor). A task of that executor whose Kafka consumer was connecting when
  the link went down may give up (the source's Kafka bootstrap timeout, 30 s) and
  fail; Spark runs it again. The figures count from the link coming up; they vary
  with TCP: a connection whose far end (the FT layer, the driver, the broker) sent
  into the cut resumes only at that end's next retransmission, which TCP backs off
  exponentially, so it may come many seconds after the link is up (the cut host's
  own side, whose sends fail at once for want of a neighbour, retries every few
  seconds).
- The driver dies, and a supervisor starts it again: a thread of the test process
  (outside the driver host, as systemd's Restart=always or a Kubernetes controller
  would be) that starts `cluster_job.py` on the driver host again whenever it exits,
  on the query's checkpoint. `host`: once the sink writes rows of a batch Spark has
  not committed, every process on the driver host is SIGKILLed (the driver's Python
  and JVM, Spark's Python planner process and workers); Spark runs that batch again
  after the restart, and the sink resumes it: its write id and start offsets were kept
  in the FT layer before it wrote, and every task of the run again reads back and
  skips, by content, the rows the dead run wrote (integration/resume.py). `planner`:
  only Spark's Python planner process on the driver is SIGKILLed while a batch runs
  (`PLANNER`: it runs the ftkafka source's reader, its offsets, barriers, commits and
  heartbeats); Spark does not start it again, so the query fails at its next call to
  it and the job exits (code 1); the supervisor starts it again. Bound: ceil(|B| / 100)
  + R. A row is written twice only if it was in flight at the kill (sent by the dead
  run, appended after the run again read back: at most 1 % of B, the design's share),
  or if its record is replayed (R, which also counts the replays the dead driver's
  last batch held and that timed out while the driver was down: the tree timeout
  here, 10 s, is shorter than a restart). The figures count from the kill, with the
  seconds until the supervisor found the driver dead and until its query ran again.
- A worker host dies (last: it leaves the cluster one worker short): once the second
  worker's executor is in the middle of a task (the driver's status tracker says so),
  every process on that host is SIGKILLed (worker, executor, PySpark daemon and
  workers); Spark runs the lost task on the other worker, and says so in its log. Its
  bound is tighter: at most one batch (`MAX_PER_TRIGGER`), the writes of the dead
  executor's tasks that ran again. The figures count from the kill.

Making namespaces needs root. Without it the module is skipped, saying so; under CI
(FTLAYER_REQUIRE_NETNS=1, set by .ci/run) it fails instead.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from netns import NetnsHost, NetnsHosts, unavailable

from ftlayer.client import FTClient
from ftlayer.integration.harness.broker import TansuBroker
from ftlayer.integration.harness.demo import event, passes_filter, source_options
from ftlayer.integration.harness.ftprocess import FTServerProcess
from ftlayer.integration.harness.kafka import create_topic, end_offsets, produce, read_all
from ftlayer.integration.harness.pki import ServerFiles, make_server_files
from ftlayer.integration.harness.standalone import StandaloneCluster
from ftlayer.status import Status

pytestmark = pytest.mark.integration

HOSTS = ("driver", "master", "worker1", "worker2", "ft", "broker")
BROKER_PORT, FT_PORT = 9092, 7070
SOURCE_TOPIC, SINK_TOPIC = "hosts-events", "hosts-enriched"
RECORDS = 4_500
"""Events per case: three batches."""
PARTITIONS = 4
MAX_PER_TRIGGER = 1_500
TREE_TIMEOUT_S = 10
FT_DOWN_S = 20.0
"""How long the FT host stays dead."""
CUT_S = 30.0
"""How long a worker host's link stays down."""
CUT_HOST = "worker1"
JOB = Path(__file__).with_name("cluster_job.py")
PLANNER = "pyspark.sql.streaming.python_streaming_source_runner"
"""The module Spark runs, on the driver, as the Python process that plans the ftkafka
source's batches (its DataSourceStreamReader: initialOffset, latestOffset, partitions,
commit; and the source's heartbeats)."""
SUPERVISE_S = 0.2
"""How often the supervisor looks whether the driver still runs."""
IN_FLIGHT_SHARE = 0.01
"""A driver's death: its rows in flight, written again by the batch's run again, are at
most this share of the batches in flight (module docstring)."""
LOST_EXECUTOR = "Lost executor"
LOST_TASK = "its executor exited for a reason unrelated to the task"
"""What Spark's TaskSetManager logs of a task lost with its executor (it runs it again)."""


@dataclass
class Parts:
    hosts: NetnsHosts
    broker: TansuBroker
    tls: ServerFiles
    ft: FTServerProcess
    cluster: StandaloneCluster
    workdir: Path

    def client(self) -> FTClient:
        token = self.tls.token.read_bytes().strip()
        return FTClient(self.ft.address, token, name="test", tls=str(self.tls.ca))


@pytest.fixture(scope="module")
def hosts() -> Iterator[NetnsHosts]:
    reason = unavailable()
    if reason is not None:
        if os.environ.get("FTLAYER_REQUIRE_NETNS") == "1":
            pytest.fail(f"hosts of their own cannot be made: {reason}", pytrace=False)
        pytest.skip(f"hosts of their own cannot be made: {reason}")
    with NetnsHosts(HOSTS) as made:
        yield made


@pytest.fixture(scope="module")
def parts(hosts: NetnsHosts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Parts]:
    work = tmp_path_factory.mktemp("cluster-hosts")
    broker_host, ft_host = hosts["broker"], hosts["ft"]
    tls = make_server_files(work / "tls", [ft_host.address])
    with (
        TansuBroker(
            port=BROKER_PORT,
            log_path=work / "broker.log",
            host=broker_host.address,
            command_prefix=broker_host.prefix,
        ) as broker,
        FTServerProcess(
            work / "ft",
            "--host", ft_host.address, "--port", str(FT_PORT),
            "--tree-timeout-s", str(TREE_TIMEOUT_S),
            *tls.serve_args(),
            command_prefix=ft_host.prefix,
        ) as ft,
        StandaloneCluster(
            work / "spark",
            [hosts["worker1"].host, hosts["worker2"].host],
            master=hosts["master"].host,
        ) as cluster,
    ):  # fmt: skip
        yield Parts(hosts, broker, tls, ft, cluster, work)


class Driver:
    """`cluster_job.py` on the driver host, its query checkpointed in `work`; `stop()`
    kills every process on that host (quicker than stopping Spark cleanly, and the
    verdict is taken by then). A driver started again on the same `work` goes on from
    the query's checkpoint."""

    def __init__(self, parts: Parts, work: Path, run: int = 0) -> None:
        (work / "flaky").mkdir(parents=True, exist_ok=True)
        self.log = work / f"driver-{run}.log"
        self.spark_log = work / f"spark-{run}.log"
        self.checkpoint = work / "checkpoint"
        self.host = host = parts.hosts["driver"]
        ft_options = {"ft.address": parts.ft.address, **parts.tls.source_options()}
        options = source_options(
            parts.broker.bootstrap, SOURCE_TOPIC, ft_options, max_per_trigger=MAX_PER_TRIGGER
        )
        conf = [f"--conf={k}={v}" for k, v in parts.cluster.spark_conf().items()]
        command = [
            *host.prefix, sys.executable, str(JOB),
            "--master", parts.cluster.master_url, "--driver-host", host.address,
            "--options", json.dumps(options), "--sink-topic", SINK_TOPIC,
            "--checkpoint", str(self.checkpoint), "--flaky-dir", str(work / "flaky"),
            "--log-file", str(self.spark_log), *conf,
        ]  # fmt: skip
        env = {**os.environ, "SPARK_LOCAL_IP": host.address, "PYSPARK_PYTHON": sys.executable}
        self._running: dict[str, int] = {}
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env
            )

    def started(self, timeout: float = 120.0) -> dict[str, float]:
        """The job's first line, once its query runs (it waits for its executors first);
        a thread then follows its lines of running tasks (`running_on`)."""
        assert self.proc.stdout is not None
        lines: queue.Queue[bytes] = queue.Queue()
        threading.Thread(target=self._read, args=(lines,), daemon=True).start()
        deadline = time.monotonic() + timeout
        while True:
            self.check()
            assert time.monotonic() < deadline, f"the driver did not start: {self.tail()}"
            with contextlib.suppress(queue.Empty):
                first: dict[str, float] = json.loads(lines.get(timeout=0.1))
                return first

    def _read(self, first: queue.Queue[bytes]) -> None:
        assert self.proc.stdout is not None
        first.put(self.proc.stdout.readline())
        for line in self.proc.stdout:
            self._running = json.loads(line)["running"]

    def running_on(self, address: str | None = None) -> int:
        """The tasks the executors on host `address` (None: every host) ran at the
        driver's last report."""
        return sum(n for at, n in self._running.items() if address in (None, at.rsplit(":", 1)[0]))

    def has_executor_on(self, address: str, timeout: float = 10.0) -> bool:
        """Whether the driver's status tracker lists an executor on host `address`,
        waiting up to `timeout` seconds for its report."""
        deadline = time.monotonic() + timeout
        while not any(at.rsplit(":", 1)[0] == address for at in self._running):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def check(self) -> None:
        code = self.proc.poll()
        assert code is None, f"the driver exited with code {code}: {self.tail()}"

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def spark_log_size(self) -> int:
        return self.spark_log.stat().st_size if self.spark_log.exists() else 0

    def spark_log_since(self, size: int) -> str:
        with self.spark_log.open("rb") as log:
            log.seek(size)
            return log.read().decode(errors="replace")

    # ---- the query's checkpoint directory: Spark's offset and commit logs ----

    def _batches(self, log: str) -> list[int]:
        directory = self.checkpoint / log
        if not directory.is_dir():
            return []
        return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())

    def committed(self) -> int:
        """The last batch Spark committed, -1 if none."""
        return max(self._batches("commits"), default=-1)

    def logged_after(self, batch: int) -> list[int]:
        """The batches Spark logged (their offsets fixed) after `batch`."""
        return [b for b in self._batches("offsets") if b > batch]

    def end_of(self, batch: int) -> dict[str, Any]:
        """The ftkafka end position of `batch`: line 3 of offsets/<batch> (a version
        line, the batch's metadata, then one line per source)."""
        if batch < 0:
            return {"kafka": {}, "replay": 0}
        lines = (self.checkpoint / "offsets" / str(batch)).read_text().splitlines()
        end: dict[str, Any] = json.loads(lines[2])
        return end

    def records_of(self, batch: int) -> int:
        """An upper bound of the records `batch` takes in: its Kafka records and the
        width of its replay seq range."""
        end, start = self.end_of(batch), self.end_of(batch - 1)
        kafka = 0
        for topic, partitions in end["kafka"].items():
            before = start["kafka"].get(topic, {})
            kafka += sum(int(o) - int(before.get(p, 0)) for p, o in partitions.items())
        return kafka + int(end.get("replay", 0)) - int(start.get("replay", 0))

    def committed_to(self, ends: dict[int, int]) -> bool:
        """Whether Spark committed a batch that reads the input topic to `ends`."""
        batch = self.committed()
        if batch < 0:
            return False
        read = self.end_of(batch)["kafka"].get(SOURCE_TOPIC, {})
        return all(int(read.get(str(p), 0)) >= end for p, end in ends.items())

    def stop(self) -> None:
        self.host.kill_all()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


@dataclass(frozen=True)
class Case:
    """One case's events in the stream: ids `first` to `first + count - 1`, and the
    input topic's end offsets once the broker had them all."""

    first: int
    count: int
    ends: dict[int, int]

    @property
    def expected(self) -> set[int]:
        """The ids whose output must reach the output topic: those the filter keeps."""
        return {i for i in range(self.first, self.first + self.count) if passes_filter(i)}


@dataclass(frozen=True)
class Outcome:
    """What the output topic holds of a case's events."""

    lost: list[int]
    duplicates: int
    unexpected: list[int]


class Stream:
    """The module's one query (see the module docstring): its topics, its driver, and
    the events each case produced into it."""

    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        self.work = parts.workdir / "driver"
        self.produced = 0
        create_topic(parts.broker.bootstrap, SOURCE_TOPIC, PARTITIONS)
        create_topic(parts.broker.bootstrap, SINK_TOPIC, PARTITIONS)
        self.runs = 0
        self.driver = Driver(parts, self.work)
        self.started = self.driver.started()

    def ensure_running(self) -> None:
        """Start the driver again on the query's checkpoint if it is dead (an earlier
        case left it so, or the `Supervisor` found it so), first killing what is left
        of it on its host."""
        if self.driver.proc.poll() is None:
            return
        self.driver.stop()
        self.runs += 1
        self.driver = Driver(self.parts, self.work, self.runs)
        self.started = self.driver.started()

    def produce(self, count: int) -> Case:
        first = self.produced
        positions = produce(
            self.parts.broker.bootstrap,
            SOURCE_TOPIC,
            (event(i, 100) for i in range(first, first + count)),
            timeout=120,
        )
        self.produced += count
        ends: dict[int, int] = {}
        for position in positions:
            ends[position.partition] = max(ends.get(position.partition, 0), position.offset + 1)
        return Case(first, count, ends)

    def settled(self, status: Status, case: Case) -> bool:
        """Every tree of `case`'s events completed: Spark committed a batch that reads
        to their end, and the FT layer holds nothing pending (in flight, in a batch
        range or queued for replay), waiting for its backoff or its bytes, or dead."""
        return (
            status.pending == 0
            and status.retry_waiting == 0
            and status.unfilled == 0
            and status.dead_letters == 0
            and self.driver.committed_to(case.ends)
        )

    def outcome(self, case: Case) -> Outcome:
        outputs = read_all(self.parts.broker.bootstrap, SINK_TOPIC, timeout=60)
        ids = (json.loads(r.value)["id"] for r in outputs if r.value is not None)
        found = Counter(i for i in ids if case.first <= i < case.first + case.count)
        expected = case.expected
        return Outcome(
            lost=sorted(expected - set(found)),
            duplicates=sum(found.values()) - len(found),
            unexpected=sorted(set(found) - expected),
        )

    def in_flight(self, committed: int) -> tuple[list[int], int]:
        """The batches logged after batch `committed`, and their records (B)."""
        batches = self.driver.logged_after(committed)
        return batches, sum(self.driver.records_of(b) for b in batches)


@pytest.fixture(scope="module")
def stream(parts: Parts) -> Iterator[Stream]:
    made = Stream(parts)
    try:
        yield made
    finally:
        made.driver.stop()


@dataclass(frozen=True)
class Restart:
    """One restart by the supervisor: the dead driver's exit code, and the seconds
    (time.monotonic()) when it was found dead and when its query ran again."""

    exit_code: int
    found_at: float
    running_at: float


class Supervisor:
    """Starts the driver again, on the driver host, whenever it exits, as systemd's
    Restart=always or a Kubernetes controller would: a thread of the test process,
    outside the driver host, that looks every SUPERVISE_S seconds and starts it on the
    query's checkpoint (`Stream.ensure_running`, which first kills what is left of the
    dead driver on its host). A context manager; a start that failed is raised at its
    exit."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.restarts: list[Restart] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="driver-supervisor", daemon=True)

    def __enter__(self) -> Supervisor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(180)
        if self.error is not None and exc[0] is None:
            raise AssertionError(f"the supervisor could not start the driver: {self.error}")

    def _run(self) -> None:
        try:
            while not self._stop.wait(SUPERVISE_S):
                code = self.stream.driver.proc.poll()
                if code is None:
                    continue
                found_at = time.monotonic()
                self.stream.ensure_running()
                self.restarts.append(Restart(code, found_at, time.monotonic()))
        except BaseException as exc:  # raised by __exit__
            self.error = exc

    def check(self) -> None:
        """Fail at once if a start failed."""
        assert self.error is None, f"the supervisor could not start the driver: {self.error}"


def planner_of(host: NetnsHost) -> int:
    """The pid of the driver's Python planner process (PLANNER) on `host`."""
    for pid in host.pids():
        with contextlib.suppress(OSError):
            if PLANNER in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                return pid
    raise AssertionError(f"no {PLANNER} process on host {host.name}")


def wait_status(
    parts: Parts,
    condition: str,
    test: Callable[[Status], object],
    timeout: float,
    interval: float = 0.1,
) -> Status:
    """Poll the FT layer's STATUS until `test(status)` holds; fail naming `condition`."""
    deadline = time.monotonic() + timeout
    with parts.client() as client:
        while True:
            status = client.status()
            if test(status):
                return status
            assert time.monotonic() < deadline, f"no {condition} within {timeout:g} s: {status}"
            time.sleep(interval)


def status(parts: Parts) -> Status:
    with parts.client() as client:
        return client.status()


def flowing(stream: Stream, host: str | None = None) -> Status:
    """Wait until the stream flows (a batch completed since this call) and a task runs
    on `host` (None: on any host); the FT layer's status then."""
    at_start = status(stream.parts)
    where = "a worker" if host is None else host
    return wait_status(
        stream.parts,
        f"task running on {where} after a completed batch",
        lambda s: s.completed > at_start.completed and stream.driver.running_on(host) > 0,
        timeout=120,
        interval=0.02,
    )


def report(
    name: str, figures: dict[str, object], record_property: Callable[[str, object], None]
) -> None:
    for key, value in figures.items():
        record_property(key, value)
    print(f"{name}: {json.dumps(figures)}")


def assert_outcome(outcome: Outcome, bound: int, figures: dict[str, object]) -> None:
    assert not outcome.lost, f"{len(outcome.lost)} events lost, e.g. {outcome.lost[:10]}"
    assert not outcome.unexpected, f"filtered events at the sink: {outcome.unexpected[:10]}"
    assert outcome.duplicates <= bound, figures


def test_the_ft_host_dies_and_comes_back_with_its_data_and_nothing_is_lost(
    parts: Parts, stream: Stream, record_property: Callable[[str, object], None]
) -> None:
    stream.ensure_running()
    case = stream.produce(RECORDS)
    ft_host = parts.hosts["ft"]
    at_start = status(parts)
    before = flowing(stream)
    committed_at_kill = stream.driver.committed()
    with parts.client() as client:
        at_kill = client.status()
    killed_at = time.monotonic()
    killed = ft_host.kill_all()
    time.sleep(max(0.0, FT_DOWN_S - (time.monotonic() - killed_at)))
    assert killed >= 1 and not parts.ft.alive()
    stream.driver.check()  # the query waits for the FT layer
    parts.ft.start()
    back_at = time.monotonic()
    batches, in_flight = stream.in_flight(committed_at_kill)
    wait_status(parts, "completion after the restart", lambda s: s.completed > 0, timeout=120)
    first_completion_s = time.monotonic() - back_at
    final = wait_status(
        parts, "completion of every tree", lambda s: stream.settled(s, case), timeout=180
    )
    all_complete_s = time.monotonic() - back_at
    stream.driver.check()
    outcome = stream.outcome(case)
    replays = at_kill.replayed - at_start.replayed + final.replayed
    bound = in_flight + replays
    figures = {
        "records": RECORDS,
        "processes_killed": killed,
        "down_s": round(back_at - killed_at, 1),
        "lost": len(outcome.lost),
        "duplicates_at_sink": outcome.duplicates,
        "duplicate_bound": bound,
        "batches_in_flight": len(batches),
        "records_in_flight": in_flight,
        "replays": replays,
        "recovered_pending": final.recovered_pending,
        "replayed_at_recovery": final.failed.get("recovery", 0),
        "timed_out_after_restart": final.failed.get("timeout", 0),
        "completed_before_kill": before.completed - at_start.completed,
        "first_completion_after_restart_s": round(first_completion_s, 1),
        "all_complete_after_restart_s": round(all_complete_s, 1),
    }
    report("FT host killed", figures, record_property)
    assert_outcome(outcome, bound, figures)


def test_a_worker_hosts_link_is_cut_for_30_s_and_the_query_rides_it_out(
    parts: Parts, stream: Stream, record_property: Callable[[str, object], None]
) -> None:
    stream.ensure_running()
    cut_host = parts.hosts[CUT_HOST]
    assert stream.driver.has_executor_on(cut_host.address)
    case = stream.produce(RECORDS)
    at_start = status(parts)
    flowing(stream, cut_host.address)
    tasks_held = stream.driver.running_on(cut_host.address)
    committed_at_cut = stream.driver.committed()
    log_at_cut = stream.driver.spark_log_size()
    at_cut = status(parts)
    cut_at = time.monotonic()
    parts.hosts.set_link(CUT_HOST, up=False)
    try:
        time.sleep(max(0.0, CUT_S - (time.monotonic() - cut_at)))
        stream.driver.check()
        at_heal = status(parts)
    finally:
        parts.hosts.set_link(CUT_HOST, up=True)
    healed_at = time.monotonic()
    batches, in_flight = stream.in_flight(committed_at_cut)
    wait_status(
        parts, "completion after the cut", lambda s: s.completed > at_heal.completed, timeout=120
    )
    first_completion_s = time.monotonic() - healed_at
    final = wait_status(
        parts, "completion of every tree", lambda s: stream.settled(s, case), timeout=180
    )
    all_complete_s = time.monotonic() - healed_at
    stream.driver.check()
    spark_log = stream.driver.spark_log_since(log_at_cut)
    outcome = stream.outcome(case)
    replays = final.replayed - at_start.replayed
    bound = in_flight + replays
    figures = {
        "records": RECORDS,
        "cut_s": round(healed_at - cut_at, 1),
        "tasks_held_at_cut": tasks_held,
        "completed_during_cut": at_heal.completed - at_cut.completed,
        "lost": len(outcome.lost),
        "duplicates_at_sink": outcome.duplicates,
        "duplicate_bound": bound,
        "batches_in_flight": len(batches),
        "records_in_flight": in_flight,
        "replays": replays,
        "timed_out": final.failed.get("timeout", 0) - at_start.failed.get("timeout", 0),
        "tasks_failed": spark_log.count("Lost task"),
        "first_completion_after_heal_s": round(first_completion_s, 1),
        "all_complete_after_heal_s": round(all_complete_s, 1),
    }
    report("worker host cut off", figures, record_property)
    # The cut cost no executor: Spark's timeouts are longer than the cut.
    assert LOST_EXECUTOR not in spark_log, spark_log[-3000:]
    assert_outcome(outcome, bound, figures)


def writing(stream: Stream, timeout: float = 120.0) -> int:
    """Wait until the sink writes rows of a batch that Spark has not committed yet (the
    output topic grew since its last commit was seen); the output topic's records
    then."""
    deadline = time.monotonic() + timeout
    committed, before = -2, 0
    while True:
        now = sum(end_offsets(stream.parts.broker.bootstrap, SINK_TOPIC).values())
        batch = stream.driver.committed()
        if batch == committed and now > before:
            return now
        committed, before = batch, now
        assert time.monotonic() < deadline, f"no batch wrote within {timeout:g} s"
        time.sleep(0.05)


@pytest.mark.parametrize("what", ["host", "planner"])
def test_the_driver_dies_and_its_supervisor_starts_it_again_losing_nothing(
    what: str, parts: Parts, stream: Stream, record_property: Callable[[str, object], None]
) -> None:
    stream.ensure_running()
    host = parts.hosts["driver"]
    case = stream.produce(RECORDS)
    at_start = status(parts)
    flowing(stream)
    with Supervisor(stream) as supervisor:

        def after(condition: Callable[[Status], bool]) -> Callable[[Status], bool]:
            return lambda s: supervisor.check() is None and condition(s)

        written = writing(stream) if what == "host" else None
        committed_at_kill = stream.driver.committed()
        at_kill = status(parts)
        killed_at = time.monotonic()
        if what == "host":
            killed = host.kill_all()
        else:
            os.kill(planner_of(host), signal.SIGKILL)
            killed = 1
        batches, in_flight = stream.in_flight(committed_at_kill)
        wait_status(
            parts,
            "completion after the kill",
            after(lambda s: s.completed > at_kill.completed),
            timeout=180,
        )
        first_completion_s = time.monotonic() - killed_at
        final = wait_status(
            parts, "completion of every tree", after(lambda s: stream.settled(s, case)), 180
        )
        all_complete_s = time.monotonic() - killed_at
    stream.driver.check()
    outcome = stream.outcome(case)
    replays = final.replayed - at_start.replayed
    bound = math.ceil(in_flight * IN_FLIGHT_SHARE) + replays
    restarts = supervisor.restarts
    figures = {
        "records": RECORDS,
        "killed": what,
        "processes_killed": killed,
        "output_records_at_kill": written,
        "driver_restarts": len(restarts),
        "driver_exit_code": restarts[0].exit_code if restarts else None,
        "driver_found_dead_s": round(restarts[0].found_at - killed_at, 1) if restarts else None,
        "query_running_again_s": (
            round(restarts[0].running_at - killed_at, 1) if restarts else None
        ),
        "lost": len(outcome.lost),
        "duplicates_at_sink": outcome.duplicates,
        "duplicate_bound": bound,
        "batches_in_flight": len(batches),
        "records_in_flight": in_flight,
        "replays": replays,
        "timed_out": final.failed.get("timeout", 0) - at_start.failed.get("timeout", 0),
        "first_completion_after_kill_s": round(first_completion_s, 1),
        "all_complete_after_kill_s": round(all_complete_s, 1),
    }
    report(f"driver killed ({what})", figures, record_property)
    # The driver died (the planner's death fails the query, which ends the job), and
    # the supervisor started it once.
    assert len(restarts) == 1, figures
    assert_outcome(outcome, bound, figures)


def test_a_worker_host_dies_mid_stream_and_nothing_is_lost(
    parts: Parts, stream: Stream, record_property: Callable[[str, object], None]
) -> None:
    stream.ensure_running()
    assert stream.started["executors"] == 2  # one on each worker host
    worker2 = parts.hosts["worker2"]
    assert stream.driver.has_executor_on(worker2.address)
    case = stream.produce(RECORDS)
    at_start = status(parts)
    # The stream flows (a batch completed) and the second worker's executor is in the
    # middle of a task.
    wait_status(
        parts,
        "task running on worker2 after a completed batch",
        lambda s: (
            s.completed > at_start.completed
            and stream.driver.running_on(worker2.address) > 0
            and bool(parts.cluster.python_workers(1))
        ),
        timeout=120,
        interval=0.02,
    )
    log_at_kill = stream.driver.spark_log_size()
    at_kill = status(parts)
    killed_at = time.monotonic()
    killed = worker2.kill_all()
    assert killed >= 4  # the worker, its executor, the PySpark daemon and a worker
    wait_status(parts, "completion after the kill", lambda s: s.completed > at_kill.completed,
                timeout=120)  # fmt: skip
    first_completion_s = time.monotonic() - killed_at
    final = wait_status(
        parts, "completion of every tree", lambda s: stream.settled(s, case), timeout=180
    )
    all_complete_s = time.monotonic() - killed_at
    stream.driver.check()
    # Spark saw the executor's task die with it, and ran it again on the other worker.
    spark_log = stream.driver.spark_log_since(log_at_kill)
    assert LOST_EXECUTOR in spark_log and LOST_TASK in spark_log
    outcome = stream.outcome(case)
    figures = {
        "records": RECORDS,
        "processes_killed": killed,
        "lost": len(outcome.lost),
        "duplicates_at_sink": outcome.duplicates,
        "duplicate_bound": MAX_PER_TRIGGER,
        "persisted_again": final.persisted - at_start.persisted - RECORDS,
        "first_completion_after_kill_s": round(first_completion_s, 1),
        "all_complete_after_kill_s": round(all_complete_s, 1),
        "driver_started_s": stream.started["started_s"],
    }
    report("worker host killed", figures, record_property)
    assert_outcome(outcome, MAX_PER_TRIGGER, figures)
