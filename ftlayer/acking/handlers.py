"""Handlers: the FT work sources and tasks do around user code.

Every record in the pipeline carries anchors: (root id, record id) pairs. A source
record, and every record derived from exactly one input, carries one pair; a record
derived from several inputs (an aggregate: multi-anchoring) carries one pair per input
it was derived from, each under that input's root.

- Persister (sources): before records are emitted, draws a root id and a record id for
  each, and persists the records with their first ack value set to that record id, so
  the source needs no separate XOR event.
- TaskHandler (tasks; the blueprint's AnchorHandler and XorHandler together): for a
  batch of inputs and the outputs derived from them, draws a fresh id for every
  (input, output) edge, gives each output its pairs (anchoring), and sends one XOR
  event per input pair, as Storm does: the pair's record id XOR the ids of every edge
  leaving that input. Inputs that failed (FailException) send a fail for their roots
  instead, and must have no outputs. A terminal task (a sink) is a task with no outputs.
- XorHandler: holds a task attempt's XOR and fail events and sends them at its end.

A task's handler holds the task attempt's events (XorHandler) until the partition
ends; the process's BatchingChannel then batches the events of every task of the
worker into few frames. Both hold them in an EventBuffer (ftlayer.acking.events).

With FT off, NoFTPersister and NoFTTaskHandler do nothing at all; the wrappers of the
integration package do not even build anchors then.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ftlayer.acking.events import EventBuffer
from ftlayer.acking.ids import new_ids
from ftlayer.causes import Cause, Causes
from ftlayer.errors import ConfigError, FailException
from ftlayer.records import RecordBatch
from ftlayer.shards import partition_shard

__all__ = [
    "Anchors",
    "FTChannel",
    "FailException",
    "NoFTPersister",
    "NoFTTaskHandler",
    "Persister",
    "TaskHandler",
    "XorHandler",
    "handlers",
]


class FTChannel(Protocol):
    """Where handlers send their work: the FT layer itself, or a client of its server."""

    def persist(self, batch: RecordBatch, initial_values: ArrayLike | None = None) -> None: ...

    def xor(self, roots: ArrayLike, values: ArrayLike) -> object: ...

    def fail(self, roots: ArrayLike, causes: Causes | Cause | None = None) -> object: ...


@dataclass(frozen=True, slots=True)
class Anchors:
    """The anchors of a batch of records, in CSR form: record i carries the pairs
    (roots[k], ids[k]) for offsets[i] <= k < offsets[i + 1]."""

    offsets: NDArray[np.int64]
    roots: NDArray[np.uint64]
    ids: NDArray[np.uint64]
    known_single: bool = field(default=False, compare=False, repr=False)
    """Made by `single`: one pair per record without checking the offsets."""

    @classmethod
    def single(cls, roots: ArrayLike, ids: ArrayLike) -> Anchors:
        """One pair per record."""
        r = np.ascontiguousarray(roots, dtype=np.uint64)
        i = np.ascontiguousarray(ids, dtype=np.uint64)
        if len(r) != len(i):
            raise ConfigError(f"anchors: {len(r)} roots but {len(i)} ids")
        return cls(np.arange(len(r) + 1, dtype=np.int64), r, i, True)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def is_single(self) -> bool:
        """True if every record carries exactly one pair."""
        if self.known_single:
            return True
        n = len(self)
        return len(self.roots) == n and bool(
            np.array_equal(self.offsets, np.arange(n + 1, dtype=self.offsets.dtype))
        )

    def take(self, index: ArrayLike) -> Anchors:
        """The anchors of the records at `index` (integer positions or a boolean mask)."""
        rows = np.asarray(index)
        rows = np.flatnonzero(rows) if rows.dtype == np.bool_ else rows.astype(np.intp)
        if self.is_single:
            return Anchors.single(self.roots[rows], self.ids[rows])
        pair, counts = _pair_positions(self.offsets, rows)
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        return Anchors(offsets, self.roots[pair], self.ids[pair])

    def merged(self) -> Anchors:
        """The same anchors with one pair per (record, root): pairs of one root are
        merged into one whose id is the XOR of theirs.

        An aggregate of several records of one tree carries several pairs of that root
        (one per edge into it). Acking it XORs all of their ids into the root, which the
        merged pair does at once. But a child must get each new id once per root: with
        two pairs of one root it would be XOR-ed in twice, cancel, and let the root
        complete while the child is still in flight."""
        if self.is_single:
            return self
        n_pairs = len(self.roots)
        record = np.repeat(np.arange(len(self), dtype=np.intp), np.diff(self.offsets))
        order = np.lexsort((self.roots, record))
        roots, record, ids = self.roots[order], record[order], self.ids[order]
        first = np.ones(n_pairs, dtype=np.bool_)
        first[1:] = (roots[1:] != roots[:-1]) | (record[1:] != record[:-1])
        if bool(first.all()):
            return self
        starts = np.flatnonzero(first)
        offsets = np.zeros(len(self) + 1, dtype=np.int64)
        np.cumsum(np.bincount(record[starts], minlength=len(self)), out=offsets[1:])
        return Anchors(offsets, roots[starts], np.bitwise_xor.reduceat(ids, starts))

    def pairs(self, i: int) -> list[tuple[int, int]]:
        """The (root, id) pairs of record i."""
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        return list(zip(self.roots[lo:hi].tolist(), self.ids[lo:hi].tolist(), strict=True))


def _pair_positions(
    offsets: NDArray[np.int64], rows: NDArray[np.intp]
) -> tuple[NDArray[np.intp], NDArray[np.int64]]:
    """Where the pairs of records `rows` are (concatenated in row order), and how many
    each record has."""
    counts = np.diff(offsets)[rows]
    first = np.repeat(np.cumsum(counts) - counts, counts)
    pair = np.repeat(offsets[:-1][rows], counts) + (np.arange(int(counts.sum())) - first)
    return pair.astype(np.intp), counts


class XorHandler:
    """A task attempt's events: held until flush() (the end of the task's partition) or
    until `flush_events` are held, so an attempt that dies midway has usually sent
    nothing (its trees then complete through the retry, not by timeout)."""

    def __init__(self, channel: FTChannel, *, flush_events: int = 65536) -> None:
        self._channel = channel
        self._flush_events = flush_events
        self._buffer = EventBuffer()

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def xor(self, roots: NDArray[np.uint64], values: NDArray[np.uint64]) -> None:
        self._buffer.add_xor(roots, values)
        if len(self._buffer) >= self._flush_events:
            self.flush()

    def fail(self, roots: NDArray[np.uint64], causes: Causes | Cause | None = None) -> None:
        self._buffer.add_fail(roots, causes)

    def flush(self) -> None:
        """Send the held fails, then the held XOR events (EventBuffer.drain's order)."""
        fails, roots, values, causes = self._buffer.drain()
        if len(fails):
            self._channel.fail(fails, causes)
        if len(roots):
            self._channel.xor(roots, values)


class Persister:
    """Source side: persist records before they are emitted; returns their anchors."""

    def __init__(
        self, channel: FTChannel, *, source_id: int = 0, barrier: bool = False, shards: int = 1
    ) -> None:
        self._channel = channel
        self.source_id = source_id
        self.shards = shards
        """The FT layer's shards: each record's root is drawn in the shard of its
        partition (ftlayer.shards), which its channel sends it to."""
        self.barrier = barrier
        """Barrier mode (ftlayer.core.barrier): the emission ids persisted as first ack
        values are the roots' barrier holds, and the emitted rows carry record id 0,
        which tells every step downstream to send no XOR events for them."""

    def persist(
        self,
        payloads: Sequence[bytes],
        *,
        topics: Sequence[str] | str,
        partitions: ArrayLike,
        offsets: ArrayLike,
        key_hashes: ArrayLike | None = None,
        has_key: ArrayLike | None = None,
        references: bool = False,
    ) -> Anchors:
        """Persist one batch of source records; returns one (root, id) pair per record.

        Returns only once the channel confirmed the records are stored, so a source
        that emits after this call never emits an unpersisted record. `references`:
        the payloads are empty and the records are stored by reference (their bytes
        stay in the source, at their coordinates; ftlayer.core.fills).
        """
        n = len(payloads)
        roots, ids = self._roots(partitions, n), new_ids(n)
        batch = RecordBatch.build(
            roots,
            payloads,
            source_ids=self.source_id,
            key_hashes=key_hashes,
            has_key=has_key,
            topics=topics,
            partitions=partitions,
            offsets=offsets,
            references=references or None,
        )
        self._channel.persist(batch, ids)
        return Anchors.single(roots, np.zeros(n, np.uint64) if self.barrier else ids)

    def _roots(self, partitions: ArrayLike, n: int) -> NDArray[np.uint64]:
        """`n` fresh roots, each in the shard of its record's partition."""
        if self.shards == 1:
            return new_ids(n)
        owners = partition_shard(self.source_id, np.broadcast_to(partitions, (n,)), self.shards)
        roots = np.empty(n, dtype=np.uint64)
        for shard in np.unique(owners).tolist():
            rows = np.flatnonzero(owners == shard)
            roots[rows] = new_ids(len(rows), shard, self.shards)
        return roots

    def emit_replays(self, roots: ArrayLike) -> Anchors:
        """Anchors for replayed records about to be emitted again (from
        FTLayer.fetch_replay): a fresh record id under each replay root, whose XOR
        event is sent now (a replayed root waits at ack value 0 for it). A re-run (a
        retried task, a batch run again) fetches the replay again under a fresh root
        (ftlayer.core.takeover), so the earlier run's emission cannot hold the re-run's
        tree; a broadcast replay keeps its root, each partition's copy a child of it."""
        replay_roots = np.ascontiguousarray(roots, dtype=np.uint64)
        if self.barrier:  # the FT layer held them when the batch fetched them
            return Anchors.single(replay_roots, np.zeros(len(replay_roots), np.uint64))
        ids = new_ids(len(replay_roots))
        if len(ids):
            self._channel.xor(replay_roots, ids)
        return Anchors.single(replay_roots, ids)


class NoFTPersister:
    """FT off: persists nothing, anchors nothing."""

    source_id = 0

    def persist(self, payloads: Sequence[bytes], **_: object) -> None:
        return None


class _RecordScope:
    """One input record being processed one at a time (see TaskHandler.anchor)."""

    def __init__(self, pairs: Sequence[tuple[int, int]]) -> None:
        merged: dict[int, int] = {}
        for root, record_id in pairs:  # one pair per root: see Anchors.merged
            merged[root] = merged.get(root, 0) ^ record_id
        self.pairs = list(merged.items())
        self.edges = np.uint64(0)
        self.barrier = all(record_id == 0 for _, record_id in pairs)
        """Barrier mode (record ids 0): outputs get id 0, and no event is sent."""

    def emit(self) -> list[tuple[int, int]]:
        """Anchors for a new output record derived from this input."""
        if self.barrier:
            return [(root, 0) for root, _ in self.pairs]
        edge = new_ids(1)[0]
        self.edges ^= edge
        return [(root, int(edge)) for root, _ in self.pairs]


class TaskHandler:
    """Task side: anchoring and combined XOR events for batches of inputs.

    `hand_over=True`: an input with one anchor pair and exactly one output (a map's
    row, a row a filter keeps) hands its record id to that output instead of drawing a
    fresh one, and sends no XOR event: the id stays outstanding in its tree until the
    output (or a row derived from it) is acked, which is what acking the input and
    anchoring a fresh id would have left, in one event less per step. Every other
    input (several outputs, none, several pairs) is processed as without it. The
    integration's task wrappers use it (a row has exactly one consumer there); a
    handler whose outputs may be consumed more than once must not.

    The hand-over has two paths, one rule: `pass_through` is the fast path of the
    wrappers' commonest steps (a map with one output per input, a filter), where every
    row keeps its FT columns as they are and nothing is computed per row (only a
    filter's dropped rows of a tree send their acks); `process` covers every other
    step, and hands over, inside `_process`, exactly the inputs `_handed_over` finds
    with one pair and one output. Both leave the same tree state: a kept row's id
    stays outstanding until its output is acked.
    """

    def __init__(self, channel: XorHandler | FTChannel, *, hand_over: bool = False) -> None:
        self._events = channel if isinstance(channel, XorHandler) else XorHandler(channel)
        self._hand_over = hand_over

    def process(
        self,
        inputs: Anchors,
        parents: ArrayLike,
        failed: ArrayLike | None = None,
        causes: Causes | Cause | None = None,
    ) -> Anchors:
        """Inputs processed into outputs, output j derived from input parents[j].

        map: parents = arange(n); flat_map: each input's index once per output;
        filter: the indices of the kept inputs; a sink: no outputs. Inputs marked in
        `failed` have their roots failed, with `causes` (one for all, or one per
        input; a root failed by several inputs takes the first one's). Returns the
        outputs' anchors.
        """
        edge_parent = np.ascontiguousarray(parents, dtype=np.intp)
        edge_child = np.arange(len(edge_parent), dtype=np.intp)
        return self._process(inputs, edge_parent, edge_child, len(edge_parent), failed, causes)

    def process_grouped(
        self,
        inputs: Anchors,
        groups: ArrayLike,
        n_groups: int,
        failed: ArrayLike | None = None,
        causes: Causes | Cause | None = None,
    ) -> Anchors:
        """Multi-anchoring: output g is derived from every input i with groups[i] == g
        (an aggregation). Failed inputs are left out of their group's output."""
        group = np.ascontiguousarray(groups, dtype=np.intp)
        if len(group) != len(inputs):
            raise ConfigError(f"process_grouped: {len(inputs)} inputs but {len(group)} groups")
        edge_parent = np.arange(len(inputs), dtype=np.intp)
        if failed is not None:
            edge_parent = edge_parent[~np.asarray(failed, dtype=np.bool_)]
        return self._process(inputs, edge_parent, group[edge_parent], n_groups, failed, causes)

    def _process(
        self,
        inputs: Anchors,
        edge_parent: NDArray[np.intp],
        edge_child: NDArray[np.intp],
        n_children: int,
        failed: ArrayLike | None,
        causes: Causes | Cause | None = None,
    ) -> Anchors:
        inputs = inputs.merged()  # one pair per (input, root): see Anchors.merged
        if len(inputs.ids) and not inputs.ids.any():
            return self._process_barrier(
                inputs, edge_parent, edge_child, n_children, failed, causes
            )
        n = len(inputs)
        counts = np.diff(inputs.offsets)
        single = inputs.is_single
        pair_input = np.arange(n, dtype=np.intp) if single else np.repeat(np.arange(n), counts)
        handed = self._handed_over(inputs, edge_parent, counts, single)
        if handed is None:
            edges = new_ids(len(edge_parent))
            combined = np.zeros(n, dtype=np.uint64)
            np.bitwise_xor.at(combined, edge_parent, edges)
            values = inputs.ids ^ combined[pair_input]
            sends = None
        else:
            # Handed-over edges carry their input's id; only the other inputs send.
            handed_edge = handed[edge_parent]
            edges = np.empty(len(edge_parent), dtype=np.uint64)
            edges[handed_edge] = inputs.ids[inputs.offsets[:-1][edge_parent[handed_edge]]]
            fresh = ~handed_edge
            edges[fresh] = new_ids(int(np.count_nonzero(fresh)))
            combined = np.zeros(n, dtype=np.uint64)
            np.bitwise_xor.at(combined, edge_parent[fresh], edges[fresh])
            values = inputs.ids ^ combined[pair_input]
            sends = ~handed[pair_input]
        if failed is not None:
            ok = ~self._fail_inputs(inputs, pair_input, edge_parent, failed, causes)
            sends = ok if sends is None else sends & ok
        if sends is None:
            self._events.xor(inputs.roots, values)
        elif sends.any():
            self._events.xor(inputs.roots[sends], values[sends])
        # Anchoring: each output gets, per edge into it, the edge id under every root
        # of the edge's input.
        if single:
            roots, ids, child = inputs.roots[edge_parent], edges, edge_child
        else:
            pair, per_edge = _pair_positions(inputs.offsets, edge_parent)
            edge_of_pair = np.repeat(np.arange(len(edge_parent)), per_edge)
            roots, ids, child = inputs.roots[pair], edges[edge_of_pair], edge_child[edge_of_pair]
        if len(child) > 1 and bool((np.diff(child) < 0).any()):
            order = np.argsort(child, kind="stable")
            roots, ids, child = roots[order], ids[order], child[order]
        offsets = np.zeros(n_children + 1, dtype=np.int64)
        np.cumsum(np.bincount(child, minlength=n_children), out=offsets[1:])
        return Anchors(offsets, roots, ids)

    def pass_through(self, inputs: Anchors, kept: NDArray[np.bool_] | None = None) -> bool:
        """The rows of `inputs` that `kept` marks (all without it) become one output
        each, carrying their anchors unchanged (a map with one output per input, a
        filter's kept rows); the others are dropped (acked), and none failed. The
        caller keeps the rows' FT columns as they are. Returns False, having done
        nothing, when that cannot be: hand_over off, or a row with several pairs; then
        call `process`. Rows of barrier-mode sources (record id 0) send nothing; a
        dropped row of a tree sends its id, as `process` would."""
        if not self._hand_over or not inputs.is_single:
            return False
        if kept is not None and not kept.all():
            dropped = ~kept
            roots, ids = inputs.roots[dropped], inputs.ids[dropped]
            tree = ids != 0
            if tree.all():
                self._events.xor(roots, ids)
            elif tree.any():
                self._events.xor(roots[tree], ids[tree])
        return True

    def _handed_over(
        self,
        inputs: Anchors,
        edge_parent: NDArray[np.intp],
        counts: NDArray[np.int64],
        single: bool,
    ) -> NDArray[np.bool_] | None:
        """Which inputs hand their id over to their one output (see the class
        docstring); None when none does, or hand_over is off."""
        if not self._hand_over or not len(edge_parent):
            return None
        handed = np.bincount(edge_parent, minlength=len(inputs)) == 1
        if not single:
            handed &= counts == 1
        return handed if handed.any() else None

    def _fail_inputs(
        self,
        inputs: Anchors,
        pair_input: NDArray[np.intp],
        edge_parent: NDArray[np.intp],
        failed: ArrayLike,
        causes: Causes | Cause | None,
    ) -> NDArray[np.bool_]:
        """Fail the roots of the inputs marked in `failed` (a root failed by several
        inputs takes the first one's cause); returns which anchor pairs failed."""
        n = len(inputs)
        failed_mask = np.asarray(failed, dtype=np.bool_)
        if len(failed_mask) != n:
            raise ConfigError(f"{n} inputs but {len(failed_mask)} failed flags")
        if bool(failed_mask[edge_parent].any()):
            raise ConfigError("a failed input cannot have outputs")
        bad = failed_mask[pair_input]
        if bool(bad.any()):
            roots, first = np.unique(inputs.roots[bad], return_index=True)
            if isinstance(causes, Causes):
                if len(causes) != n:
                    raise ConfigError(f"{n} inputs but {len(causes)} causes")
                causes = causes.take(pair_input[bad][first])
            self._events.fail(roots, causes)
        return bad

    def _process_barrier(
        self,
        inputs: Anchors,
        edge_parent: NDArray[np.intp],
        edge_child: NDArray[np.intp],
        n_children: int,
        failed: ArrayLike | None,
        causes: Causes | Cause | None,
    ) -> Anchors:
        """Inputs of barrier-mode sources (record id 0 everywhere): their trees
        complete at the barrier, so no XOR event is sent; only failed inputs fail their
        roots. Outputs carry their parents' roots, with record id 0."""
        n = len(inputs)
        counts = np.diff(inputs.offsets)
        pair_input = np.repeat(np.arange(n), counts)
        if failed is not None:
            self._fail_inputs(inputs, pair_input, edge_parent, failed, causes)
        if inputs.is_single:
            roots, child = inputs.roots[edge_parent], edge_child
        else:
            pair, per_edge = _pair_positions(inputs.offsets, edge_parent)
            roots = inputs.roots[pair]
            child = edge_child[np.repeat(np.arange(len(edge_parent)), per_edge)]
        if len(child) > 1 and bool((np.diff(child) < 0).any()):
            order = np.argsort(child, kind="stable")
            roots, child = roots[order], child[order]
        offsets = np.zeros(n_children + 1, dtype=np.int64)
        np.cumsum(np.bincount(child, minlength=n_children), out=offsets[1:])
        return Anchors(offsets, roots, np.zeros(len(roots), dtype=np.uint64))

    @contextmanager
    def anchor(self, pairs: Sequence[tuple[int, int]]) -> Iterator[_RecordScope]:
        """Process one input record: `with handler.anchor(pairs) as rec: rec.emit()`.

        On normal exit the input is acked (one combined event per pair); on
        FailException its roots fail and the exception is swallowed, so the caller
        moves on to the next record. Any other exception propagates, unacked: the
        tree then times out, unless the caller fails it.
        """
        scope = _RecordScope(pairs)
        try:
            yield scope
        except FailException as exc:
            roots = np.array(sorted({r for r, _ in scope.pairs}), dtype=np.uint64)
            self._events.fail(roots, Cause.of_exception(exc, "").clipped())
            return
        if scope.barrier:
            return
        roots = np.array([r for r, _ in scope.pairs], dtype=np.uint64)
        ids = np.array([i for _, i in scope.pairs], dtype=np.uint64)
        self._events.xor(roots, ids ^ scope.edges)

    def flush(self) -> None:
        """Send this task's events to its channel (at the end of its partition)."""
        self._events.flush()


class NoFTTaskHandler:
    """FT off: anchors nothing and sends nothing."""

    def pass_through(self, inputs: object, kept: object = None) -> bool:
        return True

    def process(
        self, inputs: object, parents: object, failed: object = None, causes: object = None
    ) -> None:
        return None

    def process_grouped(
        self,
        inputs: object,
        groups: object,
        n_groups: int,
        failed: object = None,
        causes: object = None,
    ) -> None:
        return None

    def flush(self) -> None:
        return None


def handlers(
    channel: FTChannel | None, *, source_id: int = 0
) -> tuple[Persister | NoFTPersister, TaskHandler | NoFTTaskHandler]:
    """The FT switch: real handlers for a channel, no-op handlers for None (FT off)."""
    if channel is None:
        return NoFTPersister(), NoFTTaskHandler()
    return Persister(channel, source_id=source_id), TaskHandler(channel)
