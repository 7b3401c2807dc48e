"""TLS between clients and a real `ftlayer serve` process (issue 3, section 6).

Certificates come from trustme: a throwaway CA and a server certificate for 127.0.0.1,
written as PEM files the way an operator would hand them to `ftlayer serve`.
"""

from __future__ import annotations

import json
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import trustme
from serverproc import Server, StartServer, serve_command

from ftlayer.acking.handlers import Persister, TaskHandler
from ftlayer.client import FTClient, TLSMismatch
from ftlayer.errors import ConfigError
from ftlayer.integration.source import FTKafkaDataSource
from ftlayer.server import FTServer
from ftlayer.wire import ErrorCode, FrameReader, Kind, decode_error, encode_hello, new_nonce


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
    """At once (no retries: only another CA helps), naming the CA file and the
    certificate problem."""
    started = time.monotonic()
    with (
        FTClient(tls_server.address, token=b"s3cret", tls=str(pki["other_ca"])) as client,
        pytest.raises(TLSMismatch) as refused,
    ):
        client.status()
    assert time.monotonic() - started < 5
    assert str(refused.value) == (
        f"the TLS certificate of the FT-layer server at {tls_server.address} does not verify "
        f"against the CA in {pki['other_ca']} (unable to get local issuer certificate): give "
        "the CA that signed the server's certificate (the source option ft.tlsCa, or "
        "--tls-ca of the ftlayer command)"
    )


def test_a_certificate_that_does_not_name_the_host_is_refused_naming_it(
    tmp_path: Path,
) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("ft-host.example")
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    with FTServer(
        tmp_path / "data", tls_cert=tmp_path / "cert.pem", tls_key=tmp_path / "key.pem"
    ) as server:
        address = "{}:{}".format(*server.address)
        with (
            FTClient(address, tls=str(tmp_path / "ca.pem")) as client,
            pytest.raises(TLSMismatch, match=r"does not name 127\.0\.0\.1 .*subjectAltName"),
        ):
            client.status()


def test_plain_tcp_to_a_tls_server_fails_at_once_naming_tls(
    tls_server: Server, pki: dict[str, Path]
) -> None:
    """A client without a CA is told, in plain bytes, that the server speaks TLS: the
    client, `ftlayer status` and the raw protocol all see it at once, and the server
    serves the others meanwhile."""
    with socket.create_connection(_host_port(tls_server.address), timeout=5) as raw:
        raw.sendall(encode_hello(1, new_nonce(), "plain"))
        reply = FrameReader().feed(_read_to_end(raw))
    assert [(f.kind, f.request_id) for f in reply] == [(Kind.ERROR, 0)]
    assert decode_error(reply[0]).code == ErrorCode.TLS_REQUIRED

    started = time.monotonic()
    with (
        FTClient(tls_server.address, token=b"s3cret", reconnect_s=60) as client,
        pytest.raises(TLSMismatch) as refused,
    ):
        client.status()
    assert time.monotonic() - started < 5
    assert str(refused.value) == (
        f"the FT-layer server at {tls_server.address} speaks TLS; give its CA certificate "
        "(the source option ft.tlsCa, or --tls-ca of the ftlayer command)"
    )
    token_file = tls_server.data_dir.parent / "token"
    status = [sys.executable, "-m", "ftlayer.cli", "status", "--server", tls_server.address]
    status += ["--token-file", str(token_file), "--wait-s", "60"]
    started = time.monotonic()
    done = subprocess.run(status, capture_output=True, text=True, check=False, timeout=60)
    assert done.returncode == 2 and time.monotonic() - started < 20
    assert "speaks TLS; give its CA certificate" in done.stderr and "--tls-ca" in done.stderr

    with FTClient(tls_server.address, token=b"s3cret", tls=str(pki["ca"])) as client:
        assert client.status()["pending"] == 0
    assert "a plain-TCP client on this TLS server" in tls_server.log.read_text()


def test_tls_to_a_plain_server_fails_at_once_naming_tls(
    ft_server: Server, pki: dict[str, Path]
) -> None:
    started = time.monotonic()
    with (
        FTClient(ft_server.address, tls=str(pki["ca"]), reconnect_s=60) as client,
        pytest.raises(TLSMismatch) as refused,
    ):
        client.status()
    assert time.monotonic() - started < 5
    assert str(refused.value).startswith(
        f"the FT-layer server at {ft_server.address} does not speak TLS"
    )
    assert "ft.tlsCa" in str(refused.value) and "--tls-cert" in str(refused.value)
    assert "a TLS client on this plain-TCP server" in ft_server.log.read_text()


def test_the_serving_line_says_tls(pki: dict[str, Path], tmp_path: Path) -> None:
    """What an operator reads first, and what scripts parse: the address right after
    "ftlayer serving on ", then " (TLS)"."""
    command = serve_command(tmp_path / "data", "--tls-cert", str(pki["cert"]))
    command += ["--tls-key", str(pki["key"])]
    log = tmp_path / "serve.log"
    with log.open("wb") as stderr:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, bufsize=0)
    try:
        assert proc.stdout is not None
        assert select.select([proc.stdout], [], [], 20)[0], f"no line; log: {log.read_text()}"
        line = proc.stdout.readline().decode()
        host, port = _host_port(line.removeprefix("ftlayer serving on ").split()[0])
        assert line == f"ftlayer serving on 127.0.0.1:{port} (TLS)\n" and host == "127.0.0.1"
    finally:
        proc.terminate()
        proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()
    assert "with TLS" in log.read_text()


def _read_to_end(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(1 << 16):
        data += chunk
    return data


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


def test_the_source_without_ft_tls_ca_fails_at_once_naming_the_option(
    tls_server: Server, pki: dict[str, Path], kafka_bootstrap: str, kafka_topic: str
) -> None:
    """The ftkafka source's driver half, as Spark calls it: no retrying for
    ft.reconnectTimeoutMs, one error naming TLS and the option; with ft.tlsCa it works."""
    options = {
        "kafka.bootstrap.servers": kafka_bootstrap,
        "subscribe": kafka_topic,
        "ft.address": tls_server.address,
        "ft.tokenFile": str(tls_server.data_dir.parent / "token"),
    }
    source = FTKafkaDataSource(options)
    reader = source.streamReader(source.schema())
    started = time.monotonic()
    try:
        with pytest.raises(TLSMismatch, match=r"speaks TLS; give its CA certificate .*ft\.tlsCa"):
            reader.initialOffset()
    finally:
        reader.stop()
    assert time.monotonic() - started < 10
    source = FTKafkaDataSource({**options, "ft.tlsCa": str(pki["ca"])})
    reader = source.streamReader(source.schema())
    try:
        assert reader.initialOffset()["replay"] == 0
    finally:
        reader.stop()
