"""The embedded Tansu broker: it answers Kafka requests, and every way it can fail is clear."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from ftlayer.integration.harness.broker import BrokerError, TansuBroker, free_port
from ftlayer.integration.harness.kafka import cluster_info

pytestmark = pytest.mark.integration


def _script(path: Path, body: str) -> Path:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_broker_answers_a_metadata_request(tansu_broker: TansuBroker, kafka_bootstrap: str) -> None:
    info = cluster_info(kafka_bootstrap)

    assert info.cluster_id == tansu_broker.cluster_id
    assert info.brokers == (kafka_bootstrap,)
    assert kafka_bootstrap.startswith("127.0.0.1:")


def test_missing_binary_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-tansu"

    with pytest.raises(BrokerError, match=r"no-such-tansu.*not an executable file"):
        TansuBroker(binary=missing, log_path=tmp_path / "broker.log").start()


def test_broker_that_exits_reports_its_exit_code_and_log(tmp_path: Path) -> None:
    binary = _script(tmp_path / "tansu", 'echo "cannot open storage" >&2\nexit 3')

    with pytest.raises(BrokerError, match=r"(?s)exited with code 3.*cannot open storage"):
        TansuBroker(binary=binary, log_path=tmp_path / "broker.log").start()


def test_broker_that_never_answers_times_out_and_is_killed(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    binary = _script(tmp_path / "tansu", f"echo $$ > {pid_file}\nexec sleep 60")
    broker = TansuBroker(binary=binary, log_path=tmp_path / "broker.log", start_timeout=0.5)

    with pytest.raises(BrokerError, match=r"did not answer within 0\.5 s"):
        broker.start()

    assert _process_gone(int(pid_file.read_text()))
    assert broker.pid is None


def test_port_held_by_another_broker_is_not_mistaken_for_ours(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    taken = int(kafka_bootstrap.rsplit(":", 1)[1])
    broker = TansuBroker(port=taken, log_path=tmp_path / "broker.log", start_timeout=5.0)

    # Tansu exits with code 0 when its port is taken; before it does, the port answers
    # with the other broker's cluster id. Either way start() must not succeed.
    with pytest.raises(BrokerError, match=r"another broker|exited with code"):
        broker.start()
    assert cluster_info(kafka_bootstrap).brokers == (kafka_bootstrap,)


def test_stop_ends_the_process_and_is_idempotent(tmp_path: Path) -> None:
    with TansuBroker(log_path=tmp_path / "broker.log") as broker:
        pid = broker.pid
        assert pid is not None
        assert cluster_info(broker.bootstrap).cluster_id == broker.cluster_id

    assert _process_gone(pid)
    broker.stop()
    with pytest.raises(BrokerError, match="not running"):
        _ = broker.bootstrap
    assert "tansu broker" in (tmp_path / "broker.log").read_text()


def test_default_log_is_removed_by_a_clean_stop() -> None:
    with TansuBroker() as broker:
        log_path = broker.log_path
        assert log_path is not None
        assert log_path.is_file()

    assert not log_path.exists()


def test_free_port_can_be_bound() -> None:
    port = free_port()

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
