"""Array helpers both roles use to work on whole batches instead of single tuples."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


def label_order(labels: np.ndarray, span: int) -> np.ndarray:
    """np.argsort(labels, kind="stable") for labels in [0, span): on 16-bit labels where they fit, which
    numpy sorts by radix (about 6x faster than int64 on a 25k-tuple batch, measured)."""
    return np.argsort(labels.astype(np.uint16) if span <= 1 << 16 else labels, kind="stable")


def group_pairs(labels_r: np.ndarray, labels_s: np.ndarray) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """For each label present in either array: (label, indices in labels_r, indices in labels_s).

    Labels are ids from a small range (partitions, buckets).  One stable argsort (`label_order`) and one
    bincount per array; the loop runs once per distinct label, never once per tuple.  Indices keep arrival
    order.
    """
    if len(labels_r) + len(labels_s) == 0:
        return
    lo = min(labels_r.min(initial=np.iinfo(np.int64).max), labels_s.min(initial=np.iinfo(np.int64).max))
    span = max(labels_r.max(initial=lo), labels_s.max(initial=lo)) - lo + 1
    shifted_r, shifted_s = labels_r - lo, labels_s - lo
    order_r, order_s = label_order(shifted_r, span), label_order(shifted_s, span)
    count_r, count_s = np.bincount(shifted_r, minlength=span), np.bincount(shifted_s, minlength=span)
    end_r, end_s = np.cumsum(count_r), np.cumsum(count_s)
    for i in np.flatnonzero(count_r + count_s).tolist():
        yield i + int(lo), order_r[end_r[i] - count_r[i] : end_r[i]], order_s[end_s[i] - count_s[i] : end_s[i]]


def records(rows: np.ndarray) -> np.ndarray:
    """`rows` as opaque fixed-size records (a view).  Gathering, masking and concatenating those is a plain
    memory copy; on the structured tuple dtype numpy copies field by field (about 8x slower measured)."""
    return rows.view(np.dtype((np.void, rows.dtype.itemsize)))


def words(rows: np.ndarray) -> np.ndarray:
    """`rows` as an (n, bytes per tuple / 8) int64 array (a view where the rows are contiguous and aligned,
    as batches and windows are): what compiled code reads tuple fields from, whatever the tuple's padding."""
    flat = np.require(records(rows), requirements="CA").view(np.int64)
    return flat.reshape(len(rows), rows.dtype.itemsize // 8)


def field_words(dtype: np.dtype, names) -> np.ndarray:
    """Where each field of `names` sits in a row of `words` (its byte offset / 8; every field is one word)."""
    return np.array([dtype.fields[name][1] // 8 for name in names], dtype=np.int64)


def take_rows(rows: np.ndarray, index: np.ndarray) -> np.ndarray:
    """rows[index] (an index array or a boolean mask), copied as records."""
    return records(rows)[index].view(rows.dtype)


def message_buffer(spare: np.ndarray | None, nbytes: int) -> np.ndarray:
    """`nbytes` uint8 for a message: the front of `spare` (an earlier message's buffer, no longer in use) if it
    is large enough, else a fresh one: a fresh buffer of a batch's size costs as much in page faults as a copy."""
    return spare[:nbytes] if spare is not None and len(spare) >= nbytes else np.empty(nbytes, dtype=np.uint8)


def whole_buffer(buf: np.ndarray) -> np.ndarray:
    """The whole buffer `buf` (from `message_buffer`) is the front of: what to keep as the next spare."""
    return buf if buf.base is None else buf.base
