"""The Spark audit (control.audit) on outer, semi and anti joins (join.type): exact on real runs (full, a crashed
left join seen live from its checkpoint, semi on a band join), counted against tests.reference's outer join; and planted
faults in the rows without a partner (one removed, one doubled, one added for a tuple that has a partner)
each counted under its kind and present in the diff file."""

from __future__ import annotations

import re
import shutil
import urllib.request

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from control import audit
from control.audit_metrics import AuditMetrics
from protocol.config import load_config
from protocol.plan import compile_plan, load_plan
from protocol.output import LEFT_MATCHED, LEFT_UNMATCHED, MATCHED, RIGHT_UNMATCHED, read_tables
from common.workload import generate_all
from tests.runs import run_cluster
from tests.reference import reference_outer, reference_pairs, reference_theta_pairs
from tests.cluster.test_audit import LATE, audited, copy_run

OUTER = dict(LATE, **{"generator.duration": 2.0})


def reference_rows(settings: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """tests.reference's rows of the settings' join.type over the whole input: (encoded pairs, R ids alone,
    S ids alone)."""
    cfg = load_config(None, [f"{k}={v}" for k, v in settings.items() if k.startswith("generator.")])
    d = generate_all(compile_plan(cfg).generator)
    window = (settings["join.lower"], settings["join.upper"]) if "join.lower" in settings else settings["join.window"]
    max_delay = settings["join.max_delay"]
    pairs, late = reference_pairs(d.stream, d.id, d.ts, d.key, window, max_delay)
    if settings.get("join.predicate", "equal") != "equal":
        pairs = reference_theta_pairs(
            d.stream, d.id, d.ts, d.key, window, max_delay, settings["join.predicate"], settings.get("join.band", 0)
        )
    on = ~np.isin(d.stream.astype(np.int64) * 2**40 + d.id, late)
    return reference_outer(pairs, d.id[on & (d.stream == 0)], d.id[on & (d.stream == 1)], settings["join.type"])


def outer_run(tmp_path_factory, name: str, settings: dict):
    run = run_cluster(tmp_path_factory.mktemp(name), 3, settings)
    assert run.returncode == 0, run.stderr
    return run


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    return outer_run(tmp_path_factory, "full", dict(OUTER, **{"join.type": "full", "generator.seed": 51}))


def test_the_audit_of_a_full_join_counts_each_kind_like_the_reference(spark, full_run):
    settings = dict(OUTER, **{"join.type": "full", "generator.seed": 51})
    pairs, lone_r, lone_s = reference_rows(settings)
    code, r = audited(spark, full_run)
    assert code == audit.EXACT and r["verdict"] == "exact", r
    assert r["kinds"] == [LEFT_UNMATCHED, RIGHT_UNMATCHED] and r["join_type"] == "full"
    assert r["expected"] == r["found"] == len(pairs) > 1000
    assert r["left_unmatched_expected"] == r["left_unmatched_found"] == len(lone_r) > 100
    assert r["right_unmatched_expected"] == r["right_unmatched_found"] == len(lone_s) > 100
    assert full_run.summary["late"] > 500  # late tuples are in none of those rows
    header, row = audit.table([r]).splitlines()
    assert "left_unmatched missing" in header and "right_unmatched duplicates" in header
    assert row.split()[0] == r["range"]
    metrics = AuditMetrics("127.0.0.1:0", load_plan(full_run.out.parent / "run.toml"))
    try:
        metrics.record(r)
        scraped = urllib.request.urlopen(metrics.url, timeout=10).read().decode()
    finally:
        metrics.close()
    metric = lambda labels: float(
        re.search(rf"^streamjoin_audit_rows_alone_total{{{labels}}} (\S+)$", scraped, re.M).group(1)
    )
    assert metric('kind="right_unmatched",outcome="found"') == len(lone_s)
    assert metric('kind="left_unmatched",outcome="missing"') == 0


def test_the_audit_of_asymmetric_time_bounds_is_exact_over_the_run_and_a_range(spark, tmp_path_factory):
    """join.lower / join.upper: the audit joins by lower <= s.ts - r.ts <= upper and reads partners
    up to the farther bound past a range; a full join, so both streams' rows alone are recomputed too."""
    settings = {
        **{k: v for k, v in OUTER.items() if k != "join.window"},
        "join.lower": -0.1,
        "join.upper": 0.4,
        "join.type": "full",
        "generator.seed": 53,
    }
    run = outer_run(tmp_path_factory, "bounds", settings)
    pairs, lone_r, lone_s = reference_rows(settings)
    code, r = audited(spark, run)
    assert code == audit.EXACT and r["verdict"] == "exact", r
    assert r["expected"] == r["found"] == len(pairs) > 1000
    assert r["left_unmatched_expected"] == len(lone_r) > 100 and r["right_unmatched_expected"] == len(lone_s) > 100
    code, r = audited(spark, run, "--from", "0.5", "--to", "1.5")
    assert code == audit.EXACT and 0 < r["expected"] < len(pairs), r


def test_planted_faults_in_rows_alone_are_counted_by_kind_and_in_the_diff_file(spark, full_run, tmp_path):
    faulty = copy_run(full_run, tmp_path)
    t = read_tables(faulty.out / "results")
    kind = t["kind"].to_numpy(zero_copy_only=False)
    r_ts = t["r_ts"].to_numpy(zero_copy_only=False)
    removed = int(np.flatnonzero(kind == LEFT_UNMATCHED)[0])
    doubled = int(np.flatnonzero(kind == RIGHT_UNMATCHED)[0])
    matched = int(np.flatnonzero((kind == MATCHED) & (r_ts > 0.5))[0])  # its R tuple has a partner
    partnered = t.slice(matched, 1).to_pylist()[0]
    added = {
        **{c: None for c in t.column_names},
        **{c: partnered[c] for c in ("r_id", "r_key", "r_ts", "r_value")},
        "delay": 0.0,
        "kind": LEFT_UNMATCHED,
    }
    keep = np.ones(t.num_rows, bool)
    keep[removed] = False
    shutil.rmtree(faulty.out / "results")
    (faulty.out / "results").mkdir()
    pq.write_table(
        pa.concat_tables(
            [t.filter(pa.array(keep)), t.slice(doubled, 1), pa.Table.from_pylist([added], schema=t.schema)]
        ),
        faulty.out / "results" / "slave-001-000000.parquet",
    )
    code, r = audited(spark, faulty)
    assert code == audit.DIFFERENT and r["verdict"] == "different", r
    assert (r["missing"], r["extra"], r["duplicates"], r["late_wrong"]) == (0, 0, 0, 0), r
    assert (r["left_unmatched_missing"], r["left_unmatched_extra"], r["left_unmatched_duplicates"]) == (1, 1, 0), r
    assert (r["right_unmatched_missing"], r["right_unmatched_extra"], r["right_unmatched_duplicates"]) == (0, 0, 1), r
    assert "1 left_unmatched rows missing" in audit.verdict(r)
    diff = pq.read_table(r["diff"]).to_pylist()
    assert len(diff) == 3, diff
    got = {(d["problem"], d["kind"]): d for d in diff}
    missing = got["missing", LEFT_UNMATCHED]
    assert missing["r_id"] == t["r_id"][removed].as_py() and missing["s_id"] is None
    assert missing["r_ts"] == t["r_ts"][removed].as_py()  # the tuple's own columns, from the input
    twice = got["duplicate", RIGHT_UNMATCHED]
    assert (twice["s_id"], twice["copies"], twice["r_id"]) == (t["s_id"][doubled].as_py(), 2, None)
    extra = got["extra", LEFT_UNMATCHED]
    assert extra["r_id"] == partnered["r_id"] and extra["reason"] == "its tuple has a partner: it belongs in a pair"


def test_a_crashed_left_join_is_exact_below_the_bound_where_its_rows_alone_are_final(spark, tmp_path):
    # seen live: its newest checkpoint's committed files, below the slaves' watermark minus join.window; 5 s of
    # input, as in test_audit's crashed run: in 3 s a loaded host's slave did not reach its 12th batch
    settings = dict(
        LATE,
        **{
            "join.type": "left",
            "generator.seed": 52,
            "source.rate": 6000.0,
            "epochs.distribution": 0.1,
            "generator.duration": 5.0,
        },
    )
    crashed = run_cluster(
        tmp_path, 3, settings, env={"STREAMJOIN_FAULT": f"1:batch-after-checkpoint:12:{tmp_path / 'fired'}"}
    )
    assert crashed.returncode != 0 and (tmp_path / "fired").exists()
    code, r = audited(spark, crashed)
    assert code == audit.EXACT, r
    assert r["run"].startswith("live run") and "rows alone final below" in r["run"], r
    assert r["kinds"] == [LEFT_UNMATCHED] and r["left_unmatched_expected"] > 20 and r["expected"] > 500, r
    pairs, lone_r, _ = reference_rows(settings)
    assert r["left_unmatched_expected"] < len(lone_r) and r["expected"] < len(pairs)


def test_a_semi_band_join_expects_each_r_row_with_a_partner_once(spark, tmp_path_factory):
    settings = dict(
        OUTER,
        **{"join.type": "semi", "join.predicate": "band", "join.band": 3, "generator.keys": 8192, "generator.seed": 53},
    )
    run = outer_run(tmp_path_factory, "semi", settings)
    _, lone_r, _ = reference_rows(settings)
    code, r = audited(spark, run)
    assert code == audit.EXACT, r
    assert r["kinds"] == [LEFT_MATCHED] and r["expected"] == r["found"] == 0
    assert r["left_matched_expected"] == r["left_matched_found"] == len(lone_r) > 500
    # a sample of the R rows' keys: their partners are still looked for among every S key (band)
    code, sampled = audited(spark, run, "--sample", "0.3")
    assert code == audit.EXACT, sampled
    assert 0 < sampled["left_matched_expected"] == sampled["left_matched_found"] < len(lone_r) / 2
    results = read_tables(run.out / "results")
    assert pc.all(pc.is_null(results["s_id"])).as_py()
