"""Unit tests of phase one (slave/aggregate.py), the [aggregate] config and the replay's pure helpers."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from control.replay import ReplayError, inside_engine_output, input_files, pace, parse_speed
from protocol.config import ConfigError, load_config
from protocol.aggregation import RANK, STAMP, WINDOW_START, Aggregation, aggregation
from protocol.output import RESULT_SCHEMA
from protocol.tuples import tuple_dtype
from tests.reference import pairs_of
from slave.aggregate import ColumnAggregator, column_combine
from slave.result_files import ResultWriter


def numpy_view(key, ts, value, window):
    """Per (key, window) count/sum/min/max by sorting and reduceat: a different route than pyarrow's group-by.
    ts and window in microseconds; window_start in seconds; NaN the largest value, as Spark orders it (max is
    NaN if any value is, min only if all are)."""
    ws = (ts // window) * window / 1e6 if window > 0 else np.zeros(len(ts))
    order = np.lexsort((ws, key))
    k, w, v = key[order], ws[order], value[order]
    starts = np.flatnonzero(np.r_[True, (k[1:] != k[:-1]) | (w[1:] != w[:-1])])
    return {
        "key": k[starts],
        "window_start": w[starts],
        "count": np.diff(np.r_[starts, len(k)]),
        "sum": np.add.reduceat(v, starts),
        "min": np.fmin.reduceat(v, starts),
        "max": np.maximum.reduceat(v, starts),
    }


def file_spec(*overrides: str) -> Aggregation:
    """The single file's `[aggregate]` (an old config: group_by, value, window) resolved to result columns."""
    return aggregation(load_config(None, ["aggregate.enabled=true", *overrides]))


def as_numpy_view(t: pa.Table, spec: Aggregation) -> dict:
    """Partials or a view of an old single-file config in `numpy_view`'s form: its group column as `key`, the
    window's start in seconds (0.0 without a window), count, and the sum, min and max of its one value."""
    value = next(m.column for m in spec.measures if m.column)
    t = t.sort_by([(c, "ascending") for c in spec.keys])
    starts = t[WINDOW_START].cast(pa.int64()).to_numpy() / 1e6 if spec.window else np.zeros(t.num_rows)
    view = {"key": t[spec.groups[0]].to_numpy(), "window_start": starts, "count": t["count"].to_numpy()}
    return view | {fn: t[f"{fn}_{value}"].to_numpy() for fn in ("sum", "min", "max")}


def merged_partials(tables: list[pa.Table], spec: Aggregation) -> pa.Table:
    """Partial files' tables merged as the merger does, their stamp rows left out."""
    rows = [t.filter(pc.is_null(t[RANK])).drop_columns(list(STAMP)) for t in tables]
    return column_combine(rows, spec)


def assert_same_view(got, want):
    for c in ("key", "window_start", "count", "min", "max"):
        assert np.array_equal(got[c], want[c], equal_nan=c in ("min", "max")), c
    assert np.allclose(got["sum"], want["sum"], rtol=1e-12, atol=1e-12, equal_nan=True)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def results(rng, n, keys=30, span=4_000_000):
    dt = tuple_dtype(64)
    r, s = np.zeros(n, dt), np.zeros(n, dt)
    r["id"], s["id"] = np.arange(n), np.arange(n)
    r["key"] = s["key"] = rng.integers(0, keys, n)
    r["ts"], s["ts"] = rng.integers(-span // 4, span, n), rng.integers(-span // 4, span, n)
    r["value"], s["value"] = rng.random(n), rng.random(n) + 10
    return r, s


def single_file_aggregator(
    tmp_path, spec: Aggregation, clock, interval: float
) -> tuple[ColumnAggregator, ResultWriter]:
    """Phase one as a slave of the single file runs it: over the result rows its writer makes."""
    writer = ResultWriter(str(tmp_path / "results"), 3, "parquet", 10**9)
    agg = ColumnAggregator(tmp_path / "aggregates", 3, interval, spec, 2, RESULT_SCHEMA.empty_table, clock)
    return agg, writer


@pytest.mark.parametrize("group_by,value,window", [("key", "r_value", 1.0), ("s_key", "s_value", 0.0)])
def test_an_old_single_file_config_aggregates_its_result_rows_per_key_and_window(tmp_path, group_by, value, window):
    """Phase one over the single file's result rows (float seconds as written, NaN values, ts below zero and on
    window edges): every interval a file, the files sum to numpy's view of all pairs."""
    rng, clock = np.random.default_rng(5), Clock()
    spec = file_spec(f"aggregate.group_by={group_by}", f"aggregate.value={value}", f"aggregate.window={window}")
    assert spec.groups == (group_by.replace("key", "r_key") if group_by == "key" else group_by,)
    agg, writer = single_file_aggregator(tmp_path, spec, clock, 2.0)
    batches = [results(rng, n) for n in (100, 0, 250, 80, 300)]
    batches[2][0]["ts"][:20] = np.arange(20) * 1_000_000  # on the windows' edges
    batches[3][0]["value"][:10] = np.nan
    written = []
    for i, (r, s) in enumerate(batches):
        clock.now = i * 0.9  # 0, 0.9, 1.8, 2.7 (-> file), 3.6
        written.append(agg.add_table(writer.add_pairs(pairs_of(r, s), np.zeros(len(r)))))
        agg.decided(i)
    assert written == [0, 0, 0, 1, 0]
    assert agg.flush() == 1 and agg.flush() == 0  # at stop: the rest, then nothing more
    files = sorted((tmp_path / "aggregates").iterdir())
    assert [f.name for f in files] == ["slave-003-000000.parquet", "slave-003-000001.parquet"]
    r = np.concatenate([b[0] for b in batches])
    s = np.concatenate([b[1] for b in batches])
    side = {"r": r, "s": s}
    later = np.maximum(r["ts"], s["ts"])
    want = numpy_view(side[spec.groups[0][0]]["key"], later, side[value[0]]["value"], int(window * 1e6))
    assert np.isnan(want["max"]).any() or value == "s_value"
    got = merged_partials([pq.read_table(f) for f in files], spec)
    assert_same_view(as_numpy_view(got, spec), want)
    assert got.schema.field("r_key" if group_by == "key" else "s_key").type == pa.int64()


def test_many_batches_are_combined_as_they_come(tmp_path):
    rng, clock = np.random.default_rng(6), Clock()
    agg, writer = single_file_aggregator(tmp_path, file_spec(), clock, 100.0)
    for _ in range(ColumnAggregator.COMBINE_EVERY * 2 + 3):
        agg.add_table(writer.add_pairs(pairs_of(*results(rng, 50)), np.zeros(50)))
    assert len(agg.parts) <= ColumnAggregator.COMBINE_EVERY
    assert agg.flush() == 1
    assert pq.read_table(tmp_path / "aggregates" / "slave-003-000000.parquet")["count"].to_numpy().sum() == 50 * (
        2 * 32 + 3
    )


def test_an_old_single_file_config_means_its_view_of_old_and_takes_the_streams_keys():
    spec = file_spec("aggregate.value=s_value", "aggregate.window=0.5")
    assert spec.groups == ("r_key",) and spec.times == ("r_ts", "s_ts") and spec.window == 500_000
    assert [m.name for m in spec.measures] == ["count", "sum_s_value", "min_s_value", "max_s_value", "avg_s_value"]
    left = file_spec(
        'join.type="left"',
        "aggregate.group_by=['r_key', 's_key']",
        "aggregate.measures=['count', 'avg(s_value)', 'count_distinct(s_id)']",
        "aggregate.window=1.0",
        "aggregate.slide=0.25",
        "aggregate.time='s_ts'",
    )
    assert left.groups == ("r_key", "s_key", "kind") and left.times == ("s_ts",) and left.slide == 250_000
    for override, words in [
        ("aggregate.group_by=['nope']", "'nope' is not a result column"),
        ("aggregate.measures=['sum(kind)']", "not a number"),
        ("aggregate.time='r_value'", "not a timestamp"),
    ]:
        with pytest.raises(ConfigError, match=words):
            load_config(None, ["aggregate.enabled=true", 'join.type="full"', "aggregate.window=1.0", override])


def test_aggregate_config_defaults_and_errors():
    agg = load_config()["aggregate"]
    assert agg == {
        "enabled": False,
        "group_by": "key",
        "value": "r_value",
        "window": 0.0,
        "slide": 0.0,
        "time": "",
        "measures": ["count"],
        "flush_interval": 5.0,
    }
    for override, key in [
        ("aggregate.value=key", "aggregate.value"),
        ("aggregate.window=-1", "aggregate.window"),
        ("aggregate.flush_interval=0", "aggregate.flush_interval"),
        ("aggregate.enabled=1", "aggregate.enabled"),
        ("aggregate.avg=true", "aggregate.avg"),
    ]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, [override])


def test_replay_speed_and_pace():
    assert parse_speed("max") == math.inf and parse_speed("realtime") == 1.0 and parse_speed("2.5") == 2.5
    for bad in ("0", "-3", "fast", "inf", "nan"):
        with pytest.raises(ReplayError, match="--speed"):
            parse_speed(bad)
    assert pace(1000, 2.0, 4.0) == 2000.0  # 2 s of event time at 4x speed take 0.5 s
    assert pace(1000, 2.0, 1.0) == 500.0
    assert pace(1000, 2.0, math.inf) == 0.0 and pace(1000, 0.0, 1.0) == 0.0


def test_replay_inputs_are_checked(tmp_path):
    (tmp_path / "a.parquet").write_bytes(b"")
    (tmp_path / "b.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReplayError, match="b.txt"):
        input_files([str(tmp_path / "b.txt")])
    with pytest.raises(ReplayError, match="does not exist"):
        input_files([str(tmp_path / "nope.csv")])
    with pytest.raises(ReplayError, match="no Parquet or CSV"):
        input_files([str(tmp_path / "empty")])
    assert input_files([str(tmp_path)]) == [(tmp_path / "a.parquet", "parquet")]
    out = tmp_path / "out"
    assert inside_engine_output(out / "results" / "x.parquet", out) == "results"
    assert inside_engine_output(tmp_path / "a.parquet", out) is None


@pytest.mark.parametrize(
    "module,args,needle",
    [
        ("aggregate", ["--batch"], "no result files"),
        ("aggregate", ["--trigger", "0"], "--trigger"),
        ("aggregate", ["--set", "aggregate.window=-2"], "aggregate.window"),
        ("replay", ["{tmp}/missing.parquet"], "does not exist"),
        ("replay", ["{tmp}/in.parquet", "--speed", "fast"], "--speed"),
        ("replay", ["{tmp}/in.parquet", "--from", "5", "--to", "2"], "--from"),
        ("replay", ["{tmp}/out/results"], "which the replayed run removes"),
    ],
)
def test_control_jobs_refuse_user_mistakes_before_starting_spark(tmp_path, capsys, module, args, needle):
    from control import aggregate, replay

    (tmp_path / "in.parquet").write_bytes(b"")
    (tmp_path / "out" / "results").mkdir(parents=True)
    (tmp_path / "out" / "results" / "slave-001-000000.parquet").write_bytes(b"")
    main = {"aggregate": aggregate.main, "replay": replay.main}[module]
    argv = [a.format(tmp=tmp_path) for a in args] + ["--set", f"output.path={tmp_path / 'out'}"]
    if module == "aggregate" and args[0] == "--batch":
        argv += ["--out", str(tmp_path / "empty")]
    assert main(argv, spark=object()) == 2  # a session that any use would break: none is used
    assert needle in capsys.readouterr().err
