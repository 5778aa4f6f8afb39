"""A slave's result files: each batch's result columns, written as files of about `output.flush_rows` rows.

Kept apart from the MPI loop (slave.run) so that bench.kernel can time a slave's whole work on a
batch (join, delays, result files) in one process without MPI.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pyarrow as pa

from protocol.output import RESULT_SCHEMA, write_table
from slave.join import Pairs


class ResultWriter:
    """Buffers result columns and writes them as files of about `flush_rows` rows.

    A file is written by a background thread (Arrow releases the GIL while it encodes and writes), so the
    slave goes on joining meanwhile: written in line, a file of 500,000 rows held up the next batch for a
    second or more on a busy host, and every tuple waiting for it.  One thread keeps the files in order;
    `wait` returns when all are on disk (a checkpoint's commit counts them).  At most `WRITING` files wait
    for the thread: a slave that produces results faster than they are written (a hot key's chunks,
    slave.join) waits rather than holding them all.
    """

    WRITING = 2

    def __init__(self, directory: str, rank: int, fmt: str, flush_rows: int):
        self.directory, self.rank, self.fmt, self.flush_rows = directory, rank, fmt, flush_rows
        self._parts: list[pa.Table] = []
        self._rows = 0
        self.files = 0
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="results")
        self._writing: list[Future] = []

    def add(self, pairs: Pairs, delay: np.ndarray) -> int:
        if len(pairs):  # the columns are contiguous: Arrow takes them without a copy (ts: converted to seconds)
            self._parts.append(pa.table([delay if c == "delay" else pairs.output(c) for c in RESULT_SCHEMA.names],
                                        schema=RESULT_SCHEMA))
            self._rows += len(pairs)
        return self.flush() if self._rows >= self.flush_rows else 0

    def flush(self) -> int:
        """Write what is buffered; returns the number of files written (0 or 1)."""
        if not self._parts:
            return 0
        self._done()
        self._writing.append(self._thread.submit(write_table, self.directory, f"slave-{self.rank:03d}-{self.files:06d}",
                                                 pa.concat_tables(self._parts), self.fmt))
        self._parts, self._rows = [], 0
        self.files += 1
        while len(self._writing) > self.WRITING:
            self._writing.pop(0).result()
        return 1

    def _done(self) -> None:
        """Forget the files written; a failed write raises here."""
        while self._writing and self._writing[0].done():
            self._writing.pop(0).result()

    def wait(self) -> None:
        """Return once every file handed to the thread is written (re-raising a failed write)."""
        for future in self._writing:
            future.result()
        self._writing = []
