"""Compiled passes of the payload log's gather (protocol.payload.PayloadReader): where each asked row lies, in one
loop each where numpy took a dozen passes over a batch's pairs (docs/benchmark-history.md, "Session 19").
Here, not in protocol/, and imported where the gather runs: the Spark side imports every protocol module without
numba, and only these passes load the kernels (built ahead of time, protocol.compiled).
"""

from __future__ import annotations

from protocol.compiled import kernels

_SEGMENTS_SIG = "int64(int64[::1], int64[::1], int64[::1], int64[::1], boolean[::1])"
_PLACES_SIG = "boolean(int64[::1], int64[::1], int64[::1], int64[::1])"


def _segments(rows, firsts, lasts, seg, used):  # pragma: no cover - compiled
    """Each row's segment (`firsts`, `lasts`: each segment's first and last row, rising): `seg` (-1 for a row
    below 0: none asked), `used` set for each segment some row falls in; returns the first row no segment
    holds (its place), -1 if every one is held."""
    for i in range(len(rows)):
        row = rows[i]
        if row < 0:
            seg[i] = -1
            continue
        lo, hi = 0, len(firsts)  # the last segment whose first row is at most `row`
        while lo < hi:
            mid = (lo + hi) // 2
            if firsts[mid] <= row:
                lo = mid + 1
            else:
                hi = mid
        k = lo - 1
        if k < 0 or row > lasts[k]:
            return i
        seg[i], used[k] = k, True
    return -1


def _places(rows, seg, shift, index):  # pragma: no cover - compiled
    """Each row's place in the used segments side by side (its row plus its segment's `shift`; 0 where none is
    asked); returns whether every row is asked for."""
    every = True
    for i in range(len(rows)):
        if seg[i] < 0:
            index[i], every = 0, False
        else:
            index[i] = rows[i] + shift[seg[i]]
    return every


_segments, _places = kernels(__name__, {"_segments": _SEGMENTS_SIG, "_places": _PLACES_SIG})
