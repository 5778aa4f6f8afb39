"""Input sources the master pulls tuples from, in arrival order, as whole numpy arrays (protocol.chunks.Chunk).

Three kinds (``source.kind``):

* ``generator`` -- the synthetic workload of the paper (protocol.workload);
* ``file`` -- a CSV or Parquet file, read and validated batch by batch as it goes (protocol.input_file) by a
  reader thread a bounded number of batches ahead, so the master's memory does not grow with the file and
  the first tuple moves as soon as the ranks are ready; bad rows are listed in ``rejected/`` as the run passes
  them (the run goes on), while a missing or unreadable file or column stops the run with ``InputError``;
* ``zmq`` -- live batches from producers over ZeroMQ (master/zmq_source.py).
"""
from __future__ import annotations

import queue
import threading
from collections import Counter
from pathlib import Path
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from protocol.checkpoint import numbered
from protocol.chunks import Chunk, InputError, concat, rows
from protocol.access import dispatcher_endpoint
from protocol.input_file import DUPLICATE_WINDOW, Batch, InputFile
from protocol.output import write_table
from protocol.workload import GeneratorSource

#: validated batches (protocol.input_file.BATCH_ROWS rows each) the file reader keeps ready
READ_AHEAD = 4


class Source(Protocol):
    def next_chunk(self, limit: int) -> Chunk | None:
        """At most `limit` tuples in arrival order (none yet: an empty Chunk, live sources only); None when exhausted."""

    def finish(self) -> dict:
        """Release what the source holds after the run; returns entries for summary.json."""


def open_source(cfg: dict, listed: bool = True) -> Source:
    """The source `cfg` (from protocol.config.load_config) asks for; a file source writes its rejected rows
    into the output only if `listed` (several dispatchers read the same file: one lists them)."""
    src = cfg["source"]
    listing = RejectedListing(Path(cfg["output"]["path"]) / "rejected", cfg["output"]["format"],
                              cfg["output"]["flush_rows"]) if listed else None
    if src["kind"] == "file":
        return FileSource(src["path"], src["duplicate_window"], listing, src["ts_unit"])
    if src["kind"] == "streams":
        from master.streams import StreamsSource  # it builds on this module's reader
        return StreamsSource(cfg, listing)
    if src["kind"] == "zmq":
        from master.zmq_source import ZmqSource  # pyzmq and asyncio: 50 ms of a start that other sources skip
        return ZmqSource(cfg)
    return GeneratorSource(cfg["generator"])


def open_shard(cfg: dict, index: int) -> Source:
    """Dispatcher `index`'s share of the source (the whole source with one dispatcher).

    A file or the generator is split tuple by tuple; a ZeroMQ source is not split: dispatcher i binds its
    own socket, at the endpoint's port + i (ipc: the path with ".i" appended), for its own producers, and
    publishes their acknowledgements at `source.ack_endpoint`'s port + i.
    """
    k = cfg["cluster"]["dispatchers"]
    if k == 1:
        return open_source(cfg)
    if cfg["source"]["kind"] == "zmq":
        src = cfg["source"]
        own = {key: dispatcher_endpoint(src[key], index) for key in ("endpoint", "ack_endpoint") if src[key]}
        source = open_source({**cfg, "source": {**src, **own}})
        source.rejected_stem += f"-d{index}"
        return source
    return ShardedSource(open_source(cfg, listed=index == 0), k, index)


class ShardedSource:
    """Dispatcher `index` of `k` takes every k-th tuple of the input, counted from `index` (BiStream 3.2.3:
    several dispatchers ingest in parallel); the shards of all dispatchers are the input, each tuple once.
    Each dispatcher streams the whole input and keeps its share; dispatcher 0 lists the rejected rows."""

    def __init__(self, inner: Source, k: int, index: int):
        self.inner, self.k, self.index = inner, k, index
        self._position = 0  #: tuples of the whole input read so far

    def next_chunk(self, limit: int) -> Chunk | None:
        chunk = self.inner.next_chunk(limit * self.k)
        if chunk is None:
            return None
        mine = (self._position + np.arange(len(chunk.ts))) % self.k == self.index
        self._position += len(chunk.ts)
        return Chunk(*(column[mine] for column in chunk))

    @property
    def reasons(self) -> dict[str, int]:
        return getattr(self.inner, "reasons", {}) if self.index == 0 else {}

    def ended(self) -> list[bool]:
        """[streams]: per side, every tuple of that stream has been taken (the shards as the whole input)."""
        return self.inner.ended()

    def position(self) -> dict | None:
        return mark(self.inner)

    def seek(self, where: dict) -> None:
        self.inner.seek(where)
        self._position = where["accepted"]

    def finish(self) -> dict:
        return self.inner.finish()

    @property
    def log(self):
        """[streams]: the payload log every dispatcher writes (protocol.payload), else None."""
        return getattr(self.inner, "log", None)

    @property
    def rows_taken(self) -> list[int]:
        """[streams]: per side, the rows read so far, this dispatcher's and the others' (master.streams)."""
        return self.inner.rows_taken

    @staticmethod
    def merge(finished: list[dict]) -> dict:
        """Dispatcher 0's entries: it alone lists and counts the rejected rows."""
        return finished[0]


def mark(source: Source) -> dict | None:
    """Where a source stands, for a checkpoint to `skip` back to without reading what came before (None:
    a source that is rewound by reading)."""
    return source.position() if hasattr(source, "position") else None


def skip(source: Source, n: int, where: dict | None = None) -> None:
    """Rewind to a checkpoint's position: to its `mark` if it has one, else take and drop the first `n`
    tuples (sources are deterministic)."""
    if where is not None:
        source.seek(where)
        return
    while n > 0:
        chunk = source.next_chunk(min(n, 1 << 20))
        if chunk is None:
            raise InputError(f"the input ends {n:,} tuples before the checkpoint's position: is it the same input?")
        n -= len(chunk.ts)


class RejectedListing:
    """The rejected rows in `rejected/rejected-NNNNNN.*`, a file per `flush_rows` rows (or per checkpoint):
    written as the run passes them, so neither the master nor a reader holds them whole."""

    def __init__(self, directory: Path, fmt: str, flush_rows: int):
        self.directory, self.fmt, self.flush_rows = directory, fmt, flush_rows
        self._parts: list[pa.Table] = []
        self._rows = 0
        self.files = 0
        self.rows = 0  #: rejected rows listed
        self.reasons: Counter = Counter()  #: rejected rows by reason since the start or a recovery (metrics)

    def add(self, table: pa.Table) -> None:
        reason = pc.if_else(pc.starts_with(table["reason"], "duplicate id"), "duplicate id", table["reason"])
        self.reasons.update({v["values"]: v["counts"] for v in pc.value_counts(reason).to_pylist()})
        self._parts.append(table)
        self._rows += table.num_rows
        if self._rows >= self.flush_rows:
            self.flush()

    def flush(self) -> None:
        if self._parts:
            write_table(self.directory, f"rejected-{self.files:06d}", pa.concat_tables(self._parts), self.fmt)
            self.files += 1
            self.rows += self._rows
            self._parts, self._rows = [], 0

    def roll_back(self, files: int, rows: int) -> None:
        """Back to a checkpoint: its first `files` files (`rows` rows) stay, the later ones are written again."""
        for number, f in numbered(self.directory, "rejected"):
            if number >= files:
                f.unlink()
        self.files, self.rows, self._parts, self._rows = files, rows, [], 0
        self.reasons.clear()


class FileSource:
    """A CSV or Parquet file; row order = arrival order.  A reader thread validates batches up to READ_AHEAD
    ahead (pyarrow decodes and computes outside the GIL); the master takes tuples from them.

    Its position is a file row: the row after the last tuple taken (with the duplicate check's state there),
    so a recovery starts reading there (protocol.input_file.InputFile)."""

    def __init__(self, path: str | Path, window: int = DUPLICATE_WINDOW, listing: RejectedListing | None = None,
                 ts_unit: str = "s"):
        self.path, self.window, self.listing, self.ts_unit = str(path), window, listing, ts_unit
        self._start(InputFile(self.path, window, ts_unit=ts_unit))
        self._row, self._max_id, self.accepted = 0, [None, None], 0

    def _start(self, infile: InputFile) -> None:
        """Read `infile` in a thread into a queue of its own (a seek starts another)."""
        self._queue: queue.Queue = queue.Queue(READ_AHEAD)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(infile, self._queue, self._stop),
                                        name="file-reader", daemon=True)
        self._thread.start()
        self._batch: Batch | None = None
        self._taken = 0  #: tuples of `_batch` taken
        self._waiting: list[pa.Table] = []  #: rejections of batches read, not yet passed by the position
        self._end = False

    @staticmethod
    def _read(infile: InputFile, q: queue.Queue, stop: threading.Event) -> None:
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
        return {"row": self._row, "accepted": self.accepted, "max_id": list(self._max_id),
                "rejected_files": self.listing.files if self.listing else 0,
                "rejected_rows": self.listing.rows if self.listing else 0}

    def seek(self, where: dict) -> None:
        """Start reading at a position `position` gave (a recovery)."""
        self._close()
        self._start(InputFile(self.path, self.window, where["row"], tuple(where["max_id"]), self.ts_unit))
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
