"""The cluster runner: one `mpirun` of the engine per run, and `Bench`, which runs the search of bench.search
for one slave count after another and keeps every number for results.json."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from bench.inputs import InputCache, expected_tuples, rung
from bench.search import (
    HALF_LOAD,
    MIN_INPUT_SECONDS,
    bracket,
    counted_verdict,
    flatness,
    input_verdict,
    keep_up,
    median,
    next_rate,
    search_verdict,
    sustained_rate,
)
from bench.tables import fmt
from deploy.launch import mpi_env, mpirun_command
from protocol.plan import load_plan
from protocol.delays import exact_percentiles
from protocol.output import read_tables

RUN_TIMEOUT = 600.0  # seconds per cluster run


class RunFailed(Exception):
    """A cluster run exited non-zero, wrote no summary, or timed out; the message has its stderr tail."""


def delay_seconds(s: dict) -> dict:
    """A run's delay p50, p95, p99 and max: exact (`run_cluster` reads them from the results) where known."""
    return {**s["delay_seconds"], **s.get("delay_exact", {})}


def run_numbers(s: dict) -> dict:
    """The numbers kept from one summary.json (the config is kept once, the result files not at all)."""
    slaves = s["slaves"].values()
    wt, wb = sum(v["window_tuples"] for v in slaves), sum(v["window_bytes"] for v in slaves)
    d = delay_seconds(s)
    nan_none = lambda x: None if x is None or math.isnan(x) else x
    return {
        "input_total": s["input_total"],
        "late": s["late"],
        "results": s["results"],
        "wall_seconds": s["wall_seconds"],
        "throughput": s["throughput_tuples_per_s"],
        **{f"delay_{q}": nan_none(d[q]) for q in ("p50", "p95", "p99", "max")},
        "delay_parts": s.get("delay_parts_seconds"),  # where the delay goes (buffer, transfer, join)
        "window_bytes_per_tuple": round(wb / wt, 1) if wt else None,
        "tuples_moved": s.get("tuples_moved", 0),
        "moves": len(s.get("balance", {}).get("moves", [])),
        "slaves": {
            r: {k: v[k] for k in ("tuples_processed", "window_tuples", "window_bytes", "busy_seconds", "comm_seconds")}
            for r, v in s["slaves"].items()
        },
        "first_tuple_seconds": s.get("startup", {}).get("first_tuple_seconds"),  # from the launch
        "process_seconds": s.get("process_seconds"),  # mpirun's start to its exit
        "pss_mb": round(sum(s["startup"]["pss_before_data_bytes"].values()) / 2**20, 1) if "startup" in s else None,
        "rank_rss_mb": {
            "0": round(s["master_peak_rss_bytes"] / 2**20, 1),
            **{r: round(v["peak_rss_bytes"] / 2**20, 1) for r, v in s["slaves"].items()},
        },
    }


def quarter_p99(samples: pa.Table | None, parts: int = 4) -> list[float | None]:
    """From the master's metrics log of a run (a sample a second: input counts, the delay p99 of the results
    reported since the sample before), per `parts` of the input by ingest: the median of the samples' delay p99s.
    The samples after the input's end (the drain) count for no part; a part without a p99 is None."""
    if samples is None or not samples.num_rows:
        return [None] * parts
    t = samples.sort_by("elapsed")
    seen = t["input_r"].to_numpy() + t["input_s"].to_numpy()
    total = seen.max()
    last = int(np.argmax(seen >= total))  # the first sample after the last tuple came in
    p99 = t["delay_p99"].to_numpy(zero_copy_only=False)[: last + 1].astype(float)
    part = np.minimum(np.ceil(seen[: last + 1] * parts / max(total, 1)).astype(int) - 1, parts - 1)  # -1: no input yet
    return [median(p99[part == i]) for i in range(parts)]


def aggregate(runs: list[dict]) -> dict:
    """Medians over the repeats of one kind of run."""
    return {f"delay_{q}": median(r[f"delay_{q}"] for r in runs) for q in ("p50", "p95", "p99", "max")}


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


def _exited(pid: int, timeout: float, each=None) -> bool:
    """Wait up to `timeout` s for the run's mpirun to exit, leaving it unreaped (its pid stays ours); `each()` is
    called about once a second meanwhile."""
    deadline = time.monotonic() + timeout
    next_call = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT):
            return True
        if each is not None and time.monotonic() >= next_call:
            each()
            next_call += 1.0
        time.sleep(0.05)
    return False


def _drop_results(out: Path) -> None:
    """Delete the run's complete result files (a slave writes each under a temporary name, then renames it)."""
    for f in (out / "results").glob("*.parquet"):
        f.unlink(missing_ok=True)


def _end_session(pid: int) -> None:
    """SIGTERM to mpirun (it ends the job), then SIGKILL to whatever of the run is left."""
    os.kill(pid, signal.SIGTERM)
    _exited(pid, 10)
    for p in _session_pids(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_cluster(
    ranks: int,
    settings: list[str],
    workdir: Path,
    timeout: float,
    module: str = "master",
    env: dict[str, str] | None = None,
    keep=None,
    drop_results: bool = False,
) -> dict:
    """One `mpirun -n ranks python -m master --set ...` into workdir; its summary.json, plus its peak RSS.

    `module` and `env` replace the rank program and add environment variables (bench.balance runs
    every rank through the CPU-pinning wrapper `bench.busy`); `keep(out)` takes what it needs from the
    output folder (as `kept` in the summary) before the folder is removed.  The exact delay percentiles are read
    from the result files, unless `drop_results`: delete them as they are written, and keep the summary's binned
    percentiles (a long run's results: 0.9 per input tuple on the paper workload, about 19 bytes each on disk,
    8 GB for 60 s at 8M/s, and 4 GB of delays to read whole).

    The run gets a session of its own so a hung (or interrupted) run can be ended
    completely; os.wait4 gives the largest RSS of any process in it (prterun reaps
    the ranks) at no cost.
    """
    workdir.mkdir(parents=True)
    out = workdir / "out"
    # metrics on any free port (a run beside another cluster, or another bench, would find 9464 taken)
    args = [
        a
        for kv in ["metrics.endpoint=127.0.0.1:0", *settings, f"output.path={out}", "output.progress=0"]
        for a in ("--set", kv)
    ]
    began = time.monotonic()
    with open(workdir / "stdout", "wb") as so, open(workdir / "stderr", "wb") as se:
        proc = subprocess.Popen(
            mpirun_command(ranks, args, module=module),
            env={**mpi_env(), **(env or {})},
            stdout=so,
            stderr=se,
            start_new_session=True,
        )
    try:
        timed_out = not _exited(proc.pid, timeout, (lambda: _drop_results(out)) if drop_results else None)
    except BaseException:  # Ctrl-C: the run is in its own session and did not get the signal
        timed_out = True
        raise
    finally:
        if timed_out:
            _end_session(proc.pid)
        _, status, usage = os.wait4(proc.pid, 0)
        process_seconds = round(time.monotonic() - began, 2)
        proc.returncode = os.waitstatus_to_exitcode(status)
    tail = "\n".join((workdir / "stderr").read_text(errors="replace").splitlines()[-30:])
    summary = out / "summary.json"
    if timed_out or proc.returncode != 0 or not summary.exists():
        why = f"timed out after {timeout:.0f}s" if timed_out else f"exit code {proc.returncode}"
        raise RunFailed(f"{why}: {' '.join(proc.args)}\n--- stderr tail ---\n{tail}")
    s = json.loads(summary.read_text())
    s["peak_rss_mb"] = round(usage.ru_maxrss / 1024, 1)  # Linux reports KiB
    s["cpu_seconds"] = round(usage.ru_utime + usage.ru_stime, 2)  # mpirun's and the ranks' it reaped
    s["process_seconds"] = process_seconds
    if not drop_results:  # every result row carries its delay: the exact percentiles, not the summary's bin edges
        results = read_tables(out / "results", ["delay"])
        delays = results["delay"].to_numpy() if results is not None else np.empty(0)
        s["delay_exact"] = dict(zip(("p50", "p95", "p99"), exact_percentiles(delays)))
    if keep is not None:
        s["kept"] = keep(out)
    shutil.rmtree(workdir)  # result files can be large; the summary is all we need
    return s


#: where a run's input comes from (`--input`): read from a Parquet file of the generated tuples (the default:
#: the Spark peer and the kernel limit get theirs that way, so all three are measured on input that is already
#: there; bench.inputs keeps the files between runs, the master streams them), or generated at the master as it
#: goes (the cluster's CPU then also makes the tuples)
INPUTS = ("file", "generator")


class Bench:
    """Runs the plan, prints a line per run, and keeps every number for results.json."""

    def __init__(
        self,
        slaves: list[int],
        repeats: int,
        steps: int,
        delay_bound: float,
        workload: list[str],
        timeout: float,
        tmp: Path,
        *,
        half: bool = True,
        tag: str = "",
        module: str = "master",
        env: dict[str, str] | None = None,
        input_kind: str = "file",
        cache: InputCache | None = None,
        capacity: bool = False,
        confirm_seconds: float = 0.0,
    ):
        """`half`: also repeat at half the sustained rate; `tag` names the runs (and their folders) in the
        progress lines; `module`, `env`: see run_cluster; `input_kind`: one of INPUTS; `cache`: where the input
        files are kept (default: a folder in `tmp`).  `capacity`: the runs measure capacity: every paced run gets
        at least MIN_INPUT_SECONDS of input at its rate and a shorter one cannot pass; then one confirmation run
        of `confirm_seconds` of input (0 = none)."""
        self.slaves, self.repeats, self.steps, self.delay_bound = slaves, repeats, steps, delay_bound
        self.workload, self.timeout, self.tmp = workload, timeout, tmp
        self.half, self.tag, self.module, self.env = half, tag, module, env
        self.input_kind, self.cache = input_kind, cache or InputCache(tmp / "inputs")
        self.capacity, self.confirm_seconds = capacity, confirm_seconds if capacity else 0.0
        self.total_runs = planned_runs(len(slaves), repeats, steps, half) + (len(slaves) if self.confirm_seconds else 0)
        self.done = 0
        self.config: dict | None = None

    def duration(self, tuples: float = 0) -> float:
        """The event-time length of an input of at least `tuples` (0: the workload's own): a rung of the ladder
        (bench.inputs), so files are shared between rates."""
        gen = load_plan(None, self.workload).generator
        if tuples > expected_tuples(gen):
            return rung(gen.duration, gen.rate, tuples)
        return gen.duration

    def source(self, tuples: float = 0) -> list[str]:
        """The settings of a run's input, long enough for `tuples` (0: the workload's own length)."""
        settings = [*self.workload, f"generator.duration={self.duration(tuples)!r}"]
        if self.input_kind == "generator":
            return settings
        return [*settings, "source.kind=file", f"source.path={self.cache.file(settings)}"]

    def run_at(self, k: int, label: str, rate: float, seconds: float = 0.0, long: bool = False) -> dict:
        """One run of k slaves paced at `rate` (0 = unpaced), its numbers, and a progress line.  A paced run of a
        capacity bench gets at least `seconds` (default MIN_INPUT_SECONDS) of input at its rate.  `long`: the
        result files are deleted as they come (the delays are the summary's bins) and the metrics log's delay p99
        per quarter of the input is kept (`quarter_p99`)."""
        self.done += 1
        seconds = seconds or (MIN_INPUT_SECONDS if self.capacity else 0.0)
        settings = [
            *self.source(seconds * rate),
            f"source.rate={float(rate)!r}",
            *(["metrics.log_interval=5.0"] if long else []),
        ]
        keep = (
            (lambda out: quarter_p99(read_tables(out / "metrics", ["elapsed", "input_r", "input_s", "delay_p99"])))
            if long
            else None
        )
        s = run_cluster(
            k + 1,
            settings,
            self.tmp / f"{self.tag}k{k}-{label.replace(' ', '').replace('#', '-')}",
            self.timeout,
            self.module,
            self.env,
            keep=keep,
            drop_results=long,
        )
        self.config = self.config or s["config"]
        r = {
            "label": label,
            **run_numbers(s),
            "peak_rss_mb": s["peak_rss_mb"],
            **({"quarter_p99": s["kept"]} if long else {}),
        }
        if self.input_kind == "file":
            r["input_file"] = next(x for x in settings if x.startswith("source.path=")).split("=", 1)[1]
        if rate > 0:
            tuples = r["input_total"] + r["late"]
            r.update(
                rate=rate,
                **keep_up(tuples, r["wall_seconds"], rate, s["pacing_lag_max_seconds"], s["backlog_max_seconds"]),
                **input_verdict(tuples, rate),
            )
            r["passed"], r["verdict"] = (counted_verdict if self.capacity else search_verdict)(r, self.delay_bound)
        line = (
            f"[{self.done:>2}/{self.total_runs}] {self.tag + ' ' if self.tag else ''}slaves={k} {label:<12} "
            f"{r['throughput']:>10,.0f} tuples/s in "
            f"{r['wall_seconds']:5.1f}s | delay p50 {fmt(r['delay_p50'], '.3f')}s p95 {fmt(r['delay_p95'], '.3f')}s"
            f" p99 {fmt(r['delay_p99'], '.3f')}s | peak RSS {r['peak_rss_mb']:.0f} MB"
        )
        if rate > 0:
            line += (
                f" | paced {rate:,.0f}/s over {r['input_seconds']:.1f}s: {r['ratio']:.0%} "
                f"{'kept up' if r['kept_up'] else 'FELL BEHIND'} -> "
                f"{'PASS' if r['passed'] else 'FAIL: ' + r['verdict']}"
            )
        print(line, flush=True)
        return r

    def confirm(self, k: int, rate: float) -> dict:
        """One run paced at `rate` over `confirm_seconds` of input: the search's test, and a delay p99 in its last
        quarter within `flatness` of its first (a backlog that grows slowly shows only over a long run)."""
        r = self.run_at(k, "confirm", rate, self.confirm_seconds, long=True)
        first, *_, last = r["quarter_p99"]
        r["flatness"] = flatness(first, last, load_plan(None, self.workload).epochs.distribution)
        r["confirmed"] = bool(r["passed"] and r["flatness"]["flat"])
        f = r["flatness"]
        print(
            f"    confirm: delay p99 first quarter {fmt(f['first_p99'], '.3f')}s, last {fmt(f['last_p99'], '.3f')}s "
            f"(limit {fmt(f['limit'], '.3f')}s) -> {'CONFIRMED' if r['confirmed'] else 'NOT CONFIRMED'}",
            flush=True,
        )
        return r

    def point(self, k: int) -> dict:
        """Probe, search, then repeats at the sustained rate and at half of it, and the confirmation run, for k
        slaves."""
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
            self.total_runs -= (2 if self.half else 1) * self.repeats + (1 if self.confirm_seconds else 0)
        at = [self.run_at(k, f"sustained #{i + 1}", rate) for i in range(self.repeats)] if rate else []
        half_rate = round(HALF_LOAD * rate) if self.half else 0
        half = [self.run_at(k, f"half #{i + 1}", half_rate) for i in range(self.repeats)] if half_rate else []
        return {
            "slaves": k,
            "ranks": k + 1,
            "unpaced": unpaced,
            "probe": probe,
            "search": {"trail": trail, "bracket": bracket(trail), "runs": search},
            "sustained": {"rate": rate, "throughput": median(r["throughput"] for r in at), **aggregate(at), "runs": at},
            "half": {"rate": half_rate, **aggregate(half), "runs": half},
            "confirm": self.confirm(k, rate) if rate and self.confirm_seconds else None,
        }


def planned_runs(n_slave_counts: int, repeats: int, steps: int, half: bool = True) -> int:
    """Runs the plan makes at most: per slave count a probe, the search, and repeats at the sustained rate
    (and at half of it)."""
    return n_slave_counts * (1 + steps + (2 if half else 1) * repeats)
