"""The Kafka value readers' checks on a whole batch (master.sources.kafka_values), against one value at a time:
a CSV batch with a line break, a carriage return or an empty value inside is not read whole, and halving finds
exactly those values; Schema Registry headers are cut from every datum at once, as slicing each would."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from master.sources.kafka_values import REGISTRY_HEADER, CsvValues, _without_headers

FIELDS = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("page", pa.string())])


@pytest.mark.parametrize("seed", range(5))
def test_csv_values_with_a_line_break_inside_are_the_ones_set_aside(seed):
    rng = np.random.default_rng(seed)
    values = [f"{i},/p{i % 7}".encode() for i in range(200)]
    broken = sorted(rng.choice(200, 4, replace=False).tolist())
    for i, value in zip(broken, (b"1,/p\n2,/p", b"1,/p\r", b"", b"  "), strict=True):
        values[i] = value
    reader = CsvValues(FIELDS)
    assert reader.read(values) is None
    good, bad = reader.read_all(values)
    assert bad == broken
    read = pa.concat_tables([t for _, t in good])
    assert read["id"].to_pylist() == [i for i in range(200) if i not in broken]
    assert reader.read([v for i, v in enumerate(values) if i not in broken]).num_rows == 196


def test_registry_headers_are_cut_from_every_datum_as_slicing_each_would():
    rng = np.random.default_rng(7)
    values = [b"\x00" + rng.bytes(4) + rng.bytes(int(n)) for n in rng.integers(0, 40, 500)]
    assert _without_headers(b"".join(values), values) == b"".join(v[REGISTRY_HEADER:] for v in values)
    for bad in (b"\x01" + values[3][1:], values[9][:4]):  # another magic byte; shorter than a header
        changed = [*values[:100], bad, *values[100:]]
        assert _without_headers(b"".join(changed), changed) is None
