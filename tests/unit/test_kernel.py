"""Tests of slave/kernel.py: window_matches and range_matches against a brute-force n x m broadcast."""

from __future__ import annotations

import numpy as np
import pytest

from protocol.tuples import tuple_dtype
from slave.kernel import range_matches, window_matches


def window_join(*args):
    """Every pair of `window_matches` at once."""
    return window_matches(*args).take()


def range_join(*args):
    """Every pair of `range_matches` at once."""
    return range_matches(*args).take()


def us(x):
    """Seconds as the kernels' integer microseconds (integer arrays are microseconds already)."""
    a = np.asarray(x)
    return a.astype(np.int64) if a.dtype.kind in "iu" else np.rint(a * 1e6).astype(np.int64)


def bounds(window):
    """(lower, upper) in microseconds of a window in seconds: w is (-w, w), a pair is (lower, upper)."""
    lower, upper = (-window, window) if np.ndim(window) == 0 else window
    return int(us(lower)), int(us(upper))


def in_time(a_ts, b_ts, lower, upper):
    """n x m: lower <= b.ts - a.ts <= upper."""
    dt = b_ts[None, :] - a_ts[:, None]
    return (dt >= lower) & (dt <= upper)


def brute_pairs(a_key, a_ts, b_key, b_ts, lower, upper):
    """Every (ia, ib) with equal keys and lower <= b.ts - a.ts <= upper, from a full n x m comparison."""
    if len(a_key) == 0 or len(b_key) == 0:
        return set()
    ok = (a_key[:, None] == b_key[None, :]) & in_time(a_ts, b_ts, lower, upper)
    ia, ib = np.nonzero(ok)
    return set(zip(ia.tolist(), ib.tolist()))


def check(a_key, a_ts, b_key, b_ts, window):
    """The kernel against the broadcast for `window` (seconds, see `bounds`), a as probe and as index."""
    a_ts, b_ts, (lower, upper) = us(a_ts), us(b_ts), bounds(window)
    ia, ib = window_join(a_key, a_ts, b_key, b_ts, lower, upper)
    assert len(ia) == len(ib)
    assert ia.dtype.kind == "i" and ib.dtype.kind == "i"
    got = list(zip(ia.tolist(), ib.tolist()))
    assert len(got) == len(set(got)), "window_join returned a pair twice"
    expected = brute_pairs(a_key, a_ts, b_key, b_ts, lower, upper)
    assert set(got) == expected
    return expected


SIZES = [(0, 0), (0, 5), (5, 0), (1, 1), (1, 17), (17, 1), (2, 300), (300, 2), (50, 50), (120, 80), (80, 120)]


@pytest.mark.parametrize("n,m", SIZES)
@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("n_keys", [1, 3, 40])
def test_random_against_broadcast(n, m, seed, n_keys):
    rng = np.random.default_rng(seed * 1000 + n * 7 + m)
    a_key = rng.integers(0, n_keys, n)
    b_key = rng.integers(0, n_keys, m)
    a_ts = rng.uniform(0, 10, n)
    b_ts = rng.uniform(0, 10, m)
    for window in (0.0, 0.3, 2.5, 100.0, (-0.3, 2.5), (0.0, 0.3), (-2.5, -0.3), (0.3, 2.5), (1.0, 1.0)):
        check(a_key, a_ts, b_key, b_ts, window)


@pytest.mark.parametrize("seed", range(10))
def test_integer_timestamps_window_zero_and_exact_boundary(seed):
    # integer-valued ts make |dt| == window exact; window 0 means equal ts only
    rng = np.random.default_rng(seed)
    n, m = rng.integers(1, 90, 2)
    a_key, b_key = rng.integers(0, 4, n), rng.integers(0, 4, m)
    a_ts = rng.integers(0, 8, n).astype(np.float64)
    b_ts = rng.integers(0, 8, m).astype(np.float64)
    for window in (0.0, 1.0, 3.0, (-1.0, 3.0), (0.0, 2.0), (-3.0, -1.0), (2.0, 2.0)):
        check(a_key, a_ts, b_key, b_ts, window)
        check(b_key, b_ts, a_key, a_ts, window)
    ia, ib = window_join(a_key, us(a_ts), b_key, us(b_ts), 0, 0)
    assert np.all(a_ts[ia] == b_ts[ib]) and np.all(a_key[ia] == b_key[ib])


def test_exact_boundary_included_and_just_outside_excluded():
    a_key = np.array([7, 7, 7])
    a_ts = np.array([10.0, 11.0, 11.5])
    b_key = np.array([7, 8])
    b_ts = np.array([10.5, 10.5])
    ia, ib = window_join(a_key, us(a_ts), b_key, us(b_ts), *bounds(0.5))
    assert set(zip(ia.tolist(), ib.tolist())) == {(0, 0), (1, 0)}
    # swapped roles (b larger than a) give the mirrored pairs
    ib2, ia2 = window_join(b_key, us(b_ts), a_key, us(a_ts), *bounds(0.5))
    assert set(zip(ia2.tolist(), ib2.tolist())) == {(0, 0), (1, 0)}
    ia, ib = window_join(a_key, us(a_ts), b_key, us(b_ts), 0, 0)
    assert len(ia) == 0 and len(ib) == 0


@pytest.mark.parametrize("lower,upper", [(-300, 700), (0, 700), (-700, 0), (200, 700), (-700, -200), (400, 400)])
@pytest.mark.parametrize("probes", [1, 40])
def test_asymmetric_bounds_join_exactly_at_lower_and_upper_and_not_one_microsecond_outside(lower, upper, probes):
    """R tuples (a) at 10_000 us, S tuples (b) at every offset from lower - 2 to upper + 2 us and at the far
    side's mirror image: exactly the offsets in [lower, upper] join, in both kernels and whichever side is the
    smaller (indexed) one, i.e. also when the kernel sees S as a with the bounds mirrored."""
    offsets = np.array(
        sorted(
            {
                lower - 2,
                lower - 1,
                lower,
                lower + 1,
                upper - 1,
                upper,
                upper + 1,
                upper + 2,
                -lower,
                -upper,
                -lower + 1,
                -upper - 1,
            }
        )
    )
    a_key, a_ts = np.full(probes, 5), np.full(probes, 10_000)
    b_key, b_ts = np.full(len(offsets), 5), 10_000 + offsets
    want = {(i, j) for i in range(probes) for j in np.flatnonzero((offsets >= lower) & (offsets <= upper)).tolist()}
    assert want  # each case has pairs inside and offsets outside
    for got in (
        window_join(a_key, a_ts, b_key, b_ts, lower, upper),
        range_join(a_key, a_ts, b_key, b_ts, lower, upper, 0, 0),
        range_join(a_key, a_ts, b_key, b_ts, lower, upper, -1, None),
    ):
        assert set(zip(got[0].tolist(), got[1].tolist())) == want
    joined = offsets[[j for _, j in want if _ == 0]]
    assert lower in joined and upper in joined and lower - 1 not in joined and upper + 1 not in joined


def test_all_one_key_is_full_cross_product_within_window():
    n, m = 60, 45
    a_key, b_key = np.full(n, 3), np.full(m, 3)
    a_ts, b_ts = np.zeros(n), np.zeros(m)
    ia, ib = window_join(a_key, us(a_ts), b_key, us(b_ts), 0, 0)
    assert len(ia) == n * m
    assert len(set(zip(ia.tolist(), ib.tolist()))) == n * m
    ib, ia = window_join(b_key, us(b_ts), a_key, us(a_ts), 0, 0)
    assert len(set(zip(ia.tolist(), ib.tolist()))) == n * m


def test_disjoint_keys_give_nothing():
    ia, ib = window_join(np.arange(10), us(np.zeros(10)), np.arange(10, 30), us(np.zeros(20)), -(10**15), 10**15)
    assert len(ia) == 0 and len(ib) == 0


def test_negative_and_large_keys():
    rng = np.random.default_rng(5)
    pool = np.array([-(2**62), -1, 0, 1, 2**62, 123456789012], dtype=np.int64)
    a_key, b_key = rng.choice(pool, 70), rng.choice(pool, 33)
    a_ts, b_ts = rng.uniform(0, 3, 70), rng.uniform(0, 3, 33)
    check(a_key, a_ts, b_key, b_ts, 0.7)
    check(b_key, b_ts, a_key, a_ts, 0.7)


def test_one_hot_key_far_apart_in_time_does_not_build_all_key_pairs():
    # 20k x 20k tuples of a single key spread over 1000 s, window 1 ms: 4e8 pairs share the key, a handful
    # are results; the kernel must search on time as well, not expand every key match (3+ GB here)
    import tracemalloc

    rng = np.random.default_rng(5)
    n = 20_000
    a_ts, b_ts = us(np.sort(rng.random(n) * 1000)), us(np.sort(rng.random(n) * 1000))
    keys = np.zeros(n, dtype=np.int64)
    tracemalloc.start()
    ia, ib = window_join(keys, us(a_ts), keys, us(b_ts), -1000, 1000)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 20 * 2**20
    expected = sum(int(np.count_nonzero(np.abs(b_ts - t) <= 1000)) for t in a_ts[:2000])
    assert int(np.count_nonzero(ia < 2000)) == expected
    assert np.all(np.abs(a_ts[ia] - b_ts[ib]) <= 1000)


def test_equal_timestamps_duplicates_and_strided_field_views():
    # the kernels get field views of 64-byte window records (strided), many duplicate keys and equal ts
    rng = np.random.default_rng(11)
    for n, m in ((400, 90), (90, 400), (1, 250)):
        a, b = np.zeros(n, tuple_dtype(64)), np.zeros(m, tuple_dtype(64))
        a["key"], b["key"] = rng.integers(-3, 3, n), rng.integers(-3, 3, m)
        a["ts"], b["ts"] = rng.integers(0, 5, n) * 250_000, rng.integers(0, 5, m) * 250_000
        for window in (0.0, 0.25, 0.5, (0.0, 0.5), (-0.5, -0.25)):
            check(a["key"], a["ts"], b["key"], b["ts"], window)


def brute_range(a_key, a_ts, b_key, b_ts, lower, upper, low, high):
    if len(a_key) == 0 or len(b_key) == 0:
        return set()
    d = b_key[None, :].astype(object) - a_key[:, None].astype(object)  # exact: no int64 wrap-around
    ok = in_time(a_ts, b_ts, lower, upper)
    if low is not None:
        ok &= d >= low
    if high is not None:
        ok &= d <= high
    ia, ib = np.nonzero(ok)
    return set(zip(ia.tolist(), ib.tolist()))


def check_range(a_key, a_ts, b_key, b_ts, window, low, high):
    a_ts, b_ts, (lower, upper) = us(a_ts), us(b_ts), bounds(window)
    ia, ib = range_join(a_key, a_ts, b_key, b_ts, lower, upper, low, high)
    got = list(zip(ia.tolist(), ib.tolist()))
    assert len(got) == len(set(got)), "range_join returned a pair twice"
    assert set(got) == brute_range(a_key, a_ts, b_key, b_ts, lower, upper, low, high)


@pytest.mark.parametrize("n,m", SIZES)
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("keys", [(0, 0), (-2, 2), (1, None), (None, -1), (None, None), (3, 1)])
def test_range_join_random_against_broadcast(n, m, seed, keys):
    rng = np.random.default_rng(seed * 1000 + n * 7 + m)
    a_key, b_key = rng.integers(-10, 10, n), rng.integers(-10, 10, m)
    a_ts, b_ts = rng.integers(0, 12, n) * 0.5, rng.integers(0, 12, m) * 0.5  # exact |dt| == window cases
    for window in (0.0, 0.5, 2.0, 100.0, (-0.5, 2.0), (0.0, 1.0), (-2.0, -0.5), (0.5, 0.5)):
        check_range(a_key, a_ts, b_key, b_ts, window, *keys)


def test_range_join_huge_keys_do_not_wrap_around():
    # k + band past the int64 range must saturate, not wrap to the other end of the key space
    big, small = np.iinfo(np.int64).max, np.iinfo(np.int64).min
    pool = np.array([small, small + 1, -5, 0, 5, big - 1, big], dtype=np.int64)
    rng = np.random.default_rng(2)
    a_key, b_key = rng.choice(pool, 60), rng.choice(pool, 25)
    a_ts, b_ts = np.zeros(60), np.zeros(25)
    for keys in ((-3, 3), (1, None), (None, -1), (2, 2**62), (-(2**62), -2)):
        check_range(a_key, a_ts, b_key, b_ts, 0.0, *keys)
        check_range(b_key, b_ts, a_key, a_ts, 0.0, *keys)


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("keys", [None, (-1, 1)])
def test_matches_taken_in_slices_are_all_pairs_in_order(swap, keys):
    """Slices of any size, cut inside a probe tuple's partners too, concatenate to all pairs in probe order."""
    rng = np.random.default_rng(3)
    a_key = np.where(rng.random(200) < 0.5, 1, rng.integers(0, 9, 200))
    b_key = np.ones(150, np.int64)  # every key-1 probe has up to 150 partners: more than a slice
    a_ts, b_ts = rng.integers(0, 40, 200), rng.integers(0, 40, 150)
    if swap:
        a_key, a_ts, b_key, b_ts = b_key, b_ts, a_key, a_ts
    if keys is None:
        matches = window_matches(a_key, a_ts, b_key, b_ts, -5, 20)
        expected = brute_pairs(a_key, a_ts, b_key, b_ts, -5, 20)
    else:
        matches = range_matches(a_key, a_ts, b_key, b_ts, -5, 20, *keys)
        expected = brute_range(a_key, a_ts, b_key, b_ts, -5, 20, *keys)
    ia, ib = matches.take()
    assert matches.total == len(ia) == len(expected) > 1000 and set(zip(ia.tolist(), ib.tolist())) == expected
    for size in (1, 7, 149, 1000):
        parts = [matches.take(at, min(at + size, matches.total)) for at in range(0, matches.total, size)]
        np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), ia)
        np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), ib)


@pytest.mark.parametrize("low,high", [(-3, 3), (1, None), (None, -1), (0, 0), (None, None)])
@pytest.mark.parametrize("home", [(40, 59), (0, 0), (-(2**63), 10), (90, 2**63 - 1), (1, 0)])
def test_a_home_range_leaves_out_exactly_the_pairs_of_two_guests(low, high, home):
    """A full join's range (slave.join): with `home` (first, last key) the pairs are exactly those of which at
    least one key is at home, whichever side probes (the larger), at and beside the range's edges and with
    an empty range ((1, 0): no pair at all)."""
    rng = np.random.default_rng([7, 0 if low is None else low + 9, home[0] % 97])
    for n_a, n_b in ((300, 120), (120, 300)):
        a_key, b_key = rng.integers(-5, 105, n_a), rng.integers(-5, 105, n_b)
        a_ts, b_ts = rng.integers(0, 50, n_a), rng.integers(0, 50, n_b)
        ia, ib = range_matches(a_key, a_ts, b_key, b_ts, -8, 8, low, high, home).take()
        at_home = lambda k: (k >= home[0]) & (k <= home[1])
        want = {
            (i, j)
            for i, j in brute_range(a_key, a_ts, b_key, b_ts, -8, 8, low, high)
            if at_home(a_key[i]) or at_home(b_key[j])
        }
        assert len(ia) == len(want) and set(zip(ia.tolist(), ib.tolist())) == want
        assert len(want) > 5 or home in ((1, 0), (0, 0))  # the pairs must be there to be left out


def test_compiled_delays_bin_like_the_binary_search_at_and_beside_every_edge():
    from protocol import delays
    from slave.kernel import batch_delays

    rng = np.random.default_rng(11)
    e = delays.EDGES
    values = np.concatenate(
        [
            10 ** rng.uniform(-8, 6, 100_000),
            e,
            np.nextafter(e, 0),
            np.nextafter(e, np.inf),
            [0.0, -1.0, -np.inf, np.inf, 1e-300, 1e300, 5e-324],
        ]
    )
    # produced, sent and started at 0: each delay and each buffer part is exactly -arrival
    arrival = -values
    delay, hists = batch_delays(arrival, arrival, [len(values)], [0.0], 0.0, 0.0)
    expected = delays.histogram(values)
    np.testing.assert_array_equal(delay, values)
    np.testing.assert_array_equal(hists[0], expected)
    np.testing.assert_array_equal(hists[1], expected)
    assert hists[0, 0] >= 3 and hists[0, -1] >= 2 and (hists.sum(axis=1) == len(values)).all()
    delay, hists = batch_delays(np.empty(0), np.empty(0), [0], [1.0], 0.5, 0.75)
    assert len(delay) == 0 and not hists.any()


def test_compiled_delays_and_parts_equal_their_definition():
    """Per result: the later arrival of its two tuples, its partition-group's production time, the batch's send
    and start times; against protocol.delays, computed with numpy."""
    from protocol import delays
    from slave.kernel import batch_delays

    rng = np.random.default_rng(12)
    n = 50_000
    rows = np.zeros(n, dtype=[("arrival", "f8"), ("pad", "V56")])  # strided, like fields of the result rows
    r_arrival, s_arrival = 100.0 + rng.uniform(0, 0.5, n), 100.0 + rng.uniform(0, 0.5, n)
    rows["arrival"] = s_arrival
    ends = np.sort(rng.choice(n, 40, replace=False))
    ends[-1] = n
    times = 100.8 + np.sort(rng.uniform(0, 0.3, 40))
    sent, started = 100.55, 100.6
    delay, hists = batch_delays(r_arrival, rows["arrival"], ends, times, sent, started)
    produced = np.repeat(times, np.diff(np.concatenate([[0], ends])))
    arrival = np.maximum(r_arrival, s_arrival)
    np.testing.assert_array_equal(delay, produced - arrival)
    np.testing.assert_array_equal(
        hists, np.vstack([delays.histogram(produced - arrival), delays.decomposition(arrival, sent, started, produced)])
    )
