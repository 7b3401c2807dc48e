"""A server's place in a cluster of shards and its store's id (ftlayer.shards): kept by
the data dir from its first start, refused for another place, new for a new store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ftlayer import rangeroots
from ftlayer.acking.ids import MIN_ID, new_ids
from ftlayer.causes import Cause, FailKind
from ftlayer.client.sharded import parse_addresses
from ftlayer.core import FTLayer
from ftlayer.errors import ConfigError
from ftlayer.persistence import LmdbStorage, MemoryStorage
from ftlayer.registration import SourceRegistration
from ftlayer.shards import MAX_SHARDS, ShardPlace, claim, foreign_roots, partition_shard, shard_of


@pytest.mark.parametrize(
    ("index", "count", "match"),
    [
        (2, 2, "shard 2 is not in a cluster of 2"),
        (-1, 3, "shard -1 is not in a cluster of 3"),
        (0, 0, "1 to 256 shards"),
        (0, MAX_SHARDS + 1, "1 to 256 shards"),
        (True, 2, "an integer"),
    ],
)
def test_a_place_outside_its_cluster_is_refused(index: Any, count: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ShardPlace(index, count)


def test_a_data_dir_keeps_its_place_and_its_store_id(tmp_path: Path) -> None:
    with LmdbStorage(tmp_path / "a") as storage:
        first = claim(storage, ShardPlace(1, 2), "a")
        assert len(first) == 16 and int(first, 16) >= 0
    with LmdbStorage(tmp_path / "a") as storage:
        assert claim(storage, ShardPlace(1, 2), "a") == first  # the same store
        with pytest.raises(ConfigError) as refused:
            claim(storage, ShardPlace(0, 3), "a")
    assert str(refused.value) == (
        "the data dir a holds the records of shard 1 of 2, not of shard 0 of 3: start it "
        "with --shard 1 --shards 2, or give shard 0 of 3 a data dir of its own"
    )
    # A new store (a lost data dir made again) has another id.
    with LmdbStorage(tmp_path / "b") as storage:
        assert claim(storage, ShardPlace(1, 2), "b") != first


def test_a_store_served_before_it_had_a_place_takes_the_one_it_is_given() -> None:
    storage = MemoryStorage()
    storage.put_meta("sources", b"{}")  # a store with state, no place yet
    store_id = claim(storage, ShardPlace(), "mem")
    assert claim(storage, ShardPlace(), "mem") == store_id
    with pytest.raises(ConfigError, match="holds the records of shard 0 of 1"):
        claim(storage, ShardPlace(0, 2), "mem")


@given(count=st.integers(2, MAX_SHARDS), data=st.data())
def test_a_root_names_its_shard_whoever_drew_it(count: int, data: st.DataObject) -> None:
    index = data.draw(st.integers(0, count - 1))
    place = ShardPlace(index, count)
    roots = new_ids(64, index, count)
    assert (shard_of(roots, count) == index).all() and foreign_roots(roots, place) is None
    assert (roots >= MIN_ID).all() and not rangeroots.is_range_root(roots).any()
    first, last = place.range_numbers()
    number = data.draw(st.integers(first, last))
    ranged = rangeroots.encode(number, 100, [100, 105])
    assert (shard_of(ranged, count) == index).all()
    other = ShardPlace((index + 1) % count, count)
    assert foreign_roots(roots, other) is not None
    assert ((partition_shard(3, np.arange(4 * count), count)) < count).all()


def test_a_shards_core_gives_its_own_roots_and_range_numbers() -> None:
    ft = FTLayer(MemoryStorage(), shard=ShardPlace(2, 3))
    ft.register_source(SourceRegistration(9, "forward", 4, completion="barrier"))
    (number,) = ft.register_ranges([(9, "t", 1, 0, 50)])
    assert number >> 15 == 2
    failed = Cause(FailKind.EXPLICIT, "step", "FailException: no")
    assert ft.fail(rangeroots.encode(number, 0, [3, 4]), failed) == 2
    new_roots = ft.unfilled(9).records.roots
    assert (shard_of(new_roots, 3) == 2).all()  # the failed records' new roots


def test_an_address_list_names_each_shard_once_in_order() -> None:
    assert parse_addresses("a:1, b:2,c:3") == ["a:1", "b:2", "c:3"]
    assert parse_addresses("a:1") == ["a:1"]
    with pytest.raises(ConfigError, match="empty entry"):
        parse_addresses("a:1,,b:2")
    with pytest.raises(ConfigError, match="names a shard twice"):
        parse_addresses("a:1,a:1")


def test_parked_failures_are_kept_counted_listed_dropped_and_survive_a_reopen(
    tmp_path: Path,
) -> None:
    """ftlayer.core.parked: each entry committed with its seq, counted per owner, listed
    oldest first, dropped by seq (seqs never reused, also after a reopen), and a store
    that keeps some refuses a savepoint; the wire carries an entry's FAIL unchanged."""
    from ftlayer.causes import Causes
    from ftlayer.core.parked import ParkedFailures
    from ftlayer.errors import StateConflict
    from ftlayer.wire.frames import FrameReader
    from ftlayer.wire.messages import decode
    from ftlayer.wire.parked import encode_fail_parked, encode_parked_list

    cause = Cause(FailKind.EXPLICIT, "step", "ValueError: no")
    frame = encode_fail_parked(1, 2, "7dbf5e27e271f4e8", [5, 6, 7], Causes.one(cause, 3))
    entry = decode(FrameReader(1 << 20).feed(frame)[0])
    store = LmdbStorage(tmp_path / "ft")
    parked = ParkedFailures(store)
    first = parked.park(entry)
    second = parked.park(decode(FrameReader(1 << 20).feed(encode_fail_parked(2, 1, "", [9]))[0]))
    assert parked.counts() == {1: (1, 1), 2: (1, 3)}
    listed, more = parked.listed(1)
    assert [e.seq for e in listed] == [first] and more
    assert listed[0].fail.roots.tolist() == [5, 6, 7] and listed[0].fail.causes.take([0])
    with pytest.raises(StateConflict, match="parked failures"):
        parked.refuse_savepoint()
    store.close()
    store = LmdbStorage(tmp_path / "ft")  # a restart: the entries are in the LMDB meta
    parked = ParkedFailures(store)
    assert parked.counts() == {1: (1, 1), 2: (1, 3)}
    assert parked.drop([first, 999]) == 1 and parked.drop([first]) == 0
    third = parked.park(entry)
    assert third > second > first  # never reused
    listed, more = parked.listed(10)
    assert [e.seq for e in listed] == [second, third] and not more
    reply = decode(FrameReader(1 << 20).feed(encode_parked_list(3, listed, False))[0])
    assert [(e.seq, e.owner, e.store_id, e.body) for e in reply.failures] == [
        (e.seq, e.owner, e.store_id, e.body) for e in listed
    ]
    assert parked.drop([second, third]) == 2 and parked.counts() == {}
    parked.refuse_savepoint()  # none left: no refusal
    store.close()
