"""The payload log's reader: rows gathered in any order, from segments with and without gaps, against the columns
as written."""

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

import pyarrow.parquet as pq

from protocol.output import LEFT_UNMATCHED, MATCHED, write_table
from protocol.payload import PayloadError, PayloadLog, PayloadReader
from slave.result_files import with_columns

SCHEMA = pa.schema([("label", pa.string()), ("amount", pa.float64())])


def columns(rows: np.ndarray) -> pa.Table:
    return pa.table(
        {"label": pc.binary_join_element_wise("row-", pc.cast(pa.array(rows), pa.string()), ""), "amount": rows * 0.5}
    )


def written(tmp_path, gaps: bool) -> np.ndarray:
    """Both sides' segments of 100 rows each over rows 0..999; with `gaps`, every 7th row left out (a rejected
    row has no payload).  Returns the rows written."""
    log = PayloadLog(tmp_path, "t")
    rows = np.arange(1000)
    if gaps:
        rows = rows[rows % 7 != 3]
    for side in (0, 1):
        log.write_schema(side, SCHEMA)
        for first in range(0, 1000, 100):
            mine = rows[(rows >= first) & (rows < first + 100)]
            log.write(side, mine, mine, columns(mine))
    return rows


@pytest.mark.parametrize("gaps", [False, True])
def test_gathered_rows_are_the_written_ones_in_the_asked_order(tmp_path, gaps):
    held = written(tmp_path, gaps)
    rng = np.random.default_rng(7)
    r = rng.choice(held, 5000)
    s = rng.choice(held, 5000)
    r[rng.random(5000) < 0.1] = -1  # a row alone: the other side's columns are null
    out = PayloadReader(tmp_path, ("r_", "s_")).both(r, s)
    assert out.column_names == ["r_label", "r_amount", "s_label", "s_amount"]
    for prefix, asked in (("r_", r), ("s_", s)):
        expected = columns(np.maximum(asked, 0))
        for name in ("label", "amount"):
            got = out[prefix + name].to_pylist()
            want = [None if a < 0 else v for a, v in zip(asked, expected[name].to_pylist())]
            assert got == want


def test_no_rows_give_the_columns_empty(tmp_path):
    written(tmp_path, False)
    out = PayloadReader(tmp_path, ("r_", "s_")).gather(0, np.empty(0, np.int64))
    assert out.num_rows == 0 and out.schema.names == ["r_label", "r_amount"]


def test_a_row_not_written_is_an_error(tmp_path):
    written(tmp_path, True)
    with pytest.raises(PayloadError, match="lack rows"):
        PayloadReader(tmp_path, ("r_", "s_")).gather(1, np.array([5, 3]))  # row 3 was left out
    with pytest.raises(PayloadError, match="no segment"):
        PayloadReader(tmp_path, ("r_", "s_")).gather(1, np.array([1000]))


def ts(r: np.ndarray) -> np.ndarray:
    return r * 1000 + 5


def key(r: np.ndarray) -> np.ndarray:
    return r % 13


def with_tuple_fields(tmp_path, gaps: bool) -> np.ndarray:
    """A log of both sides' rows 0-999 (without every 7th from 3 on with `gaps`) whose columns `ts` and `key` are
    the tuples' fields; returns the rows."""
    schema = pa.schema([("label", pa.string()), ("ts", pa.timestamp("us", "UTC")), ("key", pa.int64())])
    log, rows = PayloadLog(tmp_path, "t"), np.arange(1000)
    rows = rows[rows % 7 != 3] if gaps else rows
    for side in (0, 1):
        log.write_schema(side, schema, {"ts": "ts", "key": "key"})
        for first in range(0, 1000, 100):
            mine = rows[(rows >= first) & (rows < first + 100)]
            t = columns(mine).select(["label"]).append_column("ts", pa.array(ts(mine)).cast(schema.field("ts").type))
            t = t.append_column("key", pa.array(key(mine)))
            log.write(side, mine, ts(mine), t)
    return rows


def pairs_of(r: np.ndarray, s: np.ndarray) -> dict:
    return {f"{x}_{f}": g(np.maximum(a, 0)) for x, a in (("r", r), ("s", s)) for f, g in (("ts", ts), ("key", key))}


@pytest.mark.parametrize("gaps", [False, True])
def test_columns_that_are_tuple_fields_come_from_the_pairs_as_gathered(tmp_path, gaps):
    """The time and key columns the log names as its tuples' fields are taken from the pairs' fields, in their
    places and types, null where a side is missing: the same table as gathering them."""
    rows = with_tuple_fields(tmp_path, gaps)
    rng = np.random.default_rng(3)
    r, s = rng.choice(rows, 3000), rng.choice(rows, 3000)
    r[rng.random(3000) < 0.1] = -1
    reader = PayloadReader(tmp_path, ("r_", "s_"))
    pairs = pairs_of(r, s)
    gathered, taken = reader.both(r, s), reader.both(r, s, pairs)
    assert taken.schema == gathered.schema and taken.equals(gathered)
    pairs["s_key"] = pairs["s_key"] + 1  # they are the pairs' values, not the log's
    assert reader.both(r, s, pairs)["s_key"].equals(pc.add(gathered["s_key"], 1))


def test_an_inner_joins_result_files_hold_the_tuples_fields_as_required_columns(tmp_path):
    """No side of an inner join's row is missing: its tuple fields are written required (Parquet writes them
    without definition levels); the payload stays nullable, and outer joins' rows keep every column nullable."""
    rows = with_tuple_fields(tmp_path, gaps=False)
    r, s = rows[:50], rows[::-1][:50]
    reader = PayloadReader(tmp_path, ("r_", "s_"))
    inner = with_columns(reader, r, s, np.zeros(50), None, pairs_of(r, s))
    required = {f.name for f in inner.schema if not f.nullable}
    assert required == {"r_ts", "r_key", "s_ts", "s_key", "delay"}
    matched = with_columns(reader, r, s, np.zeros(50), MATCHED, pairs_of(r, s))
    assert inner.column_names == matched.column_names[:-1]
    assert all(a.equals(b) for a, b in zip(inner.columns, matched.columns))  # the same values
    write_table(tmp_path / "out", "inner", inner, "parquet")
    written = pq.read_table(tmp_path / "out" / "inner.parquet")
    assert written.schema == inner.schema and written.equals(inner)
    outer = with_columns(reader, r, np.full(50, -1), np.zeros(50), LEFT_UNMATCHED)
    assert {f.name for f in outer.schema if not f.nullable} == {"delay", "kind"}
