"""A process's batching of events: `BatchingChannel` over an FTClient, and
`shared_channel`, one per process and server, which every source, task and sink of a
Python worker shares (a task's own events wait in its XorHandler until the task ends,
then here, in an EventBuffer each)."""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Self

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ftlayer.acking.events import EventBuffer
from ftlayer.causes import Cause, Causes
from ftlayer.errors import ConfigError, StateConflict
from ftlayer.records import RecordBatch, ReplayRecords
from ftlayer.registration import SourceRegistration
from ftlayer.status import Status

from .connection import FTClient
from .errors import ConnectionLost


class BatchingChannel:
    """An FTChannel over an FTClient that batches XOR and fail events (client-side).

    - persist() is synchronous: it first flushes buffered events, then sends PERSIST
      and returns only after the server's OK, so a source never emits an unpersisted
      record.
    - xor() and fail() only buffer. The buffer is flushed (fails first, then the XOR
      events concatenated into one frame, or frames of at most `max_events` each) when
      it holds `max_events` events, when its oldest event is `max_delay_s` old (a
      daemon flusher thread, stopped by close()), or on flush(): call it at the end of
      a partition.
    - Backpressure: an event that would take the buffer past `max_buffered_events`
      makes the caller flush synchronously first; a call larger than the bound on its
      own is sent directly. The buffer never holds more than the bound.
    - Errors: an error of a background flush is kept and raised by the next call
      (persist, xor, fail, flush or close), once. Whatever fails to be sent (the
      events of the failed flush) is dropped, as FTClient drops a request whose
      connection broke: those trees time out and are replayed (a duplicate, never a
      loss).
    - Thread-safe: one lock guards the buffer and is held while flushing, so events
      leave in the order they were added and a persist never overtakes them.
    - The events wait in an EventBuffer (ftlayer.acking.events), the same one a task's
      XorHandler holds its attempt's events in until the task ends.
    """

    def __init__(
        self,
        client: FTClient,
        *,
        max_events: int = 65536,
        max_delay_s: float = 0.05,
        max_buffered_events: int = 1_000_000,
    ) -> None:
        if max_events < 1 or max_buffered_events < 1:
            raise ConfigError("max_events and max_buffered_events must be at least 1")
        if not max_delay_s > 0:
            raise ConfigError(f"max_delay_s must be positive, got {max_delay_s}")
        self.client = client
        self.max_events = max_events
        self.max_delay_s = max_delay_s
        self.max_buffered_events = max_buffered_events
        self._cond = threading.Condition(threading.Lock())
        self._buffer = EventBuffer()
        self._oldest: float | None = None  # time.monotonic() of the oldest buffered event
        self._error: BaseException | None = None
        self._closed = False
        self.max_buffered_seen = 0
        """The most events the buffer ever held (never above max_buffered_events)."""
        self.parking: Callable[[NDArray[np.uint64], Causes], None] | None = None
        """With several shards (ftlayer.client.sharded): where a FAIL goes that this
        channel's server did not take within `park_after_s` (parked on another shard).
        None: a FAIL waits for the server as every call does."""
        self.park_after_s = 2.0
        self._flusher = threading.Thread(
            target=self._flush_loop, name="ftlayer-batching-flusher", daemon=True
        )
        self._flusher.start()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def buffered(self) -> int:
        """XOR events and failed roots waiting in the buffer."""
        with self._cond:
            return len(self._buffer)

    # ---- FTChannel ---------------------------------------------------------------

    def persist(self, batch: RecordBatch, initial_values: ArrayLike | None = None) -> None:
        """Flush buffered events, then persist; returns once the server confirmed."""
        with self._cond:
            self._check()
            self._flush_locked()
            self.client.persist(batch, initial_values)

    def xor(self, roots: ArrayLike, values: ArrayLike) -> int:
        """Buffer XOR events; returns how many were buffered (not yet applied)."""
        r = np.ascontiguousarray(roots, dtype=np.uint64)
        v = np.ascontiguousarray(values, dtype=np.uint64)
        if r.shape != v.shape or r.ndim != 1:
            raise ConfigError(f"xor: {r.shape} roots but {v.shape} values")
        with self._cond:
            self._check()
            if len(r) > self.max_buffered_events:
                self._flush_locked()
                self._send_xor(r, v)
            elif len(r):
                self._make_room(len(r))
                self._buffer.add_xor(r, v)
                self._added(len(r))
        return len(r)

    def fail(self, roots: ArrayLike, causes: Causes | Cause | None = None) -> int:
        """Buffer fails of roots, with their causes (one for all, one per root, or
        unspecified); returns how many were buffered (not yet applied)."""
        r = np.ascontiguousarray(roots, dtype=np.uint64)
        if r.ndim != 1:
            raise ConfigError(f"fail: roots must be one-dimensional, got shape {r.shape}")
        if not isinstance(causes, Causes):
            causes = Causes.one(causes, len(r))
        with self._cond:
            self._check()
            if len(r) > self.max_buffered_events:
                self._flush_locked()
                self._send_fail(r, causes)
            elif len(r):
                self._make_room(len(r))
                self._buffer.add_fail(r, causes)
                self._added(len(r))
        return len(r)

    # ---- calls passed through to the client -----------------------------------------

    def fetch_replay(
        self, lo: int, hi: int, source_id: int | None = None, partition: int | None = None
    ) -> ReplayRecords:
        """`FTClient.fetch_replay` (nothing buffered is involved)."""
        return self.client.fetch_replay(lo, hi, source_id, partition)

    def register_source(self, registration: SourceRegistration) -> None:
        """`FTClient.register_source`."""
        self.client.register_source(registration)

    def read_range(self, first: int, n: int, seed: int) -> int:
        """`FTClient.read_range`, after what is buffered (an earlier read's events of
        the same records, so they cannot land after this read began)."""
        with self._cond:
            self._check()
            self._flush_locked()
            return self.client.read_range(first, n, seed)

    def hold(self, roots: ArrayLike, values: ArrayLike) -> int:
        """`FTClient.hold`, after what is buffered (so an XOR buffered before it is
        applied first)."""
        with self._cond:
            self._check()
            self._flush_locked()
            return self.client.hold(roots, values)

    def sink_hold(self, key: int, roots: ArrayLike, values: ArrayLike) -> int:
        """`FTClient.sink_hold`, after what is buffered."""
        with self._cond:
            self._check()
            self._flush_locked()
            roots = np.ascontiguousarray(roots, dtype=np.uint64)
            values = np.ascontiguousarray(values, dtype=np.uint64)
            held = 0
            for lo in range(0, len(roots), self.max_events):  # frames of max_events pairs
                hi = lo + self.max_events
                held += self.client.sink_hold(key, roots[lo:hi], values[lo:hi])
            return held

    def sink_settle(
        self, key: int, cause: Cause | None = None, *, reconnect_s: float | None = None
    ) -> int:
        """`FTClient.sink_settle`, after what is buffered (`reconnect_s`: how long the
        settle waits for a connection; None: as every call)."""
        with self._cond:
            self._check()
            self._flush_locked()
            return self.client.sink_settle(key, cause, reconnect_s=reconnect_s)

    def status(self) -> Status:
        """`FTClient.status`: flushes first, so the counters include this process's events."""
        self.flush()
        return self.client.status()

    # ---- flushing and lifecycle ----------------------------------------------------

    def flush(self) -> None:
        """Send everything buffered now (fails, then XOR events); raises a kept error."""
        with self._cond:
            self._check()
            self._flush_locked()

    def close(self) -> None:
        """Flush, stop the flusher and close the client; then raise a kept error, or
        the error of this last flush, if any."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
            kept, self._error = self._error, None
            try:
                self._flush_locked()
            except BaseException as exc:
                if kept is None:
                    raise
                kept.add_note(f"and the final flush failed too: {exc!r}")
            finally:
                self._buffer.drain()  # what the final flush could not send is dropped
                self._oldest = None
                self.client.close()
        self._flusher.join()
        if kept is not None:
            raise kept

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ---- plumbing (all under the lock) ---------------------------------------------

    def _check(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        if self._closed:
            raise StateConflict("the batching channel is closed")

    def _make_room(self, n: int) -> None:
        if len(self._buffer) + n > self.max_buffered_events:
            self._flush_locked()

    def _added(self, n: int) -> None:
        if self._oldest is None:
            self._oldest = time.monotonic()
            self._cond.notify_all()
        self.max_buffered_seen = max(self.max_buffered_seen, len(self._buffer))
        if len(self._buffer) >= self.max_events:
            self._flush_locked()

    def _flush_locked(self) -> None:
        fails, roots, values, causes = self._buffer.drain()
        self._oldest = None
        if len(fails):
            self._send_fail(fails, causes)
        if len(roots):
            self._send_xor(roots, values)

    def _send_fail(self, roots: NDArray[np.uint64], causes: Causes) -> None:
        """FAIL, or with `parking`, FAIL within `park_after_s` and else parked: a FAIL
        whose connection broke after it was sent may have been applied too, which a
        second delivery of it does no harm to (the root is no longer pending)."""
        if self.parking is None:
            self.client.fail(roots, causes)
            return
        try:
            self.client.fail(roots, causes, reconnect_s=self.park_after_s)
        except ConnectionLost:
            self.parking(roots, causes)

    def _send_xor(self, roots: NDArray[np.uint64], values: NDArray[np.uint64]) -> None:
        for lo in range(0, len(roots), self.max_events):
            hi = lo + self.max_events
            self.client.xor(roots[lo:hi], values[lo:hi])

    def _flush_loop(self) -> None:
        with self._cond:
            while not self._closed:
                if self._oldest is None:
                    self._cond.wait()
                    continue
                left = self._oldest + self.max_delay_s - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                try:
                    self._flush_locked()
                except BaseException as exc:  # kept for the next call, never swallowed
                    self._error = exc


_shared_lock = threading.Lock()
_shared: dict[tuple[str, bytes | None, str | None, float], BatchingChannel] = {}
_shared_pid = os.getpid()


def shared_channel(
    address: str,
    token: bytes | None = None,
    tls_ca: str | None = None,
    reconnect_s: float = 60.0,
) -> BatchingChannel:
    """This process's BatchingChannel to the server at `address`, made on first use.

    Spark reuses Python workers across tasks (spark.python.worker.reuse, on by default),
    so sources and tasks in one worker share one connection and one event buffer
    instead of a handshake per task. The connection itself opens lazily on the first
    call. A forked child never uses its parent's channel (the socket and the flusher
    thread belong to the parent): it makes its own. Channels are flushed and closed at
    interpreter exit; call `flush()` at the end of each partition regardless, since a
    worker may be killed without running exit handlers. `tls_ca`: connect with TLS,
    trusting the CA certificate(s) in that PEM file. `reconnect_s`: how long a refused or
    broken connection is retried with backoff (a restart of the FT layer within it is
    ridden out).
    """
    global _shared_pid
    key = (address, token, tls_ca, reconnect_s)
    with _shared_lock:
        if _shared_pid != os.getpid():
            _shared.clear()  # the parent's: never flush or close them here
            _shared_pid = os.getpid()
        channel = _shared.get(key)
        if channel is None or channel.closed:
            client = FTClient(address, token=token, tls=tls_ca or False, reconnect_s=reconnect_s)
            channel = _shared[key] = BatchingChannel(client)
        return channel


def close_shared_channels() -> None:
    """Flush and close this process's shared channels (also run at exit)."""
    with _shared_lock:
        channels = list(_shared.values()) if _shared_pid == os.getpid() else []
        _shared.clear()
    for channel in channels:
        with contextlib.suppress(Exception):  # at exit there is no one left to tell
            channel.close()


atexit.register(close_shared_channels)
