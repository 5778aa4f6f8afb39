"""The unit every source hands the master: a Chunk of tuples as whole numpy columns, in arrival order.

Shared by the file, generator and ZeroMQ sources and the producer, so none of them imports another.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Chunk(NamedTuple):
    stream: np.ndarray  # int8, STREAM_R / STREAM_S
    id: np.ndarray      # int64
    ts: np.ndarray      # int64 event time in microseconds (protocol.eventtime), converted once on input
    key: np.ndarray     # int64
    value: np.ndarray   # float64


class InputError(Exception):
    """User mistake in the input; the message names file, row and column."""


def empty() -> Chunk:
    return Chunk(np.empty(0, np.int8), np.empty(0, np.int64), np.empty(0, np.int64),
                 np.empty(0, np.int64), np.empty(0, np.float64))


def concat(parts: list[Chunk]) -> Chunk:
    if not parts:
        return empty()
    if len(parts) == 1:
        return parts[0]
    return Chunk(*(np.concatenate(cols) for cols in zip(*parts)))


def rows(c: Chunk, a: int, b: int | None = None) -> Chunk:
    """Tuples a..b of `c` (views, no copy)."""
    return Chunk(*(col[a:b] for col in c))
