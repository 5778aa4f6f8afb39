"""The join predicates both roles must agree on: which key distances s.key - r.key join.

`equal` is served by hash partitioning; `band` and `less` by key ranges
(master/ranges.py), where the master routes with these bounds and the slaves'
kernel filters with them.
"""
from __future__ import annotations

#: `join.type` (issue 22): inner gives pairs only; left keeps every R, right every S, full both, each row without a
#: partner once with the other side's columns null; semi gives each R with a partner once, anti each R without
JOIN_TYPES = ("inner", "left", "right", "full", "semi", "anti")


def key_distance(predicate: str, band: int) -> tuple[int | None, int | None]:
    """(low, high): r and s join iff low <= s.key - r.key <= high (None: open); (0, 0) is equality."""
    if predicate == "band":
        return -band, band
    if predicate == "less":  # r.key < s.key, keys are integers
        return 1, None
    return 0, 0
