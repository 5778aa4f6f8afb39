"""What the master knows about the run: counters from ingest and slave reports, progress, summary (pure: told
the time; the summary's file and lines are written by the shell, master.lifecycle)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import json
import math

import numpy as np

from protocol import delays, wire
from protocol.access import public

if TYPE_CHECKING:
    from protocol.plan import Output, Plan

#: seconds one batch may take before the progress line names its slave (a busy host's batches take a second)
LONG_BATCH = 2.0


class RunStats:
    def __init__(self, slaves: list[int], now: float):
        self.started = now
        self.input = {"R": 0, "S": 0}
        self.late = 0
        self.results = 0
        self.splits = 0
        self.merges = 0
        self.delay_hist = np.zeros(delays.BINS, dtype=np.int64)
        self.parts_hist = np.zeros((len(delays.PARTS), delays.BINS), dtype=np.int64)  #: the delay's parts
        self.delay_max = 0.0
        #: slots_missed: slots at which the slave was still joining its last batch (its tuples wait an epoch more)
        self.per_slave = {
            r: {
                "tuples_processed": 0,
                "window_tuples": 0,
                "window_bytes": 0,
                "busy_seconds": 0.0,
                "results": 0,
                "epochs": 0,
                "slots_missed": 0,
                "result_files": 0,
                "peak_rss_bytes": 0,
                "pss_start_bytes": 0,
                "cpu_seconds": 0.0,
                "comm_seconds": 0.0,
                "largest_batch_results": 0,
                "chunked_batches": 0,
                "result_chunks": 0,
            }
            for r in slaves
        }
        self._last_line = (self.started, 0)  #: (time, tuples in) at the last progress line
        self.stopped_by_signal = False
        self.tuples_moved = 0
        self.pacing_lag_max = 0.0  #: paced input: largest time the due tuples waited to be ingested
        #: largest time a tuple waited in the mini-buffers beyond one distribution epoch (its slave's slot)
        self.backlog_max = 0.0
        self.buffered_peak = 0  #: most tuples the mini-buffers ever held (at most master.buffer_capacity)
        #: slaves that said they are still joining one long batch: (results so far, seconds it has taken)
        self.joining: dict[int, tuple[int, float]] = {}
        self.elapsed_before = 0.0  #: seconds run before the checkpoint this run resumed from
        #: start-up (protocol.startup): unix times of the launch, all ranks ready, the first tuple ingested,
        #: the last result written (the slaves' final reports in); the master's PSS before data
        self.launched = self.first_tuple = self.last_result = None
        self.pss_start = 0
        self.hosts: list[str] = []  #: every rank's host, by rank

    _STATE = (
        "input",
        "late",
        "results",
        "splits",
        "merges",
        "delay_max",
        "tuples_moved",
        "pacing_lag_max",
        "backlog_max",
    )

    def state(self, now: float) -> dict:
        """The counters as JSON for a checkpoint manifest."""
        state = {
            **{k: getattr(self, k) for k in self._STATE},
            "delay_hist": self.delay_hist.tolist(),
            "parts_hist": self.parts_hist.tolist(),
            "per_slave": {str(r): v for r, v in self.per_slave.items()},
            "elapsed": self.elapsed_before + now - self.started,
        }
        return json.loads(json.dumps(state))  # a copy: the counters move on while the checkpoint completes

    def merge(self, other: dict) -> None:
        """Add another dispatcher's counters (its `state()`): sums, and maxima for levels and peaks."""
        for k in ("late", "results", "splits", "merges", "tuples_moved"):
            setattr(self, k, getattr(self, k) + other[k])
        for stream, n in other["input"].items():
            self.input[stream] += n
        self.delay_hist += np.array(other["delay_hist"], dtype=np.int64)
        self.parts_hist += np.array(other["parts_hist"], dtype=np.int64)
        self.delay_max = max(self.delay_max, other["delay_max"])
        self.pacing_lag_max = max(self.pacing_lag_max, other["pacing_lag_max"])
        self.backlog_max = max(self.backlog_max, other["backlog_max"])
        levels = (
            "window_tuples",
            "window_bytes",
            "peak_rss_bytes",
            "pss_start_bytes",
            "cpu_seconds",
            "comm_seconds",
            "largest_batch_results",
        )
        for rank, theirs in other["per_slave"].items():
            mine = self.per_slave[int(rank)]
            for k, v in theirs.items():
                mine[k] = max(mine[k], v) if k in levels else mine[k] + v

    def restore(self, state: dict) -> None:
        for k in self._STATE:
            setattr(self, k, state[k])
        self.delay_hist = np.array(state["delay_hist"], dtype=np.int64)
        self.parts_hist = np.array(state["parts_hist"], dtype=np.int64)
        then = {int(r): v for r, v in state["per_slave"].items()}  # slaves of this run only (a rescale)
        self.per_slave = {r: then.get(r, v) for r, v in self.per_slave.items()}
        self.elapsed_before = state["elapsed"]

    @property
    def ingested(self) -> int:
        return self.input["R"] + self.input["S"]

    def add_report(self, rank: int, c: dict[str, float], hists: np.ndarray) -> None:
        """A slave's report: counters and its delay histogram followed by those of the parts (delays.PARTS)."""
        s = self.per_slave[rank]
        self.joining.pop(rank, None)
        s["tuples_processed"] += int(c["tuples_r"] + c["tuples_s"])
        s["window_tuples"] = int(c["window_r"] + c["window_s"])
        s["window_bytes"] = int(c["window_bytes"])
        s["busy_seconds"] += c["busy"]
        s["results"] += int(c["results"])
        s["epochs"] += int(c["ack"] == 0)  # batches (and the stop), not move acknowledgements
        s["result_files"] += int(c["files"])
        s["peak_rss_bytes"] = max(s["peak_rss_bytes"], int(c["rss"]))
        s["pss_start_bytes"] = int(c["pss_start"])
        s["largest_batch_results"] = max(s["largest_batch_results"], int(c["results"]))
        if c["chunks"] > 1:  # a batch whose results outgrew output.result_chunk_rows
            s["chunked_batches"] += 1
            s["result_chunks"] += int(c["chunks"])
        s["cpu_seconds"] = round(c["cpu"], 3)
        s["comm_seconds"] = round(c["comm"], 3)
        self.results += int(c["results"])
        self.splits += int(c["splits"])
        self.merges += int(c["merges"])
        self.delay_hist += hists[0]
        self.parts_hist += hists[1:]
        self.delay_max = max(self.delay_max, c["delay_max"])

    def progress_line(self, now: float, buffered: int, active: int, moves: int) -> str:
        t0, n0 = self._last_line
        rate = (self.ingested - n0) / max(now - t0, 1e-9)
        self._last_line = (now, self.ingested)
        p50, p99 = delays.percentiles(self.delay_hist, (50, 99))
        chunked = sum(v["chunked_batches"] for v in self.per_slave.values())
        return (
            f"[{now - self.started:7.1f}s] in {self.ingested:,} ({rate:,.0f}/s) | results {self.results:,} | "
            f"late {self.late:,} | delay p50 {p50:.3f}s p99 {p99:.3f}s | buffered {buffered:,} | "
            f"slaves {active}/{len(self.per_slave)} | moves {moves}"
            + f" | chunked batches {chunked:,}" * bool(chunked)
            + self._longest_batch()
        )

    def _longest_batch(self) -> str:
        """The progress line's note of the slave longest at one batch, once that is a long one (LONG_BATCH):
        while it lasts no report comes, and the line would show a cluster standing still."""
        long = {rank: v for rank, v in self.joining.items() if v[1] >= LONG_BATCH}
        if not long:
            return ""
        rank, (results, seconds) = max(long.items(), key=lambda item: item[1][1])
        return (
            f" | slave {rank} still joining one batch after {seconds:.0f}s: {results:,} results so far"
            + f" (and {len(long) - 1} other slave{'s' * (len(long) > 2)})" * (len(long) > 1)
        )

    def chunking(self) -> dict:
        """How batches' results were cut into chunks (output.result_chunk_rows; slave.join): a run whose
        batches outgrow the bound says so here and in the progress line."""
        per = self.per_slave.values()
        return {
            "largest_batch_results": max((v["largest_batch_results"] for v in per), default=0),
            "chunked_batches": sum(v["chunked_batches"] for v in per),
            "chunks": sum(v["result_chunks"] for v in per),
        }

    def summary(self, plan: Plan, now: float, peak_rss_bytes: int) -> dict:
        """The run's part of summary.json; `peak_rss_bytes`: the master's own, as the shell reads it."""
        wall = self.elapsed_before + now - self.started
        p50, p95, p99 = (min(p, self.delay_max) for p in delays.percentiles(self.delay_hist, (50, 95, 99)))
        return {
            "input": dict(self.input),
            "input_total": self.ingested,
            "results": self.results,
            "late": self.late,
            "rejected": 0,  # the source counts what it set aside: its finish() entries replace this
            "wall_seconds": round(wall, 3),
            "throughput_tuples_per_s": round(self.ingested / wall, 1) if wall > 0 else 0.0,
            "delay_seconds": {
                "p50": p50,
                "p95": p95,
                "p99": p99,
                "max": self.delay_max,
                "note": "percentiles are upper edges of log bins: at most 12.2% above the exact value, capped at max",
            },
            "delay_parts_seconds": {
                **{
                    part: dict(zip(("p50", "p95", "p99"), delays.percentiles(h, (50, 95, 99))))
                    for part, h in zip(delays.PARTS, self.parts_hist)
                },
                "note": "where the delay goes, per result: buffer = the later tuple's arrival "
                "until the master sent its batch (its slave's slot), transfer = until "
                "the slave started joining it, join = until the result was produced",
            },
            "slaves": {
                str(r): {**v, "host": self.hosts[r] if r < len(self.hosts) else None} for r, v in self.per_slave.items()
            },
            "pacing_lag_max_seconds": round(max(self.pacing_lag_max, 0.0), 3),
            "backlog_max_seconds": round(max(self.backlog_max, 0.0), 3),
            "buffered_peak": self.buffered_peak,
            "master_peak_rss_bytes": peak_rss_bytes,
            "result_chunks": self.chunking(),
            "tuples_moved": self.tuples_moved,
            "partition_splits": self.splits,
            "partition_merges": self.merges,
            "stopped_by_signal": self.stopped_by_signal,
            "startup": self.startup(),
            "hosts": ranks_by_host(self.hosts),
            "config": public(plan.document),
        }

    def startup(self) -> dict:
        """Seconds from the launch to: all ranks ready, the first tuple ingested, the last result written; PSS
        per rank before data (a resumed run: of this run's launch)."""
        since = lambda t: None if t is None or self.launched is None else round(t - self.launched, 3)
        pss = {"0": self.pss_start, **{str(r): v["pss_start_bytes"] for r, v in self.per_slave.items()}}
        return {
            "ranks_ready_seconds": since(self.started),
            "first_tuple_seconds": since(self.first_tuple),
            "last_result_seconds": since(self.last_result),
            "pss_before_data_bytes": pss,
            "note": "from the launch (deploy.launch, else mpirun's start); PSS counts shared pages once",
        }


def ranks_by_host(hosts: list[str]) -> dict[str, list[int]]:
    """{host: its ranks} in the order of each host's first rank."""
    by: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by.setdefault(host, []).append(rank)
    return by


def spans(ranks: list[int]) -> str:
    """Ranks as runs: [0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ", ".join(f"{x[0]}-{x[-1]}" if len(x) > 1 else f"{x[0]}" for x in runs)


def seconds(x: float) -> str:
    return f"{x:.3f}s" if math.isfinite(x) else "n/a"


def _after(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}s"


def summary_lines(s: dict, output: Output) -> list[str]:
    """The summary as the lines the run ends with (the shell prints them); `output`: the plan's, which they
    name."""
    lines = []
    d = s["delay_seconds"]
    f = s.get("filtered")  # a query's filters
    filtered = f" (filtered R {f['R']:,}, S {f['S']:,})" if f else ""
    lines.append(
        f"done in {s['wall_seconds']:.1f}s: {s['input_total']:,} tuples in (R {s['input']['R']:,}, "
        f"S {s['input']['S']:,}){filtered}, {s['results']:,} results, {s['late']:,} late, {s['rejected']:,} rejected; "
        f"{s['throughput_tuples_per_s']:,.0f} tuples/s; delay p50 {seconds(d['p50'])} p95 {seconds(d['p95'])} "
        f"p99 {seconds(d['p99'])} max {seconds(d['max'])}; splits {s['partition_splits']}, "
        f"merges {s['partition_merges']}"
    )
    up = s["startup"]
    pss = sorted(up["pss_before_data_bytes"].values())
    lines.append(
        f"start-up: ranks ready {_after(up['ranks_ready_seconds'])}, "
        f"first tuple {_after(up['first_tuple_seconds'])}, "
        f"last result {_after(up['last_result_seconds'])} after the launch; PSS before data "
        f"{pss[len(pss) // 2] / 2**20:.0f} MiB per rank (median), {sum(pss) / 2**20:.0f} MiB in all"
    )
    lines.append("hosts: " + "; ".join(f"{host} rank{'s' * (len(r) > 1)} {spans(r)}" for host, r in s["hosts"].items()))
    parts = s["delay_parts_seconds"]
    lines.append(
        "delay parts p50 / p99: "
        + ", ".join(f"{k} {seconds(parts[k]['p50'])} / {seconds(parts[k]['p99'])}" for k in delays.PARTS)
        + f"; slots missed (slave still joining) {sum(v['slots_missed'] for v in s['slaves'].values()):,}"
    )
    c = s["result_chunks"]
    if c["chunked_batches"]:
        lines.append(
            f"results of {c['chunked_batches']:,} batches were built in {c['chunks']:,} chunks of at most "
            f"{wire.chunk_rows(output):,} rows (output.result_chunk_rows); the largest batch had "
            f"{c['largest_batch_results']:,} results"
        )
    if "zmq_ingest" in s:
        z = s["zmq_ingest"]
        lines.append(
            f"zmq ingest on {', '.join(z['endpoints'])}: {z['messages']:,} messages, {z['tuples']:,} tuples, "
            f"rejected {z['rejected_by_reason'] or 0}; producers held back {z['producers_blocked_seconds']:.2f}s "
            f"in all; buffered at most {s['buffered_peak']:,}"
        )
    for side, x in s.get("lateness", {}).items():  # [streams]: lateness and idleness per stream
        idle = x["idle"]
        lines.append(
            f"stream {side} ({x['stream']}): max_delay {x['max_delay']:g}s, {x['late']:,} late; "
            + (
                f"idle {len(idle)} time(s) for "
                f"{sum(i['ended_seconds'] - i['began_seconds'] for i in idle):.1f}s in all "
                f"(idle_timeout {x['idle_timeout']:g}s), the first from {idle[0]['began_seconds']:.1f}s"
                if idle
                else "never idle" + f" (idle_timeout {x['idle_timeout']:g}s)" * bool(x["idle_timeout"])
            )
        )
    if "streams" in s:  # [streams.*] (master.sources.streams); with text keys, what their dictionary holds
        k = s.get("keys")
        lines.append(
            f"streams: R = {s['streams']['R']}, S = {s['streams']['S']}"
            + (f"; {k['distinct']:,} distinct keys coded ({k['bytes'] / 2**20:.1f} MiB at the master)" if k else "")
            + f"; payload log {s['payload_log_bytes'] / 2**20:.1f} MiB, at most "
            f"{s['payload_log_peak_bytes'] / 2**20:.1f} MiB on disk at once"
        )
    if "result_stream" in s:
        r = s["result_stream"]
        lines.append(
            f"result stream on {', '.join(r['endpoints'])}: {r['results']:,} results, "
            f"{r['punctuations']:,} punctuations"
            f"{', ordered' if r['ordered'] else ''}; {r['gaps']:,} gaps for subscribers behind"
            f"{'; ingest held %.2fs' % r['ingest_held_seconds'] if r['ordered'] else ''}"
        )
    if "kafka_sink" in s:  # master.sink
        k = s["kafka_sink"]
        lines.append(
            f"kafka sink: {k['files']:,} result files in {k['topic']} "
            + ("(exactly once); " if k["exactly_once"] else "(at least once); ")
            + f"rank 0 sent {k['rows_at_end']:,} rows at the start and the end in {k['seconds_at_end']:.2f}s"
        )
    return lines
