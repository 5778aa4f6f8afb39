"""control.audit_view's diff of two views: only final windows inside the range count, measures exact but for
floats (within RELATIVE), null and NaN groups are groups of their own."""

from __future__ import annotations

from decimal import Decimal

import pyarrow as pa

from control import audit_view
from protocol.eventtime import NEG_INF, POS_INF

MIN = 60_000_000  #: a window of a minute, microseconds


def view(rows: list[tuple], final: list[bool] | None = None) -> pa.Table:
    """(ad, start minute, count, sum of a decimal, avg of a float) rows as a view of declared streams."""
    ad, minute, count, total, avg = zip(*rows)
    start = pa.array([m * MIN for m in minute], pa.int64())
    t = pa.table(
        {
            "ad": pa.array(ad, pa.float64()),
            "window_start": start.cast(pa.timestamp("us", "UTC")),
            "window_end": pa.array([m * MIN + MIN for m in minute], pa.int64()).cast(pa.timestamp("us", "UTC")),
            "count": pa.array(count, pa.int64()),
            "sum_cost": pa.array(total, pa.decimal128(38, 2)),
            "avg_x": pa.array(avg, pa.float64()),
        }
    )
    return t.append_column("final", pa.array(final if final is not None else [True] * t.num_rows))


ROWS = [
    (1.0, 0, 3, Decimal("1.50"), 0.1 + 0.2),
    (None, 0, 2, None, None),
    (float("nan"), 1, 1, Decimal("0.01"), float("nan")),
    (1.0, 2, 5, Decimal("9.99"), 1e300),
]
KEYS = ["ad", "window_start"]


def test_equal_views_and_float_rounding_are_exact_and_a_changed_decimal_or_count_is_named():
    want = view(ROWS)
    got = view([(*r[:4], 0.3) if i == 0 else r for i, r in enumerate(ROWS)])  # 0.1 + 0.2 vs 0.3
    counts, evidence = audit_view.diff(got, want, KEYS, MIN, NEG_INF, POS_INF)
    assert (counts["missing"], counts["extra"], counts["different"], counts["groups"]) == (0, 0, 0, 4)
    changed = view([(1.0, 0, 4, Decimal("1.51"), 0.3), *ROWS[1:3], (2.0, 2, 5, Decimal("9.99"), 1e300)])
    counts, evidence = audit_view.diff(changed, want, KEYS, MIN, NEG_INF, POS_INF)
    assert (counts["missing"], counts["extra"], counts["different"]) == (1, 1, 2)
    rows = evidence.to_pylist()
    assert {(r["problem"], r["measure"], r["view"], r["recomputed"]) for r in rows if r["problem"] == "different"} == {
        ("different", "count", "4", "3"),
        ("different", "sum_cost", "1.51", "1.50"),
    }
    assert [r["group"] for r in rows if r["problem"] == "missing"] == ["ad=1.0, window_start=1970-01-01 00:02:00+00:00"]


def test_only_final_windows_inside_the_range_are_compared():
    want = view(ROWS)
    got = view([ROWS[0], ROWS[1], (float("nan"), 1, 7, None, None)], final=[True, True, False])  # minute 1 open
    counts, _ = audit_view.diff(got, want, KEYS, MIN, NEG_INF, POS_INF)
    assert (counts["missing"], counts["different"], counts["not_final"], counts["groups"]) == (0, 0, 1, 2)
    assert counts["final_until"] == 60.0
    counts, _ = audit_view.diff(view(ROWS[2:]), want, KEYS, MIN, MIN, 3 * MIN)  # minutes 1 and 2 only
    assert (counts["missing"], counts["extra"], counts["groups"]) == (0, 0, 2)


def test_a_problem_is_said_in_words():
    different = {"problem": "different", "group": "ad=1", "measure": "count", "view": "4", "recomputed": "3"}
    assert audit_view.describe(different) == "ad=1: count 4 in the view, 3 recomputed"
    missing = {"problem": "missing", "group": "ad=2", "measure": "", "view": "", "recomputed": "count 5"}
    assert audit_view.describe(missing) == "ad=2: missing (count 5)"
