"""`streamjoin explain`: what a config (and its query) means, before anything runs.

Prints the plan every rank reads (protocol.plan), for the TOML form and a query alike: the streams as R and S,
the join type, the keys, the time bounds, what runs where each stream's rows are read (its filter), what runs on
the pairs, the result columns, how the query was rewritten, each stream's input and lateness, the cluster,
balancing, hot keys, checkpoints, the aggregation and the output; a config or a query the engine refuses exits 2
with the reason, as a run would.
Files' first schemas are read to check the columns the query names.
"""

from __future__ import annotations

import argparse
import sys

from common.chunks import InputError
from common.stream_file import first_schema, stream_files
from protocol.config import ConfigError
from protocol.lifetime import USER_ERROR, invocation
from protocol.plan import load_plan


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog=invocation("control.explain"), description=__doc__.split("\n")[0])
    p.add_argument("--config", help="the run's TOML config ([streams.NAME] tables: docs/input.md)")
    p.add_argument("--sql", metavar="FILE", help="the join as a Spark SQL query (docs/query.md)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a key")
    a = p.parse_args(argv)
    try:
        plan = load_plan(a.config, a.set, a.sql)
        if plan.query is not None:
            for side, spec in enumerate(plan.streams):
                if spec.path:
                    names = first_schema(stream_files(spec.name, spec.path)[0]).names
                    missing = [c for c in plan.query.stream(side).columns if c not in names]
                    if missing:
                        raise InputError(
                            f"stream {spec.name} has no column(s) {', '.join(missing)} that the query names"
                        )
    except (ConfigError, InputError) as e:
        print(f"refused: {e}", file=sys.stderr)
        return USER_ERROR
    print("\n".join(plan.explain()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
