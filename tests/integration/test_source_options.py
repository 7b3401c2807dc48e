"""The ftkafka source's options: declared once, parsed and documented from that table."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from ftlayer.errors import ConfigError
from ftlayer.integration.source.options import (
    OPTIONS,
    Option,
    markdown_table,
    parse_options,
    write_markdown_table,
)

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "user-guide.md"
BASE = {"kafka.bootstrap.servers": "h:1", "subscribe": "t", "ft.address": "h:2"}


def test_the_user_guide_shows_the_declared_options() -> None:
    stale = write_markdown_table(GUIDE, check=True)
    assert not stale, "docs/user-guide.md's option table differs from OPTIONS: run `make docs`"
    assert markdown_table() in GUIDE.read_text(encoding="utf-8")


def test_every_declared_option_is_accepted_and_nothing_else() -> None:
    valid = {
        "text": "x",
        "integer": "7",
        "boolean": "true",
    }
    for option in OPTIONS:
        if option.type == "prefix" or option.name in BASE or option.name == "ft.token":
            continue
        value = option.choices[0] if option.choices else valid[option.type]
        if option.name in ("startingOffsets",):
            value = "latest"
        if option.name.endswith("File"):  # ft.tokenFile, ft.loopKeyFile
            value = str(GUIDE)  # any readable, non-empty file
        parse_options({**BASE, option.name: value})
        parse_options({**BASE, option.name.upper(): value})  # Spark may change the case
    with pytest.raises(ConfigError, match=r"unknown option 'ft\.nosuch'"):
        parse_options({**BASE, "ft.noSuch": "1"})


@pytest.mark.parametrize(
    "option",
    [o for o in OPTIONS if o.type == "integer" and o.minimum is not None],
    ids=lambda o: o.name,
)
def test_an_integer_below_its_minimum_is_refused_naming_the_option(option: Option) -> None:
    name, minimum = option.name, option.minimum or 0
    with pytest.raises(ConfigError, match=f"option {name} must be at least {minimum}"):
        parse_options({**BASE, name: str(minimum - 1)})
    with pytest.raises(ConfigError, match=f"option {name} must be an integer"):
        parse_options({**BASE, name: "soon"})


def test_the_defaults_are_the_declared_ones() -> None:
    parsed = parse_options(BASE)
    declared = {o.name: o.default for o in OPTIONS}
    assert parsed.poll_timeout_s * 1000 == declared["kafkaConsumer.pollTimeoutMs"]
    assert parsed.kafka_retries == declared["fetchOffset.numRetries"]
    assert parsed.kafka_retry_interval_s * 1000 == declared["fetchOffset.retryIntervalMs"]
    assert parsed.ft_connect_timeout_s * 1000 == declared["ft.connectTimeoutMs"]
    assert parsed.ft_reconnect_timeout_s * 1000 == declared["ft.reconnectTimeoutMs"]
    assert parsed.partitioner == declared["ft.partitioner"]
    assert parsed.checkpoint_mode == declared["ft.checkpointMode"]
    assert parsed.starting == declared["startingOffsets"]
    assert parsed.max_offsets_per_trigger is None and parsed.timeout_s is None
    assert parsed.heartbeat_ms == declared["ft.heartbeatMs"] == 2000
    assert parse_options({**BASE, "ft.heartbeatMs": "0"}).heartbeat_ms == 0  # off


def test_a_missing_token_file_is_reported_under_its_own_option(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-token"
    with pytest.raises(ConfigError) as raised:
        parse_options({**BASE, "ft.tokenFile": str(missing)})
    message = str(raised.value)
    assert message.startswith("option ft.tokenFile:"), message
    assert "ft.address" not in message and str(missing) in message


def test_the_retry_options_make_the_sources_retry_policy() -> None:
    parsed = parse_options(BASE)
    declared = {o.name: o.default for o in OPTIONS}
    assert parsed.retry.max_retries == declared["ft.maxRetries"] == 10
    assert parsed.retry.backoff_ms == declared["ft.retryBackoffMs"]
    assert parsed.retry.backoff_max_ms == declared["ft.retryBackoffMaxMs"]
    assert parsed.dead_letter_topic is None and not parsed.keeps_headers
    given = {"ft.maxRetries": "-1", "ft.retryBackoffMs": "0", "ft.deadLetterTopic": " dlq "}
    parsed = parse_options({**BASE, **given})
    assert (parsed.retry.max_retries, parsed.retry.backoff_ms) == (-1, 0)
    assert parsed.dead_letter_topic == "dlq" and parsed.keeps_headers
    with pytest.raises(
        ConfigError, match=r"ft\.retryBackoffMaxMs \(100\) is below ft\.retryBackoffMs"
    ):
        parse_options({**BASE, "ft.retryBackoffMs": "500", "ft.retryBackoffMaxMs": "100"})
    with pytest.raises(ConfigError, match=r"ft\.maxRetries must be an integer from -1 to"):
        parse_options({**BASE, "ft.maxRetries": "1000000000"})


def test_the_deprecated_spelling_ft_timeout_ms_still_works_and_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="ftlayer.source"):
        old = parse_options({**BASE, "ft.timeoutMs": "2500"})
    warnings = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert warnings == ["option ft.timeoutMs is deprecated: use ft.treeTimeoutMs (same meaning)"]
    assert old.timeout_s == 2.5
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ftlayer.source"):
        assert parse_options({**BASE, "FT.TIMEOUTMS": "2500"}) == old  # any case, as Spark
        assert parse_options({**BASE, "ft.treeTimeoutMs": "2500"}) == old
    assert len([r for r in caplog.records if "deprecated" in r.getMessage()]) == 1
    with pytest.raises(ConfigError, match=r"option ft\.treeTimeoutMs must be at least 1"):
        parse_options({**BASE, "ft.timeoutMs": "0"})
    both = {**BASE, "ft.timeoutMs": "2500", "ft.treeTimeoutMs": "2500"}
    with pytest.raises(ConfigError, match=r"ft\.treeTimeoutMs or .* ft\.timeoutMs, not both"):
        parse_options(both)
    assert "Deprecated spelling: `ft.timeoutMs`" in markdown_table()
