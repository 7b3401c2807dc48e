"""The handshake: HELLO -> CHALLENGE -> AUTH -> WELCOME, and the HMAC digest that proves
knowledge of the token for one connection's two nonces (the token never crosses the
wire, and a digest replayed on another connection fails)."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from dataclasses import dataclass
from typing import Final

from .frames import (
    _U8,
    _U16,
    MAGIC,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    AuthFailed,
    BadRequest,
    Frame,
    Kind,
    MalformedFrame,
    UnsupportedVersion,
    _body,
    encode_frame,
)

NONCE_SIZE: Final = 32
MIN_CLIENT_NONCE: Final = 16
MAX_CLIENT_NONCE: Final = 32
DIGEST_SIZE: Final = 32
AUTH_CONTEXT: Final = b"ftlayer-auth-v1"
AUTH_REQUIRED: Final = 0x01
"""CHALLENGE flag bit 0: the server checks the AUTH digest."""
_HELLO_HEAD: Final = struct.Struct("<4sH")
_CHALLENGE: Final = struct.Struct(f"<B{NONCE_SIZE}s")
_WELCOME: Final = struct.Struct("<HQ")


@dataclass(frozen=True, slots=True)
class Hello:
    version: int
    client_nonce: bytes
    client_name: str


@dataclass(frozen=True, slots=True)
class Challenge:
    auth_required: bool
    server_nonce: bytes


@dataclass(frozen=True, slots=True)
class Auth:
    digest: bytes


@dataclass(frozen=True, slots=True)
class Welcome:
    version: int
    session_id: int


# ---- handshake -------------------------------------------------------------------------


def new_nonce(size: int = NONCE_SIZE) -> bytes:
    """A fresh random nonce (32 bytes for the server, 16 to 32 for the client)."""
    return secrets.token_bytes(size)


def auth_digest(token: bytes | str, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """HMAC-SHA256(token, b"ftlayer-auth-v1" + server nonce + client nonce): 32 bytes."""
    key = token.encode("utf-8") if isinstance(token, str) else token
    return hmac.new(key, AUTH_CONTEXT + server_nonce + client_nonce, hashlib.sha256).digest()


def check_auth(token: bytes | str, server_nonce: bytes, client_nonce: bytes, digest: bytes) -> None:
    """AuthFailed (which says nothing about the token) unless `digest` proves `token`
    for these nonces; the comparison takes constant time."""
    if not hmac.compare_digest(auth_digest(token, server_nonce, client_nonce), digest):
        raise AuthFailed("authentication failed: the AUTH digest does not match the token")


def encode_hello(
    request_id: int,
    client_nonce: bytes,
    client_name: str = "",
    *,
    version: int = PROTOCOL_VERSION,
) -> bytes:
    if not MIN_CLIENT_NONCE <= len(client_nonce) <= MAX_CLIENT_NONCE:
        raise BadRequest(
            f"client nonce must be {MIN_CLIENT_NONCE} to {MAX_CLIENT_NONCE} bytes, "
            f"got {len(client_nonce)}"
        )
    if not 0 <= version <= 0xFFFF:
        raise BadRequest(f"protocol version must be a u16, got {version}")
    name = client_name.encode("utf-8")
    if len(name) > 0xFFFF:
        raise BadRequest(f"client name is {len(name)} utf-8 bytes, at most 65535 fit")
    body = b"".join(
        [
            _HELLO_HEAD.pack(MAGIC, version),
            _U8.pack(len(client_nonce)),
            client_nonce,
            _U16.pack(len(name)),
            name,
        ]
    )
    return encode_frame(Kind.HELLO, request_id, body)


def decode_hello(message: Frame | bytes) -> Hello:
    """Magic and version are checked first, so a future layout after them cannot
    confuse this version: a wrong version is UnsupportedVersion, whatever follows."""
    body = _body(message, Kind.HELLO)
    magic, version = body.unpack(_HELLO_HEAD, "magic and version")
    if magic != MAGIC:
        raise MalformedFrame(f"HELLO magic is {magic!r}, expected {MAGIC!r}: not an ftlayer client")
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedVersion(
            f"client speaks protocol version {version}; this side speaks "
            f"{sorted(SUPPORTED_VERSIONS)}"
        )
    (nonce_size,) = body.unpack(_U8, "client nonce length")
    if not MIN_CLIENT_NONCE <= nonce_size <= MAX_CLIENT_NONCE:
        raise BadRequest(
            f"HELLO client nonce is {nonce_size} bytes, must be "
            f"{MIN_CLIENT_NONCE} to {MAX_CLIENT_NONCE}"
        )
    nonce = body.raw(nonce_size, "client nonce")
    name = body.text(body.u16("client name length"), "client name")
    body.done()
    return Hello(version, nonce, name)


def encode_challenge(request_id: int, auth_required: bool, server_nonce: bytes) -> bytes:
    if len(server_nonce) != NONCE_SIZE:
        raise BadRequest(f"server nonce must be {NONCE_SIZE} bytes, got {len(server_nonce)}")
    flags = AUTH_REQUIRED if auth_required else 0
    return encode_frame(Kind.CHALLENGE, request_id, _CHALLENGE.pack(flags, server_nonce))


def decode_challenge(message: Frame | bytes) -> Challenge:
    body = _body(message, Kind.CHALLENGE)
    flags, nonce = body.unpack(_CHALLENGE, "flags and server nonce")
    body.done()
    if flags & ~AUTH_REQUIRED:
        raise BadRequest(f"CHALLENGE flags 0x{flags:02x} set reserved bits (only bit 0 is defined)")
    return Challenge(bool(flags & AUTH_REQUIRED), nonce)


def encode_auth(request_id: int, digest: bytes) -> bytes:
    if len(digest) != DIGEST_SIZE:
        raise BadRequest(f"AUTH digest must be {DIGEST_SIZE} bytes, got {len(digest)}")
    return encode_frame(Kind.AUTH, request_id, digest)


def decode_auth(message: Frame | bytes) -> Auth:
    body = _body(message, Kind.AUTH)
    digest = body.raw(DIGEST_SIZE, "digest")
    body.done()
    return Auth(digest)


def encode_welcome(request_id: int, session_id: int, *, version: int = PROTOCOL_VERSION) -> bytes:
    if not 0 <= session_id < 2**64 or not 0 <= version <= 0xFFFF:
        raise BadRequest(
            f"WELCOME needs a u16 version and a u64 session id, got {version}, {session_id}"
        )
    return encode_frame(Kind.WELCOME, request_id, _WELCOME.pack(version, session_id))


def decode_welcome(message: Frame | bytes) -> Welcome:
    body = _body(message, Kind.WELCOME)
    version, session_id = body.unpack(_WELCOME, "version and session id")
    body.done()
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedVersion(
            f"server speaks protocol version {version}; this side speaks "
            f"{sorted(SUPPORTED_VERSIONS)}"
        )
    return Welcome(version, session_id)
