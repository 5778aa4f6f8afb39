"""Tuple layout on the wire and in the windows, and the hash functions both sides use.

A tuple travels as one row of a packed numpy structured array (paper 003,
section IV-B: tuples are sent "in machine independent format"; here that is a
little-endian packed record).  The two streams travel in separate arrays of the
same dtype, so no per-tuple stream attribute is needed.
"""

from __future__ import annotations

import numpy as np

STREAM_R = 0
STREAM_S = 1
STREAM_NAMES = ("R", "S")

#: The fields every tuple carries: what the user gave plus the wall-clock
#: arrival time stamped by the master (needed for the production delay).  `ts` is the event time in
#: integer microseconds (protocol.eventtime); `arrival` is wall-clock seconds.
BASE_FIELDS = [("id", "<i8"), ("ts", "<i8"), ("key", "<i8"), ("value", "<f8"), ("arrival", "<f8")]
BASE_TUPLE_BYTES = int(np.dtype(BASE_FIELDS).itemsize)
#: their names, in order
FIELDS = tuple(name for name, _ in BASE_FIELDS)
#: the field of a query's term words (protocol.condition), when its condition on the pair reads any
TERMS = "terms"


def tuple_dtype(tuple_bytes: int = BASE_TUPLE_BYTES, terms: int = 0) -> np.dtype:
    """Packed record of `tuple_bytes` bytes, or more if `terms` words do not fit: the words of a query's terms
    (protocol.condition: what its condition on the pair reads of each tuple) follow the fields; padding models
    the paper's wider tuples (64 B)."""
    if tuple_bytes < BASE_TUPLE_BYTES:
        raise ValueError(f"tuple_bytes must be at least {BASE_TUPLE_BYTES}")
    fields = list(BASE_FIELDS) + ([(TERMS, "<i8", (terms,))] if terms else [])
    used = BASE_TUPLE_BYTES + 8 * terms
    if tuple_bytes > used:
        fields.append(("pad", f"V{tuple_bytes - used}"))
    return np.dtype(fields)


def term_words(dtype: np.dtype) -> np.ndarray:
    """Where a record's term words sit (word indices; none without terms)."""
    if TERMS not in (dtype.names or ()):
        return np.empty(0, np.int64)
    sub, offset = dtype.fields[TERMS][:2]
    return offset // 8 + np.arange(sub.shape[0], dtype=np.int64)


#: splitmix64's multipliers (master.state.packing.partition_one uses them too)
MIX_M1 = np.uint64(0xBF58476D1CE4E5B9)
MIX_M2 = np.uint64(0x94D049BB133111EB)


def mix64(keys: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser over a whole key array: a well-spread 64-bit hash."""
    z = np.asarray(keys).astype(np.uint64, copy=True)
    z ^= z >> np.uint64(30)
    z *= MIX_M1
    z ^= z >> np.uint64(27)
    z *= MIX_M2
    z ^= z >> np.uint64(31)
    return z


def partition_of(keys: np.ndarray, partitions: int) -> np.ndarray:
    """Partition id of each key (high hash bits; the low bits are left to extendible hashing)."""
    return ((mix64(keys) >> np.uint64(32)) % np.uint64(partitions)).astype(np.int64)


def directory_hash(keys: np.ndarray) -> np.ndarray:
    """Hash whose least significant bits index an extendible-hash directory (paper 003, IV-D)."""
    return mix64(keys) & np.uint64(0xFFFFFFFF)
