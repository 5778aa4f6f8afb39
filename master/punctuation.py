"""Punctuation of the result stream: the largest P such that every result whose stream time is < P has been
received from the slaves (BiStream 3.2.3: a unit processes what every dispatcher's punctuation has passed;
here the same min-over-sources rule, applied to results).

A result's stream time: a pair's is the ts of its later tuple; a row without a partner (outer and anti joins)
has the time it became final, `protocol.predicates.final_time` of its tuple (ts + window: the first watermark
above it decides the row, slave.join); a semi row (an R row with a partner, emitted at its first match) has
the stream time of that first pair.

**Pairs.**  A pair not yet received comes from a tuple that is either
  * in a batch sent to a slave whose results have not come back: >= that batch's smallest ts;
  * buffered at the dispatcher (also held for a moving partition-group): every tuple of a partition
    arrived after the partition's last drain, so, being on time, it is >= (max ts then) - max_delay;
  * not yet ingested: on time, so >= (max ts now) - max_delay (a late tuple joins nothing);
and the pair's later tuple is at least as late as that tuple.  So P = the min of those bounds (`base`).
This avoids trusting a slave's own watermark, which a partition-group move can undercut (the consumer
gets held tuples older than watermarks it has already seen).  A semi row is emitted with its first pair,
in the same batch, so it is bounded as that pair is.

**Rows alone** (`lead` given: left, right, full, anti).  A slave decides them after each batch B with the
watermark it expires by, W(B) (the min over the dispatchers' last watermarks, lowered at a move's install),
and sends W(B) with B's last results message: a row is emitted in the first batch whose W is above its final
time, so every row still undecided after B has final time >= W(B).  Per partition(-group) p, `lone_floor[p]`
is W(B) of the latest-sent batch B that listed p and whose results came back (`done`).  Claim: every row
alone not yet received has stream time >= P = min(base + min(0, lead), lone_floor[p] over the partitions that
may hold rows).  Take such a row, of tuple t in partition p:
  * t not yet joined (not ingested, buffered, or in a batch whose results are not back): final time >=
    t.ts + lead >= base + min(0, lead) (final_time(ts) = ts + lead, lead = window >= 0 today);
  * t stored at a slave, and B the batch setting lone_floor[p]: if t was in p when B was joined, it was
    undecided after B (else it was emitted in B or before, and received), so its final time >= W(B).  If t
    came into p later as a fresh tuple, t.ts >= W(B): the engine's expiry rule (BiStream, Theorem 1 with
    the move floors) is that no tuple reaching a group after B is below W(B), or B's expiry could have
    dropped its partners; its final time >= t.ts >= W(B).  If t came in by a hot key's split or merge
    (`rerouted`), the target's floor was lowered to its source's, and batches sent before the reroute may
    no longer set it (`lone_stamp`); a later one is joined after the SPLIT / MERGE order (one FIFO channel).
    A move carries the group whole: its floor stays p's, and no batch lists p while it is in flight;
  * a batch listing p is joined while p is on that slave: the move protocol holds p before its MOVE and
    routes it to the consumer only once installed; results of an older batch that come back late do not
    override a newer one's floor (`lone_stamp`).
Each dispatcher's stream carries the rows decided in its own batches; a dispatcher that never sent p a batch
cannot emit p's rows, and one that does lists p, which sets its floor to NEG_INF until that batch is back
(`may_hold`).  At the end of input each slave answers every STOP with a last results message (the final one
with every row still undecided); once all are back nothing more comes on this stream: P = POS_INF (`close`
in master.result_stream).  With several dispatchers the stream's punctuation is the min over theirs.

All bounds are event time in integer microseconds (protocol.eventtime), POS_INF once nothing can come.
"""

from __future__ import annotations

import numpy as np

from protocol.eventtime import NEG_INF, POS_INF


class Punctuator:
    def __init__(self, partitions: int, lead: int | None = None):
        """`lead`: the least final time of a row alone minus its ts (protocol.predicates.final_time over the kept
        streams), None when no row is decided alone by the watermark (inner and semi joins)."""
        #: (rank, batch seq) -> (smallest ts of that batch, the partitions it listed, its send number)
        self.outstanding: dict[tuple[int, int], tuple[int, np.ndarray, int]] = {}
        #: per partition: bound on tuples buffered since
        self.drain_floor = np.full(partitions, NEG_INF, dtype=np.int64)
        self.last = NEG_INF  #: the last punctuation handed out
        self.lead = lead
        self.lone_floor = np.full(partitions, NEG_INF, dtype=np.int64)  #: per partition: bound on its rows undecided
        self.lone_stamp = np.zeros(partitions, dtype=np.int64)  #: the send number that set lone_floor
        self.holds = np.zeros(partitions, dtype=bool)  #: partitions that may hold rows alone of this stream
        self.sends = 0

    def may_hold(self, partitions: np.ndarray) -> None:
        """`partitions` (a mask or indices) may hold stored rows (a recovered run's groups): no floor above
        NEG_INF for them until a batch listing them is back."""
        self.holds[partitions] = True

    def sent(self, rank: int, seq: int, partitions: np.ndarray, min_ts: int, floor_now: int) -> None:
        """A batch (or a STOP: min_ts POS_INF) left for `rank` listing `partitions`; `floor_now` = max ts ingested
        so far - max_delay."""
        self.sends += 1
        partitions = np.asarray(partitions, dtype=np.int64)
        self.outstanding[(rank, seq)] = (min_ts, partitions, self.sends)
        self.drain_floor[partitions] = floor_now
        fresh = partitions[~self.holds[partitions]]
        self.lone_floor[fresh] = NEG_INF
        self.holds[fresh] = True

    def rerouted(self, sources, targets) -> None:
        """Buffered and stored tuples went from partitions `sources` to `targets` (a hot key's split or merge):
        they bound the targets' results now, so each target's floors fall to the lowest of theirs, and no batch
        sent before this sets a target's floor of rows alone any more."""
        sources, targets = np.asarray(sources), np.asarray(targets)
        low = int(self.drain_floor[sources].min())
        self.drain_floor[targets] = np.minimum(self.drain_floor[targets], low)
        low = int(self.lone_floor[sources].min())
        self.lone_floor[targets] = np.where(self.holds[targets], np.minimum(self.lone_floor[targets], low), low)
        self.holds[targets] = True
        self.lone_stamp[targets] = self.sends

    def done(self, rank: int, seq: int, watermark: int = NEG_INF) -> None:
        """Every result of `rank`'s batch `seq` has been received; the slave decided rows alone by `watermark`."""
        entry = self.outstanding.pop((rank, seq), None)
        if entry is None:
            return
        _, partitions, stamp = entry
        newer = partitions[self.lone_stamp[partitions] < stamp]
        self.lone_floor[newer] = watermark
        self.lone_stamp[newer] = stamp

    def bound(self, future_floor: int, buffered: np.ndarray) -> int:
        """`future_floor`: lowest ts an on-time tuple not yet ingested can have (POS_INF when the input ended);
        `buffered`: tuples buffered per partition (any shape whose last axis is the partition)."""
        held = np.asarray(buffered).reshape(-1, len(self.drain_floor)).any(axis=0)
        candidates = [future_floor, min((ts for ts, _, _ in self.outstanding.values()), default=POS_INF)]
        if held.any():
            candidates.append(int(self.drain_floor[held].min()))
        p = int(min(candidates))
        if self.lead is None:
            return p
        p += min(0, self.lead)
        return int(min(p, self.lone_floor[self.holds].min(initial=POS_INF)))

    def advance(self, future_floor: int, buffered: np.ndarray) -> int | None:
        """The new punctuation if it is above the last one (punctuations are strictly increasing), else None."""
        p = self.bound(future_floor, buffered)
        if p > self.last:
            self.last = p
            return p
        return None

    def end(self) -> int | None:
        """Every batch and STOP of this stream is answered, so nothing more comes on it: POS_INF, unless handed
        out already."""
        if self.last < POS_INF:
            self.last = POS_INF
            return POS_INF
        return None
