"""`ftlayer bench checkpoint`: a micro-batch job's records per second with a checkpoint
at every batch against none, in paired rounds, through a real `ftlayer serve` process
(ftlayer.integration.harness.ftprocess, loaded only when the bench runs); checkpoint
times against pending roots."""

from __future__ import annotations

import gc
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ftlayer.acking.ids import new_ids
from ftlayer.errors import ConfigError
from ftlayer.records import RecordBatch

from .timing import _cpu_times, _machine, _steal_percent

CHECKPOINT_TARGET_RATIO = 0.95
_CHECKPOINT_QUERY = "bench"


def bench_checkpoint(
    batches: int = 10,
    batch: int = 20_000,
    rounds: int = 60,
    payload_bytes: int = 100,
    pending_points: tuple[int, ...] = (0, 10_000, 100_000, 1_000_000),
    directory: str | None = None,
) -> dict[str, Any]:
    """Throughput with a checkpoint at every micro-batch against none, and checkpoint
    time against the number of pending roots, through a real `ftlayer serve` process.

    One client (this process) plays a micro-batch job: batch i persists `batch`
    records (topic "bench", partition 0, consecutive offsets) and the sink completes
    batch i - 1 (one batch in flight, as a pipeline has). With checkpoints, batch i is
    preceded by CHECKPOINT_BEGIN of its end position (what ftkafka's partitions()
    sends), which also completes the last batch found complete (Spark's commit(end)
    of the batch before, which ftkafka sends with the next BEGIN: Spark plans the
    next batch right after it): one request per batch, as in a Spark job. `rounds`
    pairs of rounds, one without and one with checkpoints, run on one server in the
    order AB BA AB ..., short, so drift of the machine hits both alike; the ratio is
    records/s with over records/s without, over all rounds. The spread of the pairs'
    own ratios shows how steady the machine was, and `cpu_steal_percent` how much CPU
    a hypervisor took meanwhile (Linux; the per-batch cost of checkpoints is mostly
    latency, which grows with it).

    The throughput rounds run with the server's default journal bases (a barrier writes
    one once the journal grew by max(1 MiB, 24 B per pending root)). Then, on a server
    that writes a journal base at every barrier (`--journal-base-bytes 0`: what a
    barrier that writes one costs), for each count in `pending_points`, roots that
    never complete are added until that many are pending and 5 checkpoints are taken:
    the client's round trip of CHECKPOINT_BEGIN (the server replies at once; the state
    snapshot is copied before the core's next change or by the writer thread, which
    then writes the base), the time until CHECKPOINT_DONE reports it complete
    (written), the copy's time under the server's lock (the only part that stops
    events), the write time and the base's size, as medians.
    """
    from ftlayer.client import FTClient
    from ftlayer.integration.harness.ftprocess import FTServerProcess

    if rounds < 1 or batches < 2 or batch < 1:
        raise ConfigError(
            f"need rounds >= 1, batches >= 2, batch >= 1; got {rounds}, {batches}, {batch}"
        )
    payload = os.urandom(payload_bytes)
    with tempfile.TemporaryDirectory(dir=directory, prefix="ftlayer-bench-checkpoint-") as tmp:
        server = FTServerProcess(Path(tmp) / "data", "--tree-timeout-s", "3600").start()
        try:
            with FTClient(server.address, name="bench-checkpoint") as client:
                offset = 0
                seconds = {False: 0.0, True: 0.0}
                pair_ratios: list[float] = []
                done: dict[str, Any] | None = None  # the last checkpointed batch, complete
                cpu_before = _cpu_times()
                for pair in range(rounds):
                    took: dict[bool, float] = {}
                    for checkpoints in (False, True) if pair % 2 == 0 else (True, False):
                        gc.collect()
                        began = time.perf_counter()
                        offset, done = _checkpoint_bench_round(
                            client, batches, batch, payload, offset, checkpoints, done
                        )
                        took[checkpoints] = time.perf_counter() - began
                        seconds[checkpoints] += took[checkpoints]
                    pair_ratios.append(took[False] / took[True])
                steal = _steal_percent(cpu_before)
                if done is not None:
                    _bench_checkpoint_call(client, False, done)
                status = client.status()
                if status["pending"] or status["completed"] != 2 * rounds * batches * batch:
                    raise AssertionError(
                        f"checkpoint bench: {status['completed']} completed and "
                        f"{status['pending']} pending, expected "
                        f"{2 * rounds * batches * batch} and 0"
                    )
                completed_checkpoints = status["checkpoints"][_CHECKPOINT_QUERY]["completed"]
        finally:
            server.stop()
        # A barrier writes a journal base only when one is due: the times by pending
        # roots are those of barriers that write one (a server told to at every one).
        base_server = FTServerProcess(
            Path(tmp) / "data-bases", "--tree-timeout-s", "3600", "--journal-base-bytes", "0"
        ).start()
        try:
            with FTClient(base_server.address, name="bench-checkpoint-bases") as client:
                by_pending = _checkpoint_times(client, pending_points, 0)
        finally:
            base_server.stop()
    records = rounds * batches * batch
    without, with_ = records / seconds[False], records / seconds[True]
    ratio = with_ / without
    return {
        "bench": "checkpoint",
        "batches_per_round": batches,
        "batch": batch,
        "rounds": rounds,
        "payload_bytes": payload_bytes,
        "records_per_s_without_checkpoints": round(without),
        "records_per_s_with_checkpoints": round(with_),
        "ratio_with_vs_without": round(ratio, 3),
        "pair_ratios": _spread(pair_ratios),
        "cpu_steal_percent": steal,
        "checkpoints_completed": completed_checkpoints,
        "checkpoint_time_by_pending": by_pending,
        "target": {"ratio_with_vs_without": CHECKPOINT_TARGET_RATIO},
        "meets_target": ratio >= CHECKPOINT_TARGET_RATIO,
        "machine": _machine(),
    }


def _spread(ratios: list[float]) -> dict[str, Any]:
    """Min, median, max of the pairs' ratios and a 95% interval for their geometric
    mean (normal approximation on the logs): how far the machine's noise leaves the
    overall ratio uncertain."""
    logs = np.log(np.asarray(ratios, dtype=np.float64))
    half = 1.96 * float(logs.std(ddof=1)) / np.sqrt(len(logs)) if len(logs) > 1 else 0.0
    centre = float(logs.mean())
    return {
        "pairs": len(ratios),
        "min": round(min(ratios), 3),
        "median": round(float(np.median(ratios)), 3),
        "max": round(max(ratios), 3),
        "geometric_mean_95ci": [
            round(float(np.exp(centre - half)), 3),
            round(float(np.exp(centre + half)), 3),
        ],
    }


def _checkpoint_bench_round(
    client: Any,
    batches: int,
    batch: int,
    payload: bytes,
    offset: int,
    checkpoints: bool,
    done: dict[str, Any] | None,
) -> tuple[int, dict[str, Any] | None]:
    """One round of the micro-batch job. `done` is the position of the last
    checkpointed batch, done but not reported complete yet: Spark's commit of a batch
    goes with the next BEGIN, in the next checkpointed round if this one has none.
    Returns the next offset and the `done` for the next round."""
    in_flight: tuple[NDArray[np.uint64], NDArray[np.uint64]] | None = None
    previous: dict[str, Any] | None = None
    payloads = [payload] * batch
    for _ in range(batches):
        end = {"kafka": {"bench": {"0": offset + batch}}, "replay": 0}
        if checkpoints:
            _bench_checkpoint_call(client, True, end, complete=done)
            done = None
        roots, ids = new_ids(batch), new_ids(batch)
        offsets = np.arange(offset, offset + batch, dtype=np.int64)
        client.persist(
            RecordBatch.build(roots, payloads, topics="bench", partitions=0, offsets=offsets), ids
        )
        if in_flight is not None:
            client.xor(*in_flight)
            if checkpoints:  # that batch is complete: ftkafka's commit(end) defers to here
                done = previous
        in_flight, previous, offset = (roots, ids), end, offset + batch
    if in_flight is not None:
        client.xor(*in_flight)
        if checkpoints:
            done = previous
    return offset, done


def _bench_checkpoint_call(
    client: Any,
    begin: bool,
    position: dict[str, Any],
    complete: dict[str, Any] | None = None,
) -> dict[str, Any]:
    answer: dict[str, Any] = client.checkpoint(
        begin=begin,
        query=_CHECKPOINT_QUERY,
        position=position,
        sources=[0],
        mode="unaligned",
        complete=complete,
    )
    return answer


def _checkpoint_times(
    client: Any, pending_points: tuple[int, ...], offset: int
) -> list[dict[str, Any]]:
    """Median checkpoint figures at each pending count (roots that never complete)."""
    found: list[dict[str, Any]] = []
    pending = 0
    for target in sorted(pending_points):
        while pending < target:
            n = min(65_536, target - pending)
            offsets = np.arange(offset, offset + n, dtype=np.int64)
            client.persist(
                RecordBatch.build(
                    new_ids(n), [b"x"] * n, topics="stuck", partitions=0, offsets=offsets
                )
            )
            pending, offset = pending + n, offset + n
        rtts, durations, copies, writes, sizes = [], [], [], [], []
        for _ in range(5):
            position = {"kafka": {"bench": {"0": offset}}, "replay": 0}
            offset += 1  # a new barrier each time
            began = time.perf_counter()
            _bench_checkpoint_call(client, True, position)
            rtts.append(time.perf_counter() - began)
            done = _bench_checkpoint_call(client, False, position)
            while done["state"] != "complete":  # its snapshot is still being written
                time.sleep(0.001)
                done = _bench_checkpoint_call(client, False, position)
            durations.append(time.perf_counter() - began)
            copies.append(done["copy_s"])  # taken after the reply to BEGIN (lazily)
            writes.append(done["write_s"])
            sizes.append(done["size_bytes"])
        found.append(
            {
                "pending_roots": pending,
                "begin_round_trip_ms": round(1000 * float(np.median(rtts)), 2),
                "until_complete_ms": round(1000 * float(np.median(durations)), 2),
                "copy_under_lock_ms": round(1000 * float(np.median(copies)), 3),
                "write_ms": round(1000 * float(np.median(writes)), 2),
                "snapshot_bytes": int(np.median(sizes)),
                "bytes_per_pending_root": round(float(np.median(sizes)) / pending, 1)
                if pending
                else None,
            }
        )
    return found
