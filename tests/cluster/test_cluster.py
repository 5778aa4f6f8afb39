"""Differential tests: the cluster under mpirun against the reference join over the whole input."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from common.workload import generate_all
from protocol.config import load_config
from protocol.plan import compile_plan, load_plan
from protocol.output import read_tables
from tests.runs import run_cluster, write_input
from tests.reference import reference_pairs

SMALL = {
    "generator.duration": 4.0,
    "generator.rate": 3000.0,
    "generator.keys": 4096,
    "epochs.distribution": 0.2,
    "join.window": 0.5,
    "join.max_delay": 0.3,
}


def reference_for(settings: dict) -> tuple[np.ndarray, np.ndarray, int]:
    cfg = load_config(None, [f"{k}={v}" for k, v in settings.items() if k.startswith(("generator.", "source."))])
    data = generate_all(compile_plan(cfg).generator)
    pairs, late = reference_pairs(
        data.stream, data.id, data.ts, data.key, settings["join.window"], settings["join.max_delay"]
    )
    return pairs, late, len(data.ts)


def check_exact(tmp_path, ranks: int, settings: dict, **kw):
    expected, expected_late, n = reference_for(settings)
    run = run_cluster(tmp_path, ranks, settings, **kw)
    assert run.returncode == 0, run.stderr
    got = run.pairs()
    assert len(np.unique(got)) == len(got), "a result was emitted twice"
    missing = np.setdiff1d(expected, got)
    extra = np.setdiff1d(got, expected)
    assert len(missing) == 0 and len(extra) == 0, f"{len(missing)} missing, {len(extra)} extra of {len(expected)}"
    assert np.array_equal(run.late_ids(), expected_late)
    s = run.summary
    assert s["results"] == len(expected)
    assert s["input_total"] + s["late"] == n
    assert s["late"] == len(expected_late)
    return run, expected


@pytest.mark.parametrize("ranks", [2, 3, 5])
def test_uniform_keys_any_slave_count(tmp_path, ranks):
    settings = dict(SMALL, **{"generator.skew": 0.5, "generator.seed": ranks})
    run, expected = check_exact(tmp_path, ranks, settings)
    assert len(expected) > 1000
    processed = [v["tuples_processed"] for v in run.summary["slaves"].values()]
    assert len(processed) == ranks - 1 and min(processed) > 0
    # unpaced: the master takes its first batch before the slaves start importing, so before all are ready
    up = run.summary["startup"]
    assert 0 < up["first_tuple_seconds"] < up["ranks_ready_seconds"] < up["last_result_seconds"], up


@pytest.mark.parametrize(
    "workload",
    [
        # a few heavy hitters (at half SMALL's rate: their pairs grow with its square)
        {"generator.distribution": "zipf", "generator.zipf": 1.2, "generator.rate": 1500.0},
        {"generator.distribution": "uniform", "generator.keys": 32, "join.window": 0.05},  # high key duplication
    ],
)
def test_bench_workloads_zipf_and_high_duplication_join_exactly(tmp_path, workload):
    run, expected = check_exact(tmp_path, 3, dict(SMALL, **workload))
    assert len(expected) > 1000
    if workload["generator.distribution"] == "uniform":
        assert len(expected) > 3 * run.summary["input_total"]  # every tuple meets many partners of its key


def test_sixteen_slaves_oversubscribed_make_progress_and_stay_exact(tmp_path):
    # 17 ranks on a 2-core machine: waiting ranks must not spin, or the master starves
    settings = dict(SMALL, **{"generator.seed": 17, "source.rate": 6000.0, "partitioning.subgroups": 4})
    run, _ = check_exact(tmp_path, 17, settings)
    assert all(v["epochs"] > 1 for v in run.summary["slaves"].values())
    # start-up in the summary: from the launch to ranks ready, first tuple, last result; PSS of all 17 ranks
    up = run.summary["startup"]
    assert 0 < up["ranks_ready_seconds"] <= up["first_tuple_seconds"] < up["last_result_seconds"] < 170
    pss = up["pss_before_data_bytes"]
    assert sorted(map(int, pss)) == list(range(17)) and all(20 << 20 < v < 1 << 30 for v in pss.values()), pss
    slave_rss = {r: v["peak_rss_bytes"] for r, v in run.summary["slaves"].items()}
    assert all(pss[r] <= slave_rss[r] for r in slave_rss)  # shared pages counted once: at most the RSS
    # taken once all ranks are ready: the last rank, which imports beside rank 0, weighs as the others
    assert max(pss[r] for r in slave_rss) < 1.2 * min(pss[r] for r in slave_rss), pss
    assert "start-up: ranks ready" in run.stderr


def test_second_run_into_the_same_output_replaces_the_first(tmp_path):
    # the first run leaves many small result files; none of them may leak into the second run's output
    first = dict(
        SMALL, **{"generator.seed": 21, "generator.duration": 2.0, "output.flush_rows": 20, "source.rate": 8000.0}
    )
    assert run_cluster(tmp_path, 3, first).returncode == 0
    assert len(list((tmp_path / "out" / "results").iterdir())) > 4
    check_exact(
        tmp_path, 3, dict(first, **{"generator.seed": 22, "generator.duration": 1.0, "output.flush_rows": 500000})
    )


def test_one_hot_key_in_a_large_window_costs_time_not_memory(tmp_path):
    # half of both streams is one key and the window spans the whole input: ~6M results, most in one batch of
    # one slave (built whole, 100 bytes a pair: +600 MB); in chunks it needs no more memory than the other slave
    chunk_rows = 1 << 16
    settings = dict(
        SMALL,
        **{
            "generator.duration": 2.0,
            "generator.rate": 2500.0,
            "generator.hot_share": 0.5,
            "join.window": 5.0,
            "balance.enabled": False,
            "output.flush_rows": chunk_rows,
            "output.result_chunk_rows": chunk_rows,
        },
    )
    expected, expected_late, n = reference_for(settings)
    run = run_cluster(tmp_path, 3, settings)
    assert run.returncode == 0, run.stderr
    got = run.pairs()  # sorted: equal arrays are the same set, each pair once (np.setdiff1d takes a minute here)
    assert len(got) == len(expected) > 3_000_000 and np.array_equal(got, expected)
    assert np.array_equal(run.late_ids(), expected_late) and run.summary["input_total"] + len(expected_late) == n
    slaves = sorted(run.summary["slaves"].values(), key=lambda v: v["results"])
    cold, hot = slaves
    assert hot["peak_rss_bytes"] - cold["peak_rss_bytes"] < 200 << 20, (hot, cold)
    c = run.summary["result_chunks"]
    assert c["largest_batch_results"] == hot["largest_batch_results"] > len(expected) / 2
    assert c["chunked_batches"] >= 1 and c["chunks"] >= c["largest_batch_results"] / chunk_rows
    assert f"chunks of at most {chunk_rows:,} rows" in run.stderr


def test_heavy_skew_with_partition_tuning(tmp_path):
    # a few keys hold most tuples; tiny theta bounds force splits and directory doubling
    # (a window of 0.1 s and half SMALL's rate: the few hot keys' pairs grow with both)
    settings = dict(
        SMALL,
        **{
            "generator.skew": 0.9,
            "generator.keys": 256,
            "generator.seed": 7,
            "tuning.block_size": 8,
            "tuning.theta_min": 2,
            "tuning.theta_max": 6,
            "partitioning.partitions": 8,
            "join.window": 0.1,
            "generator.rate": 1500.0,
        },
    )
    run, expected = check_exact(tmp_path, 4, settings)
    assert run.summary["partition_splits"] > 0 and len(expected) > 10_000


def test_out_of_order_within_max_delay_is_all_joined(tmp_path):
    settings = dict(SMALL, **{"generator.disorder": 0.25, "generator.seed": 3})
    run, _ = check_exact(tmp_path, 3, settings)
    assert run.summary["late"] == 0


def test_late_tuples_set_aside_with_reason(tmp_path):
    settings = dict(SMALL, **{"generator.disorder": 1.0, "join.max_delay": 0.2, "generator.seed": 4})
    run, _ = check_exact(tmp_path, 3, settings)
    assert run.summary["late"] > 0


@pytest.mark.parametrize("window,epoch", [(0.02, 0.5), (3.0, 0.1)])
def test_window_smaller_and_larger_than_an_epoch(tmp_path, window, epoch):
    settings = dict(
        SMALL, **{"join.window": window, "epochs.distribution": epoch, "generator.seed": 5, "generator.disorder": 0.1}
    )
    check_exact(tmp_path, 3, settings)


def test_paced_source_with_subgroups(tmp_path):
    settings = dict(
        SMALL, **{"generator.duration": 2.0, "source.rate": 4000.0, "partitioning.subgroups": 2, "generator.seed": 6}
    )
    run, _ = check_exact(tmp_path, 5, settings)
    assert run.summary["wall_seconds"] >= 1.0  # 6000 tuples paced at 4000/s take at least 1.5 s
    assert run.summary["delay_seconds"]["p99"] < 5.0


def test_pacing_lag_counts_input_held_back_and_backlog_what_waits_in_the_buffers(tmp_path):
    """A slave (of two) that sleeps 1 s in each batch falls behind 0.5 s epochs: with mini-buffers that hold
    less than an epoch of input it holds ingest back (lag); with room for all the input ingest keeps pace and
    its tuples wait in the buffers instead (backlog).  The result set stays exact.  (That the drain after the
    input is no lag, and a whole step due is taken within a tick, is tested on the intake desk, whose clock a
    test sets: here a loaded host adds lag of its own.)"""
    # ingest steps of at most 200 tuples (33 ms at this rate): as at millions of tuples/s with the default step
    settings = dict(
        SMALL,
        **{
            "generator.duration": 2.0,
            "source.rate": 6000.0,
            "source.batch": 200,
            "epochs.distribution": 0.5,
            "balance.enabled": False,
            "generator.seed": 9,
        },
    )
    env = {"STREAMJOIN_STRAGGLER": "1:1.0"}
    run, _ = check_exact(tmp_path / "held", 3, dict(settings, **{"master.buffer_capacity": 2000}), env=env)
    assert run.summary["pacing_lag_max_seconds"] > 0.5
    run, _ = check_exact(tmp_path / "buffered", 3, settings, env=env)
    assert run.summary["backlog_max_seconds"] > 0.5, run.summary


def test_slaves_that_miss_their_slot_are_served_when_idle_and_stay_exact(tmp_path):
    # 5 ms distribution epochs: the fixed cost of a batch keeps each slave joining past its next slot, so it
    # is served the moment it reports, between slots; disorder makes the watermark lag the batches
    settings = dict(
        SMALL,
        **{
            "generator.duration": 2.0,
            "source.rate": 6000.0,
            "epochs.distribution": 0.005,
            "partitioning.subgroups": 2,
            "generator.disorder": 0.2,
            "generator.seed": 8,
            "balance.enabled": False,
            "output.flush_rows": 300,
        },
    )  # many files, written meanwhile
    run, _ = check_exact(tmp_path, 3, settings)
    assert all(v["slots_missed"] > 0 for v in run.summary["slaves"].values())
    parts = run.summary["delay_parts_seconds"]
    assert all(0 < parts[p]["p50"] <= parts[p]["p99"] for p in ("buffer", "transfer", "join"))


def write_csv(path, stream, ids, ts, keys):
    pacsv.write_csv(pa.table({"stream": np.where(stream == 0, "R", "S"), "id": ids, "ts": ts, "key": keys}), path)


def test_burst_then_quiet_splits_and_merges(tmp_path):
    # a dense second makes buckets split; the quiet seconds after it let them expire and merge back
    rng = np.random.default_rng(12)
    n_burst, n_quiet = 6000, 300
    ts = np.concatenate([np.sort(rng.random(n_burst)), 1.0 + np.sort(rng.random(n_quiet) * 4.0)])
    stream = rng.integers(0, 2, len(ts))
    keys = rng.integers(0, 300, len(ts))
    ids = np.arange(len(ts))
    write_csv(tmp_path / "burst.csv", stream, ids, ts, keys)
    settings = {
        "source.kind": "file",
        "source.path": str(tmp_path / "burst.csv"),
        "source.rate": 3000.0,
        "join.window": 0.2,
        "join.max_delay": 0.05,
        "epochs.distribution": 0.2,
        "tuning.block_size": 8,
        "tuning.theta_min": 2,
        "tuning.theta_max": 6,
        "partitioning.partitions": 4,
    }
    run = run_cluster(tmp_path, 3, settings)
    assert run.returncode == 0, run.stderr
    expected, expected_late = reference_pairs(stream, ids, ts, keys, 0.2, 0.05)
    assert np.array_equal(run.pairs(), expected)
    assert run.summary["partition_splits"] > 0 and run.summary["partition_merges"] > 0


def test_file_source_with_bad_rows(tmp_path):
    rng = np.random.default_rng(11)
    n = 4000
    stream = np.where(rng.random(n) < 0.5, "R", "S")
    ts = np.sort(rng.random(n) * 4.0) - rng.random(n) * 0.1
    keys = rng.integers(0, 50, n)
    ids = np.arange(n)
    table = pa.table(
        {
            "stream": stream.astype(object),
            "id": ids.astype(str).astype(object),
            "ts": ts.astype(str).astype(object),
            "key": keys.astype(str).astype(object),
        }
    )
    rows = table.to_pylist()
    rows[10]["ts"] = "soon"  # not a number
    rows[20]["key"] = "seven"  # not an integer
    rows[30]["stream"] = "Q"  # unknown stream
    rows[40]["ts"] = "nan"  # not finite
    rows[50]["id"] = rows[49]["id"]  # duplicate id (if same stream)
    rows[50]["stream"] = rows[49]["stream"]
    bad = pa.Table.from_pylist(rows)
    path = tmp_path / "in.csv"
    pacsv.write_csv(bad, path)
    settings = {
        "source.kind": "file",
        "source.path": str(path),
        "join.window": 0.2,
        "join.max_delay": 0.15,
        "epochs.distribution": 0.1,
        "source.batch": 500,
    }
    run = run_cluster(tmp_path, 3, settings)
    assert run.returncode == 0, run.stderr
    assert run.summary["rejected"] == 5
    keep = np.ones(n, dtype=bool)
    keep[[10, 20, 30, 40, 50]] = False
    expected, expected_late = reference_pairs(
        (stream == "S").astype(int)[keep], ids[keep], ts[keep], keys[keep], 0.2, 0.15
    )
    got = run.pairs()
    assert np.array_equal(got, expected)
    assert np.array_equal(run.late_ids(), expected_late)
    rejected = read_tables(run.out / "rejected").to_pylist()
    assert sorted(r["row"] for r in rejected) == [11, 21, 31, 41, 51]
    assert {r["column"] for r in rejected} == {"ts", "key", "stream", "id"}


def write_generated(path, settings: dict, row_group: int, bad_every: int) -> int:
    """The generated input of `settings` as a Parquet file of many row groups with bad rows inserted
    (tests.runs.write_input); returns how many."""
    cfg = load_config(None, [f"{k}={v}" for k, v in settings.items() if k.startswith("generator.")])
    inserted = write_input(path, generate_all(compile_plan(cfg).generator), row_group, bad_every)
    assert pq.ParquetFile(path).num_row_groups > 10
    return len(inserted)


@pytest.mark.parametrize("dispatchers", [1, 2])
def test_a_parquet_file_of_many_row_groups_streamed_joins_exactly(tmp_path, dispatchers):
    path = tmp_path / "in.parquet"
    inserted = write_generated(path, SMALL, row_group=1000, bad_every=2000)
    settings = dict(
        SMALL,
        **{"source.kind": "file", "source.path": str(path), "source.batch": 700, "cluster.dispatchers": dispatchers},
    )
    run, _ = check_exact(tmp_path, 2 + dispatchers, settings)
    assert run.summary["rejected"] == inserted
    assert len(read_tables(run.out / "rejected")) == inserted


def test_damage_found_during_the_run_ends_the_job_with_the_file_and_row(tmp_path):
    path = tmp_path / "in.csv"
    rows = "".join(f"{'RS'[i % 2]},{i},{i * 0.001},{i % 50}\n" for i in range(200_000))  # several 1 MiB blocks
    path.write_text("stream,id,ts,key\n" + rows + "R,1\n")
    run = run_cluster(tmp_path, 3, {"source.kind": "file", "source.path": str(path)}, timeout=120)
    assert run.returncode != 0
    assert "cannot be read as CSV at row" in run.stderr and "in.csv" in run.stderr


def test_a_timestamp_typed_parquet_file_joins_exactly(tmp_path):
    # the generated tuples with ts as timestamp[ns, UTC]: up to 499 ns beside each microsecond, rounded back
    data = generate_all(load_plan(None, [f"{k}={v}" for k, v in SMALL.items() if k.startswith("generator.")]).generator)
    ns = data.ts * 1000 + np.random.default_rng(5).integers(-499, 500, len(data.ts))
    path = tmp_path / "ts.parquet"
    pq.write_table(
        pa.table(
            {
                "stream": np.array(["R", "S"])[data.stream].astype(object),
                "id": data.id,
                "ts": pa.array(ns, pa.timestamp("ns", tz="UTC")),
                "key": data.key,
            }
        ),
        path,
        row_group_size=2000,
    )
    settings = dict(SMALL, **{"source.kind": "file", "source.path": str(path)})
    run = run_cluster(tmp_path, 3, settings)
    assert run.returncode == 0, run.stderr
    expected, expected_late = reference_pairs(
        data.stream, data.id, data.ts, data.key, SMALL["join.window"], SMALL["join.max_delay"]
    )
    assert len(expected) > 1000
    assert np.array_equal(run.pairs(), expected)
    assert np.array_equal(run.late_ids(), expected_late)
    assert run.summary["rejected"] == 0


def test_a_column_of_the_wrong_type_ends_the_run_before_it_starts_with_one_message(tmp_path):
    path = tmp_path / "typed.csv"
    path.write_text("stream,id,ts,key\n" + "".join(f"{'RS'[i % 2]},{i},{i * 0.01},u_{i % 7}\n" for i in range(1000)))
    run = run_cluster(tmp_path, 3, {"source.kind": "file", "source.path": str(path)}, timeout=120)
    assert run.returncode == 2, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, run.stderr
    assert "typed.csv" in errors[0] and "column key of type string" in errors[0] and "expected an integer" in errors[0]
    assert not (run.out / "results").exists() or read_tables(run.out / "results") is None
