"""Two-phase aggregation over declared streams' own columns (`[aggregate]` with `[streams.NAME]`), differentially:
the streaming merger's view and `--batch`'s equal DuckDB's GROUP BY over DuckDB's own join of the original files.

The reference joins the input files in SQL (the time bounds as `lower <= s.at - r.at <= upper`, rows without a
partner by LEFT / FULL JOIN or NOT EXISTS), cuts windows with integer microseconds and aggregates with DuckDB's
count / sum / min / max / avg; nothing of the engine takes part in it.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from control import aggregate
from deploy.launch import mpi_env, mpirun_command
from protocol.aggregation import FINAL, WINDOW_END, WINDOW_START, aggregation
from protocol.config import load_config
from protocol.output import LEFT_UNMATCHED, MATCHED, RIGHT_UNMATCHED
from tests.cluster.test_balance_cluster import FORCED_CHURN, straggler
from tests.runs import ENDED_IDLE, run_cluster, soak, write_config

ROOT = Path(__file__).resolve().parent.parent.parent
SUPERVISE = [sys.executable, "-m", "control.supervise", "--backoff", "0.1", "--restarts", "3", "--"]
START = 1_795_000_000_000  #: ms: November 2026
LOWER, UPPER = -2_000_000, 3_000_000  #: the join's bounds in microseconds


def write_streams(folder: Path, seed: int = 5, n: int = 2500) -> dict:
    """views.parquet (R) and buys.parquet (S): each in time order, with nulls in group and measured columns,
    decimals, integers and floats; the `[streams]` settings that read them."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)

    def nulls(values, kind=None):
        return pa.array(values, kind, mask=rng.random(len(values)) < 0.1)

    at = np.sort(START + rng.integers(0, 8 * 60_000, n))
    views = pa.table(
        {
            "id": np.arange(n, dtype=np.int64) + 1,
            "user": rng.integers(0, 40, n),
            "at": pa.array(at, pa.timestamp("ms", "UTC")),
            "ad": nulls([f"ad{i}" for i in rng.integers(0, 4, n)]),
            "price": nulls([Decimal(int(c)) / 100 for c in rng.integers(1, 100_000, n)], pa.decimal128(12, 2)),
            "qty": nulls(rng.integers(-5, 50, n)),
        }
    )
    m = int(n * 1.2)
    at = np.sort(START + rng.integers(0, 8 * 60_000, m))
    buys = pa.table(
        {
            "id": np.arange(m, dtype=np.int64) + 1,
            "user": rng.integers(0, 40, m),
            "at": pa.array(at, pa.timestamp("ms", "UTC")),
            "venue": nulls([["north", "south"][i] for i in rng.integers(0, 2, m)]),
            "cost": nulls(np.round(rng.random(m) * 10, 3)),
            "amount": nulls([Decimal(int(c)) / 1000 for c in rng.integers(-1000, 100_000, m)], pa.decimal128(10, 3)),
        }
    )
    pq.write_table(views, folder / "views.parquet")
    pq.write_table(buys, folder / "buys.parquet")
    settings = {}
    for name in ("views", "buys"):
        settings |= {
            f"streams.{name}.path": str(folder / f"{name}.parquet"),
            f"streams.{name}.key": "user",
            f"streams.{name}.time": "at",
            f"streams.{name}.id": "id",
        }
    paced = {"source.rate": 2500.0, "source.batch": 500}  # a few seconds: several partial files per slave
    return settings | paced | {"join.lower": LOWER / 1e6, "join.upper": UPPER / 1e6, "join.max_delay": "1s"}


def reference_rows(folder: Path, join_type: str) -> str:
    """DuckDB SQL of the join's result rows, named as the engine names them, with `kind` outside inner joins."""
    cols = [f"r.{c} AS views_{c}" for c in ("id", "user", "at", "ad", "price", "qty")]
    cols += [f"s.{c} AS buys_{c}" for c in ("id", "user", "at", "venue", "cost", "amount")]
    r, s = f"read_parquet('{folder / 'views.parquet'}')", f"read_parquet('{folder / 'buys.parquet'}')"
    on = f"r.user = s.user AND epoch_us(s.at) - epoch_us(r.at) BETWEEN {LOWER} AND {UPPER}"
    if join_type == "anti":
        nothing = ", ".join(f"NULL AS buys_{c}" for c in ("id", "user", "at", "venue", "cost", "amount"))
        return (
            f"SELECT {', '.join(cols[:6])}, {nothing}, '{LEFT_UNMATCHED}' AS kind FROM {r} r "
            f"WHERE NOT EXISTS (SELECT 1 FROM {s} s WHERE {on})"
        )
    kind = (
        f", CASE WHEN r.id IS NULL THEN '{RIGHT_UNMATCHED}' WHEN s.id IS NULL THEN '{LEFT_UNMATCHED}' "
        f"ELSE '{MATCHED}' END AS kind"
        if join_type != "inner"
        else ""
    )
    return f"SELECT {', '.join(cols)}{kind} FROM {r} r {join_type.upper()} JOIN {s} s ON {on}"


def reference_view(folder: Path, cfg: dict) -> pa.Table:
    """DuckDB's GROUP BY of the reference rows with the config's groups, windows and measures."""
    return aggregated(reference_rows(folder, cfg["join"]["type"]), cfg)


def aggregated(sql: str, cfg: dict) -> pa.Table:
    """DuckDB's GROUP BY of the rows of `sql` (named as results name them) with the config's `[aggregate]`."""
    spec = aggregation(cfg)
    groups = [f'"{g}"' for g in spec.groups]
    sql_of = {"count_distinct": "count(DISTINCT {})"}
    measures = ["count(*) AS count"] + [
        sql_of.get(m.fn, m.fn + "({})").format(f'"{m.column}"') + f' AS "{m.name}"'
        for m in spec.measures
        if m.fn != "count"
    ]
    if not spec.window:
        return duckdb.sql(f"SELECT {', '.join(groups + measures)} FROM ({sql}) GROUP BY ALL").arrow().read_all()
    times = [f'epoch_us("{t}")' for t in spec.times]  # below: SQL's % keeps the sign, a floor needs it positive
    t = f"greatest({', '.join(times)})" if len(times) > 1 else times[0]
    n = -(-spec.window // spec.slide)
    windowed = (
        f"SELECT *, latest - k * {spec.slide} AS window_start FROM (SELECT *, {t} AS t, "
        f"{t} - ((({t} % {spec.slide}) + {spec.slide}) % {spec.slide}) AS latest FROM ({sql})), range({n}) AS ks(k) "
        f"WHERE latest - k * {spec.slide} > t - {spec.window} OR (t IS NULL AND k = 0)"  # no time: one null window
    )
    q = f"SELECT {', '.join([*groups, 'window_start', *measures])} FROM ({windowed}) GROUP BY ALL"
    return duckdb.sql(q).arrow().read_all()


def rows_by_group(t: pa.Table, keys: list[str]) -> dict:
    d = t.to_pydict()
    return {tuple(d[k][i] for k in keys): {c: d[c][i] for c in d if c not in keys} for i in range(t.num_rows)}


def assert_view_equals(view: pa.Table, want: pa.Table, cfg: dict, partial: bool = False, least: int = 101) -> None:
    """The engine's view and the reference, group by group: counts, integer and decimal sums, min and max exact,
    float sums and averages to rounding (a decimal's average is a decimal of 6 decimals, DuckDB's a double);
    a whole view counts at least `least` rows."""
    spec = aggregation(cfg)
    assert view is not None
    if partial:  # a view of a run going on: its final rows are the reference's
        view = view.filter(view[FINAL])
    else:  # the run has ended: every window is final
        assert view[FINAL].to_pylist() == [True] * view.num_rows
    view = view.drop_columns([FINAL])
    if spec.window:
        start = view[WINDOW_START].cast(pa.int64())
        span = pa.compute.subtract(view[WINDOW_END].cast(pa.int64()), start)  # null: a row without that time
        np.testing.assert_array_equal(span.drop_null(), spec.window)
        view = view.drop_columns([WINDOW_END]).set_column(view.column_names.index(WINDOW_START), WINDOW_START, start)
    for g in spec.groups:  # the group columns in their own types
        assert view.schema.field(g).type == want.schema.field(g).type, g
    got, exp = rows_by_group(view, spec.keys), rows_by_group(want, spec.keys)
    if partial:
        exp = {k: exp[k] for k in got}
    assert got.keys() == exp.keys()
    assert partial or sum(r["count"] for r in got.values()) >= least
    for k, row in exp.items():
        for c, v in row.items():
            g = got[k][c]
            if isinstance(v, float) or isinstance(g, float) or c.startswith("avg_"):
                near = 1e-6 if isinstance(g, Decimal) else 1e-9  # a decimal's avg: Spark's quotient, 6 decimals
                both = v is None and g is None
                assert both or math.isclose(float(g), float(v), rel_tol=1e-9, abs_tol=near), (k, c, g, v)
            else:
                assert g == v, (k, c, g, v)


def run_and_merge(tmp_path, spark, settings: dict) -> tuple[dict, pa.Table, pa.Table]:
    """The cluster on 3 ranks, then the streaming merger over its partials and `--batch` over its results:
    (config, streaming view, batch view)."""
    run = run_cluster(tmp_path, 3, settings)
    assert run.returncode == 0, run.stderr
    cfg = load_config(write_config(tmp_path, settings))
    spec = aggregation(cfg)
    assert len(list((run.out / "aggregates").glob("slave-*.parquet"))) > 2
    view, ckpt = tmp_path / "view", tmp_path / "ckpt"
    writer = aggregate.run_stream(
        spark, run.out / "aggregates", view, ckpt, ENDED_IDLE, trigger=0.3, quiet=True, spec=spec
    )
    assert writer.batches >= 1
    batch = aggregate.from_results(spark, aggregate.result_files(run.out / "results"), spec)
    aggregate.ViewWriter(tmp_path / "batch", spec, quiet=True, ended=True)(batch, 0)
    return cfg, aggregate.read_view(tmp_path / "view"), aggregate.read_view(tmp_path / "batch")


MEASURES = [
    "count",
    "sum(views_price)",
    "avg(views_price)",
    "min(views_price)",
    "sum(views_qty)",
    "max(views_qty)",
    "sum(buys_cost)",
    "avg(buys_cost)",
    "min(buys_cost)",
    "max(buys_cost)",
    "sum(buys_amount)",
    "max(buys_amount)",
    "count_distinct(buys_venue)",
    "count_distinct(buys_amount)",
    "count_distinct(views_qty)",
]


def test_inner_join_by_two_columns_per_tumbling_minute_equals_duckdb(tmp_path, spark):
    settings = write_streams(tmp_path / "data") | {
        "aggregate.enabled": True,
        "aggregate.group_by": ["views_ad", "buys_venue"],
        "aggregate.window": "1m",
        "aggregate.measures": MEASURES,
        "aggregate.flush_interval": 0.3,
    }
    cfg, view, batch = run_and_merge(tmp_path, spark, settings)
    want = reference_view(tmp_path / "data", cfg)
    assert view.schema.field("sum_views_price").type == pa.decimal128(38, 2)  # decimals stay decimals
    assert view.schema.field(WINDOW_START).type == pa.timestamp("us", "UTC")
    assert_view_equals(view, want, cfg)
    assert_view_equals(batch, want, cfg)


@pytest.mark.parametrize(
    "join_type,group_by,window,slide,time",
    [
        ("left", ["views_ad"], "2m", "30s", ""),
        ("full", "key", "1m", 0, "views_at"),
        ("anti", [], "90s", "30s", "views_at"),
        ("inner", ["buys_venue"], 0, 0, ""),
    ],
)
def test_outer_and_anti_joins_count_rows_alone_in_their_kind_in_hopping_windows(
    tmp_path, spark, join_type, group_by, window, slide, time
):
    settings = write_streams(tmp_path / "data", seed=11, n=1500) | {
        "join.type": join_type,
        "aggregate.enabled": True,
        "aggregate.group_by": group_by,
        "aggregate.window": window,
        "aggregate.slide": slide,
        "aggregate.time": time,
        "aggregate.measures": MEASURES if join_type != "anti" else [*MEASURES[:6], "count_distinct(views_qty)"],
        "aggregate.flush_interval": 0.3,
    }
    cfg, view, batch = run_and_merge(tmp_path, spark, settings)
    want = reference_view(tmp_path / "data", cfg)
    if join_type in ("left", "full"):
        kinds = set(view["kind"].to_pylist())
        assert {MATCHED, LEFT_UNMATCHED} <= kinds and (RIGHT_UNMATCHED in kinds) == (join_type == "full")
    assert_view_equals(view, want, cfg)
    assert_view_equals(batch, want, cfg)


@pytest.mark.parametrize("fault", ["2:batch-after-checkpoint:2", soak("0:checkpoint:3")])
def test_a_rank_and_the_merger_killed_change_nothing_in_the_view(tmp_path, spark, fault):
    """A left join aggregated per ad in hopping windows: slave 2 is SIGKILLed at its 2nd batch after a
    checkpoint, or the master as it begins its 3rd, and the supervisor restarts the run from the last complete
    one (partials since are staged, then replaced), then
    the merger is SIGKILLed after two micro-batches and restarted on its checkpoint: its view, and `--batch`'s,
    equal DuckDB's."""
    settings = write_streams(tmp_path / "data", seed=23, n=3000) | {
        "join.type": "left",
        "source.rate": 1200.0,  # 6 s: checkpoints every half second
        "checkpoint.interval": 5,
        "epochs.distribution": 0.1,
        "aggregate.enabled": True,
        "aggregate.group_by": ["views_ad"],
        "aggregate.window": "1m",
        "aggregate.slide": "20s",
        "aggregate.measures": MEASURES,
        "aggregate.flush_interval": 0.2,
    }
    env = {"STREAMJOIN_FAULT": f"{fault}:{tmp_path / 'fired'}"}
    run = run_cluster(tmp_path, 3, settings, wrapper=SUPERVISE, env=env)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "fired").exists() and "restart 1 of 3" in run.stderr
    assert run.summary["checkpoints"]["recovered_from"] is not None
    cfg = load_config(write_config(tmp_path, settings))
    spec, want = aggregation(cfg), reference_view(tmp_path / "data", cfg)
    assert len(list((run.out / "aggregates").glob("slave-*.parquet"))) > 4

    view, ckpt = tmp_path / "view", tmp_path / "ckpt"
    flags = ["--max-files-per-trigger", "1", "--trigger", "0.2", "--view", str(view), "--checkpoint-location"]
    cmd = [sys.executable, "-m", "control.aggregate", "--config", str(tmp_path / "run.toml"), *flags, str(ckpt)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        while len(list(view.glob("view-*.parquet"))) < 2:  # two micro-batches done, more files waiting
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the job and its JVM, without any chance to clean up
        proc.wait()
    assert aggregate.read_view(view)["count"].to_numpy().sum() < want["count"].to_numpy().sum()
    aggregate.run_stream(spark, run.out / "aggregates", view, ckpt, ENDED_IDLE, trigger=0.2, quiet=True, spec=spec)
    assert_view_equals(aggregate.read_view(view), want, cfg)
    batch = aggregate.from_results(spark, aggregate.result_files(run.out / "results"), spec)
    aggregate.ViewWriter(tmp_path / "batch", spec, quiet=True, ended=True)(batch, 0)
    assert_view_equals(aggregate.read_view(tmp_path / "batch"), want, cfg)


def test_final_windows_of_a_view_taken_while_the_run_goes_on_never_change(tmp_path, spark, monkeypatch):
    """The merger runs beside the cluster, two partial files a micro-batch, while partition-groups move between
    the slaves at every reorganization (the one active at start straggles): in every snapshot of the view, the
    windows marked final already hold the reference's numbers; some snapshot has final and open windows side by
    side, and the last has every window final."""
    settings = write_streams(tmp_path / "data", seed=29, n=3000) | {
        "join.type": "full",
        **{k: v for k, v in FORCED_CHURN.items() if k.startswith(("balance.", "epochs."))},
        "source.rate": 1500.0,
        "aggregate.enabled": True,
        "aggregate.group_by": ["views_ad"],
        "aggregate.window": "1m",
        "aggregate.measures": MEASURES,
        "aggregate.flush_interval": 0.2,
    }
    cfg = load_config(write_config(tmp_path, settings))
    spec = aggregation(cfg)
    assert spec.reach == UPPER + 1
    monkeypatch.setattr(aggregate, "KEEP", 100_000)  # every snapshot stays
    cmd = mpirun_command(3, ["--config", str(tmp_path / "run.toml")])
    env = {**mpi_env(), **straggler(1)}
    cluster = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        out = tmp_path / "out"
        deadline = time.monotonic() + 120
        while not list((out / "aggregates").glob("slave-*.parquet")):  # the cluster's start has cleared it
            assert cluster.poll() is None and time.monotonic() < deadline, cluster.stderr.read()
            time.sleep(0.05)
        view = tmp_path / "view"
        ckpt = tmp_path / "ckpt"
        aggregate.run_stream(spark, out / "aggregates", view, ckpt, 2.0, 2, trigger=0.2, quiet=True, spec=spec)
        assert cluster.wait(timeout=120) == 0, cluster.stderr.read()
    finally:
        if cluster.poll() is None:
            cluster.kill()
    # the files a pause of a loaded host left behind (the merger goes on from its checkpoint)
    aggregate.run_stream(spark, out / "aggregates", view, ckpt, ENDED_IDLE, 2, trigger=0.2, quiet=True, spec=spec)
    assert json.loads((out / "summary.json").read_text())["balance"]["moves"]  # groups moved (some may be empty)
    want = reference_view(tmp_path / "data", cfg)
    snapshots = [pq.read_table(f) for f in sorted(view.glob("view-*.parquet"))]
    mixed = [t for t in snapshots if 0 < pa.compute.sum(t[FINAL]).as_py() < t.num_rows]
    assert len(snapshots) > 3 and mixed, [pa.compute.sum(t[FINAL]).as_py() for t in snapshots]
    for t in snapshots[:-1]:
        assert_view_equals(t, want, cfg, partial=True)
    assert_view_equals(snapshots[-1], want, cfg)


@pytest.mark.parametrize(
    "settings,words",
    [
        ({"aggregate.measures": ["sum(views_nope)"]}, "aggregate.measures: 'views_nope' is not a result column"),
        ({"aggregate.measures": ["sum(views_ad)"]}, "sum(views_ad): the column is string, not a number"),
        ({"aggregate.group_by": ["buys_nope"]}, "aggregate.group_by: 'buys_nope' is not a result column"),
        ({"aggregate.time": "views_qty", "aggregate.window": "1m"}, "aggregate.time: 'views_qty' is int64"),
    ],
)
def test_columns_results_lack_or_of_the_wrong_type_end_the_run_at_its_start(tmp_path, settings, words):
    run = run_cluster(tmp_path, 2, write_streams(tmp_path / "data", n=50) | {"aggregate.enabled": True} | settings)
    assert run.returncode == 2 and words in run.stderr, run.stderr
