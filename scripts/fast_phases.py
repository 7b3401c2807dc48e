"""Where a vectorized pipeline's batches spend their time, per FT mode: one run of
`bench_fast` (integration/harness/benchfast.py) with Spark's `durationMs` of every batch
that read records summed per run (addBatch is the batch's execution; latestOffset and
commitOffsets hold the ftkafka driver's FT-layer round trips).

    .venv/bin/python scripts/fast_phases.py [BATCH_SIZE]
"""

import collections
import json
import sys
from typing import Any

import ftlayer.integration.harness.benchfast as bf

BATCH = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
calls: list[dict[str, int]] = []
processing_s = bf._processing_s


def capture(query: Any, records: int) -> float:
    seconds = processing_s(query, records)
    phases: collections.Counter[str] = collections.Counter()
    for progress in query.recentProgress:
        data = json.loads(progress.json)
        if data.get("numInputRows", 0) > 0:
            phases.update(data["durationMs"])
    calls.append(dict(phases))
    return seconds


bf._processing_s = capture
result = bf.bench_fast(records=400_000, batch_sizes=[BATCH], rounds=1)
for mode, phases in zip(
    [*(f"warm-up ({m})" for m in bf.WARM_UP), "off", "tree", "barrier"], calls, strict=False
):
    print(f"{mode:15} {phases}")
print(json.dumps(result["batch_sizes"][str(BATCH)]))
