"""The hot-key desk (equi-join): a heavy key gets a grid of sub-groups, a cooled one is gathered back.

Streaming HyperCube's grid for a heavy hitter (master.state.hot_key_router): at a
reorganization epoch the sketch names keys past `hotkeys.threshold` and hot
keys below half of it.  A hot key's owner splits it out of its partition (a
SPLIT order, served before any later batch), its buffered tuples are routed to
the grid, and the sub-groups but the first are queued as moves (paper 003,
IV-C) to the least loaded slaves.  A cooled key's sub-groups move back to the
owner, which merges them (MERGE).

With several dispatchers (BiStream 3.2.3; master.coordination) each routes its
share of the key, so the split or merge changes every router at one cut, fenced
as a move is: rank 0 decides from the dispatchers' sketches summed (SKETCH) and
sends HOT_HOLD; each other dispatcher holds the groups its tuples of the key go
to (the partition, or the grid once last drained together), caps its
watermarks, and answers HOT_READY once its batches sent before are joined.
Then rank 0, with the owner idle, re-routes its own buffered tuples and orders
SPLIT or MERGE; once the owner has answered it, HOT_RELEASE makes the others do
the same and route by the new grid.  No tuple of the key reaches the owner by
the old routing after the change, or by the new one before it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from master.state.balance import Move
from protocol.messages import Kind
from protocol.orders import Order
from protocol.tuples import STREAM_R, STREAM_S

if TYPE_CHECKING:
    from protocol.plan import Plan


class HotKeyDesk:
    def __init__(
        self, plan: Plan, router, sketch, buffers, controller, stats, channels, rerouted=lambda s, t: None, k: int = 1
    ):
        """`rerouted(sources, targets)`: told when buffered tuples move between partitions here (the result
        stream's punctuation must not pass them: master.result_stream); `k`: the dispatchers."""
        self.rerouted, self.k = rerouted, k
        self.threshold = plan.hotkeys.threshold
        self.router, self.sketch = router, sketch
        self.buffers, self.controller, self.stats, self.channels = buffers, controller, stats, channels
        self.pending: dict[int, float] = {}  #: keys found hot, waiting for their partition's owner
        self.cooling: dict[int, float] = {}  #: hot keys found cold, their grid being gathered back
        #: rank 0 with several dispatchers: the split or merge being fenced (HOT_HOLD fields, its share and grid
        #: size, the dispatchers not READY yet, whether its SPLIT or MERGE is ordered); one at a time
        self.fence: dict | None = None
        #: another dispatcher: key -> the HOT_HOLD fields, with the slaves whose earlier batch is not joined yet
        #: ("waiting", None until the groups are held) and whether READY went
        self.held: dict[int, dict] = {}
        self.log: list[dict] = []
        self.t0 = 0.0  #: the run's start (the pacing schedule's origin)

    @property
    def waiting(self) -> bool:
        """A split or merge waits to find its owner idle: no slave is to be sent a batch out of its slot."""
        return bool(self.pending or self.cooling or self.fence)

    @property
    def fencing(self) -> bool:
        """A split or merge is fenced across dispatchers: no checkpoint, no new move, no end until it is done."""
        return self.fence is not None or bool(self.held)

    def waiting_for(self) -> dict:
        """The keys whose split or merge waits for their owner (the stall watch names them), and a fence's
        waits."""
        fenced = {}
        if self.fence is not None:
            f = self.fence
            fenced = {
                f["key"]: f"SPLIT or MERGE answered by slave {f['owner']}"
                if f["ordered"]
                else f"READY from dispatcher(s) {sorted(f['waiting'])}, then slave {f['owner']} idle"
            }
        fenced.update({key: f"batches to slave {h['owner']} joined" for key, h in self.held.items() if not h["ready"]})
        return {"split": dict(self.pending), "merge": dict(self.cooling), "fenced": fenced}

    def find(self) -> None:
        """At a reorganization epoch: keys whose share of this epoch's input passed the threshold, and hot keys
        whose share fell below half of it (the gap keeps a key near the threshold from flapping)."""
        fenced = {self.fence["key"]} if self.fence is not None else set()  #: being split or merged
        splitting = len(fenced) if self.fence is not None and self.fence["split"] else 0
        for key, share in self.sketch.heavy(self.threshold):
            room = len(self.router.hot) + len(self.pending) + splitting < self.router.max_keys
            if key not in self.router.hot and key not in fenced and room:
                self.pending.setdefault(key, share)
        for key in self.router.hot:
            share = self.sketch.share(key)
            if key not in self.cooling and key not in fenced and share < self.threshold / 2:
                self.cooling[key] = share
        self.sketch.reset()

    def _owner(self, key: int) -> tuple[int, int]:
        partition = self.router.home(key)
        return partition, int(self.controller.partition_map[partition])

    def split(self, now: float) -> None:
        """Give each pending hot key its grid on the owner of its partition, once the owner is idle (with several
        dispatchers: once the others hold the partition, `fenced`)."""
        for key, share in list(self.pending.items()):
            partition, owner = self._owner(key)
            if self.controller.moving[partition] or self.channels.is_busy(owner) or self.fence is not None:
                continue  # next time round
            del self.pending[key]
            size = self.router.grid_for(share, len(self.controller.active))
            first = self.router.free_slot()
            if self.k > 1:
                self._hold(key, True, partition, owner, first, size * self.router.grids, share=share, size=size)
            else:
                self._split(key, share, size, first, now)

    def _regrid(self, key: int, size: int, first: int, partition: int, owner: int) -> range:
        """Route `key` to its grid from now on, its buffered tuples too; returns the grid's sub-groups."""
        self.router.promote(key, size, first)
        subs = range(first, first + self.router.hot[key][1])
        self.controller.partition_map[subs.start : subs.stop] = owner
        self.buffers.emptied(subs)
        self.rerouted([partition], subs)
        for stream, rows in enumerate(self.buffers.take_key(partition, key)):
            index, part = self.router.route(stream, rows)
            self.buffers.add(stream, rows[index], part)
        return subs

    def _split(self, key: int, share: float, size: int, first: int, now: float) -> None:
        """Rank 0: route `key` to its grid and order the owner to split it; spread the grid over the slaves."""
        partition, owner = self._owner(key)
        subs = self._regrid(key, size, first, partition, owner)
        self.channels.order(owner, Kind.SPLIT, partition=partition, hot_key=(key, first, len(subs)))
        ring = [
            owner,
            *sorted(
                (r for r in self.controller.active if r != owner),
                key=lambda r: self.stats.per_slave[r]["tuples_processed"],
            ),
        ]
        for j in range(1, len(subs)):  # round the slaves, least loaded first (a full join's two grids)
            if ring[j % len(ring)] != owner:
                self.controller.queue.append(Move(first + j, owner, ring[j % len(ring)], "hot key"))
        self.log.append(
            {
                "key": key,
                "event": "split",
                "share": round(share, 4),
                "grid": size,
                "partition": partition,
                "groups": list(subs),
                "owner": owner,
                "seconds": round(now - self.t0, 3),
            }
        )
        self.channels.say(
            f"hot key {key} ({share:.0%} of the input): split out of partition-group {partition} "
            f"into {len(subs)} sub-groups on slave {owner}, to be spread over slaves "
            f"{ring[: len(subs)]}"
        )

    def merge(self, now: float) -> None:
        """Gather each cooled key's grid back: its sub-groups move to the owner of the key's partition, then the
        owner merges them (a MERGE order, served before any later batch) and the key's buffered tuples go back
        to the partition: each tuple once, from the sub-groups the slave gathers it from (`HotKeyRouter.homes`:
        every tuple of the spread stream, one copy of each of the copied one; a full join's homes only).

        The merge waits until the sub-groups were last drained together (or hold nothing here): then every
        tuple has reached either all its sub-groups' windows or none, and what is buffered is exact.  A
        sub-group drained on its own slave before the others would otherwise lose the copies still buffered
        for them (pairs lost) or send its own twice (pairs twice).  Sub-groups still queued to spread from the
        owner stay there, and a sub-group in flight is waited for."""
        for key, share in list(self.cooling.items()):
            first, count = self.router.hot[key]
            partition, owner = self._owner(key)
            subs = range(first, first + count)
            pmap = self.controller.partition_map
            self.controller.queue[:] = [
                m for m in self.controller.queue if not (m.partition in subs and pmap[m.partition] == owner)
            ]
            queued = {m.partition for m in self.controller.queue}
            away = [g for g in subs if pmap[g] != owner]
            for g in away:
                if g not in queued and not self.controller.moving[g]:
                    self.controller.queue.append(Move(g, int(pmap[g]), owner, "hot key cooled"))
            if (
                away
                or self.controller.moving[partition]
                or self.controller.moving[first : first + count].any()
                or self.channels.is_busy(owner)
                or not self.buffers.together(subs)
                or self.fence is not None
            ):
                continue  # next time round: the owner's next batch drains all sub-groups together
            if self.k > 1:  # with several dispatchers, once the others hold the grid (`fenced`)
                self._hold(key, False, partition, owner, first, count, share=share)
            else:
                self._merge(key, share, now)
            del self.cooling[key]

    def _ungrid(self, key: int, partition: int) -> None:
        """Route `key` to its partition again, its buffered tuples too: each once, from its homes."""
        first, count = self.router.hot[key]
        subs = range(first, first + count)
        homes = [self.router.homes(stream, key) for stream in (STREAM_R, STREAM_S)]
        self.router.demote(key)
        self.rerouted(subs, [partition])
        taken = {g: self.buffers.take_key(g, key) for g in subs}
        for stream, mine in enumerate(homes):
            rows = np.concatenate([taken[g][stream] for g in mine])
            self.buffers.add(stream, rows, np.full(len(rows), partition))
        self.controller.partition_map[first : first + count] = -1  # the slots hold no group any more

    def _merge(self, key: int, share: float, now: float) -> None:
        """Rank 0: route `key` to its partition again and order the owner to gather its grid back."""
        first, count = self.router.hot[key]
        partition, owner = self._owner(key)
        self._ungrid(key, partition)
        self.channels.order(owner, Kind.MERGE, partition=partition, hot_key=(key, first, count))
        self.log.append(
            {
                "key": key,
                "event": "merge",
                "share": round(share, 4),
                "partition": partition,
                "owner": owner,
                "seconds": round(now - self.t0, 3),
            }
        )
        self.channels.say(
            f"hot key {key} cooled ({share:.0%} of the input): its {count} sub-groups gathered "
            f"back into partition-group {partition} on slave {owner}"
        )

    # -- several dispatchers: the fence (master.coordination) --------------------------------------------------
    def _hold(self, key: int, split: bool, partition: int, owner: int, first: int, count: int, **more) -> None:
        """Rank 0: the others hold the groups the key's tuples go to; its SPLIT or MERGE waits for their READY."""
        order = {"key": key, "split": split, "partition": partition, "owner": owner, "first": first, "count": count}
        self.fence = {**order, **more, "waiting": set(range(1, self.k)), "ordered": False}
        self.channels.tell(range(1, self.k), Order.HOT_HOLD, **order)

    def on_ready(self, source: int, order: dict) -> None:
        self.fence["waiting"].discard(source)

    def fenced(self, last_watermark, now: float) -> None:
        """Rank 0: order the fenced split or merge once every other dispatcher is READY and the owner idle (a
        merge's grid drained together here too).  Another dispatcher: hold the groups of each HOT_HOLD (a
        merge's grid once drained together here), and answer READY once its batches sent before are joined.
        `last_watermark(rank)`: the watermark of the last batch to `rank` (the held groups' cap)."""
        f = self.fence
        if f is not None and not f["waiting"] and not f["ordered"] and not self.channels.is_busy(f["owner"]):
            if f["split"]:
                f["ordered"] = True
                self._split(f["key"], f["share"], f["size"], f["first"], now)
            elif self.buffers.together(range(f["first"], f["first"] + f["count"])):
                f["ordered"] = True
                self._merge(f["key"], f["share"], now)
        for key, h in self.held.items():
            if h["waiting"] is None and (h["split"] or self.buffers.together(held_groups(h))):
                for g in held_groups(h):
                    self.controller.hold(Move(g, h["owner"], h["owner"], "hot key"), last_watermark(h["owner"]), now)
                h["waiting"] = {h["owner"]} if self.channels.is_busy(h["owner"]) else set()
            if h["waiting"] == set() and not h["ready"]:
                h["ready"] = True
                self.channels.tell([0], Order.HOT_READY, key=key)

    def on_regrouped(self, partition: int) -> None:
        """Rank 0: the owner answered the fenced SPLIT or MERGE: the others route by the new grid (or none)."""
        if self.fence is not None and self.fence["ordered"] and self.fence["partition"] == partition:
            self.channels.tell(range(1, self.k), Order.HOT_RELEASE, key=self.fence["key"])
            self.fence = None

    def on_hold(self, source: int, order: dict) -> None:
        """Another dispatcher: rank 0 fences a split or merge of `order["key"]` (held in `fenced`)."""
        self.held[order["key"]] = {**order, "waiting": None, "ready": False}

    def on_answer(self, rank: int) -> None:
        """`rank` answered a message: a batch sent to it before a hold has been joined."""
        for h in self.held.values():
            if h["waiting"]:
                h["waiting"].discard(rank)

    def on_release(self, order: dict) -> int:
        """Another dispatcher: the owner split or merged the key; route it anew.  Returns the owner."""
        h = self.held.pop(order["key"])
        for g in held_groups(h):
            self.controller.unhold(g)
        if h["split"]:
            self._regrid(h["key"], h["count"] // self.router.grids, h["first"], h["partition"], h["owner"])
        else:
            self._ungrid(h["key"], h["partition"])
        return h["owner"]

    def send_sketch(self) -> None:
        """Another dispatcher, at its reorganization epoch: its sketch's counters to rank 0, which decides."""
        if self.sketch.seen:
            sk = self.sketch
            self.channels.tell([0], Order.SKETCH, keys=sk.keys.tolist(), counts=sk.counts.tolist(), seen=sk.seen)
            sk.reset()

    def on_sketch(self, source: int, order: dict) -> None:
        """Rank 0: another dispatcher's counters, summed into the sketch `find` reads."""
        self.sketch.add(np.array(order["keys"], np.int64), np.array(order["counts"], np.int64), order["seen"])

    def state(self) -> list:
        return [[k, *v] for k, v in self.router.hot.items()]

    def restore(self, hot_keys: list) -> None:
        self.router.hot = {k: (first, size) for k, first, size in hot_keys}


def held_groups(order: dict) -> range:
    """The groups a HOT_HOLD holds: the key's partition for a split, its grid for a merge."""
    if order["split"]:
        return range(order["partition"], order["partition"] + 1)
    return range(order["first"], order["first"] + order["count"])
