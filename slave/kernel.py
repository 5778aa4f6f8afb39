"""The join kernels: all pairs with matching keys and lower <= b.ts - a.ts <= upper.

Block-nested-loop joins in the paper compare every tuple of a new block with
every tuple of the opposite mini-window.  Here the smaller side is indexed once
and every tuple of the larger side finds exactly its partners:

- `window_matches` (equi-join): a hash table over the smaller side's keys, each key
  pointing at its run of tuples ordered by ts; a probe finds its key's run and,
  with a binary search on time, the partners within its time bounds.  Searching on
  time too matters: with few distinct keys and large batches, pairs that share a
  key but lie far apart in time would otherwise outnumber the results by orders
  of magnitude.  O(n + m log m + results) for m <= n.
- `range_matches` (band and inequality joins): the smaller side sorted by key, a
  probe's key range found by binary search, candidates filtered on time.

Both are compiled from numba's subset of Python, one signature each: built ahead of time
(protocol.compiled, deploy.kernels) or compiled by numba where no build is present; a compiled probe replaced a
vectorized numpy kernel that
spent most of a slave's time (docs/benchmark-history.md, "The compiled join kernel").  Each probe
loop runs twice, count then fill, so the index arrays are allocated at their
exact size; the fill writes any slice of the pairs (`Matches.take`), so a
batch's results are produced in chunks of bounded size (slave.join).  Times and
the bounds are integer microseconds (protocol.eventtime): lower <= b.ts - a.ts <= upper is an exact integer
comparison, the same one expiry makes, so a pair exactly `lower` or `upper` apart joins (valid ts and bounds
are far below int64's ends: no difference overflows).  The bounds are those of join.lower / join.upper
(s.ts - r.ts) when a is R; a kernel that indexes the other side swaps a and b and mirrors them to
(-upper, -lower).
"""

from __future__ import annotations

from functools import partial

import numpy as np

from protocol import delays
from protocol.compiled import kernels

_I64_MIN, _I64_MAX = np.iinfo(np.int64).min, np.iinfo(np.int64).max
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: the top bits of key * 2^64/phi

# one signature per kernel, layout "A": field views of the structured windows are strided, test arrays are not
_EQUI_SIG = "UniTuple(int64[::1], 3)(int64[:], int64[:], int64[:], int64[:], int64, int64)"
_EQUI_FILL_SIG = "void(int64[::1], int64[::1], int64[::1], int64, int64[::1], int64[::1])"
_DELAYS_SIG = (
    "void(float64[:], float64[:], int64[::1], float64[::1], float64, float64, float64[::1], float64, "
    "float64, float64[::1], int64[:, ::1])"
)
_RANGE_SIG = (
    "UniTuple(int64[::1], 5)(int64[:], int64[:], int64[:], int64[:], int64, int64, int64, int64, boolean, "
    "boolean, int64, int64, boolean)"
)
_RANGE_FILL_SIG = (
    "void(int64[:], int64[::1], int64[::1], int64[::1], int64[::1], int64[::1], int64, int64, int64, "
    "int64[::1], int64[::1])"
)
_GATHER_SIG = "void(int64[:, ::1], int64[::1], int64[:, ::1], int64[::1], int64[::1], int64[:, ::1], int64)"


def _slot(used, slot_key, k, shift, mask):  # pragma: no cover - compiled
    """Open addressing: the slot that holds key k, or the free slot where it belongs."""
    h = np.int64((np.uint64(k) * _GOLDEN) >> shift)
    while used[h] and slot_key[h] != k:
        h = (h + 1) & mask
    return h


def _equi_count(a_key, a_ts, b_key, b_ts, lower, upper):  # pragma: no cover - compiled
    """The count pass for len(b) <= len(a), both non-empty: hash b's keys, probe with every a.  Returns
    (run_idx, first, offsets): probe i's partners are run_idx[first[i]:][:offsets[i + 1] - offsets[i]], and
    offsets[i] numbers its first pair (`_equi_fill` writes any slice of the pairs)."""
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
    run_ts = np.empty(n_b, np.int64)
    for j in np.argsort(b_ts, kind="mergesort"):  # each run in ts order
        p = fill[slot_of[j]]
        run_idx[p] = j
        run_ts[p] = b_ts[j]
        fill[slot_of[j]] = p + 1
    first = np.zeros(n_a, np.int64)
    offsets = np.zeros(n_a + 1, np.int64)
    for i in range(n_a):
        offsets[i + 1] = offsets[i]
        h = _slot(used, slot_key, a_key[i], shift, mask)
        if not used[h]:
            continue
        t = a_ts[i]
        lo, hi = start[h], start[h + 1]
        while lo < hi:  # first partner: b.ts - t >= lower
            mid = (lo + hi) >> 1
            if run_ts[mid] - t < lower:
                lo = mid + 1
            else:
                hi = mid
        end = lo
        stop = start[h + 1]
        while end < stop and run_ts[end] - t <= upper:
            end += 1
        first[i] = lo
        offsets[i + 1] += end - lo
    return run_idx, first, offsets


def _probe_of(offsets, pair):  # pragma: no cover - compiled
    """The probe whose pairs hold pair number `pair`: the last i with offsets[i] <= pair."""
    lo, hi = 0, len(offsets) - 1
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if offsets[mid] <= pair:
            lo = mid
        else:
            hi = mid
    return lo


def _equi_fill(run_idx, first, offsets, start, ia, ib):  # pragma: no cover - compiled
    """Pairs start .. start + len(ia) - 1 of an `_equi_count`, in probe order."""
    i = _probe_of(offsets, start)
    j, n = 0, len(ia)
    q = first[i] + start - offsets[i]  # the slice may begin inside probe i's partners
    while j < n:
        stop = min(first[i] + offsets[i + 1] - offsets[i], q + n - j)
        for p in range(q, stop):
            ia[j] = i
            ib[j] = run_idx[p]
            j += 1
        i += 1
        if i < len(first):
            q = first[i]


def _range_count(
    a_key, a_ts, b_key, b_ts, lower, upper, low, high, has_low, has_high, home_lo, home_hi, clip
):  # pragma: no cover - compiled
    """The count pass for low <= b.key - a.key <= high (a bound is open unless has_*), lower <= b.ts - a.ts <= upper.
    With `clip`, a probe whose key is outside [home_lo, home_hi] (a guest copy) looks only at candidates whose key
    is inside (at home).  Returns (order, times, first, last, offsets): b sorted by key (its indices and ts), probe
    i's candidates first[i]..last[i]-1 in that order, offsets[i] the number of its first pair (`_range_fill`)."""
    n_a, n_b = len(a_key), len(b_key)
    order = np.argsort(b_key, kind="mergesort")
    keys = np.empty(n_b, np.int64)
    times = np.empty(n_b, np.int64)
    for q in range(n_b):
        keys[q] = b_key[order[q]]
        times[q] = b_ts[order[q]]
    first = np.zeros(n_a, np.int64)
    last = np.zeros(n_a, np.int64)
    offsets = np.zeros(n_a + 1, np.int64)
    for i in range(n_a):
        offsets[i + 1] = offsets[i]
        k = a_key[i]
        guest = clip and (k < home_lo or k > home_hi)
        bounded, target = False, np.int64(0)
        if has_low:  # first key >= k + low, saturating instead of wrapping around
            if low > 0 and k > _I64_MAX - low:
                continue
            if not (low < 0 and k < _I64_MIN - low):
                bounded, target = True, k + low
        if guest and (not bounded or target < home_lo):
            bounded, target = True, home_lo
        lo, hi = 0, n_b
        if bounded:
            while lo < hi:
                mid = (lo + hi) >> 1
                if keys[mid] < target:
                    lo = mid + 1
                else:
                    hi = mid
        start = lo
        bounded, target = False, np.int64(0)
        if has_high:  # first key > k + high
            if high < 0 and k < _I64_MIN - high:
                continue
            if not (high > 0 and k > _I64_MAX - high):
                bounded, target = True, k + high
        if guest and (not bounded or target > home_hi):
            bounded, target = True, home_hi
        lo, hi = start, n_b
        if bounded:
            while lo < hi:
                mid = (lo + hi) >> 1
                if keys[mid] <= target:
                    lo = mid + 1
                else:
                    hi = mid
            hi = lo
        t = a_ts[i]
        for q in range(start, hi):
            if lower <= times[q] - t <= upper:
                offsets[i + 1] += 1
        first[i], last[i] = start, hi
    return order, times, first, last, offsets


def _range_fill(a_ts, order, times, first, last, offsets, lower, upper, start, ia, ib):  # pragma: no cover - compiled
    """Pairs start .. start + len(ia) - 1 of a `_range_count`, in probe order: the first probe's candidates
    are filtered again up to the slice's first pair."""
    i = _probe_of(offsets, start)
    skip = start - offsets[i]
    j, n = 0, len(ia)
    while j < n:
        t = a_ts[i]
        for q in range(first[i], last[i]):
            if lower <= times[q] - t <= upper:
                if skip:
                    skip -= 1
                    continue
                ia[j] = i
                ib[j] = order[q]
                j += 1
                if j == n:
                    break
        i += 1


class Matches:
    """A kernel's count pass: its pairs numbered 0..total-1 in probe order, written in any slices (`take`), so
    that a batch's pairs need never exist all at once (output.result_chunk_rows).  The count pass keeps only
    per-tuple arrays (each probe's first partner and pair number), so a hot key's millions of pairs cost
    memory only as they are taken."""

    def __init__(self, total: int, fill=None, swapped: bool = False):
        self.total, self._fill, self._swapped = total, fill, swapped

    def take(self, start: int = 0, stop: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(ia, ib) of pairs start..stop-1 (all by default)."""
        stop = self.total if stop is None else stop
        ia, ib = np.empty(stop - start, np.int64), np.empty(stop - start, np.int64)
        if stop > start:
            self._fill(start, ia, ib)
        return (ib, ia) if self._swapped else (ia, ib)

    def swapped(self) -> Matches:
        """The same pairs with the sides' roles exchanged: (ib, ia)."""
        return Matches(self.total, self._fill, not self._swapped)


_NONE = Matches(0)


def window_matches(
    a_key: np.ndarray, a_ts: np.ndarray, b_key: np.ndarray, b_ts: np.ndarray, lower: int, upper: int
) -> Matches:
    """Every pair with a_key[ia] == b_key[ib] and lower <= b_ts[ib] - a_ts[ia] <= upper (ts and bounds in
    integer microseconds), counted; the larger side probes (as a, with the bounds mirrored if it was b)."""
    if len(a_key) == 0 or len(b_key) == 0:
        return _NONE
    if len(a_key) < len(b_key):
        return window_matches(b_key, b_ts, a_key, a_ts, -upper, -lower).swapped()
    run_idx, first, offsets = _equi_count(a_key, a_ts, b_key, b_ts, int(lower), int(upper))
    return Matches(int(offsets[-1]), partial(_equi_fill, run_idx, first, offsets))


def range_matches(
    a_key: np.ndarray,
    a_ts: np.ndarray,
    b_key: np.ndarray,
    b_ts: np.ndarray,
    lower: int,
    upper: int,
    low: int | None,
    high: int | None,
    home: tuple[int, int] | None = None,
) -> Matches:
    """Every pair with low <= b_key - a_key <= high and lower <= b_ts - a_ts <= upper, counted; with `home`
    (first, last key), only the pairs of which at least one key is in [first, last].

    A bound of None is open.  The band join is (-band, band); r.key < s.key is (1, None) with a = R.
    The smaller side is sorted by key and every tuple of the larger side finds its key range with two
    binary searches (BiStream keeps a sorted index per predicate for the same reason); candidates are
    then filtered on time.  The stored side holds about one window of tuples (expiry), so candidates
    exceed results by about the ratio of the stored time span to upper - lower.  `home` is a full join's
    range (slave.join): a pair of two guest copies is neither emitted nor flagged there, so a probe outside the
    range searches only the keys inside it -- with less, most of a range's tuples are guests of both sides.
    """
    if len(a_key) == 0 or len(b_key) == 0:
        return _NONE
    if len(a_key) < len(b_key):  # search in the smaller side: a's key range as seen from b is mirrored
        return range_matches(
            b_key,
            b_ts,
            a_key,
            a_ts,
            -upper,
            -lower,
            None if high is None else -high,
            None if low is None else -low,
            home,
        ).swapped()
    home_lo, home_hi = (0, 0) if home is None else map(int, home)
    order, times, first, last, offsets = _range_count(
        a_key,
        a_ts,
        b_key,
        b_ts,
        int(lower),
        int(upper),
        0 if low is None else int(low),
        0 if high is None else int(high),
        low is not None,
        high is not None,
        home_lo,
        home_hi,
        home is not None,
    )
    return Matches(
        int(offsets[-1]), partial(_range_fill, a_ts, order, times, first, last, offsets, int(lower), int(upper))
    )


def _gather_pairs(words_r, ir, words_s, is_, fields, out, at):  # pragma: no cover - compiled
    k = len(fields)  # column by column: each loop writes one output row in order (measured 20% faster)
    for f in range(k):
        field, out_r, out_s = fields[f], out[f], out[k + f]
        for j in range(len(ir)):
            out_r[at + j] = words_r[ir[j], field]
        for j in range(len(is_)):
            out_s[at + j] = words_s[is_[j], field]


def gather_pairs(pieces: list, fields: np.ndarray, total: int) -> np.ndarray:
    """The joined pairs of `pieces` as columns: each piece is (R rows, ia, S rows, ib), the rows as int64 words
    (n x words per tuple); row f of the result is word fields[f] of R tuple ia, row k + f that of S tuple ib,
    pieces one after the other.  One pass from the windows straight into the columns results are written and
    sent as: gathering whole 64-byte records, concatenating them and then reading their fields strided (what
    Arrow and the delay histograms did) moved about 4x the bytes."""
    out = np.empty((2 * len(fields), total), dtype=np.int64)
    at = 0
    for words_r, ia, words_s, ib in pieces:
        _gather_pairs(words_r, ia, words_s, ib, fields, out, at)
        at += len(ia)
    return out


def _bin_of(x, bits, edges, log_first, per_decade):  # pragma: no cover - compiled
    """How many `edges` are <= x (`bits`: x's IEEE 754 bits).  The guess reads log2(x) off the bits (exponent
    plus mantissa as its fraction, within 0.09 of the truth): a bin or so off, then corrected by comparing with
    the edges next to it.  The libm log it replaces cost more than everything else in the loop."""
    last = len(edges)
    if not x > 0:  # zero, negative (and NaN, which no delay is): below every edge
        return 0 if x <= 0 else last
    log2 = (bits - 0x3FF0000000000000) * (1.0 / 4503599627370496.0) + 0.043
    guess = (log2 * 0.30102999566398120 - log_first) * per_decade
    i = min(int(guess) + 1, last) if guess > 0 else 0
    while i < last and edges[i] <= x:
        i += 1
    while i > 0 and edges[i - 1] > x:
        i -= 1
    return i


def _batch_delays(
    r_arrival, s_arrival, ends, times, sent, started, edges, log_first, per_decade, delay, counts
):  # pragma: no cover - compiled
    scratch = np.empty(1, np.float64)  # a part's bits: written as float64, read as int64
    bits = scratch.view(np.int64)
    delay_bits = delay.view(np.int64)
    lo = 0
    for g in range(len(ends)):
        hi, produced = ends[g], times[g]
        scratch[0] = produced - started
        counts[3, _bin_of(scratch[0], bits[0], edges, log_first, per_decade)] += hi - lo
        for i in range(lo, hi):
            arrival = max(r_arrival[i], s_arrival[i])
            delay[i] = produced - arrival
            counts[0, _bin_of(delay[i], delay_bits[i], edges, log_first, per_decade)] += 1
            scratch[0] = sent - arrival
            counts[1, _bin_of(scratch[0], bits[0], edges, log_first, per_decade)] += 1
        lo = hi
    scratch[0] = started - sent
    counts[2, _bin_of(scratch[0], bits[0], edges, log_first, per_decade)] += lo


def batch_delays(
    r_arrival: np.ndarray, s_arrival: np.ndarray, ends: np.ndarray, times: np.ndarray, sent: float, started: float
) -> tuple[np.ndarray, np.ndarray]:
    """A batch's production delays and their histograms, in one compiled pass over its results.

    Result i joined tuples that arrived at r_arrival[i] and s_arrival[i]; results ends[g-1]..ends[g]-1 were
    produced at times[g] (one partition-group each); the master sent the batch at `sent` and the slave began
    joining it at `started`.  Returns (delay per result, HISTOGRAMS x BINS counts): the delays, then their
    parts as `protocol.delays.decomposition` defines them (tests hold the two equal).  Binned with numpy's
    binary search, four histograms a batch cost a slave more CPU than its join (about 80 ns a result against
    20 here, measured on a million results)."""
    delay = np.empty(len(r_arrival), dtype=np.float64)
    counts = np.zeros((1 + len(delays.PARTS), delays.BINS), dtype=np.int64)
    _batch_delays(
        r_arrival,
        s_arrival,
        np.asarray(ends, dtype=np.int64),
        np.asarray(times, dtype=np.float64),
        float(sent),
        float(started),
        delays.EDGES,
        float(delays.LOG_FIRST),
        float(delays.PER_DECADE),
        delay,
        counts,
    )
    return delay, counts


_equi_count, _equi_fill, _range_count, _range_fill, _gather_pairs, _batch_delays = kernels(
    __name__,
    {
        "_equi_count": _EQUI_SIG,
        "_equi_fill": _EQUI_FILL_SIG,
        "_range_count": _RANGE_SIG,
        "_range_fill": _RANGE_FILL_SIG,
        "_gather_pairs": _GATHER_SIG,
        "_batch_delays": _DELAYS_SIG,
    },
    inline=("_slot", "_probe_of", "_bin_of"),
)
