"""`python -m bench.startup [--quick] [--repeats 3] [--ranks 17] [--out bench-report]`: how long the default job
takes to start, and what each rank weighs before data.

The targets (medians of the repeats, 17 ranks, 2 cores): the first tuple ingested within 1.5 s of the
launch, and PSS per rank before data no higher than about 85 MB (PSS counts the shared libraries once across the
ranks, protocol.startup).  Each run is `make run`'s job (the default config: the built-in workload, unpaced),
`generator.duration` seconds of event time; the report gives, from the launch: all ranks ready, the first tuple,
the last result, the whole process; and the PSS per rank.  Output: startup.md, startup.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench.cluster import RunFailed, run_cluster
from bench.machine import machine_info
from bench.search import median
from bench.tables import fmt, md_table

FIRST_TUPLE_TARGET = 1.5  #: seconds from the launch
PSS_TARGET_MB = 85.0  #: per rank, before data


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="5 s of event time per run instead of 20 s")
    p.add_argument("--repeats", type=int, default=3, help="runs (default 3); medians are reported")
    p.add_argument("--ranks", type=int, default=17, help="ranks in all: 1 master + slaves (default 17)")
    p.add_argument("--out", type=Path, default=Path("bench-report"))
    p.add_argument("--timeout", type=float, default=600.0)
    a = p.parse_args(argv)
    runs = []
    try:
        with tempfile.TemporaryDirectory(prefix="streamjoin-startup-") as tmp:
            for i in range(a.repeats):
                s = run_cluster(
                    a.ranks,
                    [f"generator.duration={5.0 if a.quick else 20.0}"],
                    Path(tmp) / str(i),
                    a.timeout,
                    drop_results=True,
                )
                up, pss = s["startup"], s["startup"]["pss_before_data_bytes"]
                runs.append(
                    {
                        "ranks_ready": up["ranks_ready_seconds"],
                        "first_tuple": up["first_tuple_seconds"],
                        "last_result": up["last_result_seconds"],
                        "process": s["process_seconds"],
                        "pss_mb_per_rank": round(median(pss.values()) / 2**20, 1),
                        "pss_mb_master": round(pss["0"] / 2**20, 1),
                    }
                )
                print(
                    f"[#{i + 1}] first tuple {runs[-1]['first_tuple']:.2f} s, ranks ready "
                    f"{runs[-1]['ranks_ready']:.2f} s after the launch",
                    flush=True,
                )
    except RunFailed as e:
        print(f"bench.startup: a run failed: {e}", file=sys.stderr)
        return 1
    keys = ("ranks_ready", "first_tuple", "last_result", "process", "pss_mb_per_rank", "pss_mb_master")
    medians = {k: median(r[k] for r in runs) for k in keys}
    met = {
        "first_tuple": medians["first_tuple"] <= FIRST_TUPLE_TARGET,
        "pss": medians["pss_mb_per_rank"] <= PSS_TARGET_MB,
    }
    data = {
        "command": "python -m bench.startup " + " ".join(argv),
        "machine": machine_info(),
        "ranks": a.ranks,
        "runs": runs,
        "medians": medians,
        "met": met,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "startup.json").write_text(json.dumps(data, indent=2))
    table = md_table(
        ["run", "ranks ready s", "first tuple s", "last result s", "process s", "PSS MB per rank", "PSS MB master"],
        [[str(i + 1), *(fmt(r[k], ".2f" if k in keys[:4] else ".0f") for k in keys)] for i, r in enumerate(runs)]
        + [["median", *(fmt(medians[k], ".2f" if k in keys[:4] else ".0f") for k in keys)]],
    )
    m = data["machine"]
    text = "\n".join(
        [
            f"# Start-up of the default job, {a.ranks} ranks",
            "",
            f"`{data['command'].strip()}` — {m['date']}; {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, load "
            f"average at start {m['load_average_at_start']}.  Seconds from the launch.",
            "",
            table,
            "",
            f"First tuple: median {medians['first_tuple']:.2f} s (target <= {FIRST_TUPLE_TARGET} s: "
            f"{'met' if met['first_tuple'] else 'NOT met'}).  "
            f"PSS before data: median {medians['pss_mb_per_rank']:.0f} MB "
            f"per rank (target <= {PSS_TARGET_MB:.0f} MB: {'met' if met['pss'] else 'NOT met'}).",
            "",
        ]
    )
    (a.out / "startup.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
