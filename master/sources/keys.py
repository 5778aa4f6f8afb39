"""The user's join keys as the engine's int64 keys, exactly (docs/input.md, "Keys").

An integer key column is its own int64 key, as before.  A string or binary key, and a composite key of
several columns, get a code from a dictionary the master builds as the input passes: equal values get equal
codes and different values different codes, by exact comparison of the values (pyarrow's hash sets look
them up and compare them whole; a hash never decides a match).  Codes count up from 0 in the order values
first appear in the merged input, which is the same on every read of the same input: a recovery that reads
the input again, and every dispatcher of several (each reads the whole input), build the same codes.

Dispatchers that read different rows (a Kafka topic's partitions shared out: master.sources.kafka_input) see
values in different orders, so there a value's code is its 64-bit hash (`hashed`): the same on every
dispatcher, with no message between them.  Each dispatcher still keeps its dictionary and compares bytes, so
two different values of one dispatcher with the same hash stop the run (`KeyCollision`); two that only ever
meet on different dispatchers are not detected (about n**2 / 2**65 for n distinct values: 1e-7 for 2 million).

A composite key is the row of its components' int64 values (an integer column's value, a text column's
code), as one fixed-width binary value, coded again.  Results carry the user's values, from the payload log
(protocol.payload), not the codes.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from common.chunks import InputError


class KeyCollision(InputError):
    """Two different key values have the same 64-bit hash, so hashed codes would join them."""


def _grown(a: np.ndarray, size: int) -> np.ndarray:
    if size <= len(a):
        return a
    out = np.empty(max(size, 2 * len(a)), a.dtype)
    out[: len(a)] = a
    return out


class KeyDictionary:
    """Exact codes 0, 1, ... of distinct byte strings, in order of first appearance: an open-addressing hash
    table whose slots hold codes, the values' bytes kept in one growing arena (compiled, whole batches);
    `hashed`: the codes handed out are the values' 64-bit hashes instead, checked to be distinct."""

    def __init__(self, type_: pa.DataType, hashed: bool = False):
        self.type, self.hashed = type_, hashed
        # the compiled passes, imported here (when the source opens, before the run's clock starts): a run of
        # integer keys never imports numba (0.2 s of CPU at each rank's start)
        from master.sources import key_codes

        self.compiled = key_codes
        self.count = self.used = 0
        self.slots = np.full(16, -1, np.int64)
        self.hashes = np.empty(8, np.uint64)
        self.arena = np.empty(1024, np.uint8)
        self.ends = np.zeros(9, np.int64)  #: value c is arena[ends[c]:ends[c + 1]]

    def codes(self, values: pa.Array) -> np.ndarray:
        """The int64 code of each value (strings or binary, none null)."""
        if not len(values):
            return np.empty(0, np.int64)
        values = values.cast(pa.large_binary())
        offsets = np.frombuffer(values.buffers()[1], np.int64)[values.offset : values.offset + len(values) + 1]
        data = values.buffers()[2]
        return self.codes_of(np.frombuffer(data, np.uint8) if data is not None else np.empty(0, np.uint8), offsets)

    def codes_of(self, data: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """The codes of the values data[offsets[i]:offsets[i + 1]]."""
        n = len(offsets) - 1
        if 2 * (self.count + n) > len(self.slots):  # at most half full: short probes
            size = len(self.slots)
            while 2 * (self.count + n) > size:
                size *= 2
            self.slots = np.full(size, -1, np.int64)
            self.compiled._rehash(self.slots, self.hashes, self.count)
        self.hashes = _grown(self.hashes, self.count + n)
        self.ends = _grown(self.ends, self.count + n + 1)
        self.arena = _grown(self.arena, self.used + int(offsets[-1] - offsets[0]))
        codes = np.empty(n, np.int64)
        self.count, self.used, collided = self.compiled._code(
            data, offsets, self.slots, self.hashes, self.arena, self.ends, self.count, self.used, codes
        )
        if not self.hashed:
            return codes
        if collided >= 0:
            v0, v1 = offsets[collided], offsets[collided + 1]
            h = int(self.compiled._hash(data, v0, v1))
            raise KeyCollision(
                f"two different key values have the same 64-bit hash {h:#x} (one is "
                f"{bytes(data[v0:v1])[:64]!r}): with cluster.dispatchers > 1 keys are coded by their hash; run "
                "with one dispatcher"
            )
        return self.hashes[codes].view(np.int64)

    @property
    def values(self) -> pa.Array:
        """The value of each code, as an Arrow array of the dictionary's type."""
        offsets = pa.py_buffer(self.ends[: self.count + 1].copy())
        raw = pa.LargeBinaryArray.from_buffers(
            pa.large_binary(), self.count, [None, offsets, pa.py_buffer(self.arena[: self.used].copy())]
        )
        return raw.cast(pa.large_string()).cast(pa.string()) if pa.types.is_string(self.type) else raw.cast(self.type)

    @property
    def nbytes(self) -> int:
        return self.slots.nbytes + self.hashes.nbytes + self.arena.nbytes + self.ends.nbytes


class KeyMapper:
    """Key components (int64 arrays for kind "int", Arrow arrays for "string" / "binary") -> int64 keys;
    `hashed`: coded by their hashes (dispatchers that read different rows)."""

    def __init__(self, kinds: list[str], hashed: bool = False):
        self.kinds = kinds
        self.parts = [
            None if k == "int" else KeyDictionary(pa.binary() if k == "binary" else pa.string(), hashed) for k in kinds
        ]
        #: composite keys: the rows of component values, 8 bytes each
        self.rows = KeyDictionary(pa.large_binary(), hashed) if len(kinds) > 1 else None

    @property
    def coded(self) -> bool:
        """Whether keys are codes (not the user's integers): then `table` says which value each stands for."""
        return self.kinds != ["int"]

    def keys(self, components: list) -> np.ndarray:
        values = [c if d is None else d.codes(c) for c, d in zip(components, self.parts)]
        if self.rows is None:
            return np.asarray(values[0], np.int64)
        matrix = np.ascontiguousarray(np.stack(values, axis=1).astype(np.int64))
        width = 8 * len(values)
        return self.rows.codes_of(matrix.view(np.uint8).ravel(), np.arange(len(matrix) + 1, dtype=np.int64) * width)

    def dictionaries(self) -> pa.Table:
        """Every dictionary's values in code order (a checkpoint's part), one column each: `restore` codes them
        again in that order, which gives each value its code back."""
        coded = [(f"part{i}", d) for i, d in enumerate(self.parts) if d is not None]
        coded += [("rows", self.rows)] if self.rows is not None else []
        columns = {name: d.values for name, d in coded}
        longest = max((len(v) for v in columns.values()), default=0)
        return pa.table({name: _padded(v, longest) for name, v in columns.items()})

    def restore(self, table: pa.Table) -> None:
        """Back to the dictionaries of `dictionaries` (codes only grow: a fresh mapper is coded again)."""
        for i, d in enumerate(self.parts):
            if d is not None:
                d.codes(table[f"part{i}"].drop_null().combine_chunks())
        if self.rows is not None:
            self.rows.codes(table["rows"].drop_null().combine_chunks())

    @property
    def distinct(self) -> int:
        return (self.rows or self.parts[0]).count if self.coded else 0

    @property
    def nbytes(self) -> int:
        return sum(d.nbytes for d in (*self.parts, self.rows) if d is not None)


def _padded(values: pa.Array, n: int) -> pa.Array:
    """`values` with nulls after it up to `n` (the dictionaries' columns in one table; no value is null)."""
    return pa.concat_arrays([values, pa.nulls(n - len(values), values.type)]) if len(values) < n else values
