"""The ftkafka driver's heartbeat thread (integration/source/heartbeat.py) against a real
`ftlayer serve`: it leases the running batch while it beats, stops at `idle` and
`close` (which ends a running batch's lease with a lease of 0), and survives a server
it cannot reach."""

from __future__ import annotations

import logging
import time

import pytest
from serverproc import StartServer

from ftlayer.client import FTClient
from ftlayer.integration.harness.kafka import wait_until
from ftlayer.integration.source.heartbeat import LEASE_INTERVALS, Heartbeat, heartbeat_interval_s

POSITION = {"kafka": {"t": {"0": 1}}, "replay": 0}
SOURCE = 5


def test_the_interval_is_ft_heartbeat_ms_at_most_a_quarter_of_the_timeout() -> None:
    assert heartbeat_interval_s(2000, 30.0) == 2.0
    assert heartbeat_interval_s(2000, 2.0) == 0.5
    assert LEASE_INTERVALS * heartbeat_interval_s(2000, 2.0) <= 0.75 * 2.0


def test_it_leases_the_batch_while_running_and_lets_the_lease_lapse_when_idle(
    start_server: StartServer,
) -> None:
    server = start_server()
    interval = 0.2
    with server.client() as client:
        client.checkpoint(begin=True, query="q", position=POSITION, sources=[SOURCE])
        beat = Heartbeat(lambda: FTClient(server.address), [SOURCE], interval)
        try:
            beat.running()
            wait_until(lambda: (client.status().lease_of(SOURCE) or 0) > 0, 10, "a lease")
            time.sleep(5 * interval)
            assert beat.sent >= 3
            assert 0 < (client.status().lease_of(SOURCE) or 0) <= beat.lease_s
            beat.idle()
            sent = beat.sent
            wait_until(lambda: client.status().lease_of(SOURCE) == 0, 10, "the lease to lapse")
            assert beat.sent <= sent + 1  # at most the one in flight at idle()
            beat.running()  # the next batch
            wait_until(lambda: (client.status().lease_of(SOURCE) or 0) > 0, 10, "a new lease")
        finally:
            beat.close()
        # Closed while beating (a query stopped mid-batch): its last heartbeat ended the
        # lease at once (lease 0; a lapse would leave 2 intervals or more), so its trees
        # wait for no next barrier.
        assert client.status().lease_of(SOURCE) == 0
        sent = beat.sent
        time.sleep(3 * interval)
        assert beat.sent == sent  # closed: no more heartbeats


def test_an_unreachable_ft_layer_is_logged_once_and_never_raises(
    start_server: StartServer, caplog: pytest.LogCaptureFixture
) -> None:
    server = start_server()
    address = server.address
    server.kill()
    caplog.set_level(logging.WARNING, logger="ftlayer.source")
    beat = Heartbeat(lambda: FTClient(address, reconnect_s=0.1), [SOURCE], 0.1)
    try:
        beat.running()
        time.sleep(1.0)
    finally:
        beat.close()
    warnings = [r for r in caplog.records if "heartbeat to the FT layer failed" in r.message]
    assert len(warnings) == 1 and beat.sent == 0
