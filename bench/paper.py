"""The parts of the bench beyond the capacity per slave count: the paper's figures and the issue's targets.

* **workloads**: besides the paper's default (`paper`: b-model skew 0.7, 64-byte tuples) the
  sustained-rate search (bench.search) runs on uniform keys, Zipf keys with a few heavy hitters and high
  key duplication (few distinct keys, many tuples each, as in the Rovio workload of multicore stream-join
  studies), each a set of generator keys (`WORKLOADS`), reproducible by `generator.seed`;
* **delay against input rate** per slave count (paper 003, figures 5-8): every paced run of the search is a
  point, so the curve costs no extra run;
* **with and without extendible-hash tuning** (figures 9-10): the same search with `tuning.max_depth = 0`
  (one bucket per partition-group);
* **distribution-epoch sweep** (figures 13-14): runs at one fixed rate (half the paper workload's sustained
  rate) with `epochs.distribution` varied; delay and the slaves' communication seconds (summary
  `comm_seconds`: receiving messages, sending reports);
* **targets**: window state per stored tuple against the raw tuple bytes (at most 2x), the cluster's
  sustained rate against the single-core kernel (bench.kernel's own join module, in one process)
  times the cores in use (at least 1/2), delay p99 at half capacity within one epoch + 100 ms, and the
  peak RSS of every rank.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from bench.kernel import epoch_batches, own_by_span, window_footprint, with_results
from bench.search import HALF_LOAD, MIN_INPUT_SECONDS, confirmed, median
from bench.tables import detail_table, fmt, md_table, summary_table, trail_text
from common.workload import generate_all
from protocol.plan import load_plan

#: name -> (what it is, generator/join settings on top of the bench's workload).  The windows of zipf and
#: duplication are chosen so they give about one result per input tuple, as the paper workload does (results/s
#: = rate_R x rate_S x 2 window x the sum of the key shares squared): a heavy hitter's or a duplicated key's
#: results grow with the square of its rate, and the workloads should differ in their keys, not in output.
WORKLOADS: dict[str, tuple[str, list[str]]] = {
    "paper": ("the paper's default: b-model skew 0.7 over 2^20 keys, 64-byte tuples, window 1 s", []),
    "uniform": ("uniform keys over 2^20 keys, window 1 s", ["generator.distribution=uniform"]),
    "zipf": (
        "Zipf keys, s = 1.0 over 2^20 keys (top key 7% of the tuples, top 10 20%), window 2.5 ms",
        ["generator.distribution=zipf", "generator.zipf=1.0", "join.window=0.0025"],
    ),
    "duplication": (
        "high key duplication: 1,000 keys, uniform (each 50 times per second in each stream), window 0.02 s",
        ["generator.distribution=uniform", "generator.keys=1000", "join.window=0.02"],
    ),
}
EXTRA_WORKLOADS = [w for w in WORKLOADS if w != "paper"]  #: the paper workload is the main search (python -m bench)
NO_TUNING = ["tuning.max_depth=0"]
QUICK_EPOCHS = [0.25, 0.5, 1.0]
FULL_EPOCHS = [0.1, 0.25, 0.5, 1.0, 2.0]
WINDOW_TARGET = 2.0  #: window state per stored tuple at most this times the raw tuple bytes
KERNEL_TARGET = 0.5  #: sustained rate at least this fraction of the single-core kernel x cores in use
DELAY_SLACK = 0.1  #: delay p99 at half capacity within one distribution epoch + this
SUSTAINED_TARGET, SUSTAINED_SLAVES = 8_000_000, 4  #: the sustained-rate target (this machine's kind, paper workload)
OFF_SCALE = 4.0  #: delay-against-rate plots cut their y axis at this many delay bounds


def parse_names(text: str) -> list[str]:
    """'uniform,zipf' -> ['uniform', 'zipf']; 'none' -> []; each must be one of EXTRA_WORKLOADS."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if names == ["none"]:
        return []
    bad = [n for n in names if n not in EXTRA_WORKLOADS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"expected workloads among {','.join(EXTRA_WORKLOADS)} (or none), got {text!r}"
        )
    return names


def parse_epochs(text: str) -> list[float]:
    """'0.25,0.5,1' -> [0.25, 0.5, 1.0]; 'none' -> []; each a positive number of seconds."""
    if text.strip() == "none":
        return []
    try:
        xs = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected epochs in seconds like 0.25,0.5,1 (or none), got {text!r}"
        ) from None
    if not xs or min(xs) <= 0:
        raise argparse.ArgumentTypeError(f"epochs must be positive seconds, got {text!r}")
    return xs


# --------------------------------------------------------------------------- pure helpers


def paced_runs(point: dict) -> list[dict]:
    """Every paced run of a point (search, sustained, half) by pacing rate: the delay-against-rate curve."""
    return sorted(
        [*point["search"]["runs"], *point["sustained"]["runs"], *point["half"]["runs"]], key=lambda r: r["rate"]
    )


def kernel_fraction(point: dict, kernel_rate: float, cores: int) -> dict:
    """The point's sustained rate over the single-core kernel's rate times the cores its ranks can use
    (k slaves + the master, at most the machine's cores)."""
    used = min(point["ranks"], cores)
    limit = kernel_rate * used
    rate = point["sustained"]["rate"]
    return {
        "slaves": point["slaves"],
        "cores_used": used,
        "rate": rate,
        "limit": limit,
        "fraction": rate / limit if limit else None,
    }


def window_state(points: list[dict], tuple_bytes: int) -> dict:
    """Median window bytes per stored tuple over the points' paced runs, and its ratio to the raw tuple bytes."""
    per = median(r["window_bytes_per_tuple"] for p in points for r in paced_runs(p))
    return {"bytes_per_tuple": per, "raw": tuple_bytes, "ratio": per / tuple_bytes if per else None}


def rank_rss(runs: list[dict]) -> dict[int, float]:
    """Per rank (0 = master), the largest peak RSS in MB over the runs."""
    out: dict[int, float] = {}
    for r in runs:
        for rank, mb in r["rank_rss_mb"].items():
            out[int(rank)] = max(out.get(int(rank), 0.0), mb)
    return dict(sorted(out.items()))


def comm_per_slave(run: dict) -> float:
    """Mean communication seconds of the run's slaves (paper 003 figure 14: average over the slave nodes)."""
    comm = [v["comm_seconds"] for v in run["slaves"].values()]
    return sum(comm) / len(comm) if comm else 0.0


def cluster_runs(data: dict) -> int:
    """How many cluster runs the bench made: every point's (paper, workloads, tuning off; with its confirmation
    run) and the epoch sweep's."""
    points = [
        *data["points"],
        *(p for w in data.get("workloads", {}).values() for p in w["points"]),
        *(data.get("tuning_off") or {}).get("points", []),
    ]
    return sum(
        1 + len(p["search"]["runs"]) + len(p["sustained"]["runs"]) + len(p["half"]["runs"]) + bool(p.get("confirm"))
        for p in points
    ) + len((data.get("epochs") or {}).get("runs", []))


def mark(ok: bool | None) -> str:
    return "-" if ok is None else "✓ met" if ok else "✗ not met"


def claim(data: dict, ok: bool | None) -> str:
    """A target's mark in a detail table: none in quick mode, which measures no capacity."""
    return "not measured (quick)" if data.get("quick") else mark(ok)


# --------------------------------------------------------------------------- tables


def targets_table(data: dict) -> str:
    """The issue's targets, each with what this bench measured and whether it is met."""
    cfg, points = data["config"], data["points"]
    rows = []
    ratio = data.get("peer_ratio")
    if ratio:
        value = ratio["ratio"] or ratio["ratio_at_least"]
        rows.append(
            [
                "capacity >= 10x Spark Structured Streaming",
                f"{value:.1f}x" if value else "-" if not ratio["ratio_at_least"] else f"> {value:.1f}x",
                mark(value >= 10 if value else None),
            ]
        )
    capacity = [p for p in points if confirmed(p)]
    four = next((p for p in points if p["slaves"] == SUSTAINED_SLAVES), None)
    if four is not None:
        ok = confirmed(four)
        rows.append(
            [
                f"sustained >= {SUSTAINED_TARGET / 1e6:g}M tuples/s with {SUSTAINED_SLAVES} slaves ("
                f"confirmed, every run >= {MIN_INPUT_SECONDS:g} s of input)",
                f"{four['sustained']['rate']:,.0f}/s" + ("" if ok else " (not confirmed)"),
                mark(four["sustained"]["rate"] >= SUSTAINED_TARGET) if ok else "-",
            ]
        )
    bound = cfg["epochs"]["distribution"] + DELAY_SLACK
    half = [(p["slaves"], p["half"]["delay_p99"]) for p in capacity if p["half"]["delay_p99"] is not None]
    if half:
        rows.append(
            [
                f"delay p99 at half capacity <= epoch + {DELAY_SLACK * 1000:.0f} ms = {bound:g} s",
                ", ".join(f"{k} slave(s) {d:.3f} s" for k, d in half),
                mark(all(d <= bound for _, d in half)),
            ]
        )
    ws = window_state(points, cfg["generator"]["tuple_bytes"])
    traced = ((data.get("kernel") or {}).get("footprint") or {}).get("traced_per_tuple")
    if ws["ratio"]:
        worst = max(ws["ratio"], traced / ws["raw"] if traced else 0)
        rows.append(
            [
                f"window state <= {WINDOW_TARGET:g}x the raw tuple bytes",
                f"cluster {ws['bytes_per_tuple']:.0f} B"
                + (f", in-process traced {traced:.0f} B" if traced else "")
                + f" per {ws['raw']} B tuple: {worst:.2f}x",
                mark(worst <= WINDOW_TARGET),
            ]
        )
    if data.get("kernel"):
        fr = [kernel_fraction(p, data["kernel"]["rate"], data["kernel"]["cores"]) for p in capacity]
        best = max(fr, key=lambda f: f["fraction"] or 0, default=None)
        if best is not None and best["fraction"] is not None:
            rows.append(
                [
                    f">= {KERNEL_TARGET:g} of the single-core kernel x cores in use",
                    f"{best['fraction']:.2f} ({best['slaves']} slave(s): {best['rate']:,.0f}/s of "
                    f"{best['limit']:,.0f}/s)",
                    mark(best["fraction"] >= KERNEL_TARGET),
                ]
            )
    return md_table(
        [
            "target",
            "measured (paper workload; slave counts whose sustained rate most repeats "
            "passed and the confirmation run confirmed)",
            "",
        ],
        rows,
    )


def workloads_table(data: dict) -> str:
    """One row per workload and slave count: sustained rate, search trail, delays at it, results per input tuple,
    window bytes per tuple."""
    rows = []
    groups = [("paper", data["points"])] + [(n, w["points"]) for n, w in data.get("workloads", {}).items()]
    for name, points in groups:
        for p in points:
            st = p["sustained"]
            at = st["runs"] or [r for r in p["search"]["runs"] if r["passed"]]
            per_input = median(r["results"] / r["input_total"] for r in at if r["input_total"])
            rows.append(
                [
                    name,
                    str(p["slaves"]),
                    fmt(st["rate"]),
                    trail_text(p["search"]["trail"]),
                    *(fmt(st[f"delay_{q}"], ".3f") for q in ("p50", "p95", "p99")),
                    fmt(per_input, ".2f"),
                    fmt(window_state([p], data["config"]["generator"]["tuple_bytes"])["bytes_per_tuple"], ".0f"),
                ]
            )
    return md_table(
        [
            "workload",
            "slaves",
            "sustained rate/s",
            "search (✓ pass, ✗ fail)",
            "delay p50 s",
            "p95 s",
            "p99 s",
            "results per input tuple",
            "window B/tuple",
        ],
        rows,
    )


def window_table(data: dict) -> str:
    tb = data["config"]["generator"]["tuple_bytes"]
    groups = [("paper", data["points"])] + [(n, w["points"]) for n, w in data.get("workloads", {}).items()]
    if data.get("tuning_off"):
        groups.append(("paper, tuning off", data["tuning_off"]["points"]))
    rows = []
    for name, points in groups:
        for p in points:
            ws = window_state([p], tb)
            rows.append(
                [
                    name,
                    str(p["slaves"]),
                    fmt(ws["bytes_per_tuple"], ".1f"),
                    str(tb),
                    fmt(ws["ratio"], ".2f"),
                    claim(data, ws["ratio"] <= WINDOW_TARGET if ws["ratio"] else None),
                ]
            )
    return md_table(
        ["workload", "slaves", "window B per stored tuple (median)", "raw tuple B", "ratio", f"<= {WINDOW_TARGET:g}x"],
        rows,
    )


def footprint_text(f: dict, tuple_bytes: int) -> str:
    return (
        f"Real bytes, measured in one process (`bench.kernel.window_footprint`: the join module of one "
        f"slave holding every partition-group, run over the whole paper workload, every allocation tracemalloc "
        f"sees that the module still holds at the end): {f['traced_bytes']:,} B for {f['stored_tuples']:,} "
        f"stored tuples = **{f['traced_per_tuple']:.1f} B per tuple** ({f['traced_per_tuple'] / tuple_bytes:.2f}x "
        f"the raw {tuple_bytes} B; `JoinModule.nbytes` counts {f['nbytes_per_tuple']:.1f} B)."
    )


def rss_table(points: list[dict]) -> str:
    """Per slave count, the peak RSS of every rank (largest over the paced runs) and of the unpaced probe."""
    rows = []
    for p in points:
        paced = rank_rss(paced_runs(p))
        probe = rank_rss([p["probe"]])
        rows.append(
            [
                str(p["slaves"]),
                fmt(paced.get(0), ".0f"),
                " ".join(f"{r}:{mb:.0f}" for r, mb in paced.items() if r) or "-",
                fmt(probe.get(0), ".0f"),
                " ".join(f"{r}:{mb:.0f}" for r, mb in probe.items() if r) or "-",
            ]
        )
    return md_table(
        [
            "slaves",
            "master MB (paced runs)",
            "slaves rank:MB (paced runs)",
            "master MB (probe)",
            "slaves rank:MB (probe)",
        ],
        rows,
    )


def span_table(kernel: dict) -> str:
    return md_table(
        ["batch span (s of event time)", "tuples/s (median)", "runs"],
        [[f"{s['span']:g}", fmt(s["rate"]), ", ".join(fmt(x) for x in s["runs"])] for s in kernel["spans"]],
    )


def kernel_table(data: dict) -> str:
    """The fraction of the limit per slave count; beside it (information, not the target) the fraction of the
    kernel that also computes delays and writes the result files, as a slave does."""
    k = data["kernel"]
    writing = (k.get("with_results") or {}).get("rate")
    rows = [
        [
            str(f["slaves"]),
            str(f["cores_used"]),
            fmt(f["rate"]),
            fmt(f["limit"]),
            fmt(f["fraction"], ".2f"),
            claim(data, f["fraction"] >= KERNEL_TARGET if f["fraction"] is not None else None)
            if data.get("quick") or confirmed(p)
            else "not confirmed",
            fmt(f["rate"] / (writing * f["cores_used"]) if writing else None, ".2f"),
        ]
        for p, f in ((p, kernel_fraction(p, k["rate"], k["cores"])) for p in data["points"])
    ]
    return md_table(
        [
            "slaves",
            "cores in use",
            "sustained rate/s",
            f"kernel {k['rate']:,.0f}/s x cores",
            "fraction",
            f">= {KERNEL_TARGET:g}",
            f"fraction of kernel + result files ({fmt(writing)}/s x cores)",
        ],
        rows,
    )


def tuning_table(data: dict) -> str:
    on = {p["slaves"]: p for p in data["points"]}
    rows = []
    for off in data["tuning_off"]["points"]:
        for name, p in (("on (default)", on.get(off["slaves"])), ("off (tuning.max_depth = 0)", off)):
            if p is None:
                continue
            rows.append(
                [
                    str(p["slaves"]),
                    name,
                    fmt(p["sustained"]["rate"]),
                    trail_text(p["search"]["trail"]),
                    *(fmt(p["sustained"][f"delay_{q}"], ".3f") for q in ("p50", "p99")),
                    fmt(
                        median(
                            sum(v["busy_seconds"] for v in r["slaves"].values()) / r["wall_seconds"]
                            for r in p["sustained"]["runs"]
                        ),
                        ".2f",
                    ),
                ]
            )
    return md_table(
        [
            "slaves",
            "extendible-hash tuning",
            "sustained rate/s",
            "search",
            "delay p50 s",
            "p99 s",
            "slave busy s per wall s",
        ],
        rows,
    )


def epochs_table(sweep: dict) -> str:
    rows = [
        [
            f"{r['epoch']:g}",
            fmt(r["rate"]),
            "yes" if r["kept_up"] else "FELL BEHIND",
            *(fmt(r[f"delay_{q}"], ".3f") for q in ("p50", "p95", "p99")),
            fmt(comm_per_slave(r), ".3f"),
            fmt(comm_per_slave(r) / r["wall_seconds"], ".1%"),
            fmt(median(v["busy_seconds"] for v in r["slaves"].values()), ".2f"),
        ]
        for r in sweep["runs"]
    ]
    return md_table(
        [
            "epochs.distribution s",
            "pacing/s",
            "kept up",
            "delay p50 s",
            "p95 s",
            "p99 s",
            "comm s per slave",
            "comm share of wall",
            "busy s per slave",
        ],
        rows,
    )


def report_sections(data: dict) -> list[str]:
    """The report's sections for everything this module adds; the targets table goes near the top."""
    parts = [
        "## Delay against input rate",
        "",
        "Every paced run of the paper workload's search (and its repeats) is one point: production delay "
        "against the pacing rate, per slave count (paper 003, figures 5-8). Crosses: runs that fell behind.",
        "",
        "![delay against input rate](delay_rate.png)",
        "",
    ]
    if data.get("workloads"):
        parts += [
            "## Workloads",
            "",
            "The same search per workload (each reproducible by `generator.seed`; settings on top of the bench's):",
            "",
            *(
                f"- **{n}**: {WORKLOADS[n][0]} (`{' '.join(WORKLOADS[n][1]) or 'defaults'}`)"
                for n in ["paper", *data["workloads"]]
            ),
            "",
            workloads_table(data),
            "",
        ]
        for name, w in data["workloads"].items():
            parts += [f"### Workload {name}", "", WORKLOADS[name][0], "", summary_table(w["points"]), ""]
            for p in w["points"]:
                parts += [f"{p['slaves']} slave(s):", "", detail_table(p), ""]
    if data.get("tuning_off"):
        parts += [
            "## Extendible-hash tuning on and off",
            "",
            "The paper workload's search with `tuning.max_depth = 0` (one bucket per partition-group, never "
            "split) beside the default tuning (paper 003, figures 9-10). Busy seconds per wall second: the "
            "slaves' join time summed, over the run's wall time, median of the runs at the sustained rate.",
            "",
            tuning_table(data),
            "",
            "![tuning on and off](tuning.png)",
            "",
        ]
        for p in data["tuning_off"]["points"]:
            parts += [f"Tuning off, {p['slaves']} slave(s):", "", detail_table(p), ""]
    if data.get("epochs"):
        sw = data["epochs"]
        parts += [
            "## Distribution-epoch sweep",
            "",
            f"{sw['slaves']} slave(s), paced at {sw['rate']:,.0f}/s ({HALF_LOAD:.0%} of the paper workload's "
            f"sustained rate there), one run per `epochs.distribution` (paper 003, figures 13-14). "
            "Communication seconds: per slave, the time from a probed message to its end of reception plus "
            "the time sending reports (summary `comm_seconds`), averaged over the slaves.",
            "",
            epochs_table(sw),
            "",
            "![distribution-epoch sweep](epochs.png)",
            "",
        ]
    parts += [
        "## Window state per stored tuple",
        "",
        "The slaves' window state at the end of each run (rows storage with its growth slack, the per-block "
        "newest ts, the extendible-hash directory: `JoinModule.nbytes`) over the tuples stored then; median "
        "over the paced runs. Target: at most "
        f"{WINDOW_TARGET:g}x the raw tuple bytes (`generator.tuple_bytes`).",
        "",
        window_table(data),
        "",
        *(
            [footprint_text(data["kernel"]["footprint"], data["config"]["generator"]["tuple_bytes"]), ""]
            if (data.get("kernel") or {}).get("footprint")
            else []
        ),
        "## Peak RSS per rank",
        "",
        "Largest resident set of each rank (0 = the master; from the slaves' reports and the master's "
        "getrusage) over the paced runs of each slave count, and in the unpaced probe, whose master "
        "buffers the whole input.",
        "",
        rss_table(data["points"]),
        "",
    ]
    if data.get("kernel"):
        k = data["kernel"]
        parts += [
            "## Against the single-core limit",
            "",
            f"`bench.kernel`'s own join module in one process on the same workload ({k['tuples']:,} "
            "tuples), in batches of one distribution epoch of event time and of longer spans: a paced run goes "
            "through event time many times faster than wall time, so a slave's batch spans seconds of event "
            "time, and a longer batch costs less per tuple (each probes the stored window once). The best "
            f"span, {k.get('span', 0):g} s, gives {k['rate']:,.0f} tuples/s (median of {len(k['runs'])}: "
            f"{', '.join(f'{x:,.0f}' for x in k['runs'])}). The limit is that times the cores the cluster's "
            f"ranks can use (slaves + master, at most the machine's {k['cores']}). Target: at least "
            f"{KERNEL_TARGET:g}.",
            "",
            *([span_table(k), ""] if k.get("spans") else []),
            kernel_table(data),
            "",
        ]
        if k.get("with_results"):
            w = k["with_results"]
            parts += [
                f"The last column: the same module on the same batches also computing every result's delay and "
                f"writing the result files as a slave does (snappy Parquet, its writing thread on the same "
                f"core): {w['rate']:,.0f} tuples/s (median of {len(w['runs'])}: "
                f"{', '.join(f'{x:,.0f}' for x in w['runs'])}), {w['rate'] / k['rate']:.2f}x the join alone. "
                "It is the cluster's per-tuple work without the master and the messages; the target is "
                "against the join alone.",
                "",
            ]
    return parts


# --------------------------------------------------------------------------- running


def kernel_limit(settings: list[str], repeats: int) -> dict:
    """The single-core kernel's rate on the bench's workload: bench.kernel's own join module, median of
    `repeats`, on batches of one distribution epoch and of each of `LONGER_SPANS` of event time; the best span's
    median is the limit.  And the real bytes of its window state after the input (`window_footprint`)."""
    plan = load_plan(None, settings)
    data = generate_all(plan.generator)
    spans = {span: {"rate": median(runs), "runs": runs} for span, runs in own_by_span(plan, data, repeats)[0].items()}
    footprint = window_footprint(plan, epoch_batches(plan, None, data)[1])
    best = max(spans, key=lambda s: spans[s]["rate"])
    writing = with_results(plan, data, best, repeats)
    print(
        f"bench: single-core limit {spans[best]['rate']:,.0f} tuples/s ({best:g} s batches), "
        f"{median(writing):,.0f} with delays and result files; its window state "
        f"{footprint['traced_per_tuple']:.1f} B per stored tuple (tracemalloc)",
        flush=True,
    )
    return {
        "rate": spans[best]["rate"],
        "runs": spans[best]["runs"],
        "span": best,
        "spans": [{"span": s, **v} for s, v in spans.items()],
        "tuples": len(data.ts),
        "with_results": {"rate": median(writing), "runs": writing},
        "cores": len(os.sched_getaffinity(0)),
        "footprint": footprint,
    }


def epoch_sweep(new_bench, points: list[dict], slaves: int, epochs: list[float]) -> dict | None:
    """One run per distribution epoch at half the paper workload's sustained rate for `slaves`; None when that
    slave count has no sustained rate."""
    base = next((p for p in points if p["slaves"] == slaves), None)
    if base is None or not base["sustained"]["rate"]:
        print(f"bench: no epoch sweep: no sustained rate for {slaves} slave(s)", flush=True)
        return None
    rate = round(HALF_LOAD * base["sustained"]["rate"])
    runs = []
    for e in epochs:
        bench = new_bench([f"epochs.distribution={e!r}"], f"epoch{e:g}-")
        bench.total_runs = 1
        r = bench.run_at(slaves, "epoch sweep", rate)
        runs.append({"epoch": e, **r})
    return {"slaves": slaves, "rate": rate, "runs": runs}


def plot(out: Path, data: dict, delay_bound: float) -> list[Path]:
    """delay_rate.png, and tuning.png / epochs.png when those parts ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    thousands = matplotlib.ticker.FuncFormatter(lambda y, _: f"{y / 1000:,.0f}k")

    def delay_rate(name: str, title: str, curves: list[tuple[dict, str, str, str]]) -> None:
        """One figure of delay p95 against the paced rate: a (point, color, label, line style) per curve."""
        fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
        highest = max((r["delay_p95"] or 0 for p, *_ in curves for r in paced_runs(p)), default=0)
        top = min(1.1 * highest, OFF_SCALE * delay_bound)  # one overloaded run must not flatten the rest
        for p, color, label, ls in curves:
            runs = paced_runs(p)
            ax.plot(
                [r["rate"] for r in runs],
                [r["delay_p95"] for r in runs],
                ls,
                marker="o",
                ms=3,
                color=color,
                label=label,
            )
            bad = [r for r in runs if not r["kept_up"]]
            ax.scatter([r["rate"] for r in bad], [r["delay_p95"] for r in bad], marker="x", s=40, color=color, zorder=3)
        ax.axhline(delay_bound, color="grey", ls=":", lw=1, label=f"p95 bound {delay_bound:g} s")
        ax.set(
            title=title,
            xlabel="paced input rate (tuples/s)",
            ylabel="delay p95 (s)" + (f"; cut at {top:g} s, highest {highest:.1f} s" if highest > top else ""),
        )
        ax.title.set_fontsize(10)
        ax.xaxis.set_major_formatter(thousands)
        ax.set_ylim(0, top if top > 0 else None)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out / name)
        fig.savefig(paths[-1])

    paths: list[Path] = []
    delay_rate(
        "delay_rate.png",
        "Delay p95 against input rate (paper workload; x: fell behind)",
        [(p, f"C{i}", f"{p['slaves']} slave(s)", "-") for i, p in enumerate(data["points"])],
    )
    if data.get("tuning_off"):
        on = {p["slaves"]: p for p in data["points"]}
        curves = []
        for i, off in enumerate(data["tuning_off"]["points"]):
            if off["slaves"] in on:
                curves.append((on[off["slaves"]], f"C{i}", f"{off['slaves']} slave(s), tuning on", "-"))
            curves.append((off, f"C{i}", f"{off['slaves']} slave(s), tuning off", "--"))
        delay_rate("tuning.png", "Extendible-hash tuning on and off: delay p95 against input rate", curves)

    if data.get("epochs"):
        sw = data["epochs"]
        es = [r["epoch"] for r in sw["runs"]]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=120)
        for q, color in (("p50", "C0"), ("p99", "C3")):
            a1.plot(es, [r[f"delay_{q}"] for r in sw["runs"]], "o-", color=color, label=f"delay {q}")
        a1.plot(es, es, ":", color="grey", label="one epoch")
        a1.set(title="delay against distribution epoch", xlabel="epochs.distribution (s)", ylabel="delay (s)")
        a2.plot(es, [comm_per_slave(r) for r in sw["runs"]], "o-", color="C2")
        a2.set(title="communication seconds per slave", xlabel="epochs.distribution (s)", ylabel="seconds per run")
        for a in (a1, a2):
            a.set_xscale("log")
            a.set_xticks(es, [f"{e:g}" for e in es])
            a.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            a.set_ylim(bottom=0)
            a.grid(alpha=0.3)
        a1.legend(fontsize=8)
        fig.suptitle(f"{sw['slaves']} slave(s) paced at {sw['rate']:,.0f}/s", fontsize=10)
        fig.tight_layout()
        paths.append(out / "epochs.png")
        fig.savefig(paths[-1])
    plt.close("all")
    return paths
