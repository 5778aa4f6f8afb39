"""control.audit of a run of a query (control/audit_query.py): trades and quotes (tests/cluster/test_query.py's)
joined by a query with a pair condition and filters on both streams, in inner, left, full, semi and anti form, each
run audited exact by Spark SQL running the same query over the streams' on-time rows (also a GROUP BY query's
result rows and merged view); and result files tampered with -- a row removed, one written twice, one whose quote
fails the condition -- found, each named, exit 1."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from control import audit
from protocol.output import read_tables
from tests.cluster.test_query import ON, form, result_rows, settings, trades_quotes
from tests.reference import duckdb_query
from tests.runs import run_cluster, soak


def audited(spark, tmp_path, capsys, *more: str) -> tuple[int, dict, str]:
    """(exit code, report, printed) of the audit of the run in tmp_path."""
    code = audit.main(["--config", str(tmp_path / "run.toml"), *more], spark=spark)
    report = json.loads((tmp_path / "out" / "audit" / "audit-start-end.json").read_text())
    return code, report, capsys.readouterr().out


# full (rows alone on both sides) and semi in the suite; the left join is audited by the tests below
@pytest.mark.parametrize("name", ["full", "semi", soak("inner"), soak("left"), soak("anti")])
def test_each_join_form_of_a_query_is_audited_exact(spark, tmp_path, capsys, name):
    """Trades out of order by more than their max_delay: the run's rows equal DuckDB's for the same SQL over the
    rows not set aside as late (so the engine is right here), and the audit, recomputing them with Spark SQL from
    the streams' files after the filters and the lateness rule, finds them exact, every row once."""
    tables = trades_quotes(tmp_path / "data", seed=31)
    sql = form(name)
    run = run_cluster(tmp_path, 3, settings(tmp_path / "data", sql, **{"streams.trades.max_delay": "0.1s"}))
    assert run.returncode == 0, run.stderr
    late = read_tables(run.out / "late")
    on_time = {}
    for (stream, table), id_column in zip(tables.items(), ("trade_id", "quote_id")):
        gone = late.filter(pc.equal(late["stream"], stream))[f"{stream}_{id_column}"]
        on_time[stream] = table.filter(pc.invert(pc.is_in(table[id_column], gone.combine_chunks())))
    assert result_rows(run.out) == duckdb_query(sql, on_time)
    code, report, printed = audited(spark, tmp_path, capsys)
    assert code == audit.EXACT, printed
    assert printed.startswith("EXACT"), printed
    rows = sum(pq.read_metadata(f).num_rows for f in (run.out / "results").glob("*.parquet"))
    assert report["expected"] == report["found"] == rows > 50, report
    assert report["late_wrong"] == 0 and run.summary["late"] > 0  # trades out of order by more than 0.1 s
    # the input the audit read is what passed the filters: filtered rows are never read
    n = sum(t.num_rows for t in tables.values())
    assert report["input_tuples"] == n - sum(run.summary["filtered"].values())
    if name in ("left", "full"):  # rows alone among them, with nulls
        assert pc.sum(pc.is_null(pq.read_table(run.out / "results")["quote_id"])).as_py() > 0


def test_a_row_removed_one_written_twice_and_one_that_fails_the_condition_are_found_and_named(spark, tmp_path, capsys):
    """A left join's result file tampered with: its first row removed, its second written twice, and a pair
    written again with the quote's bid above the trade's price (q.bid <= t.price fails): 1 missing, 1 duplicate,
    1 extra, exit 1, each row named in the verdict and in the evidence file."""
    trades_quotes(tmp_path / "data", seed=33)
    run = run_cluster(tmp_path, 3, settings(tmp_path / "data", form("left")))
    assert run.returncode == 0, run.stderr
    first = sorted((run.out / "results").glob("*.parquet"))[0]
    t = pq.read_table(first)
    pair = t.filter(pc.is_valid(t["quote_id"])).slice(0, 1)
    bad = pair.set_column(t.column_names.index("bid"), "bid", pc.add(pair["price"], 1.0))
    pq.write_table(pa.concat_tables([t.slice(1), t.slice(1, 1), bad]), first)
    code, report, printed = audited(spark, tmp_path, capsys)
    assert code == audit.DIFFERENT, printed
    assert (report["missing"], report["duplicates"], report["extra"]) == (1, 1, 1), report
    assert "1 rows missing, 1 rows extra, 1 rows duplicates" in printed, printed
    named = lambda row: f"trade_id={row['trade_id']}, price={row['price']}, quote_id={row['quote_id']}"  # noqa: E731
    removed, twice, wrong = t.slice(0, 1).to_pylist()[0], t.slice(1, 1).to_pylist()[0], bad.to_pylist()[0]
    assert f"missing (1 expected, 0 found): {named(removed)}" in printed, printed
    assert f"duplicate (1 expected, 2 found): {named(twice)}" in printed, printed
    assert f"extra (0 expected, 1 found): {named(wrong)}, bid={wrong['bid']}" in printed, printed
    diff = pq.read_table(report["diff"])
    assert sorted(diff["problem"].to_pylist()) == ["duplicate", "extra", "missing"]
    assert diff.filter(pc.equal(diff["problem"], "extra"))["bid"].to_pylist() == [wrong["bid"]]


def test_a_group_by_query_is_audited_as_its_aggregation_its_results_and_its_view(spark, tmp_path, capsys):
    """GROUP BY with Spark's window over a left join with a pair condition and filters: the result files (every
    row, SELECT *'s layout with kind) audited exact against the query without its GROUP BY, and the merged view
    (--batch, groups split by kind) exact against the view of those rows (--view), as an [aggregate] run's are; a
    view with a count changed differs."""
    from control import aggregate

    trades_quotes(tmp_path / "data", seed=35)
    window = "window(t.exec_time, '10 seconds')"
    sql = (
        f"SELECT t.symbol, {window} AS w, count(*) AS n, sum(t.qty), max(q.bid) "
        f"FROM trades t LEFT JOIN quotes q ON {ON} WHERE t.qty >= 100 GROUP BY t.symbol, {window}"
    )
    run = run_cluster(tmp_path, 3, settings(tmp_path / "data", sql))
    assert run.returncode == 0, run.stderr
    code, report, printed = audited(spark, tmp_path, capsys)
    assert code == audit.EXACT and report["found"] > 50, printed
    config = ["--config", str(tmp_path / "run.toml")]
    assert aggregate.main([*config, "--batch"], spark=spark) == 0
    view = run.out / "view-batch"
    assert audit.main([*config, "--view", str(view)], spark=spark) == audit.EXACT
    assert "EXACT: view" in capsys.readouterr().out
    (part,) = [f for f in view.glob("*.parquet")]
    v = pq.read_table(part)
    counts = v["count"].to_pylist()
    counts[0] += 1
    pq.write_table(v.set_column(v.column_names.index("count"), "count", pa.array(counts, v["count"].type)), part)
    assert audit.main([*config, "--view", str(view)], spark=spark) == audit.DIFFERENT
    assert "1 measures different" in capsys.readouterr().out
