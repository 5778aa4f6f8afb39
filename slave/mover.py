"""The state mover (paper 003, IV-C): a partition-group as one byte buffer, and back.

A supplier extracts the group's extendible-hash directory (global depth,
entries, local depths) and the blocks of both mini-windows of every bucket, and
sends them as one message of raw records, then every row's matched flag (outer
joins); the consumer rebuilds the same buckets, so the group keeps its
splits and every stored tuple, in order, with its flag.
"""

from __future__ import annotations

import numpy as np

from protocol.checkpoint import group_layout
from slave.exthash import ExtendibleDirectory, PartitionGroup


def encode_group(partition: int, pg: PartitionGroup) -> np.ndarray:
    d = pg.directory
    ids = sorted(pg.buckets)
    table = np.array(
        [[b, d.local_depth[b], len(pg.buckets[b][0]), len(pg.buckets[b][1])] for b in ids], dtype=np.int64
    ).reshape(-1, 4)
    head = np.array([partition, d.global_depth, len(d.entries), len(ids), d.next_id], dtype=np.int64)
    windows = [w for b in ids for w in pg.buckets[b]]
    meta = np.concatenate([head, d.entries, table.ravel()]).view(np.uint8)
    body = np.concatenate([w.rows for w in windows]).view(np.uint8) if windows else np.empty(0, np.uint8)
    flags = (
        np.concatenate([w.matched for w in windows] + [np.zeros(-len(body) // pg.dtype.itemsize % 8, np.uint8)])
        if windows
        else np.empty(0, np.uint8)
    )  # padded to whole words: the next record stays aligned
    return np.concatenate([meta, body, flags])


def encode_move(partition: int, pg: PartitionGroup, floor: int) -> np.ndarray:
    """A moving group's state (TAG_STATE), led by the floor the consumer's punctuations must not pass until
    the dispatchers send it the group's held tuples: the lowest watermark cap of those (master.coordination),
    in microseconds."""
    return np.concatenate([np.array([floor], dtype=np.int64).view(np.uint8), encode_group(partition, pg)])


def decode_move(buf: np.ndarray, make_group) -> tuple[int, PartitionGroup, int]:
    """Inverse of `encode_move`: (partition, group, floor)."""
    return *decode_group(buf[8:], make_group), int(buf[:8].view(np.int64)[0])


def decode_group(buf: np.ndarray, make_group) -> tuple[int, PartitionGroup]:
    """Inverse of `encode_group`; `make_group()` returns an empty PartitionGroup with the slave's settings."""
    head, entries, table, body = group_layout(buf)
    partition, depth, _, _, next_id = (int(x) for x in head)
    entries = entries.copy()
    pg: PartitionGroup = make_group()
    n = int(table[:, 2:].sum())
    size = n * pg.dtype.itemsize
    if len(buf) - body != size + n + -n % 8:
        raise ValueError(
            f"group state of partition {partition}: {len(buf) - body} bytes of rows and flags, the "
            f"table says {n} rows of {pg.dtype.itemsize} bytes"
        )
    rows = buf[body : body + size].view(pg.dtype)
    matched = buf[body + size : body + size + n]
    pg.directory = ExtendibleDirectory()
    pg.directory.global_depth, pg.directory.entries, pg.directory.next_id = depth, entries, next_id
    pg.directory.local_depth = {int(b): int(ld) for b, ld, _, _ in table}
    pg.buckets = {}
    at = 0
    for b, _, n_r, n_s in table.tolist():
        r, s = pg.empty_bucket()
        r.append(rows[at : at + n_r], matched[at : at + n_r])
        s.append(rows[at + n_r : at + n_r + n_s], matched[at + n_r : at + n_r + n_s])
        at += n_r + n_s
        pg.buckets[b] = (r, s)
    return partition, pg
