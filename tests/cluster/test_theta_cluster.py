"""Band and inequality joins: key ranges at the master, R copies to every range that may hold partners,
a sorted-key kernel at the slaves.  Differential against an independent broadcast reference join."""

from __future__ import annotations

import numpy as np
import pytest

from master.state.ranges import KeyRanges
from common.workload import generate_all
from protocol.config import ConfigError, load_config
from protocol.plan import compile_plan
from slave.join import JoinModule
from protocol.tuples import tuple_dtype
from protocol.eventtime import NEG_INF
from tests.runs import run_cluster
from tests.reference import reference_theta_pairs
from tests.cluster.test_balance_cluster import FORCED_CHURN, straggler

THETA = {
    "generator.duration": 3.0,
    "generator.rate": 1500.0,
    "generator.keys": 4096,
    "epochs.distribution": 0.2,
    "join.window": 0.3,
    "join.max_delay": 0.3,
}


def check_theta(tmp_path, ranks, settings, **kw):
    cfg = load_config(
        None,
        [
            f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}"
            for k, v in settings.items()
            if k.startswith(("generator.", "source."))
        ],
    )
    data = generate_all(compile_plan(cfg).generator)
    expected = reference_theta_pairs(
        data.stream,
        data.id,
        data.ts,
        data.key,
        settings["join.window"],
        settings["join.max_delay"],
        settings["join.predicate"],
        settings.get("join.band", 0),
    )
    run = run_cluster(tmp_path, ranks, settings, **kw)
    assert run.returncode == 0, run.stderr
    got = run.pairs()
    assert len(np.unique(got)) == len(got), "a result was emitted twice"
    missing, extra = np.setdiff1d(expected, got), np.setdiff1d(got, expected)
    assert len(missing) == 0 and len(extra) == 0, f"{len(missing)} missing, {len(extra)} extra of {len(expected)}"
    assert run.summary["results"] == len(expected) > 100
    return run


@pytest.mark.parametrize("band,skew,disorder", [(0, 0.7, 0.0), (3, 0.5, 0.2), (40, 0.8, 0.25)])
def test_band_join_is_exact(tmp_path, band, skew, disorder):
    check_theta(
        tmp_path,
        4,
        dict(
            THETA,
            **{
                "join.predicate": "band",
                "join.band": band,
                "generator.skew": skew,
                "generator.disorder": disorder,
                "generator.seed": band + 1,
            },
        ),
    )


def test_less_join_is_exact(tmp_path):
    settings = dict(
        THETA,
        **{
            "join.predicate": "less",
            "generator.rate": 400.0,
            "join.window": 0.1,
            "generator.disorder": 0.1,
            "generator.seed": 3,
        },
    )
    check_theta(tmp_path, 3, settings)


def test_band_join_stays_exact_while_ranges_move_between_slaves(tmp_path):
    settings = {
        **THETA,
        **FORCED_CHURN,
        "join.predicate": "band",
        "join.band": 5,
        "generator.seed": 9,
        "generator.rate": 5000.0,
    }
    run = check_theta(tmp_path, 4, settings, env=straggler(1))
    assert len(run.summary["balance"]["moves"]) > 0


def test_ranges_split_at_quantiles_and_copies_cover_every_partner():
    rng = np.random.default_rng(4)
    keys = rng.zipf(1.5, 20000) % 5000
    ranges = KeyRanges.from_sample(keys, 16)
    home = ranges.home(keys)
    load = np.bincount(home, minlength=16)
    distinct = np.array([len(np.unique(keys[home == p])) for p in range(16)])
    assert load[distinct > 1].max() <= 2 * len(keys) / 16  # quantiles spread the load; a hot key stays whole
    r = rng.integers(0, 5000, 500)
    s = rng.integers(0, 5000, 500)
    for low, high in ((-7, 7), (1, None)):
        rows, part = ranges.copies(r, low, high)
        d = s[None, :] - r[:, None]
        partners = (d >= low) & (d <= (high if high is not None else 10**9))
        ri, si = np.nonzero(partners)
        have = set(zip(rows.tolist(), part.tolist()))
        assert all((i, p) in have for i, p in zip(ri.tolist(), ranges.home(s[si]).tolist()))


@pytest.mark.parametrize("low, high", [(-7, 7), (1, None), (None, -1)])
def test_copies_of_keys_at_the_int64_limits_reach_their_partners_instead_of_wrapping_around(low, high):
    top, bottom = np.iinfo(np.int64).max, np.iinfo(np.int64).min
    ranges = KeyRanges([bottom + 10, -5, 0, 5, top - 10])
    r = np.array([top, top - 3, bottom, bottom + 3, 0], dtype=np.int64)
    s = np.array([top, top - 1, top - 6, bottom, bottom + 1, bottom + 8, 2, -2], dtype=np.int64)
    rows, part = ranges.copies(r, low, high)
    have = set(zip(rows.tolist(), part.tolist()))
    d = s[None, :].astype(object) - r[:, None].astype(object)  # exact differences, no wrap
    lo, hi = (-np.inf if low is None else low), (np.inf if high is None else high)
    ri, si = np.nonzero((d >= lo) & (d <= hi))
    assert len(ri) > 5
    assert all((i, p) in have for i, p in zip(ri.tolist(), ranges.home(s[si]).tolist()))


def test_each_range_spans_exactly_the_keys_whose_home_it_is():
    """The group table's span (first, last key) of a range (a full join's slave tells a guest copy by it) holds
    exactly the keys `home` sends there, at int64's limits and with a split point repeated (an empty range)."""
    top, bottom = np.iinfo(np.int64).max, np.iinfo(np.int64).min
    for bounds in ([bottom + 10, -5, 0, 0, 5, top - 10], [bottom, bottom, 3, top, top], [], [7]):
        ranges = KeyRanges(bounds)
        keys = np.unique(
            np.array(
                [
                    top,
                    top - 1,
                    top - 10,
                    top - 11,
                    bottom,
                    bottom + 1,
                    bottom + 9,
                    bottom + 10,
                    -6,
                    -5,
                    -1,
                    0,
                    1,
                    2,
                    3,
                    4,
                    5,
                    6,
                    7,
                    8,
                ],
                dtype=np.int64,
            )
        )
        spans = ranges.spans(np.arange(ranges.partitions))
        inside = (keys[None, :] >= spans[:, :1]) & (keys[None, :] <= spans[:, 1:])
        assert np.array_equal(inside, ranges.home(keys)[None, :] == np.arange(ranges.partitions)[:, None]), bounds


def test_range_groups_are_never_split_and_produce_each_pair_once():
    dt = tuple_dtype(40)
    m = JoinModule(dt, 2, (-1_000_000, 1_000_000), 4, 1, 2, 12, "band", 2)
    rng = np.random.default_rng(5)
    r = np.zeros(300, dt)
    s = np.zeros(300, dt)
    for x in (r, s):
        x["id"], x["key"], x["ts"] = np.arange(300), rng.integers(0, 50, 300), np.sort(rng.integers(0, 10**6, 300))
    groups = np.array([[0, 300, 300]])
    got = m.process(r, s, NEG_INF, groups)
    assert m.splits == 0 and len(m.groups[0].buckets) == 1
    d = np.abs(r["key"][:, None] - s["key"][None, :]) <= 2
    assert len(got) == int(d.sum())
    assert np.all(np.abs(got["r_key"] - got["s_key"]) <= 2)


def test_band_needs_a_known_predicate():
    with pytest.raises(ConfigError, match="join.predicate"):
        load_config(None, ["join.predicate=between"])
    with pytest.raises(ConfigError, match="join.band"):
        load_config(None, ["join.predicate=band", "join.band=-1"])
