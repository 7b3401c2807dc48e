"""The FT-layer server as a process: `FTServer`, which opens the storage (recovering
what it holds), binds, starts the accepting, ticker, deleter and checkpoint-writer
threads and the HTTP port, and stops them all (ftlayer.server is the contract); and the
data dir's serve lock, which keeps a second server off a data dir in use.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import socket
import time
from types import TracebackType
from typing import TYPE_CHECKING, Final, Self

from ftlayer.checkpoint import CHECKPOINT_STORE_DIR, CheckpointCoordinator
from ftlayer.core import FTLayer
from ftlayer.core.journal import JOURNAL_DIR, Journal
from ftlayer.core.parked import ParkedFailures
from ftlayer.errors import StateConflict, StorageError
from ftlayer.logs import fields
from ftlayer.persistence.lmdb_storage import LmdbStorage
from ftlayer.shards import claim
from ftlayer.threadnames import named_thread

from .handlers import RequestHandlers
from .transport import Transport, _listen, _shutdown
from .workers import Workers

if TYPE_CHECKING:  # the HTTP port's modules load only with an HTTP port
    from ftlayer.web import WebServer

log = logging.getLogger("ftlayer.server")


class FTServer(Transport, RequestHandlers, Workers):
    """Hosts one FTLayer over LmdbStorage(data_dir); see ftlayer.server's docstring."""

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) actually bound; the port is known once start() returned."""
        if self._listener is None:
            raise StateConflict("the server is not started")
        host, port = self._listener.getsockname()[:2]
        return str(host), int(port)

    @property
    def serves_tls(self) -> bool:
        """Whether clients must speak TLS (the server has a certificate and key)."""
        return self._tls is not None

    def start(self) -> Self:
        """Open the storage (recovering what it holds), bind, and start serving."""
        if self._listener is not None:
            raise StateConflict("the server is already started")
        storage = LmdbStorage(self.data_dir)
        record_store: LmdbStorage | None = None
        try:
            # One server per data dir: a second one would recover (and replay) what
            # the first one's jobs are processing. Taken before recovery writes.
            self._serve_lock = _lock_data_dir(self.data_dir)
            self.store_id = claim(storage, self.shard, self.data_dir)
            if not self.journal:  # an old journal would not know what happens from now on
                shutil.rmtree(os.path.join(self.data_dir, JOURNAL_DIR), ignore_errors=True)
            self._ft = FTLayer(
                storage,
                timeout_s=self.timeout_s,
                buckets=self.buckets,
                lapsed_batch_timeout_s=self.lapsed_batch_timeout_s,
                defer_deletes=True,
                journal=Journal(os.path.join(self.data_dir, JOURNAL_DIR)) if self.journal else None,
                journal_base_bytes=self.journal_base_bytes,
                shard=self.shard,
            )
            # Checkpoint records: an LMDB environment of their own, without fsync (a
            # record lost to an OS crash loses no source record; see ftlayer.checkpoint).
            record_store = LmdbStorage(
                os.path.join(self.data_dir, CHECKPOINT_STORE_DIR), sync=False
            )
            self._checkpoints = CheckpointCoordinator(
                self._ft, record_store=record_store, lock=self._lock
            )
            self._listener = _listen(self.host, self.port)
            if self.http_port is not None:
                self._web = self._web_server(self.http_port)
        except BaseException:
            if self._listener is not None:
                self._listener.close()
                self._listener = None
            self._ft = self._checkpoints = None
            self._release_serve_lock()
            storage.close()
            if record_store is not None:
                record_store.close()
            raise
        self._storage = storage
        self._parked = ParkedFailures(storage)
        self._started_at = time.monotonic()
        stats = self._ft.current_stats()
        log.info(
            "serving %s on %s:%d%s%s (recovered %d pending records for replay; from the "
            "journal: %d restored pending, %d complete)",
            self.data_dir,
            *self.address,
            " with TLS" if self.serves_tls else "",
            f" as {self.shard}, store {self.store_id}" if self.shard.count > 1 else "",
            stats.failed["recovery"],
            stats.recovered_pending,
            stats.recovered_completed,
        )
        for target, name in (
            (self._accept_loop, "accept"),
            (self._tick_loop, "ticker"),
            (self._delete_loop, "deleter"),
            (self._checkpoint_write_loop, "ckpt-writer"),
        ):
            thread = named_thread(target, name)
            thread.start()
            self._threads.append(thread)
        if self._web is not None:
            self._web.start()
            log.info("HTTP on %s (/metrics, the status page at /)", self._web.url)
        return self

    def _web_server(self, port: int) -> WebServer:
        from ftlayer.web import WebServer

        return WebServer(
            self.http_host,
            port,
            observe=self.observe,
            dead_letters=self.dead_letter_rows,
            token=None if self._http_public else self._token,
            tls=self._tls,
        )

    @property
    def http_url(self) -> str | None:
        """The status page's URL (its port known once start() returned); None without
        an HTTP port."""
        return None if self._web is None else self._web.url

    def stop(self) -> None:
        """Close every socket, stop the ticker and close the storage. Idempotent."""
        if self._stopping.is_set() or self._listener is None:
            return
        self._stopping.set()
        log.info("stopping")
        # The deleter, the checkpoint writer and the ticker stop waiting.
        self._deletes_due.set()
        self._tick_due.set()
        self._checkpoint_writes_due.set()
        if self._web is not None:
            self._web.stop()
        with contextlib.suppress(OSError):  # ends the accept loop's accept() at once
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._connections_lock:
            connections = list(self._connections.values())
        for conn in connections:
            _shutdown(conn.sock)
        for thread in list(self._threads):
            thread.join(timeout=5.0)
        with self._lock:
            if self._ft is not None:
                marked = self._ft.persistence.marked
                try:
                    self._ft.flush_deletes()
                except StorageError as exc:
                    log.error(
                        "could not delete completed records (replayed at restart): %s",
                        exc,
                        extra=fields(count=marked),
                    )
            if self._checkpoints is not None:
                self._checkpoints.write_pending()
                self._checkpoints.record_store.close()
            if self._storage is not None:
                self._storage.close()
            if self._ft is not None and self._ft.journal is not None:
                self._ft.journal.close()
            self._ft = self._checkpoints = None
            self._release_serve_lock()
        log.info("stopped")

    def _release_serve_lock(self) -> None:
        fd, self._serve_lock = self._serve_lock, None
        if fd is not None:
            os.close(fd)  # releases the flock

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


SERVE_LOCK_FILE: Final = "serve.lock"
"""In the data dir: held (flock) by the `ftlayer serve` that serves it, with its pid."""


def _lock_data_dir(data_dir: str | os.PathLike[str]) -> int:
    """Take the data dir's serve lock (an flock, which conflicts with another open of
    the file also within one process) and write this pid into it; the descriptor
    holds the lock until closed. StateConflict naming the holder if another server has
    it."""
    path = os.path.join(os.fspath(data_dir), SERVE_LOCK_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise StateConflict(
            f"the data dir {os.fspath(data_dir)} is served by another `ftlayer serve` "
            f"(pid {holder}); one server per data dir: stop it first, or give this one "
            "a data dir of its own"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
