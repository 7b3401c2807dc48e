"""The operator's messages (docs/protocol.md 5.8 and 5.11): DEAD_LETTERS with its
DEAD_LETTER_LIST reply, DEAD_LETTER_RESTORE (the list's layout, the other way), and
INSPECT with its INSPECT_REPLY. A JSON head, then records or payloads in binary."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from ftlayer.inspection import INSPECT_PAYLOAD_BYTES, Inspection, RecordQuery
from ftlayer.records import RecordBatch

from .blocks import dump_json, is_int, parse_json, read_records, record_parts
from .frames import (
    _U32,
    DEFAULT_MAX_FRAME,
    BadRequest,
    Frame,
    Kind,
    MalformedFrame,
    ProtocolError,
    _body,
    _join_frame,
    encode_frame,
)

__all__ = [
    "DEAD_LETTER_OPS",
    "DeadLetterList",
    "DeadLettersRequest",
    "decode_dead_letter_list",
    "decode_dead_letter_restore",
    "decode_dead_letters",
    "decode_inspect",
    "decode_inspect_reply",
    "encode_dead_letter_list",
    "encode_dead_letters",
    "encode_inspect",
    "encode_inspect_reply",
]

DEAD_LETTER_OPS: Final = ("list", "requeue", "purge", "delivered")


@dataclass(frozen=True, slots=True)
class DeadLettersRequest:
    """DEAD_LETTERS: `op` ("list", "requeue", "purge" or "delivered") the dead letters
    that match `where` (DeadLetterFilter.to_json); list returns at most `limit` (None
    for every other op: they take every match)."""

    op: str
    where: dict[str, Any]
    limit: int | None = None


@dataclass(frozen=True, slots=True)
class DeadLetterList:
    """DEAD_LETTER_LIST: the dead letters listed (their retry records as JSON, each with
    its "seq"), their stored records in the same order, and whether more matched than
    the reply holds."""

    letters: list[dict[str, Any]]
    records: RecordBatch
    more: bool


# ---- dead letters ----------------------------------------------------------------------


def encode_dead_letters(
    request_id: int, op: str, where: Mapping[str, Any] | None = None, limit: int | None = None
) -> bytes:
    """DEAD_LETTERS: a utf-8 JSON object {"op": str, "where": object, "limit": int or null};
    a limit is for "list" only (the other ops take every match)."""
    body = {"op": op, "where": dict(where or {}), "limit": limit}
    _check_dead_letters(body)
    return encode_frame(Kind.DEAD_LETTERS, request_id, dump_json(body, "DEAD_LETTERS body"))


def decode_dead_letters(message: Frame | bytes) -> DeadLettersRequest:
    body = parse_json(_body(message, Kind.DEAD_LETTERS).rest(), Kind.DEAD_LETTERS)
    _check_dead_letters(body)
    return DeadLettersRequest(body["op"], body["where"], body["limit"])


def _check_dead_letters(body: Any) -> None:
    """The shape of a DEAD_LETTERS request; `where` is DeadLetterFilter's to check. A
    limit with requeue, purge or delivered is refused rather than ignored: they would
    take every match, not the first `limit`."""
    if not (
        isinstance(body, dict)
        and set(body) == {"op", "where", "limit"}
        and body["op"] in DEAD_LETTER_OPS
        and isinstance(body["where"], dict)
    ):
        raise BadRequest(
            f'DEAD_LETTERS must be a JSON object {{"op": one of {list(DEAD_LETTER_OPS)}, '
            f'"where": object, "limit": a positive int or null}}; got {str(body)[:200]!r}'
        )
    limit = body["limit"]
    if limit is not None and not (is_int(limit) and limit > 0):
        raise BadRequest(f"DEAD_LETTERS limit must be a positive int or null, got {limit!r}")
    if limit is not None and body["op"] != "list":
        raise BadRequest(
            f'DEAD_LETTERS limit is for "list" only; {body["op"]!r} takes every dead letter '
            f"that matches where (narrow it instead), got limit {limit!r}"
        )


def encode_dead_letter_list(
    request_id: int,
    letters: Sequence[Mapping[str, Any]],
    records: RecordBatch,
    more: bool,
    *,
    max_frame: int = DEFAULT_MAX_FRAME,
    kind: Kind = Kind.DEAD_LETTER_LIST,
) -> bytes:
    """DEAD_LETTER_LIST: u32 J, a utf-8 JSON object {"letters": [...], "more": bool}
    of J bytes, then u32 n and the record columns without initial values (as REPLAY's).
    DEAD_LETTER_RESTORE (`kind`) has the same layout: dead letters taken back from a
    dead-letter topic, with their histories, to store and replay again."""
    if len(letters) != len(records):
        raise BadRequest(f"{len(letters)} dead letters but {len(records)} records")
    head = dump_json({"letters": list(letters), "more": more}, "dead letters", sort_keys=False)
    parts = [_U32.pack(len(head)), head, _U32.pack(len(records))]
    record_parts(records, None, parts)
    return _join_frame(kind, request_id, parts, max_frame)


def decode_dead_letter_list(
    message: Frame | bytes, kind: Kind = Kind.DEAD_LETTER_LIST
) -> DeadLetterList:
    body = _body(message, kind)
    head = parse_json(body.raw(body.u32("JSON length"), "JSON"), kind, "JSON")
    n = body.u32("record count")
    records, _ = read_records(body, n, with_initial=False)
    if not (
        isinstance(head, dict)
        and isinstance(head.get("letters"), list)
        and isinstance(head.get("more"), bool)
        and len(head["letters"]) == n
    ):
        raise MalformedFrame(f"{kind.name} JSON does not describe its {n} records")
    return DeadLetterList(head["letters"], records, head["more"])


def decode_dead_letter_restore(message: Frame | bytes) -> DeadLetterList:
    return decode_dead_letter_list(message, Kind.DEAD_LETTER_RESTORE)


# ---- INSPECT ---------------------------------------------------------------------------


def encode_inspect(request_id: int, query: RecordQuery) -> bytes:
    """INSPECT: a utf-8 JSON object {"root": u64} or {"topic": str, "partition": int,
    "offset": int} (ftlayer.inspection.RecordQuery)."""
    body = query.to_json()
    _record_query(body, BadRequest)
    return encode_frame(Kind.INSPECT, request_id, dump_json(body, "INSPECT query"))


def decode_inspect(message: Frame | bytes) -> RecordQuery:
    body = parse_json(_body(message, Kind.INSPECT).rest(), Kind.INSPECT)
    return _record_query(body, BadRequest)


def _record_query(data: Any, error: type[ProtocolError]) -> RecordQuery:
    """The RecordQuery `data` is; `error` naming the problem otherwise. Its integers
    are never bools: {"root": true} is no root."""
    numbers = ("root", "partition", "offset")
    if isinstance(data, dict) and any(key in data and not is_int(data[key]) for key in numbers):
        raise error(f"INSPECT root, partition and offset are integers, got {str(data)[:200]}")
    try:
        return RecordQuery.from_json(data)
    except (TypeError, ValueError) as exc:
        raise error(f"INSPECT: {exc}"[:600]) from None


def encode_inspect_reply(
    request_id: int, inspection: Inspection, *, max_frame: int = DEFAULT_MAX_FRAME
) -> bytes:
    """INSPECT_REPLY: u32 J, a utf-8 JSON object of J bytes (Inspection.to_json: the
    query, the records found, "retired"), then per record u32 length and the start of
    its payload: at most INSPECT_PAYLOAD_BYTES each, and together at most half a frame
    (its "payload_bytes" is the whole size)."""
    head = dump_json(inspection.to_json(), "inspection", sort_keys=False)
    cut = min(INSPECT_PAYLOAD_BYTES, max_frame // 2 // max(1, len(inspection.records)))
    parts = [_U32.pack(len(head)), head]
    for record in inspection.records:
        payload = record.payload[:cut]
        parts += [_U32.pack(len(payload)), payload]
    return _join_frame(Kind.INSPECT_REPLY, request_id, parts, max_frame)


def decode_inspect_reply(message: Frame | bytes) -> Inspection:
    body = _body(message, Kind.INSPECT_REPLY)
    head = parse_json(body.raw(body.u32("JSON length"), "JSON"), Kind.INSPECT_REPLY, "JSON")
    records = head.get("records") if isinstance(head, dict) else None
    if not isinstance(records, list):
        raise MalformedFrame(f"INSPECT_REPLY JSON has no records list: {str(head)[:200]}")
    payloads = [body.raw(body.u32("payload length"), "payload") for _ in records]
    body.done()
    _record_query(head.get("query"), MalformedFrame)
    try:
        return Inspection.from_json(head, payloads)
    except ValueError as exc:
        raise MalformedFrame(f"INSPECT_REPLY: {exc}"[:600]) from None
