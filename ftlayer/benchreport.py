"""`ftlayer bench report`: every bench in one run, written up as docs/benchmarks.md.

1. Run the benches of `BENCHES` in order, each through its own command line
   (`ftlayer bench NAME ...`: the report measures exactly what that command does), at
   the benches' default sizes, or with `quick` at small ones. A bench that raises is
   recorded with its error and the others still run; the report then says so.
2. Save every result, the command that produced it, the machine (CPU, cores, memory,
   OS, Python, Spark, Java, the commit) and the load before and after, as
   `<out>/benchmarks/results.json`.
3. Render: the plots of `ftlayer.benchplots` as `<out>/benchmarks/*.png`, and
   `<out>/benchmarks.md` with the machine, every target and whether it was met, the
   plots, every figure of every bench in tables, and last the profile of where FT on
   spends its time, kept by hand in `<out>/benchmarks/profile.md` (a profile is
   measured by scripts, not by one bench command), if there is one.

`render(results, out)` is step 3 alone, from a saved results.json (`ftlayer bench
report --from`): the page and its plots are never drawn by hand, and redrawing them
needs no bench run. A bench added later needs a row in `BENCHES`; its targets and
figures then appear in the tables (its own plot, if any, in ftlayer.benchplots).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from ftlayer import __version__

__all__ = [
    "BENCHES",
    "ReportBench",
    "load_results",
    "machine",
    "render",
    "run_report",
    "save_results",
    "target_checks",
]

RESULTS_FORMAT = 1
PROFILE = "profile.md"


@dataclass(frozen=True, slots=True)
class ReportBench:
    """One bench of the report: its name (its result's "bench"), its command line after
    `ftlayer bench`, and the options that make it quick."""

    name: str
    argv: tuple[str, ...]
    quick: tuple[str, ...]

    def command(self, quick: bool) -> list[str]:
        return [*self.argv, *(self.quick if quick else ())]


BENCHES: tuple[ReportBench, ...] = (
    ReportBench("acker", ("acker",), ("--roots", "200000")),
    ReportBench("persist", ("persist",), ("--records", "200000")),
    ReportBench("server", ("server",), ("--records", "200000", "--events", "400000")),
    ReportBench(
        "cluster",
        ("cluster", "--shards", "1,2"),
        ("--records", "200000", "--events", "400000", "--rounds", "1"),
    ),
    ReportBench(
        "checkpoint",
        ("checkpoint",),
        ("--batches", "5", "--batch", "10000", "--rounds", "10", "--pending", "0,10000,100000"),
    ),
    ReportBench("pipeline", ("pipeline",), ("--records", "5000", "--rounds", "1")),
    ReportBench(
        "pipeline-fast",
        ("pipeline", "--fast"),
        ("--records", "100000", "--batch-sizes", "10000,50000", "--rounds", "1"),
    ),
    ReportBench(
        "pipeline-fast-failures",
        ("pipeline", "--fast", "--fail-rate", "0.01", "--batch-sizes", "50000,200000"),
        ("--records", "100000", "--batch-sizes", "50000", "--rounds", "1"),
    ),
)

_AT_MOST = frozenset(
    {
        "reprocessed_per_failed_ftlayer",
        "ftlayer_table_bytes_per_pending_root",
        "server_cpu_us_per_record",
        "lmdb_bytes_per_record",
        "cpu_per_record_ratio",
    }
)
"""Targets that are upper bounds; every other target is a lower bound."""


# ---- 1 and 2: run and save ---------------------------------------------------------------


def run_report(
    out: Path,
    run_bench: Callable[[list[str]], dict[str, Any]],
    quick: bool = False,
    names: Sequence[str] | None = None,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> dict[str, Any]:
    """Run the benches (`names`, default all, in `BENCHES` order) with `run_bench` (the
    CLI's: argv after `ftlayer bench` -> the result), save and render them; returns
    the saved results."""
    from ftlayer.bench import _cpu_times, _steal_percent

    chosen = [b for b in BENCHES if names is None or b.name in names]
    results: dict[str, Any] = {
        "format": RESULTS_FORMAT,
        "generated_at": _now(),
        "quick": quick,
        "machine": machine(),
        "load_average_before": _load_average(),
        "benches": {},
    }
    cpu_before = _cpu_times()
    for i, bench in enumerate(chosen, 1):
        argv = bench.command(quick)
        command = " ".join(["ftlayer", "bench", *argv])
        log(f"ftlayer bench report: ({i}/{len(chosen)}) {command}")
        started = time.monotonic()
        entry: dict[str, Any] = {"command": command}
        try:
            entry["result"] = run_bench(argv)
        except Exception as exc:  # the report records it and runs the other benches
            entry["error"] = f"{type(exc).__name__}: {exc}"
            log(f"ftlayer bench report: {bench.name} failed:\n{traceback.format_exc()}")
        entry["seconds"] = round(time.monotonic() - started, 1)
        results["benches"][bench.name] = entry
    results["load_average_after"] = _load_average()
    results["cpu_steal_percent"] = _steal_percent(cpu_before)
    # Rendered from the saved file, so that `--from` it redraws the very same page.
    saved = load_results(save_results(results, out))
    render(saved, out)
    return saved


def save_results(results: Mapping[str, Any], out: Path) -> Path:
    path = out / "benchmarks" / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return path


def load_results(path: Path) -> dict[str, Any]:
    """A saved results.json, checked for the fields the page needs."""
    from ftlayer.errors import ConfigError, CorruptData

    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read the bench results {path}: {exc}") from None
    try:
        results = json.loads(text)
    except ValueError as exc:  # not JSON, or not UTF-8
        raise CorruptData(f"cannot read the bench results {path}: {exc}") from None
    if not isinstance(results, dict) or results.get("format") != RESULTS_FORMAT:
        raise CorruptData(
            f"{path} is not a results.json of `ftlayer bench report` (format {RESULTS_FORMAT})"
        )
    for key, kind in (("benches", dict), ("machine", dict), ("generated_at", str)):
        if not isinstance(results.get(key), kind):
            raise CorruptData(f"{path}: {key!r} is missing or not a {kind.__name__}")
    return results


def machine() -> dict[str, Any]:
    """What the benches ran on; None where the machine does not tell."""
    memory = None
    with contextlib.suppress(ValueError, OSError, AttributeError):
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        os_name = platform.freedesktop_os_release().get("PRETTY_NAME")
    except OSError:
        os_name = None
    return {
        "cpu_model": _cpu_model(),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_bytes": memory,
        "os": os_name or platform.platform(terse=True),
        "kernel": f"{platform.system()} {platform.release()} {platform.machine()}",
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "spark": _version("pyspark"),
        "java": _java_version(),
        "numpy": _version("numpy"),
        "lmdb": _version("lmdb"),
        "ftlayer": __version__,
        "commit": _commit(),
    }


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _java_version() -> str | None:
    """The first line of `java -version` of the java Spark launches."""
    home = os.environ.get("JAVA_HOME")
    java = os.path.join(home, "bin", "java") if home else shutil.which("java")
    if java is None:
        return None
    try:
        probe = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = (probe.stderr or probe.stdout).splitlines()
    return lines[0].strip() if lines else None


def _commit() -> str | None:
    """The git commit of this checkout, "+ local changes" when it has any; None when
    ftlayer is not run from a git checkout."""
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(here), *args],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != here.parent:  # an installed copy in some repo
        return None
    commit = git("rev-parse", "--short=12", "HEAD")
    if commit is None:
        return None
    changed = git("status", "--porcelain", "--untracked-files=no")
    return f"{commit} + local changes" if changed else commit


# ---- 3: render ---------------------------------------------------------------------------


def render(results: Mapping[str, Any], out: Path) -> Path:
    """Write `<out>/benchmarks.md` and its plots from `results`; returns the page.

    A plot whose figures were not measured is not drawn, and an old PNG of that name is
    removed, so the page never shows figures of another run."""
    from ftlayer import benchplots

    folder = out / "benchmarks"
    folder.mkdir(parents=True, exist_ok=True)
    benches = _results_by_bench(results)
    drawn: set[str] = set()
    for name, plot in benchplots.PLOTS.items():
        figure = plot(benches)
        if figure is None:
            (folder / name).unlink(missing_ok=True)
        else:
            benchplots.save(figure, folder / name)
            drawn.add(name)
    page = out / "benchmarks.md"
    saved = (folder / "results.json").as_posix()
    kept = folder / PROFILE
    profile = kept.read_text(encoding="utf-8") if kept.is_file() else None
    lines = _page(results, benches, drawn, saved, profile)
    page.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return page


def _entries(results: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """The benches' entries in `BENCHES` order (results.json keeps its keys sorted),
    then any other bench's, by name."""
    order = {bench.name: i for i, bench in enumerate(BENCHES)}
    return sorted(results["benches"].items(), key=lambda item: (order.get(item[0], 99), item[0]))


def _results_by_bench(results: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {
        name: entry["result"]
        for name, entry in _entries(results)
        if entry.get("result") is not None
    }


def _page(
    results: Mapping[str, Any],
    benches: Mapping[str, Mapping[str, Any]],
    drawn: set[str],
    saved: str,
    profile: str | None = None,
) -> Iterator[str]:
    sizes = "quick sizes (`--quick`)" if results.get("quick") else "the benches' default sizes"
    yield "# Benchmarks"
    yield ""
    yield (
        f"Generated by `ftlayer bench report` on {results['generated_at']}, at {sizes}. "
        "Do not edit: `ftlayer bench report` runs the benches again and rewrites this page, "
        "its plots and [the raw figures](benchmarks/results.json); `ftlayer bench report "
        f"--from {saved}` redraws them from the raw figures. What each "
        "bench measures, against which baseline, is in "
        "[the architecture](architecture.md#benchmarks)."
    )
    yield ""
    yield (
        "Every bench measures ftlayer and its baseline in the same run, on whatever else "
        "the machine is doing: the ratios, which both sides of one run share, say more "
        "than the absolute rates."
    )
    if results.get("quick"):
        yield ""
        yield (
            "**Quick sizes**: too small for steady figures (start-up costs weigh in); "
            "run `ftlayer bench report` without `--quick` for figures to quote."
        )
    yield from _machine_section(results)
    yield from _targets_section(results, benches)
    yield from _rates_section(benches, drawn)
    yield from _checkpoint_section(benches, drawn)
    yield from _cluster_section(benches)
    yield from _pipeline_section(benches, drawn)
    yield from _latency_section(benches, drawn)
    yield from _figures_section(results)
    yield from _profile_section(profile)


def _machine_section(results: Mapping[str, Any]) -> Iterator[str]:
    found = results["machine"]
    memory = found.get("memory_bytes")
    load = [results.get("load_average_before"), results.get("load_average_after")]
    rows = [
        ("date", results["generated_at"]),
        ("CPU", found.get("cpu_model")),
        ("cores", f"{found.get('cpus')} logical, {found.get('cpus_usable')} usable"),
        ("memory", None if memory is None else f"{memory / 2**30:.1f} GiB"),
        ("OS", found.get("os")),
        ("kernel", found.get("kernel")),
        ("Python", found.get("python")),
        ("Spark (pyspark)", found.get("spark")),
        ("Java", found.get("java")),
        ("numpy, lmdb", f"{found.get('numpy')}, {found.get('lmdb')}"),
        ("ftlayer", f"{found.get('ftlayer')}, commit {found.get('commit') or 'unknown'}"),
        (
            "load average (1, 5, 15 min) before, after",
            "; ".join("-" if x is None else ", ".join(f"{v:g}" for v in x) for x in load),
        ),
        ("CPU steal during the run", _percent(results.get("cpu_steal_percent"))),
    ]
    yield ""
    yield "## The machine"
    yield ""
    yield "| | |"
    yield "|---|---|"
    for name, value in rows:
        yield f"| {name} | {_text(value)} |"
    before = results.get("load_average_before")
    cpus = found.get("cpus_usable") or found.get("cpus")
    if before and cpus and before[0] > 0.5 * cpus:
        yield ""
        yield (
            f"The load average was {before[0]:g} on {cpus} cores when the run began: other "
            "work competed with the benches, and the absolute rates are lower than on a "
            "quiet machine."
        )


@dataclass(frozen=True, slots=True)
class TargetCheck:
    """One target of one bench: the figure, its bound and what was measured."""

    bench: str
    figure: str
    at_most: bool
    target: float
    measured: float | None

    @property
    def met(self) -> bool | None:
        if self.measured is None:
            return None
        return self.measured <= self.target if self.at_most else self.measured >= self.target


def target_checks(name: str, result: Mapping[str, Any]) -> list[TargetCheck]:
    """The targets a bench's result names (`targets`, or `target`) against its figures."""
    targets = result.get("targets") or result.get("target") or {}
    if not isinstance(targets, Mapping):  # a single figure named nothing: no check
        return []
    if name.startswith("pipeline-fast"):
        return _fast_checks(name, result, targets)
    return [
        TargetCheck(name, key, key in _AT_MOST, float(bound), _number(result.get(key)))
        for key, bound in targets.items()
        if _number(bound) is not None
    ]


def _fast_checks(
    name: str, result: Mapping[str, Any], targets: Mapping[str, Any]
) -> list[TargetCheck]:
    """bench pipeline --fast: the ratios at each target batch size, FT off against the
    bare consumer at the largest size measured, and the server's costs per record
    (each where the run's `targets` name it)."""
    rows = result.get("batch_sizes") or {}
    checks = [
        TargetCheck(
            name,
            f"batch_sizes.{size}.{key}",
            False,
            float(targets[key]),
            _number((rows.get(str(size)) or {}).get(key)),
        )
        for size in targets.get("at_batch_sizes", [])
        for key in ("ratio_tree_vs_off", "ratio_barrier_vs_off")
        if key in targets
    ]
    checks += [
        TargetCheck(name, key, True, float(targets[key]), _number(result.get(key)))
        for key in ("server_cpu_us_per_record", "lmdb_bytes_per_record")
        if key in targets
    ]
    if rows:
        largest = max(rows, key=int)
        checks.append(
            TargetCheck(
                name,
                f"batch_sizes.{largest}.ratio_off_vs_consumer",
                False,
                float(targets["ratio_off_vs_consumer_at_largest"]),
                _number(rows[largest].get("ratio_off_vs_consumer")),
            )
        )
    return checks


def _targets_section(
    results: Mapping[str, Any], benches: Mapping[str, Mapping[str, Any]]
) -> Iterator[str]:
    yield ""
    yield "## Targets"
    yield ""
    yield "| bench | figure | target | measured | met |"
    yield "|---|---|---|---|---|"
    for name, entry in _entries(results):
        if name not in benches:
            yield f"| {name} | - | - | failed: {_cell(entry.get('error'))} | **no** |"
            continue
        for check in target_checks(name, benches[name]):
            met = {True: "yes", False: "**no**", None: "not measured"}[check.met]
            bound = "≤" if check.at_most else "≥"
            yield (
                f"| {name} | `{check.figure}` | {bound} {_text(check.target)} | "
                f"{_text(check.measured)} | {met} |"
            )
    verdicts = [
        f"{name}: {'met' if verdict else '**not met**'}"
        for name, result in benches.items()
        if (verdict := result.get("meets_targets", result.get("meets_target"))) is not None
    ]
    if verdicts:
        yield ""
        yield "Each bench's own verdict (`meets_targets`): " + "; ".join(verdicts) + "."
    missing = [b.name for b in BENCHES if b.name not in results["benches"]]
    if missing:
        yield ""
        yield "Not run: " + ", ".join(missing) + "."


def _image(name: str, drawn: set[str], alt: str) -> Iterator[str]:
    if name in drawn:
        yield ""
        yield f"![{alt}](benchmarks/{name})"


def _rates_section(benches: Mapping[str, Mapping[str, Any]], drawn: set[str]) -> Iterator[str]:
    acker, persist, server = (benches.get(n) for n in ("acker", "persist", "server"))
    yield ""
    yield "## XOR and record rates"
    yield from _image("rates.png", drawn, "XOR updates/s and records/s against their baselines")
    rows: list[tuple[str, Any, Any, Any]] = []
    if acker is not None:
        rows += [
            ("XOR updates/s", "AckerTable, in process", acker["updates_per_s"], None),
            ("XOR updates/s", "naive dict loop (baseline)", acker["naive_updates_per_s"], None),
            (
                "bytes per pending root",
                "bare AckerTable",
                acker["memory_bytes_per_pending_root"],
                None,
            ),
            (
                "bytes per pending root",
                "the FT layer's table, its roots replaced once",
                acker["ftlayer_table_bytes_per_pending_root"],
                None,
            ),
            (
                "bytes per pending root",
                "the FT layer's table, just filled",
                acker.get("ftlayer_table_bytes_per_pending_root_filled"),
                None,
            ),
        ]
    if persist is not None:
        sync = "fsync per commit" if persist.get("sync") else "no fsync"
        rows += [
            ("records/s", f"FT layer on LMDB, {sync}", persist["records_per_s"], None),
            (
                "records/s",
                f"raw py-lmdb (baseline), {sync}",
                persist["raw_lmdb_records_per_s"],
                None,
            ),
        ]
    if server is not None:
        rows += [
            (
                "XOR updates/s",
                "server",
                server["xor_updates_per_s"],
                server["without_journal_xor_updates_per_s"],
            ),
            (
                "records/s",
                "server",
                server["records_per_s"],
                server["without_journal_records_per_s"],
            ),
        ]
    if not rows:
        yield ""
        yield "Not measured: the acker, persist and server benches did not run."
        return
    yield ""
    yield "| figure | where | measured | server without its journal |"
    yield "|---|---|---|---|"
    for figure, where, value, plain in rows:
        yield f"| {figure} | {where} | {_text(value)} | {_text(plain)} |"


def _checkpoint_section(benches: Mapping[str, Mapping[str, Any]], drawn: set[str]) -> Iterator[str]:
    checkpoint = benches.get("checkpoint")
    yield ""
    yield "## Checkpoints"
    if checkpoint is None:
        yield ""
        yield "Not measured: the checkpoint bench did not run."
        return
    yield from _image("checkpoint_pending.png", drawn, "checkpoint time against pending roots")
    spread = checkpoint.get("pair_ratios") or {}
    ci = spread.get("geometric_mean_95ci") or [None, None]
    yield ""
    yield (
        f"A job of {checkpoint['batch']:,}-record batches through a real server: "
        f"{_text(checkpoint['records_per_s_with_checkpoints'])} records/s with a checkpoint "
        f"at every batch, {_text(checkpoint['records_per_s_without_checkpoints'])} without; "
        f"ratio {_text(checkpoint['ratio_with_vs_without'])} (pairs' ratios from "
        f"{_text(spread.get('min'))} to {_text(spread.get('max'))}, 95 % interval of their "
        f"geometric mean {' to '.join(_text(x) for x in ci)}; CPU steal "
        f"{_percent(checkpoint.get('cpu_steal_percent'))})."
    )
    columns = (
        ("pending roots", "pending_roots"),
        ("BEGIN round trip ms", "begin_round_trip_ms"),
        ("copy under the lock ms", "copy_under_lock_ms"),
        ("snapshot write ms", "write_ms"),
        ("until complete ms", "until_complete_ms"),
        ("snapshot bytes", "snapshot_bytes"),
        ("bytes per pending root", "bytes_per_pending_root"),
    )
    yield ""
    yield "| " + " | ".join(header for header, _ in columns) + " |"
    yield "|" + "---|" * len(columns)
    for point in checkpoint.get("checkpoint_time_by_pending") or []:
        yield "| " + " | ".join(_text(point.get(key)) for _, key in columns) + " |"


def _cluster_section(benches: Mapping[str, Mapping[str, Any]]) -> Iterator[str]:
    """bench cluster: each shard count's rates and costs, the ratios, what limits them."""
    cluster = benches.get("cluster")
    yield ""
    yield "## Shards"
    if cluster is None:
        yield ""
        yield "Not measured: the cluster bench did not run."
        return
    yield ""
    yield (
        f"An FT layer of {' and '.join(str(n) for n in cluster['shards'])} shards (server "
        f"processes), fed by {cluster['clients']} client processes over loopback, each on "
        f"one partition and so on one shard: {cluster['records']:,} records of "
        f"{cluster['payload_bytes']} bytes persisted and completed, {cluster['events']:,} "
        f"XOR updates, median of {cluster['rounds']} round(s)."
    )
    columns = (
        ("records/s", "records_per_s"),
        ("XOR updates/s", "xor_updates_per_s"),
        ("server CPU s per million records", "server_cpu_s_per_million_records"),
        ("server CPU s per million XOR updates", "server_cpu_s_per_million_xor_updates"),
        ("client CPU s per million records", "client_cpu_s_per_million_records"),
        ("cores busy", "cpu_busy_share"),
        ("machine busy", "machine_busy_share"),
    )
    yield ""
    yield "| shards | " + " | ".join(header for header, _ in columns) + " |"
    yield "|---|" + "---|" * len(columns)
    by_shards = cluster.get("by_shards") or {}
    for count, row in sorted(by_shards.items(), key=lambda item: int(item[0])):
        cells = [
            _share(row.get(key)) if key.endswith("_share") else _text(row.get(key))
            for _, key in columns
        ]
        yield f"| {int(count)} | " + " | ".join(cells) + " |"
    yield ""
    yield (
        f"`ratio` (records/s, most shards over fewest) {_text(cluster.get('ratio'))}, "
        f"`xor_ratio` {_text(cluster.get('xor_ratio'))}, `cpu_per_record_ratio` (server "
        f"CPU per record, most shards over fewest) {_text(cluster.get('cpu_per_record_ratio'))}"
        f"; CPU steal {_percent(cluster.get('cpu_steal_percent'))}."
    )
    if cluster.get("limit"):
        yield ""
        yield f"What limits the ratio: {cluster['limit']}."


def _pipeline_section(benches: Mapping[str, Mapping[str, Any]], drawn: set[str]) -> Iterator[str]:
    pipeline, fast = benches.get("pipeline"), benches.get("pipeline-fast")
    yield ""
    yield "## Pipelines on Spark"
    if pipeline is None and fast is None:
        yield ""
        yield "Not measured: the pipeline benches did not run."
        return
    yield from _image("pipeline_rates.png", drawn, "pipeline records/s per mode")
    yield from _image("ft_ratio_batch.png", drawn, "FT on / FT off against batch size")
    if pipeline is not None:
        yield ""
        yield (
            f"The demo's per-record pipeline, {pipeline['records']:,} records: FT off "
            f"{_text(pipeline['ft_off_records_per_s'])} records/s, tree mode "
            f"{_text(pipeline['ft_on_records_per_s'])} (ratio "
            f"{_text(pipeline['ratio_on_vs_off'])}), barrier mode "
            f"{_text(pipeline['ft_on_barrier_records_per_s'])} (ratio "
            f"{_text(pipeline['ratio_barrier_vs_off'])}). Records processed again per "
            f"failed record: {_text(pipeline['reprocessed_per_failed_ftlayer'])} under "
            f"ftlayer, {_text(pipeline['reprocessed_per_failed_spark'])} under Spark's task "
            "retries."
        )
    if fast is not None:
        yield ""
        yield (
            f"The vectorized pipeline, {fast['records']:,} records; a bare kafka-python "
            f"consumer read them at {_text(fast['consumer_records_per_s'])} records/s."
        )
        yield ""
        yield (
            "| batch size | FT off records/s | tree records/s | barrier records/s | "
            "tree / off | barrier / off | off / consumer | rounds |"
        )
        yield "|---|---|---|---|---|---|---|---|"
        for size, row in sorted(fast.get("batch_sizes", {}).items(), key=lambda x: int(x[0])):
            keys = (
                "ft_off_records_per_s",
                "ft_tree_records_per_s",
                "ft_barrier_records_per_s",
                "ratio_tree_vs_off",
                "ratio_barrier_vs_off",
                "ratio_off_vs_consumer",
                "rounds",
            )
            yield f"| {int(size):,} | " + " | ".join(_text(row.get(k)) for k in keys) + " |"


def _latency_section(benches: Mapping[str, Mapping[str, Any]], drawn: set[str]) -> Iterator[str]:
    from ftlayer.benchplots import latency_runs

    yield ""
    yield "## Complete latency"
    runs = latency_runs(benches)
    if not runs:
        ran = [n for n in ("pipeline", "pipeline-fast") if n in benches]
        yield ""
        yield (
            "Not measured: "
            + (
                "the pipeline benches did not run."
                if not ran
                else "the FT layer's STATUS of this run carries no complete latency."
            )
        )
        return
    yield from _image("complete_latency.png", drawn, "complete latency per run")
    yield ""
    yield (
        "Persist to completion of the trees that completed on their first attempt, per "
        "timed run (the server's histogram: quantiles within its bucket width)."
    )
    yield ""
    yield "| pipeline | batch size | mode | round | trees | mean ms | p50 ms | p99 ms |"
    yield "|---|---|---|---|---|---|---|---|"
    for run in runs:
        kind = "per-record" if run["bench"] == "pipeline" else "vectorized"
        ms = [
            _text(None if run[k] is None else 1000 * run[k]) for k in ("mean_s", "p50_s", "p99_s")
        ]
        yield (
            f"| {kind} | {run['batch_size']:,} | {run['mode']} | {run['round'] + 1} | "
            f"{run['count']:,} | " + " | ".join(ms) + " |"
        )


def _profile_section(profile: str | None) -> Iterator[str]:
    """The hand-kept profile (`<out>/benchmarks/profile.md`), one heading level down."""
    if profile is None:
        return
    yield ""
    for line in profile.strip("\n").splitlines():
        yield f"#{line}" if line.startswith("#") else line


def _figures_section(results: Mapping[str, Any]) -> Iterator[str]:
    yield ""
    yield "## Every figure"
    for name, entry in _entries(results):
        yield ""
        seconds = entry.get("seconds")
        took = "" if seconds is None else f", {seconds:,.0f} s"
        yield f"### {name}: `{entry['command']}`{took}"
        yield ""
        if entry.get("result") is None:
            yield f"Failed: {_cell(entry.get('error'))}"
            continue
        yield "| figure | value |"
        yield "|---|---|"
        for key, value in _flatten(entry["result"]):
            yield f"| `{key}` | {_text(value)} |"


def _flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Scalars and lists of scalars under dotted keys; lists of objects as key[i]."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from _flatten(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, list) and any(isinstance(v, Mapping | list) for v in value):
        for i, item in enumerate(value):
            yield from _flatten(item, f"{prefix}[{i}]")
    else:
        yield prefix, value


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _percent(value: Any) -> str:
    return "-" if value is None else f"{value:g} %"


def _share(value: Any) -> str:
    """A share of 0 to 1 as a percentage."""
    return "-" if value is None else f"{value:.0%}"


def _text(value: Any) -> str:
    """A figure as the page shows it: thousands separated, 4 significant digits below 100."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:,.1f}".removesuffix(".0") if abs(value) >= 100 else f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join(_text(v) for v in value)
    return _cell(value)


def _cell(value: Any) -> str:
    """Text that cannot break a table row."""
    return " ".join(str(value).replace("|", "\\|").splitlines())
