"""The dashboard's server and the metrics log's layout, shared by the live master (master.metrics) and the
after-the-run viewer (control.dashboard).

One HTTP port serves the page (`dashboard.html`, a file of this package: plain JS and inline SVG, nothing
fetched from elsewhere), its data as JSON (`/api/data?since=SEQ`: the samples from SEQ on, moves, hot-key
events, checkpoints, the summary once there is one) and, live, the Prometheus exposition (`/metrics`).
The server runs in a daemon thread and only reads what its callbacks return.
"""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable
from urllib.parse import parse_qs, urlparse

import pyarrow as pa

from protocol.strict_json import json_text

PAGE = Path(__file__).with_name("dashboard.html")
PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def sample_schema() -> pa.Schema:
    """One row of `metrics/*.parquet` per sample: counters since the start, levels now, per-slave lists in the
    order of `slaves` (docs/metrics.md)."""
    f64, i64 = pa.float64(), pa.int64()
    scalars = [
        ("seq", i64),
        ("time", f64),
        ("elapsed", f64),
        ("input_r", i64),
        ("input_s", i64),
        ("results", i64),
        ("late", i64),
        ("rejected", i64),
        ("idle_seconds_r", f64),
        ("idle_seconds_s", f64),
        ("result_stream_gaps", i64),
        ("delay_p50", f64),
        ("delay_p99", f64),
        ("buffered", i64),
        ("backlog_max_seconds", f64),
        ("pacing_lag_max_seconds", f64),
        ("watermark", pa.list_(f64)),
        ("watermark_r", pa.list_(f64)),
        ("watermark_s", pa.list_(f64)),
        ("moves", i64),
        ("tuples_moved", i64),
        ("reorganizations", i64),
        ("partition_splits", i64),
        ("partition_merges", i64),
        ("checkpoints", i64),
        ("checkpoint_age_seconds", f64),
        ("checkpoint_duration_seconds", f64),
        ("slaves", pa.list_(i64)),
        ("active", pa.list_(pa.bool_())),
        ("hosts", pa.list_(pa.string())),
    ]
    per_slave = [
        ("busy_seconds", f64),
        ("tuples_joined", i64),
        ("slave_results", i64),
        ("occupancy", f64),
        ("window_tuples", i64),
        ("window_bytes", i64),
        ("rss_bytes", i64),
        ("slots_missed", i64),
        ("cpu_seconds", f64),
        ("comm_seconds", f64),
        ("partitions", i64),
    ]
    hot = pa.struct([("key", i64), ("first", i64), ("size", i64), ("slaves", pa.list_(i64))])
    kafka = pa.struct(
        [
            ("stream", pa.string()),
            ("topic", pa.string()),
            ("partition", i64),
            ("records", i64),
            ("bytes", i64),
            ("lag", i64),
            ("lost", i64),
        ]
    )
    return pa.schema(
        [
            *scalars,
            *((n, pa.list_(t)) for n, t in per_slave),
            ("partition_map", pa.list_(i64)),
            ("moving", pa.list_(i64)),
            ("hot_keys", pa.list_(hot)),
            ("kafka_partitions", pa.list_(kafka)),
        ]
    )


class DashboardServer:
    """`endpoint` HOST:PORT (port 0: any free one); `data(since)` gives the JSON, `exposition()` the
    Prometheus text (None: no /metrics)."""

    def __init__(self, endpoint: str, data: Callable[[int], dict], exposition: Callable[[], bytes] | None = None):
        host, _, port = endpoint.rpartition(":")
        host = host.strip("[]")
        server_class = type(
            "Server",
            (ThreadingHTTPServer,),
            {"daemon_threads": True, "address_family": socket.AF_INET6 if ":" in host else socket.AF_INET},
        )
        handler = type("Handler", (_Handler,), {"data": staticmethod(data), "exposition": staticmethod(exposition)})
        try:
            self.httpd = server_class((host, int(port)), handler)
        except OSError as e:
            raise OSError(
                f"metrics.endpoint {endpoint!r}: cannot serve there ({e.strerror or e}); choose "
                'another port or set metrics.endpoint = "" (off)'
            ) from None
        bound = self.httpd.server_address[1]
        self.url = f"http://{'[' + host + ']' if ':' in host else host}:{bound}/"
        # `close` waits for the loop's next poll: at 0.5 s that was up to half a second of every run's end
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="dashboard", daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    data: Callable[[int], dict]
    exposition: Callable[[], bytes] | None

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        url = urlparse(self.path)
        if url.path in ("/", "/index.html"):
            self._send(200, "text/html; charset=utf-8", PAGE.read_bytes())
        elif url.path == "/api/data":
            since = int(parse_qs(url.query).get("since", ["0"])[0] or 0)
            self._send(200, "application/json", json_text(self.data(since)).encode())
        elif url.path == "/metrics" and self.exposition is not None:
            self._send(200, PROMETHEUS_TYPE, self.exposition())
        else:
            self._send(404, "text/plain", b"not found: / (dashboard), /api/data, /metrics\n")

    def _send(self, code: int, kind: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:  # no line per request on the master's stderr
        pass
