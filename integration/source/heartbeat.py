"""The driver's heartbeat: while a batch of the query runs, tell the FT layer so.

A tree must not time out while the batch carrying it is still running and its driver
alive (ftlayer.core.leases). Spark runs one micro-batch at a time: it plans batch n
(the source's `partitions()`, which sends the barrier, CHECKPOINT_BEGIN, and so opens
the batch in the FT layer), runs it, and only then asks the source for the next end
(`latestOffset()`). So the source's driver knows when a batch runs, and `Heartbeat`
sends HEARTBEAT for the query's sources every `interval_s` from `running()` (called
after the barrier) until `idle()` (called when Spark asks for the next end) or
`close()` (the query stops). Each heartbeat leases the batch for `lease_s` (a few
intervals, so one late or lost heartbeat lapses nothing).

A driver that dies, hangs or loses the FT layer sends no more heartbeats, and the
lease lapses by itself; the batch's trees then wait for the source's next barrier (a
restarted driver runs the batch again, and its barrier completes them), up to the
server's `--lapsed-batch-timeout-s`, and time out after it (ftlayer.core.leases). A
reader that closes its heartbeat while a batch runs (`close()`) ends the lease by a
last heartbeat of lease 0, so the trees time out within the usual bound; if that
heartbeat does not get through (or `close()` is never called: a query stopped
mid-batch by StreamingQuery.stop() was seen not to reach it), they wait as a dead
driver's do.

A heartbeat that fails is logged (once per run of failures) and the next one is
tried on a fresh connection; nothing else waits for it: heartbeats have their own
thread and their own FTClient, so they never queue behind the driver's own calls.
A heartbeat that arrives after the batch was reported done renews nothing (the FT
layer ignores heartbeats of sources with no open batch).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from ftlayer.client import FTClient
from ftlayer.errors import ConfigError, FTLayerError

__all__ = ["LEASE_INTERVALS", "Heartbeat", "heartbeat_interval_s"]

log = logging.getLogger("ftlayer.source")

LEASE_INTERVALS = 3
"""A heartbeat leases the batch for this many intervals: two heartbeats may be late or
lost before the lease lapses."""


def heartbeat_interval_s(heartbeat_ms: int, timeout_s: float) -> float:
    """How often to send heartbeats: `ft.heartbeatMs`, but at least four times per tree
    timeout T, so a lease (3 intervals) stays within 3/4 T and a driver that died
    lets its trees time out soon after the usual bound."""
    return min(heartbeat_ms / 1000, timeout_s / 4)


class Heartbeat:
    """HEARTBEAT for `source_ids` every `interval_s` while a batch runs; see the
    module docstring. `connect` makes the thread's own client."""

    def __init__(
        self,
        connect: Callable[[], FTClient],
        source_ids: Sequence[int],
        interval_s: float,
    ) -> None:
        if not interval_s > 0:
            raise ConfigError(f"a heartbeat interval is a positive number, got {interval_s!r}")
        self.source_ids = tuple(sorted(set(source_ids)))
        self.interval_s = interval_s
        self.lease_s = LEASE_INTERVALS * interval_s
        self.sent = 0
        """Heartbeats the FT layer answered."""
        self._connect = connect
        self._client: FTClient | None = None
        self._cond = threading.Condition()
        self._beating = False
        self._closed = False
        self._end_lease = False  # closed while beating: end the lease (lease 0)
        self._due = 0.0  # monotonic: the next heartbeat
        self._failing = False
        self._thread: threading.Thread | None = None

    def running(self) -> None:
        """A batch runs: heartbeat now and then every interval, until `idle`."""
        with self._cond:
            if self._closed or self._beating:
                return
            self._beating = True
            self._due = 0.0
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="ftkafka-heartbeat", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()

    def idle(self) -> None:
        """The batch is done: no more heartbeats until the next `running`."""
        with self._cond:
            self._beating = False
            self._cond.notify_all()

    def close(self) -> None:
        """Stop for good (the query stops): a batch running ends its lease (a last
        heartbeat of lease 0, sent by the thread; waited for at most a lease)."""
        with self._cond:
            self._end_lease = self._beating and not self._closed
            self._closed = True
            self._beating = False
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=self.lease_s + 1.0)
        if self._client is not None and (thread is None or not thread.is_alive()):
            self._client.close()
            self._client = None

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed:
                    wait = self._due - time.monotonic()
                    if self._beating and wait <= 0:
                        break
                    self._cond.wait(wait if self._beating else None)
                if self._closed:
                    end_lease = self._end_lease
                    break
                self._due = time.monotonic() + self.interval_s
            self._beat()
        if end_lease:
            self._beat(0.0)

    def _beat(self, lease_s: float | None = None) -> None:
        try:
            if self._client is None:
                self._client = self._connect()
            self._client.heartbeat(self.source_ids, self.lease_s if lease_s is None else lease_s)
        except (OSError, FTLayerError) as exc:  # ConnectionLost, an ERROR reply, ...
            if self._client is not None:
                self._client.close()
                self._client = None
            if not self._failing:
                log.warning(
                    "heartbeat to the FT layer failed (retried every %.1f s; while none "
                    "gets through, this batch's trees wait for its next barrier): %r",
                    self.interval_s,
                    exc,
                )
            self._failing = True
            return
        if self._failing:
            log.info("heartbeats reach the FT layer again")
        self._failing = False
        self.sent += 1
