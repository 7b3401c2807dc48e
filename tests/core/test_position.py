"""Position: one JSON form, one parser, one formatter."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ftlayer.position import Position, PositionError, offsets_from_json, offsets_to_json

offsets = st.dictionaries(
    st.text(min_size=1, max_size=8),
    st.dictionaries(st.integers(0, 1000), st.integers(0, 2**62), max_size=6),
    max_size=4,
)
positions = st.builds(Position, offsets, st.none() | st.integers(0, 2**62))


@given(positions)
def test_a_position_survives_its_json_text(position: Position) -> None:
    text = json.dumps(position.to_json())
    assert Position.parse(json.loads(text)) == position


@given(offsets, st.integers(0, 10), st.randoms())
def test_equal_positions_have_equal_keys_whatever_the_order(
    kafka: dict[str, dict[int, int]], replay: int, rnd: object
) -> None:
    shuffled_topics = list(kafka.items())
    rnd.shuffle(shuffled_topics)  # type: ignore[attr-defined]
    shuffled = {t: dict(reversed(list(parts.items()))) for t, parts in shuffled_topics}
    assert Position(kafka, replay).key() == Position(shuffled, replay).key()


def test_partitions_are_strings_in_numeric_order() -> None:
    position = Position({"t": {10: 5, 2: 7}}, 3)
    assert json.dumps(position.to_json()) == '{"kafka": {"t": {"2": 7, "10": 5}}, "replay": 3}'


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ([], "JSON object"),
        ({"replay": 1}, 'needs "kafka"'),
        ({"kafka": {}, "replay": 1, "extra": 0}, "extra"),
        ({"kafka": {"t": {"0": -1}}}, "below 0"),
        ({"kafka": {"t": {"x": 1}}}, "partition 'x'"),
        ({"kafka": {"t": {"-1": 1}}}, "partition '-1'"),
        ({"kafka": {"t": {"0": True}}}, "True"),
        ({"kafka": {"t": {"0": 1.5}}}, "1.5"),
        ({"kafka": {"t": []}}, "topic 't'"),
        ({"kafka": {}, "replay": -1}, "replay"),
        ({"kafka": {}, "replay": None}, "replay"),
        ({"kafka": {}, "replay": "3"}, "replay"),
    ],
)
def test_a_malformed_position_is_refused_naming_the_problem(data: object, words: str) -> None:
    with pytest.raises(PositionError, match=words.replace("(", r"\(")):
        Position.parse(data)


def test_a_barrier_needs_its_replay_cursor() -> None:
    assert Position.parse({"kafka": {}}).replay is None
    with pytest.raises(PositionError, match="replay cursor"):
        Position.parse({"kafka": {}}, need_replay=True)


def test_offsets_and_their_json() -> None:
    kafka = {"b": {1: 4, 0: 3}, "a": {0: 0}}
    assert offsets_from_json(offsets_to_json(kafka)) == kafka
    assert list(offsets_to_json(kafka)) == ["a", "b"]
    with pytest.raises(PositionError):
        offsets_from_json({"a": {"0": -2}})


sharded_positions = st.builds(
    Position.at, offsets, st.lists(st.integers(0, 2**62), min_size=1, max_size=5)
)


@given(sharded_positions)
def test_a_position_with_a_cursor_per_shard_survives_its_json_text(position: Position) -> None:
    text = json.dumps(position.to_json())
    parsed = Position.parse(json.loads(text), sharded=True)
    assert parsed == position and parsed.cursors == position.cursors
    if position.cursors is not None and len(position.cursors) == 1:
        assert json.loads(text)["replay"] == position.replay  # one shard: one number


def test_a_cursor_per_shard_and_each_shards_part() -> None:
    position = Position.parse({"kafka": {"t": {"0": 5, "1": 7}}, "replay": [3, 9]}, sharded=True)
    assert (position.replay, position.cursors) == (None, (3, 9))
    part = position.part({"t": {1: 7}}, 1)
    assert part.to_json() == {"kafka": {"t": {"1": 7}}, "replay": 9}
    with pytest.raises(PositionError, match="no shard 2"):
        position.part({}, 2)


@pytest.mark.parametrize(
    ("data", "sharded", "words"),
    [
        ({"kafka": {}, "replay": [1, 2]}, False, "integer >= 0"),  # a CHECKPOINT's: one shard
        ({"kafka": {}, "replay": [1]}, True, "two or more"),
        ({"kafka": {}, "replay": [1, -1]}, True, "one per shard"),
        ({"kafka": {}, "replay": [1, True]}, True, "one per shard"),
        ({"kafka": {}, "replay": []}, True, "two or more"),
    ],
)
def test_a_bad_cursor_list_is_refused(data: object, sharded: bool, words: str) -> None:
    with pytest.raises(PositionError, match=words):
        Position.parse(data, sharded=sharded)


store_ids = st.text("0123456789abcdef", min_size=16, max_size=16)
positions_with_stores = st.lists(st.integers(0, 2**62), min_size=1, max_size=5).flatmap(
    lambda cursors: st.builds(
        Position.at,
        offsets,
        st.just(cursors),
        st.lists(store_ids, min_size=len(cursors), max_size=len(cursors)),
    )
)


@given(positions_with_stores)
def test_the_stores_of_the_cursors_survive_the_json_text(position: Position) -> None:
    parsed = Position.parse(json.loads(json.dumps(position.to_json())), sharded=True)
    assert parsed == position and parsed.stores == position.stores
    assert parsed.stores is not None and len(parsed.stores) == len(parsed.cursors or ())
    # A shard's part of a barrier is what a CHECKPOINT carries: its cursor, no store.
    assert "stores" not in parsed.part({}, 0).to_json()


@pytest.mark.parametrize(
    ("data", "sharded", "words"),
    [
        ({"kafka": {}, "replay": 1, "stores": ["a"]}, False, "got also"),  # a CHECKPOINT's
        ({"kafka": {}, "replay": [1, 2], "stores": ["a"]}, True, "one store per replay"),
        ({"kafka": {}, "replay": 1, "stores": "a"}, True, "list of store ids"),
        ({"kafka": {}, "replay": 1, "stores": [""]}, True, "list of store ids"),
        ({"kafka": {}, "stores": ["a"]}, True, 'needs "replay"'),
    ],
)
def test_bad_stores_are_refused(data: object, sharded: bool, words: str) -> None:
    with pytest.raises(PositionError, match=words):
        Position.parse(data, sharded=sharded)
