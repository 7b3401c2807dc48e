"""The walkthrough of docs/user-guide.md section 2, run as printed.

The guide marks its walkthrough with HTML comments before fenced blocks:
`<!-- walkthrough -->` before a shell block to run, and
`<!-- walkthrough: save as NAME -->` before a file to save. This test joins them, in
the guide's order, into one bash script and runs it as a user would: from the
repository root, in one shell, with a HOME of its own (the guide works in
`~/orders-job`). The only change is the ports: the guide's 9092 (Kafka) and 7070 (the
FT layer) become free ports, so runs never collide. Everything is real: the Tansu
broker and the `ftlayer serve` process the guide starts, and its job on local Spark.
When the guide drifts from the code, this test fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trustme
from fixture_types import MakeTopic
from serverproc import StartServer

from ftlayer.client import FTClient
from ftlayer.integration.harness.broker import free_port
from ftlayer.integration.harness.kafka import produce

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "user-guide.md"
_BLOCK = re.compile(
    r"<!-- walkthrough(?:: save as (?P<name>[\w.-]+))? -->\n```(?P<lang>\w+)\n(?P<body>.*?)^```$",
    re.DOTALL | re.MULTILINE,
)
ORDERS = 2000  # the guide produces orders 0..999, starts the job, then 1000..1999


def walkthrough_script(guide: str) -> str:
    """The guide's walkthrough blocks as one bash script, files written where saved."""
    parts = ["set -e", f"cd {REPO}"]
    blocks = list(_BLOCK.finditer(guide))
    assert blocks, "the guide marks no walkthrough blocks"
    for block in blocks:
        name, body = block["name"], block["body"]
        if name is None:
            assert block["lang"] == "sh", f"a walkthrough block to run must be sh: {body[:80]}"
            parts.append(body)
        else:
            assert "GUIDE_EOF" not in body
            parts.append(f"cat > {name} <<'GUIDE_EOF'\n{body}GUIDE_EOF")
    return "\n".join(parts)


def test_every_walkthrough_block_is_found() -> None:
    """A block whose marker the pattern misses would silently drop out of the run."""
    guide = GUIDE.read_text()
    assert len(_BLOCK.findall(guide)) == guide.count("<!-- walkthrough")
    assert {m["name"] for m in _BLOCK.finditer(guide)} >= {
        "job.py",
        "produce_orders.py",
        "check_totals.py",
    }


def saved_file(guide: str, name: str) -> str:
    """The body of the walkthrough block the guide saves as `name`."""
    found = [m["body"] for m in _BLOCK.finditer(guide) if m["name"] == name]
    assert len(found) == 1, f"the guide saves {name} {len(found)} times"
    return found[0]


def test_a_misspelt_option_ends_the_guide_job_in_one_line(tmp_path: Path) -> None:
    """The guide's job checks its options before Spark starts: a misspelt name ends it
    within seconds with one plain line naming the option and the nearest valid name,
    and no trace (no broker, FT layer or token file needed: nothing is reached)."""
    job = saved_file(GUIDE.read_text(), "job.py")
    right = '"maxOffsetsPerTrigger": "5000",'
    assert right in job, "the guide's job no longer sets maxOffsetsPerTrigger"
    (tmp_path / "job.py").write_text(job.replace(right, '"maxOffsetPerTrigger": "5000",'))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK", "SPARK"))}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "job.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - started
    assert done.returncode == 1, done.stderr[-4000:]
    assert done.stdout == ""
    assert done.stderr == (
        "orders-job: unknown option 'maxoffsetpertrigger' for the ftkafka source; "
        "did you mean maxOffsetsPerTrigger?\n"
    )
    assert took < 30, f"the job took {took:.0f} s to report a misspelt option"


@pytest.mark.integration
def test_the_guide_job_runs_as_printed_and_its_totals_are_exact(tmp_path: Path) -> None:
    kafka_port, ft_port = free_port(), free_port()
    script = walkthrough_script(GUIDE.read_text())
    script = script.replace(":9092", f":{kafka_port}").replace(":7070", f":{ft_port}")
    script = script.replace("--port 7070", f"--port {ft_port}")
    assert "9092" not in script and "7070" not in script
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHASHSEED")}
    env["HOME"] = str(home)
    # The guide activates .venv itself; start from a PATH without it, as a new user does.
    venv_bin = str(REPO / ".venv" / "bin")
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != venv_bin)
    proc = subprocess.Popen(
        ["bash", "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,  # its process group holds everything the guide starts
    )
    try:
        out, _ = proc.communicate(timeout=900)  # a hang guard: the guide waits on progress
    finally:
        # The guide stops what it started; on a failure, stop the rest here.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    text = out.decode(errors="replace")
    job_dir = home / "orders-job"
    job_log = (job_dir / "job.log").read_text(errors="replace") if job_dir.is_dir() else ""
    assert proc.returncode == 0, f"{text[-4000:]}\n--- job.log ---\n{job_log[-4000:]}"
    assert "every user's totals are exact" in text
    # The status the guide prints at the end: every order persisted, the failed tier
    # lookups replayed, no tree timed out.
    status = json.loads([line for line in text.splitlines() if line.startswith("{")][-1])
    assert status["persisted"] == ORDERS
    assert status["failed"]["explicit"] > 0 and status["failed"]["timeout"] == 0
    assert "Traceback" not in job_log


@pytest.mark.integration
def test_the_guide_job_reaches_a_tls_server_through_ft_tls_ca(
    start_server: StartServer, make_topic: MakeTopic, kafka_bootstrap: str, tmp_path: Path
) -> None:
    """The guide's job as a user runs it against an FT layer with a token and TLS, the
    CA given by FT_TLS_CA: the driver and the Python workers connect over TLS, and
    every order completes."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "server.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "server.key"))
    (tmp_path / "token").write_text("guide-tls-token\n")
    server = start_server(
        None,
        *("--tls-cert", str(tmp_path / "server.pem"), "--tls-key", str(tmp_path / "server.key")),
        *("--token-file", str(tmp_path / "token")),
    )
    orders, totals = make_topic(4), make_topic(4)
    job = saved_file(GUIDE.read_text(), "job.py")
    for theirs, ours in (('"subscribe": "orders"', f'"subscribe": "{orders}"'),
                         ('"user-totals"', f'"{totals}"')):  # fmt: skip
        assert theirs in job
        job = job.replace(theirs, ours)
    (tmp_path / "job.py").write_text(job)
    count = 200
    produce(
        kafka_bootstrap,
        orders,
        [(f"user-{i % 7}".encode(), json.dumps({"user": f"user-{i % 7}", "amount": 5}).encode())
         for i in range(count)],
    )  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK", "SPARK"))}
    env |= {
        "KAFKA": kafka_bootstrap,
        "FT_ADDRESS": server.address,
        "FT_TOKEN_FILE": str(tmp_path / "token"),
        "FT_TLS_CA": str(tmp_path / "ca.pem"),
        "CHECKPOINT": str(tmp_path / "checkpoint"),
        "SPARK_MASTER": "local[2,4]",
    }
    job_log = tmp_path / "job.log"
    with job_log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "job.py"],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        with FTClient(server.address, token=b"guide-tls-token", tls=str(tmp_path / "ca.pem")) as ft:
            deadline = time.monotonic() + 180
            while True:
                status = ft.status()
                if status.completed >= count and status.pending == 0:
                    break
                assert proc.poll() is None, job_log.read_text(errors="replace")[-4000:]
                assert time.monotonic() < deadline, (
                    f"{status.to_json()}\n{job_log.read_text(errors='replace')[-4000:]}"
                )
                time.sleep(1.0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert status.persisted >= count
    assert status.failed["timeout"] == 0
