"""Records stored by reference (ftlayer.core.fills): a failed one is unfilled until its
source copies its bytes in; one its source no longer has becomes a dead letter with
the cause source-expired, counted, never skipped; both survive a restart."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from manual_clock import Clock

from ftlayer.acking.ids import new_ids
from ftlayer.causes import Cause, FailKind
from ftlayer.core import FTLayer
from ftlayer.core.retries import RetryPolicy
from ftlayer.errors import ConfigError
from ftlayer.persistence import LmdbStorage, MemoryStorage, PersistenceStorage
from ftlayer.records import RecordBatch
from ftlayer.registration import SourceRegistration

SOURCE = 5
OTHER = 6


def _by_reference(n: int, source: int = SOURCE, first_offset: int = 100) -> RecordBatch:
    return RecordBatch.build(
        new_ids(n),
        [b""] * n,
        source_ids=source,
        topics="orders",
        partitions=np.arange(n) % 2,
        offsets=np.arange(first_offset, first_offset + n),
        references=True,
    )


def _bytes_of(offsets: np.ndarray) -> list[bytes]:
    """What the source holds at each offset."""
    return [b"record-at-%d" % offset for offset in offsets.tolist()]


def _layer(storage: PersistenceStorage, policy: RetryPolicy | None = None) -> FTLayer:
    ft = FTLayer(storage, timeout_s=30, clock=Clock(), wall_clock=Clock(1000.0), seed=3)
    for source in (SOURCE, OTHER):
        ft.register_source(
            SourceRegistration(source, "forward", 2, retry=policy or RetryPolicy(3, 0, 0))
        )
    return ft


def _replays(ft: FTLayer, lo: int = 0) -> RecordBatch:
    return ft.fetch_replay(lo, ft.replay_cursor_of(SOURCE), source_id=SOURCE).records


def test_a_record_that_completes_never_needs_its_bytes(storage: PersistenceStorage) -> None:
    ft = _layer(storage)
    batch = _by_reference(4)
    ids = new_ids(4)
    ft.persist(batch, ids)
    ft.xor(batch.roots, ids)  # the anchored ids acked: complete
    assert len(ft) == 0 and len(storage) == 0
    assert len(ft.unfilled(SOURCE)) == 0 and ft.current_stats().unfilled == 0


def test_a_failed_record_is_unfilled_until_its_source_copies_its_bytes_in(
    storage: PersistenceStorage,
) -> None:
    ft = _layer(storage)
    batch = _by_reference(4)
    ft.persist(batch)
    ft.fail(batch.roots[[1, 3]], Cause(FailKind.EXPLICIT, "enrich", "FailException: no"))
    # Queued for replay, but the FT layer has only where they are.
    wanted = ft.unfilled(SOURCE)
    assert wanted.records.offsets.tolist() == [101, 103]
    assert wanted.records.partitions.tolist() == [1, 1]
    assert wanted.records.reference_mask.all()
    assert ft.current_stats().unfilled == 2
    assert ft.current_stats().by_source[str(SOURCE)]["unfilled"] == 2
    assert len(ft.unfilled(OTHER)) == 0
    replayed = _replays(ft)
    assert replayed.reference_mask.all()  # fetched before the fill: the reader reads it
    result = ft.fill(wanted.seqs, _bytes_of(wanted.records.offsets), [True, True])
    assert result.as_dict() == {"filled": 2, "expired": 0}
    assert len(ft.unfilled(SOURCE)) == 0
    replayed = _replays(ft)
    assert list(replayed.payloads) == [b"record-at-101", b"record-at-103"]
    assert not replayed.reference_mask.any()
    stats = ft.current_stats()
    assert (stats.unfilled, stats.filled) == (0, 2)
    # Filling again (a second driver, a retried request) changes nothing.
    assert ft.fill(wanted.seqs, [b"x", b"y"], [True, True]).as_dict() == {
        "filled": 0,
        "expired": 0,
    }
    replayed = _replays(ft)  # a re-run's fetch: fresh roots
    assert list(replayed.payloads) == [b"record-at-101", b"record-at-103"]
    # The replays complete (emitted, then acked): their records and bytes leave.
    assert storage.filled == 2
    emitted = new_ids(len(replayed))
    ft.xor(replayed.roots, emitted)
    ft.xor(replayed.roots, emitted)
    assert storage.filled == 0 and len(storage) == 2


def test_a_record_gone_from_its_source_becomes_a_source_expired_dead_letter(
    storage: PersistenceStorage,
) -> None:
    ft = _layer(storage)
    batch = _by_reference(3)
    ft.persist(batch)
    ft.fail(batch.roots, Cause(FailKind.EXPLICIT, "enrich", "FailException: no"))
    wanted = ft.unfilled(SOURCE)
    found = np.array([True, False, True])
    result = ft.fill(wanted.seqs, _bytes_of(wanted.records.offsets), found)
    assert result.as_dict() == {"filled": 2, "expired": 1}
    stats = ft.current_stats()
    assert stats.failed["source-expired"] == 1
    assert stats.by_source[str(SOURCE)]["failed"]["source-expired"] == 1
    assert stats.dead_lettered == 1 and stats.unfilled == 0
    letters, records = ft.dead_letters()
    assert records.offsets.tolist() == [101]
    (_, record) = letters[0]
    assert record.last_cause is not None
    assert record.last_cause.kind is FailKind.SOURCE_EXPIRED and record.last_cause.final
    # The two found are replayed with their bytes; the expired one is not.
    assert sorted(_replays(ft).offsets.tolist()) == [100, 102]


def test_a_dead_letter_by_reference_gets_its_bytes_or_the_expiry_in_its_history(
    storage: PersistenceStorage,
) -> None:
    ft = _layer(storage)
    batch = _by_reference(2)
    ft.persist(batch)
    ft.fail(batch.roots, Cause(FailKind.ERROR, "parse", "ValueError: bad", final=True))
    assert ft.current_stats().dead_lettered == 2
    wanted = ft.unfilled(SOURCE)
    assert len(wanted) == 2  # a dead letter keeps its bytes too
    ft.fill(wanted.seqs, _bytes_of(wanted.records.offsets), [True, False])
    letters, records = ft.dead_letters()
    assert list(records.payloads) == [b"record-at-100", b""]
    assert records.reference_mask.tolist() == [False, True]
    causes = [record.last_cause.kind for _, record in letters if record.last_cause]
    assert causes == [FailKind.ERROR, FailKind.SOURCE_EXPIRED]
    assert ft.current_stats().failed["source-expired"] == 1
    assert len(ft.unfilled(SOURCE)) == 0


def test_unfilled_records_are_listed_again_after_a_restart(tmp_path: Path) -> None:
    storage = LmdbStorage(tmp_path / "ft")
    ft = _layer(storage, RetryPolicy(max_retries=3, backoff_ms=60_000, backoff_max_ms=60_000))
    batch = _by_reference(6)
    ft.persist(batch)
    ft.fail(batch.roots[:4], Cause(FailKind.EXPLICIT, "enrich", "FailException: no"))
    ft.fail(batch.roots[[4]], Cause(FailKind.ERROR, "parse", "ValueError: bad", final=True))
    wanted = ft.unfilled(SOURCE)
    assert wanted.records.offsets.tolist() == [100, 101, 102, 103, 104]
    # 100 filled, 101 and 104 (a dead letter) gone from the source; 102, 103 still wanted.
    ft.fill(wanted.seqs[[0, 1, 4]], [b"record-at-100", b"", b""], [True, False, False])
    storage.close()
    storage = LmdbStorage(tmp_path / "ft")
    ft = _layer(storage)
    again = ft.unfilled(SOURCE)
    # 102 and 103 wait for their backoff, still unfilled; 105 was pending, so the
    # restart failed it (recovery), and it is unfilled too.
    assert again.records.offsets.tolist() == [102, 103, 105]
    _, records = ft.dead_letters()
    assert sorted(records.offsets.tolist()) == [101, 104]
    storage.close()


def test_fill_refuses_columns_of_different_lengths(storage: PersistenceStorage) -> None:
    ft = _layer(storage)
    with pytest.raises(ConfigError, match="a payload and a found flag per seq"):
        ft.fill([1, 2], [b"a"], [True, True])


@settings(max_examples=40, deadline=None)
@given(
    fails=st.lists(st.integers(0, 11), max_size=12),
    gone=st.lists(st.integers(0, 11), max_size=12),
    completes=st.lists(st.integers(0, 11), max_size=12),
)
def test_every_failed_record_by_reference_ends_filled_or_expired(
    fails: list[int], gone: list[int], completes: list[int]
) -> None:
    """However records fail, complete and turn out gone, once the source answered for
    every unfilled record each failed record has its bytes or is a source-expired
    dead letter: none is left without both."""
    storage = MemoryStorage()
    ft = _layer(storage, RetryPolicy(-1, 0, 0))
    batch = _by_reference(12)
    ids = new_ids(12)
    ft.persist(batch, ids)
    failed = sorted(set(fails))
    ft.fail(batch.roots[failed], Cause(FailKind.EXPLICIT, "s", "FailException: x"))
    done = [i for i in set(completes) if i not in failed]
    ft.xor(batch.roots[done], ids[done])
    wanted = ft.unfilled(SOURCE)
    offsets = wanted.records.offsets
    assert sorted(offsets.tolist()) == [100 + i for i in failed]
    found = ~np.isin(offsets - 100, gone)
    ft.fill(wanted.seqs, _bytes_of(offsets), found)
    assert len(ft.unfilled(SOURCE)) == 0
    replayed = _replays(ft)
    _, dead = ft.dead_letters()
    assert sorted(replayed.offsets.tolist()) == sorted(offsets[found].tolist())
    assert list(replayed.payloads) == _bytes_of(replayed.offsets)
    assert sorted(dead.offsets.tolist()) == sorted(offsets[~found].tolist())
    assert ft.current_stats().failed["source-expired"] == int((~found).sum())
