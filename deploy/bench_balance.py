"""`python -m deploy.bench_balance [--quick] [--repeats 3] [--out bench-report]`: load balancing off and on.

The workload is skewed and its hot keys move (`generator.shift`), so a static
partition map leaves some slaves with more work than others.  The same paced
runs are made with balancing off, with repartitioning only (moves, fixed active
set) and in full (moves and the degree of declustering), and the report compares,
as medians over the repeats: max/mean tuples processed per slave, delay p99,
how far ingest fell behind its pacing, tuples moved and moves made, plus one
unpaced run each for the throughput.  Output: balance.md, balance.json, balance.png.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from deploy.bench import RunFailed, fmt, machine_info, md_table, median, run_cluster

# few keys over few partitions, so hot keys make hot slaves; a short window keeps the result volume modest
WORKLOAD = ["generator.skew=0.7", "generator.keys=256", "generator.rate=40000", "generator.shift=5",
            "partitioning.partitions=16", "join.window=0.01", "epochs.reorganization=2"]
MODES = {"off": ["balance.enabled=false"],
         "repartition": ["balance.enabled=true", "balance.declustering=false"],
         "full": ["balance.enabled=true", "balance.declustering=true"]}
SLAVES = 4


def imbalance(summary: dict) -> float:
    """max / mean tuples processed per slave (1.0 = perfectly even)."""
    done = [v["tuples_processed"] for v in summary["slaves"].values()]
    mean = sum(done) / len(done)
    return max(done) / mean if mean else float("nan")


def numbers(s: dict) -> dict:
    return {"imbalance": round(imbalance(s), 3), "delay_p99": s["delay_seconds"]["p99"],
            "delay_p50": s["delay_seconds"]["p50"], "pacing_lag": s["pacing_lag_max_seconds"],
            "throughput": s["throughput_tuples_per_s"], "tuples_moved": s["tuples_moved"],
            "moves": len(s["balance"]["moves"]), "active_changes": [c["action"] for c in s["balance"]["active_changes"]],
            "active_at_end": len(s["balance"]["active_at_end"])}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.bench_balance", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="20 s of input per run instead of 60 s")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rate", type=float, default=250000.0, help="paced input rate, tuples/s (default 250000: near the capacity of 4 slaves here)")
    p.add_argument("--out", type=Path, default=Path("bench-report"))
    p.add_argument("--timeout", type=float, default=600.0)
    a = p.parse_args(argv)
    workload = WORKLOAD + [f"generator.duration={20.0 if a.quick else 60.0}"]
    data = {"command": "python -m deploy.bench_balance " + " ".join(argv), "machine": machine_info(),
            "workload": workload, "slaves": SLAVES, "rate": a.rate, "runs": {m: [] for m in MODES}, "unpaced": {}}
    try:
        with tempfile.TemporaryDirectory(prefix="streamjoin-balance-") as tmp:
            for i in range(a.repeats):
                for mode, settings in MODES.items():
                    s = run_cluster(SLAVES + 1, [*workload, f"source.rate={a.rate}", *settings],
                                    Path(tmp) / f"{mode}-{i}", a.timeout)
                    data["runs"][mode].append(numbers(s))
                    r = data["runs"][mode][-1]
                    print(f"[{mode:>11} #{i + 1}] max/mean {r['imbalance']:.2f} | delay p99 {r['delay_p99']:.3f}s | "
                          f"lag {r['pacing_lag']:.2f}s | moves {r['moves']} ({r['tuples_moved']:,} tuples) | "
                          f"active changes {r['active_changes']}", flush=True)
            for mode, settings in MODES.items():
                s = run_cluster(SLAVES + 1, [*workload, "source.rate=0", *settings],
                                Path(tmp) / f"{mode}-unpaced", a.timeout)
                data["unpaced"][mode] = numbers(s)
                print(f"[{mode:>11} unpaced] {s['throughput_tuples_per_s']:,.0f} tuples/s", flush=True)
    except RunFailed as e:
        print(f"bench_balance: a run failed: {e}", file=sys.stderr)
        return 1
    keys = ("imbalance", "delay_p50", "delay_p99", "pacing_lag", "tuples_moved", "moves", "active_at_end")
    med = {mode: {k: median(r[k] for r in runs) for k in keys} for mode, runs in data["runs"].items()}
    data["medians"] = med
    rows = [[mode, fmt(m["imbalance"], ".2f"), fmt(m["delay_p50"], ".3f"), fmt(m["delay_p99"], ".3f"),
             fmt(m["pacing_lag"], ".2f"), fmt(m["tuples_moved"]), fmt(m["moves"]), fmt(m["active_at_end"]),
             fmt(data["unpaced"][mode]["throughput"])] for mode, m in med.items()]
    table = md_table(["balancing", "max/mean tuples per slave", "delay p50 s", "delay p99 s", "pacing lag s",
                      "tuples moved", "moves", "active slaves at end", "unpaced tuples/s"], rows)
    m = data["machine"]
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "balance.json").write_text(json.dumps(data, indent=2))
    (a.out / "balance.md").write_text("\n".join([
        "# Load balancing: off, repartitioning only, full", "", f"`{data['command'].strip()}` — {m['date']}", "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; {SLAVES} slaves + master; "
        f"paced at {a.rate:,.0f} tuples/s; workload `{' '.join(workload)}`; medians of {a.repeats} runs.", "",
        table, "", "![balancing](balance.png)", ""]))
    _plot(a.out, data)
    print(table)
    print(f"wrote {a.out / 'balance.md'}, {a.out / 'balance.json'}, {a.out / 'balance.png'}")
    return 0


def _plot(out: Path, data: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(10, 3.4), dpi=120)
    for ax, key, title in zip(axes, ("imbalance", "delay_p99", "pacing_lag"),
                              ("max/mean tuples per slave", "delay p99 (s)", "ingest lag behind pacing (s)")):
        for x, mode in enumerate(MODES):
            ys = [r[key] for r in data["runs"][mode]]
            ax.scatter([x] * len(ys), ys, alpha=0.5)
            ax.bar(x, median(ys) or 0, alpha=0.3)
        ax.set_xticks(range(len(MODES)), list(MODES))
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "balance.png")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
