"""The Spark peer of the benchmark: its job computes exactly the reference join (so the comparison is of equal
work), with a real local Spark; and the feeder's slicing (pure)."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from bench.spark import run_spark, slice_bounds, stream_tables
from common.workload import generate_all
from protocol.config import load_config
from protocol.plan import compile_plan
from tests.reference import encode_pairs, reference_pairs


def test_slice_bounds_cover_every_tuple_once_by_nominal_arrival():
    assert slice_bounds(10, rate=10.0, slice_seconds=0.25) == [(0, 3), (3, 5), (5, 8), (8, 10)]
    assert slice_bounds(0, 5.0, 0.2) == [(0, 0)]
    for n, rate, sl in ((1000, 333.0, 0.2), (7, 1e6, 0.2), (12345, 9876.5, 0.1)):
        b = slice_bounds(n, rate, sl)
        assert b[0][0] == 0 and b[-1][1] == n and all(x[1] == y[0] for x, y in zip(b, b[1:]))
        # tuple i arrives at i / rate: it lies in slice floor(i / rate / sl)
        for k, (lo, hi) in enumerate(b):
            idx = np.arange(lo, hi)
            assert ((idx / rate >= k * sl - 1e-9) & (idx / rate < (k + 1) * sl + 1e-9)).all()
    with pytest.raises(ValueError):
        slice_bounds(10, 0.0, 0.2)


def test_stream_tables_split_by_stream_with_arrivals():
    cfg = load_config(None, ["generator.duration=0.5", "generator.rate=200"])
    data = generate_all(compile_plan(cfg).generator)
    r, s = stream_tables(data, 10, 60, np.arange(10, 60, dtype=np.float64))
    assert r.num_rows + s.num_rows == 50 and r.column_names == ["id", "ts", "key", "value", "arrival"]
    assert sorted(np.concatenate([r["arrival"].to_numpy(), s["arrival"].to_numpy()]).tolist()) == list(range(10, 60))


def _pairs(out):
    t = pq.read_table(out / "results")
    assert t.num_rows == len(set(zip(t["r_id"].to_pylist(), t["s_id"].to_pylist()))), "a pair was emitted twice"
    assert np.all(t["r_key"].to_numpy() == t["s_key"].to_numpy())
    return encode_pairs(t["r_id"].to_numpy(), t["s_id"].to_numpy())


def test_spark_job_equals_the_reference_join(spark, tmp_path):
    """Skewed keys over few keys, a window a sixth of the input's span, paced over several micro-batches (the
    state carries across them): every pair the reference has, once."""
    rate = 2500.0
    cfg = load_config(
        None,
        [
            "generator.duration=2.0",
            "generator.rate=600",
            "generator.keys=40",
            "generator.skew=0.8",
            "join.window=0.3",
            "join.max_delay=0.5",
        ],
    )
    data = generate_all(compile_plan(cfg).generator)
    n = len(data.id)
    run = run_spark(spark, data, n, rate, tmp_path / "run", cfg["join"]["window"], cfg["join"]["max_delay"], 180)
    expected, late = reference_pairs(data.stream, data.id, data.ts, data.key, 0.3, 0.5)
    assert len(late) == 0 and len(expected) > 1000
    assert run["results"] == len(expected) and run["input_total"] + run["warm_up"] == n and run["warm_up"] > 0
    assert run["batches"] >= 2  # timed micro-batches after the warm-up one
    assert np.array_equal(_pairs(tmp_path / "run"), expected)
    assert run["delay_p50"] is not None and 0 < run["delay_p50"] <= run["delay_p99"] <= run["delay_max"] + 1e-3


def _peer(trail, sustained_runs=()):
    from bench.search import bracket, sustained_rate

    return {
        "peer": "spark",
        "cores": 2,
        "run_seconds": 10.0,
        "delay_bound": 5.0,
        "unpaced": 50_000.0,
        "probe": {
            "label": "probe",
            "rate": 0.0,
            "input_total": 1000,
            "throughput": 50_000.0,
            "batches": 1,
            "drain_seconds": 1.0,
            "delay_p50": 1.0,
            "delay_p95": 2.0,
            "delay_p99": 2.0,
            "delay_max": 2.0,
        },
        "search": {"trail": trail, "bracket": bracket(trail), "runs": []},
        "sustained": {
            "rate": sustained_rate(trail),
            "throughput": None,
            "delay_p50": 0.9,
            "delay_p95": 1.2,
            "delay_p99": 1.4,
            "runs": list(sustained_runs),
        },
    }


def test_ratio_of_the_clusters_best_rate_to_sparks():
    from bench.spark import ratio, ratio_text

    held, luck = [{"passed": True}, {"passed": True}, {"passed": False}], [{"passed": True}, {"passed": False}]
    flat, climbed = {"confirmed": True}, {"confirmed": False}
    points = [
        {"slaves": 1, "sustained": {"rate": 250_000, "runs": held}, "confirm": flat},
        {"slaves": 2, "sustained": {"rate": 450_000, "runs": held}, "confirm": flat},
        {"slaves": 4, "sustained": {"rate": 900_000, "runs": luck}, "confirm": flat},  # half its repeats: luck
        {"slaves": 8, "sustained": {"rate": 800_000, "runs": held}, "confirm": climbed},  # the long run: no
        {"slaves": 3, "sustained": {"rate": 700_000, "runs": held}, "confirm": None},
    ]  # no confirmation run
    r = ratio(points, _peer([(25_000, False), (12_500, True), (17_700, False)]))
    assert r == {
        "cluster_rate": 450_000,
        "cluster_slaves": 2,
        "spark_rate": 12_500,
        "ratio": 36.0,
        "ratio_at_least": None,
        "bounds": None,
    }
    assert "(delay p95 bounds 1.5 s and 5 s)" in ratio_text(ratio(points, _peer([(12_500, True)]), 1.5))
    assert "ratio cluster/Spark **36.0x**" in ratio_text(r)
    none = ratio(points, _peer([(25_000, False), (12_500, False), (6_250, False), (3_125, False)]))
    assert none["ratio"] is None and none["ratio_at_least"] == 144.0
    assert "more than 144.0x" in ratio_text(none)
    unconfirmed = ratio(points[2:], _peer([(12_500, True)]))
    assert unconfirmed["ratio"] is None and "no ratio" in ratio_text(unconfirmed)
    assert ratio_text(unconfirmed).startswith(
        "cluster (no slave count's rate confirmed by its repeats and confirmation run) vs Spark"
    )


def test_report_section_lists_every_spark_run():
    from bench.spark import report_section

    lines = "\n".join(
        report_section(
            [{"slaves": 2, "sustained": {"rate": 100_000, "runs": [{"passed": True}]}, "confirm": {"confirmed": True}}],
            _peer([(25_000, False), (12_500, True)]),
            1.5,
        )
    )
    assert "held to a delay p95 bound of 5 s, the cluster to 1.5 s" in lines
    assert "## Peer: Spark Structured Streaming" in lines and "| Spark local[2] | 50,000 " in lines
    assert "| probe " in lines and "ratio cluster/Spark **8.0x**" in lines


def test_bench_report_and_plot_carry_the_peer(tmp_path):
    import json
    import bench.report
    from bench.spark import ratio
    from tests.cluster.test_bench import fake_data, point

    data = fake_data([point(1), point(2)])
    data["peer"] = _peer([(25_000, False), (12_500, True)])
    data["peer_ratio"] = ratio(data["points"], data["peer"], 1.5)
    data = json.loads(json.dumps(data))
    bench.report.write_report(tmp_path, data)
    report = (tmp_path / "report.md").read_text()
    assert "## Peer: Spark Structured Streaming" in report and "ratio cluster/Spark **23.8x**" in report  # 297k / 12.5k
    assert bench.report.plot(tmp_path, data["points"], 1.5, data["peer"])[0].stat().st_size > 10_000
