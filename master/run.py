"""The master's loop (paper 003, Algorithm 1): the desks wired around one loop that routes and keeps time.

The desks (master/state/) hold the concerns: ingest, distribution per
sub-group slot (section V-B), moves (IV-C), hot keys (Streaming HyperCube) and
the checkpoint cut; they ask for messages, orders, lines and checkpoint files
as effects (master/state/channels.py), which the loop carries out after each
step, the links object (master/links.py) being the MPI edge.  The
loop routes slave reports by their ack and other dispatchers' orders by their
kind (BiStream 3.2.3) to the desks' handlers, and runs the timers: sub-group
slots, reorganization epochs, progress lines, checkpoints.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import signal
import time
from pathlib import Path

from mpi4py import MPI

from master.lifecycle import Lifecycle, say_started
from master.intake_shell import IntakeShell
from master.links import Links
from master.metrics import Metrics
from master.result_stream import ResultStream
from master.routing import Routing
from master.state import may_serve
from master.state.buffers import MiniBuffers
from master.state.channels import Channels
from master.state.checkpoints import CheckpointDesk
from master.state.controller import Controller
from master.state.distribution import DistributionDesk
from master.state.hot_key_router import FrequentKeys, HotKeyRouter
from master.state.hot_keys import HotKeyDesk
from master.state.intake import IngestDesk
from master.state.moves import MovesDesk
from master.state.payload import PayloadDesk
from master.state.stall import StallWatch
from master.state.stats import RunStats
from protocol import eventtime, faults
from protocol.orders import Order
from protocol.startup import pss_bytes

if TYPE_CHECKING:
    from protocol.plan import Plan


class Master(Routing, Lifecycle):
    def __init__(self, comm: MPI.Comm, plan: Plan, source, resume: tuple[Path, dict] | None = None, sink=None):
        """`sink`: rank 0's Kafka result sink (master.sink), started."""
        self.comm, self.plan, self.source, self.sink = comm, plan, source, sink
        #: with k dispatchers (BiStream 3.2.3) ranks 0..k-1 each run this loop on their share of the input;
        #: rank 0 decides moves and checkpoints and writes the summary
        self.k, self.index = plan.cluster.dispatchers, comm.rank
        self.slaves = slaves = list(range(self.k, comm.size))
        parts, hot = plan.partitioning.partitions, plan.hotkeys
        router = HotKeyRouter(parts, hot.max_keys, hot.grid, plan.join.type) if hot.enabled else None
        sketch = FrequentKeys(hot.sketch)
        if router is not None:
            parts = router.total_partitions
        self.controller = controller = Controller(
            plan.balance, slaves, parts, share=self.k, live=router.partitions if router else None
        )
        self.buffers = buffers = MiniBuffers(parts, plan.dtype)
        self.stats = stats = RunStats(slaves, time.time())
        self.channels = channels = Channels(slaves, buffers.dtype)
        self.links = Links(comm, self.index, self.k, channels)
        groups = min(plan.partitioning.subgroups, len(slaves))
        self.ingest = IngestDesk(
            plan, buffers, stats, channels, self.index, self.k, groups, router, sketch, source.own_rows
        )
        self.intake = IntakeShell(plan, source, self.index, self.k)
        self.results_out = ResultStream(comm, plan, parts, self.index)
        self.metrics = Metrics(comm, plan, self.index)
        self.distribution = DistributionDesk(
            plan, slaves, buffers, controller, stats, channels, self.results_out.sent, self.ingest.spans
        )
        self.moves = MovesDesk(self.k, controller, stats, channels)
        self.hot = (
            HotKeyDesk(plan, router, sketch, buffers, controller, stats, channels, self.results_out.rerouted, self.k)
            if router
            else None
        )
        self.checkpoints = CheckpointDesk(plan, self.index, self.k, slaves, buffers, controller, stats, channels)
        self.checkpoints.on_commit = self._committed
        log = source.log  # declared streams: their rows' own columns (protocol.payload)
        self.payload = PayloadDesk(plan, self.index, slaves) if log is not None else None
        self.stall = StallWatch(plan, buffers, controller, channels, coordinator=self.index == 0)
        self.done_from: set[int] = set()  #: rank 0: dispatchers that said DONE
        self.done_sent = self.finished = False
        self._stop_requested = False
        self._routes()
        if resume is not None:
            self._resume(*resume)
        self.results_out.may_hold(controller.partition_map >= 0)  # a recovered run's groups hold rows already

    # -- the loop -----------------------------------------------------------------------------------------
    def run(self) -> dict:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._request_stop)
        ingest, distribution, checkpoints = self.ingest, self.distribution, self.checkpoints
        slot = self.plan.epochs.distribution / len(distribution.subgroups)
        progress = self.plan.output.progress
        self.read_ahead()
        self.stats.hosts = self.links.wait_all_started(self.plan)
        if self.index == 0:  # the launcher reads this line: from here on every rank runs (deploy.job)
            say_started(self.stats.hosts, self.k, self.plan)
        self.stats.started = time.time()
        # with the others' libraries loaded, so shared pages count once each (its first batch in it, if read)
        self.stats.pss_start = pss_bytes()
        t0 = checkpoints.t0 = self.controller.t0 = ingest.start(self.stats.started)
        if self.hot is not None:
            self.hot.t0 = t0
        next_slot, next_progress = t0 + slot, t0 + progress
        reorganization = self.plan.epochs.reorganization
        next_reorganization = t0 + reorganization
        while True:
            now = time.time()
            if self._stop_requested:
                ingest.exhausted = True
            # an ordered result stream takes no more input than its byte bound has room for the results of
            room = self.results_out.ingest_room(len(self.buffers))
            worked = self.intake.pull(ingest, now, now >= next_slot, room) + self._route_reports()
            if self.stats.first_tuple is None and self.stats.ingested:
                self.stats.first_tuple = now
            worked += self.results_out.pump(
                eventtime.POS_INF if ingest.exhausted else ingest.frontier(), self.buffers.counts
            )
            if now >= next_slot:
                distribution.empty_batches = self.source.holding
                if distribution.slot(ingest.batch_watermark(), now, serve=not checkpoints.pending):
                    checkpoints.on_epoch(distribution.epochs_done, ingest.exhausted)
                if self.payload is not None:
                    self._payload()
                next_slot = max(next_slot + slot, now)
                worked += 1
            fencing = self.hot is not None and self.hot.fencing  # a hot key's split or merge across dispatchers
            if checkpoints.may_begin(quiet=not self.channels.busy and not self.controller.in_flight and not fencing):
                checkpoints.begin(self._sections(), distribution.epochs_done, now, self.intake.records())
                if self.stats.ingested:  # crash tests count the checkpoints that hold input (protocol.faults)
                    faults.reached(self.index, "checkpoint")
            if self.k > 1:
                if self.index == 0 and (bounds := ingest.ranges_to_share()) is not None:
                    self.channels.tell(range(1, self.k), Order.RANGES, bounds=bounds)
                self._route_orders()
            if now >= next_reorganization and self.index == 0:
                if not ingest.exhausted and not checkpoints.pending:
                    self.controller.reorganize(now)
                    if self.hot is not None:
                        self.hot.find()
                next_reorganization = now + reorganization
            elif now >= next_reorganization:  # another dispatcher's keys count in rank 0's decision
                if self.hot is not None and not ingest.exhausted:  # so no SKETCH comes after its DONE
                    self.hot.send_sketch()
                next_reorganization = now + reorganization
            if checkpoints.open is None:  # no order crosses an open cut (master/state/checkpoints.py)
                if self.hot is not None:
                    if not checkpoints.pending:
                        self.hot.split(now)
                        self.hot.merge(now)
                    self.hot.fenced(distribution.sent_watermark.get, now)
                    fencing = self.hot.fencing
                hold = not checkpoints.pending and not fencing
                for move in self.moves.start(distribution.sent_watermark.get, now, hold=hold):
                    distribution.handed_over(move.supplier)
                    if self.payload is not None:
                        self.payload.on_move(move.partition, distribution.sent_watermark[move.supplier])
            rule = may_serve(checkpoints.pending, self.moves.waits_for(), self.hot is not None and self.hot.waiting)
            if rule is not None:
                distribution.serve_missed(rule, ingest.batch_watermark(), now)
            if progress and now >= next_progress:
                self._progress()
                next_progress = now + progress
            self.metrics.tick(self, now)
            ended = self._may_end()
            self._perform()
            if ended:
                break
            self._watch(now)
            if not worked:
                time.sleep(min(2e-3, max(0.0, next_slot - time.time())))
        return self._end()
