"""The input reader: a declared stream's files (protocol.streams), or the single file holding both streams
(`source.kind = "file"`), read batch by batch and checked.  Shared by the master's source
(master.sources.streams) and control.produce, so both agree on every row.

A stream's files (`path`: a file, a glob or a folder; CSV, Parquet or JSON-lines by extension) are read in name
order, as one stream, a record batch at a time with the columns the stream uses: its key column(s), its time
and its id (`StreamInput`; a live stream's batches are checked by `StreamChecks` alone); CSV columns the stream's
`schema` declares are converted by pyarrow's CSV reader itself (`CsvTypes`), so decimal text stays exact.  The
single file is read the same way in its one-file, two-sided mode (`SidedFile`): columns stream (R or S), id, ts,
key and optionally value, one row per tuple in arrival order, and reading can start at any row (Parquet skips whole row
groups by the row counts in its footer), so a recovery does not read what came before its position (BiStream
3.5 rewinds the source).

Each batch is checked with vectorized pyarrow.compute: bad cells give rejected rows naming file, row, column and
reason, and duplicate ids are found by `IdCheck` within `source.duplicate_window` rows; a missing path or
column, a column of a type that cannot become what is declared (common.input_schema), or a file that cannot be
parsed, is an InputError naming the file, raised when the input is opened where it can be.

Keys leave as the columns' values: integer components as int64, the others as Arrow arrays; the master maps
them to the engine's int64 keys (master.sources.keys).  Without an id column a row's id is its position in the stream.
"""

from __future__ import annotations

import glob
import re
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import pyarrow.parquet as pq

from common import input_schema
from protocol import eventtime
from common.chunks import Chunk, InputError, no_terms
from protocol.condition import ConditionError, row_mask, term_words
from protocol.query import StreamQuery
from protocol.config import DEFAULTS
from protocol.errors import ConfigError
from protocol.streams import FILE_COLUMNS
from protocol.tuples import STREAM_NAMES

if TYPE_CHECKING:
    from protocol.plan import Stream

EXTENSIONS = {
    ".csv": "csv",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".json": "json",
    ".jsonl": "json",
    ".ndjson": "json",
}

BATCH_ROWS = 1 << 16  #: rows per record batch read (a Parquet batch never spans two row groups)
DUPLICATE_WINDOW = DEFAULTS["source"]["duplicate_window"][0]
_INT_RE = r"^[+-]?[0-9]+$"
_INT64_MAX = "9223372036854775807"
_INT64_MIN_DIGITS = "9223372036854775808"  #: the magnitude of int64's minimum, which only a minus sign may carry


def _raw_strings(col: pa.ChunkedArray) -> pa.ChunkedArray:
    """Cells as strings, as written (what the rejections show); an unconvertible type gives nulls,
    so every row fails."""
    try:
        return col if pa.types.is_string(col.type) else pc.cast(col, pa.string())
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid):
        return pa.chunked_array([pa.nulls(len(col), pa.string())])


def _strings(col: pa.ChunkedArray) -> pa.ChunkedArray:
    """Trimmed strings: the regex path for CSV and for non-numeric Parquet columns."""
    return pc.utf8_trim_whitespace(_raw_strings(col))


def _ok(mask) -> np.ndarray:
    return np.asarray(pc.fill_null(mask, False).to_numpy(zero_copy_only=False), dtype=bool)


def _present(col: pa.ChunkedArray) -> np.ndarray:
    """Whether each cell holds a value (a column without nulls: no pass over it)."""
    return np.ones(len(col), bool) if col.null_count == 0 else _ok(pc.is_valid(col))


def _writable(a: np.ndarray) -> np.ndarray:
    """`a` as the compiled passes take it: contiguous and writable (Arrow's zero-copy arrays are read-only)."""
    return a if a.flags.writeable and a.flags.c_contiguous else np.array(a)


def _parse_int(col: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(int64 values, ok) -- integer columns are taken as they are; anything else goes through the regex."""
    t = col.type
    if pa.types.is_integer(t) and t != pa.uint64():
        if col.null_count == 0:  # as a rule: no pass to fill nulls
            return pc.cast(col, pa.int64()).to_numpy(), np.ones(len(col), bool)
        return pc.fill_null(pc.cast(col, pa.int64()), 0).to_numpy(), _present(col)
    s = _strings(col)
    digits = pc.replace_substring_regex(s, r"^[+-]?0*", "")  # for the int64 range check
    length = pc.utf8_length(digits)
    largest = pc.if_else(pc.starts_with(s, "-"), _INT64_MIN_DIGITS, _INT64_MAX)  # both 19 digits
    fits = pc.or_(
        pc.less(length, len(_INT64_MAX)), pc.and_(pc.equal(length, len(_INT64_MAX)), pc.less_equal(digits, largest))
    )
    ok = _ok(pc.and_(pc.match_substring_regex(s, _INT_RE), fits))
    clean = pc.if_else(pa.array(ok), pc.replace_substring_regex(s, r"^\+", ""), "0")
    return pc.cast(clean, pa.int64()).to_numpy(), ok


def _parse_float(col: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(float64 values, ok, present); null cells are not ok and not present (values 0.0)."""
    t = col.type
    present = _present(col)
    if pa.types.is_floating(t) or pa.types.is_integer(t):
        return pc.fill_null(pc.cast(col, pa.float64()), 0.0).to_numpy(), present, present
    s = _strings(col)
    ok = _ok(pc.match_substring_regex(s, eventtime.FLOAT_TEXT, ignore_case=True))
    return pc.cast(pc.if_else(pa.array(ok), s, "0"), pa.float64()).to_numpy(), ok, present


def _times(col: pa.ChunkedArray, unit: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """protocol.eventtime.from_column; a float column in a unit of a microsecond or more in one compiled pass
    (common.read_passes: the same ticks), where numpy's steps cost a fifth of reading the single file."""
    t = col.type
    if pa.types.is_integer(t) and t != pa.uint64() and col.null_count == 0:  # as a rule: no pass for nulls
        ticks, ok = eventtime.from_integers(pc.cast(col, pa.int64()).to_numpy(), unit)
        every = np.ones(len(col), bool)
        return ticks, every, every, ok
    if not pa.types.is_floating(t) or eventtime.UNITS[unit] > 6:
        return eventtime.from_column(col, unit)
    from common.read_passes import _numbers

    present = _present(col)
    x = _writable(pc.fill_null(pc.cast(col, pa.float64()), np.nan).to_numpy().astype(np.float64, copy=False))
    ticks, ok = np.empty(len(x), np.int64), np.empty(len(x), bool)
    _numbers(x, 10.0 ** (6 - eventtime.UNITS[unit]), eventtime.TS_LIMIT, ticks, ok)
    return ticks, present, present & np.isfinite(x), ok & present


def _sides(col: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(is S, is R or S) of each cell of the single file's stream column, trimmed: a column of one-byte cells R
    and S (as a rule) read from its Arrow buffers without a pass of pyarrow.compute's per cell."""
    if col.type == pa.string() and col.num_chunks == 1 and col.null_count == 0 and len(col):
        a = col.chunk(0)
        _, offsets, data = a.buffers()
        at = np.frombuffer(offsets, np.int32, len(a) + 1, a.offset * 4)
        if data is not None and at[-1] - at[0] == len(a) and (np.diff(at) == 1).all():
            first = np.frombuffer(data, np.uint8, len(a), int(at[0]))
            is_s = first == ord("S")
            if (is_s | (first == ord("R"))).all():
                return is_s, np.ones(len(a), bool)
    stream = _strings(col)
    is_s = _ok(pc.equal(stream, "S"))
    return is_s, _ok(pc.equal(stream, "R")) | is_s


def _first_failing(n: int, checks: list[np.ndarray]) -> np.ndarray:
    """Each row's code: the number (from 1) of the first of `checks` it fails, 0 if none (as a rule: no pass)."""
    code = np.zeros(n, np.int8)
    for c, good in reversed(list(enumerate(checks, 1))):
        if not good.all():
            code[~good] = c
    return code


class Parsed(NamedTuple):
    code: np.ndarray  # int8 reason per row, 0 = good
    is_s: np.ndarray  # bool
    id: np.ndarray
    ts: np.ndarray
    key: np.ndarray
    value: np.ndarray
    converts: dict  #: column -> bool per row: its cell converts (input_schema.unconverted)


class IdCheck:
    """Duplicate (stream, id) pairs, found as the file is read, in memory bounded by `window` rows.

    A row whose id is above every earlier id of its stream cannot repeat one: ids that rise per stream
    (generated input, an archive) are checked exactly whatever the file's length, from two numbers.  Any other
    row is compared with the good rows of the last `window` rows (a duplicate of a row further back is not
    found; docs/input.md).  The result depends on the rows alone, never on batch boundaries, so a recovery
    that starts reading at a row (with `max_id` and the `window` rows before it) marks the same rows.
    """

    def __init__(self, window: int, duplicate: int, max_id: tuple = (None, None)):
        """`duplicate`: the code a repeated row is marked with (its caller's list of reasons)."""
        self.window, self.duplicate = window, duplicate
        self.max_id = list(max_id)  #: per stream, the highest id of a good row so far (None: none yet)
        self._recent: deque[tuple[np.ndarray, np.ndarray, np.ndarray]] = deque()  # (is_s, id, row) of good rows

    def window_rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The good rows it compares with, (is_s, id, row) (a checkpoint's part: `resume` takes them back)."""
        if not self._recent:
            return np.empty(0, bool), np.empty(0, np.int64), np.empty(0, np.int64)
        return tuple(np.concatenate(c) for c in zip(*self._recent))

    def resume(self, max_id: list, is_s: np.ndarray, ids: np.ndarray, rows: np.ndarray) -> None:
        """Back to a checkpoint's state (`window_rows` and `max_id` there)."""
        self.max_id = list(max_id)
        self._recent.clear()
        self.remember(is_s, ids, rows)

    def remember(self, is_s: np.ndarray, ids: np.ndarray, rows: np.ndarray) -> None:
        """Good rows (duplicates too: they are the same ids) join the window; the highest ids move up."""
        self._keep(is_s, ids, rows)
        self._rise(np.zeros(len(ids), np.int8), is_s, ids)

    def _keep(self, is_s: np.ndarray, ids: np.ndarray, rows: np.ndarray) -> None:
        """Good rows join the window; those more than `window` rows before the last leave it."""
        if not len(rows):
            return
        self._recent.append((is_s, ids, rows))
        oldest = rows[-1] - self.window  #: the next row compares with rows from here on (`_repeats`)
        while self._recent and self._recent[0][2][-1] < oldest:
            self._recent.popleft()
        s_, i_, r_ = self._recent[0]  # a resumed window is one part: cut, else it stays until a run outlives it
        if r_[0] < oldest:
            cut = int(np.searchsorted(r_, oldest))
            self._recent[0] = (s_[cut:], i_[cut:], r_[cut:])

    def _rise(self, code: np.ndarray, is_s: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """The rows of code 0 whose id is not above every earlier one of its stream (suspects: they may repeat
        one), as a mask; the highest ids move up past them."""
        from common.read_passes import _rising

        tops = np.array([m or 0 for m in self.max_id], np.int64)
        has = np.array([m is not None for m in self.max_id])
        suspect = np.zeros(len(code), bool)
        _rising(_writable(code), _writable(is_s), _writable(ids), tops, has, suspect)
        self.max_id = [int(t) if h else None for t, h in zip(tops, has)]
        return suspect

    def mark(self, p: Parsed, rows: np.ndarray) -> np.ndarray:
        """Set the code of repeated good rows to duplicate; returns per row the earlier row it repeats (-1)."""
        first = np.full(len(p.code), -1, np.int64)
        suspect = self._rise(p.code, p.is_s, p.id)
        if p.code.any():
            good = np.flatnonzero(p.code == 0)
            is_s, ids, g_rows, suspect = p.is_s[good], p.id[good], rows[good], suspect[good]
        else:  # every row is good (as a rule): the batch's own arrays
            good, is_s, ids, g_rows = np.arange(len(rows)), p.is_s, p.id, rows
        if suspect.any():
            self._repeats(good, is_s, ids, g_rows, np.flatnonzero(suspect), p.code, first)
        self._keep(is_s, ids, g_rows)
        return first

    def _repeats(self, good, is_s, ids, g_rows, suspects, code, first) -> None:
        """Compare the suspect rows with the window and the batch: a suspect repeats the earliest row of its
        (stream, id) that lies at most `window` rows before it."""
        wanted = ids[suspects]
        parts = [(s_, i_, r_, np.full(len(r_), -1)) for s_, i_, r_ in self._recent]
        parts.append((is_s, ids, g_rows, np.arange(len(ids))))
        cs, ci, cr, label = (np.concatenate(cols) for cols in zip(*parts))
        keep = np.isin(ci, wanted)
        cs, ci, cr, label = cs[keep], ci[keep], cr[keep], label[keep]
        order = np.lexsort((cr, ci, cs))
        cs, ci, cr, label = cs[order], ci[order], cr[order], label[order]
        group = np.cumsum(np.concatenate([[True], (ci[1:] != ci[:-1]) | (cs[1:] != cs[:-1])])) - 1
        base = int(cr.min()) if len(cr) else 0
        span = int(cr.max()) - base + 1 if len(cr) else 1
        composite = group * span + (cr - base)  # sorted: by group, then row
        where = np.empty(len(ids), np.int64)
        where[label[label >= 0]] = np.flatnonzero(label >= 0)
        at = where[suspects]
        lowest = np.maximum(g_rows[suspects] - self.window, base) - base
        j = np.searchsorted(composite, group[at] * span + lowest)
        dup = j < at
        code[good[suspects[dup]]] = self.duplicate
        first[good[suspects[dup]]] = cr[j[dup]]


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


class CsvTypes(NamedTuple):
    """A stream's declared CSV column types (protocol.streams `schema` of a stream of CSV files) and the strptime
    formats of their timestamp text (`time_format`; [] = ISO-8601): pyarrow's CSV reader converts those columns
    itself, so decimal text becomes an exact decimal, never a double on the way."""

    types: dict[str, pa.DataType]
    formats: list[str]

    def options(self, **options) -> pacsv.ConvertOptions:
        """CSV convert options with the formats (the caller gives the column types)."""
        return pacsv.ConvertOptions(**options, **({"timestamp_parsers": self.formats} if self.formats else {}))


NO_TYPES = CsvTypes({}, [])
_FORMAT_NAMES = {"csv": "CSV", "parquet": "Parquet", "json": "JSON-lines"}


def csv_types(name: str, spec: Stream, files: list[Path]) -> CsvTypes:
    """Stream `name`'s declared CSV column types (none for a live stream, whose `schema` is its columns); a
    ConfigError for a type that is not Arrow's or that a CSV cell cannot hold, and for files that carry their
    own types (Parquet, JSON lines: cast them where they are written)."""
    if not spec.schema or spec.endpoint or spec.kafka:
        return NO_TYPES
    where = f"streams.{name}.schema"
    for f in files:
        fmt = EXTENSIONS[f.suffix.lower()]
        if fmt != "csv":
            raise ConfigError(
                f"{where}: declares the types of CSV columns, but input file {str(f)!r} is {_FORMAT_NAMES[fmt]}, "
                "which carries its own types: leave schema out (or write the types into the file)"
            )
    types = {}
    for column, text in spec.schema.items():
        try:
            types[column] = arrow_type(text)
        except ValueError as e:
            raise ConfigError(f"{where}: {column}: {e}") from None
        if pa.types.is_nested(types[column]):
            raise ConfigError(f"{where}: {column}: a CSV cell cannot hold a {text}")
    roles = {c: "key" for c in spec.key} | {spec.time: "time"} | ({spec.id: "id"} if spec.id else {})
    wrong = input_schema.wrong_stream_types(pa.schema(list(types.items())), roles)
    if wrong:
        raise ConfigError(f"{where}: " + "; ".join(w.replace("has column", "column", 1) for w in wrong))
    return CsvTypes(types, list(spec.time_format))


def first_schema(f: Path, typed: CsvTypes = NO_TYPES) -> pa.Schema:
    """The file's columns and types (CSV, JSON: as pyarrow infers them from the first block; CSV columns with
    declared types in those)."""
    fmt = EXTENSIONS[f.suffix.lower()]
    try:
        if fmt == "parquet":
            return pq.ParquetFile(f).schema_arrow
        if fmt == "csv":
            return pacsv.open_csv(f, convert_options=typed.options(column_types=typed.types)).schema
        return pajson.open_json(f).schema
    except (pa.ArrowException, OSError) as e:
        what = _bad_cell(f, typed) or str(e).splitlines()[0]
        raise InputError(f"input file {str(f)!r} cannot be read as {_FORMAT_NAMES[fmt]}: {what}") from None


def _bad_cell(f: Path, typed: CsvTypes) -> str | None:
    """The first cell of a declared CSV column that does not convert to its type, as "its row N: column C holds
    'text', not TYPE" (rows 1-based, the header aside), or None: pyarrow's message names neither row nor
    value.  An error path: the declared columns are read again as text and a failing batch is halved."""
    try:
        names = pacsv.open_csv(f, convert_options=pacsv.ConvertOptions(column_types={})).schema.names
        columns = [c for c in typed.types if c in names]
        if not columns:
            return None
        opts = pacsv.ConvertOptions(
            column_types={c: pa.string() for c in columns},
            include_columns=columns,
            strings_can_be_null=True,
            null_values=[""],
        )
        seen = 0
        for batch in pacsv.open_csv(f, convert_options=opts):
            for c in columns:
                cells, kind = batch[c], typed.types[c]
                if not _converts(cells, kind, typed.formats):
                    lo, hi = 0, len(cells)  # cells[lo:hi] holds a bad cell
                    while hi - lo > 1:
                        mid = (lo + hi) // 2
                        lo, hi = (mid, hi) if _converts(cells.slice(lo, mid - lo), kind, typed.formats) else (lo, mid)
                    written = f" written as {' or '.join(map(repr, typed.formats))}" if typed.formats else ""
                    return f"its row {seen + lo + 1:,}: column {c} holds {str(cells[lo])[:40]!r}, not {kind}" + (
                        written if pa.types.is_timestamp(kind) else ""
                    )
            seen += batch.num_rows
    except (pa.ArrowException, OSError):
        return None
    return None


def _converts(cells: pa.Array, kind: pa.DataType, formats: list[str]) -> bool:
    """Whether every non-null text cell converts to `kind` as the CSV reader converts it."""
    cells = cells.drop_null()
    try:
        if pa.types.is_timestamp(kind) and formats:
            parsed = pc.coalesce(*(pc.strptime(cells, f, kind.unit, error_is_null=True) for f in formats))
            return parsed.null_count == 0
        pc.cast(cells, kind)
        return True
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return False


def key_kinds(streams: dict[str, Stream], firsts: dict[str, pa.Schema]) -> list[str]:
    """Per key component, how both streams' values are compared: "int" when both first files (or a live
    stream's declared schema) hold integers (CSV: as pyarrow infers them), else "binary" when either holds
    binary, else "string" (both as text)."""
    kinds = []
    for columns in zip(*(s.key for s in streams.values())):
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
    terms: np.ndarray  #: int64 (rows, words): the query's terms of each row (protocol.condition), words 0 without


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

    def __init__(
        self,
        name: str,
        spec: Stream,
        kinds: list[str],
        window: int,
        first: pa.Schema,
        where: Path | str,
        query: StreamQuery | None = None,
    ):
        """`query`: the stream's part of a query (protocol.query.QueryPlan.stream): its filter, run on each batch's
        checked rows (those it drops are counted, `filtered`), and its terms, computed for the rows kept."""
        self.name, self.spec, self.kinds, self.where, self.query = name, spec, kinds, where, query
        self.filtered = 0  #: rows the query's filter dropped
        missing = [c for c in (query.columns if query else ()) if c not in first.names]
        if missing:
            raise self._fail(where, f"lacks column(s) {', '.join(missing)} that the query names")
        #: the columns read, by role
        self.roles = {c: "key" for c in spec.key} | {spec.time: "time"} | ({spec.id: "id"} if spec.id else {})
        self._check_schema(where, first, list(self.roles))
        self.schema = self._output_schema(first)
        #: the columns read: those used, then the payload ones
        self.read = list(self.roles) + [c for c in self.schema.names if c not in self.roles and c != "row"]
        self.check = IdCheck(window, duplicate=_DUPLICATE) if spec.id else None
        self.row = 0  #: the next stream row

    def checked(self, table: pa.Table) -> StreamBatch:
        """The next rows of the stream (a live stream's batch, in `first`'s columns), checked; rejected rows are
        listed with their stream row (1-based)."""
        return self._validate(self.where, 0, table)

    def place(self) -> tuple[dict, pa.Table]:
        """The next stream row and the duplicate-id check's state there (JSON, and its recent ids): a live
        stream's part of a checkpoint, which `resume` goes back to."""
        check = self.check
        recent = check.window_rows() if check is not None else (np.empty(0, bool), *[np.empty(0, np.int64)] * 2)
        where = {"row": self.row, "max_id": None if check is None else list(check.max_id)}
        return where, pa.table({"is_s": recent[0], "id": recent[1], "row": recent[2]})

    def resume(self, where: dict, recent: pa.Table) -> None:
        """Back to a `place`."""
        self.row = where["row"]
        if self.check is not None:
            self.check.resume(where["max_id"], *(recent[c].to_numpy().copy() for c in ("is_s", "id", "row")))

    def times(self, table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
        """(event time in microseconds, passes every check but the duplicate id's and the query's filter) of rows
        not yet numbered: what a Kafka stream's partition watermarks count (master.sources.partitions), so that a
        row the filter drops moves no watermark there either."""
        p = self._parse(table, 0)
        ok = p.code == 0
        if self.query is not None and self.query.filter is not None and ok.any():
            at = np.flatnonzero(ok)
            try:
                kept = row_mask(self.query.filter, self._columns(self.where, table.take(at), p.ts[at], at))
            except ConditionError as e:
                raise self._fail(self.where, f"does not suit the query: {e}") from None
            ok[at[~kept]] = False
        return p.ts, ok

    def _output_schema(self, first: pa.Schema) -> pa.Schema:
        """The columns results carry of this stream (protocol.payload), in the first file's order: key(s), time,
        id (without one: `row`, the stream row) and the payload; types as in the first file (CSV: as pyarrow
        infers them), the time as microseconds in its zone (text and numbers: UTC)."""
        payload = self.spec.payload
        missing = [c for c in ([] if payload == "*" else payload) if c not in first.names]
        if missing:
            raise self._fail(
                self.where, f"lacks payload column(s) {', '.join(missing)}; columns found: {', '.join(first.names)}"
            )
        if not self.spec.id and "row" in first.names:
            raise self._fail(
                self.where,
                "has a column named row, the name results give the stream row of a "
                f"stream without an id: declare streams.{self.name}.id",
            )
        fields = [] if self.spec.id else [pa.field("row", pa.int64())]
        for f in first:
            if f.name == self.spec.time:
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
        ids, id_ok = _parse_int(table[spec.id]) if spec.id else (rows, np.ones(n, bool))
        ts, is_time, finite, ts_ok = _times(table[spec.time], spec.time_unit)
        keys, present, converts = [], [], {spec.time: ts_ok}
        for c, kind in zip(spec.key, self.kinds):
            valid = _present(table[c])
            values, ok = _parse_int(table[c]) if kind == "int" else (_text(table[c], kind), valid)
            keys.append(values)
            present.append(valid)
            converts[c] = ok
        key_ok = np.logical_and.reduce(present)
        key_int = np.logical_and.reduce([converts[c] | ~valid for c, valid in zip(spec.key, present)])
        code = _first_failing(n, [id_ok, is_time, finite, ts_ok, key_ok, key_int])
        if spec.id:
            converts[spec.id] = id_ok
        return Parsed(code, np.zeros(n, bool), ids, ts, keys, None, converts)

    def _validate(self, f: Path | str, file_start: int, table: pa.Table) -> StreamBatch:
        n, first_row = table.num_rows, self.row
        rows = first_row + np.arange(n, dtype=np.int64)
        p = self._parse(table, first_row)
        first = self.check.mark(p, rows) if self.check is not None else None
        self.row += n
        ok = p.code == 0
        if ok.all():  # as a rule: the batch's own arrays, no gather; the rows and ids copied (IdCheck keeps them)
            rows, ids, ts, keys = rows.copy(), np.array(p.id), p.ts, p.key
            batch = StreamBatch(rows, ids, ts, keys, None, self._columns(f, table, ts, rows), no_terms(n))
            return batch if self.query is None else self._queried(f, batch)
        take = pa.array(np.flatnonzero(ok))
        keys = [k[ok] if isinstance(k, np.ndarray) else k.take(take) for k in p.key]
        rejected = self._rejected(f, table, p, rows - file_start, first)
        rows, ts = rows[ok], p.ts[ok]
        batch = StreamBatch(
            rows, p.id[ok], ts, keys, rejected, self._columns(f, table.filter(ok), ts, rows), no_terms(len(rows))
        )
        return batch if self.query is None else self._queried(f, batch)

    def _queried(self, f: Path | str, batch: StreamBatch) -> StreamBatch:
        """The rows of `batch` the query's filter keeps, with their terms (protocol.condition)."""
        q = self.query
        try:
            keep = row_mask(q.filter, batch.columns) if q.filter is not None else None
            if keep is not None and not keep.all():
                self.filtered += int(len(keep) - keep.sum())
                at = pa.array(np.flatnonzero(keep))
                batch = batch._replace(
                    rows=batch.rows[keep],
                    id=batch.id[keep],
                    ts=batch.ts[keep],
                    keys=[k[keep] if isinstance(k, np.ndarray) else k.take(at) for k in batch.keys],
                    columns=batch.columns.filter(keep),
                )
            return batch._replace(terms=term_words(q.terms, batch.columns, q.words))
        except ConditionError as e:
            raise self._fail(f, f"does not suit the query: {e}") from None

    def _columns(self, f: Path | str, table: pa.Table, ts: np.ndarray, rows: np.ndarray) -> pa.Table:
        """The accepted rows' output columns in `self.schema`'s types (the time from the engine's microseconds)."""
        out = []
        for field in self.schema:
            if field.name == "row" and not self.spec.id:
                out.append(pa.array(rows, pa.int64()))
            elif field.name == self.spec.time:
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
        role_column = {"id": self.spec.id, "time": self.spec.time}
        key_column = self.spec.key[0] if len(self.spec.key) == 1 else "+".join(self.spec.key)
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

    def __init__(
        self,
        name: str,
        spec: Stream,
        kinds: list[str],
        window: int,
        files: list[Path] | None = None,
        query: StreamQuery | None = None,
    ):
        self.files = files if files is not None else stream_files(name, spec.path)
        self.typed = csv_types(name, spec, self.files)
        schemas = [first_schema(f, self.typed) for f in self.files]
        super().__init__(name, spec, kinds, window, schemas[0], self.files[0], query)
        for f, schema in zip(self.files, schemas):
            self._check_schema(f, schema, [*self.read, *(c for c in self.typed.types if c not in self.read)])
        self._batches = self._read()
        self._held = next(self._batches, None)
        if self._held is not None:
            f, _, table = self._held
            expected = {c: input_schema.STREAM_EXPECTED[r] for c, r in self.roles.items()}
            found = lambda c: first_schema(f, self.typed).field(c).type  # noqa: E731 -- only for the message
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
                if fmt == "csv":  # declared columns in their types, the others used as text (checked cell by
                    # cell), the payload as the first file's
                    types = {
                        c: self.typed.types.get(c, pa.string() if c in self.roles else self.schema.field(c).type)
                        for c in columns
                    }
                    opts = self.typed.options(
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
                bad = _bad_cell(f, self.typed) if fmt == "csv" and self.typed.types else None
                raise self._fail(
                    f,
                    f"cannot be read: {bad}"
                    if bad
                    else f"cannot be read at its row {seen - start + 1:,} or after: {str(e).splitlines()[0]}",
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


# The single input file (`source.kind = "file"`): two streams in one CSV or Parquet file, a row's side in its
# column `stream` (R or S), read in the file's row order (protocol.streams.file_streams).

SIDED_COLUMNS = FILE_COLUMNS
SIDED_REQUIRED = SIDED_COLUMNS[:4]
SIDED_EXTENSIONS = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}
#: reason code -> (column, reason); code 0 = accepted, the last code = duplicate id
_SIDED_REASONS = [
    (None, None),
    ("stream", "stream is not R or S"),
    ("id", "id is not an integer"),
    ("ts", "ts is not a number or an ISO-8601 time"),
    ("ts", "ts is NaN or infinite"),
    ("ts", f"ts is out of range (|ts| < {eventtime.TS_LIMIT // eventtime.PER_SECOND} s)"),
    ("key", "key is not an integer"),
    ("value", "value is not a number"),
    ("id", None),  # duplicate: the reason is built per row
]
_SIDED_DUPLICATE = len(_SIDED_REASONS) - 1


def parse_sided(table: pa.Table, ts_unit: str = "s") -> Parsed:
    """Every row's values and the first check it fails (the duplicate check is IdCheck's); numbers in the ts
    column count `ts_unit`s (source.ts_unit)."""
    n = table.num_rows
    is_s, sided = _sides(table["stream"])
    ids, id_ok = _parse_int(table["id"])
    ts, ts_number, ts_finite, ts_ok = _times(table["ts"], ts_unit)
    keys, key_ok = _parse_int(table["key"])
    if "value" in table.column_names:
        value, value_ok, present = _parse_float(table["value"])
        value_ok |= ~present  # a null value is 0.0, not an error
    else:
        value, value_ok = np.zeros(n), np.ones(n, bool)
    checks = [sided, id_ok, ts_number, ts_finite, ts_ok, key_ok, value_ok]
    code = _first_failing(n, checks)
    converts = dict(zip(SIDED_COLUMNS, (checks[0], id_ok, ts_ok, key_ok, value_ok)))
    return Parsed(code, is_s, ids, ts, keys, value, converts)


class SidedBatch(NamedTuple):
    first_row: int  #: 0-based file row of the batch's first row
    end_row: int  #: one past its last row
    chunk: Chunk  #: the accepted tuples
    rows: np.ndarray  #: the 0-based file row of each accepted tuple
    rejected: pa.Table | None


class SidedFile:
    """The one-file, two-sided mode: the single file's validated batches from row `start` on, both streams in one
    arrival order (its rows'); `max_id` is the duplicate check's state there
    (IdCheck), and the `window` rows before `start` are read again to fill its window.  Numbers in the ts
    column count `ts_unit`s.  Opened at row 0, the first batch is read at once: a column none of whose cells
    converts stops the run there (common.input_schema)."""

    def __init__(
        self,
        path: str | Path,
        window: int = DUPLICATE_WINDOW,
        start: int = 0,
        max_id: tuple = (None, None),
        ts_unit: str = "s",
    ):
        self.path, self.ts_unit = str(path), ts_unit
        p = Path(self.path)
        if not p.is_file():
            raise self._fail("does not exist")
        self.fmt = SIDED_EXTENSIONS.get(p.suffix.lower())
        if self.fmt is None:
            raise self._fail(f"has extension {p.suffix or '(none)'!r}; accepted: {', '.join(SIDED_EXTENSIONS)}")
        self.check = IdCheck(window, _SIDED_DUPLICATE, max_id)
        self.row = max(0, start - window)  #: the next row to read
        self._batches = self._open(p, self.row)
        self._held: pa.Table | None = None
        while self.row < start:  # the window before `start`: read again, not checked again
            table = self._next_table()
            if table is None:
                raise InputError(
                    f"input file {self.path!r} has {self.row:,} rows, fewer than the checkpoint's "
                    f"position (row {start:,}): is it the same input?"
                )
            head = table.slice(0, start - self.row)
            parsed = parse_sided(head, ts_unit)
            good = parsed.code == 0
            self.check.remember(parsed.is_s[good], parsed.id[good], self.row + np.flatnonzero(good))
            self.row += head.num_rows
            self._held = table.slice(head.num_rows) if head.num_rows < table.num_rows else None
        if start == 0:
            self._check_first_batch(p)

    def _check_first_batch(self, p: Path) -> None:
        self._held = self._next_table()
        if self._held is None:
            return
        found = (lambda c: self._held[c].type) if self.fmt == "parquet" else (lambda c: _inferred_type(p, c))
        wrong = input_schema.unconverted(self._held, parse_sided(self._held, self.ts_unit).converts, found)
        if wrong:
            raise self._fail("; ".join(wrong))

    def _fail(self, what: str) -> InputError:
        return InputError(f"input file {self.path!r} {what} (source.path)")

    def _unreadable(self, e: Exception) -> InputError:
        kind = "CSV" if self.fmt == "csv" else "Parquet"
        where = f" at row {self.row + 1:,} or after" if self.row else ""
        return self._fail(f"cannot be read as {kind}{where}: {str(e).splitlines()[0]}")

    def _open(self, p: Path, start: int) -> Iterator[pa.RecordBatch]:
        try:
            if self.fmt == "csv":
                # every column as a string: validation is ours, and pyarrow's type inference cannot fail on a
                # later block
                conv = dict(
                    column_types={c: pa.string() for c in SIDED_COLUMNS}, strings_can_be_null=True, null_values=[""]
                )
                names = pacsv.open_csv(p, convert_options=pacsv.ConvertOptions(**conv)).schema.names
                self._check_columns(names)
                opts = pacsv.ConvertOptions(include_columns=[c for c in SIDED_COLUMNS if c in names], **conv)
                return iter(
                    pacsv.open_csv(p, read_options=pacsv.ReadOptions(skip_rows_after_names=start), convert_options=opts)
                )
            pf = pq.ParquetFile(p, pre_buffer=False)  # pre-buffering reads every row group asked for at once
            names = pf.schema_arrow.names
            self._check_columns(names)
            wrong = input_schema.wrong_types(pf.schema_arrow)
            if wrong:
                raise self._fail("; ".join(wrong))
            counts = [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)]
            starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
            group = int(np.searchsorted(starts, start, side="right")) - 1
            if group >= len(counts):
                return iter(())
            batches = pf.iter_batches(
                BATCH_ROWS, row_groups=range(group, len(counts)), columns=[c for c in SIDED_COLUMNS if c in names]
            )
            return _drop_rows(batches, start - int(starts[group]))
        except (pa.ArrowException, OSError) as e:
            raise self._unreadable(e) from None

    def _check_columns(self, names: list[str]) -> None:
        missing = [c for c in SIDED_REQUIRED if c not in names]
        if missing:
            raise self._fail(f"lacks column(s) {', '.join(missing)}; columns found: {', '.join(names) or '(none)'}")

    def _next_table(self) -> pa.Table | None:
        if self._held is not None:
            table, self._held = self._held, None
            return table
        try:
            batch = next(self._batches, None)
        except (pa.ArrowException, OSError) as e:
            raise self._unreadable(e) from None
        return None if batch is None else pa.Table.from_batches([batch])

    def __iter__(self) -> Iterator[SidedBatch]:
        while (table := self._next_table()) is not None:
            yield self._validate(table)

    def _validate(self, table: pa.Table) -> SidedBatch:
        first_row, n = self.row, table.num_rows
        rows = first_row + np.arange(n, dtype=np.int64)
        p = parse_sided(table, self.ts_unit)
        first = self.check.mark(p, rows)
        self.row += n
        ok = p.code == 0
        if ok.all():  # as a rule: copies (the source's chunks are written to), not a gather
            chunk = Chunk(  # the stream and the ids are copied: IdCheck keeps the batch's own
                np.array(p.is_s.view(np.int8)), np.array(p.id), *map(_writable, (p.ts, p.key, p.value)), no_terms(n)
            )
            return SidedBatch(first_row, first_row + n, chunk, rows, None)
        chunk = Chunk(p.is_s[ok].astype(np.int8), p.id[ok], p.ts[ok], p.key[ok], p.value[ok], no_terms(int(ok.sum())))
        return SidedBatch(first_row, first_row + n, chunk, rows[ok], self._rejected(table, p, rows, first))

    def _rejected(self, table: pa.Table, p: Parsed, rows: np.ndarray, first: np.ndarray) -> pa.Table:
        """One row per rejected row: file, 1-based row, column, reason and the raw cells as strings."""
        rej = np.flatnonzero(p.code)
        code = p.code[rej]
        cols, reasons = zip(*_SIDED_REASONS[1:])
        reason = pa.array(list(reasons), pa.string()).take(pa.array(code - 1))
        dup = code == _SIDED_DUPLICATE
        if dup.any():
            text = lambda a: pc.cast(pa.array(a), pa.string())
            dup_reason = pc.binary_join_element_wise(
                "duplicate id ",
                text(p.id[rej]),
                " in stream ",
                text(np.array(STREAM_NAMES)[p.is_s[rej].astype(int)]),
                " (first seen at row ",
                text(first[rej] + 1),
                ")",
                "",
            )
            reason = pc.if_else(pa.array(dup), dup_reason, reason)
        out = {
            "file": pa.repeat(self.path, len(rej)),
            "row": pa.array(rows[rej] + 1, pa.int64()),
            "column": pa.array(list(cols), pa.string()).take(pa.array(code - 1)),
            "reason": reason,
        }
        for c in SIDED_COLUMNS:
            out[c] = (
                _raw_strings(table[c].take(pa.array(rej)))
                if c in table.column_names
                else pa.nulls(len(rej), pa.string())
            )
        return pa.table(out)


def _inferred_type(p: Path, column: str) -> pa.DataType:
    """The type pyarrow infers for a CSV column from the file's first block (for messages only)."""
    try:
        opts = pacsv.ConvertOptions(include_columns=[column])
        return pacsv.open_csv(p, convert_options=opts).schema.field(column).type
    except (pa.ArrowException, OSError):
        return pa.string()


def _drop_rows(batches: Iterator[pa.RecordBatch], n: int) -> Iterator[pa.RecordBatch]:
    """The batches without their first `n` rows (the part of a row group before the starting row)."""
    for b in batches:
        if n >= b.num_rows:
            n -= b.num_rows
            continue
        yield b.slice(n) if n else b
        n = 0
