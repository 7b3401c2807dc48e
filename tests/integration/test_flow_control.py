"""Flow control (issue 12, part 4): `ft.maxPendingRecords`, as Storm's max.spout.pending.

A source admits new Kafka records only while its pending trees (in flight, or replays
waiting to be read) plus those records stay within the limit; replays are always
taken in. The stalled-sink test runs on real parts (Tansu, a real `ftlayer serve`,
local Spark): a foreachBatch sink hangs for 35 s, longer than the query's tree
timeout and then longer than it again while the timed-out records wait as replays,
while a sampler reads the FT layer's STATUS. What a user would notice: the
FT layer's pending trees and stored records stay bounded, the source stops reading,
no record times out merely because it waited to be read (each record of the hung
batch times out once, none again while it waits as a replay), and once the sink
recovers every record reaches it, the hung batch's records twice. The query sends no
heartbeats (`ft.heartbeatMs=0`): with them, the hung batch's trees would not time out
at all while it runs (tests/integration/test_slow_batches.py), and this test is about
the replays of trees that did.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from fixture_types import MakeTopic
from hypothesis import given
from hypothesis import strategies as st
from pyspark.sql import DataFrame, SparkSession
from serverproc import StartServer

from ftlayer.errors import ConfigError
from ftlayer.integration.ftcolumns import FTSettings
from ftlayer.integration.harness.kafka import produce, wait_until
from ftlayer.integration.sinks import ft_foreach_batch
from ftlayer.integration.source.driver import SourceDriver, share_out
from ftlayer.integration.source.options import (
    DEFAULT_MAX_PENDING_RECORDS,
    parse_options,
    source_id,
)
from ftlayer.position import Position

BASE = {"kafka.bootstrap.servers": "h:1", "subscribe": "t", "ft.address": "h:2"}

PARTITIONS = 4
PER_PARTITION = 1000
LIMIT = 1000  # ft.maxPendingRecords: a quarter of the backlog
TIMEOUT_MS = 10_000  # ft.treeTimeoutMs: a tree fails between 10 and 15 s (3 buckets)
STALL_S = 35.0  # the sink hangs this long, in the second batch: its trees fail at 10-15 s,
# then wait 20 s or more as replays, past a tree timeout again (which none may obey)
RANGE_STALL_S = 25.0  # by reference: past every timeout (10 to 15 s), which none obeys
STALLED_EPOCH = 1


# ---- the option ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("0", "must be at least 1, got '0'"),
        ("-5", "must be at least 1, got '-5'"),
        ("1.5", "must be an integer, got '1.5'"),
        ("lots", "must be an integer, got 'lots'"),
    ],
)
def test_a_bad_max_pending_records_is_a_config_error_naming_it(value: str, words: str) -> None:
    with pytest.raises(ConfigError, match=f"option ft.maxPendingRecords {words}"):
        parse_options({**BASE, "ft.maxPendingRecords": value})


def test_max_pending_records_defaults_to_a_bound_and_takes_any_positive_integer() -> None:
    assert parse_options(BASE).max_pending_records == DEFAULT_MAX_PENDING_RECORDS == 1_000_000
    assert parse_options({**BASE, "ft.maxpendingrecords": " 7 "}).max_pending_records == 7


@given(
    st.integers(0, 10_000),
    st.dictionaries(st.integers(0, 63), st.integers(1, 5_000), max_size=16),
)
def test_shares_add_up_to_the_budget_and_never_pass_a_backlog(
    budget: int, backlog: dict[int, int]
) -> None:
    shares = share_out(budget, backlog)
    assert set(shares) == set(backlog)
    assert sum(shares.values()) == min(budget, sum(backlog.values()))
    assert all(0 <= shares[p] <= backlog[p] for p in backlog)
    total = sum(backlog.values())
    if budget < total:  # proportional: each share within one record of its exact part
        assert all(abs(shares[p] - budget * backlog[p] / total) < 1 for p in backlog)


@given(
    st.integers(1, 10_000),
    st.lists(st.integers(0, 5_000), min_size=1, max_size=12),
)
def test_max_offsets_per_trigger_takes_exactly_that_many_when_more_wait(
    max_rows: int, backlog: list[int]
) -> None:
    """A batch takes `maxOffsetsPerTrigger` records when more wait (Spark's Kafka
    source rounds each partition's share down, leaving a few records to a batch of
    their own), at least one of each partition with a backlog, and no more than a
    partition holds."""
    parsed = parse_options({"kafka.bootstrap.servers": "h:1", "subscribe": "t"})  # FT off
    driver = SourceDriver(parsed, parsed.source_ids())
    starts = {"t": {p: 1_000 * p for p in range(len(backlog))}}
    ends = {"t": {p: 1_000 * p + n for p, n in enumerate(backlog)}}
    cut = Position.parse(
        driver.limited(
            Position.at(starts, None).to_json(), Position.at(ends, None).to_json(), max_rows
        ),
        need_replay=False,
    ).kafka["t"]
    taken = [cut[p] - starts["t"][p] for p in range(len(backlog))]
    waiting = [n for n in backlog if n]
    assert all(0 <= got <= n for got, n in zip(taken, backlog, strict=True))
    assert all(got >= 1 for got, n in zip(taken, backlog, strict=True) if n)
    if sum(backlog) <= max_rows:
        assert taken == backlog
    else:
        assert max_rows <= sum(taken) < max_rows + len(waiting)


# ---- a stalled sink ----------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    at: float
    pending: int
    """The source's pending trees (STATUS pending_by_source)."""
    stored: int
    persisted: int
    timeouts: int


@pytest.mark.parametrize("persist", ["payload", "reference"])
def test_a_stalled_sink_keeps_pending_and_the_store_bounded_and_loses_nothing(
    spark: SparkSession,
    kafka_bootstrap: str,
    make_topic: MakeTopic,
    start_server: StartServer,
    tmp_path: Path,
    persist: str,
) -> None:
    """With payload, the hung batch's trees time out (no heartbeats here) and are
    replayed in a fifth batch; by reference the batch is a range, which does not time
    out: it completes when the sink comes back, nothing replayed, nothing stored."""
    server = start_server()
    stall_s = STALL_S if persist == "payload" else RANGE_STALL_S
    topic = make_topic(PARTITIONS)
    for p in range(PARTITIONS):
        produce(
            kafka_bootstrap, topic, [(None, b"r%d" % i) for i in range(PER_PARTITION)], partition=p
        )
    everything = {(p, o) for p in range(PARTITIONS) for o in range(PER_PARTITION)}
    source = str(source_id(topic, topic))
    settings = FTSettings(server.address)

    batches: dict[int, list[tuple[int, int]]] = {}
    stall: dict[str, float] = {}
    release = threading.Event()  # set only to end the stall early when the test fails

    def write(batch: DataFrame, epoch: int) -> None:
        batches[epoch] = [(r.partition, r.offset) for r in batch.collect()]
        if epoch == STALLED_EPOCH:  # the sink's database hangs
            stall["began"] = time.monotonic()
            release.wait(stall_s)
            stall["ended"] = time.monotonic()

    samples: list[Sample] = []
    sampling = threading.Event()

    def sample() -> None:
        with server.client() as client:
            while not sampling.is_set():
                status = client.status()
                samples.append(
                    Sample(
                        time.monotonic(),
                        status.pending_of(int(source)),
                        status.stored_records,
                        status.persisted,
                        status.failed["timeout"],
                    )
                )
                sampling.wait(0.2)

    sampler = threading.Thread(target=sample, name="status-sampler", daemon=True)
    sampler.start()
    query = (
        spark.readStream.format("ftkafka")
        .option("kafka.bootstrap.servers", kafka_bootstrap)
        .option("subscribe", topic)
        .option("ft.address", server.address)
        .option("ft.treeTimeoutMs", str(TIMEOUT_MS))
        .option("ft.maxPendingRecords", str(LIMIT))
        .option("ft.heartbeatMs", "0")
        .option("ft.persist", persist)
        .load()
        .writeStream.foreachBatch(ft_foreach_batch(write, settings))
        .trigger(processingTime="200 milliseconds")
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .start()
    )
    try:
        wait_until(lambda: "ended" in stall, stall_s + 60, "the stalled batch to end")

        def settled() -> bool:
            written = {row for rows in batches.values() for row in rows}
            return written == everything and bool(samples) and samples[-1].pending == 0

        wait_until(settled, 90, "every record at the sink and nothing pending", 0.2)
    finally:
        release.set()
        query.stop()
        sampling.set()
        sampler.join(10)

    stalled = batches[STALLED_EPOCH]
    during = [s for s in samples if stall["began"] <= s.at <= stall["ended"]]
    largest = max(len(rows) for rows in batches.values())
    if persist == "reference":
        _ranges_wait_out_the_stall(batches, samples, during)
        return
    # The limit holds every batch, replays included; the hung batch too (without it
    # the first batch would have taken the whole backlog).
    assert [len(rows) for rows in batches.values()] == [LIMIT] * 5, {
        e: len(r) for e, r in batches.items()
    }
    # Bounded: pending within the limit, stored within the limit plus one batch, all
    # the time and while the sink hangs, sampled many times over the stall.
    assert len(during) >= STALL_S / 0.5, len(during)
    assert max(s.pending for s in samples) <= LIMIT
    assert max(s.stored for s in samples) <= LIMIT + largest
    # The source stopped: nothing was read while the sink hung.
    assert {s.persisted for s in during} == {2 * LIMIT}, during[0]
    # The hung batch's trees timed out once each (they waited in the sink longer than
    # the timeout); as replays waiting to be read they never timed out again.
    assert samples[-1].timeouts == len(stalled)
    assert max(s.timeouts for s in during) == len(stalled)
    # The batch after the stall is the hung batch's replays and no new record: the
    # limit counts them.
    assert sorted(batches[STALLED_EPOCH + 1]) == sorted(stalled)
    # Nothing lost; the hung batch's records, written before their trees timed out,
    # are the only duplicates.
    counts = Counter(row for rows in batches.values() for row in rows)
    assert set(counts) == everything
    assert {row for row, n in counts.items() if n > 1} == set(stalled)
    assert max(counts.values()) == 2


def _ranges_wait_out_the_stall(
    batches: dict[int, list[tuple[int, int]]],
    samples: list[Sample],
    during: list[Sample],
) -> None:
    """By reference: the limit holds every batch; while the sink hangs the source reads
    nothing, pending stays within the limit and nothing is stored per record; the hung
    batch's range does not time out, so nothing is replayed or written twice."""
    assert [len(rows) for rows in batches.values()] == [LIMIT] * 4, {
        e: len(r) for e, r in batches.items()
    }
    assert len(during) >= RANGE_STALL_S / 0.5, len(during)
    assert max(s.pending for s in samples) <= LIMIT
    assert max(s.stored for s in samples) == 0
    assert {s.persisted for s in during} == {2 * LIMIT}, during[0]
    assert samples[-1].timeouts == 0
    counts = Counter(row for rows in batches.values() for row in rows)
    assert len(counts) == PARTITIONS * PER_PARTITION and max(counts.values()) == 1
