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
from protocol.plan import compile_plan
from protocol.output import LEFT_UNMATCHED, MATCHED, read_tables
from protocol.tuples import tuple_dtype
from protocol.aggregation import aggregation
from slave.aggregate import column_partials, stamped
from tests.runs import ENDED_IDLE, run_cluster, toml_value
from tests.reference import micros, pairs_of, reference_outer, reference_pairs
from tests.unit.test_aggregate_logic import as_numpy_view, file_spec, merged_partials, numpy_view
from tests.cluster.test_cluster import SMALL

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def assert_view(view: pa.Table, want: dict, spec):
    """A view of an old single-file config (key, window, count, sum, min, max, avg of its value) equals numpy's."""
    got = as_numpy_view(view, spec)
    assert len(got["key"]) == len(want["key"]) > 0
    for c in ("key", "window_start", "count", "min", "max"):
        assert np.array_equal(got[c], want[c], equal_nan=c in ("min", "max")), c
    assert np.allclose(got["sum"], want["sum"], rtol=1e-9, atol=1e-9, equal_nan=True)
    if "final" in view.column_names:
        avg = view.sort_by([(c, "ascending") for c in spec.keys])[spec.measures[-1].name].to_numpy()
        assert np.allclose(avg, want["sum"] / want["count"], rtol=1e-9, equal_nan=True)


def merged_views(spark, out, tmp_path, spec) -> tuple[pa.Table, pa.Table]:
    """The streaming merger's view of the partials in `out` and `--batch`'s of its results (of an ended run)."""
    view, ckpt = tmp_path / "view", tmp_path / "ckpt"
    writer = aggregate.run_stream(spark, out / "aggregates", view, ckpt, ENDED_IDLE, trigger=0.3, quiet=True, spec=spec)
    assert writer.batches >= 1
    batch = aggregate.from_results(spark, aggregate.result_files(out / "results"), spec)
    aggregate.ViewWriter(tmp_path / "batch", spec, quiet=True, ended=True)(batch, 0)
    return aggregate.read_view(tmp_path / "view"), aggregate.read_view(tmp_path / "batch")


def reference_view(settings: dict, group_by: str, value: str, window: float) -> dict:
    """The reference join of the generated input, then per (key, window) count/sum/min/max with numpy."""
    cfg = load_config(None, [f"{k}={v}" for k, v in settings.items() if k.startswith("generator.")])
    d = generate_all(compile_plan(cfg).generator)
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
    spec = aggregation(load_config(None, [f"{k}={toml_value(v)}" for k, v in settings.items() if k.startswith("agg")]))

    view, batched = merged_views(spark, run.out, tmp_path, spec)  # --batch: CSV or Parquet
    assert_view(view, want, spec)
    audited = ["--config", str(tmp_path / "run.toml"), "--view", str(tmp_path / "view")]
    assert audit.main(audited, spark=spark) == audit.EXACT  # the audit's own view of the recomputed pairs agrees
    assert json.loads((run.out / "audit" / "view-start-end.json").read_text())["groups"] == len(want["count"])
    assert view["final"].to_pylist() == [True] * view.num_rows  # the run has ended
    assert_view(batched, want, spec)


def test_a_single_file_left_join_aggregated_by_columns_with_measures_equals_duckdb(tmp_path, spark):
    """The single file through the same aggregation as declared streams: a left join's pairs and lone R rows in
    hopping windows, grouped by a list of result columns (a lone row's s_key null) and `kind`, measures over both
    sides' columns; the streaming and `--batch` views equal DuckDB's GROUP BY over the reference join's rows
    (tests/reference.py: the inner reference pairs, the on-time R tuples in none), each row with its tuples'
    columns."""
    import duckdb

    from tests.cluster.test_aggregate_streams import aggregated, assert_view_equals, run_and_merge

    settings = dict(
        SMALL,
        **{
            "join.type": "left",
            "generator.duration": 2.0,
            "generator.seed": 47,
            "generator.disorder": 0.2,
            "source.rate": 3000.0,  # paced: several partial files per slave
            "output.format": "csv",  # --batch reads the single file's CSV with its known columns
            "aggregate.enabled": True,
            "aggregate.group_by": ["r_key", "s_key"],
            "aggregate.window": 1.0,
            "aggregate.slide": 0.5,
            "aggregate.measures": ["count", "sum(r_value)", "avg(s_value)", "min(s_value)", "max(r_value)"]
            + ["count_distinct(s_id)"],
            "aggregate.flush_interval": 0.3,
        },
    )
    cfg = load_config(None, [f"{k}={v}" for k, v in settings.items() if k.startswith("generator.")])
    d = generate_all(compile_plan(cfg).generator)
    pairs, late = reference_pairs(d.stream, d.id, d.ts, d.key, settings["join.window"], settings["join.max_delay"])
    on_time = ~np.isin(d.stream.astype(np.int64) * 2**40 + d.id, late)
    kept, lone_r, _ = reference_outer(pairs, d.id[on_time & (d.stream == 0)], d.id[on_time & (d.stream == 1)], "left")
    assert len(kept) > 500 and len(lone_r) > 100

    def side(code: int, ids: np.ndarray, name: str) -> dict:
        mine = np.flatnonzero(d.stream == code)
        mine = mine[np.argsort(d.id[mine])]
        rows = mine[np.searchsorted(d.id[mine], ids)]
        ts = pa.array(micros(d.ts[rows]), pa.int64()).cast(pa.timestamp("us"))
        return {f"{name}_id": ids, f"{name}_key": d.key[rows], f"{name}_ts": ts, f"{name}_value": d.value[rows]}

    def nothing(n: int) -> dict:
        return {"s_id": pa.nulls(n, pa.int64()), "s_key": pa.nulls(n, pa.int64())} | {
            "s_ts": pa.nulls(n, pa.timestamp("us")),
            "s_value": pa.nulls(n, pa.float64()),
        }

    both = pa.table(side(0, kept // 2**32, "r") | side(1, kept % 2**32, "s") | {"kind": [MATCHED] * len(kept)})
    alone = pa.table(side(0, lone_r, "r") | nothing(len(lone_r)) | {"kind": [LEFT_UNMATCHED] * len(lone_r)})
    duckdb.register("file_rows", pa.concat_tables([both, alone.select(both.column_names)]))

    cfg, streamed, batched = run_and_merge(tmp_path, spark, settings)
    want = aggregated("SELECT * FROM file_rows", cfg)
    assert want.num_rows > 100 and None in want["s_key"].to_pylist()  # lone rows: a null s_key
    assert_view_equals(streamed, want, cfg)
    assert_view_equals(batched, want, cfg)


def test_streaming_merger_and_batch_view_agree_on_the_same_results_with_nan_and_window_edges(tmp_path, spark):
    """Phase one (slave.aggregate, as slaves run it) and the result files (slave.result_files) of the same
    results, merged by the streaming job and recomputed by --batch: the same view, equal to numpy's.  Values
    hold NaN (a group of NaN only, groups with some NaN: NaN is the largest value in both views), later ts
    lie exactly on window edges given in decimals no float holds (0.3 s in 0.1 s windows) and below zero."""
    from slave.aggregate import ColumnAggregator
    from protocol.output import RESULT_SCHEMA
    from slave.result_files import ResultWriter

    rng = np.random.default_rng(61)
    dt = tuple_dtype(64)
    out = tmp_path / "out"
    spec = file_spec("aggregate.window=0.1")
    phase_one = ColumnAggregator(out / "aggregates", 1, 0.0, spec, 1, RESULT_SCHEMA.empty_table)
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
        phase_one.add_table(writer.add_pairs(pairs_of(r, s), np.zeros(n)))
        phase_one.decided(batch)
        keys.append(r["key"]), later.append(np.maximum(r["ts"], s["ts"])), values.append(r["value"].copy())
    phase_one.flush()
    writer.flush()
    writer.wait()
    want = numpy_view(np.concatenate(keys), np.concatenate(later), np.concatenate(values), 100_000)
    assert np.isnan(want["max"]).sum() > 3 and np.isnan(want["min"]).sum() >= 1 and (want["window_start"] < 0).any()
    streamed, batched = merged_views(spark, out, tmp_path, spec)
    assert_view(streamed, want, spec)
    assert_view(batched, want, spec)


#: the view of the merger run with --set aggregate.window=1.0 (the single file's r_value per r_key)
ROUND_SPEC = file_spec("aggregate.window=1.0")


def write_round(directory, rng, first: int, count: int) -> list[pa.Table]:
    """`count` partial files as slaves write them (random results, 1 s windows, stamped); returns their tables."""
    out = []
    for i in range(first, first + count):
        n = int(rng.integers(200, 800))
        rows = pa.table(
            {"r_key": rng.integers(0, 60, n), "r_ts": rng.integers(0, 6_000_000, n) / 1e6, "r_value": rng.random(n)}
        )
        t = stamped(column_partials(rows.append_column("s_ts", rows["r_ts"]), ROUND_SPEC), 1 + i % 3, i, 0, 3)
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
        "--set",
        "aggregate.window=1.0",
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

    aggregate.run_stream(spark, source, view, ckpt, ENDED_IDLE, trigger=0.2, quiet=True, spec=ROUND_SPEC)
    restarted = aggregate.read_view(view)
    view2, ckpt2 = tmp_path / "view2", tmp_path / "ckpt2"
    aggregate.run_stream(spark, source, view2, ckpt2, ENDED_IDLE, trigger=0.2, quiet=True, spec=ROUND_SPEC)
    uninterrupted = aggregate.read_view(view2)
    want = as_numpy_view(merged_partials(tables, ROUND_SPEC), ROUND_SPEC)
    assert_view(restarted, want, ROUND_SPEC)
    assert_view(uninterrupted, want, ROUND_SPEC)
    assert len(list(view.glob("view-*.parquet"))) <= aggregate.KEEP + 1


def test_the_merger_reports_results_not_hopping_window_memberships_and_stops_cleanly_on_ctrl_c(tmp_path):
    """The streaming merger over partials in 1 s windows hopping every 0.5 s (each result in two): its report
    line counts each result once; Ctrl-C (SIGINT to its process group, as a terminal sends it) stops it between
    two calls to Spark: exit 0, the line saying so, no traceback."""
    rng = np.random.default_rng(43)
    source = tmp_path / "out" / "aggregates"
    source.mkdir(parents=True)
    hopping = ("aggregate.window=1.0", "aggregate.slide=0.5")
    spec = file_spec(*hopping)
    rows = 0
    for i in range(3):
        n = int(rng.integers(200, 800))
        t = pa.table({"r_key": rng.integers(0, 60, n), "r_ts": rng.integers(0, 6_000_000, n) / 1e6})
        t = t.append_column("r_value", pa.array(rng.random(n))).append_column("s_ts", t["r_ts"])
        pq.write_table(stamped(column_partials(t, spec), 1 + i, i, 0, 3), source / f"slave-{1 + i:03d}-{i:06d}.parquet")
        rows += n
    cmd = [sys.executable, "-m", "control.aggregate", "--out", str(tmp_path / "out"), "--trigger", "0.2"]
    cmd += [a for h in hopping for a in ("--set", h)]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    lines = []
    try:
        for line in proc.stdout:  # until the first batch's report
            lines.append(line)
            if line.startswith("[view] batch"):
                break
        assert lines and lines[-1].startswith("[view] batch 0"), "".join(lines)
        assert f", {rows:,} results" in lines[-1], lines[-1]
        os.killpg(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = "".join(lines) + rest
    assert proc.returncode == 0, out
    assert "interrupted: stopped" in out and "Traceback" not in out, out
    assert f"groups, {rows:,} results, in" in out.splitlines()[-1], out


def test_replay_of_a_time_range_gives_exactly_the_reference_join_of_that_range(tmp_path, spark):
    settings = dict(SMALL, **{"generator.seed": 51, "generator.disorder": 0.2})
    cfg = load_config(None, [f"{k}={v}" for k, v in settings.items() if k.startswith("generator.")])
    d = generate_all(compile_plan(cfg).generator)
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
