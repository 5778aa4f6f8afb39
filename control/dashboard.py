"""`python -m control.dashboard OUT [--endpoint 127.0.0.1:9464]`: the dashboard of a finished run.

Serves the page the master serves live (common.dashboard) from a run's files: the samples of its metrics
log (`OUT/metrics/*.parquet`), the moves, hot-key events and checkpoints of `OUT/summary.json`, and the final
Prometheus exposition (`OUT/metrics.prom`) at /metrics.  Loopback only: it is a viewer, not a service.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq

from protocol.access import endpoint_is_local
from common.dashboard import DashboardServer
from protocol.strict_json import finite
from protocol.lifetime import invocation
from protocol.plan import compile_plan


def load(out: Path) -> dict:
    """The page's data for the run in `out` (every sample, oldest first)."""
    files = sorted((out / "metrics").glob("*.parquet"))
    if not files:
        raise FileNotFoundError(
            f"{out / 'metrics'} holds no metrics log (*.parquet): was metrics.log_interval 0, "
            "or is this not a run's output folder?"
        )
    samples = [row for f in files for row in pq.read_table(f).to_pylist()]
    samples.sort(key=lambda s: s["time"])
    for seq, s in enumerate(samples):  # a resumed run's samples follow the first run's
        s["seq"] = seq
    summary_file = out / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else None
    run = compile_plan(summary["config"]) if summary else None  #: the plan the run wrote down
    return finite(
        {
            "live": False,
            "samples": samples,
            "summary": summary,
            "moves": (summary or {}).get("balance", {}).get("moves", []),
            "hot_events": (summary or {}).get("hot_keys", []),
            "checkpoints": (summary or {}).get("checkpoints", {}).get("log", []),
            "config": {
                "dispatchers": run.cluster.dispatchers if run else 1,
                "output": str(out.resolve()),
                "buffer_capacity": run.master.buffer_capacity if run else None,
                "source": run.source.kind if run else None,
            },
        }
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=invocation("control.dashboard"), description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path, help="the run's output folder (output.path)")
    p.add_argument("--endpoint", default="127.0.0.1:9464", help="HOST:PORT to serve on, loopback (port 0: any free)")
    args = p.parse_args(argv)
    if not endpoint_is_local(args.endpoint):
        print(f"error: --endpoint {args.endpoint!r} is not a loopback address", file=sys.stderr)
        return 2
    try:
        data = load(args.out)
        final = args.out / "metrics.prom"
        server = DashboardServer(
            args.endpoint,
            lambda since: {**data, "samples": data["samples"][since:]},
            final.read_bytes if final.exists() else None,
        )
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"dashboard of {args.out.resolve()} ({len(data['samples'])} samples): {server.url}  (Ctrl-C ends)",
        file=sys.stderr,
        flush=True,
    )
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
