"""`python -m bench.balance [--quick] [--repeats 3] [--hogs 2] [--out bench-report]`: load balancing off and on.

Repartitioning (paper 003 IV-C) pays when one slave is backlogged while another
idles.  On one machine whose ranks float over all cores that never happens, so
this bench builds a **busy host** (bench.busy): the master and slaves 1-2 are
pinned to the quiet half of the CPUs, slaves 3-4 to the other half, where
`--hogs` processes spin as other work on a shared host would.  The workload is
skewed and its hot keys move (`generator.shift`).

For each mode -- balancing off, repartitioning only (moves, fixed active set),
full (moves and the degree of declustering) -- the sustained-rate search of
bench.search finds the highest paced rate that keeps up (`bench.search.keep_up`)
with delay p95 <= 1.5 s, then `--repeats` runs at that rate give medians of:
max/mean tuples processed per slave, the busy host's share of the tuples, delay
p50/p99, moves and tuples moved.  Output: balance.md, balance.json, balance.png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.busy import PLAN_ENV, busy_slaves, cpu_plan, encode_plan, hogs, hosts
from bench.cluster import Bench, RunFailed, planned_runs
from bench.machine import machine_info
from bench.search import DELAY_BOUND, KEEP_UP_LAG, KEEP_UP_SHARE, median
from bench.tables import count, fmt, md_table, trail_text

# few keys over few partitions, so hot keys make hot slaves; a short window keeps the result volume modest.
# balance.buffer_capacity = 5000 is about one slave's batch (rate / 4 slaves x the 0.5 s epoch set here, at
# 40k-160k/s), so a slave is a supplier when it is still joining at most of its slots; with the default 20000 it is
# classified a supplier only once it is several batches behind, when the run has already failed the search's delay
# bound.
WORKLOAD = [
    "generator.skew=0.7",
    "generator.keys=256",
    "generator.rate=40000",
    "generator.shift=5",
    "partitioning.partitions=16",
    "join.window=0.01",
    "epochs.distribution=0.5",
    "epochs.reorganization=2",
    "balance.buffer_capacity=5000",
]
MODES = {
    "off": ["balance.enabled=false"],
    "repartition": ["balance.enabled=true", "balance.declustering=false"],
    "full": ["balance.enabled=true", "balance.declustering=true"],
}
SLAVES = 4
HOGS = 2  # default --hogs: with 2 slaves on the busy CPU each gets about 1/4 of it, a quiet-host slave about 1/2


def imbalance(slaves: dict, field: str = "tuples_processed") -> float:
    """max / mean of a per-slave counter (1.0 = perfectly even); `slaves` as in summary.json."""
    done = [v[field] for v in slaves.values()]
    mean = sum(done) / len(done)
    return max(done) / mean if mean else float("nan")


def busy_share(slaves: dict, busy: list[int]) -> float:
    """The fraction of all tuples processed that the busy host's slaves processed."""
    total = sum(v["tuples_processed"] for v in slaves.values())
    return sum(v["tuples_processed"] for r, v in slaves.items() if int(r) in busy) / total if total else float("nan")


def mode_summary(point: dict, busy: list[int]) -> dict:
    """The numbers of one mode: its sustained rate and search, and medians over the repeats at that rate."""
    runs = point["sustained"]["runs"]
    med = lambda f: median(f(r) for r in runs)
    return {
        "sustained_rate": point["sustained"]["rate"],
        "bracket": point["search"]["bracket"],
        "trail": point["search"]["trail"],
        "unpaced": point["unpaced"],
        "passed": count(runs, "passed"),
        "kept_up": count(runs, "kept_up"),
        "imbalance": med(lambda r: imbalance(r["slaves"])),
        "busy_share": med(lambda r: busy_share(r["slaves"], busy)),
        "delay_p50": med(lambda r: r["delay_p50"]),
        "delay_p99": med(lambda r: r["delay_p99"]),
        "moves": med(lambda r: r["moves"]),
        "tuples_moved": med(lambda r: r["tuples_moved"]),
        "throughput": med(lambda r: r["throughput"]),
    }


HEADER = [
    "balancing",
    "sustained rate/s",
    "vs off",
    "search (✓ pass, ✗ fail)",
    "repeats passed",
    "max/mean tuples per slave",
    "busy host's share",
    "delay p50 s",
    "delay p99 s",
    "moves",
    "tuples moved",
]


def table(summaries: dict[str, dict]) -> str:
    off = summaries.get("off", {}).get("sustained_rate")
    rows = [
        [
            mode,
            fmt(m["sustained_rate"]),
            f"{m['sustained_rate'] / off:.2f}x" if off else "-",
            trail_text(m["trail"]),
            m["passed"],
            fmt(m["imbalance"], ".2f"),
            fmt(m["busy_share"], ".0%"),
            fmt(m["delay_p50"], ".3f"),
            fmt(m["delay_p99"], ".3f"),
            fmt(m["moves"], ".0f"),
            fmt(m["tuples_moved"]),
        ]
        for mode, m in summaries.items()
    ]
    return md_table(HEADER, rows)


def write_report(out: Path, data: dict) -> None:
    m, n_hogs, busy = data["machine"], data["hogs"], data["busy_slaves"]
    quiet_cpus, busy_cpus = data["hosts"]
    regime = (
        f"the master and slaves {', '.join(str(r) for r in range(1, SLAVES + 1) if r not in busy)} pinned to "
        f"CPU(s) {quiet_cpus} (the quiet host), slaves {', '.join(map(str, busy))} pinned to CPU(s) {busy_cpus} "
        f"(the busy host) together with {n_hogs} CPU hog(s)"
    )
    parts = [
        "# Load balancing: off, repartitioning only, full",
        "",
        f"`{data['command']}` — {m['date']}; {data['runs']} runs in {data['bench_seconds']:.0f} s",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB. Load average before the bench (before "
        f"the hogs started): {' '.join(map(str, data['load_before']))}; after (hogs stopped): "
        f"{' '.join(map(str, data['load_after']))}. The hogs alone add {n_hogs} to the load average.",
        "",
        f"Busy-host regime: {SLAVES} slaves + master, {regime}. Workload `{' '.join(data['workload'])}`.",
        "",
        table(data["summaries"]),
        "",
        f"- **sustained rate**: the highest paced rate that kept up (ingest and the master's buffers never more "
        f"than {KEEP_UP_LAG:g} s, nor {KEEP_UP_SHARE:.0%} of the input's scheduled length, behind the pacing) "
        f"with delay p95 <= {data['delay_bound']:g} s, found by the search of bench.search (single runs: "
        f"probe, then at most {data['steps']} paced runs); *vs off* is its ratio to balancing off.",
        f"- the other columns are medians of {data['repeats']} runs at that mode's sustained rate (so modes are "
        "compared each at its own capacity); *busy host's share* is the fraction of all tuples that the busy "
        "host's slaves processed: balancing should lower it.",
        "- max/mean tuples per slave is not the aim under a busy host: a balanced cluster gives the quiet slaves "
        "more tuples, so it can rise while delay falls.",
        "",
        "![balancing](balance.png)",
        "",
    ]
    for mode, p in data["points"].items():
        parts += [
            f"## {mode}",
            "",
            md_table(
                [
                    "run",
                    "pacing/s",
                    "kept up",
                    "passes",
                    "delay p50 s",
                    "p99 s",
                    "max/mean",
                    "busy share",
                    "moves",
                    "tuples moved",
                ],
                [
                    [
                        r["label"],
                        fmt(r.get("rate")) if "rate" in r else "unpaced",
                        (f"lag {r['lag_seconds']:.2f}s" + ("" if r["kept_up"] else " FELL BEHIND"))
                        if "rate" in r
                        else "-",
                        (r["verdict"] if r["passed"] else "FAIL: " + r["verdict"]) if "rate" in r else "-",
                        fmt(r["delay_p50"], ".3f"),
                        fmt(r["delay_p99"], ".3f"),
                        fmt(imbalance(r["slaves"]), ".2f"),
                        fmt(busy_share(r["slaves"], busy), ".0%"),
                        str(r["moves"]),
                        fmt(r["tuples_moved"]),
                    ]
                    for r in [p["probe"], *p["search"]["runs"], *p["sustained"]["runs"]]
                ],
            ),
            "",
        ]
    (out / "balance.md").write_text("\n".join(parts))


def plot(out: Path, data: dict) -> Path:
    """balance.png: per mode the sustained rate (with the search runs), and at it delay p99, max/mean tuples per
    slave and the busy host's share (medians as bars, single runs as dots)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    busy = data["busy_slaves"]
    modes = list(data["points"])
    fig, axes = plt.subplots(1, 4, figsize=(13, 3.6), dpi=110)
    ax = axes[0]
    for x, mode in enumerate(modes):
        trail = data["points"][mode]["search"]["trail"]
        ax.bar(x, data["summaries"][mode]["sustained_rate"], alpha=0.35, color="C0")
        ax.scatter(
            [x + 0.15] * len(trail),
            [r for r, _ in trail],
            s=18,
            alpha=0.7,
            c=["C2" if ok else "C3" for _, ok in trail],
            marker="o",
        )
    ax.set_title("sustained rate (tuples/s)\ndots: search runs, green passed", fontsize=9)
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y / 1000:,.0f}k"))
    per_run = {
        "delay p99 (s) at it": lambda r: r["delay_p99"],
        "max/mean tuples per slave at it": lambda r: imbalance(r["slaves"]),
        "busy host's share of tuples at it": lambda r: busy_share(r["slaves"], busy),
    }
    for ax, (title, f) in zip(axes[1:], per_run.items()):
        for x, mode in enumerate(modes):
            ys = [y for r in data["points"][mode]["sustained"]["runs"] if (y := f(r)) is not None]
            ax.scatter([x] * len(ys), ys, alpha=0.6, s=18, color="C1")
            ax.bar(x, median(ys) or 0, alpha=0.35, color="C1")
        ax.set_title(title, fontsize=9)
    for ax in axes:
        ax.set_xticks(range(len(modes)), modes)
        ax.grid(alpha=0.3)
    fig.suptitle(
        f"Load balancing with a busy host ({data['hogs']} CPU hogs beside slaves "
        f"{', '.join(map(str, busy))}); medians of {data['repeats']} runs",
        fontsize=10,
    )
    fig.tight_layout()
    path = out / "balance.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.balance", description=__doc__.split("\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="20 s of input per run instead of 60 s, and 4 search steps instead of 8"
    )
    p.add_argument("--repeats", type=int, default=3, help="runs at each mode's sustained rate (default 3)")
    p.add_argument(
        "--steps",
        type=int,
        help="paced runs of each search (default 4 with --quick, else 8: enough to look above the probe)",
    )
    p.add_argument(
        "--hogs",
        type=int,
        default=HOGS,
        help=f"CPU hogs on the busy host (default {HOGS}; 0 = pinned hosts, none busy)",
    )
    p.add_argument("--modes", default=",".join(MODES), help=f"modes to run (default {','.join(MODES)})")
    p.add_argument("--delay-bound", type=float, default=DELAY_BOUND)
    p.add_argument("--out", type=Path, default=Path("bench-report"))
    p.add_argument("--timeout", type=float, default=600.0)
    a = p.parse_args(argv)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        p.error(f"--modes takes a comma list of {', '.join(MODES)}, got {a.modes!r}")
    steps = a.steps if a.steps is not None else 4 if a.quick else 8
    if a.repeats < 1 or steps < 1 or a.hogs < 0:
        p.error("--repeats and --steps must be at least 1, --hogs at least 0")
    workload = WORKLOAD + [f"generator.duration={20.0 if a.quick else 60.0}"]
    cpus = sorted(os.sched_getaffinity(0))
    ranks = SLAVES + 1
    quiet_cpus, busy_cpus = hosts(cpus)
    env = {PLAN_ENV: encode_plan(cpu_plan(ranks, cpus))}
    busy = busy_slaves(ranks)
    data = {
        "command": ("python -m bench.balance " + " ".join(argv)).strip(),
        "machine": machine_info(),
        "workload": workload,
        "slaves": SLAVES,
        "hogs": a.hogs,
        "hosts": [quiet_cpus, busy_cpus],
        "busy_slaves": busy,
        "repeats": a.repeats,
        "steps": steps,
        "delay_bound": a.delay_bound,
        "load_before": [round(x, 2) for x in os.getloadavg()],
        "points": {},
    }
    print(
        f"bench.balance: {', '.join(modes)}; busy host: slaves {busy} on CPU(s) {busy_cpus} with {a.hogs} hog(s), "
        f"master and the other slaves on CPU(s) {quiet_cpus}; at most "
        f"{len(modes) * planned_runs(1, a.repeats, steps, half=False)} runs",
        flush=True,
    )
    started = time.monotonic()
    runs = 0
    try:
        with tempfile.TemporaryDirectory(prefix="streamjoin-balance-") as tmp, hogs(a.hogs, busy_cpus):
            for mode in modes:
                bench = Bench(
                    [SLAVES],
                    a.repeats,
                    steps,
                    a.delay_bound,
                    [*workload, *MODES[mode]],
                    a.timeout,
                    Path(tmp),
                    half=False,
                    tag=mode,
                    module="bench.busy",
                    env=env,
                )
                try:
                    data["points"][mode] = bench.point(SLAVES)
                finally:
                    runs += bench.done
    except RunFailed as e:
        print(f"bench.balance: a run failed: {e}", file=sys.stderr)
        return 1
    data["load_after"] = [round(x, 2) for x in os.getloadavg()]
    data["runs"], data["bench_seconds"] = runs, round(time.monotonic() - started, 1)
    data["summaries"] = {mode: mode_summary(pt, busy) for mode, pt in data["points"].items()}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "balance.json").write_text(json.dumps(data, indent=2))
    write_report(a.out, data)
    png = plot(a.out, data)
    print("\n" + table(data["summaries"]))
    print(
        f"load average before {data['load_before']}, after {data['load_after']}; {runs} runs in "
        f"{data['bench_seconds']:.0f} s. Wrote {a.out / 'balance.md'}, {a.out / 'balance.json'}, {png}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
