"""Tests of deploy/bench.py's pure helpers (no cluster runs, no speed assertions)."""
from __future__ import annotations

import argparse
import math

import pytest

from deploy.bench import aggregate, fmt, keep_up, md_table, median, parse_slaves, run_numbers, summary_table


def test_parse_slaves():
    assert parse_slaves("1,2,4") == [1, 2, 4]
    assert parse_slaves("3") == [3]
    assert parse_slaves("2, 8,") == [2, 8]
    for bad in ("", "0,1", "a,b", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_slaves(bad)


def test_median_skips_missing_runs():
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4, 1, 3, 2]) == 2.5
    assert median([1.0, None, float("nan"), 5.0]) == 3.0
    assert median([None, float("nan")]) is None
    assert median([]) is None


def test_keep_up():
    on_time = keep_up(tuples=100_000, wall=1.05, rate=100_000)
    assert on_time["kept_up"] and on_time["ratio"] == pytest.approx(0.952, abs=1e-3)
    assert on_time["lag_seconds"] == pytest.approx(0.05)
    # a short run: 73% of the rate, but only the 0.5 s drain behind schedule
    short = keep_up(tuples=100_000, wall=1.5, rate=100_000)
    assert short["kept_up"] and short["ratio"] < 0.9
    behind = keep_up(tuples=1_000_000, wall=20.0, rate=100_000)
    assert not behind["kept_up"]
    assert behind["achieved_rate"] == 50_000 and behind["lag_seconds"] == 10.0


def test_fmt_and_md_table():
    assert fmt(1234567.8) == "1,234,568"
    assert fmt(0.12345, ".3f") == "0.123"
    assert fmt(None) == "-" and fmt(float("nan"), ".3f") == "-"
    lines = md_table(["a", "long header"], [["12345", "x"], ["1", "yy"]]).splitlines()
    assert lines == ["| a     | long header |",
                     "|-------|-------------|",
                     "| 12345 | x           |",
                     "| 1     | yy          |"]


def summary(throughput, p50, wt=10, wb=640):
    return {"input_total": 1000, "late": 0, "results": 50, "wall_seconds": 2.0, "throughput_tuples_per_s": throughput,
            "delay_seconds": {"p50": p50, "p95": 0.2, "p99": 0.3, "max": 0.25, "note": "..."},
            "slaves": {"1": {"tuples_processed": 1000, "window_tuples": wt, "window_bytes": wb,
                             "busy_seconds": 0.5, "results": 50, "epochs": 3, "result_files": 1}},
            "config": {"big": "dropped"}}


def test_run_numbers_and_aggregate():
    r = run_numbers(summary(500.0, 0.1))
    assert r["throughput"] == 500.0 and r["delay_p50"] == 0.1 and r["window_bytes_per_tuple"] == 64.0
    assert "config" not in r and r["slaves"]["1"] == {"tuples_processed": 1000, "window_tuples": 10,
                                                      "window_bytes": 640, "busy_seconds": 0.5}
    empty = run_numbers(summary(500.0, float("nan"), wt=0, wb=0))
    assert empty["delay_p50"] is None and empty["window_bytes_per_tuple"] is None
    runs = [run_numbers(summary(1.0, p)) for p in (0.3, 0.1, float("nan"))]
    agg = aggregate(runs)
    assert agg["delay_p50"] == pytest.approx(0.2) and agg["delay_p99"] == 0.3


def test_summary_table_lists_medians_and_every_repeat():
    cap = [dict(run_numbers(summary(t, 0.5)), peak_rss_mb=100.0) for t in (100_000.0, 300_000.0, 200_000.0)]
    half = [dict(run_numbers(summary(100_000.0, 0.05)), peak_rss_mb=120.0, rate=100_000,
                 **keep_up(1000, 2.0, 100 if i else 100_000)) for i in range(3)]  # the first fell behind
    point = {"slaves": 2, "ranks": 3, "capacity": {"median": median(r["throughput"] for r in cap), **aggregate(cap),
                                                   "runs": cap},
             "half_load": {"rate": 100_000, **aggregate(half), "runs": half}}
    header, rule, row = summary_table([point]).splitlines()
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == len(header.strip("|").split("|"))
    assert cells[:3] == ["2", "200,000", "100,000 300,000 200,000"]
    assert cells[3] == "0.500 / 0.300" and cells[4] == "100,000" and cells[5] == "0.050"
    assert cells[-2] == "2/3" and cells[-1] == "120"
    assert not math.isnan(point["capacity"]["median"])
