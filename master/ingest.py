"""Turning source chunks into wire tuples, and the lateness rule.

A tuple is late iff its ts is below (the largest ts of all tuples before it in
arrival order, both streams together) minus `join.max_delay`.  Late tuples are
set aside, never joined; everything else may be out of order by at most
max_delay, which is what makes watermark expiry safe (BiStream, Theorem 1).
"""
from __future__ import annotations

import numpy as np


def late_mask(ts: np.ndarray, running_max: float, max_delay: float) -> tuple[np.ndarray, np.ndarray, float]:
    """(late flags, largest ts before each tuple, new running max), over a whole batch at once."""
    before = np.maximum.accumulate(np.concatenate([[running_max], ts]))
    prev = before[:-1]
    return ts < prev - max_delay, prev, float(before[-1])


def to_wire(dtype: np.dtype, ids, ts, keys, values, arrival) -> np.ndarray:
    """Pack columns into the protocol's tuple records."""
    rows = np.zeros(len(ids), dtype=dtype)
    rows["id"], rows["ts"], rows["key"], rows["value"], rows["arrival"] = ids, ts, keys, values, arrival
    return rows
