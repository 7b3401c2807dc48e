"""A streaming job as a child process that tests SIGKILL and start again: `Job` runs
kill_job.py (`JOB`) in a session and process group of its own, reads the JSON lines its
runs printed, and kills the whole group (driver, Spark JVM, Python workers). Used by
test_recovery_kills.py and test_ingest_kills.py."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

from ftlayer.integration.harness.kafka import wait_until
from ftlayer.integration.harness.standalone import proc_stats

__all__ = ["JOB", "Job"]

JOB = Path(__file__).with_name("kill_job.py")

_PRCTL = ctypes.CDLL(None).prctl  # resolved here: the child must not import after fork
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child, before exec
    """A job left behind by a killed test run dies with it (its driver; the JVM follows)."""
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _group_alive(pgid: int) -> list[int]:
    """Processes of process group `pgid` that are not zombies."""
    return [pid for pid, fields in proc_stats() if int(fields[2]) == pgid and fields[0] != "Z"]


class Job:
    """kill_job.py as a child process in a session (and process group) of its own."""

    def __init__(self, command: list[str], workdir: Path) -> None:
        self.command = command
        self.workdir = workdir
        self.stdout = workdir / "job.out"
        self.stderr = workdir / "job.err"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        with self.stdout.open("ab") as out, self.stderr.open("ab") as err:
            err.write(f"---- start {self.starts} ----\n".encode())
            err.flush()
            self.proc = subprocess.Popen(
                self.command,
                stdout=out,
                stderr=err,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def reports(self) -> list[dict[str, Any]]:
        """The JSON lines the job's runs printed so far (kill_job.py's docstring), in
        order; a line a kill cut short is left out."""
        found = []
        for line in self.stdout.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                found.append(json.loads(line))
        return found

    def check(self) -> None:
        """Raise if the job exited: its query died."""
        assert self.proc is not None
        code = self.proc.poll()
        if code is not None:
            tail = self.stderr.read_text(errors="replace")[-3000:]
            raise AssertionError(f"the job exited with code {code}; its stderr ends:\n{tail}")

    def send_kill(self) -> None:
        """SIGKILL the whole process group: driver, Spark JVM, Python workers."""
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # a session leader: pid = group id

    def kill(self) -> None:
        """SIGKILL the whole process group and wait until every process of it is gone."""
        assert self.proc is not None
        pgid = self.proc.pid
        self.send_kill()
        self.proc.wait(30)
        wait_until(lambda: not _group_alive(pgid), 30, f"every process of group {pgid} to die")
