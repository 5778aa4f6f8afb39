"""The master's desks (master/state/) in-process: real mini-buffers, controller, channels and files.

The desks' effects are carried out as the shell would, but a message to a
slave is decoded and recorded instead of sent, and a slave is busy from a send
until the test answers for it (its report came).
"""

from __future__ import annotations

from dataclasses import asdict

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pytest

from master.effects import carry_out
from master.state.balance import Move
from master.state.channels import Channels, Tell
from master.state.buffers import MiniBuffers
from master.state.controller import Controller
from protocol.orders import Order
from master.state import may_serve
from master.state.checkpoints import CheckpointDesk
from master.state.distribution import DistributionDesk
from master.state.hot_keys import HotKeyDesk
from master.intake_shell import IntakeShell
from master.state.intake import IngestDesk
from master.state.moves import MovesDesk
from master.state.payload import PayloadDesk
from master.state.stall import StallError, StallWatch
from master.state.hot_key_router import FrequentKeys, HotKeyRouter
from master.state.stats import RunStats
from protocol import checkpoint, eventtime
from protocol.plan import load_plan
from protocol.output import read_tables
from protocol.payload import PayloadLog
from protocol.messages import ALL_KEYS, NO_KEYS, Ack, Kind, batch_groups, decode_batch, hot_key
from protocol.tuples import STREAM_R, STREAM_S, partition_of, tuple_dtype
from tests.runs import file_source

DT = tuple_dtype(64)


def S(seconds: float) -> int:
    """Event time in the engine's integer microseconds (protocol.eventtime)."""
    return eventtime.duration(seconds)


PARTS = 8


class Shell:
    """The shell's part for the desks, without MPI: the real channel state (master/state/channels.py), its
    effects carried out by master.effects with messages decoded and recorded instead of sent."""

    def __init__(self, slaves: list[int]):
        self.channels = Channels(slaves, DT)
        self.intake = None  #: master.intake_shell.IntakeShell of an ingest desk's test
        #: rank, header, R, S, and the table: a BATCH's groups, a SPLIT / MERGE's hot-key row
        self._sent: list[tuple[int, np.void, np.ndarray, np.ndarray, np.ndarray | tuple | None]] = []
        self._told: list[tuple[list[int], str, dict]] = []

    def perform(self, effect) -> None:
        if isinstance(effect, Tell):
            self._told.append((list(effect.dests), effect.order, effect.fields))
            return
        head, r, s = decode_batch(effect.buf, DT)
        kind = Kind(int(head["kind"]))
        table = (
            batch_groups(effect.buf, head).copy()
            if kind == Kind.BATCH
            else hot_key(effect.buf, head)
            if kind in (Kind.SPLIT, Kind.MERGE)
            else None
        )
        self._sent.append((effect.rank, head, r.copy(), s.copy(), table))

    def done(self) -> None:
        """Carry out what the desks asked for so far."""
        carry_out(self.channels.take(), self, self.intake)

    @property
    def sent(self):
        self.done()
        return self._sent

    @property
    def told(self):
        self.done()
        return self._told

    @property
    def busy(self) -> dict:
        return self.channels.busy

    @property
    def seq(self) -> dict:
        return self.channels.seq

    def answer(self, rank: int) -> None:
        """`rank`'s report for its message came."""
        self.done()
        assert self.channels.answered(rank, {"ack": Ack.BATCH, "seq": self.seq[rank]}, 0.0)

    def kinds(self) -> list[tuple[int, Kind]]:
        return [(rank, Kind(int(head["kind"]))) for rank, head, *_ in self.sent]


class FakeResults:
    """The result stream's `sent`, recorded."""

    def __init__(self):
        self.calls = []

    def sent(self, rank, seq, partitions, r, s, floor):
        self.calls.append((rank, seq, partitions.tolist(), len(r), len(s), floor))


def released(log, desk, taken, holders) -> int:
    """The payload log's segments removed by the cuts a payload desk's `release` returns (as the shell does)."""
    return sum(log.release(*cut)[0] for cut in desk.release(taken, holders))


def config(tmp_path, *overrides):
    return load_plan(
        None, [f"partitioning.partitions={PARTS}", "partitioning.subgroups=2", f"output.path={tmp_path}", *overrides]
    )


def rows(ids, keys, ts=None, arrival=0.0):
    out = np.zeros(len(ids), DT)
    out["id"], out["key"] = ids, keys
    out["ts"] = np.arange(len(ids)) if ts is None else ts
    out["arrival"] = arrival
    return out


class Parts:
    """The shared objects a desk is built with."""

    def __init__(self, plan, slaves, partitions=PARTS, live=None):
        self.plan, self.slaves = plan, slaves
        self.buffers = MiniBuffers(partitions, DT)
        self.controller = Controller(plan.balance, slaves, partitions, live=live)
        self.stats = RunStats(slaves, 0.0)
        self.links = Shell(slaves)


# --------------------------------------------------------------------------- distribution


def test_a_busy_slave_misses_its_slot_and_is_served_when_its_report_comes(tmp_path):
    p = Parts(config(tmp_path), [1, 2, 3, 4])
    results = FakeResults()
    desk = DistributionDesk(p.plan, p.slaves, p.buffers, p.controller, p.stats, p.links.channels, results.sent)
    assert desk.subgroups == [[1, 3], [2, 4]]
    rng = np.random.default_rng(1)
    p.buffers.add(STREAM_R, rows(np.arange(200), rng.integers(0, 1000, 200)))
    p.buffers.add(STREAM_S, rows(np.arange(200, 500), rng.integers(0, 1000, 300)))
    owned = {r: p.controller.partitions_of(r) for r in p.slaves}
    waiting = {r: int(p.buffers.counts[:, owned[r]].sum()) for r in p.slaves}

    assert not desk.slot(frontier=S(5.0), now=1.0)  # slaves 1 and 3: idle, served
    assert p.links.kinds() == [(1, Kind.BATCH), (3, Kind.BATCH)]
    for rank, head, r, s, groups in p.links.sent:
        assert len(r) + len(s) == waiting[rank] and head["watermark"] == S(5.0) and head["seq"] == 1
        assert set(groups[:, 0]) <= set(owned[rank].tolist())
        assert np.isin(partition_of(np.concatenate([r["key"], s["key"]]), PARTS), owned[rank]).all()
    assert [c[:2] for c in results.calls] == [(1, 1), (3, 1)]
    assert desk.slot(frontier=S(5.0), now=1.0)  # slaves 2 and 4: the epoch is over
    assert desk.epochs_done == 1 and p.links.busy.keys() == {1, 2, 3, 4}

    p.buffers.add(STREAM_S, rows(np.arange(500, 600), rng.integers(0, 1000, 100)))
    more = int(p.buffers.counts[:, owned[1]].sum())
    p.links.answer(3)
    desk.slot(frontier=S(6.0), now=1.0)  # slave 1 still joins its batch: it misses the slot; slave 3 is served
    assert p.stats.per_slave[1]["slots_missed"] == 1 and desk.missed == {1}
    assert p.controller.buffer_samples[1][-1] == waiting[1] + more  # its batch and what waits for it
    assert p.links.sent[-1][0] == 3
    rule = may_serve(False, set(), False)
    desk.serve_missed(rule, frontier=S(6.0), now=1.0)
    assert len(p.links.sent) == 5  # still busy: nothing
    p.links.answer(1)
    desk.serve_missed(rule, frontier=S(6.0), now=1.0)
    rank, head, r, s, _ = p.links.sent[-1]
    assert rank == 1 and len(r) + len(s) == more and head["watermark"] == S(6.0) and head["seq"] == 2
    assert desk.missed == set() and p.buffers.counts[:, owned[1]].sum() == 0


def test_a_slave_with_nothing_new_is_not_sent_a_batch(tmp_path):
    p = Parts(config(tmp_path), [1, 2])
    desk = DistributionDesk(p.plan, p.slaves, p.buffers, p.controller, p.stats, p.links.channels, FakeResults().sent)
    desk.serve(1, frontier=S(3.0), now=1.0)  # no tuples, but a new watermark: it may expire blocks
    desk.serve(2, frontier=eventtime.NEG_INF, now=1.0)  # no tuples and no news
    assert p.links.kinds() == [(1, Kind.BATCH)]
    p.links.answer(1)
    desk.serve(1, frontier=S(3.0), now=1.0)
    assert len(p.links.sent) == 1


# --------------------------------------------------------------------------- moves


def test_a_held_move_blocks_serving_its_supplier_and_is_ordered_once_idle(tmp_path):
    p = Parts(config(tmp_path), [2, 3])  # rank 0 with one more dispatcher (rank 1)
    desk = DistributionDesk(p.plan, p.slaves, p.buffers, p.controller, p.stats, p.links.channels, FakeResults().sent)
    moves = MovesDesk(2, p.controller, p.stats, p.links.channels)
    group = int(p.controller.partitions_of(2)[0])
    move = Move(group, 2, 3, "test")
    p.controller.queue.append(move)
    assert moves.waits_for() == {2, 3}
    p.buffers.add(STREAM_S, rows(np.arange(400), np.arange(400)))
    desk.serve(2, frontier=S(1.0), now=1.0)  # its slot came first: busy, so the move waits
    assert moves.start(desk.sent_watermark.get, 1.0) == [] and p.controller.queue == [move]

    p.links.answer(2)
    assert moves.start(desk.sent_watermark.get, 1.0) == []  # held everywhere: HOLD, then wait for READY
    assert p.links.told == [([1], Order.HOLD, asdict(move))] and p.controller.moving[group]
    assert moves.waits_for() == {2}
    p.buffers.add(STREAM_S, rows(np.arange(400, 800), np.arange(400, 800)))
    held = int(p.buffers.counts[:, group].sum())
    assert held > 0
    desk.serve(2, frontier=S(2.0), now=1.0)  # another slot: the held group's tuples stay here, the watermark is capped
    _, head, r, s, groups = p.links.sent[-1]
    assert group not in groups[:, 0] and head["watermark"] == S(1.0)
    assert p.buffers.counts[:, group].sum() == held

    moves.on_ready(1, {"partition": group, "cap": S(0.5)})
    assert moves.start(desk.sent_watermark.get, 1.0) == []  # ready everywhere, but the supplier is joining
    p.links.answer(2)
    desk.owe(2)
    desk.serve_missed(may_serve(False, moves.waits_for(), False), frontier=S(2.0), now=1.0)
    assert p.links.kinds()[-1] == (2, Kind.BATCH) and len(p.links.sent) == 2  # not served: the move waits
    assert moves.start(desk.sent_watermark.get, 1.0) == [move]
    rank, head, *_ = p.links.sent[-1]
    assert (rank, Kind(int(head["kind"])), head["partition"], head["peer"]) == (2, Kind.MOVE, group, 3)
    assert head["floor"] == S(0.5)  # the lowest cap of every dispatcher that held the group

    assert moves.on_installed({"partition": group, "moved_tuples": 77}, 0.0) == 3
    assert p.links.told[-1] == ([1], Order.RELEASE, {"partition": group})
    assert p.controller.partition_map[group] == 3 and not p.controller.moving[group]
    assert p.stats.tuples_moved == 77
    desk.owe(3)
    desk.serve_missed(may_serve(False, moves.waits_for(), False), frontier=S(2.0), now=1.0)
    rank, head, r, s, groups = p.links.sent[-1]
    assert rank == 3 and list(groups[:, 0]).count(group) == 1 and len(s) >= held


def test_another_dispatcher_is_ready_only_when_its_batches_before_the_hold_are_joined(tmp_path):
    p = Parts(config(tmp_path), [2, 3])
    moves = MovesDesk(2, p.controller, p.stats, p.links.channels)
    p.links.busy[3] = np.empty(0)  # a batch to the consumer, sent before the hold
    move = Move(int(p.controller.partitions_of(2)[0]), 2, 3, "test")
    moves.on_hold(move, last_watermark=S(4.0), now=1.0)
    moves.send_ready()
    assert p.links.told == [] and p.controller.watermark_cap() == S(4.0)
    moves.on_answer(2)  # not a slave it waits for
    moves.send_ready()
    assert p.links.told == []
    moves.on_answer(3)
    moves.send_ready()
    assert p.links.told == [([0], Order.READY, {"partition": move.partition, "cap": S(4.0)})]
    assert moves.on_release({"partition": move.partition}, 0.0) == 3


def test_the_serving_rule_reads_every_desks_answer():
    assert may_serve(True, set(), False) is None  # a checkpoint wants quiet: they stay owed
    rule = may_serve(False, {2}, False)
    assert rule(1) and not rule(2)
    assert not may_serve(False, set(), True)(1)  # a hot key's split or merge waits for its owner


# --------------------------------------------------------------------------- checkpoints


def master_sections(p, consumed):
    return {
        "consumed": consumed,
        "source": {"accepted": consumed},
        "max_ts": 9.5,
        "late_files": 2,
        "key_ranges": None,
        "archive_files": 0,
        "epochs_done": 4,
        "sent_watermark": {str(r): S(1.0) for r in p.slaves},
        "seq": {str(r): 3 for r in p.slaves},
        "hot_keys": None,
    }


def slave_writes_its_part(p, desk, rank, ckpt_dir, tuples):
    size = checkpoint.write_atomic(ckpt_dir / checkpoint.slave_part(rank), np.arange(tuples, dtype=np.int64))
    desk.on_checkpointed(
        rank,
        {"part_bytes": size, "window_r": tuples, "window_s": 0, "result_files": rank, "aggregate_files": 0},
        now=2.0,
    )
    p.links.done()


def test_a_checkpoint_cut_waits_for_quiet_and_completes_only_when_every_part_is_in(tmp_path):
    p = Parts(config(tmp_path, "checkpoint.interval=2"), [1, 2])
    desk = CheckpointDesk(p.plan, 0, 1, p.slaves, p.buffers, p.controller, p.stats, p.links.channels)
    p.buffers.add(STREAM_R, rows(np.arange(50), np.arange(50)))
    p.buffers.add(STREAM_S, rows(np.arange(50, 80), np.arange(30)))
    # rows not in their key's hash partition (a key range's R copy, a hot key's sub-group): restored where they were
    p.buffers.add(STREAM_R, rows(np.arange(90, 95), np.full(5, 7)), np.array([0, 1, 2, 3, 4]))
    desk.on_epoch(1, exhausted=False)
    assert not desk.pending
    desk.on_epoch(2, exhausted=False)
    assert desk.pending and may_serve(desk.pending, set(), False) is None
    assert not desk.may_begin(quiet=False)  # a batch or move in flight: wait
    assert desk.may_begin(quiet=True)
    desk.begin(master_sections(p, 1234), epochs_done=2, now=1.0)
    assert not desk.pending and not desk.may_begin(quiet=True)  # one at a time
    assert p.links.kinds() == [(1, Kind.CHECKPOINT), (2, Kind.CHECKPOINT)]
    assert {int(head["checkpoint"]) for _, head, *_ in p.links.sent} == {1}
    ckpt_dir = p.plan.checkpoint.root / checkpoint.name_of(1)
    assert (ckpt_dir / checkpoint.master_part(0)).is_file() and len(p.buffers) == 85  # a snapshot, not a drain

    slave_writes_its_part(p, desk, 1, ckpt_dir, 10)
    assert not (ckpt_dir / checkpoint.MANIFEST).exists() and desk.written == 0
    slave_writes_its_part(p, desk, 2, ckpt_dir, 20)
    manifest = checkpoint.load_manifest(ckpt_dir)
    assert desk.written == 1 and desk.open is None
    assert manifest["master"]["consumed"] == 1234 and manifest["result_files"] == {"1": 1, "2": 2}
    assert manifest["commit"]["late"] == {"late": 2}
    assert sum(part["tuples"] for part in manifest["parts"].values()) == 85 + 30

    q = Parts(p.plan, [1, 2])
    resumed = CheckpointDesk(q.plan, 0, 1, q.slaves, q.buffers, q.controller, q.stats, q.links.channels)
    resumed.restore(checkpoint.read_part(ckpt_dir / checkpoint.master_part(0)), manifest, epochs_done=4)
    (r0, s0, counts0), (r1, s1, counts1) = p.buffers.snapshot(), q.buffers.snapshot()
    assert np.array_equal(counts0, counts1) and np.array_equal(r0, r1) and np.array_equal(s0, s1)
    assert (resumed.recovered_from, resumed.next_id, resumed.due) == (1, 2, 6)
    assert q.stats.per_slave[2]["result_files"] == 2


def test_with_two_dispatchers_the_manifest_waits_for_the_others_snapshot(tmp_path):
    p = Parts(config(tmp_path, "checkpoint.interval=1"), [2, 3])
    desk = CheckpointDesk(p.plan, 0, 2, p.slaves, p.buffers, p.controller, p.stats, p.links.channels)
    desk.on_epoch(1, exhausted=False)
    desk.begin(master_sections(p, 10), epochs_done=1, now=1.0)
    # rank 0's part (which clears a crashed run's unfinished directory) is written before the others are told
    effects = p.links.channels.take()
    kinds = [type(e).__name__ for e in effects]
    assert kinds.index("WritePart") < kinds.index("Tell")
    carry_out(effects, p.links)
    assert p.links.told[0][:2] == ([1], Order.CHECKPOINT)
    ckpt_dir = p.plan.checkpoint.root / checkpoint.name_of(1)
    for rank in p.slaves:
        slave_writes_its_part(p, desk, rank, ckpt_dir, 5)
    assert desk.written == 0

    q = Parts(p.plan, [2, 3])  # dispatcher 1, ordered by rank 0
    other = CheckpointDesk(q.plan, 1, 2, q.slaves, q.buffers, q.controller, q.stats, q.links.channels)
    other.on_epoch(1, exhausted=False)
    assert not other.pending  # only rank 0 decides
    other.on_order(0, {"id": 1})
    other.begin(master_sections(q, 20), epochs_done=1, now=1.0)
    ((dests, order, fields),) = q.links.told
    assert (dests, order) == ([0], Order.SNAPSHOT)
    told = len(p.links.told)
    desk.on_snapshot(1, fields, now=1.0)
    p.links.done()
    manifest = checkpoint.load_manifest(ckpt_dir)
    assert desk.written == 1 and manifest["dispatchers"]["1"]["consumed"] == 20
    # once the manifest is written, dispatcher 1 learns that its part is durable (its producers' acks)
    assert p.links.told[told:] == [([1], Order.COMMITTED, {"source": {"accepted": 20}})]


# --------------------------------------------------------------------------- hot keys

HOT = 7


def hot_setup(tmp_path, join_type="inner", k=1):
    plan = config(
        tmp_path,
        "hotkeys.enabled=true",
        "hotkeys.max_keys=2",
        "hotkeys.grid=4",
        "hotkeys.threshold=0.2",
        f'join.type="{join_type}"',
    )
    router = HotKeyRouter(PARTS, 2, 4, join_type)
    p = Parts(plan, [1, 2, 3], router.total_partitions, live=PARTS)
    # sub-group slots no hot key uses belong to no slave: balancing must not move a group nobody holds
    assert (p.controller.partition_map[PARTS:] == -1).all()
    sketch = FrequentKeys(64)
    p.rerouted = []
    desk = HotKeyDesk(
        plan,
        router,
        sketch,
        p.buffers,
        p.controller,
        p.stats,
        p.links.channels,
        lambda sources, targets: p.rerouted.append((list(sources), list(targets))),
        k,
    )
    rng = np.random.default_rng(5)
    keys = np.where(rng.random(600) < 0.5, HOT, rng.integers(100, 200, 600))
    sketch.update(keys)
    r, s = rows(np.arange(300), keys[:300]), rows(np.arange(300, 600), keys[300:])
    p.buffers.add(STREAM_R, r, router.route(STREAM_R, r)[1])  # as ingest routes them: no key is hot yet
    p.buffers.add(STREAM_S, s, router.route(STREAM_S, s)[1])
    return p, desk, router, keys


def test_a_hot_key_split_routes_its_buffered_tuples_to_the_grid(tmp_path):
    p, desk, router, keys = hot_setup(tmp_path)
    home = router.home(HOT)
    owner = int(p.controller.partition_map[home])
    desk.find()
    assert list(desk.pending) == [HOT] and desk.waiting
    p.links.busy[owner] = np.empty(0)
    desk.split(now=1.0)
    assert desk.pending and not p.links.sent  # its owner is busy: next time round
    p.links.answer(owner)
    others_before = p.buffers.counts.sum() - p.buffers.counts[:, home].sum()
    desk.split(now=1.0)
    first, size = router.hot[HOT]
    ((rank, head, _, _, table),) = p.links.sent
    assert (rank, Kind(int(head["kind"])), head["partition"]) == (owner, Kind.SPLIT, home)
    assert table == (HOT, first, size) and size == 3  # a share of ~0.5 over 3 slaves: all of them
    r_home, s_home = p.buffers.drain(np.array([home]))
    assert HOT not in r_home["key"] and HOT not in s_home["key"]
    grid = [p.buffers.drain(np.array([g])) for g in range(first, first + size)]
    hot_r = np.sort(np.flatnonzero(keys[:300] == HOT))
    for r, _ in grid:  # every sub-group has a copy of each R
        assert np.array_equal(np.sort(r["id"]), hot_r)
    s_ids = np.concatenate([s["id"] for _, s in grid])
    assert np.array_equal(np.sort(s_ids), 300 + np.flatnonzero(keys[300:] == HOT))  # each S once
    assert p.buffers.counts.sum() == others_before  # other partitions untouched
    assert (p.controller.partition_map[first : first + size] == owner).all()
    assert [(m.partition, m.supplier) for m in p.controller.queue] == [(first + 1, owner), (first + 2, owner)]
    assert {m.consumer for m in p.controller.queue} == {1, 2, 3} - {owner} and desk.log[0]["event"] == "split"
    assert p.rerouted == [([home], list(range(first, first + size)))]  # the result stream's floors follow


def split_and_cooled(tmp_path, join_type="inner"):
    """A hot key split on its idle owner, then found cooled: (parts, desk, router, keys, home, owner)."""
    p, desk, router, keys = hot_setup(tmp_path, join_type)
    desk.find()
    desk.split(now=1.0)
    home = router.home(HOT)
    owner = int(p.controller.partition_map[home])
    p.links.answer(owner)
    desk.cooling[HOT] = 0.01
    return p, desk, router, keys, home, owner


def test_the_merge_keeps_every_s_and_one_copy_of_each_r(tmp_path):
    p, desk, router, keys, home, owner = split_and_cooled(tmp_path)
    first, size = router.hot[HOT]
    moved = p.controller.queue[0]
    p.controller.queue.clear()
    p.controller.partition_map[moved.partition] = moved.consumer  # one sub-group went to another slave
    desk.merge(now=1.0)
    assert desk.cooling and len(p.links.sent) == 1  # it is still to come back: nothing yet
    assert [(m.partition, m.supplier, m.consumer) for m in p.controller.queue] == [
        (moved.partition, moved.consumer, owner)
    ]
    p.controller.queue.clear()
    p.controller.partition_map[moved.partition] = owner
    desk.merge(now=1.0)
    (rank, head, *_, table) = p.links.sent[-1]
    assert (rank, Kind(int(head["kind"])), table) == (owner, Kind.MERGE, (HOT, first, size))
    assert HOT not in router.hot and not desk.waiting
    r, s = p.buffers.drain(np.array([home]))
    assert np.array_equal(np.sort(r["id"][r["key"] == HOT]), np.flatnonzero(keys[:300] == HOT))
    assert np.array_equal(np.sort(s["id"][s["key"] == HOT]), 300 + np.flatnonzero(keys[300:] == HOT))
    assert p.buffers.counts[:, first : first + size].sum() == 0


def test_the_merge_waits_until_the_sub_groups_were_drained_together(tmp_path):
    """A sub-group drained to its slave before the others: its R copies left, the others' still wait here. A
    merge now would drop those (pairs lost) or send them again (twice); it waits for the owner's next batch,
    which drains all sub-groups at once."""
    p, desk, router, keys, home, owner = split_and_cooled(tmp_path)
    first, size = router.hot[HOT]
    p.buffers.drain(np.array([first]))  # the first sub-group went out at its slave's slot
    assert p.buffers.counts[STREAM_R, first + 1] == (keys[:300] == HOT).sum()  # the others still hold copies
    desk.merge(now=1.0)
    assert desk.cooling and HOT in router.hot and not p.controller.queue  # the queued spread is dropped
    assert all(Kind(int(head["kind"])) != Kind.MERGE for _, head, *_ in p.links.sent)
    p.buffers.drain(np.arange(first, first + size))  # the owner's batch: every sub-group at once
    more = rows(np.arange(1000, 1010), np.full(10, HOT))
    index, part = router.route(STREAM_R, more)
    p.buffers.add(STREAM_R, more[index], part)  # copies to every sub-group
    desk.merge(now=1.0)
    assert Kind(int(p.links.sent[-1][1]["kind"])) == Kind.MERGE and HOT not in router.hot
    assert (p.controller.partition_map[first : first + size] == -1).all()  # the slots are free again
    assert p.rerouted[-1] == (list(range(first, first + size)), [home])
    r, _ = p.buffers.drain(np.array([home]))
    assert np.array_equal(np.sort(r["id"][r["key"] == HOT]), np.arange(1000, 1010))  # one copy each


def test_a_full_joins_hot_key_gets_two_grids_with_each_tuple_at_home_in_one_sub_group(tmp_path):
    """join.type = "full": S spread over the first grid with R copied into it as guests, R spread over the second
    with S copied as guests (protocol.predicates.hot_grids); the group table's spans say which are guests."""
    p, desk, router, keys = hot_setup(tmp_path, "full")
    desk.find()
    desk.split(now=1.0)
    first, count = router.hot[HOT]
    assert count == 6 and first == PARTS and router.total_partitions == PARTS + 2 * 2 * 4
    owner = int(p.controller.partition_map[router.home(HOT)])
    assert (
        p.links.sent[-1][-1] == (HOT, first, count) and (p.controller.partition_map[first : first + 6] == owner).all()
    )
    others = sorted({1, 2, 3} - {owner})  # round the slaves: two sub-groups stay on the owner
    assert sorted(m.partition for m in p.controller.queue) == [first + 1, first + 2, first + 4, first + 5]
    assert {m.consumer for m in p.controller.queue} == set(others)
    grids = [p.buffers.drain(np.array([g])) for g in range(first, first + 6)]
    hot_r, hot_s = np.flatnonzero(keys[:300] == HOT), 300 + np.flatnonzero(keys[300:] == HOT)
    for j, (r, s) in enumerate(grids):  # first grid: every R, S spread; second: every S, R spread
        assert np.array_equal(np.sort((r, s)[j >= 3]["id"]), (hot_r, hot_s)[j >= 3])
    for stream, spread in ((STREAM_R, grids[3:]), (STREAM_S, grids[:3])):
        ids = np.concatenate([g[stream]["id"] for g in spread])
        assert np.array_equal(np.sort(ids), (hot_r, hot_s)[stream]) and all(len(g[stream]) for g in spread)
    spans = router.spans(np.array([first, first + 3, 0]))
    assert spans.tolist() == [[*NO_KEYS, *ALL_KEYS], [*ALL_KEYS, *NO_KEYS], [*ALL_KEYS, *ALL_KEYS]]


def test_a_full_joins_merge_gathers_each_tuple_once_from_its_home_grid(tmp_path):
    p, desk, router, keys, home, owner = split_and_cooled(tmp_path, "full")
    first, count = router.hot[HOT]
    p.buffers.drain(np.array([first + 3]))  # one sub-group of the second grid went out alone
    desk.merge(now=1.0)
    assert desk.cooling and HOT in router.hot  # its R went out, their guest copies in the first grid did not
    p.buffers.drain(np.arange(first, first + count))  # the owner's batch: every sub-group at once
    more_r, more_s = rows(np.arange(1000, 1010), np.full(10, HOT)), rows(np.arange(2000, 2010), np.full(10, HOT))
    for stream, more in ((STREAM_R, more_r), (STREAM_S, more_s)):
        index, part = router.route(stream, more)
        p.buffers.add(stream, more[index], part)  # each at home once, a guest in every sub-group of the other grid
    desk.merge(now=1.0)
    assert Kind(int(p.links.sent[-1][1]["kind"])) == Kind.MERGE and p.links.sent[-1][-1] == (HOT, first, count)
    r, s = p.buffers.drain(np.array([home]))
    assert np.array_equal(np.sort(r["id"][r["key"] == HOT]), np.arange(1000, 1010))  # each once, from its home
    assert np.array_equal(np.sort(s["id"][s["key"] == HOT]), np.arange(2000, 2010))
    assert p.buffers.counts[:, first : first + count].sum() == 0


def test_with_two_dispatchers_a_split_and_a_merge_change_both_routers_at_one_fence(tmp_path):
    """Rank 0 decides from both sketches, the other dispatcher holds the key's partition (its watermarks capped)
    until its batch sent before is joined; SPLIT only after its READY, and it routes by the grid only after the
    owner answered (HOT_RELEASE).  The merge the same way, the grid held instead."""
    p, desk, router, keys = hot_setup(tmp_path, k=2)  # rank 0
    q, other, router1, _ = hot_setup(tmp_path, k=2)  # dispatcher 1, with the same tuples buffered
    home = router.home(HOT)
    owner = int(p.controller.partition_map[home])
    other.send_sketch()
    ((dests, order, sketch),) = q.links.told
    assert (dests, order, sketch["seen"]) == ([0], Order.SKETCH, 600) and not other.sketch.seen
    desk.on_sketch(1, sketch)
    true = (keys == HOT).mean()  # both saw the same keys: the summed sketch keeps Misra-Gries' bound
    assert desk.sketch.seen == 1200 and true - 1 / 64 <= desk.sketch.share(HOT) <= true
    q.links.busy[owner] = np.empty(0)  # dispatcher 1's batch to the owner, not joined yet
    desk.find()
    desk.split(now=1.0)
    ((dests, order, hold),) = p.links.told
    assert (dests, order) == ([1], Order.HOT_HOLD) and hold["split"] and hold["partition"] == home
    assert not router.hot and not p.links.sent and desk.fencing  # no SPLIT before the others hold
    desk.sketch.update(keys)
    desk.find()
    assert not desk.pending  # a key being split is not found hot again
    other.on_hold(0, hold)
    other.fenced(lambda rank: 5, now=1.0)
    assert q.controller.moving[home] and q.controller.watermark_cap() == 5 and len(q.links.told) == 1
    desk.fenced(lambda rank: 0, now=1.0)
    assert not p.links.sent  # dispatcher 1 is not READY
    q.links.answer(owner)
    other.on_answer(owner)
    other.fenced(lambda rank: 5, now=1.0)
    assert q.links.told[-1] == ([0], Order.HOT_READY, {"key": HOT})
    desk.on_ready(1, q.links.told[-1][2])
    desk.fenced(lambda rank: 0, now=1.0)
    ((rank, head, *_, table),) = p.links.sent
    assert (rank, Kind(int(head["kind"])), table) == (owner, Kind.SPLIT, (HOT, *router.hot[HOT]))
    assert not router1.hot and desk.fencing  # dispatcher 1 routes the key to its partition until the answer
    p.links.answer(owner)
    desk.on_regrouped(home)
    assert p.links.told[-1] == ([1], Order.HOT_RELEASE, {"key": HOT}) and not desk.fencing
    assert other.on_release(p.links.told[-1][2]) == owner and router1.hot == router.hot and not other.fencing
    assert not q.controller.moving.any() and q.controller.watermark_cap() == eventtime.POS_INF
    first, count = router.hot[HOT]
    for parts in (p, q):  # both routers' buffered tuples of the key went to the grid
        r, s = parts.buffers.drain(np.array([home]))
        assert HOT not in r["key"] and HOT not in s["key"]
        r, s = parts.buffers.drain(np.arange(first, first + count))
        assert np.array_equal(np.unique(s["id"]), 300 + np.flatnonzero(keys[300:] == HOT)) and len(r)

    p.controller.queue.clear()  # the grid stayed on its owner
    desk.cooling[HOT] = 0.01
    desk.merge(now=2.0)
    hold = p.links.told[-1][2]
    assert p.links.told[-1][:2] == ([1], Order.HOT_HOLD) and not hold["split"] and HOT in router.hot
    desk.find()
    assert not desk.cooling  # nor one being merged found cooled again
    more = rows(np.arange(1000, 1010), np.full(10, HOT))
    for router_, parts in ((router, p), (router1, q)):
        index, part = router_.route(STREAM_R, more)
        parts.buffers.add(STREAM_R, more[index], part)  # copies to every sub-group, at both dispatchers
    other.on_hold(0, hold)
    other.fenced(lambda rank: 7, now=2.0)
    assert q.controller.moving[first : first + count].all() and q.links.told[-1][1] == Order.HOT_READY
    desk.on_ready(1, q.links.told[-1][2])
    desk.fenced(lambda rank: 0, now=2.0)
    assert Kind(int(p.links.sent[-1][1]["kind"])) == Kind.MERGE and HOT not in router.hot and HOT in router1.hot
    desk.on_regrouped(home)
    assert other.on_release(p.links.told[-1][2]) == owner and not router1.hot and not q.controller.moving.any()
    for parts in (p, q):  # one copy of each R back in the partition, the grid's slots free
        r, _ = parts.buffers.drain(np.array([home]))
        assert np.array_equal(np.sort(r["id"][r["key"] == HOT]), np.arange(1000, 1010))
        assert (parts.controller.partition_map[first : first + count] == -1).all()


# --------------------------------------------------------------------------- ingest


def write_input(path: Path, ts, keys, stream):
    pacsv.write_csv(
        pa.table({"stream": np.where(stream == STREAM_R, "R", "S"), "id": np.arange(len(ts)), "ts": ts, "key": keys}),
        path,
    )


def test_ingest_sets_late_tuples_aside_and_routes_the_rest_by_hash(tmp_path):
    ts = np.array([1.0, 2.0, 3.0, 1.5, 0.4, 3.2, 2.9, 5.0, 1.0])  # 1.5, 0.4 and 1.0: below the max before - 1.0
    keys = np.arange(len(ts)) * 11
    stream = np.array([0, 1, 0, 1, 0, 1, 0, 1, 1])
    write_input(tmp_path / "in.csv", ts, keys, stream)
    plan = config(tmp_path, "join.max_delay=1.0", "source.batch=4")
    p = Parts(plan, [1, 2])
    desk = IngestDesk(plan, p.buffers, p.stats, p.links.channels, 0, 1, 2, None, None)
    intake = p.links.intake = IntakeShell(plan, file_source(tmp_path / "in.csv"), 0, 1)
    desk.start(100.0)
    while intake.pull(desk, 100.0) or not desk.exhausted:
        pass
    p.links.done()
    intake.flush()
    assert p.stats.late == 3 and intake.late.files == 1 and desk.consumed == len(ts)
    late = read_tables(tmp_path / "late")
    assert sorted(late.column("id").to_pylist()) == [3, 4, 8]
    assert desk.frontier() == S(5.0) - S(1.0)
    on_time = np.setdiff1d(np.arange(len(ts)), [3, 4, 8])
    for stream_id in (STREAM_R, STREAM_S):
        mine = on_time[stream[on_time] == stream_id]
        assert np.array_equal(
            p.buffers.counts[stream_id], np.bincount(partition_of(keys[mine], PARTS), minlength=PARTS)
        )
    assert intake.state()["late_files"] == 1 and desk.state()["consumed"] == len(ts)


def test_paced_ingest_takes_what_is_due_in_ticks_and_everything_due_at_a_slot(tmp_path):
    n = 5000
    write_input(tmp_path / "in.csv", np.arange(n) / 1000, np.arange(n), np.arange(n) % 2)
    plan = config(tmp_path, "source.rate=1000")
    p = Parts(plan, [1, 2])
    desk = IngestDesk(plan, p.buffers, p.stats, p.links.channels, 0, 1, 2, None, None)
    intake = p.links.intake = IntakeShell(plan, file_source(tmp_path / "in.csv"), 0, 1)
    t0 = desk.start(100.0)
    assert intake.pull(desk, t0 + 0.5) == 500
    assert intake.pull(desk, t0 + 0.501) == 0  # one due, within the tick
    assert intake.pull(desk, t0 + 0.501, slot=True) == 1
    arrival = p.buffers.drain(np.arange(PARTS))[0]["arrival"]
    assert arrival.min() == t0 and arrival.max() < t0 + 0.501  # nominal arrival on the schedule
    # the ordered result stream's room caps what is taken; a cap of 0 holds the due tuples back (pacing lag)
    assert intake.pull(desk, t0 + 0.7, slot=True, cap=0) == 0 and p.stats.pacing_lag_max > 0.19
    assert intake.pull(desk, t0 + 0.7, slot=True, cap=120) == 120
    assert intake.pull(desk, t0 + 0.7, slot=True) == 79


def test_a_whole_step_due_is_taken_within_a_tick_and_the_drain_after_the_input_is_no_lag(tmp_path):
    """Steps of 50 tuples in 10 ms ticks would cap ingest at 5,000/s: at 12,000/s a whole step due within a
    tick is taken at once.  Full mini-buffers hold the due tuples back (pacing lag); the time after the input
    has ended is no lag, however long the slaves take to drain."""
    n = 600
    write_input(tmp_path / "in.csv", np.arange(n) / 12000, np.arange(n), np.arange(n) % 2)
    plan = config(tmp_path, "source.rate=12000", "source.batch=50", "master.buffer_capacity=300")
    p = Parts(plan, [1, 2])
    desk = IngestDesk(plan, p.buffers, p.stats, p.links.channels, 0, 1, 2, None, None)
    intake = p.links.intake = IntakeShell(plan, file_source(tmp_path / "in.csv"), 0, 1)
    t0 = desk.start(100.0)
    assert intake.pull(desk, t0 + 0.0101) == 50  # 121 due
    assert intake.pull(desk, t0 + 0.0102) == 50  # within the tick: 72 due, a whole step
    assert intake.pull(desk, t0 + 0.0103) == 0  # 23 due: they wait for the next tick
    assert p.stats.pacing_lag_max < 0.01
    while intake.pull(desk, t0 + 0.1):
        pass
    assert len(p.buffers) == 300  # the buffers' room is taken: 900 due are held back (lag)
    assert intake.pull(desk, t0 + 0.1) == 0 and p.stats.pacing_lag_max >= (1200 - 300) / 12000
    while not desk.exhausted:  # the slaves take what is buffered: the rest comes in
        p.buffers.drain(np.arange(PARTS))
        intake.pull(desk, t0 + 0.2)
    lag = p.stats.pacing_lag_max
    assert intake.pull(desk, t0 + 5.0) == 0 and p.stats.pacing_lag_max == lag  # the drain: no lag


def test_band_join_routes_s_to_its_range_and_copies_r_to_every_range_with_partners(tmp_path):
    rng = np.random.default_rng(4)
    keys = rng.integers(0, 1000, 400)
    stream = rng.integers(0, 2, 400)
    write_input(tmp_path / "in.csv", np.sort(rng.random(400)), keys, stream)
    plan = config(tmp_path, "join.predicate=band", "join.band=30")
    p = Parts(plan, [1, 2])
    desk = IngestDesk(plan, p.buffers, p.stats, p.links.channels, 0, 1, 2, None, None)
    intake = p.links.intake = IntakeShell(plan, file_source(tmp_path / "in.csv"), 0, 1)
    desk.start(0.0)
    intake.pull(desk, 0.0)
    assert desk.ranges is not None
    r, s = zip(*(p.buffers.drain(np.array([g])) for g in range(PARTS)))
    assert sum(map(len, s)) == (stream == STREAM_S).sum() and sum(map(len, r)) >= (stream == STREAM_R).sum()
    for g in range(PARTS):
        assert (desk.ranges.home(s[g]["key"]) == g).all()
        for other in range(PARTS):  # every S's partner R is in its range
            near = np.abs(s[g]["key"][:, None] - r[other]["key"][None, :]) <= 30
            if other != g and near.any():
                assert np.isin(r[other]["id"][near.any(axis=0)], r[g]["id"]).all()


# --------------------------------------------------------------------------- the floors

# --------------------------------------------------------------------------- stall watch


def test_pending_work_that_stands_still_ends_the_job_naming_what_it_waits_for(tmp_path):
    p = Parts(config(tmp_path, "epochs.distribution=0.5"), [1, 2])
    watch = StallWatch(p.plan, p.buffers, p.controller, p.links.channels)
    assert watch.bound() == 10.0  # 8 epochs are 4 s: the floor
    watch.on_report(3.0)
    assert watch.bound() == 16.0  # plus twice the slowest batch
    watch.watch(0.0, 0, {}, "")
    watch.watch(100.0, 0, {}, "")  # nothing pending: no stall, however long
    p.buffers.add(STREAM_R, rows(np.arange(40), np.full(40, 5)), np.full(40, 3))
    p.links.busy[2] = np.empty(0)
    watch.watch(101.0, 0, {}, "")  # pending work begins
    watch.watch(110.0, 40, {}, "")  # input was taken: progress
    watch.watch(126.0, 40, {}, "")
    with pytest.raises(StallError) as e:
        watch.watch(126.5, 40, {"split": {}, "merge": {7: 0.01}}, "waiting for quiet")
    msg = str(e.value)
    assert "for 16.5s" in msg and "slave(s) [2]" in msg and "40 tuples buffered" in msg
    assert f"3 (40, slave {int(p.controller.partition_map[3])})" in msg
    assert "'merge': {7: 0.01}" in msg and "checkpoint: waiting for quiet" in msg


def test_a_configured_stall_timeout_replaces_the_automatic_bound(tmp_path):
    p = Parts(config(tmp_path, "master.stall_timeout=2.5"), [1])
    watch = StallWatch(p.plan, p.buffers, p.controller, p.links.channels)
    watch.on_report(30.0)
    p.links.busy[1] = np.empty(0)
    watch.watch(0.0, 0, {}, "")
    watch.watch(2.5, 0, {}, "")
    watch.joining += 1  # the busy slave says it is still joining its batch: progress
    watch.watch(2.6, 0, {}, "")
    watch.watch(5.1, 0, {}, "")
    with pytest.raises(StallError):
        watch.watch(5.2, 0, {}, "")


def test_another_dispatcher_waiting_for_rank_0_to_finish_a_move_is_not_stalled(tmp_path):
    p = Parts(config(tmp_path, "master.stall_timeout=1.0"), [2, 3])
    watch = StallWatch(p.plan, p.buffers, p.controller, p.links.channels, coordinator=False)
    group = int(p.controller.partitions_of(2)[0])
    p.controller.hold(Move(group, 2, 3, "test"), 0, 1.0)
    p.buffers.add(STREAM_S, rows(np.arange(5), np.zeros(5, np.int64)), np.full(5, group))
    watch.watch(0.0, 0, {}, "")
    watch.watch(50.0, 0, {}, "")  # its held tuples wait for rank 0's RELEASE: rank 0's work, not its own
    p.buffers.add(STREAM_S, rows(np.arange(5, 9), np.zeros(4, np.int64)), np.full(4, (group + 1) % PARTS))
    watch.orders += 1  # an order from rank 0 is progress
    watch.watch(50.5, 0, {}, "")
    watch.watch(51.5, 0, {}, "")
    with pytest.raises(StallError):  # tuples of a group not moving, unsent: its own
        watch.watch(51.6, 0, {}, "")
    rank0 = StallWatch(p.plan, p.buffers, p.controller, p.links.channels)
    rank0.watch(60.0, 0, {}, "")
    with pytest.raises(StallError, match="moves in flight"):  # rank 0 drives the move: a stall there is its own
        rank0.watch(61.1, 0, {}, "")


def test_a_checkpoint_waiting_for_quiet_holds_no_new_move_but_lets_a_held_one_finish(tmp_path):
    # the cut waits for no move in flight; a held move must still be ordered, or the two wait for each other
    p = Parts(config(tmp_path), [2, 3])  # rank 0 with one more dispatcher (rank 1)
    moves = MovesDesk(2, p.controller, p.stats, p.links.channels)
    first, second = (int(g) for g in p.controller.partitions_of(2)[:2])
    p.controller.queue.append(Move(first, 2, 3, "test"))
    assert moves.start(lambda rank: S(0.0), 1.0) == [] and first in p.controller.in_flight  # held: HOLD, wait READY
    p.controller.queue.append(Move(second, 3, 2, "test"))
    moves.on_ready(1, {"partition": first, "cap": S(0.0)})
    (ordered,) = moves.start(lambda rank: S(0.0), 1.0, hold=False)  # a checkpoint wants quiet
    assert ordered.partition == first and p.links.kinds()[-1] == (2, Kind.MOVE)
    assert second not in p.controller.in_flight and p.controller.queue  # no new move held meanwhile


# --------------------------------------------------------------------------- payload log


def test_the_payload_desk_removes_a_segment_once_every_holder_is_past_its_rows_partners(tmp_path):
    """R rows' last partner lies `upper` after them, S rows' `-lower` after: a segment goes once the smallest
    watermark the slaves holding groups answered (a move's consumer at its floor until it answers again; a
    checkpoint's cut from the moment it is taken) is past that, and the master has taken its rows in."""
    plan = config(tmp_path, "join.lower=-0.5", "join.upper=2.0", "checkpoint.keep=1")
    log = PayloadLog(tmp_path / "out", "test")
    for side in (0, 1):
        log.write(side, np.arange(0, 10), np.full(10, S(10)), pa.table({"x": np.arange(10)}))
        log.write(side, np.arange(10, 20), np.full(10, S(20)), pa.table({"x": np.arange(10)}))
    desk = PayloadDesk(plan, 0, [1, 2, 3])

    def files(side: int) -> list[int]:  # the first rows of the segments still on disk
        return sorted(int(p.name[:12]) for p in (tmp_path / "out" / "payload" / "RS"[side]).glob("0*.arrow"))

    assert released(log, desk, (20, 20), [1, 2]) == 0  # no slave has answered
    desk.on_answer(1, S(12.5))
    desk.on_answer(2, S(11))
    assert released(log, desk, (20, 20), [1, 2]) == 1  # W = 11 s: S's rows at 10 s done (10.5 < 11), R's not (12)
    assert (files(0), files(1)) == ([0, 10], [10])
    desk.on_answer(2, S(12.5))
    desk.on_move(5, S(11.5))  # group 5 goes to slave 3, decided up to 11.5 s: it counts from now on
    assert released(log, desk, (20, 20), [1, 2]) == 0
    desk.on_answer(3, S(30))  # an answer before the install does not lift the floor
    assert released(log, desk, (20, 20), [1, 2]) == 0
    desk.on_installed(5, 3)
    assert desk.watermark([1, 2, 3]) == S(11.5)  # installed, not yet answered: the group's rows wait there
    assert released(log, desk, (20, 20), [1, 2, 3]) == 0
    desk.on_answer(3, S(12.5))
    assert desk.cut([1, 2, 3]) == S(12.5)  # a checkpoint is being taken at 12.5 s
    for rank in (1, 2, 3):
        desk.on_answer(rank, S(40))
    assert released(log, desk, (5, 20), [1, 2, 3]) == 0  # W = the open cut, 12.5 s; R's rows 5.. are not taken in yet
    assert released(log, desk, (20, 20), [1, 2, 3]) == 1  # R's first segment (10 + 2 < 12.5); its second needs 22 s
    assert (files(0), files(1)) == ([10], [10])
    desk.on_commit(S(12.5))
    desk.cut([1, 2, 3])
    desk.on_commit(S(40))  # keep = 1: the older checkpoint is gone
    assert released(log, desk, (20, 20), [1, 2, 3]) == 2
    assert files(0) == files(1) == [] and log.removed_bytes == log.peak_bytes > 0 and log.held_bytes == 0


def test_with_two_dispatchers_rank_0_removes_segments_only_as_far_as_the_other_reports(tmp_path):
    """A slave's watermark is the smallest of the dispatchers': rank 0 removes by its own answers and the last
    PAYLOAD report of dispatcher 1 (its watermark and the rows it has taken in), which reports only changes."""
    plan = config(tmp_path, "join.window=1", "cluster.dispatchers=2")
    log = PayloadLog(tmp_path / "out", "test")
    for side in (0, 1):
        for first in (0, 10):
            log.write(side, np.arange(first, first + 10), np.full(10, S(first)), pa.table({"x": np.arange(10)}))
    rank0, other = PayloadDesk(plan, 0, [2, 3]), PayloadDesk(plan, 1, [2, 3])
    for desk in (rank0, other):
        desk.on_answer(2, S(30))
        desk.on_answer(3, S(30))
    assert released(log, rank0, (20, 20), [2, 3]) == 0  # no word from dispatcher 1 yet
    other.on_answer(3, S(5))  # dispatcher 1's last batch to slave 3 held a watermark of 5 s
    report = other.report((20, 15), [2, 3])
    assert report == {"watermark": S(5), "taken": (20, 15)} and other.report((20, 15), [2, 3]) is None
    rank0.on_report(1, report["watermark"], report["taken"])
    assert released(log, rank0, (20, 20), [2, 3]) == 2  # the first segment of each (0 s + the 1 s window < 5 s)
    other.on_answer(3, S(30))
    rank0.on_report(1, **other.report((20, 15), [2, 3]))
    assert released(log, rank0, (20, 20), [2, 3]) == 1  # R's second; S's rows 15.. are not taken in by dispatcher 1
    rank0.on_report(1, **other.report((20, 20), [2, 3]))
    assert released(log, rank0, (20, 20), [2, 3]) == 1 and log.held_bytes == 0
