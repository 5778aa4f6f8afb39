"""The join predicates both roles must agree on: which key distances s.key - r.key join, and which time
distances s.ts - r.ts (`time_bounds`).

`equal` is served by hash partitioning; `band` and `less` by key ranges
(master/state/ranges.py), where the master routes with these bounds and the slaves'
kernel filters with them.
"""

from __future__ import annotations

from protocol import eventtime
from protocol.tuples import STREAM_R, STREAM_S

#: `join.type`: inner gives pairs only; left keeps every R, right every S, full both, each row without a
#: partner once with the other side's columns null; semi gives each R with a partner once, anti each R without
JOIN_TYPES = ("inner", "left", "right", "full", "semi", "anti")
#: the `kind` of a row in the results of a join other than inner: a pair, an R row without a partner (left,
#: full, anti), an S row without one (right, full), an R row with one (semi; its s_* columns are null)
MATCHED, LEFT_UNMATCHED, RIGHT_UNMATCHED, LEFT_MATCHED = "matched", "left_unmatched", "right_unmatched", "left_matched"


def copied_stream(join_type: str) -> int:
    """The stream copied where one must be (an R or S tuple into several key ranges or hot-key sub-groups; the
    other is stored once, where its pairs are produced): S for the joins that decide R rows alone from R's
    matched flag (left, semi, anti), else R."""
    return STREAM_S if join_type in ("left", "semi", "anti") else STREAM_R


def hot_grids(join_type: str, stream: int, first: int, count: int) -> tuple[range, range]:
    """A hot key's sub-groups first..first+count-1 (master.state.hot_key_router) as a tuple of `stream` sees them:
    (those it is spread over, stored at home in one by a hash of its id; those it is copied into, every one).  One grid
    (Streaming HyperCube, paper 000): the `copied_stream` copied, the other spread.  A full join keeps both
    sides, so it has two grids of count / 2: S spread and R copied, then R spread and S copied; each tuple is
    at home in one sub-group and a guest in the other grid (slave.join)."""
    if join_type == "full":
        grids = range(first, first + count // 2), range(first + count // 2, first + count)
        return grids[::-1] if stream == STREAM_R else grids
    grid = range(first, first + count)
    return (range(0), grid) if stream == copied_stream(join_type) else (grid, range(0))


def hot_homes(join_type: str, stream: int, first: int, count: int) -> range:
    """The sub-groups a merge gathers the tuples of `stream` from, each tuple once (with its flag): those it is
    spread over, or the first it is copied into (`hot_grids`)."""
    spread, copied = hot_grids(join_type, stream, first, count)
    return spread or copied[:1]


def range_copied(join_type: str) -> tuple[int, ...]:
    """The streams key ranges (band and less joins) copy into every range that may hold partners: one
    (`copied_stream`), or both for a full join, whose R and S rows alone are each decided once, at the tuple's
    home range (the range of its own key; its copies elsewhere are guests: slave.join)."""
    return (STREAM_R, STREAM_S) if join_type == "full" else (copied_stream(join_type),)


def final_time(stream: int, ts, bounds: tuple[int, int]):
    """When a stored tuple of `stream` with `ts` (microseconds; an int or an array) becomes final: once a batch's
    watermark W is above it, no on-time tuple still to come (ts >= W) can join it, so its row alone is decided
    (slave.join: decided iff final_time(stream, ts) < W, i.e. ts below its stream's expiry threshold), and the
    result stream gives that row this stream time (master.punctuation).  With `bounds` (lower, upper)
    (`time_bounds`): ts + upper for R, ts - lower for S (ts + window for both with the symmetric window)."""
    lower, upper = bounds
    return ts + upper if stream == STREAM_R else ts - lower


def key_distance(predicate: str, band: int) -> tuple[int | None, int | None]:
    """(low, high): r and s join iff low <= s.key - r.key <= high (None: open); (0, 0) is equality."""
    if predicate == "band":
        return -band, band
    if predicate == "less":  # r.key < s.key, keys are integers
        return 1, None
    return 0, 0


def time_bounds(join: dict) -> tuple[int, int]:
    """(lower, upper) in integer microseconds: r and s join iff lower <= s.ts - r.ts <= upper (Flink's
    intervalJoin between(lower, upper)).  `join.window = w` is the shorthand (-w, w); protocol.config refuses
    both forms together and one bound alone."""
    if join.get("lower") is None:
        w = eventtime.duration(join["window"])
        return -w, w
    return eventtime.duration(join["lower"]), eventtime.duration(join["upper"])
