"""Hot keys of the equi-join: the frequent-items sketch, the grid routing, the split on the slave, and the
cluster with a key holding 30% of both streams -- exact against the reference join, its grid spread out."""

from __future__ import annotations

import numpy as np
import pytest

from master.state.hot_key_router import FrequentKeys, HotKeyRouter
from common.workload import GeneratorSource
from protocol.config import ConfigError, load_config
from protocol.plan import compile_plan
from protocol.tuples import STREAM_R, STREAM_S, partition_of, tuple_dtype
from protocol.eventtime import NEG_INF
from slave.join import JoinModule
from tests.cluster.test_cluster import SMALL, check_exact

HOT = dict(
    SMALL,
    **{
        "generator.hot_share": 0.3,
        "generator.keys": 65536,
        "hotkeys.enabled": True,
        "epochs.reorganization": 0.5,
        "balance.enabled": False,
        "join.window": 0.3,
    },
)


def test_sketch_finds_every_key_above_its_bound_and_no_rare_one():
    rng = np.random.default_rng(1)
    sketch = FrequentKeys(16)
    keys = np.concatenate([np.full(3000, 5), np.full(1500, 9), rng.integers(100, 10**6, 20000)])
    for part in np.array_split(rng.permutation(keys), 37):
        sketch.update(part)
    heavy = dict(sketch.heavy(0.05))
    assert set(heavy) == {5, 9}
    n = len(keys)
    assert 3000 / n - 1 / 16 <= heavy[5] <= 3000 / n and 1500 / n - 1 / 16 <= heavy[9] <= 1500 / n
    assert len(sketch.keys) <= 16


def test_router_stores_each_s_once_and_copies_r_to_the_whole_grid():
    router = HotKeyRouter(8, 2, 4)
    first = router.promote(42, 3)
    rows = np.zeros(1000, tuple_dtype(40))
    rows["id"] = np.arange(1000)
    rows["key"] = np.where(np.arange(1000) % 2 == 0, 42, np.arange(1000))
    index, s_part = router.route(STREAM_S, rows)
    assert np.array_equal(index, np.arange(1000))
    assert set(s_part[rows["key"] == 42]) == {first, first + 1, first + 2}
    assert np.all(s_part[rows["key"] != 42] < 8)
    index, part = router.route(STREAM_R, rows)
    assert np.array_equal(np.bincount(index, minlength=1000), np.where(rows["key"] == 42, 3, 1))
    assert set(part[rows["key"][index] == 42]) == {first, first + 1, first + 2}


def test_split_moves_a_keys_window_into_its_grid_and_pairs_stay_exact():
    dt = tuple_dtype(40)
    m = JoinModule(dt, 4, (-10_000_000, 10_000_000), 8, 2, 64, 12)
    rng = np.random.default_rng(2)

    def rows(n, start):
        x = np.zeros(n, dt)
        x["id"] = start + np.arange(n)
        x["key"] = np.where(rng.random(n) < 0.5, 7, rng.integers(0, 20, n))
        x["ts"] = np.sort(rng.integers(0, 1_000_000, n))
        return x

    r1, s1, r2, s2 = rows(200, 0), rows(200, 0), rows(100, 1000), rows(100, 1000)
    got = m.process(r1, s1, NEG_INF)
    p = int(partition_of(np.array([7]), 4)[0])
    moved = m.split_hot_key(p, 7, 4, 3)
    n_r, n_s = int((r1["key"] == 7).sum()), int((s1["key"] == 7).sum())
    assert moved == n_r + n_s
    assert sum(len(m.groups[4 + j]) for j in range(3)) == 3 * n_r + n_s  # R copied to all three, S spread
    assert not (
        m.groups[p].buckets and any((w.rows["key"] == 7).any() for b in m.groups[p].buckets.values() for w in b)
    )
    router = HotKeyRouter(4, 1, 3)
    router.promote(7, 3)
    index, part = router.route(STREAM_R, r2)
    s_part = router.route(STREAM_S, s2)[1]
    cr, cs = r2[index], s2
    order_r, order_s = np.argsort(part, kind="stable"), np.argsort(s_part, kind="stable")
    parts = sorted(set(part) | set(s_part))
    table = np.array([[q, (part == q).sum(), (s_part == q).sum()] for q in parts])
    got2 = m.process(cr[order_r], cs[order_s], NEG_INF, table)
    all_r = np.concatenate([got["r_id"], got2["r_id"]])
    all_s = np.concatenate([got["s_id"], got2["s_id"]])
    pairs = np.sort(all_r * 2**32 + all_s)
    R, S = np.concatenate([r1, r2]), np.concatenate([s1, s2])
    ri, si = np.nonzero(R["key"][:, None] == S["key"][None, :])
    assert np.array_equal(pairs, np.sort(R["id"][ri] * 2**32 + S["id"][si]))


def test_generator_hot_share_is_a_single_key_of_both_streams():
    cfg = load_config(None, ["generator.hot_share=0.3", "generator.duration=2", "generator.keys=65536"])
    src = GeneratorSource(compile_plan(cfg).generator)
    c = src.next_chunk(10**6)
    for stream in (0, 1):
        share = np.mean(c.key[c.stream == stream] == src.hot_key)
        assert 0.28 < share < 0.33


@pytest.mark.parametrize("ranks,seed", [(4, 1), (5, 2)])
def test_a_key_with_30_percent_of_the_input_gets_a_grid_and_the_result_stays_exact(tmp_path, ranks, seed):
    # half SMALL's rate: a hot key's pairs grow with its rate squared, and its share, not its rate, makes the grid
    settings = dict(
        HOT, **{"generator.seed": seed, "generator.rate": 1500.0, "source.rate": 3000.0, "generator.duration": 4.0}
    )
    run, expected = check_exact(tmp_path, ranks, settings)
    hot = run.summary["hot_keys"]
    assert len(hot) == 1 and hot[0]["grid"] >= 2
    moved = [m for m in run.summary["balance"]["moves"] if m["reason"] == "hot key"]
    assert len(moved) == hot[0]["grid"] - 1  # every sub-group but the first went to another slave
    assert len({m["to"] for m in moved} | {hot[0]["owner"]}) == hot[0]["grid"]


def test_hot_keys_only_for_the_equi_join():
    with pytest.raises(ConfigError, match="hotkeys.enabled: only for"):
        load_config(None, ["hotkeys.enabled=true", "join.predicate=band"])


@pytest.mark.parametrize("join_type", ["inner", "left"])
def test_merge_gathers_the_grid_back_with_every_s_and_one_copy_of_each_r(join_type):
    """Inner: S spread, R copied.  Left: the other way round (each R once, with its matched flag)."""
    dt = tuple_dtype(40)
    m = JoinModule(dt, 4, (-10_000_000, 10_000_000), 8, 2, 64, 12, join_type=join_type)
    rng = np.random.default_rng(3)
    r, s = np.zeros(300, dt), np.zeros(300, dt)
    for x in (r, s):
        x["id"], x["ts"] = np.arange(300), np.sort(rng.integers(0, 1_000_000, 300))
        x["key"] = np.where(rng.random(300) < 0.5, 7, rng.integers(0, 20, 300))
    lonely = (r["key"] != 7) & (rng.random(300) < 0.5)
    r["key"][lonely] = 1000 + r["id"][lonely]  # R tuples without a partner: matched flags of both values
    m.process(r, s, NEG_INF)
    p = int(partition_of(np.array([7]), 4)[0])
    before = {
        w: np.sort(np.concatenate([b[i].rows["id"] for b in m.groups[p].buckets.values()])) for i, w in enumerate("rs")
    }
    flags = {int(i): int(f) for b in m.groups[p].buckets.values() for i, f in zip(b[0].rows["id"], b[0].matched)}
    spread = 0 if join_type == "left" else 1
    m.split_hot_key(p, 7, 4, 3)
    held = [
        np.concatenate([b[spread].rows["id"][b[spread].rows["key"] == 7] for b in m.groups[4 + j].buckets.values()])
        for j in range(3)
    ]
    assert sum(map(len, held)) == len(np.unique(np.concatenate(held))) == int((r, s)[spread]["key"].__eq__(7).sum())
    assert all(len(h) for h in held)  # spread over every sub-group, each tuple in one
    assert m.merge_hot_key(p, 7, 4, 3) == int((r["key"] == 7).sum() + (s["key"] == 7).sum())
    assert set(m.groups) == {p} | {q for q in range(4) if q in m.groups}  # the sub-groups are gone
    after = {
        w: np.sort(np.concatenate([b[i].rows["id"] for b in m.groups[p].buckets.values()])) for i, w in enumerate("rs")
    }
    assert all(np.array_equal(before[w], after[w]) for w in "rs")
    if join_type == "left":  # R's matched flags came back with their rows
        assert {
            int(i): int(f) for b in m.groups[p].buckets.values() for i, f in zip(b[0].rows["id"], b[0].matched)
        } == flags and 0 < sum(flags.values()) < len(flags)


def test_router_reuses_the_slot_of_a_demoted_key():
    router = HotKeyRouter(8, 2, 4)
    a = router.promote(1, 2)
    b = router.promote(2, 4)
    router.demote(1)
    c = router.promote(3, 3)
    assert c == a and b != a and sorted(router.hot) == [2, 3]


def hot_then_cold(tmp_path, join_type: str) -> tuple[tuple, dict]:
    """An input file whose key 7 holds 40% of both streams for 2 s, then 3 s of uniform keys, and the settings
    that give key 7 a grid and take it back: ((stream, ids, ts, keys), settings); window 0.1, max_delay 0.05."""
    from tests.cluster.test_cluster import write_csv

    rng = np.random.default_rng(8)
    n1, n2 = 9000, 9000
    ts = np.concatenate([np.sort(rng.random(n1) * 2.0), 2.0 + np.sort(rng.random(n2) * 3.0)])
    keys = np.concatenate([np.where(rng.random(n1) < 0.4, 7, rng.integers(0, 5000, n1)), rng.integers(0, 5000, n2)])
    stream, ids = rng.integers(0, 2, n1 + n2), np.arange(n1 + n2)
    write_csv(tmp_path / "hot-then-cold.csv", stream, ids, ts, keys)
    return (stream, ids, ts, keys), {
        "source.kind": "file",
        "source.path": str(tmp_path / "hot-then-cold.csv"),
        "source.rate": 4000.0,
        "join.window": 0.1,
        "join.max_delay": 0.05,
        "epochs.distribution": 0.1,
        "epochs.reorganization": 0.5,
        "hotkeys.enabled": True,
        "balance.enabled": False,
        "join.type": join_type,
    }


def check_hot_then_cold(run, data: tuple, join_type: str) -> tuple[np.ndarray, np.ndarray]:
    """The run of `hot_then_cold`'s input (`data`) gave exactly the reference's pairs and rows alone, each once;
    returns the reference's R and S rows alone."""
    from tests.reference import reference_outer, reference_pairs

    stream, ids, ts, keys = data
    assert run.returncode == 0, run.stderr
    expected, late = reference_pairs(stream, ids, ts, keys, 0.1, 0.05)
    got = run.pairs()
    assert len(np.unique(got)) == len(got) and np.array_equal(np.sort(got), expected)
    on = ~np.isin(stream * 2**40 + ids, late)
    _, alone, alone_s = reference_outer(expected, ids[on & (stream == 0)], ids[on & (stream == 1)], join_type)
    assert np.array_equal(run.alone("r"), alone) and np.array_equal(run.alone("s"), alone_s)
    return alone, alone_s


@pytest.mark.parametrize("join_type", ["inner", "left", "full"])
def test_a_key_hot_then_cold_gets_a_grid_and_gives_it_back_exactly(tmp_path, join_type):
    """Left: R spread over the grid and S copied (each R decided once), through split and merge.  Full: two
    grids, S spread with R guests and R spread with S guests, each row alone decided at its tuple's home."""
    from tests.runs import run_cluster

    data, settings = hot_then_cold(tmp_path, join_type)
    run = run_cluster(tmp_path, 4, settings)
    alone, alone_s = check_hot_then_cold(run, data, join_type)
    assert join_type == "inner" or len(alone) > 1000
    assert join_type != "full" or len(alone_s) > 1000
    events = [(h["key"], h["event"]) for h in run.summary["hot_keys"]]
    assert events == [(7, "split"), (7, "merge")], events
    split = run.summary["hot_keys"][0]
    assert len(split["groups"]) == split["grid"] * (2 if join_type == "full" else 1)  # a full join: two grids
    moves = [m["reason"] for m in run.summary["balance"]["moves"]]
    assert "hot key" in moves and "hot key cooled" in moves


@pytest.mark.parametrize(
    "k,join_type,fault",
    [
        (2, "inner", None),
        (3, "left", "1:checkpoint:6"),  # dispatcher 1 SIGKILLed as it begins checkpoint 6 (5 is complete)
        (2, "full", "3:batch-after-checkpoint:3"),  # a slave SIGKILLed: grids, guests and flags from the checkpoint
    ],
)
def test_several_dispatchers_split_and_merge_a_hot_key_at_one_fence_while_groups_move(tmp_path, k, join_type, fault):
    """Each dispatcher routes its share of key 7: rank 0 decides from their sketches summed, and every router
    changes at one fence (HOT_HOLD, HOT_READY, HOT_RELEASE) while balancing moves other groups (every slave a
    supplier and a consumer); with a crash, the restarted dispatchers take the key's grid from the checkpoint."""
    from tests.cluster.test_balance_cluster import CHURN
    from tests.cluster.test_recovery import SUPERVISE
    from tests.runs import run_cluster

    data, settings = hot_then_cold(tmp_path, join_type)
    settings.update({**CHURN, "balance.enabled": True, "cluster.dispatchers": k, "checkpoint.interval": 2})
    env = {"STREAMJOIN_JITTER": "0.005"}
    if fault:
        env["STREAMJOIN_FAULT"] = f"{fault}:{tmp_path / 'fault-fired'}"
    run = run_cluster(tmp_path, k + 3, settings, env=env, wrapper=SUPERVISE if fault else ())
    check_hot_then_cold(run, data, join_type)
    moves = {m["reason"] for m in run.summary["balance"]["moves"]}
    assert moves - {"hot key", "hot key cooled"}, moves  # other groups moved too
    if fault is None:
        assert [(h["key"], h["event"]) for h in run.summary["hot_keys"]] == [(7, "split"), (7, "merge")]
    else:  # split before the checkpoint resumed from (its grid restored on every dispatcher) or after it
        assert (tmp_path / "fault-fired").exists() and "restart 1 of" in run.stderr
        assert run.summary["checkpoints"]["recovered_from"] is not None
        assert "split out of partition-group" in run.stderr, run.stderr
