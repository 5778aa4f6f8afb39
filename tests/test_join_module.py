"""Differential tests of slave/join.py: JoinModule.process over many epochs against tests/reference.py."""
from __future__ import annotations

import numpy as np
import pytest

from protocol.tuples import STREAM_R, STREAM_S, partition_of, tuple_dtype
from slave.join import JoinModule
from protocol.eventtime import NEG_INF
from tests.reference import encode_pairs, late_flags, micros, reference_pairs, reference_theta_pairs

DT = tuple_dtype(64)


def make_input(rng, n, n_keys, disorder, step=1 / 8, decimals=None):
    """Interleaved arrival order: stream, id, ts in seconds (multiples of `step`: exact |dt| == window cases;
    with `decimals`, rounded to that many, as a file would hold them), key."""
    stream = (rng.random(n) < 0.45).astype(np.int64)
    ids = rng.permutation(n).astype(np.int64) + 1000  # unique, not in arrival order
    base = np.cumsum(rng.random(n) < 0.05) * step      # many equal ts, slowly increasing
    ts = base - np.round(rng.uniform(0, disorder, n) / step) * step
    if decimals is not None:
        ts = np.round(ts, decimals)
    # skewed keys whose hot set drifts with time, so buckets grow and later shrink
    hot = rng.random(n) < 0.5
    keys = np.where(hot, (rng.zipf(1.6, n) % 8) + (base // 3).astype(np.int64) * 100,
                    rng.integers(0, n_keys, n))
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
@pytest.mark.parametrize("window,max_delay", [(0.5, 0.375), (0.0, 0.25), (2.0, 1.0)])
def test_process_matches_reference(seed, window, max_delay):
    rng = np.random.default_rng(seed)
    n = 6000
    stream, ids, ts, keys = make_input(rng, n, n_keys=300, disorder=max_delay * 1.3)
    expected, late_ids = reference_pairs(stream, ids, ts, keys, window, max_delay)
    assert len(late_ids) > 0  # some input is late and must not join
    module = JoinModule(DT, partitions=3, window=micros(window), block_size=4, theta_min=2, theta_max=6, max_depth=8)
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
    module = JoinModule(DT, partitions=2, window=micros(window), block_size=2, theta_min=1, theta_max=3, max_depth=6)
    got = run_module(module, stream, ids, ts, keys, max_delay, rng, max_epoch=3)  # sizes 0, 1, 2
    assert len(expected) > 50
    np.testing.assert_array_equal(got, expected)


def test_single_hot_key_many_epochs():
    rng = np.random.default_rng(9)
    n = 3000
    stream, ids, ts, _ = make_input(rng, n, n_keys=1, disorder=0.25)
    keys = np.full(n, 5)
    expected, _ = reference_pairs(stream, ids, ts, keys, 0.25, 0.25)
    module = JoinModule(DT, partitions=4, window=250_000, block_size=4, theta_min=1, theta_max=3, max_depth=6)
    got = run_module(module, stream, ids, ts, keys, 0.25, rng)
    np.testing.assert_array_equal(got, expected)
    assert module.splits == 0
    assert all(pg.directory.global_depth == 0 for pg in module.groups.values())


def test_empty_process_returns_empty_typed_arrays():
    module = JoinModule(DT, partitions=4, window=1_000_000, block_size=4, theta_min=1, theta_max=4, max_depth=4)
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
    module = JoinModule(DT, partitions=3, window=micros(window), block_size=4, theta_min=2, theta_max=6,
                        max_depth=8)
    got = run_module(module, stream, ids, ts, keys, max_delay, rng, max_epoch=60)
    np.testing.assert_array_equal(got, expected)


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
    expected = (reference_pairs(stream, ids, ts, keys, window, max_delay)[0] if predicate == "equal" else
                reference_theta_pairs(stream, ids, ts, keys, window, max_delay, "band", band))
    args = dict(partitions=1, window=micros(window), block_size=4, theta_min=1, theta_max=3, max_depth=6,
                predicate=predicate, band=band)
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
