"""Handlers: anchoring, combined XOR events, multi-anchoring, FailException, FT off."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.typing import ArrayLike

from ftlayer.acking.handlers import (
    Anchors,
    NoFTPersister,
    NoFTTaskHandler,
    Persister,
    TaskHandler,
    XorHandler,
    handlers,
)
from ftlayer.core import FTLayer
from ftlayer.errors import ConfigError, FailException
from ftlayer.persistence import MemoryStorage
from ftlayer.records import RecordBatch


class CountingChannel:
    """Forwards to an FTLayer and counts the events each call carried."""

    def __init__(self, ft: FTLayer) -> None:
        self.ft = ft
        self.xor_calls: list[int] = []

    def persist(self, batch: RecordBatch, initial_values: ArrayLike | None = None) -> None:
        self.ft.persist(batch, initial_values)

    def xor(self, roots: ArrayLike, values: ArrayLike) -> object:
        self.xor_calls.append(len(np.asarray(roots)))
        return self.ft.xor(roots, values)

    def fail(self, roots: ArrayLike) -> object:
        return self.ft.fail(roots)


def _source(ft: FTLayer, n: int) -> Anchors:
    return Persister(ft).persist(
        [b"r%d" % i for i in range(n)], topics="t", partitions=0, offsets=np.arange(n)
    )


def test_chain_completes_only_after_the_sink_acks() -> None:
    ft = FTLayer(MemoryStorage())
    inputs = _source(ft, 4)
    # map -> flat_map (2 outputs each) -> filter (keeps the first of each pair) -> sink
    stages = [np.arange(4), np.repeat(np.arange(4), 2), np.arange(0, 8, 2)]
    records = inputs
    for parents in stages:
        task = TaskHandler(ft)
        records = task.process(records, parents)
        task.flush()
        assert ft.current_stats().completed == 0
    # Outputs carry their input's root (anchoring), each with a fresh record id.
    assert records.roots.tolist() == inputs.roots.tolist()
    assert not set(records.ids.tolist()) & set(inputs.ids.tolist())
    sink = TaskHandler(ft)
    sink.process(records, np.zeros(0, dtype=np.intp))
    assert ft.current_stats().completed == 0  # the sink's acks are still buffered
    sink.flush()
    assert ft.current_stats().completed == 4 and len(ft) == 0


def _run_chain(ft: FTLayer, n: int, *, flush_map: bool) -> TaskHandler:
    inputs = _source(ft, n)
    map_task = TaskHandler(ft)
    mapped = map_task.process(inputs, np.arange(n))
    if flush_map:
        map_task.flush()
    sink = TaskHandler(ft)
    sink.process(mapped, np.zeros(0, dtype=np.intp))
    sink.flush()
    return map_task


def test_a_tree_is_incomplete_while_any_ack_is_outstanding() -> None:
    ft = FTLayer(MemoryStorage())
    map_task = _run_chain(ft, 3, flush_map=False)
    assert ft.current_stats().completed == 0 and len(ft) == 3
    map_task.flush()
    assert ft.current_stats().completed == 3 and len(ft) == 0


def test_one_combined_event_per_input_and_root() -> None:
    ft = FTLayer(MemoryStorage())
    channel = CountingChannel(ft)
    inputs = _source(ft, 5)
    task = TaskHandler(channel)
    task.process(inputs, np.repeat(np.arange(5), 3))  # flat_map: 3 outputs per input
    task.flush()
    assert channel.xor_calls == [5]  # 5 events for 15 outputs, not 20


def test_hand_over_sends_events_only_for_inputs_without_exactly_one_output() -> None:
    ft = FTLayer(MemoryStorage())
    channel = CountingChannel(ft)
    inputs = _source(ft, 6)
    # map: every input has one output, which carries the input's own id; no event.
    mapper = TaskHandler(channel, hand_over=True)
    mapped = mapper.process(inputs, np.arange(6))
    mapper.flush()
    assert channel.xor_calls == []
    assert mapped.roots.tolist() == inputs.roots.tolist()
    assert mapped.ids.tolist() == inputs.ids.tolist()
    # filter dropping 1 and 4, flat_map of 5 into two: events for those three only.
    task = TaskHandler(channel, hand_over=True)
    out = task.process(mapped, [0, 2, 3, 5, 5])
    task.flush()
    assert channel.xor_calls == [3]
    assert out.ids[:3].tolist() == inputs.ids[[0, 2, 3]].tolist()
    assert not set(out.ids[3:].tolist()) & set(inputs.ids.tolist())
    assert ft.current_stats().completed == 2  # the dropped ones, acked by the filter
    sink = TaskHandler(channel, hand_over=True)
    sink.process(out.take([0, 1, 2, 3]), np.zeros(0, dtype=np.intp))
    sink.flush()
    assert ft.current_stats().completed == 5  # input 5 waits for its second output
    sink.process(out.take([4]), np.zeros(0, dtype=np.intp))
    sink.flush()
    assert ft.current_stats().completed == 6 and len(ft) == 0


def test_hand_over_leaves_a_tree_incomplete_until_its_row_is_acked() -> None:
    ft = FTLayer(MemoryStorage())
    inputs = _source(ft, 3)
    for _ in range(3):  # three maps in a row: the source's ids go all the way down
        task = TaskHandler(ft, hand_over=True)
        inputs_next = task.process(inputs, np.arange(3))
        task.flush()
        assert ft.current_stats().completed == 0
        inputs = inputs_next
    sink = TaskHandler(ft, hand_over=True)
    sink.process(inputs.take([0, 2]), np.zeros(0, dtype=np.intp))
    sink.flush()
    assert ft.current_stats().completed == 2 and len(ft) == 1


def test_pass_through_keeps_anchors_and_acks_only_the_dropped_rows() -> None:
    ft = FTLayer(MemoryStorage())
    channel = CountingChannel(ft)
    inputs = _source(ft, 5)
    task = TaskHandler(channel, hand_over=True)
    assert task.pass_through(inputs)  # a map: nothing to send
    assert task.pass_through(inputs, np.array([True, False, True, True, False]))
    task.flush()
    assert channel.xor_calls == [2]
    assert ft.current_stats().completed == 2  # the two dropped rows' trees
    sink = TaskHandler(channel)
    sink.process(inputs.take([0, 2, 3]), np.zeros(0, dtype=np.intp))
    sink.flush()
    assert ft.current_stats().completed == 5 and len(ft) == 0
    # Rows of a barrier-mode source (record id 0) send nothing even when dropped.
    barrier = Anchors.single(inputs.roots, np.zeros(5, np.uint64))
    assert task.pass_through(barrier, np.zeros(5, dtype=np.bool_))
    task.flush()
    assert channel.xor_calls == [2, 3]  # only the sink's three
    # Without hand_over, or with a row of several pairs, it leaves the work to process.
    assert not TaskHandler(channel).pass_through(inputs)
    two_pairs = Anchors(np.array([0, 2]), inputs.roots[:2], inputs.ids[:2])
    assert not task.pass_through(two_pairs)


def test_multi_anchored_aggregate_holds_every_contributing_root() -> None:
    ft = FTLayer(MemoryStorage())
    inputs = _source(ft, 6)
    agg = TaskHandler(ft)
    # Two groups: inputs 0-3 aggregate into output 0, inputs 4-5 into output 1.
    outputs = agg.process_grouped(inputs, [0, 0, 0, 0, 1, 1], 2)
    agg.flush()
    assert len(outputs) == 2
    assert outputs.pairs(0)[0][0] == int(inputs.roots[0])
    assert sorted(r for r, _ in outputs.pairs(0)) == sorted(inputs.roots[:4].tolist())
    assert ft.current_stats().completed == 0
    sink = TaskHandler(ft)
    sink.process(
        Anchors(outputs.offsets[:2], outputs.roots[:4], outputs.ids[:4]), np.zeros(0, np.intp)
    )
    sink.flush()
    assert ft.current_stats().completed == 4  # group 0's roots, and only those
    done = set(inputs.roots[:4].tolist())
    assert not done & set(ft.acker.roots().tolist())


def test_failed_inputs_fail_their_tree_only() -> None:
    ft = FTLayer(MemoryStorage())
    inputs = _source(ft, 4)
    task = TaskHandler(ft)
    failed = np.array([False, True, False, False])
    out = task.process(inputs, np.flatnonzero(~failed), failed=failed)
    task.flush()
    sink = TaskHandler(ft)
    sink.process(out, np.zeros(0, np.intp))
    sink.flush()
    stats = ft.current_stats()
    assert stats.completed == 3 and stats.failed["explicit"] == 1
    assert ft.fetch_replay(0, ft.replay_cursor).records.payloads == [b"r1"]
    with pytest.raises(ConfigError, match="failed input cannot have outputs"):
        task.process(inputs, np.arange(4), failed=failed)


def test_anchor_scope_acks_fails_or_propagates() -> None:
    ft = FTLayer(MemoryStorage())
    inputs = _source(ft, 3)
    task = TaskHandler(ft)
    sink = TaskHandler(ft)
    with task.anchor(inputs.pairs(0)) as rec:
        child = rec.emit()
    with task.anchor(inputs.pairs(1)):
        raise FailException("bad record")
    with pytest.raises(KeyError), task.anchor(inputs.pairs(2)):
        raise KeyError("bug in user code")
    task.flush()
    with sink.anchor(child):
        pass
    sink.flush()
    stats = ft.current_stats()
    assert stats.completed == 1 and stats.failed["explicit"] == 1
    assert int(inputs.roots[2]) in ft.acker  # unacked: it will time out and replay


class ExplodingChannel:
    def persist(self, *_: object, **__: object) -> None:
        raise AssertionError("FT off must not persist")

    def xor(self, *_: object) -> object:
        raise AssertionError("FT off must not send events")

    def fail(self, *_: object) -> object:
        raise AssertionError("FT off must not send events")


def test_ft_off_handlers_do_nothing() -> None:
    persister, task = handlers(None)
    assert isinstance(persister, NoFTPersister) and isinstance(task, NoFTTaskHandler)
    assert persister.persist([b"x"], topics="t", partitions=0, offsets=[0]) is None
    assert task.process(None, None) is None
    task.flush()
    on_persister, on_task = handlers(ExplodingChannel())
    assert isinstance(on_persister, Persister) and isinstance(on_task, TaskHandler)


def test_xor_handler_flushes_on_size() -> None:
    ft = FTLayer(MemoryStorage())
    channel = CountingChannel(ft)
    buffer = XorHandler(channel, flush_events=10)
    roots = np.arange(2, 9, dtype=np.uint64)
    buffer.xor(roots, roots)
    assert channel.xor_calls == [] and buffer.buffered == 7
    buffer.xor(roots, roots)
    assert channel.xor_calls == [14] and buffer.buffered == 0


def test_a_task_attempts_events_leave_only_when_it_ends() -> None:
    ft = FTLayer(MemoryStorage())
    inputs = _source(ft, 6)
    channel = CountingChannel(ft)
    sink = TaskHandler(channel)
    sink.process(inputs.take([0, 1, 2]), np.zeros(0, dtype=np.intp))
    sink.process(inputs.take([3, 4, 5]), np.zeros(0, dtype=np.intp))
    assert channel.xor_calls == [], "an attempt that dies here has sent nothing"
    sink.flush()
    assert channel.xor_calls == [6] and ft.current_stats().completed == 6


def test_an_aggregate_of_one_tree_acks_once_per_root() -> None:
    ft = FTLayer(MemoryStorage())
    channel = CountingChannel(ft)
    inputs = _source(ft, 1)
    # One source record fans out into 3 records, which an aggregate folds back into one.
    fan = TaskHandler(channel)
    three = fan.process(inputs, [0, 0, 0])
    fan.flush()
    agg = TaskHandler(channel)
    folded = agg.process_grouped(three, [0, 0, 0], 1)
    agg.flush()
    assert len(folded.pairs(0)) == 3  # three edges, all under the one root
    sink = TaskHandler(channel)
    sink.process(folded, np.zeros(0, dtype=np.intp))
    sink.flush()
    assert channel.xor_calls[-1] == 1  # the sink sends one combined event for that root
    assert ft.current_stats().completed == 1


def _folded(ft: FTLayer, fan_out: int) -> tuple[int, Anchors]:
    """One source record fanned out into `fan_out` records, folded back into one by an
    aggregate: (its root, the aggregate's anchors: `fan_out` pairs of that root)."""
    inputs = _source(ft, 1)
    fan = TaskHandler(ft)
    many = fan.process(inputs, [0] * fan_out)
    fan.flush()
    agg = TaskHandler(ft)
    folded = agg.process_grouped(many, [0] * fan_out, 1)
    agg.flush()
    return int(inputs.roots[0]), folded


@pytest.mark.parametrize("fan_out", [2, 3, 4])
def test_a_map_after_an_aggregate_of_one_tree_keeps_the_root_pending(fan_out: int) -> None:
    # Found by the topology property: an aggregate of an even number of records of one
    # tree carried pairs of that root whose child ids cancelled in the next map, and
    # the root completed while the map's output was still in flight.
    ft = FTLayer(MemoryStorage())
    root, folded = _folded(ft, fan_out)
    mapper = TaskHandler(ft)
    mapped = mapper.process(folded, [0])
    mapper.flush()
    assert ft.current_stats().completed == 0, "complete while the map's output is in flight"
    assert mapped.pairs(0) == [(root, int(mapped.ids[0]))]  # one pair per root
    sink = TaskHandler(ft)
    sink.process(mapped, np.zeros(0, dtype=np.intp))
    sink.flush()
    assert ft.current_stats().completed == 1


@pytest.mark.parametrize("fan_out", [2, 3, 4])
def test_the_record_scope_after_an_aggregate_of_one_tree_keeps_the_root_pending(
    fan_out: int,
) -> None:
    ft = FTLayer(MemoryStorage())
    root, folded = _folded(ft, fan_out)
    mapper = TaskHandler(ft)
    with mapper.anchor(folded.pairs(0)) as record:
        child = record.emit()
    mapper.flush()
    assert ft.current_stats().completed == 0, "complete while the map's output is in flight"
    assert len(child) == 1 and child[0][0] == root
    sink = TaskHandler(ft)
    with sink.anchor(child):
        pass
    sink.flush()
    assert ft.current_stats().completed == 1
