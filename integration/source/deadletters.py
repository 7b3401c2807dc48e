"""Dead letters to a Kafka topic (`ft.deadLetterTopic`): the source's driver takes the
dead letters of its sources from the FT layer and writes them to the topic.

Each dead letter is written with its original key, value and Kafka headers byte for
byte (headers are kept with the payload whenever a dead-letter topic is set), plus
headers that say where it came from and why it died:

| header | value (utf-8 text) |
|---|---|
| `ftlayer-dlq-topic`, `-partition`, `-offset` | where the record was read |
| `ftlayer-dlq-timestamp` | its Kafka timestamp (epoch ms) |
| `ftlayer-dlq-source-id` | the FT-layer source it was read under |
| `ftlayer-dlq-attempts` | how many times it failed |
| `ftlayer-dlq-first-failed`, `-last-failed`, `-dead-at` | epoch ms |
| `ftlayer-dlq-causes` | JSON list of its failures' causes (at, kind, step, error, final) |

A dead letter stored by reference (`ft.persist=reference`) is written once its bytes
were copied into the FT layer; one whose record Kafka no longer had (its last cause
`source-expired`) is written without key and value, its headers saying where it was.

A dead letter leaves the FT layer's store only after the broker confirmed its write
(DEAD_LETTERS "delivered"): a crash between the two writes it again (a duplicate in
the topic), never loses it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, Final

import numpy as np
from kafka import KafkaProducer
from kafka.errors import KafkaError

from ftlayer.client import FTClient
from ftlayer.errors import SourceError
from ftlayer.payloads import decode_payloads
from ftlayer.records import RecordBatch
from ftlayer.wire import DeadLetterList

from .cluster import ShardClients
from .groups import SECURITY
from .options import SourceOptions

__all__ = [
    "DLQ_HEADER_PREFIX",
    "DeadLetterDelivery",
    "dead_letter_messages",
    "deliverable",
    "history_of",
]

log = logging.getLogger("ftlayer.source")  # the driver's

_DELIVER_CHUNK: Final = 500  # dead letters per DEAD_LETTERS request and producer flush

DLQ_HEADER_PREFIX: Final = "ftlayer-dlq-"


def _ms(seconds: float | None) -> bytes:
    return b"" if seconds is None else str(round(seconds * 1000)).encode()


def deliverable(letters: Sequence[Mapping[str, Any]], records: RecordBatch) -> list[int]:
    """The rows that can be written now: all but those stored by reference whose bytes
    are not copied in yet (unless Kafka no longer had them: last cause source-expired)."""
    references = records.reference_mask
    return [i for i, letter in enumerate(letters) if not references[i] or _expired(letter)]


def _expired(letter: Mapping[str, Any]) -> bool:
    causes = letter.get("causes") or []
    return bool(causes) and causes[-1].get("kind") == "source-expired"


def dead_letter_messages(
    letters: Sequence[Mapping[str, Any]], records: RecordBatch
) -> list[tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]]:
    """(key, value, headers) of each dead letter, as written to the dead-letter topic
    (rows stored by reference: no key, value nor original headers)."""
    references = records.reference_mask
    stored = np.flatnonzero(~references)
    keys, values, timestamps, headers = decode_payloads(
        [records.payloads[i] for i in stored.tolist()]
    )
    at = {int(row): j for j, row in enumerate(stored.tolist())}
    messages: list[tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]] = []
    for i, letter in enumerate(letters):
        j = at.get(i)
        causes = [
            {k: v for k, v in cause.items() if k != "final" or v} for cause in letter["causes"]
        ]
        history = {
            "topic": records.topics[i].encode(),
            "partition": str(int(records.partitions[i])).encode(),
            "offset": str(int(records.offsets[i])).encode(),
            "timestamp": b"" if j is None else str(int(timestamps[j])).encode(),
            "source-id": str(int(letter["source_id"])).encode(),
            "attempts": str(int(letter["attempts"])).encode(),
            "first-failed": _ms(letter["first_failed"]),
            "last-failed": _ms(letter["last_failed"]),
            "dead-at": _ms(letter.get("dead_at")),
            "causes": json.dumps(causes, separators=(",", ":")).encode(),
        }
        added = [(DLQ_HEADER_PREFIX + name, value) for name, value in history.items()]
        if j is None:
            messages.append((None, None, added))
            continue
        kept = [(k, v if v is not None else b"") for k, v in headers[j]]
        messages.append((keys[j].as_py(), values[j].as_py(), [*kept, *added]))
    return messages


def history_of(headers: Sequence[tuple[str, bytes | None]]) -> dict[str, Any]:
    """The `ftlayer-dlq-*` headers of a message read from a dead-letter topic, decoded
    (causes as a list); the original headers are left out."""
    found: dict[str, Any] = {}
    for key, value in headers:
        if key.startswith(DLQ_HEADER_PREFIX) and value is not None:
            name = key[len(DLQ_HEADER_PREFIX) :]
            text = value.decode("utf-8", errors="replace")
            found[name] = json.loads(text) if name == "causes" else text
    return found


class DeadLetterDelivery:
    """The driver's delivery of its sources' dead letters to `ft.deadLetterTopic`: its
    producer, kept from batch to batch, and when it last delivered."""

    def __init__(
        self,
        options: SourceOptions,
        shards: ShardClients,
        source_ids: Mapping[str, int],
        timeout_ms: int,
    ) -> None:
        self.options = options
        self.shards = shards
        self.source_ids = source_ids
        self._timeout_ms = timeout_ms  # the driver's Kafka request timeout
        self._producer: Any = None
        self._next_delivery = 0.0

    def close(self) -> None:
        self._drop_producer()

    def deliver(self, *, every_s: float = 1.0) -> int:
        """With ft.deadLetterTopic: write this query's dead letters to the topic, and
        once the broker confirmed them, have the FT layer delete them (at most once per
        `every_s`), shard by shard. Returns how many were delivered. A failure is logged
        and retried at the next call: the dead letters stay in the FT layer's store
        meanwhile."""
        topic = self.options.dead_letter_topic
        now = time.monotonic()
        if topic is None or not self.options.ft_on or now < self._next_delivery:
            return 0
        self._next_delivery = now + every_s
        delivered = 0
        for shard in range(self.shards.count):
            if shard in self.shards.down:
                continue
            try:
                for source_id in sorted(set(self.source_ids.values())):
                    delivered += self._deliver_source(topic, shard, source_id)
            except (SourceError, KafkaError, OSError) as exc:
                self._drop_producer()
                log.warning(
                    "could not write dead letters of %s to topic %r (retried at the next "
                    "batch; they stay in the FT layer's store meanwhile): %r",
                    self.shards.where(shard),
                    topic,
                    exc,
                )
        return delivered

    def _deliver_source(self, topic: str, shard: int, source_id: int) -> int:
        delivered = 0
        while True:
            # One connection attempt: this runs before the trigger's STATUS notices a
            # shard that just died, and waiting for it would hold up every partition.
            listed = self.shards.quick(
                shard, "read the dead letters", partial(_list_dead, source_id)
            )
            rows = deliverable(listed.letters, listed.records)
            if not rows:  # none, or only records whose bytes are still to be copied in
                return delivered
            letters = [listed.letters[i] for i in rows]
            producer = self._kept_producer()
            messages = dead_letter_messages(letters, listed.records.take(np.array(rows)))
            futures = [
                producer.send(topic, key=key, value=value, headers=headers)
                for key, value, headers in messages
            ]
            producer.flush(timeout=self._timeout_ms * 4 / 1000)
            confirmed = [
                letter["seq"]
                for letter, future in zip(letters, futures, strict=True)
                if future.is_done and future.succeeded()
            ]
            if confirmed:
                self.shards.call(
                    shard, "mark dead letters delivered", partial(_delivered, confirmed)
                )
                delivered += len(confirmed)
            if len(rows) < len(listed.letters):  # the rest after their bytes are copied
                return delivered
            if len(confirmed) < len(letters):
                failed = next(f for f in futures if not (f.is_done and f.succeeded()))
                raise KafkaError(f"the broker did not confirm a dead letter: {failed.exception}")
            if not listed.more:
                return delivered

    def _kept_producer(self) -> Any:
        if self._producer is None:
            self._producer = KafkaProducer(
                bootstrap_servers=self.options.bootstrap,
                acks="all",
                max_request_size=64 * 1024 * 1024,
                **{k: v for k, v in self.options.kafka_config.items() if k in SECURITY},
            )
        return self._producer

    def _drop_producer(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            with contextlib.suppress(Exception):
                producer.close(timeout=0)


def _list_dead(source_id: int, client: FTClient) -> DeadLetterList:
    return client.dead_letters({"source_id": source_id}, _DELIVER_CHUNK)


def _delivered(seqs: list[int], client: FTClient) -> int:
    return client.dead_letter_op("delivered", {"seqs": seqs})
