"""`python -m bench.aggregate [--quick] [--seconds S] [--lag-seconds S] [--repeats 3] [--slaves 2] [--out DIR]`:
the join with two-phase aggregation on (3 group columns, 4 measures) against the same join without, and the
merger's view lag.

The workload is bench.payload's (the generator's tuples as two declared streams, a Parquet file each) with
payload columns made to group by: bids carry `region` (8 texts), `tier` (int32, 3) and `price` (float64), asks
`venue` (4 texts), `amount` (float64) and `qty` (int64).  Unpaced runs alternate `aggregate.enabled = false`
and the view per `bids_region, asks_venue, bids_tier` and 1 s tumbling window of count, sum(asks_amount),
avg(bids_price) and max(asks_qty) (partials flushed every FLUSH seconds in both); the report gives each side's
in-run rates and the ratio of the medians against the target (with aggregation at least 80% of without).

Then the view lag: one run paced at half the aggregated runs' median rate (the same generator, its input long
enough to last --lag-seconds, default 40) with the merger (control.aggregate,
Structured Streaming, a micro-batch every TRIGGER seconds) beside it in this process.  A window's end is
passed by the run's watermark when every slave has published a partial file stamped with a watermark at or
past it (the stamps carry each slave's watermark, the files' times when they were published); the window is
in the view when the first snapshot holding it `final` is written (every snapshot is kept, its file's time).
The lag is the second minus the first, per window: p50, p99 and max, over the windows whose end the slaves
passed before the end of input (the last ones are decided by the stamps of the run's end) and after the
merger's first snapshot (before it, the merger's start is in the lag).  It includes the join's reach (a window
is final once the watermark is past its end by it) and the merger's own micro-batches.
Output: aggregate.md, aggregate.json.
"""

from __future__ import annotations

import subprocess
from dataclasses import replace
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from bench.ab import Comparison, parser
from bench.cluster import RunFailed
from bench.payload import STREAMS, stream_settings, write_streams
from deploy.launch import mpi_env, mpirun_command
from protocol.aggregation import FINAL, RANK, WATERMARK, WINDOW_END
from protocol.plan import load_plan
from protocol.eventtime import POS_INF

RATE_TARGET = 0.8
REGIONS = np.array(["north", "south", "east", "west", "centre", "coast", "hills", "islands"], dtype=object)
VENUES = np.array(["xnys", "xlon", "xpar", "xtks"], dtype=object)
AGGREGATE = {
    "aggregate.enabled": "true",
    "aggregate.group_by": '["bids_region", "asks_venue", "bids_tier"]',
    "aggregate.window": '"1s"',
    "aggregate.measures": '["count", "sum(asks_amount)", "avg(bids_price)", "max(asks_qty)"]',
}
FLUSH = 0.5  #: aggregate.flush_interval of every run: seconds between two partial files of a slave
TRIGGER = 0.5  #: the merger's seconds between micro-batches
IDLE = 3.0  #: the merger stops this many seconds after its last batch, once the run has ended


def columns(side: int, ids: np.ndarray, values: np.ndarray) -> dict:
    """The payload columns of a stream's tuples (bids: side 0), derived from their ids and values."""
    if side == 0:
        return {"region": pa.array(REGIONS[ids % 8]), "tier": (ids % 3).astype(np.int32), "price": values}
    return {"venue": pa.array(VENUES[ids % 4]), "amount": values, "qty": ids % 100}


def stamps(aggregates: Path) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per slave: the watermarks of its partial files (int64 microseconds) and when each was published (unix
    seconds), in publication order."""
    per: dict[int, list[tuple[float, int]]] = {}
    for f in aggregates.glob("slave-*.parquet"):
        t = pq.read_table(f, columns=[RANK, WATERMARK])
        stamp = t.filter(pc.is_valid(t[RANK]))
        per.setdefault(stamp[RANK][0].as_py(), []).append((f.stat().st_mtime, stamp[WATERMARK][0].as_py()))
    out = {}
    for rank, rows in per.items():
        rows.sort()
        out[rank] = (np.array([w for _, w in rows], np.int64), np.array([m for m, _ in rows]))
    return out


def passed(per_slave: dict[int, tuple[np.ndarray, np.ndarray]], ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(when, by_end): for each window end, the time the last slave published a stamp at or past it (nan if one
    never did), and whether that took a stamp of the run's end (POS_INF)."""
    when = np.full(len(ends), -np.inf)
    by_end = np.zeros(len(ends), bool)
    for watermarks, times in per_slave.values():
        highest = np.maximum.accumulate(watermarks)
        i = np.searchsorted(highest, ends, "left")
        seen, j = i < len(highest), np.minimum(i, len(highest) - 1)
        when = np.where(seen, np.maximum(when, times[j]), np.nan)  # nan stays nan: a slave never passed it
        by_end |= seen & (highest[j] >= POS_INF)
    return when, by_end


def appeared(view: Path) -> dict[int, float]:
    """Per window end (microseconds): when the first snapshot holding it final was written."""
    first: dict[int, float] = {}
    for f in sorted(view.glob("view-*.parquet")):
        t = pq.read_table(f, columns=[WINDOW_END, FINAL])
        ends = pc.unique(t.filter(t[FINAL])[WINDOW_END]).cast(pa.int64()).to_numpy()
        for e in ends.tolist():
            first.setdefault(e, f.stat().st_mtime)
    return first


def view_lag(aggregates: Path, view: Path) -> dict:
    """The lag from the watermark passing each window's end to the window final in the view (module doc)."""
    shown = appeared(view)
    snapshots = sorted(view.glob("view-*.parquet"))
    if not shown or not snapshots:
        return {"windows": 0}
    ends = np.array(sorted(shown), np.int64)
    per_slave = stamps(aggregates)
    when, by_end = passed(per_slave, ends)
    start = snapshots[0].stat().st_mtime
    lag = np.array([shown[e] for e in ends.tolist()]) - when
    steady = ~by_end & (when >= start) & np.isfinite(lag)
    x = lag[steady]
    first_file = min(t[0] for _, t in per_slave.values())
    out = {
        "windows": int(steady.sum()),
        "windows_in_view": len(ends),
        "decided_by_the_end": int(by_end.sum()),
        "merger_start_seconds": round(start - first_file, 2),  #: the first partial file to the first snapshot
    }
    if len(x):
        out |= {k: round(float(v), 3) for k, v in zip(("p50", "p99", "max"), np.percentile(x, [50, 99, 100]))}
    return out


def lag_run(ranks: int, settings: list[str], work: Path, timeout: float) -> dict:
    """The cluster paced by `settings` with the merger beside it (every snapshot kept); the view lag."""
    from control import aggregate
    from control.spark import session

    out = work / "out"
    args = [
        x
        for kv in ["metrics.endpoint=127.0.0.1:0", *settings, f"output.path={out}", "output.progress=0"]
        for x in ("--set", kv)
    ]
    from pyspark.sql import SparkSession

    spec = load_plan(None, settings).aggregate.view
    ours = SparkSession.getActiveSession() is None  #: stopped at the end unless a caller's (a test's) session
    spark = session(app="bench-aggregate")
    work.mkdir(parents=True, exist_ok=True)
    with open(work / "stderr", "wb") as se:
        proc = subprocess.Popen(
            mpirun_command(ranks, args), env=mpi_env(), stdout=subprocess.DEVNULL, stderr=se, start_new_session=True
        )
    try:
        deadline = time.monotonic() + timeout
        while not list((out / "aggregates").glob("slave-*.parquet")):  # the cluster's start has cleared it
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RunFailed(f"no partial file from the paced run: {(work / 'stderr').read_text()[-2000:]}")
            time.sleep(0.05)
        while True:  # the merger goes on from its checkpoint if it idled while the run still went
            aggregate.run_stream(
                spark,
                out / "aggregates",
                work / "view",
                work / "ckpt",
                IDLE,
                trigger=TRIGGER,
                quiet=True,
                spec=spec,
                keep=1 << 30,
            )
            if proc.poll() is not None or time.monotonic() > deadline:
                break
        if proc.wait(timeout=max(1.0, deadline - time.monotonic())) != 0:
            raise RunFailed(f"the paced run: exit {proc.returncode}: {(work / 'stderr').read_text()[-2000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if ours:
            spark.stop()
    return view_lag(out / "aggregates", work / "view")


def main(argv: list[str]) -> int:
    p = parser("python -m bench.aggregate", __doc__, 10.0, 30.0, 3)
    p.add_argument("--seconds", type=float, help="seconds of event time per run (default 30; 10 with --quick)")
    p.add_argument(
        "--lag-seconds", type=float, default=40.0, help="wall seconds of the paced run the lag is measured on"
    )
    a = p.parse_args(argv)
    seconds = a.seconds or (10.0 if a.quick else 30.0)
    gen = load_plan(None, [f"generator.duration={seconds}"]).generator
    try:
        with tempfile.TemporaryDirectory(prefix="streamjoin-aggregate-") as tmp:
            sizes = write_streams(gen, Path(tmp), columns, STREAMS)
            flush = [f"aggregate.flush_interval={FLUSH}"]
            workload = stream_settings(Path(tmp), STREAMS) + flush
            on = [f"{k}={v}" for k, v in AGGREGATE.items()]
            ab = Comparison("python -m bench.aggregate " + " ".join(argv), a, workload, {"none": [], "aggregate": on})
            ab.run(Path(tmp) / "runs")
            rate = round(ab.data["medians"]["aggregate"] / 2, 1)
            # the same generator, long enough to last --lag-seconds at that rate
            longer = replace(gen, duration=max(seconds, round(rate * a.lag_seconds / (2 * gen.rate), 3)))
            lag_input = Path(tmp) / "lag-input"
            lag_input.mkdir()
            write_streams(longer, lag_input, columns, STREAMS)
            paced = stream_settings(lag_input, STREAMS) + flush
            lag = lag_run(a.slaves + 1, [*paced, *on, f"source.rate={rate}"], Path(tmp) / "lag", a.timeout)
    except RunFailed as e:
        print(f"bench.aggregate: a run failed: {e}", file=sys.stderr)
        return 1
    ab.data["input_rows"] = sum(x["rows"] for x in sizes.values())
    ab.data["lag"] = lag | {"rate": rate, "trigger_seconds": TRIGGER, "flush_interval_seconds": FLUSH}
    same = len(set(map(tuple, ab.data["results"].values()))) == 1
    lines = [
        ab.verdict(RATE_TARGET),
        "",
        f"Results per run: {'the same in both modes' if same else 'DIFFERENT between the modes'} "
        f"({', '.join(f'{m}: {r}' for m, r in ab.data['results'].items())}).",
        "",
        f"View lag at {rate:,.0f} tuples/s (half the aggregated median; merger trigger {TRIGGER:g} s, partials every "
        f"{FLUSH:g} s): "
        + (
            f"p50 {lag['p50']:g} s, p99 {lag['p99']:g} s, max {lag['max']:g} s over {lag['windows']} windows "
            if lag.get("windows")
            else "no window measured "
        )
        + f"({lag.get('windows_in_view', 0)} final in the view, {lag.get('decided_by_the_end', 0)} decided by the "
        f"run's end and those passed before the merger's first snapshot, {lag.get('merger_start_seconds')} s after "
        "the first partial file, left out).",
    ]
    ab.write("aggregate", "The join with two-phase aggregation against the same join without", "aggregate", lines)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
