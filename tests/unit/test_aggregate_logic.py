"""Unit tests of phase one (slave/aggregate.py), the [aggregate] config and the replay's pure helpers."""

from __future__ import annotations

import math

import numpy as np
import pyarrow.parquet as pq
import pytest

from control.replay import ReplayError, inside_engine_output, input_files, pace, parse_speed
from protocol.config import ConfigError, load_config
from protocol.output import PARTIAL_SCHEMA
from protocol.tuples import tuple_dtype
from tests.reference import pairs_of
from slave.aggregate import PartialAggregator, combine, partials, window_starts


def random_results(rng, n, keys=40):
    """(key, later ts in microseconds, value)."""
    return rng.integers(0, keys, n), rng.integers(0, 10_000_000, n), rng.normal(size=n)


def sorted_rows(t):
    t = t.sort_by([("key", "ascending"), ("window_start", "ascending")])
    return {c: t[c].to_numpy() for c in t.column_names}


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


def assert_same_view(got, want):
    for c in ("key", "window_start", "count", "min", "max"):
        assert np.array_equal(got[c], want[c], equal_nan=c in ("min", "max")), c
    assert np.allclose(got["sum"], want["sum"], rtol=1e-12, atol=1e-12, equal_nan=True)


@pytest.mark.parametrize("window", [0, 700_000])
def test_partials_equal_a_direct_aggregation(window):
    key, ts, value = random_results(np.random.default_rng(1), 5000)
    p = partials(key, ts, value, window)
    assert p.schema == PARTIAL_SCHEMA
    assert_same_view(sorted_rows(p), numpy_view(key, ts, value, window))


@pytest.mark.parametrize("seed", [2, 3, 4])
def test_combining_is_associative_any_split_gives_the_same_totals(seed):
    rng = np.random.default_rng(seed)
    key, ts, value = random_results(rng, 4000)
    value[rng.random(4000) < 0.02] = np.nan
    value[key == 7] = np.nan  # a group of NaN only
    want = numpy_view(key, ts, value, 500_000)
    assert np.isnan(want["max"]).any() and not np.isnan(want["min"]).all()
    cuts = np.sort(rng.choice(np.arange(1, 4000), size=rng.integers(1, 12), replace=False))
    pieces = [partials(k, t, v, 500_000) for k, t, v in zip(*(np.split(a, cuts) for a in (key, ts, value)))]
    flat = combine(pieces)
    rng.shuffle(pieces)
    nested = combine([combine(pieces[: len(pieces) // 2]), combine(pieces[len(pieces) // 2 :])])
    assert_same_view(sorted_rows(flat), want)
    assert_same_view(sorted_rows(nested), want)


def test_window_starts_on_boundaries_and_negative_ts():
    ts = np.array([-100_000, 0, 490_000, 499_999, 500_000, 1_000_000, 1_240_000])
    assert np.array_equal(window_starts(ts, 500_000), [-0.5, 0.0, 0.0, 0.0, 0.5, 1.0, 1.0])
    assert np.array_equal(window_starts(ts, 0), np.zeros(7))
    # decimals a float misses: 0.3 s is the start of its own 0.1 s window (floor(0.3 / 0.1) is 2 in floats)
    assert window_starts(np.array([300_000]), 100_000).tolist() == [0.3]


def test_nan_is_the_largest_value_in_partials_and_combine():
    key = np.array([1, 1, 2, 2, 3, 3])
    value = np.array([1.0, np.nan, np.nan, np.nan, 2.0, 5.0])
    p = sorted_rows(partials(key, np.zeros(6, np.int64), value, 0))
    assert np.array_equal(p["min"], [1.0, np.nan, 2.0], equal_nan=True)
    assert np.array_equal(p["max"], [np.nan, np.nan, 5.0], equal_nan=True)
    assert p["count"].tolist() == [2, 2, 2]
    split = sorted_rows(
        combine([partials(key[i : i + 1], np.zeros(1, np.int64), value[i : i + 1], 0) for i in range(6)])
    )
    for c in ("min", "max", "count"):
        assert np.array_equal(split[c], p[c], equal_nan=True)


def test_combine_of_nothing_is_empty_with_the_schema():
    assert combine([]).schema == PARTIAL_SCHEMA and combine([]).num_rows == 0
    assert partials(np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0), 1_000_000).num_rows == 0


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def results(rng, n):
    dt = tuple_dtype(64)
    r, s = np.zeros(n, dt), np.zeros(n, dt)
    r["key"] = s["key"] = rng.integers(0, 30, n)
    r["ts"], s["ts"] = rng.integers(0, 4_000_000, n), rng.integers(0, 4_000_000, n)
    r["value"], s["value"] = rng.random(n), rng.random(n) + 10
    return r, s


@pytest.mark.parametrize("group_by,value", [("key", "r_value"), ("s_key", "s_value")])
def test_aggregator_writes_every_interval_and_files_sum_to_the_whole(tmp_path, group_by, value):
    rng, clock = np.random.default_rng(5), Clock()
    agg = PartialAggregator(
        tmp_path / "aggregates", 3, {"window": 1.0, "flush_interval": 2.0, "group_by": group_by, "value": value}, clock
    )
    batches = [results(rng, n) for n in (100, 0, 250, 80, 300)]
    written = []
    for i, (r, s) in enumerate(batches):
        clock.now = i * 0.9  # 0, 0.9, 1.8, 2.7 (-> file), 3.6
        written.append(agg.add_pairs(pairs_of(r, s)))
    assert written == [0, 0, 0, 1, 0]
    assert agg.flush() == 1 and agg.flush() == 0  # at stop: the rest, then nothing more
    files = sorted((tmp_path / "aggregates").iterdir())
    assert [f.name for f in files] == ["slave-003-000000.parquet", "slave-003-000001.parquet"]
    first = pq.read_table(files[0])
    assert first.schema == PARTIAL_SCHEMA and first["count"].to_numpy().sum() == 430
    r = np.concatenate([b[0] for b in batches])
    s = np.concatenate([b[1] for b in batches])
    side = {"r": r, "s": s}
    want = numpy_view(
        side[group_by[0] if group_by != "key" else "r"]["key"],
        np.maximum(r["ts"], s["ts"]),
        side[value[0]]["value"],
        1_000_000,
    )
    assert_same_view(sorted_rows(combine([pq.read_table(f) for f in files])), want)


def test_many_batches_are_combined_as_they_come(tmp_path):
    rng, clock = np.random.default_rng(6), Clock()
    agg = PartialAggregator(
        tmp_path, 1, {"window": 0.0, "flush_interval": 100.0, "group_by": "key", "value": "r_value"}, clock
    )
    for _ in range(PartialAggregator.COMBINE_EVERY * 2 + 3):
        agg.add_pairs(pairs_of(*results(rng, 50)))
    assert len(agg.parts) <= PartialAggregator.COMBINE_EVERY
    assert agg.flush() == 1
    assert pq.read_table(tmp_path / "slave-001-000000.parquet")["count"].to_numpy().sum() == 50 * (2 * 32 + 3)


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
        ("aggregate.group_by=r_id", "aggregate.group_by"),
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
