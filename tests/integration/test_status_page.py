"""The status page in a real browser: headless Chromium (selenium over Debian's
chromium and chromium-driver, which `make browser` installs) loads the page of a real
`ftlayer serve --http-port` while a real FTClient drives traffic, and the page must
show STATUS's numbers: the counters, each source's row, the checkpoints, the dead
letters, and a chart drawn from its samples.

Without Chromium the test is skipped, saying how to install it; under CI
(FTLAYER_REQUIRE_BROWSER=1, set by .ci/run) it fails instead. With
FTLAYER_SCREENSHOT=path it saves its screenshot there too (docs/images/status-page.png
is made so).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serverproc import StartServer
from webtraffic import QUERY, drive

from ftlayer.client import FTClient
from ftlayer.integration.receivers import Message, Receiver, ingest_source_id
from ftlayer.status import Status

_CHROMIUM = next(
    (p for name in ("chromium", "chromium-browser") if (p := shutil.which(name))), None
)
_DRIVER = shutil.which("chromedriver")

_READ_PAGE = """
const shown = (node) => [node.textContent, node.dataset.value ?? ""];
const top = {};
for (const node of document.querySelectorAll("[data-field]")) {
  if (!node.closest("table")) top[node.dataset.field] = shown(node);
}
const sources = {};
for (const row of document.querySelectorAll("#sources tbody tr")) {
  const cells = {};
  for (const node of row.querySelectorAll("[data-field]")) cells[node.dataset.field] = shown(node);
  sources[row.dataset.source] = cells;
}
const checkpoints = {};
for (const box of document.querySelectorAll("#checkpoints .query")) {
  checkpoints[box.dataset.query] = Array.from(box.querySelectorAll("tbody tr")).map(
    (row) => [Number(row.dataset.id), row.querySelector('[data-field="state"]').textContent]);
}
const canvas = document.getElementById("chart");
const pixels = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
let green = 0;  // the completed/s line: --completed, #1f9d57
for (let i = 0; i < pixels.length; i += 4) {
  if (Math.abs(pixels[i] - 31) < 12 && Math.abs(pixels[i + 1] - 157) < 12
      && Math.abs(pixels[i + 2] - 87) < 12 && pixels[i + 3] > 200) green += 1;
}
return {
  top, sources, checkpoints, green,
  dead: Array.from(document.querySelectorAll("#dead-letters tbody tr")).map(
    (row) => Number(row.dataset.seq)),
  deadTotal: document.getElementById("dead-shown").dataset.value,
  samples: Number(canvas.dataset.samples),
  live: document.getElementById("live").className,
};
"""


@pytest.fixture
def browser() -> Iterator[Any]:
    if _CHROMIUM is None or _DRIVER is None:
        reason = (
            "headless Chromium is not installed (Debian packages chromium and "
            "chromium-driver): `make browser` installs them"
        )
        if os.environ.get("FTLAYER_REQUIRE_BROWSER") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = _CHROMIUM
    for argument in (
        "--headless=new",
        "--no-sandbox",  # root in a container has no user namespace sandbox
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1280,1000",
        "--force-device-scale-factor=1",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=Service(_DRIVER))
    driver.set_page_load_timeout(60)
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


def _ms(text: str) -> tuple[float, float] | None:
    """A latency as the page shows it ("1.23 ms", "12.4 ms", "2.50 s") in milliseconds,
    with half its last shown digit (the rounding it may carry)."""
    number, _, unit = text.partition(" ")
    scale = 1000.0 if unit == "s" else 1.0
    decimals = len(number.partition(".")[2])
    try:
        return float(number) * scale, 0.5 * 10.0**-decimals * scale + 1e-9
    except ValueError:
        return None


def _number(raw: str) -> float | None:
    try:
        return float(raw)
    except ValueError:
        return None


def _mismatches(status: Status, page: dict[str, Any], client: FTClient) -> list[str]:
    """What the page shows that STATUS does not say (empty: it agrees)."""
    wrong: list[str] = []

    def same(where: str, shown: list[str], value: Any, text: str | None = None) -> None:
        expected = f"{value:,}" if text is None else text
        if shown[0] != expected or shown[1] != str(value):
            wrong.append(f"{where}: the page shows {shown}, STATUS says {value!r}")

    top = page["top"]
    for name in (
        "persisted",
        "completed",
        "pending",
        "replayed",
        "replay_queue",
        "retry_waiting",
        "dead_letters",
        "dead_lettered",
        "stored_records",
        "connections",
        "ingested",
        "ingest_duplicates",
    ):
        same(name, top[name], status[name])
    for cause, n in status.failed.items():
        same(f"failed.{cause}", top[f"failed.{cause}"], n)
    same("failed_total", top["failed_total"], sum(status.failed.values()))
    same("complete_latency.count", top["complete_latency.count"], status.complete_latency.count)
    if top["lmdb_size_bytes"][1] != str(status.lmdb_size_bytes):
        wrong.append(f"lmdb_size_bytes: {top['lmdb_size_bytes']} vs {status.lmdb_size_bytes}")
    for name in ("p50_s", "p99_s"):
        value = getattr(status.complete_latency, name)
        text, raw = top[f"complete_latency.{name}"]
        ms = _ms(text)
        if (
            value is None
            or _number(raw) != value
            or ms is None
            or abs(ms[0] - 1000 * value) > ms[1]
        ):
            wrong.append(f"complete_latency.{name}: the page shows {text!r}, STATUS {value}")

    if set(page["sources"]) != set(status.by_source):
        wrong.append(f"sources: the page shows {sorted(page['sources'])}")
    for source, figures in status.by_source.items():
        row = page["sources"].get(source, {})
        expected = {
            "persisted": figures.persisted,
            "completed": figures.completed,
            "failed": sum(figures.failed.values()),
            "replayed": figures.replayed,
            "dead_lettered": figures.dead_lettered,
            "pending": status.pending_of(int(source)),
            "replay_queue": figures.replay_queue,
        }
        for name, value in expected.items():
            same(f"source {source} {name}", row.get(name, ["?", "?"]), value)
        for name in ("p50_s", "p99_s"):
            value = getattr(figures.complete_latency, name)
            raw = row.get(name, ["?", "?"])[1]
            if value is None or _number(raw) != value:
                wrong.append(f"source {source} {name}: {row.get(name)} vs {value}")

    checkpoints = status.checkpoints[QUERY]
    expected_rows = [[c.id, c.state] for c in (*checkpoints.recent[-10:], *checkpoints.open)]
    if page["checkpoints"].get(QUERY) != expected_rows:
        wrong.append(f"checkpoints: {page['checkpoints']} vs {expected_rows}")

    listed = client.dead_letters(limit=50)
    if page["dead"] != [letter["seq"] for letter in listed.letters]:
        wrong.append(f"dead letters: the page lists {page['dead']}")
    if page["deadTotal"] != str(status.dead_letters):
        wrong.append(f"dead letters: the page counts {page['deadTotal']}")
    return wrong


def test_the_status_page_shows_what_status_says(
    start_server: StartServer, browser: Any, tmp_path: Path
) -> None:
    server = start_server(None, "--http-port", "0", "--tree-timeout-s", "300")
    assert server.http_url is not None
    with server.client() as client:
        drive(client, rounds=8, pause_s=1.0, ramp=True)
        browser.get(server.http_url)
        assert browser.title == "ftlayer status"
        deadline = time.monotonic() + 60.0
        while True:
            before = client.status()
            page = browser.execute_script(_READ_PAGE)
            after = client.status()
            # Clocks, not counters; and the requests, which these STATUS requests count.
            moving = [
                k
                for k in before
                if k not in ("uptime_s", "batches_running", "requests") and before[k] != after[k]
            ]
            wrong = [f"STATUS moved: {moving}"] if moving else _mismatches(after, page, client)
            if page["live"] != "live ok":
                wrong.append(f"the page is not live: {page['live']}")
            if not wrong:
                break
            assert time.monotonic() < deadline, "\n".join(wrong)
            time.sleep(0.5)

    # The chart: the samples of the traffic (one a second), and the completed/s line.
    assert page["samples"] >= 8
    assert page["green"] > 200, page["green"]
    assert after.dead_letters > 0 and len(page["dead"]) == after.dead_letters

    # The page down to the first dead letters, for the docs.
    height = browser.execute_script("return document.documentElement.scrollHeight")
    browser.set_window_size(1280, min(int(height) + 40, 1700))
    polls = int(browser.execute_script("return document.body.dataset.polls"))
    deadline = time.monotonic() + 30.0
    while int(browser.execute_script("return document.body.dataset.polls")) < polls + 2:
        assert time.monotonic() < deadline, "the page stopped polling"
        time.sleep(0.2)
    shot = tmp_path / "status-page.png"
    assert browser.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    target = os.environ.get("FTLAYER_SCREENSHOT")
    if target:
        shutil.copyfile(shot, target)


def test_a_protected_page_works_from_a_url_with_the_token(
    start_server: StartServer, browser: Any, tmp_path: Path
) -> None:
    """With --token-file, the page opened as http://user:TOKEN@host:port/ (how a
    headless browser or a script passes basic auth) loads, and so do its own requests:
    it goes live and shows STATUS's numbers."""
    token = "s3cret-page-token"
    (tmp_path / "token").write_text(token + "\n")
    server = start_server(None, "--http-port", "0", "--token-file", str(tmp_path / "token"))
    assert server.http_url is not None and server.http_url.startswith("http://")
    with FTClient(server.address, token=token.encode()) as client:
        drive(client, rounds=2, pause_s=0.2)
        browser.get(server.http_url.replace("http://", f"http://ftlayer:{token}@", 1))
        assert browser.title == "ftlayer status"
        deadline = time.monotonic() + 30.0
        while True:
            page = browser.execute_script(_READ_PAGE)
            status = client.status()
            wrong = _mismatches(status, page, client)
            if page["live"] != "live ok":
                live = browser.find_element("id", "live").text
                wrong.append(f"the page is not live: {page['live']}: {live}")
            if not wrong:
                break
            assert time.monotonic() < deadline, "\n".join(wrong)
            time.sleep(0.5)
        polls = int(browser.execute_script("return document.body.dataset.polls"))
        deadline = time.monotonic() + 10.0
        while int(browser.execute_script("return document.body.dataset.polls")) < polls + 2:
            assert time.monotonic() < deadline, "the page stopped polling"
            time.sleep(0.2)


_READ_SHARDS = """
const nav = document.getElementById("shards");
return {
  hidden: nav.hidden,
  shard: nav.dataset.shard ?? null,
  text: nav.textContent,
  links: Array.from(nav.querySelectorAll("a")).map((a) => [a.dataset.shard, a.href]),
  here: Array.from(nav.querySelectorAll(".here")).map((s) => s.dataset.shard),
};
"""


def _shards_shown(browser: Any, shard: str) -> dict[str, Any]:
    """What the page's shard bar shows, once it shows shard `shard`'s place."""
    deadline = time.monotonic() + 30.0
    while True:
        shown: dict[str, Any] = browser.execute_script(_READ_SHARDS)
        if shown["shard"] == shard:
            return shown
        assert time.monotonic() < deadline, f"the page never showed its shard: {shown}"
        time.sleep(0.2)


def test_each_shards_page_links_the_others(
    start_server: StartServer, browser: Any, tmp_path: Path
) -> None:
    """Two shards, each with its status page: opened with ?shards= and both pages (in
    shard order), a page names its place and links the other shard's page, which links
    back; opened without, it names its place and says how to link the others."""
    shards = [
        start_server(tmp_path / f"shard{i}", "--http-port", "0", "--shard", str(i), "--shards", "2")
        for i in (0, 1)
    ]
    urls = [s.http_url for s in shards]
    assert None not in urls
    pages = ",".join(str(u) for u in urls)

    browser.get(f"{urls[1]}?shards={pages}")
    shown = _shards_shown(browser, "1")
    assert not shown["hidden"] and shown["text"].startswith("shard 1 of 2")
    assert shown["here"] == ["1"] and [s for s, _ in shown["links"]] == ["0"]
    link = shown["links"][0][1]
    assert link.startswith(str(urls[0])) and "shards=" in link

    browser.get(link)  # shard 0's page, which links shard 1's
    shown = _shards_shown(browser, "0")
    assert shown["text"].startswith("shard 0 of 2") and shown["here"] == ["0"]
    assert [s for s, _ in shown["links"]] == ["1"]
    assert shown["links"][0][1].startswith(str(urls[1]))

    browser.get(str(urls[0]))  # without the list: its place, and how to link the others
    shown = _shards_shown(browser, "0")
    assert shown["links"] == [] and "open this page with ?shards=" in shown["text"]


def test_the_page_names_the_sources_receivers_registered_and_counts_what_they_stored(
    start_server: StartServer, browser: Any
) -> None:
    server = start_server(None, "--http-port", "0")
    assert server.http_url is not None
    with Receiver(server.address, "orders", partitions=2) as receiver:
        receiver.store([Message(b"k%d" % i, b"v", identity=i) for i in range(5)], "http:orders")
        receiver.store([Message(b"k%d" % i, b"v", identity=i) for i in range(3, 8)], "http:orders")
    source = str(ingest_source_id("orders"))
    browser.get(server.http_url)
    deadline = time.monotonic() + 30.0
    while True:
        page = browser.execute_script(_READ_PAGE)
        shown = (page["top"].get("ingested"), page["top"].get("ingest_duplicates"))
        name = page["sources"].get(source, {}).get("name")
        if shown == (["8", "8"], ["2", "2"]) and name == [f"orders ({source})", "orders"]:
            break
        assert time.monotonic() < deadline, (shown, name)
        time.sleep(0.2)
