"""Reading Kafka: one partition's range in polled chunks of records as columns, with
kafka-python as the ftkafka source configures it (assign and seek, no consumer group,
large fetches). The reader reads its batch's range here, and refetch the records of
failed ones stored by reference."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Generator, Mapping, Sequence
from typing import Any, Final, Protocol

from kafka import KafkaConsumer, TopicPartition
from kafka.errors import KafkaError

from ftlayer.errors import SourceError
from ftlayer.integration.ftcolumns import LOOP_HEADER

from .columnar import RecordColumns, columnar_consumer
from .options import SourceOptions

__all__ = [
    "POLL_SECONDS",
    "KafkaRange",
    "close_consumer",
    "new_consumer",
    "read_config",
    "read_kafka",
    "user_headers",
]

# An executor reads one partition, so one partition's fetch may use most of the fetch.
_FETCH_MAX_BYTES: Final = 32 * 1024 * 1024
_PARTITION_FETCH_MAX_BYTES: Final = 16 * 1024 * 1024
_MAX_POLL_RECORDS: Final = 50_000
# kafka-python's poll() returns early only with records; poll in short slices.
POLL_SECONDS: Final = 0.05


class KafkaRange(Protocol):
    """[start, end) of one Kafka partition."""

    @property
    def topic(self) -> str: ...
    @property
    def partition(self) -> int: ...
    @property
    def start(self) -> int: ...
    @property
    def end(self) -> int: ...


def read_config(options: SourceOptions) -> dict[str, Any]:
    """The configuration of a consumer that reads records (`read_kafka`)."""
    timeout_ms = int(options.poll_timeout_s * 1000)
    return {
        "bootstrap_timeout_ms": min(timeout_ms, 30_000),
        "fetch_max_bytes": _FETCH_MAX_BYTES,
        "max_partition_fetch_bytes": _PARTITION_FETCH_MAX_BYTES,
        "max_poll_records": _MAX_POLL_RECORDS,
        "fetch_max_wait_ms": 100,
        **options.kafka_config,
    }


def read_kafka(
    options: SourceOptions, part: KafkaRange, consumer: Any = None, *, to_log_end: bool = False
) -> Generator[RecordColumns, None, None]:
    """Kafka [start, end) of one partition, in polled chunks of records as columns.
    SourceError if no record arrives for pollTimeoutMs. With `consumer` (made with
    `read_config`), read with it and leave it open; else with a consumer of its own.
    With `to_log_end`, stop early where the partition's log ends (a fetch's high
    watermark at or below the position: the topic was made again, or its log cut):
    the records past it are gone, for a caller that counts them so (`refetch`); a
    batch's reader waits, then fails, as its batch's records must be there."""
    if part.end <= part.start:
        return
    where = f"{part.topic}-{part.partition} [{part.start}, {part.end})"
    own = consumer is None
    try:
        if own:
            consumer = new_consumer(options.bootstrap, read_config(options))
        # Records as columns, one chunk per poll (the module docstring of .columnar).
        columnar = columnar_consumer(consumer, int(consumer.config["max_poll_records"]))
        max_records = 1 if columnar else None
    except KafkaError as exc:
        raise SourceError(
            f"cannot reach Kafka at {options.bootstrap} to read {where}: {exc!r}"
        ) from exc
    try:
        tp = TopicPartition(part.topic, part.partition)
        consumer.assign([tp])
        consumer.seek(tp, part.start)
        position = part.start
        last_progress = time.monotonic()
        while position < part.end:
            polled = consumer.poll(timeout_ms=int(POLL_SECONDS * 1000), max_records=max_records)
            found = polled.get(tp)
            records = RecordColumns.of_polled(found).before(part.end) if found else None
            # Offsets may have gaps (compaction, transaction markers): go by position.
            new_position = int(consumer.position(tp))
            if records or new_position > position:
                last_progress = time.monotonic()
            position = max(position, new_position)
            if to_log_end and not records:
                mark = consumer.highwater(tp)
                if mark is not None and int(mark) <= position:
                    return
            if records:
                if records.offsets[0] < part.start:  # paranoid: seek must not go back
                    raise SourceError(f"Kafka returned offset {records.offsets[0]} for {where}")
                yield records
            elif time.monotonic() - last_progress > options.poll_timeout_s:
                raise SourceError(
                    f"reading {where} from Kafka at {options.bootstrap}: nothing arrived "
                    f"for {options.poll_timeout_s:.1f} s (kafkaConsumer.pollTimeoutMs) at "
                    f"offset {position}"
                )
    except KafkaError as exc:
        raise SourceError(f"reading {where} from Kafka at {options.bootstrap}: {exc!r}") from exc
    finally:
        if own:
            consumer.close(autocommit=False)


def close_consumer(consumer: Any) -> None:
    """Close a consumer that may be broken, committing nothing (a broken one is gone
    either way, and its close may raise)."""
    if consumer is not None:
        with contextlib.suppress(Exception):
            consumer.close(autocommit=False)


def new_consumer(bootstrap: str, config: Mapping[str, Any]) -> Any:
    return KafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=None,
        enable_auto_commit=False,
        allow_auto_create_topics=False,
        **{"client_id": "ftkafka", **config},
    )


def user_headers(
    headers: Sequence[Sequence[tuple[str, bytes | None]] | None],
) -> list[list[tuple[str, bytes | None]]]:
    """Each record's Kafka headers as the `headers` column shows them and the payload
    keeps them: in order, without the loop header (ftlayer's own, see ftcolumns)."""
    return [[(k, v) for k, v in (found or ()) if k != LOOP_HEADER] for found in headers]
