"""TLS between clients and a real `ftlayer serve` process (issue 3, section 6).

Certificates come from trustme: a throwaway CA and a server certificate for 127.0.0.1,
written as PEM files the way an operator would hand them to `ftlayer serve`.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import trustme
from serverproc import Server, StartServer

from ftlayer.acking.handlers import Persister, TaskHandler
from ftlayer.client import ConnectionLost, FTClient
from ftlayer.errors import ConfigError
from ftlayer.server import FTServer
from ftlayer.wire import encode_hello, new_nonce


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    paths = {name: tmp_path / f"{name}.pem" for name in ("ca", "cert", "key", "other_ca")}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    cert.cert_chain_pems[0].write_to_path(str(paths["cert"]))
    cert.private_key_pem.write_to_path(str(paths["key"]))
    trustme.CA().cert_pem.write_to_path(str(paths["other_ca"]))
    return paths


@pytest.fixture
def tls_server(start_server: StartServer, pki: dict[str, Path], tmp_path: Path) -> Server:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    return start_server(
        None,
        "--tls-cert",
        str(pki["cert"]),
        "--tls-key",
        str(pki["key"]),
        "--token-file",
        str(token),
    )


def test_records_complete_over_tls_with_a_token(tls_server: Server, pki: dict[str, Path]) -> None:
    with FTClient(tls_server.address, token=b"s3cret", tls=str(pki["ca"])) as client:
        anchors = Persister(client).persist(
            [b"a", b"b", b"c"], topics="t", partitions=np.zeros(3), offsets=None
        )
        task = TaskHandler(client)
        task.process(anchors, np.zeros(0, dtype=np.intp))
        task.flush()
        status = client.status()
    assert (status["persisted"], status["completed"], status["pending"]) == (3, 3, 0)
    status_command = [sys.executable, "-m", "ftlayer.cli", "status"]
    status_command += ["--server", tls_server.address, "--tls-ca", str(pki["ca"]), "--json"]
    refused = subprocess.run(status_command, capture_output=True, check=False, timeout=60)
    assert refused.returncode == 2
    assert b"requires a token" in refused.stderr
    token_file = tls_server.data_dir.parent / "token"
    shown = subprocess.run(
        [*status_command, "--token-file", str(token_file)],
        capture_output=True,
        check=True,
        timeout=60,
    )
    assert json.loads(shown.stdout.splitlines()[-1])["completed"] == 3


def test_a_client_that_does_not_trust_the_certificate_is_refused(
    tls_server: Server, pki: dict[str, Path]
) -> None:
    with (
        FTClient(tls_server.address, token=b"s3cret", tls=str(pki["other_ca"])) as client,
        pytest.raises(ConnectionLost, match="CERTIFICATE_VERIFY_FAILED"),
    ):
        client.status()


def test_plain_tcp_to_a_tls_server_is_closed_and_others_go_on(
    tls_server: Server, pki: dict[str, Path]
) -> None:
    with socket.create_connection(_host_port(tls_server.address), timeout=5) as raw:
        raw.sendall(encode_hello(1, new_nonce(), "plain"))
        assert raw.recv(1 << 16) == b""  # closed after the failed TLS handshake
    with FTClient(tls_server.address, token=b"s3cret", tls=str(pki["ca"])) as client:
        assert client.status()["pending"] == 0
    assert "TLS handshake failed" in tls_server.log.read_text()


def test_tls_to_a_plain_server_fails_clearly(ft_server: Server, pki: dict[str, Path]) -> None:
    with (
        FTClient(ft_server.address, tls=str(pki["ca"]), connect_timeout=5) as client,
        pytest.raises(ConnectionLost, match="could not be opened"),
    ):
        client.status()


def test_tls_needs_both_files_and_loadable_ones(pki: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="both a certificate and its private key"):
        FTServer(tmp_path / "d", tls_cert=pki["cert"])
    with pytest.raises(ConfigError, match="cannot load the TLS certificate"):
        FTServer(tmp_path / "d", tls_cert=pki["cert"], tls_key=pki["ca"])
    with pytest.raises(ConfigError, match="cannot load the TLS CA file"):
        FTClient("127.0.0.1:1", tls=str(tmp_path / "missing.pem"))


def _host_port(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def test_a_tls_client_waits_for_a_place_at_a_full_server(
    pki: dict[str, Path], tmp_path: Path
) -> None:
    """Over TLS the refusal is a cut handshake (no plain ERROR 103 can go first); the
    client retries it with backoff like a refused connection."""
    with FTServer(
        tmp_path / "data", tls_cert=pki["cert"], tls_key=pki["key"], max_connections=1
    ) as server:
        address = "{}:{}".format(*server.address)
        holder = FTClient(address, tls=str(pki["ca"]))
        assert holder.status()["connections"] == 1
        threading.Timer(0.5, holder.close).start()
        with FTClient(address, tls=str(pki["ca"]), reconnect_s=10) as client:
            assert client.status()["connections"] == 1
