"""A micro-batch's start in one round trip (docs/protocol.md 5.20): BATCH_BEGIN opens
the batch's offset ranges (as BATCH_RANGES), begins its barrier (as CHECKPOINT_BEGIN,
completing the barrier before it first when asked) and fetches the replays it takes in
(as FETCH_REPLAY, for each of its sources), in that order; BATCH_BEGUN answers with the
checkpoint, the range numbers and the first page of the replays.

The three steps are the ftkafka driver's planning of every batch (each a request of its
own, three round trips and three cold wake-ups of the server, before the batch's first
task can start). Their bodies and checks are those of the requests they stand for:
the checkpoint object is CHECKPOINT_BEGIN's, the ranges BATCH_RANGES', the replays a
FETCH_REPLAY's lo and hi, for each of the sources named."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ftlayer.records import ReplayRecords

from .blocks import dump_json, is_u32, is_u64, parse_json
from .control import CheckpointRequest, _check_checkpoint, _checkpoint_request, checkpoint_body
from .data import read_replay, replay_parts
from .fills import _check_ranges
from .frames import (
    _U32,
    DEFAULT_MAX_FRAME,
    BadRequest,
    Frame,
    Kind,
    MalformedFrame,
    _body,
    _join_frame,
    encode_frame,
)

__all__ = [
    "BatchBegin",
    "BatchBegun",
    "decode_batch_begin",
    "decode_batch_begun",
    "encode_batch_begin",
    "encode_batch_begun",
]

_KEYS = frozenset({"checkpoint", "ranges", "tree", "replays"})


@dataclass(frozen=True, slots=True)
class BatchBegin:
    """BATCH_BEGIN: open `ranges` (BATCH_RANGES; `tree`: tree-mode ranges), then begin
    `checkpoint` (a CHECKPOINT_BEGIN), then fetch the replays with lo < replay seq <= hi
    of each of `replay_sources` (`replays`: (lo, hi), or None: none)."""

    checkpoint: CheckpointRequest
    ranges: list[tuple[int, str, int, int, int]]
    tree: bool = False
    replays: tuple[int, int] | None = None
    replay_sources: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class BatchBegun:
    """BATCH_BEGUN: the checkpoint (CHECKPOINT's JSON), a number per range asked for (0:
    an empty range) and the replays' first page with its `through` (as REPLAY's: the
    replay seq up to which it holds every row asked for; 0 with no replays asked)."""

    checkpoint: dict[str, Any]
    range_numbers: list[int]
    replays: ReplayRecords
    through: int


def encode_batch_begin(
    request_id: int,
    *,
    query: str,
    position: Mapping[str, Any],
    sources: Sequence[int],
    mode: str,
    complete: Mapping[str, Any] | None = None,
    ranges: Sequence[tuple[int, str, int, int, int]] = (),
    tree: bool = False,
    replays: tuple[int, int] | None = None,
    replay_sources: Sequence[int] = (),
) -> bytes:
    """BATCH_BEGIN: utf-8 JSON {"checkpoint": CHECKPOINT_BEGIN's object, "ranges":
    BATCH_RANGES' list, "tree": bool, "replays": {"lo": u64, "hi": u64, "sources":
    [u32]} or null}."""
    body = {
        "checkpoint": checkpoint_body(query, position, sources, mode, complete),
        "ranges": [list(r) for r in ranges],
        "tree": tree,
        "replays": (
            None
            if replays is None
            else {"lo": replays[0], "hi": replays[1], "sources": list(replay_sources)}
        ),
    }
    _check(body)
    return encode_frame(Kind.BATCH_BEGIN, request_id, dump_json(body, "BATCH_BEGIN body"))


def decode_batch_begin(message: Frame | bytes) -> BatchBegin:
    body = parse_json(_body(message, Kind.BATCH_BEGIN).rest(), Kind.BATCH_BEGIN)
    _check(body)
    replays = body["replays"]
    return BatchBegin(
        _checkpoint_request(body["checkpoint"], Kind.CHECKPOINT_BEGIN),
        [(int(a), str(b), int(c), int(d), int(e)) for a, b, c, d, e in body["ranges"]],
        tree=body["tree"],
        replays=None if replays is None else (replays["lo"], replays["hi"]),
        replay_sources=() if replays is None else tuple(replays["sources"]),
    )


def _check(body: object) -> None:
    if not isinstance(body, dict) or set(body) != _KEYS:
        raise BadRequest(
            'BATCH_BEGIN body must be a JSON object {"checkpoint": object, "ranges": '
            f'[[u32 source id, topic, partition, start, end]], "tree": bool, "replays": '
            f"object or null}}, got {body!r}"[:600]
        )
    _check_checkpoint(body["checkpoint"], Kind.CHECKPOINT_BEGIN)
    _check_ranges({"ranges": body["ranges"], "tree": body["tree"]}, Kind.BATCH_BEGIN)
    replays = body["replays"]
    if replays is not None and not (
        isinstance(replays, dict)
        and set(replays) == {"lo", "hi", "sources"}
        and is_u64(replays["lo"])
        and is_u64(replays["hi"])
        and replays["lo"] <= replays["hi"]
        and isinstance(replays["sources"], list)
        and all(is_u32(x) for x in replays["sources"])
    ):
        raise BadRequest(
            'BATCH_BEGIN "replays" must be {"lo": u64, "hi": u64, "sources": [u32]} '
            f"with lo <= hi, or null, got {replays!r}"[:600]
        )


def encode_batch_begun(
    request_id: int,
    checkpoint: Mapping[str, Any],
    range_numbers: Sequence[int],
    replays: ReplayRecords,
    *,
    through: int | None = None,
    max_frame: int = DEFAULT_MAX_FRAME,
) -> bytes:
    """BATCH_BEGUN: u32 J, utf-8 JSON {"checkpoint": object, "range_numbers": [u32]} of
    J bytes, then REPLAY's body (the replays' first page and its `through`)."""
    if not all(isinstance(n, int) and 0 <= n < 2**32 for n in range_numbers):
        raise BadRequest("range numbers are u32")
    head = dump_json(
        {"checkpoint": dict(checkpoint), "range_numbers": list(range_numbers)}, "BATCH_BEGUN"
    )
    parts = replay_parts(replays, through, [_U32.pack(len(head)), head])
    return _join_frame(Kind.BATCH_BEGUN, request_id, parts, max_frame)


def decode_batch_begun(message: Frame | bytes) -> BatchBegun:
    body = _body(message, Kind.BATCH_BEGUN)
    head = parse_json(body.raw(body.u32("JSON length"), "JSON"), Kind.BATCH_BEGUN, "JSON")
    if not (
        isinstance(head, dict)
        and set(head) == {"checkpoint", "range_numbers"}
        and isinstance(head["checkpoint"], dict)
        and isinstance(head["range_numbers"], list)
        and all(isinstance(n, int) and not isinstance(n, bool) for n in head["range_numbers"])
    ):
        raise MalformedFrame(
            'BATCH_BEGUN JSON must be {"checkpoint": object, "range_numbers": [u32]}'
        )
    replays, through = read_replay(body)
    return BatchBegun(head["checkpoint"], list(head["range_numbers"]), replays, through)
