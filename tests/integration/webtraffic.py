"""Traffic for the HTTP-port tests: two sources through a real FTClient, with trees
that complete, fail, replay, dead-letter and stay pending, and checkpoints."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from typing import Any

import numpy as np

from ftlayer.acking.ids import new_ids
from ftlayer.causes import Cause, FailKind
from ftlayer.client import FTClient
from ftlayer.records import RecordBatch
from ftlayer.registration import SourceRegistration

__all__ = ["ORDERS", "PAYMENTS", "QUERY", "drive", "get"]

ORDERS, PAYMENTS = 7, 8
QUERY = "orders-job"
_ONE_RETRY = {"max_retries": 1, "backoff_ms": 0, "backoff_max_ms": 0}


def _batch(source: int, topic: str, start: int, n: int) -> RecordBatch:
    return RecordBatch.build(
        new_ids(n),
        [b"event-%d" % i for i in range(start, start + n)],
        source_ids=source,
        topics=topic,
        partitions=np.arange(n, dtype=np.int32) % 2,
        offsets=np.arange(start, start + n),
    )


def drive(client: FTClient, rounds: int = 4, pause_s: float = 0.7, *, ramp: bool = False) -> None:
    """Per round: 200 orders (with `ramp`, 200, 400, 600, 200, ...) and 50 payments
    persisted; all but 8 orders complete, the replays of the round before fail again (a
    dead letter each: one retry), 5 orders fail and are queued for replay, 3 stay
    pending; a checkpoint of QUERY per round, the last one left open. The pauses give
    the page's chart several samples."""
    client.register_source(SourceRegistration(ORDERS, "forward", 2, retry=_ONE_RETRY))
    client.register_source(SourceRegistration(PAYMENTS, "forward", 2))
    cause = Cause(FailKind.ERROR, "enrich", "ValueError: no price for sku-17")
    replayed_to, offset = 0, 0
    for n in range(rounds):
        size = 200 * (1 + n % 3) if ramp else 200
        orders, payments = (
            _batch(ORDERS, "orders", offset, size),
            _batch(PAYMENTS, "pay", 50 * n, 50),
        )
        offset += size
        ids, pay_ids = new_ids(size), new_ids(50)
        client.persist(orders, ids)
        client.persist(payments, pay_ids)
        client.xor(orders.roots[: size - 8], ids[: size - 8])
        client.xor(payments.roots, pay_ids)
        cursor = client.status().replay_cursor_of([ORDERS])
        replays = client.fetch_replay(replayed_to, cursor, source_id=ORDERS).records
        replayed_to = cursor
        if len(replays):  # the round before's: one retry spent, failing dead-letters them
            client.fail(replays.roots, cause)
        client.fail(orders.roots[size - 8 : size - 3], cause)  # replayed; 3 stay pending
        position = {"kafka": {"orders": {"0": offset, "1": offset}}, "replay": 0}
        client.checkpoint(begin=True, query=QUERY, position=position, sources=[ORDERS])
        if n < rounds - 1:
            client.checkpoint(begin=False, query=QUERY, position=position, sources=[ORDERS])
        time.sleep(pause_s)


def get(url: str, headers: dict[str, str] | None = None, **kwargs: Any) -> tuple[int, bytes]:
    """(status, body) of a GET; an HTTP error's status and body rather than a raise."""
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30, **kwargs) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
