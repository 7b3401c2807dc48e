"""`ftlayer bench cluster`, tiny: real `ftlayer serve` shards and client processes;
the JSON shape, figures for each shard count, the ratios named in `targets`, and what
limits them (no timing asserts). Bad shard counts are refused with a clear error."""

from __future__ import annotations

import json

import pytest

from ftlayer.cli import main

PER_SHARDS = (
    "records_per_s",
    "xor_updates_per_s",
    "server_cpu_s_per_million_records",
    "server_cpu_s_per_million_xor_updates",
    "client_cpu_s_per_million_records",
    "cpu_busy_share",
    "server_cpu_share",
    "server_peak_rss_bytes",
)


def test_bench_cluster_json(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "cluster", "--records", "20000", "--events", "40000", "--rounds", "1"]
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["bench"] == "cluster" and result["shards"] == [1, 2]
    assert result["clients"] == 4 and result["records"] == 20000 and result["events"] == 40000
    assert set(result["by_shards"]) == {"1", "2"}
    for count, figures in result["by_shards"].items():
        for key in PER_SHARDS:
            assert figures[key] is not None, (count, key)
        assert figures["records_per_s"] > 0 and figures["xor_updates_per_s"] > 0, count
        assert figures["server_peak_rss_bytes"] > 0, count
    # The ratios are 2 shards over 1, and the targets name them.
    by = result["by_shards"]
    assert result["ratio"] == pytest.approx(
        by["2"]["records_per_s"] / by["1"]["records_per_s"], rel=0.01
    )
    assert result["targets"] == {"ratio": 1.3, "cpu_per_record_ratio": 1.15}
    assert isinstance(result["meets_targets"], bool)
    assert result["cpu_per_record_ratio"] is None or result["cpu_per_record_ratio"] > 0
    assert "cores shared by 4 client processes and 2 server processes" in result["limit"]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--shards", "2"], "compares two shard counts or more (such as 1,2), got 2"),
        (["--shards", "1,4", "--clients", "2"], "every shard needs a client: 2 clients for 4"),
    ],
)
def test_bench_cluster_refuses_what_it_cannot_compare(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "cluster", *argv, "--json"]) == 2
    assert words in capsys.readouterr().err
