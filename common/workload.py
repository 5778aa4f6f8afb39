"""The synthetic workload of the paper (section VI-A): two Poisson streams R and S with b-model skewed keys
(or uniform or Zipf keys, ``generator.distribution``), generated lazily in fixed event-time slices so memory stays
bounded and the output depends only on the seed, never on the chunk sizes the caller asks for.

The master's generator source, the tests' reference data and the benches all take it from here; it needs
neither numba nor the master.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import math

import numpy as np

from protocol import eventtime
from common.chunks import Chunk, InputError, Source, concat, no_terms, rows
from protocol.tuples import STREAM_R, STREAM_S

if TYPE_CHECKING:
    from protocol.plan import Generator

#: Expected tuples per stream in one generation slice.  A slice's event-time
#: length is derived from the rate only, so the data never depends on `limit`.
SLICE_TUPLES = 1 << 16


_U64_MAX = np.iinfo(np.uint64).max
BMODEL_GROUP = 5  #: b-model levels drawn together from one 16-bit draw


def bmodel_tables(levels: int, p_upper: float) -> list[tuple[int, np.ndarray]]:
    """The b-model (paper 003, VI-A) in groups of up to BMODEL_GROUP levels, most significant first: per group
    (its levels, a table from a uniform 16-bit draw to the group's bits).  Each level independently takes its
    upper half with probability `p_upper`, so a group's value v has probability p^ones(v) (1-p)^(bits-ones(v));
    the table gives v to round(65536 x that) of the draws.  One lookup replaces `bits` uniform draws (the
    generator's keys took more of the master's CPU than routing them); every probability is exact to 1/65536."""
    sizes = [BMODEL_GROUP] * (levels // BMODEL_GROUP) + ([levels % BMODEL_GROUP] if levels % BMODEL_GROUP else [])
    tables = []
    for bits in sizes:
        ones = np.array([bin(v).count("1") for v in range(1 << bits)])
        cdf = np.cumsum(p_upper**ones * (1 - p_upper) ** (bits - ones))
        cells = np.searchsorted(cdf / cdf[-1], (np.arange(1 << 16) + 0.5) / (1 << 16), side="right")
        tables.append((bits, np.minimum(cells, (1 << bits) - 1).astype(np.uint8)))
    return tables


class GeneratorSource(Source):
    """R and S with Poisson arrivals and b-model, uniform or Zipf keys, generated slice by slice.

    Slice i uses its own rng seeded with (seed, 2, i); the per-slice Poisson
    counts are drawn up front from (seed, 0), which gives `total` and the id
    offsets; the key permutation comes from (seed, 1).
    """

    def __init__(self, gen: Generator):
        self.rate, self.duration = gen.rate, gen.duration
        self.keys, self.skew = gen.keys, gen.skew
        self.distribution = gen.distribution
        self.disorder = gen.disorder
        self.shift = gen.shift
        self.hot_share = gen.hot_share
        self._seed = gen.seed % (1 << 64)  # SeedSequence wants non-negative entropy
        self._slice_len = SLICE_TUPLES / self.rate
        n = max(1, math.ceil(self.duration / self._slice_len))
        starts = np.arange(n) * self._slice_len
        self._bounds = np.stack([starts, np.minimum(starts + self._slice_len, self.duration)], axis=1)
        lengths = np.maximum(self._bounds[:, 1] - self._bounds[:, 0], 0.0)
        counts_rng = np.random.default_rng([self._seed, 0])
        self._counts = counts_rng.poisson(self.rate * lengths[:, None], size=(n, 2))
        self._first_id = np.cumsum(self._counts, axis=0) - self._counts  # ids before each slice
        self.total = int(self._counts.sum())
        self._perm = np.random.default_rng([self._seed, 1]).permutation(self.keys).astype(np.int64)
        self._bmodel = bmodel_tables((self.keys - 1).bit_length(), 1.0 - self.skew)  # ceil(log2(keys)) levels
        if self.distribution == "zipf":  # P(rank r) ~ 1 / (r + 1)^s: drawn by inverting this CDF
            cdf = np.cumsum(np.arange(1, self.keys + 1, dtype=np.float64) ** -gen.zipf)
            self._zipf_cdf = cdf / cdf[-1]
        self._next_slice = 0
        self.hot_key = int(self._perm[-1])  #: the heavy hitter of `hot_share` (a key the b-model makes rare)
        self._pending: list[Chunk] = []

    def finish(self) -> dict:
        return {}

    def _keys(self, rng: np.random.Generator, arrival: np.ndarray) -> np.ndarray:
        """A rank per tuple, then the key of that rank: hot ranks are spread over the domain by a permutation.

        b-model: at each level the upper half with probability 1 - skew (paper VI-A); uniform: every rank alike
        (with few keys, many tuples per key: the high-duplication workload); zipf: rank r with probability
        proportional to 1 / (r + 1)^zipf, a few heavy hitters and a long tail.

        With `shift` > 0 the b-model ranks rotate by a fixed stride every `shift` seconds of arrival time, so
        the hot keys change while the distribution keeps its shape (a workload whose skew moves).
        """
        if self.distribution == "uniform":
            rank = rng.integers(0, self.keys, len(arrival), dtype=np.int64)
        elif self.distribution == "zipf":
            rank = np.minimum(np.searchsorted(self._zipf_cdf, rng.random(len(arrival)), side="right"), self.keys - 1)
        else:
            # four 16-bit draws per 64-bit word, one per group of levels, each looked up in its group's table
            words = -(-len(self._bmodel) // 4)
            draws = rng.integers(0, _U64_MAX, size=len(arrival) * words, dtype=np.uint64, endpoint=True)
            draws = draws.view(np.uint16).reshape(len(arrival), 4 * words)
            rank = np.zeros(len(arrival), dtype=np.int64)
            for j, (bits, table) in enumerate(self._bmodel):
                rank <<= bits
                rank |= table[draws[:, j]]
            rank %= self.keys
        if self.shift > 0:
            stride = int(self.keys * 0.6180339887) | 1
            rank = (rank + (arrival // self.shift).astype(np.int64) * stride) % self.keys
        return self._perm[rank]

    def _make_slice(self, i: int) -> Chunk:
        """Both streams of slice i merged by arrival time; the disorder is drawn last so it changes nothing else."""
        rng = np.random.default_rng([self._seed, 2, i])
        t0, t1 = self._bounds[i]
        n = self._counts[i]
        arrival = [t0 + np.sort(rng.random(n[s])) * (t1 - t0) for s in (STREAM_R, STREAM_S)]
        key = [self._keys(rng, arrival[s]) for s in (STREAM_R, STREAM_S)]
        value = [rng.random(n[s]) for s in (STREAM_R, STREAM_S)]
        if self.hot_share > 0:  # drawn only then, so every other workload stays as it was
            for s in (STREAM_R, STREAM_S):
                key[s][rng.random(n[s]) < self.hot_share] = self.hot_key
        arr = np.concatenate(arrival)
        ts = eventtime.from_seconds(arr - rng.random(len(arr)) * self.disorder if self.disorder > 0 else arr)[0]
        stream = np.repeat(np.array([STREAM_R, STREAM_S], np.int8), n)
        ids = np.concatenate([self._first_id[i, s] + np.arange(n[s], dtype=np.int64) for s in (STREAM_R, STREAM_S)])
        order = np.argsort(arr, kind="stable")
        values = np.concatenate(value)[order]
        return Chunk(stream[order], ids[order], ts[order], np.concatenate(key)[order], values, no_terms(len(order)))

    def skip(self, n: int) -> None:
        """Start at tuple `n` (a recovery's position): the slices wholly before it are not drawn (each slice has its
        own rng, so those after are the same), the part of the next one before it is dropped."""
        through = np.cumsum(self._counts.sum(axis=1))  #: the tuples up to and including each slice
        self._next_slice = int(np.searchsorted(through, n, side="right"))
        n -= int(through[self._next_slice - 1]) if self._next_slice else 0
        while n > 0:
            chunk = self.next_chunk(n)
            if chunk is None:
                raise InputError(f"the generator draws {self.total:,} tuples, fewer than the checkpoint's position")
            n -= len(chunk.ts)

    def next_chunk(self, limit: int) -> Chunk | None:
        if limit < 1:
            raise ValueError(f"limit must be positive, got {limit}")
        buffered = sum(len(c.id) for c in self._pending)
        while buffered < limit and self._next_slice < len(self._counts):
            c = self._make_slice(self._next_slice)
            self._next_slice += 1
            if len(c.id):
                self._pending.append(c)
                buffered += len(c.id)
        if not self._pending:
            return None
        merged = concat(self._pending)
        self._pending = [rows(merged, limit)] if len(merged.id) > limit else []
        return rows(merged, 0, limit)


def generate_all(gen: Generator) -> Chunk:
    """The whole generated input in one Chunk: drains a GeneratorSource, so it is the same data."""
    src = GeneratorSource(gen)
    parts = []
    while (c := src.next_chunk(1 << 22)) is not None:
        parts.append(c)
    return concat(parts)
