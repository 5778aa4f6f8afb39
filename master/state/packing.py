"""Source chunks into wire tuples: compiled passes that hash each tuple to its partition and pack the columns
into the fixed-width records a BATCH carries, each mini-buffer's tuples as one slice.
"""

from __future__ import annotations

import numpy as np

from protocol.arrays import field_words, words
from protocol.compiled import kernels
from protocol.tuples import MIX_M1, MIX_M2, FIELDS, term_words


def partition_one(key, partitions):  # pragma: no cover - compiled
    """protocol.tuples.partition_of of one key, for compiled loops that route tuples without a pass per hashing
    step (here, not in protocol/: the Spark side imports protocol/ in Python workers without numba)."""
    z = np.uint64(key)
    z = (z ^ (z >> np.uint64(30))) * MIX_M1
    z = (z ^ (z >> np.uint64(27))) * MIX_M2
    z = z ^ (z >> np.uint64(31))
    return np.int64((z >> np.uint64(32)) % np.uint64(partitions))


_PACK_SIG = (
    "void(int64[:], int64[:], int64[:], int64[:], int64[:], int64[::1], int64[::1], int64[::1], int64[:, ::1], "
    "int64[:, :], int64[::1])"
)
_COUNT_SIG = "void(int8[:], int64[:], boolean[::1], int64, int64[::1], int64[:, ::1])"
_ROUTE_SIG = (
    "void(int8[:], int64[:], int64[:], int64[:], int64[:], int64[:], boolean[::1], int64[::1], "
    "int64[:, ::1], int64[::1], int64[::1], int64[:, ::1], int64[:, ::1], int64[:, :], int64[::1])"
)


def _put(out, d, ids, ts, keys, values, arrival, j, fields, pad, terms, term_fields):  # pragma: no cover - compiled
    """Column row j into record d, with its query terms' words (protocol.condition); its padding words zero
    (nothing of this process's memory goes on the wire)."""
    out[d, fields[0]] = ids[j]
    out[d, fields[1]] = ts[j]
    out[d, fields[2]] = keys[j]
    out[d, fields[3]] = values[j]
    out[d, fields[4]] = arrival[j]
    for w in range(len(term_fields)):
        out[d, term_fields[w]] = terms[j, w]
    for w in pad:
        out[d, w] = 0


def _pack(ids, ts, keys, values, arrival, index, fields, pad, out, terms, term_fields):  # pragma: no cover - compiled
    for i in range(len(index)):
        _put(out, i, ids, ts, keys, values, arrival, index[i], fields, pad, terms, term_fields)


def _count_hashed(stream, keys, late, partitions, part, sizes):  # pragma: no cover - compiled
    """Each on-time tuple's hash partition, and the tuples per stream and partition."""
    for i in range(len(keys)):
        if not late[i]:
            part[i] = partition_one(keys[i], partitions)
            sizes[stream[i], part[i]] += 1


def _pack_hashed(
    stream, ids, ts, keys, values, arrival, late, part, starts, fields, pad, out_r, out_s, terms, term_fields
):  # pragma: no cover - compiled
    """Each on-time tuple into the next free record of its stream's group of its partition (the groups start
    at `starts`): the columns are read in order and written to one place per group, where gathering them in
    group order missed the cache on every column of every tuple."""
    for i in range(len(keys)):
        if late[i]:
            continue
        s, p = stream[i], part[i]
        d = starts[s, p]
        starts[s, p] += 1
        _put(out_r if s == 0 else out_s, d, ids, ts, keys, values, arrival, i, fields, pad, terms, term_fields)


_pack, _count_hashed, _pack_hashed = kernels(
    __name__,
    {"_pack": _PACK_SIG, "_count_hashed": _COUNT_SIG, "_pack_hashed": _ROUTE_SIG},
    inline=("partition_one", "_put"),
)


def _columns(dtype: np.dtype, columns: tuple) -> tuple:
    """Each column in its field's type, then as int64 words (floats as their bits), as the packers read them.
    ts must be integer microseconds already: a float cast to int64 here would drop its fraction unseen."""
    if np.asarray(columns[1]).dtype.kind not in "iu":
        raise TypeError(f"ts must be integer microseconds (protocol.eventtime), got {np.asarray(columns[1]).dtype}")
    return tuple(np.asarray(c, dtype=dtype[f]).view(np.int64) for f, c in zip(FIELDS, columns))


def _padding(dtype: np.dtype) -> np.ndarray:
    taken = set(field_words(dtype, FIELDS).tolist()) | set(term_words(dtype).tolist())
    return np.array([w for w in range(dtype.itemsize // 8) if w not in taken], dtype=np.int64)


def _terms(dtype: np.dtype, terms: np.ndarray | None, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The terms' words (n, words) as the packers read them, and where they go in a record."""
    places = term_words(dtype)
    if terms is None or not len(places):
        return np.zeros((n, 0), np.int64), places[:0]
    return np.asarray(terms, np.int64), places


def to_wire(
    dtype: np.dtype, ids, ts, keys, values, arrival, index: np.ndarray | None = None, terms: np.ndarray | None = None
) -> np.ndarray:
    """Pack columns into the protocol's tuple records: rows `index` of them (all if None), in that order, in one
    compiled pass (gathering each column and then writing it into the records field by field cost the master
    about 100 ns a tuple, as much as generating it).  `terms`: the query's term words of each row
    (protocol.condition), if the records carry them."""
    n = len(ids) if index is None else len(index)
    rows = np.empty(n, dtype=dtype)
    index = np.arange(n, dtype=np.int64) if index is None else np.asarray(index, dtype=np.int64)
    _pack(
        *_columns(dtype, (ids, ts, keys, values, arrival)),
        index,
        field_words(dtype, FIELDS),
        _padding(dtype),
        words(rows),
        *_terms(dtype, terms, len(ids)),
    )
    return rows


def to_wire_hashed(
    dtype: np.dtype,
    stream,
    ids,
    ts,
    keys,
    values,
    arrival,
    late: np.ndarray,
    partitions: int,
    terms: np.ndarray | None = None,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per stream (R, S): (the records of its on-time tuples grouped by hash partition, arrival order kept
    within a partition; the records per partition), what MiniBuffers.add_ordered takes.  Two compiled passes
    (count, then pack) in place of a selection, a hash and a gather per stream."""
    part = np.empty(len(keys), dtype=np.int64)
    sizes = np.zeros((2, partitions), dtype=np.int64)
    stream, keys = np.asarray(stream, dtype=np.int8), np.asarray(keys, dtype=np.int64)
    _count_hashed(stream, keys, late, partitions, part, sizes)
    rows = [np.empty(int(n), dtype=dtype) for n in sizes.sum(axis=1)]
    starts = np.cumsum(sizes, axis=1) - sizes
    _pack_hashed(
        stream,
        *_columns(dtype, (ids, ts, keys, values, arrival)),
        late,
        part,
        starts,
        field_words(dtype, FIELDS),
        _padding(dtype),
        words(rows[0]),
        words(rows[1]),
        *_terms(dtype, terms, len(keys)),
    )
    return [(rows[0], sizes[0]), (rows[1], sizes[1])]
