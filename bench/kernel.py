"""`python -m bench.kernel [--quick] [--repeats 5] [--out bench-report]`: what one core can do.

The cluster's capacity is judged against the best single-core join of the same
input: this runs the project's own join module in one process, batch
by batch as a slave would (watermark expiry, extendible-hash tuning), on
batches of one distribution epoch of event time and of `LONGER_SPANS`, and
DuckDB with one thread joining the whole input at once with the same key and
time condition, as a reference for a compiled kernel. Both count the results,
which must agree. Reports tuples per second (both streams) as the median over
the repeats, and the limit the cluster is measured against: the own kernel's
rate on its best batch span times the cores (DuckDB times the cores is given
beside it: a whole-input join, not a streaming one, so it shows what compiled
code could reach, not what this design can).
Output: kernel.md, kernel.json.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import argparse
import json
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from bench.machine import machine_info
from bench.search import median
from bench.tables import md_table
from master.state.packing import to_wire
from common.workload import generate_all
from protocol import eventtime
from protocol.output import NumberedFiles
from protocol.plan import load_plan
from protocol.tuples import STREAM_R, STREAM_S, tuple_dtype
from slave.join import JoinModule
from slave.result_files import ResultWriter

if TYPE_CHECKING:
    from protocol.plan import Plan


class TimedFiles(NumberedFiles):
    """Files written as NumberedFiles writes them, the CPU seconds of the thread that writes each counted."""

    seconds = 0.0

    def write(self, stem, table) -> None:
        began = time.thread_time()
        super().write(stem, table)
        self.seconds += time.thread_time() - began


class TimedWriter(ResultWriter, TimedFiles):
    """A slave's result writer whose writing thread's CPU is counted (ResultWriter hands each file to
    TimedFiles.write on that thread)."""


#: Batch spans (seconds of event time) the bench also times the kernel on besides one distribution epoch.  A
#: paced bench run goes through event time many times faster than wall time, so a slave's batch of one epoch
#: spans seconds of event time; and longer batches are cheaper per tuple (every batch probes the stored window
#: once).  The best span is the limit.
LONGER_SPANS = (1.0, 2.0, 4.0, 8.0)


def epoch_batches(plan: Plan, span: float | None = None, data=None):
    """The input (`data`, generated here if not given) cut into one batch per distribution epoch (or per `span`
    seconds) of event time, with its watermark (as the master would send it to a single slave)."""
    data = generate_all(plan.generator) if data is None else data
    dtype = tuple_dtype(plan.generator.tuple_bytes)
    rows = to_wire(dtype, data.id, data.ts, data.key, data.value, eventtime.to_seconds(data.ts))
    epoch = eventtime.duration(span or plan.epochs.distribution)  # ts are microseconds (protocol.eventtime)
    cut = np.searchsorted(data.ts, np.arange(epoch, data.ts.max() + epoch, epoch))
    seen = np.maximum.accumulate(data.ts)
    max_delay = plan.join.max_delay
    batches = []
    for a, b in zip(np.concatenate([[0], cut[:-1]]), cut):
        if b > a:
            part, stream = rows[a:b], data.stream[a:b]
            batches.append((part[stream == STREAM_R], part[stream == STREAM_S], int(seen[b - 1]) - max_delay))
    return data, batches


def own_by_span(plan: Plan, data, repeats: int) -> tuple[dict[float, list[float]], set[int]]:
    """Tuples/s of the own join module on `data` in batches of one distribution epoch and of each of
    `LONGER_SPANS`, `repeats` runs each (one span's batches in memory at a time), and the result counts seen."""
    rates, counts = {}, set()
    for span in sorted({plan.epochs.distribution, *LONGER_SPANS}):
        _, batches = epoch_batches(plan, span, data)
        rates[span] = []
        for i in range(repeats):
            seconds, results = own_kernel(plan, batches)
            rates[span].append(round(len(data.ts) / seconds, 1))
            counts.add(results)
            print(
                f"[own {span:g} s batches #{i + 1}] {rates[span][-1]:,.0f} tuples/s ({results:,} results in "
                f"{seconds:.2f}s)",
                flush=True,
            )
    return rates, counts


def join_module(plan: Plan, dtype: np.dtype) -> JoinModule:
    """The join module one slave would run with this config, holding every partition-group."""
    t = plan.tuning
    return JoinModule(
        dtype,
        plan.partitioning.partitions,
        plan.join.bounds,
        t.block_size,
        t.theta_min,
        t.theta_max,
        t.max_depth,
        chunk_rows=plan.output.result_chunk_rows,
    )


@contextmanager
def one_core():
    """Run the body on one CPU of this process (threads started in it stay there too): the limit is one core's."""
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, cpus)


def own_kernel(
    plan: Plan,
    batches,
    results_to: Path | None = None,
    payload=None,
    slaves: int = 1,
    cpu: dict[str, float] | None = None,
) -> tuple[float, int]:
    """Seconds and results of the slave's join module over all batches, on one core of this process; with
    `slaves`, batch i is slave i % slaves's, each slave with a join module of its own (one module would expire a
    slave's state by another's watermark before its own batch of the epoch came).

    With `results_to`, also the rest of a slave's work on each batch's results: their delays
    (slave.join.Chunk.delays) and the Parquet result files (slave.result_files.ResultWriter, whose writing
    thread shares the core; `payload`: declared streams' columns gathered from their payload log): what the
    cluster's slaves do besides the join, without master or messages.  `cpu` gets that work's CPU seconds as
    "results": this thread's around it and the writing thread's."""
    with one_core():
        modules = [join_module(plan, batches[0][0].dtype) for _ in range(slaves)]
        writer = (
            TimedWriter(str(results_to), 1, "parquet", plan.output.flush_rows, payload=payload) if results_to else None
        )
        results, own = 0, 0.0
        started = time.perf_counter()
        for i, (r, s, watermark) in enumerate(batches):
            module = modules[i % slaves]
            if writer is None:
                results += len(module.process(r, s, watermark))
                continue
            began = time.time()
            for chunk in module.chunks(r, s, watermark):
                mine = time.thread_time()
                delay, _ = chunk.delays(began, began)
                writer.add_pairs(chunk.pairs, delay)
                own += time.thread_time() - mine
                results += len(delay)
        if writer is not None:
            mine = time.thread_time()
            writer.flush()
            writer.wait()
            own += time.thread_time() - mine
            if cpu is not None:
                cpu["results"] = own + writer.seconds
        return time.perf_counter() - started, results


def with_results(plan: Plan, data, span: float, repeats: int) -> list[float]:
    """Tuples/s of `own_kernel` writing its results (a fresh folder each run), `repeats` runs on `span` batches."""
    _, batches = epoch_batches(plan, span, data)
    rates = []
    for i in range(repeats):
        with tempfile.TemporaryDirectory(prefix="streamjoin-kernel-") as tmp:
            seconds, results = own_kernel(plan, batches, Path(tmp))
        rates.append(round(len(data.ts) / seconds, 1))
        print(
            f"[own {span:g} s batches + delays + result files #{i + 1}] {rates[-1]:,.0f} tuples/s ({results:,} "
            f"results in {seconds:.2f}s)",
            flush=True,
        )
    return rates


def window_footprint(plan: Plan, batches) -> dict:
    """The real memory of a join module's window state after all batches, per stored tuple: every allocation
    tracemalloc sees while the module runs (numpy's arrays, the directories, the Python objects) and is still
    held by it at the end; beside it the module's own count (`JoinModule.nbytes`)."""
    import gc
    import tracemalloc

    tracemalloc.start()
    try:
        module = join_module(plan, batches[0][0].dtype)
        for r, s, watermark in batches:
            module.process(r, s, watermark)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    stored = sum(module.stored())
    return {
        "traced_bytes": held,
        "nbytes": module.nbytes,
        "stored_tuples": stored,
        "traced_per_tuple": held / stored if stored else None,
        "nbytes_per_tuple": module.nbytes / stored if stored else None,
    }


def duckdb_join(plan: Plan, data) -> tuple[float, int]:
    """Seconds and results of DuckDB (one thread) joining the whole input with the same condition."""
    import pyarrow as pa

    sides = [
        pa.table({"id": data.id[mine], "ts": data.ts[mine], "key": data.key[mine]})
        for mine in (data.stream == STREAM_R, data.stream == STREAM_S)
    ]
    began = time.perf_counter()
    ((results,),) = duckdb_pairs(plan, *sides, "count(*)").fetchall()
    return time.perf_counter() - began, int(results)


def duckdb_pairs(plan: Plan, r, s, select: str):
    """DuckDB (one thread) joining the Arrow tables `r` and `s` (id, ts, key, ...) with the join's key and time
    condition, selecting `select`: the query's relation, its result still to fetch."""
    import duckdb

    con = duckdb.connect()
    con.execute("SET threads = 1")
    con.register("r", r)
    con.register("s", s)
    return con.sql(f"SELECT {select} FROM r JOIN s ON {join_on(plan)}")


def join_on(plan: Plan) -> str:
    """The join's key and time condition in SQL over the relations r and s (id, ts, key, ...)."""
    lower, upper = plan.join.bounds  # integer microseconds, as ts: the engine's exact rule
    return f"r.key = s.key AND s.ts BETWEEN r.ts + {lower} AND r.ts + {upper}"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kernel", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="10 s of input instead of 30 s")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="workload settings")
    p.add_argument("--out", type=Path, default=Path("bench-report"))
    a = p.parse_args(argv)
    plan = load_plan(None, [f"generator.duration={10 if a.quick else 30}", *a.set])
    data = generate_all(plan.generator)
    n = len(data.ts)
    own_rates, counts = own_by_span(plan, data, a.repeats)
    runs = {**{f"own {span:g} s": rates for span, rates in own_rates.items()}, "duckdb": []}
    for i in range(a.repeats):
        seconds, results = duckdb_join(plan, data)
        counts.add(results)
        runs["duckdb"].append(n / seconds)
        print(f"[duckdb #{i + 1}] {n / seconds:,.0f} tuples/s ({results:,} results in {seconds:.2f}s)", flush=True)
    if len(counts) != 1:
        print(f"bench.kernel: the kernels disagree on the result count: {sorted(counts)}", file=sys.stderr)
        return 1
    cores = len(os.sched_getaffinity(0))
    best = {k: median(v) for k, v in runs.items()}
    own = max((k for k in best if k.startswith("own")), key=best.get)  # the best batch span is the limit
    limit = best[own] * cores
    data_out = {
        "command": "python -m bench.kernel " + " ".join(argv),
        "machine": machine_info(),
        "tuples": n,
        "results": counts.pop(),
        "runs": runs,
        "medians": best,
        "cores": cores,
        "best": own,
        "limit_tuples_per_s": limit,
        "duckdb_times_cores": best["duckdb"] * cores,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "kernel.json").write_text(json.dumps(data_out, indent=2))
    table = md_table(
        ["kernel (one core)", "tuples/s (median)"],
        [
            *(
                [f"own join module, batches of {k[4:]} of event time", f"{v:,.0f}"]
                for k, v in best.items()
                if k.startswith("own")
            ),
            ["DuckDB, 1 thread, whole input", f"{best['duckdb']:,.0f}"],
            [f"limit: own ({own[4:]}) x {cores} cores", f"{limit:,.0f}"],
            [f"DuckDB x {cores} cores (reference)", f"{best['duckdb'] * cores:,.0f}"],
        ],
    )
    m = data_out["machine"]
    (a.out / "kernel.md").write_text(
        "\n".join(
            [
                "# The single-core limit",
                "",
                f"`{data_out['command'].strip()}` — {m['date']}",
                "",
                f"Machine: {m['cpu']}, {cores} cores; {n:,} tuples, {data_out['results']:,} results; "
                f"medians of {a.repeats} runs.",
                "",
                table,
                "",
            ]
        )
    )
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
