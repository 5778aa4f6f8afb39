"""Typed CSV columns (`streams.NAME.schema` and `time_format` on a stream of CSV files): decimal text stays an exact
decimal through the results, the run's aggregation, the audit, the replay and the Kafka sink's record values.

Trades are CSV with prices as decimal text (up to 12 digits, 4 decimals: sums of them are not exact in float64)
and times written "%d/%m/%Y %H:%M:%S"; quotes are CSV with ISO-8601 text and decimal bids.  The reference is
DuckDB's join and GROUP BY of the rows as Python reads them (`Decimal`, `datetime.strptime`), nothing of the
engine, pyarrow's CSV reader or Spark.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from decimal import Decimal

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.chunks import InputError
from control import aggregate, audit, replay
from master.sources import open_source
from protocol.config import ConfigError, load_config
from protocol.plan import compile_plan
from protocol.kafka_sink import json_text
from tests.runs import ENDED_IDLE, run_cluster, toml_value

T0 = 1_772_461_920  #: 2026-03-02 14:32:00 UTC
SYMBOLS = ["AAPL", "MSFT", "GOOG"]
LOWER, UPPER = -2_000_000, 0  #: microseconds: lower <= quote - trade <= upper
TRADES = {"price": "decimal128(12, 4)", "traded_at": "timestamp[s]", "qty": "int32"}
WRITTEN = "%d/%m/%Y %H:%M:%S"


def make_data(folder) -> tuple[pa.Table, pa.Table]:
    """trades.csv and quotes.csv, and their rows as the reference reads them: trades (trade_id, symbol, t:
    microseconds, price: Decimal) and quotes (row, symbol, t, bid: Decimal)."""
    rng = np.random.default_rng(4)
    n, m = 180, 360
    t = T0 + np.sort(rng.integers(0, 90, n))
    sym = rng.choice(SYMBOLS, n)
    prices = [f"{rng.integers(0, 10**8)}.{rng.integers(0, 10**4):04d}".rstrip("0").rstrip(".") for _ in range(n)]
    prices[:3] = ["99999999.9999", "0.0001", "12345678.1"]
    lines = ["trade_id,symbol,traded_at,price,qty"]
    for i in range(n):
        at = datetime.fromtimestamp(int(t[i]), timezone.utc).strftime(WRITTEN)
        lines.append(f"{500 + i},{sym[i]},{at},{prices[i]},{rng.integers(1, 1000)}")
    (folder / "trades.csv").write_text("\n".join(lines) + "\n")
    stamps = [datetime.strptime(line.split(",")[2], WRITTEN).replace(tzinfo=timezone.utc) for line in lines[1:]]
    trades = pa.table(
        {
            "trade_id": np.arange(500, 500 + n),
            "symbol": sym,
            "t": [int(s.timestamp()) * 10**6 for s in stamps],
            "price": pa.array([Decimal(p) for p in prices], pa.decimal128(12, 4)),
        }
    )
    q = T0 + np.sort(rng.integers(-2, 90, m))
    q_sym = rng.choice(SYMBOLS, m)
    bids = [f"{rng.integers(10, 500)}.{rng.integers(0, 10**4):04d}" for _ in range(m)]
    quote_lines = ["symbol,quote_ts,bid"] + [
        f"{q_sym[i]},{datetime.fromtimestamp(int(q[i]), timezone.utc).isoformat()},{bids[i]}" for i in range(m)
    ]
    (folder / "quotes.csv").write_text("\n".join(quote_lines) + "\n")
    quotes = pa.table(
        {
            "row": np.arange(m),
            "symbol": q_sym,
            "t": [int(datetime.fromisoformat(x.split(",")[1]).timestamp()) * 10**6 for x in quote_lines[1:]],
            "bid": pa.array([Decimal(b) for b in bids], pa.decimal128(10, 4)),
        }
    )
    return trades, quotes


def reference(trades: pa.Table, quotes: pa.Table, lo: int | None = None, hi: int | None = None) -> set:
    """DuckDB's join: (trade_id, quote row, price, bid) of the rows whose time lies in [lo, hi) microseconds."""
    where = "" if lo is None else f"WHERE t >= {lo} AND t < {hi}"
    sql = f"""
        WITH tr AS (SELECT * FROM trades {where}), qu AS (SELECT * FROM quotes {where})
        SELECT tr.trade_id, qu.row, tr.price, qu.bid FROM tr JOIN qu ON tr.symbol = qu.symbol
        AND qu.t - tr.t BETWEEN {LOWER} AND {UPPER}"""
    return set(duckdb.connect().sql(sql).fetchall())


def results(out) -> pa.Table:
    return pa.concat_tables([pq.read_table(f) for f in sorted((out / "results").glob("*.parquet"))])


def found(t: pa.Table) -> set:
    cols = ("trades_trade_id", "quotes_row", "trades_price", "quotes_bid")
    return set(zip(*(t[c].to_pylist() for c in cols)))


def settings_of(tmp) -> dict:
    return {
        "streams.trades.path": str(tmp / "trades.csv"),
        "streams.trades.key": "symbol",
        "streams.trades.time": "traded_at",
        "streams.trades.id": "trade_id",
        "streams.trades.schema": TRADES,
        "streams.trades.time_format": WRITTEN,
        "streams.quotes.path": str(tmp / "quotes.csv"),
        "streams.quotes.key": "symbol",
        "streams.quotes.time": "quote_ts",
        "streams.quotes.schema": {"bid": "decimal128(10, 4)"},
        "join.lower": "-2s",
        "join.upper": "0s",
        "join.max_delay": "1s",
        "aggregate.enabled": True,
        "aggregate.group_by": ["trades_symbol"],
        "aggregate.measures": ["count", "min(trades_price)", "sum(trades_price)", "max(quotes_bid)"],
        "aggregate.flush_interval": 0.3,
    }


@pytest.fixture(scope="module")
def market(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("typed")
    trades, quotes = make_data(tmp)
    run = run_cluster(tmp, 3, settings_of(tmp))
    assert run.returncode == 0, run.stderr
    return tmp, run, trades, quotes


def test_decimal_text_stays_exact_through_results_aggregation_audit_replay_and_sink(spark, market, capsys):
    tmp, run, trades, quotes = market
    t = results(run.out)
    assert t.schema.field("trades_price").type == pa.decimal128(12, 4)
    assert t.schema.field("quotes_bid").type == pa.decimal128(10, 4)
    assert t.schema.field("trades_qty").type == pa.int32()
    assert t.schema.field("trades_traded_at").type == pa.timestamp("us")  # declared without a zone
    want = reference(trades, quotes)
    assert found(t) == want and len(want) > 300
    assert Decimal("99999999.9999") in {p for _, _, p, _ in want}  # 12 digits: not a float64's on the way

    # the sink's record values: the decimals' digits as written, to the declared scale
    text = json_text(t["trades_price"].combine_chunks()).to_pylist()
    assert text == [format(p, "f") for p in t["trades_price"].to_pylist()]
    assert all(len(x.split(".")[1]) == 4 for x in text)

    # the run's partial aggregates merged: decimals, equal to DuckDB's over the reference join
    config = ["--config", str(tmp / "run.toml")]
    assert aggregate.main([*config, "--until-idle", str(ENDED_IDLE)], spark=spark) == 0
    view = aggregate.read_view(run.out / "view")
    assert view.schema.field("min_trades_price").type == pa.decimal128(12, 4)
    assert pa.types.is_decimal(view.schema.field("sum_trades_price").type)
    assert view.schema.field("max_quotes_bid").type == pa.decimal128(10, 4)
    pairs = pa.table({k: [p[i] for p in want] for i, k in enumerate(["trade_id", "row"])})  # noqa: F841 -- DuckDB's
    expected = (
        duckdb.connect()
        .sql(
            "SELECT t.symbol, count(*), min(t.price), sum(t.price), max(q.bid) FROM pairs p "
            "JOIN trades t USING (trade_id) JOIN quotes q USING (row) GROUP BY t.symbol"
        )
        .fetchall()
    )
    v = view.to_pydict()
    cols = ("trades_symbol", "count", "min_trades_price", "sum_trades_price", "max_quotes_bid")
    assert set(zip(*(v[c] for c in cols))) == set(expected)
    total = sum(float(p) for _, _, p, _ in want)
    assert sum(s for _, _, _, s, _ in expected) != Decimal(repr(total))  # float64 would not have it exactly

    # the audit reads the declared types too: exact; then a price lowered by 0.0001 is found
    assert audit.main(config, spark=spark) == audit.EXACT
    report = json.loads((run.out / "audit" / "audit-start-end.json").read_text())
    assert report["expected"] == report["found"] == len(want) and report["payload_wrong"] == 0, report

    lo, hi = T0 + 20, T0 + 50
    replayed = tmp / "replayed"
    args = ["--from", str(lo), "--to", str(hi), "-n", "3", "--set", f"output.path={json.dumps(str(replayed))}"]
    assert replay.main([*config, *args], spark=spark) == 0
    assert (replayed / "replay" / "trades.csv").read_text().splitlines()[1].split(",")[2].count("/") == 2  # as written
    kept = [r for r, x in zip(quotes["row"].to_pylist(), quotes["t"].to_pylist()) if lo * 10**6 <= x < hi * 10**6]
    again = {(tr, kept[row], p, b) for tr, row, p, b in found(results(replayed))}
    assert again == reference(trades, quotes, lo * 10**6, hi * 10**6) and again

    first = sorted((run.out / "results").glob("*.parquet"))[0]
    part = pq.read_table(first)
    prices = part["trades_price"].to_pylist()
    prices[0] -= Decimal("0.0001")
    at = part.column_names.index("trades_price")
    pq.write_table(part.set_column(at, "trades_price", pa.array(prices, pa.decimal128(12, 4))), first)
    capsys.readouterr()
    assert audit.main(config, spark=spark) == audit.DIFFERENT
    planted = json.loads((run.out / "audit" / "audit-start-end.json").read_text())
    assert planted["payload_wrong"] == 1 and planted["missing"] == planted["extra"] == 0, planted
    diff = pq.read_table(planted["diff"])
    reasons = [r for r in diff["reason"].to_pylist() if r]
    assert any(f"trades.price is {prices[0]} where its row has {prices[0] + Decimal('0.0001')}" in r for r in reasons)


def streams(tmp, trades: dict, quotes: dict | None = None) -> dict:
    """A config of trades.csv and quotes.csv in `tmp` with these `[streams.trades]` (and quotes) settings."""
    text = ""
    for name, spec in (("trades", trades), ("quotes", quotes or {})):
        base = {"path": str(tmp / f"{name}.csv"), "key": "symbol", "time": "quote_ts" if name == "quotes" else "t"}
        text += f"[streams.{name}]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in (base | spec).items())
    (tmp / "typed.toml").write_text(text + f'[output]\npath = "{tmp / "out"}"\n')
    return load_config(tmp / "typed.toml")


@pytest.mark.parametrize(
    "trades, error, words",
    [
        ({"schema": {"price": "decimal(12, 4)"}}, None, ""),
        ({"schema": {"price": "money"}}, ConfigError, "streams.trades.schema: price: 'money' is not an Arrow type"),
        ({"schema": {"price": "list<int32>"}}, ConfigError, "price: a CSV cell cannot hold a list<int32>"),
        ({"schema": {"symbol": "double"}}, ConfigError, "schema: column symbol of type double, expected an integer"),
        ({"schema": {"prize": "decimal128(12, 4)"}}, InputError, "trades.csv' lacks column(s) prize"),
        ({"schema": {"price": "decimal128(12, 2)"}}, InputError, "its row 2: column price holds '1.005', not decimal"),
        ({"schema": {"qty": "int8"}}, InputError, "its row 3: column qty holds '300', not int8"),
        (
            {"schema": {"t": "timestamp[s]"}, "time_format": "%d/%m/%Y"},
            InputError,
            "its row 1: column t holds '2026-03-02 14:32:00', not timestamp[s] written as '%d/%m/%Y'",
        ),
        ({"time_format": "%d/%m/%Y"}, ConfigError, "time_format: the format of the columns `schema` declares as"),
        ({"time_format": ["%d", ""]}, ConfigError, "time_format: expected a strptime format or a list of them"),
    ],
)
def test_declared_csv_types_refused_before_the_run_name_the_key_or_the_cell(tmp_path, trades, error, words):
    (tmp_path / "trades.csv").write_text(
        "symbol,t,price,qty\nA,2026-03-02 14:32:00,1.5,7\nA,2026-03-02 14:32:01,1.005,9\nB,2026-03-02 14:32:02,2,300\n"
    )
    (tmp_path / "quotes.csv").write_text("symbol,quote_ts\nA,2026-03-02T14:32:00Z\n")
    if error is None:
        src = open_source(compile_plan(streams(tmp_path, trades)))
        while src.next_chunk(100) is not None:  # read to the end: the rows read as declared
            pass
        return
    with pytest.raises(error) as err:
        open_source(compile_plan(streams(tmp_path, trades)))
    assert words in str(err.value), str(err.value)


def test_declared_types_for_files_that_carry_their_own_are_refused(tmp_path):
    (tmp_path / "trades.csv").write_text("symbol,t\nA,2026-03-02T14:32:00Z\n")
    pq.write_table(pa.table({"symbol": ["A"], "quote_ts": pa.array([T0], pa.timestamp("s"))}), tmp_path / "q.parquet")
    cfg = streams(tmp_path, {}, {"path": str(tmp_path / "q.parquet"), "schema": {"quote_ts": "timestamp[ms]"}})
    with pytest.raises(ConfigError, match="streams.quotes.schema: declares the types of CSV columns, but input file"):
        open_source(compile_plan(cfg))
    with pytest.raises(ConfigError, match=r"streams.trades.time_format: only for a stream of CSV files"):
        load_config(
            tmp_path / "typed.toml",
            [
                "streams.trades.path=",
                'streams.trades.endpoint="tcp://127.0.0.1:5999"',
                'streams.trades.schema={symbol = "string", t = "timestamp[ms]"}',
                'streams.trades.time_format="%Y"',
            ],
        )
