"""A local SparkSession set up the way ftlayer's demo and tests need it.

`local_spark` checks for Java first, so a machine without it gets one clear error
instead of a py4j stack trace, and then builds the session with:

- master ``local[2,4]`` by default: two task threads, and a failed task is retried up
  to 4 times (plain ``local[N]`` never retries, which would hide the retry path);
- this interpreter for the Python workers. In a Python driver that is already running,
  PySpark 4.3 takes the worker executable from the environment variable
  ``PYSPARK_PYTHON`` only (`SparkContext.pythonExec`, default ``python3`` from PATH):
  ``spark.pyspark.python`` alone is ignored, and workers then run a base interpreter
  outside the virtualenv that cannot import ftlayer. So both are set, the variable in
  this process's environment before the JVM starts;
- ``PYTHONHASHSEED`` fixed in this process's environment (inherited by the JVM and its
  Python workers) and in ``spark.executorEnv``: pyspark's `portable_hash` refuses
  string keys without it, and the hash partitioners must agree across workers. The
  calling process's own str and bytes hashes stay random unless it was started with
  PYTHONHASHSEED set, so never compare its `portable_hash` of such keys with a worker's;
- no UI, no console progress bar, log4j at ERROR (to stderr, or to `log_file`), few
  shuffle partitions, Arrow on, UTC session time zone, the Python fault handler on (a
  worker crash shows a traceback).

A JVM can host one SparkContext: if a session already runs in this process,
getOrCreate returns it and Spark ignores the static settings given here.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from pyspark.sql import SparkSession

from ftlayer.errors import FTLayerError

__all__ = ["MIN_JAVA", "SparkSetupError", "find_java", "local_spark"]

MIN_JAVA = 17

# Everything at ERROR, to stderr: Spark's default profile logs INFO/WARN lines (native
# Hadoop library, loopback hostname, ...) that bury a test's own output. A pyspark
# driver counts as a shell: Spark prints "Setting default log level" unless the logger
# of its entry class, PythonGatewayServer, is configured with the root logger's level.
_LOG4J2 = """\
rootLogger.level = error
logger.gateway.name = org.apache.spark.api.python.PythonGatewayServer
logger.gateway.level = error
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss.SSS} %p %c{1}: %m%n%ex
"""
# The same, into a file instead of stderr (`local_spark(log_file=...)`).
_LOG4J2_FILE = """\
rootLogger.level = error
logger.gateway.name = org.apache.spark.api.python.PythonGatewayServer
logger.gateway.level = error
rootLogger.appenderRef.file.ref = file
appender.file.type = File
appender.file.name = file
appender.file.fileName = {path}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = %d{{HH:mm:ss.SSS}} %p %c{{1}}: %m%n%ex
"""


class SparkSetupError(FTLayerError):
    """Local Spark cannot start: Java missing or too old, or the JVM did not come up."""


def find_java() -> tuple[Path, int]:
    """The java binary Spark will launch ($JAVA_HOME/bin/java, else PATH) and its major version.

    Raises `SparkSetupError` if there is none or it is older than `MIN_JAVA`.
    """
    java_home = os.environ.get("JAVA_HOME")
    if java_home:
        java = Path(java_home) / "bin" / "java"
        if not os.access(java, os.X_OK):
            raise SparkSetupError(
                f"JAVA_HOME={java_home!r} has no executable bin/java; Spark needs Java "
                f"{MIN_JAVA}+ (e.g. apt-get install openjdk-17-jre-headless) and a JAVA_HOME "
                "pointing at it, or JAVA_HOME unset and java on PATH"
            )
    else:
        found = shutil.which("java")
        if found is None:
            raise SparkSetupError(
                f"Java not found: Spark needs Java {MIN_JAVA}+ on PATH or in JAVA_HOME "
                "(e.g. apt-get install openjdk-17-jre-headless)"
            )
        java = Path(found)
    try:
        probe = subprocess.run(
            [str(java), "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SparkSetupError(f"cannot run {java} -version: {exc}") from exc
    # `java -version` prints e.g. `openjdk version "17.0.15"` or `java version "1.8.0_382"`.
    match = re.search(r'version "(\d+)(?:\.(\d+))?', probe.stderr + probe.stdout)
    if match is None:
        raise SparkSetupError(f"cannot tell the version of {java}: {probe.stderr.strip()!r}")
    major = int(match.group(1))
    if major == 1 and match.group(2) is not None:
        major = int(match.group(2))
    if major < MIN_JAVA:
        raise SparkSetupError(
            f"{java} is Java {major}; Spark 4 needs Java {MIN_JAVA}+ (set JAVA_HOME to a newer one)"
        )
    return java, major


def _log4j2_config(log_file: Path | None = None) -> Path:
    """The quiet log4j2 configuration as a file (content-addressed, shared by sessions):
    to stderr, or appending to `log_file`."""
    text = _LOG4J2 if log_file is None else _LOG4J2_FILE.format(path=log_file.resolve())
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"ftlayer-log4j2-{digest}.properties"
    if not path.is_file():
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".ftlayer-log4j2-")
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(tmp, path)
    return path


def local_spark(
    master: str = "local[2,4]",
    app_name: str = "ftlayer",
    conf: Mapping[str, str] | None = None,
    shuffle_partitions: int = 4,
    fast_start: bool = False,
    log_file: str | os.PathLike[str] | None = None,
) -> SparkSession:
    """Build (or get) a local SparkSession for ftlayer; `conf` entries override the defaults.

    `master` may also be a cluster's, e.g. a standalone master's spark:// URL: the
    driver then runs here in client mode, and its executors run this interpreter too
    (`PYSPARK_PYTHON`, `spark.pyspark.python`), which must exist at the same path on
    their hosts.

    Spark's Python workers fork from `ftlayer.integration.daemon` (its docstring): each
    starts with pandas, pyarrow and ftlayer's steps imported. `conf` may name another
    `spark.python.daemon.module`, e.g. ``pyspark.daemon``, Spark's own.

    `log_file`: Spark's log (ERROR and above, with the stack traces of failed tasks)
    goes to this file instead of stderr.

    `fast_start` limits the JVM to its C1 JIT compiler: start-up and the first jobs are
    quicker, and long CPU-bound runs slower. Right for tests and short demos, wrong for
    benchmarks.

    Raises `SparkSetupError` if Java is missing or too old, or the JVM does not start.
    """
    find_java()
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    hash_seed = os.environ.setdefault("PYTHONHASHSEED", "0")
    log_path = None if log_file is None else Path(log_file)
    java_options = f"-Dlog4j2.configurationFile=file:{_log4j2_config(log_path)}"
    if fast_start:
        java_options += " -XX:TieredStopAtLevel=1"
    settings: dict[str, str] = {
        "spark.pyspark.python": sys.executable,
        "spark.pyspark.driver.python": sys.executable,
        "spark.executorEnv.PYTHONHASHSEED": hash_seed,
        "spark.driver.extraJavaOptions": java_options,
        "spark.executor.extraJavaOptions": java_options,
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": str(shuffle_partitions),
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        "spark.sql.session.timeZone": "UTC",
        "spark.python.worker.faulthandler.enabled": "true",
        "spark.sql.execution.pyspark.udf.faulthandler.enabled": "true",
        # Python workers fork with pandas, pyarrow and ftlayer's steps imported.
        "spark.python.daemon.module": "ftlayer.integration.daemon",
    }
    settings.update(conf or {})
    builder = SparkSession.builder.master(master).appName(app_name)
    for key, value in settings.items():
        builder = builder.config(key, value)
    try:
        spark = builder.getOrCreate()
    except Exception as exc:
        raise SparkSetupError(f"local Spark ({master}) did not start: {exc}") from exc
    spark.sparkContext.setLogLevel("ERROR")
    return spark
