"""The search rule: when a paced run passes, and which rate to try next.

The capacity of the cluster is its **sustained input rate**: the highest paced input rate (`source.rate`) at
which it keeps up with the pacing *and* the production delay stays bounded (paper 003 section VI: the highest
input rate before the production delay climbs).  Per slave count:

1. probe: one unpaced run (`source.rate = 0`); its throughput U is an upper bound only, since an unpaced run
   works off a backlog (the input goes into the master's buffer at once and is joined in large batches);
2. search: single paced runs.  A run *passes* iff it kept up with its pacing (`keep_up`) and its delay p95 is
   at most the delay bound (`search_verdict`); `next_rate` picks each rate;
3. sustained: repeats paced at the sustained rate (medians of delay and throughput, kept-up counts);
4. half: repeats paced at half the sustained rate (delay at half load);
5. confirm: one long run at the sustained rate (`confirm_seconds` of input, 60 s by default) whose delay must stay
   flat from its first to its last quarter (`flatness`).

A paced run counts toward a capacity only if its input lasts at least MIN_INPUT_SECONDS at its rate
(`input_verdict`): over a shorter run a cluster below the rate ends only slightly behind, so a backlog cannot show
(12M-tuple runs passed at 9.3M/s, which fell behind over 40M tuples).

Pure functions only: the cluster runner (bench.cluster) and the Spark peer (bench.spark) both use them.
"""

from __future__ import annotations

import math
import statistics

DELAY_BOUND = 1.5  # default --delay-bound: a passing run has delay p95 <= this (epochs 0.25 s)
FIRST_FRACTION = 0.5  # the search starts at this fraction of the unpaced throughput U ...
MAX_FAILS_WITHOUT_PASS = 4  # ... and halves after each failure, giving up after this many (last try U/16)
HALF_LOAD = 0.5  # the delay at half load is measured at this fraction of the sustained rate
PROBE_MARGIN = 0.9  # a pass at this fraction of U with no failure above it: the search looks above U
KEEP_UP_LAG = 0.5  # a paced run kept up iff the master's ingest never fell more than this behind schedule
KEEP_UP_SHARE = 0.1  # ... and no more than this share of its input's scheduled length (keep_up)
MIN_INPUT_SECONDS = 10.0  # a paced run counts only if its input lasts this long at its rate (tuples / rate)
CONFIRM_SECONDS = 60.0  # default --confirm-seconds: the confirmation run's input at the sustained rate
FLAT_FACTOR = 2.0  # confirmed iff the last quarter's delay p99 <= max(this x, + one epoch) the first's


def median(values) -> float | None:
    """Median of the values that exist (None and NaN are runs without that number); None if there are none."""
    xs = [float(v) for v in values if v is not None and not math.isnan(v)]
    return statistics.median(xs) if xs else None


def keep_up(tuples: int, wall: float, rate: float, pacing_lag: float, backlog: float) -> dict:
    """Did a paced run keep up?  How far behind it fell is the larger of the master's two measures (summary
    pacing_lag_max_seconds: the longest due tuples waited to be ingested; backlog_max_seconds: the longest an
    ingested tuple waited for its slave beyond one distribution epoch).  They grow as soon as the cluster
    cannot absorb the pacing rate, unlike the achieved rate whose wall time includes start and drain.  The
    backlog is needed because ingest is held back only once the mini-buffers are full, so a run can end barely
    behind at ingest with its backlog in the buffers.

    The bound is KEEP_UP_LAG, or KEEP_UP_SHARE of the input's scheduled length (tuples / rate) when that is
    less: a cluster of capacity C paced at rate r ends behind by about tuples * (1/C - 1/r), so a fixed bound
    lets a short run pass well above C; the share caps a passing rate at 1.1x C whatever the run's length
    (docs/benchmarks.md)."""
    achieved = tuples / wall if wall > 0 else 0.0
    bound = min(KEEP_UP_LAG, KEEP_UP_SHARE * tuples / rate)
    behind = max(pacing_lag, backlog)
    return {
        "achieved_rate": round(achieved, 1),
        "ratio": round(achieved / rate, 3),
        "lag_seconds": round(behind, 3),
        "lag_bound": round(bound, 3),
        "kept_up": behind <= bound,
    }


def search_verdict(run: dict, delay_bound: float) -> tuple[bool, str]:
    """Does a paced run pass the search's test: kept up with its pacing AND delay p95 <= delay_bound?

    Returns (passed, why) with why 'pass', 'fell behind', 'p95 > bound' (both reasons joined by '; ').
    A run without a delay p95 (no results) cannot show a bounded delay, so it fails.
    """
    why = []
    if not run["kept_up"]:
        why.append("fell behind")
    p95 = run["delay_p95"]
    if p95 is None or (isinstance(p95, float) and math.isnan(p95)):
        why.append("no delay p95")
    elif p95 > delay_bound:
        why.append(f"p95 {p95:.2f}s > {delay_bound:g}s")
    return (not why, "; ".join(why) or "pass")


def input_verdict(tuples: int, rate: float) -> dict:
    """How long a paced run's input lasts at its rate, and whether that is long enough to count."""
    seconds = tuples / rate
    return {"input_seconds": round(seconds, 2), "long_enough": seconds >= MIN_INPUT_SECONDS}


def counted_verdict(run: dict, delay_bound: float) -> tuple[bool, str]:
    """The search's test (`search_verdict`) for a run that measures capacity: a run whose input is shorter than
    MIN_INPUT_SECONDS is reported but cannot pass."""
    ok, why = search_verdict(run, delay_bound)
    if run["long_enough"]:
        return ok, why
    short = f"too short to count ({run['input_seconds']:.1f} s of input < {MIN_INPUT_SECONDS:g} s)"
    return False, short if ok else f"{why}; {short}"


def flatness(first_p99: float | None, last_p99: float | None, epoch: float) -> dict:
    """Did the delay stay flat over the confirmation run?  Its last quarter's p99 may exceed the first's by at most
    FLAT_FACTOR times or one distribution epoch, whichever allows more (a small first p99 would make FLAT_FACTOR
    alone tighter than the epoch's granularity).  A quarter without results cannot show it."""
    if first_p99 is None or last_p99 is None or math.isnan(first_p99) or math.isnan(last_p99):
        return {"first_p99": first_p99, "last_p99": last_p99, "limit": None, "flat": False}
    limit = max(FLAT_FACTOR * first_p99, first_p99 + epoch)
    return {"first_p99": first_p99, "last_p99": last_p99, "limit": round(limit, 4), "flat": last_p99 <= limit}


def next_rate(trail: list[tuple[float, bool]], unpaced: float, steps: int) -> int | None:
    """The next paced rate for the search, given the (rate, passed) runs so far; None when the search is over.

    * no run yet: FIRST_FRACTION * unpaced;
    * nothing passed yet: half the lowest failing rate, or None after MAX_FAILS_WITHOUT_PASS failures;
    * else the geometric mean of lo = the highest passing rate and hi = the lowest failing rate above lo
      (the unpaced throughput when none failed above lo; 2 * lo once lo is within PROBE_MARGIN of it: the
      probe was slow, start and drain weigh on an unpaced run's throughput);
    * None once `steps` runs are done, or when lo and hi are so close the next integer rate repeats one.
    """
    if unpaced <= 0:
        raise ValueError(f"the unpaced throughput must be positive, got {unpaced}")
    if len(trail) >= steps:
        return None
    if not trail:
        return round(FIRST_FRACTION * unpaced)
    passed = [r for r, ok in trail if ok]
    if not passed:
        return None if len(trail) >= MAX_FAILS_WITHOUT_PASS else round(min(r for r, _ in trail) / 2)
    lo = max(passed)
    hi = min((r for r, ok in trail if not ok and r > lo), default=unpaced if lo < PROBE_MARGIN * unpaced else 2 * lo)
    rate = round(math.sqrt(lo * hi))
    return None if rate <= lo or rate >= hi else rate


def sustained_rate(trail: list[tuple[float, bool]]) -> int:
    """The highest passing rate of the search; 0 if no run passed."""
    return round(max((r for r, ok in trail if ok), default=0))


def confirmed(point: dict) -> bool:
    """Is the point's sustained rate a capacity?  Most repeats at it passed the search's test (a rate that one
    search run passed and most repeats did not is luck on a noisy machine), and its long confirmation run passed
    with a flat delay.  The targets count only confirmed rates; a point without a confirmation run (quick, or
    --confirm-seconds 0) confirms nothing."""
    runs, confirm = point["sustained"]["runs"], point.get("confirm")
    return 2 * sum(bool(r["passed"]) for r in runs) > len(runs) > 0 and bool(confirm and confirm["confirmed"])


def bracket(trail: list[tuple[float, bool]]) -> tuple[int, int | None]:
    """(sustained rate, lowest failing rate above it or None): where the search left the true sustained rate."""
    lo = sustained_rate(trail)
    return lo, min((round(r) for r, ok in trail if not ok and r > lo), default=None)
