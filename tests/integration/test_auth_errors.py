"""A wrong or missing token: the error a user sees names the option that fixes it.

Real `ftlayer serve` processes with a token file; the ftkafka source's driver half and
the `ftlayer status` command as a user runs them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from serverproc import StartServer

from ftlayer.integration.source import FTKafkaDataSource
from ftlayer.wire import AuthFailed, NotAuthenticated


def _server_with_token(start_server: StartServer, tmp_path: Path) -> str:
    token_file = tmp_path / "token"
    token_file.write_bytes(b"s3cret\n")
    return start_server(None, "--token-file", str(token_file)).address


def test_a_wrong_token_in_ft_token_file_names_the_option(
    start_server: StartServer, tmp_path: Path, kafka_bootstrap: str, kafka_topic: str
) -> None:
    address = _server_with_token(start_server, tmp_path)
    wrong = tmp_path / "wrong-token"
    wrong.write_bytes(b"not-it\n")
    options = {
        "kafka.bootstrap.servers": kafka_bootstrap,
        "subscribe": kafka_topic,
        "ft.address": address,
        "ft.tokenFile": str(wrong),
    }
    source = FTKafkaDataSource(options)
    reader = source.streamReader(source.schema())
    try:
        with pytest.raises(AuthFailed, match=r"refused the token.*ft\.tokenFile"):
            reader.initialOffset()
    finally:
        reader.stop()
    options.pop("ft.tokenFile")
    source = FTKafkaDataSource(options)
    reader = source.streamReader(source.schema())
    try:
        with pytest.raises(NotAuthenticated, match=r"requires a token.*ft\.tokenFile"):
            reader.initialOffset()
    finally:
        reader.stop()


def test_status_with_a_wrong_token_file_says_so(start_server: StartServer, tmp_path: Path) -> None:
    address = _server_with_token(start_server, tmp_path)
    wrong = tmp_path / "wrong-token"
    wrong.write_bytes(b"not-it\n")
    command = [sys.executable, "-m", "ftlayer.cli", "status", "--server", address]
    done = subprocess.run(
        [*command, "--token-file", str(wrong)], capture_output=True, timeout=60, check=False
    )
    assert done.returncode != 0
    assert b"refused the token" in done.stderr and b"--token-file" in done.stderr
