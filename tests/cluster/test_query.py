"""The join as a Spark SQL query (protocol.query, docs/query.md) on the real cluster: trades and quotes as users
write them, a composite text key, bounds on the event times, a condition on the pair and filters per stream, in
every join type, across a crash under the supervisor and on two dispatchers; each run's result rows equal, row for
row and under the same names, the rows DuckDB gives for the same query (transpiled by the same parser) over the
same files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from protocol.lifetime import NOT_AUDITED
from protocol.output import read_tables
from tests.reference import _row_order, duckdb_query
from tests.runs import run_cluster, soak, write_config

T0 = 1_772_461_920_000_000  #: microseconds
ON = """t.symbol = q.symbol AND t.venue = q.venue
 AND q.quote_ts BETWEEN t.exec_time - INTERVAL 2 SECONDS AND t.exec_time
 AND q.bid <= t.price AND q.src IS NOT NULL"""
PAIR_COLUMNS = "t.trade_id, t.price, q.quote_id, q.bid, q.quote_ts AS quoted_at"


def trades_quotes(folder: Path, seed: int = 5, n_trades: int = 2000, n_quotes: int = 4000) -> dict[str, pa.Table]:
    """Trades and quotes of 6 symbols on 2 venues over 40 s, each out of order by up to 0.3 s (no row late with
    max_delay 1 s), written as Parquet; the tables by stream name."""
    rng = np.random.default_rng(seed)
    symbols = np.array(["AAPL", "MSFT", "NVDA", "AMZN", "META", "TSLA"])
    venues = np.array(["XNAS", "ARCX"])

    def times(n: int) -> np.ndarray:
        return np.sort(rng.integers(0, 40_000_000, n)) + rng.integers(0, 300_000, n) + T0

    trades = pa.table(
        {
            "trade_id": np.arange(1, n_trades + 1, dtype=np.int64) * 7,
            "symbol": symbols[rng.integers(0, len(symbols), n_trades)],
            "venue": venues[rng.integers(0, 2, n_trades)],
            "exec_time": pa.array(times(n_trades), pa.timestamp("us", "UTC")),
            "price": np.round(100 + rng.normal(0, 1, n_trades), 2),
            "qty": rng.integers(1, 500, n_trades),
        }
    )
    src = rng.choice(np.array(["ARCA", "EDGX", "BATS"]), n_quotes).astype(object)
    src[rng.random(n_quotes) < 0.1] = None
    quotes = pa.table(
        {
            "quote_id": np.arange(n_quotes, dtype=np.int64),
            "symbol": symbols[rng.integers(0, len(symbols), n_quotes)],
            "venue": venues[rng.integers(0, 2, n_quotes)],
            "quote_ts": pa.array(times(n_quotes), pa.timestamp("us", "UTC")),
            "bid": np.round(100 + rng.normal(0, 1, n_quotes), 2),
            "src": pa.array(src, pa.string()),
        }
    )
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(trades, folder / "trades.parquet")
    pq.write_table(quotes, folder / "quotes.parquet")
    return {"trades": trades, "quotes": quotes}


def settings(data: Path, sql: str, **more) -> dict:
    return {
        "streams.trades.path": str(data / "trades.parquet"),
        "streams.trades.id": "trade_id",
        "streams.quotes.path": str(data / "quotes.parquet"),
        "streams.quotes.id": "quote_id",
        "join.max_delay": "1s",
        "partitioning.partitions": 8,
        "query.sql": sql,
        **more,
    }


def result_rows(out: Path) -> list[tuple]:
    return sorted(zip(*(c.to_pylist() for c in read_tables(out / "results").columns)), key=_row_order)


#: join form -> (the JOIN, the extra ON, the WHERE, the columns)
FORMS = {
    "inner": ("JOIN", "", "WHERE t.qty >= 100", PAIR_COLUMNS),
    "left": ("LEFT JOIN", "", "WHERE t.qty >= 100", PAIR_COLUMNS),
    # t is the null-supplying side: ON t.qty >= 100 filters trades as they are read
    "right": ("RIGHT JOIN", "AND t.qty >= 100", "", PAIR_COLUMNS),
    # t is kept: ON t.qty >= 100 decides pairs only, every trade comes out
    "full": ("FULL OUTER JOIN", "AND t.qty >= 100", "", PAIR_COLUMNS),
    "semi": ("LEFT SEMI JOIN", "", "WHERE t.qty >= 100", "t.trade_id, t.price"),
    "anti": ("LEFT ANTI JOIN", "", "WHERE t.qty >= 100", "t.trade_id, t.price"),
}


def form(name: str) -> str:
    join, on, where, cols = FORMS[name]
    return f"SELECT {cols} FROM trades t {join} quotes q ON {ON} {on} {where}"


@pytest.mark.parametrize("name", list(FORMS))
def test_every_join_form_of_a_query_equals_duckdb_running_it(tmp_path, name):
    """Each form's results are DuckDB's rows for the same SQL, under the SELECT's names; the rows its filters
    drop are counted per stream."""
    tables = trades_quotes(tmp_path / "data")
    sql = form(name)
    run = run_cluster(tmp_path, 3, settings(tmp_path / "data", sql))
    assert run.returncode == 0, run.stderr
    want = duckdb_query(sql, tables)
    assert len(want) > 50
    got = result_rows(run.out)
    assert got == want
    names = [c.split(".")[-1].split()[-1] for c in FORMS[name][3].split(", ")]  # the alias, else the column
    assert read_tables(run.out / "results").column_names == names
    assert run.summary["late"] == 0
    filtered = run.summary["filtered"]
    # WHERE on a kept side and ON on a null-supplying one filter at ingest; ON on a kept side decides pairs
    kept = {"right": "S", "full": "RS"}.get(name, "R")
    filters_r, filters_s = "WHERE" in FORMS[name][2] or "R" not in kept, "S" not in kept
    assert filtered["R"] == (int((tables["trades"]["qty"].to_numpy() < 100).sum()) if filters_r else 0)
    assert filtered["S"] == (tables["quotes"]["src"].null_count if filters_s else 0)


@pytest.mark.parametrize("dispatchers", [1, soak(2)])
def test_a_query_with_a_condition_and_filters_is_exact_across_a_slave_killed_under_the_supervisor(
    tmp_path, dispatchers
):
    """A left join with a pair condition and filters, paced, with checkpoints: slave rank k+1 is SIGKILLed as it
    writes its part of the second checkpoint and the supervisor recovers from the first; the results equal
    DuckDB's rows once each."""
    tables = trades_quotes(tmp_path / "data", seed=9)
    sql = form("left")
    marker = tmp_path / "fault-fired"
    run = run_cluster(
        tmp_path,
        3 + dispatchers - 1,
        settings(
            tmp_path / "data",
            sql,
            **{
                "cluster.dispatchers": dispatchers,
                "source.rate": 2000.0,
                "epochs.distribution": "100ms",
                "checkpoint.interval": 2,
                "output.flush_rows": 1,
            },
        ),
        wrapper=[sys.executable, "-m", "control.supervise", "--backoff", "0.1", "--restarts", "3", "--"],
        env={"STREAMJOIN_FAULT": f"{dispatchers + 1}:checkpoint:2:{marker}"},
    )
    assert run.returncode == 0, run.stderr
    assert marker.exists() and run.summary["checkpoints"]["recovered_from"] is not None
    assert result_rows(run.out) == duckdb_query(sql, tables)


def test_the_query_on_two_dispatchers_equals_duckdb(tmp_path):
    """Two dispatchers read the files and route the same tuples: a full join's pair condition on the kept side
    and its filter on quotes give DuckDB's rows."""
    tables = trades_quotes(tmp_path / "data", seed=3)
    sql = form("full")
    run = run_cluster(tmp_path, 4, settings(tmp_path / "data", sql, **{"cluster.dispatchers": 2}))
    assert run.returncode == 0, run.stderr
    assert result_rows(run.out) == duckdb_query(sql, tables)


def test_explain_prints_the_plan_and_a_refusal_names_its_clause(tmp_path):
    """`streamjoin explain` (control.explain) prints keys, bounds, what runs at ingest and on pairs, the columns;
    a query a streaming join cannot run exits 2 naming the clause, before any rank starts."""
    trades_quotes(tmp_path / "data")
    (tmp_path / "q.sql").write_text(form("left"))
    cfg = tmp_path / "streams.toml"
    cfg.write_text(
        f'[streams.trades]\npath = "{tmp_path / "data/trades.parquet"}"\nid = "trade_id"\n'
        f'[streams.quotes]\npath = "{tmp_path / "data/quotes.parquet"}"\nid = "quote_id"\n'
    )
    explain = [sys.executable, "-m", "control.explain", "--config", str(cfg), "--sql"]
    ok = subprocess.run([*explain, str(tmp_path / "q.sql")], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "keys: t.symbol = q.symbol, t.venue = q.venue" in ok.stdout
    assert "time: q.quote_ts - t.exec_time >= -2 s and <= 0 s" in ok.stdout
    assert "at ingest, trades: (t.qty >= 100)" in ok.stdout
    assert "on pairs: (q.bid <= t.price)" in ok.stdout
    (tmp_path / "bad.sql").write_text(form("inner") + " ORDER BY t.exec_time")
    bad = subprocess.run([*explain, str(tmp_path / "bad.sql")], capture_output=True, text=True)
    assert bad.returncode == 2 and "ORDER BY" in bad.stderr
    launch = [sys.executable, "-m", "deploy.launch", "-n", "3", "--", "--config", str(cfg), "--sql"]
    run = subprocess.run([*launch, str(tmp_path / "bad.sql")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "ORDER BY" in run.stderr
    audit = [sys.executable, "-m", "control.audit", "--config", str(cfg), "--set", f"query.sql={form('left')}"]
    audit += ["--set", f"output.path={tmp_path / 'out'}"]  # not the checkout's out/, which `make run` fills
    refused = subprocess.run(audit, capture_output=True, text=True, timeout=120)
    assert refused.returncode == NOT_AUDITED and "a live run of declared streams" in refused.stderr  # none yet


def test_group_by_with_sparks_window_is_the_aggregation_and_its_view_equals_duckdbs(tmp_path, spark):
    """GROUP BY with window(time, '10 seconds', '5 seconds'), count(*), sum, avg, min and count(DISTINCT) over an
    inner join with a pair condition and a filter: the slaves pre-aggregate (`[aggregate]`, which the query sets),
    the merger's streaming view and the batch view both equal DuckDB's GROUP BY in the same hopping windows over
    DuckDB's rows of the same join."""
    import duckdb

    from tests.cluster.test_aggregate_streams import aggregated, assert_view_equals, run_and_merge

    tables = trades_quotes(tmp_path / "data", seed=13)
    on = f"{ON} AND t.qty >= 100"
    sql = (
        "SELECT t.symbol, window(q.quote_ts, '10 seconds', '5 seconds') AS w, count(*) AS n, sum(t.qty), "
        f"avg(q.bid), min(q.bid), count(DISTINCT q.src) FROM trades t JOIN quotes q ON {on} "
        "GROUP BY t.symbol, window(q.quote_ts, '10 seconds', '5 seconds')"
    )
    more = {"source.rate": 3000.0, "aggregate.flush_interval": 0.3}
    cfg, streamed, batched = run_and_merge(tmp_path, spark, settings(tmp_path / "data", sql, **more))
    assert cfg["aggregate"]["group_by"] == ["trades_symbol"] and cfg["aggregate"]["time"] == "quotes_quote_ts"
    for name, table in tables.items():
        duckdb.register(name, table)
    columns = [f"{a}.{c} AS {n}_{c}" for a, n in (("t", "trades"), ("q", "quotes")) for c in tables[n].column_names]
    want = aggregated(f"SELECT {', '.join(columns)} FROM trades t JOIN quotes q ON {on}", cfg)
    assert want.num_rows > 50
    assert_view_equals(streamed, want, cfg)
    assert_view_equals(batched, want, cfg)


def test_the_clicks_example_query_as_shipped_equals_duckdb_running_it_on_the_files(tmp_path):
    """examples/clicks/query.toml (the README's query: a left join with a pair condition and a filter) on
    make_data.py's files, from `[query] sql` and again from `--sql FILE`: DuckDB's rows for the same SQL over the
    same files (the CSV's ISO text read as timestamps), row for row."""
    import duckdb
    import sqlglot
    import tomllib

    from deploy.launch import mpi_env, mpirun_command

    root = Path(__file__).resolve().parents[2]
    data = tmp_path / "data"
    subprocess.run([sys.executable, str(root / "examples/clicks/make_data.py"), str(data)], check=True)
    example = root / "examples/clicks/query.toml"
    sql = tomllib.loads(example.read_text())["query"]["sql"]
    con = duckdb.connect()
    con.execute("SET TimeZone = 'UTC'")
    con.execute(
        "CREATE VIEW impressions AS SELECT impression_id, user_id, ad_id, CAST(shown_at AS TIMESTAMPTZ) AS shown_at "
        f"FROM read_csv('{data}/impressions/*.csv')"
    )
    con.execute(f"CREATE VIEW clicks AS SELECT * FROM read_parquet('{data}/clicks.parquet')")
    want = sorted(con.execute(sqlglot.transpile(sql, read="spark", write="duckdb")[0]).fetchall(), key=_row_order)
    assert len(want) > 1000 and any(row[3] is None for row in want)  # impressions without a click come out alone
    (tmp_path / "query.sql").write_text(sql)
    paths = [f"streams.impressions.path={data / 'impressions'}", f"streams.clicks.path={data / 'clicks.parquet'}"]
    for form, extra in (("toml", []), ("file", ["--set", 'query.sql=""', "--sql", str(tmp_path / "query.sql")])):
        out = tmp_path / form
        args = ["--config", str(example), *extra, "--set", f"output.path={out}", "--set", "output.progress=0"]
        args += ["--set", "metrics.endpoint=127.0.0.1:0", *(a for p in paths for a in ("--set", p))]
        proc = subprocess.run(mpirun_command(3, args), env=mpi_env(), capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr
        assert result_rows(out) == want, form


def test_a_replayed_range_of_a_querys_streams_equals_duckdb_running_the_query_on_that_range(tmp_path, spark):
    """control.replay of 10 s of trades and quotes with a query (a left join with a pair condition and filters):
    Spark selects each stream's rows of the range from its files, the cluster runs the config's query on them,
    and the results are DuckDB's rows of the same SQL over the rows of the range."""
    import pyarrow.compute as pc

    from control import replay

    tables = trades_quotes(tmp_path / "data", seed=21)
    sql = form("left")
    config = write_config(tmp_path, settings(tmp_path / "data", sql))
    start, end = T0 + 10_000_000, T0 + 20_000_000  # microseconds
    args = ["--config", str(config), "--from", str(start / 1e6), "--to", str(end / 1e6), "--speed", "4", "-n", "3"]
    assert replay.main(args, spark=spark) == 0
    ranged = {
        name: t.filter(
            pc.and_(pc.greater_equal(pc.cast(t[c], pa.int64()), start), pc.less(pc.cast(t[c], pa.int64()), end))
        )
        for (name, t), c in zip(tables.items(), ("exec_time", "quote_ts"))
    }
    want = duckdb_query(sql, ranged)
    assert len(want) > 100
    assert result_rows(tmp_path / "out") == want


def test_group_by_of_a_left_join_groups_as_sql_does_and_its_view_equals_duckdbs(tmp_path, spark):
    """GROUP BY over a left join with a pair condition and filters, windows on the trade's time: the `[aggregate]`
    of a left join (the query sets it), its groups the GROUP BY's alone (a trade without a qualifying quote and
    the pairs of its symbol in one group, as SQL has them, `avg` and `count(DISTINCT ...)` included); the
    merger's view and the batch view equal DuckDB's GROUP BY of the same query's rows by the same columns."""
    from tests.cluster.test_aggregate_streams import aggregated, assert_view_equals, run_and_merge

    tables = trades_quotes(tmp_path / "data", seed=17)
    window = "window(t.exec_time, '10 seconds')"
    on, where = f"{ON} AND t.qty >= 200", "WHERE t.qty >= 100"  # ON on the kept side: decides pairs only
    sql = (
        f"SELECT t.symbol, {window} AS w, count(*) AS n, sum(t.qty), max(q.bid), avg(q.bid), count(DISTINCT q.src) "
        f"FROM trades t LEFT JOIN quotes q ON {on} {where} GROUP BY t.symbol, {window}"
    )
    more = {"source.rate": 3000.0, "aggregate.flush_interval": 0.3}
    cfg, streamed, batched = run_and_merge(tmp_path, spark, settings(tmp_path / "data", sql, **more))
    assert cfg["join"]["type"] == "left" and cfg["aggregate"]["time"] == "trades_exec_time"
    import duckdb

    for name, table in tables.items():
        duckdb.register(name, table)
    columns = [f"{a}.{c} AS {n}_{c}" for a, n in (("t", "trades"), ("q", "quotes")) for c in tables[n].column_names]
    rows = f"SELECT {', '.join(columns)} FROM trades t LEFT JOIN quotes q ON {on} {where}"
    alone = duckdb.sql(f"SELECT count(*) FROM ({rows}) WHERE quotes_quote_id IS NULL").fetchall()[0][0]
    want = aggregated(rows, cfg)
    assert "kind" not in want.column_names and want.num_rows > 20 and alone > 20
    assert_view_equals(streamed, want, cfg)
    assert_view_equals(batched, want, cfg)
