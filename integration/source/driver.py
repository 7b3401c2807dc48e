"""The driver side of the ftkafka source: its Kafka consumer and FT-layer client.

`SourceDriver` lives in the driver's source process and answers what Spark asks of the
source between batches: the initial position, the end of what is readable now, a
position capped by maxOffsetsPerTrigger and ft.maxPendingRecords, the barrier
checkpoints (CHECKPOINT_BEGIN / COMPLETE), and the consumer-group commits.

The FT layer may be several shards (`ft.address` HOST:PORT,HOST:PORT,...): each
partition's records, ranges, checkpoints and group offset are its own shard's, the
position has a replay cursor per shard, and every request goes to the shard it
concerns (.cluster).

Flow control (ft.maxPendingRecords, Storm's max.spout.pending per source, and per shard
with several): the STATUS reply (the brief one, docs/protocol.md 6.2: only what this
driver reads) that gives `available` the replay cursor also gives each source's
pending roots, counted by the FT layer at that moment: trees still in
flight and replays waiting in the queue. `limited` then admits at most (limit -
pending) new Kafka records of that source's topic on each shard, split over the
shard's partitions in proportion to their backlog, and none once pending reaches the
limit (a shard whose sink stalls holds back its own partitions only); replays are
always taken in (they are pending already, and only being read lets them complete).
Spark runs one batch at a time and a batch's records become pending only when it reads
them, so a source's pending roots stay within the limit, plus the records of a batch
Spark runs again (a retried task persists under fresh roots while the first attempt's
trees time out). A sink that stalls keeps its trees pending (in its running batch, or
past the timeout as replays waiting to be read), so the batches after it take in no
more new records than the limit leaves.

Timeouts that follow progress (ft.heartbeatMs): from the barrier of a batch
(`batch_running`, after CHECKPOINT_BEGIN) until Spark asks for the next end
(`batch_done`, from latestOffset) or the query stops, a `Heartbeat` thread leases the
running batch in the FT layer, so its trees do not time out while it runs
(integration/source/heartbeat.py, ftlayer.core.leases).

Every call to Kafka and to the FT layer is retried with doubling backoff and then
fails with SourceError naming what and where: an unreachable broker or FT layer is an
error within seconds, never a hang.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, Final, TypeVar

from kafka import TopicPartition
from kafka.errors import KafkaError

from ftlayer.client import BatchStart, FTClient
from ftlayer.errors import ConfigError, SourceError
from ftlayer.position import EARLIEST, LATEST, KafkaOffsets, Position
from ftlayer.records import ReplayRecords
from ftlayer.registration import SourceRegistration
from ftlayer.status import BriefStatus, CheckpointReport, Status

from .cluster import CheckpointAnswers, ShardClients, ShardMap, brief_status
from .columnar import probe_consumer
from .deadletters import DeadLetterDelivery
from .filling import Filler
from .given import hand_over
from .groups import ConsumerGroup
from .heartbeat import LEASE_INTERVALS, Heartbeat, heartbeat_interval_s
from .kafkaread import close_consumer, new_consumer
from .options import SourceOptions
from .parking import Parking
from .reader import FTKafkaPartition
from .rewind import Rewind, no_group, plan_rewind, same_stores

T = TypeVar("T")
_K = TypeVar("_K", int, tuple[str, int])  # share_out: a partition, or (topic, partition)

Offset = dict[str, Any]
"""A position (ftlayer.position) in its JSON form, as Spark's offset log holds it."""

log = logging.getLogger("ftlayer.source")

# Driver-side Kafka calls: each attempt is bounded by this unless kafka.* says otherwise.
_DRIVER_TIMEOUT_MS: Final = 1500
# _ends polls in short slices: a probe poll returns no record, so poll() would wait out
# its whole timeout, fetching the same batch again and again meanwhile.
_PROBE_POLL_MS: Final = 2


class SourceDriver:
    """The driver's Kafka consumer and FT-layer client, with retries."""

    def __init__(self, options: SourceOptions, source_ids: Mapping[str, int]) -> None:
        self.options = options
        self.source_ids = source_ids
        self._consumer: Any = None
        self.shards = ShardClients(options)
        self.shard_map = ShardMap(source_ids, options.ft.shards)
        self._partition_counts: dict[str, int] = {}
        self.group = ConsumerGroup(options)
        self.pending: dict[str, list[int]] = {}
        """Per topic: its source's pending roots on each shard at the last `available`
        (FT on)."""
        self._held: set[tuple[str, int]] = set()  # (topic, shard)s flow control holds back
        self._server_timeout_s: float | None = None  # the server's T, from its STATUS
        self._heartbeats: list[Heartbeat] = []
        self._cursors: tuple[int, ...] = ()  # each shard's replay cursor, as last read
        self.parking = Parking(self.shards)
        self.filler = Filler(options, self.shards)
        self.dead_letters = DeadLetterDelivery(options, self.shards, source_ids, self._timeout_ms())

    # ---- lifecycle ----

    def start(self) -> None:
        """Check the topics exist; with FT on, check each shard of the FT layer is
        where ft.address puts it (.cluster), then register the sources."""
        self._partition_counts = self._kafka(
            "read the topics' metadata", lambda: self._topic_partitions(check_exist=True)
        )
        if self.options.ft_on:
            self.shards.check_places()
            self._register_sources()

    def close(self) -> None:
        for heartbeat in self._heartbeats:
            heartbeat.close()
        self._heartbeats = []
        self._drop_consumer()
        self.filler.close()
        self.group.close()
        self.dead_letters.close()
        self.shards.close()

    # ---- offsets ----

    def initial_offset(self) -> Offset:
        starting = self.options.starting
        counts = self._partition_counts
        tps = [TopicPartition(t, p) for t in self.options.topics for p in range(counts[t])]
        if starting == "earliest":
            kafka = self._kafka("read the earliest offsets", lambda: self._earliest(tps))
        elif starting == "latest":
            kafka = self._kafka("read the end offsets", lambda: self._ends(tps))
        else:
            assert isinstance(starting, dict)
            kafka = self._specific_offsets(starting, tps)
        if not self.options.ft_on:
            return Position.at(kafka, None).to_json()
        return Position.at(kafka, self._replay_start(), self.shards.store_ids).to_json()

    def _specific_offsets(
        self, starting: dict[str, dict[int, int]], tps: list[TopicPartition]
    ) -> KafkaOffsets:
        counts = self._partition_counts
        for topic in self.options.topics:
            wanted = set(range(counts[topic]))
            given = set(starting.get(topic, {}))
            if given - wanted:
                raise ConfigError(
                    f"option startingOffsets: topic {topic!r} has no partition "
                    f"{sorted(given - wanted)}; it has partitions 0-{counts[topic] - 1}"
                )
            if wanted - given:
                raise ConfigError(
                    f"option startingOffsets must give every partition of topic {topic!r} "
                    f"(-2 earliest, -1 latest); missing: {sorted(wanted - given)}"
                )
        earliest = self._kafka("read the earliest offsets", lambda: self._earliest(tps))
        ends = self._kafka("read the end offsets", lambda: self._ends(tps))
        kafka: KafkaOffsets = {}
        for topic in self.options.topics:
            kafka[topic] = {}
            for p, offset in starting[topic].items():
                lo, hi = earliest[topic][p], ends[topic][p]
                if offset == EARLIEST:
                    offset = lo
                elif offset == LATEST:
                    offset = hi
                elif not lo <= offset <= hi:
                    raise ConfigError(
                        f"option startingOffsets: offset {offset} of {topic}-{p} is outside "
                        f"the records Kafka holds, [{lo}, {hi}]"
                    )
                kafka[topic][p] = offset
        return kafka

    def available(self, start: Offset | None) -> Offset:
        """The end of everything readable now: the high watermark of every partition
        (a partition new since `start` at its earliest offset: it enters one batch
        later, from there) and the FT layer's replay cursors and stores; the partitions
        of a shard that lost its store at their committed group offsets (.rewind)."""
        counts = self._kafka(
            "read the topics' metadata", lambda: self._topic_partitions(check_exist=False)
        )
        first = None if start is None else self.parse(start)
        known = {} if first is None else first.kafka
        tps = [TopicPartition(t, p) for t in self.options.topics for p in range(counts[t])]
        ends = self._kafka("read the end offsets", lambda: self._ends(tps))
        new = [tp for tp in tps if tp.partition not in known.get(tp.topic, {})]
        if start is not None and new:
            earliest = self._kafka("read the earliest offsets", lambda: self._earliest(new))
            for tp in new:
                ends[tp.topic][tp.partition] = earliest[tp.topic][tp.partition]
        for topic, partitions in known.items():
            for p, offset in partitions.items():
                end = ends.get(topic, {}).get(p)
                if end is not None and end < offset:
                    raise SourceError(
                        f"Kafka's end of {topic}-{p} is {end}, behind this query's offset "
                        f"{offset}: the topic was deleted or truncated, records may be lost"
                    )
        if self.options.ft_on and counts != self._partition_counts:
            self._partition_counts = counts
            self._register_sources()
        if not self.options.ft_on:
            return Position.at(ends, None).to_json()
        previous = None if first is None else first.cursors
        was = self.shards.store_ids if first is None or first.stores is None else first.stores
        cursors, statuses = self._replay_cursors(previous, was)
        stores = list(was)
        for rewind in self._rewinds(first, was, statuses):
            for topic, partitions in rewind.offsets.items():
                ends[topic].update(partitions)
            cursors[rewind.shard], stores[rewind.shard] = rewind.cursor, rewind.store
        for shard, (now, before) in enumerate(zip(cursors, previous or cursors, strict=True)):
            if now < before and stores[shard] == was[shard]:
                raise SourceError(
                    f"{self.shards.where(shard)} has replay cursor {now}, behind this "
                    f"query's {before}: it is not the FT layer this query ran with (its "
                    "data directory was lost or replaced)"
                )
        return Position.at(ends, cursors, stores).to_json()

    def _rewinds(
        self, first: Position | None, known: Sequence[str], statuses: list[BriefStatus | None]
    ) -> list[Rewind]:
        """The rewinds of the shards that serve another store than `known`, the stores
        `first` names (.rewind)."""
        rewinds = []
        for shard, (was, status) in enumerate(zip(known, statuses, strict=True)):
            if first is not None and status is not None and status.store_id != was:
                rewinds.append(self._rewind(first, shard, was, status))
        self.shards.store_ids = [
            was if status is None else status.store_id
            for was, status in zip(known, statuses, strict=True)
        ]
        return rewinds

    def _rewind(self, first: Position, shard: int, was: str, status: BriefStatus) -> Rewind:
        """Shard `shard`'s partitions back to their group offsets, its sources
        registered with its new store, logged."""
        where = self.shards.where(shard)
        if self.options.group_id is None:
            raise no_group(where, status.store_id, was)
        owned = self.shard_map.owned(first.kafka, shard)
        tps = [TopicPartition(t, p) for t, partitions in owned.items() for p in partitions]
        committed = self._kafka("read the group offsets", partial(self.group.committed, tps))
        earliest = self._kafka("read the earliest offsets", partial(self._earliest, tps))
        sources = sorted(set(self.source_ids.values()))
        rewind = plan_rewind(
            shard, was, status.store_id, status.replay_start_of(sources), owned, committed,
            earliest, where,
        )  # fmt: skip
        self._register_sources([shard])
        log.warning("%s", rewind.describe(where))
        return rewind

    def parse(self, offset: Offset) -> Position:
        """A position of this query's (Spark's offset log): with FT on, one replay cursor
        per shard of the FT layer ft.address names (ConfigError for another count: the
        query ran with another FT layer, whose replay seqs mean nothing here)."""
        position = Position.parse(offset, sharded=True)
        cursors = position.cursors
        shards = self.shards.count
        if self.options.ft_on and cursors is not None and len(cursors) != shards:
            raise ConfigError(
                f"option ft.address names {shards} FT-layer shard(s), but this query's "
                f"checkpoint has replay cursors of {len(cursors)}: a query keeps the "
                "shards it started with (restore a savepoint to start over on others)"
            )
        return position

    def limited(self, start: Offset, available: Offset, max_rows: int | None) -> Offset:
        """`available`, cut to `max_rows` Kafka records split over partitions in
        proportion to their backlog (`share_out`; a partition with a backlog gets at
        least one, as in Spark's KafkaMicroBatchStream.rateLimit), and at most
        `max_rows` replay seqs; with FT on, first cut by ft.maxPendingRecords (see the
        module docstring)."""
        now, first = self.parse(available), self.parse(start)
        ends, starts, cursors = now.offsets(), first.kafka, now.cursors
        if self.options.ft_on:
            self._admit(starts, ends)
        if max_rows is None:
            return Position.at(ends, cursors, now.stores).to_json()
        sizes = {
            (t, p): end - starts[t][p]
            for t, partitions in ends.items()
            for p, end in partitions.items()
            if p in starts.get(t, {}) and end > starts[t][p]
        }
        # Exactly max_rows in all when the backlog exceeds it (the records rounding down
        # leaves go to the largest remainders; Spark's Kafka source leaves them to a
        # batch of their own), and at least one for each partition with a backlog.
        for (t, p), share in share_out(max_rows, sizes).items():
            ends[t][p] = min(ends[t][p], starts[t][p] + max(share, 1))
        if cursors is not None and first.cursors is not None:
            cursors = tuple(  # a rewound shard's cursor counts in another store
                min(at, before + max_rows) if same else at
                for at, before, same in zip(
                    cursors, first.cursors, same_stores(first, now), strict=True
                )
            )
        return Position.at(ends, cursors, now.stores).to_json()

    def _admit(self, starts: Mapping[str, Mapping[int, int]], ends: KafkaOffsets) -> None:
        """Cut `ends` so that on each shard, each source's pending roots plus its new
        Kafka records stay within ft.maxPendingRecords (exactly: the shares are whole
        records)."""
        limit = self.options.max_pending_records
        for topic, partitions in ends.items():
            pending = self.pending.get(topic, [0] * self.shards.count)
            backlogs: list[dict[int, int]] = [{} for _ in range(self.shards.count)]
            for p, end in partitions.items():
                if p in starts.get(topic, {}) and end > starts[topic][p]:
                    backlogs[self.shard_map.owner(topic, p)][p] = end - starts[topic][p]
            for shard, backlog in enumerate(backlogs):
                # A shard that is down takes in nothing: its partitions wait in Kafka.
                budget = 0 if shard in self.shards.stalled else max(0, limit - pending[shard])
                for p, share in share_out(budget, backlog).items():
                    partitions[p] = starts[topic][p] + share
                held = budget < sum(backlog.values())
                self._note_held(topic, shard, held, pending[shard], limit)

    def _note_held(self, topic: str, shard: int, held: bool, pending: int, limit: int) -> None:
        """Log when flow control starts and stops holding a topic back (not per batch)."""
        on = "" if self.shards.count == 1 else f" on shard {shard}"
        if held and (topic, shard) not in self._held:
            self._held.add((topic, shard))
            log.info(
                "ft.maxPendingRecords=%d holds back topic %r%s: its source has %d pending "
                "trees; new records wait in Kafka until they complete",
                limit,
                topic,
                on,
                pending,
            )
        elif not held and (topic, shard) in self._held:
            self._held.discard((topic, shard))
            log.info("topic %r is no longer held back%s (%d pending trees)", topic, on, pending)

    # ---- replay queue ----

    def checkpoint(
        self, end: Position, *, begin: bool, complete: Position | None = None
    ) -> CheckpointAnswers:
        """CHECKPOINT_BEGIN (barrier `end`; with `complete`, that barrier's batch is
        done and completes first, in the same request) or CHECKPOINT_DONE (its
        batch is done), to every shard, each its part of the barrier; their answers. A
        completion's `commit_offsets` are the group offsets the checkpoint allows: the
        lowest pending offsets capped at its barrier (unaligned), the barrier once
        aligned, the last aligned checkpoint's while aligning, or None. A failure is
        logged and gives None for that shard: the next batch's checkpoint covers this
        one (the FT layer completes checkpoints in order, and a later commit finishes
        the batches before it). A shard is sent no part of a barrier of a store it no
        longer serves, and completes no barrier of its old store (.rewind)."""
        what = "begin the checkpoint" if begin else "complete the checkpoint"
        self._settle_parked(completes=complete is not None or not begin)
        reports: list[CheckpointReport | None] = []
        kept = None if complete is None else same_stores(complete, end)
        for shard in range(self.shards.count):
            store = None if end.stores is None else end.stores[shard]
            if shard in self.shards.stalled or store not in (None, self.shards.store_ids[shard]):
                reports.append(None)  # down: its barriers when it is back; lost: gone
                continue
            part = self.shard_map.part(end, shard)
            done = None
            if complete is not None and kept is not None and kept[shard]:
                done = self.shard_map.part(complete, shard)
            try:
                report = self.shards.quick(
                    shard,
                    f"{what} of {self.options.checkpoint_query!r}",
                    partial(self._checkpoint_call, store, part, begin, done),
                )
            except SourceError as exc:
                log.warning("%s (covered by the next batch's checkpoint)", exc)
                report = None
            reports.append(report)
        return CheckpointAnswers(tuple(reports), self.shard_map)

    def _settle_parked(self, *, completes: bool) -> None:
        """Before a barrier completes: with several shards, if a batch ran since the last
        look at the parked failures (this completion comes before the next trigger's
        STATUS), look now, before any barrier completes the ranges those failures
        belong to."""
        if self.shards.count > 1 and completes and not self.parking.settled:
            statuses, back = self.shards.statuses()
            if back:
                self._register_sources(back)
            self.parking.settle(statuses, self.shards.store_ids)

    def begin_batch(
        self, parts: list[FTKafkaPartition], end: Position, complete: Position | None
    ) -> tuple[list[FTKafkaPartition], CheckpointAnswers]:
        """The batch of `parts` that ends at barrier `end` begins, on each shard in one
        request (BATCH_BEGIN, one round trip where three were: BATCH_RANGES,
        CHECKPOINT_BEGIN and FETCH_REPLAY): its ranges opened and numbered (FT on by
        range, `open_ranges`), its barrier begun (with `complete`, the batch before
        completes first: `checkpoint`), and in barrier mode the replays it takes in
        fetched and handed to `parts` (.given). Returns `parts` so completed and the
        shards' answers to the barrier.

        A shard with ranges to open must answer (SourceError otherwise: the batch's
        rows cannot be emitted before their range is stored). One without may fail: it
        is logged, the next batch's barrier covers this one, and its readers fetch
        their replays. An answer from another store than `end` names does not count
        (`_checkpoint_call`), and its replays are not handed over."""
        self._settle_parked(completes=complete is not None)
        tree = self.options.completion == "tree"
        fetch = self.options.completion == "barrier" and bool(parts) and parts[0].replays()
        bounds = {shard: (lo, hi) for shard, lo, hi in (parts[0].replays() if fetch else [])}
        replay_sources = sorted({p.source_id for p in parts})
        numbers = [p.range_number for p in parts]
        reports: list[CheckpointReport | None] = []
        found: list[ReplayRecords | None] = [None] * self.shards.count
        kept = None if complete is None else same_stores(complete, end)
        for shard in range(self.shards.count):
            rows, ranges = self._shard_ranges(parts, shard) if self.options.by_range else ([], [])
            store = None if end.stores is None else end.stores[shard]
            if shard in self.shards.stalled or store not in (None, self.shards.store_ids[shard]):
                reports.append(None)  # down: its barriers when it is back; lost: gone
                if ranges:  # the rows still need their ranges' numbers (`open_ranges`)
                    given = self.shards.call(
                        shard,
                        "open the batch's ranges in the FT layer",
                        partial(_register_ranges, ranges, tree),
                    )
                    for i, number in zip(rows, given, strict=True):
                        numbers[i] = number
                continue
            done = None
            if complete is not None and kept is not None and kept[shard]:
                done = self.shard_map.part(complete, shard)
            call = partial(
                self._begin_call,
                store,
                self.shard_map.part(end, shard),
                done,
                ranges,
                tree,
                bounds.get(shard),
                replay_sources,
            )
            what = f"begin the batch of {self.options.checkpoint_query!r}"
            started: tuple[BatchStart, bool] | None = None
            if ranges:
                started = self.shards.call(shard, what, call)
            else:
                try:
                    started = self.shards.quick(shard, what, call)
                except SourceError as exc:
                    log.warning("%s (covered by the next batch's checkpoint)", exc)
            if started is None:
                reports.append(None)
                continue
            start, counts = started
            reports.append(start.checkpoint if counts else None)
            for i, number in zip(rows, start.range_numbers, strict=True):
                numbers[i] = number
            if counts and shard in bounds:
                found[shard] = start.replays
        if self.options.by_range:
            parts = [p.with_range(n) for p, n in zip(parts, numbers, strict=True)]
        answers = CheckpointAnswers(tuple(reports), self.shard_map)
        if fetch and answers.answered:
            parts = hand_over(parts, found)
        return parts, answers

    def _begin_call(
        self,
        store: str | None,
        end: Position,
        complete: Position | None,
        ranges: list[tuple[int, str, int, int, int]],
        tree: bool,
        replays: tuple[int, int] | None,
        replay_sources: list[int],
        client: FTClient,
    ) -> tuple[BatchStart, bool]:
        """The shard's answers, and whether they count (`_checkpoint_call`)."""
        start = client.begin_batch(
            query=self.options.checkpoint_query,
            position=end.to_json(),
            sources=sorted(set(self.source_ids.values())),
            mode=self.options.checkpoint_mode,
            complete=None if complete is None else complete.to_json(),
            ranges=ranges,
            tree=tree,
            replays=replays,
            replay_sources=replay_sources,
        )
        return start, self._same_store(client, store)

    def _same_store(self, client: FTClient, store: str | None) -> bool:
        """Whether `client`'s answers came from `store` (None: any); a warning if not."""
        if store is None or self.shards.store_on(client, client.connections) == store:
            return True
        log.warning(
            "%s answered a checkpoint from another store than %s: the answer does not "
            "count (the next batch goes back to the group offsets of its partitions)",
            client.address,
            store,
        )
        return False

    def _checkpoint_call(
        self,
        store: str | None,
        end: Position,
        begin: bool,
        complete: Position | None,
        client: FTClient,
    ) -> CheckpointReport | None:
        """The shard's answer, None if it came from another store than `store`."""
        report = client.checkpoint(
            begin=begin,
            query=self.options.checkpoint_query,
            position=end.to_json(),
            sources=sorted(set(self.source_ids.values())),
            mode=self.options.checkpoint_mode,
            complete=None if complete is None else complete.to_json(),
        )
        return report if self._same_store(client, store) else None

    # ---- running batches ----

    def batch_running(self) -> None:
        """The batch whose barrier was just sent runs now: heartbeat for the query's
        sources until `batch_done` (FT on, ft.heartbeatMs > 0)."""
        self.parking.settled = False  # its tasks may park failures
        if not self.options.ft_on or not self.options.heartbeat_ms:
            return
        if not self._heartbeats:
            try:
                timeout = self._tree_timeout_s()
            except SourceError as exc:  # heartbeats are an optimization: the batch goes on
                log.warning("no heartbeats for this batch (its trees time out as usual): %s", exc)
                return
            interval = heartbeat_interval_s(self.options.heartbeat_ms, timeout)
            self._heartbeats = [  # one per shard: a shard that does not answer delays no other
                Heartbeat(
                    partial(self._heartbeat_client, shard, interval),
                    sorted(set(self.source_ids.values())),
                    interval,
                )
                for shard in range(self.shards.count)
            ]
        for heartbeat in self._heartbeats:
            heartbeat.running()

    def batch_done(self) -> None:
        """Spark asks for the next batch: the one before is done, heartbeats stop."""
        for heartbeat in self._heartbeats:
            heartbeat.idle()

    def _tree_timeout_s(self) -> float:
        """This query's tree timeout T: its ft.treeTimeoutMs, or the server's."""
        if self.options.timeout_s is not None:
            return self.options.timeout_s
        if self._server_timeout_s is None:
            status = self.shards.call(0, "read the FT layer's timeout", brief_status)
            self._server_timeout_s = status.timeout_s
        return self._server_timeout_s

    def _heartbeat_client(self, shard: int, interval_s: float) -> FTClient:
        """A heartbeat thread's own client: a heartbeat waits at most about a lease,
        and gives up reconnecting after an interval (the next one tries again)."""
        return self.shards.connect(
            shard,
            name="ftkafka-heartbeat",
            request_timeout=LEASE_INTERVALS * interval_s,
            reconnect_s=interval_s,
        )

    # ---- consumer-group offsets ----

    def commit_group(self, target: Mapping[str, Mapping[int, int]]) -> KafkaOffsets:
        """Commit these group offsets where they move forward; returns what it
        committed (.groups: a failure is logged and retried at the next commit)."""
        return self.group.commit(target)

    # ---- dead letters ----

    def deliver_dead_letters(self, *, every_s: float = 1.0) -> int:
        """With ft.deadLetterTopic: write this query's dead letters to the topic
        (.deadletters.DeadLetterDelivery). Returns how many were delivered."""
        return self.dead_letters.deliver(every_s=every_s)

    # ---- Kafka ----

    def _kafka(self, what: str, call: Callable[[], T]) -> T:
        retries, delay = self.options.kafka_retries, self.options.kafka_retry_interval_s
        began = time.monotonic()
        for attempt in range(retries + 1):
            try:
                return call()
            except (KafkaError, OSError, _NoFetchResponse) as exc:
                self._drop_consumer()
                if attempt == retries:
                    raise SourceError(
                        f"could not {what} from Kafka at {self.options.bootstrap} "
                        f"(kafka.bootstrap.servers): {retries + 1} attempts in "
                        f"{time.monotonic() - began:.1f} s, the last failed with {exc!r}"
                    ) from exc
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    def _client(self) -> Any:
        if self._consumer is None:
            config: dict[str, Any] = {
                "bootstrap_timeout_ms": _DRIVER_TIMEOUT_MS,
                "request_timeout_ms": _DRIVER_TIMEOUT_MS,
                "fetch_max_wait_ms": 20,
                "metadata_max_age_ms": 10_000,
                "max_partition_fetch_bytes": 1024 * 1024,
                "fetch_max_bytes": 1024 * 1024,
                **self.options.kafka_config,
            }
            self._consumer = new_consumer(self.options.bootstrap, config)
            # _ends polls only for the high watermark: the fetched batch is not decoded
            # (kafka-python's decoding made each probe cost 55 ms and 4.4 ms of CPU).
            probe_consumer(self._consumer)
        return self._consumer

    def _drop_consumer(self) -> None:
        consumer, self._consumer = self._consumer, None
        close_consumer(consumer)

    def _topic_partitions(self, check_exist: bool) -> dict[str, int]:
        """The partition count of every topic. `check_exist` asks the broker for all
        topics (a metadata request; at start); otherwise the consumer's metadata cache
        answers, refreshed every metadata_max_age_ms (10 s: new partitions show up)."""
        consumer = self._client()
        if check_exist:
            existing: set[str] = consumer.topics()
            missing = [t for t in self.options.topics if t not in existing]
            shown = sorted(existing)[:20]
            if missing:
                raise ConfigError(
                    f"option subscribe: topic(s) {missing} do not exist on "
                    f"{self.options.bootstrap}; it has {len(existing)} topic(s), e.g. {shown}"
                )
            dead = self.options.dead_letter_topic
            if dead is not None and dead not in existing:
                raise ConfigError(
                    f"option ft.deadLetterTopic: topic {dead!r} does not exist on "
                    f"{self.options.bootstrap} (create it first); it has {len(existing)} "
                    f"topic(s), e.g. {shown}"
                )
        counts: dict[str, int] = {}
        for topic in self.options.topics:
            partitions = sorted(consumer.partitions_for_topic(topic) or ())
            if not partitions or partitions != list(range(len(partitions))):
                raise SourceError(
                    f"topic {topic!r} on {self.options.bootstrap} has partitions {partitions}: "
                    "deleted while the query runs?"
                )
            counts[topic] = len(partitions)
        return counts

    def _earliest(self, tps: list[TopicPartition]) -> KafkaOffsets:
        found = self._client().beginning_offsets(tps, timeout_ms=self._timeout_ms())
        return _by_topic(found)

    def _ends(self, tps: list[TopicPartition]) -> KafkaOffsets:
        """High watermarks from a Fetch. ListOffsets(latest) gives a lower bound (exact
        on Kafka, the last batch's base offset + 1 on Tansu); seeking there, one fetch
        per partition returns at most that batch, and the high watermark."""
        consumer = self._client()
        consumer.unsubscribe()  # fresh partition states: no stale high watermark
        consumer.assign(tps)
        for tp, offset in consumer.end_offsets(tps, timeout_ms=self._timeout_ms()).items():
            consumer.seek(tp, offset)
        deadline = time.monotonic() + self._timeout_ms() / 1000
        marks: dict[TopicPartition, int] = {}
        while len(marks) < len(tps):
            if time.monotonic() > deadline:
                missing = sorted(f"{tp.topic}-{tp.partition}" for tp in tps if tp not in marks)
                raise _NoFetchResponse(f"no fetch response for {missing}")
            consumer.poll(timeout_ms=_PROBE_POLL_MS)
            for tp in tps:
                mark = consumer.highwater(tp)
                if mark is not None and tp not in marks:
                    marks[tp] = int(mark)
                    consumer.pause(tp)
        return _by_topic(marks)

    def _timeout_ms(self) -> int:
        return int(self.options.kafka_config.get("request_timeout_ms", _DRIVER_TIMEOUT_MS))

    # ---- FT layer ----

    def _register_sources(self, shards: list[int] | None = None) -> None:
        """Register every topic's source with these shards (None: every shard that is
        not down; one that is registers them when it is back)."""
        options = self.options
        if shards is None:
            shards = [s for s in range(self.shards.count) if s not in self.shards.down]
        for topic in options.topics:

            def register(client: FTClient, topic: str = topic) -> None:
                client.register_source(self._registration(topic))

            for shard in shards:
                self.shards.call(shard, f"register the source of topic {topic!r}", register)

    def _registration(self, topic: str) -> SourceRegistration:
        """What this query registers for `topic`'s source."""
        options = self.options
        return SourceRegistration(
            self.source_ids[topic],
            options.partitioner,
            self._partition_counts[topic],
            options.partitioner_options,
            options.timeout_s,
            options.retry,
            options.dead_letter_topic,
            options.completion,
            options.source_name,
        )

    def _replay_start(self) -> tuple[int, ...]:
        """A new query's replay cursors: where each shard pruned its sources' replay
        queue entries to (FTLayer.replay_start_of), so its first batch takes in every
        queued replay of its sources, such as those recovered after an FT-layer restart
        or restored from a savepoint."""
        statuses = self.shards.each("read the replay cursor", brief_status)
        self._server_timeout_s = statuses[0].timeout_s
        return tuple(s.replay_start_of(list(self.source_ids.values())) for s in statuses)

    def _replay_cursors(
        self, previous: tuple[int, ...] | None, stores: Sequence[str] | None = None
    ) -> tuple[list[int], list[BriefStatus | None]]:
        """Each shard's highest replay seq of this query's sources (see
        FTLayer.replay_cursor_of): other queries' failures do not move it, so they cause
        no empty batches here. The same reply gives each source's pending roots on the
        shard (`pending`, for flow control): one STATUS per shard and batch serves both.
        A shard that is down keeps its cursor at `previous` (the batch takes in none of
        its replays), and its partitions take in no records (`_admit`); one that is back
        has the sources registered again. Failures parked for a shard are delivered
        first (.parking), and a shard that must wait for them counts as down. Returns
        the cursors and each shard's STATUS (None: down, or held)."""
        statuses, back = self.shards.statuses()
        if back:
            self._register_sources(back)
        statuses = self.parking.settle(statuses, stores or self.shards.store_ids)
        sources = list(self.source_ids.values())
        cursors = list(previous or self._cursors or [0] * self.shards.count)
        self.pending = {t: [0] * self.shards.count for t in self.source_ids}
        for shard, status in enumerate(statuses):
            if status is None:
                continue
            self._fill_behind(shard, status)
            self._server_timeout_s = status.timeout_s
            cursors[shard] = status.replay_cursor_of(sources)
            for topic, source in self.source_ids.items():
                self.pending[topic][shard] = status.pending_of(source)
        self._cursors = tuple(cursors)
        return cursors, statuses

    def _fill_behind(self, shard: int, status: BriefStatus) -> None:
        """Have the filler's thread copy in the bytes of the failed records `status`
        shows the shard holding of this query's sources, while the batch this trigger
        plans runs (.filling: the trigger does not wait for Kafka's reads)."""
        unfilled = [s for s in sorted(set(self.source_ids.values())) if status.unfilled_of(s)]
        if unfilled:
            self.filler.request(shard, unfilled)

    def open_ranges(self, parts: list[FTKafkaPartition]) -> list[FTKafkaPartition]:
        """`parts` with the range numbers the FT layer gave their Kafka ranges (stored
        before this returns: BATCH_RANGES), one request per shard for the batch: each
        partition's range on the shard that owns it."""
        numbers = [p.range_number for p in parts]
        tree = self.options.completion == "tree"
        for shard in range(self.shards.count):
            rows, ranges = self._shard_ranges(parts, shard)
            if not ranges:
                continue
            given = self.shards.call(
                shard,
                "open the batch's ranges in the FT layer",
                partial(_register_ranges, ranges, tree),
            )
            for i, number in zip(rows, given, strict=True):
                numbers[i] = number
        return [p.with_range(n) for p, n in zip(parts, numbers, strict=True)]

    def _shard_ranges(
        self, parts: list[FTKafkaPartition], shard: int
    ) -> tuple[list[int], list[tuple[int, str, int, int, int]]]:
        """The indexes of the parts whose partition `shard` owns and their ranges
        (source id, topic, partition, start, end); none when none of them is new."""
        owner = self.shard_map.owner
        rows = [i for i, p in enumerate(parts) if owner(p.topic, p.partition) == shard]
        ranges = [
            (p.source_id, p.topic, p.partition, p.start, p.end) for p in (parts[i] for i in rows)
        ]
        if not any(end > start for _, _, _, start, end in ranges):
            return [], []  # nothing new on this shard: no range to open
        return rows, ranges

    def fill_failed(self, source_ids: list[int], shard: int | None = None) -> int:
        """Copy the bytes of these sources' failed records stored by reference from
        Kafka into the FT layer now, in this thread (into shard `shard`, or every
        shard): what a trigger hands to the filler's thread (.filling). Returns how
        many were copied. A Kafka error is logged and the rest waits for the next
        trigger."""
        if shard is None:
            return sum(self.fill_failed(source_ids, s) for s in range(self.shards.count))
        return self.filler.fill(source_ids, shard)


def share_out(budget: int, backlog: Mapping[_K, int]) -> dict[_K, int]:
    """At most `budget` records over partitions with these backlogs: every backlog if
    they fit; otherwise each partition's share in proportion to its backlog, rounded
    down, and the records left one each to the largest remainders (ties: the lower
    partition). The shares add up to min(budget, total backlog) exactly, and none
    exceeds its backlog."""
    total = sum(backlog.values())
    if total <= budget:
        return dict(backlog)
    shares = {k: budget * size // total for k, size in backlog.items()}
    left = budget - sum(shares.values())
    by_remainder = sorted(backlog, key=lambda k: (-(budget * backlog[k] % total), k))
    for k in by_remainder[:left]:
        shares[k] += 1
    return shares


def _whole_status(client: FTClient) -> Status:
    return client.status()


def _register_ranges(
    ranges: list[tuple[int, str, int, int, int]], tree: bool, client: FTClient
) -> list[int]:
    return client.register_ranges(ranges, tree=tree)


class _NoFetchResponse(Exception):
    """A driver fetch for high watermarks got no answer in time (retried)."""


def _by_topic(found: Mapping[Any, Any]) -> KafkaOffsets:
    offsets: KafkaOffsets = {}
    for tp, offset in found.items():
        if offset is None:
            raise _NoFetchResponse(f"no offset for {tp.topic}-{tp.partition}")
        offsets.setdefault(tp.topic, {})[tp.partition] = int(offset)
    return offsets
