"""CPU per record of LmdbStorage's put, delete, set_roots and scan, the way the FT-layer
server uses them in a vectorized pipeline: 50,000-record batches of 70-byte payloads
(or 50 to 90 bytes), 8 of them (two 200,000-record micro-batches), each micro-batch's
records deleted at once (barrier mode), then the same records deleted in scattered
subsets (20 deletes of every 20th record, each offset by one: completions that arrive
out of put order, as after a shuffle), set_roots of every 100th record of a batch, and
a scan of what is left. Process CPU time (user + system) per record, median of ROUNDS
rounds on fresh stores in a temporary directory, fsync on as the server runs. Each
store is first filled and emptied once, so the figures are those of a running server,
whose data.mdb no longer grows (a growing file costs the kernel far more CPU per byte
than pages LMDB reuses).

    .venv/bin/python scripts/storage_cpu.py [ROUNDS] [DIRECTORY]
"""

import json
import resource
import statistics
import sys
import tempfile
from collections.abc import Callable

import numpy as np

from ftlayer.persistence import LmdbStorage
from ftlayer.records import RecordBatch

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
DIRECTORY = sys.argv[2] if len(sys.argv) > 2 else None
BATCH, BATCHES, MICRO = 50_000, 8, 200_000
rng = np.random.default_rng(7)


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def batch(n: int, varied: bool) -> RecordBatch:
    sizes = rng.integers(50, 91, n) if varied else np.full(n, 70)
    payloads = [b"x" * int(size) for size in sizes]
    roots = rng.integers(2, 2**63, n, dtype=np.uint64)
    return RecordBatch.build(roots, payloads, topics="events", offsets=np.arange(n))


def timed(work: Callable[[], object], records: int) -> float:
    before = cpu()
    work()
    return (cpu() - before) / records * 1e6


def run(varied: bool) -> dict[str, float]:
    batches = [batch(BATCH, varied) for _ in range(BATCHES)]
    total = BATCH * BATCHES
    with (
        tempfile.TemporaryDirectory(dir=DIRECTORY) as tmp,
        LmdbStorage(f"{tmp}/store", map_size=1 << 30) as storage,
    ):
        for b in batches:
            storage.put(b)
        storage.delete(np.arange(1, storage.next_seq, dtype=np.uint64))
        base = storage.next_seq - 1
        put = timed(lambda: [storage.put(b) for b in batches], total)
        micro = [
            np.arange(base + lo + 1, base + lo + MICRO + 1, dtype=np.uint64)
            for lo in range(0, total, MICRO)
        ]
        whole = timed(lambda: [storage.delete(seqs) for seqs in micro], total)
        for b in batches:
            storage.put(b)
        first = base + total + 1
        seqs = np.arange(first, first + total, dtype=np.uint64)

        def scattered() -> None:
            for offset in range(20):
                storage.delete(seqs[offset::20])

        storage.put(batches[0])
        scattered_cpu = timed(scattered, total)
        tail = np.arange(base + 2 * total + 1, base + 2 * total + BATCH + 1, dtype=np.uint64)
        retag = tail[::100]
        set_roots = timed(lambda: storage.set_roots(retag, retag, retag), len(retag))
        scan = timed(lambda: list(storage.scan()), BATCH)
    return {
        "put": put,
        "delete_200k_at_once": whole,
        "delete_scattered": scattered_cpu,
        "set_roots_scattered": set_roots,
        "scan": scan,
    }


results: dict[str, dict[str, float]] = {}
for varied in (False, True):
    rounds = [run(varied) for _ in range(ROUNDS)]
    name = "varied_payloads_50_90" if varied else "payloads_70"
    results[name] = {k: round(statistics.median(r[k] for r in rounds), 3) for k in rounds[0]}
print(json.dumps({"us_cpu_per_record": results, "rounds": ROUNDS}))
