"""How sources, tasks and tools reach the FT-layer server: `FTClient` (one blocking
connection, lazy handshake, reconnect with backoff; `connection`), `BatchingChannel`
(a process's batching of events: bounded, flushed by size and time) and
`shared_channel` (one per process and server; `channel`)."""

from .channel import (
    BatchingChannel,
    close_shared_channels,
    shared_channel,
)
from .connection import SAVEPOINT_TIMEOUT_S, BatchStart, FTClient
from .endpoint import client_tls_context, parse_address, read_token_file
from .errors import (
    ConnectionLost,
    RequestRejected,
    ServerBusy,
    ServerError,
    ServerStorageError,
    TLSMismatch,
)

__all__ = [
    "SAVEPOINT_TIMEOUT_S",
    "BatchStart",
    "BatchingChannel",
    "ConnectionLost",
    "FTClient",
    "RequestRejected",
    "ServerBusy",
    "ServerError",
    "ServerStorageError",
    "TLSMismatch",
    "client_tls_context",
    "close_shared_channels",
    "parse_address",
    "read_token_file",
    "shared_channel",
]
