"""The plots of `ftlayer bench report` (ftlayer.benchreport), drawn from the benches'
results with matplotlib on its Agg backend (no display needed), saved as PNG.

Each `plot_*` function takes the report's `benches` (bench name -> that bench's result
dict, as `ftlayer bench NAME --json` prints it; absent or failed benches are missing)
and returns a figure, or None when the figures it draws were not measured. PNGs carry
no creation date or software version, so an unchanged plot is an unchanged file.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["PLOTS", "save"]

Results = Mapping[str, Mapping[str, Any]]

_MODES = ("off", "tree", "barrier")
_COLOURS = {"off": "#7f7f7f", "tree": "#1f77b4", "barrier": "#ff7f0e", "baseline": "#bcbd22"}
_TARGET = {"color": "#d62728", "linestyle": "--", "linewidth": 1}


def _log_y(axes: Any) -> None:
    """A log y axis labelled with plain numbers (2,000, not 2 x 10^3); when it spans less
    than two decades, the 2s and 5s between the powers of ten are labelled too."""
    from matplotlib.ticker import FuncFormatter

    def plain(x: float) -> str:
        return f"{x:,.0f}" if x >= 1 else f"{x:.2g}"

    def minor(x: float, _pos: int) -> str:
        low, high = axes.get_ylim()
        leading = round(x / 10 ** math.floor(math.log10(x)))
        return plain(x) if high / low < 100 and leading in (2, 5) else ""

    axes.set_yscale("log")
    axes.yaxis.set_major_formatter(FuncFormatter(lambda x, _pos: plain(x)))
    axes.yaxis.set_minor_formatter(FuncFormatter(minor))


def _figure(columns: int = 1) -> tuple[Figure, Any]:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(5.5 * columns, 4.2), layout="constrained")
    return figure, figure.subplots(1, columns, squeeze=False)[0]


def _bars(
    axes: Any,
    title: str,
    unit: str,
    bars: list[tuple[str, float, float | None, str]],
) -> None:
    """Labelled bars (label, value, target or None, colour) from zero, with each bar's
    target as a dashed line across it."""
    labels = [b[0] for b in bars]
    axes.bar(labels, [b[1] for b in bars], color=[b[3] for b in bars])
    for i, (_, value, target, _) in enumerate(bars):
        axes.annotate(
            f"{value:,.0f}",
            (i, value),
            ha="center",
            va="bottom",
            fontsize=7,
            xytext=(0, 2),
            textcoords="offset points",
        )
        if target is not None:
            axes.hlines(target, i - 0.45, i + 0.45, **_TARGET)
    axes.set_ylim(bottom=0)
    axes.yaxis.set_major_formatter("{x:,.0f}")
    axes.set_title(title, fontsize=10)
    axes.set_ylabel(unit)
    axes.tick_params(axis="x", labelrotation=30, labelsize=8)
    for tick in axes.get_xticklabels():
        tick.set_horizontalalignment("right")


def plot_rates(benches: Results) -> Figure | None:
    """XOR updates/s and records/s: in process (acker, persist) and through the server,
    with and without its journal, against their baselines; targets dashed."""
    acker, persist, server = (benches.get(name) for name in ("acker", "persist", "server"))
    xor: list[tuple[str, float, float | None, str]] = []
    records: list[tuple[str, float, float | None, str]] = []
    if acker is not None:
        target = acker["targets"]["updates_per_s"]
        xor += [
            ("AckerTable", acker["updates_per_s"], target, _COLOURS["tree"]),
            ("naive dict loop", acker["naive_updates_per_s"], None, _COLOURS["baseline"]),
        ]
    if persist is not None:
        target = persist["targets"]["records_per_s"]
        records += [
            ("FT layer on LMDB", persist["records_per_s"], target, _COLOURS["tree"]),
            ("raw py-lmdb", persist["raw_lmdb_records_per_s"], None, _COLOURS["baseline"]),
        ]
    if server is not None:
        xor_target = server["targets"]["xor_updates_per_s"]
        record_target = server["targets"]["records_per_s"]
        xor += [
            ("server", server["xor_updates_per_s"], xor_target, _COLOURS["barrier"]),
            ("server, no journal", server["without_journal_xor_updates_per_s"], None, "#ffbb78"),
        ]
        records += [
            ("server", server["records_per_s"], record_target, _COLOURS["barrier"]),
            ("server, no journal", server["without_journal_records_per_s"], None, "#ffbb78"),
        ]
    if not xor and not records:
        return None
    figure, (left, right) = _figure(2)
    if xor:
        _bars(left, "XOR updates/s (acker, server)", "updates/s", xor)
    if records:
        _bars(right, "records/s persisted and completed (persist, server)", "records/s", records)
    figure.suptitle("XOR and record rates; dashed: target", fontsize=11)
    return figure


def plot_checkpoint_pending(benches: Results) -> Figure | None:
    """Checkpoint times and snapshot size against the number of pending roots (one
    step per count measured, log scales: the default counts are decades)."""
    checkpoint = benches.get("checkpoint")
    points = [] if checkpoint is None else checkpoint.get("checkpoint_time_by_pending") or []
    if not points:
        return None
    steps = range(len(points))
    figure, (times, sizes) = _figure(2)
    for key, label in (
        ("until_complete_ms", "BEGIN until complete"),
        ("begin_round_trip_ms", "BEGIN round trip"),
        ("write_ms", "snapshot write"),
        ("copy_under_lock_ms", "copy under the lock"),
    ):
        times.plot(steps, [p[key] for p in points], marker="o", label=label)
    times.set_title("checkpoint time (median of 5)", fontsize=10)
    times.set_ylabel("ms")
    times.legend(fontsize=8)
    sizes.plot(steps, [p["snapshot_bytes"] for p in points], marker="o")
    sizes.set_title("snapshot size", fontsize=10)
    sizes.set_ylabel("bytes")
    for axes in (times, sizes):
        _log_y(axes)
        axes.set_xticks(steps, [f"{p['pending_roots']:,}" for p in points])
        axes.set_xlabel("pending roots")
        axes.grid(True, which="major", alpha=0.3)
    figure.suptitle("checkpoint cost against pending roots", fontsize=11)
    return figure


def _fast_sizes(fast: Mapping[str, Any]) -> list[tuple[int, Mapping[str, Any]]]:
    """bench pipeline --fast's rows by batch size, in numeric order (JSON keys are text)."""
    return sorted((int(size), row) for size, row in fast["batch_sizes"].items())


def plot_ft_ratio(benches: Results) -> Figure | None:
    """FT on / FT off against batch size (bench pipeline --fast), targets dashed."""
    fast = benches.get("pipeline-fast")
    if fast is None or not fast.get("batch_sizes"):
        return None
    rows = _fast_sizes(fast)
    sizes = [size for size, _ in rows]
    figure, (axes,) = _figure()
    targets = fast["targets"]
    for mode, key in (("tree", "ratio_tree_vs_off"), ("barrier", "ratio_barrier_vs_off")):
        axes.plot(
            sizes,
            [row[key] for _, row in rows],
            marker="o",
            color=_COLOURS[mode],
            label=f"FT on, {mode} mode / FT off",
        )
        axes.axhline(targets[key], color=_COLOURS[mode], linestyle="--", linewidth=1)
    axes.plot(
        sizes,
        [row["ratio_off_vs_consumer"] for _, row in rows],
        marker="s",
        color=_COLOURS["baseline"],
        label="FT off / bare consumer",
    )
    consumer_target = targets["ratio_off_vs_consumer_at_largest"]
    axes.axhline(consumer_target, color=_COLOURS["baseline"], linestyle="--", linewidth=1)
    axes.axhline(1.0, color="black", linewidth=0.5)
    axes.set_xscale("log")
    axes.set_xticks(sizes, [f"{s:,}" for s in sizes])
    axes.minorticks_off()
    axes.set_xlabel("batch size (maxOffsetsPerTrigger)")
    axes.set_ylabel("records/s ratio")
    axes.legend(fontsize=8)
    axes.grid(True, alpha=0.3)
    axes.set_title(
        "FT on / FT off against batch size (vectorized pipeline); dashed: target", fontsize=10
    )
    return figure


def plot_pipeline_rates(benches: Results) -> Figure | None:
    """Records/s per mode: the per-record pipeline, and the vectorized one per batch size
    with the bare consumer."""
    pipeline, fast = benches.get("pipeline"), benches.get("pipeline-fast")
    if pipeline is None and (fast is None or not fast.get("batch_sizes")):
        return None
    figure, (left, right) = _figure(2)
    if pipeline is not None:
        keys = ("ft_off_records_per_s", "ft_on_records_per_s", "ft_on_barrier_records_per_s")
        values = [pipeline[key] for key in keys]
        left.bar(list(_MODES), values, color=[_COLOURS[m] for m in _MODES])
        for i, value in enumerate(values):
            left.annotate(f"{value:,}", (i, value), ha="center", va="bottom", fontsize=8)
        left.set_title(f"per-record pipeline, {pipeline['records']:,} records", fontsize=10)
        left.set_ylabel("records/s")
        left.yaxis.set_major_formatter("{x:,.0f}")
    if fast is not None and fast.get("batch_sizes"):
        rows = _fast_sizes(fast)
        width = 0.8 / len(_MODES)
        for j, mode in enumerate(_MODES):
            right.bar(
                [i + (j - 1) * width for i in range(len(rows))],
                [row[f"ft_{mode}_records_per_s"] for _, row in rows],
                width,
                color=_COLOURS[mode],
                label=f"FT {mode}" if mode == "off" else mode,
            )
        right.axhline(
            fast["consumer_records_per_s"],
            color=_COLOURS["baseline"],
            linestyle=":",
            label="bare consumer",
        )
        right.set_xticks(range(len(rows)), [f"{size:,}" for size, _ in rows])
        right.set_xlabel("batch size (maxOffsetsPerTrigger)")
        right.set_ylabel("records/s")
        right.yaxis.set_major_formatter("{x:,.0f}")
        right.set_title(f"vectorized pipeline, {fast['records']:,} records", fontsize=10)
        right.legend(fontsize=8)
    figure.suptitle("pipeline records/s per mode (median of the rounds)", fontsize=11)
    return figure


def latency_runs(benches: Results) -> list[dict[str, Any]]:
    """Every measured run's complete latency, with the bench it came from; [] when no
    bench measured it (its server's STATUS has no complete latency)."""
    found: list[dict[str, Any]] = []
    for name in ("pipeline", "pipeline-fast"):
        latency = (benches.get(name) or {}).get("complete_latency")
        for run in [] if latency is None else latency["runs"]:
            if run["count"]:
                found.append({"bench": name, **run})
    return found


def plot_complete_latency(benches: Results) -> Figure | None:
    """Per timed run, its complete latency: p50 to p99 as a bar, the mean as a cross."""
    from matplotlib.lines import Line2D

    runs = latency_runs(benches)
    if not runs:
        return None
    runs.sort(key=lambda r: (r["bench"], r["batch_size"], r["mode"] != "tree", r["round"]))
    figure, (axes,) = _figure()
    figure.set_figwidth(max(5.5, 0.45 * len(runs) + 3.5))
    for i, run in enumerate(runs):
        colour = _COLOURS.get(run["mode"], "black")
        axes.vlines(i, run["p50_s"] * 1000, run["p99_s"] * 1000, color=colour, linewidth=6)
        axes.plot([i], [run["mean_s"] * 1000], marker="x", color="black")
    labels = [
        f"{'per-record' if r['bench'] == 'pipeline' else 'vectorized'} {r['batch_size']:,}\n"
        f"{r['mode']} r{r['round'] + 1}"
        for r in runs
    ]
    axes.set_xticks(range(len(runs)), labels, fontsize=7, rotation=90)
    _log_y(axes)
    axes.set_ylabel("ms")
    axes.legend(
        handles=[
            Line2D([], [], color=_COLOURS["tree"], linewidth=6, label="tree: p50 to p99"),
            Line2D([], [], color=_COLOURS["barrier"], linewidth=6, label="barrier: p50 to p99"),
            Line2D([], [], color="black", marker="x", linestyle="", label="mean"),
        ],
        fontsize=8,
        loc="upper left",
        bbox_to_anchor=(1.01, 1),
    )
    axes.set_title("complete latency (persist to completion) per run", fontsize=10)
    axes.grid(True, axis="y", alpha=0.3)
    return figure


PLOTS: dict[str, Callable[[Results], Figure | None]] = {
    "rates.png": plot_rates,
    "checkpoint_pending.png": plot_checkpoint_pending,
    "ft_ratio_batch.png": plot_ft_ratio,
    "pipeline_rates.png": plot_pipeline_rates,
    "complete_latency.png": plot_complete_latency,
}
"""Every plot of the report, by its file name."""


def save(figure: Figure, path: Path) -> None:
    """The figure as a PNG without its metadata (no date, no software version)."""
    figure.savefig(path, format="png", dpi=110, metadata={"Software": None})
