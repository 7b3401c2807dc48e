"""Errors that repeat are not a log flood: one line per distinct error of a partition,
with its count, and its traceback once per process and step."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import uuid

import pytest

from ftlayer.errors import FailException
from ftlayer.integration.tasks.results import Failures, log_failures

LOGGER = "ftlayer.integration.tasks"


def _partition_of_malformed_records(n: int) -> Failures:
    failures = Failures()
    for i in range(n):
        try:
            json.loads(b"{not json")
        except ValueError as exc:
            failures.add(exc)
        if i == 0:
            failures.add(KeyError("amount"))
    failures.add(FailException("the user's call"), 3)
    return failures


def test_a_partition_logs_each_distinct_error_once_with_its_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    step = f"map(parse-{uuid.uuid4().hex[:6]})"
    with caplog.at_level(logging.INFO, logger=LOGGER):
        log_failures(_partition_of_malformed_records(19), step, ft=True)
    lines = [r for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 3, [r.getMessage() for r in lines]
    text = [r.getMessage() for r in lines]
    assert any("3 records raised FailException" in m for m in text)
    assert any("19 records failed with JSONDecodeError" in m for m in text)
    assert any("1 records failed with KeyError" in m for m in text)
    assert sum(r.exc_info is not None for r in lines) == 2  # one traceback per error


def test_the_same_error_on_a_replay_logs_no_second_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    step = f"map(parse-{uuid.uuid4().hex[:6]})"
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        log_failures(_partition_of_malformed_records(19), step, ft=True)
        caplog.clear()
        for _replay in range(5):
            log_failures(_partition_of_malformed_records(19), step, ft=True)
        again = [r for r in caplog.records if r.name == LOGGER]
        assert len(again) == 10 and all(r.exc_info is None for r in again)
        assert all("traceback logged at" in r.getMessage() for r in again)
        caplog.clear()
        log_failures(_partition_of_malformed_records(1), f"{step}-other-step", ft=False)
    other = [r for r in caplog.records if r.name == LOGGER]
    assert sum(r.exc_info is not None for r in other) == 2  # another step: its own traceback
    assert all("dropped (FT is off)" in r.getMessage() for r in other)


def test_a_python_worker_logs_with_time_level_and_logger() -> None:
    code = (
        "import logging\n"
        "from ftlayer.integration.tasks.results import log_with_time_and_level\n"
        "log_with_time_and_level(); log_with_time_and_level()\n"
        "logging.getLogger('ftlayer.integration.tasks').warning('parse: 2 records failed')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    lines = [line for line in done.stderr.splitlines() if "records failed" in line]
    assert len(lines) == 1, done.stderr  # one handler, however often it is asked for
    assert " WARNING ftlayer.integration.tasks: parse: 2 records failed" in lines[0]
    assert lines[0][:4].isdigit()  # starts with the date and time
