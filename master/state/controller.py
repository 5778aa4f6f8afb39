"""The controller of the master (paper 003, IV-A): load bookkeeping, reorganization, moves in flight.

Between two reorganization epochs it records, per active slave, its buffer at
the end of each distribution epoch (at its slot: the tuples it has not joined
yet, i.e. its batch still in progress plus what waits for it at the master;
0 when it is idle and takes its new batch) and the tuples sent per partition-group.
At a reorganization epoch `balance.plan` decides the
moves and the change of the active set; the controller then runs each move as
the paper's protocol: MOVE order to the supplier once it is idle, the state goes
supplier -> consumer, the consumer acknowledges, and only then does the
partition map change and the master send the tuples it held for that group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from master.state.balance import Move, plan
from protocol.checkpoint import reassign
from protocol.eventtime import POS_INF

if TYPE_CHECKING:
    from protocol.plan import Balance


class Controller:
    def __init__(self, balance: Balance, slaves: list[int], partitions: int, share: int = 1, live: int | None = None):
        """`live`: partition ids from it on are hot-key sub-group slots (master.state.hot_key_router), mapped to no
        slave (-1) until a hot key uses them: nothing must route to, balance or move a group that no slave holds."""
        self.balance = balance
        #: with k dispatchers rank 0 sees a 1/k share of every slave's input and scales its samples by k
        self.share = share
        self.enabled = self.balance.enabled
        n = self.balance.initial_slaves or len(slaves)
        self.slaves = list(slaves)
        self.active: list[int] = slaves[:n]
        self.inactive: list[int] = slaves[n:]
        self.partition_map = np.array([self.active[p % n] for p in range(partitions)])  #: partition -> rank
        self.partition_map[partitions if live is None else live :] = -1
        self.moving = np.zeros(partitions, dtype=bool)  #: groups whose state is in flight (held at the master)
        self.queue: list[Move] = []
        self.in_flight: dict[int, tuple[Move, float, int, int]] = {}  #: partition -> (move, start, reorg, watermark)
        self.retiring: set[int] = set()
        self.reorganizations = 0
        self.moves_log: list[dict] = []
        self.active_log: list[dict] = []
        self.occupancy_log: list[dict] = []  #: per reorganization, every active slave's occupancy (why it moved)
        self.rng = np.random.default_rng(self.balance.seed)
        self.t0 = 0.0  #: the run's start (the pacing schedule's origin): the logs' seconds count from it
        self._reset_epoch()

    def state(self) -> dict:
        """What a checkpoint keeps (taken with no move in flight; queued moves are only plans and are dropped)."""
        return {
            "partition_map": self.partition_map.tolist(),
            "active": list(self.active),
            "inactive": list(self.inactive),
            "retiring": sorted(self.retiring),
            "reorganizations": self.reorganizations,
            "moves_log": self.moves_log,
            "active_log": self.active_log,
        }

    def restore(self, state: dict, then: list[int]) -> None:
        """A checkpoint taken on slaves `then`: on others its groups are placed anew (protocol.checkpoint.reassign)
        and every slave of this run is active."""
        self.partition_map = reassign(np.array(state["partition_map"]), self.slaves, then)
        if sorted(then) == sorted(self.slaves):
            self.active, self.inactive = list(state["active"]), list(state["inactive"])
            self.retiring = set(state["retiring"])
        else:
            self.active, self.inactive, self.retiring = list(self.slaves), [], set()
        self.reorganizations = state["reorganizations"]
        self.moves_log, self.active_log = state["moves_log"], state["active_log"]
        self._reset_epoch()

    def _reset_epoch(self) -> None:
        self.buffer_samples: dict[int, list[int]] = {r: [] for r in self.active}
        self.group_load = np.zeros(len(self.partition_map), dtype=np.int64)
        self.work: dict[int, list[float]] = {}  #: rank -> [tuples joined, seconds spent joining] this epoch

    @property
    def busy(self) -> bool:
        return bool(self.queue or self.in_flight)

    def partitions_of(self, rank: int) -> np.ndarray:
        """The groups `rank` is sent now: mapped to it and not being moved."""
        return np.flatnonzero((self.partition_map == rank) & ~self.moving)

    def holders(self) -> list[int]:
        """The slaves a partition-group is mapped to (a moving one: to its supplier until installed)."""
        return np.unique(self.partition_map[self.partition_map >= 0]).tolist()

    def on_slot(self, rank: int, unjoined: int) -> None:
        """`rank`'s buffer at the end of a distribution epoch: tuples it has not joined yet."""
        self.buffer_samples.setdefault(rank, []).append(unjoined * self.share)

    def on_batch(self, partitions: np.ndarray, sizes: np.ndarray) -> None:
        """A batch left: `sizes` tuples per partition of `partitions`."""
        self.group_load[partitions] += sizes * self.share

    def on_work(self, rank: int, tuples: int, seconds: float) -> None:
        """A slave's report: it joined `tuples` in `seconds` (its join's wall time, longer on a busy host)."""
        w = self.work.setdefault(rank, [0, 0.0])
        w[0] += tuples
        w[1] += seconds

    def cost(self) -> dict[int, float]:
        """Seconds per tuple joined of every slave that joined something this reorganization epoch."""
        return {r: s / t for r, (t, s) in self.work.items() if t > 0 and s > 0}

    def occupancy(self) -> dict[int, float]:
        """Average buffer occupancy of every active slave over this reorganization epoch (paper IV-C)."""
        cap = self.balance.buffer_capacity
        return {r: (float(np.mean(self.buffer_samples.get(r) or [0])) / cap) for r in self.active}

    def reorganize(self, now: float) -> None:
        """Decide this epoch's moves and active-set change (skipped while earlier moves are still running)."""
        self.reorganizations += 1
        self.occupancy_log.append(
            {
                "reorganization": self.reorganizations,
                "occupancy": {r: round(o, 4) for r, o in self.occupancy().items()},
                "us_per_tuple": {r: round(c * 1e6, 2) for r, c in self.cost().items()},
            }
        )
        if self.enabled and not self.busy:
            group_load = {
                r: {int(p): float(self.group_load[p]) for p in np.flatnonzero(self.partition_map == r)}
                for r in self.active
            }
            moves, joining, leaving = plan(
                self.occupancy(), group_load, self.inactive, self.balance, self.rng, self.cost()
            )
            if joining is not None:
                self.inactive.remove(joining)
                self.active.append(joining)
                self._log_active(now, "join", joining)
            self.queue.extend(moves)
            if leaving is not None:
                self.retiring.add(leaving)
                self._retire_if_empty(leaving, now)
        self._reset_epoch()

    def watermark_cap(self) -> int:
        """The highest watermark a slave may be sent while groups are in flight.

        Tuples of a moving group are held at the master, so a watermark taken after they arrived would let
        the consumer expire the installed group's blocks before those tuples have joined them.  The held
        tuples are those that arrived after the supplier's last batch was drained, so, being on time, none is
        below the watermark that batch carried.  In microseconds; POS_INF when no group is in flight.
        """
        return min((w for *_, w in self.in_flight.values()), default=POS_INF)

    def next_orders(self, idle, last_watermark, now: float) -> list[Move]:
        """Queued moves whose supplier and consumer are both idle now (one per supplier), marked in flight;
        `last_watermark(rank)` is the watermark of the last batch drained for `rank`.

        The consumer must be idle too: a batch already on its way to it carries a watermark taken before the
        move, not capped by `watermark_cap`; the consumer could receive the group's state first (it comes from
        another rank, so MPI does not order the two) and then expire installed blocks that the held tuples
        still have to join.  Every batch it gets after the order is capped.
        """
        orders, taken = [], set()
        for move in list(self.queue):
            if move.supplier in taken or not idle(move.supplier) or not idle(move.consumer):
                continue
            taken.add(move.supplier)
            self.queue.remove(move)
            self.hold(move, last_watermark(move.supplier), now)
            orders.append(move)
        return orders

    def hold(self, move: Move, watermark: int, now: float) -> None:
        """From now on the group's tuples wait here and no watermark above `watermark` leaves (see
        `watermark_cap`); every dispatcher does this for every move (master.coordination)."""
        self.moving[move.partition] = True
        self.in_flight[move.partition] = (move, now, self.reorganizations, watermark)

    def unhold(self, partition: int) -> None:
        """The group held for a hot key's split or merge on its own slave goes out again (no move to log)."""
        del self.in_flight[partition]
        self.moving[partition] = False

    def on_installed(self, partition: int, tuples: int, now: float) -> Move:
        """The consumer installed the group: route it there from now on."""
        move, started, epoch, _ = self.in_flight.pop(partition)
        self.partition_map[partition] = move.consumer
        self.moving[partition] = False
        self.moves_log.append(
            {
                "reorganization": epoch,
                "partition": partition,
                "from": move.supplier,
                "to": move.consumer,
                "reason": move.reason,
                "tuples_moved": tuples,
                "seconds": round(now - started, 4),
            }
        )
        self._retire_if_empty(move.supplier, now)
        return move

    def _retire_if_empty(self, rank: int, now: float) -> None:
        """A leaving slave leaves the active set once it has handed over its last group (paper V-A)."""
        if rank in self.retiring and not (self.partition_map == rank).any():
            self.retiring.discard(rank)
            self.active.remove(rank)
            self.inactive.append(rank)
            self._log_active(now, "leave", rank)

    def _log_active(self, now: float, action: str, rank: int) -> None:
        self.active_log.append(
            {
                "reorganization": self.reorganizations,
                "action": action,
                "rank": rank,
                "active_after": sorted(self.active),
                "seconds": round(now - self.t0, 3),
            }
        )
