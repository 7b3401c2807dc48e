"""Frames: `u32 L | u8 kind | u32 request id | body`, the kinds, the error codes and
the typed errors every decoder raises (the package docstring has the whole layout).
`FrameReader` cuts a byte stream into frames and refuses a bad length as soon as its
four bytes arrive, before any of the body is buffered."""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Any, Final, TypeGuard

import numpy as np
from numpy.typing import NDArray

from ftlayer.errors import ConfigError, FTLayerError

PROTOCOL_VERSION: Final = 1
SUPPORTED_VERSIONS: Final = frozenset({PROTOCOL_VERSION})
MAGIC: Final = b"FTLY"
DEFAULT_MAX_FRAME: Final = 64 * 1024 * 1024
MAX_U32: Final = 0xFFFFFFFF
_PREFIX: Final = struct.Struct(">I")
_HEAD: Final = struct.Struct(">IBI")
_HEAD_SIZE: Final = _HEAD.size  # 9: length, kind, request id
_MIN_LENGTH: Final = 5  # kind + request id
_U16: Final = struct.Struct("<H")
_U32: Final = struct.Struct("<I")
_U8: Final = struct.Struct("<B")


class Kind(enum.IntEnum):
    """The u8 kind of a frame. Requests are below 0x80; replies have the high bit set."""

    HELLO = 0x01
    AUTH = 0x02
    PERSIST = 0x10
    XOR = 0x11
    FAIL = 0x12
    FETCH_REPLAY = 0x13
    STATUS = 0x14
    REGISTER_SOURCE = 0x15
    CHECKPOINT_BEGIN = 0x20
    CHECKPOINT_DONE = 0x21
    SAVEPOINT = 0x22
    DEAD_LETTERS = 0x23
    DEAD_LETTER_RESTORE = 0x24
    HOLD = 0x25
    HEARTBEAT = 0x26
    INSPECT = 0x27
    SINK_HOLD = 0x28
    SINK_SETTLE = 0x29
    UNFILLED = 0x2A
    FILL = 0x2B
    BATCH_RANGES = 0x2C
    SINK_MARK = 0x2D
    INGEST = 0x2E
    SAVEPOINT_READ = 0x2F
    FAIL_PARKED = 0x30
    PARKED = 0x31
    RANGE_READ = 0x32
    BATCH_BEGIN = 0x33
    CHALLENGE = 0x81
    WELCOME = 0x82
    OK = 0x90
    REPLAY = 0x91
    STATUS_REPLY = 0x92
    CHECKPOINT = 0x94
    SAVEPOINT_CREATED = 0x95
    DEAD_LETTER_LIST = 0x96
    INSPECT_REPLY = 0x97
    UNFILLED_LIST = 0x98
    RANGE_NUMBERS = 0x99
    MARK = 0x9A
    SAVEPOINT_BYTES = 0x9B
    PARKED_LIST = 0x9C
    BATCH_BEGUN = 0x9D
    ERROR = 0xFF


REQUEST_KINDS: Final = frozenset(k for k in Kind if k < 0x80)
"""The kinds a client may send; the others (high bit set) are replies."""
HANDSHAKE_KINDS: Final = frozenset({Kind.HELLO, Kind.AUTH})


class ErrorCode(enum.IntEnum):
    """The u16 code of an ERROR reply. 1-99: the request or stream; 100+: the server."""

    MALFORMED_FRAME = 1
    FRAME_TOO_LARGE = 2
    UNKNOWN_KIND = 3
    UNSUPPORTED_VERSION = 4
    AUTH_FAILED = 5
    NOT_AUTHENTICATED = 6
    BAD_REQUEST = 7
    UNEXPECTED_KIND = 9
    INTERNAL = 100
    STORAGE = 101
    REJECTED = 102
    BUSY = 103
    TLS_REQUIRED = 104


# ---- errors --------------------------------------------------------------------------


class ProtocolError(FTLayerError):
    """Bytes that break the protocol, or a message it cannot carry; `code` names why."""

    code: ErrorCode = ErrorCode.MALFORMED_FRAME


class MalformedFrame(ProtocolError):
    """The bytes do not fit the layout of their kind (lengths, utf-8, JSON)."""

    code = ErrorCode.MALFORMED_FRAME


class FrameTooLarge(ProtocolError):
    """A frame's length is above max_frame (or a message would encode to one)."""

    code = ErrorCode.FRAME_TOO_LARGE


class UnknownKind(ProtocolError):
    """A frame's kind is not in `Kind`."""

    code = ErrorCode.UNKNOWN_KIND


class UnsupportedVersion(ProtocolError):
    """HELLO or WELCOME names a protocol version this side does not speak."""

    code = ErrorCode.UNSUPPORTED_VERSION


class AuthFailed(ProtocolError):
    """The AUTH digest does not prove the token for this connection's nonces."""

    code = ErrorCode.AUTH_FAILED


class NotAuthenticated(ProtocolError):
    """A data request arrived before the handshake completed."""

    code = ErrorCode.NOT_AUTHENTICATED


class BadRequest(ProtocolError):
    """The bytes fit the layout, but a value is outside its documented range."""

    code = ErrorCode.BAD_REQUEST


class UnexpectedKind(ProtocolError):
    """A valid kind where another was expected (a reply sent to the server, ...)."""

    code = ErrorCode.UNEXPECTED_KIND


@dataclass(frozen=True, slots=True)
class Frame:
    """One frame: its kind (any u8: unknown kinds are the decoder's to reject), the
    request id, and the body."""

    kind: int
    request_id: int
    body: bytes


# ---- framing ---------------------------------------------------------------------------


def _check_max_frame(max_frame: int) -> None:
    if not _MIN_LENGTH <= max_frame <= MAX_U32:
        raise ConfigError(f"max_frame must be {_MIN_LENGTH} to {MAX_U32}, got {max_frame}")


def _length_error(length: int, max_frame: int) -> ProtocolError | None:
    """The error a frame length prefix is, or None if it is within 5..max_frame."""
    if length < _MIN_LENGTH:
        return MalformedFrame(
            f"frame length {length} is below {_MIN_LENGTH} (kind + request id): "
            "the stream is out of step"
        )
    if length > max_frame:
        return FrameTooLarge(f"frame length {length} is above max_frame {max_frame}")
    return None


def encode_frame(
    kind: int, request_id: int, body: bytes, *, max_frame: int = DEFAULT_MAX_FRAME
) -> bytes:
    """One frame of any u8 kind; BadRequest for a kind or request id out of range,
    FrameTooLarge if 5 + len(body) > max_frame."""
    return _frame_head(kind, request_id, _MIN_LENGTH + len(body), max_frame) + body


def _join_frame(kind: Kind, request_id: int, parts: list[bytes], max_frame: int) -> bytes:
    """The frame whose body is b"".join(parts): size checked first, joined once."""
    length = _MIN_LENGTH + sum(map(len, parts))
    return b"".join([_frame_head(kind, request_id, length, max_frame), *parts])


def _frame_head(kind: int, request_id: int, length: int, max_frame: int) -> bytes:
    if not (_is_int(kind) and 0 <= kind <= 0xFF):
        raise BadRequest(f"frame kind must be a u8, got {kind!r}")
    if not (_is_int(request_id) and 0 <= request_id <= MAX_U32):
        raise BadRequest(f"request id must be a u32, got {request_id!r}")
    if length > max_frame:
        raise FrameTooLarge(
            f"{_kind_name(kind)} frame would be {length} bytes, above max_frame "
            f"{max_frame}: send a smaller batch"
        )
    return _HEAD.pack(length, kind, request_id)


def _is_int(value: object) -> TypeGuard[int]:
    """An integer (a Python or numpy one) and not a bool: `isinstance(True, int)` holds,
    and struct would pack True as 1."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


class FrameReader:
    """Splits a byte stream into frames, whatever the chunks it arrives in.

    `feed` returns every frame the stream now completes. A length prefix below 5 or
    above max_frame breaks the stream as soon as its four bytes arrive, before the
    body is buffered: `feed` still returns the frames completed before it, and sets
    `error` (MalformedFrame, FrameTooLarge), the caller's to report after those
    frames. The stream cannot be resynchronized after that, so the reader stays
    failed: every later `feed` raises that error. Unknown kinds are not the reader's
    concern.
    """

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        _check_max_frame(max_frame)
        self.max_frame = max_frame
        self._buffer = bytearray()
        self.error: ProtocolError | None = None
        """Why the stream broke (a bad length prefix), or None."""

    @property
    def pending_bytes(self) -> int:
        """Bytes received that are not yet part of a returned frame."""
        return len(self._buffer)

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        if self.error is not None:
            raise type(self.error)(f"the stream failed earlier: {self.error}")
        buffer = self._buffer
        buffer += data
        frames: list[Frame] = []
        error: ProtocolError | None = None
        pos = 0
        end = len(buffer)
        # One copy per frame body: slices of a memoryview, not of the bytearray.
        with memoryview(buffer) as view:
            while end - pos >= _PREFIX.size:
                (length,) = _PREFIX.unpack_from(view, pos)
                error = _length_error(length, self.max_frame)
                if error is not None or end - pos - _PREFIX.size < length:
                    break
                _, kind, request_id = _HEAD.unpack_from(view, pos)
                body = view[pos + _HEAD_SIZE : pos + _PREFIX.size + length].tobytes()
                frames.append(Frame(kind, request_id, body))
                pos += _PREFIX.size + length
        if error is not None:
            self.error = error
            buffer.clear()
        elif pos:
            del buffer[:pos]
        return frames


# ---- body reading ----------------------------------------------------------------------


class _Body:
    """A cursor over one body; every read checks the bytes are there (MalformedFrame)."""

    __slots__ = ("data", "kind", "pos")

    def __init__(self, data: bytes, kind: Kind) -> None:
        self.data = data
        self.kind = kind
        self.pos = 0

    def _take(self, size: int, what: str) -> int:
        start = self.pos
        if size > len(self.data) - start:
            raise MalformedFrame(
                f"{self.kind.name} body is truncated: {what} needs {size} bytes at offset "
                f"{start}, the body has {len(self.data)}"
            )
        self.pos = start + size
        return start

    def unpack(self, layout: struct.Struct, what: str) -> tuple[Any, ...]:
        return layout.unpack_from(self.data, self._take(layout.size, what))

    def u16(self, what: str) -> int:
        value: int = self.unpack(_U16, what)[0]
        return value

    def u32(self, what: str) -> int:
        value: int = self.unpack(_U32, what)[0]
        return value

    def raw(self, size: int, what: str) -> bytes:
        start = self._take(size, what)
        return self.data[start : start + size]

    def array(self, dtype: str, count: int, what: str) -> NDArray[Any]:
        """`count` little-endian items, copied into a native, writable array."""
        item = np.dtype(dtype)
        start = self._take(count * item.itemsize, what)
        view = np.frombuffer(self.data, dtype=item, count=count, offset=start)
        return view.astype(item.newbyteorder("="))

    def text(self, size: int, what: str) -> str:
        return _utf8(self.raw(size, what), self.kind, what)

    def rest(self) -> bytes:
        start = self.pos
        self.pos = len(self.data)
        return self.data[start:]

    def done(self) -> None:
        extra = len(self.data) - self.pos
        if extra:
            raise MalformedFrame(
                f"{self.kind.name} body has {extra} trailing bytes after offset {self.pos}"
            )


def _utf8(raw: bytes, kind: Kind, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedFrame(f"{kind.name} {what} is not valid utf-8: {exc.reason}") from None


def _body(message: Frame | bytes, kind: Kind) -> _Body:
    """The body of `message` (a Frame, whose kind must be `kind`, or a bare body)."""
    if isinstance(message, Frame):
        if message.kind != kind:
            raise UnexpectedKind(f"expected a {kind.name} frame, got {_kind_name(message.kind)}")
        return _Body(message.body, kind)
    return _Body(bytes(message), kind)


def _kind_name(kind: int) -> str:
    return Kind(kind).name if kind in Kind._value2member_map_ else f"kind 0x{kind:02x}"


def kind_of(frame: Frame) -> Kind:
    """The frame's `Kind`; UnknownKind if it has none (retired kinds included)."""
    if frame.kind not in Kind._value2member_map_:
        raise UnknownKind(f"unknown frame kind 0x{frame.kind:02x} (request id {frame.request_id})")
    return Kind(frame.kind)
