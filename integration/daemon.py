"""Spark's Python daemon with what ftlayer's steps import already imported.

Spark starts its Python workers by forking them from one daemon per executor (in local
mode, per driver): ``python -m pyspark.daemon pyspark.worker``. The daemon imports
little, and each worker it forks imports what its first task needs on its own: pandas,
pyarrow and numpy for any Arrow step, and under ftlayer its task wrappers, FT client
and Kafka reader (with the numba kernels that decode Kafka's record batches), some
2 s of CPU per worker on a 2-core machine. A worker serves the
tasks that follow, but Spark stops one idle for a minute, an executor that dies takes
its workers with it, and every new executor or driver forks fresh ones: a test suite
or a cluster that loses hosts pays that import again and again.

With ``spark.python.daemon.module=ftlayer.integration.daemon`` (what
`ftlayer.integration.spark.local_spark` sets unless told otherwise) the daemon imports
them once, before it forks, and every worker starts with them (copy-on-write: the
workers share the daemon's pages until they write to them). Then the daemon runs as
pyspark's does (`pyspark.daemon.manager`), with the same worker module.

pyspark's daemon leaves its imports to the workers because a thread started before a
fork does not exist in the child: of these modules only numpy (OpenBLAS's pool) and
pyarrow (jemalloc's background thread) start one at import, and both libraries
re-create theirs in a forked child (their fork handlers); nothing here starts a Python
thread or opens a connection.
"""

from __future__ import annotations

import importlib

PRELOADED = (
    "pandas",
    "pyarrow",
    "pyarrow.compute",
    "numpy",
    "pyspark.worker",
    "pyspark.sql.pandas.serializers",
    "ftlayer.integration.tasks",
    "ftlayer.integration.source",
    "ftlayer.integration.sinks",
)
"""What the daemon imports before it forks its first worker."""


DAEMONS = (b"pyspark.daemon", __name__.encode())
"""The daemon modules whose forks run Spark's tasks: Spark's own and this one."""


def is_task_worker_cmdline(cmdline: bytes) -> bool:
    """Whether a process's /proc/PID/cmdline is a PySpark task daemon's, or one of the
    workers it forked (they carry its command line): ``... -m DAEMON pyspark.worker``."""
    words = cmdline.rstrip(b"\0").split(b"\0")
    return len(words) >= 2 and words[-1] == b"pyspark.worker" and words[-2] in DAEMONS


def preload() -> None:
    """Import `PRELOADED` and load the source's numba kernels from numba's cache (about
    1 s of CPU more per worker that reads Kafka otherwise)."""
    for name in PRELOADED:
        importlib.import_module(name)
    from ftlayer.integration.source.columnar import compile_kernels

    compile_kernels()


if __name__ == "__main__":
    preload()
    from pyspark.daemon import manager

    manager()
