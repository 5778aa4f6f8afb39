"""`python -m bench.limit [--rows N] [--slaves 2] [--repeats 3] [--out bench-report]`: what each tuple costs, stage
by stage, and how far the cluster is from their sum.

On one Parquet file of the side-by-side workload (the generator's Zipf keys over 200,000 keys, 100,000 tuples/s
of event time, 0.2 s of disorder, a 1 s window: about 1.9 results per tuple; `--rows`, default 4M) each stage
runs alone in this process (or, for the transfer, two ranks of this host), medians of `--repeats`:

- read: the master's file source streaming the file into chunks of fixed-width arrays (master.sources.streams);
- ingest: the ingest desk on those chunks (lateness, partition hashing, the tuples built into the mini-buffers:
  master.state.intake) and the mini-buffers drained into one batch per slave per distribution epoch;
- transfer: those batches' bytes sent and received between two ranks (`mpirun -n 2`, MPI Send/Recv of byte
  buffers of the batches' mean size; wall time, counted once though both ranks are busy);
- join: the slave's join module on the batches (bench.kernel.own_kernel, one core);
- results: the same writing the result files (gathering, delays, Parquet: the CPU of that work in the joining
  thread and of the writing thread, bench.kernel.own_kernel's `cpu`).

A tuple's nanoseconds are the stage's CPU seconds (the join's and the results' on one core: the process's, the
result writer's thread's too; the transfer's: wall time) over the file's tuples; their sum is what one tuple costs
the machine along the pipeline, and the **pipeline limit** is cores / sum: the rate the cores could carry if no
stage waited and nothing were done twice. Beside read, join and results, the library alone on the same bytes (CPU):
pyarrow reading the same columns of the same files; DuckDB (one thread) joining the same batches' tuples whole with
the same condition into the pairs' columns as Arrow; pyarrow writing the result table the stage wrote as one Parquet
file. With declared streams, the results' gathering of their columns from the payload log (thread CPU) beside
Arrow's `take` of the same rows from the same columns held whole in memory, and the results stage beside the write
and the take together. Then the cluster (`--slaves` slaves, unpaced) on the same file, `--repeats`
times, each kind of run in turn first after the stages (the run there costs more CPU than the others): its in-run
and whole-process rates (medians) and their ratios to the limit, and whole process against in-run. The metrics'
share: the cluster once more with the metrics off, by in-run rate and by CPU per tuple (mpirun's and every rank's
user and system time: steadier on a busy machine).

Side by side: before each run of the cluster on the single file, its peer, DuckDB on as many threads as the
cores, the same file's tuples preloaded into its tables in memory, one timed query doing the whole join at once
(`peer_run`); its rate (the file's tuples over the query's wall seconds) per run and median, and the cluster's
in-run and whole-process rates over it against their targets (PEER_TARGETS). Both must find the same results
(else the bench fails, after its report).

The payload: the same generator's tuples as two declared streams (bench.payload's files: id, key, ts and three
payload columns a side), read by the streams' source (which writes the payload log), each stage measured again
without and with the payload columns (the results' gathering them from the log, protocol.payload), and the
cluster run on both: the rate with payload against the rate without.  Of their read, the part that writes the
payload log (its writers' thread CPU), which pyarrow's read does not do, and the read without it against pyarrow's.

With `--profile`, one more run of the cluster is sampled by py-spy (the master and the first slave), the folded
stacks saved beside the report (`profile-master.txt`, `profile-slave.txt`) and the top frames by own time listed.
Output: limit.md, limit.json.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.big import generator_for
from bench.cluster import RUN_TIMEOUT, RunFailed, run_cluster
from bench.inputs import write_input
from bench.kernel import duckdb_pairs, join_on, own_kernel
from bench.machine import machine_info
from bench.search import median
from bench.tables import fmt, md_table
from deploy.launch import mpi_env, mpirun_command
from protocol import eventtime
from protocol.payload import PayloadReader
from protocol.plan import load_plan
from protocol.tuples import FIELDS

if TYPE_CHECKING:
    from protocol.plan import Plan

#: the side-by-side workload: Zipf keys (s = 0.58) over 200,000 keys, 100,000 tuples/s of event time, 0.2 s
#: disorder, a 1 s window
WORKLOAD = [
    "generator.distribution=zipf",
    "generator.keys=200000",
    "generator.zipf=0.58",  # about 1.9 results per tuple
    "generator.rate=50000",
    "generator.disorder=0.2",
    "join.window=1.0",
    "join.max_delay=0.25",
]
ROWS = 4_000_000
STAGES = ("read", "ingest", "transfer", "join", "results")
#: the stages measured beside a library doing the same work on the same bytes (read_reference, join_reference,
#: write_reference), and the part of results measured beside Arrow's take (gather_reference)
REFERENCES = {"read": "pyarrow", "join": "DuckDB", "results": "pyarrow"}
#: the rate with three payload columns a side over the rate without, at least (issue 52's target)
PAYLOAD_TARGET = 0.8
#: the part of declared streams' results that gathers their columns from the payload log (thread CPU of
#: PayloadReader.both), beside Arrow's take of the same rows (gather_reference)
GATHER = "gather"
#: the part of declared streams' read that writes the payload log (thread CPU of PayloadLog.write), which
#: pyarrow's read of the same columns does not do
LOG = "payload log"


def read_stage(plan: Plan) -> tuple[float, list, float]:
    """CPU seconds (its reader threads' too) to stream the file into chunks, the chunks, and the CPU seconds of
    those that went to writing the payload log (declared streams; 0 otherwise: protocol.payload.PayloadLog)."""
    from master.sources import open_source

    began = time.process_time()
    source, chunks = open_source(plan, listed=False), []
    while (chunk := source.next_chunk(plan.source.batch)) is not None:
        chunks.append(chunk)
    source.finish()
    log = getattr(source, "log", None)
    return time.process_time() - began, chunks, log.seconds if log is not None else 0.0


def ingest_stage(plan: Plan, chunks: list, slaves: int) -> tuple[float, list]:
    """CPU seconds of the ingest desk on `chunks` and of draining the mini-buffers into one batch (R, S rows) per
    slave each distribution epoch of event time; the batches with their watermarks."""
    from master.state.buffers import MiniBuffers
    from master.state.channels import Channels
    from master.state.intake import IngestDesk
    from master.state.stats import RunStats
    from protocol.tuples import tuple_dtype

    parts = plan.partitioning.partitions
    buffers = MiniBuffers(parts, tuple_dtype(plan.generator.tuple_bytes))
    ranks = list(range(1, slaves + 1))
    desk = IngestDesk(plan, buffers, RunStats(ranks, 0.0), Channels(ranks, buffers.dtype), 0, 1, 1, None, None)
    owned = np.array_split(np.arange(parts), slaves)
    epoch = eventtime.duration(plan.epochs.distribution)
    batches, seen, next_cut = [], eventtime.NEG_INF, None
    began = time.process_time()
    desk.start(0.0)
    for chunk in chunks:
        desk.take(chunk, len(chunk.ts), 0.0)
        seen = max(seen, int(chunk.ts.max()))
        next_cut = seen + epoch if next_cut is None else next_cut
        if seen >= next_cut:  # an epoch of event time in: every slave's batch goes, with the desk's watermark
            batches += [(*buffers.drain(mine), desk.batch_watermark()) for mine in owned]
            next_cut = seen + epoch
    batches += [(*buffers.drain(mine), desk.batch_watermark()) for mine in owned]
    return time.process_time() - began, batches


def transfer_stage(batch_bytes: int, total_bytes: int) -> float:
    """Seconds two ranks of this host take to send and receive `total_bytes` in messages of `batch_bytes`."""
    out = subprocess.run(
        mpirun_command(2, ["--transfer", str(batch_bytes), str(total_bytes)], module="bench.limit"),
        env=mpi_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if out.returncode != 0:
        raise RunFailed(f"the transfer ranks failed: {out.stderr[-2000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def transfer_ranks(batch_bytes: int, total_bytes: int) -> None:
    """`--transfer`: rank 0 sends, rank 1 receives, blocking, as many messages as make `total_bytes`; rank 0
    prints the seconds from the first send to the last receive's answer."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    buf = np.ones(batch_bytes, np.uint8)
    messages = max(1, total_bytes // batch_bytes)
    comm.Barrier()
    began = time.perf_counter()
    for _ in range(messages):
        if comm.rank == 0:
            comm.Send(buf, dest=1)
        else:
            comm.Recv(buf, source=0)
    comm.Barrier()
    if comm.rank == 0:
        print(time.perf_counter() - began)


def profiles(settings: list[str], slaves: int, folder: Path, work: Path, timeout: float) -> dict[str, list]:
    """py-spy's samples of the master (rank 0) and the first slave (rank 1) through one more unpaced run of the
    cluster (its output in `work`), saved as folded stacks (`profile-master.txt`, `profile-slave.txt` in
    `folder`); per rank its top frames by own time: [function (file:line), share of the samples]."""
    import os
    import signal

    import psutil

    spy = Path(sys.executable).parent / "py-spy"
    run = work
    folder.mkdir(parents=True, exist_ok=True)
    args = [x for kv in [*settings, f"output.path={run / 'out'}", "output.progress=0"] for x in ("--set", kv)]
    cluster = subprocess.Popen(
        mpirun_command(slaves + 1, args),
        env=mpi_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    found: dict[str, int] = {}
    deadline = time.monotonic() + 60
    while len(found) < 2 and cluster.poll() is None and time.monotonic() < deadline:
        for p in psutil.process_iter(["cmdline", "environ"]):
            try:
                rank = (p.info["environ"] or {}).get("OMPI_COMM_WORLD_RANK")
                if rank in ("0", "1") and str(run) in " ".join(p.info["cmdline"] or []):
                    found.setdefault({"0": "master", "1": "slave"}[rank], p.pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        time.sleep(0.01)
    spies = [
        subprocess.Popen(
            [
                str(spy),
                "record",
                "--pid",
                str(pid),
                "--rate",
                "200",
                "--format",
                "raw",
                "--nonblocking",
                "--output",
                str(folder / f"profile-{role}.txt"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for role, pid in found.items()
    ]
    try:
        cluster.wait(timeout=timeout)
    finally:
        if cluster.poll() is None:
            os.killpg(cluster.pid, signal.SIGKILL)
            cluster.wait()
    for s in spies:
        s.wait(timeout=60)
    top = {}
    for role in found:
        own: dict[str, int] = {}
        path = folder / f"profile-{role}.txt"
        for line in path.read_text().splitlines() if path.exists() else []:
            stack, _, count = line.rpartition(" ")
            frame = stack.rsplit(";", 1)[-1]
            own[frame] = own.get(frame, 0) + int(count)
        total = sum(own.values()) or 1
        top[role] = [[f, round(n / total, 3)] for f, n in sorted(own.items(), key=lambda x: -x[1])[:8]]
    return top


def read_reference(plan: Plan) -> float:
    """CPU seconds pyarrow takes to read the columns the source reads from the same files into Arrow arrays: the
    single file whole; a declared stream's id, key and time, and its payload columns if it has any."""
    import pyarrow.parquet as pq

    if plan.source.kind == "file":
        files = [(plan.source.path, None)]
    else:
        files = [(s.path, None if s.payload else [s.id, *s.key, s.time]) for s in plan.streams]
    began = time.process_time()
    for path, columns in files:
        pq.read_table(path, columns=columns)
    return time.process_time() - began


def join_reference(plan: Plan, batches: list) -> tuple[float, int]:
    """CPU seconds DuckDB (one thread) takes to join the tuples of `batches` whole with the join's condition
    into the pairs' columns (both sides' tuple fields) as one Arrow table, and its rows."""
    import pyarrow as pa

    r, s = (
        pa.table({f: np.ascontiguousarray(np.concatenate([b[side][f] for b in batches])) for f in FIELDS})
        for side in (0, 1)
    )
    began = time.process_time()
    pairs = duckdb_pairs(plan, r, s, ", ".join(f"{x}.{f} AS {x}_{f}" for x in "rs" for f in FIELDS))
    rows = pairs.to_arrow_table().num_rows
    return time.process_time() - began, rows


class TimedGather(PayloadReader):
    """The results' payload reader, timing its gathers (CPU of the thread that gathers) and keeping the rows
    asked for, so that `gather_reference` takes the same."""

    def __init__(self, plan: Plan):
        super().__init__(plan.output.path, tuple(s.prefix for s in plan.streams))
        self.seconds, self.asked = 0.0, []

    def both(self, r_rows: np.ndarray, s_rows: np.ndarray, tuples=None):
        began = time.thread_time()
        out = super().both(r_rows, s_rows, tuples)
        self.seconds += time.thread_time() - began
        self.asked.append((r_rows, s_rows))
        return out


def gather_reference(plan: Plan, gather: TimedGather) -> float:
    """CPU seconds of Arrow's `take` of the rows `gather` was asked for from the columns it gathers (those that
    are not the tuples' own fields, which it takes from the pairs) of each stream's file, read whole into memory
    beforehand (a stream's id is its row)."""
    import pyarrow.parquet as pq

    tables = []
    for side, s in enumerate(plan.streams):
        gathered = [c for c in gather.schema(side).names if c not in gather.fields(side)]
        tables.append(pq.read_table(s.path, columns=gathered).combine_chunks())
    began = time.thread_time()
    for rows in gather.asked:
        for table, taken in zip(tables, rows):
            table.take(taken)
    return time.thread_time() - began


def write_reference(folder: Path) -> float:
    """CPU seconds pyarrow takes to write the result table the results stage wrote into `folder`, read back, as
    one Parquet file with the result files' settings (protocol.output.write_table)."""
    from protocol.output import read_tables, write_table

    table = read_tables(folder)
    began = time.process_time()
    write_table(folder / "reference", "all", table, "parquet")
    return time.process_time() - began


def stages(plan: Plan, slaves: int) -> tuple[dict[str, float], int, dict[str, float]]:
    """One measurement of every stage: seconds each, the tuples read, and the references' seconds (pyarrow
    reading the same columns for read, DuckDB joining the same tuples for join, pyarrow writing the same result
    table for results; with declared streams, the gather's seconds and Arrow's take's, GATHER and its reference).
    Declared streams' read writes their payload log into `plan`'s output folder (its part of read: LOG), and
    their results gather from it."""
    from protocol.payload import payload_reader, remove_log

    read, chunks, log = read_stage(plan)
    tuples = sum(len(c.ts) for c in chunks)
    ingest, batches = ingest_stage(plan, chunks, slaves)
    del chunks
    sizes = [r.nbytes + s.nbytes for r, s, _ in batches]
    transfer = transfer_stage(max(1, int(np.mean(sizes))), sum(sizes))
    began = time.process_time()  # CPU, not own_kernel's wall time: on a shared machine the core is not ours alone
    _, pairs = own_kernel(plan, batches, slaves=slaves)
    join = time.process_time() - began
    duck, reference_pairs = join_reference(plan, batches)
    if pairs != reference_pairs:
        raise RuntimeError(f"bench.limit: the join stage found {pairs:,} pairs, DuckDB {reference_pairs:,}")
    references = {"join": duck}
    gather = TimedGather(plan) if plan.streams else None
    cpu: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="streamjoin-limit-") as tmp:
        own_kernel(plan, batches, Path(tmp), gather or payload_reader(plan), slaves, cpu)
        del batches
        references |= {"read": read_reference(plan), "results": write_reference(Path(tmp))}
    seconds = {"read": read, "ingest": ingest, "transfer": transfer, "join": join, "results": cpu["results"]}
    if plan.streams:
        seconds[LOG] = log
    if gather is not None:
        seconds[GATHER], references[GATHER] = gather.seconds, gather_reference(plan, gather)
    remove_log(plan.output.path)
    return seconds, tuples, references


#: the side-by-side targets: the cluster's rates (the single file, metrics on) over the DuckDB peer's
PEER_TARGETS = {"in_run": 3.0, "whole_process": 2.5}
#: the result columns the cluster writes of each pair (protocol.output.RESULT_COLUMNS but the delay)
PEER_COLUMNS = ", ".join(f"{x}.{f} AS {x}_{f}" for x in "rs" for f in ("id", "key", "ts", "value"))


def peer_run(plan: Plan) -> dict:
    """The DuckDB peer, side by side with the cluster on the same file: DuckDB on as many threads as this
    process has cores, the file's tuples preloaded into its in-memory tables r and s (id, ts, key, value) before
    the clock starts, then one timed query joining them whole, one-shot, with the engine's condition
    (bench.kernel.join_on: same key, integer microseconds), materializing each pair's columns the cluster writes
    (r_id, s_id, r_key, s_key, r_ts, s_ts, r_value, s_value; not the delay, the engine's own measure) as a
    DuckDB table in memory. That favours the peer: the cluster's in-run rate counts reading the file, and its
    results are written as Parquet files. The tuples are the engine's (read by its file source, ts already in
    microseconds) less those it would set aside as late in the file's order (master.state.lateness: the same
    rule, both streams together), so the counts must agree. Its rate: the file's tuples over the query's wall
    seconds; returned with the query's CPU seconds (its threads'), the results and the late tuples left out.
    DuckDB plans a hash join on the key with the time bounds checked on every pair of the same key in the whole
    file: its cost a tuple grows with the file's length, so the same-key pairs (counted after the clock) come
    too."""
    import os

    import duckdb
    import pyarrow as pa

    from master.state.lateness import Lateness
    from protocol.tuples import STREAM_R, STREAM_S

    chunks = read_stage(plan)[1]
    cols = {f: np.concatenate([getattr(c, f) for c in chunks]) for f in ("stream", "id", "ts", "key", "value")}
    del chunks
    late, _, _ = Lateness([plan.join.max_delay]).judge(cols["ts"], cols["stream"], 0.0)
    threads = len(os.sched_getaffinity(0))
    con = duckdb.connect()  # in memory
    con.execute(f"SET threads = {threads}")
    for name, side in (("r", STREAM_R), ("s", STREAM_S)):
        mine = ~late & (cols["stream"] == side)
        con.register("side", pa.table({f: cols[f][mine] for f in ("id", "ts", "key", "value")}))
        con.execute(f"CREATE TABLE {name} AS SELECT * FROM side")
        con.unregister("side")
    tuples = len(cols["ts"])
    del cols
    wall, cpu = time.perf_counter(), time.process_time()
    con.execute(f"CREATE TABLE pairs AS SELECT {PEER_COLUMNS} FROM r JOIN s ON {join_on(plan)}")
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    ((results,),) = con.execute("SELECT count(*) FROM pairs").fetchall()
    ((same_key,),) = con.execute(
        "SELECT sum(r.n * s.n) FROM (SELECT key, count(*) AS n FROM r GROUP BY key) r "
        "JOIN (SELECT key, count(*) AS n FROM s GROUP BY key) s USING (key)"
    ).fetchall()
    con.close()
    return {
        "rate": round(tuples / wall, 1),
        "seconds": round(wall, 3),
        "cpu_ns_per_tuple": round(cpu / tuples * 1e9, 1),
        "threads": threads,
        "results": int(results),
        "late": int(late.sum()),
        "same_key_pairs": int(same_key),
    }


def beside(peer: dict[str, list], settings: list[str], tmp: str) -> None:
    """One run of the DuckDB peer on the single file, its figures appended to `peer`'s."""
    for k, v in peer_run(load_plan(None, [*settings, f"output.path={tmp}/out"])).items():
        peer.setdefault(k, []).append(v)


def peer_lines(peer: dict, runs: dict) -> tuple[dict, list[str]]:
    """The side-by-side numbers for limit.json (the peer's runs, its median rate, the cluster's ratios to it
    with their targets) and their lines for the report. `runs`: the cluster's single-file runs."""
    rate = median(peer["rate"])
    ratios = {
        k: {"ratio": float(f"{median(runs[k]) / rate:.3g}"), "target": t, "met": median(runs[k]) / rate >= t}
        for k, t in PEER_TARGETS.items()
    }
    counts = ", ".join(f"{ours:,} / {theirs:,}" for ours, theirs in zip(runs["results"], peer["results"]))
    lines = [
        f"Side by side with DuckDB ({peer['threads'][0]} threads, one-shot, data preloaded; the same file, alternated "
        f"with the cluster's runs): DuckDB {', '.join(fmt(x) for x in peer['rate'])} tuples/s "
        f"(median {fmt(rate)}; {median(peer['cpu_ns_per_tuple']):,.0f} CPU ns a tuple). The cluster in-run "
        + "; whole process ".join(
            f"{r['ratio']:.2f}x DuckDB (target {r['target']:g}x: {'met' if r['met'] else 'not met'})"
            for r in ratios.values()
        )
        + f". Results, cluster / DuckDB: {counts} ({peer['late'][0]:,} late tuples left out of DuckDB's input); "
        f"DuckDB's hash join on the key checks {peer['same_key_pairs'][0] / max(1, peer['results'][0]):.1f} "
        "same-key pairs a result (a whole file's: more, the longer the file)."
    ]
    return {"runs": peer, "rate": rate, "ratios": ratios, "results_agree": runs["results"] == peer["results"]}, lines


def workloads(rows: int, folder: Path) -> dict[str, list[str]]:
    """The side-by-side workload as the single file of `rows` rows and as two declared streams of the same
    generator's tuples (a Parquet file each: id, key, ts and bench.payload's three payload columns), written into
    `folder`: each one's settings, the streams without and with their payload columns."""
    from bench.payload import STREAMS, stream_settings, write_streams

    path = folder / "input.parquet"
    gen = generator_for(rows, WORKLOAD)
    write_input(gen, path, rows)
    write_streams(gen, folder)
    streams = [*WORKLOAD, "source.rate=0.0", *stream_settings(folder)]
    return {
        "file": [*WORKLOAD, "source.kind=file", f"source.path={path}", "source.rate=0.0"],
        "streams": [*streams, *(f"streams.{n}.payload=[]" for n in STREAMS)],
        "payload": [*streams, *(f'streams.{n}.payload="*"' for n in STREAMS)],
    }


def main(argv: list[str]) -> int:
    if argv[:1] == ["--transfer"]:
        transfer_ranks(int(argv[1]), int(argv[2]))
        return 0
    p = argparse.ArgumentParser(prog="python -m bench.limit", description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=ROWS, help=f"rows of the file (default {ROWS:,})")
    p.add_argument("--slaves", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("bench-report"))
    p.add_argument("--timeout", type=float, default=RUN_TIMEOUT)
    p.add_argument("--profile", action="store_true", help="also one run profiled by py-spy (master and one slave)")
    a = p.parse_args(argv)
    machine = machine_info()
    cores = machine["cores"]
    measured: dict[str, dict[str, list]] = {}  #: per workload, per stage: ns per tuple of each repeat
    runs: dict[str, dict[str, list]] = {}  #: per cluster run's kind: in-run and whole-process rates
    #: per declared streams' workload: ns per tuple of the results' gather, and of Arrow's take
    gathered: dict[str, dict[str, list]] = {}
    logged: dict[str, list] = {}  #: per declared streams' workload: ns per tuple of read writing the payload log
    try:
        with tempfile.TemporaryDirectory(prefix="streamjoin-limit-") as tmp:
            forms = workloads(a.rows, Path(tmp))
            clusters = {**forms, "file, metrics off": [*forms["file"], "metrics.endpoint=", "metrics.log_interval=0"]}
            measured = {w: {s: [] for s in STAGES} for w in forms}
            referenced = {w: {s: [] for s in REFERENCES} for w in forms}  #: ns per tuple of the references
            runs = {c: {"in_run": [], "whole_process": [], "cpu_ns_per_tuple": [], "results": []} for c in clusters}
            peer: dict[str, list] = {}  #: the DuckDB peer's runs, each beside the single file's cluster run
            for i in range(a.repeats):  # stages and clusters alternated, so the machine's drift falls on all
                for w, settings in forms.items():
                    plan = load_plan(None, [*settings, f"output.path={tmp}/out"])
                    seconds, tuples, references = stages(plan, a.slaves)
                    if GATHER in seconds:
                        g = gathered.setdefault(w, {"ours": [], "take": []})
                        g["ours"].append(seconds.pop(GATHER) / tuples * 1e9)
                        g["take"].append(references.pop(GATHER) / tuples * 1e9)
                    if LOG in seconds:
                        logged.setdefault(w, []).append(seconds.pop(LOG) / tuples * 1e9)
                    for stage, x in seconds.items():
                        measured[w][stage].append(x / tuples * 1e9)
                    for stage, x in references.items():
                        referenced[w][stage].append(x / tuples * 1e9)
                kinds = list(clusters)  # each kind of run in turn first after the stages
                for c in kinds[i % len(kinds) :] + kinds[: i % len(kinds)]:
                    settings = clusters[c]
                    # the peer right beside, so both see the same machine: before the cluster's run in even
                    # repeats, after it in odd ones (a run right after other work is slower: docs/benchmarks.md)
                    if c == "file" and i % 2 == 0:
                        beside(peer, settings, tmp)
                    s = run_cluster(
                        a.slaves + 1, settings, Path(tmp) / f"run-{i}-{len(c)}", a.timeout, drop_results=True
                    )
                    runs[c]["in_run"].append(s["throughput_tuples_per_s"])
                    runs[c]["whole_process"].append(round(s["input_total"] / s["process_seconds"], 1))
                    runs[c]["cpu_ns_per_tuple"].append(round(s["cpu_seconds"] / s["input_total"] * 1e9, 1))
                    runs[c]["results"].append(s["results"])
                    if c == "file" and i % 2 == 1:
                        beside(peer, settings, tmp)
                print(
                    f"[#{i + 1}] "
                    + "; ".join(
                        f"{w}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in m.items()) for w, m in measured.items()
                    )
                    + " ns; cluster in-run "
                    + ", ".join(f"{c} {r['in_run'][-1]:,.0f}" for c, r in runs.items())
                    + f"; DuckDB {peer['rate'][-1]:,.0f}",
                    flush=True,
                )
            top = profiles(forms["file"], a.slaves, a.out, Path(tmp) / "profiled", a.timeout) if a.profile else {}
    except RunFailed as e:
        print(f"bench.limit: {e}", file=sys.stderr)
        return 1
    ns = {w: {k: median(v) for k, v in m.items()} for w, m in measured.items()}
    ref = {w: {k: median(v) for k, v in m.items()} for w, m in referenced.items()}
    gather = {w: {k: median(v) for k, v in g.items()} for w, g in gathered.items()}
    #: declared streams' results against what they do: pyarrow's write and Arrow's take together
    write_and_take = {w: ns[w]["results"] / (ref[w]["results"] + g["take"]) for w, g in gather.items()}
    log = {w: median(v) for w, v in logged.items()}
    total = {w: sum(x.values()) for w, x in ns.items()}
    limit = {w: cores * 1e9 / t for w, t in total.items()}
    rates = {c: {k: median(v) for k, v in r.items()} for c, r in runs.items()}
    side_by_side, peer_text = peer_lines(peer, runs["file"])
    ratios = {w: {k: round(rates[w][k] / limit[w], 3) for k in ("in_run", "whole_process")} for w in ns}
    # the payload's stages at their libraries' costs (read: pyarrow's; results: pyarrow's write and Arrow's take),
    # the others as measured: the most its rate can be of the rate without, with the streams' stages as they are
    p = ns["payload"]
    floor = min(p["read"], ref["payload"]["read"]) + p["ingest"] + p["transfer"] + p["join"]
    floor += min(p["results"], ref["payload"]["results"] + gather["payload"]["take"])
    data = {
        "command": "python -m bench.limit " + " ".join(argv),
        "machine": machine,
        "rows": a.rows,
        "slaves": a.slaves,
        "workload": WORKLOAD,
        "ns_per_tuple": {w: {k: round(v, 1) for k, v in x.items()} for w, x in ns.items()},
        "ns_per_tuple_runs": measured,
        "reference_ns_per_tuple": {w: {k: round(v, 1) for k, v in x.items()} for w, x in ref.items()},
        "reference_ns_per_tuple_runs": referenced,
        "to_reference": {w: {k: round(ns[w][k] / v, 2) for k, v in x.items() if v > 0} for w, x in ref.items()},
        "gather_ns_per_tuple": {w: {k: round(v, 1) for k, v in g.items()} for w, g in gather.items()},
        "gather_runs": gathered,
        "gather_to_take": {w: round(g["ours"] / g["take"], 2) for w, g in gather.items()},
        "payload_log_ns_per_tuple": {w: round(x, 1) for w, x in log.items()},
        "payload_log_runs": logged,
        "read_without_log_to_reference": {w: round((ns[w]["read"] - x) / ref[w]["read"], 2) for w, x in log.items()},
        "sum_ns": {w: round(t, 1) for w, t in total.items()},
        "pipeline_limit": {w: round(x) for w, x in limit.items()},
        "cluster": runs,
        "ratios": ratios,
        "whole_process_to_in_run": round(rates["file"]["whole_process"] / rates["file"]["in_run"], 3),
        "payload_to_streams": round(rates["payload"]["in_run"] / rates["streams"]["in_run"], 3),
        "results_to_write_and_take": {w: round(x, 2) for w, x in write_and_take.items()},
        "payload_sum_at_references_ns": round(floor, 1),
        "payload_to_streams_at_references": round(total["streams"] / floor, 3),
        "metrics_on_to_off": round(rates["file"]["in_run"] / rates["file, metrics off"]["in_run"], 3),
        "metrics_cpu_on_to_off": round(
            rates["file"]["cpu_ns_per_tuple"] / rates["file, metrics off"]["cpu_ns_per_tuple"], 3
        ),
        "duckdb_peer": side_by_side,
        "top_frames": top,
    }
    f, fr = ns["file"], ref["file"]
    table = md_table(
        ["stage", *(f"run {i + 1}" for i in range(a.repeats)), "median ns/tuple", "share", "reference", "ratio"],
        [
            [
                k,
                *(fmt(x, ".0f") for x in measured["file"][k]),
                fmt(f[k], ".0f"),
                f"{f[k] / total['file']:.0%}",
                f"{REFERENCES[k]} {fr[k]:.0f}" if k in fr else "",
                f"{f[k] / fr[k]:.1f}x" if k in fr else "",
            ]
            for k in STAGES
        ]
        + [["sum", *([""] * a.repeats), fmt(total["file"], ".0f"), "100%", "", ""]],
    )
    forms_table = md_table(
        ["stage (median ns/tuple)", *ns],
        [[k, *(fmt(ns[w][k], ".0f") for w in ns)] for k in STAGES]
        + [
            [f"{k}: {lib} alone (ratio)", *(f"{ref[w][k]:.0f} ({ns[w][k] / ref[w][k]:.1f}x)" for w in ns)]
            for k, lib in REFERENCES.items()
        ]
        + [
            [
                "results: pyarrow's write and Arrow's take (ratio)",
                *(
                    f"{ref[w]['results'] + gather[w]['take']:.0f} ({write_and_take[w]:.1f}x)" if w in gather else ""
                    for w in ns
                ),
            ],
            [
                "read: of it the payload log (read without it / pyarrow)",
                *(f"{log[w]:.0f} ({(ns[w]['read'] - log[w]) / ref[w]['read']:.1f}x)" if w in log else "" for w in ns),
            ],
        ]
        + [["sum", *(fmt(total[w], ".0f") for w in ns)], ["pipeline limit (tuples/s)", *(fmt(limit[w]) for w in ns)]]
        + [
            [f"cluster {k.replace('_', '-')} (tuples/s)", *(fmt(rates[w][k]) for w in ns)]
            for k in ("in_run", "whole_process")
        ]
        + [
            [f"{k.replace('_', '-')} / limit", *(f"{ratios[w][k]:.2f}" for w in ns)]
            for k in ("in_run", "whole_process")
        ],
    )
    lines = [
        f"Pipeline limit: {cores} cores / {total['file']:.0f} ns = {limit['file']:,.0f} tuples/s.",
        f"Cluster ({a.slaves} slaves, unpaced; medians of {a.repeats}): in-run {rates['file']['in_run']:,.0f} tuples/s "
        f"({ratios['file']['in_run']:.2f} of the limit), whole process {rates['file']['whole_process']:,.0f} "
        f"({ratios['file']['whole_process']:.2f}; {data['whole_process_to_in_run']:.2f} of the in-run rate).",
        *peer_text,
        f"The metrics: in-run {rates['file, metrics off']['in_run']:,.0f} tuples/s without them, "
        f"{data['metrics_on_to_off']:.3f} of that with them; CPU (the whole process, every rank) "
        f"{rates['file']['cpu_ns_per_tuple']:,.0f} ns a tuple with them, "
        f"{rates['file, metrics off']['cpu_ns_per_tuple']:,.0f} without ({data['metrics_cpu_on_to_off']:.3f}). "
        "The run with them is the one beside the DuckDB peer, and a run right after other work is slower "
        "(docs/benchmarks.md): bench.metrics_cost alternates the two for the metrics' target.",
        "The same tuples as two declared streams, without and with three payload columns a side (bench.payload's):\n\n"
        + forms_table
        + f"\n\nWith payload the cluster joins {data['payload_to_streams']:.2f} of the rate without. Of the results "
        f"stage with payload, gathering the columns costs {gather['payload']['ours']:.0f} ns a tuple; Arrow's take of "
        f"the same rows from the same columns in memory {gather['payload']['take']:.0f} "
        f"({data['gather_to_take']['payload']:.1f}x); the stage is {write_and_take['payload']:.1f}x pyarrow's write "
        "and Arrow's take together. "
        f"With its read and results at those libraries' costs and the other stages as they are, the payload's sum "
        f"would be {floor:.0f} ns a tuple: its rate at most {data['payload_to_streams_at_references']:.2f} of the "
        f"rate without (target {PAYLOAD_TARGET}: "
        + ("reachable" if data["payload_to_streams_at_references"] >= PAYLOAD_TARGET else "out of reach")
        + ").",
    ]
    for role, frames in top.items():
        lines.append(
            f"Top frames of the {role} by own time (py-spy, `profile-{role}.txt`): "
            + "; ".join(f"{f} {share:.0%}" for f, share in frames)
        )
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "limit.json").write_text(json.dumps(data, indent=2))
    (a.out / "limit.md").write_text(
        f"# What a tuple costs, stage by stage\n\n`{data['command']}` — {machine['date']}; {machine['cpu']}, "
        f"{cores} cores; {a.rows:,} rows of `{' '.join(WORKLOAD)}`\n\n" + table + "\n\n" + "\n\n".join(lines) + "\n"
    )
    print(table + "\n\n" + "\n".join(lines) + f"\nwrote {a.out / 'limit.md'}, {a.out / 'limit.json'}")
    if not side_by_side["results_agree"]:
        print(f"bench.limit: the cluster and DuckDB disagree on the results: {peer_text[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
