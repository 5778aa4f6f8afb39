"""A slave's result files: each batch's result columns, written as files of about `output.flush_rows` rows.

Kept apart from the MPI loop (slave.run) so that bench.kernel can time a slave's whole work on a
batch (join, delays, result files) in one process without MPI.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pyarrow as pa

from protocol import eventtime
from protocol.output import (
    LEFT_MATCHED,
    LEFT_UNMATCHED,
    MATCHED,
    OUTER_RESULT_SCHEMA,
    RESULT_SCHEMA,
    RIGHT_UNMATCHED,
    NumberedFiles,
)
from protocol.payload import PayloadReader
from protocol.query import projected
from slave.join import Pairs


def _kind(kind: str, n: int) -> pa.Array:
    return pa.array([kind], pa.string()).take(np.zeros(n, np.int64))


def with_columns(
    payload: PayloadReader,
    r_rows: np.ndarray,
    s_rows: np.ndarray,
    delay: np.ndarray,
    kind: str | None,
    pairs: Pairs | None = None,
) -> pa.Table:
    """Result rows of declared streams: both sides' own columns gathered by stream row from the
    payload log (-1: the side is missing, its columns null; those that are the tuples' own fields taken from
    `pairs`, the rows' pairs, if given), then `delay` and, outside inner joins, `kind`; as a query's SELECT names
    them if the reader has one."""
    delays = pa.field("delay", pa.float64(), nullable=False)
    t = payload.both(r_rows, s_rows, pairs).append_column(delays, pa.array(delay))
    if kind is None:  # an inner join's rows: no side is missing, so the tuples' own fields are never null
        t = required(t, {payload.prefixes[side] + c for side in (0, 1) for c in payload.fields(side)})
    else:
        t = t.append_column(pa.field("kind", pa.string(), nullable=False), _kind(kind, len(delay)))
    return projected(t, payload.plan, payload.prefixes)


def required(table: pa.Table, names: set[str]) -> pa.Table:
    """`table` with its columns `names` declared not nullable (no copy): Parquet writes a required column without
    the definition levels of a nullable one, a fifth less time for a result row of six columns a side."""
    fields = [f.with_nullable(False) if f.name in names else f for f in table.schema]
    return pa.Table.from_arrays(table.columns, schema=pa.schema(fields, table.schema.metadata))


def lone_table(rows: np.ndarray, side: str, kind: str, now: float) -> pa.Table:
    """Rows of one side without a partner (or, semi, with one) as result rows: the other side's columns null,
    `delay` = `now` minus the row's arrival (it is produced when it is decided)."""
    n = len(rows)
    cols = {}
    for name in OUTER_RESULT_SCHEMA.names:
        field = name[2:]
        if name == "delay":
            cols[name] = pa.array(now - rows["arrival"])
        elif name == "kind":
            cols[name] = _kind(kind, n)
        elif name[0] != side:
            cols[name] = pa.nulls(n, OUTER_RESULT_SCHEMA.field(name).type)
        elif field == "ts":
            cols[name] = pa.array(eventtime.to_seconds(rows["ts"]))
        else:
            cols[name] = pa.array(np.ascontiguousarray(rows[field]))
    return pa.table(cols, schema=OUTER_RESULT_SCHEMA)


def outer_table(
    pairs: Pairs | None,
    delay: np.ndarray | None,
    lone_r: np.ndarray | None,
    lone_s: np.ndarray | None,
    join_type: str,
    payload: PayloadReader | None = None,
) -> pa.Table:
    """One batch's rows of an outer, semi or anti join (protocol.output.OUTER_RESULT_SCHEMA; with `payload`, the
    streams' own columns): its pairs (none for semi and anti), then the R rows and the S rows it decided."""
    now = time.time()
    parts = []
    for rows, side, kind in (
        (lone_r, "r", LEFT_MATCHED if join_type == "semi" else LEFT_UNMATCHED),
        (lone_s, "s", RIGHT_UNMATCHED),
    ):
        if rows is None or not len(rows):
            continue
        if payload is None:
            parts.append(lone_table(rows, side, kind, now))
            continue
        none = np.full(len(rows), -1, np.int64)
        ids = np.ascontiguousarray(rows["id"])
        parts.append(with_columns(payload, *((ids, none) if side == "r" else (none, ids)), now - rows["arrival"], kind))
    if pairs is not None and len(pairs):
        parts.insert(
            0,
            with_columns(payload, pairs["r_id"], pairs["s_id"], delay, MATCHED, pairs)
            if payload is not None
            else pa.table(
                [
                    delay if c == "delay" else _kind(MATCHED, len(pairs)) if c == "kind" else pairs.output(c)
                    for c in OUTER_RESULT_SCHEMA.names
                ],
                schema=OUTER_RESULT_SCHEMA,
            ),
        )
    return pa.concat_tables(parts)


class ResultWriter(NumberedFiles):
    """Buffers result columns and writes them as files of about `flush_rows` rows.

    A file is written by a background thread (Arrow releases the GIL while it encodes and writes), so the
    slave goes on joining meanwhile: written in line, a file of 500,000 rows held up the next batch for a
    second or more on a busy host, and every tuple waiting for it.  One thread keeps the files in order;
    `wait` returns when all are on disk (a checkpoint's commit counts them).  At most `WRITING` files wait
    for the thread: a slave that produces results faster than they are written (a hot key's chunks,
    slave.join) waits rather than holding them all.
    """

    WRITING = 2

    def __init__(
        self,
        directory: str,
        rank: int,
        fmt: str,
        flush_rows: int,
        join_type: str = "inner",
        payload: PayloadReader | None = None,
    ):
        """`payload`: with declared streams, where results gather the streams' own columns (protocol.payload)."""
        super().__init__(directory, f"slave-{rank:03d}", fmt, flush_rows)
        self.join_type, self.payload = join_type, payload
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="results")
        self._writing: list[Future] = []

    def add_pairs(self, pairs: Pairs, delay: np.ndarray) -> pa.Table | None:
        """A chunk of a batch's pairs; returns them as the rows written (None: no pairs), which the result
        stream of declared streams sends as they are (slave.results_out)."""
        if not len(pairs):
            return None
        if self.join_type != "inner":
            return self._buffer(outer_table(pairs, delay, None, None, self.join_type, self.payload))
        if self.payload is not None:
            return self._buffer(with_columns(self.payload, pairs["r_id"], pairs["s_id"], delay, None, pairs))
        # the columns are contiguous: Arrow takes them without a copy (ts: converted to seconds)
        return self._buffer(
            pa.table([delay if c == "delay" else pairs.output(c) for c in RESULT_SCHEMA.names], schema=RESULT_SCHEMA)
        )

    def add_lone(self, lone_r: np.ndarray, lone_s: np.ndarray) -> pa.Table | None:
        """The rows without a partner (semi: R rows with one) a batch decided, once its pairs are in (slave.join:
        `lone_r`, `lone_s`); returns them as written (None: none)."""
        if not len(lone_r) + len(lone_s):
            return None
        return self._buffer(outer_table(None, None, lone_r, lone_s, self.join_type, self.payload))

    def _buffer(self, table: pa.Table) -> pa.Table:
        self.add(table)
        return table

    def write(self, stem: str, table: pa.Table) -> None:
        """Hand the file to the writer thread, once at most WRITING others wait for it."""
        self._done()
        self._writing.append(self._thread.submit(super().write, stem, table))
        while len(self._writing) > self.WRITING:
            self._writing.pop(0).result()

    def _done(self) -> None:
        """Forget the files written; a failed write raises here."""
        while self._writing and self._writing[0].done():
            self._writing.pop(0).result()

    def wait(self) -> None:
        """Return once every file handed to the thread is written (re-raising a failed write)."""
        for future in self._writing:
            future.result()
        self._writing = []
