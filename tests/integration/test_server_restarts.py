"""One server per data dir, and FT-layer restarts that do not kill jobs (issue 14,
part 5), on real parts: `ftlayer serve` processes, Tansu, local Spark."""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pyspark import cloudpickle
from pyspark.sql import DataFrame, SparkSession
from serverproc import StartServer, serve_command

from ftlayer.client import FTClient
from ftlayer.integration.ftcolumns import FTSettings
from ftlayer.integration.harness.kafka import produce
from ftlayer.integration.sinks import ft_foreach_batch
from ftlayer.integration.source import register

cloudpickle.register_pickle_by_value(sys.modules[__name__])

MakeTopic = Callable[..., str]


@pytest.fixture(scope="module", autouse=True)
def ftkafka(spark: SparkSession) -> None:
    register(spark)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_second_server_on_a_served_data_dir_is_refused_and_recovers_nothing(
    start_server: StartServer, tmp_path: Path
) -> None:
    import subprocess

    first = start_server()
    with first.client() as client:
        client.register_source(3, "forward", 1)
    second = subprocess.run(
        serve_command(first.data_dir, "--port", "0"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert second.returncode == 2
    assert "is served by another `ftlayer serve`" in second.stderr
    assert f"pid {first.proc.pid}" in second.stderr
    assert "recovered" not in second.stderr
    with first.client() as client:  # the first one serves on, untouched
        assert client.status().sources["3"]["partitioner"] == "forward"
    first.kill()
    third = start_server(first.data_dir)  # once it is gone, the data dir is free
    with third.client() as client:
        assert client.status().sources["3"]["partitioner"] == "forward"


def test_a_query_rides_out_a_15_second_restart_of_the_ft_layer(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
) -> None:
    """SIGTERM, 15 s down, start again on the same port: the query (its driver and its
    tasks, with the default windows) waits and goes on; every record arrives."""
    port = str(_free_port())
    server = start_server(None, "--port", port, "--timeout-s", "60")
    settings = FTSettings(server.address)
    topic = make_topic(2)
    produce(kafka_bootstrap, topic, [(str(i).encode(), b"a") for i in range(200)])
    seen: set[int] = set()

    def sink(batch: DataFrame, epoch_id: int) -> None:
        seen.update(int(r.key) for r in batch.select("key").collect())

    query = (
        spark.readStream.format("ftkafka")
        .option("kafka.bootstrap.servers", kafka_bootstrap)
        .option("subscribe", topic)
        .option("ft.address", server.address)
        .load()
        .writeStream.foreachBatch(ft_foreach_batch(sink, settings))
        .option("checkpointLocation", str(tmp_path / "cp"))
        .trigger(processingTime="250 milliseconds")
        .start()
    )
    try:
        _wait(lambda: len(seen) == 200, 60, query)
        server.proc.terminate()
        server.proc.wait(30)
        produce(kafka_bootstrap, topic, [(str(i).encode(), b"b") for i in range(200, 400)])
        time.sleep(15)
        assert query.isActive, f"the query stopped: {query.exception()}"
        server = start_server(server.data_dir, "--port", port, "--timeout-s", "60")
        _wait(lambda: len(seen) == 400, 90, query)
        with FTClient(server.address) as client:
            _wait(lambda: client.status().pending == 0, 60, query)
    finally:
        query.stop()
    assert seen == set(range(400))


def _wait(predicate: Callable[[], bool], timeout_s: float, query: Any) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if query.exception() is not None:
            raise AssertionError(f"the query failed: {query.exception()}")
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)
