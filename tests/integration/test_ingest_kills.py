"""Sources that cannot replay, proven by killing things: 100,000 messages from a webhook
sender (`ftlayer ingest http`) or a JetStream stream (`ftlayer ingest jetstream`), read
by a real streaming job (kill_job.py with the ftingest source -> FTTasks.map ->
ft_kafka_sink, on ``local[2,4]``, in a process group of its own) through a real
``ftlayer serve``, while four things are SIGKILLed in turn:

1. the receiver (once 15% of the messages were acknowledged upstream), started again
   a second later: the webhook sender sends what was not answered 200 again, JetStream
   redelivers what was not acknowledged, and the FT layer drops the second copies of
   what the dead receiver had stored (their ids, their stream sequences);
2. the FT layer (once 25% of the trees completed), started again on its data dir: the
   records receivers stored are durable there, the receivers answer 503 or leave
   JetStream's messages unacknowledged meanwhile;
3. a PySpark Python worker busy on a task (once 50% completed): Spark retries the task;
4. the driver's whole process group (once 75% completed), started again on its
   checkpoint: Spark runs its last batch again, reading the same replay seqs.

What a user would notice is asserted: every message acknowledged upstream (all of
them, at the end) has its output in the sink topic (lost = 0), and the extra copies
there stay within the bound the kills explain. Per kill, the records in flight are at
most one batch (Spark runs one at a time, maxOffsetsPerTrigger M records of the
queue): the receiver kill adds no copy (the FT layer drops the second copies); the FT
layer kill at most 2M (the batch's tasks retried write again, and records whose
journal write died with the server are replayed once more); the worker kill at most M
(the retried task's rows); the driver kill ceil(M / 100) (the sink resumes the batch
run again, integration/resume.py). Records the FT layer replays after a timeout (F,
its `failed.timeout` over every life of the server) write once more each. Bound:
3M + ceil(M / 100) + F.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from jobproc import JOB, Job

from ftlayer.client import FTClient
from ftlayer.errors import FTLayerError
from ftlayer.integration.harness.broker import free_port
from ftlayer.integration.harness.child import log_tail
from ftlayer.integration.harness.demo import busy_python_workers, python_workers
from ftlayer.integration.harness.ftprocess import FTServerProcess
from ftlayer.integration.harness.kafka import create_topic, read_all
from ftlayer.integration.harness.upstreams import HttpUpstream, JetStreamUpstream, Upstream
from ftlayer.registration import ingest_source_id

pytestmark = pytest.mark.integration

N = 100_000
PARTITIONS = 4
M = 2_000  # maxOffsetsPerTrigger
TREE_TIMEOUT_S = 20
SETTLE_TIMEOUT_S = 420.0
OUTPUT_PREFIX = b"out-"


def _kill_a_worker(driver: int, deadline_s: float = 60.0) -> int:
    """SIGKILL one PySpark Python worker of the job whose driver is `driver`, one busy on
    a task if there is one; its pid."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        workers = busy_python_workers(root=driver) or python_workers(driver)
        if workers:
            os.kill(workers[0], signal.SIGKILL)
            return workers[0]
        time.sleep(0.05)
    raise AssertionError("no PySpark Python worker ran for a minute")


class Server:
    """The FT layer's process and what its lives counted."""

    def __init__(self, workdir: Path) -> None:
        self.process = FTServerProcess(
            workdir / "ft-data",
            *("--port", str(free_port()), "--tree-timeout-s", str(TREE_TIMEOUT_S)),
            log_path=workdir / "ft.log",
        ).start()
        self.address = self.process.address
        # What the server's earlier lives counted (its counters start at 0 with it).
        self.timeouts_before = self.completed_before = self.duplicates_before = 0
        self.client = FTClient(self.address, name="test-ingest-kills", reconnect_s=60.0)

    def kill_and_restart(self) -> None:
        status = self.client.status()
        self.timeouts_before += int(status.failed.get("timeout", 0))
        self.completed_before += status.completed
        self.duplicates_before += status.ingest_duplicates
        self.process.kill()
        time.sleep(1.0)
        self.process.start()

    def timeouts(self) -> int:
        return self.timeouts_before + int(self.client.status().failed.get("timeout", 0))

    def completed(self) -> int:
        return self.completed_before + self.client.status().completed

    def close(self) -> None:
        self.client.close()
        self.process.stop()


def _wait(
    what: str,
    predicate: Callable[[], bool],
    job: Job,
    upstream: Upstream,
    server: Server,
    timeout_s: float,
) -> None:
    """Until `predicate`; fails at once if the job or a receiver exited, and after
    `timeout_s` with the FT layer's status and the ends of every log."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        job.check()
        upstream.check()
        if time.monotonic() >= deadline:
            logs = [server.process.log_path, job.stderr, *upstream.logs()]
            raise AssertionError(
                f"timed out waiting for {what} ({timeout_s:g} s); the FT layer's status: "
                f"{server.client.status()}{''.join(log_tail(p) for p in logs)}"
            )
        time.sleep(0.2)


def _upstream(kind: str, server: Server, workdir: Path, source: str) -> Upstream:
    # A JSON number: the webhook stores its JSON text, JetStream the bytes: both b"<i>".
    events = [(b"k%d" % (i % 1000), b"%d" % i) for i in range(N)]
    common = {"workdir": workdir, "max_pending": 20_000}
    if kind == "http":
        return HttpUpstream(server.address, source, PARTITIONS, events, **common)
    from ftlayer.integration.harness.nats import NatsServer

    nats = NatsServer(workdir / "nats", log_path=workdir / "nats.log")
    nats.start()
    upstream = JetStreamUpstream(
        server.address, source, PARTITIONS, events,
        nats_url=nats.url, stream=f"kills{uuid.uuid4().hex[:6]}", **common,
    )  # fmt: skip
    upstream.nats = nats  # type: ignore[attr-defined]  # stopped with the upstream
    return upstream


@pytest.mark.parametrize("kind", ["http", "jetstream"])
def test_every_message_acknowledged_upstream_reaches_the_sink_through_four_kills(
    kind: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    sink_topic = f"ingest-kills-{uuid.uuid4().hex[:8]}"
    create_topic(kafka_bootstrap, sink_topic, PARTITIONS)
    server = Server(tmp_path)
    source = f"ingest-kills-{kind}"
    source_id = ingest_source_id(source)
    upstream = _upstream(kind, server, tmp_path, source)
    (tmp_path / "job").mkdir()
    command = [sys.executable, str(JOB), "--bootstrap", kafka_bootstrap]
    command += ["--ingest-source", source, "--sink-topic", sink_topic]
    command += ["--ft-address", server.address, "--checkpoint", str(tmp_path / "checkpoint")]
    command += ["--workdir", str(tmp_path / "job"), "--max-offsets-per-trigger", str(M)]
    job = Job(command, tmp_path / "job")
    kills: list[str] = []
    watched = (job, upstream, server)
    try:
        upstream.start()  # the receivers register the source
        job.start()

        def completed(share: float) -> Callable[[], bool]:
            return lambda: server.completed() >= share * N

        _wait("15% acknowledged upstream", lambda: upstream.acked >= 0.15 * N, *watched, 300)
        upstream.kill_receiver(0)
        kills.append(f"receiver at {upstream.acked} acked")
        _wait("25% completed", completed(0.25), *watched, 300)
        server.kill_and_restart()
        kills.append("FT layer")
        _wait("50% completed", completed(0.5), *watched, 300)
        assert job.proc is not None
        kills.append(f"Python worker {_kill_a_worker(job.proc.pid)}")
        _wait("75% completed", completed(0.75), *watched, 300)
        job.kill()
        job.start()
        kills.append("driver")

        def settled() -> bool:
            status = server.client.status()
            return upstream.done and status.pending_of(source_id) == 0

        everything = "every message acknowledged and every tree complete"
        _wait(everything, settled, *watched, SETTLE_TIMEOUT_S)
        timeouts = server.timeouts()
        ingest_duplicates = server.duplicates_before + server.client.status().ingest_duplicates
        outputs = read_all(kafka_bootstrap, sink_topic, timeout=120)
        acked = upstream.acked
    finally:
        if job.alive():
            job.kill()
        upstream.close()
        nats = getattr(upstream, "nats", None)
        if nats is not None:
            nats.stop()
        server.close()
    copies = Counter(r.value for r in outputs)
    lost = [i for i in range(acked) if OUTPUT_PREFIX + b"%d" % i not in copies]
    unexpected = [v for v in copies if not v.startswith(OUTPUT_PREFIX)]
    duplicates = sum(copies.values()) - len(copies)
    bound = 3 * M + math.ceil(M / 100) + timeouts
    print(
        f"{kind}: acked upstream {acked} of {N}, lost {len(lost)}, duplicates {duplicates} "
        f"(bound {bound}: M {M}, timeouts {timeouts}), second copies dropped by the FT layer "
        f"{ingest_duplicates}, resent by the sender "
        f"{getattr(upstream, 'resent', '-')}, kills: {kills}"
    )
    assert acked == N
    assert not lost, f"{len(lost)} messages acknowledged upstream are not at the sink: {lost[:10]}"
    assert not unexpected
    assert duplicates <= bound


def test_the_upstreams_report_errors_clearly(tmp_path: Path) -> None:
    """A receiver that cannot start (its FT layer unreachable) is an UpstreamError naming
    what it printed, not a hang."""
    events = [(b"k", b"1")]
    upstream = HttpUpstream(f"127.0.0.1:{free_port()}", "nowhere", 1, events, workdir=tmp_path)
    with pytest.raises(FTLayerError, match="did not start"):
        upstream.start()
    upstream.close()
