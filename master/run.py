"""The master's loop (paper 003, Algorithm 1): the desks wired around one loop that routes and keeps time.

The desks (master/desks/) hold the concerns: ingest, distribution per
sub-group slot (section V-B), moves (IV-C), hot keys (Streaming HyperCube) and
the checkpoint cut; the links object (master/links.py) is the MPI edge.  The
loop routes slave reports by their ack and other dispatchers' orders by their
kind (BiStream 3.2.3) to the desks' handlers, and runs the timers: sub-group
slots, reorganization epochs, progress lines, checkpoints.
"""
from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from mpi4py import MPI

from master.buffers import MiniBuffers
from master.controller import Controller
from master.coordination import CHECKPOINT, COMMITTED, DONE, FINISH, HOLD, PAYLOAD, RANGES, READY, RELEASE, \
    SNAPSHOT
from master.desks import may_serve
from master.desks.checkpoints import CheckpointDesk, section
from master.desks.distribution import DistributionDesk
from master.desks.hotkeys import HotKeyDesk
from master.desks.ingest import IngestDesk
from master.desks.moves import MovesDesk
from master.desks.payload import PayloadDesk, payload_cuts
from master.desks.stall import StallWatch
from master.hotkeys import FrequentKeys, HotKeyRouter
from master.links import Links
from master.metrics import Metrics
from master.result_stream import ResultStream
from master.stats import RunStats, print_summary, ranks_by_host, spans, write_summary
from protocol import eventtime
from protocol.liveness import heartbeat_timeout
from protocol.messages import Ack
from protocol.payload import remove_log
from protocol.startup import launched_at, pss_bytes, restarts
from protocol.streams import live_endpoints
from protocol.tuples import tuple_dtype


def say_started(hosts: list[str], k: int, cfg: dict) -> None:
    by_host = ranks_by_host(hosts)
    print(f"started: {'1 master' if k == 1 else f'{k} dispatchers'} + {len(hosts) - k} slaves on {len(by_host)} "
          f"host{'s' * (len(by_host) > 1)} (" + "; ".join(f"{h}: {spans(r)}" for h, r in by_host.items())
          + f"); heartbeat_timeout {heartbeat_timeout(cfg['cluster'], cfg['epochs']['distribution']):g}s",
          file=sys.stderr, flush=True)


class Master:
    def __init__(self, comm: MPI.Comm, cfg: dict, source, resume: tuple[Path, dict] | None = None):
        self.comm, self.cfg, self.source = comm, cfg, source
        #: with k dispatchers (BiStream 3.2.3) ranks 0..k-1 each run this loop on their share of the input;
        #: rank 0 decides moves and checkpoints and writes the summary
        self.k, self.index = cfg["cluster"]["dispatchers"], comm.rank
        self.slaves = slaves = list(range(self.k, comm.size))
        parts, hot = cfg["partitioning"]["partitions"], cfg["hotkeys"]
        router = HotKeyRouter(parts, hot["max_keys"], hot["grid"], cfg["join"]["type"]) \
            if hot["enabled"] else None
        sketch = FrequentKeys(hot["sketch"])
        if router is not None:
            parts = router.total_partitions
        self.controller = controller = Controller(cfg, slaves, parts, share=self.k,
                                                  live=router.partitions if router else None)
        self.buffers = buffers = MiniBuffers(parts, tuple_dtype(cfg["generator"]["tuple_bytes"]))
        self.stats = stats = RunStats(slaves)
        self.links = links = Links(comm, self.index, self.k, slaves, buffers.dtype)
        groups = min(cfg["partitioning"]["subgroups"], len(slaves))
        self.ingest = IngestDesk(cfg, source, buffers, stats, self.index, self.k, groups, router, sketch)
        self.results_out = ResultStream(comm, cfg, parts, self.index)
        self.metrics = Metrics(comm, cfg, self.index)
        self.distribution = DistributionDesk(cfg, slaves, buffers, controller, stats, links, self.results_out,
                                             self.ingest.spans)
        self.moves = MovesDesk(self.k, controller, stats, links)
        self.hot = HotKeyDesk(cfg, router, sketch, buffers, controller, stats, links,
                              self.results_out.rerouted) if router else None
        self.checkpoints = CheckpointDesk(cfg, self.index, self.k, slaves, buffers, controller, stats, links)
        self.checkpoints.on_commit = self._committed
        log = getattr(source, "log", None)  # declared streams: their rows' own columns (protocol.payload)
        self.payload = PayloadDesk(cfg, self.index, slaves, log) if log is not None else None
        self.stall = StallWatch(cfg, buffers, controller, links, coordinator=self.index == 0)
        self.done_from: set[int] = set()  #: rank 0: dispatchers that said DONE
        self.done_sent = self.finished = False
        self._stop_requested = False
        #: what each report answers -> its handlers; any other ack answers a batch or an order of ours
        self.on_ack = {Ack.INSTALLED: (self._installed,), Ack.CHECKPOINTED: (self.checkpoints.on_checkpointed,
                                                                              self._answered)}
        self.on_order = {HOLD: self._hold, READY: self.moves.on_ready, RELEASE: self._release,
                         CHECKPOINT: self.checkpoints.on_order, SNAPSHOT: self.checkpoints.on_snapshot,
                         DONE: lambda source, _: self.done_from.add(source), FINISH: self._finish,
                         RANGES: lambda source, order: self.ingest.use_ranges(order["bounds"]),
                         COMMITTED: lambda source, order: self.checkpoints.on_commit(order),
                         PAYLOAD: lambda source, order: self.payload.on_report(source, order["watermark"],
                                                                               order["taken"])}
        if resume is not None:
            self._resume(*resume)
        self.results_out.may_hold(controller.partition_map >= 0)  # a recovered run's groups hold rows already

    def _resume(self, directory: Path, manifest: dict) -> None:
        """Start where the checkpoint left off: source position, mini-buffers, counters, partition map."""
        m = section(manifest, self.index)
        self.ingest.restore(m)
        self.distribution.restore(m)
        self.links.restore(m["seq"])
        if m["hot_keys"] is not None:
            self.hot.restore(m["hot_keys"])
        self.checkpoints.restore(directory, manifest, self.distribution.epochs_done)
        if self.payload is not None:
            self.payload.restore(payload_cuts(self.cfg))

    # -- routing ----------------------------------------------------------------------------------------
    def _route_reports(self) -> int:
        """Every waiting slave report to its ack's handlers (`on_ack`); returns how many came."""
        for rank, results, seconds in self.links.joining():
            self.stall.joining += 1
            self.stats.joining[rank] = (results, seconds)
        reports = self.links.reports()
        for rank, counters, hist in reports:
            self.stats.add_report(rank, counters, hist)
            self.stall.on_report(counters["busy"])
            for handle in self.on_ack.get(Ack(int(counters["ack"])), (self._answered,)):
                handle(rank, counters)
        return len(reports)

    def _answered(self, rank: int, counters: dict) -> None:
        self.controller.on_work(rank, int(counters["tuples_r"] + counters["tuples_s"]), counters["busy"])
        self.moves.on_answer(rank)
        if self.payload is not None:
            self.payload.on_answer(rank, self.distribution.sent_watermark[rank])

    def _installed(self, rank: int, counters: dict) -> None:
        """Not an answer to a message of ours: the consumer's news; the group's held tuples go out at once."""
        consumer = self.moves.on_installed(counters, time.time())
        self.distribution.owe(consumer)
        if self.payload is not None:
            self.payload.on_installed(int(counters["partition"]), consumer)

    def _committed(self, section: dict) -> None:
        """A checkpoint is complete: producers learn what it made durable, the payload log what it must keep."""
        self.ingest.committed(section)
        if self.payload is not None and self.index == 0:
            self.payload.on_commit(section["payload_cut"])

    def _route_orders(self) -> None:
        """Every order from another dispatcher to its kind's handler (`on_order`), then READY where due."""
        for source, order in self.links.arrived():
            self.stall.orders += 1
            self.on_order[order["order"]](source, order)
        self.moves.send_ready()

    def _hold(self, source: int, order: dict) -> None:
        move = order["move"]
        self.moves.on_hold(order, self.distribution.sent_watermark[move.supplier])
        if self.payload is not None:
            self.payload.on_move(move.partition, self.distribution.sent_watermark[move.supplier])

    def _release(self, source: int, order: dict) -> None:
        consumer = self.moves.on_release(order, time.time())
        self.distribution.owe(consumer)
        if self.payload is not None:
            self.payload.on_installed(order["partition"], consumer)

    def _payload(self) -> None:
        """Rank 0 removes the payload log's segments no result can still need; another dispatcher tells it how
        far its own batches are done with (master.desks.payload)."""
        holders = self.controller.holders()
        if self.index == 0:
            self.payload.release(self.source.rows_taken, holders)
        elif (report := self.payload.report(self.source.rows_taken, holders)) is not None:
            self.links.tell([0], PAYLOAD, **report)

    def _finish(self, source: int, order: dict) -> None:
        self.finished = True

    # -- the loop -----------------------------------------------------------------------------------------
    def _request_stop(self, signum, frame) -> None:
        if self._stop_requested:  # second signal: give up at once
            raise KeyboardInterrupt
        self._stop_requested = True
        self.stats.stopped_by_signal = True
        print("stopping: no more input; joining what was accepted, flushing results ...", file=sys.stderr, flush=True)

    def read_ahead(self) -> None:
        """Take the first batch of unpaced input while the other ranks start: rank 0 before it lets
        them import their kernels (until then it has the cores to itself), every other dispatcher before it
        waits for them; a file source's reader thread reads on meanwhile.  The run's clock still starts when
        the cluster can join, so rates count at most one batch read before it.  Paced input and live sources
        start when the cluster can join: a paced replay's delays measure the join, not the start-up."""
        if self.stats.launched is not None:
            return
        self.stats.launched = launched_at()
        if self.ingest.rate > 0 or live_endpoints(self.cfg):
            return
        now = time.time()
        self.ingest.start(now)
        self.ingest.ingest(now, cap=self.results_out.ingest_room(len(self.buffers)))
        if self.stats.ingested:
            self.stats.first_tuple = now

    def run(self) -> dict:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._request_stop)
        ingest, distribution, checkpoints = self.ingest, self.distribution, self.checkpoints
        slot = self.cfg["epochs"]["distribution"] / len(distribution.subgroups)
        progress = self.cfg["output"]["progress"]
        self.read_ahead()
        self.stats.hosts = self.links.wait_all_started(self.cfg)
        if self.index == 0:  # the launcher reads this line: from here on every rank runs (deploy.job)
            say_started(self.stats.hosts, self.k, self.cfg)
        self.stats.started = time.time()
        # with the others' libraries loaded, so shared pages count once each (its first batch in it, if read)
        self.stats.pss_start = pss_bytes()
        t0 = checkpoints.t0 = ingest.start(self.stats.started)
        if self.hot is not None:
            self.hot.t0 = t0
        next_slot, next_progress = t0 + slot, t0 + progress
        reorganization = self.cfg["epochs"]["reorganization"]
        next_reorganization = t0 + reorganization
        while True:
            now = time.time()
            if self._stop_requested:
                ingest.exhausted = True
            # an ordered result stream takes no more input than its byte bound has room for the results of
            room = self.results_out.ingest_room(len(self.buffers))
            worked = ingest.ingest(now, now >= next_slot, room) + self._route_reports()
            if self.stats.first_tuple is None and self.stats.ingested:
                self.stats.first_tuple = now
            worked += self.results_out.pump(eventtime.POS_INF if ingest.exhausted else ingest.frontier(),
                                            self.buffers.counts)
            if now >= next_slot:
                if distribution.slot(ingest.frontier(), serve=not checkpoints.pending):
                    checkpoints.on_epoch(distribution.epochs_done, ingest.exhausted)
                if self.payload is not None:
                    self._payload()
                next_slot = max(next_slot + slot, now)
                worked += 1
            if checkpoints.may_begin(quiet=not self.links.busy and not self.controller.in_flight):
                ingest.flush()
                checkpoints.begin({**ingest.state(), **distribution.state(), "seq": self.links.state(),
                                   "hot_keys": None if self.hot is None else self.hot.state(),
                                   "payload_cut": self.payload.cut(self.controller.holders())
                                   if self.payload is not None and self.index == 0 else None},
                                  distribution.epochs_done)
            if self.k > 1:
                if self.index == 0 and (bounds := ingest.ranges_to_share()) is not None:
                    self.links.tell(range(1, self.k), RANGES, bounds=bounds)
                self._route_orders()
            if now >= next_reorganization and self.index == 0:
                if not ingest.exhausted and not checkpoints.pending:
                    self.controller.reorganize(now)
                    if self.hot is not None:
                        self.hot.find()
                next_reorganization = now + reorganization
            if checkpoints.open is None:  # no order crosses an open cut (master/desks/checkpoints.py)
                if self.hot is not None and not checkpoints.pending:
                    self.hot.split()
                    self.hot.merge()
                for move in self.moves.start(distribution.sent_watermark.get, hold=not checkpoints.pending):
                    distribution.handed_over(move.supplier)
                    if self.payload is not None:
                        self.payload.on_move(move.partition, distribution.sent_watermark[move.supplier])
            rule = may_serve(checkpoints.pending, self.moves.waits_for(), self.hot is not None and self.hot.waiting)
            if rule is not None:
                distribution.serve_missed(rule, ingest.frontier())
            if progress and now >= next_progress:
                print(f"[dispatcher {self.index}] " * (self.k > 1) + self.stats.progress_line(
                    len(self.buffers), len(self.controller.active), len(self.controller.moves_log))
                    + ingest.idle_note(), file=sys.stderr, flush=True)
                next_progress = now + progress
            self.metrics.tick(self, now)
            if self._may_end():
                break
            self._watch(now)
            if not worked:
                time.sleep(min(2e-3, max(0.0, next_slot - time.time())))
        return self._end()

    def _watch(self, now: float) -> None:
        """End the job, naming what it waits for, when pending work has not moved for too long (desks.stall)."""
        self.stall.watch(now, self.ingest.consumed, {} if self.hot is None else self.hot.waiting_for(),
                         self.checkpoints.waiting_for(), self.moves.waiting_for())

    def _may_end(self) -> bool:
        """Input exhausted and joined, no move in flight; with several dispatchers, all of them (DONE, FINISH)."""
        if not (self.ingest.exhausted and len(self.buffers) == 0 and not self.links.busy
                and not self.controller.busy and not self.checkpoints.pending):
            return False
        if self.k == 1:
            return True
        if self.index > 0:
            if not self.done_sent:
                self.links.tell([0], DONE)
                self.done_sent = True
            return self.finished
        if len(self.done_from) < self.k - 1:
            return False
        self.links.tell(range(1, self.k), FINISH)
        return True

    def _end(self) -> dict:
        """STOP to every slave and their final reports; rank 0 writes the summary with the others' counters."""
        self.links.close()
        for rank, seq in self.links.stop().items():  # each answers on the result stream too (rows undecided)
            self.results_out.stopped(rank, seq, self.controller.partitions_of(rank))
        self.results_out.close()
        while self.links.busy:
            if not self._route_reports():
                time.sleep(1e-3)
        self.stats.last_result = time.time()  # the slaves' final reports: their results are written
        self.checkpoints.finish()
        self.ingest.flush()
        self.metrics.finish(self)
        lateness = self.ingest.stream_summary(time.time())
        if self.index > 0:
            self.links.send_summary({"stats": self.stats.state(), "results_out": self.results_out.summary(),
                                     "source": self.source.finish(), "lateness": lateness})
            return {}
        others = self.links.summaries(self.k)
        for other in others:
            self.stats.merge(other["stats"])
        c = self.controller
        summary = self.stats.summary(self.cfg)
        summary["balance"] = {"reorganizations": c.reorganizations, "moves": c.moves_log,
                              "active_changes": c.active_log, "active_at_end": sorted(c.active),
                              "occupancy": c.occupancy_log}
        summary["hot_keys"] = [] if self.hot is None else self.hot.log
        summary["checkpoints"] = {"written": self.checkpoints.written,
                                  "recovered_from": self.checkpoints.recovered_from, "log": self.checkpoints.log}
        summary["restarts"] = restarts()
        finished = [self.source.finish(), *(o["source"] for o in others)]
        summary.update(**(type(self.source).merge(finished) if self.k > 1 and finished[0] else finished[0]),
                       **self.results_out.summary([o["results_out"] for o in others if o["results_out"]]))
        if lateness:  # [streams]: each stream's max_delay, late tuples and idle periods
            summary["lateness"] = IngestDesk.merge_summaries([lateness, *(o["lateness"] for o in others)])
        remove_log(self.cfg["output"]["path"])  # every result is written: no row needs its columns any more
        write_summary(Path(self.cfg["output"]["path"]) / "summary.json", summary)
        print_summary(summary)
        self.metrics.close(self, summary)
        return summary
