"""`ftlayer bench ingest`: records/s a JetStream receiver stores in a real FT layer,
against a bare pull consumer that only acknowledges (integration.receivers.nats)."""

from __future__ import annotations

import asyncio
import multiprocessing
import statistics
import tempfile
import time
from multiprocessing.synchronize import Barrier, Event
from pathlib import Path
from typing import Any

from ftlayer.errors import ConfigError

from .timing import _cpu_times, _join, _machine, _steal_percent

INGEST_TARGET_RATIO = 0.5
_STREAM = "BENCH"
_SUBJECT = "bench"
_POLL_S = 0.01
_DEADLINE_S = 300.0


def bench_ingest(
    messages: int = 200_000,
    payload_bytes: int = 100,
    batch: int = 1000,
    rounds: int = 1,
    directory: str | None = None,
) -> dict[str, Any]:
    """Records/s through JetStream receivers into a real FT layer, against a bare pull
    consumer; the figures are medians over `rounds`.

    A nats-server with JetStream (integration.harness.nats) holds one stream of
    `messages` messages of `payload_bytes`, published before anything is timed. Each
    run reads the whole stream through a durable pull consumer of its own (explicit
    acks, `batch` messages a fetch), in worker processes (spawn) that are timed from a
    barrier until the main process sees every message taken:

    - bare: one process fetches and acknowledges, nothing else (counted by the workers);
    - one receiver: one JetStreamReceiver stores each batch in a fresh `ftlayer serve`
      (a child process) and acknowledges it after (counted by the FT layer's `ingested`);
    - two receivers: two such processes share the consumer and the FT layer.

    `ratio` is one receiver / bare.
    """
    if messages < 1 or payload_bytes < 1 or batch < 1 or rounds < 1:
        raise ConfigError("messages, payload_bytes, batch and rounds must be at least 1")
    from ftlayer.integration.harness.nats import (
        NatsServer,
        add_stream,
        publish,
        wait_stream_messages,
    )

    steal_from = _cpu_times()
    runs: dict[str, list[float]] = {"bare": [], "one": [], "two": []}
    with (
        tempfile.TemporaryDirectory(prefix="ftlayer-bench-ingest-", dir=directory) as tmp,
        NatsServer(Path(tmp) / "jetstream") as nats,
    ):
        asyncio.run(add_stream(nats.url, _STREAM, [_SUBJECT]))
        payload = b"x" * payload_bytes
        asyncio.run(publish(nats.url, _SUBJECT, (payload for _ in range(messages))))
        asyncio.run(wait_stream_messages(nats.url, _STREAM, messages, timeout=120))
        for r in range(rounds):
            runs["bare"].append(_run(nats.url, f"bare-{r}", 0, messages, batch, tmp))
            runs["one"].append(_run(nats.url, f"one-{r}", 1, messages, batch, tmp))
            runs["two"].append(_run(nats.url, f"two-{r}", 2, messages, batch, tmp))
    bare, one, two = (messages / statistics.median(runs[k]) for k in ("bare", "one", "two"))
    ratio = one / bare
    return {
        "bench": "ingest",
        "messages": messages,
        "payload_bytes": payload_bytes,
        "batch": batch,
        "rounds": rounds,
        "bare_per_s": round(bare),
        "one_receiver_per_s": round(one),
        "two_receivers_per_s": round(two),
        "ratio": round(ratio, 3),
        "two_receivers_ratio": round(two / bare, 3),
        "target_ratio": INGEST_TARGET_RATIO,
        "meets_target": ratio >= INGEST_TARGET_RATIO,
        "cpu_steal_percent": _steal_percent(steal_from),
        "machine": _machine(),
    }


def _run(url: str, durable: str, receivers: int, messages: int, batch: int, tmp: str) -> float:
    """Seconds for `receivers` receiver processes (0: one bare consumer) to take the
    whole stream through a new consumer `durable`."""
    from ftlayer.integration.harness.ftprocess import FTServerProcess

    asyncio.run(_add_consumer(url, durable, batch))
    if receivers == 0:
        return _timed_workers(url, durable, None, 1, messages, batch)
    with FTServerProcess(Path(tmp) / f"ft-{durable}") as ft:
        return _timed_workers(url, durable, ft.address, receivers, messages, batch)


async def _add_consumer(url: str, durable: str, batch: int) -> None:
    import nats
    from nats.js.api import AckPolicy, ConsumerConfig

    nc = await nats.connect(url)
    try:
        await nc.jetstream().add_consumer(
            _STREAM,
            ConsumerConfig(
                durable_name=durable,
                ack_policy=AckPolicy.EXPLICIT,
                ack_wait=30.0,
                max_ack_pending=8 * batch,
            ),
        )
    finally:
        await nc.close()


def _timed_workers(
    url: str, durable: str, ft: str | None, workers: int, messages: int, batch: int
) -> float:
    ctx = multiprocessing.get_context("spawn")
    ready, stop = ctx.Barrier(workers + 1), ctx.Event()
    taken = ctx.Value("q", 0)
    procs = [
        ctx.Process(target=_worker, args=(url, durable, ft, batch, messages, ready, stop, taken))
        for _ in range(workers)
    ]
    for proc in procs:
        proc.start()
    try:
        ready.wait(60)
        start = time.perf_counter()
        deadline = time.monotonic() + _DEADLINE_S
        while _taken(ft, taken) < messages:
            if time.monotonic() > deadline or not any(p.is_alive() for p in procs):
                raise ConfigError(f"bench ingest: {_taken(ft, taken)} of {messages} taken")
            time.sleep(_POLL_S)
        return time.perf_counter() - start
    finally:
        stop.set()
        _join(procs)


def _taken(ft: str | None, taken: Any) -> int:
    if ft is None:
        return int(taken.value)
    from ftlayer.client import FTClient

    with FTClient(ft, name="bench-status") as client:
        return client.status().ingested


def _worker(*args: Any) -> None:  # pragma: no cover - runs in a worker process
    asyncio.run(_consume(*args))


async def _consume(
    url: str,
    durable: str,
    ft: str | None,
    batch: int,
    messages: int,
    ready: Barrier,
    stop: Event,
    taken: Any,
) -> None:  # pragma: no cover - runs in a worker process

    from ftlayer.integration.receivers import Receiver
    from ftlayer.integration.receivers.nats import JetStreamReceiver, connect_nats

    stopping = asyncio.Event()

    async def watch() -> None:
        while not stop.is_set():
            await asyncio.sleep(_POLL_S)
        stopping.set()

    def go() -> None:
        ready.wait(60)

    watcher = asyncio.create_task(watch())
    if ft is not None:
        with Receiver(ft, "bench", partitions=4, max_pending=2 * messages) as receiver:
            consumer = JetStreamReceiver(receiver, url, _STREAM, durable=durable, batch=batch)
            await consumer.run(stopping, ready=go)
        return
    nc = await connect_nats(url)
    sub = await nc.jetstream().pull_subscribe_bind(durable=durable, stream=_STREAM)
    go()
    while not stopping.is_set():
        try:
            msgs = await sub.fetch(batch, timeout=1.0)
        except TimeoutError:  # nats-py raises both kinds
            continue
        for msg in msgs:
            await msg.ack()
        with taken.get_lock():
            taken.value += len(msgs)
    watcher.cancel()
    await nc.close()
