"""`python -m bench.query [--quick] [--repeats 3] [--slaves 2] [--out bench-report]`: the join said as a Spark SQL
query, with a condition on the pair and a filter, against the same query without them.

The default workload is written once as two declared streams (bench.payload's files: id, key, ts and the payload
`label`, `amount`, `qty`, with `qty` = id mod 1000), and unpaced runs alternate five modes on them:

- `query`: the equi-join as a query, `SELECT` of each side's id, key and time (the baseline);
- `every`: the same with a condition on the pair that keeps every pair (`a.qty + b.qty >= 0`): its terms travel
  in the tuple records and the slaves test it on every candidate pair (target: at least 0.85 of `query`);
- `half`: a condition that keeps about half of the pairs (`a.qty <= b.qty`);
- `filter`: a filter that keeps 10% of stream R (`WHERE a.qty < 100`), dropped where it is read (target: faster
  than `query`);
- `toml`: the same join from the TOML keys, no query, with the payload left out (the query itself costs nothing).
The runs of `query`, `every` and `toml` must give the same number of results, `half` and `filter` fewer, or the
bench fails.  Output: query.md, query.json.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from bench.ab import Comparison, parser
from bench.cluster import RunFailed
from bench.payload import STREAMS, stream_settings, write_streams
from protocol.plan import load_plan

EVERY_TARGET = 0.85
SELECT = "SELECT a.id, a.key, a.ts, b.id AS b_id, b.key AS b_key, b.ts AS b_ts, delay"
ON = "a.key = b.key AND b.ts BETWEEN a.ts - INTERVAL 1 SECOND AND a.ts + INTERVAL 1 SECOND"


def sql(condition: str = "", where: str = "") -> str:
    a, b = STREAMS
    return f"query.sql={SELECT} FROM {a} a JOIN {b} b ON {ON}{condition}{where}"


def main(argv: list[str]) -> int:
    p = parser("python -m bench.query", __doc__, 15.0, 30.0, 3)
    p.add_argument("--seconds", type=float, help="seconds of event time per run (instead of 15 or 30)")
    a = p.parse_args(argv)
    seconds = a.seconds or (15.0 if a.quick else 30.0)
    gen = load_plan(None, [f"generator.duration={seconds}"]).generator
    try:
        with tempfile.TemporaryDirectory(prefix="streamjoin-query-") as tmp:
            write_streams(gen, Path(tmp))
            workload = [s for s in stream_settings(Path(tmp)) if not s.endswith(("key=key", "time=ts"))]
            payload = [f"streams.{n}.payload=[]" for n in STREAMS]
            ab = Comparison(
                "python -m bench.query " + " ".join(argv),
                a,
                [*workload, *payload],
                {
                    "query": [sql()],
                    "every": [sql(" AND a.qty + b.qty >= 0")],
                    "half": [sql(" AND a.qty <= b.qty")],
                    "filter": [sql(where=" WHERE a.qty < 100")],
                    "toml": [f"streams.{n}.{k}={v}" for n in STREAMS for k, v in (("key", "key"), ("time", "ts"))],
                },
            )
            ab.run(Path(tmp) / "runs")
    except RunFailed as e:
        print(f"bench.query: a run failed: {e}", file=sys.stderr)
        return 1
    results = {m: set(r) for m, r in ab.data["results"].items()}
    same = results["query"] == results["every"] == results["toml"] and len(results["query"]) == 1
    fewer = max(results["half"] | results["filter"]) < min(results["query"])
    if not (same and fewer):
        print(f"bench.query: the modes' results are not what their queries keep: {results}", file=sys.stderr)
        return 1
    ratios = ab.data["ratios"]
    faster = ratios["filter"] > 1.0
    ab.write(
        "query",
        "A query's condition on the pair and filter against the query without them",
        "mode",
        [
            ab.verdict(EVERY_TARGET),
            f"half/query = {ratios['half']:.3f} (a condition that keeps about half of the pairs: fewer results "
            "to write; no target).",
            f"filter/query = {ratios['filter']:.3f} (target > 1: {'met' if faster else 'NOT met'}; 10% of R kept).",
            f"toml/query = {ratios['toml']:.3f} (the same join without a query; no target).",
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
