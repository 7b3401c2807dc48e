"""INGEST (0x2E): a receiver's records of a source that cannot replay, with their bytes
(docs/protocol.md, 5.17): `FTLayer.ingest`, answered OK(records taken); the others were
second copies of records ingested within the window, dropped."""

from __future__ import annotations

from dataclasses import dataclass

from ftlayer.records import RecordBatch

from .blocks import read_records, record_parts
from .frames import _U32, DEFAULT_MAX_FRAME, Frame, Kind, _body, _join_frame

__all__ = ["Ingest", "decode_ingest", "encode_ingest"]


@dataclass(frozen=True, slots=True)
class Ingest:
    """INGEST: records (`offsets`: each one's identity upstream, or -1)."""

    batch: RecordBatch


def encode_ingest(
    request_id: int, batch: RecordBatch, *, max_frame: int = DEFAULT_MAX_FRAME
) -> bytes:
    """INGEST: u32 n and the record columns without initial values (as REPLAY's)."""
    parts = [_U32.pack(len(batch))]
    record_parts(batch, None, parts)
    return _join_frame(Kind.INGEST, request_id, parts, max_frame)


def decode_ingest(message: Frame | bytes) -> Ingest:
    body = _body(message, Kind.INGEST)
    n = body.u32("record count")
    batch, _ = read_records(body, n, with_initial=False)
    return Ingest(batch)
