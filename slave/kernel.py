"""The join kernels: all pairs with matching keys and timestamps at most `window` apart.

Block-nested-loop joins in the paper compare every tuple of a new block with
every tuple of the opposite mini-window.  Here the smaller side is indexed once
and every tuple of the larger side finds exactly its partners:

- `window_join` (equi-join): a hash table over the smaller side's keys, each key
  pointing at its run of tuples ordered by ts; a probe finds its key's run and,
  with a binary search on time, the partners within the window.  Searching on
  time too matters: with few distinct keys and large batches, pairs that share a
  key but lie far apart in time would otherwise outnumber the results by orders
  of magnitude.  O(n + m log m + results) for m <= n.
- `range_join` (band and inequality joins): the smaller side sorted by key, a
  probe's key range found by binary search, candidates filtered on time.

Both are compiled with numba (cached on disk, one signature each, compiled at
import or loaded from the cache; `make setup`, `python -m slave.kernel` and the
launcher warm it, so 16 slave ranks never compile at once).  Profiled on the
epoch batches of `deploy.bench_kernel`, the equi-join kernel took 0.7 s where
the earlier vectorized numpy kernel (np.unique, three searchsorted and a
repeat/arange expansion per call) took 6.0 s of the slave's 11.7 s.  Each probe
loop runs twice, count then fill, so the index arrays are allocated once at
their exact size.  The time condition is evaluated exactly as
|a.ts - b.ts| <= window (floating-point subtraction is monotone, so a probe's
partners are one contiguous run of the ts-ordered side).
"""
from __future__ import annotations

import math
import sys

import numpy as np
from numba import njit

from protocol import delays

_EMPTY = np.empty(0, dtype=np.int64)
_I64_MIN, _I64_MAX = np.iinfo(np.int64).min, np.iinfo(np.int64).max
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: the top bits of key * 2^64/phi

# one signature per kernel, layout "A": field views of the structured windows are strided, test arrays are not
_EQUI_SIG = "UniTuple(int64[::1], 2)(int64[:], float64[:], int64[:], float64[:], float64)"
_BINS_SIG = "void(float64[:], float64[::1], float64, float64, int64[::1])"
_RANGE_SIG = "UniTuple(int64[::1], 2)(int64[:], float64[:], int64[:], float64[:], float64, int64, int64, boolean, boolean)"


@njit(cache=True, nogil=True, inline="always")
def _slot(used, slot_key, k, shift, mask):  # pragma: no cover - compiled
    """Open addressing: the slot that holds key k, or the free slot where it belongs."""
    h = np.int64((np.uint64(k) * _GOLDEN) >> shift)
    while used[h] and slot_key[h] != k:
        h = (h + 1) & mask
    return h


@njit(_EQUI_SIG, cache=True, nogil=True)
def _equi_join(a_key, a_ts, b_key, b_ts, window):  # pragma: no cover - compiled
    """(ia, ib) for len(b) <= len(a), both non-empty: hash b's keys, probe with every a."""
    n_a, n_b = len(a_key), len(b_key)
    bits = 1
    while (1 << bits) < 2 * n_b:
        bits += 1
    size = 1 << bits
    mask = size - 1
    shift = np.uint64(64 - bits)
    used = np.zeros(size, np.bool_)
    slot_key = np.empty(size, np.int64)
    count = np.zeros(size + 1, np.int64)
    slot_of = np.empty(n_b, np.int64)
    for j in range(n_b):
        h = _slot(used, slot_key, b_key[j], shift, mask)
        if not used[h]:
            used[h] = True
            slot_key[h] = b_key[j]
        slot_of[j] = h
        count[h + 1] += 1
    start = np.cumsum(count)  # the run of slot h is start[h]..start[h+1]
    fill = start[:size].copy()
    run_idx = np.empty(n_b, np.int64)
    run_ts = np.empty(n_b, np.float64)
    for j in np.argsort(b_ts, kind="mergesort"):  # each run in ts order
        p = fill[slot_of[j]]
        run_idx[p] = j
        run_ts[p] = b_ts[j]
        fill[slot_of[j]] = p + 1
    first = np.empty(n_a, np.int64)
    hits = np.zeros(n_a, np.int64)
    total = 0
    for i in range(n_a):
        h = _slot(used, slot_key, a_key[i], shift, mask)
        if not used[h]:
            continue
        t = a_ts[i]
        lo, hi = start[h], start[h + 1]
        while lo < hi:  # first partner: t - b.ts <= window
            mid = (lo + hi) >> 1
            if t - run_ts[mid] > window:
                lo = mid + 1
            else:
                hi = mid
        end = lo
        stop = start[h + 1]
        while end < stop and run_ts[end] - t <= window:
            end += 1
        first[i] = lo
        hits[i] = end - lo
        total += end - lo
    ia = np.empty(total, np.int64)
    ib = np.empty(total, np.int64)
    at = 0
    for i in range(n_a):
        for q in range(first[i], first[i] + hits[i]):
            ia[at] = i
            ib[at] = run_idx[q]
            at += 1
    return ia, ib


@njit(_RANGE_SIG, cache=True, nogil=True)
def _range_join(a_key, a_ts, b_key, b_ts, window, low, high, has_low, has_high):  # pragma: no cover - compiled
    """(ia, ib) for low <= b.key - a.key <= high (a bound is open unless has_*), |dt| <= window."""
    n_a, n_b = len(a_key), len(b_key)
    order = np.argsort(b_key, kind="mergesort")
    keys = np.empty(n_b, np.int64)
    times = np.empty(n_b, np.float64)
    for q in range(n_b):
        keys[q] = b_key[order[q]]
        times[q] = b_ts[order[q]]
    first = np.zeros(n_a, np.int64)
    last = np.zeros(n_a, np.int64)
    total = 0
    for i in range(n_a):
        k = a_key[i]
        lo, hi = 0, n_b
        if has_low:  # first key >= k + low, saturating instead of wrapping around
            if low > 0 and k > _I64_MAX - low:
                continue
            if not (low < 0 and k < _I64_MIN - low):
                target = k + low
                while lo < hi:
                    mid = (lo + hi) >> 1
                    if keys[mid] < target:
                        lo = mid + 1
                    else:
                        hi = mid
        start = lo
        lo, hi = start, n_b
        if has_high:  # first key > k + high
            if high < 0 and k < _I64_MIN - high:
                continue
            if not (high > 0 and k > _I64_MAX - high):
                target = k + high
                while lo < hi:
                    mid = (lo + hi) >> 1
                    if keys[mid] <= target:
                        lo = mid + 1
                    else:
                        hi = mid
                hi = lo
            else:
                hi = n_b
        t = a_ts[i]
        for q in range(start, hi):
            if abs(t - times[q]) <= window:
                total += 1
        first[i], last[i] = start, hi
    ia = np.empty(total, np.int64)
    ib = np.empty(total, np.int64)
    at = 0
    for i in range(n_a):
        t = a_ts[i]
        for q in range(first[i], last[i]):
            if abs(t - times[q]) <= window:
                ia[at] = i
                ib[at] = order[q]
                at += 1
    return ia, ib


def window_join(a_key: np.ndarray, a_ts: np.ndarray, b_key: np.ndarray, b_ts: np.ndarray,
                window: float) -> tuple[np.ndarray, np.ndarray]:
    """Index arrays (ia, ib) of every pair with a_key[ia] == b_key[ib] and |a_ts[ia] - b_ts[ib]| <= window."""
    if len(a_key) == 0 or len(b_key) == 0:
        return _EMPTY, _EMPTY
    if len(a_key) < len(b_key):
        ib, ia = _equi_join(b_key, b_ts, a_key, a_ts, float(window))
        return ia, ib
    return _equi_join(a_key, a_ts, b_key, b_ts, float(window))


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
    return _range_join(a_key, a_ts, b_key, b_ts, float(window), 0 if low is None else int(low),
                       0 if high is None else int(high), low is not None, high is not None)


@njit(_BINS_SIG, cache=True, nogil=True)
def _count_bins(values, edges, log_first, per_decade, counts):  # pragma: no cover - compiled
    """counts[i] += the values with exactly i edges <= them: a first guess from the log (the edges are
    10^(log_first + j / per_decade)), corrected by comparing with the edges next to it."""
    last = len(edges)
    for x in values:
        if not x > 0:  # zero, negative (and NaN, which no delay is): below every edge
            i = 0 if x <= 0 else last
        else:
            i = min(max(int(math.floor((math.log10(x) - log_first) * per_decade)) + 1, 0), last)
            while i < last and edges[i] <= x:
                i += 1
            while i > 0 and edges[i - 1] > x:
                i -= 1
        counts[i] += 1


def delay_histogram(values: np.ndarray) -> np.ndarray:
    """`protocol.delays.histogram`, compiled: a slave bins every result's delay and its parts each batch, and
    numpy's binary search per value cost it more CPU than the join (about 60 ns a value against about 5)."""
    counts = np.zeros(delays.BINS, dtype=np.int64)
    _count_bins(np.asarray(values, dtype=np.float64), delays.EDGES, delays.LOG_FIRST, delays.PER_DECADE, counts)
    return counts


if __name__ == "__main__":  # `python -m slave.kernel`: compile into the on-disk cache (make setup runs this)
    print(f"join kernels compiled and cached ({sys.modules['numba'].__version__})")
