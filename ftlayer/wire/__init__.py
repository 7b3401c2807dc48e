"""The FT-layer wire protocol: frames, message bodies and the handshake, as pure functions.

`frames` (the frame codec, kinds, error codes, typed errors), `auth` (the handshake),
`blocks` (what bodies share: the record block, causes, JSON, the integer and text
rules), one type and codec per kind by concern in `data` (the data path), `control`
(registration, checkpoints, savepoints, heartbeats, status, OK, ERROR) and `admin`
(dead letters, INSPECT), and `messages` (`decode`, the table from kind to decoder, and
every message re-exported).

Sources and tasks talk to the FT-layer server over one byte stream (TCP, optionally
inside TLS). This module turns messages into bytes and bytes back into messages; it opens no
socket. docs/protocol.md documents every byte; this docstring is the summary.

Frames
------
Every message is one frame::

    u32 L (big-endian)  |  u8 kind  |  u32 request id (big-endian)  |  body (L - 5 bytes)

L counts kind + request id + body, so 5 <= L <= max_frame (64 MiB by default, a
parameter of the reader and of the encoders of variable-size messages). A shorter L is
`MalformedFrame`, a longer one `FrameTooLarge`, found as soon as the four length
bytes arrive, before any of the body is buffered; `FrameReader` still returns the
frames completed before it and keeps the error in `.error`. The client picks request
ids (1, 2, 3, ..., never 0); every reply echoes the id of its request; id 0 in a reply
means "no request" (an error about the stream itself). Integers inside bodies are
little-endian.

Kinds: requests (client to server) are below 0x80, replies have the high bit set.

| kind | name                | body                                                        |
|------|---------------------|-------------------------------------------------------------|
| 0x01 | HELLO               | b"FTLY", u16 version, u8 k, client nonce[k] (16 <= k <= 32), |
|      |                     | u16 m, utf-8 client name[m]                                 |
| 0x02 | AUTH                | 32-byte HMAC-SHA256(token, b"ftlayer-auth-v1" +             |
|      |                     | server nonce + client nonce)                                |
| 0x10 | PERSIST             | record columns with initial ack values (below)              |
| 0x11 | XOR                 | u32 n, roots u64[n], values u64[n]                          |
| 0x12 | FAIL                | u32 n, roots u64[n] [, u16 C, C causes (u8 kind, u8 flags,  |
|      |                     | u16 + utf-8 step, u16 + utf-8 error), cause index u16[n]]   |
| 0x13 | FETCH_REPLAY        | lo u64, hi u64, source id i64, partition i32 (-1 = any)     |
| 0x14 | STATUS              | empty                                                       |
| 0x15 | REGISTER_SOURCE     | u32 source id, utf-8 JSON object {"partitioner": str,       |
|      |                     | "num_partitions": int, "options": object[, "timeout_s":     |
|      |                     | a finite positive number, "retry": object,                  |
|      |                     | "dead_letter_topic": str, "completion": "tree"|"barrier"]}; |
|      |                     | "retry" has int "max_retries", "backoff_ms",                |
|      |                     | "backoff_max_ms", each optional                             |
| 0x20 | CHECKPOINT_BEGIN    | utf-8 JSON object {"query": str, "position": {"kafka":     |
|      |                     | {topic: {partition: offset}}, "replay": int}, "sources":    |
|      |                     | [u32], "mode": "aligned" or "unaligned"}                    |
|      |                     | [, "complete": position: completed first, one round trip]   |
| 0x21 | CHECKPOINT_DONE     | the same JSON object (without "complete")                   |
| 0x22 | SAVEPOINT           | utf-8 JSON object {"dir": str (absolute, on the server's    |
|      |                     | host) or null (its spool, for SAVEPOINT_READ), "name": str  |
|      |                     | or null[, "id": str, shared by a cluster's parts]}          |
| 0x23 | DEAD_LETTERS        | utf-8 JSON object {"op": "list", "requeue", "purge" or      |
|      |                     | "delivered", "where": filter object, "limit": int (list     |
|      |                     | only) or null}                                              |
| 0x24 | DEAD_LETTER_RESTORE | as DEAD_LETTER_LIST: dead letters from a topic to replay    |
| 0x25 | HOLD                | as XOR: a barrier-mode root goes on in a new batch          |
| 0x26 | HEARTBEAT           | u32 lease ms, u32 n, source ids u32[n]: their batch runs    |
| 0x27 | INSPECT             | utf-8 JSON object {"root": u64} or {"topic": str,           |
|      |                     | "partition": int, "offset": int}                            |
| 0x28 | SINK_HOLD           | u64 sink key (top bit set), then XOR's body                 |
| 0x29 | SINK_SETTLE         | u64 sink key, u8 outcome (0 written, 1 failed) [, a cause]  |
| 0x2A | UNFILLED            | u32 source id, u32 limit                                    |
| 0x2B | FILL                | u32 n, seqs u64[n], found u8[n], key hashes i64[n], has_key |
|      |                     | u8[n], payload lengths u32[n], the payloads (none where not |
|      |                     | found)                                                      |
| 0x2C | BATCH_RANGES        | utf-8 JSON {"ranges": [[source id, topic, partition, start, |
|      |                     | end]]} [, "tree": true]: a batch's offset ranges to open    |
| 0x2D | SINK_MARK           | utf-8 JSON {"sink": name, "batch": id, "mark": object}      |
| 0x2E | INGEST              | u32 n, record columns without initial values (below)        |
| 0x2F | SAVEPOINT_READ      | utf-8 JSON {"name": str, "offset": int, "length": int,      |
|      |                     | "release": bool}: a chunk of a spooled savepoint part       |
| 0x30 | FAIL_PARKED         | u16 owner shard, u8 S + S bytes utf-8 store id, then FAIL's |
|      |                     | body: a FAIL for a shard that could not be reached          |
| 0x31 | PARKED              | u8 op: 0 list (u32 limit), 1 drop (u32 n, seqs u64[n])      |
| 0x32 | RANGE_READ          | u64 range root of the first record, u64 n, u64 seed: a      |
|      |                     | tree-mode range's records read under the seed               |
| 0x33 | BATCH_BEGIN         | utf-8 JSON {"checkpoint": CHECKPOINT_BEGIN's object,        |
|      |                     | "ranges": BATCH_RANGES' list, "tree": bool, "replays":      |
|      |                     | [lo, hi] or null}: a batch's start in one round trip        |
| 0x81 | CHALLENGE           | u8 flags (bit 0: auth required; others 0), 32-byte server nonce |
| 0x82 | WELCOME             | u16 version, u64 session id                                 |
| 0x90 | OK                  | u32 count (records persisted, events applied, roots failed) |
| 0x91 | REPLAY              | u32 n, replay seqs u64[n], target partitions i32[n],        |
|      |                     | record columns without initial values (below)               |
| 0x92 | STATUS_REPLY        | a utf-8 JSON object                                         |
| 0x94 | CHECKPOINT          | utf-8 JSON object: the checkpoint (id, state, figures,      |
|      |                     | "commit_offsets"), the reply to both checkpoint requests;   |
|      |                     | with "complete", also "completed": that checkpoint          |
| 0x95 | SAVEPOINT_CREATED   | utf-8 JSON object: the savepoint created (its manifest and  |
|      |                     | "path", Savepoint.as_dict of ftlayer.checkpoint.savepoint)  |
| 0x96 | DEAD_LETTER_LIST    | u32 J, utf-8 JSON {"letters": [...], "more": bool}, then    |
|      |                     | u32 n and record columns without initial values (below)     |
| 0x97 | INSPECT_REPLY       | u32 J, utf-8 JSON {"query", "records": [...], "retired"},   |
|      |                     | then per record u32 length + the start of its payload       |
| 0x98 | UNFILLED_LIST       | u32 n, seqs u64[n], record columns without initial values   |
| 0x99 | RANGE_NUMBERS       | u32 n, u32 numbers[n]: the reply to BATCH_RANGES            |
| 0x9A | MARK                | utf-8 JSON {"mark": object, "first": bool}: SINK_MARK's     |
| 0x9B | SAVEPOINT_BYTES     | the bytes read: SAVEPOINT_READ's reply                      |
| 0x9C | PARKED_LIST         | u8 more, u32 E, per entry: u64 seq, u16 owner, u8 S + store |
|      |                     | id, u32 L + L bytes of FAIL's body                          |
| 0x9D | BATCH_BEGUN         | u32 J, utf-8 JSON {"checkpoint": object, "range_numbers":   |
|      |                     | [u32]}, then REPLAY's body: BATCH_BEGIN's reply             |
| 0xFF | ERROR               | u16 error code, utf-8 message (the rest of the body)        |

Kinds 0x16, 0x17 and 0x93 are reserved (never assigned): they decode as unknown kinds.

Record columns (PERSIST; REPLAY has the same without `initial`): u32 n, then roots
u64[n], initial u64[n], source ids u32[n], key hashes i64[n], flags u8[n] (bit 0: has a
key; bit 1: stored by reference, its payload empty), partitions i32[n], offsets i64[n],
topic index u16[n]; a topic table (u16 count, then per topic u16 length + utf-8);
payload lengths u32[n]; the payloads, concatenated.
Columns are decoded with `np.frombuffer`: the only Python objects built per record
are its payload bytes (sliced from the body) and a reference to its topic's str.

`kind_of(frame)` gives a frame's `Kind` (UnknownKind otherwise), so a server can
refuse a kind in the wrong place before it decodes the body; `decode(frame)` decodes
any kind.

Handshake: HELLO -> CHALLENGE -> AUTH -> WELCOME, always four frames. When CHALLENGE
says no auth is required the client still sends AUTH (32 zero bytes will do) and the
server does not check it. The token never crosses the wire: AUTH proves knowledge of
it for this connection's two nonces, so a digest replayed on another connection fails.

Errors
------
Every decoder checks lengths exactly and raises a `ProtocolError` subclass carrying
its `ErrorCode` (the code an ERROR reply about it carries), and nothing else: no
IndexError, struct.error or numpy error escapes, and no half-built batch is returned.
`MalformedFrame` means the bytes do not fit the kind's layout (truncated, trailing
bytes, declared counts that disagree with the byte length, invalid utf-8 or JSON);
`BadRequest` means they fit, but a value is outside its documented range (topic index,
record flags, nonce length, filter below -1, reserved flag bits) or a JSON body has the
wrong shape: a missing or extra key, a bool where an integer belongs, NaN or an
infinity, a control character (C0, DEL, C1) in a query name. Encoders raise
`BadRequest` for values the wire cannot carry or the decoder would refuse, and
`FrameTooLarge` above max_frame.
"""

from .auth import (
    AUTH_CONTEXT,
    AUTH_REQUIRED,
    DIGEST_SIZE,
    MAX_CLIENT_NONCE,
    MIN_CLIENT_NONCE,
    NONCE_SIZE,
    Auth,
    Challenge,
    Hello,
    Welcome,
    auth_digest,
    check_auth,
    decode_auth,
    decode_challenge,
    decode_hello,
    decode_welcome,
    encode_auth,
    encode_challenge,
    encode_hello,
    encode_welcome,
    new_nonce,
)
from .frames import (
    DEFAULT_MAX_FRAME,
    HANDSHAKE_KINDS,
    MAGIC,
    MAX_U32,
    PROTOCOL_VERSION,
    REQUEST_KINDS,
    SUPPORTED_VERSIONS,
    AuthFailed,
    BadRequest,
    ErrorCode,
    Frame,
    FrameReader,
    FrameTooLarge,
    Kind,
    MalformedFrame,
    NotAuthenticated,
    ProtocolError,
    UnexpectedKind,
    UnknownKind,
    UnsupportedVersion,
    encode_frame,
    kind_of,
)
from .messages import (
    DEAD_LETTER_OPS,
    SINK_KEY_BIT,
    BatchBegin,
    BatchBegun,
    BatchRanges,
    CheckpointReply,
    CheckpointRequest,
    DeadLetterList,
    DeadLettersRequest,
    ErrorReply,
    Fail,
    FetchReplay,
    Fill,
    Heartbeat,
    Ingest,
    Message,
    Ok,
    ParkedFailure,
    ParkedList,
    ParkedOp,
    ParkedRequest,
    Persist,
    RangeRead,
    RegisterSource,
    SavepointBytes,
    SavepointCreated,
    SavepointRead,
    SavepointRequest,
    SinkHold,
    SinkMark,
    SinkMarkRequest,
    SinkSettle,
    StatusReply,
    StatusRequest,
    Unfilled,
    UnfilledList,
    Xor,
    decode,
    decode_batch_begin,
    decode_batch_begun,
    decode_batch_ranges,
    decode_checkpoint_begin,
    decode_checkpoint_done,
    decode_checkpoint_reply,
    decode_dead_letter_list,
    decode_dead_letter_restore,
    decode_dead_letters,
    decode_error,
    decode_fail,
    decode_fail_parked,
    decode_fetch_replay,
    decode_fill,
    decode_heartbeat,
    decode_hold,
    decode_ingest,
    decode_inspect,
    decode_inspect_reply,
    decode_mark,
    decode_ok,
    decode_parked,
    decode_parked_list,
    decode_persist,
    decode_range_numbers,
    decode_range_read,
    decode_register_source,
    decode_replay,
    decode_replay_page,
    decode_savepoint,
    decode_savepoint_bytes,
    decode_savepoint_created,
    decode_savepoint_read,
    decode_sink_hold,
    decode_sink_mark,
    decode_sink_settle,
    decode_status_reply,
    decode_status_request,
    decode_unfilled,
    decode_unfilled_list,
    decode_xor,
    encode_batch_begin,
    encode_batch_begun,
    encode_batch_ranges,
    encode_checkpoint_reply,
    encode_checkpoint_request,
    encode_dead_letter_list,
    encode_dead_letters,
    encode_error,
    encode_error_for,
    encode_fail,
    encode_fail_parked,
    encode_fetch_replay,
    encode_fill,
    encode_heartbeat,
    encode_hold,
    encode_ingest,
    encode_inspect,
    encode_inspect_reply,
    encode_mark,
    encode_ok,
    encode_parked,
    encode_parked_list,
    encode_persist,
    encode_range_numbers,
    encode_range_read,
    encode_register_source,
    encode_replay,
    encode_savepoint,
    encode_savepoint_bytes,
    encode_savepoint_created,
    encode_savepoint_read,
    encode_sink_hold,
    encode_sink_mark,
    encode_sink_settle,
    encode_status_reply,
    encode_status_request,
    encode_unfilled,
    encode_unfilled_list,
    encode_xor,
)

__all__ = [
    "AUTH_CONTEXT",
    "AUTH_REQUIRED",
    "DEAD_LETTER_OPS",
    "DEFAULT_MAX_FRAME",
    "DIGEST_SIZE",
    "HANDSHAKE_KINDS",
    "MAGIC",
    "MAX_CLIENT_NONCE",
    "MAX_U32",
    "MIN_CLIENT_NONCE",
    "NONCE_SIZE",
    "PROTOCOL_VERSION",
    "REQUEST_KINDS",
    "SINK_KEY_BIT",
    "SUPPORTED_VERSIONS",
    "Auth",
    "AuthFailed",
    "BadRequest",
    "BatchBegin",
    "BatchBegun",
    "BatchRanges",
    "Challenge",
    "CheckpointReply",
    "CheckpointRequest",
    "DeadLetterList",
    "DeadLettersRequest",
    "ErrorCode",
    "ErrorReply",
    "Fail",
    "FetchReplay",
    "Fill",
    "Frame",
    "FrameReader",
    "FrameTooLarge",
    "Heartbeat",
    "Hello",
    "Ingest",
    "Kind",
    "MalformedFrame",
    "Message",
    "NotAuthenticated",
    "Ok",
    "ParkedFailure",
    "ParkedList",
    "ParkedOp",
    "ParkedRequest",
    "Persist",
    "ProtocolError",
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
    "UnexpectedKind",
    "Unfilled",
    "UnfilledList",
    "UnknownKind",
    "UnsupportedVersion",
    "Welcome",
    "Xor",
    "auth_digest",
    "check_auth",
    "decode",
    "decode_auth",
    "decode_batch_begin",
    "decode_batch_begun",
    "decode_batch_ranges",
    "decode_challenge",
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
    "decode_hello",
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
    "decode_welcome",
    "decode_xor",
    "encode_auth",
    "encode_batch_begin",
    "encode_batch_begun",
    "encode_batch_ranges",
    "encode_challenge",
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
    "encode_frame",
    "encode_heartbeat",
    "encode_hello",
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
    "encode_welcome",
    "encode_xor",
    "kind_of",
    "new_nonce",
]
