"""The window-join kernel: all pairs with equal keys and timestamps at most `window` apart.

Block-nested-loop joins in the paper compare every tuple of a new block with
every tuple of the opposite mini-window.  Done as Python loops that is hopeless;
done as an n x m broadcast it is quadratic in memory.  Here the smaller side is
sorted once by (key, ts), and every tuple of the larger side finds, with two
binary searches, exactly the run of partners with its key and a ts within the
window; the pairs are expanded with `repeat`.  Searching on time too (not only
on the key) matters: with few distinct keys and large batches, pairs that share
a key but lie far apart in time would otherwise outnumber the results by orders
of magnitude.  O((n + m) log min(n, m) + results), all in numpy.
"""
from __future__ import annotations

import numpy as np

_EMPTY = np.empty(0, dtype=np.int64)


def window_join(a_key: np.ndarray, a_ts: np.ndarray, b_key: np.ndarray, b_ts: np.ndarray,
                window: float) -> tuple[np.ndarray, np.ndarray]:
    """Index arrays (ia, ib) of every pair with a_key[ia] == b_key[ib] and |a_ts[ia] - b_ts[ib]| <= window."""
    if len(a_key) == 0 or len(b_key) == 0:
        return _EMPTY, _EMPTY
    if len(a_key) < len(b_key):
        ib, ia = window_join(b_key, b_ts, a_key, a_ts, window)
        return ia, ib
    # b is the smaller side.  Key ranks and times combine into one sortable float: rank * span + ts,
    # where span exceeds the whole time range plus twice the window, so a search around one tuple's
    # time never leaves its key's run.
    keys = np.unique(b_key)
    rank_b = np.searchsorted(keys, b_key)
    rank_a = np.minimum(np.searchsorted(keys, a_key), len(keys) - 1)
    known = np.flatnonzero(keys[rank_a] == a_key)
    if len(known) == 0:
        return _EMPTY, _EMPTY
    t0 = min(float(a_ts.min()), float(b_ts.min()))
    span = max(float(a_ts.max()), float(b_ts.max())) - t0 + 2.0 * window + 1.0
    slack = 4.0 * float(np.spacing(len(keys) * span))  # rounding of the combined value; filtered exactly below
    combined_b = rank_b * span + (b_ts - t0)
    order = np.argsort(combined_b, kind="stable")
    sorted_b = combined_b[order]
    combined_a = rank_a[known] * span + (a_ts[known] - t0)
    lo = np.searchsorted(sorted_b, combined_a - window - slack, side="left")
    hi = np.searchsorted(sorted_b, combined_a + window + slack, side="right")
    counts = hi - lo
    hit = np.flatnonzero(counts)
    if len(hit) == 0:
        return _EMPTY, _EMPTY
    counts = counts[hit]
    total = int(counts.sum())
    ia = np.repeat(known[hit], counts)
    # position within each run: 0..count-1, offset by the run's start
    starts = np.cumsum(counts) - counts
    ib = order[np.arange(total, dtype=np.int64) - np.repeat(starts, counts) + np.repeat(lo[hit], counts)]
    keep = (a_key[ia] == b_key[ib]) & (np.abs(a_ts[ia] - b_ts[ib]) <= window)
    return ia[keep], ib[keep]


def range_join(a_key: np.ndarray, a_ts: np.ndarray, b_key: np.ndarray, b_ts: np.ndarray, window: float,
               low: int | None, high: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Index arrays (ia, ib) of every pair with low <= b_key - a_key <= high and |a_ts - b_ts| <= window.

    A bound of None is open.  The band join is (-band, band); r.key < s.key is (1, None) with a = R.
    The smaller side is sorted by key and every tuple of the larger side finds its key range with two
    binary searches (BiStream keeps a sorted index per predicate for the same reason); candidates are
    then filtered on time.  The stored side holds about one window of tuples (expiry), so candidates
    exceed results by about the ratio of the stored time span to the window.
    """
    if len(a_key) == 0 or len(b_key) == 0:
        return _EMPTY, _EMPTY
    if len(a_key) < len(b_key):  # search in the smaller side: a's key range as seen from b is mirrored
        ib, ia = range_join(b_key, b_ts, a_key, a_ts, window, None if high is None else -high,
                            None if low is None else -low)
        return ia, ib
    order = np.argsort(b_key, kind="stable")
    sorted_key = b_key[order]
    lo = np.zeros(len(a_key), np.int64) if low is None else np.searchsorted(sorted_key, a_key + low, side="left")
    hi = np.full(len(a_key), len(b_key), np.int64) if high is None else \
        np.searchsorted(sorted_key, a_key + high, side="right")
    counts = np.maximum(hi - lo, 0)
    hit = np.flatnonzero(counts)
    if len(hit) == 0:
        return _EMPTY, _EMPTY
    counts = counts[hit]
    total = int(counts.sum())
    ia = np.repeat(hit, counts)
    starts = np.cumsum(counts) - counts
    ib = order[np.arange(total, dtype=np.int64) - np.repeat(starts, counts) + np.repeat(lo[hit], counts)]
    keep = np.abs(a_ts[ia] - b_ts[ib]) <= window
    return ia[keep], ib[keep]
