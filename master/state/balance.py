"""The controller's balancing decision at a reorganization epoch (paper 003, IV-C and V-A), pure logic.

Load of a slave = its average buffer occupancy over the reorganization epoch:
the tuples it had to buffer at each distribution epoch (the batch it received),
averaged, over its buffer capacity.  Slaves above `supplier_threshold` are
suppliers, below `consumer_threshold` consumers, the rest neutral.  One scan
pairs the most loaded supplier with the least loaded consumer, and so on; each
supplier yields one partition-group.  The degree of declustering follows the
same classification: no supplier at all -> one slave fewer (it hands all its
groups over first: the slave with the highest measured cost per tuple, i.e. on
the busiest host, else the least loaded); more than `gamma` x consumers
suppliers -> one slave more.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dataclasses import dataclass

import numpy as np

if TYPE_CHECKING:
    from protocol.plan import Balance


@dataclass(frozen=True)
class Move:
    partition: int
    supplier: int
    consumer: int
    reason: str  # "balance", "grow" (to a newly active slave) or "shrink" (from a leaving slave)


def classify(
    occupancy: dict[int, float], supplier_threshold: float, consumer_threshold: float
) -> tuple[list[int], list[int]]:
    """(suppliers by load descending, consumers by load ascending)."""
    suppliers = sorted((r for r, o in occupancy.items() if o > supplier_threshold), key=lambda r: -occupancy[r])
    consumers = sorted((r for r, o in occupancy.items() if o < consumer_threshold), key=lambda r: occupancy[r])
    return suppliers, consumers


def choose_group(
    groups: dict[int, float],
    supplier_load: float,
    consumer_load: float,
    choice: str,
    rng: np.random.Generator,
    supplier_cost: float = 1.0,
    consumer_cost: float = 1.0,
) -> int | None:
    """Which partition-group a supplier yields: a random one (the paper), or the largest that fits, i.e. whose
    load moved over does not leave the consumer more loaded than the supplier (so a move cannot just swap the
    overload); None when there is nothing to give.

    Loads are tuples; the costs (seconds per tuple on each slave) turn them into work time, so on a busy host,
    whose slave joins the same tuples more slowly, a supplier with no more tuples than its consumer can still
    give: g fits iff consumer_load*cc + g*cc <= supplier_load*cs - g*cs (equal costs: g <= (s - c) / 2)."""
    if not groups:
        return None
    if choice == "random":
        return int(rng.choice(sorted(groups)))
    room = (supplier_load * supplier_cost - consumer_load * consumer_cost) / (supplier_cost + consumer_cost)
    fits = [p for p, load in groups.items() if load <= room]
    return max(fits, key=lambda p: (groups[p], -p)) if fits else None


def plan(
    occupancy: dict[int, float],
    group_load: dict[int, dict[int, float]],
    inactive: list[int],
    balance: Balance,
    rng: np.random.Generator,
    cost: dict[int, float] | None = None,
) -> tuple[list[Move], int | None, int | None]:
    """Moves for this reorganization epoch, plus the slave to activate and the slave to retire (or None).

    `occupancy` covers the active slaves; `group_load[r]` maps each partition of slave r to its tuples
    in this reorganization epoch; `cost[r]`, where known, is slave r's measured seconds per tuple joined
    (a slave without one, e.g. a joining slave, is taken at the median of the known costs).
    """
    known = sorted(c for c in (cost or {}).values() if c > 0)
    typical = known[len(known) // 2] if known else 1.0
    per_tuple = lambda r: (cost or {}).get(r) or typical
    suppliers, consumers = classify(occupancy, balance.supplier_threshold, balance.consumer_threshold)
    load = {r: float(sum(group_load.get(r, {}).values())) for r in occupancy}
    moves: list[Move] = []
    joining = leaving = None
    if balance.declustering and not suppliers and len(occupancy) > 1:
        # the slave on the busiest host (highest cost per tuple, in steps of 10% of the typical cost, so that
        # noise does not decide) leaves; among equals the least loaded one (the paper's rule)
        leaving = min(occupancy, key=lambda r: (-round(per_tuple(r) / typical, 1), occupancy[r], load[r], -r))
        others = sorted((r for r in occupancy if r != leaving), key=lambda r: (load[r], r))
        given = dict.fromkeys(others, 0.0)
        for p, g in sorted(group_load.get(leaving, {}).items(), key=lambda pg: -pg[1]):
            to = min(others, key=lambda r: (load[r] + given[r], r))
            given[to] += g
            moves.append(Move(p, leaving, to, "shrink"))
        return moves, None, leaving
    if balance.declustering and inactive and len(suppliers) > balance.gamma * len(consumers):
        joining = inactive[0]
        consumers = [joining] + consumers
        load[joining] = 0.0
    for supplier, consumer in zip(suppliers, consumers):
        p = choose_group(
            group_load.get(supplier, {}),
            load[supplier],
            load[consumer],
            balance.choice,
            rng,
            per_tuple(supplier),
            per_tuple(consumer),
        )
        if p is not None:
            moves.append(Move(p, supplier, consumer, "grow" if consumer == joining else "balance"))
    return moves, joining if any(m.consumer == joining for m in moves) else None, None
