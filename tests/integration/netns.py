"""Hosts of their own for tests: Linux network namespaces on a bridge.

`NetnsHosts(names)` makes, for each name, a network namespace `ftlPID-NAME` with its
loopback up and one veth pair: `ftlPID-I` on this machine's side, a port of the bridge
`ftlPID-br`, and `eth0` inside, with one address of a /24 of 10.231.0.0/16 that no
interface here uses yet (.2 onwards, in the order of `names`). PID is the test
process's pid in hex, so that two test runs never touch each other's hosts (one
`NetnsHosts` at a time in a test process). The
bridge itself has the .1 address, so the test process reaches every host, as an
operator's machine on the same network would. Processes of a host talk to the others
over the bridge; their own loopback is theirs alone.

A process runs on a host behind its prefix, ``ip netns exec ftlPID-NAME ...``
(`NetnsHost.prefix`). `NetnsHost.kill_all()` is that host dying: every process in its
namespace (``ip netns pids``) stopped, then SIGKILLed. `NetnsHosts.set_link(name, up)`
is its cable pulled and plugged in again at the switch: its veth's end on the bridge
goes down, so the host's eth0 loses its carrier and whatever it sends, or is sent to
it, is dropped, while its address, routes and sockets stay as they were (its TCP
connections resume once the link is up). `NetnsHosts.close()` kills what
runs on every host and removes every namespace, link and bridge it made, also after a
failed test; `NetnsHosts.start()` first removes what killed earlier runs left behind
(every namespace and link named `ftlPID-*` whose PID no longer runs).

`unavailable()` says why this machine cannot make such hosts (not root, no `ip`, no
network namespaces), or None.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

from ftlayer.integration.harness.standalone import Host, freeze_and_kill, started_at

PREFIX = "ftl"
_OWNED = re.compile(rf"^{PREFIX}([0-9a-f]+)-")
NETWORK = ipaddress.IPv4Network("10.231.0.0/16")


class NetnsError(Exception):
    """A command of `ip` failed; the message has its output."""


def ip(*args: str, check: bool = True) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def unavailable() -> str | None:
    """Why hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); run the tests as root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"{PREFIX}{os.getpid():x}-probe"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if done.returncode != 0:
        return f"ip netns add failed: {done.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return None


@dataclass(frozen=True)
class NetnsHost:
    """One host: its namespace and address."""

    name: str
    netns: str
    address: str

    @property
    def prefix(self) -> tuple[str, ...]:
        """The command prefix that runs a process on this host."""
        return ("ip", "netns", "exec", self.netns)

    @property
    def host(self) -> Host:
        """This host as the harness's `Host` (address and prefix)."""
        return Host(self.address, self.prefix)

    def pids(self) -> list[int]:
        """Every living process in this host's namespace (zombies are dead: their
        parent has not collected them yet)."""
        found = ip("netns", "pids", self.netns, check=False).split()
        return [int(pid) for pid in found if not _zombie(int(pid))]

    def kill_all(self, timeout: float = 60.0) -> int:
        """This host dies: every process on it SIGKILLed (stopped first, so none starts
        another meanwhile); returns how many, once they are gone (NetnsError after
        `timeout` seconds). Only those are waited for: a process started on the host
        after them (a supervisor starting its driver again as soon as the old one died)
        is not this death's."""
        started: dict[int, int | None] = {}

        def find() -> list[int]:
            found = self.pids()
            for pid in found:
                started.setdefault(pid, started_at(pid))
            return found

        killed = freeze_and_kill(find)
        deadline = time.monotonic() + timeout
        while left := [pid for pid, at in started.items() if _alive_since(pid, at)]:
            if time.monotonic() > deadline:
                states = ", ".join(f"{pid} ({_state(pid)})" for pid in left)
                raise NetnsError(f"processes on host {self.name} outlived SIGKILL: {states}")
            time.sleep(0.02)
        return killed


def _alive_since(pid: int, started: int | None) -> bool:
    """Whether the process that started at `started` is `pid` still and not dead (a
    pid may be reused by a new process meanwhile)."""
    return started is not None and started_at(pid) == started and not _zombie(pid)


def _state(pid: int) -> str:
    """A process's state and where it waits in the kernel, for an error message."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        wchan = Path(f"/proc/{pid}/wchan").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "gone"
    return f"state {state}, waiting in {wchan or '-'}: {cmdline[:80]}"


def _zombie(pid: int) -> bool:
    """Whether process `pid` is dead: gone, or a zombie whose threads are gone too (a
    killed process's main thread is a zombie before its other threads have exited, and
    only then can its parent collect it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state == "Z" and len(os.listdir(f"/proc/{pid}/task")) <= 1
    except OSError:
        return True  # gone


def _pid_alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def _leftover(name: str) -> bool:
    """A name of this module's whose test process is gone."""
    owner = _OWNED.match(name)
    return owner is not None and not _pid_alive(int(owner.group(1), 16))


def remove_leftovers() -> None:
    """Remove the namespaces and links of earlier runs that were killed (their test
    process is gone), killing the processes in those namespaces first."""
    for line in ip("netns", "list", check=False).splitlines():
        words = line.split()
        if words and _leftover(words[0]):
            NetnsHost(words[0], words[0], "").kill_all()
            ip("netns", "del", words[0], check=False)
    for line in ip("-o", "link", "show", check=False).splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if _leftover(name):
            ip("link", "del", name, check=False)


def _free_subnet() -> ipaddress.IPv4Network:
    """The first /24 of `NETWORK` that no interface here has an address in."""
    used = set()
    for word in ip("-o", "-4", "addr", "show", check=False).split():
        if "/" in word and word[0].isdigit():
            with contextlib.suppress(ValueError):
                used.add(ipaddress.IPv4Interface(word).network)
    for subnet in NETWORK.subnets(new_prefix=24):
        if not any(subnet.overlaps(other) for other in used):
            return subnet
    raise NetnsError(f"every /24 of {NETWORK} is in use here")


class NetnsHosts:
    """Hosts made of network namespaces; a context manager. See the module docstring."""

    def __init__(self, names: Sequence[str]) -> None:
        if not 0 < len(names) <= 250 or len(set(names)) != len(names):
            raise NetnsError(f"need 1 to 250 distinct host names, got {names}")
        self.tag = f"{PREFIX}{os.getpid():x}-"
        self.bridge = f"{self.tag}br"
        self.names = tuple(names)
        self.hosts: dict[str, NetnsHost] = {}
        self.gateway = ""
        """The bridge's own address: the test process's address on the hosts' network."""

    def __getitem__(self, name: str) -> NetnsHost:
        return self.hosts[name]

    def _veth(self, index: int) -> str:
        return f"{self.tag}{index}"  # at most 15 characters (Linux's IFNAMSIZ - 1)

    def set_link(self, name: str, up: bool) -> None:
        """Take host `name`'s link down (`up` False) or up again: see the module
        docstring."""
        ip("link", "set", self._veth(self.names.index(name)), "up" if up else "down")

    def start(self) -> Self:
        remove_leftovers()
        subnet = _free_subnet()
        addresses = list(subnet.hosts())
        self.gateway = str(addresses[0])
        self.hosts = {
            name: NetnsHost(name, f"{self.tag}{name}", str(addresses[i + 1]))
            for i, name in enumerate(self.names)
        }
        try:
            ip("link", "add", self.bridge, "type", "bridge")
            ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for i, host in enumerate(self.hosts.values()):
                ip("netns", "add", host.netns)
                ip("link", "add", self._veth(i), "type", "veth", "peer", "name", "eth0",
                   "netns", host.netns)  # fmt: skip
                ip("link", "set", self._veth(i), "master", self.bridge, "up")
                ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
                ip("-n", host.netns, "link", "set", "eth0", "up")
                ip("-n", host.netns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Kill every process on the hosts, remove the namespaces, links and bridge."""
        for i, host in enumerate(self.hosts.values()):
            host.kill_all()
            ip("netns", "del", host.netns, check=False)
            ip("link", "del", self._veth(i), check=False)  # gone with its peer, normally
        ip("link", "del", self.bridge, check=False)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
