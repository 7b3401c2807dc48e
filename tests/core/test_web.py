"""WebServer's own rules, without an FT layer behind it: who is let in, which paths
exist, and what a bad query gets."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import pytest

from ftlayer.core.meters import LatencyHistogram
from ftlayer.web import DeadLetterRows, Observation, WebServer
from ftlayer.web.http import SAMPLE_FIELDS

_STATUS: dict[str, Any] = {
    "persisted": 3,
    "completed": 2,
    "pending": 1,
    "failed": {"explicit": 1, "timeout": 0, "recovery": 0, "source-expired": 0},
    "replayed": 1,
    "dead_lettered": 0,
    "replay_queue": 1,
    "retry_waiting": 0,
}


@pytest.fixture
def web() -> Iterator[WebServer]:
    server = WebServer(
        "127.0.0.1",
        0,
        observe=lambda: Observation(_STATUS, {"7": LatencyHistogram()}),
        dead_letters=lambda limit: DeadLetterRows([], 0),
        token=b"s3cret",
    )
    yield server
    server.stop()


def _basic(user_and_password: bytes) -> str:
    return "Basic " + base64.b64encode(user_and_password).decode()


@pytest.mark.parametrize(
    ("header", "allowed"),
    [
        (None, False),
        ("", False),
        ("Bearer s3cret", True),
        ("bearer   s3cret  ", True),
        ("Bearer s3cre", False),
        ("Bearer s3cret2", False),
        (_basic(b"anyone:s3cret"), True),
        (_basic(b":s3cret"), True),
        (_basic(b"s3cret"), False),  # no colon: no password
        (_basic(b"anyone:wrong"), False),
        ("Basic !!!not-base64", False),
        ("Token s3cret", False),
        ("s3cret", False),
    ],
)
def test_only_the_token_lets_a_request_in(
    web: WebServer, header: str | None, allowed: bool
) -> None:
    assert web.authorized(header) is allowed


def test_without_a_token_every_request_is_let_in() -> None:
    open_web = WebServer(
        "127.0.0.1",
        0,
        observe=lambda: Observation(_STATUS, {}),
        dead_letters=lambda limit: DeadLetterRows([], 0),
    )
    try:
        assert open_web.authorized(None) and open_web.url.startswith("http://127.0.0.1:")
    finally:
        open_web.stop()


@pytest.mark.parametrize(
    "path",
    ["/nothing", "/static/../http.py", "/static/", "/static/app.js.map", "/metrics/x", "//"],
)
def test_paths_outside_the_routes_are_not_found(web: WebServer, path: str) -> None:
    assert web.respond(path, None)[0] == 404


def test_the_page_and_its_files_are_served_from_the_package(web: WebServer) -> None:
    for path, kind, marker in (
        ("/", "text/html", b'<canvas id="chart"'),
        ("/index.html?x=1", "text/html", b"/static/app.js"),
        ("/static/app.js", "text/javascript", b"/api/status"),
        ("/static/style.css", "text/css", b"--completed"),
    ):
        status, content_type, body = web.respond(path, None)
        assert status == 200 and content_type.startswith(kind) and marker in body
        assert b"http://" not in body and b"https://" not in body  # nothing from elsewhere


def test_api_status_gives_the_samples_after_since(web: WebServer) -> None:
    status, _, body = web.respond("/api/status?since=abc", None)
    assert status == 400
    status, content_type, body = web.respond("/api/status", None)
    data = json.loads(body)
    assert status == 200 and content_type == "application/json"
    assert data["status"] == _STATUS and data["history"]["fields"] == list(SAMPLE_FIELDS)
    assert data["dead_letters"] == {"total": 0, "rows": []}
    later = json.loads(web.respond(f"/api/status?since={data['now'] + 60}", None)[2])
    assert later["history"]["rows"] == []


_FULL_STATUS: dict[str, Any] = {
    "version": "0.test",
    "by_source": {"7": _STATUS},
    "pending_by_source": {"7": 1},
    "checkpoints": {
        "q": {
            "completed": 1,
            "open": [],
            "recent": [{"state": "complete", "id": 1, "pending_roots": 4, "duration_s": 0.5}],
        }
    },
    "late_events": 0,
    "unknown_events": 0,
    **dict.fromkeys(
        [
            "retry_waiting",
            "dead_letters",
            "barrier_holds",
            "stored_records",
            "deletes_pending",
            "lmdb_size_bytes",
            "connections",
            "max_connections",
            "replay_cursor",
            "xor_events",
            "filled",
            "ingested",
            "ingest_duplicates",
            "open_ranges",
            "barrier_released",
            "dead_letters_delivered",
            "dead_letters_purged",
            "dead_letters_requeued",
            "timeouts_postponed",
            "recovered_pending",
            "recovered_completed",
        ],
        0,
    ),
    "ingested": 8,
    "ingest_duplicates": 2,
    "timeout_s": 30.0,
    "requests": {"STATUS": {"count": 3, "cpu_s": 0.0012}},
    "store_commits": 17,
    "shard": 1,
    "shards": 2,
}


def test_metrics_count_roots_and_still_serve_the_deprecated_tree_names() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from ftlayer.web.metrics import DEPRECATED_NAMES

    open_web = WebServer(
        "127.0.0.1",
        0,
        observe=lambda: Observation(_FULL_STATUS, {"7": LatencyHistogram()}),
        dead_letters=lambda limit: DeadLetterRows([], 0),
    )
    try:
        status, _, body = open_web.respond("/metrics", None)
    finally:
        open_web.stop()
    assert status == 200
    found = {f.name: f for f in text_string_to_metric_families(body.decode())}
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in found.values()
        for s in family.samples
    }
    # Every sample names the server's shard (shard 1 of 2 here), the process's too.
    assert {dict(labels).get("shard") for _, labels in samples} == {"1"}
    assert any(name.startswith("process_") for name, _ in samples)
    shard = (("shard", "1"),)
    source = (("shard", "1"), ("source", "7"))
    failed = (("cause", "explicit"), ("shard", "1"), ("source", "7"))
    assert samples["ftlayer_roots_completed_total", source] == 2
    assert samples["ftlayer_roots_failed_total", failed] == 1
    assert samples["ftlayer_pending_roots", source] == 1
    assert samples["ftlayer_last_checkpoint_pending_roots", (("query", "q"), *shard)] == 4
    assert samples["ftlayer_tree_timeout_seconds", shard] == 30.0  # the setting's one name
    assert samples["ftlayer_requests_total", (("kind", "STATUS"), *shard)] == 3
    assert samples["ftlayer_store_commits_total", shard] == 17
    assert samples["ftlayer_records_ingested_total", shard] == 8  # what receivers stored
    assert samples["ftlayer_ingest_duplicates_total", shard] == 2  # second copies dropped
    assert samples["ftlayer_request_cpu_seconds_total", (("kind", "STATUS"), *shard)] == 0.0012
    assert DEPRECATED_NAMES == {
        "ftlayer_trees_completed": "ftlayer_roots_completed",
        "ftlayer_trees_failed": "ftlayer_roots_failed",
        "ftlayer_pending_trees": "ftlayer_pending_roots",
        "ftlayer_last_checkpoint_pending_trees": "ftlayer_last_checkpoint_pending_roots",
    }
    for old, new in DEPRECATED_NAMES.items():
        suffix = "_total" if found[new].type == "counter" else ""
        assert found[old].type == found[new].type
        assert found[old].documentation.startswith(f"Deprecated: use {new}{suffix}.")
        assert not found[new].documentation.startswith("Deprecated")
        assert [(s.name.replace(old, new, 1), s.labels, s.value) for s in found[old].samples] == [
            (s.name, s.labels, s.value) for s in found[new].samples
        ]
    trees = {name for name in found if "tree" in name} - set(DEPRECATED_NAMES)
    assert trees == {"ftlayer_tree_timeout_seconds"}
