"""A CSV or Parquet file as a source (`source.kind = "file"`), read and validated batch by batch by a reader
thread a bounded number of batches ahead, and the listing of its rejected rows in `rejected/`."""

from __future__ import annotations

import queue
import threading
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from common.chunks import Chunk, Source, concat, rows
from common.stream_file import DUPLICATE_WINDOW, SidedBatch, SidedFile
from protocol.checkpoint import numbered
from protocol.output import NumberedFiles

#: validated batches (common.stream_file.BATCH_ROWS rows each) the file reader keeps ready
READ_AHEAD = 4


class RejectedListing(NumberedFiles):
    """The rejected rows in `rejected/<prefix>-NNNNNN.*`, a file per `flush_rows` rows (or per checkpoint):
    written as the run passes them, so neither the master nor a reader holds them whole.  Counted by their column
    `reason` (a Kafka stream lists its records under a prefix of its own: master.sources.kafka_input)."""

    def __init__(self, directory: Path, fmt: str, flush_rows: int, prefix: str = "rejected"):
        super().__init__(directory, prefix, fmt, flush_rows)
        self.rows = 0  #: rejected rows listed
        self.reasons: Counter = Counter()  #: rejected rows by reason since the start or a recovery (metrics)

    def add(self, table: pa.Table) -> int:
        reason = pc.if_else(pc.starts_with(table["reason"], "duplicate id"), "duplicate id", table["reason"])
        self.reasons.update({v["values"]: v["counts"] for v in pc.value_counts(reason).to_pylist()})
        return super().add(table)

    def write(self, stem: str, table: pa.Table) -> None:
        super().write(stem, table)
        self.rows += table.num_rows

    def roll_back(self, files: int, rows: int) -> None:
        """Back to a checkpoint: its first `files` files (`rows` rows) stay, the later ones are written again."""
        for number, f in numbered(self.directory, self.prefix):
            if number >= files:
                f.unlink()
        self.files, self.rows, self.parts, self.waiting = files, rows, [], 0
        self.reasons.clear()


class FileSource(Source):
    """A CSV or Parquet file; row order = arrival order.  A reader thread validates batches up to READ_AHEAD
    ahead (pyarrow decodes and computes outside the GIL); the master takes tuples from them.

    Its position is a file row: the row after the last tuple taken (with the duplicate check's state there),
    so a recovery starts reading there (common.stream_file.SidedFile)."""

    def __init__(
        self,
        path: str | Path,
        window: int = DUPLICATE_WINDOW,
        listing: RejectedListing | None = None,
        ts_unit: str = "s",
    ):
        self.path, self.window, self.listing, self.ts_unit = str(path), window, listing, ts_unit
        self._start(SidedFile(self.path, window, ts_unit=ts_unit))
        self._row, self._max_id, self.accepted = 0, [None, None], 0

    def _start(self, infile: SidedFile) -> None:
        """Read `infile` in a thread into a queue of its own (a seek starts another)."""
        self._queue: queue.Queue = queue.Queue(READ_AHEAD)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._read, args=(infile, self._queue, self._stop), name="file-reader", daemon=True
        )
        self._thread.start()
        self._batch: SidedBatch | None = None
        self._taken = 0  #: tuples of `_batch` taken
        self._waiting: list[pa.Table] = []  #: rejections of batches read, not yet passed by the position
        self._end = False

    @staticmethod
    def _read(infile: SidedFile, q: queue.Queue, stop: threading.Event) -> None:
        def put(item) -> bool:
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    pass
            return False

        try:
            for batch in infile:
                if not put(batch):
                    return
            put(None)
        except Exception as e:  # noqa: BLE001 -- raised again in the master's thread by next_chunk
            put(e)

    def _close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _next_batch(self) -> bool:
        item = self._queue.get()
        if isinstance(item, Exception):
            self._end = True
            raise item
        if item is None:
            self._end = True
            return False
        self._batch, self._taken = item, 0
        if item.rejected is not None:
            self._waiting.append(item.rejected)
        return True

    def next_chunk(self, limit: int) -> Chunk | None:
        if limit < 1:
            raise ValueError(f"limit must be positive, got {limit}")
        parts, room = [], limit
        while room > 0:
            b = self._batch
            if b is None or self._taken >= len(b.rows):
                if self._end or not self._next_batch():
                    break
                continue
            n = min(room, len(b.rows) - self._taken)
            part = rows(b.chunk, self._taken, self._taken + n)
            for s in (0, 1):
                mine = part.id[part.stream == s]
                if len(mine):
                    top = int(mine.max())
                    self._max_id[s] = top if self._max_id[s] is None else max(self._max_id[s], top)
            self._taken += n
            self._row = int(b.rows[self._taken - 1]) + 1
            parts.append(part)
            room -= n
        if not parts:
            if self._end and self._batch is not None:
                self._row = self._batch.end_row  # every row read is passed: the trailing rejections too
            self._list()
            return None
        self.accepted += limit - room
        self._list()
        return concat(parts)

    def _list(self) -> None:
        """Rejections of rows the position has passed go to the listing; those ahead of it wait."""
        keep = []
        for t in self._waiting:
            passed = pc.less_equal(t["row"], self._row)  # 1-based rows: row <= position is passed
            n = pc.sum(passed).as_py() or 0
            if self.listing is not None and n:
                self.listing.add(t.filter(passed))
            if n < t.num_rows:
                keep.append(t.filter(pc.invert(passed)))
        self._waiting = keep

    @property
    def reasons(self) -> dict[str, int]:
        """Rejected rows listed so far, by reason (a duplicate's reason names its id: counted as one)."""
        self._list()
        return dict(self.listing.reasons) if self.listing is not None else {}

    def position(self) -> dict:
        if self.listing is not None:
            self._list()
            self.listing.flush()
        return {
            "row": self._row,
            "accepted": self.accepted,
            "max_id": list(self._max_id),
            "rejected_files": self.listing.files if self.listing else 0,
            "rejected_rows": self.listing.rows if self.listing else 0,
        }

    def seek(self, where: dict) -> None:
        """Start reading at a position `position` gave (a recovery)."""
        self._close()
        self._start(SidedFile(self.path, self.window, where["row"], tuple(where["max_id"]), self.ts_unit))
        self._row, self._max_id, self.accepted = where["row"], list(where["max_id"]), where["accepted"]
        if self.listing is not None:
            self.listing.roll_back(where["rejected_files"], where["rejected_rows"])

    def finish(self) -> dict:
        self._close()
        if self.listing is None:
            return {}
        self._list()
        self.listing.flush()
        return {"rejected": self.listing.rows}
