"""Every message after the handshake, and `decode`: one table from kind to decoder.

The codecs live by concern: `data` (PERSIST, REPLAY, XOR, HOLD, FAIL, SINK_HOLD,
SINK_SETTLE, FETCH_REPLAY), `fills` (UNFILLED, UNFILLED_LIST, FILL, BATCH_RANGES, RANGE_NUMBERS,
RANGE_READ), `batches` (BATCH_BEGIN, BATCH_BEGUN), `control`
(REGISTER_SOURCE, the checkpoint and savepoint requests and replies, HEARTBEAT,
STATUS, OK, ERROR) and `admin` (the dead letters, INSPECT); `blocks` has the pieces
they share. This module re-exports them all, so `ftlayer.wire.messages.X` names every
message type and codec."""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from ftlayer.inspection import Inspection, RecordQuery
from ftlayer.records import ReplayRecords

from .admin import (
    DEAD_LETTER_OPS,
    DeadLetterList,
    DeadLettersRequest,
    decode_dead_letter_list,
    decode_dead_letter_restore,
    decode_dead_letters,
    decode_inspect,
    decode_inspect_reply,
    encode_dead_letter_list,
    encode_dead_letters,
    encode_inspect,
    encode_inspect_reply,
)
from .auth import (
    Auth,
    Challenge,
    Hello,
    Welcome,
    decode_auth,
    decode_challenge,
    decode_hello,
    decode_welcome,
)
from .batches import (
    BatchBegin,
    BatchBegun,
    decode_batch_begin,
    decode_batch_begun,
    encode_batch_begin,
    encode_batch_begun,
)
from .control import (
    CheckpointReply,
    CheckpointRequest,
    ErrorReply,
    Heartbeat,
    Ok,
    RegisterSource,
    SavepointCreated,
    SavepointRequest,
    StatusReply,
    StatusRequest,
    decode_checkpoint_begin,
    decode_checkpoint_done,
    decode_checkpoint_reply,
    decode_error,
    decode_heartbeat,
    decode_ok,
    decode_register_source,
    decode_savepoint,
    decode_savepoint_created,
    decode_status_reply,
    decode_status_request,
    encode_checkpoint_reply,
    encode_checkpoint_request,
    encode_error,
    encode_error_for,
    encode_heartbeat,
    encode_ok,
    encode_register_source,
    encode_savepoint,
    encode_savepoint_created,
    encode_status_reply,
    encode_status_request,
)
from .data import (
    SINK_KEY_BIT,
    Fail,
    FetchReplay,
    Persist,
    SinkHold,
    SinkSettle,
    Xor,
    decode_fail,
    decode_fetch_replay,
    decode_hold,
    decode_persist,
    decode_replay,
    decode_replay_page,
    decode_sink_hold,
    decode_sink_settle,
    decode_xor,
    encode_fail,
    encode_fetch_replay,
    encode_hold,
    encode_persist,
    encode_replay,
    encode_sink_hold,
    encode_sink_settle,
    encode_xor,
)
from .fills import (
    BatchRanges,
    Fill,
    RangeRead,
    Unfilled,
    UnfilledList,
    decode_batch_ranges,
    decode_fill,
    decode_range_numbers,
    decode_range_read,
    decode_unfilled,
    decode_unfilled_list,
    encode_batch_ranges,
    encode_fill,
    encode_range_numbers,
    encode_range_read,
    encode_unfilled,
    encode_unfilled_list,
)
from .frames import Frame, Kind, kind_of
from .ingest import Ingest, decode_ingest, encode_ingest
from .marks import (
    SinkMark,
    SinkMarkRequest,
    decode_mark,
    decode_sink_mark,
    encode_mark,
    encode_sink_mark,
)
from .parked import (
    ParkedFailure,
    ParkedList,
    ParkedOp,
    ParkedRequest,
    decode_fail_parked,
    decode_parked,
    decode_parked_list,
    encode_fail_parked,
    encode_parked,
    encode_parked_list,
)
from .parts import (
    SavepointBytes,
    SavepointRead,
    decode_savepoint_bytes,
    decode_savepoint_read,
    encode_savepoint_bytes,
    encode_savepoint_read,
)

__all__ = [
    "DEAD_LETTER_OPS",
    "SINK_KEY_BIT",
    "BatchBegin",
    "BatchBegun",
    "BatchRanges",
    "CheckpointReply",
    "CheckpointRequest",
    "DeadLetterList",
    "DeadLettersRequest",
    "ErrorReply",
    "Fail",
    "FetchReplay",
    "Fill",
    "Heartbeat",
    "Ingest",
    "Message",
    "Ok",
    "ParkedFailure",
    "ParkedList",
    "ParkedOp",
    "ParkedRequest",
    "Persist",
    "RangeRead",
    "RegisterSource",
    "SavepointBytes",
    "SavepointCreated",
    "SavepointRead",
    "SavepointRequest",
    "SinkHold",
    "SinkMark",
    "SinkMarkRequest",
    "SinkSettle",
    "StatusReply",
    "StatusRequest",
    "Unfilled",
    "UnfilledList",
    "Xor",
    "decode",
    "decode_batch_begin",
    "decode_batch_begun",
    "decode_batch_ranges",
    "decode_checkpoint_begin",
    "decode_checkpoint_done",
    "decode_checkpoint_reply",
    "decode_dead_letter_list",
    "decode_dead_letter_restore",
    "decode_dead_letters",
    "decode_error",
    "decode_fail",
    "decode_fail_parked",
    "decode_fetch_replay",
    "decode_fill",
    "decode_heartbeat",
    "decode_hold",
    "decode_ingest",
    "decode_inspect",
    "decode_inspect_reply",
    "decode_mark",
    "decode_ok",
    "decode_parked",
    "decode_parked_list",
    "decode_persist",
    "decode_range_numbers",
    "decode_range_read",
    "decode_register_source",
    "decode_replay",
    "decode_replay_page",
    "decode_savepoint",
    "decode_savepoint_bytes",
    "decode_savepoint_created",
    "decode_savepoint_read",
    "decode_sink_hold",
    "decode_sink_mark",
    "decode_sink_settle",
    "decode_status_reply",
    "decode_status_request",
    "decode_unfilled",
    "decode_unfilled_list",
    "decode_xor",
    "encode_batch_begin",
    "encode_batch_begun",
    "encode_batch_ranges",
    "encode_checkpoint_reply",
    "encode_checkpoint_request",
    "encode_dead_letter_list",
    "encode_dead_letters",
    "encode_error",
    "encode_error_for",
    "encode_fail",
    "encode_fail_parked",
    "encode_fetch_replay",
    "encode_fill",
    "encode_heartbeat",
    "encode_hold",
    "encode_ingest",
    "encode_inspect",
    "encode_inspect_reply",
    "encode_mark",
    "encode_ok",
    "encode_parked",
    "encode_parked_list",
    "encode_persist",
    "encode_range_numbers",
    "encode_range_read",
    "encode_register_source",
    "encode_replay",
    "encode_savepoint",
    "encode_savepoint_bytes",
    "encode_savepoint_created",
    "encode_savepoint_read",
    "encode_sink_hold",
    "encode_sink_mark",
    "encode_sink_settle",
    "encode_status_reply",
    "encode_status_request",
    "encode_unfilled",
    "encode_unfilled_list",
    "encode_xor",
]

Message = (
    Hello
    | Challenge
    | Auth
    | Welcome
    | Persist
    | Xor
    | Fail
    | FetchReplay
    | RegisterSource
    | CheckpointRequest
    | CheckpointReply
    | SavepointRequest
    | SavepointCreated
    | StatusRequest
    | StatusReply
    | Heartbeat
    | SinkHold
    | SinkSettle
    | Ok
    | ReplayRecords
    | DeadLettersRequest
    | RecordQuery
    | Inspection
    | DeadLetterList
    | Unfilled
    | UnfilledList
    | Fill
    | BatchRanges
    | BatchBegin
    | BatchBegun
    | RangeRead
    | SinkMarkRequest
    | Ingest
    | SinkMark
    | SavepointRead
    | SavepointBytes
    | ParkedFailure
    | ParkedRequest
    | ParkedList
    | list[int]
    | ErrorReply
)


def decode(frame: Frame) -> Message:
    """The message in `frame`, by its kind; UnknownKind for a kind not in `Kind`."""
    return _DECODERS[kind_of(frame)](frame)


_DECODERS: Final[dict[Kind, Callable[[Frame], Message]]] = {
    Kind.HELLO: decode_hello,
    Kind.AUTH: decode_auth,
    Kind.PERSIST: decode_persist,
    Kind.XOR: decode_xor,
    Kind.FAIL: decode_fail,
    Kind.FETCH_REPLAY: decode_fetch_replay,
    Kind.STATUS: decode_status_request,
    Kind.REGISTER_SOURCE: decode_register_source,
    Kind.CHECKPOINT_BEGIN: decode_checkpoint_begin,
    Kind.CHECKPOINT_DONE: decode_checkpoint_done,
    Kind.SAVEPOINT: decode_savepoint,
    Kind.DEAD_LETTERS: decode_dead_letters,
    Kind.DEAD_LETTER_LIST: decode_dead_letter_list,
    Kind.DEAD_LETTER_RESTORE: decode_dead_letter_restore,
    Kind.HOLD: decode_hold,
    Kind.HEARTBEAT: decode_heartbeat,
    Kind.SINK_HOLD: decode_sink_hold,
    Kind.SINK_SETTLE: decode_sink_settle,
    Kind.INSPECT: decode_inspect,
    Kind.INSPECT_REPLY: decode_inspect_reply,
    Kind.UNFILLED: decode_unfilled,
    Kind.UNFILLED_LIST: decode_unfilled_list,
    Kind.FILL: decode_fill,
    Kind.BATCH_RANGES: decode_batch_ranges,
    Kind.RANGE_NUMBERS: decode_range_numbers,
    Kind.RANGE_READ: decode_range_read,
    Kind.BATCH_BEGIN: decode_batch_begin,
    Kind.BATCH_BEGUN: decode_batch_begun,
    Kind.SINK_MARK: decode_sink_mark,
    Kind.INGEST: decode_ingest,
    Kind.MARK: decode_mark,
    Kind.SAVEPOINT_READ: decode_savepoint_read,
    Kind.SAVEPOINT_BYTES: decode_savepoint_bytes,
    Kind.FAIL_PARKED: decode_fail_parked,
    Kind.PARKED: decode_parked,
    Kind.PARKED_LIST: decode_parked_list,
    Kind.CHECKPOINT: decode_checkpoint_reply,
    Kind.SAVEPOINT_CREATED: decode_savepoint_created,
    Kind.CHALLENGE: decode_challenge,
    Kind.WELCOME: decode_welcome,
    Kind.OK: decode_ok,
    Kind.REPLAY: decode_replay,
    Kind.STATUS_REPLY: decode_status_reply,
    Kind.ERROR: decode_error,
}
