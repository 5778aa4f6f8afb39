"""The audit's verdicts as Prometheus metrics, for `control.audit --follow` beside a live run.

The audit is a job apart from the cluster (Spark, its own process, often outliving the run it checks), so it
serves its own small registry rather than reaching into the master's: an operator scrapes both and alerts on
`increase(streamjoin_audit_ranges_total{verdict="different"}[1h]) > 0`.  Same naming as the master's metrics
(docs/metrics.md): units in names, `_total` for counters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from protocol.access import check_http_endpoint

if TYPE_CHECKING:
    from protocol.plan import Plan

#: where `--follow` serves by default: beside the master's 127.0.0.1:9464
DEFAULT_ENDPOINT = "127.0.0.1:9465"
#: report keys counted as pairs, by outcome (`duplicates` counts the surplus copies); for rows without a partner
#: the same outcomes, as `<kind>_<outcome>`
PAIR_OUTCOMES = ("expected", "found", "missing", "extra", "duplicates")
LATE_PROBLEMS = ("late_unexpected", "late_missed")


class AuditMetrics:
    """Counters over every audited range, and where the audit has got to."""

    def __init__(self, endpoint: str, plan: Plan):
        check_http_endpoint("--metrics", endpoint, plan.security.allow_remote)
        self.registry = CollectorRegistry()
        r = self.registry
        self.ranges = Counter("streamjoin_audit_ranges", "ranges audited, by verdict", ["verdict"], registry=r)
        self.pairs = Counter(
            "streamjoin_audit_pairs", "pairs over the audited ranges, by outcome", ["outcome"], registry=r
        )
        self.late = Counter(
            "streamjoin_audit_late_wrong",
            "tuples whose lateness the run got wrong, by problem",
            ["problem"],
            registry=r,
        )
        self.alone = Counter(
            "streamjoin_audit_rows_alone",
            "rows without a partner over the audited ranges (join.type other than inner), by kind and outcome",
            ["kind", "outcome"],
            registry=r,
        )
        self.tuples = Counter("streamjoin_audit_input_tuples", "input tuples read for the audited ranges", registry=r)
        self.until = Gauge(
            "streamjoin_audit_audited_until_seconds",
            "event time up to which the run has been audited (end of the last range)",
            registry=r,
        )
        self.took = Gauge(
            "streamjoin_audit_last_range_duration_seconds", "how long the last range took to audit", registry=r
        )
        for v in ("exact", "different"):
            self.ranges.labels(v)
        for o in PAIR_OUTCOMES:
            self.pairs.labels(o)
        for p in LATE_PROBLEMS:
            self.late.labels(p)
        host, port = endpoint.rsplit(":", 1)
        self.server, self.thread = start_http_server(int(port), host.strip("[]"), registry=r)
        self.url = f"http://{endpoint.rsplit(':', 1)[0]}:{self.server.server_port}/metrics"

    def record(self, report: dict) -> None:
        self.ranges.labels(report["verdict"]).inc()
        for o in PAIR_OUTCOMES:
            self.pairs.labels(o).inc(report[o])
        for p in LATE_PROBLEMS:
            self.late.labels(p).inc(report[p])
        for k in report.get("kinds", []):
            for o in PAIR_OUTCOMES:
                self.alone.labels(k, o).inc(report[f"{k}_{o}"])
        self.tuples.inc(report["input_tuples"])
        if report["to"] is not None:
            self.until.set(report["to"])
        self.took.set(report["seconds"])

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
