"""Bounded retries with backoff and dead letters in the FT-layer core (issue 12, parts 1
and 2): a failed record waits its backoff before it gets a replay seq, is
dead-lettered after max_retries + 1 failures (or at once for a final cause), keeps its
history across restarts, and can be requeued or purged."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from manual_clock import Clock

from ftlayer.acking.ids import new_ids
from ftlayer.causes import Cause, Causes, FailKind
from ftlayer.core import FTLayer, SourceConfig
from ftlayer.core.retries import DeadLetterFilter, RetryPolicy, RetryRecord
from ftlayer.errors import ConfigError
from ftlayer.persistence import Completed, LmdbStorage, MemoryStorage, PersistenceStorage
from ftlayer.records import RecordBatch
from ftlayer.registration import SourceRegistration

SOURCE = 3


def _records(n: int, source: int = SOURCE) -> RecordBatch:
    return RecordBatch.build(
        new_ids(n),
        [b"payload-%d" % i for i in range(n)],
        source_ids=source,
        topics="orders",
        partitions=np.arange(n) % 2,
        offsets=np.arange(100, 100 + n),
    )


def _layer(
    storage: PersistenceStorage,
    policy: RetryPolicy,
    clock: Clock,
    wall: Clock,
    *,
    topic: str | None = None,
) -> FTLayer:
    ft = FTLayer(storage, timeout_s=30, clock=clock, wall_clock=wall, seed=7)
    ft.register_source(
        SourceRegistration(SOURCE, "forward", 2, retry=policy, dead_letter_topic=topic)
    )
    return ft


def _emit_replays(ft: FTLayer, lo: int) -> tuple[RecordBatch, int]:
    """Fetch the replays after `lo`; returns them and the new cursor."""
    hi = ft.replay_cursor_of(SOURCE)
    return ft.fetch_replay(lo, hi, source_id=SOURCE).records, hi


def test_a_failed_record_waits_for_its_backoff_before_it_gets_a_replay_seq(
    storage: PersistenceStorage,
) -> None:
    clock, wall = Clock(), Clock(1000.0)
    ft = _layer(
        storage, RetryPolicy(max_retries=5, backoff_ms=1000, backoff_max_ms=3000), clock, wall
    )
    batch = _records(3)
    ft.persist(batch)
    cause = Cause(FailKind.EXPLICIT, "enrich", "FailException: lookup timed out")
    assert ft.fail(batch.roots[[1]], cause) == 1
    # Waiting: pending (its partition's offset is held), but not in the replay queue.
    assert ft.replay_cursor_of(SOURCE) == 0 and ft.waiting_replays == 1
    assert ft.lowest_pending_offsets() == {"orders": {0: 100, 1: 101}}
    gaps = []
    for attempt in range(1, 5):
        failed_at = wall.now
        ft.tick()
        assert ft.replay_cursor_of(SOURCE) == attempt - 1  # not before its due time
        wall.now += 0.5
        while ft.release_due() == 0:
            wall.now += 0.05
        gaps.append(wall.now - failed_at)
        replay, _ = _emit_replays(ft, ft.replay_cursor_of(SOURCE) - 1)
        assert replay.payloads == [b"payload-1"]
        assert ft.retries(int(replay.roots[0])) == attempt
        ft.fail(replay.roots, cause)
    # The schedule: 1 s, 2 s, 3 s (the cap), 3 s, each with up to 20% jitter below.
    for gap, step in zip(gaps, [1.0, 2.0, 3.0, 3.0], strict=True):
        assert 0.8 * step - 0.06 <= gap <= step + 0.06, gaps
    record = ft.retry_record(2)  # the storage seq of offset 101
    assert record is not None and record.attempts == 5 and ft.dead_letter_count == 0


def test_after_its_last_retry_a_record_is_a_dead_letter_and_its_tree_completes(
    storage: PersistenceStorage,
) -> None:
    clock, wall = Clock(), Clock(1000.0)
    ft = _layer(storage, RetryPolicy(max_retries=2, backoff_ms=0, backoff_max_ms=0), clock, wall)
    completed: list[Completed] = []
    ft.add_completion_listener(completed.append)
    batch = _records(4)
    ft.persist(batch)
    roots = batch.roots[[2]]
    causes = ["ValueError: bad json", "ValueError: bad json again", "timeout"]
    for attempt, text in enumerate(causes, start=1):
        wall.now += 10
        if text == "timeout":
            for _ in range(4):  # the third attempt times out instead (and the others)
                clock.now += 20
                ft.tick()
        else:
            ft.fail(roots, Cause(FailKind.ERROR, "parse", text))
        if attempt <= 2:
            replay, _ = _emit_replays(ft, ft.replay_cursor_of(SOURCE) - 1)
            assert replay.payloads == [b"payload-2"]
            roots = replay.roots
    # Dead: its tree completed (the group offset may move past it), the record stays.
    assert [c.offsets.tolist() for c in completed] == [[102]]
    assert ft.dead_letter_count == 1 and len(storage) == 4
    letters, records = ft.dead_letters()
    ((_seq, record),) = letters
    assert records.payloads == [b"payload-2"] and records.offsets.tolist() == [102]
    assert record.attempts == 3 and record.dead_at == wall.now
    assert [(c.kind, c.error) for _, c in record.causes] == [
        (FailKind.ERROR, "ValueError: bad json"),
        (FailKind.ERROR, "ValueError: bad json again"),
        (FailKind.TIMEOUT, ""),
    ]
    assert record.first_failed == 1010.0 and record.last_failed == 1030.0
    stats = ft.current_stats()
    assert (stats.dead_lettered, stats.dead_letters, stats.pending) == (1, 1, 3)
    # Late events of the dead tree are dropped, never resurrect it.
    assert ft.fail(roots) == 0


def test_a_final_cause_dead_letters_at_once(storage: PersistenceStorage) -> None:
    ft = _layer(storage, RetryPolicy(), Clock(), Clock(50.0))
    batch = _records(2)
    ft.persist(batch)
    schema_error = Cause(FailKind.ERROR, "map", "OutputSchemaError: column 'n'", final=True)
    ft.fail(batch.roots, Causes((Cause(), schema_error), np.array([0, 1], dtype=np.uint16)))
    letters, records = ft.dead_letters()
    assert records.offsets.tolist() == [101]
    assert letters[0][1].attempts == 1 and letters[0][1].last_cause == schema_error
    assert ft.waiting_replays == 1  # the other one waits for its backoff


def test_a_batch_wide_programming_error_is_retried_once_and_final_when_it_repeats(
    storage: PersistenceStorage,
) -> None:
    ft = _layer(storage, RetryPolicy(max_retries=10, backoff_ms=0), Clock(), Clock(50.0))
    batch = _records(3)
    ft.persist(batch)
    error = Cause(FailKind.ERROR, "map", "ImportError: no module ujson", final_if_repeated=True)
    ft.fail(batch.roots, error)
    # Retried once, not dead: a transient ImportError on one executor passes.
    assert ft.dead_letter_count == 0 and ft.queued_replays == 3
    replay, _ = _emit_replays(ft, 0)
    # The retry fails one record alike again (dead), another with another type (retried),
    # and one completes.
    again = replay.roots[replay.offsets == 100]
    other = replay.roots[replay.offsets == 101]
    ft.fail(again, Cause(FailKind.ERROR, "map", "ImportError: still", final_if_repeated=True))
    ft.fail(other, Cause(FailKind.ERROR, "map", "TypeError: 1", final_if_repeated=True))
    letters, records = ft.dead_letters()
    assert records.offsets.tolist() == [100]
    assert letters[0][1].attempts == 2
    assert ft.dead_letter_count == 1 and ft.queued_replays >= 1


def test_retry_counts_due_times_and_dead_letters_survive_a_restart(tmp_path: Path) -> None:
    clock, wall = Clock(), Clock(5000.0)
    store = LmdbStorage(tmp_path / "ft")
    policy = RetryPolicy(max_retries=1, backoff_ms=60_000, backoff_max_ms=60_000)
    ft = _layer(store, policy, clock, wall)
    batch = _records(3)
    ft.persist(batch)
    ft.fail(batch.roots[[0]], Cause(FailKind.EXPLICIT, "a", "x"))  # waits 48-60 s
    due = ft.retry_record(1)
    assert due is not None and 5048.0 <= due.due <= 5060.0
    ft.fail(batch.roots[[1]], Cause(FailKind.EXPLICIT, "a", "y"))
    wall.now = due.due + 1
    ft.release_due()
    replay, _ = _emit_replays(ft, 0)
    ft.fail(replay.roots[replay.offsets == 100], Cause(FailKind.SINK, "kafka", "refused"))
    assert ft.dead_letter_count == 1
    store.close()  # the process is gone

    store = LmdbStorage(tmp_path / "ft")
    wall.now = 5001.0
    again = FTLayer(store, clock=clock, wall_clock=wall, seed=1)
    # Record 100 is still a dead letter, with its history; 101 still waits for its due
    # time; 102 (never failed) is replayed at once.
    letters, records = again.dead_letters()
    assert records.offsets.tolist() == [100]
    assert [c.kind for _, c in letters[0][1].causes] == [FailKind.EXPLICIT, FailKind.SINK]
    replay, cursor = _emit_replays(again, 0)
    assert replay.offsets.tolist() == [102]
    waiting = again.retry_record(2)
    assert waiting is not None and waiting.attempts == 1 and again.waiting_replays == 1
    wall.now = waiting.due + 0.01
    again.release_due()
    replay, _ = _emit_replays(again, cursor)
    assert replay.offsets.tolist() == [101]
    assert again.retries(int(replay.roots[0])) == 1
    store.close()


def test_requeue_puts_dead_letters_back_with_their_history(storage: PersistenceStorage) -> None:
    wall = Clock(100.0)
    ft = _layer(storage, RetryPolicy(max_retries=0, backoff_ms=0, backoff_max_ms=0), Clock(), wall)
    batch = _records(3)
    ids = new_ids(3)
    ft.persist(batch, ids)
    ft.fail(batch.roots[[0, 2]], Cause(FailKind.EXPLICIT, "s", "broken"))
    assert ft.dead_letter_count == 2
    assert ft.requeue_dead_letters(DeadLetterFilter(partition=1, seqs=frozenset({3}))) == 0
    assert ft.requeue_dead_letters(DeadLetterFilter(seqs=frozenset({3}))) == 1
    replay, _ = _emit_replays(ft, 0)
    assert replay.offsets.tolist() == [102]
    # It fails again (max_retries 0): a dead letter again, with both failures.
    ft.fail(replay.roots, Cause(FailKind.EXPLICIT, "s", "still broken"))
    letters, _ = ft.dead_letters(DeadLetterFilter(seqs=frozenset({3})))
    record = letters[0][1]
    assert record.requeued == 1 and record.attempts == 2
    assert [c.error for _, c in record.causes] == ["broken", "still broken"]
    # Requeued and fixed this time: its tree completes and its history is gone.
    ft.requeue_dead_letters(DeadLetterFilter(seqs=frozenset({3})))
    replay, _ = _emit_replays(ft, ft.replay_cursor_of(SOURCE) - 1)
    emitted = new_ids(1)
    ft.xor(replay.roots, emitted)
    ft.xor(replay.roots, emitted)
    assert ft.retry_record(3) is None and ft.dead_letter_count == 1
    # Purge deletes the rest for good.
    assert ft.purge_dead_letters(DeadLetterFilter(kind=FailKind.EXPLICIT)) == 1
    assert ft.dead_letter_count == 0 and len(storage) == 1
    assert ft.current_stats().dead_letters_purged == 1


def test_dead_letter_filters(storage: PersistenceStorage) -> None:
    wall = Clock(100.0)
    ft = _layer(storage, RetryPolicy(max_retries=0, backoff_ms=0, backoff_max_ms=0), Clock(), wall)
    batch = _records(4)
    ft.persist(batch)
    ft.fail(batch.roots[[0]], Cause(FailKind.EXPLICIT))
    wall.now = 200.0
    ft.fail(batch.roots[[1, 2]], Cause(FailKind.SINK, "kafka", "MessageSizeTooLarge"))

    def offsets(**where: object) -> list[int]:
        _letters, records = ft.dead_letters(DeadLetterFilter(**where))  # type: ignore[arg-type]
        return records.offsets.tolist()

    assert offsets() == [100, 101, 102]
    assert offsets(kind=FailKind.SINK) == [101, 102]
    assert offsets(partition=0) == [100, 102]
    assert offsets(since=150.0) == [101, 102] and offsets(until=150.0) == [100]
    assert offsets(source_id=SOURCE + 1) == []
    assert ft.dead_letters(limit=2)[1].offsets.tolist() == [100, 101]
    round_trip = DeadLetterFilter.from_json(DeadLetterFilter(kind=FailKind.SINK).to_json())
    assert round_trip == DeadLetterFilter(kind=FailKind.SINK)
    with pytest.raises(ConfigError, match="unknown fail cause 'bogus'"):
        DeadLetterFilter.from_json({"cause": "bogus"})


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"max_retries": -2}, "ft.maxRetries"),
        ({"max_retries": 1.5}, "ft.maxRetries"),
        ({"backoff_ms": -1}, "ft.retryBackoffMs"),
        ({"backoff_max_ms": 10**13}, "ft.retryBackoffMaxMs"),
        ({"backoff_ms": 5000, "backoff_max_ms": 1000}, "ft.retryBackoffMaxMs"),
    ],
)
def test_a_retry_policy_out_of_range_names_its_option(kwargs: dict, option: str) -> None:
    with pytest.raises(ConfigError, match=option.replace(".", r"\.")):
        RetryPolicy(**kwargs)


def test_registrations_keep_their_retry_policy_and_dead_letter_topic(tmp_path: Path) -> None:
    store = LmdbStorage(tmp_path / "ft")
    policy = RetryPolicy(max_retries=4, backoff_ms=10, backoff_max_ms=20)
    _layer(store, policy, Clock(), Clock(), topic="orders.dlq")
    store.close()
    store = LmdbStorage(tmp_path / "ft")
    config = FTLayer(store).source_config(SOURCE)
    assert isinstance(config, SourceConfig)
    assert (config.retry, config.dead_letter_topic) == (policy, "orders.dlq")
    store.close()


@settings(max_examples=40, deadline=None)
@given(
    max_retries=st.integers(0, 4),
    plan=st.lists(st.tuples(st.integers(0, 9), st.sampled_from([0.05, 0.5, 1.0])), max_size=40),
)
def test_every_record_waits_is_queued_or_is_a_dead_letter_after_its_exact_attempts(
    max_retries: int, plan: list[tuple[int, float]]
) -> None:
    """Random fails of 10 records at random times: none is ever lost, none is
    dead-lettered before max_retries + 1 failures, each dead letter has exactly them,
    and none is replayed before its backoff (at least 80% of its step) has passed."""
    wall = Clock(0.0)
    policy = RetryPolicy(max_retries=max_retries, backoff_ms=100, backoff_max_ms=400)
    ft = FTLayer(MemoryStorage(), wall_clock=wall, clock=Clock(), seed=3)
    ft.register_source(SourceRegistration(SOURCE, "forward", 2, retry=policy))
    batch = _records(10)
    ft.persist(batch)
    root_of: dict[int, int | None] = dict(
        zip(batch.offsets.tolist(), batch.roots.tolist(), strict=True)
    )
    failures = dict.fromkeys(root_of, 0)
    failed_at: dict[int, float] = {}
    cursor = 0
    for offset, step in plan:
        wall.now += step
        ft.release_due()
        replay, cursor = _emit_replays(ft, cursor)
        for off, root in zip(replay.offsets.tolist(), replay.roots.tolist(), strict=True):
            assert wall.now - failed_at[off] >= 0.8 * policy.step_s(failures[off]) - 1e-9
            root_of[off] = root
        root = root_of[offset + 100]
        if root is None:
            continue  # waiting for its backoff, or dead
        assert ft.fail(np.array([root], dtype=np.uint64), Cause(FailKind.ERROR, "s", "e")) == 1
        failures[offset + 100] += 1
        failed_at[offset + 100] = wall.now
        root_of[offset + 100] = None
    letters, records = ft.dead_letters()
    dead = dict(zip(records.offsets.tolist(), [r for _, r in letters], strict=True))
    for offset, count in failures.items():
        if offset in dead:
            assert count == max_retries + 1 == dead[offset].attempts
        else:
            assert count <= max_retries
    # Nothing lost: every record is still stored, pending or a dead letter.
    assert len(ft.storage) == 10
    assert ft.current_stats().pending + ft.dead_letter_count == 10


def test_dead_letters_restored_from_a_topic_are_replayed_with_their_history(
    storage: PersistenceStorage,
) -> None:
    wall = Clock(500.0)
    ft = _layer(storage, RetryPolicy(max_retries=0, backoff_ms=0, backoff_max_ms=0), Clock(), wall)
    cause = Cause(FailKind.ERROR, "map(parse)", "ValueError: bad")
    history = RetryRecord(SOURCE, attempts=1, first_failed=10.0, last_failed=10.0)
    history.causes.append((10.0, cause))
    history.dead_at = 10.0
    batch = _records(2)
    assert ft.restore_dead_letters(batch, [history, history]) == 2
    replay, _ = _emit_replays(ft, 0)
    assert replay.payloads == [b"payload-0", b"payload-1"]
    assert replay.offsets.tolist() == [100, 101]  # the coordinates it was first read at
    record = ft.retry_record(1)
    assert record is not None and (record.requeued, record.budget_from, record.dead_at) == (
        1,
        1,
        None,
    )
    # It fails again: a dead letter again at once (max_retries 0), both causes kept.
    ft.fail(replay.roots[:1], Cause(FailKind.ERROR, "map(parse)", "ValueError: still bad"))
    letters, _ = ft.dead_letters()
    assert [c.error for _, c in letters[0][1].causes] == [
        "ValueError: bad",
        "ValueError: still bad",
    ]
    assert ft.current_stats().dead_letters_requeued == 2
    with pytest.raises(ConfigError, match="2 records but 1 histories"):
        ft.restore_dead_letters(_records(2), [history])


@settings(max_examples=60, deadline=None)
@given(
    own=st.sets(st.integers(1, 400), max_size=40),
    grouped=st.sets(st.integers(1, 400), max_size=40),
    completed=st.lists(st.integers(1, 400), unique=True, max_size=300),
)
def test_completions_forget_exactly_the_retry_records_they_name(
    own: set[int], grouped: set[int], completed: list[int]
) -> None:
    """Whether a completion names fewer seqs than the book holds (a lookup per seq) or
    many more (a micro-batch of trees, looked for in one vectorized step), the book
    forgets exactly the records and group members among them, and keeps the others;
    the attempts it tells of every seq (checkpoints copy them) are its records'."""
    from ftlayer.core.retries import FreshGroup, RetryBook

    grouped -= own
    book = RetryBook(MemoryStorage())
    records = {seq: RetryRecord(SOURCE, attempts=1 + seq % 3) for seq in sorted(own)}
    book.stage(records)
    book.commit(records)
    if grouped:
        members = sorted(grouped)
        cause = Cause(FailKind.EXPLICIT, "map", "no")
        book.add_groups([FreshGroup.new(SOURCE, cause, 1.0, members, [0.0] * len(members))])
    forgotten = book.forget(np.array(completed, dtype=np.uint64))
    assert forgotten == [s for s in completed if s in own] + [s for s in completed if s in grouped]
    assert sorted(book.seqs()) == sorted((own | grouped) - set(completed))
    probe = list(range(1, 401))
    assert book.attempts(probe) == [
        0 if (record := book.get(seq)) is None else record.attempts for seq in probe
    ]


_MANY_WAITS = [(int(seq), float(at)) for seq, at in zip(
    np.random.default_rng(5).integers(1, 400, 600), np.random.default_rng(6).random(600) * 100,
    strict=True,
)]  # fmt: skip


@settings(max_examples=80, deadline=None)
@given(
    waits=st.lists(st.tuples(st.integers(1, 400), st.floats(0, 100)), max_size=600),
    waves=st.lists(st.integers(1, 80), max_size=8),
    now=st.floats(0, 100),
    later=st.floats(0, 100),
)
@example(waits=_MANY_WAITS, waves=[], now=60.0, later=80.0)  # hundreds due at once
@example(waits=_MANY_WAITS, waves=[200, 150, 1], now=60.0, later=80.0)
def test_the_records_due_are_those_whose_last_wait_ended_earliest_first(
    waits: list[tuple[int, float]], waves: list[int], now: float, later: float
) -> None:
    """Records wait one by one or in waves (a failure's, `wait_many`, of the sizes
    drawn, then one by one): whether few are due (a pop each) or many (one pass over
    the waiting ones, a binary search in a wave), `due` returns exactly the records
    whose last wait (under a root of its own) ended by `now`, earliest first (ties by
    seq), and leaves the others waiting, the earliest of them `next_due`; a wait a later
    one replaced is never returned. The same again at a later time."""
    from ftlayer.core.retries import RetryBook

    book = RetryBook(MemoryStorage())
    last: dict[int, tuple[int, float]] = {}
    at_wait = 0
    for size in waves:
        chunk = waits[at_wait : at_wait + size]
        roots = list(range(at_wait + 1, at_wait + 1 + len(chunk)))
        book.wait_many([seq for seq, _ in chunk], roots, [at for _, at in chunk])
        last.update((seq, (root, at)) for root, (seq, at) in zip(roots, chunk, strict=True))
        at_wait += len(chunk)
    for root, (seq, at) in enumerate(waits[at_wait:], start=at_wait + 1):
        book.wait(seq, root, at)
        last[seq] = (root, at)
    for when in (now, max(now, later)):
        ended = sorted((at, seq, root) for seq, (root, at) in last.items() if at <= when)
        assert book.due(when) == [(seq, root) for _, seq, root in ended]
        last = {seq: (root, at) for seq, (root, at) in last.items() if at > when}
        assert book.waiting == len(last)
        assert sorted(book.waiting_items()) == sorted((s, r, a) for s, (r, a) in last.items())
        assert book.next_due() == min((at for _, at in last.values()), default=None)
        assert book.due(when) == []


@settings(max_examples=60, deadline=None)
@given(
    groups=st.lists(st.sets(st.integers(1, 300), min_size=1, max_size=60), max_size=5),
    completed=st.lists(st.integers(1, 300), max_size=300),
)
def test_completions_leave_each_group_with_exactly_its_other_records_after_a_restart(
    groups: list[set[int]], completed: list[int]
) -> None:
    """Several first failures' groups: completions (two, one after the other) naming
    all of a group (deleted whole), part of one, or none of it, seqs named twice among
    them, leave every group with exactly its other records, in memory and in the
    entries a restart reads."""
    from ftlayer.core.retries import FreshGroup, RetryBook

    storage = MemoryStorage()
    book = RetryBook(storage)
    taken: set[int] = set()
    members: list[list[int]] = []
    for group in groups:
        mine = sorted(group - taken)
        taken |= group
        if mine:
            members.append(mine)
    cause = Cause(FailKind.EXPLICIT, "map", "no")
    fresh = [FreshGroup.new(SOURCE, cause, 1.0, m, [2.0] * len(m)) for m in members]
    storage.update_meta({g.key: g.encode() for g in fresh})
    book.add_groups(fresh)
    half = len(completed) // 2  # two barriers: a group left in part, then the rest
    book.forget(np.array(completed[:half], dtype=np.uint64))
    book.forget(np.array(completed[half:], dtype=np.uint64))
    storage.flush_staged()
    left = sorted(taken - set(completed))
    assert sorted(book.seqs()) == left
    assert all(book.get(seq) is not None for seq in left)
    assert all(book.get(seq) is None for seq in set(completed))
    assert sorted(RetryBook(storage).seqs()) == left


@settings(max_examples=60, deadline=None)
@given(
    seqs=st.lists(st.integers(1, 2**63), min_size=1, max_size=50, unique=True),
    at=st.floats(0, 2e9),
    jitter=st.floats(0, 1),
)
def test_a_group_entry_reads_back_as_written_and_as_earlier_versions_wrote_it(
    seqs: list[int], at: float, jitter: float
) -> None:
    """A group's entry gives back its source, cause, time and each seq's due time, in
    order; the JSON entry of earlier versions reads the same; a cut or altered entry
    is CorruptData naming its key, never a group."""
    import json

    from ftlayer.core.retries import FreshGroup
    from ftlayer.errors import CorruptData

    cause = Cause(FailKind.EXPLICIT, "map", "ValueError: no")
    dues = [at + jitter * i for i in range(len(seqs))]
    group = FreshGroup.new(SOURCE, cause, at, seqs, dues)
    legacy = json.dumps(
        {"source_id": SOURCE, "at": at, "cause": cause.to_json(), "seqs": seqs, "due": dues}
    ).encode()
    for raw in (group.encode(), legacy):
        back = FreshGroup.decode(group.key, raw)
        assert (back.source_id, back.cause, back.at) == (SOURCE, cause, at)
        assert list(back.dues.items()) == list(zip(seqs, dues, strict=True))
    raw = group.encode()
    for bad in (raw[:-1], raw + b"\0", b"\x02" + raw[1:], raw[:5]):
        with pytest.raises(CorruptData, match=group.key):
            FreshGroup.decode(group.key, bad)
