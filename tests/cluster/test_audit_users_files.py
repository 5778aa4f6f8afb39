"""Users' own files through every Spark tool: trades as CSV (ISO-8601 text at +02:00, decimal prices, an id) and
quotes as Parquet written by pyarrow (`timestamp[ns, UTC]`, no id column: rows named by their place, over two
files of several row groups), keyed by (symbol, venue), quotes from 2 s before a trade up to it.

One cluster run; the reference is DuckDB's join of the rows as Python reads them (`datetime.fromisoformat` for the
text, nanoseconds rounded half to even in numpy), nothing of the engine or of Spark.  The audit is exact, the
replay of a range equals the reference join of that range, the aggregation's counts and extremes equal DuckDB's;
a result row removed and one whose quote is changed are found; a file the audit cannot read and a refusal exit
with the audit's own code, never 1.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from control import aggregate, audit, replay
from protocol.lifetime import NOT_AUDITED
from tests.runs import run_cluster, write_config

T0 = 1_772_461_920  #: 2026-03-02 14:32:00 UTC
SYMBOLS, VENUES = ["AAPL", "MSFT", "GOOG"], ["XNAS", "ARCX"]
LOWER, UPPER = -2_000_000, 0  #: microseconds: lower <= quote - trade <= upper


def make_data(folder) -> tuple[pa.Table, pa.Table]:
    """The files, and the rows as the reference reads them: trades (trade_id, symbol, venue, t: microseconds)
    and quotes (row: its place over both files, symbol, venue, t)."""
    rng = np.random.default_rng(51)
    n = 240
    t_us = T0 * 10**6 + np.sort(rng.integers(0, 120 * 10**6, n))
    sym, ven = rng.choice(SYMBOLS, n), rng.choice(VENUES, n)
    zone = timezone(timedelta(hours=2))
    lines = ["trade_id,symbol,venue,traded_at,price"]
    for i in range(n):
        at = datetime.fromtimestamp(int(t_us[i]) // 10**6, zone).strftime("%Y-%m-%dT%H:%M:%S")
        price = f"{rng.integers(10**5, 10**6)}.{i % 10}25"
        lines.append(f"{7000 + i},{sym[i]},{ven[i]},{at}.{int(t_us[i]) % 10**6:06d}+02:00,{price}")
    (folder / "trades.csv").write_text("\n".join(lines) + "\n")
    text = [line.split(",")[3] for line in lines[1:]]
    trades = pa.table(
        {
            "trade_id": np.arange(7000, 7000 + n),
            "symbol": sym,
            "venue": ven,
            "t": [round(datetime.fromisoformat(x).timestamp() * 10**6) for x in text],
        }
    )
    assert trades["t"].to_pylist() == t_us.tolist()  # the reference's own reading of the text
    # quotes: random ones, and around some trades one exactly 2 s before after rounding (-400 ns), one a
    # microsecond more (-600 ns), one at the trade itself (+500 ns: a tie, to the even microsecond)
    m = 500
    q_ns = T0 * 10**9 + rng.integers(0, 120 * 10**9, m)
    q_sym, q_ven = rng.choice(SYMBOLS, m), rng.choice(VENUES, m)
    edge = np.arange(0, n, 20)
    base = t_us[edge] * 1000
    q_ns = np.concatenate([q_ns, base - 2 * 10**9 - 400, base - 2 * 10**9 - 600, base + 500 + (t_us[edge] % 2) * 1000])
    q_sym, q_ven = np.concatenate([q_sym, *[sym[edge]] * 3]), np.concatenate([q_ven, *[ven[edge]] * 3])
    order = np.argsort(q_ns, kind="stable")
    q_ns, q_sym, q_ven = q_ns[order], q_sym[order], q_ven[order]
    bid = np.round(rng.uniform(10, 20, len(q_ns)), 4)
    quotes_dir = folder / "quotes"
    quotes_dir.mkdir()
    half = len(q_ns) // 2
    for name, part in (("part-0.parquet", slice(0, half)), ("part-1.parquet", slice(half, None))):
        table = pa.table(
            {
                "symbol": q_sym[part],
                "venue": q_ven[part],
                "quote_ts": pa.array(q_ns[part], pa.timestamp("ns", "UTC")),
                "bid": bid[part],
            }
        )
        pq.write_table(table, quotes_dir / name, row_group_size=64)
    q, r = np.divmod(q_ns, 1000)
    q_us = q + ((r > 500) | ((r == 500) & (q % 2 == 1)))  # half to even
    quotes = pa.table({"row": np.arange(len(q_ns)), "symbol": q_sym, "venue": q_ven, "t": q_us, "bid": bid})
    return trades, quotes


def reference(trades: pa.Table, quotes: pa.Table, lo: int | None = None, hi: int | None = None) -> set:
    """DuckDB's join: (trade_id, quote row) of the rows whose time lies in [lo, hi) microseconds (all: None)."""
    where = "" if lo is None else f"WHERE t >= {lo} AND t < {hi}"
    sql = f"""
        WITH tr AS (SELECT * FROM trades {where}), qu AS (SELECT * FROM quotes {where})
        SELECT tr.trade_id, qu.row FROM tr JOIN qu ON tr.symbol = qu.symbol AND tr.venue = qu.venue
        AND qu.t - tr.t BETWEEN {LOWER} AND {UPPER}"""
    return set(duckdb.connect().sql(sql).fetchall())


def found(out) -> set:
    t = pa.concat_tables([pq.read_table(f) for f in sorted((out / "results").glob("*.parquet"))])
    return set(zip(t["trades_trade_id"].to_pylist(), t["quotes_row"].to_pylist()))


@pytest.fixture(scope="module")
def market(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("market")
    trades, quotes = make_data(tmp)
    settings = {
        "streams.trades.path": str(tmp / "trades.csv"),
        "streams.trades.key": ["symbol", "venue"],
        "streams.trades.time": "traded_at",
        "streams.trades.id": "trade_id",
        "streams.quotes.path": str(tmp / "quotes"),
        "streams.quotes.key": ["symbol", "venue"],
        "streams.quotes.time": "quote_ts",
        "join.lower": "-2s",
        "join.upper": "0s",
        "join.max_delay": "1s",
    }
    run = run_cluster(tmp, 3, settings)
    assert run.returncode == 0, run.stderr
    return tmp, run, trades, quotes


def test_nanosecond_quotes_without_ids_are_joined_audited_replayed_and_aggregated_exactly(spark, market, capsys):
    tmp, run, trades, quotes = market
    want = reference(trades, quotes)
    assert found(run.out) == want and len(want) > 100
    q, when = quotes.to_pydict(), dict(zip(trades["trade_id"].to_pylist(), trades["t"].to_pylist()))
    apart = {q["t"][row] - when[trade] for trade, row in want}
    assert {LOWER, UPPER} <= apart  # the bounds met exactly, after rounding nanoseconds
    config = ["--config", str(tmp / "run.toml")]

    assert audit.main(config, spark=spark) == audit.EXACT
    report = json.loads((run.out / "audit" / "audit-start-end.json").read_text())
    assert report["expected"] == report["found"] == len(want) and report["payload_wrong"] == 0, report

    lo, hi = T0 + 30, T0 + 70
    replayed = tmp / "replayed"
    args = [
        "--from",
        str(lo),
        "--to",
        str(hi),
        "--speed",
        "20",
        "-n",
        "3",
        "--set",
        f"output.path={json.dumps(str(replayed))}",
    ]
    assert replay.main([*config, *args], spark=spark) == 0
    printed = capsys.readouterr().out
    assert f"time {T0 + 30}." in printed and "e+09" not in printed, printed
    assert pq.read_schema(replayed / "replay" / "quotes.parquet").field("quote_ts").type == pa.timestamp("ns", "UTC")
    kept = [r for r, t in zip(q["row"], q["t"]) if lo * 10**6 <= t < hi * 10**6]  # a replayed row's original row
    pairs = {(trade, kept[row]) for trade, row in found(replayed)}
    assert pairs == reference(trades, quotes, lo * 10**6, hi * 10**6) and pairs

    sets = ['aggregate.group_by=["trades_symbol"]', 'aggregate.measures=["count", "max(quotes_bid)"]']
    assert aggregate.main([*config, "--batch", *(x for s in sets for x in ("--set", s))], spark=spark) == 0
    view = aggregate.read_view(run.out / "view-batch").to_pydict()
    joined = pa.table({"trade_id": [p[0] for p in want], "row": [p[1] for p in want]})  # noqa: F841 -- DuckDB's
    expected = (
        duckdb.connect()
        .sql(
            "SELECT t.symbol, count(*), max(q.bid) FROM joined p JOIN trades t USING (trade_id) "
            "JOIN quotes q USING (row) GROUP BY t.symbol"
        )
        .fetchall()
    )
    got = set(zip(view["trades_symbol"], view["count"], view["max_quotes_bid"]))
    assert got == set(expected)

    # a result row removed, one whose quote is another row, one whose bid is changed: found, exit 1
    first = sorted((run.out / "results").glob("*.parquet"))[0]
    t = pq.read_table(first)
    rows, bids = t["quotes_row"].to_pylist(), t["quotes_bid"].to_pylist()
    gone = (t["trades_trade_id"][0].as_py(), rows[0])
    rows[1] += 1
    bids[2] += 1.0
    t = t.set_column(t.column_names.index("quotes_row"), "quotes_row", pa.array(rows, pa.int64()))
    t = t.set_column(t.column_names.index("quotes_bid"), "quotes_bid", pa.array(bids))
    pq.write_table(t.slice(1), first)
    assert audit.main(config, spark=spark) == audit.DIFFERENT
    planted = json.loads((run.out / "audit" / "audit-start-end.json").read_text())
    assert (planted["missing"], planted["extra"]) == (2, 1), planted
    assert planted["payload_wrong"] >= 2, planted  # the changed bid; the other row's own columns
    diff = pq.read_table(planted["diff"])
    missing = diff.filter(pc.equal(diff["problem"], "missing"))
    assert gone in set(zip(missing["r_id"].to_pylist(), missing["s_id"].to_pylist()))
    assert any("quotes.bid is" in r for r in diff["reason"].to_pylist() if r)

    # no verdict: never 1
    capsys.readouterr()
    assert audit.main([*config, "--sample", "0.5"], spark=spark) == NOT_AUDITED
    assert "could not audit: not audited yet: --sample" in capsys.readouterr().err
    first.write_bytes(b"not a Parquet file")
    assert audit.main(config, spark=spark) == NOT_AUDITED
    assert "error: could not audit:" in capsys.readouterr().err


def test_the_audit_of_a_missing_input_exits_with_its_own_code(tmp_path, capsys):
    cfg = write_config(tmp_path, {"source.kind": "file", "source.path": str(tmp_path / "gone.parquet")})
    (tmp_path / "out").mkdir()
    from protocol.config import load_config

    (tmp_path / "out" / "summary.json").write_text(json.dumps({"config": load_config(cfg)}))
    assert audit.main(["--config", str(cfg)]) == NOT_AUDITED
    assert "gone.parquet' does not exist" in capsys.readouterr().err
