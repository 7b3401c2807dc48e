"""Per-source counters and the complete latency of one FT layer.

`ftlayer status` and the server's /metrics show, per source, what it persisted,
completed, failed (by cause), replayed and dead-lettered, and its complete latency:
the time from a record's persist (the storage commit returned) to its tree's
completion, Storm's headline figure.

The complete latency costs no memory per pending root. Storage seqs grow in persist
order, so `PersistTimes`, a ring of (first seq of a persist call, clock when the call
returned), gives a completed record's persist time by np.searchsorted over the ring.
The ring takes at most one entry per `RESOLUTION_S` (a persist call within that of the
ring's newest entry shares its time, so a latency is overstated by less than
RESOLUTION_S) and keeps the newest `CAPACITY`, so it always reaches back at least
CAPACITY * RESOLUTION_S (131 s), further than the top bucket edge (100 s): a record
older than the ring lands in the +Inf bucket, where it belongs.

Only first attempts are measured. A replayed record keeps its storage seq, so its
persist time would add its failure, backoff and wait in the replay queue to the
figure. A completion is a replay when its record failed in this process (it has a
retry record) or was recovered at the start (its seq is below the first one this
process persisted); it counts in `completed`, not in the latency.

The histogram's bucket edges are fixed: the R10 preferred numbers (1, 1.25, 1.6, 2,
2.5, 3.15, 4, 5, 6.3, 8 per decade) from 100 µs to 100 s, kept per topic number (the
numbers of a source's topics are summed when read). A batch of completions costs a
searchsorted of its seqs over the ring (no sort: the ring is sorted) and a count per
ring entry it reaches; each entry's latency then takes one search over the edges:
O(completed log ring), vectorized (4 ms for 200,000 completions, against 9 ms
when they were sorted first).
Quantiles are estimated as Prometheus' histogram_quantile does (linear within a
bucket), so p50 and p99 lie within one bucket (28 % at most) of the true value; a quantile
above the top edge reads as the top edge. /metrics exports the edges 1, 2.5 and 5 of
each decade.

Not thread-safe: the core's owner serializes calls (the server's lock).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from ftlayer.status import LatencySummary, SourceFigures

__all__ = [
    "CAPACITY",
    "EDGES_S",
    "EXPORTED_EDGES_S",
    "RESOLUTION_S",
    "LatencyHistogram",
    "Meters",
    "PersistTimes",
    "SourceMeters",
    "total_latency",
]

RESOLUTION_S: Final = 0.001
CAPACITY: Final = 1 << 17

_R10: Final = ("1", "1.25", "1.6", "2", "2.5", "3.15", "4", "5", "6.3", "8")
EDGES_S: Final[NDArray[np.float64]] = np.array(
    [float(f"{m}e{e}") for e in range(-4, 2) for m in _R10] + [100.0]
)
"""Upper bounds (inclusive, as Prometheus' `le`) of the finite buckets, in seconds."""
EXPORTED_EDGES_S: Final[tuple[float, ...]] = (
    *(float(f"{m}e{e}") for e in range(-4, 2) for m in ("1", "2.5", "5")),
    100.0,
)
_EXPORTED: Final = np.searchsorted(EDGES_S, EXPORTED_EDGES_S)
_BUCKETS: Final = len(EDGES_S) + 1  # the last one: above the top edge (+Inf)
_CAUSES: Final = ("explicit", "timeout", "recovery", "source-expired")


class PersistTimes:
    """A ring of (first storage seq of a persist call, its clock time): see the module
    docstring for its resolution and reach."""

    def __init__(self, capacity: int = CAPACITY, resolution_s: float = RESOLUTION_S) -> None:
        self._seqs = np.zeros(capacity, dtype=np.uint64)
        self._times = np.zeros(capacity, dtype=np.float64)
        self._size = 0
        self._next = 0  # where the next entry goes; the newest is just before it
        self._resolution = resolution_s
        self.first_seq: int | None = None
        """The first seq this process persisted (None before its first persist)."""

    def __len__(self) -> int:
        return self._size

    def add(self, first_seq: int, now: float) -> None:
        """A persist call stored seqs from `first_seq` on, returning at `now`."""
        if self.first_seq is None:
            self.first_seq = first_seq
        if self._size and now - self._times[self._next - 1] < self._resolution:
            return
        self._seqs[self._next] = first_seq
        self._times[self._next] = now
        self._next = (self._next + 1) % len(self._seqs)
        self._size = min(self._size + 1, len(self._seqs))

    @property
    def oldest(self) -> float:
        """The time of the oldest entry (0.0 when empty)."""
        if not self._size:
            return 0.0
        return float(self._times[0 if self._size < len(self._seqs) else self._next])

    def times_of(self, seqs: NDArray[np.uint64]) -> NDArray[np.float64]:
        """The persist times of seqs this process persisted, in any order; NaN for one
        older than the ring."""
        at = self._entries(seqs)
        out = np.full(len(seqs), np.nan)
        known = at >= 0
        out[known] = self._times[at[known]]
        return out

    def entry_counts(
        self, seqs: NDArray[np.uint64]
    ) -> tuple[NDArray[np.float64], NDArray[np.int64], int]:
        """For seqs in any order: the persist times of the ring entries they fall in,
        how many fall in each, and how many are older than the ring. No sort: a search
        per seq over the ring, and a count per entry over the span of entries they
        reach (the few persist calls of the batch that completes)."""
        at = self._entries(seqs)
        known = at[at >= 0]
        older = len(seqs) - len(known)
        if not len(known):
            return np.zeros(0, dtype=np.float64), np.zeros(0, dtype=np.int64), older
        lo = int(known.min())
        counts = np.bincount(known - lo)
        hit = np.flatnonzero(counts)
        return self._times[lo + hit], counts[hit], older

    def _entries(self, seqs: NDArray[np.uint64]) -> NDArray[np.intp]:
        """Per seq, the index of its ring entry (the last whose first seq <= it), or -1
        for one older than the ring. The ring is one sorted run, or once it wrapped two:
        [next:] the older one, [:next] the newer."""
        seqs = np.asarray(seqs, dtype=np.uint64)
        if not self._size:
            return np.full(len(seqs), -1, dtype=np.intp)
        wrapped = self._size == len(self._seqs)
        if not wrapped or not self._next:  # one sorted run from index 0
            run = self._seqs[: self._size]
            return np.searchsorted(run, seqs, side="right").astype(np.intp) - 1
        at = np.empty(len(seqs), dtype=np.intp)
        newer = seqs >= self._seqs[0]
        at[newer] = np.searchsorted(self._seqs[: self._next], seqs[newer], side="right") - 1
        older_run = self._seqs[self._next :]
        found = np.searchsorted(older_run, seqs[~newer], side="right") - 1
        at[~newer] = np.where(found >= 0, found + self._next, -1)
        return at


@dataclass(slots=True)
class LatencyHistogram:
    """Bucket counts over EDGES_S (the last bucket is +Inf) and the sum, in seconds."""

    counts: NDArray[np.int64] = field(default_factory=lambda: np.zeros(_BUCKETS, np.int64))
    sum_s: float = 0.0

    @property
    def count(self) -> int:
        return int(self.counts.sum())

    def quantile(self, q: float) -> float | None:
        """The q-quantile (0 < q < 1), interpolated within its bucket as Prometheus'
        histogram_quantile does; the top edge if it lies above; None if empty."""
        total = self.count
        if not total:
            return None
        cumulative = np.cumsum(self.counts)
        bucket = int(np.searchsorted(cumulative, q * total, side="left"))
        if bucket >= len(EDGES_S):
            return float(EDGES_S[-1])
        below = int(cumulative[bucket - 1]) if bucket else 0
        lower = float(EDGES_S[bucket - 1]) if bucket else 0.0
        upper = float(EDGES_S[bucket])
        inside = int(self.counts[bucket])
        return lower + (upper - lower) * (q * total - below) / inside

    def exported(self) -> list[tuple[float, int]]:
        """(le, cumulative count) at EXPORTED_EDGES_S, then (inf, count): a Prometheus
        histogram's buckets."""
        cumulative = np.cumsum(self.counts)
        buckets = [(float(EDGES_S[i]), int(cumulative[i])) for i in _EXPORTED.tolist()]
        return [*buckets, (float("inf"), int(cumulative[-1]))]

    def summary(self) -> LatencySummary:
        """Count, sum and the two quantiles STATUS shows (ftlayer.status, which writes
        their JSON form); the quantiles None when nothing was measured."""
        return LatencySummary(
            count=self.count,
            sum_s=round(self.sum_s, 6),
            p50_s=_rounded(self.quantile(0.5)),
            p99_s=_rounded(self.quantile(0.99)),
        )

    def add(self, other: LatencyHistogram) -> None:
        self.counts += other.counts
        self.sum_s += other.sum_s


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 7)


@dataclass(slots=True)
class SourceMeters:
    """One source's counters since the start and its complete latency."""

    persisted: int = 0
    completed: int = 0
    failed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_CAUSES, 0))
    replayed: int = 0
    dead_lettered: int = 0
    latency: LatencyHistogram = field(default_factory=LatencyHistogram)

    def figures(self, replay_queue: int, unfilled: int = 0) -> SourceFigures:
        """The STATUS figures of the source (docs/protocol.md, 6.2, `by_source`), with its
        replay queue entries and unfilled records now; ftlayer.status writes their one
        JSON form."""
        return SourceFigures(
            persisted=self.persisted,
            completed=self.completed,
            failed=dict(self.failed),
            replayed=self.replayed,
            dead_lettered=self.dead_lettered,
            replay_queue=replay_queue,
            unfilled=unfilled,
            complete_latency=self.latency.summary(),
        )


class Meters:
    """The counters of one FT layer by source, and the complete latency by topic
    number (see the module docstring). The core calls `persisted`, `completed`,
    `failed`, `replayed` and `dead_lettered`; `by_source` reads them."""

    def __init__(self, capacity: int = CAPACITY, resolution_s: float = RESOLUTION_S) -> None:
        self.persist_times = PersistTimes(capacity, resolution_s)
        self._persisted: dict[int, int] = {}
        self._failed: dict[str, dict[int, int]] = {cause: {} for cause in _CAUSES}
        self._replayed: dict[int, int] = {}
        self._dead_lettered: dict[int, int] = {}
        # Per topic number: completions, latency bucket counts (flat, _BUCKETS per
        # number) and latency sums.
        self._completed = np.zeros(0, dtype=np.int64)
        self._counts = np.zeros(0, dtype=np.int64)
        self._sums = np.zeros(0, dtype=np.float64)

    def persisted(self, source_ids: NDArray[Any], first_seq: int, now: float) -> None:
        """A persist call stored these records (seqs from `first_seq` on) by `now`."""
        if len(source_ids):
            self.persist_times.add(first_seq, now)
            _count(self._persisted, source_ids)

    def ranged(self, source_id: int, n: int) -> None:
        """A batch range of `n` records opened (counted persisted: ftlayer.core.ranges)."""
        self._persisted[source_id] = self._persisted.get(source_id, 0) + n

    def range_completed(self, number: int, n: int, latency_s: float | None = None) -> None:
        """`n` records of a batch range of topic number `number` completed: with their
        batch (barrier mode, no latency), or each with its tree (tree mode: `latency_s`,
        from the range's opening, for all `n`)."""
        self._grow(number + 1)
        self._completed[number] += n
        if latency_s is not None:
            latency = max(latency_s, 0.0)
            bucket = int(np.searchsorted(EDGES_S, latency, side="left"))
            self._counts[number * _BUCKETS + bucket] += n
            self._sums[number] += latency * n

    def failed(self, cause: str, source_ids: NDArray[Any]) -> None:
        _count(self._failed[cause], source_ids)

    def replayed(self, source_ids: NDArray[Any]) -> None:
        """These records entered the replay queue (each got a replay seq)."""
        _count(self._replayed, source_ids)

    def dead_lettered(self, source_ids: NDArray[Any]) -> None:
        _count(self._dead_lettered, source_ids)

    def completed(
        self,
        seqs: NDArray[np.uint64],
        numbers: NDArray[Any],
        replays: Iterable[int] | None,
        now: float,
    ) -> None:
        """Trees completed at `now`: their records' storage seqs and topic numbers;
        `replays`: the seqs among them that are replays (failed in this process)."""
        if not len(seqs):
            return
        numbers = numbers.astype(np.intp, copy=False)
        per_number = np.bincount(numbers)
        self._grow(len(per_number))
        self._completed[: len(per_number)] += per_number
        first = self.persist_times.first_seq
        if first is None:
            return  # nothing persisted by this process: every one was recovered
        measured = seqs >= first
        if replays is not None:
            replayed = np.fromiter(replays, dtype=np.uint64)
            if len(replayed):
                measured &= ~np.isin(seqs, replayed)
        if not bool(measured.all()):
            seqs, numbers = seqs[measured], numbers[measured]
            per_number = np.bincount(numbers, minlength=len(per_number))
        present = np.flatnonzero(per_number).tolist()
        if len(present) == 1:  # the usual case: one source and topic per batch
            self._measure(present[0], seqs, now)
        else:
            for number in present:
                self._measure(number, seqs[numbers == number], now)

    def _measure(self, number: int, seqs: NDArray[np.uint64], now: float) -> None:
        """Add the latencies of one topic number's completions: each ring entry they
        fall in is one latency for all of its seqs, so the buckets cost a search per
        entry, not per record (a bucket's upper edge is inclusive, as Prometheus'
        `le`)."""
        times, counts, unknown = self.persist_times.entry_counts(seqs)
        latencies = np.maximum(now - times, 0.0)
        buckets = np.searchsorted(EDGES_S, latencies, side="left")
        row = self._counts[number * _BUCKETS : (number + 1) * _BUCKETS]
        row += np.bincount(buckets, weights=counts, minlength=_BUCKETS).astype(np.int64)
        row[-1] += unknown
        total = float(latencies @ counts)
        if unknown:  # at least as old as the ring reaches
            total += unknown * max(0.0, now - self.persist_times.oldest)
        self._sums[number] += total

    def _grow(self, rows: int) -> int:
        """Room for topic numbers below `rows`; returns the rows held."""
        have = len(self._completed)
        if rows > have:
            more = rows - have
            self._completed = np.concatenate([self._completed, np.zeros(more, np.int64)])
            self._counts = np.concatenate([self._counts, np.zeros(more * _BUCKETS, np.int64)])
            self._sums = np.concatenate([self._sums, np.zeros(more, np.float64)])
            return rows
        return have

    def by_source(self, number_sources: NDArray[Any]) -> dict[int, SourceMeters]:
        """Every source's meters; `number_sources[n]` is the source id of topic number
        n (PersistenceLayer.number_sources)."""
        out: dict[int, SourceMeters] = {}

        def of(source_id: int) -> SourceMeters:
            found = out.get(source_id)
            if found is None:
                found = out[source_id] = SourceMeters()
            return found

        counts = self._counts.reshape(-1, _BUCKETS)
        for number, source_id in enumerate(number_sources.tolist()):
            meters = of(int(source_id))
            if number < len(self._completed):
                meters.completed += int(self._completed[number])
                meters.latency.counts += counts[number]
                meters.latency.sum_s += float(self._sums[number])
        for source_id, n in self._persisted.items():
            of(source_id).persisted = n
        for cause, by_source in self._failed.items():
            for source_id, n in by_source.items():
                of(source_id).failed[cause] = n
        for source_id, n in self._replayed.items():
            of(source_id).replayed = n
        for source_id, n in self._dead_lettered.items():
            of(source_id).dead_lettered = n
        return dict(sorted(out.items()))


def total_latency(sources: Mapping[int, SourceMeters]) -> LatencyHistogram:
    """The complete latency of every source together."""
    total = LatencyHistogram()
    for meters in sources.values():
        total.add(meters.latency)
    return total


def _count(counter: dict[int, int], source_ids: NDArray[Any]) -> None:
    if not len(source_ids):
        return
    first = int(source_ids[0])
    if bool((source_ids == first).all()):
        counter[first] = counter.get(first, 0) + len(source_ids)
        return
    ids, counts = np.unique(source_ids, return_counts=True)
    for source_id, n in zip(ids.tolist(), counts.tolist(), strict=True):
        counter[int(source_id)] = counter.get(int(source_id), 0) + int(n)
