"""`python -m bench.audit [--quick] [--repeats 1] [--slaves 2] [--out bench-report]`: the audit's rate beside the
engine's, on the same input.

Two workloads of the generated tuples (the default generator config, `--quick`: fewer seconds of event time):

- **file**: the bench's input file (bench.inputs, source.kind = "file", no archive: the audit reads the file);
- **streams**: the same tuples as two declared streams (bench.payload's files: id, key, ts and three payload
  columns, whose values the audit checks too).

Each repeat runs the engine unpaced on the workload (its in-run tuples/s and its whole process's), then
`python -m control.audit` over the whole run in a new process (Spark's start included, as a user runs it): its
rate is the input tuples over its wall clock and over its own `seconds` (the table's, Spark's start left out),
with its verdict (it must be exact) and the Spark jobs it ran.  Runs alternate the workloads; the report gives
the medians.  Output: audit.md, audit.json.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.ab import parser
from bench.cluster import RunFailed, run_cluster
from bench.inputs import DEFAULT_DIR, InputCache
from bench.machine import machine_info
from bench.payload import stream_settings, write_streams
from bench.search import median
from bench.tables import fmt, md_table
from protocol.plan import load_plan


def audit_run(out: Path, settings: list[str], timeout: float) -> dict:
    """`python -m control.audit` over the whole run in `out` (the run's settings): wall seconds, its report."""
    args = [a for kv in [*settings, f"output.path={out}"] for a in ("--set", kv)]
    began = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "control.audit", *args], capture_output=True, text=True, timeout=timeout)
    wall = time.monotonic() - began
    reports = sorted((out / "audit").glob("audit-*.json"))
    if p.returncode != 0 or not reports:
        raise RunFailed(f"the audit exited {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    report = json.loads(reports[-1].read_text())
    return {"wall_seconds": round(wall, 2), **report}


def measure(workload: str, settings: list[str], a, tmp: Path) -> dict:
    """One engine run of `settings` and the audit of its output."""
    s = run_cluster(
        a.slaves + 1,
        settings,
        tmp / f"{workload}-{time.monotonic_ns()}",
        a.timeout,
        keep=lambda out: audit_run(out, settings, a.timeout),
    )
    r, n = s["kept"], s["input_total"]
    row = {
        "tuples": n,
        "results": s["results"],
        "engine_in_run": s["throughput_tuples_per_s"],
        "engine_whole_process": round(n / s["process_seconds"], 1),
        "audit_wall": round(n / r["wall_seconds"], 1),
        "audit_own": round(n / max(r["seconds"], 1e-9), 1),
        "audit_wall_seconds": r["wall_seconds"],
        "audit_seconds": r["seconds"],
        "spark_jobs": r.get("spark_jobs"),
        "verdict": r["verdict"],
        "expected": r["expected"],
        "found": r["found"],
    }
    print(
        f"[{workload:>7}] {n:,} tuples: engine {row['engine_in_run']:,.0f}/s in-run; audit "
        f"{row['audit_wall']:,.0f}/s ({r['wall_seconds']:.1f} s wall, {r['seconds']:.1f} s its own, "
        f"{row['spark_jobs']} Spark jobs), {row['verdict']}",
        flush=True,
    )
    if row["verdict"] != "exact":
        raise RunFailed(f"the audit of the {workload} workload is not exact: {r}")
    return row


def main(argv: list[str]) -> int:
    p = parser("python -m bench.audit", __doc__, 30.0, 60.0, 1)
    p.add_argument("--data", type=Path, default=DEFAULT_DIR, help="the bench's input file cache (bench.inputs)")
    a = p.parse_args(argv)
    base = [f"generator.duration={30.0 if a.quick else 60.0}"]
    data = {"command": "python -m bench.audit " + " ".join(argv), "machine": machine_info(), "runs": {}}
    try:
        with tempfile.TemporaryDirectory(prefix="streamjoin-audit-") as tmp:
            gen = load_plan(None, base).generator
            write_streams(gen, Path(tmp))
            workloads = {
                "file": [*base, "source.kind=file", f"source.path={InputCache(a.data).file(base)}"],
                "streams": [*base, *stream_settings(Path(tmp))],
            }
            data["runs"] = {w: [] for w in workloads}
            for _ in range(a.repeats):
                for w, settings in workloads.items():
                    data["runs"][w].append(measure(w, settings, a, Path(tmp) / "runs"))
    except (RunFailed, subprocess.TimeoutExpired) as e:
        print(f"bench.audit: {e}", file=sys.stderr)
        return 1
    keys = ["engine_in_run", "engine_whole_process", "audit_wall", "audit_own", "audit_wall_seconds", "spark_jobs"]
    data["medians"] = {
        w: {k: median([r[k] for r in runs if r[k] is not None]) for k in keys} for w, runs in data["runs"].items()
    }
    rows = [
        [
            w,
            fmt(runs[0]["tuples"], ",.0f"),
            *(fmt(data["medians"][w][k], ",.0f") for k in keys[:4]),
            fmt(data["medians"][w]["audit_wall_seconds"], ".1f"),
            fmt(data["medians"][w]["spark_jobs"], ".0f"),
        ]
        for w, runs in data["runs"].items()
    ]
    table = md_table(
        [
            "workload",
            "tuples",
            "engine in-run /s",
            "engine whole process /s",
            "audit /s (wall)",
            "audit /s (own seconds)",
            "audit wall s",
            "Spark jobs",
        ],
        rows,
    )
    m = data["machine"]
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "audit.json").write_text(json.dumps(data, indent=2))
    (a.out / "audit.md").write_text(
        "\n".join(
            [
                "# The audit's rate beside the engine's",
                "",
                f"`{data['command'].strip()}` — {m['date']}",
                "",
                f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, load at start "
                f"{m['load_average_at_start']}; {a.slaves} slaves + master, unpaced; medians of {a.repeats}; "
                "the audit over the whole run in a new process (wall: with Spark's start), every audit exact.",
                "",
                table,
                "",
            ]
        )
    )
    print(table)
    print(f"wrote {a.out / 'audit.md'}, {a.out / 'audit.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
