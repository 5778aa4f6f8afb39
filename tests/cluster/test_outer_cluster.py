"""Outer, semi and anti joins on the real cluster: every row without a partner exactly once, across
moves, a crash with recovery, several dispatchers and key ranges (a full join's both sides copied); differential
against the inner reference join (tests/reference.py, `reference_outer`) and, for left, right and full, DuckDB's
outer join, late tuples removed."""

from __future__ import annotations

import numpy as np
import pyarrow.compute as pc
import pytest

from protocol.aggregation import aggregation
from protocol.config import load_config
from protocol.plan import compile_plan
from protocol.output import LEFT_MATCHED, LEFT_UNMATCHED, MATCHED, OUTER_RESULT_SCHEMA, RIGHT_UNMATCHED, read_tables
from common.workload import generate_all
from tests.runs import run_cluster
from protocol.predicates import time_bounds
from tests.reference import duckdb_outer, encode_pairs, reference_outer, reference_pairs, reference_theta_pairs
from tests.cluster.test_balance_cluster import FORCED_CHURN, straggler
from tests.cluster.test_cluster import SMALL
from tests.cluster.test_recovery import CKPT, SUPERVISE
from tests.unit.test_aggregate_logic import as_numpy_view, file_spec, merged_partials


def check_outer(tmp_path, ranks: int, settings: dict, **kw):
    """Run the cluster and compare each kind of row with the reference; returns the run."""
    join_type = settings["join.type"]
    cfg = load_config(None, [f"{k}={v}" for k, v in settings.items() if k.startswith(("generator.", "source."))])
    data = generate_all(compile_plan(cfg).generator)
    window, max_delay, predicate = settings["join.window"], settings["join.max_delay"], settings.get("join.predicate")
    pairs, late = reference_pairs(data.stream, data.id, data.ts, data.key, window, max_delay)
    if predicate in ("band", "less"):
        pairs = reference_theta_pairs(
            data.stream, data.id, data.ts, data.key, window, max_delay, predicate, settings.get("join.band", 0)
        )
    on = ~np.isin(data.stream.astype(np.int64) * 2**40 + data.id, late)
    want = reference_outer(pairs, data.id[on & (data.stream == 0)], data.id[on & (data.stream == 1)], join_type)
    if join_type in ("left", "right", "full"):  # the SQL outer join over the on-time tuples says the same
        r, s = on & (data.stream == 0), on & (data.stream == 1)
        lower, upper = time_bounds({"window": window})
        duck = duckdb_outer(
            data.id[r],
            data.ts[r],
            data.key[r],
            data.id[s],
            data.ts[s],
            data.key[s],
            lower,
            upper,
            predicate or "equal",
            settings.get("join.band", 0),
            join_type,
        )
        for name, w, d in zip(("pairs", "R rows alone", "S rows alone"), want, duck):
            assert np.array_equal(w, d), f"the references disagree on the {name}"
    run = run_cluster(tmp_path, ranks, settings, **kw)
    assert run.returncode == 0, run.stderr
    t = read_tables(run.out / "results")
    assert t.schema.equals(OUTER_RESULT_SCHEMA), t.schema
    kind = t["kind"].to_numpy(zero_copy_only=False)
    both = kind == MATCHED
    lone_r = (kind == LEFT_MATCHED) if join_type == "semi" else (kind == LEFT_UNMATCHED)
    lone_s = kind == RIGHT_UNMATCHED
    assert (both | lone_r | lone_s).all(), f"unexpected kinds {set(kind.tolist())}"
    r_null, s_null = (pc.is_null(t[c]).to_numpy(zero_copy_only=False) for c in ("r_id", "s_id"))
    assert not r_null[both | lone_r].any() and not s_null[both | lone_s].any()
    assert r_null[lone_s].all() and s_null[lone_r].all()  # the missing side is null, all its columns
    assert all(pc.is_null(t[c]).to_numpy(zero_copy_only=False)[lone_r].all() for c in ("s_key", "s_ts", "s_value"))
    got = (
        encode_pairs(t["r_id"].filter(both).to_numpy(), t["s_id"].filter(both).to_numpy()),
        np.sort(t["r_id"].filter(lone_r).to_numpy()),
        np.sort(t["s_id"].filter(lone_s).to_numpy()),
    )
    for name, g, w in zip(("pairs", "R rows alone", "S rows alone"), got, want):
        assert len(np.unique(g)) == len(g), f"{name}: {len(g) - len(np.unique(g))} emitted twice"
        missing, extra = np.setdiff1d(w, g), np.setdiff1d(g, w)
        assert len(missing) == 0 and len(extra) == 0, f"{name}: {len(missing)} missing, {len(extra)} extra of {len(w)}"
    assert np.array_equal(run.late_ids(), late)
    assert run.summary["results"] == t.num_rows
    return run, want


def test_full_join_stays_exact_while_groups_move(tmp_path):
    settings = dict(
        SMALL,
        **{
            **FORCED_CHURN,
            "join.type": "full",
            "generator.duration": 3.0,
            "generator.rate": 4000.0,
            "generator.disorder": 0.2,
            "generator.seed": 41,
            "tuning.block_size": 8,
            "tuning.theta_min": 2,
            "tuning.theta_max": 8,
        },
    )
    run, want = check_outer(tmp_path, 3, settings, env=straggler(1))
    assert run.summary["balance"]["moves"] and all(len(w) > 100 for w in want)  # a busy host may make only one


def test_left_join_recovers_from_a_killed_slave_without_losing_or_repeating_an_unmatched_row(tmp_path):
    settings = dict(CKPT, **{"join.type": "left", "generator.seed": 4})
    env = {"STREAMJOIN_FAULT": f"2:batch-after-checkpoint:2:{tmp_path / 'fault-fired'}"}
    run, want = check_outer(tmp_path, 3, settings, wrapper=SUPERVISE, env=env)
    assert (tmp_path / "fault-fired").exists() and "restart 1 of 3" in run.stderr
    assert run.summary["checkpoints"]["recovered_from"] is not None
    assert len(want[1]) > 100


def test_full_join_with_a_hot_key_recovers_from_a_killed_slave_deciding_each_row_once(tmp_path):
    """A hot key's two grids (S spread with R guests, R spread with S guests) across a SIGKILLed slave: the
    restarted slaves take their sub-groups (guests and flags too) from the checkpoint, the master its grid."""
    settings = dict(
        CKPT,
        **{
            "join.type": "full",
            "generator.seed": 6,
            "generator.rate": 1500.0,  # half, paced at half: the same wall time, a quarter of the hot pairs
            "source.rate": 3000.0,
            "generator.hot_share": 0.3,
            "generator.keys": 65536,
            "hotkeys.enabled": True,
            "hotkeys.threshold": 0.15,
            "epochs.reorganization": 0.3,
            "balance.enabled": False,
        },
    )
    env = {"STREAMJOIN_FAULT": f"2:batch-after-checkpoint:1:{tmp_path / 'fault-fired'}"}
    run, want = check_outer(tmp_path, 4, settings, wrapper=SUPERVISE, env=env)
    assert (tmp_path / "fault-fired").exists() and "restart 1 of 3" in run.stderr
    assert run.summary["checkpoints"]["recovered_from"] is not None
    # the key was split in the killed run or the restarted one (a split before the checkpoint the restart resumes
    # from is in its state, not in its summary's log)
    assert "split out of partition-group" in run.stderr, run.stderr
    assert all(len(w) > 100 for w in want), [len(w) for w in want]


@pytest.mark.parametrize(
    "join_type,extra",
    [
        # impressions without a click per key and window: the anti join's rows aggregated
        ("anti", {"cluster.dispatchers": 2, "aggregate.enabled": True, "aggregate.window": 0.5}),
        # key ranges: left and semi copy S into the ranges (each R stored once); right copies R as inner does (the
        # matrix draws it, tests/matrix.py)
        ("left", {"join.predicate": "band", "join.band": 3, "generator.keys": 8192}),
        ("semi", {"join.predicate": "less", "generator.rate": 400.0, "join.window": 0.1}),
    ],
)
def test_semi_anti_and_left_joins_are_exact_with_key_ranges_and_dispatchers(tmp_path, join_type, extra):
    settings = dict(
        SMALL,
        **{"join.type": join_type, "generator.duration": 2.0, "generator.seed": 43, "generator.disorder": 0.2, **extra},
    )
    run, want = check_outer(tmp_path, 3, settings)
    kept = [w for w, emitted in zip(want, (join_type == "left", True, False)) if emitted]
    assert all(len(w) > 50 for w in kept)  # the rows this type emits are there to be checked
    if settings.get("aggregate.enabled"):  # the merged partials are those of the anti rows, per r_key and window
        spec = file_spec(f'join.type="{join_type}"', f"aggregate.window={settings['aggregate.window']}")
        view = merged_partials([read_tables(run.out / "aggregates")], spec)
        assert set(view["kind"].to_pylist()) == {LEFT_UNMATCHED}
        t = read_tables(run.out / "results")
        key, ts, value = (t[c].to_numpy() for c in ("r_key", "r_ts", "r_value"))
        assert len(np.unique(t["r_id"].to_numpy())) == len(want[1]) == t.num_rows
        start = np.floor(ts / 0.5) * 0.5
        cells = {(int(k), float(w)): [] for k, w in zip(key, start)}
        for k, w, v in zip(key.tolist(), start.tolist(), value.tolist()):
            cells[(k, w)].append(v)
        got = {
            (k, w): (c, s_, lo, hi)
            for k, w, c, s_, lo, hi in zip(
                *(as_numpy_view(view, spec)[c].tolist() for c in ("key", "window_start", "count", "sum", "min", "max"))
            )
        }
        assert set(got) == set(cells)
        for cell, values in cells.items():
            c, s_, lo, hi = got[cell]
            assert (c, lo, hi) == (len(values), min(values), max(values)) and abs(s_ - sum(values)) < 1e-6


#: key ranges with a full join: both sides copied, each row alone decided at its tuple's home range only
RANGED_FULL = {
    "join.type": "full",
    "generator.duration": 3.0,
    "generator.seed": 47,
    "generator.disorder": 0.2,
    "tuning.block_size": 8,
    "tuning.theta_min": 2,
    "tuning.theta_max": 8,
}


@pytest.mark.parametrize(
    "ranks,extra",
    [
        # ranges moving between the slaves (the first straggles), two dispatchers routing by rank 0's ranges
        (
            4,
            {
                **FORCED_CHURN,
                "join.predicate": "band",
                "join.band": 3,
                "generator.keys": 2048,
                "join.window": 0.1,
                "generator.distribution": "uniform",
                "cluster.dispatchers": 2,
                "source.rate": 6000.0,
            },
        ),
        # less: R copied to every range from its own up, S to every range up to its own; ranges moving
        (
            3,
            {
                **FORCED_CHURN,
                "join.predicate": "less",
                "generator.rate": 1000.0,
                "join.window": 0.02,
                "source.rate": 3000.0,
            },
        ),
    ],
)
def test_full_join_with_key_ranges_is_exact_while_ranges_move(tmp_path, ranks, extra):
    settings = dict(SMALL, **{**RANGED_FULL, **extra})
    run, want = check_outer(tmp_path, ranks, settings, env=straggler(extra.get("cluster.dispatchers", 1)))
    assert len(run.summary["balance"]["moves"]) >= 1 and all(len(w) > 50 for w in want), [len(w) for w in want]


def test_full_band_join_recovers_from_a_killed_slave_deciding_each_row_once(tmp_path):
    """A slave SIGKILLed under the supervisor: the restarted slaves take their groups (guest copies and their
    flags too) from the checkpoint, and the master its key ranges and buffered copies."""
    settings = dict(
        CKPT,
        **{
            **RANGED_FULL,
            "join.predicate": "band",
            "join.band": 3,
            "generator.keys": 2048,
            "join.window": 0.1,
            "generator.distribution": "uniform",
            "generator.seed": 5,
        },
    )
    env = {"STREAMJOIN_FAULT": f"2:batch-after-checkpoint:2:{tmp_path / 'fault-fired'}"}
    run, want = check_outer(tmp_path, 3, settings, wrapper=SUPERVISE, env=env)
    assert (tmp_path / "fault-fired").exists() and "restart 1 of 3" in run.stderr
    assert run.summary["checkpoints"]["recovered_from"] is not None
    assert all(len(w) > 50 for w in want), [len(w) for w in want]


@pytest.mark.parametrize("join_type", ["left", "right", "full", "semi", "anti"])
def test_every_type_takes_copies_and_aggregates_its_rows_in_their_kind(join_type):
    for predicate in ("band", "less"):  # full copies both sides and decides each tuple at its home range
        load_config(None, [f'join.type="{join_type}"', f'join.predicate="{predicate}"'])
    load_config(None, [f'join.type="{join_type}"', "hotkeys.enabled=true"])  # full: at its home sub-group
    load_config(None, [f'join.type="{join_type}"', 'output.zmq_endpoint="tcp://127.0.0.1:5599"'])  # punctuated
    cfg = load_config(None, [f'join.type="{join_type}"', "aggregate.enabled=true", 'aggregate.value="s_value"'])
    assert aggregation(cfg).groups == ("r_key", "kind")  # pairs and rows alone apart
