"""The master's loop (paper 003, Algorithm 1): ingest, distribute per sub-group slot, collect reports.

Time is divided into distribution epochs; each epoch has one slot per
sub-group of slaves (section V-B).  At its slot a slave that has finished its
previous batch gets the drained mini-buffers of its partitions in one message;
a slave still busy keeps accumulating in the mini-buffers until its next slot,
which is the back-pressure that bounds the work in flight.  Ingest pauses while
the mini-buffers hold `master.buffer_capacity` tuples.

Every `checkpoint.interval` distribution epochs the master takes a checkpoint
(protocol.checkpoint): it holds back new batches and moves until none is in
flight, snapshots its mini-buffers, source position and counters, and orders
every slave to write its state; the manifest is written when all have answered.
"""
from __future__ import annotations

import shutil
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
from mpi4py import MPI

from master.archive import InputArchive
from master.buffers import MiniBuffers
from master.balance import Move
from master.controller import Controller
from master.coordination import CHECKPOINT, DONE, FINISH, HOLD, READY, RELEASE, SNAPSHOT, Orders
from master.hotkeys import FrequentKeys, HotKeyRouter
from master.ranges import KeyRanges
from master.ingest import late_mask, to_wire, to_wire_hashed
from master.source import skip
from master.result_stream import ResultStream
from master.stats import RunStats, print_summary, write_summary
from protocol import checkpoint, eventtime, faults
from protocol.arrays import whole_buffer
from protocol.predicates import key_distance
from protocol.mpi import wait_all_started
from protocol.messages import REPORT_BYTES, TAG_DATA, TAG_REPORT, TAG_SUMMARY, Ack, Kind, batch_message, decode_report, \
    encode_batch
from protocol.output import write_table
from protocol.tuples import STREAM_NAMES, STREAM_R, STREAM_S, tuple_dtype


def named(prefix: str, index: int, k: int) -> str:
    """The file prefix of dispatcher `index`'s own output (late tuples, archive): several write side by side."""
    return prefix if k == 1 else f"{prefix}-d{index}"


class Master:
    def __init__(self, comm: MPI.Comm, cfg: dict, source, resume: tuple[Path, dict] | None = None):
        self.comm, self.cfg, self.source = comm, cfg, source
        #: with k dispatchers (BiStream 3.2.3) ranks 0..k-1 each run this loop on their share of the input;
        #: rank 0 also writes the summary
        self.k, self.index = cfg["cluster"]["dispatchers"], comm.rank
        self.slaves = list(range(self.k, comm.size))
        self.rate = cfg["source"]["rate"] / self.k  #: this dispatcher's paced share
        parts = cfg["partitioning"]["partitions"]
        hot = cfg["hotkeys"]
        #: hot keys (equi-join): a sketch of frequent keys and the grids of the hot ones (None: off)
        self.router = HotKeyRouter(parts, hot["max_keys"], hot["grid"]) if hot["enabled"] else None
        self.sketch = FrequentKeys(hot["sketch"])
        self.pending_hot: dict[int, float] = {}  #: keys found hot, waiting for their partition's owner
        self.cooling: dict[int, float] = {}  #: hot keys found cold, their grid being gathered back
        self.hot_log: list[dict] = []
        if self.router is not None:
            parts = self.router.total_partitions
        groups = min(cfg["partitioning"]["subgroups"], len(self.slaves))
        self.controller = Controller(cfg, self.slaves, parts, share=self.k)
        #: several dispatchers: rank 0 decides moves, the others follow its orders (master.coordination)
        self.orders = Orders(comm) if self.k > 1 else None
        #: rank 0: held moves -> [move, dispatchers not yet READY, lowest watermark cap of the group's holders]
        self.unready: dict[int, list] = {}
        self.fences: dict[int, tuple[Move, set[int]]] = {}  #: others: held moves -> slaves with an earlier batch
        self.done_from: set[int] = set()  #: rank 0: dispatchers that said DONE
        self.done_sent = self.finished = False
        self.subgroups = [self.slaves[g::groups] for g in range(groups)]
        self.dtype = tuple_dtype(cfg["generator"]["tuple_bytes"])
        self.buffers = MiniBuffers(parts, self.dtype)
        self.stats = RunStats(self.slaves)
        self.busy: dict[int, tuple[MPI.Request, np.ndarray]] = {}  #: rank -> (send request, its buffer)
        self.spare: dict[int, np.ndarray] = {}  #: rank -> the buffer of its last batch, joined: reused
        self.epoch = {r: 0 for r in self.slaves}
        self.sent_watermark = {r: eventtime.NEG_INF for r in self.slaves}
        self.in_batch = dict.fromkeys(self.slaves, 0)  #: tuples of the batch each slave is joining
        #: slaves owed a batch before their next slot: they were still joining at their last one, or a group
        #: whose tuples the master held during its move was just installed on them
        self.missed: set[int] = set()
        self.max_ts = eventtime.NEG_INF  #: event time in integer microseconds, as every ts here (protocol.eventtime)
        join = cfg["join"]
        self.max_delay = eventtime.duration(join["max_delay"])
        #: band / inequality joins: key ranges, fixed from the first keys seen (None: hash partitions)
        self.ranges: KeyRanges | None = None
        self.range_partitioned = join["predicate"] != "equal"
        self.key_distance = key_distance(join["predicate"], join["band"])
        self.exhausted = False
        self._late_parts: list[pa.Table] = []
        self._late_files = 0
        self._stop_requested = False
        #: paced ingest tick: a tenth of a sub-group slot, at most 10 ms (bounds the delay it adds)
        self.ingest_interval = min(0.01, cfg["epochs"]["distribution"] / groups / 10)
        self._last_ingest = 0.0
        self.consumed = 0  #: tuples taken from the source: its position
        out = Path(cfg["output"]["path"])
        ck = cfg["checkpoint"]
        self.interval = ck["interval"]
        self.archive = InputArchive(out / "archive", cfg["output"]["flush_rows"], named("input", self.index, self.k)) \
            if self.interval and ck["archive"] else None
        self.epochs_done = 0  #: distribution epochs completed (every sub-group served once)
        self.next_checkpoint, self.checkpoint_due = 1, self.interval
        self.checkpoint_pending = False
        self.checkpoint_open: dict | None = None  #: the checkpoint whose slave parts are being written
        self.checkpoint_ordered = 0  #: another dispatcher: the checkpoint rank 0 ordered
        self.checkpoints_written = 0
        self.recovered_from = None
        if resume is not None:
            self._resume(*resume)
        self.results_out = ResultStream(comm, cfg, parts, self.index)

    # -- ingest ---------------------------------------------------------------------------------
    def _ingest(self, now: float, slot: bool = False) -> int:
        """Pull what has arrived (paced) or what fits (unpaced) from the source; returns tuples taken.
        At a `slot` paced input is taken whatever the tick, so what arrived until then goes out now."""
        src = self.cfg["source"]
        room = self.cfg["master"]["buffer_capacity"] - len(self.buffers)
        limit = min(src["batch"], room)
        behind = 0.0
        if self.rate > 0:
            due = int((now - self.t0) * self.rate) - self.consumed
            # paced input is taken in ticks, not tuple by tuple; but a whole batch due is taken at once, or the
            # tick would cap ingest at source.batch per tick (65,536 per 10 ms: 6.5M/s, whatever the cluster)
            if due < src["batch"] and now - self._last_ingest < self.ingest_interval and not slot:
                return 0
            # how far ingest is behind the pacing schedule (the due tuples this step cannot take): it grows only
            # when the cluster cannot keep up
            behind = (due - limit) / self.rate
            limit = min(limit, due)
        if self.exhausted:
            return 0  # the schedule goes on, but no tuple is due after the input's end: the drain is no lag
        if limit <= 0:
            self.stats.pacing_lag_max = max(self.stats.pacing_lag_max, behind)  # full mini-buffers hold ingest back
            return 0
        self._last_ingest = now
        chunk = self.source.next_chunk(limit)
        if chunk is None:
            self.exhausted = True
            return 0
        n = len(chunk.ts)
        if n == limit:  # a shorter chunk is all the source has: the due tuples past it do not exist
            self.stats.pacing_lag_max = max(self.stats.pacing_lag_max, behind)
        if self.archive is not None:
            self.archive.add(chunk)
        if self.rate > 0:  # nominal arrival of each tuple, so master-side queueing counts as delay
            arrival = self.t0 + (self.consumed + np.arange(n)) / self.rate
        else:
            arrival = np.full(n, now)
        self.consumed += n
        late, prev_max, self.max_ts = late_mask(chunk.ts, self.max_ts, self.max_delay)
        if late.any():
            self._set_aside_late(chunk, late, prev_max)
        self._route(chunk, arrival, late)
        self.stats.buffered_peak = max(self.stats.buffered_peak, len(self.buffers))
        return n

    def _route(self, chunk, arrival: np.ndarray, late: np.ndarray) -> None:
        """The on-time tuples of `chunk` into the mini-buffers of their partitions."""
        on_time = ~late
        if self.router is not None:
            self.sketch.update(chunk.key[on_time])
        if self.range_partitioned and self.ranges is None and on_time.any():
            self.ranges = KeyRanges.from_sample(chunk.key[on_time], self.buffers.partitions)
        if self.router is None and self.ranges is None:  # hash partitions: the rows built in their order
            for stream, (rows, sizes) in enumerate(to_wire_hashed(self.dtype, chunk.stream, chunk.id, chunk.ts,
                                                                  chunk.key, chunk.value, arrival, late,
                                                                  self.buffers.partitions)):
                self.stats.input[STREAM_NAMES[stream]] += len(rows)
                self.buffers.add_ordered(stream, rows, sizes)
            return
        for stream in (STREAM_R, STREAM_S):
            sel = np.flatnonzero(on_time & (chunk.stream == stream))
            self.stats.input[STREAM_NAMES[stream]] += len(sel)
            rows = to_wire(self.dtype, chunk.id, chunk.ts, chunk.key, chunk.value, arrival, sel)
            if self.router is not None:
                if stream == STREAM_S:
                    self.buffers.add(stream, rows, self.router.route_s(rows))
                else:
                    index, part = self.router.route_r(rows)
                    self.buffers.add(stream, rows[index], part)
            elif stream == STREAM_S:  # the home of its pairs
                self.buffers.add(stream, rows, self.ranges.home(rows["key"]))
            else:  # a copy to every range that may hold partners
                index, part = self.ranges.copies(rows["key"], *self.key_distance)
                self.buffers.add(stream, rows[index], part)

    def _set_aside_late(self, chunk, late: np.ndarray, prev_max: np.ndarray) -> None:
        md = self.cfg["join"]["max_delay"]
        self.stats.late += int(late.sum())
        bound = eventtime.to_seconds(prev_max[late] - self.max_delay)
        self._late_parts.append(pa.table({
            "stream": np.array(STREAM_NAMES)[chunk.stream[late]], "id": chunk.id[late],
            "ts": eventtime.to_seconds(chunk.ts[late]),
            "key": chunk.key[late], "value": chunk.value[late],
            "reason": pa.repeat(f"late: ts below max ts seen before minus join.max_delay ({md})", int(late.sum())),
            "bound": bound,
        }))
        if sum(t.num_rows for t in self._late_parts) >= self.cfg["output"]["flush_rows"]:
            self._flush_late()

    def _flush_late(self) -> None:
        if self._late_parts:
            stem = f"{named('late', self.index, self.k)}-{self._late_files:06d}"
            write_table(Path(self.cfg["output"]["path"]) / "late", stem,
                        pa.concat_tables(self._late_parts), self.cfg["output"]["format"])
            self._late_parts, self._late_files = [], self._late_files + 1

    # -- distribution -----------------------------------------------------------------------------
    def _distribute(self, group: list[int]) -> None:
        """Serve one sub-group: every idle slave in it gets its partitions' tuples in one message; a slave
        still joining its last batch is served as soon as it reports (`_serve_missed`)."""
        for rank in group:
            if rank in self.busy:  # still joining its last batch: all of it and what waits here is unjoined
                mine = self.controller.partitions_of(rank)
                self.controller.on_slot(rank, self.in_batch[rank] + int(self.buffers.counts[:, mine].sum()))
                self.stats.per_slave[rank]["slots_missed"] += 1
                self.missed.add(rank)
                continue
            self.controller.on_slot(rank, 0)
            self._serve(rank)

    def _serve_missed(self) -> None:
        """Send each slave that missed its slot its batch as soon as it is idle, instead of a whole
        distribution epoch later: its tuples have waited their epoch already, and the slave would sit idle
        until its next slot; likewise the consumer of a move, for the tuples held during it.  Not while a
        checkpoint waits for quiet, nor to a slave a queued move (or a hot key's split or merge) is waiting
        to find idle."""
        if self.checkpoint_pending:
            return
        waiting = {r for m in self.controller.queue for r in (m.supplier, m.consumer)}
        waiting.update(m.supplier for m, *_ in self.unready.values())  # its MOVE order waits for it to be idle
        if self.pending_hot or self.cooling:
            waiting.update(self.slaves)
        for rank in sorted(self.missed):
            if rank not in self.busy:
                self.missed.discard(rank)
                if rank not in waiting:
                    self._serve(rank)

    def _serve(self, rank: int) -> None:
        """Send the idle slave `rank` its partitions' buffered tuples in one message, if there is news."""
        watermark = min(self.max_ts - self.max_delay, self.controller.watermark_cap())
        mine = self.controller.partitions_of(rank)
        sizes = self.buffers.counts[:, mine].sum(axis=0)
        if len(mine) == 0 or (not sizes.any() and watermark <= self.sent_watermark[rank]):
            return  # nothing new: no tuples and no punctuation that would let the slave expire blocks
        self.sent_watermark[rank] = watermark
        self.controller.on_batch(mine, sizes)
        # which rows belong to which group: R copies (key ranges, hot-key grids) cannot be told apart otherwise,
        # and the slave need not hash and sort the batch again to find its groups
        counts = self.buffers.counts[:, mine]
        nonempty = counts.any(axis=0)
        groups = np.column_stack([mine[nonempty], counts[0, nonempty], counts[1, nonempty]])
        self.epoch[rank] += 1
        n_r, n_s = counts.sum(axis=1).tolist()
        # a tuple waits at most one epoch for its slave's slot; longer means the cluster is behind, even while
        # the mini-buffers still have room (ingest, and so the pacing lag, is held back only once they are full)
        waited = time.time() - self.buffers.oldest_arrival(mine) - self.cfg["epochs"]["distribution"]
        self.stats.backlog_max = max(self.stats.backlog_max, waited)
        buf, r, s = batch_message(Kind.BATCH, self.epoch[rank], watermark, n_r, n_s, self.dtype, groups=groups,
                                  spare=self.spare.pop(rank, None))
        self.buffers.drain(mine, out=(r, s))
        self.in_batch[rank] = n_r + n_s
        self.results_out.sent(rank, self.epoch[rank], mine, r, s, self.max_ts - self.max_delay)
        self._send(rank, buf)

    def _send(self, rank: int, buf: np.ndarray) -> None:
        """Isend a message; the slave counts as busy until its report for it arrives."""
        faults.jitter()
        if faults.fires(self.index, "drop"):  # a channel that loses a batch: the slave must notice
            self.epoch[rank] += 1
            return
        self.busy[rank] = (self.comm.Isend([buf, MPI.BYTE], dest=rank, tag=TAG_DATA), buf)

    def _start_moves(self) -> None:
        """Queued moves whose supplier and consumer are idle here are held, at every dispatcher (HOLD); each
        is ordered from its supplier (MOVE, paper IV-C) once the others are READY and the supplier is idle."""
        for move in self.controller.next_orders(lambda rank: rank not in self.busy, self.sent_watermark.get):
            self.unready[move.partition] = [move, set(range(1, self.k)), self.controller.in_flight[move.partition][3]]
            if self.orders:
                self.orders.send(range(1, self.k), HOLD, move=move)
        empty = np.empty(0, dtype=self.dtype)
        for partition, (move, waiting, floor) in list(self.unready.items()):
            if waiting or move.supplier in self.busy:
                continue
            del self.unready[partition]
            self.in_batch[move.supplier] = 0
            self._send(move.supplier, encode_batch(Kind.MOVE, self.epoch[move.supplier], floor, empty, empty,
                                                   partition=move.partition, peer=move.consumer))

    def _serve_orders(self) -> None:
        """Several dispatchers: act on what the others sent (master.coordination); READY for the held moves
        whose earlier batches have all been joined."""
        for source, order in self.orders.arrived():
            kind = order["order"]
            if kind == HOLD:
                move = order["move"]
                self.controller.hold(move, self.sent_watermark[move.supplier])
                self.fences[move.partition] = (move, {r for r in (move.supplier, move.consumer) if r in self.busy})
            elif kind == READY:
                entry = self.unready[order["partition"]]
                entry[1].discard(source)
                entry[2] = min(entry[2], order["cap"])
            elif kind == RELEASE:
                move = self.controller.on_installed(order["partition"], 0, time.time())
                self.missed.add(move.consumer)  # the group's tuples held during the move go out at once
            elif kind == CHECKPOINT:
                self.checkpoint_pending, self.checkpoint_ordered = True, order["id"]
            elif kind == SNAPSHOT:
                self._on_snapshot(source, order)
            elif kind == DONE:
                self.done_from.add(source)
            elif kind == FINISH:
                self.finished = True
        for partition, (move, waiting) in list(self.fences.items()):
            if not waiting:
                del self.fences[partition]
                self.orders.send([0], READY, partition=partition, cap=self.controller.in_flight[partition][3])

    def _may_end(self) -> bool:
        """Input exhausted and joined, no move in flight; with several dispatchers, all of them (DONE, FINISH)."""
        if not (self.exhausted and len(self.buffers) == 0 and not self.busy and not self.controller.busy
                and not self.checkpoint_pending):
            return False
        if self.k == 1:
            return True
        if self.index > 0:
            if not self.done_sent:
                self.orders.send([0], DONE)
                self.done_sent = True
            return self.finished
        if len(self.done_from) < self.k - 1:
            return False
        self.orders.send(range(1, self.k), FINISH)
        return True

    def _collect_reports(self) -> int:
        got = 0
        status = MPI.Status()
        report = np.empty(REPORT_BYTES, dtype=np.uint8)
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_REPORT, status=status):
            rank = status.Get_source()
            self.comm.Recv([report, MPI.BYTE], source=rank, tag=TAG_REPORT)
            counters, hist = decode_report(report)
            got += 1
            self.stats.add_report(rank, counters, hist)
            if counters["ack"] == Ack.CHECKPOINTED:
                self._on_checkpointed(rank, counters)
            if counters["ack"] == Ack.INSTALLED:  # not an answer to a message of ours: the consumer's news
                move = self.controller.on_installed(int(counters["partition"]), int(counters["moved_tuples"]),
                                                    time.time())
                self.stats.tuples_moved += int(counters["moved_tuples"])
                if self.orders:
                    self.orders.send(range(1, self.k), RELEASE, partition=move.partition)
                self.missed.add(move.consumer)  # the group's tuples held during the move go out at once
                print(f"moved partition-group {move.partition}: slave {move.supplier} -> {move.consumer} "
                      f"({int(counters['moved_tuples']):,} tuples, {move.reason})", file=sys.stderr, flush=True)
                continue
            self.controller.on_work(rank, int(counters["tuples_r"] + counters["tuples_s"]), counters["busy"])
            for _, waiting in self.fences.values():  # a batch sent before a HOLD has been joined
                waiting.discard(rank)
            request, buf = self.busy.pop(rank)
            request.Wait()
            self.spare[rank] = whole_buffer(buf)  # the next batch to it is built in it
        return got

    # -- hot keys ---------------------------------------------------------------------------------------
    def _find_hot_keys(self) -> None:
        """At a reorganization epoch: keys whose share of this epoch's input passed the threshold, and hot keys
        whose share fell below half of it (the gap keeps a key near the threshold from flapping)."""
        threshold = self.cfg["hotkeys"]["threshold"]
        for key, share in self.sketch.heavy(threshold):
            if key not in self.router.hot and len(self.router.hot) + len(self.pending_hot) < self.router.max_keys:
                self.pending_hot.setdefault(key, share)
        for key in self.router.hot:
            share = self.sketch.share(key)
            if key not in self.cooling and share < threshold / 2:
                self.cooling[key] = share
        self.sketch.reset()

    def _merge_cooled_keys(self) -> None:
        """Gather each cooled key's grid back: its sub-groups move to the owner of the key's partition, then the
        owner merges them (a MERGE order, served before any later batch) and the key's buffered tuples go back
        to the partition: every S tuple, and the R tuples of the first sub-group (each sub-group has a copy)."""
        for key, share in list(self.cooling.items()):
            first, size = self.router.hot[key]
            partition = self.router.home(key)
            owner = int(self.controller.partition_map[partition])
            subs = range(first, first + size)
            queued = {m.partition for m in self.controller.queue}
            away = [g for g in subs if self.controller.partition_map[g] != owner]
            for g in away:
                if g not in queued and not self.controller.moving[g]:
                    self.controller.queue.append(Move(g, int(self.controller.partition_map[g]), owner, "hot key cooled"))
            if away or self.controller.moving[partition] or owner in self.busy:
                continue  # next time round
            del self.cooling[key]
            self.router.demote(key)
            taken = [self.buffers.take_key(g, key) for g in subs]
            self.buffers.add(STREAM_R, taken[0][0], np.full(len(taken[0][0]), partition))
            s = np.concatenate([t[1] for t in taken])
            self.buffers.add(STREAM_S, s, np.full(len(s), partition))
            empty = np.empty(0, dtype=self.dtype)
            self._send(owner, encode_batch(Kind.MERGE, self.epoch[owner], eventtime.NONE, empty, empty,
                                           partition=partition, groups=np.array([[key, first, size]])))
            self.hot_log.append({"key": key, "event": "merge", "share": round(share, 4), "partition": partition,
                                 "owner": owner, "seconds": round(time.time() - self.t0, 3)})
            print(f"hot key {key} cooled ({share:.0%} of the input): its {size} sub-groups gathered back into "
                  f"partition-group {partition} on slave {owner}", file=sys.stderr, flush=True)

    def _split_hot_keys(self) -> None:
        """Give each pending hot key its grid: its owner splits it out of its partition (a SPLIT order, which
        the owner serves before any later batch), the tuples of it buffered here are routed to the grid, and
        all sub-groups but the first are queued to move to the least loaded other slaves."""
        for key, share in list(self.pending_hot.items()):
            partition = self.router.home(key)
            owner = int(self.controller.partition_map[partition])
            if self.controller.moving[partition] or owner in self.busy:
                continue  # next time round
            del self.pending_hot[key]
            size = self.router.grid_for(share, len(self.controller.active))
            first = self.router.promote(key, size)
            self.controller.partition_map[first: first + size] = owner
            r, s = self.buffers.take_key(partition, key)
            self.buffers.add(STREAM_S, s, self.router.route_s(s))
            index, part = self.router.route_r(r)
            self.buffers.add(STREAM_R, r[index], part)
            empty = np.empty(0, dtype=self.dtype)
            self._send(owner, encode_batch(Kind.SPLIT, self.epoch[owner], eventtime.NONE, empty, empty,
                                           partition=partition, groups=np.array([[key, first, size]])))
            others = sorted((r for r in self.controller.active if r != owner),
                            key=lambda r: self.stats.per_slave[r]["tuples_processed"])
            for j, consumer in zip(range(1, size), others):
                self.controller.queue.append(Move(first + j, owner, consumer, "hot key"))
            self.hot_log.append({"key": key, "event": "split", "share": round(share, 4), "grid": size,
                                 "partition": partition,
                                 "groups": list(range(first, first + size)), "owner": owner,
                                 "seconds": round(time.time() - self.t0, 3)})
            print(f"hot key {key} ({share:.0%} of the input): split out of partition-group {partition} into "
                  f"{size} sub-groups on slave {owner}, to be spread over slaves {[owner, *others[:size - 1]]}",
                  file=sys.stderr, flush=True)

    # -- checkpoints and recovery -------------------------------------------------------------------
    def _begin_checkpoint(self) -> None:
        """No batch or move is in flight: snapshot the master's side and order every slave to write its own
        (with several dispatchers rank 0 orders the others to do the same: master.coordination)."""
        if self.index == 0:
            ckpt_id = self.next_checkpoint
            self.next_checkpoint += 1
            self.checkpoint_due = self.epochs_done + self.interval
        else:
            ckpt_id = self.checkpoint_ordered
        self.checkpoint_pending = False
        directory = checkpoint.root_of(self.cfg) / checkpoint.name_of(ckpt_id)
        if directory.exists() and self.index == 0:  # an unfinished attempt of a run that crashed
            shutil.rmtree(directory)
        if self.orders and self.index == 0:
            self.orders.send(range(1, self.k), CHECKPOINT, id=ckpt_id)
        self._flush_late()
        if self.archive is not None:
            self.archive.flush()
        r, s = self.buffers.snapshot()
        name = checkpoint.master_part(self.index)
        size = checkpoint.write_atomic(directory / name, checkpoint.pack([r.view(np.uint8), s.view(np.uint8)]))
        part = {name: {"bytes": size, "records": 2, "tuples": len(r) + len(s)}}
        mine = {"consumed": self.consumed, "max_ts": self.max_ts, "epochs_done": self.epochs_done,
                "epoch": {str(k): v for k, v in self.epoch.items()},
                "sent_watermark": {str(k): v for k, v in self.sent_watermark.items()},
                "late_files": self._late_files,
                "key_ranges": None if self.ranges is None else self.ranges.bounds.tolist(),
                "hot_keys": None if self.router is None else [[k, *v] for k, v in self.router.hot.items()],
                "archive_files": self.archive.files if self.archive else 0,
                "stats": self.stats.state(), "controller": self.controller.state()}
        if self.index == 0:
            self.checkpoint_open = {"id": ckpt_id, "dir": directory, "started": time.time(), "slaves": {},
                                    "parts": part, "master": mine, "dispatchers": {}}
        empty = np.empty(0, dtype=self.dtype)
        for rank in self.slaves:
            self._send(rank, encode_batch(Kind.CHECKPOINT, self.epoch[rank], eventtime.NONE, empty, empty,
                                          partition=ckpt_id))
        if self.index > 0:
            self.orders.send([0], SNAPSHOT, id=ckpt_id, part=part, master=mine)

    def _on_snapshot(self, source: int, order: dict) -> None:
        """Another dispatcher's part of the open checkpoint is written."""
        ck = self.checkpoint_open
        ck["parts"].update(order["part"])
        ck["dispatchers"][str(source)] = order["master"]
        self._complete_checkpoint()

    def _on_checkpointed(self, rank: int, c: dict) -> None:
        """A slave's part is written."""
        ck = self.checkpoint_open
        ck["slaves"][rank] = c
        ck["parts"][checkpoint.slave_part(rank)] = {"bytes": int(c["part_bytes"]), "records": None,
                                                    "tuples": int(c["window_r"] + c["window_s"])}
        self._complete_checkpoint()

    def _complete_checkpoint(self) -> None:
        """With every slave's and dispatcher's part written, the manifest makes the checkpoint complete."""
        ck = self.checkpoint_open
        if len(ck["slaves"]) < len(self.slaves) or len(ck["dispatchers"]) < self.k - 1:
            return
        result_files = {str(r): int(v["result_files"]) for r, v in ck["slaves"].items()}
        sections = {0: ck["master"], **{int(d): m for d, m in ck["dispatchers"].items()}}
        commit = {"results": {f"slave-{int(r):03d}": n for r, n in result_files.items()},
                  "late": {named("late", d, self.k): m["late_files"] for d, m in sections.items()},
                  "archive": {named("input", d, self.k): m["archive_files"] for d, m in sections.items()},
                  checkpoint.PENDING_AGGREGATES: {f"slave-{int(r):03d}": int(v["aggregate_files"])
                                                  for r, v in ck["slaves"].items()}}
        checkpoint.write_manifest(ck["dir"], {"id": ck["id"], "slaves": len(self.slaves), "config": self.cfg,
                                              "parts": ck["parts"], "result_files": result_files, "commit": commit,
                                              "master": ck["master"], "dispatchers": ck["dispatchers"]})
        self.checkpoints_written += 1
        checkpoint.publish_aggregates(Path(self.cfg["output"]["path"]), commit[checkpoint.PENDING_AGGREGATES])
        checkpoint.prune(checkpoint.root_of(self.cfg), self.cfg["checkpoint"]["keep"])
        tuples = sum(p["tuples"] for p in ck["parts"].values())
        mb = sum(p["bytes"] for p in ck["parts"].values()) / 2**20
        print(f"checkpoint {ck['id']} complete: {tuples:,} tuples in state, {mb:.1f} MiB, "
              f"{time.time() - ck['started']:.2f}s", file=sys.stderr, flush=True)
        self.checkpoint_open = None

    def _resume(self, directory: Path, manifest: dict) -> None:
        """Start where the checkpoint left off: source position, mini-buffers, counters, partition map."""
        m = manifest["master"] if self.index == 0 else manifest["dispatchers"][str(self.index)]
        if self.cfg["source"]["kind"] == "zmq":  # a live stream cannot be rewound; producers get no acks
            print('recover: source.kind = "zmq": tuples the producers sent after the checkpoint and before the '
                  "crash are not replayed (a live stream cannot be rewound); the state and results up to the "
                  "checkpoint are restored", file=sys.stderr, flush=True)
        else:
            skip(self.source, m["consumed"])
        self.consumed, self.max_ts, self.epochs_done = m["consumed"], m["max_ts"], m["epochs_done"]
        r, s = checkpoint.read_part(directory / checkpoint.master_part(self.index))
        self.buffers.add(STREAM_R, r.view(self.dtype))
        self.buffers.add(STREAM_S, s.view(self.dtype))
        self.epoch = {int(k): v for k, v in m["epoch"].items()}
        self.sent_watermark = {int(k): v for k, v in m["sent_watermark"].items()}
        self._late_files = m["late_files"]
        if m["hot_keys"] is not None:
            self.router.hot = {k: (first, size) for k, first, size in m["hot_keys"]}
        if m["key_ranges"] is not None:
            self.ranges = KeyRanges(m["key_ranges"])
        if self.archive is not None:
            self.archive.files = m["archive_files"]
        self.stats.restore(m["stats"])
        for rank, files in manifest["result_files"].items():  # the checkpoint's own flush came after the snapshot
            self.stats.per_slave[int(rank)]["result_files"] = files
        self.controller.restore(m["controller"])
        self.recovered_from = manifest["id"]
        self.next_checkpoint, self.checkpoint_due = manifest["id"] + 1, self.epochs_done + self.interval

    # -- the loop -------------------------------------------------------------------------------------
    def _request_stop(self, signum, frame) -> None:
        if self._stop_requested:  # second signal: give up at once
            raise KeyboardInterrupt
        self._stop_requested = True
        self.stats.stopped_by_signal = True
        print("stopping: no more input; joining what was accepted, flushing results ...", file=sys.stderr, flush=True)

    def run(self) -> dict:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._request_stop)
        out = Path(self.cfg["output"]["path"])
        if self.source.rejected is not None and self.source.rejected.num_rows:
            self.stats.rejected = self.source.rejected.num_rows
            write_table(out / "rejected", "rejected", self.source.rejected, self.cfg["output"]["format"])
        slot = self.cfg["epochs"]["distribution"] / len(self.subgroups)
        progress = self.cfg["output"]["progress"]
        wait_all_started(self.comm)
        self.t0 = self.stats.started = time.time()
        if self.rate > 0:  # a resumed run keeps the pacing schedule where it was
            self.t0 -= self.consumed / self.rate
        next_slot, next_progress, g = self.t0 + slot, self.t0 + progress, 0
        reorganization = self.cfg["epochs"]["reorganization"]
        next_reorganization = self.t0 + reorganization
        while True:
            now = time.time()
            if self._stop_requested:
                self.exhausted = True
            worked = self._ingest(now, now >= next_slot) + self._collect_reports()
            worked += self.results_out.pump(eventtime.POS_INF if self.exhausted else self.max_ts - self.max_delay,
                                            self.buffers.counts)
            if now >= next_slot:
                if not self.checkpoint_pending:
                    self._distribute(self.subgroups[g])
                g = (g + 1) % len(self.subgroups)
                if g == 0:
                    self.epochs_done += 1
                    self.checkpoint_pending |= (bool(self.interval) and not self.exhausted and self.index == 0
                                                and self.epochs_done >= self.checkpoint_due)
                next_slot = max(next_slot + slot, now)
                worked += 1
            if self.checkpoint_pending and not self.busy and not self.controller.in_flight \
                    and self.checkpoint_open is None:
                self._begin_checkpoint()
            if self.orders:
                self._serve_orders()
            if now >= next_reorganization and self.index == 0:
                if not self.exhausted and not self.checkpoint_pending:
                    self.controller.reorganize(now)
                    if self.router is not None:
                        self._find_hot_keys()
                next_reorganization = now + reorganization
            if not self.checkpoint_pending:
                if self.pending_hot:
                    self._split_hot_keys()
                if self.cooling:
                    self._merge_cooled_keys()
                self._start_moves()
                self._serve_missed()
            if progress and now >= next_progress:
                print(f"[dispatcher {self.index}] " * (self.k > 1) + self.stats.progress_line(len(self.buffers), len(self.controller.active),
                                               len(self.controller.moves_log)), file=sys.stderr, flush=True)
                next_progress = now + progress
            if self._may_end():
                break
            if not worked:
                time.sleep(min(2e-3, max(0.0, next_slot - time.time())))
        self.results_out.close()
        if self.orders:
            self.orders.close()
        self._stop_slaves()
        if self.interval and self.index == 0:  # the run is complete: every staged partial is final
            checkpoint.publish_aggregates(Path(self.cfg["output"]["path"]), None)
        self._flush_late()
        if self.archive is not None:
            self.archive.flush()
        if self.index > 0:  # another dispatcher: its counters go to rank 0, which writes the summary
            self.comm.send({"stats": self.stats.state(), "results_out": self.results_out.summary(),
                            "source": self.source.finish()}, dest=0, tag=TAG_SUMMARY)
            return {}
        others = [self.comm.recv(source=other, tag=TAG_SUMMARY) for other in range(1, self.k)]
        for other in others:
            self.stats.merge(other["stats"])
        summary = self.stats.summary(self.cfg)
        summary["balance"] = {"reorganizations": self.controller.reorganizations, "moves": self.controller.moves_log,
                              "active_changes": self.controller.active_log,
                              "active_at_end": sorted(self.controller.active),
                              "occupancy": self.controller.occupancy_log}
        summary["hot_keys"] = self.hot_log
        summary["checkpoints"] = {"written": self.checkpoints_written, "recovered_from": self.recovered_from}
        finished = [self.source.finish(), *(o["source"] for o in others)]
        summary.update(**(type(self.source).merge(finished) if self.k > 1 and finished[0] else finished[0]),
                       **self.results_out.summary([o["results_out"] for o in others if o["results_out"]]))
        write_summary(out / "summary.json", summary)
        print_summary(summary)
        return summary

    def _stop_slaves(self) -> None:
        """STOP to every slave, then wait for each final report (results flushed)."""
        empty = np.empty(0, dtype=self.dtype)
        for rank in self.slaves:
            buf = encode_batch(Kind.STOP, self.epoch[rank] + 1, eventtime.POS_INF, empty, empty)
            self.busy[rank] = (self.comm.Isend([buf, MPI.BYTE], dest=rank, tag=TAG_DATA), buf)
        while self.busy:
            if not self._collect_reports():
                time.sleep(1e-3)
