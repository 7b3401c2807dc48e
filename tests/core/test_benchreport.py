"""`ftlayer bench report`: the page names every figure and target, its plots are real
PNGs, what was not measured is said (never drawn from an old run), a failed bench is
reported, and the page is redrawn from its saved results without running a bench."""

from __future__ import annotations

import json
import re
import string
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from bench_results import results
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftlayer import benchreport
from ftlayer.benchplots import PLOTS
from ftlayer.cli import main
from ftlayer.errors import CorruptData

_PNG = b"\x89PNG\r\n\x1a\n"


def _images(page: str) -> list[str]:
    return re.findall(r"!\[[^\]]*\]\((benchmarks/[^)]+\.png)\)", page)


def _assert_real_png(path: Path) -> None:
    """A PNG that decodes, of plot size, with something drawn on it."""
    from matplotlib import image

    assert path.read_bytes().startswith(_PNG), f"{path} is not a PNG"
    pixels = image.imread(path)
    height, width = pixels.shape[:2]
    assert height >= 300 and width >= 500, f"{path}: {width}x{height}"
    assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 10, f"{path} is blank"


def test_the_page_names_every_figure_and_target_and_links_real_plots(tmp_path: Path) -> None:
    given_results = results()
    page_path = benchreport.render(given_results, tmp_path)
    page = page_path.read_text(encoding="utf-8")

    linked = _images(page)
    assert sorted(linked) == sorted(f"benchmarks/{name}" for name in PLOTS)
    for link in linked:
        _assert_real_png(tmp_path / link)

    for name, entry in given_results["benches"].items():
        assert f"### {name}: `{entry['command']}`" in page
        for key, value in benchreport._flatten(entry["result"]):
            assert f"| `{key}` | {benchreport._text(value)} |" in page, key

    for row in (
        "| acker | `updates_per_s` | ≥ 3,000,000 | 16,742,086 | yes |",
        "| acker | `ftlayer_table_bytes_per_pending_root` | ≤ 64 | 58.7 | yes |",
        "| persist | `ratio_vs_raw_lmdb` | ≥ 0.5 | 0.367 | **no** |",
        "| pipeline | `reprocessed_per_failed_ftlayer` | ≤ 1.05 | 1 | yes |",
        "| checkpoint | `ratio_with_vs_without` | ≥ 0.95 | 1.37 | yes |",
        "| pipeline-fast | `batch_sizes.50000.ratio_tree_vs_off` | ≥ 0.9 | 0.91 | yes |",
        "| pipeline-fast | `batch_sizes.200000.ratio_off_vs_consumer` | ≥ 0.8 | 0.854 | yes |",
    ):
        assert row in page
    for row in (
        "| CPU | AMD EPYC |",
        "| cores | 2 logical, 2 usable |",
        "| OS | Debian GNU/Linux 12 (bookworm) |",
        "| Python | CPython 3.11.7 |",
        "| Spark (pyspark) | 4.3.0 |",
        '| Java | openjdk version "17.0.15" 2025-04-15 |',
        "| date | 2026-11-25 19:06:18 UTC |",
    ):
        assert row in page
    # the batch sizes in numeric order, though JSON keys sort as text
    table = page[page.index("| batch size | FT off") :].split("\n\n")[0]
    sizes = re.findall(r"^\| ([\d,]+) \|", table, flags=re.MULTILINE)
    assert sizes == ["10,000", "50,000", "200,000"]
    assert "| vectorized | 200,000 | barrier | 1 | 900 | 1,260 | 900 | 3,600 |" in page


def test_what_was_not_measured_is_said_and_an_old_plot_removed(tmp_path: Path) -> None:
    old = results()
    benchreport.render(old, tmp_path)
    assert (tmp_path / "benchmarks" / "complete_latency.png").exists()

    # A server whose STATUS has no complete latency; no checkpoint bench.
    new = results()
    for name in ("pipeline", "pipeline-fast"):
        new["benches"][name]["result"]["complete_latency"] = None
    del new["benches"]["checkpoint"]
    page = benchreport.render(new, tmp_path).read_text(encoding="utf-8")

    assert "Not measured: the FT layer's STATUS of this run carries no complete latency." in page
    assert "Not measured: the checkpoint bench did not run." in page
    assert "Not run: checkpoint." in page
    assert "complete_latency.png" not in page and "checkpoint_pending.png" not in page
    assert not (tmp_path / "benchmarks" / "complete_latency.png").exists()
    assert not (tmp_path / "benchmarks" / "checkpoint_pending.png").exists()
    assert sorted(p.name for p in (tmp_path / "benchmarks").glob("*.png")) == sorted(
        link.removeprefix("benchmarks/") for link in _images(page)
    )


def test_a_failed_bench_is_reported_and_the_others_still_run(tmp_path: Path) -> None:
    hand = results()["benches"]
    ran: list[list[str]] = []

    def run_bench(argv: list[str]) -> dict[str, Any]:
        ran.append(argv)
        if argv[0] == "server":
            raise RuntimeError("the server bench lost 3 records")
        result: dict[str, Any] = hand[argv[0]]["result"]
        return result

    saved = benchreport.run_report(
        tmp_path, run_bench, quick=True, names=["acker", "server", "persist"], log=lambda _: None
    )
    assert [argv[0] for argv in ran] == ["acker", "persist", "server"]  # BENCHES' order
    assert ran[0] == ["acker", "--roots", "200000"]
    assert saved["benches"]["server"]["error"] == "RuntimeError: the server bench lost 3 records"
    on_disk = json.loads((tmp_path / "benchmarks" / "results.json").read_text(encoding="utf-8"))
    assert on_disk == saved
    page = (tmp_path / "benchmarks.md").read_text(encoding="utf-8")
    assert (
        "| server | - | - | failed: RuntimeError: the server bench lost 3 records | **no** |"
        in (page)
    )
    assert "| acker | `updates_per_s` | ≥ 3,000,000 | 16,742,086 | yes |" in page
    assert "Not run: cluster, checkpoint, pipeline, pipeline-fast, pipeline-fast-failures." in page


def test_the_cluster_bench_has_its_section_and_its_targets(tmp_path: Path) -> None:
    """Records/s and XOR updates/s per shard count, the servers' CPU per million
    records, both ratios against their targets, and what limits the ratio."""
    page = benchreport.render(results(), tmp_path).read_text(encoding="utf-8")
    section = page[page.index("## Shards") : page.index("## Pipelines on Spark")]
    assert "An FT layer of 1 and 2 shards (server processes), fed by 4 client processes" in (
        section
    )
    assert "200,000 records of 100 bytes persisted and completed, 400,000 XOR updates" in section
    assert "| shards | records/s | XOR updates/s | server CPU s per million records |" in section
    assert "| 1 | 301,200 | 2,100,400 | 2.41 | 0.52 | 2.9 | 71% | 83% |" in section
    assert "| 2 | 355,400 | 2,522,000 | 2.63 | 0.55 | 3.1 | 93% | 97% |" in section
    assert "`ratio` (records/s, most shards over fewest) 1.18" in section
    assert "`cpu_per_record_ratio` (server CPU per record, most shards over fewest) 1.091" in (
        section
    )
    assert "What limits the ratio: the cores: 2 cores shared by 4 client processes" in section
    assert "| cluster | `ratio` | ≥ 1.3 | 1.18 | **no** |" in page
    assert "| cluster | `cpu_per_record_ratio` | ≤ 1.15 | 1.091 | yes |" in page
    assert "Each bench's own verdict (`meets_targets`): " in page and "cluster: **not met**" in page

    without = results()
    del without["benches"]["cluster"]
    page = benchreport.render(without, tmp_path).read_text(encoding="utf-8")
    assert "## Shards\n\nNot measured: the cluster bench did not run." in page
    assert "Not run: cluster." in page


_KEYS = st.text(string.ascii_lowercase + "_", min_size=1, max_size=12)
_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**12), 10**12),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.text(max_size=20),
)
_VALUES = st.recursive(
    _LEAVES,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_KEYS, inner, max_size=4),
    max_leaves=12,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(figures=st.dictionaries(_KEYS, _VALUES, min_size=1, max_size=6))
def test_a_bench_added_later_gets_every_figure_in_the_tables(
    tmp_path: Path, figures: dict[str, Any]
) -> None:
    given_results = results()
    given_results["benches"] = {"later": {"command": "ftlayer bench later", "result": figures}}
    page = benchreport.render(given_results, tmp_path).read_text(encoding="utf-8")
    for key, value in benchreport._flatten(figures):
        row = f"| `{key}` | {benchreport._text(value)} |"
        assert row in page
        assert len(row.splitlines()) == 1 and len(re.findall(r"(?<!\\)\|", row)) == 3


def test_report_from_saved_results_redraws_the_same_page(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Real benches (no Spark, quick sizes), through the command line.
    assert (
        main(["bench", "report", "--benches", "acker,persist", "--quick", "--out", str(tmp_path)])
        == 0
    )
    folder = tmp_path / "benchmarks"
    saved = json.loads((folder / "results.json").read_text(encoding="utf-8"))
    assert list(saved["benches"]) == ["acker", "persist"]
    acker = saved["benches"]["acker"]["result"]
    assert acker["roots"] == 200_000 and acker["updates_per_s"] > 0
    assert saved["machine"]["cpus"] and saved["machine"]["python"]
    before = {p.name: p.read_bytes() for p in [tmp_path / "benchmarks.md", *folder.iterdir()]}
    assert "rates.png" in before
    page = before["benchmarks.md"].decode()
    assert f"| `updates_per_s` | {benchreport._text(acker['updates_per_s'])} |" in page

    for path in [tmp_path / "benchmarks.md", *folder.glob("*.png")]:
        path.unlink()
    capsys.readouterr()
    assert (
        main(["bench", "report", "--from", str(folder / "results.json"), "--out", str(tmp_path)])
        == 0
    )
    after = {p.name: p.read_bytes() for p in [tmp_path / "benchmarks.md", *folder.iterdir()]}
    assert after == before
    assert f"wrote {tmp_path / 'benchmarks.md'}" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--from", "x.json", "--quick"], "--from renders saved results"),
        (["--benches", "acker,nope"], "--benches takes some of acker,persist,server"),
        (["--from", "/nonexistent/results.json"], "cannot read the bench results"),
    ],
)
def test_bad_report_arguments_are_clear_errors(
    argv: list[str], error: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "report", *argv, "--out", str(tmp_path)]) == 2
    assert error in capsys.readouterr().err
    assert not (tmp_path / "benchmarks.md").exists()


def test_results_of_another_tool_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"bench": "acker"}), encoding="utf-8")
    with pytest.raises(CorruptData, match=r"not a results\.json of `ftlayer bench report`"):
        benchreport.load_results(path)


def test_the_hand_kept_profile_ends_the_page_one_heading_down(tmp_path: Path) -> None:
    assert "Measured by hand" not in benchreport.render(results(), tmp_path).read_text("utf-8")
    (tmp_path / "benchmarks" / benchreport.PROFILE).write_text(
        "# Where FT on spends its time\n\nMeasured by hand.\n\n## A part\n\n| a | 1 |\n",
        encoding="utf-8",
    )
    page = benchreport.render(results(), tmp_path).read_text(encoding="utf-8")
    assert page.endswith(
        "## Where FT on spends its time\n\nMeasured by hand.\n\n### A part\n\n| a | 1 |\n"
    )


def test_the_report_help_names_every_bench_it_runs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "report", "--help"])
    help_text = "".join(capsys.readouterr().out.split())  # argparse wraps the lines
    assert ",".join(b.name for b in benchreport.BENCHES) in help_text
