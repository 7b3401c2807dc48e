"""Record ids: non-zero, never the reserved values, fresh after fork."""

from __future__ import annotations

import os

import numpy as np
import pytest

from ftlayer.acking.ids import MIN_ID, new_id, new_ids
from ftlayer.errors import ConfigError


def test_ids_are_uint64_and_never_reserved() -> None:
    ids = new_ids(200_000)
    assert ids.dtype == np.uint64 and len(ids) == 200_000
    assert int(ids.min()) >= MIN_ID
    # Uniform over 63 bits: the top bit (range roots) never set, the next one about
    # half the time, no repeats.
    assert not (ids >> np.uint64(63)).any()
    assert 0.48 < float(np.mean((ids >> np.uint64(62)) & np.uint64(1))) < 0.52
    assert len(np.unique(ids)) == len(ids)
    assert new_id() >= MIN_ID


def test_negative_count_is_an_error() -> None:
    with pytest.raises(ConfigError, match="negative"):
        new_ids(-1)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_children_draw_different_ids() -> None:
    new_ids(1)  # the parent's generator exists before the fork
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write, new_ids(4).tobytes())
        os._exit(0)
    os.waitpid(pid, 0)
    child = np.frombuffer(os.read(read, 32), dtype=np.uint64)
    assert not set(child.tolist()) & set(new_ids(4).tolist())
