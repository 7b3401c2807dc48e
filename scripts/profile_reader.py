"""Where the ftkafka reader spends its time per record (docs/benchmarks.md, "Where FT
on spends its time at full speed"): bare consumer vs read_partition
FT off / FT on (barrier, tree), with and without the prefetch thread; wrapped timers on
the FT steps. One 200,000-record partition of 40-byte values, a real broker and server."""

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kafka import TopicPartition

import ftlayer.integration.source.reader as reader
from ftlayer.integration.harness.broker import TansuBroker
from ftlayer.integration.harness.ftprocess import FTServerProcess
from ftlayer.integration.harness.kafka import create_topic, produce
from ftlayer.integration.source import source_schema
from ftlayer.integration.source.options import parse_options

N = 200_000
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
timers = {"persist": 0.0, "encode": 0.0, "arrow": 0.0}


def timed(name, fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            timers[name] += time.perf_counter() - t

    return wrapper


reader._persist = timed("persist", reader._persist)
reader.encode_payloads = timed("encode", reader.encode_payloads)
reader._arrow_batch = timed("arrow", reader._arrow_batch)
prefetched = reader._prefetched


def value(i):
    body = b"%08d|" % i
    return body + b"x" * (40 - len(body))


results = {}
with tempfile.TemporaryDirectory() as tmp, TansuBroker(log_path=Path(tmp) / "b.log") as broker:
    create_topic(broker.bootstrap, "t", 1)
    produce(broker.bootstrap, "t", ((None, value(i)) for i in range(N)), timeout=600)
    cfg = {
        "fetch_max_bytes": reader._FETCH_MAX_BYTES,
        "max_partition_fetch_bytes": reader._PARTITION_FETCH_MAX_BYTES,
        "max_poll_records": reader._MAX_POLL_RECORDS,
        "fetch_max_wait_ms": 100,
    }

    def bare():
        c = reader.new_consumer(broker.bootstrap, cfg)
        tp = TopicPartition("t", 0)
        c.assign([tp])
        c.seek(tp, 0)
        seen = 0
        while seen < N:
            for b in c.poll(timeout_ms=500).values():
                seen += len(b)
        c.close()

    with FTServerProcess(Path(tmp) / "ft") as server:
        source = 0

        def run(mode, prefetch):
            global source
            source += 1
            opts = {"kafka.bootstrap.servers": broker.bootstrap, "subscribe": "t"}
            if mode != "off":
                opts.update({"ft.address": server.address, "ft.completion": mode})
            options = parse_options(opts)
            schema = source_schema(mode != "off", completion=mode if mode != "off" else "tree")
            reader._prefetched = prefetched if prefetch else (lambda chunks: chunks)
            for k in timers:
                timers[k] = 0.0
            t = time.perf_counter()
            rows = sum(
                b.num_rows
                for b in reader.read_partition(
                    options, schema, reader.FTKafkaPartition("t", 0, 0, N, source, 0, 0)
                )
            )
            assert rows == N
            return time.perf_counter() - t, dict(timers)

        cases = [
            ("consumer", None, None),
            ("off", False),
            ("barrier", False),
            ("barrier", True),
            ("tree", False),
            ("tree", True),
        ]
        for case in cases:
            results[str(case[:2])] = []
        for _ in range(ROUNDS):
            for case in cases:
                if case[0] == "consumer":
                    t = time.perf_counter()
                    bare()
                    results[str(case[:2])].append((time.perf_counter() - t, {}))
                else:
                    results[str(case[:2])].append(run(case[0], case[1]))
out = {}
for key, runs in results.items():
    secs = statistics.median(s for s, _ in runs)
    parts = (
        {k: round(statistics.median(t[k] for _, t in runs) / N * 1e6, 3) for k in timers}
        if runs[0][1]
        else {}
    )
    out[key] = {
        "records_per_s": round(N / secs),
        "us_per_record": round(secs / N * 1e6, 3),
        **({"us_per_record_in": parts} if parts else {}),
    }
print(json.dumps(out, indent=1))
