"""The FT-layer server's worker threads, items 5, 6 and 7 of ftlayer.server's
contract: the ticker (FTLayer.tick when a rotation or a backoff's end is due,
checkpoints polled while one aligns, staged checkpoint records flushed on an idle
store; asleep in between, `_tick_loop`), the
deleter (completed records deleted outside the lock, in transactions of bounded work,
`_delete_slices`, each after the requests under way) and the checkpoint writer
(a due journal base and the checkpoint records written outside the lock).
"""

from __future__ import annotations

import logging
import time
from typing import Final

import numpy as np
from numpy.typing import NDArray

from ftlayer.checkpoint.fetch import expire_spooled
from ftlayer.core import FTLayer
from ftlayer.errors import StorageError
from ftlayer.logs import fields
from ftlayer.persistence.lmdb_layout import sorted_distinct

from .state import _DELETE_CHUNK, _IDLE_WAIT_S, _POLL_S, _STAGED_MAX_WAIT_S, ServerState

log = logging.getLogger("ftlayer.server")

_SPOOL_CHECK_S: Final = 30.0  # the spool is checked for idle parts this often (at most)
# The ticker wakes this long after the work it sleeps until is due, so that the tick
# finds it due (a rotation is due at its time by the same clock, not before).
_TICK_SLACK_S: Final = 0.001
# Ticks are at least this far apart, whatever is due: what one tick left due waits for
# the next (a bound on the ticker's CPU, not a schedule).
_MIN_TICK_GAP_S: Final = 0.01
# A record whose seq follows the one deleted before it in the same transaction weighs
# this fraction of one that starts a run: a run of records lies in one chunk, or drops
# whole chunks, which LMDB does for far less than a chunk state rewritten per record.
_RUN_WEIGHT: Final = 8
# Each delete transaction waits for the requests under way (_after_requests), at most
# this long.
_REQUESTS_FIRST_MAX_WAIT_S: Final = 1.0
_EMPTY_SEQS: Final = np.zeros(0, dtype=np.uint64)


class Workers(ServerState):
    """The ticker, deleter and checkpoint-writer threads' loops (started by FTServer)."""

    def _tick_loop(self) -> None:
        """Item 5 of ftlayer.server's contract: tick when the core, an aligning
        checkpoint or a staged write has work (`_tick_delay`), and look for idle spooled
        savepoint parts now and then; sleep in between (a request that brings work
        sooner wakes it, `_wake_workers`). A tick that fails is tried again after
        `_interval_s`, not at once."""
        spool_checked = time.monotonic()
        spool_every = min(_SPOOL_CHECK_S, self.spool_idle_s / 4)
        not_before = 0.0  # no tick before this (_MIN_TICK_GAP_S; after a failure, longer)
        while True:
            with self._lock:
                ft = self._ft
                if ft is None:
                    return
                self._tick_due.clear()
                if self._stopping.is_set():
                    # stop() sets _stopping before it wakes the ticker: a wake-up the
                    # clear above took would leave it asleep for its whole wait.
                    return
                now = time.monotonic()
                wait = min(
                    max(self._tick_delay(ft) + _TICK_SLACK_S, not_before - now, 0.0),
                    spool_checked + spool_every - now,
                )
                self._ticker_wakes_at = now + wait
            if self._tick_due.wait(max(wait, 0.0)) and not self._stopping.is_set():
                continue  # a request brought work sooner: sleep again until it
            if self._stopping.is_set():
                return
            if time.monotonic() - spool_checked >= spool_every:
                spool_checked = time.monotonic()
                try:  # a savepoint part whose fetch was given up (ftlayer.checkpoint.fetch)
                    expire_spooled(self.data_dir, self.spool_idle_s, time.time())
                except OSError as exc:
                    log.error("could not delete an idle savepoint part from the spool: %s", exc)
            with self._lock:
                ft = self._ft
                if ft is None:
                    return
                try:  # the core logs the trees that time out, by source and partition
                    ft.tick()
                    if self._checkpoints is not None:
                        self._checkpoints.poll()
                except Exception:
                    log.exception("tick failed; the roots stay pending and are retried")
                    not_before = time.monotonic() + self._interval_s
                    continue
                finally:
                    self._wake_workers(ft)
                    not_before = max(not_before, time.monotonic() + _MIN_TICK_GAP_S)
            try:  # checkpoint records staged and no write since (ftlayer.checkpoint)
                ft.flush_staged(older_than_s=_STAGED_MAX_WAIT_S)
            except StorageError as exc:
                log.error("could not write staged checkpoint records: %s", exc)
                not_before = time.monotonic() + self._interval_s

    def _delete_loop(self) -> None:
        """Step 6 of the module docstring: take the completed records' seqs from the
        core (under the lock) as soon as a request left _DELETE_CHUNK of them, or
        `delete_interval_s` after the first, and delete them outside the lock, in
        transactions of their own of bounded work (`_delete_slices`), each after the
        requests under way. With none, it sleeps until a change marks some
        (`_wake_workers`). Seqs whose delete failed go back to the core, tried again
        after `delete_interval_s`."""
        idle = False
        while not self._stopping.is_set():
            if idle:  # the first completed records wake it; then it gathers more
                self._deletes_due.wait(_IDLE_WAIT_S)
                self._deletes_due.clear()
                idle = False
            self._deletes_due.wait(self._delete_interval_s)
            self._deletes_due.clear()
            if self._stopping.is_set():
                return  # stop() deletes what is left, under the lock
            with self._lock:
                ft = self._ft
                if ft is None:
                    return
                seqs = ft.take_deletes()
                if not len(seqs):
                    self._deleter_idle = idle = True
                    continue
                with self._deletes_changed:
                    self._deleting = len(seqs)
                    self._delete_rounds += 1
                    round_ = self._delete_rounds
            left = seqs
            try:
                left = self._delete_chunks(ft, sorted_distinct(seqs))
            except Exception:  # a bug: the thread goes on (deleting twice does no harm)
                log.exception("deleting completed records failed; they are tried again")
            finally:
                if len(left):
                    with self._lock:
                        if self._ft is not None:
                            self._ft.retry_deletes(left)
                with self._deletes_changed:
                    self._deleting = 0
                    self._deletes_done = round_
                    self._deletes_changed.notify_all()
            if len(left):
                self._stopping.wait(self._delete_interval_s)

    def _after_requests(self, timeout_s: float) -> None:
        """Until the requests under way now have ended (at most `timeout_s`): the
        deleter goes after them, and still gets its turn between them."""
        with self._requests_changed:
            begun = self._requests_begun
            self._requests_changed.wait_for(lambda: self._requests_ended >= begun, timeout_s)

    def _delete_chunks(self, ft: FTLayer, seqs: NDArray[np.uint64]) -> NDArray[np.uint64]:
        """Delete `seqs` (sorted) a slice per transaction; returns those not deleted."""
        for lo, hi in _delete_slices(seqs):
            self._after_requests(_REQUESTS_FIRST_MAX_WAIT_S)
            try:
                ft.delete_stored(seqs[lo:hi])
            except StorageError as exc:
                log.error(
                    "could not delete completed records; they stay stored and are tried "
                    "again (a restart before that replays them: duplicates, not losses): %s",
                    exc,
                    extra=fields(count=len(seqs) - lo),
                )
                return seqs[lo:]
            with self._deletes_changed:
                self._deleting = len(seqs) - hi
        return _EMPTY_SEQS

    def _checkpoint_write_loop(self) -> None:
        """Write a due journal base and the checkpoint records, outside the core lock: woken
        after a CHECKPOINT_BEGIN's reply; the records of checkpoints completed since
        go with that write, or, on an idle stream, within _POLL_S. With nothing to
        write, it sleeps until a change gives it something (`_wake_workers`)."""
        while not self._stopping.is_set():
            with self._lock:
                checkpoints = self._checkpoints
                if checkpoints is None:
                    return
                self._writer_idle = idle = not checkpoints.has_writes
            if idle:
                self._checkpoint_writes_due.wait(_IDLE_WAIT_S)
                self._checkpoint_writes_due.clear()
                continue
            woken = self._checkpoints_queued.wait(_POLL_S)
            self._checkpoints_queued.clear()
            checkpoints = self._checkpoints
            if checkpoints is None:
                return
            if not woken and not checkpoints.has_writes:
                continue
            if checkpoints.write_pending():
                with self._lock:  # a checkpoint completed by its commit before the write
                    if self._checkpoints is not None and self._ft is not None:
                        self._checkpoints.poll()
                        self._wake_workers(self._ft)  # its record staged: the ticker commits it


def _delete_slices(seqs: NDArray[np.uint64], limit: int = _DELETE_CHUNK) -> list[tuple[int, int]]:
    """[lo, hi) slices of `seqs` (sorted, distinct), one per delete transaction, each of
    at most `limit` in work: a record that starts a run of consecutive seqs
    weighs 1, one that goes on a run 1/_RUN_WEIGHT. Scattered completions (a record here
    and there in each chunk, each rewriting a chunk's state) go _DELETE_CHUNK at a
    time, as before; a barrier's micro-batch, one run of seqs over whole chunks that
    LMDB drops, goes in _RUN_WEIGHT times fewer transactions, each with its commit and
    fsync. Every slice holds at least one record."""
    n = len(seqs)
    if n == 0:
        return []
    starts = np.ones(n, dtype=np.int64)
    starts[1:] = np.diff(seqs) != 1
    work = np.cumsum(starts * (_RUN_WEIGHT - 1) + 1)  # in 1/_RUN_WEIGHT units
    slices: list[tuple[int, int]] = []
    lo, done = 0, 0
    while lo < n:  # each slice as long as the limit allows
        hi = max(lo + 1, int(np.searchsorted(work, done + limit * _RUN_WEIGHT, side="right")))
        slices.append((lo, hi))
        lo, done = hi, int(work[hi - 1])
    return slices
