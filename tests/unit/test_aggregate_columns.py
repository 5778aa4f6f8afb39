"""Phase one over declared streams' columns (slave.aggregate.column_partials / column_combine) and the
`[aggregate]` keys that go with it (protocol.aggregation), against plain Python over the same rows."""

from __future__ import annotations

import math
from decimal import Decimal

import numpy as np
import pyarrow as pa
import pytest

from control.aggregate import final_view, snapshot, watermark_of
from protocol import eventtime
from protocol.aggregation import Aggregation, Measure
from protocol.config import ConfigError, load_config
from slave.aggregate import column_combine, column_partials, stamped, windows


def python_windows(t, window: int, slide: int) -> list:
    return [s for s in range(t - t % slide, t - window - slide, -slide) if s <= t < s + window]


@pytest.mark.parametrize("window,slide", [(10, 10), (10, 5), (10, 3), (7, 7), (1, 1)])
def test_windows_hold_each_time_in_every_window_that_covers_it(window, slide):
    ts = [0, 1, 4, 5, 9, 10, 11, -1, -10, -11, 29, None]
    index, starts = windows(pa.array(ts, pa.int64()), window, slide)
    got = sorted(zip(index.tolist(), starts.to_pylist()), key=str)
    want = [(i, s) for i, t in enumerate(ts) for s in (python_windows(t, window, slide) if t is not None else [None])]
    assert got == sorted(want, key=str)
    assert np.all(np.diff(index) >= 0)


def rows(rng, n: int) -> pa.Table:
    def nulls(values, kind=None):
        return pa.array(values, kind, mask=rng.random(n) < 0.2)

    floats = rng.random(n) * 10
    floats[rng.random(n) < 0.05] = np.nan
    return pa.table(
        {
            "g": nulls([f"g{i}" for i in rng.integers(0, 3, n)]),
            "h": rng.integers(0, 2, n),
            "r_at": nulls(rng.integers(0, 60_000_000, n), pa.timestamp("us", "UTC")),
            "s_at": nulls(rng.integers(0, 60_000_000, n), pa.timestamp("us", "UTC")),
            "d": nulls([Decimal(int(c)) / 100 for c in rng.integers(-500, 5000, n)], pa.decimal128(9, 2)),
            "i": nulls(rng.integers(-50, 50, n)),
            "f": nulls(floats),
        }
    )


def python_view(t: pa.Table, spec: Aggregation) -> dict:
    """Group -> measures, row by row: NaN orders above every number (Spark's and DuckDB's order)."""
    out: dict = {}
    for row in t.to_pylist():
        times = [row[c].timestamp() * 1e6 for c in spec.times if row[c] is not None] if spec.window else []
        t_ = round(max(times)) if times else None
        starts = python_windows(t_, spec.window, spec.slide) if t_ is not None else [None]
        for s in starts if spec.window else [None]:
            key = tuple(row[g] for g in spec.groups) + ((s,) if spec.window else ())
            out.setdefault(key, []).append(row)
    view = {}
    for key, group in out.items():
        v = {"count": len(group)}
        for name, fn, col in spec.parts:
            values = [r[col] for r in group if r[col] is not None]
            if fn == "count":
                v[name] = len(values)
            elif fn == "distinct":
                v[name] = set(values)
            elif not values:
                v[name] = None
            elif fn == "sum":
                v[name] = sum(values)
            else:
                nan = [x for x in values if isinstance(x, float) and math.isnan(x)]
                numbers = [x for x in values if not (isinstance(x, float) and math.isnan(x))]
                if fn == "max":
                    v[name] = nan[0] if nan else max(numbers)
                else:
                    v[name] = min(numbers) if numbers else nan[0]
        view[key] = v
    return view


def as_dict(t: pa.Table, spec: Aggregation) -> dict:
    d = t.to_pydict()
    return {tuple(d[k][i] for k in spec.keys): {c: d[c][i] for c in d if c not in spec.keys} for i in range(t.num_rows)}


def same(a, b) -> bool:
    if isinstance(b, set):
        return len(a) == len(b) and set(a) == b
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-12)
    return a == b


@pytest.mark.parametrize(
    "groups,window,slide,times",
    [
        (("g", "h"), 0, 0, ()),
        (("g", "h"), 20_000_000, 20_000_000, ("r_at", "s_at")),
        (("g", "h"), 20_000_000, 5_000_000, ("r_at",)),
        ((), 0, 0, ()),  # one group: the whole run's
        ((), 20_000_000, 5_000_000, ("s_at",)),
    ],
)
def test_partials_of_any_split_merge_to_the_view_of_all_rows(groups, window, slide, times):
    rng = np.random.default_rng(3)
    t = rows(rng, 3000)
    measures = tuple(Measure(fn, c) for fn in ("sum", "min", "max", "avg") for c in ("d", "i", "f"))
    measures += (Measure("count_distinct", "i"), Measure("count_distinct", "d"))
    spec = Aggregation(groups, times, window, slide, (Measure("count", None), *measures), None)
    cuts = np.sort(rng.choice(np.arange(1, 3000), 7, replace=False))
    parts = [column_partials(p, spec) for p in (t.slice(a, b - a) for a, b in zip([0, *cuts], [*cuts, 3000]))]
    merged = column_combine([column_combine(parts[:3], spec), *parts[3:]], spec)
    assert merged.schema.field("sum_d").type == pa.decimal128(38, 2)
    assert merged.schema.field("min_d").type == pa.decimal128(9, 2)
    got, want = as_dict(merged, spec), python_view(t, spec)
    assert got.keys() == want.keys()
    for key, v in want.items():
        for c, x in v.items():
            assert same(got[key][c], x), (key, c, got[key][c], x)


def test_streams_aggregate_keys_are_checked(tmp_path):
    (tmp_path / "a.csv").write_text("u,t\n")
    streams = [
        "streams.views.path='" + str(tmp_path / "a.csv") + "'",
        "streams.views.key='u'",
        "streams.views.time='t'",
        "streams.buys.path='" + str(tmp_path / "a.csv") + "'",
        "streams.buys.key='u'",
        "streams.buys.time='t'",
        "aggregate.enabled=true",
    ]
    cfg = load_config(None, [*streams, "aggregate.group_by=[]", "aggregate.measures=['count', 'avg(buys_x)']"])
    assert cfg["aggregate"]["group_by"] == []
    for override, words in [
        ("aggregate.measures=['median(x)']", "is not a measure"),
        ("aggregate.measures=[]", "a list of measures"),
        ("aggregate.slide='10s'", "needs aggregate.window"),
        ("aggregate.group_by=['count']", "repeat a name"),
        ("aggregate.group_by=[1]", "a result column or a list"),
    ]:
        with pytest.raises(ConfigError, match=words):
            load_config(None, [*streams, override])
    with pytest.raises(ConfigError, match="at most aggregate.window"):
        load_config(None, [*streams, "aggregate.window='10s'", "aggregate.slide='11s'"])
    for value in ("r_value", "s_value"):  # the single file's measured column: set, it would do nothing here
        with pytest.raises(ConfigError, match=r"aggregate\.value: not with \[streams.*use aggregate\.measures"):
            load_config(None, [*streams, f"aggregate.value={value}"])
    for override, words in [  # the single file's result columns: x and t are none of them
        ("aggregate.measures=['sum(x)']", "'x' is not a result column"),
        ("aggregate.time='t'", "'t' is not a result column"),
    ]:
        with pytest.raises(ConfigError, match=words):
            load_config(None, ["aggregate.enabled=true", "aggregate.window=1.0", override])
    load_config(None, ["aggregate.enabled=true", "aggregate.window=1.0", "aggregate.slide=0.5"])  # hopping


def test_after_a_recovery_on_fewer_slaves_the_ranks_it_no_longer_has_hold_no_window_back():
    part = pa.table(
        {"g": pa.array([], pa.string()), "window_start": pa.array([], pa.int64()), "count": pa.array([], pa.int64())}
    )

    def stamps(*rows):  # (rank, watermark, slaves of the run that wrote the rank's newest file), one file each
        return pa.concat_tables([stamped(part, r, 0, w, n).slice(0, 1) for r, w, n in rows])

    assert watermark_of(stamps((1, 30, 2), (2, 40, 2), (3, 5, 3))) == 30  # rank 3: the run before's, left out
    assert watermark_of(stamps((1, 30, 2), (2, 40, 3), (3, 5, 3))) == eventtime.NEG_INF  # rank 2 not heard of yet
    assert watermark_of(stamps((1, 30, 3), (2, 40, 3), (3, 5, 3))) == 5  # back on three slaves: rank 3 counts


def test_a_window_is_final_once_every_slave_stamped_a_watermark_past_its_end_by_the_reach():
    spec = Aggregation(("g",), ("t",), 10, 10, (Measure("count", None),), 3)
    part = pa.table({"g": pa.array(["a", "b", None], pa.string()), "window_start": [0, 10, None], "count": [1, 2, 3]})

    def merged(*stamps):  # (rank, newest file, files merged, watermark) of 2 slaves, as the merger groups them
        rows = [stamped(part.slice(0, 0), r, f, w, 2).slice(0, 1) for r, f, _, w in stamps]
        for i, (_, _, files, _) in enumerate(stamps):
            rows[i] = rows[i].set_column(rows[i].column_names.index("__files"), "__files", pa.array([files]))
        return pa.concat_tables([stamped(part, 1, 0, 0, 2).slice(0, 3), *rows])

    assert watermark_of(merged((1, 4, 5, 30)).slice(3)) == eventtime.NEG_INF  # slave 2 not heard of
    assert watermark_of(merged((1, 4, 5, 30), (2, 4, 4, 40)).slice(3)) == eventtime.NEG_INF  # one of its files missing
    assert watermark_of(merged((1, 4, 5, 30), (2, 6, 7, 12)).slice(3)) == 12
    for watermark, final in [(12, [False, False, False]), (13, [True, False, False]), (23, [True, True, False])]:
        view = final_view(merged((1, 4, 5, 30), (2, 6, 7, watermark)), spec, None)
        assert view["final"].to_pylist() == final and view["count"].to_pylist() == [1, 2, 3]
        assert view.column_names == ["g", "window_start", "window_end", "count", "final"]
    ended = final_view(merged((1, 4, 5, 30)), spec, eventtime.POS_INF)  # --batch: a finished run's results
    assert ended["final"].to_pylist() == [True] * 3
    assert final_view(merged((1, 4, 5, 30)), spec._replace(reach=None), 10**9)["final"].to_pylist() == [False] * 3


def test_a_view_grouped_by_nothing_is_one_row_of_the_whole_run():
    """`group_by = []` without a window: the partials and the merger's view hold one group (the whole run's)."""
    spec = Aggregation((), (), 0, 0, (Measure("count", None), Measure("count_distinct", "i")), None)
    t = rows(np.random.default_rng(5), 500)
    merged = column_combine([column_partials(t.slice(a, 250), spec) for a in (0, 250)], spec)

    class Merged:  # the merger's DataFrame of the partials, with a slave's stamp (control.aggregate.snapshot)
        def toArrow(self):
            return stamped(merged, 1, 0, 7, 1)

    view = snapshot(Merged(), spec, eventtime.POS_INF)
    assert view.column_names == ["count", "distinct_i", "final"] and view["count"].to_pylist() == [500]
    assert sorted(view["distinct_i"][0].as_py()) == sorted(set(t["i"].drop_null().to_pylist()))
