"""The payload codec of the ftkafka source: what a replay gets back is what was read,
Kafka headers included; payloads stored before headers were kept still read."""

from __future__ import annotations

import struct

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlayer.errors import SourceError
from ftlayer.payloads import (
    decode_payloads,
    encode_payload_columns,
    encode_payloads,
)
from ftlayer.records import Payloads, RecordBatch
from ftlayer.wire.frames import FrameReader
from ftlayer.wire.messages import decode_persist, encode_persist

maybe_bytes = st.none() | st.binary(max_size=20)
header = st.tuples(st.text(max_size=8), maybe_bytes)
record = st.tuples(maybe_bytes, maybe_bytes, st.integers(0, 2**62), st.lists(header, max_size=3))


@given(st.lists(record, max_size=12), st.booleans())
def test_a_replay_reads_back_what_was_read(records: list, keep_headers: bool) -> None:
    keys = [r[0] for r in records]
    values = [r[1] for r in records]
    stamps = np.array([r[2] for r in records], dtype=np.int64)
    headers = [r[3] for r in records]
    payloads = encode_payloads(keys, values, stamps, headers if keep_headers else None)
    got_keys, got_values, got_stamps, got_headers = decode_payloads(payloads)
    assert got_keys.to_pylist() == keys and got_values.to_pylist() == values
    assert got_stamps.tolist() == stamps.tolist()
    assert got_headers == (headers if keep_headers else [[] for _ in records])
    versions = {p[0] for p in payloads}
    assert versions <= ({1, 2} if keep_headers else {1})  # no headers: the old format


def _arrow_column(items: list[bytes | None], lead: int, slot_bytes: bool) -> pa.Array:
    """`items` as the reader's Arrow column may hold them: after `lead` other entries
    (a slice, offsets not from 0), and, with `slot_bytes`, null entries whose slot still
    spans bytes (Arrow allows it; the reader's decoder never makes one)."""
    filled = [b"x" * lead] * lead + [b"junk" if (v is None and slot_bytes) else v for v in items]
    array = pa.array(filled, pa.binary())
    if slot_bytes:
        valid = np.array([True] * lead + [v is not None for v in items], dtype=np.bool_)
        bitmap = pa.py_buffer(np.packbits(valid, bitorder="little"))
        _, offsets, data = array.buffers()
        nulls = int((~valid).sum())
        array = pa.Array.from_buffers(pa.binary(), len(filled), [bitmap, offsets, data], nulls)
    return array.slice(lead)


@settings(deadline=None)  # the first example loads numba and the kernel
@given(st.lists(record, max_size=40), st.integers(0, 3), st.booleans(), st.booleans())
def test_payloads_built_column_wise_are_the_same_bytes(
    records: list, lead: int, slot_bytes: bool, large: bool
) -> None:
    keys = [r[0] for r in records]
    values = [r[1] for r in records]
    stamps = np.array([r[2] for r in records], dtype=np.int64)
    key_column = _arrow_column(keys, lead, slot_bytes)
    value_column = _arrow_column(values, lead, slot_bytes)
    if large:
        key_column = key_column.cast(pa.large_binary())
        value_column = value_column.cast(pa.large_binary())

    built = encode_payload_columns(key_column, value_column, stamps)

    assert list(built) == encode_payloads(keys, values, stamps)
    got_keys, got_values, got_stamps, _ = decode_payloads(built)  # the blob, as it is
    assert got_keys.to_pylist() == keys and got_values.to_pylist() == values
    assert got_stamps.tolist() == stamps.tolist()


@given(st.lists(st.binary(max_size=30), max_size=30), st.integers(0, 30), st.integers(0, 30))
def test_payloads_in_one_buffer_cross_the_wire_and_slice_like_a_list(
    items: list[bytes], lo: int, hi: int
) -> None:
    payloads = Payloads.of(items)
    assert list(payloads) == items and len(payloads) == len(items)
    assert list(payloads[lo:hi]) == items[lo:hi]
    assert [payloads[i] for i in range(-len(items), len(items))] == items + items
    batch = RecordBatch.build(np.arange(2, 2 + len(items), dtype=np.uint64), payloads)
    (received,) = FrameReader().feed(encode_persist(1, batch))
    sent = decode_persist(received).batch
    assert list(sent.payloads) == items
    assert sent.payloads == payloads == items


def test_a_payload_stored_before_headers_were_kept_still_reads() -> None:
    # Version 1 as it was written: header, key, value; no room for headers.
    old = struct.pack("<BBqI", 1, 3, 1234, 2) + b"k1" + b"value"
    keys, values, stamps, headers = decode_payloads([old])
    assert keys.to_pylist() == [b"k1"] and values.to_pylist() == [b"value"]
    assert stamps.tolist() == [1234] and headers == [[]]


def test_a_record_without_headers_is_written_in_the_version_1_layout() -> None:
    keys, values = [b"k1", None, b"", None], [b"value", b"v", None, None]
    payloads = encode_payloads(keys, values, np.array([1234, -5, 0, 7]))
    assert payloads == [
        struct.pack("<BBqI", 1, 3, 1234, 2) + b"k1" + b"value",
        struct.pack("<BBqI", 1, 2, -5, 0) + b"v",
        struct.pack("<BBqI", 1, 1, 0, 0),
        struct.pack("<BBqI", 1, 0, 7, 0),
    ]
    unkeyed = encode_payloads([None, None], [b"ab", None], np.array([1, 2]))
    assert unkeyed == [struct.pack("<BBqI", 1, 2, 1, 0) + b"ab", struct.pack("<BBqI", 1, 0, 2, 0)]


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: p[:16],  # headers cut short
        lambda p: bytes([1]) + p[1:],  # version 1 claiming headers
        lambda p: bytes([3]) + p[1:],  # a version this ftkafka does not know
        lambda p: p[:14] + struct.pack("<I", 9999) + p[18:],  # headers longer than the payload
    ],
)
def test_a_damaged_payload_is_a_clear_error(damage: object) -> None:
    good = encode_payloads([b"k"], [b"v"], np.array([1]), [[("h", b"x")]])[0]
    with pytest.raises(SourceError, match=r"payload|version"):
        decode_payloads([damage(good)])  # type: ignore[operator]
