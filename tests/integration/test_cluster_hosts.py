"""ftlayer on a real cluster of hosts: every part on a host of its own, and a host dies.

The hosts are Linux network namespaces on a bridge (`netns.NetnsHosts`): the driver,
the Spark standalone master, two worker hosts, the FT layer and the Kafka broker (Tansu)
each on its own address of a /24 of 10.231.0.0/16, talking over the bridge, never over
loopback.
The FT layer serves TLS with a token (a CA and a certificate naming its address, made
as docs/deploy.md makes them); the driver (`cluster_job.py`, client mode) runs the
demo's pipeline, and the executors learn of the FT layer only from the source's
options ft.address, ft.tokenFile and ft.tlsCa. The module's cases share these parts.

Case 1, a worker host dies: once the stream flows (a batch has completed) and the
second worker's executor is in the middle of a task (the driver's status tracker says
so), every process on that host is SIGKILLed (worker, executor, PySpark daemon and
workers); Spark runs the lost task on the other worker, and says so in its log. Nothing
may be lost (every event that passes the filter is in the output topic), and the
duplicates at the sink are at most one batch (`MAX_PER_TRIGGER`): the
writes of the dead executor's tasks that ran again. The seconds from the kill until
trees complete again, and until every tree completed, are recorded as properties
(`first_completion_after_kill_s`, `all_complete_after_kill_s`) and printed.

Making namespaces needs root. Without it the module is skipped, saying so; under CI
(FTLAYER_REQUIRE_NETNS=1, set by .ci/run) it fails instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from netns import NetnsHosts, unavailable

from ftlayer.client import FTClient
from ftlayer.integration.harness.broker import TansuBroker
from ftlayer.integration.harness.demo import event, passes_filter, source_options
from ftlayer.integration.harness.ftprocess import FTServerProcess
from ftlayer.integration.harness.kafka import create_topic, produce, read_all
from ftlayer.integration.harness.pki import ServerFiles, make_server_files
from ftlayer.integration.harness.standalone import StandaloneCluster
from ftlayer.status import Status

pytestmark = pytest.mark.integration

HOSTS = ("driver", "master", "worker1", "worker2", "ft", "broker")
BROKER_PORT, FT_PORT = 9092, 7070
RECORDS = 6_000
PARTITIONS = 4
MAX_PER_TRIGGER = 1_500
TREE_TIMEOUT_S = 10
JOB = Path(__file__).with_name("cluster_job.py")
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
    """`cluster_job.py` on the driver host; `stop()` kills every process on that host
    (quicker than stopping Spark cleanly, and the verdict is taken by then)."""

    def __init__(self, parts: Parts, source: str, sink: str) -> None:
        work = parts.workdir / f"driver-{source}"
        (work / "flaky").mkdir(parents=True)
        self.log = work / "driver.log"
        self.spark_log = work / "spark.log"
        self.host = host = parts.hosts["driver"]
        ft_options = {"ft.address": parts.ft.address, **parts.tls.source_options()}
        options = source_options(
            parts.broker.bootstrap, source, ft_options, max_per_trigger=MAX_PER_TRIGGER
        )
        conf = [f"--conf={k}={v}" for k, v in parts.cluster.spark_conf().items()]
        command = [
            *host.prefix, sys.executable, str(JOB),
            "--master", parts.cluster.master_url, "--driver-host", host.address,
            "--options", json.dumps(options), "--sink-topic", sink,
            "--checkpoint", str(work / "checkpoint"), "--flaky-dir", str(work / "flaky"),
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

    def running_on(self, address: str) -> int:
        """The tasks the executors on host `address` ran at the driver's last report."""
        return sum(n for at, n in self._running.items() if at.rsplit(":", 1)[0] == address)

    def check(self) -> None:
        code = self.proc.poll()
        assert code is None, f"the driver exited with code {code}: {self.tail()}"

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        self.host.kill_all()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


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


def test_a_worker_host_dies_mid_stream_and_nothing_is_lost(
    parts: Parts, record_property: Callable[[str, object], None]
) -> None:
    source, sink = "hosts-events", "hosts-enriched"
    bootstrap = parts.broker.bootstrap
    create_topic(bootstrap, source, PARTITIONS)
    create_topic(bootstrap, sink, PARTITIONS)
    produce(bootstrap, source, (event(i, 100) for i in range(RECORDS)), timeout=120)
    driver = Driver(parts, source, sink)
    try:
        started = driver.started()
        assert started["executors"] == 2  # one on each worker host
        worker2 = parts.hosts["worker2"]
        # The stream flows (a batch completed) and the second worker's executor is in
        # the middle of a task.
        wait_status(
            parts,
            "task running on worker2 after a completed batch",
            lambda s: (
                s.completed > 0
                and driver.running_on(worker2.address) > 0
                and bool(parts.cluster.python_workers(1))
            ),
            timeout=120,
            interval=0.02,
        )
        with parts.client() as client:
            at_kill = client.status()
        killed_at = time.monotonic()
        killed = worker2.kill_all()
        assert killed >= 4  # the worker, its executor, the PySpark daemon and a worker
        wait_status(parts, "completion after the kill", lambda s: s.completed > at_kill.completed,
                    timeout=120)  # fmt: skip
        first_completion_s = time.monotonic() - killed_at
        final = wait_status(
            parts,
            "completion of every tree",
            lambda s: s.completed >= RECORDS and s.pending == 0 and s.dead_letters == 0,
            timeout=180,
            interval=0.25,
        )
        all_complete_s = time.monotonic() - killed_at
        driver.check()
    finally:
        driver.stop()
    # Spark saw the executor's task die with it, and ran it again on the other worker.
    spark_log = driver.spark_log.read_text(errors="replace")
    assert "Lost executor" in spark_log and LOST_TASK in spark_log
    outputs = read_all(bootstrap, sink, timeout=60)
    found = [json.loads(r.value)["id"] for r in outputs if r.value is not None]
    expected = {i for i in range(RECORDS) if passes_filter(i)}
    lost = sorted(expected - set(found))
    duplicates = len(found) - len(set(found))
    figures = {
        "records": RECORDS,
        "processes_killed": killed,
        "lost": len(lost),
        "duplicates_at_sink": duplicates,
        "persisted_again": final.persisted - RECORDS,
        "first_completion_after_kill_s": round(first_completion_s, 1),
        "all_complete_after_kill_s": round(all_complete_s, 1),
        "driver_started_s": started["started_s"],
    }
    for name, value in figures.items():
        record_property(name, value)
    print(f"worker host killed: {json.dumps(figures)}")
    assert not lost, f"{len(lost)} events lost, e.g. {lost[:10]}"
    assert set(found) <= expected
    assert duplicates <= MAX_PER_TRIGGER, figures
