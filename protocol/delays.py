"""Production-delay histograms: slaves count, the master merges, anyone reads percentiles.

A fixed log-spaced binning makes the per-epoch report a small fixed-size array
and lets the master merge reports by addition (paper 003, VI-A: the production
delay is the time since arrival of the later of the two joining tuples).
"""
from __future__ import annotations

import numpy as np

#: Bin edges in seconds: 1 us .. ~1e4 s, 20 bins per decade.
EDGES = np.logspace(-6, 4, 201)
BINS = len(EDGES) + 1  # plus underflow and overflow


def histogram(delays: np.ndarray) -> np.ndarray:
    """Counts of `delays` per bin (int64, length BINS)."""
    idx = np.searchsorted(EDGES, delays, side="right")
    return np.bincount(idx, minlength=BINS).astype(np.int64)


def percentiles(hist: np.ndarray, qs=(50, 95, 99)) -> list[float]:
    """Upper edge of the bin holding each percentile: at most one bin (12.2%) above the true value."""
    total = int(hist.sum())
    if total == 0:
        return [float("nan")] * len(qs)
    cum = np.cumsum(hist)
    out = []
    for q in qs:
        b = int(np.searchsorted(cum, total * q / 100.0, side="left"))
        out.append(float(EDGES[min(b, len(EDGES) - 1)]))
    return out
