"""The wire protocol codec: round trips, every malformed input's typed error, a fuzz run
through FrameReader + decode, the handshake digest, and one trip through a real FTLayer.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from ftlayer import wire as p
from ftlayer.acking.ids import new_ids
from ftlayer.causes import Cause, FailKind
from ftlayer.core import FTLayer
from ftlayer.errors import ConfigError
from ftlayer.inspection import RecordQuery
from ftlayer.persistence import MemoryStorage
from ftlayer.policy import RetryPolicy
from ftlayer.records import RecordBatch, ReplayRecords
from ftlayer.registration import SourceRegistration

U64_MAX = 2**64 - 1
I64 = st.integers(-(2**63), 2**63 - 1)
I32 = st.integers(-(2**31), 2**31 - 1)
U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, U64_MAX)
TOPICS = st.text(max_size=12)  # unicode, empty included


@st.composite
def batches(draw: st.DrawFn, max_size: int = 20) -> RecordBatch:
    n = draw(st.integers(0, max_size))
    column = st.lists
    topic_pool = draw(st.lists(TOPICS, min_size=1, max_size=4))
    if draw(st.booleans()):
        # Equal-length payloads take the fast path of the decoder: cover it too.
        width = draw(st.integers(0, 8))
        payloads = draw(column(st.binary(min_size=width, max_size=width), min_size=n, max_size=n))
    else:
        payloads = draw(column(st.binary(max_size=40), min_size=n, max_size=n))
    return RecordBatch(
        roots=np.array(draw(column(U64, min_size=n, max_size=n)), dtype=np.uint64),
        source_ids=np.array(draw(column(U32, min_size=n, max_size=n)), dtype=np.uint32),
        key_hashes=np.array(draw(column(I64, min_size=n, max_size=n)), dtype=np.int64),
        has_key=np.array(draw(column(st.booleans(), min_size=n, max_size=n)), dtype=np.bool_),
        topics=draw(column(st.sampled_from(topic_pool), min_size=n, max_size=n)),
        partitions=np.array(draw(column(I32, min_size=n, max_size=n)), dtype=np.int32),
        offsets=np.array(draw(column(I64, min_size=n, max_size=n)), dtype=np.int64),
        payloads=payloads,
        references=(
            np.array(draw(column(st.booleans(), min_size=n, max_size=n)), dtype=np.bool_)
            if draw(st.booleans())
            else None
        ),
    )


def assert_same_batch(got: RecordBatch, want: RecordBatch) -> None:
    for name in ("roots", "source_ids", "key_hashes", "has_key", "partitions", "offsets"):
        expected = getattr(want, name)
        actual = getattr(got, name)
        assert actual.dtype == expected.dtype, name
        np.testing.assert_array_equal(actual, expected, err_msg=name)
    np.testing.assert_array_equal(got.reference_mask, want.reference_mask, err_msg="references")
    assert list(got.topics) == list(want.topics)
    assert list(got.payloads) == list(want.payloads)
    assert all(type(payload) is bytes for payload in got.payloads)


def frame(data: bytes) -> p.Frame:
    """The one frame `data` is."""
    reader = p.FrameReader()
    frames = reader.feed(data)
    assert len(frames) == 1 and reader.pending_bytes == 0 and reader.error is None
    return frames[0]


def body_of(data: bytes) -> bytes:
    return frame(data).body


def reframe(kind: int, body: bytes, request_id: int = 7) -> p.Frame:
    return p.Frame(kind, request_id, body)


def small_batch(n: int = 3, topics: list[str] | None = None) -> RecordBatch:
    return RecordBatch.build(
        new_ids(n),
        [b"payload-%d" % i for i in range(n)],
        key_hashes=np.arange(n) - 1,
        topics=topics if topics is not None else "orders",
        partitions=np.arange(n) % 2,
    )


# ---- round trips -----------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(batch=batches(), data=st.data(), request_id=U32)
def test_persist_round_trips(batch: RecordBatch, data: st.DataObject, request_id: int) -> None:
    n = len(batch)
    initial = np.array(data.draw(st.lists(U64, min_size=n, max_size=n)), dtype=np.uint64)
    decoded = p.decode(frame(p.encode_persist(request_id, batch, initial)))
    assert isinstance(decoded, p.Persist)
    assert_same_batch(decoded.batch, batch)
    np.testing.assert_array_equal(decoded.initial_values, initial)
    assert decoded.initial_values.dtype == np.uint64
    assert frame(p.encode_persist(request_id, batch)).request_id == request_id


def test_persist_without_initial_values_sends_zeros() -> None:
    decoded = p.decode_persist(frame(p.encode_persist(1, small_batch(4))))
    np.testing.assert_array_equal(decoded.initial_values, np.zeros(4, dtype=np.uint64))


def test_empty_persist_is_a_short_frame() -> None:
    data = p.encode_persist(1, RecordBatch.empty())
    assert len(data) == 9 + 4 + 2  # frame header, n = 0, empty topic table
    assert len(p.decode_persist(frame(data)).batch) == 0


def test_decoded_columns_are_writable_native_arrays() -> None:
    decoded = p.decode_persist(frame(p.encode_persist(1, small_batch(5), new_ids(5))))
    for column in (decoded.batch.roots, decoded.initial_values, decoded.batch.offsets):
        assert column.flags.writeable
        assert column.dtype.isnative


@settings(max_examples=100, deadline=None)
@given(batch=batches(), data=st.data())
def test_replay_round_trips(batch: RecordBatch, data: st.DataObject) -> None:
    n = len(batch)
    replay = ReplayRecords(
        replay_seqs=np.array(data.draw(st.lists(U64, min_size=n, max_size=n)), dtype=np.uint64),
        partitions=np.array(data.draw(st.lists(I32, min_size=n, max_size=n)), dtype=np.int32),
        records=batch,
    )
    decoded = p.decode(frame(p.encode_replay(3, replay)))
    assert isinstance(decoded, ReplayRecords)
    np.testing.assert_array_equal(decoded.replay_seqs, replay.replay_seqs)
    np.testing.assert_array_equal(decoded.partitions, replay.partitions)
    assert decoded.replay_seqs.dtype == np.uint64 and decoded.partitions.dtype == np.int32
    assert_same_batch(decoded.records, batch)


@settings(max_examples=100, deadline=None)
@given(pairs=st.lists(st.tuples(U64, U64), max_size=50))
def test_xor_and_fail_round_trip(pairs: list[tuple[int, int]]) -> None:
    roots = np.array([r for r, _ in pairs], dtype=np.uint64)
    values = np.array([v for _, v in pairs], dtype=np.uint64)
    xor = p.decode(frame(p.encode_xor(1, roots, values)))
    assert isinstance(xor, p.Xor)
    np.testing.assert_array_equal(xor.roots, roots)
    np.testing.assert_array_equal(xor.values, values)
    fail = p.decode(frame(p.encode_fail(2, roots)))
    assert isinstance(fail, p.Fail)
    np.testing.assert_array_equal(fail.roots, roots)
    assert xor.roots.dtype == xor.values.dtype == fail.roots.dtype == np.uint64


def test_xor_accepts_python_ints_up_to_u64_max() -> None:
    xor = p.decode_xor(frame(p.encode_xor(1, [U64_MAX, 2**63, 2], [1, U64_MAX, 0])))
    assert xor.roots.tolist() == [U64_MAX, 2**63, 2]
    assert xor.values.tolist() == [1, U64_MAX, 0]


@settings(max_examples=100, deadline=None)
@given(
    request_id=U32,
    nonce=st.binary(min_size=16, max_size=32),
    name=st.text(max_size=30),
    server_nonce=st.binary(min_size=32, max_size=32),
    auth_required=st.booleans(),
    session_id=U64,
)
def test_handshake_round_trips(
    request_id: int,
    nonce: bytes,
    name: str,
    server_nonce: bytes,
    auth_required: bool,
    session_id: int,
) -> None:
    hello = frame(p.encode_hello(request_id, nonce, name))
    assert (hello.kind, hello.request_id) == (p.Kind.HELLO, request_id)
    assert p.decode(hello) == p.Hello(p.PROTOCOL_VERSION, nonce, name)
    challenge = p.decode(frame(p.encode_challenge(request_id, auth_required, server_nonce)))
    assert challenge == p.Challenge(auth_required, server_nonce)
    digest = p.auth_digest(b"token", server_nonce, nonce)
    assert p.decode(frame(p.encode_auth(request_id, digest))) == p.Auth(digest)
    welcome = p.decode(frame(p.encode_welcome(request_id, session_id)))
    assert welcome == p.Welcome(p.PROTOCOL_VERSION, session_id)


@settings(max_examples=100, deadline=None)
@given(
    lo=U64,
    hi=U64,
    source_id=st.none() | U32,
    partition=st.none() | st.integers(0, 2**31 - 1),
)
def test_fetch_replay_round_trips(
    lo: int, hi: int, source_id: int | None, partition: int | None
) -> None:
    data = p.encode_fetch_replay(5, lo, hi, source_id=source_id, partition=partition)
    assert p.decode(frame(data)) == p.FetchReplay(lo, hi, source_id, partition)


def test_register_source_round_trips() -> None:
    data = p.encode_register_source(
        7, SourceRegistration(2**32 - 1, "key-group", 8, {"max_parallelism": 64})
    )
    message = p.decode(frame(data))
    assert message == p.RegisterSource(
        SourceRegistration(2**32 - 1, "key-group", 8, {"max_parallelism": 64})
    )
    timed = p.decode(
        frame(p.encode_register_source(7, SourceRegistration(3, "forward", 2, timeout_s=2.5)))
    )
    assert timed == p.RegisterSource(SourceRegistration(3, "forward", 2, {}, 2.5))
    limited = SourceRegistration(4, "rebalance", 3, max_pending=500)
    assert p.decode(frame(p.encode_register_source(7, limited))) == p.RegisterSource(limited)
    with pytest.raises(p.BadRequest, match="u32 source id"):
        p.encode_register_source(1, SourceRegistration(2**32, "forward", 1))


@pytest.mark.parametrize("kind", [0x16, 0x17, 0x93])
def test_retired_kinds_are_unknown(kind: int) -> None:
    """LOWEST_PENDING, PRUNE_REPLAY and OFFSETS left the protocol; their numbers are
    never reused."""
    assert kind not in {int(k) for k in p.Kind}
    with pytest.raises(p.UnknownKind, match=f"0x{kind:02x}"):
        p.decode(reframe(kind, b""))


def test_checkpoint_requests_and_reply_round_trip() -> None:
    position = {"kafka": {"orders": {"0": 5, "1": 7}}, "replay": 3}
    for begin, kind in ((True, p.Kind.CHECKPOINT_BEGIN), (False, p.Kind.CHECKPOINT_DONE)):
        request = frame(
            p.encode_checkpoint_request(
                9, begin=begin, query="orders", position=position, sources=[4, 2], mode="aligned"
            )
        )
        assert request.kind == kind
        assert p.decode(request) == p.CheckpointRequest(
            begin, "orders", position, [4, 2], "aligned"
        )
    reply = {"id": 3, "state": "complete", "commit_offsets": {"orders": {"0": 5}}}
    assert p.decode(frame(p.encode_checkpoint_reply(9, reply))) == p.CheckpointReply(reply)
    with pytest.raises(p.BadRequest, match="mode"):
        p.encode_checkpoint_request(1, begin=True, query="q", position={}, sources=[], mode="x")


def test_a_begin_can_complete_the_batch_before_in_the_same_request() -> None:
    before = {"kafka": {"orders": {"0": 3}}, "replay": 1}
    position = {"kafka": {"orders": {"0": 5}}, "replay": 3}
    request = frame(
        p.encode_checkpoint_request(
            2,
            begin=True,
            query="q",
            position=position,
            sources=[1],
            mode="unaligned",
            complete=before,
        )
    )
    assert p.decode(request) == p.CheckpointRequest(
        True, "q", position, [1], "unaligned", complete=before
    )
    # Only a BEGIN carries one, and it is a position object.
    complete_body = {"query": "q", "position": position, "sources": [1], "mode": "unaligned"}
    for kind, body in (
        (p.Kind.CHECKPOINT_DONE, {**complete_body, "complete": before}),
        (p.Kind.CHECKPOINT_BEGIN, {**complete_body, "complete": [3]}),
    ):
        with pytest.raises(p.BadRequest, match=kind.name):
            p.decode(frame(p.encode_frame(kind, 1, json.dumps(body).encode())))


def test_savepoint_request_and_reply_round_trip() -> None:
    request = frame(p.encode_savepoint(4, "/var/lib/ftlayer/savepoints", "nightly"))
    assert request.kind == p.Kind.SAVEPOINT
    assert p.decode(request) == p.SavepointRequest("/var/lib/ftlayer/savepoints", "nightly")
    unnamed = p.decode(frame(p.encode_savepoint(5, "/sp/ü")))
    assert unnamed == p.SavepointRequest("/sp/ü", None)
    created = {
        "name": "nightly",
        "path": "/var/lib/ftlayer/savepoints/nightly",
        "stored_records": 12,
        "positions": {"orders": {"kafka": {"orders": {"0": 5}}, "replay": 0}},
    }
    reply = frame(p.encode_savepoint_created(4, created))
    assert reply.kind == p.Kind.SAVEPOINT_CREATED
    assert p.decode(reply) == p.SavepointCreated(created)


def test_a_spooled_savepoint_part_is_fetched_in_chunks() -> None:
    """SAVEPOINT with "dir" null (into the server's spool) and a cluster's savepoint id;
    SAVEPOINT_READ asks for a chunk or a release, SAVEPOINT_BYTES carries it."""
    request = frame(p.encode_savepoint(4, None, "sp.shard-0-of-2", savepoint_id="ab12"))
    assert p.decode(request) == p.SavepointRequest(None, "sp.shard-0-of-2", "ab12")
    read = frame(p.encode_savepoint_read(5, "sp", 4 << 20, 4 << 20))
    assert read.kind == p.Kind.SAVEPOINT_READ
    assert p.decode(read) == p.SavepointRead("sp", 4 << 20, 4 << 20, False)
    release = p.decode(frame(p.encode_savepoint_read(6, "sp", 0, 0, release=True)))
    assert release == p.SavepointRead("sp", 0, 0, True)
    chunk = bytes(range(256)) * 9
    assert p.decode(frame(p.encode_savepoint_bytes(5, chunk))) == p.SavepointBytes(chunk)
    assert p.decode(frame(p.encode_savepoint_bytes(6, b""))) == p.SavepointBytes(b"")


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b'{"name":"sp","offset":0,"length":1}', '"release": bool'),
        (b'{"name":"sp","offset":-1,"length":1,"release":false}', "offset >= 0"),
        (b'{"name":"sp","offset":0,"length":16777217,"release":false}', "length <= 16777216"),
        (b'{"name":"sp","offset":true,"length":1,"release":false}', '"offset": int'),
        (b'{"name":7,"offset":0,"length":1,"release":false}', '"name": str'),
    ],
)
def test_a_savepoint_read_out_of_range_is_refused(body: bytes, match: str) -> None:
    with pytest.raises(p.BadRequest, match=match):
        p.decode(frame(p.encode_frame(p.Kind.SAVEPOINT_READ, 1, body)))


@pytest.mark.parametrize(
    ("savepoint_id", "match"), [("", "1 to 64"), ("a/b", "letters or digits"), ("x" * 65, "64")]
)
def test_a_bad_savepoint_id_is_refused(savepoint_id: str, match: str) -> None:
    with pytest.raises(p.BadRequest, match=match):
        p.encode_savepoint(1, None, "sp", savepoint_id=savepoint_id)


@pytest.mark.parametrize(
    ("directory", "name", "match"),
    [
        ("savepoints", None, "absolute path on the server's host"),
        ("", "x", "absolute path"),
        ("/sp\0x", None, "absolute path"),
        ("/sp", 7, "str or null"),
    ],
)
def test_savepoint_encoder_refuses_what_the_server_cannot_take(
    directory: str, name: object, match: str
) -> None:
    with pytest.raises(p.BadRequest, match=match):
        p.encode_savepoint(1, directory, name)  # type: ignore[arg-type]


def test_status_ok_and_error_round_trip() -> None:
    assert p.decode(frame(p.encode_status_request(1))) == p.StatusRequest()
    brief = p.encode_status_request(1, brief=True)
    assert brief[9:] == b"\x01"  # one flags byte after the head
    assert p.decode(frame(brief)) == p.StatusRequest(brief=True)
    status = {"persisted": 3, "failed": {"timeout": 1}, "name": "ü"}
    assert p.decode(frame(p.encode_status_reply(1, status))) == p.StatusReply(status)
    assert p.decode(frame(p.encode_ok(1, 2**32 - 1))) == p.Ok(2**32 - 1)
    error = p.decode(frame(p.encode_error(9, p.ErrorCode.STORAGE, "disk full ✗")))
    assert error == p.ErrorReply(p.ErrorCode.STORAGE, "disk full ✗")
    unknown_code = p.decode(frame(p.encode_error(9, 4242, "from the future")))
    assert unknown_code == p.ErrorReply(4242, "from the future")


def test_error_for_a_protocol_error_carries_its_code() -> None:
    reply = p.decode_error(frame(p.encode_error_for(4, p.FrameTooLarge("too big"))))
    assert reply == p.ErrorReply(p.ErrorCode.FRAME_TOO_LARGE, "too big")


def test_long_error_messages_are_cut_on_a_character_boundary() -> None:
    reply = p.decode_error(frame(p.encode_error(1, p.ErrorCode.INTERNAL, "é" * 5000)))
    assert reply.message == "é" * 2048


def test_persist_status_and_replay_through_a_real_ft_layer() -> None:
    """What the server will do: decode PERSIST into FTLayer, fail, encode its REPLAY."""
    ft = FTLayer(MemoryStorage(), timeout_s=30)
    sent = small_batch(4, topics=["a", "b", "a", "ü"])
    request = p.decode_persist(frame(p.encode_persist(1, sent, new_ids(4))))
    ft.persist(request.batch, request.initial_values)
    fail = p.decode_fail(frame(p.encode_fail(2, sent.roots[:2])))
    assert ft.fail(fail.roots) == 2
    fetch = p.decode_fetch_replay(frame(p.encode_fetch_replay(3, 0, 10)))
    replay = ft.fetch_replay(fetch.lo, fetch.hi, source_id=fetch.source_id)
    got = p.decode_replay(frame(p.encode_replay(3, replay)))
    assert list(got.records.payloads) == [b"payload-0", b"payload-1"]
    assert list(got.records.topics) == ["a", "b"]
    np.testing.assert_array_equal(got.records.roots, replay.records.roots)
    status = dataclasses.asdict(ft.current_stats())
    assert p.decode_status_reply(frame(p.encode_status_reply(4, status))).status == status


# ---- FrameReader -----------------------------------------------------------------------


def _some_frames() -> list[bytes]:
    return [
        p.encode_hello(1, b"n" * 16, "client"),
        p.encode_persist(2, small_batch(3), new_ids(3)),
        p.encode_status_request(3),
        p.encode_xor(4, new_ids(5), new_ids(5)),
        p.encode_frame(0x77, 5, b"unknown kinds pass the reader"),
    ]


@settings(max_examples=100, deadline=None)
@given(cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_reader_reassembles_frames_from_any_chunks(cuts: list[int]) -> None:
    encoded = _some_frames()
    stream = b"".join(encoded)
    points = sorted({min(c, len(stream)) for c in cuts})
    reader = p.FrameReader()
    got: list[p.Frame] = []
    for start, end in zip([0, *points], [*points, len(stream)], strict=True):
        got += reader.feed(stream[start:end])
    assert got == [frame(data) for data in encoded]
    assert reader.pending_bytes == 0


def test_reader_counts_pending_bytes_of_a_partial_frame() -> None:
    data = p.encode_ok(1, 5)
    reader = p.FrameReader()
    assert reader.feed(data[:-1]) == []
    assert reader.pending_bytes == len(data) - 1
    assert reader.feed(data[-1:]) == [p.Frame(p.Kind.OK, 1, struct.pack("<I", 5))]
    assert reader.pending_bytes == 0


def test_reader_rejects_an_oversized_length_before_the_body_arrives() -> None:
    reader = p.FrameReader(max_frame=1024)
    assert reader.feed(struct.pack(">I", 1025)) == []  # only the four length bytes
    assert isinstance(reader.error, p.FrameTooLarge) and "1025" in str(reader.error)
    assert reader.pending_bytes == 0
    with pytest.raises(p.FrameTooLarge, match="failed earlier"):
        reader.feed(p.encode_ok(1))  # the stream cannot be resynchronized


def test_frames_before_a_bad_length_in_the_same_chunk_are_returned() -> None:
    reader = p.FrameReader(max_frame=1024)
    good = [p.encode_ok(1, 5), p.encode_status_request(2)]
    got = reader.feed(b"".join(good) + struct.pack(">I", 2) + p.encode_ok(3))
    assert got == [frame(data) for data in good]
    assert isinstance(reader.error, p.MalformedFrame)


def test_reader_accepts_a_frame_of_exactly_max_frame() -> None:
    data = p.encode_frame(p.Kind.STATUS_REPLY, 1, b"x" * 95)
    assert len(p.FrameReader(max_frame=100).feed(data)) == 1


@pytest.mark.parametrize("length", [0, 1, 4])
def test_reader_rejects_a_length_below_five(length: int) -> None:
    reader = p.FrameReader()
    assert reader.feed(struct.pack(">IBI", length, 1, 1)) == []
    assert isinstance(reader.error, p.MalformedFrame)
    assert f"frame length {length} is below 5" in str(reader.error)


@pytest.mark.parametrize("max_frame", [4, 2**32, -1])
def test_reader_max_frame_must_fit_the_length_prefix(max_frame: int) -> None:
    with pytest.raises(ConfigError):
        p.FrameReader(max_frame=max_frame)


# ---- malformed bodies: each gives its typed error --------------------------------------


def _persist_body(batch: RecordBatch | None = None) -> bytes:
    return body_of(p.encode_persist(1, batch if batch is not None else small_batch(3)))


def _patch(body: bytes, offset: int, raw: bytes) -> bytes:
    return body[:offset] + raw + body[offset + len(raw) :]


# Offsets inside a 3-record PERSIST body: n (4), then columns of 43 bytes per record.
_N3 = 3
_HAS_KEY_AT = 4 + _N3 * (8 + 8 + 4 + 8)
_TOPIC_INDEX_AT = _HAS_KEY_AT + _N3 * (1 + 4 + 8)
_TABLE_AT = _TOPIC_INDEX_AT + _N3 * 2

MALFORMED: list[tuple[str, p.Frame, type[p.ProtocolError], str]] = [
    (
        "persist count larger than the body",
        reframe(p.Kind.PERSIST, _patch(_persist_body(), 0, struct.pack("<I", 4))),
        p.MalformedFrame,
        "truncated",
    ),
    (
        "persist count smaller than the body",
        reframe(p.Kind.PERSIST, _patch(_persist_body(), 0, struct.pack("<I", 2))),
        p.ProtocolError,  # which one depends on the random roots read as other columns
        "PERSIST",
    ),
    (
        "persist huge count",
        reframe(p.Kind.PERSIST, _patch(_persist_body(), 0, struct.pack("<I", 2**32 - 1))),
        p.MalformedFrame,
        "truncated",
    ),
    (
        "persist trailing byte",
        reframe(p.Kind.PERSIST, _persist_body() + b"\0"),
        p.MalformedFrame,
        "payload lengths add up to",
    ),
    (
        "persist truncated payload",
        reframe(p.Kind.PERSIST, _persist_body()[:-1]),
        p.MalformedFrame,
        "payload lengths add up to",
    ),
    (
        "persist truncated in a column",
        reframe(p.Kind.PERSIST, _persist_body()[:50]),
        p.MalformedFrame,
        "truncated",
    ),
    (
        "persist empty body",
        reframe(p.Kind.PERSIST, b""),
        p.MalformedFrame,
        "record count",
    ),
    (
        "persist topic index out of range",
        reframe(p.Kind.PERSIST, _patch(_persist_body(), _TOPIC_INDEX_AT, struct.pack("<H", 1))),
        p.BadRequest,
        "topic index 1 is out of range",
    ),
    (
        "persist record flags beyond bits 0 and 1",
        reframe(p.Kind.PERSIST, _patch(_persist_body(), _HAS_KEY_AT, b"\x04")),
        p.BadRequest,
        "record flags",
    ),
    (
        "persist topic not utf-8",
        reframe(p.Kind.PERSIST, _patch(_persist_body(), _TABLE_AT + 4, b"\xff")),
        p.MalformedFrame,
        "utf-8",
    ),
    (
        "persist topic length beyond the body",
        reframe(p.Kind.PERSIST, _patch(_persist_body(), _TABLE_AT + 2, b"\xff\xff")),
        p.MalformedFrame,
        "topic 0",
    ),
    (
        "replay truncated",
        reframe(
            p.Kind.REPLAY,
            body_of(
                p.encode_replay(
                    1,
                    ReplayRecords(
                        np.arange(1, 4, dtype=np.uint64), np.zeros(3, np.int32), small_batch(3)
                    ),
                )
            )[:-3],
        ),
        p.MalformedFrame,
        "payload lengths",
    ),
    (
        "xor count disagrees with the arrays",
        reframe(p.Kind.XOR, struct.pack("<I", 2) + b"\0" * 16),
        p.MalformedFrame,
        "declares 2 events",
    ),
    (
        "xor trailing bytes",
        reframe(p.Kind.XOR, struct.pack("<I", 1) + b"\0" * 17),
        p.MalformedFrame,
        "declares 1 events",
    ),
    ("xor empty body", reframe(p.Kind.XOR, b""), p.MalformedFrame, "event count"),
    (
        "fail count disagrees with the array",
        reframe(p.Kind.FAIL, struct.pack("<I", 3) + b"\0" * 16),
        p.MalformedFrame,
        "declares 3 roots",
    ),
    (
        "fetch replay short",
        reframe(p.Kind.FETCH_REPLAY, b"\0" * 27),
        p.MalformedFrame,
        "truncated",
    ),
    (
        "fetch replay trailing",
        reframe(p.Kind.FETCH_REPLAY, body_of(p.encode_fetch_replay(1, 0, 5)) + b"\0"),
        p.MalformedFrame,
        "trailing",
    ),
    (
        "fetch replay partition below -1",
        reframe(p.Kind.FETCH_REPLAY, struct.pack("<QQqi", 0, 5, -1, -2)),
        p.BadRequest,
        "out of range",
    ),
    (
        "fetch replay source id beyond u32",
        reframe(p.Kind.FETCH_REPLAY, struct.pack("<QQqi", 0, 5, 2**32, 0)),
        p.BadRequest,
        "out of range",
    ),
    ("status with two bytes", reframe(p.Kind.STATUS, b"\x01\x00"), p.MalformedFrame, "trailing"),
    ("status with a reserved flag", reframe(p.Kind.STATUS, b"\x02"), p.BadRequest, "reserved"),
    ("status reply not utf-8", reframe(p.Kind.STATUS_REPLY, b"\xff"), p.MalformedFrame, "utf-8"),
    ("status reply not json", reframe(p.Kind.STATUS_REPLY, b"{"), p.MalformedFrame, "not JSON"),
    (
        "status reply not an object",
        reframe(p.Kind.STATUS_REPLY, b"[1]"),
        p.MalformedFrame,
        "not an object",
    ),
    ("ok short", reframe(p.Kind.OK, b"\0\0\0"), p.MalformedFrame, "truncated"),
    ("ok trailing", reframe(p.Kind.OK, b"\0" * 5), p.MalformedFrame, "trailing"),
    ("error without code", reframe(p.Kind.ERROR, b"\0"), p.MalformedFrame, "truncated"),
    ("error not utf-8", reframe(p.Kind.ERROR, b"\1\0\xff"), p.MalformedFrame, "utf-8"),
    (
        "hello wrong magic",
        reframe(p.Kind.HELLO, _patch(body_of(p.encode_hello(1, b"n" * 16)), 0, b"HTTP")),
        p.MalformedFrame,
        "magic",
    ),
    (
        "hello wrong version",
        reframe(p.Kind.HELLO, body_of(p.encode_hello(1, b"n" * 16, version=2))),
        p.UnsupportedVersion,
        "version 2",
    ),
    (
        "hello wrong version, whatever follows",
        reframe(p.Kind.HELLO, b"FTLY" + struct.pack("<H", 7)),
        p.UnsupportedVersion,
        "version 7",
    ),
    (
        "hello nonce too short",
        reframe(p.Kind.HELLO, struct.pack("<4sHB", b"FTLY", 1, 15) + b"n" * 15 + b"\0\0"),
        p.BadRequest,
        "15 bytes",
    ),
    (
        "hello name truncated",
        reframe(p.Kind.HELLO, body_of(p.encode_hello(1, b"n" * 16, "name"))[:-1]),
        p.MalformedFrame,
        "client name",
    ),
    (
        "hello name not utf-8",
        reframe(p.Kind.HELLO, struct.pack("<4sHB", b"FTLY", 1, 16) + b"n" * 16 + b"\1\0\xc3"),
        p.MalformedFrame,
        "utf-8",
    ),
    (
        "challenge reserved flag",
        reframe(p.Kind.CHALLENGE, b"\x02" + b"s" * 32),
        p.BadRequest,
        "reserved bits",
    ),
    ("challenge short nonce", reframe(p.Kind.CHALLENGE, b"\1" * 32), p.MalformedFrame, "trunc"),
    ("auth short digest", reframe(p.Kind.AUTH, b"d" * 31), p.MalformedFrame, "truncated"),
    ("auth long digest", reframe(p.Kind.AUTH, b"d" * 33), p.MalformedFrame, "trailing"),
    (
        "welcome wrong version",
        reframe(p.Kind.WELCOME, struct.pack("<HQ", 9, 1)),
        p.UnsupportedVersion,
        "version 9",
    ),
    ("welcome short", reframe(p.Kind.WELCOME, b"\1\0"), p.MalformedFrame, "truncated"),
    ("unknown kind", reframe(0x55, b""), p.UnknownKind, "0x55"),
    ("register short", reframe(p.Kind.REGISTER_SOURCE, b"\1\0"), p.MalformedFrame, "trunc"),
    *[
        (
            f"register timeout {text}",
            reframe(
                p.Kind.REGISTER_SOURCE,
                b'\1\0\0\0{"partitioner":"forward","num_partitions":1,"options":{},"timeout_s":'
                + text.encode()
                + b"}",
            ),
            p.BadRequest,
            "finite",  # NaN and the infinities are no JSON numbers; 1e400 parses as one
        )
        for text in ("Infinity", "1e400", "-Infinity", "NaN", "0", "-1", "1" + "0" * 400, "true")
    ],
    (
        "register not json",
        reframe(p.Kind.REGISTER_SOURCE, b"\1\0\0\0{nope"),
        p.MalformedFrame,
        "not JSON",
    ),
    (
        "register missing key",
        reframe(p.Kind.REGISTER_SOURCE, b'\1\0\0\0{"partitioner":"forward","options":{}}'),
        p.BadRequest,
        "nothing else",
    ),
    (
        "register bad timeout",
        reframe(
            p.Kind.REGISTER_SOURCE,
            b'\1\0\0\0{"partitioner":"forward","num_partitions":1,"options":{},"timeout_s":-1}',
        ),
        p.BadRequest,
        "timeout_s",
    ),
    (
        "register bool partitions",
        reframe(
            p.Kind.REGISTER_SOURCE,
            b'\1\0\0\0{"partitioner":"forward","num_partitions":true,"options":{}}',
        ),
        p.BadRequest,
        "int",
    ),
    ("checkpoint begin empty", reframe(p.Kind.CHECKPOINT_BEGIN, b""), p.MalformedFrame, "JSON"),
    (
        "checkpoint complete not an object",
        reframe(p.Kind.CHECKPOINT_DONE, b"[1]"),
        p.BadRequest,
        "query",
    ),
    (
        "checkpoint bad mode",
        reframe(
            p.Kind.CHECKPOINT_BEGIN,
            b'{"query":"q","position":{},"sources":[1],"mode":"exactly"}',
        ),
        p.BadRequest,
        "aligned",
    ),
    (
        "checkpoint negative source",
        reframe(
            p.Kind.CHECKPOINT_DONE,
            b'{"query":"q","position":{},"sources":[-1],"mode":"aligned"}',
        ),
        p.BadRequest,
        "u32",
    ),
    (
        "checkpoint reply not an object",
        reframe(p.Kind.CHECKPOINT, b'"done"'),
        p.MalformedFrame,
        "not an object",
    ),
    ("savepoint empty", reframe(p.Kind.SAVEPOINT, b""), p.MalformedFrame, "not JSON"),
    ("savepoint not utf-8", reframe(p.Kind.SAVEPOINT, b"\xff{}"), p.MalformedFrame, "utf-8"),
    ("savepoint a list", reframe(p.Kind.SAVEPOINT, b'["/sp"]'), p.BadRequest, '"dir": str'),
    (
        "savepoint without name",
        reframe(p.Kind.SAVEPOINT, b'{"dir":"/sp"}'),
        p.BadRequest,
        "str or null",
    ),
    (
        "savepoint extra key",
        reframe(p.Kind.SAVEPOINT, b'{"dir":"/sp","name":null,"force":true}'),
        p.BadRequest,
        "str or null",
    ),
    (
        "savepoint dir not a str",
        reframe(p.Kind.SAVEPOINT, b'{"dir":["/sp"],"name":null}'),
        p.BadRequest,
        '"dir": str',
    ),
    (
        "savepoint relative dir",
        reframe(p.Kind.SAVEPOINT, b'{"dir":"sp","name":null}'),
        p.BadRequest,
        "absolute path",
    ),
    (
        "heartbeat truncated",
        reframe(p.Kind.HEARTBEAT, b"\x01\x00"),
        p.MalformedFrame,
        "truncated",
    ),
    (
        "heartbeat count disagrees",
        reframe(p.Kind.HEARTBEAT, struct.pack("<II", 1000, 2) + bytes(4)),
        p.MalformedFrame,
        "declares 2 source ids",
    ),
    (
        "savepoint created not an object",
        reframe(p.Kind.SAVEPOINT_CREATED, b"[1]"),
        p.MalformedFrame,
        "not an object",
    ),
    (
        "savepoint created not JSON",
        reframe(p.Kind.SAVEPOINT_CREATED, b"{nope"),
        p.MalformedFrame,
        "not JSON",
    ),
]


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [case[1:] for case in MALFORMED],
    ids=[case[0] for case in MALFORMED],
)
def test_malformed_bodies_give_their_typed_error(
    bad: p.Frame, error: type[p.ProtocolError], match: str
) -> None:
    with pytest.raises(error, match=match) as raised:
        p.decode(bad)
    assert isinstance(raised.value.code, p.ErrorCode)
    assert raised.value.code == type(raised.value).code


def test_a_decoder_checks_the_frame_kind() -> None:
    with pytest.raises(p.UnexpectedKind, match="expected a XOR frame, got FAIL"):
        p.decode_xor(frame(p.encode_fail(1, [5])))


def test_decoders_take_a_bare_body_too() -> None:
    roots = new_ids(3)
    assert p.decode_fail(body_of(p.encode_fail(1, roots))).roots.tolist() == roots.tolist()


# ---- encoders refuse what the wire cannot carry ----------------------------------------


ENCODE_ERRORS: list[tuple[str, Callable[[], bytes], type[p.ProtocolError], str]] = [
    (
        "persist above max_frame",
        lambda: p.encode_persist(1, small_batch(100), max_frame=1000),
        p.FrameTooLarge,
        "above max_frame 1000",
    ),
    (
        "initial values of another length",
        lambda: p.encode_persist(1, small_batch(3), [1, 2]),
        p.BadRequest,
        "3 unsigned",
    ),
    (
        "negative initial value",
        lambda: p.encode_persist(1, small_batch(2), [1, -1]),
        p.BadRequest,
        "unsigned",
    ),
    (
        "topic longer than 65535 bytes",
        lambda: p.encode_persist(1, small_batch(1, topics=["t" * 70_000])),
        p.BadRequest,
        "70000 utf-8 bytes",
    ),
    (
        "xor values of another length",
        lambda: p.encode_xor(1, [1, 2], [3]),
        p.BadRequest,
        "2 unsigned",
    ),
    ("xor negative root", lambda: p.encode_xor(1, np.array([-5]), [3]), p.BadRequest, "-5"),
    ("fail float roots", lambda: p.encode_fail(1, np.array([1.5])), p.BadRequest, "float"),
    (
        "xor above max_frame",
        lambda: p.encode_xor(1, new_ids(100), new_ids(100), max_frame=100),
        p.FrameTooLarge,
        "XOR frame",
    ),
    ("client nonce too short", lambda: p.encode_hello(1, b"n" * 15), p.BadRequest, "nonce"),
    ("client nonce too long", lambda: p.encode_hello(1, b"n" * 33), p.BadRequest, "nonce"),
    ("server nonce", lambda: p.encode_challenge(1, True, b"s" * 31), p.BadRequest, "nonce"),
    ("digest size", lambda: p.encode_auth(1, b"d" * 31), p.BadRequest, "digest"),
    ("request id", lambda: p.encode_ok(2**32, 0), p.BadRequest, "request id"),
    ("ok count", lambda: p.encode_ok(1, -1), p.BadRequest, "count"),
    (
        "fetch partition",
        lambda: p.encode_fetch_replay(1, 0, 1, partition=-3),
        p.BadRequest,
        "partition",
    ),
    ("status not json", lambda: p.encode_status_reply(1, {"x": object()}), p.BadRequest, "JSON"),
    ("heartbeat lease", lambda: p.encode_heartbeat(1, [7], -1), p.BadRequest, "HEARTBEAT"),
    ("heartbeat source", lambda: p.encode_heartbeat(1, [2**32], 10), p.BadRequest, "u32"),
    (
        "replay columns disagree",
        lambda: p.encode_replay(
            1, ReplayRecords(np.zeros(2, np.uint64), np.zeros(3, np.int32), small_batch(3))
        ),
        p.BadRequest,
        "2 replay seqs",
    ),
]


@pytest.mark.parametrize(
    ("encode", "error", "match"),
    [case[1:] for case in ENCODE_ERRORS],
    ids=[case[0] for case in ENCODE_ERRORS],
)
def test_encoders_refuse_what_the_wire_cannot_carry(
    encode: Callable[[], bytes], error: type[p.ProtocolError], match: str
) -> None:
    with pytest.raises(error, match=match):
        encode()


# ---- fuzz: only ProtocolError escapes --------------------------------------------------


def _valid_frames() -> list[bytes]:
    replay = ReplayRecords(
        np.arange(1, 4, dtype=np.uint64),
        np.array([0, 1, -1], dtype=np.int32),
        small_batch(3, topics=["a", "ü", "a"]),
    )
    return [
        *_some_frames(),
        p.encode_persist(6, RecordBatch.empty()),
        p.encode_persist(7, small_batch(2, topics=["x", "y"])),
        p.encode_replay(8, replay),
        p.encode_fail(9, new_ids(3)),
        p.encode_fetch_replay(10, 1, 9, source_id=2, partition=1),
        p.encode_challenge(11, True, b"s" * 32),
        p.encode_auth(12, b"d" * 32),
        p.encode_welcome(13, 99),
        p.encode_status_reply(14, {"a": [1, 2]}),
        p.encode_ok(15, 1),
        p.encode_error(16, 1, "bad"),
        p.encode_savepoint(17, "/sp", "nightly"),
        p.encode_savepoint_created(18, {"name": "nightly", "stored_records": 3}),
        p.encode_heartbeat(19, [7, 2**32 - 1], 1500),
        p.encode_register_source(
            20, SourceRegistration(3, "rebalance", 4, {"start": 1}, 2.5, {"max_retries": 3})
        ),
        p.encode_checkpoint_request(
            21, begin=True, query="q", position={"replay": 1}, sources=[3], mode="aligned"
        ),
        p.encode_dead_letters(22, "list", {"source_id": 3}, 10),
        p.encode_dead_letter_list(23, [{"seq": 1}], small_batch(1), False),
        p.encode_inspect(24, RecordQuery(topic="t", partition=1, offset=41)),
        p.encode_sink_settle(25, 2**63 + 1, Cause(FailKind.SINK, "s", "e")),
        p.encode_savepoint(26, None, "sp", savepoint_id="f00d"),
        p.encode_savepoint_read(27, "sp", 8, 64),
        p.encode_savepoint_bytes(28, b"\x00lmdb" * 9),
        p.encode_batch_begin(
            29,
            query="q",
            position={"replay": 1},
            sources=[3],
            mode="unaligned",
            ranges=[(3, "t", 0, 1, 4)],
            replays=(0, 3),
            replay_sources=[3],
        ),
        p.encode_batch_begun(30, {"id": 1}, [5], replay),
    ]


VALID = _valid_frames()
FUZZ_MAX_FRAME = 4096


@st.composite
def fuzzed_frames(draw: st.DrawFn) -> bytes:
    """A valid frame, mutated: bit flips, truncation, extension, or a random kind/body."""
    how = draw(st.sampled_from(["flip", "truncate", "extend", "random", "rekind"]))
    data = bytearray(draw(st.sampled_from(VALID)))
    if how == "flip":
        for position in draw(st.lists(st.integers(0, len(data) - 1), min_size=1, max_size=4)):
            data[position] ^= 1 << draw(st.integers(0, 7))
    elif how == "truncate":
        cut = draw(st.integers(0, len(data) - 1))
        body = data[9:]
        return p.encode_frame(data[4], 1, bytes(body[: max(0, cut - 9)]))
    elif how == "extend":
        return p.encode_frame(data[4], 1, bytes(data[9:]) + draw(st.binary(min_size=1)))
    elif how == "random":
        return p.encode_frame(draw(st.integers(0, 255)), 1, draw(st.binary(max_size=64)))
    else:
        data[4] = draw(st.integers(0, 255))
    return bytes(data)


FRAMES_PER_EXAMPLE = 25
FUZZ_EXAMPLES = 450  # 11,250 frames


@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    frames=st.lists(fuzzed_frames(), min_size=FRAMES_PER_EXAMPLE, max_size=FRAMES_PER_EXAMPLE),
    chunk=st.integers(1, 200),
)
def test_fuzzed_frames_only_raise_protocol_errors(frames: list[bytes], chunk: int) -> None:
    decoded = 0
    # Each frame through its own reader (a bad length prefix ends a stream) ...
    for data in frames:
        reader = p.FrameReader(max_frame=FUZZ_MAX_FRAME)
        try:
            for start in range(0, len(data), chunk):
                for got in reader.feed(data[start : start + chunk]):
                    decoded += _decode_or_protocol_error(got)
        except p.ProtocolError as exc:
            assert isinstance(exc.code, p.ErrorCode)
    # ... and all of them as one stream, as a server would see them.
    stream = p.FrameReader(max_frame=FUZZ_MAX_FRAME)
    try:
        for got in stream.feed(b"".join(frames)):
            _decode_or_protocol_error(got)
    except p.ProtocolError:
        pass
    assert decoded <= len(frames)


def _decode_or_protocol_error(got: p.Frame) -> int:
    try:
        message = p.decode(got)
    except p.ProtocolError as exc:
        assert isinstance(exc.code, p.ErrorCode)
        return 0
    if isinstance(message, p.Persist):
        assert len(message.initial_values) == len(message.batch)
    return 1


# ---- authentication --------------------------------------------------------------------


def test_the_right_token_verifies() -> None:
    server, client = p.new_nonce(), p.new_nonce(16)
    digest = p.auth_digest(b"s3cret", server, client)
    assert len(digest) == p.DIGEST_SIZE
    p.check_auth(b"s3cret", server, client, digest)
    p.check_auth("s3cret", server, client, digest)  # str tokens are utf-8


def test_a_wrong_token_fails() -> None:
    server, client = p.new_nonce(), p.new_nonce()
    digest = p.auth_digest(b"guess", server, client)
    with pytest.raises(p.AuthFailed) as raised:
        p.check_auth(b"s3cret", server, client, digest)
    assert "s3cret" not in str(raised.value)
    assert raised.value.code == p.ErrorCode.AUTH_FAILED


def test_a_digest_replayed_under_another_server_nonce_fails() -> None:
    client = p.new_nonce()
    recorded = p.auth_digest(b"s3cret", p.new_nonce(), client)
    with pytest.raises(p.AuthFailed):
        p.check_auth(b"s3cret", p.new_nonce(), client, recorded)


def test_the_token_never_crosses_the_wire() -> None:
    token = b"the-token-bytes"
    server, client = p.new_nonce(), p.new_nonce()
    wire = b"".join(
        [
            p.encode_hello(1, client, "c"),
            p.encode_challenge(1, True, server),
            p.encode_auth(2, p.auth_digest(token, server, client)),
        ]
    )
    assert token not in wire


def _as_u64(values: list[int]) -> NDArray[np.uint64]:
    return np.array(values, dtype=np.uint64)


def test_u64_columns_from_uint64_arrays_are_not_reinterpreted() -> None:
    big = _as_u64([U64_MAX, 0])
    assert p.decode_fail(frame(p.encode_fail(1, big))).roots.tolist() == [U64_MAX, 0]


def test_fail_carries_a_cause_per_root_and_omits_unspecified_ones() -> None:
    from ftlayer.causes import UNSPECIFIED, Cause, Causes, FailKind

    roots = np.array([5, 6, 7], dtype=np.uint64)
    long_error = "ValueError: " + "é" * 900  # cut to 1,000 bytes on a character boundary
    causes = Causes(
        (Cause(FailKind.ERROR, "map(parse)", long_error), Cause(FailKind.SINK, "kafka", "x", True)),
        np.array([1, 0, 1], dtype=np.uint16),
    )
    decoded = p.decode(frame(p.encode_fail(3, roots, causes)))
    assert isinstance(decoded, p.Fail)
    assert decoded.roots.tolist() == [5, 6, 7]
    assert [decoded.causes[i].kind for i in range(3)] == [
        FailKind.SINK,
        FailKind.ERROR,
        FailKind.SINK,
    ]
    assert decoded.causes[0].final and not decoded.causes[1].final
    assert len(decoded.causes[1].error.encode()) <= 1000 and decoded.causes[1].error.endswith("...")
    # Without causes (or with unspecified ones) the body is the version 1 body.
    plain = p.encode_fail(4, roots, Causes.one(None, 3))
    assert plain == p.encode_fail(4, roots) and len(plain) == 9 + 4 + 24
    assert p.decode(frame(plain)).causes[2] == UNSPECIFIED  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("tail", "error", "match"),
    [
        (struct.pack("<HBBHHH", 1, 7, 0, 0, 0, 0), p.BadRequest, "unknown encoding: kind 7"),
        (struct.pack("<HBBHHH", 1, 1, 4, 0, 0, 0), p.BadRequest, "flags 0x4"),
        (struct.pack("<HBBHHH", 1, 1, 0, 0, 0, 1), p.MalformedFrame, "cause index 1 beyond"),
        (struct.pack("<HBBHH", 1, 1, 0, 0, 0), p.MalformedFrame, "cause index"),
        (
            struct.pack("<HBBH", 1, 1, 0, 2) + b"\xff\xfe" + struct.pack("<HH", 0, 0),
            p.MalformedFrame,
            "utf-8",
        ),
    ],
)
def test_a_fail_with_a_bad_cause_section_names_the_problem(
    tail: bytes, error: type[Exception], match: str
) -> None:
    body = struct.pack("<IQ", 1, 5) + tail
    with pytest.raises(error, match=match):
        p.decode(reframe(p.Kind.FAIL, body))


def test_dead_letter_requests_and_lists_round_trip() -> None:

    request = p.decode(frame(p.encode_dead_letters(1, "list", {"cause": "sink"}, 10)))
    assert request == p.DeadLettersRequest("list", {"cause": "sink"}, 10)
    records = RecordBatch.build(
        np.zeros(2, dtype=np.uint64), [b"a", b"bc"], topics="t", partitions=[0, 1], offsets=[4, 9]
    )
    letters = [{"seq": 1, "attempts": 3}, {"seq": 2, "attempts": 1}]
    listed = p.decode(frame(p.encode_dead_letter_list(2, letters, records, True)))
    assert isinstance(listed, p.DeadLetterList)
    assert listed.letters == letters and listed.more
    assert listed.records.payloads == [b"a", b"bc"] and listed.records.offsets.tolist() == [4, 9]
    for bad in (
        {"op": "delete", "where": {}, "limit": None},
        {"op": "list", "where": [], "limit": None},
        {"op": "list", "where": {}, "limit": 0},
        {"op": "list", "where": {}, "limit": True},
        {"op": "list", "where": {}},
    ):
        with pytest.raises(p.BadRequest, match=r"DEAD_LETTERS (must be|limit must be)"):
            p.decode(reframe(p.Kind.DEAD_LETTERS, json.dumps(bad).encode()))


@pytest.mark.parametrize("op", ["requeue", "purge", "delivered"])
def test_a_dead_letters_limit_is_for_list_only(op: str) -> None:
    # Purging "at most 5" would purge every match: the limit is refused, not ignored.
    body = json.dumps({"op": op, "where": {"source_id": 3}, "limit": 5}).encode()
    with pytest.raises(p.BadRequest, match='for "list" only'):
        p.decode(reframe(p.Kind.DEAD_LETTERS, body))
    with pytest.raises(p.BadRequest, match='for "list" only'):
        p.encode_dead_letters(1, op, {"source_id": 3}, 5)
    request = p.decode(frame(p.encode_dead_letters(1, op, {"source_id": 3})))
    assert request == p.DeadLettersRequest(op, {"source_id": 3}, None)


def test_hold_has_xors_body_and_register_source_carries_the_completion() -> None:
    roots, values = np.array([5, 6], dtype=np.uint64), np.array([7, 8], dtype=np.uint64)
    hold = p.decode(frame(p.encode_hold(3, roots, values)))
    assert isinstance(hold, p.Xor) and hold.roots.tolist() == [5, 6]
    assert frame(p.encode_hold(3, roots, values)).kind == p.Kind.HOLD
    register = p.decode(
        frame(
            p.encode_register_source(4, SourceRegistration(9, "forward", 2, completion="barrier"))
        )
    )
    assert isinstance(register, p.RegisterSource) and register.registration.completion == "barrier"
    plain = p.decode(frame(p.encode_register_source(4, SourceRegistration(9, "forward", 2))))
    assert isinstance(plain, p.RegisterSource) and plain.registration.completion == "tree"
    body = (
        struct.pack("<I", 9)
        + json.dumps(
            {"partitioner": "forward", "num_partitions": 2, "options": {}, "completion": "soon"}
        ).encode()
    )
    with pytest.raises(p.BadRequest, match='"completion"'):
        p.decode(reframe(p.Kind.REGISTER_SOURCE, body))


def test_sink_hold_and_settle_round_trip_and_refuse_what_they_cannot_mean() -> None:
    key = 2**63 + 12345
    roots, values = np.array([5, 6], dtype=np.uint64), np.array([7, 8], dtype=np.uint64)
    hold = p.decode(frame(p.encode_sink_hold(3, key, roots, values)))
    assert isinstance(hold, p.SinkHold) and hold.key == key
    assert hold.roots.tolist() == [5, 6] and hold.values.tolist() == [7, 8]
    written = p.decode(frame(p.encode_sink_settle(4, key)))
    assert written == p.SinkSettle(key, None)
    cause = Cause(FailKind.SINK, "ft_foreach_batch", "OSError: refused", final=True)
    failed = p.decode(frame(p.encode_sink_settle(5, key, cause)))
    assert isinstance(failed, p.SinkSettle) and failed.cause == cause
    body = frame(p.encode_sink_hold(3, key, roots, values)).body
    with pytest.raises(p.MalformedFrame, match="SINK_HOLD declares 2 events"):
        p.decode(reframe(p.Kind.SINK_HOLD, body[:-1]))
    with pytest.raises(p.BadRequest, match="outcome must be 0"):
        p.decode(reframe(p.Kind.SINK_SETTLE, struct.pack("<QB", key, 2)))
    with pytest.raises(p.BadRequest, match="u64"):
        p.encode_sink_settle(4, -1)


def test_heartbeat_round_trips() -> None:
    data = p.encode_heartbeat(5, [9, 2**32 - 1, 7], 1500)
    assert frame(data).kind == p.Kind.HEARTBEAT
    assert body_of(data) == struct.pack("<IIIII", 1500, 3, 9, 2**32 - 1, 7)
    assert p.decode(frame(data)) == p.Heartbeat((9, 2**32 - 1, 7), 1500)
    assert p.decode(frame(p.encode_heartbeat(6, [], 0))) == p.Heartbeat((), 0)


# ---- what the spec refuses (docs/protocol.md; issue 26's fuzzer findings) ----------------

CONTROL_CHARACTERS = [chr(c) for c in (*range(0x00, 0x20), *range(0x7F, 0xA0))]


def _checkpoint_body(query: str, kind: p.Kind = p.Kind.CHECKPOINT_BEGIN) -> p.Frame:
    body = {"query": query, "position": {"kafka": {}, "replay": 0}, "sources": [1]}
    return reframe(kind, json.dumps({**body, "mode": "aligned"}).encode())


@pytest.mark.parametrize("control", ["\x7f", "\x85"], ids=["DEL", "C1 NEL"])
def test_a_query_name_with_del_or_a_c1_control_is_refused(control: str) -> None:
    for kind in (p.Kind.CHECKPOINT_BEGIN, p.Kind.CHECKPOINT_DONE):
        with pytest.raises(p.BadRequest, match=f"U\\+{ord(control):04X}") as raised:
            p.decode(_checkpoint_body(f"orders{control}", kind))
        assert raised.value.code == p.ErrorCode.BAD_REQUEST
    with pytest.raises(p.BadRequest, match="control character"):
        p.encode_checkpoint_request(
            1, begin=True, query=f"q{control}", position={}, sources=[], mode="aligned"
        )


@given(
    prefix=st.text(max_size=8),
    control=st.sampled_from(CONTROL_CHARACTERS),
    suffix=st.text(max_size=8),
)
def test_no_query_name_with_a_control_character_decodes(
    prefix: str, control: str, suffix: str
) -> None:
    with pytest.raises(p.BadRequest, match="control character"):
        p.decode(_checkpoint_body(prefix + control + suffix))


@given(st.text(alphabet=st.characters(exclude_categories=("Cc",)), min_size=1, max_size=20))
def test_query_names_without_control_characters_pass_the_wire(query: str) -> None:
    # Unicode category Cc is exactly U+0000-U+001F and U+007F-U+009F.
    request = p.decode(_checkpoint_body(query))
    assert isinstance(request, p.CheckpointRequest) and request.query == query


@pytest.mark.parametrize("flag", [b"true", b"false"])
def test_a_bool_is_no_root(flag: bytes) -> None:
    with pytest.raises(p.BadRequest, match="integers") as raised:
        p.decode(reframe(p.Kind.INSPECT, b'{"root": ' + flag + b"}"))
    assert raised.value.code == p.ErrorCode.BAD_REQUEST
    coordinates = b'{"topic": "t", "partition": %s, "offset": 4}' % flag
    with pytest.raises(p.BadRequest):
        p.decode(reframe(p.Kind.INSPECT, coordinates))
    assert p.decode(reframe(p.Kind.INSPECT, b'{"root": 1}')) == RecordQuery(root=1)


def test_an_inspect_reply_about_a_bool_root_is_malformed() -> None:
    head = json.dumps({"query": {"root": True}, "records": [], "retired": False}).encode()
    with pytest.raises(p.MalformedFrame, match="integers"):
        p.decode(reframe(p.Kind.INSPECT_REPLY, struct.pack("<I", len(head)) + head))


def _register(config: dict[str, object]) -> p.Frame:
    spec = {"partitioner": "forward", "num_partitions": 2, "options": {}, **config}
    return reframe(p.Kind.REGISTER_SOURCE, struct.pack("<I", 9) + json.dumps(spec).encode())


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"num_partitions": True}, '"num_partitions"'),
        ({"num_partitions": 2.0}, '"num_partitions"'),
        ({"num_partitions": 2**31 + 1}, '"num_partitions"'),
        ({"retry": {"max_retries": True}}, '"retry"'),
        ({"retry": {"max_retries": 3.0}}, '"retry"'),
        ({"retry": {"max_retries": "3"}}, '"retry"'),
        ({"retry": {"attempts": 3}}, '"retry"'),
        ({"retry": [3, 100, 1000]}, '"retry"'),
        ({"completion": ""}, '"completion"'),
        ({"completion": False}, '"completion"'),
        ({"dead_letter_topic": ""}, '"dead_letter_topic"'),
        ({"timeout_s": True}, '"timeout_s"'),
        ({"partitioner": 7}, '"partitioner"'),
        ({"options": []}, '"options"'),
        ({"max_pending": 0}, '"max_pending"'),
        ({"max_pending": True}, '"max_pending"'),
        ({"max_pending": 5.0}, '"max_pending"'),
    ],
)
def test_register_source_refuses_each_key_of_the_wrong_json_type(
    config: dict[str, object], match: str
) -> None:
    with pytest.raises(p.BadRequest, match=match):
        p.decode(_register(config))


def test_register_source_null_optional_keys_mean_absent() -> None:
    nulls = {"timeout_s": None, "retry": None, "dead_letter_topic": None, "completion": None}
    assert p.decode(_register(nulls)) == p.RegisterSource(SourceRegistration(9, "forward", 2, {}))
    # A partial retry object is the wire's to carry; its ranges are RetryPolicy's.
    partial = p.decode(_register({"retry": {"max_retries": 3}}))
    assert isinstance(partial, p.RegisterSource) and partial.registration.retry == {
        "max_retries": 3
    }
    # Values only the FT layer can judge pass the wire (ERROR 102 at the server).
    assert p.decode(_register({"num_partitions": 0, "retry": {"backoff_ms": -1}}))


def test_register_source_encoder_refuses_what_the_decoder_would() -> None:
    with pytest.raises(p.BadRequest, match='"retry"'):
        p.encode_register_source(
            1, SourceRegistration(9, "forward", 2, retry={"max_retries": True})
        )
    with pytest.raises(p.BadRequest, match='"completion"'):
        p.encode_register_source(1, SourceRegistration(9, "forward", 2, completion="soon"))


def test_register_source_retry_ranges_are_the_ft_layers_to_refuse() -> None:
    ft = FTLayer(MemoryStorage())
    request = p.decode(_register({"retry": {"backoff_ms": 60_000}}))
    assert isinstance(request, p.RegisterSource) and request.registration.retry is not None
    # backoff_max_ms takes RetryPolicy's default (30 s), below 60 s: a ConfigError (102).
    with pytest.raises(ConfigError, match="BackoffMaxMs"):
        ft.register_source(
            SourceRegistration(
                9, "forward", 2, retry=RetryPolicy.from_json(request.registration.retry)
            )
        )


@pytest.mark.parametrize("constant", [b"NaN", b"Infinity", b"-Infinity"])
def test_json_bodies_refuse_nan_and_the_infinities(constant: bytes) -> None:
    for kind, body in (
        (p.Kind.STATUS_REPLY, b'{"uptime_s": %s}'),
        (p.Kind.CHECKPOINT, b'{"id": %s}'),
        (p.Kind.DEAD_LETTERS, b'{"op": "list", "where": {"since": %s}, "limit": null}'),
    ):
        with pytest.raises(p.BadRequest, match="not a JSON number"):
            p.decode(reframe(kind, body % constant))
    with pytest.raises(p.BadRequest, match="JSON"):
        p.encode_status_reply(1, {"uptime_s": float("nan")})


@pytest.mark.parametrize("request_id", [1.0, True, "1", None])
def test_a_request_id_is_an_integer(request_id: object) -> None:
    with pytest.raises(p.BadRequest, match="request id"):
        p.encode_ok(request_id, 1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "encode",
    [
        lambda: p.encode_ok(1, 1.0),
        lambda: p.encode_ok(1, True),
        lambda: p.encode_error(1, 7.0, "x"),
        lambda: p.encode_fetch_replay(1, 0.5, 1),
        lambda: p.encode_fetch_replay(1, 0, 1, source_id=True),
        lambda: p.encode_register_source(1, SourceRegistration(2.0, "forward", 1)),  # type: ignore[arg-type]
        lambda: p.encode_heartbeat(1, [True], 10),
    ],
)
def test_encoders_refuse_floats_and_bools_for_integers(encode: Callable[[], bytes]) -> None:
    with pytest.raises(p.BadRequest):
        encode()


def test_batch_ranges_say_tree_mode_and_a_range_read_carries_its_seed() -> None:
    """BATCH_RANGES with "tree" opens tree-mode ranges (docs/protocol.md 5.14); RANGE_READ
    is the first range root read, the count and the read's seed (5.19)."""
    ranges = [(9, "orders", 0, 10, 20), (9, "orders", 1, 0, 0)]
    for tree in (False, True):
        decoded = p.decode(frame(p.encode_batch_ranges(3, ranges, tree=tree)))
        assert decoded == p.BatchRanges(ranges, tree=tree)
    first = (1 << 63) | (5 << 40)
    read = frame(p.encode_range_read(4, first, 10, 2**64 - 1))
    assert read.kind == p.Kind.RANGE_READ and len(read.body) == 24
    assert p.decode(read) == p.RangeRead(first, 10, 2**64 - 1)
    with pytest.raises(p.BadRequest, match="seed"):
        p.encode_range_read(5, first, 1, 0)


@pytest.mark.parametrize(
    ("kind", "body", "match"),
    [
        (p.Kind.RANGE_READ, struct.pack("<QQQ", 1 << 63, 5, 0), "seed is not 0"),
        (p.Kind.RANGE_READ, struct.pack("<QQ", 1 << 63, 5), "RANGE_READ"),
        (p.Kind.BATCH_RANGES, b'{"ranges": [], "tree": 1}', '"tree": a bool'),
        (p.Kind.BATCH_RANGES, b'{"ranges": [], "mode": "tree"}', '"tree": a bool'),
    ],
)
def test_a_bad_range_read_or_tree_flag_is_refused(kind: p.Kind, body: bytes, match: str) -> None:
    with pytest.raises(p.ProtocolError, match=match):
        p.decode(frame(p.encode_frame(kind, 1, body)))


def test_a_batch_begins_in_one_request_and_its_reply_carries_all_three_answers() -> None:
    """BATCH_BEGIN (docs/protocol.md 5.20) carries a CHECKPOINT_BEGIN's object, a
    BATCH_RANGES' ranges and a FETCH_REPLAY's bounds for the sources named; BATCH_BEGUN
    the checkpoint, a number per range and the replays' page with its `through`."""
    before = {"kafka": {"orders": {"0": 3}}, "replay": 1}
    position = {"kafka": {"orders": {"0": 5}}, "replay": 3}
    ranges = [(9, "orders", 0, 3, 5), (9, "orders", 1, 7, 7)]
    request = frame(
        p.encode_batch_begin(
            5,
            query="q",
            position=position,
            sources=[9, 4],
            mode="unaligned",
            complete=before,
            ranges=ranges,
            tree=True,
            replays=(1, 3),
            replay_sources=[9],
        )
    )
    assert request.kind == p.Kind.BATCH_BEGIN
    assert p.decode(request) == p.BatchBegin(
        p.CheckpointRequest(True, "q", position, [9, 4], "unaligned", complete=before),
        ranges,
        tree=True,
        replays=(1, 3),
        replay_sources=(9,),
    )
    bare = p.decode(
        frame(p.encode_batch_begin(6, query="q", position=position, sources=[9], mode="aligned"))
    )
    assert bare == p.BatchBegin(p.CheckpointRequest(True, "q", position, [9], "aligned"), [])

    replay = ReplayRecords(
        np.array([2, 3], dtype=np.uint64),
        np.array([1, 0], dtype=np.int32),
        small_batch(2, topics=["orders", "orders"]),
    )
    checkpoint = {"id": 4, "state": "begun", "completed": {"id": 3}}
    begun = p.decode(frame(p.encode_batch_begun(5, checkpoint, [17, 0], replay, through=3)))
    assert isinstance(begun, p.BatchBegun)
    assert (begun.checkpoint, begun.range_numbers, begun.through) == (checkpoint, [17, 0], 3)
    assert begun.replays.replay_seqs.tolist() == [2, 3]
    assert begun.replays.partitions.tolist() == [1, 0]
    assert begun.replays.records.payloads == replay.records.payloads
    empty = p.decode(frame(p.encode_batch_begun(6, checkpoint, [], ReplayRecords.concat([]))))
    assert isinstance(empty, p.BatchBegun) and len(empty.replays) == 0 and empty.through == 0


_BEGIN = {
    "checkpoint": {"query": "q", "position": {"replay": 1}, "sources": [1], "mode": "aligned"},
    "ranges": [],
    "tree": False,
    "replays": None,
}


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"tree": None}, "BATCH_BEGIN"),
        ({"extra": 1}, "BATCH_BEGIN body must be"),
        ({"ranges": [[1, "t", 0, 5, 3]]}, "BATCH_BEGIN body must be"),
        ({"checkpoint": {"query": "q"}}, "CHECKPOINT_BEGIN body must be"),
        ({"replays": [1, 2]}, '"replays" must be'),
        ({"replays": {"lo": 3, "hi": 2, "sources": [1]}}, "lo <= hi"),
        ({"replays": {"lo": 1, "hi": 2, "sources": [-1]}}, '"replays" must be'),
        ({"replays": {"lo": 1, "hi": 2}}, '"replays" must be'),
    ],
)
def test_a_bad_batch_begin_is_refused_naming_the_part_at_fault(
    change: dict[str, object], match: str
) -> None:
    body = json.dumps({**_BEGIN, **change}).encode()
    with pytest.raises(p.BadRequest, match=match):
        p.decode(frame(p.encode_frame(p.Kind.BATCH_BEGIN, 1, body)))


def test_a_batch_begun_whose_json_is_not_its_own_is_malformed() -> None:
    for head in (b"[]", b'{"checkpoint": {}}', b'{"checkpoint": {}, "range_numbers": [true]}'):
        body = struct.pack("<I", len(head)) + head + struct.pack("<I", 0) + bytes(8)
        with pytest.raises(p.MalformedFrame):
            p.decode(frame(p.encode_frame(p.Kind.BATCH_BEGUN, 1, body)))
