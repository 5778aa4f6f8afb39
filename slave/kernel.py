"""The window-join kernel: all pairs with equal keys and timestamps at most `window` apart.

Block-nested-loop joins in the paper compare every tuple of a new block with
every tuple of the opposite mini-window.  Done as Python loops that is hopeless;
done as an n x m broadcast it is quadratic in memory.  Here the smaller side is
sorted by key once and every tuple of the larger side finds its partners with a
binary search (`searchsorted`), then the candidate pairs are expanded with
`repeat` and filtered on time: O((n + m) log min(n, m) + candidates), all in numpy.
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
    # b is the smaller side: sort it, probe it with every tuple of a.
    order = np.argsort(b_key, kind="stable")
    sorted_keys = b_key[order]
    lo = np.searchsorted(sorted_keys, a_key, side="left")
    hi = np.searchsorted(sorted_keys, a_key, side="right")
    counts = hi - lo
    hit = np.flatnonzero(counts)
    if len(hit) == 0:
        return _EMPTY, _EMPTY
    counts = counts[hit]
    total = int(counts.sum())
    ia = np.repeat(hit, counts)
    # position within each run of equal keys: 0..count-1, then offset by the run's start
    starts = np.cumsum(counts) - counts
    pos = np.arange(total, dtype=np.int64) - np.repeat(starts, counts) + np.repeat(lo[hit], counts)
    ib = order[pos]
    keep = np.abs(a_ts[ia] - b_ts[ib]) <= window
    return ia[keep], ib[keep]
