"""Punctuation of the result stream: the largest P such that every result whose later tuple has ts < P
has been received from the slaves (BiStream 3.2.3: a unit processes what every dispatcher's punctuation
has passed; here the same min-over-sources rule, applied to results).

A result not yet received comes from a tuple that is either
  * in a batch sent to a slave whose results have not come back: >= that batch's smallest ts;
  * buffered at the dispatcher (also held for a moving partition-group): every tuple of a partition
    arrived after the partition's last drain, so, being on time, it is >= (max ts then) - max_delay;
  * not yet ingested: on time, so >= (max ts now) - max_delay (a late tuple joins nothing);
and the result's later tuple is at least as late as that tuple.  So P = the min of those bounds.
This avoids trusting a slave's own watermark, which a partition-group move can undercut (the consumer
gets held tuples older than watermarks it has already seen).  With several dispatchers each would feed
`sent` and its own `bound` floor; P is the min over all of them.  All bounds are event time in integer
microseconds (protocol.eventtime), POS_INF once nothing can come.
"""
from __future__ import annotations

import numpy as np

from protocol.eventtime import NEG_INF, POS_INF


class Punctuator:
    def __init__(self, partitions: int):
        self.outstanding: dict[tuple[int, int], int] = {}  #: (rank, batch seq) -> smallest ts of that batch
        self.drain_floor = np.full(partitions, NEG_INF, dtype=np.int64)  #: per partition: bound on tuples buffered since
        self.last = NEG_INF                                 #: the last punctuation handed out

    def sent(self, rank: int, seq: int, partitions: np.ndarray, min_ts: int, floor_now: int) -> None:
        """A batch left for `rank` draining `partitions`; `floor_now` = max ts ingested so far - max_delay."""
        self.outstanding[(rank, seq)] = min_ts
        self.drain_floor[partitions] = floor_now

    def rerouted(self, sources, targets) -> None:
        """Buffered tuples went from partitions `sources` to `targets` (a hot key's split or merge): they bound
        the targets' results now, so each target's floor falls to the lowest of theirs."""
        low = int(self.drain_floor[np.asarray(sources)].min())
        targets = np.asarray(targets)
        self.drain_floor[targets] = np.minimum(self.drain_floor[targets], low)

    def done(self, rank: int, seq: int) -> None:
        """Every result of `rank`'s batch `seq` has been received."""
        self.outstanding.pop((rank, seq), None)

    def bound(self, future_floor: int, buffered: np.ndarray) -> int:
        """`future_floor`: lowest ts an on-time tuple not yet ingested can have (POS_INF when the input ended);
        `buffered`: tuples buffered per partition (any shape whose last axis is the partition)."""
        held = np.asarray(buffered).reshape(-1, len(self.drain_floor)).any(axis=0)
        candidates = [future_floor, min(self.outstanding.values(), default=POS_INF)]
        if held.any():
            candidates.append(int(self.drain_floor[held].min()))
        return int(min(candidates))

    def advance(self, future_floor: int, buffered: np.ndarray) -> int | None:
        """The new punctuation if it is above the last one (punctuations are strictly increasing), else None."""
        p = self.bound(future_floor, buffered)
        if p > self.last:
            self.last = p
            return p
        return None
