"""The FT-layer server's HTTP port (`ftlayer serve --http-port P`): Prometheus metrics
at /metrics, a live status page at /, and the JSON that feeds the page at /api/status.

- `ftlayer.web.metrics`: the Prometheus collector, which reads the core's counters at
  scrape time (nothing is counted on the hot path for it) and names them by Prometheus'
  conventions.
- `ftlayer.web.http`: the HTTP server (a thread per request, read-only, optionally
  behind the token and TLS) and the short history of samples the page charts.
- `ftlayer/web/static/`: the page, plain HTML, CSS and JavaScript with no build step,
  no library and nothing fetched from elsewhere: it works offline.

Only `ftlayer serve` imports this package (never an executor or a driver).
"""

from __future__ import annotations

from .http import WebServer
from .observation import DeadLetterRows, Observation

__all__ = ["DeadLetterRows", "Observation", "WebServer"]
