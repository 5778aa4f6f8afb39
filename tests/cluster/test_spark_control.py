"""The Spark side against independent references, with real clusters (mpirun) and real Spark local[*]:
two-phase aggregation (streaming and batch), a killed and restarted merger, and replay of a time range."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from control import aggregate, audit, replay
from common.workload import generate_all
from protocol.config import load_config
from protocol.output import read_tables
from protocol.tuples import tuple_dtype
from slave.aggregate import combine, partials
from tests.runs import run_cluster
from tests.reference import micros, pairs_of, reference_pairs
from tests.unit.test_aggregate_logic import numpy_view
from tests.cluster.test_cluster import SMALL

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def view_columns(t: pa.Table) -> dict:
    t = t.sort_by([("key", "ascending"), ("window_start", "ascending")])
    return {c: t[c].to_numpy() for c in t.column_names}


def assert_view(got: pa.Table, want: dict):
    got = view_columns(got)
    assert len(got["key"]) == len(want["key"]) > 0
    for c in ("key", "window_start", "count", "min", "max"):
        assert np.array_equal(got[c], want[c], equal_nan=c in ("min", "max")), c
    assert np.allclose(got["sum"], want["sum"], rtol=1e-9, atol=1e-9, equal_nan=True)
    assert np.allclose(got["avg"], want["sum"] / want["count"], rtol=1e-9, equal_nan=True)


def reference_view(settings: dict, group_by: str, value: str, window: float) -> dict:
    """The reference join of the generated input, then per (key, window) count/sum/min/max with numpy."""
    cfg = load_config(None, [f"{k}={v}" for k, v in settings.items() if k.startswith("generator.")])
    d = generate_all(cfg)
    pairs, _ = reference_pairs(d.stream, d.id, d.ts, d.key, settings["join.window"], settings["join.max_delay"])
    rows = {}
    for side, code, ids in (("r", 0, pairs // 2**32), ("s", 1, pairs % 2**32)):
        mine = np.flatnonzero(d.stream == code)
        mine = mine[np.argsort(d.id[mine])]
        rows[side] = mine[np.searchsorted(d.id[mine], ids)]
    ts = np.maximum(d.ts[rows["r"]], d.ts[rows["s"]])
    key = d.key[rows["s" if group_by == "s_key" else "r"]]
    return numpy_view(key, ts, d.value[rows[value[0]]], micros(window))


@pytest.mark.parametrize(
    "group_by,value,window,fmt", [("key", "r_value", 0.0, "parquet"), ("s_key", "s_value", 0.5, "csv")]
)
def test_streaming_and_batch_views_equal_the_reference_aggregation(tmp_path, spark, group_by, value, window, fmt):
    settings = dict(
        SMALL,
        **{
            "generator.seed": 31,
            "source.rate": 12000.0,
            "output.format": fmt,
            "aggregate.enabled": True,
            "aggregate.group_by": group_by,
            "aggregate.value": value,
            "aggregate.window": window,
            "aggregate.flush_interval": 0.3,
        },
    )
    run = run_cluster(tmp_path, 3, settings)
    assert run.returncode == 0, run.stderr
    files = sorted((run.out / "aggregates").iterdir())
    assert {f.name[:9] for f in files} == {"slave-001", "slave-002"} and len(files) > 2
    want = reference_view(settings, group_by, value, window)
    assert want["count"].sum() == run.summary["results"]

    writer = aggregate.run_stream(
        spark, run.out / "aggregates", tmp_path / "view", tmp_path / "ckpt", until_idle=1.5, trigger=0.3, quiet=True
    )
    assert writer.batches >= 1
    assert_view(aggregate.read_view(tmp_path / "view"), want)
    view = ["--config", str(tmp_path / "run.toml"), "--view", str(tmp_path / "view")]
    assert audit.main(view, spark=spark) == audit.EXACT  # the audit's own view of the recomputed pairs agrees
    assert json.loads((run.out / "audit" / "view-start-end.json").read_text())["groups"] == len(want["key"])

    agg = {"group_by": group_by, "value": value, "window": window}
    batch = aggregate.from_results(spark, aggregate.result_files(run.out / "results"), agg)  # CSV or Parquet
    aggregate.ViewWriter(tmp_path / "batch", quiet=True)(batch, 0)
    assert_view(aggregate.read_view(tmp_path / "batch"), want)


def test_streaming_merger_and_batch_view_agree_on_the_same_results_with_nan_and_window_edges(tmp_path, spark):
    """Phase one (slave.aggregate, as slaves run it) and the result files (slave.result_files) of the same
    results, merged by the streaming job and recomputed by --batch: the same view, equal to numpy's.  Values
    hold NaN (a group of NaN only, groups with some NaN: NaN is the largest value in both views), later ts
    lie exactly on window edges given in decimals no float holds (0.3 s in 0.1 s windows) and below zero."""
    from slave.aggregate import PartialAggregator
    from slave.result_files import ResultWriter

    rng = np.random.default_rng(61)
    dt = tuple_dtype(64)
    out = tmp_path / "out"
    agg = {"window": 0.1, "flush_interval": 0.0, "group_by": "key", "value": "r_value"}
    phase_one = PartialAggregator(out / "aggregates", 1, agg)
    writer = ResultWriter(str(out / "results"), 1, "parquet", 10**9)
    keys, later, values = [], [], []
    for batch in range(6):
        n = 400
        r, s = np.zeros(n, dt), np.zeros(n, dt)
        r["id"], s["id"] = np.arange(n) + batch * n, np.arange(n) + batch * n
        r["key"] = s["key"] = rng.integers(0, 12, n)
        r["ts"] = rng.integers(-5, 20, n) * 100_000 + rng.choice([0, 1, 99_999], n)  # on and next to the edges
        s["ts"] = r["ts"] - rng.integers(0, 3, n) * 50_000
        r["value"] = rng.random(n)
        r["value"][rng.random(n) < 0.05] = np.nan
        r["value"][r["key"] == 3] = np.nan
        pairs = pairs_of(r, s)
        phase_one.add_pairs(pairs)
        writer.add_pairs(pairs, np.zeros(n))
        keys.append(r["key"]), later.append(np.maximum(r["ts"], s["ts"])), values.append(r["value"].copy())
    phase_one.flush()
    writer.flush()
    writer.wait()
    want = numpy_view(np.concatenate(keys), np.concatenate(later), np.concatenate(values), 100_000)
    assert np.isnan(want["max"]).sum() > 3 and np.isnan(want["min"]).sum() >= 1 and (want["window_start"] < 0).any()
    aggregate.run_stream(
        spark, out / "aggregates", tmp_path / "view", tmp_path / "ckpt", until_idle=1.5, trigger=0.3, quiet=True
    )
    streamed = aggregate.read_view(tmp_path / "view")
    batch_view = aggregate.from_results(spark, aggregate.result_files(out / "results"), agg)
    aggregate.ViewWriter(tmp_path / "batch", quiet=True)(batch_view, 0)
    batched = aggregate.read_view(tmp_path / "batch")
    assert_view(streamed, want)
    assert_view(batched, want)


def write_round(directory, rng, first: int, count: int) -> list[pa.Table]:
    """`count` partial files as slaves write them (random results, 1 s windows); returns their tables."""
    out = []
    for i in range(first, first + count):
        n = int(rng.integers(200, 800))
        t = partials(rng.integers(0, 60, n), rng.integers(0, 6_000_000, n), rng.random(n), 1_000_000)
        pq.write_table(t, directory / f".tmp-{i}")
        os.replace(directory / f".tmp-{i}", directory / f"slave-{1 + i % 3:03d}-{i:06d}.parquet")
        out.append(t)
    return out


def test_merger_killed_mid_stream_and_restarted_ends_with_the_uninterrupted_view(tmp_path, spark):
    rng = np.random.default_rng(41)
    source = tmp_path / "out" / "aggregates"
    source.mkdir(parents=True)
    tables = write_round(source, rng, 0, 4)
    ckpt, view = tmp_path / "ckpt", tmp_path / "view"
    cmd = [
        sys.executable,
        "-m",
        "control.aggregate",
        "--out",
        str(tmp_path / "out"),
        "--view",
        str(view),
        "--checkpoint-location",
        str(ckpt),
        "--max-files-per-trigger",
        "1",
        "--trigger",
        "0.2",
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 150
        while len(list(view.glob("view-*.parquet"))) < 2:  # two micro-batches done, more files waiting
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "slow"
            time.sleep(0.1)
        tables += write_round(source, rng, 4, 3)
        time.sleep(0.3)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the job and its JVM, without any chance to clean up
        proc.wait()
    killed_at = aggregate.read_view(view)
    assert killed_at["count"].to_numpy().sum() < sum(t["count"].to_numpy().sum() for t in tables)
    tables += write_round(source, rng, 7, 3)

    aggregate.run_stream(spark, source, view, ckpt, until_idle=1.5, trigger=0.2, quiet=True)
    restarted = aggregate.read_view(view)
    aggregate.run_stream(spark, source, tmp_path / "view2", tmp_path / "ckpt2", until_idle=1.5, trigger=0.2, quiet=True)
    uninterrupted = aggregate.read_view(tmp_path / "view2")
    want = view_columns(combine(tables))
    assert_view(restarted, want)
    assert_view(uninterrupted, want)
    assert len(list(view.glob("view-*.parquet"))) <= aggregate.KEEP + 1


def test_replay_of_a_time_range_gives_exactly_the_reference_join_of_that_range(tmp_path, spark):
    settings = dict(SMALL, **{"generator.seed": 51, "generator.disorder": 0.2})
    cfg = load_config(None, [f"{k}={v}" for k, v in settings.items() if k.startswith("generator.")])
    d = generate_all(cfg)
    names = np.where(d.stream == 0, "R", "S")
    half = len(d.ts) // 2  # half the input as Parquet, half as CSV (text cells) without values
    seconds = d.ts / 1e6  # the generator's microseconds as a file holds them
    pq.write_table(
        pa.table(
            {
                "stream": names[:half],
                "id": d.id[:half],
                "ts": seconds[:half],
                "key": d.key[:half],
                "value": d.value[:half],
            }
        ),
        tmp_path / "a.parquet",
    )
    pacsv.write_csv(
        pa.table({"stream": names[half:], "id": d.id[half:], "ts": seconds[half:], "key": d.key[half:]}),
        tmp_path / "b.csv",
    )  # value is optional
    start, end = 1.25, 2.75
    out = tmp_path / "out"
    code = replay.main(
        [
            str(tmp_path / "a.parquet"),
            str(tmp_path / "b.csv"),
            "--from",
            str(start),
            "--to",
            str(end),
            "--speed",
            "4",
            "-n",
            "3",
            *(
                x
                for k in ("join.window", "join.max_delay", "epochs.distribution")
                for x in ("--set", f"{k}={settings[k]}")
            ),
            "--set",
            f"output.path={out}",
            "--set",
            "output.progress=0",
        ],
        spark=spark,
    )
    assert code == 0
    keep = np.flatnonzero((seconds >= start) & (seconds < end))
    keep = keep[np.lexsort((d.id[keep], d.stream[keep], d.ts[keep]))]  # replay order: ts, stream, id
    expected, late = reference_pairs(
        d.stream[keep], d.id[keep], d.ts[keep], d.key[keep], settings["join.window"], settings["join.max_delay"]
    )
    t = read_tables(out / "results")
    got = np.sort(t["r_id"].to_numpy() * 2**32 + t["s_id"].to_numpy())
    assert len(expected) > 1000 and len(late) == 0
    assert np.array_equal(got, expected)
    sel = pq.read_table(out / "replay" / "selection.parquet")
    sel_ts = pc.cast(sel["ts"], pa.float64()).to_numpy()  # text: half the input came from CSV
    assert sel.num_rows == len(keep) and np.array_equal(sel_ts, seconds[keep])
    summary = json.loads((out / "summary.json").read_text())
    span = seconds[keep].max() - seconds[keep].min()
    assert summary["config"]["source"]["speed"] == 4.0 and summary["wall_seconds"] >= span / 4 * 0.95


def test_replay_of_declared_streams_takes_each_streams_rows_of_the_range_from_its_files_with_their_timing(
    tmp_path, spark
):
    """A run's config with two declared streams -- trades in CSV files with ISO-8601 times at +02:00 and text
    keys, quotes in a Parquet file with a timestamp column -- replayed for a range: Spark keeps each stream's rows
    of the range in their files' order, the cluster joins exactly the reference join of those rows, and it hands
    them on as their times say at the given speed: the event time's gap of 2 s in the middle is a wait of 1 s."""
    rng = np.random.default_rng(61)
    t0 = np.datetime64("2026-11-25T09:00:00", "ms")

    def times(n: int) -> np.ndarray:  # rising, with a 2 s gap after the first half
        ms = np.cumsum(rng.integers(1, 6, n))
        return ms + np.where(np.arange(n) >= n // 2, 2000, 0)

    tr_ms, qu_ms = times(1500), times(1200)
    tr_key, qu_key = rng.integers(0, 40, 1500), rng.integers(0, 40, 1200)
    (tmp_path / "trades").mkdir()
    local = (t0 + tr_ms.astype("timedelta64[ms]") + np.timedelta64(2, "h")).astype(str)
    for i, part in enumerate(np.array_split(np.arange(1500), 3)):
        pacsv.write_csv(
            pa.table(
                {
                    "tid": part,
                    "sym": np.char.add("k", tr_key[part].astype(str)),
                    "at": np.char.add(local[part], "+02:00"),
                }
            ),
            tmp_path / "trades" / f"part-{i}.csv",
        )
    pq.write_table(
        pa.table(
            {
                "qid": np.arange(1200),
                "sym": np.char.add("k", qu_key.astype(str)),
                "at": pa.array(
                    (t0 + qu_ms.astype("timedelta64[ms]")).astype("datetime64[ms]"), pa.timestamp("ms", "UTC")
                ),
            }
        ),
        tmp_path / "quotes.parquet",
    )
    config = tmp_path / "run.toml"
    config.write_text(
        f"""[streams.trades]
path = "{tmp_path / "trades"}"
key = "sym"
time = "at"
id = "tid"
[streams.quotes]
path = "{tmp_path / "quotes.parquet"}"
key = "sym"
time = "at"
id = "qid"
[join]
window = 0.05
max_delay = 0.01
[epochs]
distribution = 0.05
[output]
path = "{tmp_path / "out"}"
progress = 0
"""
    )
    start_ms, end_ms = 1000, 6000  # of event time after t0: both halves and the gap
    base = (t0 - np.datetime64("1970-01-01T00:00:00", "ms")).astype(np.int64) / 1000
    code = replay.main(
        [
            "--config",
            str(config),
            "--from",
            str(base + start_ms / 1000),
            "--to",
            str(base + end_ms / 1000),
            "--speed",
            "2",
            "-n",
            "3",
        ],
        spark=spark,
    )
    assert code == 0
    out = tmp_path / "out"
    tr_in, qu_in = (np.flatnonzero((ms >= start_ms) & (ms < end_ms)) for ms in (tr_ms, qu_ms))
    keys = np.r_[tr_key[tr_in], qu_key[qu_in]]
    stream = np.r_[np.zeros(len(tr_in), int), np.ones(len(qu_in), int)]
    at = np.r_[tr_ms[tr_in], qu_ms[qu_in]] / 1000
    order = np.argsort(at, kind="stable")
    expected, _ = reference_pairs(stream[order], np.r_[tr_in, qu_in][order], at[order], keys[order], 0.05, 1e9)
    t = read_tables(out / "results")
    got = np.sort(t["trades_tid"].to_numpy() * 2**32 + t["quotes_qid"].to_numpy())
    assert len(expected) > 200
    np.testing.assert_array_equal(got, expected)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["input_total"] == len(tr_in) + len(qu_in) and summary["config"]["source"]["speed"] == 2.0
    span = (max(tr_ms[tr_in].max(), qu_ms[qu_in].max()) - min(tr_ms[tr_in].min(), qu_ms[qu_in].min())) / 1000
    assert summary["wall_seconds"] >= span / 2 * 0.95  # as their times say: no faster, the gap kept
    assert pacsv.read_csv(out / "replay" / "trades.csv")["tid"].to_pylist() == tr_in.tolist()  # the files' order
