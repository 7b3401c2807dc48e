"""Durability under SIGKILL (issue 3, section 4): no confirmed record vanishes; and
with the acker journal (issue 14, part 2) a restart replays only the trees whose events
were in transit at the kill.

A real `ftlayer serve` runs on a tmp data dir; two client processes stream small
persist batches, complete most records with XOR, fail some and leave the rest
pending, logging every PERSIST that got OK and every completing XOR about to be sent.
The server is SIGKILLed at a random moment (a seeded RNG: FTLAYER_DURABILITY_SEED,
else a fresh seed per run, shown on failure) and restarted on the same data dir.
Then every record whose persist was confirmed must still be stored and pending in the
restarted server (restored from the journal, or replayed), unless the XOR that
completes it was sent (applied or not: the kill may come between applying it and the
reply). Records never confirmed may or may not be there. Each client has one request
in flight at a time, so at most one batch per client has events in transit at the
kill: with the journal, recovery replays (failed.recovery) at most that many trees;
without it (`--no-journal`), every stored record.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from serverproc import StartServer, read_address, terminated

from ftlayer import rangeroots
from ftlayer.causes import Cause, FailKind
from ftlayer.client import FTClient
from ftlayer.persistence import LmdbStorage
from ftlayer.policy import RetryPolicy
from ftlayer.registration import SourceRegistration

CLIENTS = 2
PER_BATCH = 50
BASE_SEED = int(os.environ.get("FTLAYER_DURABILITY_SEED", time.time_ns() % 2**32))

# One client process: persist batches of PER_BATCH records with payloads
# b"c<client>-b<batch>-r<i>"; after each OK append a line to the log, then fail the
# records i % 10 == 0, complete those with i % 10 >= 2 (XOR) and leave i % 10 == 1
# pending. Log lines: "P <batch>" (persist OK), "S <batch>" (about to send the
# completing XOR).
# It stops at the first error: the server was killed (it retries a refused connection
# for 1 s only, not the default minute a job waits for a restarting server).
CLIENT_SCRIPT = """
import sys
import numpy as np
from ftlayer.client import FTClient
from ftlayer.acking.handlers import Persister

address, client, log_path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
n = int(sys.argv[4])
i = np.arange(n)
with open(log_path, "a", buffering=1) as log, FTClient(address, reconnect_s=1) as channel:
    persister = Persister(channel, source_id=client)
    batch = 0
    try:
        while True:
            payloads = [f"c{client}-b{batch}-r{r}".encode() for r in range(n)]
            a = persister.persist(payloads, topics="t", partitions=i % 2, offsets=None)
            log.write(f"P {batch}\\n")
            channel.fail(a.roots[i % 10 == 0])
            done = i % 10 >= 2
            log.write(f"S {batch}\\n")
            channel.xor(a.roots[done], a.ids[done])
            batch += 1
    except Exception as exc:
        print(f"client {client} stopped at batch {batch}: {exc!r}", file=sys.stderr)
"""


class Processes:
    """Every process a test starts; all killed by the fixture's finalizer."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: dict[int, Path] = {}  # a server's log by its pid

    def server(self, data_dir: Path, *args: str) -> tuple[subprocess.Popen[bytes], str]:
        log = self.tmp_path / f"server-{len(self.procs)}.log"
        command = [sys.executable, "-m", "ftlayer.cli", "serve", "--data-dir", str(data_dir)]
        command += args
        with log.open("wb") as stderr:
            proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr)
        self.procs.append(proc)
        self.logs[proc.pid] = log
        return proc, read_address(proc, log)

    def client(self, address: str, client: int, log: Path) -> subprocess.Popen[bytes]:
        command = [sys.executable, "-c", CLIENT_SCRIPT, address, str(client), str(log)]
        command.append(str(PER_BATCH))
        stderr = (self.tmp_path / f"client-{client}.err").open("ab")
        with stderr:
            proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
        self.procs.append(proc)
        return proc

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(tmp_path)
    try:
        yield procs
    finally:
        procs.kill_all()


def _confirmed(log: Path) -> tuple[set[int], set[int]]:
    """(batches whose persist got OK, batches whose completing XOR was sent).

    A sent XOR may have been applied even if the kill came before its OK reached the
    client, so the records it completes may be gone: only sending is logged."""
    persisted: set[int] = set()
    completing: set[int] = set()
    text = log.read_text() if log.exists() else ""
    for line in text.split("\n")[:-1]:  # the last piece is "" or a torn line
        kind, batch = line.split()
        (persisted if kind == "P" else completing).add(int(batch))
    return persisted, completing


def _wait_for_batches(logs: list[Path], at_least: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while min(len(_confirmed(log)[0]) for log in logs) < at_least:
        if time.monotonic() > deadline:
            raise AssertionError(f"clients did not confirm {at_least} batches in {timeout} s")
        time.sleep(0.01)


@pytest.mark.parametrize(("kill_point", "journal"), [(0, True), (1, True), (2, True), (3, False)])
def test_no_confirmed_record_vanishes_after_sigkill(
    processes: Processes, tmp_path: Path, kill_point: int, journal: bool
) -> None:
    seed = BASE_SEED + kill_point
    rng = random.Random(seed)
    data_dir = tmp_path / "data"
    flags = () if journal else ("--no-journal",)
    server, address = processes.server(data_dir, *flags)
    logs = [tmp_path / f"client-{c}.log" for c in range(CLIENTS)]
    clients = [processes.client(address, c, logs[c]) for c in range(CLIENTS)]
    _wait_for_batches(logs, at_least=1, timeout=15.0)
    time.sleep(rng.uniform(0.0, 0.6))  # the random kill point
    server.send_signal(signal.SIGKILL)
    server.wait(10)
    for proc in clients:  # each stops at its first error
        assert proc.wait(15) == 0

    restarted, address = processes.server(data_dir, *flags)
    with FTClient(address) as client:
        status = client.status()
    assert terminated(restarted, processes.logs[restarted.pid]) == 0
    with LmdbStorage(data_dir) as storage:  # what the restarted server held
        stored = {bytes(p) for _seqs, batch, _r in storage.scan() for p in batch.payloads}

    must_survive: set[bytes] = set()
    batches = 0
    for c, log in enumerate(logs):
        persisted, completing = _confirmed(log)
        assert persisted, f"client {c} never confirmed a persist (seed {seed})"
        batches += len(persisted)
        for batch in persisted:
            for r in range(PER_BATCH):
                payload = f"c{c}-b{batch}-r{r}".encode()
                if not (batch in completing and r % 10 >= 2):  # no completing XOR sent
                    must_survive.add(payload)
    missing = must_survive - stored
    assert not missing, (
        f"seed {seed}: {len(missing)} of {len(must_survive)} confirmed records "
        f"vanished, e.g. {sorted(missing)[:5]}"
    )
    assert status["pending"] == status["stored_records"] == len(stored), f"seed {seed}: {status}"
    # Everything stored is a record a client sent: nothing is made up.
    assert all(p.startswith(b"c") and b"-b" in p and b"-r" in p for p in stored)
    replayed = status["failed"]["recovery"]
    if journal:
        # Only trees with events in transit (one request per client) are replayed; the
        # rest were restored as they were, and completed trees whose delete was still
        # staged were deleted, not replayed.
        assert replayed <= CLIENTS * PER_BATCH, f"seed {seed}: {status}"
        assert status["recovered_pending"] + replayed == len(stored), f"seed {seed}: {status}"
    else:
        assert replayed == len(stored) and status["recovered_pending"] == 0
    assert batches >= CLIENTS, f"seed {seed}: the clients made too little progress"


def test_a_batch_s_failures_answered_before_a_sigkill_are_failed_after_the_restart(
    start_server: StartServer,
) -> None:
    """Barrier mode by reference: a FAIL of a batch's rows is answered once the server
    journaled it (the failures of a batch are applied together, ftlayer.core.failnotes).
    A SIGKILL right after the answers loses none of them, and the restarted server does
    not complete them with their batch; STATUS shows a failure as soon as it is
    answered."""
    source, topic = 7, "orders"
    cause = Cause(FailKind.EXPLICIT, "enrich", "FailException: no")
    server = start_server()
    with server.client() as client:
        client.register_source(SourceRegistration(source, "forward", 2, completion="barrier"))
        (number,) = client.register_ranges([(source, topic, 0, 0, 100)])
        assert client.fail(rangeroots.encode(number, 0, [3, 5, 3]), cause) == 2
        assert client.fail(rangeroots.encode(number, 0, [9]), cause) == 1
    server.kill()
    server = start_server(server.data_dir)
    with server.client() as client:
        assert sorted(client.unfilled(source).records.offsets.tolist()) == [3, 5, 9]
        assert client.fail(rangeroots.encode(number, 0, [40]), cause) == 1
        # The three the journal gave back, and this one, applied for the STATUS.
        assert client.status().failed["explicit"] == 4
        assert sorted(client.unfilled(source).records.offsets.tolist()) == [3, 5, 9, 40]


@pytest.mark.parametrize("kill", [False, True], ids=["filled", "killed-before-the-fill"])
def test_a_batch_s_failures_are_filled_by_range_root_after_its_barrier(
    start_server: StartServer, kill: bool
) -> None:
    """Over the wire, in the pipeline's order: a batch's FAILs are noted; the next
    trigger's brief STATUS counts them unfilled and the filler's UNFILLED lists them by
    range root; the barrier that completes the batch commits the group offset only up
    to the first failed row; the filler's FILL stores them with their bytes, and the
    planner's FETCH_REPLAY gets them back with those bytes. A SIGKILL between the
    barrier and the FILL loses none: the restarted server lists them by seq."""
    source, topic = 7, "orders"
    cause = Cause(FailKind.EXPLICIT, "enrich", "FailException: no")
    server = start_server()

    def end(offset: int, replay: int) -> dict[str, object]:
        return {"kafka": {topic: {"0": offset}}, "replay": replay}

    with server.client() as client:
        client.register_source(
            SourceRegistration(
                source, "forward", 2, retry=RetryPolicy(3, 0, 0), completion="barrier"
            )
        )
        client.checkpoint(begin=True, query="q", position=end(100, 0), sources=[source])
        (number,) = client.register_ranges([(source, topic, 0, 0, 100)])
        assert client.fail(rangeroots.encode(number, 0, [5, 3]), cause) == 2
        # The next trigger.
        assert client.brief_status().unfilled_of(source) == 2
        wanted = client.unfilled(source)
        assert sorted(wanted.seqs.tolist()) == rangeroots.encode(number, 0, [3, 5]).tolist()
        reply = client.checkpoint(
            begin=True, query="q", position=end(200, 0), sources=[source], complete=end(100, 0)
        )
        assert reply["completed"]["commit_offsets"] == {topic: {"0": 3}}
        if kill:
            server.kill()
            server = start_server(server.data_dir)
            client = server.client()
            wanted = client.unfilled(source)
            assert sorted(wanted.records.offsets.tolist()) == [3, 5]
            assert not bool(rangeroots.is_range_root(wanted.seqs).any())
        offsets = wanted.records.offsets.tolist()
        n = len(offsets)
        filled = client.fill(
            wanted.seqs,
            np.ones(n, dtype=np.bool_),
            [b"bytes of %d" % o for o in offsets],
            (np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.bool_)),
        )
        assert filled == 2
        assert client.brief_status().unfilled_of(source) == 0
        hi = client.brief_status().replay_cursor_of([source])
        replays = client.fetch_replay(0, hi, source).records
        assert sorted(zip(replays.offsets.tolist(), list(replays.payloads), strict=True)) == [
            (3, b"bytes of 3"),
            (5, b"bytes of 5"),
        ]
        assert client.status().failed["explicit"] == 2
        client.close()
