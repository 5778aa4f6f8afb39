"""The punctuated result stream (`output.zmq_endpoint`): the master's collector and PUB socket.

Every slave sends, per batch, MPI messages (TAG_RESULTS) with that batch's
results as protocol.wire RESULTS frames (ROWS for the join types other than
inner: pairs and rows without a partner with their kind and stream time), one
per chunk (slave.join.Chunk); the last (even an empty one) says the batch is
done and carries the watermark the slave decided rows alone by.  Each STOP is
answered the same way (the last one with every row still undecided), and
`close` waits for those answers.  The master loop calls `pump`,
which publishes them and, when master.punctuation allows a higher bound P, a
PUNCT message.  With
`output.ordered` results are held and released sorted by stream time (a pair's later ts)
up to each P (SplitJoin's punctuated, ordered output with one punctuation per
released run: the relaxed adjustable punctuation with the epoch as its interval);
a row without a partner is held and released by its stream time as a pair is.
With declared streams (`[streams]`) the slaves send TABLEs, their results with
the streams' own columns and each row's stream time (`time`), and the stream
publishes TABLEs, held and ordered by that column in the same way.

Memory is bounded per subscriber (`output.subscriber_buffer_bytes`): results
go out in messages of at most MESSAGE_BYTES and the XPUB socket queues at most
bound / MESSAGE_BYTES of them for each subscriber.  The socket is set to
XPUB_NODROP and sent to without blocking, so a full subscriber shows as EAGAIN:
unordered, the message is then sent lossy: ZeroMQ delivers it to the
subscribers with room and drops it for the full one, and then skips that one
silently until it has read half its queue; it sees the gap in `seq`.  So the
master counts gaps (one per lossy send, by reason), not the messages in them:
a subscriber counts those itself (`control.subscribe`: `missed_messages`).  The join is never slowed.
With `output.ordered` the stream is lossless instead and slows the cluster (SplitJoin's ordered output needs every
result): messages wait in an outbox while a subscriber is full, and ingest
takes only as many tuples as the bound has room for (`ingest_room`: the
results a tuple brings -- the larger of the run's mean and its latest batches'
-- times the tuples whose results are still to come, in batches out or
buffered, must fit beside those held and waiting), pausing until punctuation or
the subscriber frees some; a subscriber full for
`output.subscriber_timeout` seconds is given up on: sends turn lossy as
unordered until every subscriber has room again.  The slaves' result messages
are flow-controlled by the master's pace: a slave sends them synchronously
(slave.results_out, at most IN_FLIGHT unreceived), and while a subscriber is
behind the master takes no more of them once the held and waiting results fill
the bound (`_may_take`), so the slaves wait with their results instead of the
master's memory or MPI's queues growing.  The held and waiting bytes stay
within the bound plus one result message (slave.results_out.chunk_rows: at
most 1/8 of the bound of records; a TABLE's or a batch's rows alone may be
wider), plus what the estimate of results per tuple misses while no subscriber
is behind (then every message is taken: the held results wait for a
punctuation that needs the batches' results).
`output.wait_subscribers` holds ingest until that many have subscribed, so
they miss nothing at the start.

With several dispatchers each publishes the results of its own batches on its
own socket (the endpoint's port + its index), marked with its index as sender,
and punctuates for its own batches, buffered and future tuples.  A pair whose
later ts lies below every dispatcher's punctuation has both tuples joined, so
its result has been published on one of the streams: the stream's punctuation
is the min over the dispatchers' (`control.subscribe --dispatchers k`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import sys
import time
from collections import Counter, deque

import numpy as np
import pyarrow as pa
from mpi4py import MPI

from protocol import eventtime, wire
from protocol.access import dispatcher_endpoint
from protocol.messages import TAG_RESULTS
from protocol.predicates import final_time
from master.punctuation import Punctuator

if TYPE_CHECKING:
    from protocol.plan import Plan

#: the largest result message in bytes: RESULTS frames of as many records as fit (ZeroMQ gets its own copy, so
#: a queued message never pins a larger array), the socket's SNDHWM is the bound over this
MESSAGE_BYTES = 64 * 1024


def frame_rows(record: np.dtype) -> int:
    """How many records of `record` (protocol.wire RESULT_RECORD or ROW_RECORD) one result message holds."""
    return (MESSAGE_BYTES - wire.HEADER.itemsize) // record.itemsize


def table_cuts(rows: pa.Table) -> np.ndarray:
    """Where to cut a TABLE's rows into messages of at most MESSAGE_BYTES (the row offsets, 0 first, len(rows)
    last): each row's bytes -- fixed widths, 4 or 8 bytes of offset plus the length of a text or binary value,
    a nested column's mean -- summed until the message's room (beside the header, the schema its IPC stream
    repeats and a KiB of batch metadata and padding) is full; at least one row a message."""
    import pyarrow.compute as pc  # here: a run without TABLEs does not pay its import at start

    size = np.zeros(len(rows))
    for column in rows.columns:
        kind = column.type
        large = pa.types.is_large_string(kind) or pa.types.is_large_binary(kind)
        if large or pa.types.is_string(kind) or pa.types.is_binary(kind):
            size += (8 if large else 4) + pc.binary_length(column).fill_null(0).to_numpy()
        elif pa.types.is_boolean(kind) or pa.types.is_null(kind):
            size += 1 / 8
        else:
            try:
                size += kind.bit_width / 8
            except ValueError:  # nested
                size += column.nbytes / max(1, len(rows))
        if column.null_count:
            size += 1 / 8  # validity bits
    room = MESSAGE_BYTES - wire.HEADER.itemsize - rows.schema.serialize().size - 1024
    ends = np.cumsum(size)
    cuts = [0]
    while cuts[-1] < len(rows):
        before = ends[cuts[-1] - 1] if cuts[-1] else 0.0
        cuts.append(max(cuts[-1] + 1, int(np.searchsorted(ends, before + room, "right"))))
    return np.array(cuts)


#: seconds between two punctuation checks when no result message came in
CHECK_INTERVAL = 0.05
#: ordered: the latest batches whose results per tuple the ingest's estimate takes the largest of (windows that
#: fill up, a key that heats up: the run's mean alone lags behind)
RECENT_BATCHES = 8
#: ordered: tuples let in before any batch's results came back to estimate from
FIRST_TUPLES = 4096
#: ordered: the tuples on their way may bring this many times the results per tuple seen (windows that fill up
#: bring more with each batch); ingest lets in only what fits with that headroom
HEADROOM = 2.0


class ResultStream:
    def __init__(self, comm: MPI.Comm, plan: Plan, partitions: int, index: int = 0):
        out = plan.output
        self.comm, self.ordered, self.index = comm, out.ordered, index
        self.endpoint = dispatcher_endpoint(out.zmq_endpoint, index) if out.zmq_endpoint else ""
        self.enabled = bool(self.endpoint)
        join = plan.join
        #: rows without a partner decided by the watermark: their final time lies `lead` after their ts at least
        kept = {"left": (0,), "anti": (0,), "right": (1,), "full": (0, 1)}.get(join.type, ())
        lead = min((final_time(stream, 0, join.bounds) for stream in kept), default=None)
        self.punctuator = Punctuator(partitions, lead)
        self.seq = self.results = self.punctuations = 0
        self.result_bytes = 0  #: of the results so far, as they came (records, or TABLEs' columns)
        self.held: list = []  #: ordered mode: results (records, or TABLEs' tables) not yet covered by a punctuation
        self.held_peak = self.held_rows = self.held_bytes = self.held_peak_bytes = 0
        self.bound, self.timeout = out.subscriber_buffer_bytes, out.subscriber_timeout
        self.gaps: Counter[str] = Counter()  #: gaps opened in a subscriber's stream (lossy sends), by reason
        #: ordered mode: messages (frames, bytes) waiting for a full subscriber, oldest first
        self.outbox: deque[tuple[list, int]] = deque()
        self.outbox_bytes = 0
        self._waiting_since: float | None = None  #: ordered: since when the outbox's head waits
        self._given_up = False  #: ordered: a subscriber stayed full past the timeout: drop for it
        self.held_back = 0.0  #: ordered: seconds ingest was paused by `ingest_room`
        self._holding_since: float | None = None
        self._batch_tuples: dict[tuple[int, int], int] = {}  #: ordered: tuples of each batch out
        self._batch_bytes: Counter[tuple[int, int]] = Counter()  #: ordered: result bytes of each batch out so far
        #: ordered: results bytes per tuple of the latest batches done (RECENT_BATCHES of them)
        self._recent: deque[float] = deque(maxlen=RECENT_BATCHES)
        self.tuples_sent = self.tuples_done = 0  #: ordered: tuples sent to slaves, those whose results came
        self.holding = False  #: ordered: a slave's result message waits, not taken while a subscriber is behind
        self.held_back_messages = 0  #: ordered: times the stream stopped taking the slaves' result messages
        self._next_check = 0.0
        if not self.enabled:
            return
        import zmq  # here and below, not at the top: pyzmq takes 50 ms of a start that has no result stream
        from common.zmq_security import bind_server

        # its own context: `close` terminates it, which returns once the queued messages went out (at most the
        # socket's linger), before the interpreter exits under ZeroMQ's I/O thread
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.XPUB)
        self.sock.sndhwm, self.sock.linger = max(1, self.bound // MESSAGE_BYTES), 2000
        self.sock.setsockopt(zmq.XPUB_NODROP, 1)  # a full subscriber: EAGAIN, and we decide (`_publish`)
        self.sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, not only a topic's first: wait_subscribers
        try:
            bind_server(self.sock, self.endpoint, plan.security)
        except zmq.ZMQError as e:
            raise OSError(f"cannot bind output.zmq_endpoint {self.endpoint!r}: {e}") from None
        self.endpoint = self.sock.last_endpoint.decode()
        self._wait_subscribers(out.wait_subscribers)

    def _wait_subscribers(self, n: int) -> None:
        if n:
            print(f"results: waiting for {n} subscriber(s) on {self.endpoint}", file=sys.stderr, flush=True)
        seen = 0
        while seen < n:
            if self.sock.recv()[:1] == b"\x01":  # XPUB: a subscription arrived
                seen += 1

    def sent(self, rank: int, seq: int, partitions: np.ndarray, r: np.ndarray, s: np.ndarray, floor_now: int) -> None:
        """The master sent `rank` its batch `seq` (R rows `r`, S rows `s`) draining `partitions`; event time
        in microseconds (protocol.eventtime) here and in `pump`."""
        if self.enabled:
            min_ts = min(
                int(r["ts"].min()) if len(r) else eventtime.POS_INF, int(s["ts"].min()) if len(s) else eventtime.POS_INF
            )
            self.punctuator.sent(rank, seq, partitions, min_ts, floor_now)
            if self.ordered:
                self._batch_tuples[(rank, seq)] = len(r) + len(s)
                self.tuples_sent += len(r) + len(s)

    def stopped(self, rank: int, seq: int, partitions: np.ndarray) -> None:
        """The master sent `rank` its STOP `seq`; its groups are `partitions`: the slave answers with its last
        results (master.punctuation: the last STOP brings every row still undecided)."""
        if self.enabled:
            self.punctuator.sent(rank, seq, partitions, eventtime.POS_INF, eventtime.POS_INF)

    def may_hold(self, partitions: np.ndarray) -> None:
        """Groups that may hold stored rows already (a recovered run's): Punctuator.may_hold."""
        if self.enabled:
            self.punctuator.may_hold(partitions)

    def rerouted(self, sources, targets) -> None:
        """Tuples moved between partitions (master.punctuation.Punctuator.rerouted)."""
        if self.enabled:
            self.punctuator.rerouted(sources, targets)

    def pump(self, future_floor: int, buffered: np.ndarray) -> int:
        """Publish what the slaves sent and a punctuation if P rose; returns the result messages taken."""
        if not self.enabled:
            return 0
        self._flush()
        got = 0
        status = MPI.Status()
        while (take := self._may_take()) and self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_RESULTS, status=status):
            buf = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
            self.comm.Recv([buf, MPI.BYTE], source=status.Get_source(), tag=TAG_RESULTS)
            msg = wire.decode(wire.unpack(buf), (wire.Frame.RESULTS, wire.Frame.ROWS, wire.Frame.TABLE), sys.maxsize)
            if isinstance(msg, wire.Rejection):  # our own slaves wrote it: a bug, not a user mistake
                raise RuntimeError(f"result message from slave {status.Get_source()}: {msg.detail}")
            nbytes = self._add(wire.read_table(msg.arrow) if msg.kind == wire.Frame.TABLE else msg.rows)
            if self.ordered:
                self._batch_bytes[(msg.sender, msg.seq)] += nbytes
            if msg.floor != wire.MORE:  # the batch's last chunk of results
                self.punctuator.done(msg.sender, msg.seq, msg.floor)
                self._batch_done((msg.sender, msg.seq))
            got += 1
        holding = not take and self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_RESULTS)
        self.held_back_messages += holding and not self.holding
        self.holding = holding
        now = time.monotonic()
        if got or now >= self._next_check:
            self._next_check = now + CHECK_INTERVAL
            p = self.punctuator.advance(future_floor, buffered)
            if p is not None:
                self._punctuate(p)
        return got

    def _may_take(self) -> bool:
        """Whether to take a slave's result message now.  Ordered, while a subscriber is behind (messages wait
        in the outbox) and the held and waiting results fill the bound, no: the slave waits for its message to
        be taken (slave.results_out), which is the flow control of results.  Else yes: with no subscriber behind,
        held results wait for a punctuation, which waits for the batches' results."""
        return not self.ordered or not self.outbox or self.held_bytes + self.outbox_bytes < self.bound

    def note(self) -> str:
        """For the progress line: ordered results wait for a subscriber behind, how many, and what waits."""
        if not (self.ordered and self.outbox):
            return ""
        held = (self.held_bytes + self.outbox_bytes) / 2**20
        return (
            f" | results wait for a subscriber behind: {held:.1f} of {self.bound / 2**20:.1f} MiB held"
            + "; ingest paused" * (self._holding_since is not None)
            + "; slaves' results held back" * self.holding
        )

    def _batch_done(self, batch: tuple[int, int]) -> None:
        """Ordered: every result of `batch` came: its results per tuple join the estimate."""
        tuples = self._batch_tuples.pop(batch, 0)
        nbytes = self._batch_bytes.pop(batch, 0)
        self.tuples_done += tuples
        if tuples:
            self._recent.append(nbytes / tuples)

    def per_tuple(self) -> float:
        """Ordered: result bytes a tuple may bring: HEADROOM times the run's mean, or a latest batch's if more."""
        return HEADROOM * max(self.result_bytes / max(1, self.tuples_done), *self._recent, 0.0)

    def ingest_room(self, buffered: int) -> int | None:
        """Ordered mode: how many more tuples ingest may take now (None: no limit of ours).  The results per
        tuple (`per_tuple`), times the tuples whose results are still to come (`buffered` at the master and in
        batches out) and the new ones, must fit in the bound beside the results held and waiting; at 0 ingest
        pauses until punctuation or the subscribers free room.  Before any batch's results came, FIRST_TUPLES
        are let in to learn from.  If nothing is on its way, the held results wait for input that moves the
        punctuation on: then one bound's worth of input is let in."""
        room = None
        pending = buffered + self.tuples_sent - self.tuples_done
        if self.ordered and not self.tuples_done:
            room = max(0, FIRST_TUPLES - pending)
        elif self.ordered and self.results:
            per_tuple = self.per_tuple()
            room = max(0, int((self.bound - self.held_bytes - self.outbox_bytes) / per_tuple) - pending)
            if not room and not (pending or self.outbox):
                room = max(1, int(self.bound / per_tuple))
        now = time.monotonic()
        if room == 0 and self._holding_since is None:
            self._holding_since = now
        elif room != 0 and self._holding_since is not None:
            self.held_back += now - self._holding_since
            self._holding_since = None
        return room

    def _add(self, rows) -> int:
        """A slave's results: records, or a TABLE's pa.Table (None: a TABLE of no rows); returns their bytes."""
        if rows is None or not len(rows):
            return 0
        self.results += len(rows)
        self.result_bytes += rows.nbytes
        if self.ordered:
            self.held.append(rows)
            self.held_rows += len(rows)
            self.held_bytes += rows.nbytes
            self.held_peak = max(self.held_peak, self.held_rows)
            self.held_peak_bytes = max(self.held_peak_bytes, self.held_bytes + self.outbox_bytes)
        else:
            self._publish_results(rows)
        return rows.nbytes

    def _publish_results(self, rows) -> None:
        if isinstance(rows, np.ndarray):
            encode, cuts = wire.encode_results, np.r_[0 : len(rows) : frame_rows(rows.dtype), len(rows)]
        else:
            encode, cuts = wire.encode_table, table_cuts(rows)
        for start, stop in zip(cuts[:-1], cuts[1:]):
            self._publish(encode(rows[start:stop], sender=self.index, seq=self.seq))

    def _punctuate(self, p: int) -> None:
        """Publish punctuation `p` (microseconds) as subscribers read it, in seconds like the results' ts: the
        conversion keeps order, so a result whose stream time in seconds is below P's is below P."""
        p = eventtime.bound_seconds(p)
        if self.ordered:
            out = wire.take_due(self.held, p)
            self.held_rows = sum(len(h) for h in self.held)
            self.held_bytes = sum(h.nbytes for h in self.held)
            self._publish_results(out)
        self._publish(wire.encode_punct(p, sender=self.index, seq=self.seq))
        self.punctuations += 1

    def _publish(self, frames: list) -> None:
        """Unordered: send now, dropped for full subscribers; ordered: through the outbox (`_flush`)."""
        self.seq += 1
        if not self.ordered:
            if not self._send(frames):
                self._drop(frames, "subscriber_full")
            return
        size = sum(len(f) for f in frames)
        self.outbox.append((frames, size))
        self.outbox_bytes += size
        self.held_peak_bytes = max(self.held_peak_bytes, self.held_bytes + self.outbox_bytes)
        self._flush()

    def _send(self, frames: list) -> bool:
        """Every subscriber had room (XPUB_NODROP: a full one makes the whole send EAGAIN, nothing sent)."""
        import zmq

        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def _drop(self, frames: list, reason: str) -> None:
        """Send lossy: to the subscribers with room; a full one misses it and what follows until it has read
        half its queue (ZeroMQ skips it meanwhile): one gap in its `seq`."""
        if not self.gaps:
            print(
                f"results: a subscriber of {self.endpoint} is {self.bound:,} bytes behind: it misses messages "
                "until it has read half of them (it sees the gap in seq; gaps counted in the summary)",
                file=sys.stderr,
                flush=True,
            )
        import zmq

        self.sock.setsockopt(zmq.XPUB_NODROP, 0)
        self.sock.send_multipart(frames)
        self.sock.setsockopt(zmq.XPUB_NODROP, 1)
        self.gaps[reason] += 1

    def _flush(self) -> None:
        """Ordered: send what waits in the outbox while every subscriber has room; a subscriber full for
        `output.subscriber_timeout` seconds is given up on until every subscriber has room again."""
        while self.outbox:
            frames, size = self.outbox[0]
            if self._send(frames):
                self._waiting_since, self._given_up = None, False
            elif self._given_up:
                self._drop(frames, "subscriber_timeout")
            else:
                now = time.monotonic()
                self._waiting_since = self._waiting_since or now
                if now - self._waiting_since < self.timeout:
                    return
                self._given_up = True
                self._drop(frames, "subscriber_timeout")
            self.outbox.popleft()
            self.outbox_bytes -= size

    def close(self) -> None:
        """After the STOPs (`stopped`): wait for every slave's last results, punctuate with +inf, send END."""
        if not self.enabled:
            return
        empty = np.zeros(len(self.punctuator.drain_floor), dtype=np.int64)
        while self.punctuator.outstanding:
            if not self.pump(eventtime.POS_INF, empty):
                time.sleep(1e-3)
        if self.punctuator.end() is not None:
            self._punctuate(eventtime.POS_INF)
        self._publish(wire.encode_end(sender=self.index, seq=self.seq))
        while self.outbox:  # ordered: within subscriber_timeout, or lossy
            self._flush()
            time.sleep(1e-3)
        self.ingest_room(0)  # ends a pause still counted
        from common.zmq_security import stop_authenticators

        self.sock.close()
        stop_authenticators()
        self.ctx.term()  # waits for delivery, at most the socket's linger

    def summary(self, others: list[dict] = ()) -> dict:
        """This stream's counters, with those of the other dispatchers' streams (their `summary()`) added."""
        if not self.enabled:
            return {}
        mine = {
            "endpoints": [self.endpoint],
            "ordered": self.ordered,
            "results": self.results,
            "punctuations": self.punctuations,
            "messages": self.seq,
            "subscriber_buffer_bytes": self.bound,
            "gaps": sum(self.gaps.values()),
            "gaps_by_reason": dict(self.gaps),
            "held_peak_results": self.held_peak,
            "held_peak_bytes": self.held_peak_bytes,
            "ingest_held_seconds": round(self.held_back, 3),
            "slaves_held_back": self.held_back_messages,
        }
        for theirs in others:
            theirs = theirs["result_stream"]
            mine["endpoints"] += theirs["endpoints"]
            for key in ("results", "punctuations", "messages", "gaps", "ingest_held_seconds", "slaves_held_back"):
                mine[key] += theirs[key]
            for key in ("held_peak_results", "held_peak_bytes"):
                mine[key] = max(mine[key], theirs[key])
            mine["gaps_by_reason"] = dict(Counter(mine["gaps_by_reason"]) + Counter(theirs["gaps_by_reason"]))
        return {"result_stream": mine}
