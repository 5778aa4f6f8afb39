"""Production-delay histograms: slaves count, the master merges, anyone reads percentiles.

A fixed log-spaced binning makes the per-epoch report a small fixed-size array
and lets the master merge reports by addition (paper 003, VI-A: the production
delay is the time since arrival of the later of the two joining tuples).
"""

from __future__ import annotations

import numpy as np

#: Bin edges in seconds: 1 us .. ~1e4 s, 20 bins per decade.
LOG_FIRST, PER_DECADE = -6, 20
EDGES = np.logspace(LOG_FIRST, 4, 201)
BINS = len(EDGES) + 1  # plus underflow and overflow

#: Where a result's delay goes, one histogram each (they add up to the delay result by result):
#: buffer = the later tuple's arrival until the master sent its batch (waiting for the slave's slot),
#: transfer = sent until the slave started joining the batch (MPI, the slave's poll, decoding),
#: join = joining started until the result was produced.
PARTS = ("buffer", "transfer", "join")


def histogram(delays: np.ndarray) -> np.ndarray:
    """Counts of `delays` per bin (int64, length BINS)."""
    idx = np.searchsorted(EDGES, delays, side="right")
    return np.bincount(idx, minlength=BINS).astype(np.int64)


def decomposition(arrival: np.ndarray, sent: float, started: float, produced: np.ndarray | float) -> np.ndarray:
    """Histograms (len(PARTS) x BINS) of the parts of the delays of results whose later tuple arrived at
    `arrival`, sent by the master at `sent`, joined from `started` and produced at `produced`: the definition;
    slaves compute the same in one compiled pass (slave.kernel.batch_delays)."""
    n = len(arrival)

    def each(part) -> np.ndarray:  # a part that is one value for the whole batch is binned once
        return histogram(part) if np.ndim(part) else histogram(np.array([part], dtype=np.float64)) * n

    return np.stack([each(sent - arrival), each(started - sent), each(produced - started)])


def exact_percentiles(values: np.ndarray, qs=(50, 95, 99)) -> list[float]:
    """The percentiles of the delays themselves (every result file row carries its delay): the value at rank
    ceil(q% of n), the one whose bin `percentiles` reports the upper edge of."""
    if len(values) == 0:
        return [float("nan")] * len(qs)
    return [float(x) for x in np.percentile(values, qs, method="inverted_cdf")]


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
