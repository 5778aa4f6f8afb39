"""The punctuated result stream (`output.zmq_endpoint`): the master's collector and PUB socket.

Every slave sends, per batch, MPI messages (TAG_RESULTS) with that batch's
results as protocol.wire RESULTS frames, one per chunk (slave.join.Chunk); the
last (even an empty one) says the batch is done.  The master loop calls `pump`,
which publishes them and, when protocol.punctuation allows a higher bound P, a
PUNCT message.  With
`output.ordered` results are held and released sorted by the later tuple's ts
up to each P (SplitJoin's punctuated, ordered output with one punctuation per
released run: the relaxed adjustable punctuation with the epoch as its interval).

The socket is XPUB: a slow or absent subscriber never slows the join (messages
beyond SNDHWM are dropped for that subscriber, which sees the gap in `seq`);
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

import sys
import time

import numpy as np
import zmq
from mpi4py import MPI

from protocol import eventtime, wire
from protocol.config import dispatcher_endpoint
from protocol.messages import TAG_RESULTS
from protocol.punctuation import Punctuator
from protocol.zmq_security import bind_server, stop_authenticators

#: messages queued per subscriber before PUB drops
SNDHWM = 10000
#: seconds between two punctuation checks when no result message came in
CHECK_INTERVAL = 0.05


class ResultStream:
    def __init__(self, comm: MPI.Comm, cfg: dict, partitions: int, index: int = 0):
        out = cfg["output"]
        self.comm, self.ordered, self.index = comm, out["ordered"], index
        self.endpoint = dispatcher_endpoint(out["zmq_endpoint"], index) if out["zmq_endpoint"] else ""
        self.enabled = bool(self.endpoint)
        self.punctuator = Punctuator(partitions)
        self.seq = self.results = self.punctuations = 0
        self.held: list[np.ndarray] = []  #: ordered mode: results not yet covered by a punctuation
        self.held_peak = 0
        self._next_check = 0.0
        if not self.enabled:
            return
        # its own context: `close` terminates it, which returns only when ZeroMQ no longer reads the results'
        # buffers (they are sent without a copy); at interpreter exit they were freed under its I/O thread
        # ("Bad address (src/tcp.cpp:227)", SIGABRT: a finished run exited 134 and a supervisor restarted it)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.XPUB)
        self.sock.sndhwm, self.sock.linger = SNDHWM, 2000
        try:
            bind_server(self.sock, self.endpoint, cfg["security"])
        except zmq.ZMQError as e:
            raise OSError(f"cannot bind output.zmq_endpoint {self.endpoint!r}: {e}") from None
        self.endpoint = self.sock.last_endpoint.decode()
        self._wait_subscribers(out["wait_subscribers"])

    def _wait_subscribers(self, n: int) -> None:
        if n:
            print(f"results: waiting for {n} subscriber(s) on {self.endpoint}", file=sys.stderr, flush=True)
        seen = 0
        while seen < n:
            if self.sock.recv()[:1] == b"\x01":  # XPUB: a subscription arrived
                seen += 1

    def sent(self, rank: int, seq: int, partitions: np.ndarray, r: np.ndarray, s: np.ndarray,
             floor_now: int) -> None:
        """The master sent `rank` its batch `seq` (R rows `r`, S rows `s`) draining `partitions`; event time
        in microseconds (protocol.eventtime) here and in `pump`."""
        if self.enabled:
            min_ts = min(int(r["ts"].min()) if len(r) else eventtime.POS_INF,
                         int(s["ts"].min()) if len(s) else eventtime.POS_INF)
            self.punctuator.sent(rank, seq, partitions, min_ts, floor_now)

    def rerouted(self, sources, targets) -> None:
        """Buffered tuples moved between partitions at the master (protocol.punctuation.Punctuator.rerouted)."""
        if self.enabled:
            self.punctuator.rerouted(sources, targets)

    def pump(self, future_floor: int, buffered: np.ndarray) -> int:
        """Publish what the slaves sent and a punctuation if P rose; returns the result messages taken."""
        if not self.enabled:
            return 0
        got = 0
        status = MPI.Status()
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_RESULTS, status=status):
            buf = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
            self.comm.Recv([buf, MPI.BYTE], source=status.Get_source(), tag=TAG_RESULTS)
            msg = wire.decode(wire.unpack(buf), (wire.Kind.RESULTS,), sys.maxsize)
            if isinstance(msg, wire.Rejection):  # our own slaves wrote it: a bug, not a user mistake
                raise RuntimeError(f"result message from slave {status.Get_source()}: {msg.detail}")
            self._add(msg.rows)
            if msg.mark != wire.MORE:  # the batch's last chunk of results
                self.punctuator.done(msg.sender, msg.seq)
            got += 1
        now = time.monotonic()
        if got or now >= self._next_check:
            self._next_check = now + CHECK_INTERVAL
            p = self.punctuator.advance(future_floor, buffered)
            if p is not None:
                self._punctuate(p)
        return got

    def _add(self, rows: np.ndarray) -> None:
        if not len(rows):
            return
        self.results += len(rows)
        if self.ordered:
            self.held.append(rows)
            self.held_peak = max(self.held_peak, sum(len(h) for h in self.held))
        else:
            self._publish(wire.encode_results(rows, sender=self.index, seq=self.seq))

    def _punctuate(self, p: int) -> None:
        """Publish punctuation `p` (microseconds) as subscribers read it, in seconds like the results' ts: the
        conversion keeps order, so a result whose later ts in seconds is below P's is below P."""
        p = eventtime.bound_seconds(p)
        if self.ordered:
            out = wire.take_due(self.held, p)
            if len(out):
                self._publish(wire.encode_results(out, sender=self.index, seq=self.seq))
        self._publish(wire.encode_mark(wire.Kind.PUNCT, p, sender=self.index, seq=self.seq))
        self.punctuations += 1

    def _publish(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames, copy=False)  # XPUB never blocks: past SNDHWM a subscriber's are dropped
        self.seq += 1

    def close(self) -> None:
        """After the last batch: wait for every slave's last results, punctuate with +inf, send END."""
        if not self.enabled:
            return
        empty = np.zeros(len(self.punctuator.drain_floor), dtype=np.int64)
        while self.punctuator.outstanding:
            if not self.pump(eventtime.POS_INF, empty):
                time.sleep(1e-3)
        if self.punctuator.advance(eventtime.POS_INF, empty) is not None:
            self._punctuate(eventtime.POS_INF)
        self._publish(wire.encode_mark(wire.Kind.END, 0.0, sender=self.index, seq=self.seq))
        self.sock.close()
        stop_authenticators()
        self.ctx.term()  # waits for delivery, at most the socket's linger

    def summary(self, others: list[dict] = ()) -> dict:
        """This stream's counters, with those of the other dispatchers' streams (their `summary()`) added."""
        if not self.enabled:
            return {}
        mine = {"endpoints": [self.endpoint], "ordered": self.ordered, "results": self.results,
                "punctuations": self.punctuations, "messages": self.seq, "held_peak_results": self.held_peak}
        for theirs in others:
            theirs = theirs["result_stream"]
            mine["endpoints"] += theirs["endpoints"]
            for key in ("results", "punctuations", "messages"):
                mine[key] += theirs[key]
            mine["held_peak_results"] = max(mine["held_peak_results"], theirs["held_peak_results"])
        return {"result_stream": mine}
