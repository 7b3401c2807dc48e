"""The HTTP port of a real `ftlayer serve --http-port`: /metrics after traffic agrees
with STATUS and with the traffic itself, parsed by prometheus_client's own parser; the
token guards it; a non-loopback bind needs the token and TLS, or --http-public."""

from __future__ import annotations

import base64
import http.client
import os
import re
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trustme
from prometheus_client.parser import text_string_to_metric_families
from serverproc import StartServer, serve_command
from webtraffic import ORDERS, PAYMENTS, QUERY, drive, get

from ftlayer.client import FTClient
from ftlayer.status import Status

_GUIDE = Path(__file__).resolve().parents[2] / "docs" / "user-guide.md"


def _scrape(url: str, **kwargs: Any) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """{sample name: {sorted labels: value}} of one scrape of /metrics."""
    status, body = get(url + "metrics", **kwargs)
    assert status == 200, body
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def _one(samples: dict[str, Any], name: str, **labels: str) -> float:
    """The sample of `name` with these labels and the server's shard ("0": alone)."""
    return float(samples[name][tuple(sorted({"shard": "0", **labels}.items()))])


def _settled(client: FTClient, url: str) -> tuple[Status, dict[str, Any]]:
    """A scrape and the STATUS it must agree with: read until two STATUS replies around
    the scrape agree (the deleter thread may still be removing completed records)."""
    for _ in range(50):
        before = client.status()
        samples = _scrape(url)
        after = client.status()
        # Clocks, not counters; and the requests, which these STATUS requests count.
        moving = ("uptime_s", "batches_running", "requests")
        if {k: v for k, v in before.to_json().items() if k not in moving} == {
            k: v for k, v in after.to_json().items() if k not in moving
        }:
            return after, samples
    raise AssertionError("the server's status never settled")


def test_metrics_agree_with_status_and_with_the_traffic(start_server: StartServer) -> None:
    server = start_server(None, "--http-port", "0", "--tree-timeout-s", "300")
    assert server.http_url is not None and server.http_url.startswith("http://127.0.0.1:")
    rounds = 3
    with server.client() as client:
        drive(client, rounds=rounds, pause_s=0.1)
        status, samples = _settled(client, server.http_url)

    # What the traffic did (webtraffic.drive), per source.
    orders, payments = str(ORDERS), str(PAYMENTS)
    expected = {
        ("ftlayer_records_persisted_total", orders): 200 * rounds,
        ("ftlayer_records_persisted_total", payments): 50 * rounds,
        ("ftlayer_trees_completed_total", orders): 192 * rounds,
        ("ftlayer_trees_completed_total", payments): 50 * rounds,
        ("ftlayer_records_replayed_total", orders): 5 * rounds,
        ("ftlayer_records_dead_lettered_total", orders): 5 * (rounds - 1),
        ("ftlayer_pending_trees", orders): 3 * rounds + 5,
        ("ftlayer_pending_trees", payments): 0,
        ("ftlayer_complete_latency_seconds_count", orders): 192 * rounds,
        ("ftlayer_complete_latency_seconds_count", payments): 50 * rounds,
    }
    for (name, source), value in expected.items():
        assert _one(samples, name, source=source) == value, (name, source)
    assert _one(samples, "ftlayer_trees_failed_total", source=orders, cause="explicit") == (
        5 * rounds + 5 * (rounds - 1)
    )
    assert _one(samples, "ftlayer_dead_letters") == 5 * (rounds - 1)

    # The same figures as STATUS, source by source, and the sums are STATUS's totals.
    assert set(status.by_source) == {orders, payments}
    for source, figures in status.by_source.items():
        assert _one(samples, "ftlayer_records_persisted_total", source=source) == (
            figures.persisted
        )
        assert _one(samples, "ftlayer_trees_completed_total", source=source) == figures.completed
        for cause, n in figures.failed.items():
            assert _one(samples, "ftlayer_trees_failed_total", source=source, cause=cause) == n
        assert _one(samples, "ftlayer_records_replayed_total", source=source) == figures.replayed
        assert _one(samples, "ftlayer_records_dead_lettered_total", source=source) == (
            figures.dead_lettered
        )
        assert _one(samples, "ftlayer_replay_queue_entries", source=source) == (
            figures.replay_queue
        )
        assert _one(samples, "ftlayer_pending_trees", source=source) == status.pending_of(
            int(source)
        )
        latency = figures.complete_latency
        buckets = {
            float(dict(labels)["le"]): value
            for labels, value in samples["ftlayer_complete_latency_seconds_bucket"].items()
            if dict(labels)["source"] == source
        }
        counts = [buckets[le] for le in sorted(buckets)]
        assert counts == sorted(counts) and counts[-1] == latency.count
        total = _one(samples, "ftlayer_complete_latency_seconds_sum", source=source)
        assert abs(total - latency.sum_s) < 1e-5
        assert latency.p50_s is not None and latency.p99_s is not None
        assert 0 < latency.p50_s <= latency.p99_s
    assert sum(f.persisted for f in status.by_source.values()) == status.persisted
    assert sum(f.completed for f in status.by_source.values()) == status.completed
    assert sum(f.replayed for f in status.by_source.values()) == status.replayed
    assert status.complete_latency.count == 242 * rounds

    for name, key in (
        ("ftlayer_stored_records", "stored_records"),
        ("ftlayer_store_size_bytes", "lmdb_size_bytes"),
        ("ftlayer_retry_waiting_records", "retry_waiting"),
        ("ftlayer_xor_events_total", "xor_events"),
        ("ftlayer_replay_cursor", "replay_cursor"),
        ("ftlayer_connections", "connections"),
    ):
        assert _one(samples, name) == status[key], name
    # Requests by kind, as STATUS counted them after the scrape (which is no request).
    assert status.requests["STATUS"].count >= 1 and status.requests["PERSIST"].count >= rounds
    for kind, cost in status.requests.items():
        assert _one(samples, "ftlayer_requests_total", kind=kind) == cost.count, kind
        assert _one(samples, "ftlayer_request_cpu_seconds_total", kind=kind) == cost.cpu_s, kind
    assert _one(samples, "ftlayer_request_cpu_seconds_total", kind="PERSIST") > 0
    checkpoints = status.checkpoints[QUERY]
    last = checkpoints.recent[-1]
    assert _one(samples, "ftlayer_checkpoints_completed_total", query=QUERY) == rounds - 1
    assert _one(samples, "ftlayer_checkpoints_open", query=QUERY) == len(checkpoints.open) == 1
    assert _one(samples, "ftlayer_last_checkpoint_id", query=QUERY) == last.id == rounds - 1
    assert _one(samples, "ftlayer_last_checkpoint_duration_seconds", query=QUERY) == (
        last.duration_s
    )
    assert _one(samples, "ftlayer_last_checkpoint_size_bytes", query=QUERY) == last.size_bytes
    assert _one(samples, "ftlayer_info", version=status.version) == 1

    # `ftlayer status` shows the same latency, in milliseconds, and a row per source.
    shown = subprocess.run(
        [sys.executable, "-m", "ftlayer.cli", "status", "--server", server.address],
        capture_output=True,
        check=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "160"},
    ).stdout.decode()
    p50, p99 = status.complete_latency.p50_s, status.complete_latency.p99_s
    assert p50 is not None and p99 is not None
    assert re.search(rf"complete_latency\.p50 +│ {1000 * p50:,.2f} ms", shown), shown
    assert re.search(rf"complete_latency\.p99 +│ {1000 * p99:,.2f} ms", shown), shown
    figures = status.by_source[orders]
    row = [
        *(f"{n:,}" for n in (ORDERS, figures.persisted, figures.completed, 25, 15, 10, 14)),
        f"{figures.replay_queue:,}",
        f"{1000 * (figures.complete_latency.p50_s or 0):,.2f} ms",
    ]
    assert re.search(r" +│ +".join(re.escape(cell) for cell in row), shown), shown

    # Every FT-layer metric is in the user guide's table.
    guide = _GUIDE.read_text()
    names = {re.sub(r"_(total|bucket|count|sum)$", "", n) for n in samples}
    for name in sorted(n for n in names if n.startswith("ftlayer")):
        assert f"`{name}" in guide, f"{name} is not in docs/user-guide.md"


def test_with_a_token_every_http_request_must_carry_it(
    start_server: StartServer, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    server = start_server(None, "--http-port", "0", "--token-file", str(token))
    assert server.http_url is not None
    with server.client(b"s3cret") as client:
        drive(client, rounds=1, pause_s=0.0)
    for path in ("metrics", "", "api/status"):
        status, _ = get(server.http_url + path)
        assert status == 401
    basic = base64.b64encode(b"anyone:s3cret").decode()
    wrong = base64.b64encode(b"anyone:guess").decode()
    assert get(server.http_url + "metrics", {"Authorization": "Bearer guess"})[0] == 401
    assert get(server.http_url + "metrics", {"Authorization": f"Basic {wrong}"})[0] == 401
    status, body = get(server.http_url + "metrics", {"Authorization": "Bearer s3cret"})
    assert status == 200 and b"ftlayer_records_persisted_total" in body
    status, body = get(server.http_url, {"Authorization": f"Basic {basic}"})
    assert status == 200 and b"<title>ftlayer status</title>" in body


def _serve_fails(tmp_path: Path, *args: str) -> str:
    done = subprocess.run(
        serve_command(tmp_path / "refused", "--http-port", "0", *args),
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done
    return done.stderr.decode()


def test_a_non_loopback_http_port_needs_the_token_and_tls_or_http_public(
    start_server: StartServer, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    stderr = _serve_fails(tmp_path, "--http-host", "0.0.0.0")
    assert "without the token" in stderr and "--http-public" in stderr
    stderr = _serve_fails(tmp_path, "--http-host", "0.0.0.0", "--token-file", str(token))
    assert "without TLS" in stderr and "--tls-cert" in stderr

    # --http-public: read-only, for anyone who reaches it.
    public = start_server(None, "--http-port", "0", "--http-host", "0.0.0.0", "--http-public")
    assert public.http_url is not None and public.http_url.startswith("http://0.0.0.0:")
    port = public.http_url.rsplit(":", 1)[1]
    status, body = get(f"http://127.0.0.1:{port}metrics")
    assert status == 200 and b"ftlayer_pending_trees" in body

    # The token and TLS: HTTPS only, and the token required.
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert_pem, key_pem = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.cert_chain_pems[0].write_to_path(str(cert_pem))
    cert.private_key_pem.write_to_path(str(key_pem))
    secured = start_server(
        tmp_path / "secured",
        *("--http-port", "0", "--http-host", "0.0.0.0", "--token-file", str(token)),
        *("--tls-cert", str(cert_pem), "--tls-key", str(key_pem)),
    )
    assert secured.http_url is not None and secured.http_url.startswith("https://")
    url = f"https://127.0.0.1:{secured.http_url.rsplit(':', 1)[1]}"
    context = ssl.create_default_context()
    ca.configure_trust(context)
    assert get(url + "metrics", context=context)[0] == 401
    status, body = get(url + "metrics", {"Authorization": "Bearer s3cret"}, context=context)
    assert status == 200 and b"ftlayer_records_persisted_total" in body
    with pytest.raises((OSError, http.client.HTTPException)):  # plain HTTP: no answer
        get(url.replace("https", "http") + "metrics")
