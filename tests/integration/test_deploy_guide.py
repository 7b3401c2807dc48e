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
process, TLS, the token, curl. Section 5's blocks (`standalone`, and the packed
environment's `pack` of section 4 with `standalone-pack`) run in test_packed_env.py, on
a standalone cluster.
"""

from __future__ import annotations

import json
import os
import re
import select
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

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
    assert guide.count("<!-- deploy-test") == len(_BLOCK.findall(guide)) == 10
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


# ---------------------------------------------------------------------------------
# Sections 6 (YARN) and 7 (Kubernetes): no cluster here, so each command runs as far
# as it can without one. kubectl runs in client dry-run (and `label --local` reads the
# manifests); spark-submit runs as written against a master that is not there (YARN:
# a ResourceManager on a closed port; Kubernetes: a stand-in API server on loopback
# that records what Spark sends and refuses it); pyspark's own jars, in one small JVM
# (DeployGuideCheck.java), say which `--conf` keys Spark defines, what environment
# and files YARN's client gives the application master, and whether fabric8's typed
# Kubernetes model (the one Spark submits with) knows every field of the manifests.

SPARK_JARS = Path(__import__("pyspark").__file__).parent / "jars"
SPARK_SUBMIT = VENV_BIN / "spark-submit"
USER_GUIDE = REPO / "docs" / "user-guide.md"
JAVA_CHECK = Path(__file__).with_name("DeployGuideCheck.java")
_JVM_TIMEOUT_S = 120


def commands(body: str) -> list[list[str]]:
    """The block's commands, continued lines joined, each split as the shell does (the
    blocks have no comments: shlex would take the `#` of `file#link` for one)."""
    joined = body.replace("\\\n", " ")
    return [shlex.split(line) for line in joined.splitlines() if line.strip()]


def the_command(body: str, program: str) -> list[str]:
    found = [c for c in commands(body) if c and c[0] == program]
    assert len(found) == 1, found
    return found[0]


def options(argv: list[str], name: str) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == name]


def confs(argv: list[str]) -> dict[str, str]:
    pairs = [conf.split("=", 1) for conf in options(argv, "--conf")]
    assert all(len(pair) == 2 for pair in pairs), pairs
    result = dict(pairs)
    assert len(result) == len(pairs), "a --conf key given twice"
    return result


def with_prefix(values: dict[str, str], prefix: str) -> dict[str, str]:
    return {k[len(prefix) :]: v for k, v in values.items() if k.startswith(prefix)}


def job_source() -> str:
    found = re.findall(
        r"<!-- walkthrough: save as job.py -->\n```python\n(.*?)^```",
        USER_GUIDE.read_text(),
        re.DOTALL | re.MULTILINE,
    )
    assert len(found) == 1
    return found[0]


def job_env_vars() -> set[str]:
    """The environment variables the user guide's job.py reads (os.environ.get,
    os.environ.setdefault, os.environ[...])."""
    import ast

    names: set[str] = set()
    for node in ast.walk(ast.parse(job_source())):
        target = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("get", "setdefault") and node.args:
                target, key = node.func.value, node.args[0]
        elif isinstance(node, ast.Subscript):
            target, key = node.value, node.slice
        if (
            target is not None
            and ast.unparse(target) == "os.environ"
            and isinstance(key, ast.Constant)
            and isinstance(key.value, str)
        ):
            names.add(key.value)
    return names


# What job.py needs set on a cluster: its defaults are for one machine.
JOB_NEEDS = {"KAFKA", "FT_ADDRESS", "FT_TOKEN_FILE", "FT_TLS_CA", "CHECKPOINT", "SPARK_MASTER"}


def test_job_py_reads_the_variables_the_guide_sets() -> None:
    assert JOB_NEEDS | {"PYSPARK_PYTHON", "PYTHONHASHSEED"} == job_env_vars()


def kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        pytest.skip("kubectl is not installed (the machine image has /usr/bin/kubectl)")
    return found


def java_tools() -> tuple[str, str]:
    java, javac = shutil.which("java"), shutil.which("javac")
    if java is None or javac is None:
        pytest.skip("java and javac (JDK 17) are not installed")
    return java, javac


@pytest.fixture(scope="module")
def jvm_check(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Runs DeployGuideCheck (compiled once) against pyspark's jars; returns its lines
    split at tabs."""
    java, javac = java_tools()
    classes = tmp_path_factory.mktemp("deploy-guide-check")
    classpath = f"{SPARK_JARS}/*"
    subprocess.run(
        [javac, "-nowarn", "-d", str(classes), "-cp", classpath, str(JAVA_CHECK)],
        check=True,
        timeout=_JVM_TIMEOUT_S,
    )

    def run(*args: str) -> list[list[str]]:
        done = subprocess.run(
            [java, "-cp", f"{classes}{os.pathsep}{classpath}", "DeployGuideCheck", *args],
            env={**os.environ, "SPARK_HOME": str(SPARK_JARS.parent)},
            capture_output=True,
            text=True,
            timeout=_JVM_TIMEOUT_S,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-4000:]
        return [line.split("\t") for line in done.stdout.splitlines()]

    return run


def kubectl_dry_run(argv: list[str], cwd: Path) -> dict[str, Any]:
    """A `kubectl create ...` of the guide, as written, in client dry-run: nothing
    contacts a server."""
    assert argv[:2] == ["kubectl", "create"], argv
    done = subprocess.run(
        [kubectl(), *argv[1:], "--dry-run=client", "-o", "json"],
        cwd=cwd,
        env={**os.environ, "KUBECONFIG": str(cwd / "no-kubeconfig")},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, (argv, done.stderr)
    return json.loads(done.stdout)


def kubectl_objects(tmp_path: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """Every `kubectl create` of section 7, run in client dry-run with stand-in files,
    by (kind, name)."""
    for name in ("ca.pem", "token", "server.pem", "server.key"):
        (tmp_path / name).write_text(f"stand-in {name}\n")
    made: dict[tuple[str, str], dict[str, Any]] = {}
    for name in ("k8s-submit", "k8s-server"):
        for argv in commands(block(name)):
            if argv[0] == "kubectl":
                obj = kubectl_dry_run(argv, tmp_path)
                made[(obj["kind"], obj["metadata"]["name"])] = obj
    return made


def manifests(tmp_path: Path) -> list[dict[str, Any]]:
    """The YAML of section 7 as kubectl reads it (`label --local`: no server)."""
    path = tmp_path / "ftlayer.yaml"
    path.write_text(block("k8s-yaml"))
    done = subprocess.run(
        [kubectl(), "label", "--local", "-f", str(path), "-o", "json", "deploy-test=read"],
        env={**os.environ, "KUBECONFIG": str(tmp_path / "no-kubeconfig")},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    decoder, text, objects = json.JSONDecoder(), done.stdout, []
    at = 0
    while text[at:].strip():
        obj, end = decoder.raw_decode(text, at + len(text[at:]) - len(text[at:].lstrip()))
        objects.append(obj)
        at = end
    return objects


def test_kubectl_commands_run_in_client_dry_run(tmp_path: Path) -> None:
    made = kubectl_objects(tmp_path)
    client, server = made[("Secret", "ftlayer-client")], made[("Secret", "ftlayer-server")]
    assert set(client["data"]) == {"ca.pem", "token"}
    assert set(server["data"]) == {"server.pem", "server.key", "token"}
    assert server["metadata"]["namespace"] == "data"
    assert ("Namespace", "data") in made
    binding = made[("RoleBinding", "spark-edit")]
    account = made[("ServiceAccount", "spark")]
    namespace = client["metadata"]["namespace"]
    assert account["metadata"]["namespace"] == binding["metadata"]["namespace"] == namespace
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "spark", "namespace": namespace}
    ]
    assert binding["roleRef"]["name"] == "edit"
    # The job's pods run where the secret and the service account are.
    submit = confs(the_command(block("k8s-submit"), "spark-submit"))
    assert submit["spark.kubernetes.namespace"] == namespace
    assert submit["spark.kubernetes.authenticate.driver.serviceAccountName"] == "spark"


def test_the_statefulset_and_service_fit_together_and_ftlayer_parses_the_args(
    tmp_path: Path,
) -> None:
    from ftlayer.cli import _parser

    objects = manifests(tmp_path)
    assert [o["kind"] for o in objects] == ["Service", "StatefulSet"]
    service, sts = objects
    namespace = service["metadata"]["namespace"]
    assert sts["metadata"]["namespace"] == namespace
    spec, pod = sts["spec"], sts["spec"]["template"]["spec"]
    # Headless, and the StatefulSet's governing service: stable DNS names per pod.
    assert service["spec"]["clusterIP"] == "None"
    assert spec["serviceName"] == service["metadata"]["name"]
    assert spec["replicas"] == 1
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    (container,) = pod["containers"]

    # The container's args through ftlayer's own parser (the image's entrypoint is
    # `ftlayer`): they must parse, as `ftlayer serve`.
    args = _parser().parse_args(container["args"])
    assert args.command == "serve"
    assert args.host == args.http_host == "0.0.0.0"

    # The ports: the container's, the service's and the probe's are the args'.
    container_ports = {p["containerPort"] for p in container["ports"]}
    service_ports = {p["port"] for p in service["spec"]["ports"]}
    assert {args.port, args.http_port} == container_ports == service_ports
    assert container["readinessProbe"]["tcpSocket"]["port"] == args.port

    # The paths: the data dir on the volume claim, the server's files in its secret.
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    (claim,) = spec["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    data_mount = mounts[claim["metadata"]["name"]]["mountPath"]
    assert Path(args.data_dir).is_relative_to(data_mount), (args.data_dir, data_mount)
    volumes = {v["name"]: v for v in pod["volumes"]}
    secret_mounts = {
        volumes[name]["secret"]["secretName"]: m
        for name, m in mounts.items()
        if "secret" in volumes.get(name, {})
    }
    assert set(secret_mounts) == {"ftlayer-server"}
    mount = secret_mounts["ftlayer-server"]
    assert mount.get("readOnly") is True
    made = kubectl_objects(tmp_path)
    server = made[("Secret", "ftlayer-server")]
    assert server["metadata"]["namespace"] == namespace
    for path in (args.token_file, args.tls_cert, args.tls_key):
        assert str(Path(path).parent) == mount["mountPath"], path
        assert Path(path).name in server["data"], path

    # The driver's FT_ADDRESS is pod 0's name under the headless service, at the port.
    submit = confs(the_command(block("k8s-submit"), "spark-submit"))
    name = sts["metadata"]["name"]
    assert submit["spark.kubernetes.driverEnv.FT_ADDRESS"] == (
        f"{name}-0.{spec['serviceName']}.{namespace}.svc.cluster.local:{args.port}"
    )


def test_fabric8_knows_every_field_of_the_manifests(tmp_path: Path, jvm_check: Any) -> None:
    path = tmp_path / "ftlayer.yaml"
    path.write_text(block("k8s-yaml"))
    lines = jvm_check("k8s-yaml", str(path))
    assert [line for line in lines if line[0] == "unknown"] == []
    assert [line for line in lines if line[0] == "kind"] == [
        ["kind", "Service", "ftlayer"],
        ["kind", "StatefulSet", "ftlayer"],
    ]


# The YARN client reads spark.yarn.appMasterEnv.* in a method of its own (no constant
# to look up); test_yarn_submit shows the application master's environment instead.
_CHECKED_BY_THE_YARN_CLIENT = "spark.yarn.appMasterEnv."


def test_every_conf_key_is_one_spark_defines(jvm_check: Any) -> None:
    keys = sorted(
        {
            key
            for name in ("yarn", "k8s-submit")
            for key in confs(the_command(block(name), "spark-submit"))
        }
    )
    lines = jvm_check("keys", *keys)
    entries = {line[1] for line in lines if line[0] == "entry"}
    prefixes = {line[2]: line[1] for line in lines if line[0] == "prefix"}
    unknown = [line[1] for line in lines if line[0] == "unknown"]
    assert "spark.kubernetes.driverEnv." in prefixes  # the lookup works at all
    for key in unknown:
        prefix = next((p for p in prefixes if key.startswith(p) and key != p), None)
        assert prefix is not None or key.startswith(_CHECKED_BY_THE_YARN_CLIENT), (
            f"{key} is neither a Spark config entry nor under a prefix Spark defines"
        )
    assert entries, lines


def spark_submit_env(tmp_path: Path) -> dict[str, str]:
    if not SPARK_SUBMIT.exists():
        pytest.skip(f"{SPARK_SUBMIT} is missing")
    java_tools()
    conf_dir = tmp_path / "spark-conf"  # spark-defaults.conf: print secrets unredacted
    conf_dir.mkdir()
    (conf_dir / "spark-defaults.conf").write_text("spark.redaction.regex (?!)\n")
    return {
        **os.environ,
        "SPARK_CONF_DIR": str(conf_dir),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
    }


def verbose_spark_config(output: str) -> dict[str, str]:
    """spark-submit --verbose's "Spark config:" lines, (key,value) each."""
    section = output.split("\nSpark config:\n", 1)[1].split("\nClasspath elements:", 1)[0]
    return dict(line[1:-1].split(",", 1) for line in section.splitlines() if line.startswith("("))


_YARN_SITE = """<configuration>
<property><name>yarn.resourcemanager.address</name><value>127.0.0.1:{port}</value></property>
<property><name>yarn.resourcemanager.connect.max-wait.ms</name><value>500</value></property>
<property><name>yarn.resourcemanager.connect.retry-interval.ms</name><value>100</value></property>
</configuration>
"""
_CORE_SITE = """<configuration>
<property><name>ipc.client.connect.max.retries</name><value>0</value></property>
<property><name>ipc.client.connect.max.retries.on.timeouts</name><value>0</value></property>
</configuration>
"""


def test_yarn_submit(tmp_path: Path, jvm_check: Any) -> None:
    body = block("yarn")
    env = spark_submit_env(tmp_path)
    argv = the_command(body, "spark-submit")
    # Stand-ins in the submitting directory: the packed environment, the job, the token.
    work = tmp_path / "submit"
    (work / "etc-ftlayer").mkdir(parents=True)
    (work / "etc-ftlayer" / "token").write_text("stand-in token\n")
    (work / "ftlayer-env.tar.gz").write_bytes(b"stand-in archive")
    (work / "job.py").write_text(job_source())
    argv = [a.replace("/etc/ftlayer/token", str(work / "etc-ftlayer" / "token")) for a in argv]
    hadoop = tmp_path / "hadoop-conf"  # a ResourceManager on a closed port, given up fast
    hadoop.mkdir()
    (hadoop / "yarn-site.xml").write_text(_YARN_SITE.format(port=free_port()))
    (hadoop / "core-site.xml").write_text(_CORE_SITE)
    env["HADOOP_CONF_DIR"] = str(hadoop)
    done = subprocess.run(
        [str(SPARK_SUBMIT), "--verbose", *argv[1:]],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=_JVM_TIMEOUT_S,
        check=False,
    )
    output = done.stdout + done.stderr
    # It parses the command, then fails at the ResourceManager, and only there.
    assert done.returncode != 0
    assert "Main class:\norg.apache.spark.deploy.yarn.YarnClusterApplication" in output, output
    assert re.search(r"ConnectException: Call From .* failed on connection", output), output
    spark_config = verbose_spark_config(output)
    assert spark_config["spark.submit.deployMode"] == "cluster"

    # What the YARN client makes of that config: the AM's environment and the files it
    # localizes (a local staging dir; a stand-in for Spark's own jars' archive).
    (tmp_path / "spark-libs.zip").write_bytes(b"stand-in")
    spark_config["spark.yarn.archive"] = (tmp_path / "spark-libs.zip").as_uri()
    props = tmp_path / "spark.properties"
    props.write_text("".join(f"{k}={v}\n".replace("\\", "\\\\") for k, v in spark_config.items()))
    lines = jvm_check("yarn", str(props), (tmp_path / "staging").as_uri(), str(work / "job.py"))
    am_env = {line[1]: line[2] for line in lines if line[0] == "env"}
    localized = {line[1]: line[2] for line in lines if line[0] == "local"}
    wanted = with_prefix(confs(argv), _CHECKED_BY_THE_YARN_CLIENT)
    assert wanted.items() <= am_env.items()
    assert JOB_NEEDS <= set(wanted) <= job_env_vars(), wanted

    # --archives ...#environment and --files ...#ft-token: the names the env uses.
    (archive,) = options(argv, "--archives")
    (files,) = options(argv, "--files")
    archive_link, file_link = archive.split("#")[1], files.split("#")[1]
    assert localized.get(archive_link) == "ARCHIVE" and localized.get(file_link) == "FILE"
    assert wanted["PYSPARK_PYTHON"].startswith(f"./{archive_link}/")
    assert wanted["FT_TOKEN_FILE"] == file_link
    assert wanted["SPARK_MASTER"] == options(argv, "--master")[0]


class _FakeKubernetes:
    """A stand-in Kubernetes API server on loopback: records each request, refuses it."""

    def __init__(self) -> None:
        import http.server
        import threading

        self.requests: list[tuple[str, str, bytes]] = []
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _refuse(self) -> None:
                size = int(self.headers.get("Content-Length") or 0)
                fake.requests.append((self.command, self.path, self.rfile.read(size)))
                body = json.dumps(
                    {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                     "message": "a stand-in API server", "reason": "Forbidden", "code": 403}
                ).encode()  # fmt: skip
                self.send_response(403)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _refuse

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_kubernetes_submit(tmp_path: Path) -> None:
    body = block("k8s-submit")
    argv = the_command(body, "spark-submit")
    env = spark_submit_env(tmp_path)
    (master,) = options(argv, "--master")
    fake = _FakeKubernetes()
    try:
        at = argv.index("--master") + 1  # only the master: SPARK_MASTER keeps its value
        ours = [*argv[:at], f"k8s://http://127.0.0.1:{fake.port}", *argv[at + 1 :]]
        done = subprocess.run(
            [str(SPARK_SUBMIT), "--verbose", *ours[1:]],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=_JVM_TIMEOUT_S,
            check=False,
        )
    finally:
        fake.close()
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "org.apache.spark.deploy.k8s.submit.KubernetesClientApplication" in output, output
    submitted = confs(argv)
    namespace = submitted["spark.kubernetes.namespace"]
    posts = [
        json.loads(b)
        for method, path, b in fake.requests
        if method == "POST" and path == f"/api/v1/namespaces/{namespace}/pods"
    ]
    assert len(posts) == 1, (fake.requests, output[-3000:])
    (pod,) = posts
    assert pod["spec"]["serviceAccountName"] == "spark"
    (driver,) = pod["spec"]["containers"]
    assert driver["image"] == submitted["spark.kubernetes.container.image"]
    assert driver["args"][-1] == argv[-1]  # local:///opt/job/job.py

    # The driver's environment: what driverEnv set, the variables job.py reads.
    pod_env = {e["name"]: e.get("value") for e in driver["env"]}
    wanted = with_prefix(submitted, "spark.kubernetes.driverEnv.")
    assert wanted.items() <= pod_env.items()
    assert JOB_NEEDS <= set(wanted) <= job_env_vars(), wanted
    assert wanted["SPARK_MASTER"] == master

    # The secret at its path in the driver; the executors get the same path.
    secrets = with_prefix(submitted, "spark.kubernetes.driver.secrets.")
    assert secrets == with_prefix(submitted, "spark.kubernetes.executor.secrets.")
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounted = {
        volumes[m["name"]]["secret"]["secretName"]: m["mountPath"]
        for m in driver["volumeMounts"]
        if "secret" in volumes[m["name"]]
    }
    assert mounted == secrets
    client = kubectl_objects(tmp_path)[("Secret", "ftlayer-client")]
    for var in ("FT_TLS_CA", "FT_TOKEN_FILE"):
        path = Path(wanted[var])
        assert str(path.parent) == secrets[client["metadata"]["name"]], var
        assert path.name in client["data"], var
