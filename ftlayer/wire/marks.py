"""SINK_MARK (0x2D) and MARK (0x9A): a sink's note of how a batch writes, kept by the
FT layer where a restarted driver finds it (docs/protocol.md, 5.16).

A Kafka sink draws a write id and reads its topic's end offsets before each batch
writes (ftlayer.integration.resume); SINK_MARK stores that mark under the sink's name
and the batch id unless a mark for them is there already, and MARK answers the one
stored: the request's own (`first`), or the one an earlier driver stored before it
died, whose write the batch run again resumes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from .blocks import dump_json, is_int, parse_json
from .frames import BadRequest, Frame, Kind, MalformedFrame, _body, encode_frame

__all__ = [
    "MAX_SINK_NAME",
    "SinkMark",
    "SinkMarkRequest",
    "decode_mark",
    "decode_sink_mark",
    "encode_mark",
    "encode_sink_mark",
]

MAX_SINK_NAME: Final = 512
"""Characters in a sink's name."""
_MAX_MARK_BYTES: Final = 1 << 20


@dataclass(frozen=True, slots=True)
class SinkMarkRequest:
    """SINK_MARK: store `mark` for (`sink`, `batch`) unless one is stored."""

    sink: str
    batch: int
    mark: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class SinkMark:
    """MARK: the mark stored for the batch; `first`: this request's (none was there)."""

    mark: Mapping[str, Any]
    first: bool


def encode_sink_mark(request_id: int, sink: str, batch: int, mark: Mapping[str, Any]) -> bytes:
    """SINK_MARK: utf-8 JSON {"sink": name, "batch": id, "mark": object}."""
    body = {"sink": sink, "batch": batch, "mark": dict(mark)}
    _check_request(body)
    return encode_frame(Kind.SINK_MARK, request_id, dump_json(body, "SINK_MARK body"))


def decode_sink_mark(message: Frame | bytes) -> SinkMarkRequest:
    raw = _body(message, Kind.SINK_MARK).rest()
    if len(raw) > _MAX_MARK_BYTES:
        raise BadRequest(f"a SINK_MARK body is at most {_MAX_MARK_BYTES} bytes, got {len(raw)}")
    body = parse_json(raw, Kind.SINK_MARK)
    _check_request(body)
    return SinkMarkRequest(body["sink"], int(body["batch"]), body["mark"])


def _check_request(body: object) -> None:
    ok = (
        isinstance(body, dict)
        and set(body) == {"sink", "batch", "mark"}
        and isinstance(body["sink"], str)
        and 0 < len(body["sink"]) <= MAX_SINK_NAME
        and is_int(body["batch"])
        and 0 <= body["batch"] < 2**63
        and isinstance(body["mark"], dict)
    )
    if not ok:
        raise BadRequest(
            f'SINK_MARK body must be {{"sink": a name of 1 to {MAX_SINK_NAME} characters, '
            f'"batch": an id >= 0, "mark": an object}}, got {body!r}'[:600]
        )


def encode_mark(request_id: int, mark: Mapping[str, Any], first: bool) -> bytes:
    """MARK: utf-8 JSON {"mark": object, "first": bool}."""
    body = {"mark": dict(mark), "first": bool(first)}
    return encode_frame(Kind.MARK, request_id, dump_json(body, "MARK body"))


def decode_mark(message: Frame | bytes) -> SinkMark:
    body = parse_json(_body(message, Kind.MARK).rest(), Kind.MARK)
    if not (
        isinstance(body, dict)
        and set(body) == {"mark", "first"}
        and isinstance(body["mark"], dict)
        and isinstance(body["first"], bool)
    ):
        raise MalformedFrame(
            f'MARK body must be {{"mark": an object, "first": a bool}}, got {body!r}'[:600]
        )
    return SinkMark(body["mark"], body["first"])
