"""The demo's pipeline with its driver in client mode on a standalone cluster, as a
script: the driver process of test_cluster_hosts.py, run on a host of its own.

``python cluster_job.py --master spark://... --driver-host ADDR --options JSON
--sink-topic T --checkpoint DIR --flaky-dir DIR --log-file FILE --executors N
[--conf KEY=VALUE ...]`` starts a SparkSession against the master (its driver bound to
`--driver-host`), waits until `--executors` executors registered, and starts the
demo's query (`ftlayer.integration.harness.demo.start_pipeline`) with the `ftkafka`
source options of `--options`: the FT layer reached only through ft.address,
ft.tokenFile and ft.tlsCa, as a user's job reaches it. It then prints one JSON line
(`executors`, `started_s`), and one (`running`: the tasks each executor runs, by
"HOST:PORT", from the driver's status tracker) whenever those change, and runs until
its stdin closes, when it stops the query between triggers and exits 0, or until it is
killed; if the query dies first, it exits 1 with the query's exception on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

from ftlayer.integration.harness.demo import start_pipeline, stop_when_idle
from ftlayer.integration.harness.standalone import (
    log_lost_tasks,
    running_tasks,
    wait_for_executors,
)
from ftlayer.integration.source import register
from ftlayer.integration.spark import local_spark


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--master", required=True)
    parser.add_argument("--driver-host", required=True)
    parser.add_argument("--options", required=True, help="the source's options, JSON")
    parser.add_argument("--sink-topic", required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--flaky-dir", required=True)
    parser.add_argument("--fail-rate", type=float, default=0.01)
    parser.add_argument("--log-file", required=True)
    parser.add_argument("--executors", type=int, default=2)
    parser.add_argument("--conf", action="append", default=[], help="KEY=VALUE")
    args = parser.parse_args()
    started = time.monotonic()
    conf = dict(item.split("=", 1) for item in args.conf)
    conf |= {"spark.driver.host": args.driver_host, "spark.driver.bindAddress": args.driver_host}
    spark = local_spark(
        master=args.master,
        app_name="ftlayer-cluster-hosts",
        conf=conf,
        fast_start=True,
        log_file=args.log_file,
    )
    spark.sparkContext.setLogLevel("WARN")
    log_lost_tasks(spark)
    executors = wait_for_executors(spark, args.executors)
    register(spark)
    options = json.loads(args.options)
    query = start_pipeline(
        spark, options, args.sink_topic, args.checkpoint, args.flaky_dir, args.fail_rate
    )
    print(
        json.dumps({"executors": executors, "started_s": round(time.monotonic() - started, 1)}),
        flush=True,
    )
    stdin_closed = threading.Event()

    def wait_for_eof() -> None:
        sys.stdin.read()
        stdin_closed.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    running: dict[str, int] = {}
    checked = time.monotonic()
    while not stdin_closed.wait(0.02):
        now = running_tasks(spark)
        if now != running:
            running = now
            print(json.dumps({"running": running}), flush=True)
        if time.monotonic() - checked > 0.5:
            checked = time.monotonic()
            if query.exception() is not None:
                print(f"the query failed: {query.exception()}", file=sys.stderr, flush=True)
                return 1
    stop_when_idle(query)
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
