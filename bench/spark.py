"""The peer in the benchmark: Spark Structured Streaming's inner stream-stream join on the same data.

`python -m bench.spark [--quick] [--set section.key=value ...]` finds Spark's sustained input rate
the way bench.search finds the cluster's; `python -m bench --peer spark` runs it beside the cluster.

The job (`start_join`) is what a Spark user would write for the project's contract: two file streams R and
S (Parquet, one directory each), `withWatermark` on event time with `join.max_delay`, and an inner join on
`r.key = s.key` and the time range `|r.ts - s.ts| <= join.window` (stated on the event-time columns, so Spark
can drop state, plus the exact test on the float seconds), written by `foreachBatch` to Parquet files.  It
runs on `local[N]` with N = the cores and `spark.sql.shuffle.partitions` = N, the default trigger (the
next micro-batch starts as soon as the last one ended: Spark's lowest delay), and the in-memory state store.

The data is the project's generated workload (`common.workload.generate_all`), so the same seed gives the
same tuples as the cluster joins.  A feeder thread paces it: the tuple i of a run at rate x arrives at
t0 + i/x (its nominal arrival, as in the cluster's paced runs), and every `SLICE` seconds the tuples that
arrived in the slice are written as one Parquet file per stream (atomically: a hidden name, then a
rename).  A result's **delay** is the wall time its micro-batch's files were written minus the nominal
arrival of the later of its two tuples; its percentiles are exact, as the bench takes them for the cluster
(`protocol.delays.exact_percentiles`).

A paced run **kept up** iff, after the last input file was dropped, Spark had joined and written
everything within `--delay-bound` seconds (`drain_seconds`); it passes the search's test iff it kept up
and its delay p95 is at most `--delay-bound` (the cluster's test has the same bound on p95).  The search
itself (probe, halving, geometric bisection) is bench.search's.

Spark does not follow the project's per-tuple lateness rule (its watermark moves per micro-batch), so the
two agree exactly on input without disorder, which the bench uses (`generator.disorder = 0`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bench.search import DELAY_BOUND, bracket, confirmed, median, next_rate, search_verdict, sustained_rate
from bench.tables import fmt, md_table, trail_text
from protocol import eventtime
from protocol.plan import load_plan
from protocol.delays import exact_percentiles
from protocol.tuples import STREAM_R

if TYPE_CHECKING:
    from protocol.plan import Plan

SLICE = 0.2  # seconds of arrivals per input file (per stream)
RUN_SECONDS = 20.0  # a paced run feeds at most this many seconds of input (quick: QUICK_RUN_SECONDS)
QUICK_RUN_SECONDS = 10.0
WARM_TUPLES = 20_000  # joined before a run's clock starts (at most a tenth of the run's tuples)
PROBE_TUPLES = 1 << 19  # the unpaced probe joins this many tuples (or all there are) as one backlog
PEER_DELAY_BOUND = 5.0  # default --peer-delay-bound of python -m bench: Spark's micro-batches alone take over a second


# --------------------------------------------------------------------------- pure helpers


def slice_bounds(n: int, rate: float, slice_seconds: float) -> list[tuple[int, int]]:
    """[start, end) index ranges of the tuples whose nominal arrival i/rate falls in each slice of the run."""
    if rate <= 0 or slice_seconds <= 0:
        raise ValueError(f"rate and slice must be positive, got {rate}, {slice_seconds}")
    slices = max(1, int(np.ceil(n / rate / slice_seconds)))
    cuts = np.minimum(np.ceil(np.arange(slices + 1) * slice_seconds * rate).astype(np.int64), n)
    cuts[-1] = n
    return [(int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:])]


def stream_tables(data, lo: int, hi: int, arrival: np.ndarray) -> tuple[pa.Table, pa.Table]:
    """Tuples lo..hi of the generated input as one Arrow table per stream (R, S) with their arrival times."""
    sl = slice(lo, hi)
    is_r = data.stream[sl] == STREAM_R
    cols = {
        "id": data.id[sl],
        "ts": eventtime.to_seconds(data.ts[sl]),
        "key": data.key[sl],
        "value": data.value[sl],
        "arrival": arrival,
    }
    return (pa.table({k: v[is_r] for k, v in cols.items()}), pa.table({k: v[~is_r] for k, v in cols.items()}))


# --------------------------------------------------------------------------- Spark


def spark_session(cores: int | None = None):
    """A local Spark session for the bench: local[cores], shuffle partitions = cores, quiet logs."""
    from control.spark import session

    cores = cores or os.cpu_count()
    return session(
        f"local[{cores}]",
        "streamjoin-peer",
        {
            "spark.sql.shuffle.partitions": str(cores),
            "spark.default.parallelism": str(cores),
            "spark.driver.memory": "4g",
            "spark.sql.streaming.noDataMicroBatches.enabled": "false",
            # the file source lists each new file as a path; above this many paths the listing becomes a
            # Spark job with a task per file (seconds per micro-batch on 2 cores): list in the driver
            "spark.sql.sources.parallelPartitionDiscovery.threshold": "1000000",
        },
    )


SCHEMA = "id LONG, ts DOUBLE, key LONG, value DOUBLE, arrival DOUBLE"


class Sink:
    """foreachBatch target: writes each micro-batch's results to Parquet, then keeps the delay of every result
    (written now minus the later arrival of its two tuples) and counts results and batches."""

    def __init__(self, out: Path):
        self.out = out
        self.delays: list[np.ndarray] = []
        self.results = self.batches = 0
        self.measuring = False  # off during the warm-up: its results are written and counted, not timed
        self.max_delay = 0.0

    def __call__(self, df, batch_id: int) -> None:
        # one Spark job per micro-batch: the results come to the driver as Arrow and are written from there
        t = df.toArrow()
        later = np.maximum(t["r_arrival"].to_numpy(), t["s_arrival"].to_numpy())
        pq.write_table(t.drop_columns(["r_arrival", "s_arrival"]), self.out / f".batch-{batch_id:06d}.parquet")
        os.replace(self.out / f".batch-{batch_id:06d}.parquet", self.out / f"batch-{batch_id:06d}.parquet")
        written = time.time()
        self.results += len(later)
        if self.measuring:
            self.delays.append(written - later)
            self.batches += 1
            self.max_delay = max(self.max_delay, float(self.delays[-1].max(initial=0.0)))


def start_join(spark, r_dir: Path, s_dir: Path, out: Path, checkpoint: Path, window: float, max_delay: float):
    """The streaming query: R and S file streams, watermarks, the inner time-range equi-join, foreachBatch."""
    from pyspark.sql import functions as F

    def side(path: Path, p: str):
        d = spark.readStream.schema(SCHEMA).parquet(str(path))
        d = d.select(
            *(F.col(c).alias(f"{p}_{c}") for c in ("id", "ts", "key", "value", "arrival")),
            F.timestamp_seconds(F.col("ts")).alias(f"{p}_time"),
        )
        return d.withWatermark(f"{p}_time", f"{int(round(max_delay * 1e6))} microseconds")

    r, s = side(r_dir, "r"), side(s_dir, "s")
    slack = f"INTERVAL {int(round(window * 1e6)) + 1} MICROSECONDS"  # timestamps keep microseconds: 1 us slack
    joined = r.join(
        s,
        F.expr(
            f"r_key = s_key AND s_time >= r_time - {slack} AND s_time <= r_time + {slack}"
            f" AND abs(r_ts - s_ts) <= {window!r}"
        ),
        "inner",
    )
    joined = joined.drop("r_time", "s_time")
    sink = Sink(out)
    query = joined.writeStream.foreachBatch(sink).option("checkpointLocation", str(checkpoint)).start()
    return query, sink


def drop(dirs: tuple[Path, Path], tables: tuple[pa.Table, pa.Table], name: str) -> None:
    """One Parquet file per stream, written under a hidden name (the file source skips those), then renamed."""
    for d, t in zip(dirs, tables):
        pq.write_table(t, d / f".{name}")
        os.rename(d / f".{name}", d / name)


def drain(query, timeout: float) -> None:
    """Wait until the query has joined and written everything dropped so far (at most `timeout` s)."""
    done = threading.Event()
    failure: list[BaseException] = []

    def wait():
        try:
            query.processAllAvailable()
        except BaseException as e:  # reported below, in the caller's thread
            failure.append(e)
        done.set()

    threading.Thread(target=wait, daemon=True).start()
    if not done.wait(timeout):
        raise TimeoutError(f"Spark did not finish the run within {timeout:.0f} s of the last input file")
    if failure:
        raise failure[0]


def run_spark(
    spark,
    data,
    n: int,
    rate: float,
    workdir: Path,
    window: float,
    max_delay: float,
    timeout: float = 600.0,
    warm: int = WARM_TUPLES,
) -> dict:
    """One run over the first n tuples: paced at `rate` (0 = all dropped at once, the unpaced probe).

    The first `warm` of them (at most a tenth) are a warm-up, dropped at once and joined before the clock
    starts, so that the query's start (planning, code generation, state stores) is not timed: a streaming
    job runs for long.  Their results are written and counted, their delays are not."""
    r_dir, s_dir, out = workdir / "r", workdir / "s", workdir / "results"
    for d in (r_dir, s_dir, out):
        d.mkdir(parents=True)
    query, sink = start_join(spark, r_dir, s_dir, out, workdir / "checkpoint", window, max_delay)
    try:
        w = min(warm, n // 10)
        drop((r_dir, s_dir), stream_tables(data, 0, w, np.full(w, time.time())), "warm.parquet")
        drain(query, timeout)
        sink.measuring = True
        bounds = [(w + a, w + b) for a, b in (slice_bounds(n - w, rate, SLICE) if rate > 0 else [(0, n - w)])]
        t0 = time.time()
        arrival_of = (lambda i: t0 + (i - w) / rate) if rate > 0 else (lambda i: np.full(len(i), t0))
        lag = 0.0
        for k, (lo, hi) in enumerate(bounds):
            due = t0 + (k + 1) * SLICE if rate > 0 else t0
            if (wait := due - time.time()) > 0:
                time.sleep(wait)
            lag = max(lag, time.time() - due)
            drop((r_dir, s_dir), stream_tables(data, lo, hi, arrival_of(np.arange(lo, hi))), f"part-{k:06d}.parquet")
        dropped = time.time()
        drain(query, timeout)
        drained = time.time()
    finally:
        query.stop()
    wall = drained - t0
    n -= w
    p50, p95, p99 = exact_percentiles(np.concatenate([np.empty(0), *sink.delays]))
    return {
        "rate": rate,
        "input_total": n,
        "warm_up": w,
        "results": sink.results,
        "batches": sink.batches,
        "wall_seconds": round(wall, 3),
        "throughput": round(n / wall, 1) if wall > 0 else 0.0,
        "drain_seconds": round(drained - dropped, 3),
        "feed_lag_seconds": round(lag, 3),
        "delay_p50": nan_none(p50),
        "delay_p95": nan_none(p95),
        "delay_p99": nan_none(p99),
        "delay_max": round(sink.max_delay, 3) if sink.results else None,
    }


def nan_none(x: float) -> float | None:
    return None if x != x else x


def kept_up(run: dict, bound: float) -> bool:
    """Spark kept up iff it finished joining and writing within `bound` s of the last input file."""
    return run["drain_seconds"] <= bound


# --------------------------------------------------------------------------- the search


class SparkBench:
    """The sustained-rate search of bench.search, on Spark: probe (unpaced), search, repeats at the rate."""

    def __init__(
        self, plan: Plan, run_seconds: float, steps: int, repeats: int, delay_bound: float, timeout: float, tmp: Path
    ):
        from common.workload import generate_all

        self.plan, self.run_seconds, self.steps, self.repeats = plan, run_seconds, steps, repeats
        self.delay_bound, self.timeout, self.tmp = delay_bound, timeout, tmp
        if plan.generator.disorder:
            raise ValueError(
                "the Spark peer needs generator.disorder = 0: Spark's watermark moves per micro-batch, "
                "so its lateness differs from the project's per-tuple rule"
            )
        self.data = generate_all(plan.generator)
        self.runs = 0
        self.spark = spark_session()

    def run(self, label: str, rate: float) -> dict:
        self.runs += 1
        total = len(self.data.id)
        n = min(total, PROBE_TUPLES) if rate <= 0 else min(total, int(rate * self.run_seconds))
        j = self.plan.join
        r = {
            "label": label,
            **run_spark(
                self.spark,
                self.data,
                n,
                rate,
                self.tmp / f"spark-{self.runs}",
                j.upper / eventtime.PER_SECOND,  # the workload's symmetric window: |r.ts - s.ts| <= upper
                j.max_delay / eventtime.PER_SECOND,
                self.timeout,
            ),
        }
        shutil.rmtree(self.tmp / f"spark-{self.runs}", ignore_errors=True)
        line = (
            f"[spark {self.runs:>2}] {label:<12} {r['input_total']:>9,} tuples "
            f"{r['throughput']:>9,.0f} tuples/s in "
            f"{r['wall_seconds']:5.1f}s | {r['batches']} batches | delay p50 {fmt(r['delay_p50'], '.3f')}s "
            f"p95 {fmt(r['delay_p95'], '.3f')}s p99 {fmt(r['delay_p99'], '.3f')}s"
        )
        if rate > 0:
            r["kept_up"] = kept_up(r, self.delay_bound)
            r["passed"], r["verdict"] = search_verdict(r, self.delay_bound)
            line += (
                f" | paced {rate:,.0f}/s, drained in {r['drain_seconds']:.2f}s -> "
                f"{'PASS' if r['passed'] else 'FAIL: ' + r['verdict']}"
            )
        print(line, flush=True)
        return r

    def point(self) -> dict:
        probe = self.run("probe", 0.0)
        trail, search = [], []
        while (rate := next_rate(trail, probe["throughput"], self.steps)) is not None:
            r = self.run(f"search #{len(search) + 1}", rate)
            search.append(r)
            trail.append((rate, r["passed"]))
        rate = sustained_rate(trail)
        at = [self.run(f"sustained #{i + 1}", rate) for i in range(self.repeats)] if rate else []
        return {
            "peer": "spark",
            "cores": os.cpu_count(),
            "run_seconds": self.run_seconds,
            "delay_bound": self.delay_bound,
            "unpaced": probe["throughput"],
            "probe": probe,
            "search": {"trail": trail, "bracket": bracket(trail), "runs": search},
            "sustained": {
                "rate": rate,
                "throughput": median(r["throughput"] for r in at),
                **{f"delay_{q}": median(r[f"delay_{q}"] for r in at) for q in ("p50", "p95", "p99")},
                "runs": at,
            },
        }

    def close(self) -> None:
        self.spark.stop()


def peer_table(p: dict) -> str:
    st = p["sustained"]
    return md_table(
        [
            "peer",
            "unpaced tuples/s",
            "sustained rate/s",
            "search (✓ pass, ✗ fail)",
            "repeats passed",
            "delay p50 s",
            "p95 s",
            "p99 s",
        ],
        [
            [
                f"Spark local[{p['cores']}]",
                fmt(p["unpaced"]),
                fmt(st["rate"]),
                trail_text(p["search"]["trail"]),
                f"{sum(r['passed'] for r in st['runs'])}/{len(st['runs'])}" if st["runs"] else "-",
                *(fmt(st[f"delay_{q}"], ".3f") for q in ("p50", "p95", "p99")),
            ]
        ],
    )


def ratio(points: list[dict], peer: dict, cluster_bound: float | None = None) -> dict:
    """The cluster's best sustained rate (over its slave counts whose rate is confirmed: bench.search.confirmed)
    over Spark's;
    when Spark sustained no rate, a lower bound from the lowest rate it was tried at."""
    best = max(
        [p for p in points if confirmed(p)] or [{"slaves": None, "sustained": {"rate": 0}}],
        key=lambda p: p["sustained"]["rate"],
    )
    spark = peer["sustained"]["rate"]
    lowest = min((r for r, _ in peer["search"]["trail"]), default=None)
    value = best["sustained"]["rate"] / spark if spark else None
    at_least = best["sustained"]["rate"] / lowest if not spark and lowest else None
    return {
        "cluster_rate": best["sustained"]["rate"],
        "cluster_slaves": best["slaves"],
        "spark_rate": spark,
        "bounds": [cluster_bound, peer["delay_bound"]] if cluster_bound else None,
        "ratio": round(value, 2) if value else None,
        "ratio_at_least": round(at_least, 2) if at_least else None,
    }


def ratio_text(r: dict) -> str:
    cluster = (
        f"cluster ({r['cluster_slaves']} slaves) {r['cluster_rate']:,.0f}/s"
        if r["cluster_slaves"]
        else "cluster (no slave count's rate confirmed by its repeats and confirmation run)"
    )
    head = f"{cluster} vs Spark {r['spark_rate']:,.0f}/s"
    if r.get("bounds"):
        head += f" (delay p95 bounds {r['bounds'][0]:g} s and {r['bounds'][1]:g} s)"
    if r["ratio"]:
        return f"{head}: ratio cluster/Spark **{r['ratio']:.1f}x**"
    if r["ratio_at_least"]:
        return f"{head}: Spark sustained no paced rate tried, so the ratio is more than {r['ratio_at_least']:.1f}x"
    return f"{head}: no ratio (the cluster sustained no confirmed rate)"


def report_section(points: list[dict], peer: dict, cluster_bound: float) -> list[str]:
    """The report's section on the peer: its table, the ratio, how it was measured, every Spark run."""
    delay_bound = peer["delay_bound"]
    floor = min(
        (r["delay_p50"] for r in [*peer["search"]["runs"], *peer["sustained"]["runs"]] if r["delay_p50"] is not None),
        default=None,
    )
    return [
        "## Peer: Spark Structured Streaming",
        "",
        peer_table(peer),
        "",
        ratio_text(ratio(points, peer, cluster_bound)),
        "",
        f"Spark is held to a delay p95 bound of {delay_bound:g} s, the cluster to {cluster_bound:g} s: a "
        "micro-batch of this join takes over a second on this machine even when small"
        + (f" (Spark's lowest delay p50 in any paced run here: {floor:.2f} s)" if floor else "")
        + ", so the cluster's bound would leave it little or no room; the looser bound lets the ratio "
        "compare throughput (`--peer-delay-bound`).",
        "",
        f"The same generated data (same config and seed), fed as one Parquet file per stream every {SLICE:g} s "
        f"of nominal arrivals; a paced run feeds at most {peer['run_seconds']:g} s of input (the cluster's runs "
        f"feed the whole input), the probe {PROBE_TUPLES:,} tuples at once. Spark local[{peer['cores']}], "
        f"shuffle partitions {peer['cores']}, default trigger, inner join on key and |r.ts - s.ts| <= window "
        f"with watermarks of join.max_delay. A run passes iff everything was joined and written within "
        f"{delay_bound:g} s of the last file (drain) and its delay p95 <= {delay_bound:g} s; delay = wall "
        "time the micro-batch's results were written minus the nominal arrival of the later tuple. "
        "Its result set equals the reference join (tests/cluster/test_bench_spark.py).",
        "",
        detail_table(peer),
        "",
    ]


def detail_table(p: dict) -> str:
    rows = [
        [
            r["label"],
            fmt(r["rate"]) if r["rate"] else "unpaced",
            fmt(r["input_total"]),
            fmt(r["throughput"]),
            str(r["batches"]),
            fmt(r["drain_seconds"], ".2f"),
            *(fmt(r[f"delay_{q}"], ".3f") for q in ("p50", "p95", "p99", "max")),
            (r["verdict"] if r["passed"] else "FAIL: " + r["verdict"]) if r["rate"] else "-",
        ]
        for r in [p["probe"], *p["search"]["runs"], *p["sustained"]["runs"]]
    ]
    return md_table(
        [
            "run",
            "pacing/s",
            "tuples",
            "throughput/s",
            "batches",
            "drain s",
            "delay p50 s",
            "p95 s",
            "p99 s",
            "max s",
            "passes",
        ],
        rows,
    )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.spark", description=__doc__.split("\n")[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK_RUN_SECONDS:g} s of paced input per run instead "
        f"of {RUN_SECONDS:g} s, 4 search steps instead of 6",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int)
    p.add_argument("--delay-bound", type=float, default=DELAY_BOUND)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="workload keys, as for python -m master (default: the default workload)",
    )
    a = p.parse_args(argv)
    plan = load_plan(None, a.set)
    with tempfile.TemporaryDirectory(prefix="streamjoin-spark-") as tmp:
        bench = SparkBench(
            plan,
            QUICK_RUN_SECONDS if a.quick else RUN_SECONDS,
            a.steps or (4 if a.quick else 6),
            a.repeats,
            a.delay_bound,
            a.timeout,
            Path(tmp),
        )
        try:
            point = bench.point()
        finally:
            bench.close()
    print("\n" + peer_table(point) + "\n\n" + detail_table(point))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
