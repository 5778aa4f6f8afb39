"""The user's join keys as the engine's int64 keys, exactly (issue 20; docs/input.md, "Keys").

An integer key column is its own int64 key, as before.  A string or binary key, and a composite key of
several columns, get a code from a dictionary the master builds as the input passes: equal values get equal
codes and different values different codes, by exact comparison of the values (pyarrow's hash sets look
them up and compare them whole; a hash never decides a match).  Codes count up from 0 in the order values
first appear in the merged input, which is the same on every read of the same input: a recovery that reads
the input again, and every dispatcher of several (each reads the whole input), build the same codes.

A composite key is the row of its components' int64 values (an integer column's value, a text column's
code), as one fixed-width binary value, coded again.  `table()` gives the codes with the user's values
(keys.parquet in the output), since results carry the codes.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


class KeyDictionary:
    """Exact codes 0, 1, ... of the distinct values of one Arrow type, in order of first appearance."""

    def __init__(self, type_: pa.DataType):
        self.values = pa.array([], type_)  #: the value of each code

    def codes(self, values: pa.Array) -> np.ndarray:
        """The int64 code of each value (none null); unseen values are appended first."""
        known = pc.index_in(values, value_set=self.values)
        new = pc.is_null(known)
        codes = pc.fill_null(known, -1).to_numpy().astype(np.int64)
        if pc.any(new).as_py():
            fresh = pc.unique(values.filter(new))
            base = len(self.values)
            self.values = pa.concat_arrays([self.values, fresh])
            mask = np.asarray(new.to_numpy(zero_copy_only=False), bool)
            codes[mask] = pc.index_in(values.filter(new), value_set=fresh).to_numpy() + base
        return codes

    @property
    def nbytes(self) -> int:
        return self.values.nbytes


class KeyMapper:
    """Key components (int64 arrays for kind "int", Arrow arrays for "string" / "binary") -> int64 keys."""

    def __init__(self, kinds: list[str]):
        self.kinds = kinds
        self.parts = [None if k == "int" else KeyDictionary(pa.binary() if k == "binary" else pa.string())
                      for k in kinds]
        #: composite keys: the rows of component values as fixed-width binary
        self.rows = KeyDictionary(pa.binary(8 * len(kinds))) if len(kinds) > 1 else None

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
        rows = pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), len(matrix), [None, pa.py_buffer(matrix)])
        return self.rows.codes(rows)

    @property
    def distinct(self) -> int:
        return len((self.rows or self.parts[0]).values) if self.coded else 0

    @property
    def nbytes(self) -> int:
        return sum(d.nbytes for d in (*self.parts, self.rows) if d is not None)

    def table(self, names: list[str]) -> pa.Table:
        """`key` (the engine's int64) and the user's value of each component, named `names`, one row per code."""
        if self.rows is None:
            values = [self.parts[0].values]
        else:
            raw = np.frombuffer(self.rows.values.buffers()[1], np.int64, len(self.rows.values) * len(self.kinds))
            matrix = raw.reshape(-1, len(self.kinds))
            values = [pa.array(matrix[:, i]) if d is None else d.values.take(pa.array(matrix[:, i]))
                      for i, d in enumerate(self.parts)]
        key = "engine_key" if "key" in names else "key"
        return pa.table({key: pa.array(np.arange(len(values[0]), dtype=np.int64)), **dict(zip(names, values))})
