"""`ftlayer bench server`, tiny: the JSON shape and positive figures (no timing asserts)."""

from __future__ import annotations

import json

import pytest

from ftlayer.cli import main


def test_bench_server_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "server", "--records", "2000", "--events", "20000", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["bench"] == "server"
    assert result["clients"] == 2
    assert result["records"] == 2000
    assert result["events"] == 20000
    for key in (
        "xor_updates_per_s",
        "records_per_s",
        "in_process_xor_updates_per_s",
        "in_process_records_per_s",
        "xor_ratio_vs_in_process",
        "records_ratio_vs_in_process",
    ):
        assert result[key] > 0, key
    assert set(result["targets"]) == {"xor_updates_per_s", "records_per_s"}
    assert isinstance(result["meets_targets"], bool)
