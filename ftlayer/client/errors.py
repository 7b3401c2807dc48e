"""The errors an FTClient raises for what the server answers or the connection does:
ERROR frames of code 100 and up as `ServerError` and its kinds (`error_for` maps a
code to its exception, the protocol's own codes to ftlayer.wire's), a connection that
broke (`ConnectionLost`), TLS that cannot work as configured (`TLSMismatch`)."""

from __future__ import annotations

from typing import Final

from ftlayer.errors import ConfigError, FTLayerError, StorageError
from ftlayer.wire import (
    AuthFailed,
    BadRequest,
    ErrorCode,
    FrameTooLarge,
    MalformedFrame,
    NotAuthenticated,
    ProtocolError,
    UnexpectedKind,
    UnknownKind,
    UnsupportedVersion,
)

__all__ = [
    "PROTOCOL_ERRORS",
    "ConnectionLost",
    "RequestRejected",
    "ServerBusy",
    "ServerError",
    "ServerStorageError",
    "TLSMismatch",
    "error_for",
]

PROTOCOL_ERRORS: Final[dict[int, type[ProtocolError]]] = {
    cls.code: cls
    for cls in (
        MalformedFrame,
        FrameTooLarge,
        UnknownKind,
        UnsupportedVersion,
        AuthFailed,
        NotAuthenticated,
        BadRequest,
        UnexpectedKind,
    )
}


class ServerError(FTLayerError):
    """The server answered ERROR with a code of 100 or more; `code` is that code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"server error {code}: {message}")
        self.code = code


class ServerStorageError(ServerError, StorageError):
    """ERROR 101: the server's storage refused the write; nothing was persisted."""


class RequestRejected(ServerError, ValueError):
    """ERROR 102: the core refused the request (reserved or repeated root, a record its
    partitioner cannot route); nothing was applied."""


class ServerBusy(ServerError):
    """ERROR 103: the server is at its connection limit; connecting retries it."""


class ConnectionLost(FTLayerError):
    """The connection broke before the reply: the request may or may not be applied."""


class TLSMismatch(ConfigError):
    """TLS between this client and the server cannot work as configured: the server
    speaks TLS and the client has no CA, the client speaks TLS to a plain-TCP server,
    or the server's certificate does not verify (an unknown CA, a name that does not
    match, expired). Never retried: only a change of configuration helps."""


def error_for(code: int, message: str) -> FTLayerError:
    protocol_error = PROTOCOL_ERRORS.get(code)
    if protocol_error is not None:
        return protocol_error(f"server: {message}")
    if code == ErrorCode.STORAGE:
        return ServerStorageError(code, message)
    if code == ErrorCode.REJECTED:
        return RequestRejected(code, message)
    if code == ErrorCode.BUSY:
        return ServerBusy(code, message)
    return ServerError(code, message)
