"""Differential tests of slave/join.py: JoinModule.process over many epochs against tests/reference.py."""

from __future__ import annotations

import numpy as np
import pytest

from master.state.hot_key_router import HotKeyRouter
from master.state.ranges import KeyRanges, copy_offsets
from protocol.tuples import STREAM_R, STREAM_S, partition_of, tuple_dtype
from slave.join import JoinModule
from protocol.eventtime import NEG_INF, POS_INF
from protocol.predicates import JOIN_TYPES, key_distance
from slave.mover import decode_group, decode_move, encode_group, encode_move
from slave.window import DECIDED, GUEST
from tests.reference import (
    bounds,
    duckdb_outer,
    encode_pairs,
    late_flags,
    micros,
    reference_outer,
    reference_pairs,
    reference_theta_pairs,
)

DT = tuple_dtype(64)


def make_input(rng, n, n_keys, disorder, step=1 / 8, decimals=None):
    """Interleaved arrival order: stream, id, ts in seconds (multiples of `step`: exact |dt| == window cases;
    with `decimals`, rounded to that many, as a file would hold them), key."""
    stream = (rng.random(n) < 0.45).astype(np.int64)
    ids = rng.permutation(n).astype(np.int64) + 1000  # unique, not in arrival order
    base = np.cumsum(rng.random(n) < 0.05) * step  # many equal ts, slowly increasing
    ts = base - np.round(rng.uniform(0, disorder, n) / step) * step
    if decimals is not None:
        ts = np.round(ts, decimals)
    # skewed keys whose hot set drifts with time, so buckets grow and later shrink
    hot = rng.random(n) < 0.5
    keys = np.where(hot, (rng.zipf(1.6, n) % 8) + (base // 3).astype(np.int64) * 100, rng.integers(0, n_keys, n))
    return stream, ids, ts, keys


def run_module(module, stream, ids, ts, keys, max_delay, rng, max_epoch=400):
    """Feed the input in random epochs; ts (seconds) and max_delay are converted to microseconds here."""
    late = late_flags(ts, max_delay)
    ts, max_delay = micros(ts), micros(max_delay)
    out, running, pos, n = [], NEG_INF, 0, len(ts)
    ts_of, keys_of = np.zeros(ids.max() + 1, np.int64), np.zeros(ids.max() + 1, np.int64)
    ts_of[ids], keys_of[ids] = ts, keys
    while pos < n:
        k = int(rng.integers(0, max_epoch))
        sl = slice(pos, min(n, pos + k))
        pos = sl.stop
        if len(ts[sl]):
            running = max(running, int(ts[sl].max()))
        ok = ~late[sl]
        sides = []
        for st in (STREAM_R, STREAM_S):
            sel = ok & (stream[sl] == st)
            r = np.zeros(int(sel.sum()), dtype=DT)
            r["id"], r["ts"], r["key"] = ids[sl][sel], ts[sl][sel], keys[sl][sel]
            r["value"], r["arrival"] = st, r["id"] + 0.25
            sides.append(r)
        stamps = []
        res = module.process(sides[0], sides[1], running - max_delay, stamps=stamps)
        # one stamp per partition-group with fresh tuples: results so far and when, both non-decreasing
        touched = np.unique(partition_of(np.concatenate([sides[0]["key"], sides[1]["key"]]), module.partitions))
        assert len(stamps) == len(touched)
        if stamps:
            counts, times = np.array(stamps).T
            assert counts[-1] == len(res) and (np.diff(counts) >= 0).all() and (np.diff(times) >= 0).all()
        assert np.all(res["r_value"] == STREAM_R) and np.all(res["s_value"] == STREAM_S)
        assert np.all(res["r_key"] == res["s_key"])
        for side in "rs":  # every column holds the joined tuple's field
            assert np.array_equal(res[f"{side}_ts"], ts_of[res[f"{side}_id"]])
            assert np.array_equal(res[f"{side}_key"], keys_of[res[f"{side}_id"]])
            assert np.array_equal(res[f"{side}_arrival"], res[f"{side}_id"] + 0.25)
        out.append(encode_pairs(res["r_id"], res["s_id"]))
    return np.sort(np.concatenate(out))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "window,max_delay",
    [
        (0.5, 0.375),
        (0.0, 0.25),
        (2.0, 1.0),
        ((-0.25, 1.0), 0.375),
        ((0.0, 0.5), 0.25),
        ((-1.0, -0.25), 0.5),
        ((0.25, 0.75), 0.375),
    ],
)
def test_process_matches_reference(seed, window, max_delay):
    """A window w or time bounds (lower, upper) (join.lower / join.upper, one-sided and negative too)."""
    rng = np.random.default_rng(seed)
    n = 6000
    stream, ids, ts, keys = make_input(rng, n, n_keys=300, disorder=max_delay * 1.3)
    expected, late_ids = reference_pairs(stream, ids, ts, keys, window, max_delay)
    assert len(late_ids) > 0  # some input is late and must not join
    module = JoinModule(DT, partitions=3, bounds=bounds(window), block_size=4, theta_min=2, theta_max=6, max_depth=8)
    got = run_module(module, stream, ids, ts, keys, max_delay, rng)
    assert len(np.unique(got)) == len(got), "a pair was produced twice"
    assert len(expected) > 1000
    missing = np.setdiff1d(expected, got)
    extra = np.setdiff1d(got, expected)
    assert len(missing) == 0 and len(extra) == 0, f"{len(missing)} missing, {len(extra)} extra pairs"
    np.testing.assert_array_equal(got, expected)
    # tuning and expiry really happened
    assert module.splits > 0 and module.merges > 0
    stored_r, stored_s = module.stored()
    assert stored_r + stored_s < n / 2


@pytest.mark.parametrize("seed", range(2))
def test_process_one_tuple_per_epoch_and_empty_epochs(seed):
    rng = np.random.default_rng(100 + seed)
    n = 400
    stream, ids, ts, keys = make_input(rng, n, n_keys=20, disorder=0.5)
    window, max_delay = 0.5, 0.375
    expected, _ = reference_pairs(stream, ids, ts, keys, window, max_delay)
    module = JoinModule(DT, partitions=2, bounds=bounds(window), block_size=2, theta_min=1, theta_max=3, max_depth=6)
    got = run_module(module, stream, ids, ts, keys, max_delay, rng, max_epoch=3)  # sizes 0, 1, 2
    assert len(expected) > 50
    np.testing.assert_array_equal(got, expected)


def test_single_hot_key_many_epochs():
    rng = np.random.default_rng(9)
    n = 3000
    stream, ids, ts, _ = make_input(rng, n, n_keys=1, disorder=0.25)
    keys = np.full(n, 5)
    expected, _ = reference_pairs(stream, ids, ts, keys, 0.25, 0.25)
    module = JoinModule(
        DT, partitions=4, bounds=(-250_000, 250_000), block_size=4, theta_min=1, theta_max=3, max_depth=6
    )
    got = run_module(module, stream, ids, ts, keys, 0.25, rng)
    np.testing.assert_array_equal(got, expected)
    assert module.splits == 0
    assert all(pg.directory.global_depth == 0 for pg in module.groups.values())


def test_empty_process_returns_empty_typed_arrays():
    module = JoinModule(
        DT, partitions=4, bounds=(-1_000_000, 1_000_000), block_size=4, theta_min=1, theta_max=4, max_depth=4
    )
    empty = np.zeros(0, dtype=DT)
    res = module.process(empty, empty, 0)
    assert len(res) == 0 and res["r_id"].dtype == np.int64 and res["s_ts"].dtype == np.int64
    one = np.zeros(1, dtype=DT)
    assert len(module.process(one, empty, 0)) == 0 and module.stored() == (1, 0)
    other = np.zeros(1, dtype=DT)
    other["id"] = 7
    res = module.process(empty, other, 0)
    assert len(res) == 1 and int(res["r_id"][0]) == 0 and int(res["s_id"][0]) == 7
    assert module.stored() == (1, 1)
    # expiry keeps a tuple exactly `window` before the watermark (it can still join a tuple at the watermark)
    assert len(module.process(empty, empty, 1_000_000)) == 0 and module.stored() == (1, 1)
    assert len(module.process(empty, empty, 1_000_001)) == 0 and module.stored() == (0, 0)  # all expire


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("window,decimals", [(0.1, 3), (1.0, 3), (0.001, 6)])
def test_decimal_timestamps_exactly_one_window_apart(seed, window, decimals):
    """Millisecond (and microsecond) decimals, many pairs exactly one window apart, whose float64
    difference misses the window: every such pair joins, none is expired before its partner comes."""
    rng = np.random.default_rng(200 + seed)
    n = 4000
    step = window / 4 if decimals == 3 else 1e-6 * 250
    stream, ids, ts, keys = make_input(rng, n, n_keys=40, disorder=window, step=step, decimals=decimals)
    # epoch seconds with decimals no binary fraction holds: a float's ulp is 0.24 us there
    ts = np.round(ts + (1_700_000_000.123 if decimals == 3 else 1_000.000123), decimals)
    max_delay = window
    expected, _ = reference_pairs(stream, ids, ts, keys, window, max_delay)
    t = micros(ts)
    at_window = {int(x) for x in np.flatnonzero(np.abs(t[:, None][:400] - t[None, :400]) == micros(window))}
    assert at_window, "no pair exactly one window apart: the test would prove nothing"
    if window != int(window):  # floats miss some (with a whole window, x + 1 is exact where x is not)
        float_says = np.abs(ts[:, None][:400] - ts[None, :400]) <= window
        assert not float_says[np.abs(t[:, None][:400] - t[None, :400]) == micros(window)].all()
    module = JoinModule(DT, partitions=3, bounds=bounds(window), block_size=4, theta_min=2, theta_max=6, max_depth=8)
    got = run_module(module, stream, ids, ts, keys, max_delay, rng, max_epoch=60)
    np.testing.assert_array_equal(got, expected)


def run_outer(module, stream, ids, ts, keys, max_delay, rng, move=False):
    """Feed the input in random epochs, then the end of input (watermark +inf); returns (encoded pairs, ids of
    R rows emitted alone, ids of S rows emitted alone), each row as often as it was emitted.  With `move`, every
    partition-group goes through a move's encoding (slave.mover) now and then: the matched flags must travel."""
    late = late_flags(ts, max_delay)
    ts, max_delay = micros(ts), micros(max_delay)
    pairs, lone_r, lone_s, running, pos, end = [], [], [], NEG_INF, 0, False
    while not end:
        end = pos == len(ts)  # then one more epoch without tuples: the end of input
        sl = slice(pos, min(len(ts), pos + int(rng.integers(0, 300))))
        pos = sl.stop
        if len(ts[sl]):
            running = max(running, int(ts[sl].max()))
        sides = []
        for st in (STREAM_R, STREAM_S):
            sel = ~late[sl] & (stream[sl] == st)
            r = np.zeros(int(sel.sum()), dtype=DT)
            r["id"], r["ts"], r["key"], r["arrival"] = ids[sl][sel], ts[sl][sel], keys[sl][sel], 1.0
            sides.append(r)
        res = module.process(sides[0], sides[1], POS_INF if end else running - max_delay)
        pairs.append(encode_pairs(res["r_id"], res["s_id"]))
        lone_r.append(module.lone_r["id"])
        lone_s.append(module.lone_s["id"])
        if move and rng.random() < 0.3:
            for p in list(module.groups):
                module.install(*decode_move(encode_move(p, module.extract(p), 0), module.new_group)[:2])
    assert module.stored() == (0, 0)  # the end of input decided every row
    return tuple(np.sort(np.concatenate(x)) for x in (pairs, lone_r, lone_s))


@pytest.mark.parametrize("window", [0.25, (-0.5, 0.125), (0.0, 0.25)])
@pytest.mark.parametrize("join_type", JOIN_TYPES)
@pytest.mark.parametrize("predicate", ["equal", "band", "less"])
def test_outer_semi_anti_match_the_reference(join_type, predicate, window):
    """Every type x predicate x window (symmetric, asymmetric, one-sided): the pairs, and each row without a
    partner (semi: with one) exactly once; late tuples never.  Band and less run in one group (the module alone,
    no copies; a full join over several ranges with copies of both sides:
    test_full_join_with_key_ranges_decides_each_row_at_its_home_once)."""
    rng = np.random.default_rng([3, JOIN_TYPES.index(join_type), len(predicate)])
    n, max_delay = 3000, 0.375
    stream, ids, ts, keys = make_input(rng, n, n_keys=400 if predicate == "equal" else 3000, disorder=0.5)
    if predicate == "equal":
        inner, late_ids = reference_pairs(stream, ids, ts, keys, window, max_delay)
    else:
        inner = reference_theta_pairs(stream, ids, ts, keys, window, max_delay, predicate, band=2)
        late_ids = np.flatnonzero(late_flags(ts, max_delay))
    on = ~late_flags(ts, max_delay)
    want = reference_outer(inner, ids[on & (stream == 0)], ids[on & (stream == 1)], join_type)
    assert len(late_ids) and len(inner) > 100
    emitted = (
        join_type in ("inner", "left", "right", "full"),
        join_type in ("left", "full", "semi", "anti"),
        join_type in ("right", "full"),
    )
    assert [len(w) > 20 for w in want] == list(emitted), "the input has rows of every kind the type emits"
    module = JoinModule(
        DT,
        partitions=3 if predicate == "equal" else 1,
        bounds=bounds(window),
        block_size=4,
        theta_min=2,
        theta_max=6,
        max_depth=8,
        predicate=predicate,
        band=2,
        join_type=join_type,
        chunk_rows=64,
    )  # the flags are set slice by slice of the pairs (output.result_chunk_rows)
    got = run_outer(module, stream, ids, ts, keys, max_delay, rng, move=True)
    for name, g, w in zip(("pairs", "R rows", "S rows"), got, want):
        assert len(np.unique(g)) == len(g), f"{join_type}: a {name[:-1]} was emitted twice"
        np.testing.assert_array_equal(g, w, err_msg=f"{join_type} {predicate}: {name}")


def test_an_unmatched_row_comes_out_when_no_on_time_tuple_can_reach_it_not_before_and_once():
    """A full join's row alone is decided when ts < watermark - window (the expiry rule, per row, not per block):
    here two R rows share a block, the older comes out first, the S row (another key) with it."""
    module = JoinModule(
        DT,
        partitions=1,
        bounds=(-1_000_000, 1_000_000),
        block_size=4,
        theta_min=1,
        theta_max=4,
        max_depth=0,
        join_type="full",
    )
    r, s = np.zeros(2, dtype=DT), np.zeros(1, dtype=DT)
    r["id"], r["ts"], s["ts"], s["key"] = [1, 2], [5_000_000, 7_000_000], 5_000_000, 1  # never a pair
    module.process(r, s, 0)
    module.process(r[:0], s[:0], 6_000_000)  # exactly a window later: a tuple at the watermark could still join
    assert len(module.lone_r) == len(module.lone_s) == 0
    module.process(r[:0], s[:0], 6_000_001)
    assert module.lone_r["id"].tolist() == [1] and len(module.lone_s) == 1
    assert module.stored() == (2, 0)  # R 1 waits in its block for R 2, decided already
    module.process(r[:0], s[:0], 6_500_000)
    assert len(module.lone_r) == len(module.lone_s) == 0
    module.process(r[:0], s[:0], POS_INF)
    assert module.lone_r["id"].tolist() == [2] and len(module.lone_s) == 0 and module.stored() == (0, 0)


@pytest.mark.parametrize(
    "lower,upper",
    [(-200_000, 1_000_000), (0, 1_000_000), (-1_000_000, -500_000), (300_000, 800_000), (-1_000_000, 1_000_000)],
)
def test_each_stream_expires_and_is_final_at_its_own_threshold(lower, upper):
    """With bounds [lower, upper] and watermark W, R tuple r can still meet a later S (ts >= W) while r.ts >= W -
    upper, S tuple s a later R while s.ts >= W + lower: a full join keeps each exactly until then (a tuple
    exactly at its threshold stays) and writes its row alone one microsecond of watermark later, not before."""
    module = JoinModule(
        DT, partitions=1, bounds=(lower, upper), block_size=4, theta_min=1, theta_max=4, max_depth=0, join_type="full"
    )
    r, s = np.zeros(1, dtype=DT), np.zeros(1, dtype=DT)
    r["id"], r["ts"], s["id"], s["ts"], s["key"] = 1, 5_000_000, 2, 5_000_000, 1  # other keys: never a pair
    module.process(r, s, NEG_INF)
    r_last, s_last = 5_000_000 + upper, 5_000_000 - lower  # the last watermarks at which each is kept
    seen = {"r": [], "s": []}
    for w in sorted({r_last - 1, r_last, r_last + 1, s_last - 1, s_last, s_last + 1}):
        module.process(r[:0], s[:0], w)
        seen["r"] += [w] * len(module.lone_r)
        seen["s"] += [w] * len(module.lone_s)
        assert module.stored() == (int(w <= r_last), int(w <= s_last)), f"watermark {w}"
    assert seen == {"r": [r_last + 1], "s": [s_last + 1]}


def test_a_later_tuple_at_the_watermark_still_joins_at_both_bounds():
    """The thresholds are no tighter than the join test: with bounds [-0.2 s, 1 s] and W = 5.2 s, R 1 (5.0 s,
    kept: 5.0 >= W - upper) joins S 3 arriving at 6.0 s, exactly upper after it, and S 2 (5.0 s, kept: 5.0 >= W +
    lower) joins R 4 arriving at W, exactly -lower before it."""
    module = JoinModule(
        DT, partitions=1, bounds=(-200_000, 1_000_000), block_size=4, theta_min=1, theta_max=4, max_depth=0
    )
    r, s = np.zeros(2, dtype=DT), np.zeros(2, dtype=DT)
    r["id"], r["ts"], r["key"] = [1, 4], [5_000_000, 5_200_000], [1, 2]
    s["id"], s["ts"], s["key"] = [2, 3], [5_000_000, 6_000_000], [2, 1]
    assert len(module.process(r[:1], s[:1], NEG_INF)) == 0
    module.process(r[:0], s[:0], 5_200_000)
    assert module.stored() == (1, 1)
    got = module.process(r[1:], s[1:], 5_200_000)
    assert sorted(zip(got["r_id"].tolist(), got["s_id"].tolist())) == [(1, 3), (4, 2)]


@pytest.mark.parametrize("predicate", ["equal", "band"])
def test_results_come_in_bounded_chunks_whose_union_is_the_reference(predicate):
    """A hot key's epoch yields chunks of exactly `chunk_rows` pairs but the last, in the order an unchunked
    module produces them, each with stamps covering its rows; a single tuple with more partners than the
    bound is split; over all epochs the chunks are the reference's pairs, each once."""
    rng = np.random.default_rng(5)
    chunk_rows, window, max_delay = 64, 2.0, 10.0
    sizes = [(0, 300), (100, 60), (150, 150)]  # (R, S) tuples per epoch; 60% of them carry key 7
    epochs, next_id, t0 = [], 1000, 0.0
    for n_r, n_s in sizes:
        stream = np.repeat([STREAM_R, STREAM_S], [n_r, n_s])
        keys = np.where(rng.random(len(stream)) < 0.6, 7, rng.integers(0, 30, len(stream)))
        ts = np.sort(t0 + rng.integers(0, 8, len(stream)) / 8)  # exact |dt| == window cases
        t0 += 1.0
        epochs.append((stream, np.arange(next_id, next_id + len(stream)), ts, keys))
        next_id += len(stream)
    stream, ids, ts, keys = (np.concatenate(cols) for cols in zip(*epochs))
    band = 1 if predicate == "band" else 0
    expected = (
        reference_pairs(stream, ids, ts, keys, window, max_delay)[0]
        if predicate == "equal"
        else reference_theta_pairs(stream, ids, ts, keys, window, max_delay, "band", band)
    )
    args = dict(
        partitions=1,
        bounds=bounds(window),
        block_size=4,
        theta_min=1,
        theta_max=3,
        max_depth=6,
        predicate=predicate,
        band=band,
    )
    chunked, whole = JoinModule(DT, chunk_rows=chunk_rows, **args), JoinModule(DT, chunk_rows=1 << 30, **args)
    got, running, split = [], NEG_INF, False
    for e_stream, e_ids, e_ts, e_keys in epochs:
        sides = []
        for st in (STREAM_R, STREAM_S):
            sel = e_stream == st
            rows = np.zeros(int(sel.sum()), dtype=DT)
            rows["id"], rows["ts"], rows["key"] = e_ids[sel], micros(e_ts[sel]), e_keys[sel]
            rows["arrival"] = 1.0
            sides.append(rows)
        running = max(running, int(micros(e_ts).max()))
        watermark = running - micros(max_delay)
        chunks = list(chunked.chunks(sides[0], sides[1], watermark))
        reference = whole.process(sides[0], sides[1], watermark)
        assert [c.last for c in chunks] == [False] * (len(chunks) - 1) + [True]
        assert all(len(c.pairs) == chunk_rows for c in chunks[:-1]) and len(chunks[-1].pairs) <= chunk_rows
        assert len(chunks[-1].pairs) or len(chunks) == 1  # empty only when the epoch has no results
        for c in chunks:
            ends, times = np.array(c.stamps).T
            assert ends[-1] == len(c.pairs) and (np.diff(ends) >= 0).all() and (np.diff(times) >= 0).all()
            delay, hists = c.delays(sent=0.5, started=1.5)
            assert np.isfinite(delay).all() and (delay > 0).all() and hists[0].sum() == len(c.pairs)
        for name in reference.columns:  # the same pairs, in the same order, as without a bound
            np.testing.assert_array_equal(np.concatenate([c.pairs[name] for c in chunks]), reference[name])
        r_ids = np.concatenate([c.pairs["r_id"] for c in chunks])
        s_ids = np.concatenate([c.pairs["s_id"] for c in chunks])
        for ids_of in (r_ids, s_ids):  # a tuple with more partners than the bound, split across chunks
            split |= np.bincount(ids_of - 1000).max(initial=0) > chunk_rows
        got.append(encode_pairs(r_ids, s_ids))
    got = np.sort(np.concatenate(got))
    assert split and len(chunks) > 2
    assert len(np.unique(got)) == len(got), "a pair was produced twice"
    np.testing.assert_array_equal(got, expected)


def ranged_input(rng, n, n_keys, predicate, band, lower, upper, disorder):
    """(stream, id, ts in integer microseconds, key) in arrival order, for a band or less join: for one R in
    six an S tuple exactly at the key edge (band: key -+ band; less: key + 1) or just past it (band -+ 1; less:
    the same key), exactly `lower` or `upper` after it in time or one microsecond outside."""
    stream = (rng.random(n) < 0.5).astype(np.int64)
    ts = np.sort(rng.integers(0, n * 2_000, n))  # ~2 ms apart
    keys = rng.integers(0, n_keys, n)
    r = np.flatnonzero(stream == STREAM_R)
    twins = r[rng.random(len(r)) < 1 / 6]
    edges = [-band, band, -band - 1, band + 1] if predicate == "band" else [1, 1, 0]
    stream = np.concatenate([stream, np.full(len(twins), STREAM_S)])
    ts = np.concatenate([ts, ts[twins] + rng.choice([lower, upper, lower, upper, lower - 1, upper + 1], len(twins))])
    keys = np.concatenate([keys, keys[twins] + rng.choice(edges, len(twins))])
    order = np.argsort(ts + rng.integers(0, disorder, len(ts)), kind="stable")
    ids = rng.permutation(len(ts)).astype(np.int64) + 1000
    return stream[order], ids, ts[order], keys[order]


def routed(ranges, predicate, band, rows_r, rows_s, owner, slave):
    """What the master sends slave `slave` of one epoch's on-time rows with key ranges and a full join (as
    master.state.intake routes them, both sides copied): (R rows, S rows, the group table (partition, R rows, S
    rows, then each stream's first and last key) of the partitions `owner` maps to it."""
    sides, counts = [], []
    for st, rows in ((STREAM_R, rows_r), (STREAM_S, rows_s)):
        index, part = ranges.copies(rows["key"], *copy_offsets(st, *key_distance(predicate, band), home=True))
        mine = owner[part] == slave
        index, part = index[mine], part[mine]
        order = np.argsort(part, kind="stable")
        sides.append(rows[index[order]])
        counts.append(np.bincount(part, minlength=ranges.partitions))
    present = np.flatnonzero(counts[0] + counts[1])
    table = np.column_stack([present, counts[0][present], counts[1][present], np.tile(ranges.spans(present), 2)])
    return sides[0], sides[1], table


@pytest.mark.parametrize(
    "predicate,window", [("band", 0.25), ("band", (-0.5, 0.125)), ("less", 0.02), ("less", (0.0, 0.05))]
)
def test_full_join_with_key_ranges_decides_each_row_at_its_home_once(predicate, window):
    """join.type = "full" with band and less: both sides copied into every range that may hold partners, the
    ranges on two slaves (modules) that move groups between them and restart from their groups' encoding (a
    checkpoint); each pair exactly once (at its R's home), each R and each S without a partner exactly once (at
    its own home), against the numpy reference and DuckDB's FULL OUTER JOIN, with pairs exactly at the band edge
    and exactly lower / upper apart in time, across ranges."""
    rng = np.random.default_rng([22, len(predicate), int(np.ndim(window))])
    band, max_delay, n = 2, 0.1, 3000
    lower, upper = bounds(window)
    stream, ids, ts, keys = ranged_input(rng, n, 200, predicate, band, lower, upper, disorder=150_000)
    late = late_flags(ts, max_delay)
    on = ~late
    inner = reference_theta_pairs(stream, ids, ts, keys, window, max_delay, predicate, band)
    want = reference_outer(inner, ids[on & (stream == STREAM_R)], ids[on & (stream == STREAM_S)], "full")
    r_on, s_on = on & (stream == STREAM_R), on & (stream == STREAM_S)
    duck = duckdb_outer(ids[r_on], ts[r_on], keys[r_on], ids[s_on], ts[s_on], keys[s_on], lower, upper, predicate, band)
    for name, w, d in zip(("pairs", "R rows alone", "S rows alone"), want, duck):
        np.testing.assert_array_equal(w, d, err_msg=f"the references disagree on the {name}")
    assert late.any() and all(len(w) > 30 for w in want), [len(w) for w in want]

    ranges = KeyRanges.from_sample(keys[:300], 12)
    at = np.zeros(ids.max() + 1, np.int64)
    at[ids] = np.arange(len(ids))
    r, s = at[want[0] // 2**32], at[want[0] % 2**32]  # each pair's tuples
    key_edge = (np.abs(keys[s] - keys[r]) == band) if predicate == "band" else (keys[s] - keys[r] == 1)
    time_edge = np.isin(ts[s] - ts[r], [lower, upper])
    across = ranges.home(keys[r]) != ranges.home(keys[s])
    assert (key_edge & time_edge & across).any(), "no pair at both edges across ranges: the test would prove less"

    args = dict(
        bounds=(lower, upper),
        block_size=4,
        theta_min=1,
        theta_max=4,
        max_depth=8,
        predicate=predicate,
        band=band,
        join_type="full",
        chunk_rows=64,
    )
    owner = np.arange(ranges.partitions) % 2
    got, guests, _ = two_modules(
        rng,
        lambda: JoinModule(DT, ranges.partitions, **args),
        owner,
        lambda *rows: routed(ranges, predicate, band, *rows),
        lambda: np.arange(ranges.partitions),
        (stream, ids, ts, keys, on),
        max_delay,
    )
    assert guests > 100  # guest copies were stored (summed over the epochs)
    assert_each_once(got, want, f"full {predicate}")


def two_modules(rng, new_module, owner, route, movable, feed, max_delay, epoch=lambda pos, modules: None, move_p=0.2):
    """Feed the on-time tuples of `feed` (stream, ids, ts, keys, on) in random epochs to two slaves' modules
    (`route(rows_r, rows_s, owner, slave)`: what the master sends one), moving one of the groups `movable()`
    to the other slave now and then, its flags with it, and restarting a slave from its groups' encoding (a
    checkpoint); `epoch(pos, modules)` comes before each epoch.  Returns ((pairs, R alone, S alone), sorted;
    guest copies stored, summed over the epochs; the groups moved)."""
    stream, ids, ts, keys, on = feed
    modules = [new_module() for _ in range(2)]
    pairs, lone_r, lone_s, guests, moves = [], [], [], 0, []
    running, pos, end, max_delay_us = NEG_INF, 0, False, micros(max_delay)
    while not end:
        end = pos == len(ts)  # then one more epoch without tuples: the end of input
        epoch(pos, modules)
        sl = slice(pos, min(len(ts), pos + int(rng.integers(0, 300))))
        pos = sl.stop
        if pos > sl.start:
            running = max(running, int(ts[sl].max()))
        rows = []
        for st in (STREAM_R, STREAM_S):
            sel = on[sl] & (stream[sl] == st)
            x = np.zeros(int(sel.sum()), dtype=DT)
            x["id"], x["ts"], x["key"], x["arrival"] = ids[sl][sel], ts[sl][sel], keys[sl][sel], 1.0
            rows.append(x)
        for slave, module in enumerate(modules):
            fresh_r, fresh_s, table = route(*rows, owner, slave)
            res = module.process(fresh_r, fresh_s, POS_INF if end else running - max_delay_us, table)
            pairs.append(encode_pairs(res["r_id"], res["s_id"]))
            lone_r.append(module.lone_r["id"])
            lone_s.append(module.lone_s["id"])
            guests += sum(
                int((w.matched == GUEST).sum())
                for pg in module.groups.values()
                for bucket in pg.buckets.values()
                for w in bucket
            )
        if rng.random() < move_p:  # a group moves to the other slave, its flags with it
            p = int(rng.choice(movable()))
            src = owner[p]
            modules[1 - src].install(
                *decode_move(encode_move(p, modules[src].extract(p), 0), modules[1 - src].new_group)[:2]
            )
            owner[p] = 1 - src
            moves.append(p)
        if rng.random() < 0.1:  # a slave restarts from its groups' state, as from a checkpoint
            slave = int(rng.integers(2))
            restarted = new_module()
            for p, pg in sorted(modules[slave].groups.items()):
                restarted.install(*decode_group(encode_group(p, pg), restarted.new_group))
            modules[slave] = restarted
    assert all(m.stored() == (0, 0) for m in modules)  # the end of input decided every row, guests expired
    return tuple(np.sort(np.concatenate(x)) for x in (pairs, lone_r, lone_s)), guests, moves


def assert_each_once(got: tuple, want: tuple, what: str) -> None:
    for name, g, w in zip(("pairs", "R rows alone", "S rows alone"), got, want):
        assert len(np.unique(g)) == len(g), f"{name}: {len(g) - len(np.unique(g))} emitted twice"
        np.testing.assert_array_equal(g, w, err_msg=f"{what}: {name}")


def grid_routed(router, rows_r, rows_s, owner, slave):
    """What the master sends slave `slave` of one epoch's on-time rows with hot keys (master.state.intake routes
    them through the router): (R rows, S rows, the group table with each stream's span) of its partitions."""
    sides, counts = [], []
    for st, rows in ((STREAM_R, rows_r), (STREAM_S, rows_s)):
        index, part = router.route(st, rows)
        mine = owner[part] == slave
        index, part = index[mine], part[mine]
        sides.append(rows[index[np.argsort(part, kind="stable")]])
        counts.append(np.bincount(part, minlength=router.total_partitions))
    present = np.flatnonzero(counts[0] + counts[1])
    table = np.column_stack([present, counts[0][present], counts[1][present], router.spans(present)])
    return sides[0], sides[1], table


@pytest.mark.parametrize("window", [0.02, (-0.03, 0.01)])
def test_full_join_with_a_hot_key_grid_decides_each_row_at_its_home_once(window):
    """join.type = "full" with a hot key (Streaming HyperCube's grid, twice: S spread and R copied as guests, then
    R spread and S copied as guests): key 7 holds 40% of the input, is split out of its partition-group into
    its two grids, whose sub-groups move between two slaves (modules) and restart from their groups' encoding
    (a checkpoint), and is merged back; each pair exactly once (at its R's home), each R and each S without a
    partner exactly once, against the numpy reference and DuckDB's FULL OUTER JOIN."""
    rng = np.random.default_rng([23, int(np.ndim(window))])
    max_delay, n = 0.1, 4000
    lower, upper = bounds(window)
    stream, ids, ts, keys = ranged_input(rng, n, 100, "less", 0, lower, upper, disorder=150_000)
    quiet = (ts > np.quantile(ts, 0.15)) & (ts < np.quantile(ts, 0.25))  # key 7 rare before the split: rows alone
    keys = np.where(rng.random(len(keys)) < np.where(quiet, 0.02, 0.4), 7, keys)
    late = late_flags(ts, max_delay)
    on = ~late
    inner = reference_pairs(stream, ids, ts, keys, window, max_delay)[0]
    want = reference_outer(inner, ids[on & (stream == STREAM_R)], ids[on & (stream == STREAM_S)], "full")
    r_on, s_on = on & (stream == STREAM_R), on & (stream == STREAM_S)
    duck = duckdb_outer(ids[r_on], ts[r_on], keys[r_on], ids[s_on], ts[s_on], keys[s_on], lower, upper, "equal", 0)
    for name, w, d in zip(("pairs", "R rows alone", "S rows alone"), want, duck):
        np.testing.assert_array_equal(w, d, err_msg=f"the references disagree on the {name}")
    assert late.any() and all(len(w) > 100 for w in want), [len(w) for w in want]

    router = HotKeyRouter(4, 1, 3, "full")
    args = dict(
        bounds=(lower, upper), block_size=4, theta_min=1, theta_max=4, max_depth=8, join_type="full", chunk_rows=64
    )
    owner = np.full(router.total_partitions, -1)
    owner[:4] = np.arange(4) % 2
    home, decided = router.home(7), []

    def split_or_merge(pos, modules):
        if n // 4 <= pos and not decided:  # key 7 is split on the owner of its partition
            first = router.promote(7, 3)
            held = modules[owner[home]].groups[home]
            decided.append(
                sum(int((w.matched[w.rows["key"] == 7] == DECIDED).sum()) for b in held.buckets.values() for w in b)
            )
            assert modules[owner[home]].split_hot_key(home, 7, *router.hot[7]) > 0
            owner[first : first + router.hot[7][1]] = owner[home]
        if 3 * n // 4 <= pos and router.hot:  # key 7 cooled: its sub-groups come back to the owner and merge
            first, count = router.demote(7)
            for g in range(first, first + count):
                if owner[g] != owner[home]:
                    modules[owner[home]].install(g, modules[owner[g]].extract(g))
            modules[owner[home]].merge_hot_key(home, 7, first, count)
            owner[first : first + count] = -1

    def movable():  # while key 7 is hot, one of its sub-groups
        present = np.flatnonzero(owner >= 0)
        return present[present >= 4] if router.hot else present

    got, guests, moves = two_modules(
        rng,
        lambda: JoinModule(DT, 4, **args),
        owner,
        lambda *rows: grid_routed(router, *rows),
        movable,
        (stream, ids, ts, keys, on),
        max_delay,
        split_or_merge,
        move_p=0.3,
    )
    moved = sum(p >= 4 for p in moves)
    assert guests > 100 and decided[0] > 0 and moved > 2  # guests stored, the split carried decided rows, moves
    assert_each_once(got, want, "full, hot key")
