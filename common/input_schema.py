"""The column types an input file may have, checked when it is opened (docs/input.md, "Errors that stop the run").

A column whose type cannot become what the engine needs -- a boolean ts, a list key -- is one error naming
the file, the column, the type found and the type expected, before the run starts; so is a column of which
no cell of the first batch converts (a CSV key of `u_123`s: CSV columns are text, their type shows in their
cells).  Single bad cells further on are the rejected rows' business (common.stream_file).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import pyarrow as pa

EXPECTED = {
    "stream": "text R or S",
    "id": "an integer (int64) or text of one",
    "ts": "a time: a timestamp (any unit, any zone), a date, a number in source.ts_unit, "
    "or text of a number or of an ISO-8601 time",
    "key": "an integer (int64) or text of one",
    "value": "a number or text of one",
}


def _text(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t)


_ACCEPTS: dict[str, Callable[[pa.DataType], bool]] = {
    "stream": _text,
    "id": lambda t: _text(t) or pa.types.is_integer(t) or pa.types.is_floating(t),
    "ts": lambda t: _text(t) or _number(t) or pa.types.is_timestamp(t) or pa.types.is_date(t),
    "key": lambda t: _text(t) or pa.types.is_integer(t) or pa.types.is_floating(t),
    "value": lambda t: _text(t) or _number(t) or pa.types.is_null(t),
}


#: a declared stream's columns (protocol.streams) by their role
STREAM_EXPECTED = {
    "key": "an integer, a string or binary",
    "time": "a time: a timestamp (any unit, any zone), a date, a number in the stream's time_unit, "
    "or text of a number or of an ISO-8601 time",
    "id": "an integer (int64) or text of one (or no id: leave streams.NAME.id out and rows are numbered)",
}
_STREAM_ACCEPTS: dict[str, Callable[[pa.DataType], bool]] = {
    "key": lambda t: (
        _text(t)
        or pa.types.is_integer(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_fixed_size_binary(t)
    ),
    "time": _ACCEPTS["ts"],
    "id": lambda t: _text(t) or pa.types.is_integer(t),
}


def wrong_stream_types(schema: pa.Schema, roles: dict[str, str]) -> list[str]:
    """`wrong_types` for a declared stream's file: `roles` maps each column used to key, time or id."""
    return [
        f"has column {f.name} of type {f.type}, expected {STREAM_EXPECTED[roles[f.name]]}"
        for f in schema
        if f.name in roles and not _STREAM_ACCEPTS[roles[f.name]](f.type)
    ]


def wrong_types(schema: pa.Schema) -> list[str]:
    """What is wrong with the types of `schema`'s columns (a Parquet file's), one phrase per column."""
    return [
        f"has column {f.name} of type {f.type}, expected {EXPECTED[f.name]}"
        for f in schema
        if f.name in _ACCEPTS and not _ACCEPTS[f.name](f.type)
    ]


def unconverted(
    table: pa.Table,
    converts: dict[str, np.ndarray],
    found: Callable[[str], pa.DataType],
    expected: dict[str, str] = EXPECTED,
) -> list[str]:
    """Columns of which no cell of `table` (the first batch) converts (`converts`: per column, which do),
    one phrase each naming the type `found` (CSV: pyarrow's inference), a cell and what was `expected`."""
    out = []
    for column, ok in converts.items():
        if len(ok) and not ok.any():
            cells = table[column].drop_null()
            cell = f"e.g. {str(cells[0])[:40]!r}" if len(cells) else "every cell empty"
            out.append(
                f"has column {column} of type {found(column)} ({cell}), expected {expected[column]}: "
                f"no cell of the first {len(ok):,} rows converts"
            )
    return out
