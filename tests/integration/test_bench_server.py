"""`ftlayer bench server`, tiny: the JSON shape and positive figures (no timing asserts)."""

from __future__ import annotations

import json
from pathlib import Path

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


def test_bench_server_mixed_phase_json(capsys: pytest.CaptureFixture[str]) -> None:
    """The mixed phase (a job's shape): each persist's and XOR frame's round trip."""
    args = ["bench", "server", "--records", "2000", "--events", "20000", "--rounds", "1"]
    assert main([*args, "--mixed-batches", "2", "--json"]) == 0
    mixed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["mixed"]
    assert mixed["batches"] == 2 and mixed["rounds"] == 1
    assert mixed["batch_records"] == 200_000 and mixed["chunk_records"] == 50_000
    for key in ("persist_ms", "xor_ms", "batch_ms"):
        figures = mixed[key]
        assert 0 < figures["median"] <= figures["p90"] <= figures["max"], key
    assert mixed["records_per_s"] > 0
    assert main([*args, "--mixed-batches", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["mixed"] is None


def test_bench_checkpoint_json(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "checkpoint", "--rounds", "2", "--batches", "3", "--batch", "500"]
    assert main([*args, "--pending", "0,1000", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["bench"] == "checkpoint"
    # Every batch of the rounds with checkpoints was checkpointed and completed.
    assert result["checkpoints_completed"] == 2 * 3
    assert result["records_per_s_with_checkpoints"] > 0
    assert result["records_per_s_without_checkpoints"] > 0
    spread = result["pair_ratios"]
    assert spread["pairs"] == 2 and spread["min"] <= spread["median"] <= spread["max"]
    low, high = spread["geometric_mean_95ci"]
    assert 0 < low <= high
    steal = result["cpu_steal_percent"]
    assert (steal is None) is (not Path("/proc/stat").exists())
    assert steal is None or 0 <= steal <= 100
    by_pending = {row["pending_roots"]: row for row in result["checkpoint_time_by_pending"]}
    assert sorted(by_pending) == [0, 1000]
    assert 24 <= by_pending[1000]["bytes_per_pending_root"] < 25  # root, ack, seq + header
    assert isinstance(result["meets_target"], bool)
