"""A Spark standalone cluster from pyspark's own jars: a master and workers as processes
of their own, for `ftlayer demo --cluster` and the tests on hosts of their own.

`StandaloneCluster(workdir, workers=(Host(), Host()))` runs
`org.apache.spark.deploy.master.Master` and one `org.apache.spark.deploy.worker.Worker`
per entry through pyspark's `bin/spark-class` (nothing to download; Java 17+), each a
child process whose output goes to a log file in `workdir`. `start()`:

1. Start the master on its host: RPC port and web UI port free ports on this
   machine's loopback, or 7077 and 8080 on a host of its own (a network namespace,
   where nothing else listens).
2. Start every worker at once, each with `worker_cores` cores and `worker_memory`
   (what its executors may use, `SPARK_WORKER_MEMORY`), its work dir (executors' logs,
   the application's files) and Spark's scratch space under `workdir`.
3. Ready once the master's JSON page (`http://HOST:UI/json/`) lists every worker as
   ALIVE; `ClusterError` with the logs' tails at the deadline or when a process exits.

`kill_worker(i)` is the loss of worker i's machine for Spark: the worker JVM and every
process under it (its executors' JVMs, their PySpark daemons and Python workers) are
stopped with SIGSTOP first, so none can start another, then SIGKILLed together; the
master and the driver learn of it from the broken connections, and Spark runs the lost
tasks on the executors left.

`stop()` (also when the `with` block ends in an error) stops every process it started:
SIGTERM to the workers and the master, SIGKILL after `stop_timeout`, and then SIGKILL to
anything still living under them (an executor outlives its worker for a moment). Each
process also gets SIGKILL when the thread that started it dies (PDEATHSIG), so a killed
demo or test run leaves no JVM behind.

A `Host` is where a process runs: the address it binds and advertises, and the command
prefix that places it there (`ip netns exec NAME` for a network namespace; none for
this machine, every process then on loopback). The driver's side is `spark_conf()`:
executors of one core each and memory that fits a worker; the driver needs its
reachable address in `spark.driver.host` when it is not on loopback. What the driver
knows of its executors: `executor_count` and `wait_for_executors` (registered),
`running_tasks` (the tasks each one runs now); `log_lost_tasks` makes Spark's log name
the tasks a dead executor took with it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

from ftlayer.errors import FTLayerError
from ftlayer.integration.daemon import is_task_worker_cmdline

from .broker import free_port

__all__ = [
    "ClusterError",
    "Host",
    "StandaloneCluster",
    "descendants",
    "executor_count",
    "freeze_and_kill",
    "log_lost_tasks",
    "proc_stats",
    "running_tasks",
    "spark_class",
    "started_at",
    "wait_for_executors",
]

_MASTER_CLASS = "org.apache.spark.deploy.master.Master"
_WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"
_MASTER_PORT, _MASTER_UI_PORT = 7077, 8080
_LOG_TAIL_LINES = 8
_PR_SET_PDEATHSIG = 1
_PRCTL = ctypes.CDLL(None).prctl if sys.platform == "linux" else None


class ClusterError(FTLayerError):
    """The standalone cluster did not start, or a process of it died."""


@dataclass(frozen=True)
class Host:
    """Where a process runs: the `address` it binds and advertises, and the command
    `prefix` that places it there (e.g. ``("ip", "netns", "exec", "NAME")``)."""

    address: str = "127.0.0.1"
    prefix: tuple[str, ...] = ()

    @property
    def own(self) -> bool:
        """A host of its own (a prefix places processes there), not this machine."""
        return bool(self.prefix)


def spark_class() -> Path:
    """pyspark's `bin/spark-class`, the launcher of Spark's JVM classes."""
    import pyspark

    return Path(pyspark.__file__).parent / "bin" / "spark-class"


def _die_with_parent() -> None:  # pragma: no cover - runs in the child, before exec
    assert _PRCTL is not None
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)


def proc_stats() -> Iterator[tuple[int, list[str]]]:
    """(pid, the fields of /proc/PID/stat after the command's name) of every process
    now: fields[0] is its state, [1] its parent, [2] its process group, [11] and [12]
    its utime and stime, [19] its start time (proc(5), less two)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            yield int(entry), Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile


def _parents() -> dict[int, int]:
    """Every process's parent, from /proc."""
    return {pid: int(fields[1]) for pid, fields in proc_stats()}


def _tree(pid: int) -> list[tuple[int, int]]:
    """(process, parent) of each process under `pid`, parents first."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    found, queue = [], [pid]
    while queue:
        parent = queue.pop(0)
        for child in children.get(parent, []):
            found.append((child, parent))
            queue.append(child)
    return found


def descendants(pid: int) -> list[int]:
    """The processes under `pid` (children, their children, ...), parents first."""
    return [child for child, _ in _tree(pid)]


def freeze_and_kill(find: Callable[[], Iterable[int]]) -> int:
    """SIGKILL the processes `find()` names, with none able to start another meanwhile:
    SIGSTOP each one found, again until `find()` names no new one, then SIGKILL them all.
    Returns how many were killed."""
    stopped: set[int] = set()
    for _ in range(50):
        new = [pid for pid in find() if pid not in stopped]
        if not new:
            break
        for pid in new:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
            stopped.add(pid)
    killed = 0
    for pid in stopped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            killed += 1
    return killed


def executor_count(spark: Any) -> int:
    """The executors registered with a SparkSession's driver (its block managers, less
    the driver's own)."""
    return int(spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size()) - 1


def running_tasks(spark: Any) -> dict[str, int]:
    """The tasks each executor runs now, by its block manager's "HOST:PORT", from the
    driver's status tracker (the driver's own entry included: on a cluster it runs none)."""
    infos = spark.sparkContext._jsc.sc().statusTracker().getExecutorInfos()
    return {f"{info.host()}:{info.port()}": int(info.numRunningTasks()) for info in infos}


def log_lost_tasks(spark: Any) -> None:
    """Make Spark's log say which tasks an executor took with it when it died: Spark logs
    those (and where each task started and finished) at INFO, from its TaskSetManager,
    so that logger is set to INFO whatever the level of the rest."""
    jvm = spark.sparkContext._jvm
    jvm.org.apache.logging.log4j.core.config.Configurator.setLevel(
        "org.apache.spark.scheduler.TaskSetManager", jvm.org.apache.logging.log4j.Level.INFO
    )


def wait_for_executors(spark: Any, count: int, timeout: float = 120.0) -> int:
    """Wait until at least `count` executors registered; their number, or ClusterError."""
    deadline = time.monotonic() + timeout
    while True:
        found = executor_count(spark)
        if found >= count:
            return found
        if time.monotonic() > deadline:
            raise ClusterError(f"{found} executors registered within {timeout:g} s, not {count}")
        time.sleep(0.2)


class _Process:
    """One JVM of the cluster, its log file and its host."""

    def __init__(self, name: str, host: Host, command: list[str], env: dict[str, str], log: Path):
        self.name, self.host, self.log_path = name, host, log
        self._log: IO[bytes] = log.open("ab")
        try:
            self.proc = subprocess.Popen(
                [*host.prefix, *command],
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=_die_with_parent if _PRCTL is not None else None,
            )
        except OSError:
            self._log.close()
            raise

    def tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()[-_LOG_TAIL_LINES:]
        except OSError:
            return f"(no log at {self.log_path})"
        return f"--- {self.log_path} ---\n" + "\n".join(lines)

    def close(self) -> None:
        self._log.close()


class StandaloneCluster:
    """A Spark standalone master and workers; a context manager. See the module docstring."""

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        workers: Sequence[Host] = (Host(), Host()),
        *,
        master: Host = Host(),
        worker_cores: int = 1,
        worker_memory: str = "1g",
        start_timeout: float = 90.0,
        stop_timeout: float = 10.0,
    ) -> None:
        if not workers:
            raise ClusterError("a cluster needs at least one worker")
        self.workdir = Path(workdir)
        self.master_host = master
        self.worker_hosts = tuple(workers)
        self.worker_cores = worker_cores
        self.worker_memory = worker_memory
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.master_url = ""
        """spark://HOST:PORT, once started."""
        self.ui_url = ""
        """The master's web UI, http://HOST:PORT, once started."""
        self._master: _Process | None = None
        self._workers: list[_Process] = []
        self._killed: set[int] = set()

    # ---- starting --------------------------------------------------------------------

    def _env(self, host: Host, scratch: Path) -> dict[str, str]:
        import pyspark

        scratch.mkdir(parents=True, exist_ok=True)
        return {
            **os.environ,
            "SPARK_HOME": str(Path(pyspark.__file__).parent),
            "SPARK_LOCAL_IP": host.address,
            "SPARK_LOCAL_DIRS": str(scratch),
            # The daemons need little: C1 only starts them quicker, and less heap.
            "SPARK_DAEMON_JAVA_OPTS": "-XX:TieredStopAtLevel=1",
            "SPARK_DAEMON_MEMORY": "512m",
            "PYSPARK_PYTHON": os.environ.get("PYSPARK_PYTHON", sys.executable),
        }

    def start(self) -> Self:
        if self._master is not None:
            raise ClusterError(f"the cluster already runs at {self.master_url}")
        self.workdir.mkdir(parents=True, exist_ok=True)
        launcher = str(spark_class())
        host = self.master_host
        if host.own:
            port, ui_port = _MASTER_PORT, _MASTER_UI_PORT
        else:
            port, ui_port = free_port(host.address), free_port(host.address)
        self.master_url = f"spark://{host.address}:{port}"
        self.ui_url = f"http://{host.address}:{ui_port}"
        try:
            # Step 1: the master.
            self._master = _Process(
                "master",
                host,
                [launcher, _MASTER_CLASS, "--host", host.address, "--port", str(port),
                 "--webui-port", str(ui_port)],
                self._env(host, self.workdir / "master-scratch"),
                self.workdir / "master.log",
            )  # fmt: skip
            # Step 2: the workers, all at once (each JVM takes seconds to start).
            for i, worker in enumerate(self.worker_hosts):
                work_dir = self.workdir / f"worker-{i}"
                self._workers.append(
                    _Process(
                        f"worker {i}",
                        worker,
                        [launcher, _WORKER_CLASS, "--host", worker.address,
                         "--cores", str(self.worker_cores), "--memory", self.worker_memory,
                         "--webui-port", "0", "--work-dir", str(work_dir), self.master_url],
                        self._env(worker, work_dir / "scratch"),
                        self.workdir / f"worker-{i}.log",
                    )
                )  # fmt: skip
            # Step 3: ready once the master lists every worker as ALIVE.
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def master_state(self, timeout: float = 2.0) -> dict[str, Any]:
        """The master's JSON page: its workers, cores, applications."""
        with urllib.request.urlopen(f"{self.ui_url}/json/", timeout=timeout) as reply:
            state: dict[str, Any] = json.load(reply)
            return state

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        problem = "the master's web UI never answered"
        while True:
            self.check()
            with contextlib.suppress(OSError, ValueError):
                alive = int(self.master_state().get("aliveworkers", 0))
                if alive >= len(self.worker_hosts):
                    return
                problem = f"{alive} of {len(self.worker_hosts)} workers registered"
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"the standalone cluster did not start within {self.start_timeout:g} s: "
                    f"{problem}\n{self._tails()}"
                )
            time.sleep(0.25)

    def check(self) -> None:
        """ClusterError, with its log's tail, if a process exited that was not killed."""
        for process in self._processes():
            code = process.proc.poll()
            if code is not None and process.proc.pid not in self._killed:
                raise ClusterError(f"the Spark {process.name} exited with code {code}\n"
                                   f"{process.tail()}")  # fmt: skip

    def _tails(self) -> str:
        return "\n".join(process.tail() for process in self._processes())

    def _processes(self) -> Iterator[_Process]:
        if self._master is not None:
            yield self._master
        yield from self._workers

    # ---- using it --------------------------------------------------------------------

    def spark_conf(self) -> dict[str, str]:
        """The driver's settings for this cluster: an executor of one core per worker,
        with memory that fits a worker beside its Python workers."""
        return {
            "spark.executor.cores": str(self.worker_cores),
            "spark.cores.max": str(self.worker_cores * len(self.worker_hosts)),
            "spark.executor.memory": "512m",
        }

    @property
    def worker_pids(self) -> list[int]:
        """The workers' JVM process ids, in the order of `workers`."""
        return [process.proc.pid for process in self._workers]

    def python_workers(self, index: int) -> list[int]:
        """The PySpark Python workers under worker `index`: the processes its executors'
        PySpark daemons forked to run tasks (pooled between tasks)."""
        daemons: set[int] = set()
        found = []
        for pid, parent in _tree(self._workers[index].proc.pid):  # parents first
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if is_task_worker_cmdline(cmdline):
                if parent in daemons:
                    found.append(pid)
                daemons.add(pid)
        return found

    def kill_worker(self, index: int) -> int:
        """SIGKILL worker `index` and every process under it (see the module
        docstring); returns how many processes were killed."""
        pid = self._workers[index].proc.pid
        self._killed.add(pid)
        killed = freeze_and_kill(lambda: [pid, *descendants(pid)])
        self._workers[index].proc.wait(10)
        return killed

    # ---- stopping --------------------------------------------------------------------

    def stop(self) -> None:
        """Stop every process this cluster started (see the module docstring). Idempotent."""
        processes = list(self._processes())
        under = {process.proc.pid: descendants(process.proc.pid) for process in processes}
        for process in reversed(processes):  # workers first: they stop their executors
            if process.proc.poll() is None:
                process.proc.terminate()
        deadline = time.monotonic() + self.stop_timeout
        for process in reversed(processes):
            try:
                process.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.proc.kill()
                process.proc.wait()
        # What lives on under them, by pid and start time (a pid may be reused meanwhile).
        left = {pid: started_at(pid) for pids in under.values() for pid in pids}
        freeze_and_kill(lambda: [pid for pid, t in left.items() if t and started_at(pid) == t])
        for process in processes:
            process.close()
        self._master = None
        self._workers = []

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def started_at(pid: int) -> int | None:
    """When a running process started (clock ticks after boot); None for none or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[19])
