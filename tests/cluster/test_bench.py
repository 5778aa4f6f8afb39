"""Tests of the bench package's helpers and report writing, and a few small real runs (no speed assertions)."""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import replace

import numpy as np
import pytest

import bench.report
import bench.search
import bench.tables
from bench.__main__ import parse_slaves
from bench.cluster import aggregate, planned_runs, run_numbers
from bench.report import caveats
from bench.search import bracket, keep_up, median, next_rate, search_verdict, sustained_rate
from bench.tables import count, fmt, krate, md_table, summary_table, trail_text
from protocol.plan import load_plan


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


def test_keep_up_is_decided_by_the_masters_pacing_lag():
    on_time = keep_up(tuples=100_000, wall=1.05, rate=100_000, pacing_lag=0.01, backlog=0.0)
    assert on_time["kept_up"] and on_time["ratio"] == pytest.approx(0.952, abs=1e-3)
    assert on_time["lag_seconds"] == pytest.approx(0.01)
    # a short run whose wall time is mostly start-up and drain still kept up if ingest never lagged
    short = keep_up(tuples=100_000, wall=1.5, rate=100_000, pacing_lag=0.02, backlog=0.0)
    assert short["kept_up"] and short["ratio"] < 0.9
    # ... and a run that finished near its schedule but whose ingest fell behind on the way did not
    lagging = keep_up(tuples=100_000, wall=1.05, rate=100_000, pacing_lag=bench.search.KEEP_UP_LAG + 0.01, backlog=0.0)
    assert not lagging["kept_up"]
    behind = keep_up(tuples=1_000_000, wall=20.0, rate=100_000, pacing_lag=9.5, backlog=0.0)
    assert not behind["kept_up"] and behind["achieved_rate"] == 50_000


def test_keep_up_also_counts_the_backlog_in_the_masters_buffers():
    # ingest kept pace (the mini-buffers had room) but tuples waited 0.3 s past their slot: behind all the same
    held = keep_up(tuples=12_000_000, wall=1.6, rate=10_000_000, pacing_lag=0.02, backlog=0.3)
    assert not held["kept_up"] and held["lag_seconds"] == 0.3 and held["lag_bound"] == 0.12
    assert keep_up(tuples=12_000_000, wall=1.6, rate=10_000_000, pacing_lag=0.02, backlog=0.005)["kept_up"]


def test_keep_up_bound_shrinks_with_a_short_input():
    # 12M tuples paced at 7M/s are 1.7 s of input: a cluster ingesting 5.9M/s ends 0.33 s behind, within the
    # fixed 0.5 s; the bound is 10% of the input's length, 0.17 s
    assert keep_up(tuples=12_000_000, wall=2.3, rate=7_000_000, pacing_lag=0.33, backlog=0.0) == {
        "achieved_rate": pytest.approx(5_217_391.3),
        "ratio": 0.745,
        "lag_seconds": 0.33,
        "lag_bound": 0.171,
        "kept_up": False,
    }
    assert keep_up(tuples=12_000_000, wall=2.3, rate=6_000_000, pacing_lag=0.15, backlog=0.0)["kept_up"]
    # a long input keeps the fixed bound
    long = keep_up(tuples=12_000_000, wall=20.0, rate=600_000, pacing_lag=0.45, backlog=0.0)
    assert long["lag_bound"] == bench.search.KEEP_UP_LAG and long["kept_up"]


def test_fmt_and_md_table():
    assert fmt(1234567.8) == "1,234,568"
    assert fmt(0.12345, ".3f") == "0.123"
    assert fmt(None) == "-" and fmt(float("nan"), ".3f") == "-"
    lines = md_table(["a", "long header"], [["12345", "x"], ["1", "yy"]]).splitlines()
    assert lines == [
        "| a     | long header |",
        "|-------|-------------|",
        "| 12345 | x           |",
        "| 1     | yy          |",
    ]


def summary(throughput, p50, wt=10, wb=640, p95=0.2, comm=0.1):
    return {
        "input_total": 1000,
        "late": 0,
        "results": 50,
        "wall_seconds": 2.0,
        "throughput_tuples_per_s": throughput,
        "delay_seconds": {"p50": p50, "p95": p95, "p99": 0.3, "max": 0.25, "note": "..."},
        "slaves": {
            "1": {
                "tuples_processed": 1000,
                "window_tuples": wt,
                "window_bytes": wb,
                "busy_seconds": 0.5,
                "results": 50,
                "epochs": 3,
                "result_files": 1,
                "comm_seconds": comm,
                "peak_rss_bytes": 100 * 2**20,
                "cpu_seconds": 1.0,
            }
        },
        "master_peak_rss_bytes": 300 * 2**20,
        "config": {"big": "dropped"},
        "process_seconds": 3.5,
        "startup": {"first_tuple_seconds": 1.25, "pss_before_data_bytes": {"0": 90 * 2**20, "1": 80 * 2**20}},
    }


def test_run_numbers_and_aggregate():
    r = run_numbers(summary(500.0, 0.1))
    assert r["throughput"] == 500.0 and r["delay_p50"] == 0.1 and r["window_bytes_per_tuple"] == 64.0
    assert "config" not in r and r["slaves"]["1"] == {
        "tuples_processed": 1000,
        "window_tuples": 10,
        "window_bytes": 640,
        "busy_seconds": 0.5,
        "comm_seconds": 0.1,
    }
    assert r["rank_rss_mb"] == {"0": 300.0, "1": 100.0}
    assert (r["first_tuple_seconds"], r["process_seconds"], r["pss_mb"]) == (1.25, 3.5, 170.0)
    empty = run_numbers(summary(500.0, float("nan"), wt=0, wb=0))
    assert empty["delay_p50"] is None and empty["window_bytes_per_tuple"] is None
    runs = [run_numbers(summary(1.0, p)) for p in (0.3, 0.1, float("nan"))]
    agg = aggregate(runs)
    assert agg["delay_p50"] == pytest.approx(0.2) and agg["delay_p99"] == 0.3
    exact = run_numbers({**summary(500.0, 0.1), "delay_exact": {"p50": 0.093, "p95": 0.18, "p99": 0.27}})
    assert (exact["delay_p50"], exact["delay_p95"], exact["delay_p99"], exact["delay_max"]) == (0.093, 0.18, 0.27, 0.25)


# --------------------------------------------------------------------------- the search for the sustained rate


def test_a_run_shorter_than_ten_seconds_of_input_cannot_pass():
    from bench.search import MIN_INPUT_SECONDS, counted_verdict, input_verdict

    assert MIN_INPUT_SECONDS == 10.0
    # 12M tuples at 9.3M/s are 1.3 s of input; it kept up with a bounded delay, and still cannot count
    short = {"kept_up": True, "delay_p95": 0.4, **input_verdict(12_000_000, 9_300_000)}
    assert short["input_seconds"] == 1.29 and not short["long_enough"]
    assert search_verdict(short, 1.5) == (True, "pass")
    assert counted_verdict(short, 1.5) == (False, "too short to count (1.3 s of input < 10 s)")
    behind = {**short, "kept_up": False}
    assert counted_verdict(behind, 1.5) == (False, "fell behind; too short to count (1.3 s of input < 10 s)")
    long = {"kept_up": True, "delay_p95": 0.4, **input_verdict(93_000_000, 9_300_000)}  # exactly 10 s counts
    assert long["long_enough"] and counted_verdict(long, 1.5) == (True, "pass")
    assert counted_verdict({**long, "delay_p95": 2.0}, 1.5)[0] is False


def test_flatness_of_the_confirmation_runs_delay():
    from bench.search import flatness

    assert flatness(0.3, 0.6, 0.25)["flat"] and flatness(0.3, 0.6, 0.25)["limit"] == 0.6  # 2x the first
    assert not flatness(0.3, 0.61, 0.25)["flat"]
    assert flatness(0.05, 0.3, 0.25)["flat"] and not flatness(0.05, 0.31, 0.25)["flat"]  # small: + one epoch
    assert flatness(0.4, 0.2, 0.25)["flat"]  # falling is flat
    for missing in (None, float("nan")):  # a quarter without results cannot show a flat delay
        assert not flatness(missing, 0.2, 0.25)["flat"] and not flatness(0.2, missing, 0.25)["flat"]


def test_confirmed_needs_the_repeats_and_a_flat_confirmation_run():
    from bench.search import confirmed

    assert confirmed(point()) and point()["confirm"]["flatness"]["limit"] == 0.8
    assert not confirmed(point(last_p99=0.9))  # the delay climbed over the long run
    assert not confirmed(point(sustained_kept=(True, False, False)))  # most repeats fell behind
    assert not confirmed({**point(), "confirm": None})  # no confirmation run (quick, --confirm-seconds 0)
    behind = point()
    behind["confirm"] = confirm_run(297_000, 0.3, 0.35, kept=False)
    assert behind["confirm"]["flatness"]["flat"] and not confirmed(behind)


def test_quarter_p99_comes_from_the_metrics_log_by_input_progress():
    import pyarrow as pa
    from bench.cluster import quarter_p99

    # a sample a second over 100 tuples of input; after the input's end two drain samples (not counted)
    seen = [0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 100, 100]
    p99 = [None, 0.3, 0.2, 0.4, 0.3, 0.35, 0.3, 0.9, 1.0, 1.1, 1.2, 5.0, 5.0]
    log = pa.table(
        {
            "elapsed": [float(i) for i in range(len(seen))][::-1],
            "input_r": [n // 2 for n in seen][::-1],
            "input_s": [n - n // 2 for n in seen][::-1],
            "delay_p99": p99[::-1],
        }
    )  # files in any order
    q = quarter_p99(log)
    # quarters of the input (0, 25], (25, 50], (50, 75], (75, 100]: medians of 0.3 0.2 | 0.4 0.3 0.35 | 0.3 0.9 |
    # 1.0 1.1 1.2 (the sample before any input and the drain's count for none)
    assert q == [pytest.approx(0.25), pytest.approx(0.35), pytest.approx(0.6), pytest.approx(1.1)]
    assert not bench.search.flatness(q[0], q[-1], 0.25)["flat"]  # 1.1 > max(0.5, 0.5)
    assert quarter_p99(None) == [None] * 4 and quarter_p99(log.slice(0, 0)) == [None] * 4


def test_a_long_run_drops_only_complete_result_files(tmp_path):
    from bench.cluster import _drop_results

    results = tmp_path / "results"
    results.mkdir()
    for name in ("slave-001-000000.parquet", ".slave-001-000001.parquet.tmp"):
        (results / name).write_bytes(b"x")
    _drop_results(tmp_path)
    assert [f.name for f in results.iterdir()] == [".slave-001-000001.parquet.tmp"]  # still being written
    _drop_results(tmp_path / "none")  # no results folder yet


def test_search_verdict_needs_keeping_up_and_a_bounded_p95():
    assert search_verdict({"kept_up": True, "delay_p95": 1.5}, 1.5) == (True, "pass")  # the bound is inclusive
    ok, why = search_verdict({"kept_up": True, "delay_p95": 1.6}, 1.5)
    assert not ok and "p95" in why and "fell behind" not in why
    ok, why = search_verdict({"kept_up": False, "delay_p95": 0.2}, 1.5)
    assert not ok and why == "fell behind"
    ok, why = search_verdict({"kept_up": False, "delay_p95": 3.0}, 1.5)
    assert not ok and "fell behind" in why and "p95" in why
    for missing in (None, float("nan")):  # no results, no delay: cannot show a bounded delay
        assert search_verdict({"kept_up": True, "delay_p95": missing}, 1.5)[0] is False


def test_next_rate_starts_at_half_the_unpaced_throughput():
    assert next_rate([], 1000.0, steps=4) == 500
    assert next_rate([], 475_421.0, steps=4) == 237_710
    with pytest.raises(ValueError):
        next_rate([], 0.0, steps=4)


def test_next_rate_halves_until_a_run_passes_then_gives_up():
    assert next_rate([(500, False)], 1000.0, steps=10) == 250
    assert next_rate([(500, False), (250, False)], 1000.0, steps=10) == 125
    assert next_rate([(500, False), (250, False), (125, False)], 1000.0, steps=10) == 62  # round(62.5)
    four_fails = [(500, False), (250, False), (125, False), (62, False)]
    assert len(four_fails) == bench.search.MAX_FAILS_WITHOUT_PASS
    assert next_rate(four_fails, 1000.0, steps=10) is None
    assert sustained_rate(four_fails) == 0 and bracket(four_fails) == (0, 62)


def test_next_rate_bisects_geometrically_between_highest_pass_and_lowest_fail():
    # first run passed: nothing failed yet, so the unpaced throughput is the upper end
    assert next_rate([(500, True)], 1000.0, steps=6) == round(math.sqrt(500 * 1000))  # 707
    # first failed, second (halved) passed
    assert next_rate([(500, False), (250, True)], 1000.0, steps=6) == round(math.sqrt(250 * 500))  # 354
    assert next_rate([(500, False), (250, True), (354, True)], 1000.0, steps=6) == round(math.sqrt(354 * 500))
    assert next_rate([(500, False), (250, True), (354, False)], 1000.0, steps=6) == round(math.sqrt(250 * 354))
    # a failure below the highest pass (noise) does not invert the bracket; the lowest fail above it counts
    assert next_rate([(800, False), (400, True), (300, False), (600, False)], 1000.0, steps=6) == round(
        math.sqrt(400 * 600)
    )
    # a pass at or above the unpaced throughput (a slow probe): look above it instead of stopping
    assert next_rate([(1000, True)], 1000.0, steps=6) == round(math.sqrt(1000 * 2000))


def test_next_rate_stops_at_the_step_budget_and_when_converged():
    trail = [(500, False), (250, True), (354, True)]
    assert next_rate(trail, 1000.0, steps=3) is None
    assert next_rate(trail, 1000.0, steps=4) is not None
    assert next_rate([(100, True), (101, False)], 1000.0, steps=6) is None  # no integer rate strictly between
    assert next_rate([(100, True), (102, False)], 1000.0, steps=6) == 101


@pytest.mark.parametrize("true_rate", [70.0, 190.0, 250.0, 300.0, 420.0, 499.0, 501.0, 800.0, 999.0])
@pytest.mark.parametrize("steps", [4, 6])
def test_search_brackets_a_threshold(true_rate, steps):
    """Against a cluster that passes exactly up to true_rate, the search halves down to the first pass, then
    bisects: it returns a passing rate at most true_rate, within the resolution its step budget allows."""
    unpaced = 1000.0
    trail = []
    while (rate := next_rate(trail, unpaced, steps)) is not None:
        assert all(rate != r for r, _ in trail), "a rate was tried twice"
        trail.append((rate, rate <= true_rate))
    assert len(trail) <= steps
    lo, hi = bracket(trail)
    assert sustained_rate(trail) == lo and 0 < lo <= true_rate
    assert hi is None or hi > true_rate
    halvings = max(0, math.ceil(math.log2(unpaced * bench.search.FIRST_FRACTION / true_rate)))
    assert [ok for _, ok in trail[: halvings + 1]] == [False] * halvings + [True]
    # after the first pass the bracket spans a factor 2; each geometric bisection halves its logarithm ...
    floor = 0.99 * true_rate * 2 ** -(1 / 2 ** (steps - halvings - 1))
    if true_rate >= bench.search.PROBE_MARGIN * unpaced:  # ... unless it looks above U, which costs resolution near U
        floor = min(floor, 0.99 * bench.search.PROBE_MARGIN * unpaced)
    assert lo >= floor


@pytest.mark.parametrize("steps", [5, 6])
def test_search_looks_above_a_slow_probe(steps):
    """An unpaced probe can be below the capacity (its start and drain weigh on a short run): once a pass
    comes within PROBE_MARGIN of it with nothing failed, the search goes on above it."""
    unpaced, true_rate = 1000.0, 1600.0
    trail = []
    while (rate := next_rate(trail, unpaced, steps)) is not None:
        trail.append((rate, rate <= true_rate))
    assert len(trail) == steps and unpaced < sustained_rate(trail) <= true_rate


def test_search_gives_up_and_reports_zero_when_nothing_passes():
    trail = []
    while (rate := next_rate(trail, 1000.0, steps=6)) is not None:
        trail.append((rate, False))
    assert [r for r, _ in trail] == [500, 250, 125, 62]
    assert sustained_rate(trail) == 0 and trail_text(trail) == "500✗ 250✗ 125✗ 62✗"


def test_trail_text_and_krate():
    assert krate(237_710) == "238k" and krate(1_250_000) == "1,250k" and krate(62) == "62"
    assert trail_text([(238_000, False), (119_000, True), (168_300, True)]) == "238k✗ 119k✓ 168k✓"
    assert trail_text([]) == "-"
    assert bracket([(238_000, False), (119_000, True), (168_300, True), (200_000, False)]) == (168_300, 200_000)
    assert bracket([(500, True)]) == (500, None)


def test_planned_runs_and_count():
    assert planned_runs(3, repeats=3, steps=4) == 3 * (1 + 4 + 6)
    assert count([{"k": True}, {"k": False}, {"k": True}], "k") == "2/3" and count([], "k") == "-"


# --------------------------------------------------------------------------- summary table and report


def paced(label, rate, throughput, p50, p95, kept=True, rss=120.0):
    r = {
        "label": label,
        **run_numbers(summary(throughput, p50, p95=p95)),
        "peak_rss_mb": rss,
        "rate": rate,
        **keep_up(1000, 2.0, 100, 0.0 if kept else 5.0, 0.0),
    }
    r["passed"], r["verdict"] = search_verdict(r, 1.5)
    return r


def confirm_run(rate, first_p99, last_p99, epoch=0.5, kept=True):
    r = paced("confirm", rate, 0.95 * rate, 0.6, 1.0, kept=kept)
    r.update(input_seconds=60.0, long_enough=True, flatness=bench.search.flatness(first_p99, last_p99, epoch))
    r["confirmed"] = r["passed"] and r["flatness"]["flat"]
    return r


def point(k=2, sustained_kept=(True, True, False), last_p99=0.35):
    """A plausible point as Bench.point builds it: probe, search 500k fail -> 250k pass -> 354k fail -> 297k pass,
    repeats, half load, and a confirmation run whose delay p99 went from 0.3 s to `last_p99` (flat up to 0.8 s)."""
    probe = {"label": "probe", **run_numbers(summary(1_000_000.0, 1.0)), "peak_rss_mb": 600.0}
    search = [
        paced("search #1", 500_000, 400_000.0, 1.0, 2.5, kept=False),
        paced("search #2", 250_000, 240_000.0, 0.5, 0.9),
        paced("search #3", 354_000, 300_000.0, 0.9, 1.8),
        paced("search #4", 297_000, 290_000.0, 0.6, 1.2),
    ]
    trail = [(r["rate"], r["passed"]) for r in search]
    at = [
        paced(f"sustained #{i + 1}", 297_000, t, 0.6, 1.0, kept=kept)
        for i, (t, kept) in enumerate(zip((280_000.0, 295_000.0, 260_000.0), sustained_kept))
    ]
    half = [paced(f"half #{i + 1}", 148_500, 148_000.0, p, 0.5) for i, p in enumerate((0.4, 0.3, 0.5))]
    return {
        "slaves": k,
        "ranks": k + 1,
        "unpaced": 1_000_000.0,
        "probe": probe,
        "search": {"trail": trail, "bracket": bracket(trail), "runs": search},
        "sustained": {
            "rate": sustained_rate(trail),
            "throughput": median(r["throughput"] for r in at),
            **aggregate(at),
            "runs": at,
        },
        "half": {"rate": 148_500, **aggregate(half), "runs": half},
        "confirm": confirm_run(297_000, 0.3, last_p99),
    }


def test_summary_table_row():
    p = point()
    assert p["search"]["trail"] == [(500_000, False), (250_000, True), (354_000, False), (297_000, True)]
    header, rule, row = summary_table([p]).splitlines()
    names = [c.strip() for c in header.strip("|").split("|")]
    cells = dict(zip(names, (c.strip() for c in row.strip("|").split("|"))))
    assert len(cells) == len(names) == len(bench.tables.SUMMARY_HEADER)
    assert cells["slaves"] == "2" and cells["unpaced tuples/s"] == "1,000,000"
    assert cells["sustained rate/s"] == "297,000"
    assert cells["search (✓ pass, ✗ fail)"] == "500k✗ 250k✓ 354k✗ 297k✓"
    assert cells["achieved/s"] == "280,000"  # median of 280k, 295k, 260k
    assert cells["delay p50 s"] == "0.600" and cells["p95 s"] == "1.000"
    assert cells["kept up"] == "2/3" and cells["passed"] == "2/3"
    assert cells["half rate/s"] == "148,500" and cells["half p50 s"] == "0.400" and cells["half kept up"] == "3/3"
    assert cells["peak RSS MB"] == "600"  # the probe's


def test_summary_table_when_nothing_passed():
    p = point()
    p["search"]["trail"] = [(500_000, False), (250_000, False), (125_000, False), (62_500, False)]
    p["sustained"] = {"rate": 0, "throughput": None, **aggregate([]), "runs": []}
    p["half"] = {"rate": 0, **aggregate([]), "runs": []}
    cells = [c.strip() for c in summary_table([p]).splitlines()[2].strip("|").split("|")]
    assert cells[2] == "0" and cells[4:9] == ["-"] * 5 and cells[9] == "-" and cells[11] == "-"


def fake_data(points):
    return {
        "command": "python -m bench --quick",
        "repeats": 3,
        "steps": 4,
        "delay_bound": 1.5,
        "workload": ["generator.duration=10.0"],
        "bench_seconds": 200.0,
        "points": points,
        "confirm_seconds": 60.0,
        "machine": {
            "cpu": "x",
            "cores": 2,
            "memory_gib": 1.0,
            "load_average_at_start": [0.1, 0.2, 0.3],
            "os": "linux",
            "python": "3",
            "numpy": "2",
            "mpi4py": "4",
            "open_mpi": "5",
            "date": "2026-01-01T00:00:00+00:00",
        },
        "config": {
            "master": {"buffer_capacity": 2_000_000},
            "generator": {"tuple_bytes": 64},
            "epochs": {"distribution": 0.5},
            "output": {"path": "x"},
        },
    }


def test_caveats():
    data = fake_data([point(1), point(2, sustained_kept=(True, True, True))])
    cs = caveats(data)
    assert "not a capacity" in cs[0] and "goes above it" in cs[0] and "fits in master.buffer_capacity" in cs[0]
    weak = [c for c in cs if "not every repeat passed" in c]
    assert len(weak) == 1 and "1 slave(s) 2/3" in weak[0] and "2 slave(s)" not in weak[0]
    assert not any("No paced rate passed" in c or "lower bound" in c for c in cs)
    open_top = point(4)
    open_top["search"]["bracket"] = (297_000, None)
    assert any("lower bound" in c and "4 slave(s)" in c for c in caveats(fake_data([open_top])))


def test_a_quick_report_claims_no_capacity_and_no_target(tmp_path):
    from bench.report import QUICK_NOTE

    data = fake_data([point(1), point(2)])
    data.update(quick=True, confirm_seconds=0.0)
    for p in data["points"]:
        p["confirm"] = None
    bench.report.write_report(tmp_path, json.loads(json.dumps(data)))
    report = (tmp_path / "report.md").read_text()
    assert QUICK_NOTE == "quick: runs too short to measure capacity; no target is claimed"
    assert f"**{QUICK_NOTE}.**" in report and report.index(QUICK_NOTE) < report.index("## Summary")
    assert "| target (issue" not in report and "✓ met" not in report and "✗ not met" not in report
    assert "| slaves | unpaced tuples/s | search rate/s (not a capacity) |" in report
    assert "sustained rate/s" not in summary_table(data["points"], quick=True)
    assert any(QUICK_NOTE[1:] in c for c in caveats(data))
    full = fake_data([point(1), point(2)])
    bench.report.write_report(tmp_path, json.loads(json.dumps(full)))
    report = (tmp_path / "report.md").read_text()
    assert QUICK_NOTE not in report and "| target " in report and "| slaves | unpaced tuples/s | sustained" in report


def test_report_and_plots_are_written(tmp_path):
    data = fake_data([point(1), point(2)])
    data = json.loads(json.dumps(data))  # as read back from results.json: tuples become lists
    bench.report.write_report(tmp_path, data)
    report = (tmp_path / "report.md").read_text()
    assert "| slaves | unpaced tuples/s | sustained rate/s |" in report
    assert "500,000 fail → 250,000 pass → 354,000 fail → 297,000 pass" in report
    assert "between 297,000 and 354,000/s" in report
    for label in ("probe", "search #4", "sustained #3", "half #1"):
        assert f"| {label} " in report
    paths = bench.report.plot(tmp_path, data["points"], 1.5)
    assert [p.name for p in paths] == ["capacity.png", "delay.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)


def test_balance_bench_imbalance_is_max_over_mean():
    from bench.balance import imbalance

    summary = {
        "slaves": {"1": {"tuples_processed": 300}, "2": {"tuples_processed": 100}, "3": {"tuples_processed": 200}}
    }
    assert imbalance(summary["slaves"]) == pytest.approx(1.5)
    assert math.isnan(imbalance({"1": {"tuples_processed": 0}}))


# --------------------------------------------------------------------------- the load-balancing bench


def test_balance_bench_busy_share_and_mode_summary():
    from bench.balance import busy_share, mode_summary, table

    slaves = {
        "1": {"tuples_processed": 300},
        "2": {"tuples_processed": 300},
        "3": {"tuples_processed": 100},
        "4": {"tuples_processed": 300},
    }
    assert busy_share(slaves, [3, 4]) == pytest.approx(0.4)
    assert busy_share(slaves, []) == 0.0
    assert math.isnan(busy_share({"1": {"tuples_processed": 0}}, [1]))
    p = point(4)
    for r, moved in zip(p["sustained"]["runs"], (10, 30, 20)):
        r["slaves"] = slaves
        r["moves"], r["tuples_moved"] = moved // 10, moved
    m = mode_summary(p, [3, 4])
    assert m["sustained_rate"] == 297_000 and m["passed"] == "2/3" and m["tuples_moved"] == 20 and m["moves"] == 2
    assert m["imbalance"] == pytest.approx(300 / 250) and m["busy_share"] == pytest.approx(0.4)
    off = dict(m, sustained_rate=200_000)
    header, _, row_off, row_on = table({"off": off, "repartition": m}).splitlines()
    assert "vs off" in header
    assert "| 1.00x " in row_off and "| 1.49x " in row_on and "| 40% " in row_on


def test_balance_report_and_plot_are_written(tmp_path):
    from bench import balance as bb

    points = {mode: point(4) for mode in ("off", "repartition")}
    data = {
        "command": "python -m bench.balance --quick",
        "machine": fake_data([])["machine"],
        "workload": bb.WORKLOAD,
        "slaves": 4,
        "hogs": 2,
        "hosts": [[0], [1]],
        "busy_slaves": [3, 4],
        "repeats": 3,
        "steps": 4,
        "delay_bound": 1.5,
        "load_before": [0.5, 0.4, 0.3],
        "load_after": [2.5, 2, 1],
        "points": points,
        "runs": 16,
        "bench_seconds": 400.0,
        "summaries": {m: bb.mode_summary(p, [3, 4]) for m, p in points.items()},
    }
    data = json.loads(json.dumps(data))
    bb.write_report(tmp_path, data)
    report = (tmp_path / "balance.md").read_text()
    assert "slaves 3, 4 pinned to CPU(s) [1] (the busy host) together with 2 CPU hog(s)" in report
    assert "Load average before the bench (before the hogs started): 0.5 0.4 0.3" in report
    assert "## repartition" in report and "| sustained #3 " in report
    assert bb.plot(tmp_path, data).stat().st_size > 10_000


def test_planned_runs_without_half_load():
    assert planned_runs(1, repeats=3, steps=4, half=False) == 1 + 4 + 3


def test_busy_host_cpu_plan():
    from bench.busy import busy_slaves, cpu_plan, decode_plan, encode_plan, hosts

    assert hosts([1, 0]) == ([0], [1]) and hosts([0]) == ([0], [0]) and hosts([0, 1, 2, 3, 4]) == ([0, 1], [2, 3, 4])
    # 4 slaves on 2 CPUs: the master and slaves 1, 2 quiet, slaves 3, 4 busy
    assert cpu_plan(5, [0, 1]) == [[0], [0], [0], [1], [1]] and busy_slaves(5) == [3, 4]
    assert cpu_plan(3, [0, 1]) == [[0], [0], [1]] and busy_slaves(3) == [2]
    assert busy_slaves(2) == []
    for ranks in range(2, 10):  # the plan and the busy list agree
        plan = cpu_plan(ranks, [0, 1, 2, 3])
        assert [r for r in range(1, ranks) if plan[r] == [2, 3]] == busy_slaves(ranks)
    assert decode_plan(encode_plan([[0], [0, 1], [2]])) == [{0}, {0, 1}, {2}]
    with pytest.raises(ValueError, match="STREAMJOIN_CPU_PLAN"):
        decode_plan("0;x")
    with pytest.raises(ValueError):
        cpu_plan(1, [0])


def test_hogs_spin_pinned_and_are_ended(tmp_path):
    import os
    import time
    from bench.busy import hogs

    cpu = min(os.sched_getaffinity(0))
    with hogs(2, [cpu]) as pids:
        assert len(pids) == 2
        for pid in pids:
            assert os.sched_getaffinity(pid) == {cpu}
        state = lambda pid: open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        deadline = time.monotonic() + 30
        while any(state(pid) != "R" for pid in pids) and time.monotonic() < deadline:  # python starting up
            time.sleep(0.1)
        time.sleep(0.5)
        assert [state(pid) for pid in pids] == ["R", "R"]  # spinning (running or runnable), never asleep
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)


def test_busy_wrapper_runs_the_cluster_pinned_and_names_a_bad_plan(tmp_path):
    """A real mpirun through `python -m bench.busy`: a valid plan runs the join; a CPU that does not exist is a
    clear error naming the rank and the CPU."""
    import os
    from bench.cluster import RunFailed, run_cluster
    from bench.busy import PLAN_ENV

    cpu = min(os.sched_getaffinity(0))
    small = ["generator.duration=1.0", "generator.rate=2000", "generator.keys=64"]
    s = run_cluster(3, small, tmp_path / "ok", 120, module="bench.busy", env={PLAN_ENV: f"{cpu};{cpu};{cpu}"})
    assert s["input_total"] > 3000 and s["results"] > 0 and set(s["slaves"]) == {"1", "2"}
    # the exact delay percentiles, read from the result files, lie in the bins the summary gives the upper edges of
    for q in ("p50", "p95", "p99"):
        binned, exact = s["delay_seconds"][q], s["delay_exact"][q]
        assert binned / 10 ** (1 / 20) <= exact <= binned, (q, exact, binned)
    with pytest.raises(RunFailed, match="cannot be pinned to CPU"):
        run_cluster(3, small, tmp_path / "bad", 120, module="bench.busy", env={PLAN_ENV: f"{cpu};{cpu};4095"})


def test_kernel_bench_batches_cover_the_input_and_both_kernels_agree():
    from bench.kernel import duckdb_join, epoch_batches, own_kernel

    cfg = load_plan(None, ["generator.duration=2", "generator.rate=5000", "generator.keys=2048"])
    data, batches = epoch_batches(cfg)
    assert sum(len(r) + len(s) for r, s, _ in batches) == len(data.ts)
    watermarks = [w for *_, w in batches]
    assert watermarks == sorted(watermarks)
    _, own = own_kernel(cfg, batches)
    _, duck = duckdb_join(cfg, data)
    assert own == duck > 1000
    data, longer = epoch_batches(cfg, 1.0)  # batches of 1 s of event time: fewer, the same results
    assert len(longer) < len(batches) and sum(len(r) + len(s) for r, s, _ in longer) == len(data.ts)
    assert own_kernel(cfg, longer)[1] == own


def test_kernel_bench_writing_results_writes_exactly_the_reference_join(tmp_path):
    from bench.kernel import epoch_batches, own_kernel
    from protocol.output import read_tables
    from tests.reference import encode_pairs, reference_pairs

    cfg = load_plan(
        None, ["generator.duration=2", "generator.rate=5000", "generator.keys=2048", "output.flush_rows=2000"]
    )
    data, batches = epoch_batches(cfg, 0.5)
    cpus = os.sched_getaffinity(0)
    _, counted = own_kernel(cfg, batches)
    cpu: dict[str, float] = {}
    _, written = own_kernel(cfg, batches, tmp_path, cpu=cpu)
    assert os.sched_getaffinity(0) == cpus  # pinned to one core only while timing
    assert cpu["results"] > 0  # the results' own CPU: delays, gathering, Parquet (the writing thread's too)
    t = read_tables(tmp_path, ["r_id", "s_id", "r_key", "s_key", "delay"])
    want, _ = reference_pairs(data.stream, data.id, data.ts, data.key, cfg.join.upper / 1e6, cfg.join.max_delay / 1e6)
    got = np.sort(encode_pairs(t["r_id"].to_numpy(), t["s_id"].to_numpy()))
    assert written == counted == t.num_rows == len(want) > 1000 and np.array_equal(got, want)
    assert np.array_equal(t["r_key"].to_numpy(), t["s_key"].to_numpy()) and len(list(tmp_path.iterdir())) > 1


def test_kernel_bench_window_footprint_counts_the_state_the_module_holds():
    from bench.kernel import epoch_batches, window_footprint

    cfg = load_plan(None, ["generator.duration=3", "generator.rate=5000", "generator.keys=2048"])
    _, batches = epoch_batches(cfg)
    f = window_footprint(cfg, batches)
    assert f["stored_tuples"] > 1000
    # at least the rows themselves, and not wildly more: the directories and objects are small beside them
    assert f["nbytes"] >= f["stored_tuples"] * 64 and f["traced_bytes"] >= f["nbytes"]
    assert f["traced_per_tuple"] < 4 * 64


def test_input_cache_writes_the_generated_input_once_and_reuses_it(tmp_path, monkeypatch):
    import bench.inputs
    from bench.inputs import FILE, InputCache
    from tests.runs import file_source
    from common.workload import generate_all

    small = ["generator.duration=2.0", "generator.rate=3000", "generator.keys=64"]
    cache = InputCache(tmp_path)
    path = cache.file(small)
    want, got = generate_all(load_plan(None, small).generator), file_source(path).next_chunk(1 << 20)
    for a, b in zip(want, got):
        assert np.array_equal(a, b)
    assert cache.used[str(path)]["generated"] and cache.used[str(path)]["tuples"] == len(want.ts)
    written = path.stat().st_mtime_ns
    again = InputCache(tmp_path)  # a later bench invocation
    assert again.file([*small, "join.window=0.5"]) == path  # same tuples: the same file, not rewritten
    assert path.stat().st_mtime_ns == written and not again.used[str(path)]["generated"]
    other = cache.file([*small, "generator.seed=7"])
    assert other != path and other.exists()
    # a run needing more tuples than the workload gets a longer rung of the ladder
    longer = cache.file(small, tuples=3 * len(want.ts))
    meta = cache.used[str(longer)]
    # 3 x 11,959 tuples x 1.01 headroom need 6.04 s at 6,000/s: 2 s x 1.41^3 = 5.66 s is short, x 1.41^4 = 8 s holds
    assert meta["tuples"] >= 3 * len(want.ts) and meta["generator"]["duration"] == 8.0
    assert {p.name for p in longer.parent.iterdir()} == {FILE, "meta.json"}
    # another generator's code: other files (the kernel limit and the peer generate theirs with the new code)
    changed = tmp_path / "workload.py"
    changed.write_text("# changed")
    monkeypatch.setattr(bench.inputs, "workload", type("Changed", (), {"__file__": str(changed)}))
    assert cache.folder(load_plan(None, small).generator) != path.parent


def test_input_cache_evicts_least_recently_used_files_it_wrote_only(tmp_path):
    import time
    from bench.inputs import InputCache

    small = lambda seed: [
        "generator.duration=1.0",
        "generator.rate=3000",
        "generator.keys=64",
        f"generator.seed={seed}",
    ]
    foreign = tmp_path / "0123456789abcdef"  # named like the cache's, but not written by it (no meta.json)
    foreign.mkdir()
    (foreign / "input.parquet").write_bytes(b"x" * 10)
    cache = InputCache(tmp_path)
    first = cache.file(small(1))
    size = first.stat().st_size
    time.sleep(0.01)
    cache.limit = 2.5 * size  # room for two files
    second = cache.file(small(2))
    third = cache.file(small(3))
    assert not first.exists() and second.exists() and third.exists()  # the least recently used went
    assert (foreign / "input.parquet").exists()
    assert sorted(d.name for d in cache.owned()) == sorted([second.parent.name, third.parent.name])


def test_rung_is_the_shortest_ladder_length_that_holds_the_tuples():
    from bench.inputs import HEADROOM, LADDER, expected_tuples, rung
    from protocol.plan import load_plan

    def generator(duration: float):
        return load_plan(None, ["generator.rate=50000.0", f"generator.duration={duration}"]).generator

    # 50,000/s per stream for 120 s: 12M tuples; 10 s at 9.3M/s needs 93M: 120 x 1.41^6 = 960 s = 96M
    d = rung(120.0, 50_000, 93_000_000)
    assert d == pytest.approx(120 * LADDER**6, abs=1e-3)
    assert expected_tuples(generator(d)) >= HEADROOM * 93_000_000
    assert expected_tuples(generator(d / LADDER)) < HEADROOM * 93_000_000
    assert rung(120.0, 50_000, 5_000_000) == 120.0  # the workload holds them already


def test_write_input_stops_at_the_rows_asked_for(tmp_path):
    import pyarrow.parquet as pq
    from bench.big import generator_for
    from bench.inputs import CHUNK_ROWS, write_input
    from common.workload import generate_all

    rows = 30_001
    gen = generator_for(rows, ["generator.keys=64"])
    assert 2 * gen.rate * gen.duration > rows
    n = write_input(gen, tmp_path / "big.parquet", rows)
    f = pq.ParquetFile(tmp_path / "big.parquet")
    assert n == f.metadata.num_rows == rows and f.metadata.num_row_groups == -(-rows // CHUNK_ROWS)
    ids = f.read(columns=["id"])["id"].to_numpy()
    assert np.array_equal(ids, generate_all(gen).id[:rows])
    assert [p.name for p in tmp_path.iterdir()] == ["big.parquet"]  # the temporary name is gone
    with pytest.raises(ValueError, match="fewer than"):
        write_input(replace(gen, duration=0.01), tmp_path / "short.parquet", rows)
    assert [p.name for p in tmp_path.iterdir()] == ["big.parquet"]


def test_a_capacity_bench_gives_every_paced_run_ten_seconds_of_input(tmp_path):
    from bench.cluster import Bench
    from bench.inputs import expected_tuples

    workload = ["generator.duration=120.0"]
    b = Bench([2], 1, 1, 1.5, workload, 60, tmp_path, input_kind="generator", capacity=True, confirm_seconds=60)
    for rate in (3e6, 9.3e6, 15e6):
        gen = load_plan(None, b.source(bench.search.MIN_INPUT_SECONDS * rate)).generator
        assert expected_tuples(gen) / rate >= bench.search.MIN_INPUT_SECONDS
    assert load_plan(None, b.source(0)).generator.duration == 120.0  # the probe: the workload as it is
    assert b.total_runs == planned_runs(1, 1, 1) + 1  # and a confirmation run
    quick = Bench([2], 1, 1, 1.5, workload, 60, tmp_path, input_kind="generator", confirm_seconds=60)
    assert quick.confirm_seconds == 0 and quick.total_runs == planned_runs(1, 1, 1)


def test_bench_runs_the_cluster_on_the_generated_file_with_the_same_results(tmp_path):
    """Real runs: the same workload from the generator and from its file gives the same input and results."""
    from bench.cluster import Bench

    small = ["generator.duration=2.0", "generator.rate=3000", "generator.keys=64"]
    runs = {
        kind: Bench([1], 1, 1, 1.5, small, 120, tmp_path / kind, input_kind=kind).run_at(1, "probe", 0.0)
        for kind in ("generator", "file")
    }
    assert runs["file"]["input_total"] == runs["generator"]["input_total"] > 5000
    assert runs["file"]["results"] == runs["generator"]["results"] > 0


def test_metrics_timeline_rates_come_from_successive_samples_of_the_log():
    from bench.metrics_cost import timeline

    samples = [
        {
            "elapsed": t,
            "input_r": 100 * t * t,
            "input_s": 50 * t,
            "results": 7 * t,
            "delay_p50": 0.1 * t,
            "delay_p99": 0.2 * t,
            "busy_seconds": [0.5 * t, 0.25 * t * t],
        }
        for t in (1.0, 2.0, 4.0)
    ]
    line = timeline(samples)
    assert line["elapsed"] == [2.0, 4.0]
    assert line["input_per_s"] == [(500 - 150) / 1, (1800 - 500) / 2]  # R + S: 150, 500, 1800 at t = 1, 2, 4
    assert line["results_per_s"] == [7.0, 7.0]
    assert line["busy_share"] == [[0.5, 0.75], [0.5, 1.5]]
    assert line["delay_p99"] == [0.4, 0.8]


def test_big_runs_an_n_row_file_end_to_end_and_deletes_it(tmp_path):
    """A real run of bench.big at a tiny N: every row joined, the master's peak RSS reported, nothing left behind."""
    from bench.big import report_rows, run

    r = run(50_000, 1, 120, tmp_path)
    assert r["rows"] == r["input_total"] == 50_000 and r["results"] > 0 and r["rank_rss_mb"]["0"] > 0
    assert r["process_seconds"] > r["wall_seconds"] > 0 and r["first_tuple_seconds"] > 0
    assert dict(report_rows(r))["tuples joined (input_total)"] == "50,000"
    assert list(tmp_path.iterdir()) == []


def test_lone_rows_are_timed_from_the_moment_they_become_final(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from bench.join_types import after_final

    (tmp_path / "results").mkdir()
    # R rows alone at ts 0..9 s, each out 1.5 s + 0.1 * i after it arrived; a pair (not timed); the rows of the
    # last 1.5 s of event time are decided by the end of input (not timed)
    ts = np.arange(10.0)
    delay = 1.5 + 0.1 * np.arange(10)
    pq.write_table(
        pa.table({"r_ts": np.r_[ts, 3.0], "delay": np.r_[delay, 0.05], "kind": ["left_unmatched"] * 10 + ["matched"]}),
        tmp_path / "results" / "slave-001.parquet",
    )
    got = after_final(tmp_path, 1.5)
    assert got["rows"] == 8  # ts 0..7: below 9 - 1.5
    assert got["after_final_max"] == pytest.approx(0.7)
    assert got["after_final_p50"] == pytest.approx(np.percentile(0.1 * np.arange(8), 50))


def test_the_payload_workload_is_the_generators_tuples_per_stream_with_three_payload_columns(tmp_path):
    import pyarrow.parquet as pq

    from bench.payload import STREAMS, write_streams
    from common.workload import GeneratorSource

    gen = load_plan(None, ["generator.duration=2"]).generator
    sizes = write_streams(gen, tmp_path)
    every = GeneratorSource(gen).next_chunk(1 << 30)
    for side, name in enumerate(STREAMS):
        t = pq.read_table(tmp_path / f"{name}.parquet")
        assert t.column_names == ["id", "key", "ts", "label", "amount", "qty"] and sizes[name]["rows"] == t.num_rows
        np.testing.assert_array_equal(t["ts"].to_numpy(), every.ts[every.stream == side])
        assert min(len(x) for x in t["label"].to_pylist()) >= 20


def test_bench_query_runs_each_mode_and_checks_what_its_condition_and_filter_keep(tmp_path):
    """A small bench.query: the condition that keeps every pair gives the query's results, the one keeping about
    half and the filter fewer (the bench fails otherwise); the report has every mode's rate and the ratios."""
    from bench.query import main

    assert main(["--seconds", "1", "--repeats", "1", "--slaves", "1", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "query.json").read_text())
    assert set(data["medians"]) == {"query", "every", "half", "filter", "toml"}
    assert data["results"]["every"] == data["results"]["query"] == data["results"]["toml"]
    assert 0 < data["results"]["filter"][0] < data["results"]["half"][0] < data["results"]["query"][0]
    assert "filter/query" in (tmp_path / "query.md").read_text()


def test_bench_kafka_reads_the_same_rows_from_files_and_topics_and_reports_the_brokers_ceiling(tmp_path):
    """A small bench.kafka: the files, the topics and the topics shared by two dispatchers give the same
    results (the bench fails otherwise) and the report has each side's rates, the ratio against the target and
    the broker's ceiling, the delay to the result topic of records produced while the cluster runs, and the
    sink's CPU a row beside produce of the same records and the rate with the sink against without."""
    from bench.kafka import main

    args = ["--rows", "6000", "--repeats", "1", "--slaves", "1", "--delay-seconds", "2", "--out", str(tmp_path)]
    assert main(args) == 0
    data = json.loads((tmp_path / "kafka.json").read_text())
    delay = data["sink_delay"]  # records produced while the cluster runs, to its pairs in the result topic
    assert delay["pairs"] > 0 and 0 < delay["p50"] <= delay["p99"] <= delay["max"] < 60, delay
    assert data["results"]["files"] == data["results"]["kafka"] == data["results"]["kafka-2"]
    assert data["results"]["files"][0] > 0
    runs = {"files", "kafka", "kafka-2", "files+checkpoints", "files+checkpoints+sink"}
    assert data["broker_ceiling"] > 0 and set(data["medians"]) == runs
    sink = data["sink"]["medians"]  # the sink's CPU a row beside produce of the same records prebuilt
    assert sink["sink"]["cpu_ns_per_row"] > 0 and sink["ceiling"]["cpu_ns_per_row"] > 0
    target = data["sink_target"]  # the target against the sink and against produce alone
    assert target["below_ceiling"] == (sink["ceiling"]["cpu_ns_per_row"] > target["cpu_ns_per_row"])
    assert target["own_ns_per_row"] == sink["sink"]["cpu_ns_per_row"] - sink["ceiling"]["cpu_ns_per_row"]
    assert set(data["sink_to_without"]) == {"in_run", "whole_process"}
    assert "kafka/files" in (tmp_path / "kafka.md").read_text()
    assert "its own work above the ceiling" in (tmp_path / "kafka.md").read_text()


def test_bench_limit_gives_each_stage_its_nanoseconds_and_the_cluster_its_ratio_to_their_sum(tmp_path):
    from bench.limit import STAGES, main

    assert main(["--rows", "60000", "--repeats", "2", "--slaves", "1", "--profile", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "limit.json").read_text())
    assert set(data["top_frames"]) == {"master", "slave"} and all(data["top_frames"].values())
    assert (tmp_path / "profile-master.txt").stat().st_size > 0 and (tmp_path / "profile-slave.txt").exists()
    assert set(data["ns_per_tuple"]) == {"file", "streams", "payload"}  # the forms' stages, each measured
    for form, ns in data["ns_per_tuple"].items():
        assert set(ns) == set(STAGES) and all(ns[k] > 0 for k in STAGES)
        limit = data["machine"]["cores"] * 1e9 / data["sum_ns"][form]
        assert data["pipeline_limit"][form] == pytest.approx(limit, rel=1e-3)
        ratios = data["ratios"][form]
        assert 0 < ratios["in_run"] and 0 < ratios["whole_process"] <= ratios["in_run"]
    for form, ns in data["payload_log_ns_per_tuple"].items():  # declared streams' read: its part writing the log
        assert 0 < ns < data["ns_per_tuple"][form]["read"] and data["read_without_log_to_reference"][form] > 0
    assert set(data["payload_log_ns_per_tuple"]) == {"streams", "payload"}
    assert set(data["cluster"]) == {"file", "streams", "payload", "file, metrics off"}
    assert 0 < data["payload_to_streams"] and 0 < data["metrics_on_to_off"] and 0 < data["metrics_cpu_on_to_off"]
    p = data["ns_per_tuple"]["payload"]  # at its libraries' costs the payload's stages sum to less, never more
    assert 0 < data["payload_sum_at_references_ns"] <= data["sum_ns"]["payload"]
    assert data["payload_sum_at_references_ns"] >= p["ingest"] + p["transfer"] + p["join"]
    assert data["payload_to_streams_at_references"] == pytest.approx(
        data["sum_ns"]["streams"] / data["payload_sum_at_references_ns"], rel=1e-2
    )
    assert "at most" in (tmp_path / "limit.md").read_text()
    for form in ("streams", "payload"):  # declared streams' results beside pyarrow's write and Arrow's take
        gather = data["gather_ns_per_tuple"][form]
        assert 0 < gather["ours"] < data["ns_per_tuple"][form]["results"] and gather["take"] > 0  # a part of it
        results = data["ns_per_tuple"][form]["results"]
        both = data["reference_ns_per_tuple"][form]["results"] + gather["take"]
        assert data["results_to_write_and_take"][form] == pytest.approx(results / both, abs=0.01)
    assert set(data["gather_ns_per_tuple"]) == {"streams", "payload"}
    for c, r in data["cluster"].items():  # the ranks' CPU counted, and no more than the cores had
        whole_seconds = data["rows"] / r["whole_process"][0]
        assert 0 < r["cpu_ns_per_tuple"][0] * data["rows"] / 1e9 <= data["machine"]["cores"] * whole_seconds, c
    peer = data["duckdb_peer"]  # DuckDB side by side: a rate each run (before the cluster's, then after), the
    runs = peer["runs"]  # same results, ratios with targets
    assert len(runs["rate"]) == len(data["cluster"]["file"]["in_run"]) == 2
    assert set(runs["threads"]) == {len(os.sched_getaffinity(0))} and runs["rate"][0] > 0 and runs["seconds"][0] > 0
    assert runs["same_key_pairs"][0] >= runs["results"][0]
    assert peer["results_agree"] and runs["results"] == data["cluster"]["file"]["results"] != [0]
    assert {k: r["target"] for k, r in peer["ratios"].items()} == {"in_run": 3.0, "whole_process": 2.5}
    assert all(r["ratio"] > 0 and isinstance(r["met"], bool) for r in peer["ratios"].values())
    report = (tmp_path / "limit.md").read_text()
    assert "Pipeline limit" in report and "Side by side with DuckDB" in report and "target 3x" in report


def test_bench_limit_joins_each_slaves_batches_apart_and_finds_duckdbs_pairs(tmp_path):
    """The join stage on two slaves' batches: each slave's module expires by its own batches, so the pairs are
    DuckDB's on the same tuples (one module for both lost 2.6% of them: one slave's watermark expired the
    other's state before its batch of the epoch came)."""
    from bench.kernel import own_kernel
    from bench.limit import ingest_stage, join_reference, read_stage, workloads

    plan = load_plan(None, [*workloads(100_000, tmp_path)["file"], f"output.path={tmp_path / 'out'}"])
    _, batches = ingest_stage(plan, read_stage(plan)[1], 2)
    _, pairs = own_kernel(plan, batches, slaves=2)
    assert pairs == join_reference(plan, batches)[1] > 10_000


def test_bench_aggregate_reports_both_rates_their_ratio_and_the_views_lag(tmp_path):
    """A small bench.aggregate: the runs with and without aggregation give the same results, the report has both
    sides' rates, the ratio against the target and the view lag's percentiles over the windows measured."""
    from bench.aggregate import main

    assert (
        main(["--seconds", "3", "--lag-seconds", "6", "--repeats", "1", "--slaves", "1", "--out", str(tmp_path)]) == 0
    )
    data = json.loads((tmp_path / "aggregate.json").read_text())
    assert set(data["medians"]) == {"none", "aggregate"} and data["ratio"] > 0
    assert data["results"]["none"] == data["results"]["aggregate"] and data["results"]["none"][0] > 0
    lag = data["lag"]
    assert lag["windows_in_view"] >= 3 and lag["rate"] > 0, lag
    assert lag["windows"] == 0 or 0 < lag["p50"] <= lag["p99"] <= lag["max"] < 60, lag
    assert "aggregate/none" in (tmp_path / "aggregate.md").read_text()


def test_a_windows_end_is_passed_when_the_last_slave_stamps_past_it():
    from bench.aggregate import passed
    from protocol.eventtime import POS_INF

    slaves = {  # watermarks (a move lowers one; the end is POS_INF) and when each file was published
        1: (np.array([5, 12, 9, 30, POS_INF]), np.array([1.0, 2.0, 3.0, 4.0, 5.0])),
        2: (np.array([10, 20, POS_INF]), np.array([1.5, 2.5, 3.5])),
    }
    when, by_end = passed(slaves, np.array([5, 10, 20, 25, 40]))
    np.testing.assert_array_equal(when, [1.5, 2.0, 4.0, 4.0, 5.0])
    np.testing.assert_array_equal(by_end, [False, False, False, True, True])
