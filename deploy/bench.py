"""`python -m deploy.bench [--quick] [--slaves 1,2,4] [--repeats 3] [--out DIR]`: capacity and delay per cluster size.

For each slave count k (k + 1 ranks) on the default generated workload:

* capacity: unpaced runs (source.rate = 0); the sustained input rate is the
  summary's throughput_tuples_per_s, and the capacity is its median over the
  repeats.  Delays here include the time tuples wait in the master's queue;
* delay at load: runs paced at half the median capacity, where the delay is the
  engine's own (arrival is the nominal pacing time), plus a check that the run
  kept up with its pacing.

Every number is a median of `repeats` runs because the machine is shared and
noisy.  Output: report.md, results.json (all raw numbers) and PNG plots.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from deploy.launch import find_mpirun, mpi_env, mpirun_command

RUN_TIMEOUT = 600.0  # seconds per cluster run
HALF_LOAD = 0.5      # pacing rate as a fraction of the measured capacity
KEEP_UP_RATIO = 0.9  # a paced run kept up if it ingested at >= 90% of the pacing rate ...
KEEP_UP_LAG = 1.0    # ... or finished within 1 s of its schedule (one end-of-run drain: a 0.5 s epoch + last batch)


class RunFailed(Exception):
    """A cluster run exited non-zero, wrote no summary, or timed out; the message has its stderr tail."""


# --------------------------------------------------------------------------- pure helpers

def parse_slaves(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]; each slave count must be a positive integer."""
    try:
        ks = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected slave counts like 1,2,4, got {text!r}") from None
    if not ks or min(ks) < 1:
        raise argparse.ArgumentTypeError(f"slave counts must be positive integers, got {text!r}")
    return ks


def median(values) -> float | None:
    """Median of the values that exist (None and NaN are runs without that number); None if there are none."""
    xs = [float(v) for v in values if v is not None and not math.isnan(v)]
    return statistics.median(xs) if xs else None


def keep_up(tuples: int, wall: float, rate: float) -> dict:
    """Did a paced run keep up?  Achieved rate vs pacing, and how late it finished against its schedule."""
    achieved = tuples / wall if wall > 0 else 0.0
    lag = wall - tuples / rate
    return {"achieved_rate": round(achieved, 1), "ratio": round(achieved / rate, 3), "lag_seconds": round(lag, 3),
            "kept_up": achieved >= KEEP_UP_RATIO * rate or lag <= KEEP_UP_LAG}


def fmt(v, spec: str = ",.0f", missing: str = "-") -> str:
    return missing if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def md_table(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub markdown table with columns padded, so it also reads well on a terminal."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def summary_table(points: list[dict]) -> str:
    """One row per slave count: capacity median and repeats, unpaced delay, delay at half load (medians)."""
    header = ["slaves", "capacity tuples/s (median)", "capacity repeats", "unpaced delay p50/p99 s",
              "half-load rate/s", "delay p50 s", "p95 s", "p99 s", "max s", "kept up", "peak RSS MB"]
    rows = []
    for p in points:
        c, h = p["capacity"], p["half_load"]
        rows.append([str(p["slaves"]), fmt(c["median"]), " ".join(fmt(r["throughput"]) for r in c["runs"]),
                     f"{fmt(c['delay_p50'], '.3f')} / {fmt(c['delay_p99'], '.3f')}", fmt(h["rate"]),
                     *(fmt(h[f"delay_{q}"], ".3f") for q in ("p50", "p95", "p99", "max")),
                     f"{sum(r['kept_up'] for r in h['runs'])}/{len(h['runs'])}",
                     fmt(max((r["peak_rss_mb"] or 0 for r in c["runs"] + h["runs"]), default=None), ".0f")])
    return md_table(header, rows)


def run_numbers(s: dict) -> dict:
    """The numbers kept from one summary.json (the config is kept once, the result files not at all)."""
    slaves = s["slaves"].values()
    wt, wb = sum(v["window_tuples"] for v in slaves), sum(v["window_bytes"] for v in slaves)
    d = s["delay_seconds"]
    nan_none = lambda x: None if x is None or math.isnan(x) else x
    return {"input_total": s["input_total"], "late": s["late"], "results": s["results"],
            "wall_seconds": s["wall_seconds"], "throughput": s["throughput_tuples_per_s"],
            **{f"delay_{q}": nan_none(d[q]) for q in ("p50", "p95", "p99", "max")},
            "window_bytes_per_tuple": round(wb / wt, 1) if wt else None,
            "slaves": {r: {k: v[k] for k in ("tuples_processed", "window_tuples", "window_bytes", "busy_seconds")}
                       for r, v in s["slaves"].items()}}


def aggregate(runs: list[dict]) -> dict:
    """Medians over the repeats of one kind of run."""
    return {f"delay_{q}": median(r[f"delay_{q}"] for r in runs) for q in ("p50", "p95", "p99", "max")}


# --------------------------------------------------------------------------- running the cluster

def _session_pids(sid: int) -> list[int]:
    """Processes still in the session a run was started in (mpirun and its ranks)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # after "pid (comm)": state ppid pgrp session
            pids.append(int(stat.parent.name))
    return pids


def _exited(pid: int, timeout: float) -> bool:
    """Wait up to `timeout` s for the run's mpirun to exit, leaving it unreaped (its pid stays ours)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT):
            return True
        time.sleep(0.05)
    return False


def _end_session(pid: int) -> None:
    """SIGTERM to mpirun (it ends the job), then SIGKILL to whatever of the run is left."""
    os.kill(pid, signal.SIGTERM)
    _exited(pid, 10)
    for p in _session_pids(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_cluster(ranks: int, settings: list[str], workdir: Path, timeout: float) -> dict:
    """One `mpirun -n ranks python -m master --set ...` into workdir; its summary.json, plus its peak RSS.

    The run gets a session of its own so a hung (or interrupted) run can be ended
    completely; os.wait4 gives the largest RSS of any process in it (prterun reaps
    the ranks) at no cost.
    """
    workdir.mkdir(parents=True)
    out = workdir / "out"
    args = [a for kv in [*settings, f"output.path={out}", "output.progress=0"] for a in ("--set", kv)]
    with open(workdir / "stdout", "wb") as so, open(workdir / "stderr", "wb") as se:
        proc = subprocess.Popen(mpirun_command(ranks, args), env=mpi_env(), stdout=so, stderr=se,
                                start_new_session=True)
    try:
        timed_out = not _exited(proc.pid, timeout)
    except BaseException:  # Ctrl-C: the run is in its own session and did not get the signal
        timed_out = True
        raise
    finally:
        if timed_out:
            _end_session(proc.pid)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    tail = "\n".join((workdir / "stderr").read_text(errors="replace").splitlines()[-30:])
    summary = out / "summary.json"
    if timed_out or proc.returncode != 0 or not summary.exists():
        why = f"timed out after {timeout:.0f}s" if timed_out else f"exit code {proc.returncode}"
        raise RunFailed(f"{why}: {' '.join(proc.args)}\n--- stderr tail ---\n{tail}")
    s = json.loads(summary.read_text())
    s["peak_rss_mb"] = round(usage.ru_maxrss / 1024, 1)  # Linux reports KiB
    shutil.rmtree(workdir)  # result files can be large; the summary is all we need
    return s


class Bench:
    """Runs the plan, prints a line per run, and keeps every number for results.json."""

    def __init__(self, slaves: list[int], repeats: int, workload: list[str], timeout: float, tmp: Path):
        self.slaves, self.repeats, self.workload, self.timeout, self.tmp = slaves, repeats, workload, timeout, tmp
        self.total_runs, self.done = 2 * repeats * len(slaves), 0
        self.config: dict | None = None

    def _run(self, k: int, label: str, rate: float) -> dict:
        self.done += 1
        s = run_cluster(k + 1, [*self.workload, f"source.rate={rate!r}"],
                        self.tmp / f"k{k}-{label.replace(' ', '').replace('#', '-')}", self.timeout)
        self.config = self.config or s["config"]
        r = {**run_numbers(s), "peak_rss_mb": s["peak_rss_mb"]}
        if rate > 0:
            r.update(rate=rate, **keep_up(r["input_total"] + r["late"], r["wall_seconds"], rate))
        line = (f"[{self.done:>2}/{self.total_runs}] slaves={k} {label:<12} {r['throughput']:>10,.0f} tuples/s in "
                f"{r['wall_seconds']:5.1f}s | delay p50 {fmt(r['delay_p50'], '.3f')}s p99 {fmt(r['delay_p99'], '.3f')}s"
                f" | peak RSS {r['peak_rss_mb']:.0f} MB")
        if rate > 0:
            line += f" | paced {rate:,.0f}/s: {r['ratio']:.0%} {'kept up' if r['kept_up'] else 'FELL BEHIND'}"
        print(line, flush=True)
        return r

    def point(self, k: int) -> dict:
        """Capacity runs, then runs paced at half the median capacity, for k slaves."""
        cap = [self._run(k, f"capacity #{i + 1}", 0.0) for i in range(self.repeats)]
        capacity = median(r["throughput"] for r in cap)
        rate = round(HALF_LOAD * capacity)
        half = [self._run(k, f"half-load #{i + 1}", float(rate)) for i in range(self.repeats)]
        return {"slaves": k, "ranks": k + 1,
                "capacity": {"median": capacity, **aggregate(cap), "runs": cap},
                "half_load": {"rate": rate, **aggregate(half), "runs": half}}


# --------------------------------------------------------------------------- machine, report, plots

def machine_info() -> dict:
    """What the numbers depend on: CPU, cores, memory, software versions, load when the bench started."""
    import mpi4py
    import numpy
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or "unknown")
    mem_kib = next((int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                    if line.startswith("MemTotal:")), 0)
    ompi = subprocess.run([find_mpirun(), "--version"], capture_output=True, text=True).stdout.splitlines()
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem_kib / 2**20, 1),
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
            "os": platform.platform(), "python": platform.python_version(), "numpy": numpy.__version__,
            "mpi4py": mpi4py.__version__, "open_mpi": ompi[0] if ompi else "unknown",
            "date": dt.datetime.now().astimezone().isoformat(timespec="seconds")}


def caveats(data: dict) -> list[str]:
    """Warnings the numbers themselves call for: overloaded half-load runs, an input that fits the master's buffers."""
    out = []
    behind = []
    for p in data["points"]:
        runs = p["half_load"]["runs"]
        if not all(r["kept_up"] for r in runs):
            behind.append(f"{p['slaves']} slave(s) ({sum(not r['kept_up'] for r in runs)}/{len(runs)} runs)")
    if behind:
        out.append(f"At half of the unpaced capacity the cluster fell behind its pacing for {', '.join(behind)}: "
                   "the unpaced capacity overstates the rate it sustains when paced, and those delays are the "
                   "delays of an overloaded cluster (they include the backlog built up behind the pacing schedule).")
    total = max(r["input_total"] + r["late"] for p in data["points"] for r in p["capacity"]["runs"])
    if total <= data["config"]["master"]["buffer_capacity"]:
        out.append(f"The whole input ({total:,} tuples) fits in master.buffer_capacity "
                   f"({data['config']['master']['buffer_capacity']:,}), so an unpaced run ingests it at once and "
                   "its throughput is the rate of working off a backlog in large batches.")
    return out


def to_toml(cfg: dict) -> str:
    val = lambda v: json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else repr(v)
    return "\n\n".join(f"[{s}]\n" + "\n".join(f"{k} = {val(v)}" for k, v in keys.items()) for s, keys in cfg.items())


def detail_table(p: dict) -> str:
    rows = [[f"capacity #{i + 1}", "unpaced", fmt(r["throughput"]), fmt(r["wall_seconds"], ".1f"),
             *(fmt(r[f"delay_{q}"], ".3f") for q in ("p50", "p95", "p99", "max")), "-",
             fmt(r["window_bytes_per_tuple"], ".0f"), fmt(r["peak_rss_mb"], ".0f")]
            for i, r in enumerate(p["capacity"]["runs"])]
    rows += [[f"half load #{i + 1}", fmt(r["rate"]), fmt(r["throughput"]), fmt(r["wall_seconds"], ".1f"),
              *(fmt(r[f"delay_{q}"], ".3f") for q in ("p50", "p95", "p99", "max")),
              f"{r['ratio']:.0%}, lag {r['lag_seconds']:.1f}s{'' if r['kept_up'] else ' FELL BEHIND'}",
              fmt(r["window_bytes_per_tuple"], ".0f"), fmt(r["peak_rss_mb"], ".0f")]
             for i, r in enumerate(p["half_load"]["runs"])]
    return md_table(["run", "pacing/s", "throughput/s", "wall s", "delay p50 s", "p95 s", "p99 s", "max s",
                     "kept up (achieved/pacing)", "window B/tuple", "peak RSS MB"], rows)


def write_report(out: Path, data: dict) -> None:
    m, n, cfg = data["machine"], data["repeats"], data["config"]
    parts = [
        "# Stream-join benchmark", "",
        f"`{data['command']}` — {m['date']}", "",
        "## Machine", "",
        f"- CPU: {m['cpu']}, {m['cores']} cores; memory {m['memory_gib']} GiB; {m['os']}",
        f"- Python {m['python']}, numpy {m['numpy']}, mpi4py {m['mpi4py']}, {m['open_mpi']}",
        f"- load average when the bench started: {' '.join(map(str, m['load_average_at_start']))}", "",
        "## Summary", "",
        summary_table(data["points"]), "",
        *(f"**Caveat:** {c}\n" for c in caveats(data)),
        f"Every number is the **median of {n} runs** on a shared, noisy {m['cores']}-core machine; with more ranks "
        "than cores the ranks share cores (Open MPI `--oversubscribe`), so more slaves need not mean more capacity "
        "here.", "",
        "- **capacity**: unpaced runs (`source.rate = 0`); the sustained input rate is `throughput_tuples_per_s` "
        "(tuples in / wall time, including start-up of the loop and the final drain). Delays in unpaced runs "
        "**include the time tuples wait in the master's queue** (arrival = when the master ingested them), so they "
        "measure back-pressure, not the engine's latency.",
        f"- **half load**: runs paced at {HALF_LOAD:.0%} of the median capacity (`source.rate`); arrival is the "
        "nominal pacing time, so the delay is end-to-end. A run *kept up* if it ingested at >= "
        f"{KEEP_UP_RATIO:.0%} of the pacing rate or finished within {KEEP_UP_LAG:.0f} s of its schedule "
        "(the wall time includes the final drain, which short runs cannot amortize).",
        "- delay percentiles are upper edges of log-spaced bins (at most 12.2% above the exact value, "
        "capped at the exact max).",
        "- peak RSS is the largest resident set of any one process of the run (master or a slave).", "",
        "![capacity vs slaves](capacity.png)", "", "![delay at half load vs slaves](delay_half_load.png)", "",
        "## Runs per slave count", "",
    ]
    for p in data["points"]:
        parts += [f"### {p['slaves']} slave(s), {p['ranks']} ranks", "", detail_table(p), ""]
    parts += ["Window B/tuple: the slaves' allocated window bytes over stored tuples at the end of the run "
              f"(at least generator.tuple_bytes = {cfg['generator']['tuple_bytes']}; the excess is growth slack). "
              "Lag: wall time minus the paced schedule (tuples / pacing rate).", "",
              "## Configuration", "",
              f"Workload settings: `{' '.join(data['workload']) or 'defaults'}`; `source.rate` as above; "
              "`output.progress = 0`; every other key is the default.", "",
              "```toml", to_toml({s: v for s, v in cfg.items() if s != "output"}), "```", ""]
    (out / "report.md").write_text("\n".join(parts))


def plot(out: Path, points: list[dict]) -> list[Path]:
    """capacity.png and delay_half_load.png: medians as lines, every repeat as a faint dot."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ks = [p["slaves"] for p in points]

    def dots(ax, key, runs_of, color):
        for p in points:
            ys = [r[key] for r in runs_of(p) if r[key] is not None]
            ax.scatter([p["slaves"]] * len(ys), ys, color=color, alpha=0.35, s=18, zorder=3)

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    ax.plot(ks, [p["capacity"]["median"] for p in points], "o-", color="C0", label="median")
    dots(ax, "throughput", lambda p: p["capacity"]["runs"], "C0")
    ax.set(title="Capacity (unpaced sustained input rate)", xlabel="slaves  (dots: single runs)", ylabel="tuples/s",
           xticks=ks)
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:,.0f}"))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    paths = [out / "capacity.png"]
    fig.savefig(paths[0])

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for q, color in (("p50", "C0"), ("p99", "C3")):
        ax.plot(ks, [p["half_load"][f"delay_{q}"] for p in points], "o-", color=color, label=f"{q} (median)")
        dots(ax, f"delay_{q}", lambda p: p["half_load"]["runs"], color)
    for p in points:  # each slave count is paced at half of its own capacity: say at what, and if it kept up
        h = p["half_load"]
        kept = sum(r["kept_up"] for r in h["runs"])
        ax.annotate(f"{h['rate'] / 1000:,.0f}k/s\nkept up {kept}/{len(h['runs'])}", (p["slaves"], h["delay_p99"] or 0),
                    textcoords="offset points", xytext=(0, 8), ha="center", fontsize=8,
                    color="black" if kept == len(h["runs"]) else "C3")
    ax.set(title="Production delay at 50% of capacity (paced)", xlabel="slaves", ylabel="delay (s)", xticks=ks)
    ax.margins(x=0.12, y=0.2)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("slaves  (dots: single runs)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    paths.append(out / "delay_half_load.png")
    fig.savefig(paths[1])
    plt.close("all")
    return paths


# --------------------------------------------------------------------------- main

def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.bench", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="10 s of generated input per run instead of 30 s")
    p.add_argument("--slaves", type=parse_slaves, default=[1, 2, 4], help="slave counts, e.g. 1,2,4 (default)")
    p.add_argument("--repeats", type=int, default=3, help="runs per measurement; medians are reported (default 3)")
    p.add_argument("--out", type=Path, default=Path("bench-report"), help="report folder (default bench-report)")
    p.add_argument("--timeout", type=float, default=RUN_TIMEOUT, help="seconds per run before it counts as failed")
    a = p.parse_args(argv)
    if a.repeats < 1:
        p.error("--repeats must be at least 1")
    workload = [f"generator.duration={10.0 if a.quick else 30.0}"]
    command = "python -m deploy.bench " + " ".join(argv)
    data = {"command": command.strip(), "machine": machine_info(), "repeats": a.repeats, "workload": workload}
    print(f"bench: slaves {a.slaves}, {a.repeats} repeats, {' '.join(workload)}; "
          f"{2 * a.repeats * len(a.slaves)} runs", flush=True)
    with tempfile.TemporaryDirectory(prefix="streamjoin-bench-") as tmp:
        bench = Bench(a.slaves, a.repeats, workload, a.timeout, Path(tmp))
        try:
            data["points"] = [bench.point(k) for k in a.slaves]
        except RunFailed as e:
            print(f"\nbench: run {bench.done}/{bench.total_runs} FAILED, {e}", file=sys.stderr, flush=True)
            return 1
    data["config"] = bench.config
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(data, indent=2))
    write_report(a.out, data)
    pngs = plot(a.out, data["points"])
    print("\n" + summary_table(data["points"]) + "\n")
    for c in caveats(data):
        print(f"caveat: {c}")
    print(f"medians of {a.repeats} runs; unpaced delays include the master's queue. Wrote "
          + ", ".join(str(x) for x in [a.out / "report.md", a.out / "results.json", *pngs]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
