"""Log lines that name what failed (issue 16, part 6): the JSON and text formatters of
`ftlayer serve --log-format`, and the core's failure lines (timeouts, explicit fails,
dead letters, recovery, a failed requeue write), one per source and partition with the
offsets and roots concerned."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from manual_clock import Clock

from ftlayer.acking.ids import new_ids
from ftlayer.causes import Cause, FailKind
from ftlayer.core import FTLayer
from ftlayer.core.retries import RetryPolicy
from ftlayer.errors import ConfigError, StorageError
from ftlayer.logs import FIELDS_ATTR, JsonFormatter, TextFormatter, configure, fields
from ftlayer.persistence import MemoryStorage
from ftlayer.records import RecordBatch
from ftlayer.registration import SourceRegistration

SOURCE = 9


def _record(message: str, *args: Any, extra: dict[str, Any] | None = None) -> logging.LogRecord:
    record = logging.getLogger("ftlayer.test").makeRecord(
        "ftlayer.test", logging.WARNING, __file__, 1, message, args, None
    )
    for key, value in (extra or {}).items():
        setattr(record, key, value)
    return record


def test_json_lines_carry_time_level_logger_message_and_the_fields() -> None:
    record = _record(
        "%d trees timed out", 2, extra=fields(partition=1, roots=["0x2a"], message="not me")
    )
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "2 trees timed out"  # a field never replaces the five keys
    assert (line["level"], line["logger"], line["partition"], line["roots"]) == (
        "WARNING", "ftlayer.test", 1, ["0x2a"],
    )  # fmt: skip
    assert line["time"].endswith("Z") and "T" in line["time"]
    try:
        raise StorageError("disk full")
    except StorageError:
        failing = logging.getLogger("x").makeRecord(
            "x",
            logging.ERROR,
            __file__,
            1,
            "tick failed",
            (),
            exc_info=__import__("sys").exc_info(),
        )
    line = json.loads(JsonFormatter().format(failing))
    assert "StorageError: disk full" in line["exception"] and "\n" not in json.dumps(line)[
        :-1
    ].replace("\\n", "")


def test_text_lines_append_the_fields() -> None:
    text = TextFormatter().format(_record("failed", extra=fields(topic="orders", offsets=[3, 4])))
    assert text.endswith("ftlayer.test failed [topic=orders offsets=[3,4]]")
    assert TextFormatter().format(_record("plain")).endswith("ftlayer.test plain")
    with pytest.raises(ConfigError, match="log format"):
        configure("xml")


@pytest.fixture
def json_log() -> Iterator[io.StringIO]:
    """Every log line of this test, as JSON in a buffer (configure, as serve does)."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    stream = io.StringIO()
    configure("json", stream)
    yield stream
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def _lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def _failures(stream: io.StringIO) -> list[dict[str, Any]]:
    return [line for line in _lines(stream) if line["logger"] == "ftlayer.core"]


def _persist(ft: FTLayer, n: int) -> RecordBatch:
    batch = RecordBatch.build(
        new_ids(n),
        [b"p%d" % i for i in range(n)],
        source_ids=SOURCE,
        topics=["orders", "orders", "refunds"][:n] if n <= 3 else "orders",
        partitions=np.arange(n) % 2,
        offsets=np.arange(10, 10 + n),
    )
    ft.persist(batch, np.full(n, 5, dtype=np.uint64))
    return batch


def test_failed_trees_are_logged_per_partition_with_offsets_and_roots(
    json_log: io.StringIO,
) -> None:
    clock = Clock()
    ft = FTLayer(MemoryStorage(), timeout_s=10, clock=clock, seed=1)
    ft.register_source(
        SourceRegistration(SOURCE, "forward", 2, retry=RetryPolicy(max_retries=1, backoff_ms=0))
    )
    batch = _persist(ft, 6)
    roots = batch.roots

    # An explicit fail of three records: one INFO line per partition, with the cause.
    cause = Cause(FailKind.ERROR, "map(parse)", "ValueError: bad")
    ft.fail(roots[:3], cause)
    lines = _failures(json_log)
    assert [(x["partition"], x["offsets"], x["level"]) for x in lines] == [
        (0, [10, 12], "INFO"),
        (1, [11], "INFO"),
    ]
    first = lines[0]
    assert (first["source_id"], first["topic"], first["cause"], first["count"]) == (
        SOURCE, "orders", "explicit", 2,
    )  # fmt: skip
    assert first["roots"] == [hex(int(roots[0])), hex(int(roots[2]))]
    assert (first["kind"], first["step"], first["error"]) == (
        "error",
        "map(parse)",
        "ValueError: bad",
    )
    assert (
        len(first["new_roots"]) == 2
        and first["message"] == "trees failed (explicit): queued for replay"
    )

    # The others time out: one WARNING line per partition.
    json_log.truncate(0)
    json_log.seek(0)
    for step in range(1, 5):  # rotations every T / (n - 1): expired within 2 of them
        clock.now = 6.0 * step
        ft.tick()
    timed_out = [x for x in _failures(json_log) if x["cause"] == "timeout"]
    assert {x["partition"]: x["offsets"] for x in timed_out} == {0: [14], 1: [13, 15]}
    assert {x["level"] for x in timed_out} == {"WARNING"}

    # Replayed, they fail again: their retries are spent, each a dead letter by seq.
    json_log.truncate(0)
    json_log.seek(0)
    replays = ft.fetch_replay(0, ft.replay_cursor_of(SOURCE), source_id=SOURCE).records
    ft.fail(replays.roots, Cause(FailKind.SINK, "kafka sink to 'out'", "KafkaTimeoutError"))
    dead = _failures(json_log)
    assert {x["message"] for x in dead} == {
        "records dead-lettered (last failure: sink): their retries are spent"
    }
    assert sorted(o for x in dead for o in x["offsets"]) == list(range(10, 16))
    assert all(x["level"] == "WARNING" and x["attempts"] == 2 for x in dead)
    letters = {seq for seq, _ in ft.dead_letters()[0]}
    assert {s for x in dead for s in x["seqs"]} == letters


def test_recovery_and_a_failed_requeue_write_name_their_records(json_log: io.StringIO) -> None:
    storage = MemoryStorage()
    ft = FTLayer(storage, timeout_s=10, seed=1)
    batch = _persist(ft, 3)
    # Restarted without a journal: every stored record is replayed, logged by partition.
    FTLayer(storage, timeout_s=10, seed=2)
    recovered = [x for x in _failures(json_log) if x["cause"] == "recovery"]
    assert sorted((x["topic"], x["partition"], tuple(x["offsets"])) for x in recovered) == [
        ("orders", 0, (10,)), ("orders", 1, (11,)), ("refunds", 0, (12,)),
    ]  # fmt: skip

    # A requeue whose write fails: the roots stay pending, and the line names them.
    json_log.truncate(0)
    json_log.seek(0)
    ft2 = FTLayer(MemoryStorage(), timeout_s=10, seed=3)
    batch = _persist(ft2, 2)

    def refuse(*_: object) -> None:
        raise StorageError("disk full")

    ft2.storage.set_roots = refuse  # type: ignore[method-assign]
    with pytest.raises(StorageError):
        ft2.fail(batch.roots)
    (line,) = _failures(json_log)
    assert line["level"] == "ERROR" and "disk full" in line["message"]
    assert sorted(line["roots"]) == sorted(hex(int(r)) for r in batch.roots)
    assert len(ft2) == 2  # still pending


def test_the_log_fields_attribute_keeps_its_name() -> None:
    assert FIELDS_ATTR == "ftlayer_fields"
