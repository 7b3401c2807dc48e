"""A batch sink's acks, held until its write is done (tree mode without the sink's cache).

`ft_foreach_batch` in tree mode acks every row of a micro-batch once the user's
function has written it. Reading the rows' FT columns for those acks after the write
means computing the batch twice, or caching it (integration.sinks), which costs as much
as the FT layer's whole budget in a fast pipeline (docs/benchmarks.md). So, when the
rows reach the sink straight from FTTasks steps over an ftkafka source, the sink asks
the steps that produce them for the acks instead (integration.sinkhold):
each such step, in the sink's own Spark jobs, sends the ack pairs (root, id) of its
output rows under the sink's *key*, a random 64-bit number with the top bit set (so
never a source id), and the FT layer keeps them as holds of that key (`OpenHolds`,
journaled as barrier holds are) without XOR-ing them. Then the sink settles the key:

- its write succeeded: every pair held under it is XOR-ed in one call, as the sink's
  own acks would have been, and the trees nobody else holds complete;
- its write failed: every root held under it fails, with the write's error (replayed).

A second computation of the batch inside the user's function (two actions) reads the
source again; the re-read takes over the roots of the first (ftlayer.core.takeover),
so the pairs held for those are dropped at the settle, and the second computation's
complete. A task that sends its pairs after the key was settled (a straggler: a
speculative attempt that lost) has them applied at once, as the settle did. A key
whose sink never settles (its driver died) keeps its holds until none of their roots
is pending any more: the trees time out and are replayed, and the first timeout
rotation a timeout after its first hold drops the key
(`drop_stale_sink_keys` in ftlayer.core.holding).
"""

from __future__ import annotations

import collections
from typing import Final

from ftlayer.causes import Cause
from ftlayer.errors import ConfigError
from ftlayer.wire.messages import SINK_KEY_BIT

__all__ = ["SINK_KEY_BIT", "SinkKeys", "check_sink_key"]

_SETTLED_KEPT: Final = 4096
"""Settled keys remembered, for stragglers."""


def check_sink_key(key: int) -> int:
    if not isinstance(key, int) or not SINK_KEY_BIT <= key < 1 << 64:
        raise ConfigError(f"a sink key is a 64-bit number with its top bit set, got {key!r}")
    return key


class SinkKeys:
    """The sink keys with open holds (when their first hold came) and the last settled
    ones (with their cause: None for a write that succeeded)."""

    def __init__(self) -> None:
        self._open: dict[int, float] = {}
        self._settled: collections.OrderedDict[int, Cause | None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._open)

    def settled(self, key: int) -> tuple[bool, Cause | None]:
        """(whether `key` was settled, the cause it was failed with if it was)."""
        if key not in self._settled:
            return False, None
        return True, self._settled[key]

    def opened(self, key: int, now: float) -> None:
        self._open.setdefault(key, now)

    def settle(self, key: int, cause: Cause | None) -> None:
        self._open.pop(key, None)
        self._settled[key] = cause
        self._settled.move_to_end(key)
        while len(self._settled) > _SETTLED_KEPT:
            self._settled.popitem(last=False)

    def older_than(self, when: float) -> list[int]:
        """Open keys whose first hold came before `when`."""
        return [key for key, began in self._open.items() if began < when]

    def forget(self, key: int) -> None:
        self._open.pop(key, None)
