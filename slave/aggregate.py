"""Phase one of the two-phase aggregation (BiStream, paper 001 section 3.4.2): each slave pre-aggregates
its own join results into a partial view; `control.aggregate` (phase two, the merger) combines the views.

Results are aggregated by their own columns (protocol.aggregation: declared streams' columns, or the single
file's r_key, r_value, ...): per group and window, what merges exactly (row count, sums, counts of values, min,
max, distinct values), so partials can be merged in any grouping and order.  Everything is a pyarrow group-by
over whole columns; no Python loop per row.

Windows are cut in integer microseconds (protocol.eventtime), as Spark's `--batch` view cuts them, and
min / max order NaN as Spark does, above every number: a group's max is NaN if any value is, its min only
if all are (pyarrow's own min / max skip NaN).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa

from protocol import eventtime
from protocol.aggregation import COUNT, FILE, FILES, RANK, SLAVES, STAMP, WATERMARK, WINDOW_START, Aggregation
from protocol.output import NumberedFiles

ROWS = "__rows"  #: each row's place in a table being grouped (distinct value sets are merged by it)
#: the one group of a view grouped by nothing: pyarrow aggregates without keys by its scalar functions, and
#: those have no `distinct` or `list` (count_distinct's values, their union)
ALL = "__all"


def micros(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """A time column in int64 microseconds: a timestamp, or float64 seconds as the single file's results hold
    them (the float64 nearest to the microseconds: rounding gives them back exactly)."""
    import pyarrow.compute as pc

    if pa.types.is_floating(column.type):
        return pc.cast(pc.round(pc.multiply(column, float(eventtime.PER_SECOND))), pa.int64())
    return pc.cast(pc.cast(column, pa.timestamp("us")), pa.int64())


def stream_times(table: pa.Table, times: tuple[str, ...]) -> pa.Array:
    """Each row's time in int64 microseconds: the latest of its `times` columns that is not null (a pair: the
    later of its two tuples; a row alone: its own); null where all are."""
    import pyarrow.compute as pc

    cols = [micros(table[c]) for c in times]
    return (pc.max_element_wise(*cols, skip_nulls=True) if len(cols) > 1 else cols[0]).combine_chunks()


def windows(ts: pa.Array, window: int, slide: int) -> tuple[np.ndarray, pa.Array]:
    """Every (row, window start) with start <= ts < start + window, starts on multiples of `slide` (tumbling:
    slide = window); a row whose time is null has one null start.  (row indices, starts), rows rising."""
    null = ts.is_null().to_numpy(zero_copy_only=False)
    t = ts.fill_null(0).to_numpy()
    latest = t - t % slide  # numpy's % floors: negative times too
    n = -(-window // slide)  # windows per row
    starts = (latest[None, :] - np.arange(n)[:, None] * slide).ravel()
    index = np.tile(np.arange(len(t)), n)
    first = np.arange(len(index)) < len(t)  # each row's latest window: a null time's only one
    keep = np.where(null[index], first, starts > t[index] - window)
    order = np.argsort(index[keep], kind="stable")
    index, starts = index[keep][order], starts[keep][order]
    return index, pa.array(starts, mask=null[index])


def grouped(t: pa.Table, keys: list[str], count: tuple, aggs: list[tuple[str, str]]) -> pa.Table:
    """`t` grouped by `keys`: the row count (`count`: pyarrow's aggregate giving it), then each (column, hash
    function, or "union": lists of distinct values united) under the column's name.  A float max is NaN if any
    value is (NaN orders above every number, as in Spark and DuckDB; pyarrow's max skips NaN, its min gives NaN
    only if all are)."""
    import pyarrow.compute as pc

    floats = [c for c, fn in aggs if fn == "max" and pa.types.is_floating(t.schema.field(c).type)]
    for c in floats:
        t = t.append_column(f"{c}__nan", pc.is_nan(t[c]))
    unions = [c for c, fn in aggs if fn == "union"]
    t = t.append_column(ROWS, pa.array(np.arange(t.num_rows))) if unions else t
    hashed = [(c, fn) for c, fn in aggs if fn != "union"] + ([(ROWS, "list")] if unions else [])
    t = t if keys else t.append_column(ALL, pa.array(np.zeros(t.num_rows, np.int8)))
    g = t.group_by(keys or [ALL], use_threads=False).aggregate(
        [count, *hashed, *((f"{c}__nan", "any") for c in floats)]
    )
    cols = {k: g[k] for k in keys}
    cols[COUNT] = g[f"{count[0]}_{count[1]}" if count[0] else count[1]]
    for c, fn in aggs:
        if fn == "union":
            cols[c] = union(t[c], g[f"{ROWS}_list"])
        else:
            cols[c] = pc.if_else(g[f"{c}__nan_any"], np.nan, g[f"{c}_{fn}"]) if c in floats else g[f"{c}_{fn}"]
    return pa.table(cols)


def union(lists: pa.ChunkedArray, rows: pa.ChunkedArray) -> pa.ListArray:
    """Per group, the distinct values of the `lists` of its `rows` (each group's input rows, as grouped)."""
    import pyarrow.compute as pc

    lists, rows = lists.combine_chunks(), rows.combine_chunks()
    group_of = np.empty(len(lists), np.int64)
    group_of[pc.list_flatten(rows).to_numpy()] = pc.list_parent_indices(rows).to_numpy()
    pairs = pa.table({"g": group_of[pc.list_parent_indices(lists).to_numpy()], "v": pc.list_flatten(lists)})
    pairs = pairs.group_by(["g", "v"], use_threads=False).aggregate([]).sort_by("g")
    offsets = np.concatenate([[0], np.cumsum(np.bincount(pairs["g"].to_numpy(), minlength=len(rows)))])
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pairs["v"].combine_chunks())


def column_partials(table: pa.Table, spec: Aggregation) -> pa.Table:
    """One partial row per group and window of a batch's result rows: the row count and, per measured column,
    what protocol.aggregation says merges exactly."""
    t = pa.table({**{g: table[g] for g in spec.groups}, **{name: table[col] for name, _, col in spec.parts}})
    if spec.window:
        index, starts = windows(stream_times(table, spec.times), spec.window, spec.slide)
        t = t.take(index).append_column(WINDOW_START, starts)
    return grouped(t, spec.keys, ([], "count_all"), [(name, fn) for name, fn, _ in spec.parts])


def column_combine(tables: list[pa.Table], spec: Aggregation) -> pa.Table:
    """Partials merged into one with a row per group and window: counts, sums and value counts add up, min of
    mins, max of maxes."""
    merge = [(name, {"count": "sum", "distinct": "union"}.get(fn, fn)) for name, fn, _ in spec.parts]
    return grouped(pa.concat_tables(tables), spec.keys, (COUNT, "sum"), merge)


def stamped(table: pa.Table, rank: int, file: int, watermark: int, slaves: int) -> pa.Table:
    """A partial file's table: its groups' rows, then its stamp (protocol.aggregation.STAMP) in a row of its own."""
    n = table.num_rows
    for c in STAMP:
        table = table.append_column(pa.field(c, pa.int64()), pa.nulls(n, pa.int64()))
    values = {COUNT: 0, RANK: rank, FILE: file, FILES: 1, WATERMARK: watermark, SLAVES: slaves}
    row = {f.name: pa.array([values.get(f.name)], f.type) for f in table.schema}
    return pa.concat_tables([table, pa.table(row, schema=table.schema)])


class ColumnAggregator(NumberedFiles):
    """A slave's running partial view of its result rows since its last file (`add_table`), grouped and measured
    as `spec` says: a file goes out every `flush_interval` seconds (and at stop) as
    `directory/slave-RRR-NNNNNN.parquet`, written atomically.  Each file holds only what came since the previous
    one, so the merger sums files and never sees a result twice.  `directory` is a parameter so that files can
    be staged elsewhere and published later.

    Each file is stamped with the watermark of the last batch in it (`decided`; lowered to a move's floor when a
    moved group is installed, `installed`), from which the merger tells final windows by each slave's newest
    stamp; a file goes out every `flush_interval` while the watermark rises, with no rows if none came
    (its columns' types from `results`: an empty result table)."""

    #: combine the per-batch partials once this many have piled up, so memory stays at about one view
    COMBINE_EVERY = 32

    def __init__(
        self,
        directory: str | Path,
        rank: int,
        flush_interval: float,
        spec: Aggregation,
        slaves: int,
        results: Callable[[], pa.Table],
        clock=time.monotonic,
    ):
        super().__init__(directory, f"slave-{rank:03d}", "parquet", flush_rows=math.inf)  # by time: `take`
        self.clock, self.interval = clock, flush_interval
        self.spec, self.rank, self.slaves, self.results = spec, rank, slaves, results
        self.watermark = self.stamp = eventtime.NEG_INF
        self._last = clock()

    def decided(self, watermark: int) -> int:
        """A batch is done: every row this slave will still put out has a time of at least `watermark` -
        `spec.reach` (eventtime.POS_INF: the run's end); returns files written (0/1)."""
        self.watermark = watermark
        return self.take(None)

    def installed(self, watermark: int) -> None:
        """A moved group is installed: its rows still to come lie only above the move's floor, below the
        stamps so far, so a file stamped with the lowered `watermark` goes out now."""
        self.watermark = watermark
        self.flush()

    def flush(self) -> int:
        """Write the partial view gathered since the last file with its stamp (none if no row came and the
        watermark stood still); returns files written (0/1)."""
        self._last = self.clock()
        if not self.parts and self.watermark == self.stamp:
            return 0
        self.parts = self.parts or [column_partials(self.results(), self.spec)]
        self.stamp = self.watermark
        return super().flush()

    def write(self, stem: str, table: pa.Table) -> None:
        super().write(stem, stamped(table, self.rank, self.files, self.stamp, self.slaves))

    def add_table(self, table: pa.Table | None) -> int:
        """Pre-aggregate result rows as written (slave.result_files; None: none), pairs and rows alone each in
        their `kind`; returns files written (0/1)."""
        return self.take(column_partials(table, self.spec) if table is not None and table.num_rows else None)

    def take(self, partial: pa.Table | None) -> int:
        """Keep one batch's partial (None: no rows); returns files written (0/1)."""
        if partial is not None:
            self.add(partial)
            if len(self.parts) >= self.COMBINE_EVERY:
                self.parts = [self.merged(self.parts)]
        return self.flush() if self.clock() - self._last >= self.interval else 0

    def merged(self, parts: list[pa.Table]) -> pa.Table:
        return column_combine(parts, self.spec)
