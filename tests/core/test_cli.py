"""The ftlayer CLI: benches print one JSON object last; bad arguments are refused."""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftlayer.cli import main
from ftlayer.registration import SourceRegistration


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


@pytest.mark.parametrize(
    ("argv", "module", "function", "passed"),
    [
        (
            ["--fast", "--persist", "payload", "--fail-rate", "0.01"],
            "benchfast",
            "bench_fast",
            {"fail_rate": 0.01, "persist": "payload"},
        ),
        (["--fast"], "benchfast", "bench_fast", {"fail_rate": 0.0, "persist": "reference"}),
        ([], "benchpipe", "bench_pipeline", {"fail_rate": 0.001, "persist": "reference"}),
    ],
)
def test_bench_pipeline_passes_persist_and_fail_rate_and_prints_the_server_cost(
    argv: list[str],
    module: str,
    function: str,
    passed: dict[str, object],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import importlib

    harness = importlib.import_module(f"ftlayer.integration.harness.{module}")
    given: dict[str, object] = {}

    def bench(**kwargs: object) -> dict[str, object]:
        given.update(kwargs)
        return {
            "bench": "pipeline",
            "persist": kwargs["persist"],
            "server_cpu_us_per_record": 2.5,
            "lmdb_bytes_per_record": None,
        }

    monkeypatch.setattr(harness, function, bench)
    assert main(["bench", "pipeline", *argv]) == 0
    assert {k: given[k] for k in passed} == passed
    out = capsys.readouterr().out
    assert "server_cpu_us_per_record" in out and "lmdb_bytes_per_record" in out
    assert out.rstrip().endswith(
        "ftlayer bench pipeline: the FT-layer server in barrier mode: 2.5 µs of CPU and no "
        f"write figure (/proc/<pid>/io not readable) per record (ft.persist {passed['persist']})"
    )


def test_demo_takes_persist_reference_by_default_and_refuses_another() -> None:
    from ftlayer.cli import _parser

    assert _parser().parse_args(["demo"]).persist == "reference"
    assert _parser().parse_args(["demo", "--persist", "payload"]).persist == "payload"
    with pytest.raises(SystemExit):
        _parser().parse_args(["demo", "--persist", "bytes"])


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--kill-shard"], "--kill-shard kills one of several FT-layer shards while the others"),
        (["--shards", "1", "--kill-shard"], "it needs --shards 2 or more (got 1)"),
        (["--shards", "300"], "--shards is at most 256, got 300"),
    ],
)
def test_demo_refuses_a_shard_kill_without_shards_to_spare(argv: list[str], words: str) -> None:
    with pytest.raises(SystemExit, match=re.escape(words)):
        main(["demo", *argv])


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--kill-receiver"], "--kill-receiver needs --source http or jetstream"),
        (["--source", "http", "--cluster"], "--cluster go with --source kafka"),
        (
            ["--source", "jetstream", "--shards", "2", "--kill-workers", "1"],
            "--kill-workers, --shards",
        ),
    ],
)
def test_demo_on_a_source_that_cannot_replay_refuses_what_goes_with_kafka(
    argv: list[str], words: str
) -> None:
    with pytest.raises(SystemExit, match=re.escape(words)):
        main(["demo", *argv])


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


@pytest.fixture(autouse=True)
def _root_logger_restored() -> Iterator[None]:
    """`ftlayer serve` run in process sends the root logger to the stream it was given
    (here pytest's capture, closed after the test): put the root logger back, or every
    later log line of the session (py4j's, kafka-python's) goes to a closed stream."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
    for handler in handlers:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(level)


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


@pytest.mark.parametrize(("flag", "warned"), [("--tree-timeout-s", False), ("--timeout-s", True)])
def test_the_tree_timeout_flag_and_its_deprecated_spelling_mean_the_same(
    flag: str, warned: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    from ftlayer.cli import _parser

    args = _parser().parse_args(["serve", "--data-dir", "d", flag, "12.5"])
    assert args.timeout_s == 12.5
    err = capsys.readouterr().err
    assert ("--timeout-s is deprecated: use --tree-timeout-s" in err) is warned


@contextlib.contextmanager
def _server_with_dead_letters_and_a_checkpoint(
    tmp_path: Path,
) -> Iterator[tuple[str, int]]:
    """A server whose source "orders" (id 7) has nested settings (its retry policy),
    a checkpoint of query "orders", and three dead letters: an ftkafka record with a
    text key and a long JSON value, one with a binary key and no value, and a payload
    that is not an ftkafka record. Yields (address, source id)."""
    from ftlayer.acking.ids import new_ids
    from ftlayer.causes import Cause, FailKind
    from ftlayer.client import FTClient
    from ftlayer.payloads import encode_payloads
    from ftlayer.records import RecordBatch
    from ftlayer.server import FTServer

    source = 7
    value = json.dumps({"order": 17, "items": ["a" * 10] * 8}).encode()
    payloads = [
        *encode_payloads([b"order-17", b"\x00\xff\x10"], [value, None], [1_700_000_000_000] * 2),
        b"not an ftkafka payload",
    ]
    with FTServer(tmp_path / "data") as server:
        address = "{}:{}".format(*server.address)
        with FTClient(address) as client:
            retry = {"max_retries": 0, "backoff_ms": 0, "backoff_max_ms": 0}
            client.register_source(SourceRegistration(source, "forward", 2, retry=retry))
            # A source with a registered name and no checkpoint yet.
            client.register_source(SourceRegistration(8, "forward", 1, name="payments"))
            roots = new_ids(3)
            client.persist(
                RecordBatch.build(
                    roots,
                    payloads,
                    source_ids=source,
                    topics="orders",
                    partitions=0,
                    offsets=[0, 1, 2],
                )
            )
            client.fail(roots, Cause(FailKind.ERROR, "map(parse)", "ValueError: bad order"))
            client.checkpoint(
                begin=True,
                query="orders",
                position={"kafka": {"orders": {"0": 3}}, "replay": 0},
                sources=[source],
            )
        yield address, source


def test_status_shows_nested_settings_as_rows_and_each_source_by_name(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    with _server_with_dead_letters_and_a_checkpoint(tmp_path) as (address, source):
        assert main(["status", "--server", address]) == 0
    shown = capsys.readouterr().out
    assert "{'" not in shown, shown  # no Python dict printed
    assert re.search(rf"sources\.{source}\.name +│ orders ", shown), shown
    assert re.search(rf"sources\.{source}\.partitioner +│ forward ", shown), shown
    assert re.search(rf"sources\.{source}\.retry\.max_retries +│ 0 ", shown), shown
    assert re.search(rf"sources\.{source}\.options +│ none ", shown), shown
    assert re.search(r"sources\.8\.name +│ payments ", shown), shown
    # The per-source table: the source's name beside its id, then its counters.
    assert re.search(rf"│ orders +│ +{source} +│ +3 +│", shown), shown


def test_dead_letters_show_previews_the_key_and_value_and_counts_read_right(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    with _server_with_dead_letters_and_a_checkpoint(tmp_path) as (address, _):
        server = ["--server", address]
        assert main(["dead-letters", "list", *server, "--json"]) == 0
        seqs = [x["seq"] for x in _last_json(capsys)["letters"]]  # type: ignore[union-attr]
        shown = []
        for seq in seqs:
            assert main(["dead-letters", "show", str(seq), *server]) == 0
            shown.append(capsys.readouterr().out)
        assert main(["dead-letters", "list", *server, "--seq", str(seqs[0])]) == 0
        listed = capsys.readouterr().out
        assert main(["dead-letters", "purge", *server, "--seq", str(seqs[0])]) == 0
        purged = capsys.readouterr().out
        assert main(["dead-letters", "purge", *server]) == 0
        purged_rest = capsys.readouterr().out
    text, binary, raw = shown
    assert '  key:   "order-17"\n' in text, text
    assert "\n  1 attempt, first failed " in text, text
    value = json.dumps({"order": 17, "items": ["a" * 10] * 8})
    assert f'  value: "{value[:60]}..." ({len(value):,} bytes)\n' in text, text
    assert "  key:   hex 00ff10 (3 bytes)\n" in binary, binary
    assert "  value: none\n" in binary, binary
    assert '  payload (not an ftkafka record): "not an ftkafka payload"\n' in raw, raw
    assert "1 dead letter " in listed and "1 dead letters" not in listed, listed
    assert purged.strip() == "1 dead letter purged"
    assert purged_rest.strip() == "2 dead letters purged"
