"""Finding one record (issue 16, part 4): FTLayer.inspect by root and by Kafka
coordinates through every state a record passes (pending, waiting, queued, dead
letter, gone), its history and payload, the INSPECT wire codec, and the CLI's parsing
and report."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from manual_clock import Clock

from ftlayer.acking.ids import new_ids
from ftlayer.causes import Cause, FailKind
from ftlayer.cli.inspect import describe, parse_root, query_of
from ftlayer.core import FTLayer
from ftlayer.core.retries import RetryPolicy
from ftlayer.errors import ConfigError
from ftlayer.inspection import InspectedRecord, Inspection, RecordQuery, RecordState
from ftlayer.payloads import decode_key, encode_payloads
from ftlayer.persistence import MemoryStorage
from ftlayer.policy import JITTER
from ftlayer.records import RecordBatch
from ftlayer.registration import SourceRegistration
from ftlayer.wire import (
    BadRequest,
    Frame,
    FrameReader,
    Kind,
    decode_inspect,
    decode_inspect_reply,
    encode_frame,
    encode_inspect,
    encode_inspect_reply,
)

SOURCE = 5
TOPIC = "orders"


def _layer(policy: RetryPolicy, *, completion: str = "tree") -> tuple[FTLayer, Clock, Clock]:
    clock, wall = Clock(), Clock(1_000.0)
    ft = FTLayer(MemoryStorage(), timeout_s=30, clock=clock, wall_clock=wall, seed=3)
    ft.register_source(
        SourceRegistration(SOURCE, "forward", 2, retry=policy, completion=completion)
    )
    return ft, clock, wall


def _persist(ft: FTLayer, n: int, first_offset: int = 100) -> RecordBatch:
    keys = [b"user-%d" % i for i in range(n)]
    payloads = encode_payloads(keys, [b"v" * (10 + i) for i in range(n)], np.full(n, 1234))
    batch = RecordBatch.build(
        new_ids(n),
        payloads,
        source_ids=SOURCE,
        key_hashes=np.arange(n) + 7,
        topics=TOPIC,
        partitions=np.arange(n) % 2,
        offsets=np.arange(first_offset, first_offset + n),
    )
    ft.persist(batch, np.full(n, 99, dtype=np.uint64))  # trees open: ack value 99
    return batch


def _one(ft: FTLayer, query: RecordQuery) -> InspectedRecord:
    found = ft.inspect(query)
    assert len(found.records) == 1, found
    return found.records[0]


def _at(offset: int, partition: int | None = None) -> RecordQuery:
    partition = offset % 2 if partition is None else partition
    return RecordQuery(topic=TOPIC, partition=partition, offset=offset)


def test_a_record_is_found_in_every_state_it_passes_through() -> None:
    policy = RetryPolicy(max_retries=1, backoff_ms=2_000, backoff_max_ms=2_000)
    ft, clock, wall = _layer(policy)
    batch = _persist(ft, 4)
    root = int(batch.roots[1])

    # Pending: by root and by coordinates, the same record, never failed.
    pending = _one(ft, RecordQuery(root=root))
    assert _one(ft, _at(101)) == pending
    assert pending.state is RecordState.PENDING
    assert (pending.topic, pending.partition, pending.offset) == (TOPIC, 1, 101)
    assert (pending.source_id, pending.key_hash, pending.has_key) == (SOURCE, 8, True)
    assert pending.payload_bytes == len(batch.payloads[1])
    assert decode_key(pending.payload) == (b"user-1", 1234)
    assert pending.history is None and not pending.barrier_hold

    # Failed once with a cause: waiting for its backoff, under a new root.
    cause = Cause(FailKind.ERROR, "map(parse)", "ValueError: bad json")
    assert ft.fail([root], cause) == 1
    waiting = _one(ft, _at(101))
    assert waiting.state is RecordState.WAITING
    assert waiting.root != root and waiting.due is not None
    assert 1_000.0 + 2.0 * (1 - JITTER) <= waiting.due <= 1_002.0  # backoff, less jitter
    assert waiting.history is not None and waiting.history["attempts"] == 1
    assert waiting.history["causes"][0]["error"] == "ValueError: bad json"
    old = ft.inspect(RecordQuery(root=root))
    assert old.records == () and old.retired and old.verdict == "retired"

    # The backoff ended: queued under a replay seq for its partition, since then.
    wall.now = 1_002.5
    clock.now = 1.0
    ft.tick()
    queued = _one(ft, RecordQuery(root=waiting.root))
    assert queued.state is RecordState.QUEUED
    assert queued.replay_seq == ft.replay_cursor_of(SOURCE) and queued.replay_partitions == (1,)
    assert queued.queued_since == waiting.due  # when its backoff ended
    # Fetched by its batch, it stays queued until that batch's checkpoint prunes it.
    ft.fetch_replay(0, ft.replay_cursor_of(SOURCE), source_id=SOURCE)
    assert _one(ft, _at(101)).state is RecordState.QUEUED
    ft.prune_replay(ft.replay_cursor_of(SOURCE), SOURCE)
    assert _one(ft, _at(101)).state is RecordState.PENDING

    # Failed again: its retries are spent, a dead letter; found by coordinates only.
    ft.fail([queued.root], Cause(FailKind.TIMEOUT))
    dead = _one(ft, _at(101))
    assert (dead.state, dead.root, dead.seq) == (RecordState.DEAD_LETTER, 0, pending.seq)
    assert dead.history is not None and dead.history["attempts"] == 2
    assert [c["kind"] for c in dead.history["causes"]] == ["error", "timeout"]
    assert dead.history["dead_at"] == pytest.approx(1_002.5)

    # A record whose tree completed is unknown or completed.
    other = int(batch.roots[2])
    ft.xor([other], [99])
    gone = ft.inspect(_at(102))
    assert gone.records == () and not gone.retired
    assert gone.verdict == "unknown or completed"
    assert ft.inspect(RecordQuery(root=other)).verdict == "unknown or completed"
    # Nothing at coordinates nobody read, nor at a topic nobody read.
    assert ft.inspect(_at(5_000)).records == ()
    assert ft.inspect(RecordQuery(topic="nope", partition=0, offset=100)).records == ()


def test_a_record_read_twice_is_found_twice_and_barrier_holds_show() -> None:
    ft, _clock, _wall = _layer(RetryPolicy(max_retries=3), completion="barrier")
    first = _persist(ft, 2)
    second = _persist(ft, 2)  # Spark ran the batch again: the same offsets, other roots
    found = ft.inspect(_at(100))
    assert sorted(r.root for r in found.records) == sorted(
        [int(first.roots[0]), int(second.roots[0])]
    )
    assert found.verdict == "several"
    assert all(r.barrier_hold and r.state is RecordState.PENDING for r in found.records)
    ft.release_barrier([SOURCE])  # the batch is done: every tree completes
    assert ft.inspect(_at(100)).records == ()


def test_inspect_changes_nothing() -> None:
    ft, _clock, _wall = _layer(RetryPolicy(max_retries=0))
    batch = _persist(ft, 3)
    ft.fail(batch.roots[:1], Cause(FailKind.EXPLICIT))
    before = (len(ft), ft.queued_replays, ft.dead_letter_count, ft.current_stats().persisted)
    for offset in (100, 101, 102):
        ft.inspect(_at(offset))
    ft.inspect(RecordQuery(root=int(batch.roots[1])))
    assert (len(ft), ft.queued_replays, ft.dead_letter_count, ft.stats.persisted) == before


@settings(max_examples=40, deadline=None)
@given(
    fates=st.lists(st.sampled_from(["pending", "done", "failed", "dead"]), min_size=1, max_size=12)
)
def test_every_record_not_completed_is_found_in_the_state_its_history_gives(
    fates: list[str],
) -> None:
    """A model: each record completes, stays pending, fails once (queued at once, no
    backoff) or fails until dead; inspect by coordinates finds exactly the records not
    completed, each once, in its state, with its attempts."""
    ft, _clock, _wall = _layer(RetryPolicy(max_retries=1, backoff_ms=0, backoff_max_ms=0))
    batch = _persist(ft, len(fates))
    roots = batch.roots
    for i, fate in enumerate(fates):
        if fate == "done":
            ft.xor([roots[i]], [99])
        elif fate in ("failed", "dead"):
            ft.fail([roots[i]], Cause(FailKind.EXPLICIT))
    replayed = ft.fetch_replay(0, ft.replay_cursor_of(SOURCE), source_id=SOURCE).records
    new_root = dict(zip(replayed.offsets.tolist(), replayed.roots.tolist(), strict=True))
    for i, fate in enumerate(fates):
        if fate == "dead":
            ft.fail([new_root[100 + i]], Cause(FailKind.EXPLICIT))
    expected = {"pending": RecordState.PENDING, "failed": RecordState.QUEUED,
                "dead": RecordState.DEAD_LETTER}  # fmt: skip
    attempts = {"pending": None, "failed": 1, "dead": 2}
    for i, fate in enumerate(fates):
        found = ft.inspect(_at(100 + i))
        if fate == "done":
            assert found.records == ()
            continue
        (record,) = found.records
        assert record.state is expected[fate]
        assert (record.history or {}).get("attempts") == attempts[fate]
        assert record.offset == 100 + i and record.payload == batch.payloads[i]


# ---- the wire and the CLI -------------------------------------------------------------------


def _frame(data: bytes) -> Frame:
    (frame,) = FrameReader().feed(data)
    return frame


def test_inspect_travels_the_wire_and_payloads_are_cut_to_fit() -> None:
    for query in (RecordQuery(root=(1 << 64) - 1), _at(7, 3)):
        assert decode_inspect(_frame(encode_inspect(9, query))) == query
    ft, _clock, _wall = _layer(RetryPolicy(max_retries=3))
    _persist(ft, 2)
    found = ft.inspect(_at(101))
    back = decode_inspect_reply(_frame(encode_inspect_reply(4, found)))
    assert back == found
    big = Inspection(found.query, (InspectedRecord(**{
        **{f: getattr(found.records[0], f) for f in InspectedRecord.__slots__},  # type: ignore[attr-defined]
        "payload": b"x" * 200_000, "payload_bytes": 200_000,
    }),))  # fmt: skip
    cut = decode_inspect_reply(_frame(encode_inspect_reply(4, big)))
    assert len(cut.records[0].payload) == 64 * 1024 and cut.records[0].payload_bytes == 200_000
    small = decode_inspect_reply(_frame(encode_inspect_reply(4, big, max_frame=4096)))
    assert len(small.records[0].payload) == 2048


@pytest.mark.parametrize(
    "body",
    [
        b'{"root": -1}',
        b'{"root": 1, "topic": "t"}',
        b'{"topic": "t", "partition": 0}',
        b'{"topic": 3, "partition": 0, "offset": 1}',
        b"[1]",
    ],
)
def test_a_bad_inspect_request_is_refused_by_name(body: bytes) -> None:
    with pytest.raises(BadRequest, match="INSPECT"):
        decode_inspect(_frame(encode_frame(Kind.INSPECT, 1, body)))


def test_roots_are_read_as_logs_users_and_spark_write_them() -> None:
    root = 0xF00D_0000_0000_0001
    signed = root - (1 << 64)  # Spark's ft_root column
    assert parse_root(hex(root)) == parse_root(str(root)) == parse_root(str(signed)) == root
    with pytest.raises(ConfigError, match="64-bit"):
        parse_root(str(1 << 64))
    with pytest.raises(ConfigError, match="0x hex"):
        parse_root("root-7")

    def args(**kw: object) -> argparse.Namespace:
        return argparse.Namespace(**{"root": None, "topic": None, "partition": None,
                                     "offset": None, **kw})  # fmt: skip

    assert query_of(args(topic="t", partition=1, offset=2)) == RecordQuery(None, "t", 1, 2)
    with pytest.raises(ConfigError, match="not both"):
        query_of(args(root="7", topic="t"))
    with pytest.raises(ConfigError, match="all of"):
        query_of(args(topic="t", offset=2))


def test_the_report_says_where_the_record_is_and_what_happened() -> None:
    ft, _clock, _wall = _layer(RetryPolicy(max_retries=0))
    batch = _persist(ft, 2)
    ft.fail(batch.roots[:1], Cause(FailKind.SINK, "kafka sink to 'out'", "KafkaTimeoutError"))
    text = describe(ft.inspect(_at(100)))
    assert "record orders-0 offset 100" in text and "dead-lettered" in text
    assert "key 'user-0' (6 bytes)" in text
    assert "sink in kafka sink to 'out': KafkaTimeoutError" in text
    assert "unknown or completed" in describe(ft.inspect(_at(999)))
    assert "failed recently" in describe(ft.inspect(RecordQuery(root=int(batch.roots[0]))))


def test_a_record_stored_by_reference_says_its_bytes_are_in_kafka() -> None:
    from ftlayer import rangeroots

    ft = FTLayer(MemoryStorage(), timeout_s=30, clock=Clock(), seed=2)
    ft.register_source(SourceRegistration(4, "forward", 2, completion="barrier"))
    (number,) = ft.register_ranges([(4, "orders", 1, 10, 20)])
    found = ft.inspect(RecordQuery(topic="orders", partition=1, offset=12))
    text = describe(found)
    assert "its bytes are in Kafka (stored by reference, not copied in)" in text
    assert f"root {int(rangeroots.encode(number, 10, [12])[0]):#x}" in text
    assert "held at its batch's barrier" in text
