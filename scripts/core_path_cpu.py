"""CPU per record of the FT-layer server's core work in barrier mode, in this process:
each micro-batch of 200,000 records persisted in pieces of 10,000 (the reader's
PERSIST_PIECE_RECORDS) in the server's three steps (begin_persist, LmdbStorage.put with
fsync, end_persist; payloads in one buffer as they come off the wire), then released
at its barrier and its completed records deleted, with a journal. The fast bench's
records: 40-byte values, one in ten 9 bytes. Process CPU (user + system) per record
over ROUNDS micro-batches after one warm-up, and the functions that take the most
time under cProfile in one more.

    .venv/bin/python scripts/core_path_cpu.py [ROUNDS]
"""

import cProfile
import os
import pstats
import resource
import sys
import tempfile

import numpy as np

from ftlayer.acking.ids import new_ids
from ftlayer.core import FTLayer
from ftlayer.core.journal import Journal
from ftlayer.persistence import LmdbStorage
from ftlayer.records import Payloads, RecordBatch
from ftlayer.registration import SourceRegistration

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
PIECE, PIECES, SOURCE = 10_000, 20, 7
VALUES = Payloads.of([b"%08d|" % i + (b"x" * 31 if i % 10 else b"") for i in range(PIECE)])


def micro_batch(ft: FTLayer, storage: LmdbStorage, first: int) -> int:
    for piece in range(PIECES):
        offsets = np.arange(first, first + PIECE)
        batch = RecordBatch.build(
            new_ids(PIECE),
            VALUES,
            source_ids=SOURCE,
            topics="t",
            partitions=piece % 4,
            offsets=offsets,
        )
        first += PIECE
        ticket = ft.begin_persist(batch, None)
        ft.end_persist(ticket, storage.put(batch))
    ft.release_barrier([SOURCE])
    storage.delete(ft.take_deletes())
    return first


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        storage = LmdbStorage(os.path.join(tmp, "db"))
        ft = FTLayer(
            storage, timeout_s=3600, defer_deletes=True, journal=Journal(os.path.join(tmp, "j"))
        )
        ft.register_source(SourceRegistration(SOURCE, "forward", 4, completion="barrier"))
        first = micro_batch(ft, storage, 0)
        began = _cpu()
        for _ in range(ROUNDS):
            first = micro_batch(ft, storage, first)
        used = _cpu() - began
        print(f"CPU per record: {used / (ROUNDS * PIECES * PIECE) * 1e6:.3f} µs")
        profile = cProfile.Profile()
        profile.enable()
        micro_batch(ft, storage, first)
        profile.disable()
        pstats.Stats(profile).sort_stats(os.environ.get("SORT", "tottime")).print_stats(
            int(os.environ.get("TOP", "12"))
        )
        storage.close()


if __name__ == "__main__":
    main()
