"""`ftlayer bench ingest`, tiny: the JSON shape and sane figures (no timing asserts)."""

from __future__ import annotations

import json

import pytest

from ftlayer.cli import main


def test_bench_ingest_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "ingest", "--messages", "3000", "--batch", "500", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["bench"] == "ingest"
    assert (result["messages"], result["batch"], result["payload_bytes"]) == (3000, 500, 100)
    for key in ("bare_per_s", "one_receiver_per_s", "two_receivers_per_s"):
        assert result[key] > 0, key
    assert result["ratio"] == pytest.approx(
        result["one_receiver_per_s"] / result["bare_per_s"], rel=0.01
    )
    assert result["target_ratio"] == 0.5 and isinstance(result["meets_target"], bool)
    assert result["machine"]["cpus"] >= 1
