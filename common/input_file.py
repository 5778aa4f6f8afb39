"""The input file (`source.kind = "file"`, and the producer): CSV or Parquet, one row per tuple in arrival order,
columns stream (R or S), id, ts, key and optionally value (docs/input.md).

The file is read as it goes, one record batch at a time (Parquet: `ParquetFile.iter_batches` over its row
groups; CSV: pyarrow's streaming reader), and each batch is validated with vectorized pyarrow.compute: bad rows
come out as rejections naming file, row, column and reason, while a missing file or column, a column of a type
that cannot convert (common.input_schema), or a file that cannot be parsed, is an InputError.  Reading can
start at any row: Parquet skips whole row groups by the row counts in its footer, so a recovery does not read
what came before its position (BiStream 3.5 rewinds the source).
Shared by the master's file source and control.produce, so both agree on every row.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from common import input_schema
from protocol import eventtime
from common.chunks import Chunk, InputError
from protocol.config import DEFAULTS
from protocol.tuples import STREAM_NAMES

COLUMNS = ("stream", "id", "ts", "key", "value")
REQUIRED = COLUMNS[:4]
EXTENSIONS = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}
BATCH_ROWS = 1 << 16  #: rows per record batch read (a Parquet batch never spans two row groups)
DUPLICATE_WINDOW = DEFAULTS["source"]["duplicate_window"][0]
_INT_RE = r"^[+-]?[0-9]+$"
_INT64_MAX = "9223372036854775807"
_INT64_MIN_DIGITS = "9223372036854775808"  #: the magnitude of int64's minimum, which only a minus sign may carry

#: reason code -> (column, reason); code 0 = accepted, the last code = duplicate id
_REASONS = [
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
_DUPLICATE = len(_REASONS) - 1


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


def _parse_int(col: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(int64 values, ok) -- integer columns are taken as they are; anything else goes through the regex."""
    t = col.type
    if pa.types.is_integer(t) and t != pa.uint64():
        return pc.fill_null(pc.cast(col, pa.int64()), 0).to_numpy(), _ok(pc.is_valid(col))
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
    present = _ok(pc.is_valid(col))
    if pa.types.is_floating(t) or pa.types.is_integer(t):
        return pc.fill_null(pc.cast(col, pa.float64()), 0.0).to_numpy(), present, present
    s = _strings(col)
    ok = _ok(pc.match_substring_regex(s, eventtime.FLOAT_TEXT, ignore_case=True))
    return pc.cast(pc.if_else(pa.array(ok), s, "0"), pa.float64()).to_numpy(), ok, present


class Parsed(NamedTuple):
    code: np.ndarray  # int8 reason per row, 0 = good
    is_s: np.ndarray  # bool
    id: np.ndarray
    ts: np.ndarray
    key: np.ndarray
    value: np.ndarray
    converts: dict  #: column -> bool per row: its cell converts (input_schema.unconverted)


def parse(table: pa.Table, ts_unit: str = "s") -> Parsed:
    """Every row's values and the first check it fails (the duplicate check is IdCheck's); numbers in the ts
    column count `ts_unit`s (source.ts_unit)."""
    n = table.num_rows
    stream = _strings(table["stream"])
    is_s = _ok(pc.equal(stream, "S"))
    ids, id_ok = _parse_int(table["id"])
    ts, ts_number, ts_finite, ts_ok = eventtime.from_column(table["ts"], ts_unit)
    keys, key_ok = _parse_int(table["key"])
    if "value" in table.column_names:
        value, value_ok, present = _parse_float(table["value"])
        value_ok |= ~present  # a null value is 0.0, not an error
    else:
        value, value_ok = np.zeros(n), np.ones(n, bool)
    checks = [_ok(pc.equal(stream, "R")) | is_s, id_ok, ts_number, ts_finite, ts_ok, key_ok, value_ok]
    code = np.zeros(n, np.int8)
    for c, good in reversed(list(enumerate(checks, 1))):  # the first failing check wins
        code[~good] = c
    converts = dict(zip(COLUMNS, (checks[0], id_ok, ts_ok, key_ok, value_ok)))
    return Parsed(code, is_s, ids, ts, keys, value, converts)


class IdCheck:
    """Duplicate (stream, id) pairs, found as the file is read, in memory bounded by `window` rows.

    A row whose id is above every earlier id of its stream cannot repeat one: ids that rise per stream
    (generated input, an archive) are checked exactly whatever the file's length, from two numbers.  Any other
    row is compared with the good rows of the last `window` rows (a duplicate of a row further back is not
    found; docs/input.md).  The result depends on the rows alone, never on batch boundaries, so a recovery
    that starts reading at a row (with `max_id` and the `window` rows before it) marks the same rows.
    """

    def __init__(self, window: int, max_id: tuple = (None, None), duplicate: int = _DUPLICATE):
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
        if not len(rows):
            return
        self._recent.append((is_s, ids, rows))
        while self._recent and self._recent[0][2][-1] < rows[-1] - self.window:
            self._recent.popleft()
        for s in (False, True):
            mine = ids[is_s == s]
            if len(mine):
                top = int(mine.max())
                self.max_id[s] = top if self.max_id[s] is None else max(self.max_id[s], top)

    def mark(self, p: Parsed, rows: np.ndarray) -> np.ndarray:
        """Set the code of repeated good rows to duplicate; returns per row the earlier row it repeats (-1)."""
        good = np.flatnonzero(p.code == 0)
        is_s, ids, g_rows = p.is_s[good], p.id[good], rows[good]
        first = np.full(len(p.code), -1, np.int64)
        suspect = np.zeros(len(good), bool)
        for s in (False, True):
            sel = np.flatnonzero(is_s == s)
            if len(sel):
                x = ids[sel]
                above = np.empty(len(x), np.int64)  # the highest id before each row
                above[0] = np.iinfo(np.int64).min if self.max_id[s] is None else self.max_id[s]
                above[1:] = np.maximum(np.maximum.accumulate(x)[:-1], above[0])
                suspect[sel] = x <= above
        if suspect.any():
            self._repeats(good, is_s, ids, g_rows, np.flatnonzero(suspect), p.code, first)
        self.remember(is_s, ids, g_rows)
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


class Batch(NamedTuple):
    first_row: int  #: 0-based file row of the batch's first row
    end_row: int  #: one past its last row
    chunk: Chunk  #: the accepted tuples
    rows: np.ndarray  #: the 0-based file row of each accepted tuple
    rejected: pa.Table | None


class InputFile:
    """The validated batches of one file from row `start` on; `max_id` is the duplicate check's state there
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
        self.fmt = EXTENSIONS.get(p.suffix.lower())
        if self.fmt is None:
            raise self._fail(f"has extension {p.suffix or '(none)'!r}; accepted: {', '.join(EXTENSIONS)}")
        self.check = IdCheck(window, max_id)
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
            parsed = parse(head, ts_unit)
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
        wrong = input_schema.unconverted(self._held, parse(self._held, self.ts_unit).converts, found)
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
                conv = dict(column_types={c: pa.string() for c in COLUMNS}, strings_can_be_null=True, null_values=[""])
                names = pacsv.open_csv(p, convert_options=pacsv.ConvertOptions(**conv)).schema.names
                self._check_columns(names)
                opts = pacsv.ConvertOptions(include_columns=[c for c in COLUMNS if c in names], **conv)
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
                BATCH_ROWS, row_groups=range(group, len(counts)), columns=[c for c in COLUMNS if c in names]
            )
            return _drop_rows(batches, start - int(starts[group]))
        except (pa.ArrowException, OSError) as e:
            raise self._unreadable(e) from None

    def _check_columns(self, names: list[str]) -> None:
        missing = [c for c in REQUIRED if c not in names]
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

    def __iter__(self) -> Iterator[Batch]:
        while (table := self._next_table()) is not None:
            yield self._validate(table)

    def _validate(self, table: pa.Table) -> Batch:
        first_row, n = self.row, table.num_rows
        rows = first_row + np.arange(n, dtype=np.int64)
        p = parse(table, self.ts_unit)
        first = self.check.mark(p, rows)
        self.row += n
        ok = p.code == 0
        chunk = Chunk(p.is_s[ok].astype(np.int8), p.id[ok], p.ts[ok], p.key[ok], p.value[ok])
        rejected = self._rejected(table, p, rows, first) if not ok.all() else None
        return Batch(first_row, first_row + n, chunk, rows[ok], rejected)

    def _rejected(self, table: pa.Table, p: Parsed, rows: np.ndarray, first: np.ndarray) -> pa.Table:
        """One row per rejected row: file, 1-based row, column, reason and the raw cells as strings."""
        rej = np.flatnonzero(p.code)
        code = p.code[rej]
        cols, reasons = zip(*_REASONS[1:])
        reason = pa.array(list(reasons), pa.string()).take(pa.array(code - 1))
        dup = code == _DUPLICATE
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
        for c in COLUMNS:
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
