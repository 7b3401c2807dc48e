"""The identities of ingested records, remembered for a window so that an upstream's
second copy of a record is dropped (ftlayer.core.ingest): per (source, upstream name),
identity -> ingest time, and the meta entries `ingest/<first seq>` that hold them."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

import numpy as np
from numpy.typing import NDArray

from ftlayer.persistence.base import PersistenceStorage
from ftlayer.records import RecordBatch

__all__ = ["DEFAULT_WINDOW_S", "INGEST_META_PREFIX", "IngestIds", "IngestResult"]

INGEST_META_PREFIX: Final = "ingest/"
DEFAULT_WINDOW_S: Final = 3600.0
"""How long an ingested record's identity is remembered: longer than any upstream's
redelivery delay (JetStream's AckWait, 30 s by default, times its redeliveries)."""

_Upstream = tuple[int, str]  # (source id, upstream name)


@dataclass(frozen=True, slots=True)
class IngestResult:
    """What `ingest` took: new records, and second copies it dropped."""

    taken: int
    duplicates: int


class IngestIds:
    """The identities of records ingested within the window, per (source, upstream
    name), and the meta entries that hold them (module docstring)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._seen: dict[_Upstream, dict[int, float]] = {}
        self._entries: dict[str, float] = {}  # meta key -> its ingest time
        self._loaded = False

    def load(self, storage: PersistenceStorage) -> None:
        """The identities stored by earlier runs (once per layer)."""
        if self._loaded:
            return
        self._loaded = True
        for key in storage.meta_keys(INGEST_META_PREFIX):
            raw = storage.get_meta(key)
            if raw is None:
                continue
            at, seen = _decode(raw)
            self._entries[key] = at
            for upstream, ids in seen.items():
                self._note(upstream, ids, at)

    def _note(self, upstream: _Upstream, ids: Iterable[int], at: float) -> None:
        mine = self._seen.setdefault(upstream, {})
        for identity in ids:
            mine[identity] = at

    def fresh(self, batch: RecordBatch, now: float) -> NDArray[np.bool_]:
        """Per record of `batch`: not a second copy (identity -1, or not seen within
        the window, and not earlier in `batch` itself)."""
        keep = np.ones(len(batch), dtype=np.bool_)
        within = now - self.window_s
        seen_here: set[tuple[int, str, int]] = set()
        rows = np.flatnonzero(batch.offsets >= 0)
        sources = batch.source_ids[rows].tolist()
        offsets = batch.offsets[rows].tolist()
        for row, source, identity in zip(rows.tolist(), sources, offsets, strict=True):
            topic = batch.topics[row]
            at = self._seen.get((source, topic), {}).get(identity)
            mark = (source, topic, identity)
            if (at is not None and at >= within) or mark in seen_here:
                keep[row] = False
            else:
                seen_here.add(mark)
        return keep

    def entry(self, batch: RecordBatch, now: float) -> bytes | None:
        """The meta value of `batch`'s identities (None: it has none)."""
        rows = np.flatnonzero(batch.offsets >= 0)
        if not len(rows):
            return None
        seen: dict[str, list[int]] = {}
        for row, source, identity in zip(
            rows.tolist(),
            batch.source_ids[rows].tolist(),
            batch.offsets[rows].tolist(),
            strict=True,
        ):
            seen.setdefault(f"{source}/{batch.topics[row]}", []).append(identity)
        return json.dumps({"at": now, "ids": seen}, sort_keys=True).encode()

    def add(self, key: str, raw: bytes) -> None:
        at, seen = _decode(raw)
        self._entries[key] = at
        for upstream, ids in seen.items():
            self._note(upstream, ids, at)

    def expired(self, now: float) -> list[str]:
        """The meta keys older than the window, forgotten here (the caller deletes
        them), and the identities older than the window."""
        within = now - self.window_s
        old = [key for key, at in self._entries.items() if at < within]
        for key in old:
            del self._entries[key]
        if old:
            for upstream in list(self._seen):
                kept = {i: at for i, at in self._seen[upstream].items() if at >= within}
                if kept:
                    self._seen[upstream] = kept
                else:
                    del self._seen[upstream]
        return old


def _decode(raw: bytes) -> tuple[float, dict[_Upstream, list[int]]]:
    data = json.loads(raw)
    seen: dict[_Upstream, list[int]] = {}
    for name, ids in data["ids"].items():
        source, _, topic = name.partition("/")
        seen[(int(source), topic)] = [int(i) for i in ids]
    return float(data["at"]), seen
