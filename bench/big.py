"""`python -m bench.big [--rows N] [--slaves 4]` (or `python -m bench --big N`): a file far larger than the runs of
the capacity bench, end to end (a user's archive of hundreds of millions of rows must run without
running out of memory, its first tuple moving at once).

It writes the paper workload's first N rows (default 200M) as a Parquet file streamed in row groups
(bench.inputs.write_input: generation stays within bounded memory), runs it unpaced with `--slaves` slaves, and
reports rows, the in-run time, the whole process's time, the time to the first tuple and the master's peak RSS
(`big.md`, `big.json` in --out).  The file and the run's output are in a temporary folder deleted after, also
when the run fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from bench.cluster import RUN_TIMEOUT, RunFailed, run_cluster, run_numbers
from bench.inputs import write_input
from bench.machine import machine_info
from bench.tables import fmt, md_table
from protocol.plan import Generator, load_plan

DEFAULT_ROWS = 200_000_000
SLAVES = 4


def generator_for(rows: int, settings: list[str] = ()) -> Generator:
    """The workload's generator config made long enough for `rows` (its counts are Poisson: a little more)."""
    gen = load_plan(None, list(settings)).generator
    need = rows / (2 * gen.rate)
    return replace(gen, duration=round(need * 1.001 + 1.0, 3))


def report_rows(r: dict) -> list[list[str]]:
    """The numbers of one big run as table rows (what, value)."""
    return [
        ["rows in the file", fmt(r["rows"])],
        ["file MB", fmt(r["file_bytes"] / 1e6)],
        ["generated in s", fmt(r["generate_seconds"], ".1f")],
        ["tuples joined (input_total)", fmt(r["input_total"])],
        ["in-run time s (wall_seconds)", fmt(r["wall_seconds"], ".1f")],
        ["whole process s (mpirun start to exit)", fmt(r["process_seconds"], ".1f")],
        ["first tuple s (from the launch)", fmt(r["first_tuple_seconds"], ".2f")],
        ["in-run throughput tuples/s", fmt(r["throughput"])],
        ["master peak RSS MB", fmt(r["rank_rss_mb"]["0"], ".0f")],
        ["largest peak RSS of any process MB", fmt(r["peak_rss_mb"], ".0f")],
    ]


def run(rows: int, slaves: int, timeout: float, where: Path | None = None) -> dict:
    """Write the file, run it, delete both; the run's numbers (bench.cluster.run_numbers) with the file's."""
    gen = generator_for(rows)
    with tempfile.TemporaryDirectory(prefix="streamjoin-big-", dir=where) as tmp:
        path = Path(tmp) / "big.parquet"
        print(f"bench.big: writing {rows:,} rows to {path}", flush=True)
        began = time.monotonic()
        write_input(gen, path, rows)
        generated = round(time.monotonic() - began, 1)
        size = path.stat().st_size
        print(
            f"bench.big: {size / 1e6:,.0f} MB in {generated:.0f} s; running it unpaced on {slaves} slaves", flush=True
        )
        s = run_cluster(
            slaves + 1,
            ["source.kind=file", f"source.path={path}", "source.rate=0.0"],
            Path(tmp) / "run",
            timeout,
            drop_results=True,
        )  # far too many results to keep or read
    return {
        "rows": rows,
        "file_bytes": size,
        "generate_seconds": generated,
        "slaves": slaves,
        **run_numbers(s),
        "peak_rss_mb": s["peak_rss_mb"],
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.big", description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=DEFAULT_ROWS, help=f"rows of the file (default {DEFAULT_ROWS:,})")
    p.add_argument("--slaves", type=int, default=SLAVES, help=f"slaves (default {SLAVES})")
    p.add_argument("--dir", type=Path, help="where the temporary file goes (default the system's temporary folder)")
    p.add_argument("--out", type=Path, default=Path("bench-report"), help="report folder (default bench-report)")
    p.add_argument("--timeout", type=float, default=RUN_TIMEOUT, help="seconds before the run counts as failed")
    a = p.parse_args(argv)
    if a.rows < 1 or a.slaves < 1:
        p.error("--rows and --slaves must be positive")
    try:
        r = run(a.rows, a.slaves, a.timeout, a.dir)
    except RunFailed as e:
        print(f"bench.big: the run FAILED, {e}", file=sys.stderr, flush=True)
        return 1
    r["machine"] = machine_info()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "big.json").write_text(json.dumps(r, indent=2))
    m = r["machine"]
    table = md_table(["", "value"], report_rows(r))
    (a.out / "big.md").write_text(
        f"# A big file end to end\n\n`python -m bench.big {' '.join(argv)}` — {m['date']}; {m['cpu']}, {m['cores']} "
        f"cores, {m['memory_gib']} GiB; load average at the start {' '.join(map(str, m['load_average_at_start']))}\n\n"
        f"The paper workload's first {r['rows']:,} rows as one Parquet file, run unpaced with {r['slaves']} slaves "
        "(the file and the run's output deleted after).\n\n" + table + "\n"
    )
    print("\n" + table + f"\n\nWrote {a.out / 'big.md'}, {a.out / 'big.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
