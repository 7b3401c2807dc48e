"""The control messages (docs/protocol.md 5.3, 5.6, 5.7, 5.10 and 6): REGISTER_SOURCE,
the checkpoint requests and their CHECKPOINT reply, SAVEPOINT and SAVEPOINT_CREATED,
HEARTBEAT, STATUS and STATUS_REPLY, and the two generic replies OK and ERROR.

Their bodies are small JSON objects (HEARTBEAT, OK and ERROR excepted). Each decoder
checks the object's shape, JSON types included (a bool is never an integer), and raises
BadRequest naming the key at fault; the values the FT layer judges by its own state or
configuration (a partitioner's name and options, a retry policy's ranges, a position, a
savepoint name) are the server's to refuse (ERROR 102)."""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from ftlayer.registration import COMPLETIONS, SourceRegistration

from .blocks import (
    control_character,
    decode_object,
    dump_json,
    encode_object,
    expect_size,
    is_int,
    is_u32,
    parse_json,
)
from .frames import (
    _U32,
    DEFAULT_MAX_FRAME,
    BadRequest,
    Frame,
    Kind,
    ProtocolError,
    _body,
    _utf8,
    encode_frame,
)

__all__ = [
    "COMPLETIONS",
    "MAX_SOURCE_PARTITIONS",
    "RETRY_KEYS",
    "STATUS_BRIEF",
    "CheckpointReply",
    "CheckpointRequest",
    "ErrorReply",
    "Heartbeat",
    "Ok",
    "RegisterSource",
    "SavepointCreated",
    "SavepointRequest",
    "StatusReply",
    "StatusRequest",
    "decode_checkpoint_begin",
    "decode_checkpoint_done",
    "decode_checkpoint_reply",
    "decode_error",
    "decode_heartbeat",
    "decode_ok",
    "decode_register_source",
    "decode_savepoint",
    "decode_savepoint_created",
    "decode_status_reply",
    "decode_status_request",
    "encode_checkpoint_reply",
    "encode_checkpoint_request",
    "encode_error",
    "encode_error_for",
    "encode_heartbeat",
    "encode_ok",
    "encode_register_source",
    "encode_savepoint",
    "encode_savepoint_created",
    "encode_status_reply",
    "encode_status_request",
]

_ERROR_HEAD: Final = struct.Struct("<H")
_MAX_ERROR_MESSAGE: Final = 4096
_HEARTBEAT_HEAD: Final = struct.Struct("<II")
_MAX_HEARTBEAT_SOURCES: Final = 0xFFFF  # a query reads at most this many topics
_CHECKPOINT_MODES: Final = ("aligned", "unaligned")
RETRY_KEYS: Final = ("max_retries", "backoff_ms", "backoff_max_ms")
"""The keys of a REGISTER_SOURCE "retry" object (ftlayer.policy.RetryPolicy.to_json)."""
MAX_SOURCE_PARTITIONS: Final = 1 << 31
"""A source's partitions are i32 on the wire (0 .. 2**31 - 1), so at most this many."""
_REGISTER_REQUIRED: Final = frozenset({"partitioner", "num_partitions", "options"})
_REGISTER_OPTIONAL: Final = frozenset(
    {"timeout_s", "retry", "dead_letter_topic", "completion", "name", "max_pending"}
)


@dataclass(frozen=True, slots=True)
class RegisterSource:
    """`FTLayer.register_source`: one source's registration (ftlayer.registration)."""

    registration: SourceRegistration


@dataclass(frozen=True, slots=True)
class CheckpointRequest:
    """CHECKPOINT_BEGIN (`begin`) or CHECKPOINT_DONE of barrier `position` of
    `query` (see ftlayer.checkpoint)."""

    begin: bool
    query: str
    position: dict[str, Any]
    sources: list[int]
    mode: str
    complete: dict[str, Any] | None = None
    """CHECKPOINT_BEGIN only: a barrier of the same query to complete first (Spark's
    commit of the batch before, which comes right before the next batch is planned):
    one round trip for both."""


@dataclass(frozen=True, slots=True)
class CheckpointReply:
    """The checkpoint as JSON (Checkpoint.to_json)."""

    checkpoint: dict[str, Any]


@dataclass(frozen=True, slots=True)
class SavepointRequest:
    """SAVEPOINT: write a savepoint of the running server's store into `directory` (a
    path on the server's host; None: the server's spool, from where the client fetches
    it with SAVEPOINT_READ, ftlayer.wire.parts) under `name` (None: the default name;
    see ftlayer.checkpoint.savepoint.create_savepoint), with `savepoint_id` (the id the
    parts of one cluster's savepoint share; None: a new one)."""

    directory: str | None
    name: str | None
    savepoint_id: str | None = None


@dataclass(frozen=True, slots=True)
class SavepointCreated:
    """The savepoint created, as JSON (Savepoint.as_dict: its manifest and "path")."""

    savepoint: dict[str, Any]


@dataclass(frozen=True, slots=True)
class StatusRequest:
    """STATUS: the whole reply, or with `brief` only what a source's driver reads per
    batch (docs/protocol.md 6.2, "The brief reply")."""

    brief: bool = False


@dataclass(frozen=True, slots=True)
class StatusReply:
    status: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """HEARTBEAT: the driver of these sources is alive and their batch runs; lease it for
    `lease_ms` more milliseconds (0 ends the lease; `FTLayer.heartbeat`)."""

    source_ids: tuple[int, ...]
    lease_ms: int


@dataclass(frozen=True, slots=True)
class Ok:
    count: int


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """An ERROR reply. `code` is an int: codes this version does not know are kept."""

    code: int
    message: str


# ---- REGISTER_SOURCE -------------------------------------------------------------------


def encode_register_source(request_id: int, registration: SourceRegistration) -> bytes:
    """REGISTER_SOURCE: u32 source id, then `registration.to_spec()` as a JSON object
    (only the optional keys that differ from their defaults are written); checked as
    the decoder checks it."""
    source_id = registration.source_id
    if not is_u32(source_id):
        raise BadRequest(f"REGISTER_SOURCE needs a u32 source id, got {source_id!r}")
    spec = registration.to_spec()
    _register_source(source_id, spec)
    config = dump_json(spec, "REGISTER_SOURCE config")
    return encode_frame(Kind.REGISTER_SOURCE, request_id, _U32.pack(source_id) + config)


def decode_register_source(message: Frame | bytes) -> RegisterSource:
    body = _body(message, Kind.REGISTER_SOURCE)
    source_id = body.u32("source id")
    return _register_source(source_id, parse_json(body.rest(), Kind.REGISTER_SOURCE, "config"))


def _register_source(source_id: int, spec: Any) -> RegisterSource:
    """The registration `spec` describes; BadRequest naming the first key at fault. A
    null optional key means the same as an absent one. Ranges are the core's to check
    (ERROR 102)."""
    if not isinstance(spec, dict) or not (
        _REGISTER_REQUIRED <= set(spec) <= _REGISTER_REQUIRED | _REGISTER_OPTIONAL
    ):
        raise BadRequest(
            'REGISTER_SOURCE config must be a JSON object with "partitioner", '
            '"num_partitions" and "options", optionally "timeout_s", "retry", '
            '"dead_letter_topic", "completion", "name" and "max_pending", and nothing else; '
            f"got {str(spec)[:200]!r}"
        )
    partitioner, partitions, options = spec["partitioner"], spec["num_partitions"], spec["options"]
    timeout, retry = spec.get("timeout_s"), spec.get("retry")
    topic, completion = spec.get("dead_letter_topic"), spec.get("completion")
    name, max_pending = spec.get("name"), spec.get("max_pending")
    checks = (
        (isinstance(partitioner, str), '"partitioner" must be a str'),
        (
            is_int(partitions) and partitions <= MAX_SOURCE_PARTITIONS,
            f'"num_partitions" must be an int (not a bool) up to {MAX_SOURCE_PARTITIONS}',
        ),
        (isinstance(options, dict), '"options" must be an object'),
        (
            timeout is None or _finite_positive(timeout),
            '"timeout_s" must be a finite positive number of seconds, or null',
        ),
        (_retry_shape(retry), f'"retry" must be null or an object of ints, keys from {RETRY_KEYS}'),
        (
            topic is None or (isinstance(topic, str) and bool(topic)),
            '"dead_letter_topic" must be a non-empty str, or null',
        ),
        (
            completion is None or completion in COMPLETIONS,
            f'"completion" must be one of {COMPLETIONS}, or null',
        ),
        (
            name is None
            or (isinstance(name, str) and bool(name) and control_character(name) is None),
            '"name" must be a non-empty str without control characters, or null',
        ),
        (
            max_pending is None or (is_int(max_pending) and max_pending >= 1),
            '"max_pending" must be an int (not a bool) of at least 1, or null',
        ),
    )
    problem = next((what for ok, what in checks if not ok), None)
    if problem is not None:
        raise BadRequest(f"REGISTER_SOURCE {problem}; got {str(spec)[:200]!r}")
    return RegisterSource(
        SourceRegistration(
            source_id,
            partitioner,
            partitions,
            options,
            None if timeout is None else float(timeout),
            retry,
            topic,
            completion or "tree",
            name,
            max_pending,
        )
    )


def _finite_positive(value: Any) -> bool:
    """A JSON number (not a bool) that is above 0 and finite as a float."""
    if type(value) not in (int, float):
        return False
    try:
        return 0 < float(value) < math.inf
    except OverflowError:  # an int beyond float range
        return False


def _retry_shape(retry: Any) -> bool:
    """None, or an object whose keys are some of RETRY_KEYS, each an int. The ranges
    are RetryPolicy's to check (ERROR 102)."""
    return retry is None or (
        isinstance(retry, dict)
        and set(retry) <= set(RETRY_KEYS)
        and all(is_int(value) for value in retry.values())
    )


# ---- checkpoints -----------------------------------------------------------------------


def encode_checkpoint_request(
    request_id: int,
    *,
    begin: bool,
    query: str,
    position: Mapping[str, Any],
    sources: Sequence[int],
    mode: str,
    complete: Mapping[str, Any] | None = None,
) -> bytes:
    """CHECKPOINT_BEGIN (begin=True; with `complete`, that barrier is completed
    first) or CHECKPOINT_DONE."""
    kind = Kind.CHECKPOINT_BEGIN if begin else Kind.CHECKPOINT_DONE
    body = checkpoint_body(query, position, sources, mode, complete)
    _check_checkpoint(body, kind)
    return encode_frame(kind, request_id, dump_json(body, f"{kind.name} body"))


def checkpoint_body(
    query: str,
    position: Mapping[str, Any],
    sources: Sequence[int],
    mode: str,
    complete: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """A checkpoint request's JSON object (unchecked)."""
    body: dict[str, Any] = {
        "query": query,
        "position": dict(position),
        "sources": list(sources),
        "mode": mode,
    }
    if complete is not None:
        body["complete"] = dict(complete)
    return body


def _decode_checkpoint_request(message: Frame | bytes, kind: Kind) -> CheckpointRequest:
    body = parse_json(_body(message, kind).rest(), kind)
    _check_checkpoint(body, kind)
    return _checkpoint_request(body, kind)


def _checkpoint_request(body: dict[str, Any], kind: Kind) -> CheckpointRequest:
    """The request of a checked body (`_check_checkpoint`)."""
    return CheckpointRequest(
        kind is Kind.CHECKPOINT_BEGIN,
        body["query"],
        body["position"],
        list(body["sources"]),
        body["mode"],
        body.get("complete"),
    )


def decode_checkpoint_begin(message: Frame | bytes) -> CheckpointRequest:
    return _decode_checkpoint_request(message, Kind.CHECKPOINT_BEGIN)


def decode_checkpoint_done(message: Frame | bytes) -> CheckpointRequest:
    return _decode_checkpoint_request(message, Kind.CHECKPOINT_DONE)


def _check_checkpoint(body: Any, kind: Kind) -> None:
    """The shape of a checkpoint request, and a query name without control characters;
    the position and the rest of the name's rule are the coordinator's to check."""
    keys = {"query", "position", "sources", "mode"}
    if kind is Kind.CHECKPOINT_BEGIN and isinstance(body, dict) and "complete" in body:
        keys.add("complete")
    if (
        not isinstance(body, dict)
        or set(body) != keys
        or not isinstance(body.get("complete", {}), dict)
        or not isinstance(body["query"], str)
        or not isinstance(body["position"], dict)
        or not isinstance(body["sources"], list)
        or not all(is_u32(s) for s in body["sources"])
        or body["mode"] not in _CHECKPOINT_MODES
    ):
        extra = ', "complete": object (optional)' if kind is Kind.CHECKPOINT_BEGIN else ""
        raise BadRequest(
            f'{kind.name} body must be a JSON object {{"query": str, "position": object, '
            f'"sources": [u32], "mode": "aligned" or "unaligned"{extra}}}, got {body!r}'[:600]
        )
    control = control_character(body["query"])
    if control is not None:
        raise BadRequest(
            f"{kind.name} query name holds the control character {control}: a query name "
            f"has none (U+0000-U+001F, U+007F-U+009F), got {body['query']!r}"[:600]
        )


def encode_checkpoint_reply(request_id: int, checkpoint: Mapping[str, Any]) -> bytes:
    return encode_object(Kind.CHECKPOINT, request_id, checkpoint, "checkpoint")


def decode_checkpoint_reply(message: Frame | bytes) -> CheckpointReply:
    return CheckpointReply(decode_object(_body(message, Kind.CHECKPOINT)))


# ---- savepoints ------------------------------------------------------------------------


def encode_savepoint(
    request_id: int,
    directory: str | None,
    name: str | None = None,
    *,
    savepoint_id: str | None = None,
) -> bytes:
    """SAVEPOINT into the savepoints directory `directory` on the server's host, or
    (None) into the server's spool."""
    body: dict[str, Any] = {"dir": directory, "name": name}
    if savepoint_id is not None:
        body["id"] = savepoint_id
    _check_savepoint(body)
    return encode_frame(Kind.SAVEPOINT, request_id, dump_json(body, "SAVEPOINT body"))


def decode_savepoint(message: Frame | bytes) -> SavepointRequest:
    body = parse_json(_body(message, Kind.SAVEPOINT).rest(), Kind.SAVEPOINT)
    _check_savepoint(body)
    return SavepointRequest(body["dir"], body["name"], body.get("id"))


_SAVEPOINT_ID: Final = 64
"""The most characters in a savepoint id."""


def _check_savepoint(body: Any) -> None:
    """The shape of a SAVEPOINT request. The directory must be absolute: a relative one
    would name a place under the server's working directory, which the client cannot
    know. The name is the server's to check (ftlayer.checkpoint.savepoint)."""
    if (
        not isinstance(body, dict)
        or not {"dir", "name"} <= set(body) <= {"dir", "name", "id"}
        or not (body["dir"] is None or isinstance(body["dir"], str))
        or not (body["name"] is None or isinstance(body["name"], str))
        or not isinstance(body.get("id", ""), str)
    ):
        raise BadRequest(
            f'SAVEPOINT body must be a JSON object {{"dir": str or null, "name": str or '
            f'null[, "id": str]}}, got {body!r}'[:600]
        )
    savepoint_id = body.get("id")
    if savepoint_id is not None and not (
        0 < len(savepoint_id) <= _SAVEPOINT_ID and savepoint_id.isascii() and savepoint_id.isalnum()
    ):
        raise BadRequest(
            f"SAVEPOINT id must be 1 to {_SAVEPOINT_ID} ASCII letters or digits, "
            f"got {savepoint_id!r}"[:600]
        )
    directory = body["dir"]
    if directory is not None and (not directory.startswith("/") or "\0" in directory):
        raise BadRequest(
            "SAVEPOINT dir must be an absolute path on the server's host (a relative one "
            f"would depend on the server's working directory), got {directory!r}"[:600]
        )


def encode_savepoint_created(request_id: int, savepoint: Mapping[str, Any]) -> bytes:
    return encode_object(Kind.SAVEPOINT_CREATED, request_id, savepoint, "savepoint")


def decode_savepoint_created(message: Frame | bytes) -> SavepointCreated:
    return SavepointCreated(decode_object(_body(message, Kind.SAVEPOINT_CREATED)))


# ---- HEARTBEAT -------------------------------------------------------------------------


def encode_heartbeat(request_id: int, source_ids: Sequence[int], lease_ms: int) -> bytes:
    """HEARTBEAT: u32 lease ms, u32 n, source ids u32[n]."""
    ids = list(source_ids)
    if not (
        is_u32(lease_ms) and all(is_u32(s) for s in ids) and len(ids) <= _MAX_HEARTBEAT_SOURCES
    ):
        raise BadRequest(
            f"HEARTBEAT needs a u32 lease in ms and at most {_MAX_HEARTBEAT_SOURCES} u32 "
            f"source ids, got {lease_ms!r} and {ids!r}"[:600]
        )
    body = _HEARTBEAT_HEAD.pack(lease_ms, len(ids)) + np.array(ids, dtype="<u4").tobytes()
    return encode_frame(Kind.HEARTBEAT, request_id, body)


def decode_heartbeat(message: Frame | bytes) -> Heartbeat:
    body = _body(message, Kind.HEARTBEAT)
    lease_ms, n = body.unpack(_HEARTBEAT_HEAD, "lease and source count")
    expect_size(body, 4 * n, n, "source ids")
    if n > _MAX_HEARTBEAT_SOURCES:
        raise BadRequest(f"HEARTBEAT names {n} sources, more than {_MAX_HEARTBEAT_SOURCES}")
    ids = body.array("<u4", n, "source ids")
    return Heartbeat(tuple(int(s) for s in ids.tolist()), int(lease_ms))


# ---- STATUS ----------------------------------------------------------------------------


STATUS_BRIEF: Final = 0x01
"""Bit 0 of the STATUS request's flags byte: the brief reply (docs/protocol.md 6.2)."""


def encode_status_request(request_id: int, *, brief: bool = False) -> bytes:
    """STATUS: an empty body (the whole reply), or with `brief` one flags byte."""
    return encode_frame(Kind.STATUS, request_id, bytes([STATUS_BRIEF]) if brief else b"")


def decode_status_request(message: Frame | bytes) -> StatusRequest:
    """An empty body, or one flags byte whose bits 1-7 are 0 (BadRequest otherwise)."""
    body = _body(message, Kind.STATUS)
    if not body.data:
        return StatusRequest()
    (flags,) = body.raw(1, "flags")
    body.done()
    if flags & ~STATUS_BRIEF:
        raise BadRequest(f"STATUS flags {flags:#04x} set a reserved bit (bits 1-7 must be 0)")
    return StatusRequest(brief=bool(flags & STATUS_BRIEF))


def encode_status_reply(
    request_id: int, status: Mapping[str, Any], *, max_frame: int = DEFAULT_MAX_FRAME
) -> bytes:
    """STATUS_REPLY: `status` as a JSON object (e.g. FTStats.to_json() of current_stats())."""
    body = dump_json(dict(status), "status", sort_keys=False)
    return encode_frame(Kind.STATUS_REPLY, request_id, body, max_frame=max_frame)


def decode_status_reply(message: Frame | bytes) -> StatusReply:
    return StatusReply(decode_object(_body(message, Kind.STATUS_REPLY)))


# ---- OK and ERROR ----------------------------------------------------------------------


def encode_ok(request_id: int, count: int = 0) -> bytes:
    if not is_u32(count):
        raise BadRequest(f"OK count must be a u32, got {count!r}")
    return encode_frame(Kind.OK, request_id, _U32.pack(count))


def decode_ok(message: Frame | bytes) -> Ok:
    body = _body(message, Kind.OK)
    count = body.u32("count")
    body.done()
    return Ok(count)


def encode_error(request_id: int, code: int, message: str) -> bytes:
    """ERROR; messages longer than 4096 utf-8 bytes are cut (an error must always fit)."""
    if not (is_int(code) and 0 <= code <= 0xFFFF):
        raise BadRequest(f"error code must be a u16, got {code!r}")
    raw = message.encode("utf-8")
    if len(raw) > _MAX_ERROR_MESSAGE:
        raw = raw[:_MAX_ERROR_MESSAGE].decode("utf-8", errors="ignore").encode("utf-8")
    return encode_frame(Kind.ERROR, request_id, _ERROR_HEAD.pack(code) + raw)


def encode_error_for(request_id: int, error: ProtocolError) -> bytes:
    """The ERROR reply that reports `error` (its code and message)."""
    return encode_error(request_id, error.code, str(error))


def decode_error(message: Frame | bytes) -> ErrorReply:
    body = _body(message, Kind.ERROR)
    (code,) = body.unpack(_ERROR_HEAD, "error code")
    return ErrorReply(code, _utf8(body.rest(), Kind.ERROR, "message"))
