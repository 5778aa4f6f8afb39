"""`python -m bench [--quick] [--slaves 1,2,4,8] [--repeats 3] [--steps N] [--delay-bound S] [--confirm-seconds S] \
[--peer spark|none] [--workloads ...] [--epochs ...] [--input file|generator] [--data DIR] [--out DIR]`: \
sustained input rate and delay per cluster size, and of the peer; `python -m bench --big N`: one N-row file end to \
end (bench.big).

For each slave count k (k + 1 ranks) on the default generated workload, written to Parquet files kept in a cache
folder (bench.inputs) and streamed by the master (`--input file`, as the peer and the kernel limit get theirs;
`--input generator` generates it at the master as it runs): the search of bench.search (probe, paced search
runs, repeats at the sustained rate and at half of it, one long confirmation run).  A paced run counts only if
its input lasts MIN_INPUT_SECONDS at its rate; `--quick` runs are shorter, so quick measures no capacity and
claims no target.  In paced runs a tuple's arrival is its nominal pacing
time, so the delay is end-to-end, including any backlog in the master.  Then (`--peer spark`, the default)
the same search on Spark Structured Streaming's stream-stream join of the same data (bench.spark) and the
ratio cluster/Spark.  Then (bench.paper) the other workloads (uniform, Zipf, high duplication), tuning off,
the distribution-epoch sweep and the single-core kernel limit (bench.kernel), and the issue's targets.
Output: report.md, results.json (all raw numbers) and PNG plots (bench.report).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from bench import big, paper
from bench.cluster import INPUTS, RUN_TIMEOUT, Bench, RunFailed, planned_runs
from bench.inputs import DEFAULT_DIR, DEFAULT_LIMIT_GB, InputCache
from bench.machine import machine_info
from bench.report import QUICK_NOTE, caveats, plot, write_report
from bench.search import CONFIRM_SECONDS, DELAY_BOUND, MIN_INPUT_SECONDS
from bench.spark import PEER_DELAY_BOUND, QUICK_RUN_SECONDS, RUN_SECONDS, SparkBench, peer_table, ratio, ratio_text
from bench.tables import summary_table
from protocol.plan import load_plan


def parse_slaves(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]; each slave count must be a positive integer."""
    try:
        ks = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected slave counts like 1,2,4, got {text!r}") from None
    if not ks or min(ks) < 1:
        raise argparse.ArgumentTypeError(f"slave counts must be positive integers, got {text!r}")
    return ks


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line, with the defaults that depend on --quick filled in."""
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help="runs of 60 s of event time (6M tuples, about a second at these rates) instead of at least "
        f"{MIN_INPUT_SECONDS:g} s of input at each rate, 5 search steps instead of 8, 1 repeat instead "
        "of 3, no confirmation run, fewer slave counts, workloads on 2 slaves only, 3 epochs in the "
        "sweep: it measures no capacity and claims no target",
    )
    p.add_argument(
        "--slaves",
        type=parse_slaves,
        help="slave counts of the paper workload, e.g. 1,2,4 (default 1,2,4 with --quick, else 1,2,4,8)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        help="runs at the sustained rate and at half of it; medians are reported (default 1 with --quick, else 3)",
    )
    p.add_argument(
        "--steps",
        type=int,
        help="paced runs of the search for the sustained rate (default 5 with "
        "--quick, else 8: the unpaced probe reads low, "
        "the first steps climb to it)",
    )
    p.add_argument(
        "--delay-bound",
        type=float,
        default=DELAY_BOUND,
        help=f"a search run passes if it kept up and its delay p95 is at most this many seconds "
        f"(default {DELAY_BOUND:g})",
    )
    p.add_argument("--out", type=Path, default=Path("bench-report"), help="report folder (default bench-report)")
    p.add_argument("--timeout", type=float, default=RUN_TIMEOUT, help="seconds per run before it counts as failed")
    p.add_argument(
        "--peer",
        choices=("spark", "none"),
        default="spark",
        help="also find the sustained rate of Spark Structured Streaming's join on the same data "
        "(bench.spark; default spark), or none",
    )
    p.add_argument(
        "--peer-delay-bound",
        type=float,
        default=PEER_DELAY_BOUND,
        help=f"the peer's delay p95 bound (default {PEER_DELAY_BOUND:g} s: Spark's micro-batches alone "
        "take over a second here, so it sustains no rate under the cluster's bound)",
    )
    p.add_argument(
        "--workloads",
        type=paper.parse_names,
        default=paper.EXTRA_WORKLOADS,
        help=f"workloads searched besides the paper's, or none (default "
        f"{','.join(paper.EXTRA_WORKLOADS)}; see bench/paper.py)",
    )
    p.add_argument(
        "--workload-slaves",
        type=parse_slaves,
        help="slave counts of those workloads and of tuning off (default 2 with --quick, else 2,4)",
    )
    p.add_argument(
        "--epochs",
        type=paper.parse_epochs,
        help="distribution epochs of the sweep in seconds, or none (default "
        f"{','.join(map(str, paper.QUICK_EPOCHS))} with --quick, else "
        f"{','.join(map(str, paper.FULL_EPOCHS))})",
    )
    p.add_argument("--no-tuning-off", action="store_true", help="skip the search with extendible-hash tuning off")
    p.add_argument(
        "--input",
        choices=INPUTS,
        default="file",
        help="the cluster's input: read from a Parquet file of the generated tuples written first, as "
        "the Spark peer and the kernel get theirs (default), or generated at the master as it runs",
    )
    p.add_argument(
        "--confirm-seconds",
        type=float,
        help=f"input seconds of the confirmation run at each slave count's sustained rate, whose delay p99 "
        f"must stay flat from its first to its last quarter; 0 = none (default {CONFIRM_SECONDS:g}, "
        "none with --quick)",
    )
    p.add_argument(
        "--data",
        type=Path,
        default=DEFAULT_DIR,
        help=f"cache folder of the generated input files, kept between invocations (default {DEFAULT_DIR})",
    )
    p.add_argument(
        "--data-limit",
        type=float,
        default=DEFAULT_LIMIT_GB,
        help="GB of input files the cache keeps; above it the least recently used files the bench wrote "
        f"are deleted (default {DEFAULT_LIMIT_GB:g})",
    )
    p.add_argument(
        "--big",
        type=int,
        metavar="N",
        help="instead of the capacity bench: generate an N-row Parquet file, run it unpaced with 4 slaves "
        "and report rows, times and the master's peak RSS, then delete the file (bench.big)",
    )
    p.add_argument(
        "--kernel-repeats",
        type=int,
        default=3,
        help="runs of the single-core kernel (bench.kernel) for the limit; 0 = skip (default 3)",
    )
    a = p.parse_args(argv)
    a.steps = a.steps if a.steps is not None else 5 if a.quick else 8
    a.repeats = a.repeats if a.repeats is not None else 1 if a.quick else 3
    a.slaves = a.slaves or ([1, 2, 4] if a.quick else [1, 2, 4, 8])
    a.workload_slaves = a.workload_slaves or ([2] if a.quick else [2, 4])
    a.epochs = a.epochs if a.epochs is not None else paper.QUICK_EPOCHS if a.quick else paper.FULL_EPOCHS
    a.confirm_seconds = 0.0 if a.quick else a.confirm_seconds if a.confirm_seconds is not None else CONFIRM_SECONDS
    if a.confirm_seconds < 0 or (a.confirm_seconds and a.confirm_seconds < MIN_INPUT_SECONDS):
        p.error(f"--confirm-seconds must be 0 or at least {MIN_INPUT_SECONDS:g}")
    if a.big is not None and a.big < 1:
        p.error("--big must be a positive number of rows")
    if a.repeats < 1:
        p.error("--repeats must be at least 1")
    if a.steps < 1:
        p.error("--steps must be at least 1")
    if not a.delay_bound > 0 or not a.peer_delay_bound > 0:
        p.error("--delay-bound and --peer-delay-bound must be positive")
    return a


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    if a.big is not None:
        return big.main(["--rows", str(a.big), "--out", str(a.out), "--timeout", str(a.timeout)])
    steps, epochs = a.steps, a.epochs
    workload = [f"generator.duration={60.0 if a.quick else 120.0}"]
    command = "python -m bench " + " ".join(argv)
    data = {
        "command": command.strip(),
        "machine": machine_info(),
        "repeats": a.repeats,
        "steps": steps,
        "delay_bound": a.delay_bound,
        "workload": workload,
        "input": a.input,
        "quick": a.quick,
        "min_input_seconds": MIN_INPUT_SECONDS,
        "confirm_seconds": a.confirm_seconds,
    }
    cache = InputCache(a.data, a.data_limit * 1e9)
    searches = len(a.workloads) + (not a.no_tuning_off)  # each on every --workload-slaves count, no half load
    most = (
        planned_runs(len(a.slaves), a.repeats, steps)
        + len(epochs)
        + (len(a.slaves) if a.confirm_seconds else 0)
        + searches * planned_runs(len(a.workload_slaves), a.repeats, steps, half=False)
    )
    print(
        f"bench: slaves {a.slaves}, probe + {steps} search steps + 2 x {a.repeats} repeats per slave count, "
        f"{f'+ a {a.confirm_seconds:g} s confirmation run, ' if a.confirm_seconds else ''}"
        f"delay bound {a.delay_bound:g} s, {' '.join(workload)}, input {a.input} "
        f"({'the workload as it is' if a.quick else f'at least {MIN_INPUT_SECONDS:g} s at each rate'}"
        f"{f', files kept in {a.data}' if a.input == 'file' else ''}); "
        f"then {', '.join(a.workloads) or 'no other workloads'}{'' if a.no_tuning_off else ' and tuning off'} on "
        f"slaves {a.workload_slaves}, epochs {epochs or 'none'}; at most {most} runs",
        flush=True,
    )
    if a.quick:
        print(f"bench: {QUICK_NOTE}", flush=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="streamjoin-bench-") as tmp:
        bench = Bench(
            a.slaves,
            a.repeats,
            steps,
            a.delay_bound,
            workload,
            a.timeout,
            Path(tmp),
            input_kind=a.input,
            cache=cache,
            capacity=not a.quick,
            confirm_seconds=a.confirm_seconds,
        )

        def new_bench(settings: list[str], tag: str, slaves: list[int] = a.workload_slaves) -> Bench:
            return Bench(
                slaves,
                a.repeats,
                steps,
                a.delay_bound,
                [*workload, *settings],
                a.timeout,
                Path(tmp),
                half=False,
                tag=tag,
                input_kind=a.input,
                cache=cache,
                capacity=not a.quick,
            )

        try:
            data["points"] = [bench.point(k) for k in a.slaves]
            data["workloads"] = {}
            for name in a.workloads:
                b = new_bench(paper.WORKLOADS[name][1], f"{name} ")
                data["workloads"][name] = {
                    "settings": paper.WORKLOADS[name][1],
                    "points": [b.point(k) for k in a.workload_slaves],
                }
            if not a.no_tuning_off:
                b = new_bench(paper.NO_TUNING, "no-tuning ")
                data["tuning_off"] = {"settings": paper.NO_TUNING, "points": [b.point(k) for k in a.workload_slaves]}
            if epochs:
                data["epochs"] = paper.epoch_sweep(new_bench, data["points"], a.workload_slaves[0], epochs)
        except RunFailed as e:
            print(f"\nbench: a run FAILED, {e}", file=sys.stderr, flush=True)
            return 1
        finally:
            data["inputs"] = list(cache.used.values())
        if a.peer == "spark":
            print("bench: the peer, Spark Structured Streaming, on the same workload", flush=True)
            peer = SparkBench(
                load_plan(None, workload),
                QUICK_RUN_SECONDS if a.quick else RUN_SECONDS,
                steps,
                a.repeats,
                a.peer_delay_bound,
                a.timeout,
                Path(tmp),
            )
            try:
                data["peer"] = peer.point()
            finally:
                peer.close()
            data["peer_ratio"] = ratio(data["points"], data["peer"], a.delay_bound)
    if a.kernel_repeats > 0:
        data["kernel"] = paper.kernel_limit(workload, a.kernel_repeats)
    data["config"] = bench.config
    data["bench_seconds"] = round(time.monotonic() - started, 1)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(data, indent=2))
    write_report(a.out, data)
    pngs = plot(a.out, data["points"], a.delay_bound, data.get("peer")) + paper.plot(a.out, data, a.delay_bound)
    print(
        "\n"
        + summary_table(data["points"], a.quick)
        + "\n\n"
        + (f"{QUICK_NOTE}\n" if a.quick else paper.targets_table(data) + "\n")
    )
    if data.get("peer"):
        print(peer_table(data["peer"]) + "\n\n" + ratio_text(data["peer_ratio"]).replace("**", "") + "\n")
    for c in caveats(data):
        print(f"caveat: {c}")
    print(
        (
            "search rate (not a capacity): highest paced rate"
            if a.quick
            else f"sustained rate: highest paced rate over at least {MIN_INPUT_SECONDS:g} s of input"
        )
        + f" that kept up with delay p95 <= {a.delay_bound:g} s; "
        f"delays and achieved/s are medians of {a.repeats} runs at it (half: at half of it). "
        f"{paper.cluster_runs(data)} cluster runs in "
        f"{data['bench_seconds']:.0f} s. Wrote "
        + ", ".join(str(x) for x in [a.out / "report.md", a.out / "results.json", *pngs]),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
