"""`python -m bench.join_types [--quick] [--repeats 3] [--slaves 2] [--out bench-report]`: a left join against the \
inner join.

The targets: a left join sustains at least 80% of the inner join's rate on the same workload, and its
rows without a partner come out within one distribution epoch of the moment they become final.

- Rate: the same unpaced runs of the default workload with `join.type` inner and left, alternated, their in-run
  rates (tuples/s) and the ratio of the medians (target >= 0.8).
- Timeliness: one left join paced in real time (source.rate = both streams' generator.rate, so a second of
  event time takes a second).  An R row without a partner becomes final when the watermark passes its ts +
  upper (join.upper, or join.window), that is when a tuple with ts >= its ts + upper + max_delay has arrived:
  upper + max_delay seconds after the row itself arrived.  Its `delay` column counts from its arrival, so
  delay - (upper + max_delay) is how long after becoming final it came out (target: within
  epochs.distribution).  Rows decided only by the end of input (ts within upper + max_delay of the last) are
  left out.
Output: join_types.md, join_types.json.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.compute as pc

from bench.ab import Comparison, parser
from bench.cluster import RunFailed, run_cluster
from bench.tables import fmt
from protocol.plan import load_plan
from protocol.eventtime import PER_SECOND
from protocol.output import LEFT_UNMATCHED, read_tables

RATE_TARGET = 0.8


def after_final(out: Path, wait: float) -> dict:
    """How long after becoming final (`wait` seconds after arriving) the R rows without a partner came out."""
    t = read_tables(out / "results", ["r_ts", "delay", "kind"])
    lone = t.filter(pc.equal(t["kind"], LEFT_UNMATCHED))
    ts, delay = lone["r_ts"].to_numpy(), lone["delay"].to_numpy()
    during = ts < ts.max() - wait if len(ts) else ts.astype(bool)  # not decided by the end of input
    late = delay[during] - wait
    p50, p99 = (float(np.percentile(late, q)) if len(late) else None for q in (50, 99))
    return {
        "rows": int(during.sum()),
        "after_final_p50": p50,
        "after_final_p99": p99,
        "after_final_max": float(late.max()) if len(late) else None,
    }


def main(argv: list[str]) -> int:
    a = parser("python -m bench.join_types", __doc__, 15.0, 30.0, 3).parse_args(argv)
    workload = [f"generator.duration={15.0 if a.quick else 30.0}"]
    plan = load_plan(None, workload)
    ab = Comparison(
        "python -m bench.join_types " + " ".join(argv),
        a,
        workload,
        {"inner": ["join.type=inner"], "left": ["join.type=left"]},
    )
    try:
        with tempfile.TemporaryDirectory(prefix="streamjoin-join-types-") as tmp:
            ab.run(Path(tmp))
            rate = 2 * plan.generator.rate  # real time: a second of event time a second
            wait = (plan.join.upper + plan.join.max_delay) / PER_SECOND
            s = run_cluster(
                a.slaves + 1,
                [*workload, "join.type=left", f"source.rate={rate}"],
                Path(tmp) / "paced",
                a.timeout,
                keep=lambda out: after_final(out, wait),
            )
    except RunFailed as e:
        print(f"bench.join_types: a run failed: {e}", file=sys.stderr)
        return 1
    t = ab.data["timeliness"] = {"rate": rate, "epoch": plan.epochs.distribution, **s["kept"]}
    met = t["after_final_p99"] is not None and t["after_final_p99"] <= t["epoch"]
    ab.write(
        "join_types",
        "A left join against the inner join",
        "join.type",
        [
            ab.verdict(RATE_TARGET),
            "",
            f"Rows without a partner, paced in real time ({t['rate']:,.0f} tuples/s): {t['rows']:,} came out p50 "
            f"{fmt(t['after_final_p50'], '.3f')} s, p99 {fmt(t['after_final_p99'], '.3f')} s after becoming final "
            f"(target: within one distribution epoch, {t['epoch']:g} s: {'met' if met else 'NOT met'}).",
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
