"""`python -m deploy.bench [--quick] [--slaves 1,2,4,8] [--repeats 3] [--steps N] [--delay-bound S] [--peer spark|none] [--workloads ...] [--epochs ...] [--input file|generator] [--out DIR]`: sustained input rate and delay per cluster size, and of the peer.

The capacity of the cluster is its **sustained input rate**: the highest paced
input rate (`source.rate`) at which it keeps up with the pacing *and* the
production delay stays bounded (paper: the highest input rate before the
production delay climbs).  For each slave count k (k + 1 ranks) on the default
generated workload, written to a Parquet file first and read by the master
before the clock starts (`--input file`, as the peer and the kernel limit get
theirs; `--input generator` generates it at the master as it runs):

1. probe: one unpaced run (`source.rate = 0`); its throughput U is an upper
   bound only, since an unpaced run works off a backlog (the input goes into the
   master's buffer at once and is joined in large batches);
2. search: `--steps` single paced runs.  A run *passes* iff it kept up with its
   pacing (`keep_up`) and its delay p95 is at most `--delay-bound`.  The first
   rate is U/2; while nothing has passed the rate is halved (giving up, with a
   sustained rate of 0, after a few failures); after that each rate is the
   geometric mean of the highest passing rate and the lowest failing rate above
   it (U when none has failed; twice the passing rate once that is within 10% of
   U, since then U was no bound).  The sustained rate is the highest passing rate;
3. sustained: `repeats` runs paced at the sustained rate (medians of delay and
   throughput, kept-up counts);
4. half: `repeats` runs paced at half the sustained rate (delay at half load).

In paced runs a tuple's arrival is its nominal pacing time, so the delay is
end-to-end, including any backlog in the master.  Then (`--peer spark`, the
default) the same search on Spark Structured Streaming's stream-stream join of
the same data (`deploy.bench_spark`) and the ratio cluster/Spark.  Then
(`deploy.bench_paper`) the other workloads (uniform, Zipf, high duplication),
tuning off, the distribution-epoch sweep and the single-core kernel limit, and
the issue's targets.  Output: report.md, results.json (all raw numbers) and PNG plots.
"""
from __future__ import annotations

import argparse
import datetime as dt
import hashlib
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

import numpy as np

from deploy.launch import find_mpirun, mpi_env, mpirun_command
from protocol.config import load_config
from protocol.delays import exact_percentiles
from protocol.output import read_tables

RUN_TIMEOUT = 600.0          # seconds per cluster run
DELAY_BOUND = 1.5            # default --delay-bound: a passing run has delay p95 <= this (epochs 0.25 s)
FIRST_FRACTION = 0.5         # the search starts at this fraction of the unpaced throughput U ...
MAX_FAILS_WITHOUT_PASS = 4   # ... and halves after each failure, giving up after this many (last try U/16)
HALF_LOAD = 0.5              # the delay at half load is measured at this fraction of the sustained rate
PEER_DELAY_BOUND = 5.0       # default --peer-delay-bound for Spark (see deploy.bench_spark)
PROBE_MARGIN = 0.9           # a pass at this fraction of U with no failure above it: the search looks above U
KEEP_UP_LAG = 0.5            # a paced run kept up iff the master's ingest never fell more than this behind schedule
KEEP_UP_SHARE = 0.1          # ... and no more than this share of its input's scheduled length (keep_up)


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


def keep_up(tuples: int, wall: float, rate: float, pacing_lag: float, backlog: float) -> dict:
    """Did a paced run keep up?  How far behind it fell is the larger of the master's two measures (summary
    pacing_lag_max_seconds: the longest due tuples waited to be ingested; backlog_max_seconds: the longest an
    ingested tuple waited for its slave beyond one distribution epoch).  They grow as soon as the cluster
    cannot absorb the pacing rate, unlike the achieved rate whose wall time includes start and drain.  The
    backlog is needed because ingest is held back only once the mini-buffers are full: 12M tuples paced at
    10M/s fit in 4M-tuple buffers for long enough to end 0.1 s behind at ingest and 0.3-0.7 s in the buffers.

    The bound is KEEP_UP_LAG, or KEEP_UP_SHARE of the input's scheduled length (tuples / rate) when that is
    less: a cluster of capacity C paced at rate r ends behind by about tuples * (1/C - 1/r), so a fixed 0.5 s
    let 12M tuples paced at 7M/s (1.7 s of input) pass with C down to 12M / 2.2 s = 5.4M/s, 1.3x its
    capacity; the share caps that at 1.1x whatever the run's length."""
    achieved = tuples / wall if wall > 0 else 0.0
    bound = min(KEEP_UP_LAG, KEEP_UP_SHARE * tuples / rate)
    behind = max(pacing_lag, backlog)
    return {"achieved_rate": round(achieved, 1), "ratio": round(achieved / rate, 3), "lag_seconds": round(behind, 3),
            "lag_bound": round(bound, 3), "kept_up": behind <= bound}


def search_verdict(run: dict, delay_bound: float) -> tuple[bool, str]:
    """Does a paced run pass the search's test: kept up with its pacing AND delay p95 <= delay_bound?

    Returns (passed, why) with why 'pass', 'fell behind', 'p95 > bound' (both reasons joined by '; ').
    A run without a delay p95 (no results) cannot show a bounded delay, so it fails.
    """
    why = []
    if not run["kept_up"]:
        why.append("fell behind")
    p95 = run["delay_p95"]
    if p95 is None or (isinstance(p95, float) and math.isnan(p95)):
        why.append("no delay p95")
    elif p95 > delay_bound:
        why.append(f"p95 {p95:.2f}s > {delay_bound:g}s")
    return (not why, "; ".join(why) or "pass")


def next_rate(trail: list[tuple[float, bool]], unpaced: float, steps: int) -> int | None:
    """The next paced rate for the search, given the (rate, passed) runs so far; None when the search is over.

    * no run yet: FIRST_FRACTION * unpaced;
    * nothing passed yet: half the lowest failing rate, or None after MAX_FAILS_WITHOUT_PASS failures;
    * else the geometric mean of lo = the highest passing rate and hi = the lowest failing rate above lo
      (the unpaced throughput when none failed above lo; 2 * lo once lo is within PROBE_MARGIN of it: the
      probe was slow, start and drain weigh on an unpaced run's throughput);
    * None once `steps` runs are done, or when lo and hi are so close the next integer rate repeats one.
    """
    if unpaced <= 0:
        raise ValueError(f"the unpaced throughput must be positive, got {unpaced}")
    if len(trail) >= steps:
        return None
    if not trail:
        return round(FIRST_FRACTION * unpaced)
    passed = [r for r, ok in trail if ok]
    if not passed:
        return None if len(trail) >= MAX_FAILS_WITHOUT_PASS else round(min(r for r, _ in trail) / 2)
    lo = max(passed)
    hi = min((r for r, ok in trail if not ok and r > lo), default=unpaced if lo < PROBE_MARGIN * unpaced else 2 * lo)
    rate = round(math.sqrt(lo * hi))
    return None if rate <= lo or rate >= hi else rate


def sustained_rate(trail: list[tuple[float, bool]]) -> int:
    """The highest passing rate of the search; 0 if no run passed."""
    return round(max((r for r, ok in trail if ok), default=0))


def confirmed(point: dict) -> bool:
    """Did most repeats at the point's sustained rate pass the search's test?  A rate that one search run passed
    and most repeats did not is luck on a noisy machine, not a capacity: the targets count only confirmed rates."""
    runs = point["sustained"]["runs"]
    return 2 * sum(bool(r["passed"]) for r in runs) > len(runs) > 0


def bracket(trail: list[tuple[float, bool]]) -> tuple[int, int | None]:
    """(sustained rate, lowest failing rate above it or None): where the search left the true sustained rate."""
    lo = sustained_rate(trail)
    return lo, min((round(r) for r, ok in trail if not ok and r > lo), default=None)


def krate(rate: float) -> str:
    """237710 -> '238k': rates in the compact search trail."""
    return f"{rate / 1000:,.0f}k" if rate >= 1000 else f"{rate:.0f}"


def trail_text(trail: list[tuple[float, bool]]) -> str:
    """[(238000, False), (119000, True)] -> '238k✗ 119k✓' (in the order the runs were made)."""
    return " ".join(f"{krate(r)}{'✓' if ok else '✗'}" for r, ok in trail) or "-"


def fmt(v, spec: str = ",.0f", missing: str = "-") -> str:
    return missing if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def md_table(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub markdown table with columns padded, so it also reads well on a terminal."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def count(runs: list[dict], key: str) -> str:
    """'2/3': how many of the runs have `key` true; '-' for no runs."""
    return f"{sum(bool(r[key]) for r in runs)}/{len(runs)}" if runs else "-"


SUMMARY_HEADER = ["slaves", "unpaced tuples/s", "sustained rate/s", "search (✓ pass, ✗ fail)", "achieved/s",
                  "delay p50 s", "p95 s", "p99 s", "max s", "kept up", "passed", "half rate/s", "half p50 s",
                  "half p99 s", "half kept up", "peak RSS MB"]


def summary_table(points: list[dict]) -> str:
    """One row per slave count: unpaced throughput, sustained rate and its search trail, the medians of the
    runs at the sustained rate (achieved throughput, delays) with kept-up and passed counts, the delay medians
    at half the sustained rate, and the peak RSS of any run."""
    rows = []
    for p in points:
        st, h = p["sustained"], p["half"]
        every = [p["probe"], *p["search"]["runs"], *st["runs"], *h["runs"]]
        rows.append([str(p["slaves"]), fmt(p["unpaced"]), fmt(st["rate"]), trail_text(p["search"]["trail"]),
                     fmt(st["throughput"]), *(fmt(st[f"delay_{q}"], ".3f") for q in ("p50", "p95", "p99", "max")),
                     count(st["runs"], "kept_up"), count(st["runs"], "passed"), fmt(h["rate"] or None),
                     fmt(h["delay_p50"], ".3f"), fmt(h["delay_p99"], ".3f"), count(h["runs"], "kept_up"),
                     fmt(max((r["peak_rss_mb"] or 0 for r in every), default=None), ".0f")])
    return md_table(SUMMARY_HEADER, rows)


def delay_seconds(s: dict) -> dict:
    """A run's delay p50, p95, p99 and max: exact (`run_cluster` reads them from the results) where known."""
    return {**s["delay_seconds"], **s.get("delay_exact", {})}


def run_numbers(s: dict) -> dict:
    """The numbers kept from one summary.json (the config is kept once, the result files not at all)."""
    slaves = s["slaves"].values()
    wt, wb = sum(v["window_tuples"] for v in slaves), sum(v["window_bytes"] for v in slaves)
    d = delay_seconds(s)
    nan_none = lambda x: None if x is None or math.isnan(x) else x
    return {"input_total": s["input_total"], "late": s["late"], "results": s["results"],
            "wall_seconds": s["wall_seconds"], "throughput": s["throughput_tuples_per_s"],
            **{f"delay_{q}": nan_none(d[q]) for q in ("p50", "p95", "p99", "max")},
            "delay_parts": s.get("delay_parts_seconds"),  # where the delay goes (buffer, transfer, join)
            "window_bytes_per_tuple": round(wb / wt, 1) if wt else None,
            "tuples_moved": s.get("tuples_moved", 0), "moves": len(s.get("balance", {}).get("moves", [])),
            "slaves": {r: {k: v[k] for k in ("tuples_processed", "window_tuples", "window_bytes", "busy_seconds",
                                             "comm_seconds")} for r, v in s["slaves"].items()},
            "rank_rss_mb": {"0": round(s["master_peak_rss_bytes"] / 2**20, 1),
                            **{r: round(v["peak_rss_bytes"] / 2**20, 1) for r, v in s["slaves"].items()}}}


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


def run_cluster(ranks: int, settings: list[str], workdir: Path, timeout: float, module: str = "master",
                env: dict[str, str] | None = None) -> dict:
    """One `mpirun -n ranks python -m master --set ...` into workdir; its summary.json, plus its peak RSS.

    `module` and `env` replace the rank program and add environment variables (deploy.bench_balance runs
    every rank through the CPU-pinning wrapper `deploy.busy`).

    The run gets a session of its own so a hung (or interrupted) run can be ended
    completely; os.wait4 gives the largest RSS of any process in it (prterun reaps
    the ranks) at no cost.
    """
    workdir.mkdir(parents=True)
    out = workdir / "out"
    args = [a for kv in [*settings, f"output.path={out}", "output.progress=0"] for a in ("--set", kv)]
    with open(workdir / "stdout", "wb") as so, open(workdir / "stderr", "wb") as se:
        proc = subprocess.Popen(mpirun_command(ranks, args, module=module), env={**mpi_env(), **(env or {})},
                                stdout=so, stderr=se,
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
    # every result row carries its delay: the exact percentiles, not the upper edges of the summary's bins
    results = read_tables(out / "results", ["delay"])
    delays = results["delay"].to_numpy() if results is not None else np.empty(0)
    s["delay_exact"] = dict(zip(("p50", "p95", "p99"), exact_percentiles(delays)))
    shutil.rmtree(workdir)  # result files can be large; the summary is all we need
    return s


#: where a run's input comes from (`--input`): read from a Parquet file of the generated tuples written before
#: the runs (the default: the Spark peer and the kernel limit get theirs that way, so all three are measured on
#: input that is already there; the master reads it before the run's clock starts), or generated at the master
#: as it goes (the cluster's CPU then also makes the tuples)
INPUTS = ("file", "generator")


def generated_file(settings: list[str], directory: Path) -> Path:
    """The input generated for `settings`, written once as an input file (the file source's columns) in
    `directory`, named by the generator config: runs of the same workload share it."""
    from master.archive import InputArchive
    from protocol.workload import generate_all
    cfg = load_config(None, settings)
    folder = directory / hashlib.sha1(json.dumps(cfg["generator"], sort_keys=True).encode()).hexdigest()[:16]
    if not folder.exists():
        archive = InputArchive(folder, flush_rows=1 << 62)
        archive.add(generate_all(cfg))
        archive.flush()
    return folder / "input-000000.parquet"


class Bench:
    """Runs the plan, prints a line per run, and keeps every number for results.json."""

    def __init__(self, slaves: list[int], repeats: int, steps: int, delay_bound: float, workload: list[str],
                 timeout: float, tmp: Path, *, half: bool = True, tag: str = "", module: str = "master",
                 env: dict[str, str] | None = None, input_kind: str = "file"):
        """`half`: also repeat at half the sustained rate; `tag` names the runs (and their folders) in the
        progress lines; `module`, `env`: see run_cluster; `input_kind`: one of INPUTS."""
        self.slaves, self.repeats, self.steps, self.delay_bound = slaves, repeats, steps, delay_bound
        self.workload, self.timeout, self.tmp = workload, timeout, tmp
        self.half, self.tag, self.module, self.env = half, tag, module, env
        self.source = ([] if input_kind == "generator" else
                       ["source.kind=file", f"source.path={generated_file(workload, tmp / 'inputs')}"])
        self.total_runs, self.done = planned_runs(len(slaves), repeats, steps, half), 0
        self.config: dict | None = None

    def run_at(self, k: int, label: str, rate: float) -> dict:
        """One run of k slaves paced at `rate` (0 = unpaced), its numbers, and a progress line."""
        self.done += 1
        s = run_cluster(k + 1, [*self.workload, *self.source, f"source.rate={float(rate)!r}"],
                        self.tmp / f"{self.tag}k{k}-{label.replace(' ', '').replace('#', '-')}", self.timeout,
                        self.module, self.env)
        self.config = self.config or s["config"]
        r = {"label": label, **run_numbers(s), "peak_rss_mb": s["peak_rss_mb"]}
        if rate > 0:
            r.update(rate=rate, **keep_up(r["input_total"] + r["late"], r["wall_seconds"], rate, s["pacing_lag_max_seconds"],
                                          s["backlog_max_seconds"]))
            r["passed"], r["verdict"] = search_verdict(r, self.delay_bound)
        line = (f"[{self.done:>2}/{self.total_runs}] {self.tag + ' ' if self.tag else ''}slaves={k} {label:<12} {r['throughput']:>10,.0f} tuples/s in "
                f"{r['wall_seconds']:5.1f}s | delay p50 {fmt(r['delay_p50'], '.3f')}s p95 {fmt(r['delay_p95'], '.3f')}s"
                f" p99 {fmt(r['delay_p99'], '.3f')}s | peak RSS {r['peak_rss_mb']:.0f} MB")
        if rate > 0:
            line += (f" | paced {rate:,.0f}/s: {r['ratio']:.0%} {'kept up' if r['kept_up'] else 'FELL BEHIND'}"
                     f" -> {'PASS' if r['passed'] else 'FAIL: ' + r['verdict']}")
        print(line, flush=True)
        return r

    def point(self, k: int) -> dict:
        """Probe, search, then repeats at the sustained rate and at half of it, for k slaves."""
        probe = self.run_at(k, "probe", 0.0)
        unpaced = probe["throughput"]
        trail, search = [], []
        while (rate := next_rate(trail, unpaced, self.steps)) is not None:
            r = self.run_at(k, f"search #{len(search) + 1}", rate)
            search.append(r)
            trail.append((rate, r["passed"]))
        self.total_runs -= self.steps - len(search)  # the search stopped early (gave up or converged)
        rate = sustained_rate(trail)
        if not rate:
            self.total_runs -= (2 if self.half else 1) * self.repeats
        at = [self.run_at(k, f"sustained #{i + 1}", rate) for i in range(self.repeats)] if rate else []
        half_rate = round(HALF_LOAD * rate) if self.half else 0
        half = [self.run_at(k, f"half #{i + 1}", half_rate) for i in range(self.repeats)] if half_rate else []
        return {"slaves": k, "ranks": k + 1, "unpaced": unpaced, "probe": probe,
                "search": {"trail": trail, "bracket": bracket(trail), "runs": search},
                "sustained": {"rate": rate, "throughput": median(r["throughput"] for r in at), **aggregate(at),
                              "runs": at},
                "half": {"rate": half_rate, **aggregate(half), "runs": half}}


def planned_runs(n_slave_counts: int, repeats: int, steps: int, half: bool = True) -> int:
    """Runs the plan makes at most: per slave count a probe, the search, and repeats at the sustained rate
    (and at half of it)."""
    return n_slave_counts * (1 + steps + (2 if half else 1) * repeats)


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
    """Warnings the numbers call for: the unpaced probe's meaning, a search that found no passing rate or no
    failing one, repeats at the sustained rate that did not pass, half-load runs that fell behind."""
    points, bound = data["points"], data["delay_bound"]
    total = max(p["probe"]["input_total"] + p["probe"]["late"] for p in points)
    buf = data["config"]["master"]["buffer_capacity"]
    out = ["The unpaced throughput is not a capacity: an unpaced run works off a backlog in large batches"
           + (f" (the whole input, {total:,} tuples, fits in master.buffer_capacity = {buf:,}, so it is "
              "ingested at once)" if total <= buf else "") + ", and its start and drain weigh on it; it sets the "
           "search's first rate, and the search goes above it once a pass comes within 10% of it."]
    none = [p for p in points if not p["sustained"]["rate"]]
    if none:
        out.append("No paced rate passed for " + ", ".join(
            f"{p['slaves']} slave(s) (down to {min(r for r, _ in p['search']['trail']):,.0f}/s)" for p in none)
            + f": the sustained rate is reported as 0; a larger --delay-bound (now {bound:g} s) may be needed.")
    open_top = [p for p in points if p["sustained"]["rate"] and p["search"]["bracket"][1] is None]
    if open_top:
        out.append("No search run failed for " + ", ".join(f"{p['slaves']} slave(s)" for p in open_top)
                   + ": the sustained rate is only a lower bound; more --steps search higher.")
    weak = [p for p in points if p["sustained"]["runs"] and not all(r["passed"] for r in p["sustained"]["runs"])]
    if weak:
        out.append("At the sustained rate not every repeat passed (kept up and delay p95 <= "
                   f"{bound:g} s): " + ", ".join(f"{p['slaves']} slave(s) {count(p['sustained']['runs'], 'passed')}"
                                                  for p in weak)
                   + ". The search decides on single runs, so on a noisy machine the sustained rate can be "
                   "optimistic; the repeats' medians show what that rate gives typically.")
    behind = [p for p in points if p["half"]["runs"] and not all(r["kept_up"] for r in p["half"]["runs"])]
    if behind:
        out.append("At half the sustained rate the cluster fell behind its pacing for "
                   + ", ".join(f"{p['slaves']} slave(s) ({count(p['half']['runs'], 'kept_up')} kept up)"
                               for p in behind) + ": those runs were disturbed (the machine is shared).")
    return out


def to_toml(cfg: dict) -> str:
    val = lambda v: json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else repr(v)
    return "\n\n".join(f"[{s}]\n" + "\n".join(f"{k} = {val(v)}" for k, v in keys.items()) for s, keys in cfg.items())


def detail_table(p: dict) -> str:
    """Every run of one slave count in the order made: probe, search #i, sustained #i, half #i."""
    rows = []
    for r in [p["probe"], *p["search"]["runs"], *p["sustained"]["runs"], *p["half"]["runs"]]:
        paced = "rate" in r
        rows.append([r["label"], fmt(r["rate"]) if paced else "unpaced", fmt(r["throughput"]),
                     fmt(r["wall_seconds"], ".1f"), *(fmt(r[f"delay_{q}"], ".3f") for q in ("p50", "p95", "p99", "max")),
                     f"{r['ratio']:.0%}, lag {r['lag_seconds']:.1f}s{'' if r['kept_up'] else ' FELL BEHIND'}"
                     if paced else "-", (r["verdict"] if r["passed"] else f"FAIL: {r['verdict']}") if paced else "-",
                     fmt(r["window_bytes_per_tuple"], ".0f"), fmt(r["peak_rss_mb"], ".0f")])
    return md_table(["run", "pacing/s", "throughput/s", "wall s", "delay p50 s", "p95 s", "p99 s", "max s",
                     "kept up (achieved/pacing)", "passes", "window B/tuple", "peak RSS MB"], rows)


def search_line(p: dict) -> str:
    """Where the search left the sustained rate of one slave count, in words."""
    lo, hi = p["search"]["bracket"]
    trail = " → ".join(f"{r:,.0f} {'pass' if ok else 'fail'}" for r, ok in p["search"]["trail"])
    where = ("no rate passed" if not lo else f"between {lo:,.0f} and {hi:,.0f}/s (+{hi / lo - 1:.0%})" if hi
             else f"at least {lo:,.0f}/s (no rate above it failed)")
    return f"- {p['slaves']} slave(s): unpaced {p['unpaced']:,.0f}/s; {trail}; sustained rate {where}."


def write_report(out: Path, data: dict) -> None:
    from deploy import bench_paper
    m, n, cfg, bound = data["machine"], data["repeats"], data["config"], data["delay_bound"]
    runs = bench_paper.cluster_runs(data)
    parts = [
        "# Stream-join benchmark", "",
        f"`{data['command']}` — {m['date']}; {runs} runs in {data['bench_seconds']:.0f} s", "",
        "## Machine", "",
        f"- CPU: {m['cpu']}, {m['cores']} cores; memory {m['memory_gib']} GiB; {m['os']}",
        f"- Python {m['python']}, numpy {m['numpy']}, mpi4py {m['mpi4py']}, {m['open_mpi']}",
        f"- load average when the bench started: {' '.join(map(str, m['load_average_at_start']))}", "",
        "## Summary", "",
        summary_table(data["points"]), "",
        bench_paper.targets_table(data), "",
        *(f"**Caveat:** {c}\n" for c in caveats(data)),
        "## Method", "",
        "The capacity is the **sustained input rate**: the highest paced input rate (`source.rate`) at which the "
        "cluster keeps up with its pacing and the production delay stays bounded (the paper's capacity: the "
        "highest input rate before the production delay climbs). Per slave count:", "",
        "1. **probe**: one unpaced run (`source.rate = 0`); its throughput (tuples in / wall time) is the "
        "**unpaced throughput** U, not a capacity (see the caveat): it sets where the search starts.",
        f"2. **search**: {data['steps']} single paced runs at most. A run **passes** iff it kept up (below) **and** "
        f"its delay p95 <= {bound:g} s (`--delay-bound`; `epochs.distribution` is "
        f"{cfg['epochs']['distribution']:g} s). The first rate is {FIRST_FRACTION:g} U; while no run has passed "
        f"the rate is halved (giving up after {MAX_FAILS_WITHOUT_PASS} failures: sustained rate 0); then each rate "
        "is the geometric mean of the highest passing rate and the lowest failing rate above it (U while none "
        f"has failed, twice the passing rate once that is within {1 - PROBE_MARGIN:.0%} of U). The **sustained rate** is the highest passing rate; the true one lies between it and the "
        "lowest failing rate above it:",
        *("   " + search_line(p) for p in data["points"]), "",
        f"3. **sustained**: {n} runs paced at the sustained rate; the table gives the medians of their achieved "
        "throughput and delay percentiles, how many kept up and how many passed the search's test.",
        f"4. **half**: {n} runs paced at {HALF_LOAD:.0%} of the sustained rate: the delay at half load (medians).",
        "",
        f"Every median is over {n} runs on a shared, noisy {m['cores']}-core machine; with more ranks than cores "
        "the ranks share cores (Open MPI `--oversubscribe`), so more slaves need not mean more capacity here.", "",
        "- In paced runs a tuple's arrival is its nominal pacing time, so the delay is end-to-end and includes any "
        "backlog in the master. (In the unpaced probe arrival is when the master ingested the tuple, so its "
        "delays, in the run tables, measure back-pressure.)",
        f"- A paced run *kept up* iff it never fell more than {KEEP_UP_LAG:g} s, nor more than "
        f"{KEEP_UP_SHARE:.0%} of its input's scheduled length (tuples / rate), behind: neither the master's ingest "
        "behind the pacing schedule (summary `pacing_lag_max_seconds`) nor a tuple in the master's mini-buffers "
        "beyond one distribution epoch (`backlog_max_seconds`); the lag column is the larger. The achieved rate "
        "(tuples / wall time) is "
        "shown too but is not the test: its wall time includes start-up and the final drain.",
        "- Input: " + ("generated by the master as it runs (`source.kind = generator`), so the cluster's CPU "
                       "includes making the tuples" if data.get("input", "generator") == "generator" else
                       "read from a Parquet file of the same generated tuples written before the runs "
                       "(`--input file`, `source.kind = file`; the master reads it before the run's clock starts)")
        + ".",
        "- Delay percentiles are exact: every result row carries its production delay, and the bench reads them "
        "from the result files (the cluster's own summary gives upper edges of log-spaced bins, up to 12.2% "
        "higher).",
        "- Peak RSS is the largest resident set of any one process (master or a slave) over all runs of that slave "
        "count; the unpaced probe, which buffers the whole input, usually sets it.", "",
        "![sustained rate vs slaves](capacity.png)", "",
        "![delay at the sustained rate and at half of it vs slaves](delay.png)", "",
        "## Runs per slave count", "",
    ]
    for p in data["points"]:
        parts += [f"### {p['slaves']} slave(s), {p['ranks']} ranks", "", detail_table(p), ""]
    if data.get("peer"):
        from deploy.bench_spark import report_section
        parts += report_section(data["points"], data["peer"], bound)
    parts += bench_paper.report_sections(data)
    parts += ["Window B/tuple: the slaves' allocated window bytes over stored tuples at the end of the run "
              f"(at least generator.tuple_bytes = {cfg['generator']['tuple_bytes']}; the excess is growth slack, the "
              "per-block index and the directories). "
              "Lag: wall time minus the paced schedule (tuples / pacing rate).", "",
              "## Configuration", "",
              f"Workload settings: `{' '.join(data['workload']) or 'defaults'}`; `source.rate` as above; "
              "`output.progress = 0`; every other key is the default.", "",
              "```toml", to_toml({s: v for s, v in cfg.items() if s != "output"}), "```", ""]
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
    ax.plot(ks, [p["unpaced"] for p in points], "s--", color="C7", alpha=0.45,
            label="unpaced throughput (probe)")
    ax.plot(ks, [p["sustained"]["rate"] for p in points], "o-", color="C0", lw=2, label="sustained rate")
    for passed, style in ((True, dict(marker="o", facecolors="none", edgecolors="C2", label="search run: passed")),
                          (False, dict(marker="x", color="C3", label="search run: failed"))):
        rates = [(p["slaves"] + 0.06, r) for p in points for r, ok in p["search"]["trail"] if ok == passed]
        ax.scatter([x for x, _ in rates], [y for _, y in rates], alpha=0.7, s=24, zorder=3, **style)
    if peer:
        ax.axhline(peer["sustained"]["rate"], color="C1", ls="-.",
                   label=f"Spark local[{peer['cores']}] sustained rate ({peer['sustained']['rate']:,.0f}/s)")
    ax.set(title=f"Sustained input rate (kept up, delay p95 ≤ {delay_bound:g} s)", xlabel="slaves",
           ylabel="tuples/s", xticks=ks)
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
            ax.plot(ks, [p[kind][f"delay_{q}"] for p in points], "o" + style, color=color,
                    alpha=1.0 if kind == "sustained" else 0.6, label=f"{q} {what}")
            for p in points:
                ys = [r[f"delay_{q}"] for r in p[kind]["runs"] if r[f"delay_{q}"] is not None]
                ax.scatter([p["slaves"]] * len(ys), ys, color=color, alpha=0.25, s=14, zorder=3)
    ax.axhline(delay_bound, color="grey", ls=":", lw=1, label=f"p95 bound {delay_bound:g} s")
    for p in points:  # each slave count has its own sustained rate: say what it is and whether its runs kept up
        st = p["sustained"]
        if st["runs"]:
            kept = sum(r["kept_up"] for r in st["runs"])
            ax.annotate(f"{krate(st['rate'])}/s\nkept up {kept}/{len(st['runs'])}",
                        (p["slaves"], max(st["delay_p99"] or 0, delay_bound)), textcoords="offset points",
                        xytext=(0, 8), ha="center", fontsize=8, color="black" if kept == len(st["runs"]) else "C3")
    ax.set(title="Production delay at the sustained rate and at half of it (medians)",
           xlabel="slaves  (dots: single runs)", ylabel="delay (s)", xticks=ks)
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


# --------------------------------------------------------------------------- main

def main(argv: list[str]) -> int:
    from deploy import bench_paper  # it imports this module's helpers, so not at the top
    p = argparse.ArgumentParser(prog="python -m deploy.bench", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="10 s of generated input per run instead of 60 s, 5 search steps instead of 8, 1 repeat "
                        "instead of 3, fewer slave counts, workloads on 2 slaves only, 3 epochs in the sweep")
    p.add_argument("--slaves", type=parse_slaves,
                   help="slave counts of the paper workload, e.g. 1,2,4 (default 1,2,4 with --quick, else 1,2,4,8)")
    p.add_argument("--repeats", type=int,
                   help="runs at the sustained rate and at half of it; medians are reported (default 1 with "
                        "--quick, else 3)")
    p.add_argument("--steps", type=int, help="paced runs of the search for the sustained rate (default 5 with "
                                             "--quick, else 8: the unpaced probe reads low, the first steps climb to it)")
    p.add_argument("--delay-bound", type=float, default=DELAY_BOUND,
                   help=f"a search run passes if it kept up and its delay p95 is at most this many seconds "
                        f"(default {DELAY_BOUND:g})")
    p.add_argument("--out", type=Path, default=Path("bench-report"), help="report folder (default bench-report)")
    p.add_argument("--timeout", type=float, default=RUN_TIMEOUT, help="seconds per run before it counts as failed")
    p.add_argument("--peer", choices=("spark", "none"), default="spark",
                   help="also find the sustained rate of Spark Structured Streaming's join on the same data "
                        "(deploy.bench_spark; default spark), or none")
    p.add_argument("--peer-delay-bound", type=float, default=PEER_DELAY_BOUND,
                   help=f"the peer's delay p95 bound (default {PEER_DELAY_BOUND:g} s: Spark's micro-batches alone "
                        "take over a second here, so it sustains no rate under the cluster's bound)")
    p.add_argument("--workloads", type=bench_paper.parse_names, default=bench_paper.EXTRA_WORKLOADS,
                   help=f"workloads searched besides the paper's, or none (default "
                        f"{','.join(bench_paper.EXTRA_WORKLOADS)}; see deploy/bench_paper.py)")
    p.add_argument("--workload-slaves", type=parse_slaves,
                   help="slave counts of those workloads and of tuning off (default 2 with --quick, else 2,4)")
    p.add_argument("--epochs", type=bench_paper.parse_epochs,
                   help="distribution epochs of the sweep in seconds, or none (default "
                        f"{','.join(map(str, bench_paper.QUICK_EPOCHS))} with --quick, else "
                        f"{','.join(map(str, bench_paper.FULL_EPOCHS))})")
    p.add_argument("--no-tuning-off", action="store_true", help="skip the search with extendible-hash tuning off")
    p.add_argument("--input", choices=INPUTS, default="file",
                   help="the cluster's input: read from a Parquet file of the generated tuples written first, as "
                        "the Spark peer and the kernel get theirs (default), or generated at the master as it runs")
    p.add_argument("--kernel-repeats", type=int, default=3,
                   help="runs of the single-core kernel (deploy.bench_kernel) for the limit; 0 = skip (default 3)")
    a = p.parse_args(argv)
    steps = a.steps if a.steps is not None else 5 if a.quick else 8
    a.repeats = a.repeats if a.repeats is not None else 1 if a.quick else 3
    a.slaves = a.slaves or ([1, 2, 4] if a.quick else [1, 2, 4, 8])
    a.workload_slaves = a.workload_slaves or ([2] if a.quick else [2, 4])
    epochs = a.epochs if a.epochs is not None else bench_paper.QUICK_EPOCHS if a.quick else bench_paper.FULL_EPOCHS
    if a.repeats < 1:
        p.error("--repeats must be at least 1")
    if steps < 1:
        p.error("--steps must be at least 1")
    if not a.delay_bound > 0 or not a.peer_delay_bound > 0:
        p.error("--delay-bound and --peer-delay-bound must be positive")
    workload = [f"generator.duration={60.0 if a.quick else 120.0}"]
    command = "python -m deploy.bench " + " ".join(argv)
    data = {"command": command.strip(), "machine": machine_info(), "repeats": a.repeats, "steps": steps,
            "delay_bound": a.delay_bound, "workload": workload, "input": a.input}
    searches = len(a.workloads) + (not a.no_tuning_off)  # each on every --workload-slaves count, no half load
    most = (planned_runs(len(a.slaves), a.repeats, steps) + len(epochs)
            + searches * planned_runs(len(a.workload_slaves), a.repeats, steps, half=False))
    print(f"bench: slaves {a.slaves}, probe + {steps} search steps + 2 x {a.repeats} repeats per slave count, "
          f"delay bound {a.delay_bound:g} s, {' '.join(workload)}, input {a.input}; "
          f"then {', '.join(a.workloads) or 'no other workloads'}{'' if a.no_tuning_off else ' and tuning off'} on "
          f"slaves {a.workload_slaves}, epochs {epochs or 'none'}; at most {most} runs", flush=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="streamjoin-bench-") as tmp:
        bench = Bench(a.slaves, a.repeats, steps, a.delay_bound, workload, a.timeout, Path(tmp), input_kind=a.input)

        def new_bench(settings: list[str], tag: str, slaves: list[int] = a.workload_slaves) -> Bench:
            return Bench(slaves, a.repeats, steps, a.delay_bound, [*workload, *settings], a.timeout, Path(tmp),
                         half=False, tag=tag, input_kind=a.input)
        try:
            data["points"] = [bench.point(k) for k in a.slaves]
            data["workloads"] = {}
            for name in a.workloads:
                b = new_bench(bench_paper.WORKLOADS[name][1], f"{name} ")
                data["workloads"][name] = {"settings": bench_paper.WORKLOADS[name][1],
                                           "points": [b.point(k) for k in a.workload_slaves]}
            if not a.no_tuning_off:
                b = new_bench(bench_paper.NO_TUNING, "no-tuning ")
                data["tuning_off"] = {"settings": bench_paper.NO_TUNING,
                                      "points": [b.point(k) for k in a.workload_slaves]}
            if epochs:
                data["epochs"] = bench_paper.epoch_sweep(new_bench, data["points"], a.workload_slaves[0], epochs)
        except RunFailed as e:
            print(f"\nbench: a run FAILED, {e}", file=sys.stderr, flush=True)
            return 1
        if a.peer == "spark":
            from deploy.bench_spark import QUICK_RUN_SECONDS, RUN_SECONDS, SparkBench, peer_table, ratio, ratio_text
            print("bench: the peer, Spark Structured Streaming, on the same workload", flush=True)
            peer = SparkBench(load_config(None, workload), QUICK_RUN_SECONDS if a.quick else RUN_SECONDS, steps,
                              a.repeats, a.peer_delay_bound, a.timeout, Path(tmp))
            try:
                data["peer"] = peer.point()
            finally:
                peer.close()
            data["peer_ratio"] = ratio(data["points"], data["peer"], a.delay_bound)
    if a.kernel_repeats > 0:
        data["kernel"] = bench_paper.kernel_limit(workload, a.kernel_repeats)
    data["config"] = bench.config
    data["bench_seconds"] = round(time.monotonic() - started, 1)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(data, indent=2))
    write_report(a.out, data)
    pngs = plot(a.out, data["points"], a.delay_bound, data.get("peer")) + bench_paper.plot(a.out, data, a.delay_bound)
    print("\n" + summary_table(data["points"]) + "\n\n" + bench_paper.targets_table(data) + "\n")
    if data.get("peer"):
        print(peer_table(data["peer"]) + "\n\n" + ratio_text(data["peer_ratio"]).replace("**", "") + "\n")
    for c in caveats(data):
        print(f"caveat: {c}")
    print(f"sustained rate: highest paced rate that kept up with delay p95 <= {a.delay_bound:g} s; delays and "
          f"achieved/s are medians of {a.repeats} runs at it (half: at half of it). "
          f"{bench_paper.cluster_runs(data)} cluster runs in "
          f"{data['bench_seconds']:.0f} s. Wrote "
          + ", ".join(str(x) for x in [a.out / "report.md", a.out / "results.json", *pngs]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
