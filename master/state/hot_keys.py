"""The hot-key desk (equi-join): a heavy key gets a grid of sub-groups, a cooled one is gathered back.

Streaming HyperCube's grid for a heavy hitter (master.state.hot_key_router): at a
reorganization epoch the sketch names keys past `hotkeys.threshold` and hot
keys below half of it.  A hot key's owner splits it out of its partition (a
SPLIT order, served before any later batch), its buffered tuples are routed to
the grid, and the sub-groups but the first are queued as moves (paper 003,
IV-C) to the least loaded slaves.  A cooled key's sub-groups move back to the
owner, which merges them (MERGE).
"""

from __future__ import annotations

import numpy as np

from master.state.balance import Move
from protocol.messages import Kind
from protocol.tuples import STREAM_R, STREAM_S


class HotKeyDesk:
    def __init__(self, cfg: dict, router, sketch, buffers, controller, stats, channels, rerouted=lambda s, t: None):
        """`rerouted(sources, targets)`: told when buffered tuples move between partitions here (the result
        stream's punctuation must not pass them: master.result_stream)."""
        self.rerouted = rerouted
        self.threshold = cfg["hotkeys"]["threshold"]
        self.router, self.sketch = router, sketch
        self.buffers, self.controller, self.stats, self.channels = buffers, controller, stats, channels
        self.pending: dict[int, float] = {}  #: keys found hot, waiting for their partition's owner
        self.cooling: dict[int, float] = {}  #: hot keys found cold, their grid being gathered back
        self.log: list[dict] = []
        self.t0 = 0.0  #: the run's start (the pacing schedule's origin)

    @property
    def waiting(self) -> bool:
        """A split or merge waits to find its owner idle: no slave is to be sent a batch out of its slot."""
        return bool(self.pending or self.cooling)

    def waiting_for(self) -> dict:
        """The keys whose split or merge waits for their owner (the stall watch names them)."""
        return {"split": dict(self.pending), "merge": dict(self.cooling)}

    def find(self) -> None:
        """At a reorganization epoch: keys whose share of this epoch's input passed the threshold, and hot keys
        whose share fell below half of it (the gap keeps a key near the threshold from flapping)."""
        for key, share in self.sketch.heavy(self.threshold):
            if key not in self.router.hot and len(self.router.hot) + len(self.pending) < self.router.max_keys:
                self.pending.setdefault(key, share)
        for key in self.router.hot:
            share = self.sketch.share(key)
            if key not in self.cooling and share < self.threshold / 2:
                self.cooling[key] = share
        self.sketch.reset()

    def _owner(self, key: int) -> tuple[int, int]:
        partition = self.router.home(key)
        return partition, int(self.controller.partition_map[partition])

    def split(self, now: float) -> None:
        """Give each pending hot key its grid on the owner of its partition, once the owner is idle."""
        for key, share in list(self.pending.items()):
            partition, owner = self._owner(key)
            if self.controller.moving[partition] or self.channels.is_busy(owner):
                continue  # next time round
            del self.pending[key]
            size = self.router.grid_for(share, len(self.controller.active))
            first = self.router.promote(key, size)
            subs = range(first, first + self.router.hot[key][1])
            self.controller.partition_map[subs.start : subs.stop] = owner
            self.buffers.emptied(subs)
            self.rerouted([partition], subs)
            for stream, rows in enumerate(self.buffers.take_key(partition, key)):
                index, part = self.router.route(stream, rows)
                self.buffers.add(stream, rows[index], part)
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
            ):
                continue  # next time round: the owner's next batch drains all sub-groups together
            del self.cooling[key]
            homes = [self.router.homes(stream, key) for stream in (STREAM_R, STREAM_S)]
            self.router.demote(key)
            self.rerouted(subs, [partition])
            taken = {g: self.buffers.take_key(g, key) for g in subs}
            for stream, mine in enumerate(homes):
                rows = np.concatenate([taken[g][stream] for g in mine])
                self.buffers.add(stream, rows, np.full(len(rows), partition))
            self.channels.order(owner, Kind.MERGE, partition=partition, hot_key=(key, first, count))
            pmap[first : first + count] = -1  # the slots hold no group any more
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

    def state(self) -> list:
        return [[k, *v] for k, v in self.router.hot.items()]

    def restore(self, hot_keys: list) -> None:
        self.router.hot = {k: (first, size) for k, first, size in hot_keys}
