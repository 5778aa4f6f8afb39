"""The main bench's report: report.md (summary, targets, caveats, method, every run, the peer and the paper's
sections) and its plots capacity.png and delay.png."""

from __future__ import annotations

from pathlib import Path

from bench import paper
from bench.search import (
    FIRST_FRACTION,
    FLAT_FACTOR,
    HALF_LOAD,
    KEEP_UP_LAG,
    KEEP_UP_SHARE,
    MAX_FAILS_WITHOUT_PASS,
    MIN_INPUT_SECONDS,
    PROBE_MARGIN,
)
from bench.spark import report_section
from bench.tables import count, detail_table, fmt, krate, md_table, search_line, summary_table, to_toml

QUICK_NOTE = "quick: runs too short to measure capacity; no target is claimed"


def inputs_table(inputs: list[dict]) -> str:
    """The input files the runs read: path, tuples, size, event-time length, and whether this bench wrote them."""
    return md_table(
        ["input file", "tuples", "MB", "generator.duration s", "this bench"],
        [
            [
                f"`{i['path']}`",
                fmt(i["tuples"]),
                fmt(i["bytes"] / 1e6),
                f"{i['generator']['duration']:g}",
                f"generated in {i['generate_seconds']:.0f} s" if i.get("generated") else "from the cache",
            ]
            for i in inputs
        ],
    )


def caveats(data: dict) -> list[str]:
    """Warnings the numbers call for: the unpaced probe's meaning, a search that found no passing rate or no
    failing one, repeats at the sustained rate that did not pass, half-load runs that fell behind."""
    points, bound = data["points"], data["delay_bound"]
    total = max(p["probe"]["input_total"] + p["probe"]["late"] for p in points)
    buf = data["config"]["master"]["buffer_capacity"]
    out = [
        "The unpaced throughput is not a capacity: an unpaced run works off a backlog in large batches"
        + (
            f" (the whole input, {total:,} tuples, fits in master.buffer_capacity = {buf:,}, so it is ingested at once)"
            if total <= buf
            else ""
        )
        + ", and its start and drain weigh on it; it sets the "
        "search's first rate, and the search goes above it once a pass comes within 10% of it."
    ]
    none = [p for p in points if not p["sustained"]["rate"]]
    if none:
        out.append(
            "No paced rate passed for "
            + ", ".join(
                f"{p['slaves']} slave(s) (down to {min(r for r, _ in p['search']['trail']):,.0f}/s)" for p in none
            )
            + f": the sustained rate is reported as 0; a larger --delay-bound (now {bound:g} s) may be needed."
        )
    open_top = [p for p in points if p["sustained"]["rate"] and p["search"]["bracket"][1] is None]
    if open_top:
        out.append(
            "No search run failed for "
            + ", ".join(f"{p['slaves']} slave(s)" for p in open_top)
            + ": the sustained rate is only a lower bound; more --steps search higher."
        )
    if data.get("quick"):
        out.insert(
            0,
            f"{QUICK_NOTE[0].upper()}{QUICK_NOTE[1:]}: its paced runs read the workload as it is, "
            f"not sized to last {MIN_INPUT_SECONDS:g} s at their rates (at the rates a cluster sustains "
            "here, about a second: a backlog cannot show), and there is no confirmation run, so its rates "
            "are the search's, not capacities.",
        )
    unconfirmed = [p for p in points if p.get("confirm") and not p["confirm"]["confirmed"]]
    if unconfirmed:
        out.append(
            "The confirmation run did not confirm the sustained rate of "
            + ", ".join(
                f"{p['slaves']} slave(s) "
                f"({p['confirm']['verdict'] if not p['confirm']['passed'] else 'delay p99 climbed'})"
                for p in unconfirmed
            )
            + ": those rates count for no target."
        )
    weak = [p for p in points if p["sustained"]["runs"] and not all(r["passed"] for r in p["sustained"]["runs"])]
    if weak:
        out.append(
            "At the sustained rate not every repeat passed (kept up and delay p95 <= "
            f"{bound:g} s): "
            + ", ".join(f"{p['slaves']} slave(s) {count(p['sustained']['runs'], 'passed')}" for p in weak)
            + ". The search decides on single runs, so on a noisy machine the sustained rate can be "
            "optimistic; the repeats' medians show what that rate gives typically."
        )
    behind = [p for p in points if p["half"]["runs"] and not all(r["kept_up"] for r in p["half"]["runs"])]
    if behind:
        out.append(
            "At half the sustained rate the cluster fell behind its pacing for "
            + ", ".join(f"{p['slaves']} slave(s) ({count(p['half']['runs'], 'kept_up')} kept up)" for p in behind)
            + ": those runs were disturbed (the machine is shared)."
        )
    return out


def write_report(out: Path, data: dict) -> None:
    m, n, cfg, bound = data["machine"], data["repeats"], data["config"], data["delay_bound"]
    runs = paper.cluster_runs(data)
    parts = [
        "# Stream-join benchmark",
        "",
        f"`{data['command']}` — {m['date']}; {runs} runs in {data['bench_seconds']:.0f} s",
        "",
        "## Machine",
        "",
        f"- CPU: {m['cpu']}, {m['cores']} cores; memory {m['memory_gib']} GiB; {m['os']}",
        f"- Python {m['python']}, numpy {m['numpy']}, mpi4py {m['mpi4py']}, {m['open_mpi']}",
        f"- load average when the bench started: {' '.join(map(str, m['load_average_at_start']))}",
        "",
        *([f"**{QUICK_NOTE}.**", ""] if data.get("quick") else []),
        "## Summary",
        "",
        summary_table(data["points"], bool(data.get("quick"))),
        "",
        *([] if data.get("quick") else [paper.targets_table(data), ""]),
        *(f"**Caveat:** {c}\n" for c in caveats(data)),
        "## Method",
        "",
        "The capacity is the **sustained input rate**: the highest paced input rate (`source.rate`) at which the "
        "cluster keeps up with its pacing and the production delay stays bounded (the paper's capacity: the "
        "highest input rate before the production delay climbs). Per slave count:",
        "",
        "1. **probe**: one unpaced run (`source.rate = 0`); its throughput (tuples in / wall time) is the "
        "**unpaced throughput** U, not a capacity (see the caveat): it sets where the search starts.",
        f"2. **search**: {data['steps']} single paced runs at most. A run **passes** iff it kept up (below) **and** "
        f"its delay p95 <= {bound:g} s (`--delay-bound`; `epochs.distribution` is "
        f"{cfg['epochs']['distribution']:g} s). The first rate is {FIRST_FRACTION:g} U; while no run has passed "
        f"the rate is halved (giving up after {MAX_FAILS_WITHOUT_PASS} failures: sustained rate 0); then each rate "
        "is the geometric mean of the highest passing rate and the lowest failing rate above it (U while none "
        f"has failed, twice the passing rate once that is within {1 - PROBE_MARGIN:.0%} of U). The **sustained rate** "
        "is the highest passing rate; the true one lies between it and the "
        "lowest failing rate above it:",
        *("   " + search_line(p) for p in data["points"]),
        "",
        f"3. **sustained**: {n} runs paced at the sustained rate; the table gives the medians of their achieved "
        "throughput and delay percentiles, how many kept up and how many passed the search's test.",
        f"4. **half**: {n} runs paced at {HALF_LOAD:.0%} of the sustained rate: the delay at half load (medians).",
        "5. **confirm**: "
        + (
            f"one run paced at the sustained rate over {data['confirm_seconds']:g} s of input. The "
            "rate is **confirmed** iff that run passes the search's test and its delay p99 in the last quarter of the "
            f"input is at most {FLAT_FACTOR:g}x, or one distribution epoch more than, that of the first quarter "
            "(whichever allows more): a backlog that grows slowly shows only over a long run. A quarter's p99 is the "
            "median of the per-second delay p99s of the master's metrics log while that quarter of the input came in. "
            "Its result files (0.9 per input tuple, about 19 bytes each on disk) are deleted as they are written, "
            "so its "
            "overall percentiles are the summary's (upper edges of 12.2% bins). Targets and the ratio to the peer "
            "count only slave counts whose rate most repeats passed and the confirmation run confirmed."
            if data.get("confirm_seconds")
            else "none (`--confirm-seconds 0` or `--quick`): no rate is confirmed, so no target is claimed."
        ),
        "",
        (
            f"**Input length.** A paced run counts toward a sustained rate only if its input lasts at least "
            f"{MIN_INPUT_SECONDS:g} s at its rate (tuples / rate; the run tables show it): over a shorter run a "
            "cluster "
            "below the rate ends only slightly behind. Each paced run reads a generated file at least that long "
            "(bench.inputs: lengths on a ladder of factor 1.41, so runs last up to 1.41x the minimum); the unpaced "
            "probe, and a rate the workload's own length already holds for that long, read the workload as it is. "
            "A shorter run is reported and marked too short to count."
            if not data.get("quick")
            else "**Input length.** Quick runs read the workload as it is, not sized to the "
            f"{MIN_INPUT_SECONDS:g} s of "
            f"input a run needs to count (the runs tables show each run's): {QUICK_NOTE}."
        ),
        "",
        *(
            [
                "Input files (generated once, kept in the cache folder between runs and invocations):",
                "",
                inputs_table(data["inputs"]),
                "",
            ]
            if data.get("inputs")
            else []
        ),
        f"Every median is over {n} runs on a shared, noisy {m['cores']}-core machine; with more ranks than cores "
        "the ranks share cores (Open MPI `--oversubscribe`), so more slaves need not mean more capacity here.",
        "",
        "- In paced runs a tuple's arrival is its nominal pacing time, so the delay is end-to-end and includes any "
        "backlog in the master. (In the unpaced probe arrival is when the master ingested the tuple, so its "
        "delays, in the run tables, measure back-pressure.)",
        f"- A paced run *kept up* iff it never fell more than {KEEP_UP_LAG:g} s, nor more than "
        f"{KEEP_UP_SHARE:.0%} of its input's scheduled length (tuples / rate), behind: neither the master's ingest "
        "behind the pacing schedule (summary `pacing_lag_max_seconds`) nor a tuple in the master's mini-buffers "
        "beyond one distribution epoch (`backlog_max_seconds`); the lag column is the larger. The achieved rate "
        "(tuples / wall time) is "
        "shown too but is not the test: its wall time includes start-up and the final drain.",
        "- Input: "
        + (
            "generated by the master as it runs (`source.kind = generator`), so the cluster's CPU "
            "includes making the tuples"
            if data.get("input", "generator") == "generator"
            else "read from Parquet files of the same generated tuples written before the runs "
            "(`--input file`, `source.kind = file`; the master streams them, a few batches ahead)"
        )
        + ".",
        "- Delay percentiles are exact: every result row carries its production delay, and the bench reads them "
        "from the result files (the cluster's own summary gives upper edges of log-spaced bins, up to 12.2% "
        "higher).",
        "- Peak RSS is the largest resident set of any one process (master or a slave) over all runs of that slave "
        "count; the unpaced probe, which fills the master's buffers (`master.buffer_capacity`), usually sets it.",
        "",
        "![sustained rate vs slaves](capacity.png)",
        "",
        "![delay at the sustained rate and at half of it vs slaves](delay.png)",
        "",
        "## Runs per slave count",
        "",
    ]
    for p in data["points"]:
        parts += [f"### {p['slaves']} slave(s), {p['ranks']} ranks", "", detail_table(p), ""]
    if data.get("peer"):
        parts += report_section(data["points"], data["peer"], bound)
    parts += paper.report_sections(data)
    parts += [
        "Window B/tuple: the slaves' allocated window bytes over stored tuples at the end of the run "
        f"(at least generator.tuple_bytes = {cfg['generator']['tuple_bytes']}; the excess is growth slack, the "
        "per-block index and the directories). "
        "Lag: wall time minus the paced schedule (tuples / pacing rate).",
        "",
        "## Configuration",
        "",
        f"Workload settings: `{' '.join(data['workload']) or 'defaults'}`; `source.rate` as above; "
        "`output.progress = 0`; every other key is the default.",
        "",
        "```toml",
        to_toml({s: v for s, v in cfg.items() if s != "output"}),
        "```",
        "",
    ]
    (out / "report.md").write_text("\n".join(parts))


def plot(out: Path, points: list[dict], delay_bound: float, peer: dict | None = None) -> list[Path]:
    """capacity.png (sustained rate, unpaced probe, search runs, the peer's sustained rate as a line) and
    delay.png (delay p50/p99 at the sustained rate and at half of it): medians as lines, single runs as faint
    dots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = [p["slaves"] for p in points]
    thousands = matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:,.0f}")

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    ax.plot(ks, [p["unpaced"] for p in points], "s--", color="C7", alpha=0.45, label="unpaced throughput (probe)")
    ax.plot(ks, [p["sustained"]["rate"] for p in points], "o-", color="C0", lw=2, label="sustained rate")
    for passed, style in (
        (True, dict(marker="o", facecolors="none", edgecolors="C2", label="search run: passed")),
        (False, dict(marker="x", color="C3", label="search run: failed")),
    ):
        rates = [(p["slaves"] + 0.06, r) for p in points for r, ok in p["search"]["trail"] if ok == passed]
        ax.scatter([x for x, _ in rates], [y for _, y in rates], alpha=0.7, s=24, zorder=3, **style)
    if peer:
        ax.axhline(
            peer["sustained"]["rate"],
            color="C1",
            ls="-.",
            label=f"Spark local[{peer['cores']}] sustained rate ({peer['sustained']['rate']:,.0f}/s)",
        )
    ax.set(
        title=f"Sustained input rate (kept up, delay p95 ≤ {delay_bound:g} s)",
        xlabel="slaves",
        ylabel="tuples/s",
        xticks=ks,
    )
    ax.set_ylim(bottom=0)
    ax.margins(x=0.12)
    if len(ks) == 1:  # one slave count: give the offset search dots room
        ax.set_xlim(ks[0] - 0.5, ks[0] + 0.5)
    ax.yaxis.set_major_formatter(thousands)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths = [out / "capacity.png"]
    fig.savefig(paths[0])

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for kind, style, what in (("sustained", "-", "at sustained rate"), ("half", "--", "at half of it")):
        for q, color in (("p50", "C0"), ("p99", "C3")):
            ax.plot(
                ks,
                [p[kind][f"delay_{q}"] for p in points],
                "o" + style,
                color=color,
                alpha=1.0 if kind == "sustained" else 0.6,
                label=f"{q} {what}",
            )
            for p in points:
                ys = [r[f"delay_{q}"] for r in p[kind]["runs"] if r[f"delay_{q}"] is not None]
                ax.scatter([p["slaves"]] * len(ys), ys, color=color, alpha=0.25, s=14, zorder=3)
    ax.axhline(delay_bound, color="grey", ls=":", lw=1, label=f"p95 bound {delay_bound:g} s")
    for p in points:  # each slave count has its own sustained rate: say what it is and whether its runs kept up
        st = p["sustained"]
        if st["runs"]:
            kept = sum(r["kept_up"] for r in st["runs"])
            ax.annotate(
                f"{krate(st['rate'])}/s\nkept up {kept}/{len(st['runs'])}",
                (p["slaves"], max(st["delay_p99"] or 0, delay_bound)),
                textcoords="offset points",
                xytext=(0, 8),
                ha="center",
                fontsize=8,
                color="black" if kept == len(st["runs"]) else "C3",
            )
    ax.set(
        title="Production delay at the sustained rate and at half of it (medians)",
        xlabel="slaves  (dots: single runs)",
        ylabel="delay (s)",
        xticks=ks,
    )
    ax.title.set_fontsize(10)
    ax.margins(x=0.12, y=0.25)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    paths.append(out / "delay.png")
    fig.savefig(paths[1])
    plt.close("all")
    return paths
