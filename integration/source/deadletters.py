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

import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np

from ftlayer.payloads import decode_payloads
from ftlayer.records import RecordBatch

__all__ = ["DLQ_HEADER_PREFIX", "dead_letter_messages", "deliverable", "history_of"]

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
