"""The payload log: the user's columns of every row of a declared stream, on disk beside the run.

The join runs on fixed-width tuples (protocol.tuples): key code, event time, arrival and, in `id`, the row's
position in its stream (its row reference).  The rest of a row -- the user's key values, id and payload columns,
any Arrow type -- is written once by the master as it reads the input, one Arrow IPC file (a segment) per
record batch, and gathered for the results where they are written with vectorized `take`s from memory-mapped
segments (late materialization, as column stores do): it never crosses MPI, never sits in a window, a move or a
checkpoint, so every path that keeps the join exact (moves, hot-key grids, band copies, recovery) carries it
unchanged.  The cost is disk under `output.path/payload/` (a shared file system on several hosts, as results
and checkpoints already need): a segment is removed once no result can need its rows (master.state.payload),
so the log holds about a window and a checkpoint's worth of input.

A segment `payload/<R|S>/<first row>-<last row>.arrow` holds the column `__row` (the stream rows, rising) and the
stream's output columns under the user's names; `schema.arrow` beside them holds none, only their types, so a
side with no row to gather still has its columns, and which of them are the tuples' own fields (TUPLE_FIELDS):
results take those from their pairs, not from the segments.  Every dispatcher reads the same input and writes a segment
that is not there yet under a temporary name, then renames it: the same rows, the same bytes, whoever is first.
Dispatchers that share a Kafka topic's partitions out (master.sources.kafka_input) read different rows: each
numbers its own from `ROW_BLOCK` times its index on, so their segments never overlap, and each lists, resumes and
removes only the segments of its own block (`block`); readers find every segment whichever wrote it.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import pyarrow as pa

from protocol.output import empty_table
from protocol.tuples import STREAM_NAMES

if TYPE_CHECKING:
    from protocol.plan import Plan

ROW = "__row"
#: a segment's schema metadata: the largest event time of its rows, so that a recovery listing it again releases it
#: by its own times, not by the stream's largest at the checkpoint (which a run cut short by the next fault
#: may never pass: the log would grow from restart to restart)
TS_MAX = b"ts_max"
#: schema.arrow's metadata: the output columns whose every value is the row's tuple field of that name (JSON,
#: column -> field: a stream's time is its tuples' ts, an integer key taken as it is their key), which results
#: take from the pairs (`PayloadReader.both`) instead of gathering them
TUPLE_FIELDS = b"tuple_fields"
FOLDER = "payload"
SCHEMA_FILE = "schema.arrow"
#: segments each reader keeps open per side (memory-mapped: the pages stay the page cache's to drop)
OPEN_SEGMENTS = 64
#: stream rows per dispatcher that numbers its own rows (Kafka partitions shared out): dispatcher d's are
#: d * ROW_BLOCK + 0, 1, ... (2**40: a trillion rows each, int64 ids up to 8,388,607 dispatchers)
ROW_BLOCK = 1 << 40


class PayloadError(Exception):
    """A row's payload cannot be found: the payload log was removed or belongs to another input."""


def segment_name(first: int, last: int) -> str:
    return f"{first:012d}-{last:012d}.arrow"


def segment_rows(name: str) -> tuple[int, int] | None:
    """(first row, last row) of a segment file's name, None if it is not one (rows past 12 digits: wider)."""
    first, _, rest = name.partition("-")
    last = rest.removesuffix(".arrow")
    if not (name.endswith(".arrow") and first.isdigit() and last.isdigit()):
        return None
    return int(first), int(last)


def _write_ipc(path: Path, table: pa.Table, tag: str) -> None:
    tmp = path.with_name(f".{path.name}.{tag}.tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    os.replace(tmp, path)


class Segment(NamedTuple):
    """One segment file of the log, as the writer lists it."""

    first: int  #: its first stream row
    last: int  #: its last stream row
    ts_max: int  #: the largest event time of its rows
    size: int  #: its bytes
    path: Path


class PayloadLog:
    """The master's side: segments and schemas of both streams under `root`/payload (`tag`: this writer's
    name in temporary files, so that dispatchers never write into each other's; `block`: the rows it numbers
    itself, [first, end), when dispatchers read different rows)."""

    def __init__(self, root: Path | str, tag: str, block: tuple[int, int] = (0, ROW_BLOCK)):
        self.folder, self.tag, self.block = Path(root) / FOLDER, tag, block
        self.removed_bytes = 0  #: what `release` removed
        self.peak_bytes = 0  #: the most the segments in `segments` ever were
        self.seconds = 0.0  #: CPU seconds the threads that wrote segments spent in `write`
        self._lock = threading.Lock()  #: each stream's reader thread appends, the master's loop releases
        self.forget()

    def forget(self) -> None:
        """Start listing segments anew (the input is read again from its start)."""
        with self._lock:
            self.segments: list[deque[Segment]] = [deque(), deque()]  #: per side, written or found, in row order
            self.held_bytes = 0  #: their bytes
            self.bytes = 0  #: the log's size: every segment listed, written here or by another dispatcher

    def write_schema(self, side: int, schema: pa.Schema, fields: dict[str, str] | None = None) -> None:
        """The output columns of stream `side` (R = 0), before any of its tuples is sent; `fields`: those whose
        values are the tuples' own fields (TUPLE_FIELDS: column -> field)."""
        meta = {TUPLE_FIELDS: json.dumps(fields).encode()} if fields else {}
        table = empty_table(schema).replace_schema_metadata({**(schema.metadata or {}), **meta})
        _write_ipc(self.folder / STREAM_NAMES[side] / SCHEMA_FILE, table, self.tag)

    def write(self, side: int, rows: np.ndarray, ts: np.ndarray, columns: pa.Table) -> None:
        """One batch's accepted rows (`rows` rising, their event times `ts`) and their output columns, unless a
        dispatcher wrote them."""
        if not len(rows):
            return
        began, ts_max = time.thread_time(), int(ts.max())
        path = self.folder / STREAM_NAMES[side] / segment_name(int(rows[0]), int(rows[-1]))
        if not path.exists():
            table = columns.add_column(0, ROW, pa.array(rows, pa.int64()))
            meta = {**(table.schema.metadata or {}), TS_MAX: str(ts_max).encode()}
            _write_ipc(path, table.replace_schema_metadata(meta), self.tag)
        size = path.stat().st_size
        with self._lock:
            self.bytes += size
            self.held_bytes += size
            self.peak_bytes = max(self.peak_bytes, self.held_bytes)
            self.segments[side].append(Segment(int(rows[0]), int(rows[-1]), ts_max, size, path))
            self.seconds += time.thread_time() - began

    def resume(self, side: int, below: int, ts_max: int) -> None:
        """A recovery that goes on at stream row `below` of stream `side` (not reading the input again): the
        segments of its rows before are listed (their times their own TS_MAX, at most `ts_max`: the stream's
        largest at the checkpoint), those from it on removed -- the rows after a checkpoint may be numbered
        otherwise when read again, so no segment of theirs may stay for `write` to take as its own."""
        folder = self.folder / STREAM_NAMES[side]
        lo, hi = self.block
        found = [(rows, f) for f in folder.glob("*.arrow") if (rows := segment_rows(f.name))] if folder.is_dir() else []
        for (first, last), path in sorted(found):
            if not lo <= first < hi:
                continue  # another dispatcher's rows
            if first >= below:
                path.unlink(missing_ok=True)
                continue
            size = path.stat().st_size
            own = min(ts_max, segment_ts_max(path, ts_max))
            with self._lock:
                self.bytes += size
                self.held_bytes += size
                self.peak_bytes = max(self.peak_bytes, self.held_bytes)
                self.segments[side].append(Segment(first, last, own, size, path))

    def release(self, side: int, taken: int, below: int) -> tuple[int, int]:
        """Remove the oldest segments of stream `side` whose rows are all below row `taken` and whose times are
        all below `below`; returns (segments, bytes) removed."""
        gone = []
        with self._lock:
            segments = self.segments[side]
            while segments and segments[0].last < taken and segments[0].ts_max < below:
                gone.append(segments.popleft())
            removed = sum(g.size for g in gone)
            self.removed_bytes += removed
            self.held_bytes -= removed
        for g in gone:
            with contextlib.suppress(FileNotFoundError):
                g.path.unlink()
        return len(gone), removed


def segment_ts_max(path: Path, otherwise: int) -> int:
    """The largest event time of a segment's rows (its TS_MAX; `otherwise` for a segment written without it)."""
    try:
        with pa.memory_map(str(path)) as source:
            meta = pa.ipc.open_file(source).schema.metadata or {}
        return int(meta[TS_MAX])
    except (OSError, pa.ArrowException, KeyError, ValueError):
        return otherwise


def remove_log(root: Path | str) -> None:
    """The payload log of a run that has ended (its results hold what they need): its own files, then its
    folders if nothing else is in them."""
    folder = Path(root) / FOLDER
    for side in STREAM_NAMES:
        d = folder / side
        if d.is_dir():
            for f in d.iterdir():
                if f.name == SCHEMA_FILE or segment_rows(f.name):
                    f.unlink()
            with contextlib.suppress(OSError):
                d.rmdir()
    with contextlib.suppress(OSError):
        folder.rmdir()


class PayloadReader:
    """Gathers the output columns of stream rows from the payload log under `root` (a slave writing results,
    the master writing late rows); `prefixes`: per side, what each output column's name starts with; `plan`: a
    query whose SELECT names the result columns (protocol.query.projected), for results."""

    def __init__(self, root: Path | str, prefixes: tuple[str, str], plan=None):
        self.folder, self.prefixes, self.plan = Path(root) / FOLDER, prefixes, plan
        self._firsts = [np.empty(0, np.int64), np.empty(0, np.int64)]
        self._lasts = [np.empty(0, np.int64), np.empty(0, np.int64)]
        self._names: list[list[str]] = [[], []]
        self._open: list[OrderedDict] = [OrderedDict(), OrderedDict()]
        self._schemas: list[pa.Schema | None] = [None, None]

    def schema(self, side: int) -> pa.Schema:
        if self._schemas[side] is None:
            self._schemas[side] = self._read(self.folder / STREAM_NAMES[side] / SCHEMA_FILE).schema
        return self._schemas[side]

    def fields(self, side: int) -> dict[str, str]:
        """The output columns of stream `side` that are its tuples' own fields (TUPLE_FIELDS: column -> field)."""
        meta = self.schema(side).metadata or {}
        return json.loads(meta[TUPLE_FIELDS]) if TUPLE_FIELDS in meta else {}

    @staticmethod
    def _read(path: Path) -> pa.Table:
        try:
            return pa.ipc.open_file(pa.memory_map(str(path))).read_all()
        except (OSError, pa.ArrowException) as e:
            raise PayloadError(f"payload log: cannot read {str(path)!r}: {str(e).splitlines()[0]}") from None

    def _list(self, side: int) -> None:
        found = sorted(
            (rows, f.name) for f in (self.folder / STREAM_NAMES[side]).iterdir() if (rows := segment_rows(f.name))
        )
        self._names[side] = [name for _, name in found]
        self._firsts[side] = np.array([first for (first, _), _ in found], np.int64)
        self._lasts[side] = np.array([last for (_, last), _ in found], np.int64)

    def _where(self, side: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The segment of each of `rows` (-1: a row below 0, none asked) and the segments used, listing the
        folder again when one is not known yet (one compiled pass: common.payload_passes)."""
        from common.payload_passes import _segments

        for attempt in (0, 1):
            seg, used = np.empty(len(rows), np.int64), np.zeros(len(self._firsts[side]), bool)
            missing = _segments(rows, self._firsts[side], self._lasts[side], seg, used)
            if missing < 0:
                return seg, np.flatnonzero(used)
            if attempt == 0:
                self._list(side)
        row = int(rows[missing])
        raise PayloadError(
            f"payload log: no segment of stream {STREAM_NAMES[side]} holds its row {row} "
            f"(in {str(self.folder / STREAM_NAMES[side])!r})"
        )

    def _segment(self, side: int, index: int) -> pa.Table:
        name = self._names[side][index]
        cache = self._open[side]
        if name in cache:
            cache.move_to_end(name)
            return cache[name]
        table = cache[name] = self._read(self.folder / STREAM_NAMES[side] / name)
        if len(cache) > OPEN_SEGMENTS:
            cache.popitem(last=False)
        return table

    def gather(self, side: int, rows: np.ndarray, tuples=None) -> pa.Table:
        """The output columns of stream `side`'s `rows` (int64; -1: no row, all its columns null), in that order,
        named with the side's prefix: one `take` over the segments they fall in, side by side as one table (no
        copy), without sorting the rows.  `tuples`: the rows' tuple fields by name, the side's letter first
        (a slave's pairs: r_ts, s_key, ...), from which the columns that are those fields (`fields`) are taken
        as they are."""
        from common.payload_passes import _places

        rows = np.require(rows, np.int64, "CW")
        taken = self.fields(side) if tuples is not None else {}
        drop = [ROW, *taken]
        seg, used = self._where(side, rows)
        index = np.zeros(len(rows), np.int64)
        tables, every = [empty_table(self.schema(side)).drop_columns(list(taken))], not len(rows)
        if len(used):
            tables, helds, placed = [], [], 0
            shift = np.zeros(used[-1] + 1, np.int64)  #: per segment used, its place in `tables` minus its first row
            for i in used:
                table = self._segment(side, int(i))
                helds.append(table[ROW].to_numpy())
                tables.append(table.drop_columns(drop))
                shift[i] = placed - helds[-1][0]
                placed += table.num_rows
            if all(h[-1] - h[0] + 1 == len(h) for h in helds):  # every row of each segment there: by position
                every = _places(rows, seg, shift, index)
            else:  # a segment lacks rows (rejected ones): by search
                valid = rows >= 0
                wanted, every = rows[valid], bool(valid.all())
                held = np.concatenate(helds)
                at = np.searchsorted(held, wanted)
                if (at >= len(held)).any() or (held[np.minimum(at, len(held) - 1)] != wanted).any():
                    raise PayloadError(
                        f"payload log: the segments of stream {STREAM_NAMES[side]} lack rows they should hold"
                    )
                index[valid] = at
        out = pa.concat_tables(tables).take(index if every else pa.array(index, mask=rows < 0))
        if taken:  # the tuples' own fields, in the schema's order among the gathered columns
            schema, letter = self.schema(side), "rs"[side]
            missing = None if every else rows < 0
            columns = dict(zip(out.column_names, out.columns))
            for column, field in taken.items():  # copied: a view would hold the pairs' every field until written
                values = pa.array(np.array(tuples[f"{letter}_{field}"], np.int64), pa.int64(), mask=missing)
                columns[column] = values.cast(schema.field(column).type)
            out = pa.Table.from_arrays([columns[c] for c in schema.names], names=schema.names)
        return out.rename_columns([self.prefixes[side] + c for c in out.column_names])

    def both(self, r_rows: np.ndarray, s_rows: np.ndarray, tuples=None) -> pa.Table:
        """R's columns then S's, row by row (-1: that side is missing); `tuples`: the rows' tuple fields (`gather`)."""
        r, s = self.gather(0, r_rows, tuples), self.gather(1, s_rows, tuples)
        return pa.Table.from_arrays(r.columns + s.columns, names=r.column_names + s.column_names)


def payload_reader(plan: Plan) -> PayloadReader | None:
    """The payload log of the run `plan` describes, if its input is declared streams (protocol.streams)."""
    if not plan.streams:
        return None
    return PayloadReader(plan.output.path, tuple(s.prefix for s in plan.streams))
