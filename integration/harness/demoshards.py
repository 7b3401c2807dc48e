"""The demo's FT layer as N shards, its figures summed over them, and one shard's kill.

- `start_shards`: N `ftlayer serve --shard I --shards N` processes, each with its own
  data dir (`ft`, or `ft0`, `ft1`, ... for several) and a port fixed at start, so a
  shard started again after a kill is where the source's `ft.address` names it.
- `ShardSampler`: one STATUS of every shard per call, summed (`ShardTotals`). A shard
  that does not answer counts with its last answer and is listed `down`. A shard's
  counters restart at 0 when its process does (STATUS `uptime_s` falls), so the sampler
  adds each earlier life's last answer to the shard's counts: what a shard completed
  between its last answer and its death is counted nowhere, which is why `ShardKill`
  asks the victim once more right before the kill.
- `ShardKill`: once a third of the events were persisted, SIGKILL the last shard
  right after a micro-batch was planned (why then: its docstring), keep it down for `outage_s`,
  then start it again on its data dir. The other shards' `completed`, sampled at the
  kill and at the restart, gives `completed_during_outage`: records of their partitions
  that completed while one shard was down (the source holds back only the dead
  shard's partitions, ftlayer.integration.source.cluster).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftlayer.client import ConnectionLost, FTClient
from ftlayer.integration.harness.ftprocess import FTServerProcess, ServerProcessError
from ftlayer.status import Status

__all__ = ["ShardKill", "ShardSampler", "ShardTotals", "start_shards"]

_PLANNED_WITHIN_S = 30.0
"""A batch's planning (its STATUS, fills, ranges and barrier) takes well under this;
past it the kill goes ahead without seeing the barrier."""

_CUMULATIVE = ("persisted", "completed", "dead_lettered", "taken_over")
"""Counters since a server's start, summed over a restarted shard's lives."""


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def start_shards(
    parts: contextlib.ExitStack,
    work: Path,
    shards: int,
    serve_args: Sequence[str],
    http_port: int | None = None,
) -> list[FTServerProcess]:
    """Start `shards` FT-layer processes under `parts` (stopped when it closes). One
    shard runs as `ftlayer serve` alone on `work/ft`, on any free port; several each get
    `--shard I --shards N`, `work/ftI` and a port chosen now (kept across a restart),
    and with `http_port` shard I serves its status page on `http_port + I`."""
    if shards == 1:
        extra = ["--http-port", str(http_port)] if http_port is not None else []
        return [parts.enter_context(FTServerProcess(work / "ft", *serve_args, *extra))]
    servers = []
    for index in range(shards):
        place = ["--shard", str(index), "--shards", str(shards)]
        place += ["--port", str(_free_port("127.0.0.1"))]
        if http_port is not None:
            place += ["--http-port", str(http_port + index)]
        server = FTServerProcess(work / f"ft{index}", *serve_args, *place)
        servers.append(parts.enter_context(server))
    return servers


@dataclass(frozen=True)
class ShardTotals:
    """The demo's figures summed over the shards; `down`: shards that did not answer
    (counted with their last answer)."""

    persisted: int
    completed: int
    pending: int
    dead_lettered: int
    dead_letters: int
    taken_over: int
    failed: dict[str, int]
    down: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "persisted": self.persisted,
            "completed": self.completed,
            "pending": self.pending,
            "dead_lettered": self.dead_lettered,
            "dead_letters": self.dead_letters,
            "taken_over": self.taken_over,
            "failed": dict(self.failed),
            "shards_down": list(self.down),
        }


@dataclass
class _Shard:
    address: str
    client: FTClient | None = None
    last: Status | None = None
    earlier: dict[str, int] = field(default_factory=dict)
    """The cumulative counters of its earlier lives."""
    earlier_failed: dict[str, int] = field(default_factory=dict)


class ShardSampler:
    """STATUS of every shard, summed (module docstring); thread-safe; a context manager
    that closes its connections."""

    def __init__(
        self, addresses: Sequence[str], token: bytes | None, tls: bool | str = False
    ) -> None:
        self._shards = [_Shard(a) for a in addresses]
        self._token, self._tls = token, tls
        self._lock = threading.Lock()

    def sample(self) -> ShardTotals:
        with self._lock:
            down = tuple(i for i in range(len(self._shards)) if not self._ask(i))
            return self._totals(down)

    def refresh(self, index: int) -> Status | None:
        """Ask shard `index` alone now; its answer, or None when it does not answer."""
        with self._lock:
            return self._shards[index].last if self._ask(index) else None

    def _ask(self, index: int) -> bool:
        shard = self._shards[index]
        try:
            if shard.client is None:  # one connection attempt: a dead shard is down now
                shard.client = FTClient(
                    shard.address, self._token, 2.0, name="ftlayer-demo", tls=self._tls,
                    reconnect_s=0.0, request_timeout=10.0,
                )  # fmt: skip
            status = shard.client.status()
        except (ConnectionLost, OSError):
            if shard.client is not None:
                shard.client.close()
            shard.client = None
            return False
        last = shard.last
        if last is not None and status.uptime_s < last.uptime_s:  # it started again
            for name in _CUMULATIVE:
                shard.earlier[name] = shard.earlier.get(name, 0) + getattr(last, name)
            for cause, n in last.failed.items():
                shard.earlier_failed[cause] = shard.earlier_failed.get(cause, 0) + n
        shard.last = status
        return True

    def _totals(self, down: tuple[int, ...]) -> ShardTotals:
        sums = dict.fromkeys(_CUMULATIVE, 0)
        failed: dict[str, int] = {}
        pending = dead_letters = 0
        for shard in self._shards:
            for name in _CUMULATIVE:
                sums[name] += shard.earlier.get(name, 0)
            for cause, n in shard.earlier_failed.items():
                failed[cause] = failed.get(cause, 0) + n
            if shard.last is None:
                continue
            for name in _CUMULATIVE:
                sums[name] += getattr(shard.last, name)
            for cause, n in shard.last.failed.items():
                failed[cause] = failed.get(cause, 0) + n
            pending += shard.last.pending
            dead_letters += shard.last.dead_letters
        return ShardTotals(
            persisted=sums["persisted"],
            completed=sums["completed"],
            pending=pending,
            dead_lettered=sums["dead_lettered"],
            dead_letters=dead_letters,
            taken_over=sums["taken_over"],
            failed=failed,
            down=down,
        )

    def close(self) -> None:
        with self._lock:
            for shard in self._shards:
                if shard.client is not None:
                    shard.client.close()
                    shard.client = None

    def __enter__(self) -> ShardSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ShardKill:
    """The kill of the last of several shards and its restart (module docstring).

    `watch(query)` starts a thread that kills the shard once a third of the events
    were persisted (`step` feeds it the figures), right after a batch was planned: when
    a micro-batch ended (a new progress), once the next batch's barrier reached the
    shard (its STATUS shows a newer checkpoint), or while the query waits for its next
    trigger. Then nothing of the batch must reach the shard: its ranges are registered
    and its barrier sent, and a failure its tasks send the dead shard is parked on
    another (ftlayer.integration.source.cluster); the next batch takes in only the live
    shards' partitions. A kill while a batch is planned would hold the batch, and every
    partition with it, until the shard is back: the batch's offsets are in Spark's
    offset log, so its ranges on that shard must be registered before any row of it.
    `step`, called by the demo's poll loop, starts the shard again once it was down
    `outage_s`: on that loop's thread, never on a thread that ends, since a server
    dies with the thread that started it (PDEATHSIG, `FTServerProcess`)."""

    def __init__(
        self,
        servers: Sequence[FTServerProcess],
        sampler: ShardSampler,
        records: int,
        outage_s: float,
        stop: threading.Event,
        on_kill: Callable[[str], None] | None,
    ) -> None:
        if len(servers) < 2:
            raise ValueError("a shard kill needs 2 or more shards")
        self.servers, self.sampler, self.records = servers, sampler, records
        self.outage_s, self.stop, self.on_kill = outage_s, stop, on_kill
        self.victim = len(servers) - 1
        self.kills = 0
        self.down_s: float | None = None
        """How long the shard was down, kill to restart."""
        self.completed_during_outage: int | None = None
        self.error: BaseException | None = None
        self._persisted = 0
        self._down_at: float | None = None
        self._live_before = 0

    def watch(self, query: Any) -> None:
        threading.Thread(
            target=self._run, args=(query,), name="ftlayer-demo-shard-kill", daemon=True
        ).start()

    def step(self, totals: ShardTotals) -> None:
        """Feed the figures; start the shard again once it was down `outage_s`. Raises
        what the kill thread met, and ServerProcessError when the shard does not start."""
        self._persisted = max(self._persisted, totals.persisted)
        if self.error is not None:
            raise self.error
        down_at = self._down_at
        if down_at is not None and time.monotonic() - down_at >= self.outage_s:
            self._restart(down_at)

    def _run(self, query: Any) -> None:
        try:
            while self._persisted < self.records // 3:
                if self.stop.wait(0.02):
                    return
            seen = _batch_id(query)
            barrier: int | None = None  # the shard's last checkpoint when a batch ended
            planned_by = 0.0
            while not self.stop.wait(0.01):
                if str(query.status.get("message", "")).startswith("Waiting"):
                    break  # no batch is planned now
                if barrier is None:
                    if _batch_id(query) != seen:  # the next batch is being planned
                        barrier = self._last_barrier()
                        planned_by = time.monotonic() + _PLANNED_WITHIN_S
                elif self._last_barrier() != barrier or time.monotonic() > planned_by:
                    break  # its barrier reached the shard: it was planned
            else:
                return
            self._kill()
        except Exception as exc:  # handed to the demo's loop by `step`
            self.error = exc

    def _last_barrier(self) -> int:
        """The newest checkpoint the shard to kill knows, of any query (0: none)."""
        status = self.sampler.refresh(self.victim)
        if status is None:
            raise ServerProcessError(f"shard {self.victim} of the FT layer did not answer STATUS")
        ids = [0]
        for q in status.checkpoints.values():
            ids += [c.id for c in (*q.open, *q.recent)]
            ids.append(q.last_complete_id or 0)
        return max(ids)

    def _live_completed(self) -> int:
        total = 0
        for index in range(len(self.servers)):
            if index == self.victim:
                continue
            status = self.sampler.refresh(index)
            if status is None:
                raise ServerProcessError(f"shard {index} of the FT layer did not answer STATUS")
            total += status.completed
        return total

    def _say(self, line: str) -> None:
        if self.on_kill is not None:
            self.on_kill(line)

    def _kill(self) -> None:
        server = self.servers[self.victim]
        # Its last words first: what it completed until now counts (ShardSampler).
        self.sampler.refresh(self.victim)
        self._live_before = self._live_completed()
        pid = server.pid
        server.kill()
        self.kills = 1
        self._down_at = time.monotonic()
        self._say(
            f"killed FT-layer shard {self.victim} (pid {pid}, SIGKILL) right after a batch was "
            "planned; "
            f"starting it again on its data dir in {self.outage_s:g} s"
        )

    def _restart(self, down_at: float) -> None:
        after = self._live_completed()
        server = self.servers[self.victim]
        server.start()
        self.down_s = round(time.monotonic() - down_at, 1)
        self._down_at = None
        self.completed_during_outage = after - self._live_before
        self._say(
            f"started FT-layer shard {self.victim} again (pid {server.pid}) after "
            f"{self.down_s:g} s; the other shards completed {self.completed_during_outage:,} "
            "records meanwhile"
        )


def _batch_id(query: Any) -> int | None:
    """The id of the query's last completed micro-batch (its last progress)."""
    progress = query.lastProgress
    return None if not progress else int(progress["batchId"])
