"""Benchmarks: each measures ftlayer and, in the same run, the baseline it is judged by.

- acker: XOR updates per second through AckerTable on batched events, against a naive
  one-event-at-a-time dict loop on the same events; and the memory per pending root of
  a bare table and of the FT layer's own. Targets: >= 3,000,000 updates/s, >= 3x the
  naive loop, <= 64 bytes per pending root in the FT layer's table.
- persist: source records per second through persist -> complete -> delete on LMDB
  (FTLayer on LmdbStorage), against raw py-lmdb put + delete of the same payloads in the
  same batches. Targets: >= 250,000 records/s and >= 0.5x raw LMDB.
- server: XOR updates and records per second through a real `ftlayer serve` over
  loopback from client processes, against the in-process core on the same sizes.
  Targets: >= 1,500,000 XOR updates/s and >= 150,000 records/s. Also, in the shape of
  a Spark job (two task slots persisting 50,000-record chunks of a 200,000-record
  micro-batch while a sink completes the batch before), how long each persist and
  each XOR frame takes: what one connection's work costs the others (`mixed`).
- cluster: records and XOR updates per second of an FT layer of 1 and of 2 shards
  (server processes, fed by client processes on the same machine), and the servers'
  CPU per record. Targets: 2 shards >= 1.3x one, and <= 1.15x its CPU per record.
- checkpoint: a micro-batch job's records per second with a checkpoint at every batch
  against none, in paired rounds; checkpoint times against pending roots. Target:
  >= 0.95x without.
- ingest: records per second a JetStream receiver stores in a real `ftlayer serve`
  (one receiver process, and two sharing the consumer), against a bare pull consumer
  that only acknowledges. Target: one receiver >= 0.5x the bare consumer.
- pipeline (ftlayer.integration.harness.benchpipe): the demo pipeline on Spark, FT on
  against FT off.

Each returns a dict of figures; the CLI prints it as one JSON object on the last line.
Figures are wall-clock rates on whatever else the machine is doing: compare the ratio,
which both sides of one run share.
"

One module per bench (`acker`, `persist`, `server` with `mixed`, `cluster`, `checkpoint`) and
`timing`, the clock and machine figures they share. Nothing here is on the runtime's
import path: the CLI loads it only for `ftlayer bench`.
"""

from .acker import bench_acker, ft_table_bytes_per_pending_root, tree_events
from .checkpoint import bench_checkpoint
from .cluster import bench_cluster
from .ingest import bench_ingest
from .mixed import mixed_server_run
from .persist import bench_persist
from .server import bench_server

# ftlayer.benchreport records the CPU steal of a report's run with these.
from .timing import _cpu_times as _cpu_times
from .timing import _steal_percent as _steal_percent

__all__ = [
    "bench_acker",
    "bench_checkpoint",
    "bench_cluster",
    "bench_ingest",
    "bench_persist",
    "bench_server",
    "ft_table_bytes_per_pending_root",
    "mixed_server_run",
    "tree_events",
]
