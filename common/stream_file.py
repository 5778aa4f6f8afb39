"""One declared stream's input (protocol.streams): its files, read batch by batch and checked.

The files of `path` (a file, a glob or a folder; CSV, Parquet or JSON-lines by extension) are read in name
order, as one stream, a record batch at a time with the columns the stream uses: its key column(s), its time
and its id.  Each batch is checked with vectorized pyarrow.compute as the single input file's are
(common.input_file): bad cells give rejected rows naming file, row, column and reason; a missing path or
column, or a column of a type that cannot become what the config declares, is one InputError naming the
file, the column, the type found and the type expected, raised when the stream is opened.

Keys leave as the columns' values: integer components as int64, the others as Arrow arrays; the master maps
them to the engine's int64 keys (master.sources.keys).  Without an id column a row's id is its position in the stream.
"""

from __future__ import annotations

import glob
import re
from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import pyarrow.parquet as pq

from common import input_schema
from protocol import eventtime
from common.chunks import InputError
from common.input_file import BATCH_ROWS, IdCheck, Parsed, _ok, _parse_int, _raw_strings

EXTENSIONS = {
    ".csv": "csv",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".json": "json",
    ".jsonl": "json",
    ".ndjson": "json",
}


def stream_files(name: str, path: str) -> list[Path]:
    """The files of `path` in reading order: the file, the glob's matches or the folder's files (hidden ones
    aside) with a known extension, by name."""
    where = f"streams.{name}.path"
    p = Path(path)
    if p.is_dir():
        files = sorted(
            f
            for f in p.rglob("*")
            if f.is_file()
            and f.suffix.lower() in EXTENSIONS
            and not any(part.startswith(".") for part in f.relative_to(p).parts)
        )
        if not files:
            raise InputError(f"{where}: folder {path!r} holds no file ending in {', '.join(EXTENSIONS)}")
        return files
    if p.is_file():
        files = [p]
    elif glob.has_magic(path):
        files = sorted(Path(f) for f in glob.glob(path, recursive=True) if Path(f).is_file())
        if not files:
            raise InputError(f"{where}: {path!r} matches no file")
    else:
        raise InputError(f"{where}: {path!r} does not exist")
    for f in files:
        if f.suffix.lower() not in EXTENSIONS:
            raise InputError(
                f"input file {str(f)!r} has extension {f.suffix or '(none)'!r}; accepted: "
                f"{', '.join(EXTENSIONS)} ({where})"
            )
    return files


def first_schema(f: Path) -> pa.Schema:
    """The file's columns and types (CSV, JSON: as pyarrow infers them from the first block)."""
    fmt = EXTENSIONS[f.suffix.lower()]
    try:
        if fmt == "parquet":
            return pq.ParquetFile(f).schema_arrow
        return (pacsv.open_csv(f) if fmt == "csv" else pajson.open_json(f)).schema
    except (pa.ArrowException, OSError) as e:
        kind = {"csv": "CSV", "parquet": "Parquet", "json": "JSON-lines"}[fmt]
        raise InputError(f"input file {str(f)!r} cannot be read as {kind}: {str(e).splitlines()[0]}") from None


def key_kinds(streams: dict[str, dict], firsts: dict[str, pa.Schema]) -> list[str]:
    """Per key component, how both streams' values are compared: "int" when both first files (or a live
    stream's declared schema) hold integers (CSV: as pyarrow infers them), else "binary" when either holds
    binary, else "string" (both as text)."""
    kinds = []
    for columns in zip(*(s["key"] for s in streams.values())):
        schemas = [firsts[name] for name in streams]
        types = [x.field(c).type if c in x.names else pa.null() for x, c in zip(schemas, columns)]
        if all(pa.types.is_integer(t) for t in types):
            kinds.append("int")
        elif any(
            pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t) for t in types
        ):
            kinds.append("binary")
        else:
            kinds.append("string")
    return kinds


_TIMESTAMP = re.compile(r"timestamp\[(s|ms|us|ns)(?:, *tz=([^\]]+))?\]")
_DECIMAL = re.compile(r"decimal(128|256)?\( *(\d+) *, *(-?\d+) *\)")
_LIST = re.compile(r"list<(?:item: *)?(.+)>")


def arrow_type(text: str) -> pa.DataType:
    """An Arrow type written as pyarrow prints it ("int64", "string", "timestamp[ms, tz=UTC]",
    "decimal128(12, 2)", "list<int32>", "date32"): a live stream's declared schema (protocol.streams)."""
    t = text.strip()
    if m := _TIMESTAMP.fullmatch(t):
        return pa.timestamp(m[1], m[2])
    if m := _DECIMAL.fullmatch(t):
        return (pa.decimal256 if m[1] == "256" else pa.decimal128)(int(m[2]), int(m[3]))
    if m := _LIST.fullmatch(t):
        return pa.list_(arrow_type(m[1]))
    try:
        return pa.type_for_alias(t)
    except (ValueError, KeyError):
        raise ValueError(
            f'{text!r} is not an Arrow type (e.g. "int64", "string", "double", '
            '"timestamp[ms, tz=UTC]", "decimal128(12, 2)", "list<int32>")'
        ) from None


class StreamBatch(NamedTuple):
    rows: np.ndarray  #: the stream row (0-based, counted over its files) of each accepted row
    id: np.ndarray  #: int64
    ts: np.ndarray  #: int64 microseconds
    keys: list  #: per key component: int64 values ("int") or an Arrow array of the accepted rows
    rejected: pa.Table | None
    columns: pa.Table  #: the accepted rows' output columns (`StreamInput.schema`: protocol.payload)


#: reason code -> (role, reason); the column is the stream's column of that role
_REASONS = [
    (None, None),
    ("id", "is not an integer"),
    ("time", "is not a number or an ISO-8601 time"),
    ("time", "is NaN or infinite"),
    ("time", f"is out of range (|ts| < {eventtime.TS_LIMIT // eventtime.PER_SECOND} s)"),
    ("key", "is empty"),
    ("key", "is not an integer"),
    ("id", None),
]
_DUPLICATE = len(_REASONS) - 1


class StreamChecks:
    """The checks and conversions of stream `name`'s rows (its settings `spec` from protocol.streams, its key
    components' `kinds`) for tables of the columns `first` (the first file's, or a live stream's declared
    schema), named `where` in messages: the output columns (protocol.payload), rejected rows, the ids."""

    def __init__(self, name: str, spec: dict, kinds: list[str], window: int, first: pa.Schema, where: Path | str):
        self.name, self.spec, self.kinds, self.where = name, spec, kinds, where
        #: the columns read, by role
        self.roles = (
            {c: "key" for c in spec["key"]} | {spec["time"]: "time"} | ({spec["id"]: "id"} if spec["id"] else {})
        )
        self._check_schema(where, first, list(self.roles))
        self.schema = self._output_schema(first)
        #: the columns read: those used, then the payload ones
        self.read = list(self.roles) + [c for c in self.schema.names if c not in self.roles and c != "row"]
        self.check = IdCheck(window, duplicate=_DUPLICATE) if spec["id"] else None
        self.row = 0  #: the next stream row

    def checked(self, table: pa.Table) -> StreamBatch:
        """The next rows of the stream (a live stream's batch, in `first`'s columns), checked; rejected rows are
        listed with their stream row (1-based)."""
        return self._validate(self.where, 0, table)

    def times(self, table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
        """(event time in microseconds, passes every check but the duplicate id's) of rows not yet numbered: what
        a Kafka stream's partition watermarks count (master.sources.partitions)."""
        p = self._parse(table, 0)
        return p.ts, p.code == 0

    def _output_schema(self, first: pa.Schema) -> pa.Schema:
        """The columns results carry of this stream (protocol.payload), in the first file's order: key(s), time,
        id (without one: `row`, the stream row) and the payload; types as in the first file (CSV: as pyarrow
        infers them), the time as microseconds in its zone (text and numbers: UTC)."""
        payload = self.spec["payload"]
        missing = [c for c in ([] if payload == "*" else payload) if c not in first.names]
        if missing:
            raise self._fail(
                self.where, f"lacks payload column(s) {', '.join(missing)}; columns found: {', '.join(first.names)}"
            )
        if not self.spec["id"] and "row" in first.names:
            raise self._fail(
                self.where,
                "has a column named row, the name results give the stream row of a "
                f"stream without an id: declare streams.{self.name}.id",
            )
        fields = [] if self.spec["id"] else [pa.field("row", pa.int64())]
        for f in first:
            if f.name == self.spec["time"]:
                zone = f.type.tz if pa.types.is_timestamp(f.type) else "UTC"
                fields.append(pa.field(f.name, pa.timestamp("us", zone)))
            elif f.name in self.roles or payload == "*" or f.name in payload:
                fields.append(pa.field(f.name, pa.string() if pa.types.is_null(f.type) else f.type))
        return pa.schema(fields)

    def _fail(self, f: Path | str, what: str) -> InputError:
        return InputError(
            f"{'input file' if isinstance(f, Path) else 'stream'} {str(f)!r} {what} (streams.{self.name})"
        )

    def _check_schema(self, f: Path | str, schema: pa.Schema, columns: list[str]) -> None:
        missing = [c for c in columns if c not in schema.names]
        if missing:
            found = ", ".join(schema.names) or "(none)"
            raise self._fail(f, f"lacks column(s) {', '.join(missing)}; columns found: {found}")
        if not isinstance(f, Path) or EXTENSIONS[f.suffix.lower()] != "csv":  # CSV cells are text: their values tell
            wrong = input_schema.wrong_stream_types(schema, self.roles)
            if wrong:
                raise self._fail(f, "; ".join(wrong))

    def _parse(self, table: pa.Table, first_row: int) -> Parsed:
        n, spec = table.num_rows, self.spec
        rows = first_row + np.arange(n, dtype=np.int64)
        ids, id_ok = _parse_int(table[spec["id"]]) if spec["id"] else (rows, np.ones(n, bool))
        ts, is_time, finite, ts_ok = eventtime.from_column(table[spec["time"]], spec["time_unit"])
        keys, present, converts = [], [], {spec["time"]: ts_ok}
        for c, kind in zip(spec["key"], self.kinds):
            valid = _ok(pc.is_valid(table[c]))
            values, ok = _parse_int(table[c]) if kind == "int" else (_text(table[c], kind), valid)
            keys.append(values)
            present.append(valid)
            converts[c] = ok
        key_ok = np.logical_and.reduce(present)
        key_int = np.logical_and.reduce([converts[c] | ~valid for c, valid in zip(spec["key"], present)])
        checks = [id_ok, is_time, finite, ts_ok, key_ok, key_int]
        code = np.zeros(n, np.int8)
        for c, good in reversed(list(enumerate(checks, 1))):  # the first failing check wins
            code[~good] = c
        if spec["id"]:
            converts[spec["id"]] = id_ok
        return Parsed(code, np.zeros(n, bool), ids, ts, keys, None, converts)

    def _validate(self, f: Path | str, file_start: int, table: pa.Table) -> StreamBatch:
        n, first_row = table.num_rows, self.row
        rows = first_row + np.arange(n, dtype=np.int64)
        p = self._parse(table, first_row)
        first = self.check.mark(p, rows) if self.check is not None else None
        self.row += n
        ok = p.code == 0
        take = pa.array(np.flatnonzero(ok))
        keys = [k[ok] if isinstance(k, np.ndarray) else k.take(take) for k in p.key]
        rejected = self._rejected(f, table, p, rows - file_start, first) if not ok.all() else None
        return StreamBatch(
            rows[ok], p.id[ok], p.ts[ok], keys, rejected, self._columns(f, table.filter(ok), p.ts[ok], rows[ok])
        )

    def _columns(self, f: Path | str, table: pa.Table, ts: np.ndarray, rows: np.ndarray) -> pa.Table:
        """The accepted rows' output columns in `self.schema`'s types (the time from the engine's microseconds)."""
        out = []
        for field in self.schema:
            if field.name == "row" and not self.spec["id"]:
                out.append(pa.array(rows, pa.int64()))
            elif field.name == self.spec["time"]:
                out.append(pa.array(ts, pa.int64()).cast(field.type))
            else:
                try:
                    out.append(pc.cast(table[field.name], field.type))
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                    raise self._fail(
                        f,
                        f"has column {field.name} of type {table[field.name].type} that does not "
                        f"become {field.type}, its type in {str(self.where)!r}: "
                        f"{str(e).splitlines()[0]}",
                    ) from None
        return pa.Table.from_arrays(out, schema=self.schema)

    def _rejected(self, f: Path | str, table: pa.Table, p: Parsed, file_rows: np.ndarray, first) -> pa.Table:
        """One row per rejected row: file, its row in the file (1-based), stream, column, reason, cells."""
        rej = np.flatnonzero(p.code)
        code = p.code[rej]
        role_column = {"id": self.spec["id"], "time": self.spec["time"]}
        key_column = self.spec["key"][0] if len(self.spec["key"]) == 1 else "+".join(self.spec["key"])
        columns = [role_column.get(r, key_column) for r, _ in _REASONS[1:]]
        reason = pc.binary_join_element_wise(
            pa.array(columns).take(pa.array(code - 1)),
            " ",
            pa.array([r or "" for _, r in _REASONS[1:]]).take(pa.array(code - 1)),
            "",
        )
        if (code == _DUPLICATE).any():
            text = lambda a: pc.cast(pa.array(a), pa.string())
            dup = pc.binary_join_element_wise(
                "duplicate id ", text(p.id[rej]), " (first seen at stream row ", text(first[rej] + 1), ")", ""
            )
            reason = pc.if_else(pa.array(code == _DUPLICATE), dup, reason)
        at = pa.array(rej)
        cells = [
            pc.binary_join_element_wise(f"{c}=", pc.fill_null(_raw_strings(table[c].take(at)), ""), "")
            for c in self.read
        ]
        return pa.table(
            {
                "file": pa.repeat(str(f), len(rej)),
                "row": pa.array(file_rows[rej] + 1, pa.int64()),
                "stream": pa.repeat(self.name, len(rej)),
                "column": pa.array(columns).take(pa.array(code - 1)),
                "reason": reason,
                "cells": pc.binary_join_element_wise(*cells, "; ") if len(cells) > 1 else cells[0],
            }
        )


class StreamInput(StreamChecks):
    """The checked batches of a stream's files (protocol.streams `path`); the first batch is read at once, so a
    column none of whose cells converts stops the run before it starts (common.input_schema)."""

    def __init__(self, name: str, spec: dict, kinds: list[str], window: int, files: list[Path] | None = None):
        self.files = files if files is not None else stream_files(name, spec["path"])
        super().__init__(name, spec, kinds, window, first_schema(self.files[0]), self.files[0])
        for f in self.files[1:]:
            self._check_schema(f, first_schema(f), self.read)
        self._batches = self._read()
        self._held = next(self._batches, None)
        if self._held is not None:
            f, _, table = self._held
            expected = {c: input_schema.STREAM_EXPECTED[r] for c, r in self.roles.items()}
            found = lambda c: first_schema(f).field(c).type  # noqa: E731 -- only for the message
            wrong = input_schema.unconverted(table, self._parse(table, 0).converts, found, expected)
            if wrong:
                raise self._fail(f, "; ".join(wrong))

    def _read(self) -> Iterator[tuple[Path, int, pa.Table]]:
        """(file, the stream row of the file's first row, a batch) in reading order."""
        seen = 0
        for f in self.files:
            start = seen
            fmt, columns = EXTENSIONS[f.suffix.lower()], self.read
            try:
                if fmt == "csv":  # the columns used as text (checked cell by cell), the payload as the first file's
                    types = {c: pa.string() if c in self.roles else self.schema.field(c).type for c in columns}
                    opts = pacsv.ConvertOptions(
                        column_types=types, include_columns=columns, strings_can_be_null=True, null_values=[""]
                    )
                    batches = pacsv.open_csv(f, convert_options=opts)
                elif fmt == "parquet":
                    batches = pq.ParquetFile(f, pre_buffer=False).iter_batches(BATCH_ROWS, columns=columns)
                else:
                    batches = pajson.open_json(f)
                for b in batches:
                    seen += b.num_rows
                    yield f, start, pa.Table.from_batches([b]).select(columns)
            except (pa.ArrowException, OSError) as e:
                raise self._fail(
                    f, f"cannot be read at its row {seen - start + 1:,} or after: {str(e).splitlines()[0]}"
                ) from None

    def __iter__(self) -> Iterator[StreamBatch]:
        while True:
            item, self._held = (self._held, None) if self._held is not None else (next(self._batches, None), None)
            if item is None:
                return
            yield self._validate(*item)


def _text(col: pa.ChunkedArray, kind: str) -> pa.Array:
    """A key component compared as text (kind "string") or bytes ("binary"): one Arrow array."""
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    return pc.cast(col, pa.binary() if kind == "binary" else pa.string())
