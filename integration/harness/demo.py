"""`ftlayer demo`: the main job, end to end on real parts, with its own verdict.

It starts an embedded Tansu broker, an FT-layer server process (`ftlayer serve`) and
local Spark; produces `records` keyed JSON events to an input topic; and runs this
Structured Streaming pipeline on them, every step wrapped by ftlayer:

    ftkafka source -> parse (JSON) -> enrich (flaky) -> filter -> Kafka sink

- parse: the event's JSON value into columns.
- enrich: adds a tier and a cents amount. It is flaky: for a `fail_rate` share of the
  events (chosen by a hash of the event id) it raises FailException the first time it
  sees the event (first sight is a marker file created with O_EXCL, so it holds across
  Python workers and retries). Only that event's tree fails; it is replayed.
- filter: drops events with a negative amount (about 3 in 97): their trees complete
  without output.
- sink: writes the enriched events as JSON to an output topic; a row is acked only
  once the broker confirmed its write.

With `kill_workers` K, a thread SIGKILLs a running PySpark Python worker K times at
random moments (a worker busy on a task: one that used CPU in the last 0.1 s; an idle
pooled worker would die unnoticed): Spark retries the task, whose re-read takes over
the dead attempt's records (ftlayer.core.takeover), and ftlayer replays whatever else
the dead worker left incomplete. Each kill is reported once through `on_kill`; Spark's
own log (WARN and above: the stack traces of the killed tasks, the query's warnings)
goes to a file, `spark_log` in the result, never to the terminal.

With `cluster`, Spark is a standalone cluster of a master and two workers, each a
process of its own (`integration/harness/standalone.py`), with the driver (this
process) in client mode, and the FT layer serves TLS and needs a token (files made with
openssl, `integration/harness/pki.py`); the executors learn of it only through the
source's options ft.address, ft.tokenFile and ft.tlsCa. With `kill_worker` too, one
worker is SIGKILLed midway with its executor JVM and Python workers, and Spark runs
the lost tasks on the other one.

With `shards` N > 1 (2 by default with `cluster`), the FT layer is N `ftlayer serve
--shard I --shards N` processes, each on its own data dir and port, named in shard
order by ft.address (`integration/harness/demoshards.py`); its figures are their sums.
With `kill_shard` too, once a third of the events were persisted, the last shard is
SIGKILLed right after a micro-batch was planned and started again on its data dir
`outage_s` later (`ShardKill`: a batch being planned would wait for the dead shard,
and every other partition with it); meanwhile the source
holds back only that shard's partitions, and `completed_during_outage` counts the
records the other shards completed (from their STATUS at the kill and at the restart).

While it runs it shows produced, completed, pending and replayed counts. At the end it
checks two counts that are measured apart against each other:

- `completed`: the trees the FT layer completed (its STATUS `completed`). An event's
  tree completes once, or is replaced by its replay's when it fails; a dead-lettered
  (poison) event completes none. A record the source persisted again
  (`persisted_again`, STATUS `persisted` - produced: a retried Spark task computes
  its input again) has a second root, which completes too in barrier mode (tree
  mode retires the earlier one: ftlayer.core.takeover).
- `completed_at_sink`: the events the output topic accounts for, read back at the end:
  those whose output is there, and those the filter drops (no output is theirs).

So completed_at_sink <= completed <= completed_at_sink + persisted_again: fewer means
an event accounted for at the sink whose tree never completed, more a tree completed
that no record explains. `lost` counts events that passed the filter and never
reached the output topic, and poison events that were not dead-lettered;
`duplicates_at_sink` counts extra copies in the output topic (at-least-once delivery:
a replayed tree writes again). The result is valid (exit 0) only with lost = 0, no
tree pending, every poison event dead-lettered, and completed within those bounds
(with no record persisted again: completed = completed_at_sink); on a cluster also
with an executor on each worker, and the worker killed when `kill_worker` asked for it.
A killed shard's counters die with it: what it completed after its last STATUS
counts nowhere, so with a shard killed `completed` is a lower bound and the bounds
above are not checked; the verdict then rests on the sink (lost = 0), no tree
pending on any shard, the dead letters and the group offsets, and on the shard
killed and started again.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftlayer.errors import FailException, FTLayerError
from ftlayer.integration.daemon import is_task_worker_cmdline
from ftlayer.integration.harness.broker import TansuBroker
from ftlayer.integration.harness.demoshards import (
    ShardKill,
    ShardSampler,
    ShardTotals,
    start_shards,
)
from ftlayer.integration.harness.kafka import create_topic, end_offsets, produce, read_all
from ftlayer.integration.harness.pki import make_server_files
from ftlayer.integration.harness.standalone import (
    StandaloneCluster,
    log_lost_tasks,
    running_tasks,
    wait_for_executors,
)
from ftlayer.integration.source.deadletters import history_of
from ftlayer.integration.source.options import parse_options
from ftlayer.shards import MAX_SHARDS

__all__ = [
    "DemoError",
    "DemoResult",
    "busy_python_workers",
    "python_workers",
    "run_demo",
    "source_options",
    "start_pipeline",
    "stop_when_idle",
]

TIERS = ("bronze", "silver", "gold")
PARSED_SCHEMA = "key binary, id long, user string, amount long"
ENRICHED_SCHEMA = "key binary, value binary, id long, amount long"


class DemoError(FTLayerError):
    """The demo could not run to a verdict (a part did not start, time ran out)."""


@dataclass
class DemoResult:
    produced: int
    completed: int
    lost: int
    replayed: int
    failed_explicit: int
    timeouts: int
    duplicates_at_sink: int
    seconds: float
    expected_outputs: int
    outputs_at_sink: int
    trees_completed: int
    workers_killed: int
    pending_at_end: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        extra = self.extra
        at_sink = extra.get("completed_at_sink", -1)
        # A killed shard's counters die with it (module docstring): no bounds then.
        counted = extra.get("shard_kills", 0) > 0 or (
            at_sink <= self.completed <= at_sink + extra.get("persisted_again", 0)
        )
        base = self.lost == 0 and self.pending_at_end == 0 and counted
        dead_ok = (
            extra.get("dead_lettered", 0) == extra.get("poison_events", 0)
            and not extra.get("dead_letters_unexpected", 0)
            and not extra.get("dead_letters_wrong_attempts", 0)
            and not extra.get("dead_letters_without_cause", 0)
            and extra.get("group_lag_at_end", 0) == 0
        )
        # On a standalone cluster: an executor on each worker, and the worker killed.
        cluster_ok = extra.get("cluster") != "standalone" or (
            extra.get("executors", 0) >= 2
            and self.workers_killed == (1 if extra.get("kill_worker") else 0)
        )
        shards_ok = extra.get("shard_kills", 0) == (1 if extra.get("kill_shard") else 0)
        # A source that cannot replay: every event acknowledged upstream, and the
        # receiver killed when asked.
        upstream_ok = extra.get("acked_upstream", self.produced) == self.produced and extra.get(
            "receivers_killed", 0
        ) == (1 if extra.get("kill_receiver") else 0)
        return base and dead_ok and cluster_ok and shards_ok and upstream_ok

    def as_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in self.__dict__.items() if k != "extra"}
        data.update(self.extra)
        data["ok"] = self.ok
        return data


# ---- the pipeline's user code (what a data engineer writes) ---------------------------


def event(i: int, users: int) -> tuple[bytes, bytes]:
    """The i-th produced event: key user-<k>, value JSON."""
    user = f"user-{i % users}"
    value = {"id": i, "user": user, "amount": i % 97 - 3}
    return user.encode(), json.dumps(value, separators=(",", ":")).encode()


def passes_filter(i: int) -> bool:
    return i % 97 - 3 >= 0


def is_flaky(event_id: int, fail_rate: float) -> bool:
    return zlib.crc32(event_id.to_bytes(8, "little")) % 1_000_000 < fail_rate * 1_000_000


def is_poison(event_id: int, poison_rate: float) -> bool:
    """Poison events fail every time (another hash than the flaky one's)."""
    chosen = zlib.crc32(b"poison" + event_id.to_bytes(8, "little")) % 1_000_000
    return chosen < poison_rate * 1_000_000


def parse(row: dict[str, Any]) -> dict[str, Any]:
    data = json.loads(row["value"])
    return {"key": row["key"], "id": data["id"], "user": data["user"], "amount": data["amount"]}


def make_enrich(
    flaky_dir: str, fail_rate: float, poison_rate: float = 0.0
) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def enrich(row: dict[str, Any]) -> dict[str, Any]:
        event_id = row["id"]
        if poison_rate and is_poison(event_id, poison_rate):
            raise FailException(f"enrich: event {event_id} is poison (it fails every time)")
        if is_flaky(event_id, fail_rate):
            try:  # first sight, across processes: only one O_EXCL create succeeds
                os.close(os.open(os.path.join(flaky_dir, str(event_id)), os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                raise FailException(f"enrich: upstream lookup timed out for event {event_id}")
        tier = TIERS[zlib.crc32(row["user"].encode()) % len(TIERS)]
        out = {"id": event_id, "user": row["user"], "tier": tier, "cents": row["amount"] * 100}
        return {
            "key": row["key"],
            "value": json.dumps(out, separators=(",", ":")).encode(),
            "id": event_id,
            "amount": row["amount"],
        }

    return enrich


def keep(row: dict[str, Any]) -> bool:
    return bool(row["amount"] >= 0)


# ---- running it --------------------------------------------------------------------------


def python_workers(root: int | None = None) -> list[int]:
    """PIDs of the PySpark task workers of the driver `root` (None: this process): the
    processes its own Spark JVM's task daemon forked (`is_task_worker_cmdline`). Never another
    process's: the machine may run other Spark jobs, and the daemons of data source
    planning (`pyspark.sql.worker.*`) run no task. (The daemon makes a process group
    of its own: ancestry, not the group, tells whose it is.)"""
    parents: dict[int, int] = {}
    task_daemons: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        pid = int(entry)
        parents[pid] = int(stat.rsplit(")", 1)[1].split()[1])
        if is_task_worker_cmdline(cmdline):
            task_daemons.add(pid)
    me = os.getpid() if root is None else root

    def ours(pid: int) -> bool:
        seen = 0
        while pid > 1 and seen < 64:  # the JVM is this process's child
            pid, seen = parents.get(pid, 0), seen + 1
            if pid == me:
                return True
        return False

    # A daemon's forked workers carry its command line too: a worker's parent is the
    # daemon, the daemon's parent the JVM.
    return [pid for pid in task_daemons if parents.get(pid) in task_daemons and ours(pid)]


def _cpu_ticks(pid: int) -> int | None:
    """User plus system CPU time of a process, in clock ticks (None: it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])


def busy_python_workers(sample_s: float = 0.1, root: int | None = None) -> list[int]:
    """PySpark Python workers (of the driver `root`, `python_workers`) that used CPU
    during the last `sample_s` seconds: those running a task (the pool also keeps idle
    ones)."""
    before = {pid: _cpu_ticks(pid) for pid in python_workers(root)}
    time.sleep(sample_s)
    busy = []
    for pid, ticks in before.items():
        now = _cpu_ticks(pid)
        if ticks is not None and now is not None and now > ticks:
            busy.append(pid)
    return busy


def _killer(
    times: int,
    seconds: float,
    stop: threading.Event,
    seed: int,
    on_kill: Callable[[str], None] | None = None,
) -> Callable[[], int]:
    """Start a thread that SIGKILLs a running Python worker `times` times, at random
    moments spread over about `seconds` from the moment the first worker runs, calling
    `on_kill` with one line per kill; returns a function giving how many it killed."""
    killed = [0]
    rng = random.Random(seed)

    def run() -> None:
        moments = sorted(rng.uniform(0.1, 1.0) * seconds for _ in range(times))
        while not stop.is_set() and not python_workers():
            stop.wait(0.05)
        start = time.monotonic()
        for moment in moments:
            while not stop.is_set():
                if time.monotonic() - start >= moment:
                    workers = busy_python_workers()
                    if workers:
                        pid = rng.choice(workers)
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                            killed[0] += 1
                            if on_kill is not None:
                                on_kill(f"killed Python worker {pid} ({killed[0]} of {times})")
                        break
                stop.wait(0.05)

    threading.Thread(target=run, name="ftlayer-demo-killer", daemon=True).start()
    return lambda: killed[0]


class _WorkerKill:
    """`run_demo`'s kill of one Spark worker, once, from a thread of its own: once a
    third of the events were persisted (`progress` feeds it the FT layer's figures), at
    the first moment every executor runs a task (the driver's status tracker) and the
    worker's executor has Python workers, so that it dies in the middle of a task.
    `start` starts the thread; it ends with the kill or when `stop` is set."""

    def __init__(
        self,
        cluster: StandaloneCluster,
        spark: Any,
        records: int,
        stop: threading.Event,
        on_kill: Callable[[str], None] | None,
    ) -> None:
        self.cluster, self.spark, self.records = cluster, spark, records
        self.stop, self.on_kill = stop, on_kill
        self.index = len(cluster.worker_pids) - 1
        self.persisted = 0
        self.workers = 0
        """Spark workers killed (0 or 1)."""
        self.processes = 0
        """Processes killed with it: the worker, its executor, Python daemon and workers."""

    def progress(self, progress: Mapping[str, Any]) -> None:
        self.persisted = max(self.persisted, int(progress.get("persisted", 0)))

    def start(self) -> None:
        threading.Thread(target=self._run, name="ftlayer-demo-worker-kill", daemon=True).start()

    def _run(self) -> None:
        executors = len(self.cluster.worker_pids)
        while not self.stop.wait(0.02):
            if self.persisted < self.records // 3:
                continue
            busy = [n for n in running_tasks(self.spark).values() if n > 0]
            if len(busy) >= executors and self.cluster.python_workers(self.index):
                pid = self.cluster.worker_pids[self.index]
                self.processes = self.cluster.kill_worker(self.index)
                self.workers = 1
                if self.on_kill is not None:
                    self.on_kill(
                        f"killed Spark worker {self.index} (pid {pid}) with its executor and "
                        f"Python workers, in the middle of a task: {self.processes} processes"
                    )
                return


def spark_log_path(workdir: str | None) -> Path:
    """Where Spark's log goes: in the workdir, or a kept file in the temp directory (the
    demo's own temporary workdir is removed at its end). `close_spark_log` ends it."""
    if workdir is not None:
        return Path(workdir) / "spark.log"
    fd, name = tempfile.mkstemp(prefix="ftlayer-demo-spark-", suffix=".log")
    os.close(fd)
    return Path(name)


def close_spark_log(path: Path) -> None:
    """Say so in the file when Spark logged nothing, so that the file the demo names
    never reads as if the log had gone elsewhere."""
    with contextlib.suppress(OSError):
        if path.stat().st_size == 0:
            path.write_text("ftlayer demo: Spark logged nothing at WARN or above in this run\n")


@contextlib.contextmanager
def demo_workdir(path: str | None) -> Iterator[Path]:
    if path is not None:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix="ftlayer-demo-") as tmp:
        yield Path(tmp)


def source_options(
    bootstrap: str,
    topic: str,
    ft_options: Mapping[str, str],
    *,
    max_per_trigger: int = 20_000,
    max_retries: int = 10,
    completion: str = "barrier",
    persist: str = "reference",
    dead_topic: str | None = None,
    group: str | None = None,
    tree_ranges: bool = True,
) -> dict[str, str]:
    """The demo's `ftkafka` source options: Kafka, the replay partitioner, retries,
    completion and persistence, plus `ft_options` (ft.address, and with a token and TLS
    ft.tokenFile and ft.tlsCa: all an executor learns of the FT layer)."""
    options = {
        "kafka.bootstrap.servers": bootstrap,
        "subscribe": topic,
        "maxOffsetsPerTrigger": str(max_per_trigger),
        "ft.partitioner": "kafka-hash",
        "ft.maxRetries": str(max_retries),
        "ft.completion": completion,
        "ft.persist": persist,
        "ft.treeRanges": str(tree_ranges).lower(),
        **ft_options,
    }
    if dead_topic is not None:
        options["ft.deadLetterTopic"] = dead_topic
    if group is not None:
        options["kafka.group.id"] = group
    return options


def start_pipeline(
    spark: Any,
    options: Mapping[str, str],
    sink_topic: str,
    checkpoint: str | os.PathLike[str],
    flaky_dir: str | os.PathLike[str],
    fail_rate: float,
    poison_rate: float = 0.0,
    trigger: str = "500 milliseconds",
    *,
    source_format: str = "ftkafka",
    sink_bootstrap: str | None = None,
) -> Any:
    """Start the demo's query on `spark` (the `ftkafka` and `ftingest` formats
    registered there): source -> parse -> enrich -> filter -> Kafka sink (module
    docstring), the source of `source_format` read with `options` (`source_options`).
    The tasks and the sink take the source's FTSettings (`parse_options(options).ft`),
    as a user's job does; the sink writes to `sink_topic` on `sink_bootstrap` (None: the
    source's brokers). Returns the StreamingQuery."""
    from ftlayer.integration.sinks import ft_kafka_sink
    from ftlayer.integration.tasks import FTTasks

    settings = parse_options(options, ingest=source_format == "ftingest").ft
    tasks = FTTasks(settings)
    source = spark.readStream.format(source_format).options(**options).load()
    parsed = tasks.map(source, parse, PARSED_SCHEMA)
    enrich = make_enrich(os.fspath(flaky_dir), fail_rate, poison_rate)
    enriched = tasks.map(parsed, enrich, ENRICHED_SCHEMA)
    kept = tasks.filter(enriched, keep)
    bootstrap = sink_bootstrap or options["kafka.bootstrap.servers"]
    return (
        kept.writeStream.foreachBatch(
            ft_kafka_sink(bootstrap, sink_topic, settings, on_error="fail-and-continue")
        )
        .option("checkpointLocation", os.fspath(checkpoint))
        .trigger(processingTime=trigger)
        .start()
    )


def run_demo(
    records: int = 100_000,
    fail_rate: float = 0.01,
    partitions: int = 4,
    kill_workers: int = 0,
    *,
    users: int = 1_000,
    max_per_trigger: int = 20_000,
    ft_timeout_s: float = 20.0,
    deadline_s: float = 900.0,
    seed: int = 0,
    workdir: str | None = None,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    on_kill: Callable[[str], None] | None = None,
    poison_rate: float = 0.0,
    max_retries: int = 10,
    completion: str = "barrier",
    http_port: int | None = None,
    persist: str = "reference",
    cluster: bool = False,
    kill_worker: bool = False,
    shards: int | None = None,
    kill_shard: bool = False,
    outage_s: float = 20.0,
    tree_ranges: bool = True,
) -> DemoResult:
    """Run the demo (see the module docstring); returns its counts. With `http_port`,
    the FT-layer process serves its status page and /metrics on that loopback port;
    `completion`, `persist` and `tree_ranges` are the source's ft.completion,
    ft.persist and ft.treeRanges.

    With `cluster`, Spark is a standalone cluster of a master and two workers, each a
    process of its own (`StandaloneCluster`), the driver (this process) in client mode,
    and the FT layer has a token and TLS (files made in the workdir, `pki`), which the
    executors learn of only through the source's options ft.address, ft.tokenFile and
    ft.tlsCa. With `kill_worker` too, once a third of the events were persisted, one
    worker is SIGKILLed with its executor and Python workers in the middle of a task
    (`_WorkerKill`, `StandaloneCluster.kill_worker`); Spark runs the lost tasks on the
    other one.
    `workers_killed` then counts Spark workers; `kill_workers` (Python workers) is for
    local Spark only.

    `shards`: the FT layer's shards (None: 2 with `cluster`, else 1); with `kill_shard`
    (2 or more shards), the last is SIGKILLed once a third of the events were persisted
    and started again on its data dir `outage_s` seconds later (`ShardKill`)."""
    from ftlayer.integration.source import register
    from ftlayer.integration.spark import local_spark

    if records < 1 or partitions < 1 or kill_workers < 0 or not 0 <= fail_rate <= 1:
        raise DemoError(
            "need records >= 1, partitions >= 1, kill_workers >= 0 and 0 <= fail_rate <= 1"
        )
    if not 0 <= poison_rate <= 1 or max_retries < 0:
        raise DemoError("need 0 <= poison_rate <= 1 and max_retries >= 0")
    if kill_worker and not cluster:
        raise DemoError("kill_worker kills a worker of a standalone cluster: it needs cluster")
    if cluster and kill_workers:
        raise DemoError("kill_workers kills Python workers of local Spark; with cluster use "
                        "kill_worker")  # fmt: skip
    shards = shards if shards is not None else 2 if cluster else 1
    if not 1 <= shards <= MAX_SHARDS or max_per_trigger < 1:
        raise DemoError(f"need 1 <= shards <= {MAX_SHARDS} and max_per_trigger >= 1")
    if kill_shard and shards < 2:
        raise DemoError(
            f"kill_shard kills one of several FT-layer shards: it needs shards >= 2, got {shards}"
        )
    if not outage_s > 0:
        raise DemoError(f"outage_s must be a positive number of seconds, got {outage_s}")
    started = time.monotonic()
    spark_log = spark_log_path(workdir)
    with (
        demo_workdir(workdir) as work,
        TansuBroker(log_path=work / "broker.log") as broker,
        contextlib.ExitStack() as parts,
    ):
        bootstrap = broker.bootstrap
        source_topic, sink_topic = "demo-events", "demo-enriched"
        dead_topic, group = "demo-dead-letters", "ftlayer-demo"
        create_topic(bootstrap, source_topic, partitions)
        create_topic(bootstrap, sink_topic, partitions)
        create_topic(bootstrap, dead_topic, 1)
        produce(bootstrap, source_topic, (event(i, users) for i in range(records)), timeout=300)
        flaky_dir = work / "flaky"
        flaky_dir.mkdir()
        serve_args = ["--tree-timeout-s", str(ft_timeout_s)]
        tls = make_server_files(work / "tls", ["localhost", "127.0.0.1"]) if cluster else None
        if tls is not None:
            serve_args += tls.serve_args()
        servers = start_shards(parts, work, shards, serve_args, http_port)
        ft_options = {"ft.address": ",".join(server.address for server in servers)}
        ft_options.update(tls.source_options() if tls is not None else {})
        options = source_options(
            bootstrap,
            source_topic,
            ft_options,
            max_per_trigger=max_per_trigger,
            max_retries=max_retries,
            completion=completion,
            persist=persist,
            dead_topic=dead_topic,
            group=group,
            tree_ranges=tree_ranges,
        )
        standalone = parts.enter_context(StandaloneCluster(work / "spark")) if cluster else None
        spark = local_spark(
            master=standalone.master_url if standalone is not None else "local[2,8]",
            app_name="ftlayer-demo",
            conf=standalone.spark_conf() if standalone is not None else None,
            log_file=spark_log,
            # Four JVMs start on the cluster; the JVMs' share of the work is small.
            fast_start=standalone is not None,
        )
        # The file, not the terminal, takes Spark's warnings too: what a reader of
        # the log needs besides errors (lost tasks, a batch falling behind).
        spark.sparkContext.setLogLevel("WARN")
        if standalone is not None:
            log_lost_tasks(spark)  # which tasks a lost executor took with it
        stop_killer = threading.Event()
        killed: Callable[[], int] | None = None
        worker_kill = None
        if standalone is not None and kill_worker:
            worker_kill = _WorkerKill(standalone, spark, records, stop_killer, on_kill)
        settings = parse_options(options).ft
        sampler = parts.enter_context(
            ShardSampler(settings.addresses, settings.token, settings.tls_ca or False)
        )
        shard_kill = None
        if kill_shard:
            shard_kill = ShardKill(servers, sampler, records, outage_s, stop_killer, on_kill)
        query = None
        try:
            executors = 0
            if standalone is not None:
                executors = wait_for_executors(spark, len(standalone.worker_pids))
            register(spark)
            query = start_pipeline(
                spark,
                options,
                sink_topic,
                work / "checkpoint",
                flaky_dir,
                fail_rate,
                poison_rate,
            )
            if kill_workers:
                killed = _killer(kill_workers, 5.0, stop_killer, seed, on_kill)
            if worker_kill is not None:
                worker_kill.start()
            if shard_kill is not None:
                shard_kill.watch(query)

            def progress(totals: ShardTotals, now: dict[str, Any]) -> None:
                if worker_kill is not None:
                    worker_kill.progress(now)
                if shard_kill is not None:
                    shard_kill.step(totals)
                if on_progress is not None:
                    on_progress(now)

            status = _wait_until_settled(
                query, sampler, source_topic, records, deadline_s, progress
            )
            # While the job runs: its group's committed offsets reach the end.
            lag = _group_lag(bootstrap, group, source_topic, partitions, wait_s=30.0)
        finally:
            stop_killer.set()
            if query is not None:
                stop_when_idle(query)
            spark.stop()
            close_spark_log(spark_log)
        outputs = read_all(bootstrap, sink_topic, timeout=120)
        dead = read_all(bootstrap, dead_topic, timeout=120)
        master = standalone.master_url if standalone is not None else "local[2,8]"
    seconds = time.monotonic() - started
    poison = {i for i in range(records) if poison_rate and is_poison(i, poison_rate)}
    expected = {i for i in range(records) if passes_filter(i)} - poison
    found = [json.loads(r.value)["id"] for r in outputs if r.value is not None]
    distinct = set(found)
    letters = _dead_letters(dead)
    pending = status.pending
    dead_ids = set(letters)
    dropped = records - len(expected) - len(poison)  # by the filter: no output is theirs
    missing = len(expected - distinct) + len(poison - dead_ids)
    failed = status.failed
    return DemoResult(
        produced=records,
        completed=status.completed,
        lost=missing,
        replayed=sum(int(v) for v in failed.values()),
        failed_explicit=int(failed.get("explicit", 0)),
        timeouts=int(failed.get("timeout", 0)),
        duplicates_at_sink=len(found) - len(distinct),
        seconds=round(seconds, 1),
        expected_outputs=len(expected),
        outputs_at_sink=len(found),
        trees_completed=status.completed,
        workers_killed=worker_kill.workers if worker_kill else killed() if killed else 0,
        pending_at_end=pending,
        extra={
            "partitions": partitions,
            "fail_rate": fail_rate,
            "kill_workers": kill_workers,
            "spark_log": str(spark_log),
            "completed_at_sink": len(distinct & expected) + dropped,
            "persisted_again": status.persisted - records,
            "poison_rate": poison_rate,
            "poison_events": len(poison),
            "max_retries": max_retries,
            "dead_lettered": len(dead_ids),
            "dead_letters_at_topic": len(dead),
            "dead_letters_unexpected": len(dead_ids - poison),
            "dead_letters_wrong_attempts": sum(
                1 for attempts, _ in letters.values() if attempts != max_retries + 1
            ),
            # Each failure's cause: the poison step's error, or a timeout (a worker kill).
            "dead_letters_without_cause": sum(
                1
                for _, causes in letters.values()
                if not any("poison" in c for c in causes)
                or not all("poison" in c or c == "" for c in causes)
            ),
            "max_attempts_seen": max((a for a, _ in letters.values()), default=0),
            "completion": completion,
            "persist": persist,
            "tree_ranges": tree_ranges,
            "group_lag_at_end": lag,
            # Records read again by a re-run (a retried task): each retired its earlier
            # root instead of leaving it to time out (ftlayer.core.takeover).
            "taken_over": status.taken_over,
            "source": "kafka",
            "cluster": "standalone" if cluster else "local",
            "master": master,
            "tls": cluster,
            "shards": shards,
            "kill_shard": kill_shard,
            "shard_kills": shard_kill.kills if shard_kill is not None else 0,
            # Records of the other shards completed while one was down (their STATUS).
            "completed_during_outage": (
                shard_kill.completed_during_outage if shard_kill is not None else None
            ),
            "shard_down_s": shard_kill.down_s if shard_kill is not None else None,
            **(
                {
                    "executors": executors,
                    "kill_worker": kill_worker,
                    "processes_killed": worker_kill.processes if worker_kill else 0,
                }
                if cluster
                else {}
            ),
        },
    )


def _dead_letters(messages: Any) -> dict[int, tuple[int, list[str]]]:
    """Per event id in the dead-letter topic: its attempts and its failures' errors."""
    found: dict[int, tuple[int, list[str]]] = {}
    for message in messages:
        history = history_of(message.headers or [])
        event_id = json.loads(message.value)["id"]
        found[event_id] = (int(history["attempts"]), [c["error"] for c in history["causes"]])
    return found


def _group_lag(bootstrap: str, group: str, topic: str, partitions: int, *, wait_s: float) -> int:
    """The consumer group's lag (end offsets minus committed offsets, summed), once it
    reaches 0 or after `wait_s`."""
    from kafka import KafkaConsumer, TopicPartition

    ends = end_offsets(bootstrap, topic)
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        deadline = time.monotonic() + wait_s
        while True:
            lag = sum(ends[tp.partition] - (consumer.committed(tp) or 0) for tp in tps)
            if lag <= 0 or time.monotonic() > deadline:
                return max(lag, 0)
            time.sleep(0.5)
    finally:
        consumer.close(autocommit=False)


def _wait_until_settled(
    query: Any,
    sampler: ShardSampler,
    topic: str,
    records: int,
    deadline_s: float,
    on_progress: Callable[[ShardTotals, dict[str, Any]], None],
) -> ShardTotals:
    """Poll until the query has read every produced record and no shard of the FT
    layer is down or holds a pending tree (twice in a row), or the deadline; returns
    the last figures, summed over the shards."""
    deadline = time.monotonic() + deadline_s
    settled = 0
    while True:
        if query.exception() is not None:
            raise DemoError(f"the streaming query failed: {query.exception()}")
        totals = sampler.sample()
        read = _records_read(query, topic)
        on_progress(totals, {"produced": records, "read": read, **totals.to_json()})
        done = (
            read >= records
            and not totals.down
            and totals.pending == 0
            and totals.persisted > 0
            and totals.dead_letters == 0  # every dead letter delivered to its topic
        )
        settled = settled + 1 if done else 0
        if settled >= 2 or time.monotonic() > deadline:
            return totals
        time.sleep(0.5)


def stop_when_idle(query: Any, wait_s: float = 10.0) -> None:
    """Stop the query between triggers: stopping it inside a foreachBatch call can make
    Spark's stream thread die noisily (a StackOverflowError formatting the Python
    traceback), though nothing is lost."""
    deadline = time.monotonic() + wait_s
    with contextlib.suppress(Exception):
        while query.isActive and query.status.get("isTriggerActive"):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
    with contextlib.suppress(Exception):
        query.stop()


def _records_read(query: Any, topic: str) -> int:
    """Kafka records of `topic` the query has taken into batches (from its progress)."""
    progress = query.lastProgress
    if not progress:
        return 0
    total = 0
    for source in progress.get("sources", []):
        end = source.get("endOffset")
        if isinstance(end, str):
            with contextlib.suppress(ValueError):
                end = json.loads(end)
        if isinstance(end, dict):
            total += sum(int(o) for o in end.get("kafka", {}).get(topic, {}).values())
    return total
