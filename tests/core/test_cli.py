"""The ftlayer CLI: benches print one JSON object last; bad arguments are refused."""

from __future__ import annotations

import json

import pytest

from ftlayer.cli import main


def _last_json(capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert isinstance(result, dict)
    return result


def test_bench_acker_json_reports_both_sides(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "acker", "--roots", "5000", "--json"]) == 0
    result = _last_json(capsys)
    assert result["bench"] == "acker" and result["events"] == 20_000
    for key in ("updates_per_s", "naive_updates_per_s", "ratio_vs_naive"):
        assert float(result[key]) > 0  # type: ignore[arg-type]
    # The FT layer's own table: 40 bytes of rows per root at least, plus its index.
    for key in (
        "ftlayer_table_bytes_per_pending_root",
        "ftlayer_table_bytes_per_pending_root_filled",
    ):
        assert float(result[key]) > 40  # type: ignore[arg-type]
    assert isinstance(result["meets_targets"], bool)


def test_bench_persist_json_reports_both_sides(
    capsys: pytest.CaptureFixture[str], tmp_path: object
) -> None:
    argv = ["bench", "persist", "--records", "3000", "--batch", "500", "--rounds", "1"]
    assert main([*argv, "--no-sync", "--dir", str(tmp_path), "--json"]) == 0
    result = _last_json(capsys)
    assert result["bench"] == "persist" and result["records"] == 3000
    assert float(result["ratio_vs_raw_lmdb"]) > 0  # type: ignore[arg-type]


@pytest.mark.parametrize("argv", [["bench", "acker", "--roots", "0"], ["bench", "nope"], []])
def test_bad_arguments_exit_with_usage(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "usage: ftlayer" in capsys.readouterr().err


def test_status_of_an_unreachable_server_is_a_clear_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from ftlayer.integration.harness.broker import free_port

    address = f"127.0.0.1:{free_port()}"
    assert main(["status", "--server", address, "--wait-s", "0.2"]) == 2
    err = capsys.readouterr().err
    assert f"the FT-layer server at {address} could not be opened" in err


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--http-host", "0.0.0.0"], "go with --http-port"),
        (["--http-public"], "go with --http-port"),
        (["--http-port", "0", "--http-host", "10.1.2.3"], "without the token"),
    ],
)
def test_http_flags_without_their_port_or_token_are_refused(
    extra: list[str], words: str, capsys: pytest.CaptureFixture[str], tmp_path: object
) -> None:
    assert main(["serve", "--data-dir", f"{tmp_path}/data", *extra]) == 2
    assert words in capsys.readouterr().err
