"""Array helpers both roles use to work on whole batches instead of single tuples."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np


def group_pairs(labels_r: np.ndarray, labels_s: np.ndarray) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """For each label present in either array: (label, indices in labels_r, indices in labels_s).

    One stable argsort per array; the loop runs once per distinct label (a
    partition or a bucket), never once per tuple.  Indices keep arrival order.
    """
    order_r = np.argsort(labels_r, kind="stable")
    order_s = np.argsort(labels_s, kind="stable")
    sorted_r, sorted_s = labels_r[order_r], labels_s[order_s]
    labels = np.union1d(sorted_r, sorted_s)
    r_lo, r_hi = np.searchsorted(sorted_r, labels, "left"), np.searchsorted(sorted_r, labels, "right")
    s_lo, s_hi = np.searchsorted(sorted_s, labels, "left"), np.searchsorted(sorted_s, labels, "right")
    for i, label in enumerate(labels.tolist()):
        yield label, order_r[r_lo[i]: r_hi[i]], order_s[s_lo[i]: s_hi[i]]
