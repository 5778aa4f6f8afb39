"""`python -m bench.hotkeys [--quick] [--repeats 3] [--rate R] [--out bench-report]`: a heavy hitter, grid off and on.

One key carries `--hot-share` (default 30%) of both streams on top of uniform
keys, so without help the slave owning its partition does most of the work.
The same paced runs are made with `hotkeys.enabled` off and on (balancing off in
both, so only the hot-key grid differs), and the report gives, as medians over
the repeats: max/mean busy seconds and tuples processed per slave, delay p50 and
p99, how far ingest fell behind its pacing, and the grid the key got.
Output: hotkeys.md, hotkeys.json, hotkeys.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench.balance import imbalance
from bench.cluster import RunFailed, delay_seconds, run_cluster
from bench.machine import machine_info
from bench.search import median
from bench.tables import fmt, md_table

SLAVES = 4
MODES = {"off": ["hotkeys.enabled=false"], "grid": ["hotkeys.enabled=true"]}


def measure(s: dict) -> dict:
    hot = s.get("hot_keys") or []
    delay = delay_seconds(s)
    return {
        "busy_spread": round(imbalance(s["slaves"], "busy_seconds"), 3),
        "tuples_spread": round(imbalance(s["slaves"]), 3),
        "delay_p50": delay["p50"],
        "delay_p99": delay["p99"],
        "pacing_lag": s["pacing_lag_max_seconds"],
        "grid": hot[0]["grid"] if hot else 1,
        "results": s["results"],
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.hotkeys", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="15 s of input per run instead of 45 s")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rate", type=float, default=20000.0, help="paced input rate, tuples/s (default 20000)")
    p.add_argument("--hot-share", type=float, default=0.3)
    p.add_argument("--out", type=Path, default=Path("bench-report"))
    p.add_argument("--timeout", type=float, default=600.0)
    a = p.parse_args(argv)
    workload = [
        f"generator.hot_share={a.hot_share}",
        "generator.skew=0.5",
        "generator.keys=65536",
        f"generator.rate={a.rate / 2}",
        f"generator.duration={15.0 if a.quick else 45.0}",
        "join.window=0.01",
        "balance.enabled=false",
        "epochs.reorganization=2",
        f"source.rate={a.rate}",
    ]
    data = {
        "command": "python -m bench.hotkeys " + " ".join(argv),
        "machine": machine_info(),
        "workload": workload,
        "slaves": SLAVES,
        "runs": {m: [] for m in MODES},
    }
    try:
        with tempfile.TemporaryDirectory(prefix="streamjoin-hotkeys-") as tmp:
            for i in range(a.repeats):
                for mode, settings in MODES.items():
                    r = measure(run_cluster(SLAVES + 1, [*workload, *settings], Path(tmp) / f"{mode}-{i}", a.timeout))
                    data["runs"][mode].append(r)
                    print(
                        f"[{mode:>4} #{i + 1}] busy max/mean {r['busy_spread']:.2f} | tuples max/mean "
                        f"{r['tuples_spread']:.2f} | delay p99 {r['delay_p99']:.3f}s | lag {r['pacing_lag']:.2f}s | "
                        f"grid {r['grid']}",
                        flush=True,
                    )
    except RunFailed as e:
        print(f"bench.hotkeys: a run failed: {e}", file=sys.stderr)
        return 1
    keys = ("busy_spread", "tuples_spread", "delay_p50", "delay_p99", "pacing_lag", "grid")
    data["medians"] = {mode: {k: median(r[k] for r in runs) for k in keys} for mode, runs in data["runs"].items()}
    rows = [
        [mode, *(fmt(m[k], f) for k, f in zip(keys, (".2f", ".2f", ".3f", ".3f", ".2f", ".0f")))]
        for mode, m in data["medians"].items()
    ]
    table = md_table(
        ["hot keys", "busy s max/mean", "tuples max/mean", "delay p50 s", "delay p99 s", "pacing lag s", "grid"], rows
    )
    m = data["machine"]
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "hotkeys.json").write_text(json.dumps(data, indent=2))
    (a.out / "hotkeys.md").write_text(
        "\n".join(
            [
                "# A heavy hitter: hot-key grid off and on",
                "",
                f"`{data['command'].strip()}` — {m['date']}",
                "",
                f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; {SLAVES} slaves + master; "
                f"workload `{' '.join(workload)}`; medians of {a.repeats} runs.",
                "",
                table,
                "",
                "![hot keys](hotkeys.png)",
                "",
            ]
        )
    )
    plot(a.out, data, keys[:4])
    print(table)
    print(f"wrote {a.out / 'hotkeys.md'}, {a.out / 'hotkeys.json'}, {a.out / 'hotkeys.png'}")
    return 0


def plot(out: Path, data: dict, keys: tuple[str, ...]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(3 * len(keys), 3.2), dpi=120)
    for ax, key in zip(axes, keys):
        for x, mode in enumerate(MODES):
            ys = [r[key] for r in data["runs"][mode]]
            ax.scatter([x] * len(ys), ys, alpha=0.6)
            ax.bar(x, median(ys) or 0, alpha=0.3)
        ax.set_xticks(range(len(MODES)), list(MODES))
        ax.set_title(key.replace("_", " "), fontsize=9)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "hotkeys.png")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
