"""Phase one of the two-phase aggregation (BiStream, paper 001 section 3.4.2): each slave pre-aggregates
its own join results into a partial view; `control.aggregate` (phase two, the merger) combines the views.

A partial is a table of `protocol.output.PARTIAL_SCHEMA`: per join key and tumbling window of the later
tuple's ts, the count, sum, min and max of the chosen value.  These four combine by sum/sum/min/max, so
partials can be merged in any grouping and order (avg = sum / count is taken at the end).  Everything is
a pyarrow group-by over whole columns; no Python loop per tuple.

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
from protocol.output import PARTIAL_SCHEMA, NumberedFiles
from slave.join import Pairs

_GROUP = ["key", "window_start"]


def window_starts(ts: np.ndarray, window: int) -> np.ndarray:
    """Start of the tumbling window holding each ts, in seconds (ts and window in microseconds: the window
    holds start <= ts < start + window exactly); all 0.0 when window = 0 (one window for all time)."""
    if window > 0:
        ts = np.asarray(ts, np.int64)
        return eventtime.to_seconds(ts - ts % window)  # numpy's % floors: negative ts too
    return np.zeros(len(ts))


def partials(key: np.ndarray, ts: np.ndarray, value: np.ndarray, window: int) -> pa.Table:
    """One partial row per (key, window) of the given results: ts is the later tuple's ts of each result."""
    value = np.asarray(value, np.float64)
    t = pa.table(
        {
            "key": np.asarray(key, np.int64),
            "window_start": window_starts(ts, window),
            "value": value,
            "nan": np.isnan(value),
        }
    )
    g = t.group_by(_GROUP).aggregate(
        [("value", "count"), ("value", "sum"), ("value", "min"), ("value", "max"), ("nan", "any")]
    )
    return _shape(g, "value_")


def combine(tables: list[pa.Table]) -> pa.Table:
    """Merge partials into one partial with a row per (key, window): sums of counts and sums, min, max."""
    import pyarrow.compute as pc  # here: a slave that does not aggregate starts without it

    t = pa.concat_tables([PARTIAL_SCHEMA.empty_table(), *tables])
    t = t.append_column("nan", pc.is_nan(t["max"]))
    g = t.group_by(_GROUP).aggregate([("count", "sum"), ("sum", "sum"), ("min", "min"), ("max", "max"), ("nan", "any")])
    return _shape(g, "", ("count_sum", "sum_sum", "min_min", "max_max"))


def _shape(g: pa.Table, prefix: str, names: tuple[str, ...] | None = None) -> pa.Table:
    import pyarrow.compute as pc

    names = names or tuple(prefix + f for f in ("count", "sum", "min", "max"))
    cols = [g["key"], g["window_start"], *(g[n] for n in names)]
    cols[-1] = pc.if_else(g["nan_any"], np.nan, cols[-1])  # NaN is the largest value (Spark's order)
    return pa.Table.from_arrays(cols, schema=PARTIAL_SCHEMA) if g.num_rows else PARTIAL_SCHEMA.empty_table()


class PartialAggregator(NumberedFiles):
    """A slave's running partial view since its last file: results go in per batch, a file goes out every
    `flush_interval` seconds (and at stop) as `directory/slave-RRR-NNNNNN.parquet`, written atomically.

    Each file holds only what came since the previous one, so the merger sums files and never sees a
    result twice.  `directory` is a parameter so that files can be staged elsewhere and published later.
    """

    #: combine the per-batch partials once this many have piled up, so memory stays at about one view
    COMBINE_EVERY = 32

    def __init__(self, directory: str | Path, rank: int, agg: dict, clock: Callable[[], float] = time.monotonic):
        super().__init__(directory, f"slave-{rank:03d}", "parquet", flush_rows=math.inf)  # by time: `add_rows`
        self.clock = clock
        self.window, self.interval = eventtime.duration(agg["window"]), float(agg["flush_interval"])
        self.key_side = "s" if agg["group_by"] == "s_key" else "r"
        self.value_side = agg["value"][0]  # "r_value" -> "r"
        self._last = clock()

    def add_pairs(self, pairs: Pairs) -> int:
        """Pre-aggregate one batch's results (slave.join.Pairs); returns files written (0/1)."""
        return self.add_rows(
            pairs[f"{self.key_side}_key"], np.maximum(pairs["r_ts"], pairs["s_ts"]), pairs[f"{self.value_side}_value"]
        )

    def add_rows(self, key: np.ndarray, ts: np.ndarray, value: np.ndarray) -> int:
        """Pre-aggregate result rows given as their key, ts (microseconds) and value columns: pairs (`add_pairs`), or
        the R rows of a semi or anti join (e.g. impressions without a click per key and window);
        returns files written (0/1)."""
        if len(key):
            self.add(partials(key, ts, value, self.window))
            if len(self.parts) >= self.COMBINE_EVERY:
                self.parts = [combine(self.parts)]
        return self.flush() if self.clock() - self._last >= self.interval else 0

    def flush(self) -> int:
        """Write the partial view gathered since the last file; returns the number of files written (0 or 1)."""
        self._last = self.clock()
        return super().flush()

    def merged(self, parts: list[pa.Table]) -> pa.Table:
        return combine(parts)
