"""The checkpoint desk: the cut, the master's snapshot, the manifest once every part is in, and resume.

Every `checkpoint.interval` distribution epochs rank 0 wants quiet: no new
batch or move leaves until none is in flight.  Then it snapshots its
mini-buffers and counters, orders every slave to write its state (a CHECKPOINT
batch: the Chandy-Lamport marker) and, with several dispatchers (BiStream
3.2.3; master.coordination), the others to do the same; they answer SNAPSHOT
with their part.  The manifest written when all parts are in makes the
checkpoint complete (protocol.checkpoint).

While a checkpoint is wanted no new move is held (the cut waits for quiet, so
moves already held are finished first); while it is open no order goes out: a
slave that has rank 0's marker takes nothing more from rank 0 until every
dispatcher's marker is in, and another dispatcher sends its marker only with no
move held, so an order sent across the cut would wait for a marker that waits
for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING


import numpy as np

from master.sources.archive import named
from master.state.channels import Prune, Publish, WriteManifest, WritePart
from protocol.orders import Order
from protocol import checkpoint
from protocol.access import public
from protocol.messages import Kind

if TYPE_CHECKING:
    from protocol.plan import Plan


class CheckpointDesk:
    def __init__(self, plan: Plan, index: int, k: int, slaves: list[int], buffers, controller, stats, channels):
        self.plan, self.index, self.k, self.slaves = plan, index, k, slaves
        self.buffers, self.controller, self.stats, self.channels = buffers, controller, stats, channels
        self.interval = plan.checkpoint.interval
        self.next_id, self.due = 1, self.interval  #: rank 0: the next checkpoint, and the epoch it is due at
        self.pending = False  #: a checkpoint waits for quiet: no batch or move may leave
        self.open: dict | None = None  #: rank 0: the checkpoint whose parts are being written
        self.ordered = 0  #: another dispatcher: the checkpoint rank 0 ordered
        self.written = 0
        self.log: list[dict] = []  #: rank 0: every complete checkpoint (metrics, summary)
        self.recovered_from = None
        #: from the checkpoint resumed: committed file counts of slaves not in this run (protocol.checkpoint)
        self.inherited = {"results": {}, checkpoint.PENDING_AGGREGATES: {}}
        self.t0 = 0.0  #: the run's start (the pacing schedule's origin)
        #: told its section of each complete checkpoint (rank 0 at once, the others by a COMMITTED order)
        self.on_commit = lambda section: None

    def on_epoch(self, epochs_done: int, exhausted: bool) -> None:
        """A distribution epoch ended: rank 0 wants a checkpoint if one is due and input is still coming."""
        self.pending |= bool(self.interval) and not exhausted and self.index == 0 and epochs_done >= self.due

    def on_order(self, source: int, order: dict) -> None:
        """Another dispatcher: rank 0 ordered checkpoint `order["id"]`."""
        self.pending, self.ordered = True, order["id"]

    def may_begin(self, quiet: bool) -> bool:
        """A checkpoint is wanted, none is being written, and `quiet`: no batch or move is in flight."""
        return self.pending and quiet and self.open is None

    def waiting_for(self) -> str:
        """What a checkpoint being taken waits for ("" when none is): the stall watch names it."""
        if self.open:
            return (
                f"{self.open['id']} open, parts in: {sorted(self.open['parts'])}" + " (the next waits)" * self.pending
            )
        return "waiting for quiet" if self.pending else ""

    def begin(self, sections: dict, epochs_done: int, now: float, records: list[np.ndarray] = ()) -> None:
        """Snapshot the master's side (`sections`: the desks' parts, flushed; `records`: the source's arrays, after
        the mini-buffers in the part) and order every slave to write its own."""
        if self.index == 0:
            ckpt_id = self.next_id
            self.next_id += 1
            self.due = epochs_done + self.interval
        else:
            ckpt_id = self.ordered
        self.pending = False
        directory = self.plan.checkpoint.root / checkpoint.name_of(ckpt_id)
        r, s, counts = self.buffers.snapshot()
        name = checkpoint.master_part(self.index)
        data = checkpoint.pack([r.view(np.uint8), s.view(np.uint8), counts.ravel().view(np.uint8), *records])
        # rank 0's part first: it clears a crashed run's unfinished directory, which no other part may be in yet
        self.channels.write(WritePart(directory, name, data, fresh=self.index == 0))
        if self.k > 1 and self.index == 0:
            self.channels.tell(range(1, self.k), Order.CHECKPOINT, id=ckpt_id)
        part = {name: {"bytes": len(data), "records": 3 + len(records), "tuples": len(r) + len(s)}}
        mine = {**sections, "stats": self.stats.state(now), "controller": self.controller.state()}
        if self.index == 0:
            self.open = {
                "id": ckpt_id,
                "dir": directory,
                "started": now,
                "slaves": {},
                "parts": part,
                "master": mine,
                "dispatchers": {},
            }
        for rank in self.slaves:
            self.channels.order(rank, Kind.CHECKPOINT, checkpoint=ckpt_id)
        if self.index > 0:
            self.channels.tell([0], Order.SNAPSHOT, id=ckpt_id, part=part, master=mine)

    def on_snapshot(self, source: int, order: dict, now: float) -> None:
        """Another dispatcher's part of the open checkpoint is written."""
        self.open["parts"].update(order["part"])
        self.open["dispatchers"][str(source)] = order["master"]
        self._complete(now)

    def on_checkpointed(self, rank: int, c: dict, now: float) -> None:
        """A slave's part is written."""
        self.open["slaves"][rank] = c
        self.open["parts"][checkpoint.slave_part(rank)] = {
            "bytes": int(c["part_bytes"]),
            "records": None,
            "tuples": int(c["window_r"] + c["window_s"]),
        }
        self._complete(now)

    def _complete(self, now: float) -> None:
        """With every slave's and dispatcher's part written, the manifest makes the checkpoint complete."""
        ck = self.open
        if len(ck["slaves"]) < len(self.slaves) or len(ck["dispatchers"]) < self.k - 1:
            return
        result_files = {
            **self.inherited["results"],
            **{str(r): int(v["result_files"]) for r, v in ck["slaves"].items()},
        }
        aggregate_files = {
            **self.inherited[checkpoint.PENDING_AGGREGATES],
            **{str(r): int(v["aggregate_files"]) for r, v in ck["slaves"].items()},
        }
        sections = {0: ck["master"], **{int(d): m for d, m in ck["dispatchers"].items()}}
        commit = {
            "results": {f"slave-{int(r):03d}": n for r, n in result_files.items()},
            "late": {named("late", d, self.k): m["late_files"] for d, m in sections.items()},
            "archive": {named("input", d, self.k): m["archive_files"] for d, m in sections.items()},
            checkpoint.PENDING_AGGREGATES: {f"slave-{int(r):03d}": n for r, n in aggregate_files.items()},
        }
        self.channels.write(
            WriteManifest(
                ck["dir"],
                {
                    "id": ck["id"],
                    "slaves": len(self.slaves),
                    "config": public(self.plan.document),
                    "parts": ck["parts"],
                    "result_files": result_files,
                    "commit": commit,
                    "master": ck["master"],
                    "dispatchers": ck["dispatchers"],
                },
            )
        )
        self.written += 1
        self.channels.write(Publish(self.plan.output.path, commit[checkpoint.PENDING_AGGREGATES]))
        self.channels.write(Prune(self.plan.checkpoint.root, self.plan.checkpoint.keep))
        tuples = sum(p["tuples"] for p in ck["parts"].values())
        mb = sum(p["bytes"] for p in ck["parts"].values()) / 2**20
        self.channels.say(
            f"checkpoint {ck['id']} complete: {tuples:,} tuples in state, {mb:.1f} MiB, {now - ck['started']:.2f}s"
        )
        self.log.append(
            {
                "id": ck["id"],
                "seconds": round(now - self.t0, 3),
                "tuples": tuples,
                "duration": round(now - ck["started"], 3),
                "bytes": round(mb * 2**20),
            }
        )
        self.open = None
        self.on_commit(ck["master"])
        for d, m in ck["dispatchers"].items():  # their producers learn it from them (master.coordination)
            self.channels.tell([int(d)], Order.COMMITTED, source=m["source"])

    def restore(self, part: list[np.ndarray], manifest: dict, epochs_done: int) -> None:
        """The checkpoint's mini-buffers (`part`: this dispatcher's records, protocol.checkpoint.read_part),
        counters and partition map (the desks restore their own sections)."""
        r, s, counts = part[:3]
        self.buffers.restore(
            r.view(self.buffers.dtype), s.view(self.buffers.dtype), counts.view(np.int64).reshape(2, -1)
        )
        m = section(manifest, self.index)
        self.stats.restore(m["stats"])
        for rank, files in manifest["result_files"].items():  # the checkpoint's own flush came after the snapshot
            if int(rank) in self.stats.per_slave:
                self.stats.per_slave[int(rank)]["result_files"] = files
        self.inherited = {
            "results": checkpoint.inherited(manifest["result_files"], self.slaves),
            checkpoint.PENDING_AGGREGATES: checkpoint.inherited(
                {
                    str(int(p.removeprefix("slave-"))): n
                    for p, n in manifest["commit"][checkpoint.PENDING_AGGREGATES].items()
                },
                self.slaves,
            ),
        }
        self.controller.restore(m["controller"], checkpoint.slaves_of(manifest))
        self.recovered_from = manifest["id"]
        self.next_id, self.due = manifest["id"] + 1, epochs_done + self.interval

    def finish(self) -> None:
        """The run is complete: every staged partial aggregate is final."""
        if self.interval and self.index == 0:
            self.channels.write(Publish(self.plan.output.path, None))


def section(manifest: dict, index: int) -> dict:
    """Dispatcher `index`'s own part of a checkpoint manifest."""
    return manifest["master"] if index == 0 else manifest["dispatchers"][str(index)]
