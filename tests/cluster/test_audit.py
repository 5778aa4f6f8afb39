"""The Spark audit (control.audit) on real cluster runs: it is exact on correct output (equal and band joins, two
dispatchers, a crash seen live and after the supervisor's recovery) and finds faults planted in copies of the
result and late files, each with its count and its pair or tuple in the diff file."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import urllib.request
from decimal import Decimal

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from control import aggregate, audit
from control.audit_metrics import AuditMetrics
from protocol import checkpoint, eventtime
from protocol.config import load_config
from protocol.plan import compile_plan, load_plan
from deploy.launch import mpi_env, mpirun_command
from protocol.output import LEFT_UNMATCHED, MATCHED, RESULT_SCHEMA, read_tables
from common.workload import generate_all
from tests.runs import ENDED_IDLE, run_cluster, write_config
from tests.reference import late_flags, micros, reference_pairs, reference_theta_pairs
from tests.cluster.test_aggregate_streams import ROOT, assert_view_equals
from tests.cluster.test_cluster import SMALL

# disorder above max_delay: about a third of the tuples are late; small files: the lateness prefix spans several
LATE = dict(
    SMALL,
    **{
        "generator.duration": 3.0,
        "generator.disorder": 0.5,
        "output.flush_rows": 3000,
        "source.batch": 2000,
        "checkpoint.interval": 2,
    },
)
SUPERVISE = [sys.executable, "-m", "control.supervise", "--backoff", "0.1", "--restarts", "3", "--"]

#: the Spark jobs an audit of an inner join of the single file may run, and of a left join of declared streams:
#: its counts, the caches it fills once, and on the tests' tiny data a job per join Spark broadcasts (12 and 37
#: here, the same for one archive file or several, one dispatcher or two; a job per file or range would add more)
PLAN_JOBS, STREAMS_PLAN_JOBS = 14, 40
#: the audit's reason for a pair whose times are outside the bounds
OUTSIDE = "s_ts - r_ts is outside the join's time bounds (join.lower, join.upper or -+join.window)"


def audited(spark, run, *args) -> tuple[int, dict]:
    """Run the command in-process on `run`'s config; (exit code, the report it wrote)."""
    code = audit.main(["--config", str(run.out.parent / "run.toml"), *args], spark=spark)
    reports = sorted((run.out / "audit").glob("audit-*.json"), key=lambda p: p.stat().st_mtime)
    return code, json.loads(reports[-1].read_text())


def reference(settings: dict, start: float = -np.inf, end: float = np.inf) -> np.ndarray:
    """tests.reference over the generated input: the encoded pairs whose later ts is in [start, end) seconds
    (compared in microseconds, as the generator's ts are)."""
    cfg = load_config(None, [f"{k}={v}" for k, v in settings.items() if k.startswith("generator.")])
    d = generate_all(compile_plan(cfg).generator)
    if settings.get("join.predicate", "equal") == "equal":
        pairs, _ = reference_pairs(d.stream, d.id, d.ts, d.key, settings["join.window"], settings["join.max_delay"])
    else:
        pairs = reference_theta_pairs(
            d.stream,
            d.id,
            d.ts,
            d.key,
            settings["join.window"],
            settings["join.max_delay"],
            settings["join.predicate"],
            settings.get("join.band", 0),
        )
    ts = {s: dict(zip(d.id[d.stream == s].tolist(), d.ts[d.stream == s].tolist())) for s in (0, 1)}
    later = np.array([max(ts[0][p // 2**32], ts[1][p % 2**32]) for p in pairs.tolist()])
    inside = np.ones(len(pairs), bool)
    if start > -np.inf:
        inside &= later >= micros(start)
    if end < np.inf:
        inside &= later < micros(end)
    return pairs[inside]


@pytest.fixture(scope="module")
def late_run(tmp_path_factory):
    """An equi-join with many late tuples and an archive of several files."""
    tmp = tmp_path_factory.mktemp("late")
    run = run_cluster(tmp, 3, dict(LATE, **{"generator.seed": 21}))
    assert run.returncode == 0, run.stderr
    assert run.summary["late"] > 1000 and len(list((run.out / "archive").iterdir())) >= 3
    return run


def test_the_audit_of_a_run_with_late_tuples_is_exact_and_counts_the_reference_pairs(spark, late_run):
    code, r = audited(spark, late_run)
    assert code == audit.EXACT and r["verdict"] == "exact", r
    assert r["spark_jobs"] <= PLAN_JOBS, r
    assert (
        r["expected"]
        == r["found"]
        == late_run.summary["results"]
        == len(reference(dict(LATE, **{"generator.seed": 21})))
    )
    assert (
        r["input"].startswith("archive")
        and r["input_tuples"] == late_run.summary["input_total"] + late_run.summary["late"]
    )
    # a middle range, and a sample of its keys
    code, r = audited(spark, late_run, "--from", "1", "--to", "2")
    assert code == 0 and r["range"] == "1-2"
    assert r["expected"] == len(reference(dict(LATE, **{"generator.seed": 21}), 1.0, 2.0)) > 500
    code, sampled = audited(spark, late_run, "--from", "1", "--to", "2", "--sample", "0.25")
    assert code == 0 and 0 < sampled["expected"] < r["expected"] / 2


def columns(t: pa.Table) -> dict[str, np.ndarray]:
    return {c: t[c].to_numpy(zero_copy_only=False) for c in t.column_names}


def copy_run(src, dest):
    """A copy of `src`'s output and config under `dest`, as a Run (the caller plants its faults)."""
    shutil.copytree(src.out, dest / "out")
    (dest / "run.toml").write_text((src.out.parent / "run.toml").read_text().replace(str(src.out), str(dest / "out")))
    return type(src)(dest / "out", src.proc)


def plant(src, dest):
    """A copy of `src`'s output with faults in its results and late files; returns what was planted."""
    out = copy_run(src, dest).out
    results, late = read_tables(out / "results"), read_tables(out / "late")
    a = columns(read_tables(out / "archive"))  # one dispatcher: the files in name order are the arrival order
    t = micros(a["ts"])
    on_time = ~late_flags(t, LATE["join.max_delay"])
    res = columns(results)
    later = np.maximum(res["r_ts"], res["s_ts"])
    removed, doubled = np.flatnonzero((later > 1.0) & (later < 2.0))[:2]
    rows = {name: np.flatnonzero(on_time & (a["stream"] == name)) for name in "RS"}
    late_s = np.flatnonzero(~on_time & (a["stream"] == "S"))

    def partner(s_rows, low: int, high: int) -> tuple[int, int]:
        """An on-time R row and one of `s_rows` with the same key whose ts are low < |dt| <= high us apart."""
        for j in s_rows.tolist():
            r = rows["R"][a["key"][rows["R"]] == a["key"][j]]
            dt = np.abs(t[r] - t[j])
            if ((dt > low) & (dt <= high)).any():
                return int(r[np.argmax((dt > low) & (dt <= high))]), j
        raise AssertionError("no such pair in the input: the test plants nothing")

    apart = partner(rows["S"], micros(0.6), micros(1.5))
    late_pair = partner(late_s, -1, micros(LATE["join.window"]))

    def row(i: int, j: int) -> dict:
        return {
            "r_id": a["id"][i],
            "s_id": a["id"][j],
            "r_key": a["key"][i],
            "s_key": a["key"][j],
            "r_ts": a["ts"][i],
            "s_ts": a["ts"][j],
            "r_value": a["value"][i],
            "s_value": a["value"][j],
            "delay": 0.0,
        }

    keep = np.ones(results.num_rows, bool)
    keep[removed] = False
    added = pa.Table.from_pylist([row(*apart), row(*late_pair)], schema=RESULT_SCHEMA)
    shutil.rmtree(out / "results")
    (out / "results").mkdir()
    pq.write_table(
        pa.concat_tables([results.filter(keep), results.slice(doubled, 1), added]),
        out / "results" / "slave-001-000000.parquet",
    )
    lt = columns(late)
    dropped = len(lt["id"]) // 2
    wrongly = rows["S"][np.argmax(a["ts"][rows["S"]] > 1.0)]
    keep = np.ones(late.num_rows, bool)
    keep[dropped] = False
    added = pa.Table.from_pylist(
        [
            {
                "stream": "S",
                "id": a["id"][wrongly],
                "ts": a["ts"][wrongly],
                "key": a["key"][wrongly],
                "value": a["value"][wrongly],
                "reason": "planted",
                "bound": 0.0,
            }
        ],
        schema=late.schema,
    )
    shutil.rmtree(out / "late")
    (out / "late").mkdir()
    pq.write_table(pa.concat_tables([late.filter(keep), added]), out / "late" / "late-000000.parquet")
    pair = lambda i: (int(res["r_id"][i]), int(res["s_id"][i]))
    return {
        "removed": pair(removed),
        "doubled": pair(doubled),
        "apart": (int(a["id"][apart[0]]), int(a["id"][apart[1]])),
        "late_pair": (int(a["id"][late_pair[0]]), int(a["id"][late_pair[1]])),
        "dropped": (lt["stream"][dropped], int(lt["id"][dropped])),
        "wrongly": ("S", int(a["id"][wrongly])),
    }


def test_planted_faults_are_each_counted_and_in_the_diff_file(spark, late_run, tmp_path):
    faults = plant(late_run, tmp_path)
    run = type(late_run)(tmp_path / "out", late_run.proc)  # plant copied it there
    code, r = audited(spark, run)
    assert code == audit.DIFFERENT and r["verdict"] == "different"
    assert (r["missing"], r["extra"], r["duplicates"], r["late_unexpected"], r["late_missed"]) == (1, 2, 1, 1, 1), r
    diff = pq.read_table(r["diff"]).to_pylist()
    assert len(diff) == 6
    pair = lambda problem, ids: [d for d in diff if d["problem"] == problem and (d["r_id"], d["s_id"]) == ids]
    assert len(pair("missing", faults["removed"])) == 1
    assert [d["copies"] for d in pair("duplicate", faults["doubled"])] == [2]
    assert [d["reason"] for d in pair("extra", faults["apart"])] == [OUTSIDE]
    assert [d["reason"] for d in pair("extra", faults["late_pair"])] == ["its S tuple is late"]
    one = lambda problem, key: [d for d in diff if d["problem"] == problem and (d["stream"], d["id"]) == key]
    assert len(one("late_missed", faults["dropped"])) == 1 and len(one("late_unexpected", faults["wrongly"])) == 1


def boundary_input(path, groups: int) -> tuple[dict, dict]:
    """A CSV input near 1.7e9 s whose decimals float64 seconds would judge wrongly at the boundaries.

    Per group, keys of its own: a pair exactly join.window (0.1 s) apart; a pair 0.100001 s apart; an S tuple
    exactly join.max_delay (0.3 s) behind the largest ts so far (on time), and one a microsecond further
    (late), both with the same R partner.  Returns ({(stream, id): (ts as written, key)}, pairs by kind: those
    that join, those a microsecond too far apart, and the joining ones float64 seconds get wrong)."""
    rows, pairs = {}, {"joins": [], "too_far": [], "float_window": [], "float_lateness": []}
    for g in range(groups):
        b = Decimal(1_700_000_000) + Decimal(g) / 2 + Decimal(g * 7 % 500) / 1000
        top = b + Decimal("0.100001")  # the largest ts so far once it arrived
        r = {"early": (b - Decimal("0.2"), 3 * g + 2), "exact": (b, 3 * g), "beyond": (b, 3 * g + 1)}
        s = {
            "exact": (b + Decimal("0.1"), 3 * g),
            "beyond": (top, 3 * g + 1),
            "on": (top - Decimal("0.3"), 3 * g + 2),
            "late": (top - Decimal("0.300001"), 3 * g + 2),
        }
        ids = {}
        for stream, tuples in (("R", r), ("S", s)):
            for name, cell in tuples.items():
                ids[stream, name] = sum(1 for k in rows if k[0] == stream)
                rows[stream, ids[stream, name]] = cell
        pairs["joins"] += [(ids["R", "exact"], ids["S", "exact"]), (ids["R", "early"], ids["S", "on"])]
        pairs["too_far"].append((ids["R", "beyond"], ids["S", "beyond"]))
        if float(s["exact"][0]) - float(b) > 0.1:
            pairs["float_window"].append(pairs["joins"][-2])
        if float(s["on"][0]) < float(top) - 0.3:
            pairs["float_lateness"].append(pairs["joins"][-1])
    path.write_text("stream,id,ts,key\n" + "".join(f"{st},{i},{ts},{k}\n" for (st, i), (ts, k) in rows.items()))
    return rows, pairs


def test_a_pair_exactly_the_window_apart_is_expected_and_one_microsecond_more_is_not(spark, tmp_path):
    path = tmp_path / "input.csv"
    rows, pairs = boundary_input(path, 200)
    assert len(pairs["float_window"]) > 50 and len(pairs["float_lateness"]) > 20  # float seconds would err here
    run = run_cluster(
        tmp_path / "run",
        3,
        {
            "source.kind": "file",
            "source.path": str(path),
            "join.window": 0.1,
            "join.max_delay": 0.3,
            "checkpoint.interval": 1,
        },
    )
    assert run.returncode == 0, run.stderr
    assert run.summary["late"] == 200
    code, r = audited(spark, run)
    assert code == audit.EXACT and r["expected"] == r["found"] == len(pairs["joins"]) == 400, r
    # one pair exactly the window apart removed, the pair one microsecond further apart added
    faulty = copy_run(run, tmp_path / "planted")
    results = read_tables(faulty.out / "results")
    removed, added = pairs["float_window"][0], pairs["too_far"][0]
    keep = pc.invert(pc.and_(pc.equal(results["r_id"], removed[0]), pc.equal(results["s_id"], removed[1])))
    (r_ts, r_key), (s_ts, s_key) = rows["R", added[0]], rows["S", added[1]]
    extra = pa.Table.from_pylist(
        [
            {
                "r_id": added[0],
                "s_id": added[1],
                "r_key": r_key,
                "s_key": s_key,
                "r_ts": float(r_ts),
                "s_ts": float(s_ts),
                "r_value": 0.0,
                "s_value": 0.0,
                "delay": 0.0,
            }
        ],
        schema=RESULT_SCHEMA,
    )
    shutil.rmtree(faulty.out / "results")
    (faulty.out / "results").mkdir()
    pq.write_table(
        pa.concat_tables([results.filter(keep).cast(RESULT_SCHEMA), extra]),
        faulty.out / "results" / "slave-001-000000.parquet",
    )
    for source in ("archive", "input file"):  # the archive's float seconds, then the CSV's decimals
        if source == "input file":
            shutil.rmtree(faulty.out / "archive")
        code, r = audited(spark, faulty)
        assert code == audit.DIFFERENT and r["input"].startswith(source), r
        assert (r["missing"], r["extra"], r["duplicates"], r["late_wrong"]) == (1, 1, 0, 0), r
        diff = {d["problem"]: d for d in pq.read_table(r["diff"]).to_pylist()}
        assert (diff["missing"]["r_id"], diff["missing"]["s_id"]) == removed
        assert (diff["extra"]["r_id"], diff["extra"]["s_id"]) == added
        assert diff["extra"]["reason"] == OUTSIDE


def test_band_join_from_the_input_file_without_an_archive(spark, tmp_path):
    # no checkpoints, so no archive: the audit takes the file source's input as the arrival order
    settings = dict(
        SMALL,
        **{
            "generator.duration": 2.0,
            "generator.disorder": 0.4,
            "join.predicate": "band",
            "join.band": 3,
            "generator.keys": 20000,
            "generator.seed": 22,
        },
    )
    cfg = load_config(None, [f"{k}={v}" for k, v in settings.items() if k.startswith("generator.")])
    d = generate_all(compile_plan(cfg).generator)
    path = tmp_path / "input.parquet"
    pq.write_table(
        pa.table(
            {
                "stream": np.array(["R", "S"])[d.stream],
                "id": d.id,
                "ts": eventtime.to_seconds(d.ts),
                "key": d.key,
                "value": d.value,
            }
        ),
        path,
    )
    run = run_cluster(tmp_path, 3, dict(settings, **{"source.kind": "file", "source.path": str(path)}))
    assert run.returncode == 0, run.stderr
    code, r = audited(spark, run)
    assert code == 0 and r["input"].startswith("input file"), r
    assert r["expected"] == r["found"] == len(reference(settings)) > 500 and run.summary["late"] > 0


@pytest.mark.parametrize(
    "settings,ranks",
    [
        # r.key < s.key: no key equality to join on, only the time buckets
        (
            {
                **SMALL,
                "join.predicate": "less",
                "generator.rate": 400.0,
                "join.window": 0.1,
                "generator.disorder": 0.4,
                "generator.keys": 4096,
                "generator.seed": 26,
                "checkpoint.interval": 2,
            },
            3,
        ),
        # a heavy hitter split into a grid of sub-groups moved to other slaves (R tuples copied to each)
        (
            {
                **SMALL,
                "generator.hot_share": 0.3,
                "generator.keys": 65536,
                "hotkeys.enabled": True,
                "epochs.reorganization": 0.5,
                "balance.enabled": False,
                "join.window": 0.05,
                "generator.seed": 27,
                "source.rate": 6000.0,
                "checkpoint.interval": 2,
            },
            4,
        ),
    ],
    ids=["less", "hot-keys"],
)
def test_less_join_and_hot_key_grids_are_exact(spark, tmp_path, settings, ranks):
    run = run_cluster(tmp_path, ranks, settings)
    assert run.returncode == 0, run.stderr
    if settings.get("hotkeys.enabled"):
        assert [h["event"] for h in run.summary["hot_keys"]][:1] == ["split"], run.summary["hot_keys"]
    code, r = audited(spark, run)
    assert code == 0, r
    assert r["expected"] == r["found"] == len(reference(settings)) > 500


def test_two_dispatchers_archives_are_merged_and_each_applies_the_lateness_rule(spark, tmp_path):
    settings = dict(LATE, **{"cluster.dispatchers": 2, "generator.seed": 23, "balance.enabled": False})
    run = run_cluster(tmp_path, 4, settings)
    assert run.returncode == 0, run.stderr
    assert {f.name.rsplit("-", 1)[0] for f in (run.out / "archive").iterdir()} == {"input-d0", "input-d1"}
    code, r = audited(spark, run)
    assert code == 0 and r["dispatchers"] == 2, r
    assert r["found"] == run.summary["results"] > 1000 and run.summary["late"] > 1000
    assert r["spark_jobs"] <= PLAN_JOBS, r  # the plan does not grow with the dispatchers or the archive's files


def test_without_an_archive_the_generator_is_rebuilt_and_split_as_the_dispatchers_split_it(spark, tmp_path):
    settings = dict(
        LATE,
        **{
            "cluster.dispatchers": 2,
            "generator.seed": 25,
            "balance.enabled": False,
            "checkpoint.interval": 0,
            "generator.duration": 2.0,
        },
    )
    run = run_cluster(tmp_path, 4, settings)
    assert run.returncode == 0, run.stderr
    assert not (run.out / "archive").exists() and run.summary["late"] > 500
    code, r = audited(spark, run)
    assert code == 0 and r["input"].startswith("generator"), r
    assert r["found"] == run.summary["results"] > 1000
    assert r["spark_jobs"] <= PLAN_JOBS, r
    assert not (run.out / "audit" / audit.SCRATCH).exists()  # the generated input it wrote is gone


def test_a_crashed_run_is_exact_below_its_checkpoint_and_followed_through_its_recovery(spark, tmp_path):
    # 5 s of input, about 55 batches: the kill comes after a complete checkpoint, on a loaded host too, and
    # after 1 s of event time (15 batches of 0.1 s after the slave's second checkpoint; a slave that misses
    # slots gets more event time per batch), so the follow below has live ranges to check
    settings = dict(
        LATE, **{"generator.seed": 24, "source.rate": 6000.0, "epochs.distribution": 0.1, "generator.duration": 5.0}
    )
    crashed = run_cluster(
        tmp_path, 3, settings, env={"STREAMJOIN_FAULT": f"1:batch-after-checkpoint:15:{tmp_path / 'fired'}"}
    )
    assert crashed.returncode != 0 and (tmp_path / "fired").exists()
    # a result file past the last commit, as a crashed run leaves them: the restarted run replaces it, so it
    # does not count (here a copy of a committed file: counted, every pair in it would be a duplicate)
    _, manifest = checkpoint.latest_complete(tmp_path / "out" / "checkpoints")
    committed = manifest["commit"]["results"]["slave-001"]
    assert committed > 0
    shutil.copy(
        tmp_path / "out" / "results" / "slave-001-000000.parquet",
        tmp_path / "out" / "results" / f"slave-001-{committed + 50:06d}.parquet",
    )
    code, r = audited(spark, crashed)
    assert (
        code == 0 and r["run"] == f"live run, checkpoint {manifest['id']}, watermark {r['range'][len('start-') :]}"
    ), r
    assert r["expected"] == len(reference(settings, -np.inf, r["to"])) > 100
    # --follow beside the supervisor's recovery: each second of event time once the watermark passed it
    plan = load_plan(tmp_path / "run.toml")  # before run_cluster writes it again
    recovery = threading.Thread(
        target=lambda: run_cluster(tmp_path, 3, settings, wrapper=SUPERVISE, extra_args=["--recover"])
    )
    recovery.start()
    lines = []
    metrics = AuditMetrics("127.0.0.1:0", plan)
    try:
        code = audit.follow(spark, plan, -1.0, 1.0, 1.0, poll=0.2, log=lines.append, metrics=metrics)
        scraped = urllib.request.urlopen(metrics.url, timeout=10).read().decode()
    finally:
        metrics.close()
    recovery.join()
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert code == audit.EXACT and summary["checkpoints"]["recovered_from"] is not None, lines
    reports = [json.loads((tmp_path / "out" / "audit" / f"audit-{line.split()[0]}.json").read_text()) for line in lines]
    live = int(r["to"]) + 1  # ranges the crashed run's watermark had passed (ts start at -disorder)
    assert live >= 2 and [x["range"] for x in reports[:live]] == [f"{i}-{i + 1}" for i in range(-1, live - 1)]
    assert reports[-1]["range"].endswith("-end") and reports[-1]["run"] == "finished run"
    assert sum(x["found"] for x in reports) == summary["results"] == len(reference(settings))
    # the verdicts as metrics: every range counted exact, the pairs found add up to the run's results
    metric = lambda name, label="": float(re.search(rf"^{name}{label} (\S+)$", scraped, re.M).group(1))
    assert metric("streamjoin_audit_ranges_total", '{verdict="exact"}') == len(reports)
    assert metric("streamjoin_audit_ranges_total", '{verdict="different"}') == 0
    assert metric("streamjoin_audit_pairs_total", '{outcome="found"}') == summary["results"]
    assert metric("streamjoin_audit_pairs_total", '{outcome="missing"}') == 0
    assert metric("streamjoin_audit_input_tuples_total") == sum(x["input_tuples"] for x in reports)


def test_usage_mistakes_exit_2_with_a_message(tmp_path, capsys):
    cfg = write_config(tmp_path, {"join.window": 0.5})
    assert audit.main(["--config", str(cfg)]) == audit.USAGE
    assert "no summary.json" in capsys.readouterr().err
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "summary.json").write_text(json.dumps({"config": load_config(cfg)}))
    assert audit.main(["--config", str(cfg), "--set", "join.window=0.7"]) == audit.USAGE
    assert "join.window is 0.7 here but the run had 0.5" in capsys.readouterr().err
    assert audit.main(["--config", str(cfg), "--sample", "0"]) == audit.USAGE
    assert audit.main(["--config", str(cfg), "--from", "3", "--to", "1"]) == audit.USAGE
    assert audit.main(["--config", str(cfg), "--set", "join.nope=1"]) == audit.USAGE
    assert "unknown key join.nope" in capsys.readouterr().err
    follow = ["--config", str(cfg), "--follow", "--from", "0", "--metrics"]
    assert audit.main(follow + ["10.1.2.3:9465"]) == audit.USAGE
    assert "--metrics: '10.1.2.3:9465' is not a loopback address" in capsys.readouterr().err


def test_a_declared_streams_run_is_audited_from_the_streams_files_and_planted_faults_are_found(spark, tmp_path):
    """The clicks example (impressions: CSV files with ISO-8601 times and text keys; clicks: Parquet with
    timestamps) as a left join on 2 dispatchers, impressions with max_delay 0.1 s (so many are late): the audit
    reads the streams' own files, applies each stream's lateness rule within each dispatcher's share of the
    merged order, and finds the run exact, also over a range; then a result row removed, one duplicated and one
    with its key changed and one with its cost changed, each counted (exit 1)."""
    import tomllib

    data = tmp_path / "data"
    subprocess.run([sys.executable, str(ROOT / "examples/clicks/make_data.py"), str(data)], check=True)
    example = tomllib.loads((ROOT / "examples/clicks/clicks.toml").read_text())
    settings = {f"join.{k}": v for k, v in example["join"].items()}
    for name, spec in example["streams"].items():
        settings |= {f"streams.{name}.{k}": v for k, v in spec.items()}
    settings |= {
        "streams.impressions.path": str(data / "impressions"),
        "streams.clicks.path": str(data / "clicks.parquet"),
        "streams.impressions.max_delay": "0.1s",
        "join.type": "left",
        "cluster.dispatchers": 2,
    }
    run = run_cluster(tmp_path, 4, settings)
    assert run.returncode == 0, run.stderr
    assert run.summary["late"] > 1000
    stored = lambda: {rdd.id() for rdd in spark.sparkContext._jsc.sc().getRDDStorageInfo()}
    before = stored()
    code, report = audited(spark, run)
    assert code == 0 and report["verdict"] == "exact", report
    assert report["expected"] > 5000 and report["left_unmatched_expected"] > 1000
    # a few jobs whatever the files (several CSV files, a Parquet file) and dispatchers: each stream read once
    assert report["spark_jobs"] <= STREAMS_PLAN_JOBS, report
    start = 1795597200 + 600  # 09:10 to 09:20 of the example's day
    code, ranged = audited(spark, run, "--from", str(start), "--to", str(start + 600))
    assert code == 0 and 0 < ranged["expected"] < report["expected"], ranged
    files = sorted((run.out / "results").glob("*.parquet"))
    t = pq.read_table(files[0])
    pairs = pc.equal(t["kind"], "matched").to_numpy(zero_copy_only=False).nonzero()[0]
    keep = np.ones(t.num_rows, bool)
    keep[pairs[0]] = False  # removed
    for column, row, value in (("impressions_user_id", 2, "u_nobody"), ("clicks_cost", 3, 99.5)):  # changed
        cells = t[column].to_pylist()
        cells[pairs[row]] = value
        t = t.set_column(t.column_names.index(column), column, pa.array(cells, t.schema.field(column).type))
    pq.write_table(pa.concat_tables([t.filter(pa.array(keep)), t.slice(int(pairs[1]), 1)]), files[0])  # one twice
    code, planted = audited(spark, run)
    assert code == 1 and planted["verdict"] == "different"
    assert (planted["missing"], planted["extra"], planted["duplicates"], planted["payload_wrong"]) == (1, 0, 1, 2)
    reasons = pq.read_table(planted["diff"]).column("reason").to_pylist()
    assert any("impressions.user_id is u_nobody where its row has u_" in r for r in reasons), reasons
    assert any("clicks.cost is 99.5 where its row has" in r for r in reasons), reasons
    assert stored() <= before  # each audit freed the frames it kept


def test_the_view_of_the_clicks_example_equals_duckdb_and_its_audit_names_a_changed_or_missing_group(tmp_path, spark):
    """examples/clicks/clicks-per-ad.toml end to end: make_data.py, the cluster on 3 ranks, the merger and
    `--batch` as their command lines run them; the view is DuckDB's GROUP BY over its left join of the files:
    per ad, kind and minute of the impression, clicks (matched) and impressions without one, and the cost.  The
    audit of the same view (one run for both: control.audit's `--view` recomputes it from the streams' files)
    finds it exact (exit 0); then one group's count changed and another group removed in the view's newest
    snapshot are each found and named (exit 1), and a range holding neither of them is still exact."""
    data, out = tmp_path / "data", tmp_path / "out"
    subprocess.run([sys.executable, str(ROOT / "examples/clicks/make_data.py"), str(data)], check=True)
    config = ROOT / "examples/clicks/clicks-per-ad.toml"
    sets = [
        f"streams.impressions.path={data / 'impressions'}",
        f"streams.clicks.path={data / 'clicks.parquet'}",
        f"output.path={out}",
        "aggregate.flush_interval=0.3",
    ]
    args = ["--config", str(config), *(x for s in sets for x in ("--set", s))]
    env = mpi_env()
    run = [*args, "--set", "output.progress=0", "--set", "metrics.endpoint=127.0.0.1:0"]
    proc = subprocess.run(mpirun_command(3, run), env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert aggregate.main([*args, "--until-idle", str(ENDED_IDLE), "--trigger", "0.3"], spark) == 0
    assert aggregate.main([*args, "--batch"], spark) == 0
    cfg = load_config(config, sets)
    shown = "epoch_us(CAST(i.shown_at AS TIMESTAMPTZ))"
    on = f"i.user_id = c.user_id AND epoch_us(c.clicked_at) - {shown} BETWEEN 0 AND 30000000"
    want = (
        duckdb.sql(
            f"""SELECT impressions_ad_id, kind, window_start, count(*) AS count,
        sum(clicks_cost) AS sum_clicks_cost, avg(clicks_cost) AS avg_clicks_cost FROM (
            SELECT i.ad_id AS impressions_ad_id, c.cost AS clicks_cost,
            CASE WHEN c.click_id IS NULL THEN '{LEFT_UNMATCHED}' ELSE '{MATCHED}' END AS kind,
            {shown} // 60000000 * 60000000 AS window_start
            FROM read_csv('{data / "impressions"}/*.csv', all_varchar = true) i
            LEFT JOIN read_parquet('{data / "clicks.parquet"}') c ON {on}
        ) GROUP BY ALL"""
        )
        .arrow()
        .read_all()
    )
    want = want.set_column(0, "impressions_ad_id", want["impressions_ad_id"].cast(pa.int64()))
    clicks = pa.compute.sum(want.filter(pa.compute.equal(want["kind"], MATCHED))["count"]).as_py()
    assert clicks > 1000 and want.num_rows > 25 * 30
    for view in ("view", "view-batch"):
        assert_view_equals(aggregate.read_view(out / view), want, cfg)

    assert audit.main([*args, "--view", str(out / "view")], spark=spark) == audit.EXACT
    report = json.loads((out / "audit" / "view-start-end.json").read_text())
    assert report["groups"] > 25 * 30 and report["not_final"] == 0, report

    newest = sorted((out / "view").glob("view-*.parquet"))[-1]
    t = pq.read_table(newest)
    first = pc.min(t["window_start"]).cast(pa.int64()).as_py() // 1_000_000  # 09:00
    counts = t["count"].to_pylist()
    counts[3] += 1  # a changed count in a window of the first minute
    t = t.set_column(t.column_names.index("count"), "count", pa.array(counts, pa.int64()))
    gone = t.num_rows - 1  # a missing group in the last minute
    pq.write_table(t.slice(0, gone), newest)
    code = audit.main([*args, "--view", str(out / "view")], spark=spark)
    planted = json.loads((out / "audit" / "view-start-end.json").read_text())
    assert code == audit.DIFFERENT and (planted["missing"], planted["extra"], planted["different"]) == (1, 0, 1)
    evidence = pq.read_table(planted["diff"]).to_pylist()
    row = t.slice(3, 1).to_pylist()[0]
    changed = [e for e in evidence if e["problem"] == "different"]
    assert changed[0]["measure"] == "count" and changed[0]["view"] == str(row["count"]), evidence
    assert f"impressions_ad_id={row['impressions_ad_id']}, kind={row['kind']}" in changed[0]["group"]
    lost = t.slice(gone, 1).to_pylist()[0]
    assert any(
        e["problem"] == "missing" and f"impressions_ad_id={lost['impressions_ad_id']}," in e["group"] for e in evidence
    )
    between = ["--from", str(first + 600), "--to", str(first + 1200)]  # 09:10 to 09:20: neither planted row
    assert audit.main([*args, "--view", str(out / "view"), *between], spark=spark) == audit.EXACT
