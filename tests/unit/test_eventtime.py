"""protocol/eventtime.py: seconds to integer microseconds, once, exactly as written."""

from __future__ import annotations

from decimal import ROUND_HALF_EVEN, Decimal

import numpy as np
import pyarrow as pa
import pytest

from protocol import eventtime
from tests.reference import micros

TRICKY = [  # (text, microseconds)
    ("1.001", 1_001_000),  # float64 1.000999999999999889...: a floor of the product gives 1_000_999
    ("0.1", 100_000),
    ("0.3", 300_000),
    ("2.675", 2_675_000),
    ("1.015", 1_015_000),
    ("1700000000.001", 1_700_000_000_001_000),
    ("1700000000.000001", 1_700_000_000_000_001),
    ("-0.001", -1_000),
    ("-1700000000.123457", -1_700_000_000_123_457),
    ("0.0000005", 0),
    ("0.0000015", 2),
    ("0.0000025", 2),
    ("-0.0000025", -2),  # ties to even
    ("0.00000051", 1),
    ("0.0000004999999999", 0),
    ("0.9999995", 1_000_000),
    ("0.9999985", 999_998),
    ("12", 12_000_000),
    ("12.", 12_000_000),
    (".5", 500_000),
    ("+3.25", 3_250_000),
    ("-0", 0),
    ("007.000001", 7_000_001),
    ("1e3", 1_000_000_000),
    ("1.5E-3", 1_500),
    ("-2e-6", -2),
    ("1700000000.123456789", 1_700_000_000_123_457),
]


@pytest.mark.parametrize("text,want", TRICKY)
def test_decimal_text_converts_exactly_as_written(text, want):
    ticks, number, ok = eventtime.from_decimal_text(pa.array([text]))
    assert number[0] and ok[0] and int(ticks[0]) == want
    if "e" not in text.lower():  # the same as Decimal's rounding of the digits
        assert want == int(Decimal(text).scaleb(6).to_integral_value(ROUND_HALF_EVEN))


def test_decimal_text_not_a_number_not_finite_and_out_of_range():
    ticks, number, ok = eventtime.from_decimal_text(
        pa.array(["x", "", "1.2.3", "nan", "inf", "-Infinity", "2305843009213.693952", "1" * 40, "1e300"])
    )
    assert number.tolist() == [False, False, False, True, True, True, True, True, True]
    assert not ok.any() and not ticks.any()


def test_float_seconds_round_to_the_microsecond_of_their_shortest_decimal():
    rng = np.random.default_rng(4)
    # decimals with up to 6 digits, as far as 2**33 s (year 2242), where a float64 still tells microseconds apart
    whole = rng.integers(-(2**33) + 1, 2**33, 20000)
    frac = rng.integers(0, 10**6, 20000)
    text = [f"{w}.{f:06d}" if w >= 0 else f"-{-w - 1}.{10**6 - f:06d}" for w, f in zip(whole.tolist(), frac.tolist())]
    floats = np.array([float(t) for t in text])
    ticks, ok = eventtime.from_seconds(floats)
    assert ok.all()
    np.testing.assert_array_equal(ticks, whole * 10**6 + frac)
    np.testing.assert_array_equal(ticks, micros(floats))  # the reference's own route (repr and Decimal)
    np.testing.assert_array_equal(eventtime.from_decimal_text(pa.array(text))[0], ticks)
    # and back: results carry the float64 nearest to the microseconds, the float of the decimals as written
    np.testing.assert_array_equal(eventtime.to_seconds(ticks), floats)


def test_float_seconds_not_finite_or_out_of_range():
    ticks, ok = eventtime.from_seconds(np.array([np.nan, np.inf, -np.inf, 2.4e12, -2.4e12, 1.5]))
    assert ok.tolist() == [False] * 5 + [True] and ticks.tolist() == [0] * 5 + [1_500_000]


def test_integer_seconds_and_config_durations():
    ticks, ok = eventtime.from_integers(np.array([3, -2, 2**61 // 10**6, -(2**61 // 10**6) + 1]), "s")
    assert ticks.tolist()[:2] == [3_000_000, -2_000_000] and ok.tolist() == [True, True, False, True]
    assert [eventtime.duration(x) for x in (0.1, 1.001, 0.0105, 2.5e-6, 3.5e-6, 1e-7, 0, 1e9)] == [
        100_000,
        1_001_000,
        10_500,
        2,
        4,
        0,
        0,
        10**15,
    ]


def test_sentinels_order_and_leave_room():
    limit = eventtime.TS_LIMIT
    d = eventtime.DURATION_LIMIT
    assert eventtime.NONE < eventtime.NEG_INF - 2 * d < eventtime.NEG_INF <= -limit - 2 * d
    assert limit + 2 * d <= eventtime.POS_INF < eventtime.POS_INF + 2 * d <= np.iinfo(np.int64).max
    assert eventtime.bound_seconds(eventtime.POS_INF) == np.inf
    assert eventtime.bound_seconds(eventtime.NEG_INF - 5) == -np.inf and eventtime.bound_seconds(-250_000) == -0.25
    assert not eventtime.valid(np.array([np.iinfo(np.int64).min, -limit, limit])).any()
