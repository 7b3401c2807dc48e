"""The driver's copying of failed records' bytes into the FT layer, behind its triggers.

With `ft.persist=reference` the FT layer keeps where a record is, not its bytes, and a
record that fails is *unfilled* until its source copies its bytes in
(ftlayer.core.fills): its retries, its dead letter and `ftlayer inspect` then never
depend on the topic's retention. The ftkafka driver does the copying: UNFILLED lists a
source's unfilled records on a shard, `refetch.read_at` reads them from Kafka, and FILL
hands their bytes and key hashes over (a record Kafka no longer has becomes a
`source-expired` dead letter there).

Reading them is slow next to anything else a trigger does: nearby failed offsets are
read as whole ranges, 20 to 250 ms for the hundred failures of a 10,000-record batch.
So a trigger whose brief STATUS shows a shard holding unfilled records of the query's
sources hands them to `Filler.request`, and the filler's thread copies them in while
the batch the trigger planned runs, with its own client per shard and its own
consumer; the trigger waits for none of it. A record copied in is queued once its
backoff ends (the fill queues one whose backoff already ended), and a batch-range row,
whose key (its replay partition) the FT layer learns from the fill, waits for it: with
`ft.retryBackoffMs=0` such a row is replayed a trigger after the one that saw it
failed, and with the default backoff (500 ms) it would have waited for that trigger
anyway.

A read or a request that fails is logged; the records stay unfilled, and the next
trigger's STATUS asks for them again. `fill` does the same work in the caller's thread
(`SourceDriver.fill_failed`); the two never run at once (one consumer, one lock).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Final, TypeVar

import numpy as np
from kafka.errors import KafkaError
from numpy.typing import NDArray

from ftlayer.client import FTClient
from ftlayer.errors import FTLayerError, SourceError
from ftlayer.wire import UnfilledList

from .cluster import ShardClients
from .kafkaread import close_consumer
from .options import SourceOptions
from .refetch import read_at, refetch_consumer

__all__ = ["FILL_CHUNK", "Filler"]

log = logging.getLogger("ftlayer.source")

T = TypeVar("T")
Call = Callable[[str, Callable[[FTClient], T]], T]
"""A request to one shard: what it does (for errors), and the call on its client."""

FILL_CHUNK: Final = 10_000  # unfilled records per UNFILLED request and Kafka read
_CLOSE_WAIT_S: Final = 5.0  # how long `close` waits for a copy under way


class Filler:
    """Copies the bytes of the failed records of the query's sources from Kafka into
    the FT layer: in its own thread for the shards `request` names, or in the
    caller's (`fill`). See the module docstring."""

    def __init__(self, options: SourceOptions, shards: ShardClients) -> None:
        self._options = options
        self._shards = shards
        self._work = threading.Lock()  # one copy at a time: the consumer is not shared
        self._consumer: Any = None  # refetch_consumer, kept from copy to copy
        self._state = threading.Condition()
        self._wanted: dict[int, set[int]] = {}  # shard -> source ids, for the thread
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._clients: dict[int, FTClient] = {}  # the thread's own, per shard

    def request(self, shard: int, source_ids: Sequence[int]) -> None:
        """Copy these sources' failed records on `shard` in, in the filler's thread;
        returns at once (a request already waiting takes these sources in)."""
        with self._state:
            if self._closed:
                return
            self._wanted.setdefault(shard, set()).update(source_ids)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="ftkafka-filler", daemon=True
                )
                self._thread.start()
            self._state.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every request was worked off; False if `timeout_s` passed first."""
        with self._state:
            return self._state.wait_for(lambda: not self._wanted and not self._busy, timeout_s)

    def fill(self, source_ids: Sequence[int], shard: int) -> int:
        """Copy these sources' failed records on `shard` in, in this thread, over the
        driver's own client of the shard. Returns how many were copied."""
        return self._fill(source_ids, partial(self._shards.call, shard))

    def close(self) -> None:
        """Stop the thread (waiting a little for a copy under way; what it has not
        copied stays unfilled for the next query) and close its clients and consumer."""
        with self._state:
            self._closed = True
            self._state.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(_CLOSE_WAIT_S)
        if thread is None or not thread.is_alive():
            self._release()  # else the thread does, when its copy ends

    def _release(self) -> None:
        with self._work:
            for shard in list(self._clients):
                self._drop_client(shard)
            self._drop_consumer()

    # ---- the thread ----

    def _run(self) -> None:
        while True:
            with self._state:
                self._state.wait_for(lambda: bool(self._wanted) or self._closed)
                if self._closed:
                    self._wanted.clear()
                    self._state.notify_all()
                    break
                shard, sources = self._wanted.popitem()
                self._busy = True
            try:
                self._fill(sorted(sources), partial(self._own_call, shard))
            except (FTLayerError, OSError) as exc:
                self._drop_client(shard)
                log.warning(
                    "could not copy failed records into %s (asked again at the next "
                    "trigger): %r",
                    self._shards.where(shard), exc,
                )  # fmt: skip
            except Exception:
                log.exception("copying failed records into the FT layer failed")
            finally:
                with self._state:
                    self._busy = False
                    self._state.notify_all()
        self._release()

    def _own_call(self, shard: int, what: str, request: Callable[[FTClient], T]) -> T:
        """A request over the thread's own client of `shard`: one connection attempt
        (the next trigger asks again), never the driver's client, which its thread
        uses meanwhile."""
        client = self._clients.get(shard)
        if client is None:
            client = self._clients[shard] = self._shards.connect(
                shard, name="ftkafka-filler", request_timeout=30.0, reconnect_s=0.0
            )
        return request(client)

    def _drop_client(self, shard: int) -> None:
        client = self._clients.pop(shard, None)
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()

    # ---- the copying ----

    def _fill(self, source_ids: Sequence[int], call: Call[Any]) -> int:
        copied = 0
        with self._work:
            for source_id in source_ids:
                while True:
                    listed: UnfilledList = call(
                        "list the failed records to copy", partial(_unfilled, source_id)
                    )
                    if not len(listed):
                        break
                    try:
                        found, payloads, keys = read_at(
                            self._options, listed.records, self._kept_consumer()
                        )
                    except (SourceError, KafkaError, OSError) as exc:
                        self._drop_consumer()  # the next copy reads with a new one
                        log.warning(
                            "could not read %d failed records of source %d from Kafka to "
                            "copy them into the FT layer (tried again at the next "
                            "trigger): %r",
                            len(listed), source_id, exc,
                        )  # fmt: skip
                        return copied
                    call(
                        "copy failed records into the FT layer",
                        partial(_fill, listed.seqs, found, payloads, keys),
                    )
                    copied += int(found.sum())
                    if not found.all():
                        gone = listed.records.take(np.flatnonzero(~found))
                        log.warning(
                            "%d failed records of source %d are no longer in Kafka "
                            "(retention, compaction or a deleted topic): dead letters with "
                            "the cause source-expired; the first is %s-%d at offset %d",
                            len(gone), source_id, gone.topics[0], int(gone.partitions[0]),
                            int(gone.offsets[0]),
                        )  # fmt: skip
                    if len(listed) < FILL_CHUNK:
                        break
        return copied

    def _kept_consumer(self) -> Any:
        """The consumer copies read with, kept from copy to copy
        (refetch.refetch_consumer)."""
        if self._consumer is None:
            self._consumer = refetch_consumer(self._options)
        return self._consumer

    def _drop_consumer(self) -> None:
        consumer, self._consumer = self._consumer, None
        close_consumer(consumer)


def _unfilled(source_id: int, client: FTClient) -> UnfilledList:
    return client.unfilled(source_id, FILL_CHUNK)


def _fill(
    seqs: NDArray[np.uint64],
    found: NDArray[np.bool_],
    payloads: list[bytes],
    keys: tuple[NDArray[np.int64], NDArray[np.bool_]],
    client: FTClient,
) -> int:
    return client.fill(seqs, found, payloads, keys)
