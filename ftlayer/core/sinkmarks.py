"""Sink marks: what a sink noted before a batch wrote, kept where a restarted driver
finds it.

A Kafka sink resumes a task Spark retries (ftlayer.integration.resume): every attempt
of a batch's write job shares the write id and the topic's start offsets the driver
took before the batch wrote, and a retry skips the rows its dead attempt wrote. A
driver that dies takes that note with it, and Spark runs the batch again under the
same batch id after the restart. So the sink stores the note here first (SINK_MARK):
`mark` keeps the first mark stored for (sink, batch) and answers it, so the run after
a restart gets the dead run's write id and start offsets back and resumes its writes.

A sink's marks older than its newest batch are deleted with the newest one's store
(Spark runs again only the last batch it planned and did not commit). The marks are
meta entries `sinkmark/<sink>/<batch, 20 digits>`, one synced write each; a savepoint's
restore drops them (a restored FT layer serves new batches).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from ftlayer.errors import ConfigError

from .state import CoreState

__all__ = ["MARK_META_PREFIX", "mark"]

MARK_META_PREFIX: Final = "sinkmark/"


def _prefix(sink: str) -> str:
    if not sink or "\x00" in sink:
        raise ConfigError(f"a sink's name is not empty and has no NUL, got {sink!r}")
    return f"{MARK_META_PREFIX}{sink}/"


def mark(
    s: CoreState, sink: str, batch: int, proposed: Mapping[str, Any]
) -> tuple[dict[str, Any], bool]:
    """The mark of (`sink`, `batch`): the one stored already, or `proposed`, stored
    now (durable on return); and whether it is `proposed` (first)."""
    prefix = _prefix(sink)
    key = f"{prefix}{batch:020d}"
    stored = s.storage.get_meta(key)
    if stored is not None:
        return json.loads(stored), False
    older = [k for k in s.storage.meta_keys(prefix) if k < key]
    s.storage.update_meta({key: json.dumps(dict(proposed), sort_keys=True).encode()}, older)
    return dict(proposed), True
