"""The soak's resource verdicts (tests/resources.py): a series with a warm-up, restarts and bursts is flat; one
that keeps growing, or passes its kind's bound, is not; a run too short to tell is judged on its bounds only."""

from __future__ import annotations

import numpy as np

from tests.resources import GROWTH_SPAN, LIMITS, MiB, Sampler, flatness

SPAN = 3600.0


def series(values) -> list[tuple[float, float]]:
    return [(t, float(v)) for t, v in zip(np.linspace(0, SPAN, len(values), endpoint=False), values)]


def verdict(name: str, values, span: float = SPAN):
    (v,) = flatness(
        {name: series(values)} if span == SPAN else {name: [(t * span / SPAN, v) for t, v in series(values)]}, span
    )
    return v


def test_a_resource_with_a_warm_up_restarts_and_bursts_is_flat():
    rng = np.random.default_rng(1)
    t = np.arange(1200)
    rss = 200 * MiB * np.minimum(1, t / 60 + 0.5) + rng.uniform(0, 30 * MiB, len(t))  # warm-up, then noise
    rss[t % 97 < 10] = 90 * MiB  # a restart: the new process small again
    v = verdict("rss slave (rank 2)", rss)
    assert v.failure is None and v.peak <= 230 * MiB
    assert all(x is not None for x in v.thirds)


def test_a_resource_that_keeps_growing_fails_though_under_its_bound():
    leak = 150 * MiB + np.arange(1200) * 0.2 * MiB  # 240 MiB an hour: under the bound, not flat
    v = verdict("rss master (rank 0)", leak)
    assert v.peak < LIMITS["rss"].bound
    assert v.failure is not None and "grows" in v.failure


def test_few_files_growing_by_one_a_restart_fail_past_the_slack():
    fds = 40 + np.arange(1200) // 20  # a descriptor a minute never closed
    assert "grows" in verdict("fds supervisor", fds).failure
    assert verdict("fds supervisor", np.full(1200, 40)).failure is None


def test_a_peak_above_the_bound_fails_at_any_length():
    big = np.full(30, 10.0)
    big[5] = LIMITS["checkpoints"].bound + 1
    v = verdict("checkpoints on disk", big, span=90.0)
    assert "above the bound" in v.failure


def test_a_short_run_is_judged_on_its_bounds_only_and_the_output_not_at_all():
    growing = 2 * MiB + np.arange(30) * 0.5 * MiB
    assert verdict("payload log on disk", growing, span=GROWTH_SPAN / 4).failure is None
    assert verdict("payload log on disk", growing, span=SPAN).failure is not None
    assert verdict("output on disk (results, late, archive, metrics)", growing * 100).failure is None


def test_the_sampler_keeps_each_series_by_name_and_skips_a_failing_sample():
    calls = iter([{"rss slave (rank 2)": 1.0}, RuntimeError("gone"), {"rss slave (rank 2)": 2.0, "fds x": 3}])

    def take():
        got = next(calls, {})
        if isinstance(got, Exception):
            raise got
        return got

    s = Sampler(take, every=0.01)
    while len(s.series.get("fds x", [])) < 1:
        pass
    span = s.stop()
    assert [v for _, v in s.series["rss slave (rank 2)"]] == [1.0, 2.0]
    assert s.errors == 1 and "gone" in s.last_error and span > 0
