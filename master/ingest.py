"""Turning source chunks into wire tuples, and the lateness rule.

A tuple is late iff its ts is below (the largest ts of all tuples before it in
arrival order, both streams together) minus `join.max_delay`.  Late tuples are
set aside, never joined; everything else may be out of order by at most
max_delay, which is what makes watermark expiry safe (BiStream, Theorem 1).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from protocol.arrays import field_words, words
from protocol.tuples import FIELDS


def late_mask(ts: np.ndarray, running_max: float, max_delay: float) -> tuple[np.ndarray, np.ndarray, float]:
    """(late flags, largest ts before each tuple, new running max), over a whole batch at once."""
    before = np.maximum.accumulate(np.concatenate([[running_max], ts]))
    prev = before[:-1]
    return ts < prev - max_delay, prev, float(before[-1])


_PACK_SIG = ("void(int64[:], int64[:], int64[:], int64[:], int64[:], int64[::1], int64[::1], int64[::1], int64[::1], "
             "int64[:, ::1])")
_NONE = np.empty(0, dtype=np.int64)


@njit(_PACK_SIG, cache=True, nogil=True)
def _pack(ids, ts, keys, values, arrival, index, labels, starts, fields, out):  # pragma: no cover - compiled
    """Column row index[i] into record i, or with labels into the next free record of its label's group (the
    groups start at `starts`): the columns are read in order and written to one stream per group, where
    gathering them in group order missed the cache on every column of every tuple."""
    out[:] = 0  # the padding too: nothing of this process's memory goes on the wire
    grouped = len(labels) > 0
    for i in range(len(index)):
        j = index[i]
        if grouped:
            d = starts[labels[i]]
            starts[labels[i]] += 1
        else:
            d = i
        out[d, fields[0]] = ids[j]
        out[d, fields[1]] = ts[j]
        out[d, fields[2]] = keys[j]
        out[d, fields[3]] = values[j]
        out[d, fields[4]] = arrival[j]


def _packed(dtype: np.dtype, columns: tuple, index: np.ndarray | None, labels: np.ndarray, starts: np.ndarray):
    n = len(columns[0]) if index is None else len(index)
    rows = np.empty(n, dtype=dtype)
    index = np.arange(n, dtype=np.int64) if index is None else np.asarray(index, dtype=np.int64)
    # each column in its field's type, then as int64 words (floats as their bits)
    ids, ts, keys, values, arrival = (np.asarray(c, dtype=dtype[f]).view(np.int64) for f, c in zip(FIELDS, columns))
    _pack(ids, ts, keys, values, arrival, index, labels, starts, field_words(dtype, FIELDS), words(rows))
    return rows


def to_wire(dtype: np.dtype, ids, ts, keys, values, arrival, index: np.ndarray | None = None) -> np.ndarray:
    """Pack columns into the protocol's tuple records: rows `index` of them (all if None), in that order, in one
    compiled pass (gathering each column and then writing it into the records field by field cost the master
    about 100 ns a tuple, as much as generating it)."""
    return _packed(dtype, (ids, ts, keys, values, arrival), index, _NONE, _NONE)


def to_wire_grouped(dtype: np.dtype, ids, ts, keys, values, arrival, index: np.ndarray, labels: np.ndarray,
                    span: int) -> tuple[np.ndarray, np.ndarray]:
    """(records of rows `index`, grouped by `labels` in [0, span) with the order of `index` kept within a label;
    the records per label): what MiniBuffers.add_ordered takes, without sorting the labels first."""
    labels = np.asarray(labels, dtype=np.int64)
    sizes = np.bincount(labels, minlength=span)
    rows = _packed(dtype, (ids, ts, keys, values, arrival), index, labels, np.cumsum(sizes) - sizes)
    return rows, sizes
