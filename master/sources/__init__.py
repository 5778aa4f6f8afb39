"""Input sources the master pulls tuples from, in arrival order, as whole numpy arrays (common.chunks.Chunk),
and the factory that opens the one a config asks for (`open_source`, `open_shard`).

Four kinds (``source.kind``), all read by one `common.chunks.Source`, master.sources.streams.StreamsSource:

* ``generator`` -- the synthetic workload of the paper (common.workload), declared as two streams as the single file
  is (protocol.streams.generator_streams) and drawn in its order by the same source;
* ``streams`` -- two declared streams, each its own files, live producers or a Kafka topic (master.sources.streams);
* ``file`` -- a CSV or Parquet file holding both streams, read as two declared streams of one file in its row
  order (protocol.streams.file_streams), by the same source;
* ``zmq`` -- the single file's tuples pushed live by producers over ZeroMQ, declared as its two streams
  (protocol.streams.zmq_streams) and taken in their arrival order by the same source (master.sources.live).

Files are read and checked batch by batch as they go: bad rows are listed in ``rejected/`` as the run passes
them (the run goes on), while a missing or unreadable file or column stops the run with ``InputError``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dataclasses import replace

import numpy as np

from common.chunks import Chunk, Source, empty
from master.sources.archive import named
from master.sources.rejected import RejectedListing
from protocol import faults
from protocol.access import dispatcher_endpoint

if TYPE_CHECKING:
    from protocol.plan import Plan

#: empty chunks a HeldEnd hands on at most (the master asks about every 2 ms when idle: tens of seconds)
HELD_END_CALLS = 20_000


def open_source(plan: Plan, listed: bool = True) -> Source:
    """The source `plan` asks for, paced by its event time with
    `source.speed` (master.sources.paced); a file source writes its rejected rows into the output only if
    `listed` (several dispatchers read the same file: one lists them)."""
    source = _opened(plan, listed)
    if plan.source.speed > 0:
        from master.sources.paced import EventTimePaced

        return EventTimePaced(source, plan.source.speed)
    return source


def _opened(plan: Plan, listed: bool) -> Source:
    src = plan.source
    # drawn tuples: none to reject; pushed ones are rejected whole, as messages (master.sources.producers)
    listing = _listing(plan) if listed and src.kind not in ("generator", "zmq") else None
    from master.sources.streams import StreamsSource  # pyarrow's readers of two streams, text keys

    return StreamsSource(plan, listing)


def open_shard(plan: Plan, index: int) -> Source:
    """Dispatcher `index`'s share of the source (the whole source with one dispatcher), its end held back while a
    test's fault waits to fire (protocol.faults.pending)."""
    source = _shard(plan, index)
    return HeldEnd(source) if faults.pending() else source


def _shard(plan: Plan, index: int) -> Source:
    """Dispatcher `index`'s share of the source.

    A file or the generator is split tuple by tuple; a ZeroMQ source is not split: dispatcher i binds its
    own socket, at the endpoint's port + i (ipc: the path with ".i" appended), for its own producers, and
    publishes their acknowledgements at `source.ack_endpoint`'s port + i; so does each live declared stream
    (master.sources.live.LiveStream), while Kafka topics are shared out partition by partition
    (master.sources.kafka_input).  With live streams (both: the config refuses them beside files) each
    dispatcher reads and lists only its own share.
    """
    k = plan.cluster.dispatchers
    if k == 1:
        return open_source(plan)
    if plan.source.kind == "streams" and any(s.live for s in plan.streams):
        from master.sources.streams import StreamsSource

        return StreamsSource(plan, _listing(plan, named("rejected", index, k)), (index, k))
    if plan.source.kind == "zmq":
        from master.sources.streams import StreamsSource

        src = plan.source
        own = {key: dispatcher_endpoint(e, index) for key in ("endpoint", "ack_endpoint") if (e := getattr(src, key))}
        return StreamsSource(replace(plan, source=replace(src, **own)), share=(index, k))
    return ShardedSource(open_source(plan, listed=index == 0), k, index)


def _listing(plan: Plan, prefix: str = "rejected") -> RejectedListing:
    out = plan.output
    return RejectedListing(out.path / "rejected", out.format, out.flush_rows, prefix)


class ShardedSource(Source):
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
        return self.inner.reasons if self.index == 0 else {}

    @property
    def filtered(self) -> dict[str, int]:
        return self.inner.filtered if self.index == 0 else {}

    def partitions(self) -> list[dict]:
        return self.inner.partitions() if self.index == 0 else []

    def ended(self) -> list[bool]:
        """[streams]: per side, every tuple of that stream has been taken (the shards as the whole input)."""
        return self.inner.ended()

    def position(self) -> dict | None:
        return self.inner.position()

    def seek(self, where: dict) -> None:
        self.inner.seek(where)
        self._position = where["accepted"]

    def finish(self) -> dict:
        return self.inner.finish()

    @property
    def log(self):
        """[streams]: the payload log every dispatcher writes (protocol.payload), else None."""
        return self.inner.log

    @property
    def rows_taken(self) -> list[int]:
        """[streams]: per side, the rows read so far, this dispatcher's and the others' (master.sources.streams)."""
        return self.inner.rows_taken

    def acknowledge(self, position: dict | None) -> None:
        self.inner.acknowledge(position)


class HeldEnd:
    """`inner` whose end is held back while protocol.faults.pending(): empty chunks instead of None, at most
    HELD_END_CALLS of them, so the epochs, checkpoints and batches a fault waits for go on after the input ran
    out; meanwhile it is `holding`, and the master sends each slave a batch at every slot even without tuples
    (master.state.distribution), so a fault at a slave's n-th batch comes however short the input.  Everything
    else is the inner source's."""

    def __init__(self, inner: Source):
        self.inner, self.held, self._ended = inner, 0, False

    def next_chunk(self, limit: int) -> Chunk | None:
        if not self._ended:
            chunk = self.inner.next_chunk(limit)
            if chunk is not None:
                return chunk
            self._ended = True
        if self.holding:
            self.held += 1
            return empty()
        return None

    @property
    def holding(self) -> bool:
        return self._ended and self.held < HELD_END_CALLS and faults.pending()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)
