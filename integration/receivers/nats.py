"""NATS receivers: a JetStream stream (`ftlayer ingest jetstream`) and core NATS
subjects (`ftlayer ingest nats`) stored in the FT layer (integration.receivers).

JetStream (`JetStreamReceiver`): a durable pull consumer on a stream, acknowledging
explicitly. Its loop, in asyncio:

1. If the source has room (`Receiver.has_room`: its pending records plus the batch
   being stored below `max_pending`), fetch up to `batch` messages; without room fetch
   nothing: the stream keeps them.
2. Store them (`Receiver.store`, in a thread of its own), each with the upstream name
   ``jetstream:<stream>`` and its stream sequence as its identity; meanwhile step 1
   fetches the next batch.
3. Only once the store returned, acknowledge each message. A store that fails (the
   FT layer unreachable for the client's reconnect window, its disk refusing the
   write) acknowledges none of them: they are logged, negatively acknowledged with a
   delay of `_RETRY_S`, so the stream delivers them again, and the loop goes on.

A receiver that dies between step 1 and step 3 leaves its messages unacknowledged: the
stream delivers them again after the consumer's `ack_wait` to whichever receiver of the
consumer fetches next, and the FT layer drops the copies it stored already (identity
within the ingest window, 1 h by default). So nothing the stream took is lost, and no
record is stored twice, as long as a redelivery comes within the window. Several
receivers (processes) may share one durable consumer: each message goes to one.

Core NATS (`NatsReceiver`): a subscription (in a queue group when given) on a subject.
Core NATS keeps nothing and takes no acknowledgement, so this receiver is the
durability point. Messages are buffered and stored when `flush_messages` are buffered
or `flush_ms` passed since the last store, whichever first; a store runs in a thread
of its own while the subscription keeps reading. A receiver that crashes (SIGKILL,
power loss) loses what it received and did not store yet: the buffer (up to
`flush_messages` messages or `flush_ms` of traffic, plus what arrived during the store
that was running), the messages in the client's pending queue and those in its
socket; and every message published while no receiver is subscribed. A store that
fails keeps its messages at the head of the buffer and is tried again after
`_RETRY_S` (the buffer grows meanwhile: core NATS cannot send them again). A clean stop
(`stop` set: SIGTERM, SIGINT) drains the subscription and stores everything first.
Records carry no identity (core NATS never sends one twice).

Both: a record's key is the value of the header `key_header` when the message has it,
else its subject; its value is the message's data; its headers are the message's NATS
headers; its timestamp is the stream's (JetStream) or the time it was received (core).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from ftlayer.errors import ConfigError, FTLayerError

from . import Message, Receiver

__all__ = [
    "DEFAULT_ACK_WAIT_S",
    "DEFAULT_BATCH",
    "DEFAULT_FLUSH_MESSAGES",
    "DEFAULT_FLUSH_MS",
    "JetStreamReceiver",
    "NatsReceiver",
    "NatsUnreachable",
    "connect_nats",
]

log = logging.getLogger("ftlayer.ingest.nats")

DEFAULT_BATCH: Final = 1000
DEFAULT_ACK_WAIT_S: Final = 30.0
DEFAULT_FLUSH_MESSAGES: Final = 1000
DEFAULT_FLUSH_MS: Final = 50
CONNECT_TIMEOUT_S: Final = 5.0
_FETCH_WAIT_S: Final = 1.0  # a fetch on an empty stream returns after this (stop checks)
_NO_ROOM_WAIT_S: Final = 0.1
_MAX_ACK_PENDING_BATCHES: Final = 8  # a new consumer's max_ack_pending, in batches
_STORE_MAX: Final = 10_000  # messages per store of the core receiver
_RETRY_S: Final = 1.0  # after a store that failed: its messages come again this much later


class NatsUnreachable(FTLayerError):
    """The NATS server cannot be reached (or refused the connection)."""


async def connect_nats(
    url: str, *, token: str | None = None, tls_ca: str | None = None, name: str = "ftlayer"
) -> NatsClient:
    """A connection to the NATS server at `url`; NatsUnreachable, naming it, when it does
    not answer within CONNECT_TIMEOUT_S. Once connected, it reconnects on its own
    (nats-py's defaults: 60 attempts, 2 s apart, then the receiver fails)."""
    tls = None if tls_ca is None else ssl.create_default_context(cafile=tls_ca)
    kwargs: dict[str, Any] = {"token": token} if token else {}
    try:
        return await asyncio.wait_for(
            nats.connect(url, name=name, tls=tls, error_cb=_log_error, **kwargs),
            CONNECT_TIMEOUT_S,
        )
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        raise NatsUnreachable(
            f"cannot connect to the NATS server at {url} within {CONNECT_TIMEOUT_S:g} s: "
            f"{exc or type(exc).__name__}"
        ) from None


async def _log_error(exc: Exception) -> None:
    log.warning("NATS: %r", exc)


def _message(msg: Msg, key_header: str | None, timestamp_ms: int, identity: int) -> Message:
    headers = msg.headers
    key = headers.get(key_header) if headers and key_header else None
    return Message(
        (key if key is not None else msg.subject).encode(),
        msg.data,
        timestamp_ms,
        identity,
        [(k, v.encode()) for k, v in headers.items()] if headers else [],
    )


def _stream_position(msg: Msg) -> tuple[int, int]:
    """(stream sequence, stream timestamp in epoch ms) from a JetStream message's reply
    subject ($JS.ACK.[domain.account.]stream.consumer.delivered.sseq.cseq.ns.pending...)."""
    tokens = msg.reply.split(".")
    at = 5 if len(tokens) == 9 else 7  # the v1 layout, or the v2 one (domain, account)
    return int(tokens[at]), int(tokens[at + 2]) // 1_000_000


class _Store:
    """`Receiver.store` and `has_room` in a thread of their own, so the asyncio loop
    keeps reading NATS while the FT layer stores (one call at a time)."""

    def __init__(self, receiver: Receiver) -> None:
        self.receiver = receiver
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="ftlayer-ingest-store")

    async def store(self, messages: Sequence[Message], upstream: str) -> int:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, self.receiver.store, messages, upstream)

    async def has_room(self, taken: int = 0) -> bool:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, self.receiver.has_room, taken)

    def close(self) -> None:
        self._thread.shutdown(wait=True)


class JetStreamReceiver:
    """Stores a JetStream stream's messages through `receiver` (module docstring).

    `durable` names the pull consumer (shared by every receiver given the same name);
    when it does not exist it is created, on `subject` (None: the whole stream), with
    explicit acks and `ack_wait_s`; an existing one is used as it is. `stored`,
    `duplicates` and `acked` count what this receiver did.
    """

    def __init__(
        self,
        receiver: Receiver,
        url: str,
        stream: str,
        *,
        subject: str | None = None,
        durable: str = "ftlayer",
        batch: int = DEFAULT_BATCH,
        ack_wait_s: float = DEFAULT_ACK_WAIT_S,
        key_header: str | None = None,
        token: str | None = None,
        tls_ca: str | None = None,
    ) -> None:
        if not stream or not durable:
            raise ConfigError("a JetStream receiver needs a stream and a durable consumer name")
        if batch < 1:
            raise ConfigError(f"batch must be at least 1, got {batch}")
        if ack_wait_s <= 0:
            raise ConfigError(f"ack_wait_s must be positive, got {ack_wait_s}")
        self.receiver, self.url, self.stream = receiver, url, stream
        self.subject, self.durable, self.batch = subject, durable, batch
        self.ack_wait_s, self.key_header = ack_wait_s, key_header
        self.token, self.tls_ca = token, tls_ca
        self.upstream = f"jetstream:{stream}"
        self.stored = self.duplicates = self.acked = 0

    async def run(self, stop: asyncio.Event, ready: Callable[[], None] | None = None) -> None:
        """Consume until `stop` is set (then finish the batch in hand); `ready` is called
        once the consumer is bound. ConfigError if the stream does not exist."""
        nc = await connect_nats(self.url, token=self.token, tls_ca=self.tls_ca)
        store = _Store(self.receiver)
        try:
            sub = await self._subscribe(nc)
            if ready is not None:
                ready()
            # Batch k is stored (in the store's thread) while batch k + 1 is fetched:
            # a batch is acknowledged once its store returned, and fetched only while
            # the source's pending records plus the batch in flight are below the limit
            # (so at most one batch over it; without room the stream keeps them).
            in_flight: tuple[asyncio.Future[int], list[Msg]] | None = None
            room = await store.has_room()
            while not stop.is_set():
                msgs = await self._fetch(sub) if room else []
                if in_flight is not None:
                    await self._acknowledge(*in_flight)
                    in_flight = None
                room = await store.has_room(len(msgs))  # the store's thread is idle now
                if msgs:
                    stored = store.store(self._messages(msgs), self.upstream)
                    in_flight = (asyncio.ensure_future(stored), msgs)
                elif not room:
                    await asyncio.sleep(_NO_ROOM_WAIT_S)
            if in_flight is not None:
                await self._acknowledge(*in_flight)
            await nc.flush()  # the last acks
        finally:
            store.close()
            await nc.close()

    async def _fetch(self, sub: Any) -> list[Msg]:
        """The next batch; none if the stream had none within _FETCH_WAIT_S."""
        try:
            return list(await sub.fetch(self.batch, timeout=_FETCH_WAIT_S))
        except TimeoutError:  # nats-py raises both kinds
            return []

    def _messages(self, msgs: Sequence[Msg]) -> list[Message]:
        messages = []
        for msg in msgs:
            sequence, timestamp_ms = _stream_position(msg)
            messages.append(_message(msg, self.key_header, timestamp_ms, sequence))
        return messages

    async def _acknowledge(self, stored: asyncio.Future[int], msgs: Sequence[Msg]) -> None:
        """Wait for the store of `msgs`, then ack each: only now are they durable in the
        FT layer. A store that failed acknowledges none: they come again (module
        docstring); a ConfigError (a message the source cannot route) raises."""
        try:
            new = await stored
        except ConfigError:
            raise
        except (FTLayerError, OSError) as exc:
            log.warning(
                "JetStream receiver: storing %d messages of %s failed (%r); they are not "
                "acknowledged and come again in %g s",
                len(msgs), self.upstream, exc, _RETRY_S,
            )  # fmt: skip
            for msg in msgs:
                await msg.nak(delay=_RETRY_S)
            await asyncio.sleep(_RETRY_S)
            return
        for msg in msgs:
            await msg.ack()
        self.stored += new
        self.duplicates += len(msgs) - new
        self.acked += len(msgs)

    async def _subscribe(self, nc: NatsClient) -> Any:
        js = nc.jetstream()
        try:
            await js.stream_info(self.stream)
        except nats.js.errors.NotFoundError:
            raise ConfigError(f"no JetStream stream {self.stream!r} on {self.url}") from None
        try:
            await js.consumer_info(self.stream, self.durable)
        except nats.js.errors.NotFoundError:
            await js.add_consumer(
                self.stream,
                ConsumerConfig(
                    durable_name=self.durable,
                    ack_policy=AckPolicy.EXPLICIT,
                    deliver_policy=DeliverPolicy.ALL,
                    ack_wait=self.ack_wait_s,
                    max_ack_pending=_MAX_ACK_PENDING_BATCHES * self.batch,
                    filter_subject=self.subject,
                ),
            )
        return await js.pull_subscribe_bind(durable=self.durable, stream=self.stream)


class NatsReceiver:
    """Stores core NATS messages on `subject` through `receiver` (module docstring):
    in a queue group `queue` when given (several receivers then share the subject's
    messages, each message going to one). `stored` counts what this receiver stored."""

    def __init__(
        self,
        receiver: Receiver,
        url: str,
        subject: str,
        *,
        queue: str | None = None,
        flush_messages: int = DEFAULT_FLUSH_MESSAGES,
        flush_ms: int = DEFAULT_FLUSH_MS,
        key_header: str | None = None,
        token: str | None = None,
        tls_ca: str | None = None,
    ) -> None:
        if not subject:
            raise ConfigError("a NATS receiver needs a subject")
        if flush_messages < 1 or flush_ms < 1:
            raise ConfigError(
                f"flush_messages and flush_ms must be at least 1, got {flush_messages}, {flush_ms}"
            )
        self.receiver, self.url, self.subject, self.queue = receiver, url, subject, queue
        self.flush_messages, self.flush_ms, self.key_header = flush_messages, flush_ms, key_header
        self.token, self.tls_ca = token, tls_ca
        self.upstream = f"nats:{subject}"
        self.stored = 0
        self._buffer: list[Message] = []
        self._full = asyncio.Event()

    async def run(self, stop: asyncio.Event, ready: Callable[[], None] | None = None) -> None:
        """Receive until `stop` is set, then drain the subscription and store the rest;
        `ready` is called once the server has the subscription."""
        nc = await connect_nats(self.url, token=self.token, tls_ca=self.tls_ca)
        store = _Store(self.receiver)
        self._full = asyncio.Event()
        try:
            sub = await nc.subscribe(self.subject, queue=self.queue or "", cb=self._on_message)
            await nc.flush()  # the server has the subscription: messages from now on come
            if ready is not None:
                ready()
            stopping = asyncio.create_task(stop.wait())
            while not stop.is_set():
                full = asyncio.create_task(self._full.wait())
                await asyncio.wait([full, stopping], timeout=self.flush_ms / 1000)
                full.cancel()
                await self._store_some(store)
            stopping.cancel()
            await sub.drain()  # type: ignore[no-untyped-call]  # what came: into the buffer
            while self._buffer:
                await self._store_some(store)
        finally:
            store.close()
            await nc.close()

    async def _on_message(self, msg: Msg) -> None:
        self._buffer.append(_message(msg, self.key_header, 0, -1))
        if len(self._buffer) >= self.flush_messages:
            self._full.set()

    async def _store_some(self, store: _Store) -> None:
        """Store the buffer's first messages (up to _STORE_MAX): messages arriving
        meanwhile go to the buffer."""
        taken, self._buffer = self._buffer[:_STORE_MAX], self._buffer[_STORE_MAX:]
        if len(self._buffer) < self.flush_messages:
            self._full.clear()
        if not taken:
            return
        try:
            self.stored += await store.store(taken, self.upstream)
        except ConfigError:
            raise
        except (FTLayerError, OSError) as exc:
            self._buffer[:0] = taken  # first again, ahead of what came meanwhile
            log.warning(
                "NATS receiver: storing %d messages of %s failed (%r); %d buffered, "
                "tried again in %g s",
                len(taken), self.upstream, exc, len(self._buffer), _RETRY_S,
            )  # fmt: skip
            await asyncio.sleep(_RETRY_S)
