"""docs/deploy.md's packed environment, as printed, on a real Spark standalone cluster.

Section 4's block `pack` (`python3.11 -m venv ftlayer-env`, pip install of this
project's wheel and venv-pack, `venv-pack -o ftlayer-env.tar.gz` without pyspark and
py4j) runs as written on a wheel built as section 3 says
(`pip wheel --no-deps . -w dist`, in a copy of the sources). Then section 5's block
`standalone-pack` runs as written, the master's URL the only change (the variables of
section 5's first block are set for this machine, and `SPARK_HOME` is this
environment's pyspark, the Spark the cluster runs): it unpacks the archive on the
driver's side, and submits the user guide's job with
`$SPARK_HOME/bin/spark-submit --archives ftlayer-env.tar.gz#environment` to a master
and a worker that are processes of their own (pyspark's `bin/spark-class`, the demo's
harness), against a real FT layer with a token and TLS and the session's broker.

The job is the user guide's `job.py` with one statement added to its `parse`: each
Python worker writes what it runs (`sys.executable`, the file of every module it
loaded) to a file the test reads. Every worker must run `environment/bin/python` of
an executor's working directory, with ftlayer and its dependencies from that
environment: only pyspark and py4j (which Spark puts on its workers' PYTHONPATH from
the Spark installation, and the archive leaves out) and the interpreter's standard
library come from elsewhere.
What a user notices is checked as the guide checks it: `check_totals.py` prints that
every user's totals are exact, and the FT layer completed every order, none pending.

The archive takes about 40 s to make on an idle machine, minutes under the suite's
load (pip installs pyspark and numba, venv-pack compresses the 600 MB left without
pyspark and py4j to 200 MB). It is kept in `.pytest_cache/d/packed-env` under a key of
the `pack` block's text, the interpreter and the contents of the wheel, so a run whose
guide, interpreter and code did not change reuses the archive those commands made; any
change builds it again.
`FTLAYER_PACK_REBUILD=1` always builds. `python3.11` becomes this interpreter's base
where no `python3.11` is on PATH.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import trustme
from fixture_types import MakeTopic
from serverproc import StartServer
from test_deploy_guide import block
from test_user_guide import GUIDE as USER_GUIDE
from test_user_guide import saved_file

from ftlayer.client import FTClient
from ftlayer.integration.harness.standalone import Host, StandaloneCluster, spark_class
from ftlayer.status import Status

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
CACHE = REPO / ".pytest_cache" / "d" / "packed-env"
SOURCES = ("pyproject.toml", "README.md", "ftlayer", "persistence", "partitioners", "integration")
ORDERS = 1000
PROBE = """    import sys as _sys
    _probe = "{dir}/%d.json" % os.getpid()
    if not os.path.exists(_probe):
        _files = {{n: getattr(m, "__file__", None) for n, m in list(_sys.modules.items())}}
        with open(_probe + ".tmp", "w") as _out:
            _seen = {{"executable": _sys.executable, "base_prefix": _sys.base_prefix}}
            json.dump({{**_seen, "cwd": os.getcwd(), "files": _files}}, _out)
        os.replace(_probe + ".tmp", _probe)
"""


def build_wheel(into: Path, log: Path) -> Path:
    """Section 3's `pip wheel --no-deps . -w dist`, in a copy of the sources (the build
    writes build/ and egg-info/ next to them; the clone is left alone)."""
    source = into / "source"
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            source.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, source / name)
    with log.open("ab") as out:
        subprocess.run(
            [str(VENV_BIN / "pip"), "wheel", "--no-deps", ".", "-w", "dist"],
            cwd=source,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=300,
            check=True,
        )
    (wheel,) = (source / "dist").glob("ftlayer-*.whl")
    return wheel


def pack_key(wheel: Path, script: str, python: str) -> str:
    """What the archive is made of: the commands, the interpreter, the wheel's files
    (names and bytes, not the zip's timestamps)."""
    digest = hashlib.sha256(script.encode())
    digest.update(python.encode())
    with zipfile.ZipFile(wheel) as archive:
        for name in sorted(archive.namelist()):
            digest.update(name.encode() + b"\0" + archive.read(name))
    return digest.hexdigest()[:32]


def run_bash(script: str, cwd: Path, env: dict[str, str], log: Path, timeout: float) -> None:
    with log.open("ab") as out:
        done = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", script],
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=timeout,
            check=False,
        )
    assert done.returncode == 0, log.read_text(errors="replace")[-4000:]


def packed_environment(work: Path, log: Path) -> Path:
    """ftlayer-env.tar.gz in `work`, made by the guide's `pack` block (or its cache)."""
    script = block("pack")
    python = "python3.11"
    if shutil.which(python) is None:
        python = sys._base_executable
        script = script.replace("python3.11 ", f"{python} ")
    which = subprocess.run(
        [python, "-c", "import sys; print(sys.version, sys.base_prefix)"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    wheel = build_wheel(work / "wheel", log)
    cached = CACHE / f"{pack_key(wheel, script, which)}.tar.gz"
    target = work / "ftlayer-env.tar.gz"
    if cached.is_file() and os.environ.get("FTLAYER_PACK_REBUILD") != "1":
        with log.open("a") as out:
            out.write(f"--- reusing {cached}\n")
    else:
        shutil.copy2(wheel, work / wheel.name)
        env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
        run_bash(script, work, env, log, timeout=600)
        CACHE.mkdir(parents=True, exist_ok=True)
        for old in CACHE.glob("*.tar.gz"):  # one archive is 600+ MB: keep the newest only
            old.unlink()
        shutil.move(target, cached.with_suffix(".partial"))  # a rename on one file system
        cached.with_suffix(".partial").replace(cached)
        shutil.rmtree(work / "ftlayer-env")
    try:
        os.link(cached, target)
    except OSError:
        shutil.copy2(cached, target)
    return target


def guide_job(probe_dir: Path, orders: str, totals: str) -> str:
    """The user guide's job.py, on these topics, with the probe in `parse`."""
    job = saved_file(USER_GUIDE.read_text(), "job.py")
    for theirs, ours in (
        ('"subscribe": "orders"', f'"subscribe": "{orders}"'),
        ('"user-totals"', f'"{totals}"'),
    ):
        assert job.count(theirs) == 1, theirs
        job = job.replace(theirs, ours)
    # The probe goes first in parse's body, after its docstring.
    head = re.search(r'^def parse\(row\):\n    """.*?"""\n', job, re.MULTILINE | re.DOTALL)
    assert head is not None, "the guide's job has no parse(row) with a docstring"
    return job[: head.end()] + PROBE.format(dir=probe_dir) + job[head.end() :]


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the job's process group (the driver's JVM removes its scratch on the
    way out), SIGKILL to what is left after 20 s."""
    deadline = time.monotonic() + 20
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
        while time.monotonic() < deadline:
            proc.poll()  # reap bash; the group lives on while any of its processes does
            os.killpg(proc.pid, 0)
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def write_guide_scripts(work: Path, orders: str, totals: str, tools: dict[str, str]) -> None:
    """The user guide's produce_orders.py and check_totals.py in `work`, on these
    topics; ORDERS orders produced."""
    guide = USER_GUIDE.read_text()
    for name, theirs, ours in (
        ("produce_orders.py", 'produce(KAFKA, "orders",', f'produce(KAFKA, "{orders}",'),
        ("check_totals.py", 'read_all(KAFKA, "user-totals")', f'read_all(KAFKA, "{totals}")'),
    ):
        script = saved_file(guide, name)
        assert script.count(theirs) == 1, theirs
        (work / name).write_text(script.replace(theirs, ours))
    subprocess.run(
        [sys.executable, "produce_orders.py", "0", str(ORDERS)], cwd=work, env=tools, check=True
    )


def wait_complete(ft: FTClient, proc: subprocess.Popen[bytes], job_log: Path) -> Status:
    """STATUS once every order completed and none is pending (within 300 s, the job
    still running)."""
    deadline = time.monotonic() + 300
    while True:
        status = ft.status()
        if status.completed >= ORDERS and status.pending == 0:
            return status
        assert proc.poll() is None, job_log.read_text(errors="replace")[-4000:]
        assert time.monotonic() < deadline, (
            f"{status.to_json()}\n{job_log.read_text(errors='replace')[-4000:]}"
        )
        time.sleep(1.0)


def check_totals(work: Path, tools: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The guide's check_totals.py for ORDERS orders."""
    return subprocess.run(
        [sys.executable, "check_totals.py", str(ORDERS)],
        cwd=work,
        env=tools,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


@dataclasses.dataclass
class PlainRun:
    """What section 5's first block's run left: `check_totals.py`'s result, the FT
    layer's STATUS once every order completed, the job's log, and the interpreters
    its Python workers ran."""

    totals: subprocess.CompletedProcess[str]
    status: Status
    log: str
    executables: set[str]


def run_plain_block(
    master: str,
    kafka: str,
    ft_address: str,
    tmp_path: Path,
    orders: str,
    totals: str,
    env: dict[str, str],
    tools: dict[str, str],
) -> PlainRun:
    """Section 5's first block (`standalone`), its example values replaced by this
    machine's (the master, the broker, the FT layer, the token and CA files, the
    checkpoint, and this test's environment for /opt/ftlayer/venv), on fresh topics,
    until every order completed; then the job is stopped."""
    work = tmp_path / "plain"
    probes = tmp_path / "plain-probes"
    work.mkdir()
    probes.mkdir()
    script = block("standalone")
    for theirs, ours in (
        ("spark://spark-master.example.com:7077", master),
        ("kafka1.example.com:9092", kafka),
        ("ft1.example.com:7070", ft_address),
        ("/etc/ftlayer/token", str(tmp_path / "token")),
        ("/etc/ftlayer/ca.pem", str(tmp_path / "ca.pem")),
        ("/data/checkpoints/orders-job", str(tmp_path / "plain-checkpoint")),
        ("/opt/ftlayer/venv", sys.prefix),
    ):
        assert theirs in script, theirs
        script = script.replace(theirs, ours)
    (work / "job.py").write_text(guide_job(probes, orders, totals))
    write_guide_scripts(work, orders, totals, tools)
    job_log = tmp_path / "plain-job.log"
    with job_log.open("wb") as out:
        proc = subprocess.Popen(
            ["bash", "-e", "-o", "pipefail", "-c", script],
            cwd=work,
            env={k: v for k, v in env.items() if k not in ("SPARK_MASTER", "KAFKA", "SPARK_HOME")},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        with FTClient(ft_address, token=b"packed-env-token", tls=str(tmp_path / "ca.pem")) as ft:
            status = wait_complete(ft, proc, job_log)
        checked = check_totals(work, tools)
        text = job_log.read_text(errors="replace")
    finally:
        stop_group(proc)
    seen = {json.loads(p.read_text())["executable"] for p in probes.glob("*.json")}
    return PlainRun(checked, status, text, seen)


def under(path: str | None, root: Path) -> bool:
    return path is not None and Path(path).is_relative_to(root)


@pytest.mark.integration
def test_the_packed_environment_runs_the_guide_job_on_a_standalone_cluster(
    start_server: StartServer,
    make_topic: MakeTopic,
    kafka_bootstrap: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    work = tmp_path / "submit"  # where the user packs and submits
    work.mkdir()
    log = tmp_path / "pack.log"
    started = time.monotonic()
    packed_environment(work, log)
    pack_s = time.monotonic() - started

    # The FT layer with a token and TLS (sections 2 to 4), the guide's topics.
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "server.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "server.key"))
    (tmp_path / "token").write_text("packed-env-token\n")
    server = start_server(
        None,
        *("--tls-cert", str(tmp_path / "server.pem"), "--tls-key", str(tmp_path / "server.key")),
        *("--token-file", str(tmp_path / "token")),
    )
    orders, totals = make_topic(4), make_topic(4)
    probes = tmp_path / "probes"
    probes.mkdir()
    (work / "job.py").write_text(guide_job(probes, orders, totals))
    tools = {**os.environ, "KAFKA": kafka_bootstrap}
    write_guide_scripts(work, orders, totals, tools)

    submit = block("standalone-pack")
    theirs = "spark://spark-master.example.com:7077"
    assert submit.count(theirs) == 1
    # Every JVM's java.io.tmpdir under tmp_path: an executor fetches the archive into a
    # temporary directory there, which outlives an executor killed before its shutdown.
    (tmp_path / "jvm-tmp").mkdir()
    java_options = os.environ.get("JAVA_TOOL_OPTIONS", "")  # the suite's class archive
    java_options += f" -Djava.io.tmpdir={tmp_path / 'jvm-tmp'}"
    monkeypatch.setenv("JAVA_TOOL_OPTIONS", java_options.strip())
    with StandaloneCluster(tmp_path / "spark", workers=(Host(),), worker_cores=2) as cluster:
        submit = submit.replace(theirs, cluster.master_url)
        # What section 5's first block exports, for this machine; no PYSPARK_* or
        # SPARK_* of the test run's own.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK", "SPARK"))}
        env.pop("VIRTUAL_ENV", None)
        env |= {
            "SPARK_MASTER": cluster.master_url,
            "KAFKA": kafka_bootstrap,
            "FT_ADDRESS": server.address,
            "FT_TOKEN_FILE": str(tmp_path / "token"),
            "FT_TLS_CA": str(tmp_path / "ca.pem"),
            "CHECKPOINT": str(tmp_path / "checkpoint"),
            "SPARK_LOCAL_IP": "127.0.0.1",  # the driver on loopback, as the cluster is
            # The driver's scratch (its copy of the archive, unpacked) under tmp_path.
            "SPARK_LOCAL_DIRS": str(tmp_path / "driver-scratch"),
            # The driver host's Spark installation: the one the cluster runs.
            "SPARK_HOME": str(spark_class().parent.parent),
        }
        job_log = tmp_path / "job.log"
        with job_log.open("wb") as out:
            proc = subprocess.Popen(
                ["bash", "-e", "-o", "pipefail", "-c", submit],
                cwd=work,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its process group: bash, spark-submit, the driver
            )
        submitted = time.monotonic()
        try:
            token, tls = b"packed-env-token", str(tmp_path / "ca.pem")
            with FTClient(server.address, token=token, tls=tls) as ft:
                status = wait_complete(ft, proc, job_log)
            job_s = time.monotonic() - submitted
            checked = check_totals(work, tools)
            text = job_log.read_text(errors="replace")  # the run, before it is stopped
            assert proc.poll() is None, text[-4000:]
        finally:
            stop_group(proc)
        apps = sorted((tmp_path / "spark" / "worker-0").glob("app-*"))
        # Section 5's first block on the same cluster: ftlayer installed on every host
        # (this test's environment stands for /opt/ftlayer/venv), the driver started
        # as `python job.py`, the guide's job on topics and an FT layer of its own (the
        # same source name and a fresh checkpoint: a new deployment, not a restart).
        plain_server = start_server(
            tmp_path / "plain-data",
            *(
                "--tls-cert",
                str(tmp_path / "server.pem"),
                "--tls-key",
                str(tmp_path / "server.key"),
            ),
            *("--token-file", str(tmp_path / "token")),
        )
        plain = run_plain_block(
            cluster.master_url,
            kafka_bootstrap,
            plain_server.address,
            tmp_path,
            make_topic(4),
            make_topic(4),
            env,
            tools,
        )

    # What the user notices: every order summed exactly, none pending or timed out.
    assert checked.returncode == 0, checked.stdout + checked.stderr + text[-3000:]
    assert "every user's totals are exact" in checked.stdout
    assert status.persisted == ORDERS and status.failed["timeout"] == 0
    assert "Traceback" not in text, text[-4000:]

    # The archive has no pyspark or py4j (section 4's --excludes): every process that
    # imported them, the driver's included, had them from SPARK_HOME.
    packed = {p.name for p in (work / "environment").glob("lib/python*/site-packages/*")}
    assert "ftlayer" in packed and not {n for n in packed if n.startswith(("pyspark", "py4j"))}
    # The executors ran the archive's interpreter, unpacked in their working directory
    # on the worker (not the driver's copy in `work`), with ftlayer and its dependencies
    # from there; only pyspark and py4j come from the worker's Spark installation.
    assert len(apps) == 1, apps
    seen = [json.loads(p.read_text()) for p in probes.glob("*.json")]
    assert seen, f"no Python worker ran parse\n{text[-3000:]}"
    spark_python = spark_class().parent.parent / "python" / "lib"
    for probe in seen:
        base = Path(probe["base_prefix"])
        cwd = Path(probe["cwd"])
        environment = cwd / "environment"
        assert cwd.parent == apps[0], probe["cwd"]  # .../worker-0/app-.../EXECUTOR_ID
        assert probe["executable"] == str(environment / "bin" / "python")
        files = {name: path for name, path in probe["files"].items() if path}
        for name in ("ftlayer", "ftlayer.integration.tasks", "pyarrow", "pandas", "numpy"):
            assert under(files.get(name), environment / "lib"), (name, files.get(name))
        elsewhere = {
            name: path
            for name, path in files.items()
            if not under(path, environment)
            and not under(path, spark_python)
            and not (under(path, base / "lib") and "site-packages" not in path)
        }
        assert not elsewhere, elsewhere
        assert all(under(files[n], spark_python) for n in ("pyspark", "py4j") if n in files)
    # The first block's run: every order summed exactly, its executors on the
    # environment the block names.
    assert plain.totals.returncode == 0, plain.totals.stdout + plain.totals.stderr + plain.log
    assert "every user's totals are exact" in plain.totals.stdout
    assert plain.status.completed == ORDERS and plain.status.pending == 0
    assert plain.status.failed["timeout"] == 0 and "Traceback" not in plain.log
    assert plain.executables == {str(Path(sys.prefix) / "bin" / "python")}, plain.executables
    # The unpacked copies (3 GB in all) stay in tmp_path, which pytest's retention
    # removes: deleting them here would add half a minute to the run.
    print(f"archive ready in {pack_s:.0f} s; every order complete {job_s:.0f} s after submit")
