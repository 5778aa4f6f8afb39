"""A checkpoint's key dictionaries (master.sources.keys.KeyMapper.dictionaries) give a fresh mapper every code
back: text keys and composite keys, values first seen in any order, then new values coded after them."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from master.sources.keys import KeyMapper
from protocol.checkpoint import record_tables, table_records


def test_a_restored_mapper_codes_every_value_as_the_first_did_and_goes_on_counting():
    rng = np.random.default_rng(3)
    words = [f"user-{i}" for i in rng.integers(0, 500, 3000)]
    ints = rng.integers(0, 7, 3000)
    for kinds, parts in (
        (["string"], lambda a, b: [pa.array(words[a:b])]),
        (["string", "int"], lambda a, b: [pa.array(words[a:b]), ints[a:b]]),
    ):
        first = KeyMapper(kinds)
        before = first.keys(parts(0, 2000))
        (table,) = record_tables(table_records([first.dictionaries()]))
        second = KeyMapper(kinds)
        second.restore(table)
        assert second.distinct == first.distinct
        np.testing.assert_array_equal(second.keys(parts(0, 2000)), before)
        np.testing.assert_array_equal(second.keys(parts(2000, 3000)), first.keys(parts(2000, 3000)))
