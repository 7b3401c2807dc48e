"""The pieces message bodies are built from, shared by the data, control and admin
messages: integer checks, u64 columns, the record block (PERSIST, REPLAY, the dead
letters), fail causes (FAIL, SINK_SETTLE), JSON bodies and the rule for text.

Rules every body follows (docs/protocol.md, conventions):

- An integer argument of an encoder is a Python int that fits its wire type; a bool
  is not an integer (`isinstance(True, int)` is true in Python, so every check here
  excludes bool first). BadRequest otherwise.
- A JSON body is one UTF-8 JSON text. Bytes that are not UTF-8 or not JSON are
  MalformedFrame; the literals NaN, Infinity and -Infinity (which Python's parser
  accepts and RFC 8259 does not) are BadRequest, as is any value outside the shape
  of its kind. Encoders write no such literal (BadRequest instead).
- A JSON integer field is an int and never a bool: `true` is not 1.
- A text field documented "without control characters" has none of U+0000-U+001F,
  U+007F (DEL) or U+0080-U+009F (C1): `control_character` finds the first.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Mapping, Sequence
from typing import Any, Final, TypeGuard

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ftlayer.causes import Cause, FailKind
from ftlayer.records import Payloads, RecordBatch

from .frames import (
    _U16,
    MAX_U32,
    BadRequest,
    Kind,
    MalformedFrame,
    _Body,
    _utf8,
    encode_frame,
)
from .frames import _is_int as is_int

__all__ = [
    "cause_parts",
    "control_character",
    "decode_object",
    "dump_json",
    "encode_object",
    "expect_size",
    "is_int",
    "is_u32",
    "is_u64",
    "parse_json",
    "read_cause",
    "read_records",
    "record_parts",
    "u64_column",
]

_MAX_TOPICS: Final = 0xFFFF
_CAUSE_HEAD: Final = struct.Struct("<BBH")
_CONTROL: Final = re.compile("[\x00-\x1f\x7f-\x9f]")


# ---- integers --------------------------------------------------------------------------


def is_u32(value: object) -> TypeGuard[int]:
    return is_int(value) and 0 <= value <= MAX_U32


def is_u64(value: object) -> TypeGuard[int]:
    return is_int(value) and 0 <= value < 1 << 64


def u64_column(values: ArrayLike, n: int | None, what: str) -> NDArray[np.uint64]:
    """`values` as a 1-d uint64 array (of length n, unless n is None); BadRequest for
    another length or a value that is not a u64."""
    try:  # the bare errors below only carry their text into the BadRequest
        array = values if isinstance(values, np.ndarray) else np.asarray(values, dtype=np.uint64)
        if array.dtype.kind not in "iu":
            raise TypeError(f"got dtype {array.dtype}")
        if array.dtype.kind == "i" and array.size and int(array.min()) < 0:
            raise ValueError(f"got {int(array.min())}")
        if array.ndim != 1 or (n is not None and len(array) != n):
            raise ValueError(f"got shape {array.shape}")
    except (ValueError, TypeError, OverflowError) as exc:
        count = "" if n is None else f"{n} "
        raise BadRequest(f"{what} must be {count}unsigned 64-bit integers: {exc}") from None
    return array.astype("<u8", copy=False)


def expect_size(body: _Body, size: int, n: int, what: str) -> None:
    """Fixed-layout bodies: the declared count must match the byte length exactly."""
    left = len(body.data) - body.pos
    if left != size:
        raise MalformedFrame(
            f"{body.kind.name} declares {n} {what} ({size} bytes), but {left} bytes follow"
        )


# ---- text ------------------------------------------------------------------------------


def control_character(text: str) -> str | None:
    """The first control character (C0, DEL or C1) in `text`, as "U+XXXX", or None."""
    found = _CONTROL.search(text)
    return None if found is None else f"U+{ord(found.group()):04X}"


# ---- the record block (PERSIST, REPLAY, DEAD_LETTER_LIST, DEAD_LETTER_RESTORE) ----------


def _encode_topics(topics: Sequence[str], n: int) -> tuple[bytes, bytes]:
    """(topic index u16[n], topic table) for the record layout."""
    if n == 0:
        return b"", _U16.pack(0)
    # list.count compares by identity first: a batch built with one topic object (the
    # usual case) is recognised without hashing every entry.
    if topics.count(topics[0]) == n:
        distinct: list[str] = [topics[0]]
        index = np.zeros(n, dtype="<u2")
    else:
        codes = {topic: code for code, topic in enumerate(dict.fromkeys(topics))}
        if len(codes) > _MAX_TOPICS:
            raise BadRequest(f"a batch may have at most {_MAX_TOPICS} topics, got {len(codes)}")
        distinct = list(codes)
        index = np.fromiter(map(codes.__getitem__, topics), dtype="<u2", count=n)
    table = [_U16.pack(len(distinct))]
    for topic in distinct:
        raw = topic.encode("utf-8")
        if len(raw) > 0xFFFF:
            raise BadRequest(
                f"topic {topic[:40]!r}... is {len(raw)} utf-8 bytes, at most 65535 fit"
            )
        table += [_U16.pack(len(raw)), raw]
    return index.tobytes(), b"".join(table)


def record_parts(
    batch: RecordBatch, initial: NDArray[np.uint64] | None, parts: list[bytes]
) -> None:
    """Append the record columns (docs/protocol.md 4.2), after u32 n, to `parts`.

    The payloads are appended one by one (or as the one buffer of `Payloads`), not
    joined: the frame is built with a single join, so the payload bytes are copied
    once."""
    n = len(batch)
    payloads = batch.payloads
    if isinstance(payloads, Payloads):
        lengths = payloads.lengths
        payload_parts: Sequence[bytes] = [payloads.blob]
    else:
        lengths = np.fromiter(map(len, payloads), dtype=np.int64, count=n)
        payload_parts = payloads
    if n and int(lengths.max()) > MAX_U32:
        raise BadRequest("a payload is longer than 4 GiB: the record layout cannot carry it")
    index, table = _encode_topics(batch.topics, n)
    parts.append(np.ascontiguousarray(batch.roots, dtype="<u8").tobytes())
    if initial is not None:
        parts.append(initial.tobytes())
    parts += [
        np.ascontiguousarray(batch.source_ids, dtype="<u4").tobytes(),
        np.ascontiguousarray(batch.key_hashes, dtype="<i8").tobytes(),
        _flags(batch).tobytes(),
        np.ascontiguousarray(batch.partitions, dtype="<i4").tobytes(),
        np.ascontiguousarray(batch.offsets, dtype="<i8").tobytes(),
        index,
        table,
        lengths.astype("<u4").tobytes(),
    ]
    parts += payload_parts


def _flags(batch: RecordBatch) -> NDArray[np.uint8]:
    """Each record's flags byte: bit 0 has a key, bit 1 stored by reference."""
    flags = np.ascontiguousarray(batch.has_key, dtype=np.bool_).astype("u1")
    if batch.references is not None:
        flags |= batch.references.astype("u1") << 1
    return flags


def read_records(body: _Body, n: int, with_initial: bool) -> tuple[RecordBatch, NDArray[Any]]:
    """The record columns of n records from `body` (after u32 n), checked completely
    before the batch is built; (batch, initial values or an empty array)."""
    roots = body.array("<u8", n, "roots")
    initial = body.array("<u8", n if with_initial else 0, "initial ack values")
    source_ids = body.array("<u4", n, "source ids")
    key_hashes = body.array("<i8", n, "key hashes")
    has_key = body.array("u1", n, "has_key")
    partitions = body.array("<i4", n, "partitions")
    offsets = body.array("<i8", n, "offsets")
    topic_index = body.array("<u2", n, "topic index")
    count = body.u16("topic count")
    table = [body.text(body.u16(f"topic {i} length"), f"topic {i}") for i in range(count)]
    lengths = body.array("<u4", n, "payload lengths")
    blob = body.rest()
    total = int(lengths.sum(dtype=np.uint64))
    if total != len(blob):
        raise MalformedFrame(
            f"{body.kind.name} payload lengths add up to {total} bytes, but {len(blob)} "
            "bytes follow them"
        )
    if n and int(has_key.max()) > 3:
        raise BadRequest(
            f"{body.kind.name} record flags must be 0 to 3 (bit 0 key, bit 1 by "
            f"reference), got {int(has_key.max())}"
        )
    if n and int(topic_index.max()) >= count:
        raise BadRequest(
            f"{body.kind.name} topic index {int(topic_index.max())} is out of range: "
            f"the topic table has {count} topics"
        )
    batch = RecordBatch(
        roots=roots,
        source_ids=source_ids,
        key_hashes=key_hashes,
        has_key=(has_key & 1).astype(np.bool_),
        topics=_topics(table, topic_index, n),
        partitions=partitions,
        offsets=offsets,
        payloads=Payloads(blob, lengths),
        references=(has_key & 2).astype(np.bool_) if n and int(has_key.max()) > 1 else None,
    )
    return batch, initial


def _topics(table: list[str], index: NDArray[Any], n: int) -> list[str]:
    if len(table) == 1:
        return [table[0]] * n
    names = np.empty(len(table), dtype=object)
    names[:] = table
    topics: list[str] = names[index].tolist()
    return topics


# ---- fail causes (FAIL, SINK_SETTLE) ---------------------------------------------------


def cause_parts(cause: Cause) -> list[bytes]:
    """A cause on the wire: u8 kind, u8 flags (bit 0 final, bit 1 final if repeated),
    u16 + utf-8 step, u16 + utf-8 error (clipped to fit)."""
    cause = cause.clipped()
    step, error = cause.step.encode("utf-8"), cause.error.encode("utf-8")
    flags = int(cause.final) | int(cause.final_if_repeated) << 1
    head = _CAUSE_HEAD.pack(int(cause.kind), flags, len(step))
    return [head, step, _U16.pack(len(error)), error]


def read_cause(body: _Body, what: str) -> Cause:
    code, flags, step_len = body.unpack(_CAUSE_HEAD, what)
    if code not in FailKind._value2member_map_ or flags & ~3:
        raise BadRequest(
            f"{what} has an unknown encoding: kind {code}, flags {flags:#x} "
            f"(kinds {[int(k) for k in FailKind]}, flag bit 0 = final, "
            "bit 1 = final if repeated)"
        )
    step = body.text(step_len, f"{what} step")
    error = body.text(body.u16(f"{what} error length"), f"{what} error")
    return Cause(FailKind(code), step, error, bool(flags & 1), bool(flags & 2))


# ---- JSON bodies -----------------------------------------------------------------------


def _no_constant(name: str) -> Any:
    raise BadRequest(f"{name} is not a JSON number: numbers on the wire are finite")


def parse_json(raw: bytes, kind: Kind, what: str = "body") -> Any:
    """The JSON value in `raw`: MalformedFrame for bytes that are not UTF-8 or not
    JSON, BadRequest for NaN, Infinity and -Infinity."""
    text = _utf8(raw, kind, what)
    try:
        return json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise MalformedFrame(f"{kind.name} {what} is not JSON: {exc}") from None


def dump_json(value: Any, what: str, *, sort_keys: bool = True) -> bytes:
    """`value` as compact UTF-8 JSON; BadRequest for what JSON cannot carry (NaN and
    infinities included)."""
    try:
        text = json.dumps(value, separators=(",", ":"), sort_keys=sort_keys, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise BadRequest(f"{what} is not JSON: {exc}") from None
    return text.encode("utf-8")


def encode_object(kind: Kind, request_id: int, value: Mapping[str, Any], what: str) -> bytes:
    """The frame of a reply whose body is one JSON object."""
    return encode_frame(kind, request_id, dump_json(dict(value), what))


def decode_object(body: _Body) -> dict[str, Any]:
    """A body that is one JSON object; MalformedFrame for another JSON value."""
    value = parse_json(body.rest(), body.kind)
    if not isinstance(value, dict):
        raise MalformedFrame(f"{body.kind.name} body is JSON {type(value).__name__}, not an object")
    return value
