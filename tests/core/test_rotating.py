"""RotatingHashMap: the expiry bound, touches, batch operations, bad input."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlayer.acking.rotating import RotatingHashMap
from ftlayer.errors import ConfigError


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan")])
def test_non_positive_timeout_is_refused(timeout: float) -> None:
    with pytest.raises(ConfigError, match="timeout must be a positive"):
        RotatingHashMap(3, timeout_s=timeout)


@pytest.mark.parametrize("buckets", [0, 1, True])
def test_fewer_than_two_buckets_are_refused(buckets: int) -> None:
    with pytest.raises(ConfigError, match="at least 2 buckets"):
        RotatingHashMap(buckets)


def test_rotate_expires_after_n_rotations_and_put_touches() -> None:
    expired: list[dict[str, int]] = []
    rmap: RotatingHashMap[str, int] = RotatingHashMap(3, expired.append)
    rmap.put("a", 1)
    rmap.put("b", 2)
    rmap.rotate()
    rmap.put("a", 10)  # touch: back to the newest bucket
    rmap.rotate()
    assert rmap.rotate() == {"b": 2}
    assert expired == [{"b": 2}]
    assert rmap.get("a") == 10 and len(rmap) == 1
    assert rmap.rotate() == {"a": 10}


def test_pop_and_get_find_a_key_in_any_bucket() -> None:
    rmap: RotatingHashMap[int, str] = RotatingHashMap(2)
    rmap.put(1, "x")
    rmap.put(2, "y")
    rmap.rotate()
    rmap.put(3, "z")
    assert rmap.get(1) == "x" and 2 in rmap and sorted(rmap) == [1, 2, 3]
    assert rmap.pop(1) == "x" and rmap.pop(1) is None
    assert rmap.rotate() == {2: "y"} and len(rmap) == 1


def test_tick_without_a_timeout_is_an_error() -> None:
    with pytest.raises(ConfigError, match="timeout_s"):
        RotatingHashMap(3).tick(1.0)


@settings(max_examples=300, deadline=None)
@given(
    timeout=st.floats(0.5, 100.0),
    buckets=st.integers(2, 8),
    put_times=st.lists(st.floats(0.0, 5.0), min_size=1, max_size=30),
    gap_fraction=st.floats(0.01, 0.2),
    gaps=st.lists(st.floats(0.2, 1.0), min_size=1, max_size=20),
)
def test_a_key_untouched_for_t_expires_between_t_and_the_bound(
    timeout: float,
    buckets: int,
    put_times: list[float],
    gap_fraction: float,
    gaps: list[float],
) -> None:
    """With the clock read at irregular moments at most `max_gap` apart, every key
    expires no earlier than T after its put, and no later than T * (1 + 1/(n-1)) plus
    the tick lateness (n ticks, each at most max_gap late)."""
    puts = [t * timeout for t in put_times]
    max_gap = gap_fraction * timeout
    now = 0.0
    expired_at: dict[int, float] = {}

    def on_expire(entries: dict[int, float]) -> None:
        for key in entries:
            expired_at[key] = now

    rmap: RotatingHashMap[int, float] = RotatingHashMap(buckets, on_expire, timeout_s=timeout)
    pending = sorted((t, key) for key, t in enumerate(puts))
    horizon = max(puts) + 2 * timeout + buckets * max_gap + 1
    step = 0
    while now < horizon:
        while pending and pending[0][0] <= now:
            _, key = pending.pop(0)
            rmap.put(key, now)
            puts[key] = now  # the put happens at the first clock reading after its time
        now += max_gap * gaps[step % len(gaps)]
        step += 1
        rmap.tick(now)
    assert set(expired_at) == set(range(len(puts)))
    for key, t in enumerate(puts):
        waited = expired_at[key] - t
        assert waited >= timeout * (1 - 1e-9)
        assert waited <= timeout * (1 + 1 / (buckets - 1)) + buckets * max_gap + 1e-9 * timeout


def test_tick_after_a_long_pause_rotates_once_and_never_expires_early() -> None:
    expired: list[dict[int, int]] = []
    rmap: RotatingHashMap[int, int] = RotatingHashMap(3, expired.append, timeout_s=2.0)
    rmap.put(1, 1)
    assert rmap.tick(1000.0) == 1  # one rotation, however long the pause
    rmap.put(2, 2)
    assert rmap.tick(1000.5) == 0  # the next one is a full interval later
    assert rmap.tick(1001.0) == 1
    assert expired == []
    assert rmap.tick(1002.0) == 1
    assert expired == [{1: 1}]


@settings(max_examples=200, deadline=None)
@given(
    timeout=st.floats(0.5, 60.0),
    buckets=st.integers(2, 6),
    idle=st.floats(0.0, 1000.0),
)
def test_a_key_put_into_a_map_left_idle_waits_for_its_rotations_as_if_ticked_all_along(
    timeout: float, buckets: int, idle: float
) -> None:
    """A ticker that sleeps while a map is empty calls `resume` before the next put: the
    key's first rotation is the one a ticker that never slept would have done next (on
    the map's schedule, after the put), and the key, ticked at its rotations, expires
    between T and T*(1+1/(n-1)) after its put, as with a ticker that never sleeps."""
    expired: list[dict[int, int]] = []
    rmap: RotatingHashMap[int, int] = RotatingHashMap(buckets, expired.append, timeout_s=timeout)
    interval = timeout / (buckets - 1)
    rmap.resume(idle)
    rmap.put(1, 1)
    first = rmap.next_rotation  # on the map's schedule, within an interval after the put
    assert idle < first <= idle + interval * (1 + 1e-9)
    assert abs(first / interval - round(first / interval)) < 1e-6
    while not expired:
        rmap.tick(rmap.next_rotation)
    waited = rmap.next_rotation - interval - idle  # the tick that expired it
    assert timeout - 1e-6 <= waited <= timeout * (1 + 1 / (buckets - 1)) + 1e-6
