"""`python -m bench.metrics_cost [--quick] [--repeats 5] [--slaves 2] [--out bench-report]`: what the metrics cost.

The same unpaced runs of the default workload with the metrics off (`metrics.endpoint = ""`, no log) and on
(endpoint, dashboard and a Parquet log every second), alternated off/on so the machine's drift falls on both;
the in-run rate (tuples/s) of each and the ratio of their medians, and the CPU a tuple of each (every rank's and
mpirun's: what a busy machine changes least) and the ratio of their medians, the target: at most 3% more with
the metrics (CPU_TARGET).  Then one paced run (15 s, at most half the off median) with the metrics on, and its timeline
plotted from its metrics log (`metrics/*.parquet`): input and result rates, delay p50/p99, per-slave busy
share, as an operator would plot a run.  Output: metrics.md, metrics.json, metrics-timeline.png.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq

from bench.ab import Comparison, parser
from bench.cluster import RunFailed, run_cluster
from protocol.plan import load_plan

TARGET = 0.98
CPU_TARGET = 1.03
MODES = {
    "off": ["metrics.endpoint=", "metrics.log_interval=0"],
    "on": ["metrics.endpoint=127.0.0.1:0", "metrics.log_interval=1", "output.progress=1"],
}


def read_log(out: Path) -> list[dict]:
    """The run's metrics log, one dict per sample in time order."""
    return sorted(pq.read_table(out / "metrics").to_pylist(), key=lambda r: r["time"])


def timeline(samples: list[dict]) -> dict[str, list]:
    """Per interval between samples: elapsed s, input and result rates, delay p50/p99, busy share per slave."""
    t = [s["elapsed"] for s in samples]
    rate = lambda f: [(f(b) - f(a)) / (b["elapsed"] - a["elapsed"]) for a, b in zip(samples, samples[1:])]
    busy = [
        [(y - x) / (b["elapsed"] - a["elapsed"]) for x, y in zip(a["busy_seconds"], b["busy_seconds"])]
        for a, b in zip(samples, samples[1:])
    ]
    return {
        "elapsed": t[1:],
        "input_per_s": rate(lambda s: s["input_r"] + s["input_s"]),
        "results_per_s": rate(lambda s: s["results"]),
        "delay_p50": [s["delay_p50"] for s in samples[1:]],
        "delay_p99": [s["delay_p99"] for s in samples[1:]],
        "busy_share": busy,
    }


def plot(out: Path, line: dict) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), dpi=110)
    x = line["elapsed"]
    axes[0].plot(x, line["input_per_s"], label="input")
    axes[0].plot(x, line["results_per_s"], label="results")
    axes[0].set(title="tuples / s (metrics log)", xlabel="run time, s")
    axes[0].legend()
    axes[1].plot(x, line["delay_p50"], label="p50")
    axes[1].plot(x, line["delay_p99"], label="p99")
    axes[1].set(title="delay, s", xlabel="run time, s", yscale="log")
    axes[1].legend()
    for i, share in enumerate(zip(*line["busy_share"]) if line["busy_share"] else []):
        axes[2].plot(x, share, label=f"slave {i + 1}")
    axes[2].set(title="busy share per slave", xlabel="run time, s", ylim=(0, 1.05))
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    png = out / "metrics-timeline.png"
    fig.savefig(png)
    plt.close(fig)
    return png


def main(argv: list[str]) -> int:
    a = parser("python -m bench.metrics_cost", __doc__, 30.0, 60.0, 5).parse_args(argv)
    workload = [f"generator.duration={30.0 if a.quick else 60.0}"]
    ab = Comparison("python -m bench.metrics_cost " + " ".join(argv), a, workload, MODES)
    try:
        with tempfile.TemporaryDirectory(prefix="streamjoin-metrics-") as tmp:
            ab.run(Path(tmp))
            gen = load_plan(None, workload).generator  # paced to last 15 s at most half the off median
            rate = round(min(ab.data["medians"]["off"] / 2, 2 * gen.rate * gen.duration / 15))
            s = run_cluster(
                a.slaves + 1,
                [*workload, *MODES["on"], f"source.rate={rate}"],
                Path(tmp) / "timeline",
                a.timeout,
                keep=lambda out: timeline(read_log(out)),
            )
            ab.data["timeline"] = {"rate": rate, **s["kept"]}
    except RunFailed as e:
        print(f"bench.metrics_cost: a run failed: {e}", file=sys.stderr)
        return 1
    a.out.mkdir(parents=True, exist_ok=True)
    png = plot(a.out, ab.data["timeline"])
    ab.write(
        "metrics",
        "What the metrics cost",
        "metrics",
        [
            ab.verdict(TARGET),
            "",
            f"CPU a tuple (every rank and mpirun), medians: on / off = {ab.data['cpu_ratios']['on']:.3f} (target <= "
            f"{CPU_TARGET}: {'met' if ab.data['cpu_ratios']['on'] <= CPU_TARGET else 'NOT met'}).",
            "",
            f"A paced run at {rate:,} tuples/s (at most half the off median, 15 s long), plotted from its metrics log:",
            "",
            f"![timeline]({png.name})",
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
