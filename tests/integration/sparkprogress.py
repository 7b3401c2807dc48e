"""Helpers of the streaming-progress tests (test_observed_progress, test_sink_progress,
test_step_progress): a listener that keeps every batch's observed metrics of one query,
and a marker that makes a record fail on first sight only."""

from __future__ import annotations

import os
import sys
import threading
from collections import Counter
from typing import Any

from pyspark import cloudpickle
from pyspark.sql.streaming import StreamingQueryListener

# The tests' functions that call first_sight run in Spark's Python workers, which
# cannot import this module: ship it by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def first_sight(marks: str, event_id: int) -> bool:
    """True the first time any process asks for this event (an O_EXCL marker file in
    `marks`), False every time after: a record that fails once, then passes."""
    try:
        os.close(os.open(os.path.join(marks, str(event_id)), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


class Progress(StreamingQueryListener):
    """The observed metrics of every batch of one query (set `query_id` once it started),
    as a listener gets them."""

    def __init__(self) -> None:
        self.batches: dict[int, dict[str, dict[str, Any]]] = {}
        self.query_id: str | None = None
        self.lock = threading.Lock()

    def onQueryStarted(self, event: Any) -> None:
        pass

    def onQueryProgress(self, event: Any) -> None:
        progress = event.progress
        if str(progress.id) != self.query_id or not progress.observedMetrics:
            return
        with self.lock:
            self.batches[progress.batchId] = {
                name: row.asDict() for name, row in progress.observedMetrics.items()
            }

    def onQueryIdle(self, event: Any) -> None:
        pass

    def onQueryTerminated(self, event: Any) -> None:
        pass

    def total(self, name: str, metric: str) -> int:
        """`metric` of observation `name`, summed over the batches that reported it."""
        with self.lock:
            return sum(b[name].get(metric, 0) for b in self.batches.values() if name in b)

    def failed_by_error(self, name: str) -> Counter[str]:
        """Observation `name`'s failed_by_error map, summed over the batches."""
        with self.lock:
            return sum(
                (Counter(b[name]["failed_by_error"]) for b in self.batches.values() if name in b),
                Counter(),
            )
