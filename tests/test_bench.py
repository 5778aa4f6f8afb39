"""Tests of the bench package's helpers and report writing, and a few small real runs (no speed assertions)."""
from __future__ import annotations

import argparse
import json
import math
import os

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
from protocol.config import load_config


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
        "achieved_rate": pytest.approx(5_217_391.3), "ratio": 0.745, "lag_seconds": 0.33, "lag_bound": 0.171,
        "kept_up": False}
    assert keep_up(tuples=12_000_000, wall=2.3, rate=6_000_000, pacing_lag=0.15, backlog=0.0)["kept_up"]
    # a long input keeps the fixed bound
    long = keep_up(tuples=12_000_000, wall=20.0, rate=600_000, pacing_lag=0.45, backlog=0.0)
    assert long["lag_bound"] == bench.search.KEEP_UP_LAG and long["kept_up"]


def test_fmt_and_md_table():
    assert fmt(1234567.8) == "1,234,568"
    assert fmt(0.12345, ".3f") == "0.123"
    assert fmt(None) == "-" and fmt(float("nan"), ".3f") == "-"
    lines = md_table(["a", "long header"], [["12345", "x"], ["1", "yy"]]).splitlines()
    assert lines == ["| a     | long header |",
                     "|-------|-------------|",
                     "| 12345 | x           |",
                     "| 1     | yy          |"]


def summary(throughput, p50, wt=10, wb=640, p95=0.2, comm=0.1):
    return {"input_total": 1000, "late": 0, "results": 50, "wall_seconds": 2.0, "throughput_tuples_per_s": throughput,
            "delay_seconds": {"p50": p50, "p95": p95, "p99": 0.3, "max": 0.25, "note": "..."},
            "slaves": {"1": {"tuples_processed": 1000, "window_tuples": wt, "window_bytes": wb,
                             "busy_seconds": 0.5, "results": 50, "epochs": 3, "result_files": 1,
                             "comm_seconds": comm, "peak_rss_bytes": 100 * 2**20, "cpu_seconds": 1.0}},
            "master_peak_rss_bytes": 300 * 2**20, "config": {"big": "dropped"}, "process_seconds": 3.5,
            "startup": {"first_tuple_seconds": 1.25, "pss_before_data_bytes": {"0": 90 * 2**20, "1": 80 * 2**20}}}


def test_run_numbers_and_aggregate():
    r = run_numbers(summary(500.0, 0.1))
    assert r["throughput"] == 500.0 and r["delay_p50"] == 0.1 and r["window_bytes_per_tuple"] == 64.0
    assert "config" not in r and r["slaves"]["1"] == {"tuples_processed": 1000, "window_tuples": 10,
                                                      "window_bytes": 640, "busy_seconds": 0.5, "comm_seconds": 0.1}
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
    assert next_rate([(800, False), (400, True), (300, False), (600, False)], 1000.0, steps=6) == \
        round(math.sqrt(400 * 600))
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
    assert [ok for _, ok in trail[:halvings + 1]] == [False] * halvings + [True]
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
    r = {"label": label, **run_numbers(summary(throughput, p50, p95=p95)), "peak_rss_mb": rss, "rate": rate,
         **keep_up(1000, 2.0, 100, 0.0 if kept else 5.0, 0.0)}
    r["passed"], r["verdict"] = search_verdict(r, 1.5)
    return r


def point(k=2, sustained_kept=(True, True, False)):
    """A plausible point as Bench.point builds it: probe, search 500k fail -> 250k pass -> 354k fail -> 297k pass."""
    probe = {"label": "probe", **run_numbers(summary(1_000_000.0, 1.0)), "peak_rss_mb": 600.0}
    search = [paced("search #1", 500_000, 400_000.0, 1.0, 2.5, kept=False),
              paced("search #2", 250_000, 240_000.0, 0.5, 0.9),
              paced("search #3", 354_000, 300_000.0, 0.9, 1.8),
              paced("search #4", 297_000, 290_000.0, 0.6, 1.2)]
    trail = [(r["rate"], r["passed"]) for r in search]
    at = [paced(f"sustained #{i + 1}", 297_000, t, 0.6, 1.0, kept=kept)
          for i, (t, kept) in enumerate(zip((280_000.0, 295_000.0, 260_000.0), sustained_kept))]
    half = [paced(f"half #{i + 1}", 148_500, 148_000.0, p, 0.5) for i, p in enumerate((0.4, 0.3, 0.5))]
    return {"slaves": k, "ranks": k + 1, "unpaced": 1_000_000.0, "probe": probe,
            "search": {"trail": trail, "bracket": bracket(trail), "runs": search},
            "sustained": {"rate": sustained_rate(trail), "throughput": median(r["throughput"] for r in at),
                          **aggregate(at), "runs": at},
            "half": {"rate": 148_500, **aggregate(half), "runs": half}}


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
    return {"command": "python -m bench --quick", "repeats": 3, "steps": 4, "delay_bound": 1.5,
            "workload": ["generator.duration=10.0"], "bench_seconds": 200.0, "points": points,
            "machine": {"cpu": "x", "cores": 2, "memory_gib": 1.0, "load_average_at_start": [0.1, 0.2, 0.3],
                        "os": "linux", "python": "3", "numpy": "2", "mpi4py": "4", "open_mpi": "5",
                        "date": "2026-01-01T00:00:00+00:00"},
            "config": {"master": {"buffer_capacity": 2_000_000}, "generator": {"tuple_bytes": 64},
                       "epochs": {"distribution": 0.5}, "output": {"path": "x"}}}


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
    summary = {"slaves": {"1": {"tuples_processed": 300}, "2": {"tuples_processed": 100},
                          "3": {"tuples_processed": 200}}}
    assert imbalance(summary["slaves"]) == pytest.approx(1.5)
    assert math.isnan(imbalance({"1": {"tuples_processed": 0}}))


# --------------------------------------------------------------------------- the load-balancing bench

def test_balance_bench_busy_share_and_mode_summary():
    from bench.balance import busy_share, mode_summary, table
    slaves = {"1": {"tuples_processed": 300}, "2": {"tuples_processed": 300}, "3": {"tuples_processed": 100},
              "4": {"tuples_processed": 300}}
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
    data = {"command": "python -m bench.balance --quick", "machine": fake_data([])["machine"],
            "workload": bb.WORKLOAD, "slaves": 4, "hogs": 2, "hosts": [[0], [1]], "busy_slaves": [3, 4],
            "repeats": 3, "steps": 4, "delay_bound": 1.5, "load_before": [0.5, 0.4, 0.3], "load_after": [2.5, 2, 1],
            "points": points, "runs": 16, "bench_seconds": 400.0,
            "summaries": {m: bb.mode_summary(p, [3, 4]) for m, p in points.items()}}
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
    from protocol.config import load_config
    cfg = load_config(None, ["generator.duration=2", "generator.rate=5000", "generator.keys=2048"])
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
    from protocol.config import load_config
    from protocol.output import read_tables
    from tests.reference import encode_pairs, reference_pairs
    cfg = load_config(None, ["generator.duration=2", "generator.rate=5000", "generator.keys=2048",
                             "output.flush_rows=2000"])
    data, batches = epoch_batches(cfg, 0.5)
    cpus = os.sched_getaffinity(0)
    _, counted = own_kernel(cfg, batches)
    _, written = own_kernel(cfg, batches, tmp_path)
    assert os.sched_getaffinity(0) == cpus  # pinned to one core only while timing
    t = read_tables(tmp_path, ["r_id", "s_id", "r_key", "s_key", "delay"])
    want, _ = reference_pairs(data.stream, data.id, data.ts, data.key, cfg["join"]["window"], cfg["join"]["max_delay"])
    got = np.sort(encode_pairs(t["r_id"].to_numpy(), t["s_id"].to_numpy()))
    assert written == counted == t.num_rows == len(want) > 1000 and np.array_equal(got, want)
    assert np.array_equal(t["r_key"].to_numpy(), t["s_key"].to_numpy()) and len(list(tmp_path.iterdir())) > 1


def test_kernel_bench_window_footprint_counts_the_state_the_module_holds():
    from bench.kernel import epoch_batches, window_footprint
    from protocol.config import load_config
    cfg = load_config(None, ["generator.duration=3", "generator.rate=5000", "generator.keys=2048"])
    _, batches = epoch_batches(cfg)
    f = window_footprint(cfg, batches)
    assert f["stored_tuples"] > 1000
    # at least the rows themselves, and not wildly more: the directories and objects are small beside them
    assert f["nbytes"] >= f["stored_tuples"] * 64 and f["traced_bytes"] >= f["nbytes"]
    assert f["traced_per_tuple"] < 4 * 64


def test_generated_file_holds_the_generated_input_once_per_generator_config(tmp_path):
    from bench.cluster import generated_file
    from master.source import FileSource
    from protocol.workload import generate_all
    small = ["generator.duration=2.0", "generator.rate=3000", "generator.keys=64"]
    path = generated_file(small, tmp_path)
    want, got = generate_all(load_config(None, small)), FileSource(path).next_chunk(1 << 20)
    for a, b in zip(want, got):
        assert np.array_equal(a, b)
    written = path.stat().st_mtime_ns
    assert generated_file([*small, "join.window=0.5"], tmp_path) == path  # same tuples: the same file, not rewritten
    assert path.stat().st_mtime_ns == written
    other = generated_file([*small, "generator.seed=7"], tmp_path)
    assert other != path and other.exists()


def test_bench_runs_the_cluster_on_the_generated_file_with_the_same_results(tmp_path):
    """Real runs: the same workload from the generator and from its file gives the same input and results."""
    from bench.cluster import Bench
    small = ["generator.duration=2.0", "generator.rate=3000", "generator.keys=64"]
    runs = {kind: Bench([1], 1, 1, 1.5, small, 120, tmp_path / kind, input_kind=kind).run_at(1, "probe", 0.0)
            for kind in ("generator", "file")}
    assert runs["file"]["input_total"] == runs["generator"]["input_total"] > 5000
    assert runs["file"]["results"] == runs["generator"]["results"] > 0


def test_metrics_timeline_rates_come_from_successive_samples_of_the_log():
    from bench.metrics_cost import timeline
    samples = [{"elapsed": t, "input_r": 100 * t * t, "input_s": 50 * t, "results": 7 * t, "delay_p50": 0.1 * t,
                "delay_p99": 0.2 * t, "busy_seconds": [0.5 * t, 0.25 * t * t]} for t in (1.0, 2.0, 4.0)]
    line = timeline(samples)
    assert line["elapsed"] == [2.0, 4.0]
    assert line["input_per_s"] == [(500 - 150) / 1, (1800 - 500) / 2]  # R + S: 150, 500, 1800 at t = 1, 2, 4
    assert line["results_per_s"] == [7.0, 7.0]
    assert line["busy_share"] == [[0.5, 0.75], [0.5, 1.5]]
    assert line["delay_p99"] == [0.4, 0.8]
