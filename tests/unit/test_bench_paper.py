"""Tests of bench/paper.py's pure parts: workloads, targets, tables, report sections and plots (no runs)."""

from __future__ import annotations

import argparse
import copy
import json

import pytest

import bench.paper
import bench.report
from bench.paper import (
    WORKLOADS,
    comm_per_slave,
    kernel_fraction,
    paced_runs,
    parse_epochs,
    parse_names,
    rank_rss,
    window_state,
)
from protocol.config import load_config
from tests.cluster.test_bench import fake_data, point


def test_every_workload_is_a_valid_config_and_differs_from_the_paper():
    for name, (what, settings) in WORKLOADS.items():
        cfg = load_config(None, settings)
        assert what
        if name != "paper":
            assert settings and cfg["generator"]["distribution"] in ("uniform", "zipf")
    assert WORKLOADS["paper"][1] == [] and bench.paper.EXTRA_WORKLOADS == ["uniform", "zipf", "duplication"]
    assert load_config(None, WORKLOADS["duplication"][1])["generator"]["keys"] <= 1000


def test_parse_names_and_epochs():
    assert parse_names("zipf, uniform") == ["zipf", "uniform"] and parse_names("none") == []
    assert parse_epochs("0.25,0.5,1") == [0.25, 0.5, 1.0] and parse_epochs("none") == []
    for bad in ("paper", "zipf,foo", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_names(bad)
    for bad in ("0", "-1,1", "a", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_epochs(bad)


def test_paced_runs_are_every_paced_run_by_rate():
    p = point()
    rates = [r["rate"] for r in paced_runs(p)]
    assert rates == sorted(rates) and len(rates) == 4 + 3 + 3
    assert all("rate" in r for r in paced_runs(p)) and p["probe"] not in paced_runs(p)


def test_kernel_fraction_uses_the_cores_the_ranks_can_use():
    p = point(k=4)  # 5 ranks, sustained 297,000/s
    two = kernel_fraction(p, 100_000.0, cores=2)
    assert two["cores_used"] == 2 and two["limit"] == 200_000.0 and two["fraction"] == pytest.approx(1.485)
    eight = kernel_fraction(p, 100_000.0, cores=8)
    assert eight["cores_used"] == 5 and eight["fraction"] == pytest.approx(297_000 / 500_000)
    assert kernel_fraction(point(k=1), 0.0, 2)["fraction"] is None


def test_window_state_rank_rss_and_comm():
    p = point()
    for r, b in zip(paced_runs(p), [64.0] * 4 + [80.0] * 3 + [200.0] * 3):
        r["window_bytes_per_tuple"] = b
    ws = window_state([p], 64)
    assert ws["bytes_per_tuple"] == 80.0 and ws["ratio"] == pytest.approx(1.25)
    assert window_state([], 64)["ratio"] is None
    runs = [{"rank_rss_mb": {"0": 300.0, "1": 100.0}}, {"rank_rss_mb": {"0": 250.0, "1": 140.0, "2": 90.0}}]
    assert rank_rss(runs) == {0: 300.0, 1: 140.0, 2: 90.0}
    assert comm_per_slave({"slaves": {"1": {"comm_seconds": 0.2}, "2": {"comm_seconds": 0.4}}}) == pytest.approx(0.3)


def full_data():
    """fake_data with every part bench.paper adds."""
    data = fake_data([point(1), point(2)])
    data["config"]["generator"]["tuple_bytes"] = 64
    data["workloads"] = {"zipf": {"settings": WORKLOADS["zipf"][1], "points": [point(2)]}}
    off = point(2)
    off["search"]["trail"] = [(250_000, True), (354_000, False), (297_000, False), (272_000, False)]
    off["sustained"]["rate"] = 250_000
    data["tuning_off"] = {"settings": bench.paper.NO_TUNING, "points": [off]}
    sweep = []
    for e, comm in ((0.25, 0.8), (0.5, 0.5), (1.0, 0.3)):
        r = copy.deepcopy(point(2)["half"]["runs"][0])
        r["slaves"]["1"]["comm_seconds"] = comm
        sweep.append({"epoch": e, **r})
    data["epochs"] = {"slaves": 2, "rate": 148_500, "runs": sweep}
    data["kernel"] = {
        "rate": 400_000.0,
        "runs": [390_000.0, 400_000.0, 410_000.0],
        "tuples": 1_000_000,
        "cores": 2,
        "span": 2.0,
        "spans": [
            {"span": 0.25, "rate": 150_000.0, "runs": [150_000.0]},
            {"span": 2.0, "rate": 400_000.0, "runs": [390_000.0, 400_000.0, 410_000.0]},
        ],
        "with_results": {"rate": 250_000.0, "runs": [240_000.0, 250_000.0, 260_000.0]},
        "footprint": {
            "traced_bytes": 7_200_000,
            "nbytes": 6_420_000,
            "stored_tuples": 100_000,
            "traced_per_tuple": 72.0,
            "nbytes_per_tuple": 64.2,
        },
    }
    data["peer_ratio"] = {"ratio": 12.5, "ratio_at_least": None}
    return json.loads(json.dumps(data))  # as read back from results.json


def table_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()[2:]]


def test_targets_table_says_what_is_met():
    data = full_data()
    rows = {r[0].split()[0]: r for r in table_rows(bench.paper.targets_table(data))}
    assert rows["capacity"][1:] == ["12.5x", "✓ met"]
    # half-load p99 of the fake points is 0.3 s <= 0.5 + 0.1
    assert rows["delay"][2] == "✓ met" and "1 slave(s) 0.300 s" in rows["delay"][1]
    # window bytes per tuple: the cluster's 64 B and the traced 72 B, the larger against 64 B: 1.12x
    assert rows["window"][1] == "cluster 64 B, in-process traced 72 B per 64 B tuple: 1.12x"
    assert rows["window"][2] == "✓ met"
    # the best fraction: 297,000 / (400,000 x 2 cores) = 0.37 < 0.5
    assert rows[">="][1].startswith("0.37") and rows[">="][2] == "✗ not met"
    # a faster point whose repeats mostly failed does not count: 900,000 / 800,000 would be met
    lucky = point(4, sustained_kept=(True, False, False))
    lucky["sustained"]["rate"] = 900_000
    data["points"].append(lucky)
    assert table_rows(bench.paper.targets_table(data))[-1][1].startswith("0.37")
    data["points"].pop()
    # 4 slaves sustaining >= 8M/s, confirmed; no 4-slave point: no row
    assert "sustained" not in {r[0].split()[0] for r in table_rows(bench.paper.targets_table(data))}
    four = point(4)
    data["points"].append(four)
    row = {r[0].split()[0]: r for r in table_rows(bench.paper.targets_table(data))}["sustained"]
    assert row[1:] == ["297,000/s", "✗ not met"]
    four["confirm"]["confirmed"] = False
    row = {r[0].split()[0]: r for r in table_rows(bench.paper.targets_table(data))}["sustained"]
    assert row[1:] == ["297,000/s (not confirmed)", "-"]
    data["points"].pop()
    data["epochs"] = None
    data["config"]["epochs"]["distribution"] = 0.1  # 0.3 s > 0.1 + 0.1
    assert "✗ not met" in {r[0].split()[0]: r for r in table_rows(bench.paper.targets_table(data))}["delay"][2]


def test_workload_tuning_epoch_and_kernel_tables():
    data = full_data()
    wl = table_rows(bench.paper.workloads_table(data))
    assert [(r[0], r[1], r[2]) for r in wl] == [
        ("paper", "1", "297,000"),
        ("paper", "2", "297,000"),
        ("zipf", "2", "297,000"),
    ]
    assert wl[0][3] == "500k✗ 250k✓ 354k✗ 297k✓" and wl[0][7] == "0.05"  # 50 results per 1,000 tuples
    tuning = table_rows(bench.paper.tuning_table(data))
    assert [(r[1], r[2]) for r in tuning] == [("on (default)", "297,000"), ("off (tuning.max_depth = 0)", "250,000")]
    ep = table_rows(bench.paper.epochs_table(data["epochs"]))
    assert [r[0] for r in ep] == ["0.25", "0.5", "1"] and [r[6] for r in ep] == ["0.800", "0.500", "0.300"]
    assert ep[0][7] == "40.0%"  # 0.8 s of a 2.0 s run
    assert table_rows(bench.paper.span_table(data["kernel"])) == [
        ["0.25", "150,000", "150,000"],
        ["2", "400,000", "390,000, 400,000, 410,000"],
    ]
    kt = table_rows(bench.paper.kernel_table(data))
    assert kt[0][:2] == ["1", "2"] and kt[0][4] == "0.37" and kt[0][5] == "✗ not met"
    assert kt[0][6] == "0.59"  # 297,000 / (250,000 x 2) against the kernel that also writes its results
    del data["kernel"]["with_results"]
    assert table_rows(bench.paper.kernel_table(data))[0][6] == "-"
    data["points"][1]["confirm"]["confirmed"] = False  # the long run's delay climbed: the fraction claims nothing
    assert [r[5] for r in table_rows(bench.paper.kernel_table(data))] == ["✗ not met", "not confirmed"]
    data["quick"] = True
    assert {r[5] for r in table_rows(bench.paper.kernel_table(data))} == {"not measured (quick)"}
    assert {r[5] for r in table_rows(bench.paper.window_table(data))} == {"not measured (quick)"}
    rss = table_rows(bench.paper.rss_table(data["points"]))
    assert rss[0] == ["1", "300", "1:100", "300", "1:100"]


def test_cluster_runs_counts_every_part():
    data = full_data()  # 4 points of 11 runs and a confirmation run each (2 paper, zipf, tuning off), 3 epoch runs
    assert bench.paper.cluster_runs(data) == 4 * 12 + 3
    data["workloads"]["zipf"]["points"][0]["confirm"] = None  # the workloads make no confirmation run
    assert bench.paper.cluster_runs(data) == 4 * 12 + 2
    assert bench.paper.cluster_runs(fake_data([point(1)])) == 12


def test_report_has_every_section_and_the_plots_are_written(tmp_path):
    data = full_data()
    bench.report.write_report(tmp_path, data)
    report = (tmp_path / "report.md").read_text()
    for heading in (
        "## Delay against input rate",
        "## Workloads",
        "### Workload zipf",
        "## Extendible-hash tuning on and off",
        "## Distribution-epoch sweep",
        "## Window state per stored tuple",
        "## Peak RSS per rank",
        "## Against the single-core limit",
        "| target ",
    ):
        assert heading in report, heading
    assert report.index("| target ") < report.index("## Method")
    assert "**72.0 B per tuple** (1.12x the raw 64 B" in report and "51 runs" in report
    paths = bench.paper.plot(tmp_path, data, 1.5)
    assert [p.name for p in paths] == ["delay_rate.png", "tuning.png", "epochs.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)
    for png in ("delay_rate.png", "tuning.png", "epochs.png"):
        assert f"({png})" in report
