"""The join predicates both roles must agree on: which key distances s.key - r.key join.

`equal` is served by hash partitioning; `band` and `less` by key ranges
(master/ranges.py), where the master routes with these bounds and the slaves'
kernel filters with them.
"""
from __future__ import annotations

from protocol.tuples import STREAM_R, STREAM_S

#: `join.type` (issue 22): inner gives pairs only; left keeps every R, right every S, full both, each row without a
#: partner once with the other side's columns null; semi gives each R with a partner once, anti each R without
JOIN_TYPES = ("inner", "left", "right", "full", "semi", "anti")


def copied_stream(join_type: str) -> int:
    """The stream copied where one must be (an R or S tuple into several key ranges or hot-key sub-groups; the
    other is stored once, where its pairs are produced): S for the joins that decide R rows alone from R's
    matched flag (left, semi, anti; issue 22), else R."""
    return STREAM_S if join_type in ("left", "semi", "anti") else STREAM_R


def key_distance(predicate: str, band: int) -> tuple[int | None, int | None]:
    """(low, high): r and s join iff low <= s.key - r.key <= high (None: open); (0, 0) is equality."""
    if predicate == "band":
        return -band, band
    if predicate == "less":  # r.key < s.key, keys are integers
        return 1, None
    return 0, 0
