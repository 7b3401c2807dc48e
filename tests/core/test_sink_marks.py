"""Sink marks (ftlayer.core.sinkmarks, SINK_MARK / MARK): a sink's note of how a batch
writes, kept where a restarted driver finds it: the first mark of a batch wins, older
batches' marks go, and a mark outlives the FT layer's restart."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlayer.client import FTClient
from ftlayer.core import FTLayer
from ftlayer.errors import ConfigError
from ftlayer.persistence import LmdbStorage
from ftlayer.server import FTServer
from ftlayer.wire import BadRequest, decode_mark, decode_sink_mark, encode_mark, encode_sink_mark
from ftlayer.wire.frames import Frame, Kind

SINK = "kafka/5c1e0d2a-query/orders-out"


def _mark(write_id: str, start: int) -> dict[str, object]:
    return {"write_id": write_id, "start": {"0": start, "1": start + 1}}


def test_the_first_mark_of_a_batch_is_kept_and_answered_to_every_later_run(
    tmp_path: Path,
) -> None:
    storage = LmdbStorage(tmp_path / "ft")
    ft = FTLayer(storage, timeout_s=30)
    first = _mark("00" * 8, 10)
    assert ft.sink_mark(SINK, 7, first) == (first, True)
    # The batch run again (a restarted driver drew another write id): the first one.
    assert ft.sink_mark(SINK, 7, _mark("11" * 8, 99)) == (first, False)
    # Another sink, or the same sink's next batch, has its own.
    other = _mark("22" * 8, 5)
    assert ft.sink_mark("kafka/other/orders-out", 7, other) == (other, True)
    storage.close()
    # After a restart of the FT layer, the same.
    storage = LmdbStorage(tmp_path / "ft")
    ft = FTLayer(storage, timeout_s=30)
    assert ft.sink_mark(SINK, 7, _mark("33" * 8, 0)) == (first, False)
    # The next batch's mark replaces the sink's older ones (Spark runs only the last
    # planned batch again); another sink's stay.
    after = _mark("44" * 8, 20)
    assert ft.sink_mark(SINK, 8, after) == (after, True)
    assert storage.meta_keys(f"sinkmark/{SINK}/") == [f"sinkmark/{SINK}/{8:020d}"]
    assert ft.sink_mark("kafka/other/orders-out", 7, first) == (other, False)
    storage.close()


def test_a_sink_name_that_is_empty_or_has_a_nul_is_refused(tmp_path: Path) -> None:
    storage = LmdbStorage(tmp_path / "ft")
    ft = FTLayer(storage, timeout_s=30)
    for name in ("", "kafka/\x00/t"):
        with pytest.raises(ConfigError, match="sink's name"):
            ft.sink_mark(name, 1, {})
    storage.close()


@settings(max_examples=50, deadline=None)
@given(
    sink=st.text(min_size=1, max_size=40),
    batch=st.integers(0, 2**63 - 1),
    start=st.dictionaries(st.integers(0, 1000).map(str), st.integers(0, 2**62), max_size=5),
    first=st.booleans(),
)
def test_sink_mark_and_mark_round_trip(
    sink: str, batch: int, start: dict[str, int], first: bool
) -> None:
    mark = {"write_id": "ab" * 8, "start": start}
    request = decode_sink_mark(
        Frame(Kind.SINK_MARK, 1, _body(encode_sink_mark(1, sink, batch, mark)))
    )
    assert (request.sink, request.batch, request.mark) == (sink, batch, mark)
    reply = decode_mark(Frame(Kind.MARK, 1, _body(encode_mark(1, mark, first))))
    assert (reply.mark, reply.first) == (mark, first)


def _body(frame: bytes) -> bytes:
    return frame[9:]  # u32 length, u8 kind, u32 request id


@pytest.mark.parametrize(
    "body",
    [
        b'{"sink": "", "batch": 1, "mark": {}}',
        b'{"sink": "s", "batch": -1, "mark": {}}',
        b'{"sink": "s", "batch": 1, "mark": []}',
        b'{"sink": "s", "batch": 1}',
        b'{"sink": "s", "batch": 1.5, "mark": {}}',
        b'{"sink": "s", "batch": 1, "mark": {}, "extra": 0}',
    ],
)
def test_a_bad_sink_mark_is_refused_with_what_it_must_be(body: bytes) -> None:
    with pytest.raises(BadRequest, match="SINK_MARK body must be"):
        decode_sink_mark(Frame(Kind.SINK_MARK, 1, body))


def test_sink_mark_over_the_wire_survives_a_server_restart(tmp_path: Path) -> None:
    mark = _mark("ab" * 8, 3)
    with FTServer(tmp_path / "data") as server, FTClient("{}:{}".format(*server.address)) as c:
        found = c.sink_mark(SINK, 4, mark)
        assert (found.mark, found.first) == (mark, True)
        assert c.status().requests["SINK_MARK"].count == 1
    with FTServer(tmp_path / "data") as server, FTClient("{}:{}".format(*server.address)) as c:
        found = c.sink_mark(SINK, 4, _mark("cd" * 8, 9))
        assert (found.mark, found.first) == (mark, False)
