"""What a retried Kafka sink task reads back (integration.resume), on the real broker.

The whole path (a sink writer killed mid-partition, Spark's retry skipping what it
wrote) is test_pipeline.py's `test_a_sink_writer_killed_mid_partition_is_resumed_...`;
these pin the parts it stands on: which records count as written by a partition of a
write job, when two rows count as the same, and which rows a retry skips.
"""

from __future__ import annotations

from collections import Counter

import pytest
from fixture_types import MakeTopic
from hypothesis import given
from hypothesis import strategies as st
from kafka import KafkaProducer

from ftlayer.integration.resume import (
    WRITE_HEADER,
    ResumeError,
    WriteTag,
    already_written,
    end_offsets,
    resume_consumer,
    row_digest,
    tag_prefix,
    written_rows,
)

maybe_bytes = st.one_of(st.none(), st.binary(max_size=16))
headers = st.lists(st.tuples(st.text(max_size=6), maybe_bytes), max_size=3)
rows = st.tuples(maybe_bytes, maybe_bytes, headers)


@given(rows, rows)
def test_two_rows_share_a_digest_only_when_they_write_the_same_record(
    a: tuple[bytes | None, bytes | None, list[tuple[str, bytes | None]]],
    b: tuple[bytes | None, bytes | None, list[tuple[str, bytes | None]]],
) -> None:
    assert (row_digest(*a) == row_digest(*b)) == (a == b)


@given(st.binary(min_size=8, max_size=8), st.integers(0, 2**32 - 1), st.integers(0, 2**63))
def test_a_tag_is_its_prefix_and_index_and_decodes_back(
    write_id: bytes, partition: int, index: int
) -> None:
    tag = WriteTag(write_id, partition, index)
    assert tag.encode() == tag_prefix(write_id, partition) + index.to_bytes(8, "big")
    assert WriteTag.decode(tag.encode()) == tag
    assert WriteTag.decode(tag.encode()[:-1]) is None


# A partition's rows as (key, value): few distinct contents, so that rows repeat.
partition_rows = st.lists(st.tuples(st.sampled_from([b"a", b"b"]), st.sampled_from([b"1", b"2"])))


@given(partition_rows, st.data())
def test_a_retry_skips_each_row_the_dead_attempt_wrote_once_wherever_it_stands(
    dead: list[tuple[bytes, bytes]], data: st.DataObject
) -> None:
    """The dead attempt computed `dead` and wrote a prefix of it; the retry computes
    other rows (some dropped, some added, reordered) and sends them in pieces. For
    each content, the topic then holds as many copies as the retry computed, or as the
    dead attempt wrote if that was more: nothing lost, nothing written twice."""
    wrote = dead[: data.draw(st.integers(0, len(dead)))]
    kept = data.draw(st.lists(st.sampled_from(dead))) if dead else []
    retry = data.draw(st.permutations(kept + data.draw(partition_rows)))
    done = Counter(row_digest(k, v) for k, v in wrote)
    sent: list[tuple[bytes, bytes]] = []
    cut = data.draw(st.integers(0, len(retry)))
    for piece in (retry[:cut], retry[cut:]):
        keys, values = [k for k, _ in piece], [v for _, v in piece]
        skip = already_written(done, keys, values, [[] for _ in piece])
        sent += [row for i, row in enumerate(piece) if skip is None or not skip[i]]
    before, computed = Counter(wrote), Counter(retry)
    topic = before + Counter(sent)
    for row in computed.keys() | before.keys():
        assert topic[row] == max(computed[row], before[row])


def test_written_rows_are_those_of_one_partition_of_one_write_after_the_start(
    kafka_bootstrap: str, make_topic: MakeTopic
) -> None:
    topic = make_topic(3)
    mine, other = b"A" * 8, b"B" * 8
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, linger_ms=0)

    def send(write_id: bytes, partition: int, index: int, value: bytes) -> None:
        tag = WriteTag(write_id, partition, index).encode()
        producer.send(topic, key=b"k%d" % index, value=value, headers=[(WRITE_HEADER, tag)])
        producer.flush()  # one record batch each: a broker's listed end may lag one

    send(mine, 0, 0, b"before the batch")  # an earlier batch's write with the same id
    consumer = resume_consumer(kafka_bootstrap, {})
    try:
        start = end_offsets(consumer, topic)
    finally:
        consumer.close()
    for index in range(5):
        send(mine, 0, index, b"v%d" % index)
        send(mine, 1, index, b"other partition")
        send(other, 0, index, b"other write")
    producer.send(topic, value=b"untagged")
    producer.flush()
    producer.close()

    found = written_rows(kafka_bootstrap, topic, start, mine, 0, {})
    assert found == Counter(row_digest(b"k%d" % i, b"v%d" % i) for i in range(5))
    assert written_rows(kafka_bootstrap, topic, start, b"C" * 8, 0, {}) == Counter()


def test_the_end_offsets_of_a_missing_topic_are_a_clear_error(kafka_bootstrap: str) -> None:
    consumer = resume_consumer(kafka_bootstrap, {})
    try:
        with pytest.raises(ResumeError, match="no partitions"):
            end_offsets(consumer, "no-such-topic-for-resume")
    finally:
        consumer.close()
