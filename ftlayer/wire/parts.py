"""SAVEPOINT_READ (0x2F) and SAVEPOINT_BYTES (0x9B): a savepoint part the server wrote
into its spool (SAVEPOINT with "dir" null, docs/protocol.md 5.7), fetched by the client
in chunks, so a part of any size crosses the wire in frames of bounded size.

The client asks for `length` bytes of the part's data file at `offset`; the reply holds
exactly that many, fewer only where the file ends (none at or past its end). Reading is
idempotent: a chunk may be asked for again. `release` asks the server to delete its
spooled copy (the reply is then empty). The client checks the bytes it put together
against the part's manifest (`data_bytes`, `data_sha256`), not the server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from .blocks import dump_json, is_int, parse_json
from .frames import BadRequest, Frame, Kind, _body, encode_frame

__all__ = [
    "MAX_READ_BYTES",
    "SavepointBytes",
    "SavepointRead",
    "decode_savepoint_bytes",
    "decode_savepoint_read",
    "encode_savepoint_bytes",
    "encode_savepoint_read",
]

MAX_READ_BYTES: Final = 16 << 20
"""The most bytes one SAVEPOINT_READ asks for (a quarter of the default frame)."""
_KEYS: Final = frozenset({"name", "offset", "length", "release"})


@dataclass(frozen=True, slots=True)
class SavepointRead:
    """SAVEPOINT_READ: `length` bytes at `offset` of spooled part `name`'s data file, or,
    with `release`, delete that spooled part."""

    name: str
    offset: int
    length: int
    release: bool = False


@dataclass(frozen=True, slots=True)
class SavepointBytes:
    """SAVEPOINT_BYTES: the bytes read (empty at the end of the file, or for a release)."""

    data: bytes


def encode_savepoint_read(
    request_id: int, name: str, offset: int, length: int, *, release: bool = False
) -> bytes:
    body = {"name": name, "offset": offset, "length": length, "release": release}
    _check(body)
    return encode_frame(Kind.SAVEPOINT_READ, request_id, dump_json(body, "SAVEPOINT_READ body"))


def decode_savepoint_read(message: Frame | bytes) -> SavepointRead:
    body = parse_json(_body(message, Kind.SAVEPOINT_READ).rest(), Kind.SAVEPOINT_READ)
    _check(body)
    return SavepointRead(body["name"], body["offset"], body["length"], body["release"])


def _check(body: object) -> None:
    if (
        not isinstance(body, dict)
        or set(body) != _KEYS
        or not isinstance(body["name"], str)
        or not is_int(body["offset"])
        or not is_int(body["length"])
        or not isinstance(body["release"], bool)
    ):
        raise BadRequest(
            'SAVEPOINT_READ body must be a JSON object {"name": str, "offset": int, '
            f'"length": int, "release": bool}}, got {body!r}'[:600]
        )
    if body["offset"] < 0 or not 0 <= body["length"] <= MAX_READ_BYTES:
        raise BadRequest(
            f"SAVEPOINT_READ wants offset >= 0 and 0 <= length <= {MAX_READ_BYTES}, got "
            f"offset {body['offset']} and length {body['length']}"
        )


def encode_savepoint_bytes(request_id: int, data: bytes) -> bytes:
    return encode_frame(Kind.SAVEPOINT_BYTES, request_id, data)


def decode_savepoint_bytes(message: Frame | bytes) -> SavepointBytes:
    return SavepointBytes(_body(message, Kind.SAVEPOINT_BYTES).rest())
