"""Where a vectorized pipeline waits on the FT layer, per FT mode and request kind: one
run of `bench_fast` (integration/harness/benchfast.py) with every FTClient request of
the driver and the Python workers timed (FTLAYER_REQUEST_TRACE, ftlayer/client/
trace.py), summed per mode over the timed runs: requests per micro-batch, the caller's
wait per request (round trip, the server's queue and handler), and the wait per batch;
beside Spark's `addBatch` per batch (the batch's execution, sink included) and
`latestOffset` (the ftkafka driver's planning). A wait in a task overlaps the other
task slots' work; the sink's SINK_SETTLE and the driver's requests are on the
batch's critical path.

    .venv/bin/python scripts/request_waits.py [BATCH_SIZE] [ROUNDS]
"""

import os
import sys
import tempfile
from pathlib import Path

TRACE = Path(tempfile.mkdtemp(prefix="ftlayer-request-waits-")) / "requests.log"
os.environ["FTLAYER_REQUEST_TRACE"] = str(TRACE)  # before ftlayer is imported

import collections  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import ftlayer.integration.harness.benchfast as bf  # noqa: E402

BATCH = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 2
RECORDS = 400_000
ends: list[float] = []  # each run's end (wall clock), in run order
phases: list[collections.Counter[str]] = []
processing_s = bf._processing_s


def capture(query: Any, records: int) -> float:
    seconds = processing_s(query, records)
    ends.append(time.time())
    counts: collections.Counter[str] = collections.Counter()
    for progress in query.recentProgress:
        data = json.loads(progress.json)
        if data.get("numInputRows", 0) > 0:
            counts.update(data["durationMs"])
            counts["batches"] += 1
    phases.append(counts)
    return seconds


bf._processing_s = capture
bf.bench_fast(records=RECORDS, batch_sizes=[BATCH], rounds=ROUNDS)
modes = [f"warm-up ({m})" for m in bf.WARM_UP]
modes += [m for r in range((len(ends) - len(modes)) // len(bf._order(0))) for m in bf._order(r)]
lines = [line.split() for line in TRACE.read_text().splitlines()]
waits: dict[str, dict[str, list[float]]] = collections.defaultdict(
    lambda: collections.defaultdict(lambda: [0, 0.0])
)
batches: collections.Counter[str] = collections.Counter()
spark: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
for i, mode in enumerate(modes):
    if mode.startswith("warm-up"):
        continue
    began = ends[i - 1]  # from the previous run's end: its query's start is in it
    batches[mode] += phases[i]["batches"]
    spark[mode].update(phases[i])
    for at, _pid, kind, ms, _size in lines:
        if began < float(at) <= ends[i]:
            entry = waits[mode][kind]
            entry[0] += 1
            entry[1] += float(ms)
print(f"{RECORDS:,} records in batches of {BATCH:,}; per micro-batch:")
for mode in ("off", "tree", "barrier"):
    n = batches[mode]
    print(
        f"{mode}: addBatch {spark[mode]['addBatch'] / n:.0f} ms, "
        f"latestOffset {spark[mode]['latestOffset'] / n:.0f} ms"
    )
    for kind, (calls, ms) in sorted(waits[mode].items(), key=lambda item: -item[1][1]):
        print(
            f"  {kind:18} {calls / n:6.1f} requests {ms / calls:7.2f} ms each "
            f"{ms / n:8.1f} ms per batch"
        )
