"""Compiled passes of the input reader (common.stream_file) over a checked batch, and of the master's merge of two
declared streams (master.sources.streams): each is one loop over the rows where numpy took a pass per step, or a
merge where a sort was taken of two runs already in order (docs/benchmark-history.md, "Session 19").  Imported
where they run, never at the reader's import: control's commands read files too, and only the passes load the
kernels (built ahead of time, protocol.compiled).
"""

from __future__ import annotations

import numpy as np

from protocol.compiled import kernels

_RISING_SIG = "int64(int8[::1], boolean[::1], int64[::1], int64[::1], boolean[::1], boolean[::1])"
_TOPS_SIG = "void(int8[::1], int64[::1], int64[::1], boolean[::1])"
_NUMBERS_SIG = "void(float64[::1], float64, int64, int64[::1], boolean[::1])"
_WATERMARKS_SIG = "int64(int64[::1], int64, int64, int64[::1])"
_RUN = "int64[::1], int64[::1], int64[::1], int64[::1]"
_MERGE_SIG = f"void({_RUN}, {_RUN}, int8[::1], int64[::1], int64[::1], int64[::1], int64[::1], int64)"


def _rising(code, is_s, ids, tops, has, suspect):  # pragma: no cover - compiled
    """IdCheck's first look at a batch: a good row (code 0) is suspect unless its id is above every earlier good
    id of its stream (`tops`, per stream; `has`: whether there was one); `tops` and `has` move on past the batch.
    Returns the suspects."""
    suspects = 0
    for i in range(len(code)):
        if code[i] != 0:
            continue
        s = 1 if is_s[i] else 0
        if has[s] and ids[i] <= tops[s]:
            suspect[i] = True
            suspects += 1
        else:
            tops[s], has[s] = ids[i], True
    return suspects


def _tops(stream, ids, tops, has):  # pragma: no cover - compiled
    """The highest id per stream (`stream` 0 or 1) moved on past `ids` (`has`: whether there was one)."""
    for i in range(len(ids)):
        s = stream[i]
        if not has[s] or ids[i] > tops[s]:
            tops[s], has[s] = ids[i], True


def _numbers(x, per_unit, limit, ticks, ok):  # pragma: no cover - compiled
    """protocol.eventtime.from_numbers for units of a microsecond or more (`per_unit` microseconds each, whole):
    the same float steps row by row, so the same ticks."""
    bound = limit / per_unit
    for i in range(len(x)):
        v = x[i]
        good = abs(v) < bound  # NaN compares False; so does an infinity
        t = 0
        if good:
            whole = np.floor(v)
            t = np.int64(whole) * np.int64(per_unit) + np.int64(np.rint((v - whole) * per_unit))
            good = -limit < t < limit
        ok[i] = good
        ticks[i] = t if good else 0


def _watermarks(ts, running, delay, watermark):  # pragma: no cover - compiled
    """Each tuple's watermark: the largest ts up to it (from `running`) minus `delay`; returns the new largest."""
    for i in range(len(ts)):
        running = max(running, ts[i])
        watermark[i] = running - delay
    return running


def _merge(r_rows, r_ts, r_keys, r_wm, s_rows, s_ts, s_keys, s_wm, side, rows, ts, keys, src, at):  # pragma: no cover
    """R's and S's runs (rows, ts, keys, watermark; each in rising watermark order) merged into `side`, `rows`,
    `ts` and `keys` from `at` on: by watermark, R first where they tie, each run's own order kept (what a stable
    sort by watermark, then side, gives); `src`: each merged tuple's place in R's run followed by S's."""
    i, j, nr, ns = 0, 0, len(r_wm), len(s_wm)
    for k in range(nr + ns):
        if j >= ns or (i < nr and r_wm[i] <= s_wm[j]):
            side[at + k], rows[at + k], ts[at + k], keys[at + k], src[k] = 0, r_rows[i], r_ts[i], r_keys[i], i
            i += 1
        else:
            side[at + k], rows[at + k], ts[at + k], keys[at + k], src[k] = 1, s_rows[j], s_ts[j], s_keys[j], nr + j
            j += 1


_rising, _tops, _numbers, _watermarks, _merge = kernels(
    __name__,
    {
        "_rising": _RISING_SIG,
        "_tops": _TOPS_SIG,
        "_numbers": _NUMBERS_SIG,
        "_watermarks": _WATERMARKS_SIG,
        "_merge": _MERGE_SIG,
    },
)
