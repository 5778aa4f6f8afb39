"""The query's compiler (protocol.query) and its conditions (protocol.condition), in-process: what each clause
becomes, every refusal with its clause, and SQL's three-valued logic on filters and pairs against DuckDB's."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest

from protocol.condition import pair_mask, row_mask, term_words
from protocol.errors import ConfigError
from protocol.query import R, S, apply_query, compile_query, projected

NAMES = ("trades", "quotes")
BOUND = "q.ts BETWEEN t.ts - INTERVAL 2 SECONDS AND t.ts"


def plan(sql: str, names=NAMES, times=()):
    return compile_query(sql, names, times)


@pytest.mark.parametrize(
    "on, lower, upper, strict",
    [
        ("q.ts BETWEEN t.ts - INTERVAL 2 SECONDS AND t.ts", -2_000_000, 0, (False, False)),
        ("t.ts BETWEEN q.ts AND q.ts + INTERVAL '500' MILLISECOND", -500_000, 0, (False, False)),
        ("q.ts > t.ts - INTERVAL 1 SECOND AND q.ts < t.ts + INTERVAL 1 SECOND", -999_999, 999_999, (True, True)),
        ("t.ts + INTERVAL 3 SECONDS >= q.ts AND t.ts <= q.ts", 0, 3_000_000, (False, False)),
        (
            "q.ts >= t.ts AND q.ts <= t.ts + INTERVAL '1.5 seconds' AND q.ts < t.ts + INTERVAL 1 SECOND",
            0,
            999_999,
            (False, True),
        ),
    ],
)
def test_time_bounds_in_every_form_become_s_minus_r_bounds_with_open_ends_exclusive(on, lower, upper, strict):
    p = plan(f"SELECT * FROM trades t JOIN quotes q ON t.k = q.k AND {on}")
    assert (p.lower, p.upper, p.open, p.time) == (lower, upper, strict, ("ts", "ts"))
    assert p.condition is None and p.filters == (None, None)


def test_keys_band_and_less():
    p = plan(f"SELECT * FROM trades t JOIN quotes q ON q.sym = t.symbol AND t.venue = q.venue AND {BOUND}")
    assert p.keys == (("symbol", "sym"), ("venue", "venue")) and p.predicate == "equal"
    p = plan(f"SELECT * FROM trades t JOIN quotes q ON ABS(q.k - t.k) <= 3 AND {BOUND}")
    assert (p.predicate, p.band, p.keys) == ("band", 3, (("k", "k"),))
    p = plan(f"SELECT * FROM trades t JOIN quotes q ON q.k > t.k AND {BOUND}")
    assert (p.predicate, p.keys) == ("less", (("k", "k"),))
    p = plan(f"SELECT * FROM trades t JOIN quotes q ON t.k = q.k AND ABS(q.x - t.x) <= 3 AND {BOUND}")
    assert p.predicate == "equal" and p.condition is not None  # with an equality, a band is a pair condition


def test_filters_go_to_ingest_where_sql_allows_and_outer_joins_simplify():
    on = f"t.k = q.k AND {BOUND} AND q.src IS NOT NULL AND t.qty > 5"
    # left: ON on quotes (null-supplying) filters them; ON on trades (kept) decides pairs
    p = plan(f"SELECT * FROM trades t LEFT JOIN quotes q ON {on} WHERE t.px > 1")
    assert p.join_type == "left" and p.filters[R] is not None and p.filters[S] is not None
    assert {c.name for c in _cols(p.filters[R])} == {"px"} and {c.name for c in _cols(p.filters[S])} == {"src"}
    assert [t for t in p.terms[R]] and p.condition is not None
    # a WHERE that rejects the null rows of quotes makes the left join inner
    p = plan(f"SELECT * FROM trades t LEFT JOIN quotes q ON {on} WHERE q.bid > 1")
    assert p.join_type == "inner" and p.notes
    p = plan(f"SELECT * FROM trades t FULL JOIN quotes q ON t.k = q.k AND {BOUND} WHERE t.px > 1")
    assert p.join_type == "left"
    p = plan(f"SELECT * FROM trades t FULL JOIN quotes q ON t.k = q.k AND {BOUND} WHERE t.px > 1 AND q.b < t.px")
    assert p.join_type == "inner" and p.condition is not None
    # FROM a, b WHERE ...: an inner join
    p = plan(f"SELECT * FROM trades t, quotes q WHERE t.k = q.k AND {BOUND} AND q.b < 3")
    assert p.join_type == "inner" and p.keys == (("k", "k"),) and p.filters[S] is not None


def _cols(node):
    from protocol.query import columns

    return columns(node)


@pytest.mark.parametrize(
    "sql, words",
    [
        (f"SELECT * FROM trades t JOIN quotes q ON t.k = q.k AND {BOUND} ORDER BY t.ts", "ORDER BY"),
        (f"SELECT * FROM trades t JOIN quotes q ON t.k = q.k AND {BOUND} LIMIT 5", "LIMIT"),
        (
            f"SELECT t.k, max(q.b) FROM trades t LEFT SEMI JOIN quotes q ON t.k = q.k AND {BOUND} GROUP BY t.k",
            "GROUP BY of a semi join names q.b",
        ),
        (f"SELECT t.k, q.x FROM trades t JOIN quotes q ON t.k = q.k AND {BOUND} GROUP BY t.k", "a group column"),
        (f"SELECT DISTINCT t.k FROM trades t JOIN quotes q ON t.k = q.k AND {BOUND}", "DISTINCT"),
        (f"SELECT * FROM trades t JOIN quotes q ON t.k = q.k AND {BOUND} JOIN x ON x.k = t.k", "exactly two"),
        (f"SELECT * FROM trades t JOIN quotes q ON t.x < q.x + 3 AND {BOUND}", "no key equality"),
        (f"SELECT * FROM trades t JOIN quotes q ON t.k = q.k AND {BOUND} AND myudf(t.x)", "MYUDF"),
        (f"SELECT * FROM trades t JOIN quotes q ON t.k = q.k AND {BOUND} AND t.x IN (SELECT 1)", "subquer"),
        (f"SELECT * FROM trades t JOIN quotes q ON t.k = q.k AND {BOUND} AND x > 1", "needs its stream"),
        (f"SELECT * FROM trades t JOIN quotes q ON t.k = q.k AND {BOUND} AND z.x > 1", "no table"),
        (f"SELECT * FROM trades t JOIN bids q ON t.k = q.k AND {BOUND}", "not a declared stream"),
        (f"SELECT * FROM trades t JOIN trades q ON t.k = q.k AND {BOUND}", "itself"),
        ("SELECT * FROM trades t JOIN quotes q USING (k)", "USING"),
        ("SELECT * FROM trades t JOIN quotes q ON t.k = q.k AND q.ts >= t.ts - INTERVAL 1 SECOND", "no upper"),
        (
            "SELECT * FROM trades t JOIN quotes q ON t.k = q.k AND q.ts <= t.ts - INTERVAL 3 SECONDS AND q.ts >= t.ts",
            "no pair",
        ),
        (f"SELECT * FROM trades t LEFT JOIN quotes q ON t.k = q.k AND {BOUND} WHERE q.b IS NULL", "null"),
        (f"SELECT * FROM trades t LEFT SEMI JOIN quotes q ON t.k = q.k AND {BOUND} WHERE q.b > 1", "semi"),
        (f"SELECT q.b FROM trades t LEFT ANTI JOIN quotes q ON t.k = q.k AND {BOUND}", "anti"),
        (f"SELECT * FROM trades t JOIN quotes q ON t.k = q.k AND {BOUND} AND t.x + q.y = 'A'", "text"),
        (f"SELECT t.x + 1 FROM trades t JOIN quotes q ON t.k = q.k AND {BOUND}", "only columns"),
        (f"SELECT t.x, q.x FROM trades t JOIN quotes q ON t.k = q.k AND {BOUND}", "two result columns named x"),
        (f"SELECT * FROM trades t JOIN quotes q ON t.k = q.k AND {BOUND}; SELECT 1", "one SELECT"),
        ("SELEC * FROM", "not valid"),
    ],
)
def test_what_a_streaming_join_cannot_do_is_refused_naming_the_clause(sql, words):
    with pytest.raises(ConfigError, match="query: ") as e:
        plan(sql)
    assert words in str(e.value)


def test_the_query_sets_the_streams_and_the_join_and_refuses_saying_it_twice():
    streams = {"quotes": {"path": "q.parquet", "payload": ["bid"]}, "trades": {"path": "t.csv", "key": "symbol"}}
    cfg = {"join": {}, "aggregate": {}}
    sql = f"SELECT * FROM trades t LEFT JOIN quotes q ON t.symbol = q.symbol AND {BOUND} AND q.src > t.px"
    apply_query(sql, streams, cfg, set())
    join = cfg["join"]
    assert streams["trades"] | {"side": "R"} == streams["trades"] and streams["trades"]["key"] == ["symbol"]
    assert streams["quotes"]["side"] == "S" and streams["quotes"]["time"] == "ts"
    assert streams["quotes"]["payload"] == ["bid", "src"]  # what the condition reads travels
    assert join == {"type": "left", "lower": -2.0, "upper": 0.0, "predicate": "equal", "band": 0}
    with pytest.raises(ConfigError, match="join.window: the query says it"):
        apply_query(sql, {"trades": {}, "quotes": {}}, {"join": {}}, {("join", "window")})
    with pytest.raises(ConfigError, match="streams.trades.key = 'venue'"):
        apply_query(sql, {"trades": {"key": "venue"}, "quotes": {}}, {"join": {}}, set())
    with pytest.raises(ConfigError, match="declared streams"):
        apply_query(sql, {}, {"join": {}}, set())


def test_group_by_with_sparks_window_is_the_two_phase_aggregation():
    sql = (
        "SELECT t.sym, window(q.ts, '60 seconds', '30 seconds') AS w, count(*), sum(q.bid), avg(t.px), "
        f"count(DISTINCT q.src) FROM trades t JOIN quotes q ON t.sym = q.sym AND {BOUND} "
        "GROUP BY t.sym, window(q.ts, '60 seconds', '30 seconds')"
    )
    cfg = {"join": {}, "aggregate": {}}
    apply_query(sql, {"trades": {}, "quotes": {"prefix": "q_"}}, cfg, set())
    assert cfg["aggregate"] == {
        "enabled": True,
        "group_by": ["trades_sym"],
        "window": 60.0,
        "slide": 30.0,
        "time": "q_ts",
        "measures": ["count", "sum(q_bid)", "avg(trades_px)", "count_distinct(q_src)"],
    }
    with pytest.raises(ConfigError, match="aggregate.window: the query's GROUP BY says it"):
        apply_query(sql, {"trades": {}, "quotes": {}}, {"join": {}, "aggregate": {}}, {("aggregate", "window")})


def test_projection_names_columns_as_sql_does():
    p = plan(f"SELECT t.id, q.bid AS b, kind, delay AS d FROM trades t LEFT JOIN quotes q ON t.k = q.k AND {BOUND}")
    table = pa.table({"trades_id": [1], "trades_k": [2], "quotes_bid": [3.0], "delay": [0.1], "kind": ["matched"]})
    got = projected(table, p, ("trades_", "quotes_"))
    assert got.column_names == ["id", "b", "kind", "d"] and got.to_pylist() == [
        {"id": 1, "b": 3.0, "kind": "matched", "d": 0.1}
    ]


#: conditions on the pair and filters, each checked against DuckDB over every pair of two small tables with nulls
CONDITIONS = [
    "q.b <= t.p",
    "q.b * 2 > t.p + 1 OR t.n IS NULL",
    "NOT (q.b < t.p) AND t.n IN (1, 2, NULL)",
    "ABS(q.b - t.p) <= 1.5 OR (q.flag AND t.n > 1)",
    "(q.s = 'A') = (t.n >= 2)",
    "q.at >= t.at - INTERVAL 1 SECOND AND t.p / t.n > q.b",
    "NOT (t.n IS NULL OR q.b IS NULL) OR -q.b < t.p",
]


def _tables():
    t = pa.table(
        {
            "n": pa.array([1, 2, None, 3, 0], pa.int64()),
            "p": pa.array([1.5, None, 2.0, 3.25, 0.5]),
            "at": pa.array([0, 1_000_000, 2_000_000, None, 500_000], pa.timestamp("us", "UTC")),
        }
    )
    q = pa.table(
        {
            "b": pa.array([1.0, 2.5, None, 0.5]),
            "s": pa.array(["A", "B", None, "A"]),
            "flag": pa.array([True, None, False, True]),
            "at": pa.array([0, 900_000, 3_000_000, None], pa.timestamp("us", "UTC")),
        }
    )
    return t, q


@pytest.mark.parametrize("cond", CONDITIONS)
def test_a_pair_condition_keeps_exactly_the_pairs_duckdb_keeps(cond):
    import duckdb

    t, q = _tables()
    p = plan(f"SELECT * FROM trades t JOIN quotes q ON t.k = q.k AND {BOUND} AND ({cond})", times=("ts", "ts"))
    wt, wq = term_words(p.terms[R], t, p.term_words), term_words(p.terms[S], q, p.term_words)
    ir, iq = (np.array(x) for x in zip(*itertools.product(range(t.num_rows), range(q.num_rows))))
    held = np.ones(len(ir), bool) if p.condition is None else pair_mask(p.condition, wt[ir], wq[iq])
    for side, rows, table in ((R, ir, t), (S, iq, q)):  # conjuncts on one stream are its filter
        if p.filters[side] is not None:
            held &= row_mask(p.filters[side], table)[rows]
    got = set(zip(ir[held].tolist(), iq[held].tolist()))
    con = duckdb.connect()
    con.register("t0", t.append_column("i", pa.array(range(t.num_rows))))
    con.register("q0", q.append_column("i", pa.array(range(q.num_rows))))
    want = set(con.execute(f"SELECT t.i, q.i FROM t0 t, q0 q WHERE {cond}").fetchall())
    assert got == want


@pytest.mark.parametrize("cond", ["t.n >= 2 OR t.p IS NULL", "NOT t.n IN (1, 3)", "t.p * t.n > 1"])
def test_a_filter_keeps_exactly_the_rows_duckdb_keeps(cond):
    import duckdb

    t, _ = _tables()
    p = plan(f"SELECT * FROM trades t JOIN quotes q ON t.k = q.k AND {BOUND} WHERE {cond}")
    got = np.flatnonzero(row_mask(p.filters[R], t)).tolist()
    con = duckdb.connect()
    con.register("t0", t.append_column("i", pa.array(range(t.num_rows))))
    assert got == [i for (i,) in con.execute(f"SELECT t.i FROM t0 t WHERE {cond} ORDER BY 1").fetchall()]


def test_a_stream_checks_its_rows_against_the_query_filter_counts_and_terms_travel():
    """Where rows are read (common.stream_file.StreamChecks): the filter drops rows after the checks, counted;
    the rows kept carry their terms; a column the query names that the stream lacks, and a text term compared
    across the streams, stop the run naming the stream."""
    from common.chunks import InputError
    from common.stream_file import StreamChecks

    p = plan(f"SELECT * FROM trades t JOIN quotes q ON t.k = q.k AND {BOUND} AND t.px * 2 < q.b WHERE t.n > 1")
    spec = SimpleNamespace(key=("k",), time="ts", id="", time_unit="s", payload="*", prefix="trades_")
    schema = pa.schema([("k", pa.int64()), ("ts", pa.int64()), ("n", pa.int64()), ("px", pa.float64())])
    checks = StreamChecks("trades", spec, ["int"], 100, schema, "here", p.stream(R))
    batch = checks.checked(pa.table({"k": [1, 2, 3], "ts": [10, 11, 12], "n": [1, 2, 3], "px": [0.5, None, 2.0]}))
    assert batch.rows.tolist() == [1, 2] and checks.filtered == 1
    assert batch.terms.shape == (2, p.term_words)
    assert batch.terms[:, 0].view(np.float64)[1] == 4.0 and batch.terms[:, -1].tolist() == [1, 0]  # px null
    with pytest.raises(InputError, match="lacks column.s. px that the query names"):
        StreamChecks("trades", spec, ["int"], 100, schema.remove(3), "here", p.stream(R))
    text = plan(f"SELECT * FROM trades t JOIN quotes q ON t.k = q.k AND {BOUND} AND t.s > q.s")
    texts = StreamChecks("trades", spec, ["int"], 100, schema.append(pa.field("s", pa.string())), "x", text.stream(R))
    with pytest.raises(InputError, match="compares numbers, times and booleans across the streams, not string"):
        texts.checked(pa.table({"k": [1], "ts": [1], "n": [1], "px": [1.0], "s": ["a"]}))
