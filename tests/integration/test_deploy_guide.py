"""docs/deploy.md as printed: its CA, certificate and token recipe, the systemd unit's
`ftlayer serve` command line with those files, and the checks it tells an operator
to run.

The guide marks the blocks it runs with `<!-- deploy-test: NAME -->` before a fenced
block: `pki` (openssl), `unit` (the unit's ExecStart, the same as in
docs/deploy/ftlayer.service) and `check` (`ftlayer status` and curl). The only changes
are the places of this machine: the host `ft1.example.com` at `10.0.0.5` becomes
`localhost` at `127.0.0.1`, `0.0.0.0` becomes loopback, the ports 7070 and 9464 free
ports, `/etc/ftlayer` and `/var/lib/ftlayer` temporary directories, and the unit's
`/opt/ftlayer/venv` this virtualenv. Everything else is real: openssl, the server
process, TLS, the token, curl.
"""

from __future__ import annotations

import os
import re
import select
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ftlayer.integration.harness.broker import free_port
from ftlayer.integration.harness.ftprocess import read_http_url

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "deploy.md"
UNIT = REPO / "docs" / "deploy" / "ftlayer.service"
VENV_BIN = Path(sys.executable).parent
_BLOCK = re.compile(
    r"<!-- deploy-test: (?P<name>[\w-]+) -->\n```(?P<lang>\w*)\n(?P<body>.*?)^```$",
    re.DOTALL | re.MULTILINE,
)


def block(name: str) -> str:
    found = [m["body"] for m in _BLOCK.finditer(GUIDE.read_text()) if m["name"] == name]
    assert len(found) == 1, f"docs/deploy.md marks {len(found)} blocks {name!r}"
    return found[0]


def exec_start(unit: str) -> str:
    """The unit's ExecStart= value, its continued lines joined as systemd joins them."""
    joined = unit.replace("\\\n", " ")
    found = re.findall(r"^ExecStart=(.*)$", joined, re.MULTILINE)
    assert len(found) == 1, found
    return " ".join(found[0].split())


def run_bash(script: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_every_marked_block_is_found_and_the_unit_runs_what_the_guide_shows() -> None:
    guide = GUIDE.read_text()
    assert guide.count("<!-- deploy-test") == len(_BLOCK.findall(guide)) == 3
    assert exec_start(block("unit")) == exec_start(UNIT.read_text())


def test_the_unit_checks_clean_with_systemd_analyze(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    unit = tmp_path / "ftlayer.service"  # verify needs the ExecStart binary to exist
    unit.write_text(UNIT.read_text().replace("/opt/ftlayer/venv/bin", str(VENV_BIN)))
    done = subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0 and done.stderr.strip() == "", done.stderr


def test_the_recipe_and_the_unit_serve_tls_that_the_checks_reach(tmp_path: Path) -> None:
    # Section 2: the CA, the server's certificate for localhost at 127.0.0.1, the token.
    etc = tmp_path / "etc-ftlayer"
    etc.mkdir()
    recipe = block("pki")
    for line, ours in (
        ("FT_HOST=ft1.example.com", "FT_HOST=localhost"),
        ("FT_IP=10.0.0.5", "FT_IP=127.0.0.1"),
    ):
        assert line in recipe
        recipe = recipe.replace(line, ours)
    made = run_bash(recipe, etc)
    assert made.returncode == 0, made.stderr
    assert "server.pem: OK" in made.stdout
    assert {"ca.pem", "server.pem", "server.key", "token"} <= {p.name for p in etc.iterdir()}

    # Section 3: the unit's command line, with those files.
    port, http_port = free_port(), free_port()
    command = exec_start(block("unit"))
    for theirs, ours in (
        ("/opt/ftlayer/venv/bin/", f"{VENV_BIN}/"),
        ("/var/lib/ftlayer", str(tmp_path / "var-lib-ftlayer")),
        ("/etc/ftlayer", str(etc)),
        ("0.0.0.0", "127.0.0.1"),
        ("7070", str(port)),
        ("9464", str(http_port)),
    ):
        assert theirs in command
        command = command.replace(theirs, ours)
    log = tmp_path / "serve.log"
    with log.open("wb") as stderr:
        proc = subprocess.Popen(  # unbuffered: read_http_url reads the next line from the fd
            shlex.split(command), stdout=subprocess.PIPE, stderr=stderr, bufsize=0
        )
    try:
        assert proc.stdout is not None
        assert select.select([proc.stdout], [], [], 20)[0], log.read_text()
        assert proc.stdout.readline().decode() == f"ftlayer serving on 127.0.0.1:{port} (TLS)\n"
        assert read_http_url(proc, log) == f"https://127.0.0.1:{http_port}/"

        # Section 3's checks, from "any machine with ca.pem and the token".
        check = block("check")
        for theirs, ours in (
            ("ft1.example.com:7070", f"localhost:{port}"),
            ("ft1.example.com:9464", f"localhost:{http_port}"),
            ("/etc/ftlayer", str(etc)),
        ):
            assert theirs in check
            check = check.replace(theirs, ours)
        checked = run_bash(check, tmp_path)
        assert checked.returncode == 0, checked.stderr
        assert "ftlayer status localhost" in checked.stdout
        assert re.search(r"^ftlayer_info\{shard=\"0\",version=", checked.stdout, re.MULTILINE)
    finally:
        proc.terminate()
        proc.wait(20)
        assert proc.stdout is not None
        proc.stdout.close()
    assert proc.returncode == 0, log.read_text()[-2000:]
