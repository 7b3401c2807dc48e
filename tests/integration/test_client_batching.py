"""BatchingChannel against a real `ftlayer serve` process (issue 3, section 3).

Every server runs as its own process on a free loopback port with a tmp data dir, and
is killed by the fixture's finalizer even when a test fails.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from serverproc import Server

from ftlayer.acking.handlers import Anchors, Persister, TaskHandler
from ftlayer.acking.ids import new_ids
from ftlayer.client import (
    BatchingChannel,
    ConnectionLost,
    FTClient,
    close_shared_channels,
    shared_channel,
)
from ftlayer.wire import Kind


@pytest.fixture
def server_proc(ft_server: Server) -> tuple[subprocess.Popen[bytes], str]:
    """One `ftlayer serve` process: (process, address); stopped at the end."""
    return ft_server.proc, ft_server.address


def _persist(persister: Persister, n: int, tag: str) -> Anchors:
    payloads = [f"{tag}-{i}".encode() for i in range(n)]
    return persister.persist(
        payloads, topics="t", partitions=np.zeros(n, dtype=np.int32), offsets=None
    )


def _wait_for(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Seconds until `condition()` held; fails the test after `timeout`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)
    return time.monotonic() - start


def test_batched_events_complete_with_few_frames(
    server_proc: tuple[subprocess.Popen[bytes], str],
) -> None:
    _, address = server_proc
    client = FTClient(address)
    n, per_batch = 2000, 100
    with BatchingChannel(client, max_events=1000, max_delay_s=30.0) as channel:
        persister = Persister(channel)
        batches = [_persist(persister, per_batch, f"b{b}") for b in range(n // per_batch)]
        assert client.requests_sent[Kind.PERSIST] == n // per_batch
        # One map and one sink per record, each flushed to the channel on its own: a
        # channel call per task call, as a task that flushes per record would make.
        calls = 0
        failed_total = 0
        for anchors in batches:
            for i in range(len(anchors)):
                one = anchors.take([i])
                mapped = TaskHandler(channel)
                if i % 25 == 0:  # fail some inputs instead of processing them
                    mapped.process(one, np.zeros(0, dtype=np.intp), failed=[True])
                    mapped.flush()
                    calls += 1
                    failed_total += 1
                    continue
                out = mapped.process(one, [0])
                mapped.flush()
                sink = TaskHandler(channel)
                sink.process(out, np.zeros(0, dtype=np.intp))
                sink.flush()
                calls += 2
        channel.flush()
        frames = client.requests_sent[Kind.XOR] + client.requests_sent[Kind.FAIL]
        assert channel.buffered == 0
        with FTClient(address) as observer:
            status = observer.status()
    assert status["persisted"] == n
    assert status["completed"] == n - failed_total
    assert status["failed"]["explicit"] == failed_total
    assert status["pending"] == status["replay_queue"] == failed_total  # failed: replayed
    assert status["unknown_events"] == status["late_events"] == 0
    assert calls >= 3900 and frames <= calls // 100, (calls, frames)


def test_a_lone_event_is_flushed_within_max_delay(
    server_proc: tuple[subprocess.Popen[bytes], str],
) -> None:
    _, address = server_proc
    max_delay_s = 0.05
    with (
        BatchingChannel(FTClient(address), max_delay_s=max_delay_s) as channel,
        FTClient(address) as observer,
    ):
        anchors = _persist(Persister(channel), 1, "lone")
        assert observer.status()["pending"] == 1
        sink = TaskHandler(channel)
        sink.process(anchors, np.zeros(0, dtype=np.intp))
        sink.flush()  # hands the event to the channel, which only buffers it
        assert channel.buffered == 1
        took = _wait_for(lambda: observer.status()["completed"] == 1, 5.0, "the lone event")
        assert channel.buffered == 0
        # Generous for a loaded CI machine, still far below "never flushed".
        assert took < max_delay_s + 1.0, took


def test_buffer_bound_holds_by_flushing_in_the_caller(
    server_proc: tuple[subprocess.Popen[bytes], str],
) -> None:
    _, address = server_proc
    client = FTClient(address)
    bound = 500
    with BatchingChannel(
        client, max_events=10_000, max_delay_s=60.0, max_buffered_events=bound
    ) as channel:
        anchors = _persist(Persister(channel), 1400, "bound")
        for lo in range(0, 1400, 7):  # complete every record, 7 at a time
            channel.xor(anchors.roots[lo : lo + 7], anchors.ids[lo : lo + 7])
            assert channel.buffered <= bound
        assert channel.max_buffered_seen <= bound
        assert client.requests_sent[Kind.XOR] >= 1400 // bound  # flushed by the callers
        # A call larger than the bound on its own goes out at once, unbuffered.
        big = _persist(Persister(channel), bound + 1, "big")
        channel.xor(big.roots, big.ids)
        assert channel.buffered == 0
        assert channel.max_buffered_seen <= bound
        with FTClient(address) as observer:
            status = observer.status()
    assert status["completed"] == 1400 + bound + 1
    assert status["pending"] == 0


def test_threads_share_one_channel(server_proc: tuple[subprocess.Popen[bytes], str]) -> None:
    _, address = server_proc
    with BatchingChannel(FTClient(address), max_events=300, max_delay_s=0.01) as channel:
        anchors = _persist(Persister(channel), 4000, "threads")
        errors: list[BaseException] = []

        def work(part: int) -> None:
            try:
                for i in range(part, 4000, 4):
                    sink = TaskHandler(channel)
                    sink.process(anchors.take([i]), np.zeros(0, dtype=np.intp))
                    sink.flush()
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(p,)) for p in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors and not any(t.is_alive() for t in threads)
        channel.flush()
        with FTClient(address) as observer:
            status = observer.status()
    assert status["completed"] == 4000 and status["pending"] == 0


def test_a_background_flush_error_surfaces_on_the_next_call(
    server_proc: tuple[subprocess.Popen[bytes], str],
) -> None:
    proc, address = server_proc
    channel = BatchingChannel(FTClient(address, reconnect_s=0.2), max_delay_s=0.02)
    try:
        anchors = _persist(Persister(channel), 3, "doomed")
        proc.kill()
        proc.wait(10)
        channel.xor(anchors.roots, anchors.ids)
        _wait_for(lambda: channel.buffered == 0, 5.0, "the background flush")
        with pytest.raises(ConnectionLost):
            channel.xor(new_ids(1), new_ids(1))
        # Raised once: the channel goes on buffering (and fails again on its next send).
        assert channel.xor(new_ids(2), new_ids(2)) == 2
        with pytest.raises(ConnectionLost):
            channel.flush()
        channel.fail(new_ids(1))
    finally:
        with pytest.raises(ConnectionLost):
            channel.close()
    with pytest.raises(Exception, match="closed"):
        channel.xor(new_ids(1), new_ids(1))


def test_one_shared_channel_per_process_and_a_new_one_after_fork(ft_server: Server) -> None:
    first = shared_channel(ft_server.address)
    assert shared_channel(ft_server.address) is first
    _persist(Persister(first), 3, "parent")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its own channel, which works
        code = 1
        try:
            child = shared_channel(ft_server.address)
            _persist(Persister(child), 2, "child")
            code = 0 if child is not first else 2
        finally:
            os.write(write, bytes([code]))
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"\0"
    assert shared_channel(ft_server.address) is first  # the parent's is untouched
    assert first.status()["persisted"] == 5
    close_shared_channels()
    assert first.closed
    assert shared_channel(ft_server.address) is not first
    close_shared_channels()
