"""The cluster seen from outside: samples of the master's counters, as Prometheus metrics, a live dashboard
and a Parquet log (`metrics/`).

The master already holds every counter (RunStats, from ingest and the slaves' reports), the controller's
load bookkeeping and partition map (paper 003, IV-A) and the hot keys; `tick` copies them into one sample at
the progress cadence: O(slaves + partitions) per sample, nothing per tuple.  Scrapes and the dashboard read
the latest sample from the server's thread (common.dashboard); the loop never waits for them.

With several dispatchers (BiStream 3.2.3) each other dispatcher sends its counters to rank 0 at the same
cadence (TAG_METRICS, a small pickled dict, no tuple data) into a receive rank 0 keeps posted; rank 0 adds
them up and serves.  At the end each sends a last one marked final and rank 0 waits for all of them
(`finish`), so no send is left unmatched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import sys
import time
from collections import Counter, deque

import numpy as np
import pyarrow as pa
from mpi4py import MPI
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from master.state.stats import RunStats
from protocol import delays, eventtime
from common.dashboard import DashboardServer, sample_schema
from protocol.strict_json import finite
from protocol.messages import TAG_METRICS
from protocol.lifetime import invocation
from protocol.output import write_table

if TYPE_CHECKING:
    from protocol.plan import Plan

#: samples the live dashboard keeps (an hour at one a second); the log keeps them all
HISTORY = 3600
#: the largest counters message of another dispatcher (its RunStats state: a few hundred bytes a slave)
MESSAGE_BYTES = 1 << 22
#: Prometheus buckets: every 5th edge of the delay bins (4 a decade, 1 us .. 10^4 s); cumulative counts of
#: whole bins, so exact at these edges
BUCKET_EDGES = delays.EDGES[::5]
_BUCKET_INDEX = np.arange(0, len(delays.EDGES), 5)
#: a bin's representative delay for the histogram's _sum: the geometric middle of its edges
_MIDDLES = np.concatenate([[delays.EDGES[0]], np.sqrt(delays.EDGES[1:] * delays.EDGES[:-1]), [delays.EDGES[-1]]])


#: a Kafka partition's labels
KAFKA_LABELS = ("stream", "topic", "partition")


def rejected_reasons(source) -> dict[str, int]:
    """Rejected inputs by reason, as far as the source has got (a ZeroMQ source counts messages, a file its
    rows as the run passes them); with several dispatchers the first counts the file's."""
    return dict(source.reasons)


def refused_kinds(source) -> dict[str, int]:
    """ZeroMQ messages refused for want of source.token, by kind (END or TUPLES): master/sources/producers.py."""
    return dict(source.refused)


class Metrics:
    def __init__(self, comm: MPI.Comm, plan: Plan, index: int):
        self.comm, self.plan, self.index = comm, plan, index
        self.k = plan.cluster.dispatchers
        mc = plan.metrics
        self.enabled = bool(mc.endpoint or mc.log_interval)
        self.interval = plan.output.progress or 1.0
        self.out = plan.output.path
        self.next = 0.0
        self.seq = 0
        self.samples: deque[dict] = deque(maxlen=HISTORY)
        self.view: dict | None = None  #: what a scrape reads: the latest sample and the histograms
        self.summary: dict | None = None
        self.moves_by_reason: Counter[str] = Counter()
        self._moves_seen = 0
        self._rejected: dict[str, int] | None = None
        self._sending: MPI.Request | None = None
        self._others: dict[int, dict] = {}  #: rank 0: the latest counters of every other dispatcher
        self._receiving: dict[int, tuple[MPI.Request, bytearray]] = {}
        self.log_interval, self._log_rows, self._log_files, self._next_log = mc.log_interval, [], 0, 0.0
        self._stamp = time.strftime("%Y%m%dT%H%M%S")  #: a resumed run's log files sit beside the first run's
        self._last_input: dict[str, tuple[int, float]] = {}  #: per stream: its input count and when it last rose
        self.server = None
        if not self.enabled or index > 0:
            return
        for d in range(1, self.k):
            self._post(d)
        if mc.endpoint:
            self.registry = CollectorRegistry()
            self.registry.register(self)
            ProcessCollector(registry=self.registry)  # the master's own CPU and memory (process_*)
            self.server = DashboardServer(mc.endpoint, self.data, lambda: generate_latest(self.registry))

    @property
    def url(self) -> str:
        return self.server.url if self.server else ""

    # -- the loop's side ----------------------------------------------------------------------------
    def tick(self, master, now: float) -> None:
        """At the cadence: a sample (rank 0) or this dispatcher's counters sent to rank 0."""
        if now < self.next:
            return
        if self.next == 0.0 and self.index == 0 and self.plan.output.progress:
            print(
                f"output: {self.out.resolve()}/ (results/, late/, metrics/, summary.json)"
                + (f"; metrics {self.url}metrics, dashboard {self.url}" if self.server else ""),
                file=sys.stderr,
                flush=True,
            )
        self.next = now + self.interval
        if not self.enabled:
            return
        if self.index > 0:
            if self._sending is None or self._sending.Test():
                self._sending = self.comm.isend(self._counters(master), dest=0, tag=TAG_METRICS)
            return
        self._receive()
        self._add(self._sample(master, now, [o["stats"] for o in self._others.values()]))

    def finish(self, master) -> None:
        """The loop has ended: another dispatcher sends its last counters, rank 0 waits for every one."""
        if not self.enabled:
            return
        if self.index > 0:
            if self._sending is not None:
                self._sending.Wait()
            self.comm.isend({**self._counters(master), "final": True}, dest=0, tag=TAG_METRICS).Wait()
            return
        while self._receiving:  # polled, not a blocking wait: MPI's spins and takes a core from the slaves
            self._receive()
            time.sleep(1e-3)

    def close(self, master, summary: dict) -> None:
        """Rank 0, after the summary: the final sample (its counters now include every dispatcher's), the
        rest of the log, the final exposition as `metrics.prom`; the server stops; the closing line."""
        out = self.out.resolve()
        if self.enabled:
            self.summary = summary
            self._add(self._sample(master, time.time(), []))
            self._write_log()
            if self.server:
                (self.out / "metrics.prom").write_bytes(generate_latest(self.registry))
                self.server.close()
        seen = [f"dashboard was live at {self.url}"] if self.server else []
        if self.log_interval:
            seen.append(f"look at the run again: {invocation('control.dashboard')} {out}")
        print(
            "; ".join([f"summary {out / 'summary.json'}", f"results in {out / 'results'}/", *seen]),
            file=sys.stderr,
            flush=True,
        )

    # -- several dispatchers ----------------------------------------------------------------------------
    def _counters(self, master) -> dict:
        return {
            "stats": master.stats.state(time.time()),
            "watermark": master.ingest.frontier(),
            "stream_max_ts": master.ingest.stream_max_ts,
            "buffered": len(master.buffers),
            "rejected": rejected_reasons(master.source),
            "filtered": dict(master.source.filtered),
            "refused": refused_kinds(master.source),
            "stream_gaps": dict(master.results_out.gaps),
            "kafka_partitions": master.source.partitions(),  # its own, when the dispatchers share them out
        }

    def _post(self, d: int, buf: bytearray | None = None) -> None:
        buf = bytearray(MESSAGE_BYTES) if buf is None else buf
        self._receiving[d] = (self.comm.irecv(buf, source=d, tag=TAG_METRICS), buf)

    def _receive(self) -> None:
        for d, (request, buf) in list(self._receiving.items()):
            done, got = request.test()
            if not done:
                continue
            self._others[d] = got
            del self._receiving[d]
            if not got.get("final"):
                self._post(d, buf)  # the message is unpickled: its buffer takes the next one

    # -- samples ---------------------------------------------------------------------------------
    def _sample(self, m, now: float, others: list[dict]) -> dict:
        """One sample: counters summed over the dispatchers, the controller's view, the hot keys."""
        stats = m.stats
        if others:  # rank 0's own counters plus the others' (RunStats.merge, as the summary does at the end)
            stats = RunStats(m.slaves, now)
            stats.restore(m.stats.state(now))
            for o in others:
                stats.merge(o)
        c = m.controller
        for move in c.moves_log[self._moves_seen :]:
            self.moves_by_reason[move["reason"]] += 1
        self._moves_seen = len(c.moves_log)
        self._rejected = Counter(rejected_reasons(m.source))
        filtered = Counter(m.source.filtered)
        for o in self._others.values():
            self._rejected.update(o["rejected"])
            filtered.update(o["filtered"])
        refused = Counter(refused_kinds(m.source))
        gaps = Counter(m.results_out.gaps)  # gaps opened in result stream subscribers' seq, by reason
        for o in self._others.values():
            refused.update(o["refused"])
            gaps.update(o["stream_gaps"])
        marks = [
            m.ingest.frontier(),
            *(self._others[d]["watermark"] if d in self._others else eventtime.NEG_INF for d in range(1, self.k)),
        ]
        stream_tops = [
            m.ingest.stream_max_ts,
            *(
                self._others[d]["stream_max_ts"] if d in self._others else [eventtime.NEG_INF] * 2
                for d in range(1, self.k)
            ),
        ]
        seconds = lambda w: finite(eventtime.bound_seconds(w))
        delay_r, delay_s = m.ingest.stream_delays  # each stream's own max_delay
        occupancy = c.occupancy()
        owned = np.bincount(
            c.partition_map[c.partition_map >= 0],  # -1: a free hot-key slot
            minlength=max(m.slaves) + 1,
        )
        per = stats.per_slave
        hist = stats.delay_hist
        last = self.view["hist"] if self.view else np.zeros_like(hist)
        p50, p99 = delays.percentiles(hist - last, (50, 99))  # over the interval since the last sample
        done = m.checkpoints.log
        hot_log = [] if m.hot is None else m.hot.log
        elapsed_run = now - m.ingest.t0
        for stream in ("R", "S"):  # an idle stream: no new input since (Flink's idle sources)
            count, since = self._last_input.get(stream, (-1, now))
            self._last_input[stream] = (count, since) if stats.input[stream] == count else (stats.input[stream], now)
        sample = {
            "seq": self.seq,
            "time": now,
            "elapsed": m.stats.elapsed_before + now - m.stats.started,
            "input_r": stats.input["R"],
            "input_s": stats.input["S"],
            "results": stats.results,
            "late": stats.late,
            "rejected": int(sum(self._rejected.values())),
            "idle_seconds_r": now - self._last_input["R"][1],
            "idle_seconds_s": now - self._last_input["S"][1],
            "result_stream_gaps": int(sum(gaps.values())),
            "delay_p50": finite(p50),
            "delay_p99": finite(p99),
            "buffered": len(m.buffers) + sum(self._others[d]["buffered"] for d in self._others),
            "backlog_max_seconds": max(stats.backlog_max, 0.0),
            "pacing_lag_max_seconds": max(stats.pacing_lag_max, 0.0),
            "watermark": [seconds(w) for w in marks],
            "watermark_r": [seconds(t[0] - delay_r) for t in stream_tops],
            "watermark_s": [seconds(t[1] - delay_s) for t in stream_tops],
            "moves": len(c.moves_log),
            "tuples_moved": stats.tuples_moved,
            "reorganizations": c.reorganizations,
            "partition_splits": stats.splits,
            "partition_merges": stats.merges,
            "checkpoints": m.checkpoints.written,
            "checkpoint_age_seconds": finite(elapsed_run - done[-1]["seconds"]) if done else None,
            "checkpoint_duration_seconds": done[-1]["duration"] if done else None,
            "slaves": list(m.slaves),
            "active": [r in c.active for r in m.slaves],
            "hosts": [m.stats.hosts[r] if r < len(m.stats.hosts) else "" for r in m.slaves],
            "busy_seconds": [per[r]["busy_seconds"] for r in m.slaves],
            "tuples_joined": [per[r]["tuples_processed"] for r in m.slaves],
            "slave_results": [per[r]["results"] for r in m.slaves],
            "occupancy": [occupancy.get(r, 0.0) for r in m.slaves],
            "window_tuples": [per[r]["window_tuples"] for r in m.slaves],
            "window_bytes": [per[r]["window_bytes"] for r in m.slaves],
            "rss_bytes": [per[r]["peak_rss_bytes"] for r in m.slaves],
            "slots_missed": [per[r]["slots_missed"] for r in m.slaves],
            "cpu_seconds": [per[r]["cpu_seconds"] for r in m.slaves],
            "comm_seconds": [per[r]["comm_seconds"] for r in m.slaves],
            "partitions": [int(owned[r]) for r in m.slaves],
            "partition_map": c.partition_map.tolist(),
            "moving": np.flatnonzero(c.moving).tolist(),
            "kafka_partitions": m.source.partitions()
            + [p for o in self._others.values() for p in o["kafka_partitions"]],
            "hot_keys": []
            if m.hot is None
            else [
                {"key": key, "first": first, "size": size, "slaves": c.partition_map[first : first + size].tolist()}
                for key, (first, size) in m.hot.router.hot.items()
            ],
        }
        self.view = {
            "sample": sample,
            "hist": hist.copy(),
            "parts": stats.parts_hist.copy(),
            "input": dict(stats.input),
            "rejected": dict(self._rejected),
            "filtered": dict(filtered),
            "refused": dict(refused),
            "stream_gaps": dict(gaps),
            "moves": dict(self.moves_by_reason),
            "hot_events": Counter(e["event"] for e in hot_log),
            "started": m.stats.started - m.stats.elapsed_before,
            "capacity": self.plan.master.buffer_capacity,
            "moves_log": c.moves_log[-100:],
            "hot_log": hot_log[-100:],
            "checkpoint_log": done[-100:],
        }
        return sample

    def _add(self, sample: dict) -> None:
        self.seq += 1
        self.samples.append(sample)
        if self.log_interval:
            self._log_rows.append(sample)
            if sample["time"] >= self._next_log:
                self._write_log()

    def _write_log(self) -> None:
        """The samples since the last file as one Parquet file of `metrics/`."""
        if self._log_rows:
            table = pa.Table.from_pylist(self._log_rows, schema=sample_schema())
            write_table(self.out / "metrics", f"samples-{self._stamp}-{self._log_files:06d}", table, "parquet")
            self._log_rows, self._log_files = [], self._log_files + 1
        self._next_log = time.time() + self.log_interval

    # -- what the server asks for (its own thread: reads the latest references only) ---------------------
    def data(self, since: int) -> dict:
        view = self.view or {}
        return {
            "live": self.summary is None,
            "samples": [s for s in list(self.samples) if s["seq"] >= since],
            "moves": view.get("moves_log", []),
            "hot_events": view.get("hot_log", []),
            "checkpoints": view.get("checkpoint_log", []),
            "summary": finite(self.summary),
            "config": {
                "dispatchers": self.k,
                "buffer_capacity": self.plan.master.buffer_capacity,
                "source": self.plan.source.kind,
                "output": str(self.out.resolve()),
            },
        }

    def describe(self):  # prometheus_client: no samples at registration
        return []

    def collect(self):
        """The Prometheus metrics of the latest sample (names and meanings: docs/metrics.md)."""
        view = self.view
        if view is None:
            return
        s = view["sample"]
        slaves = [str(r) for r in s["slaves"]]

        def counter(name, doc, value, labels=(), rows=None):
            fam = CounterMetricFamily(f"streamjoin_{name}", doc, labels=list(labels))
            for values, v in rows if rows is not None else [((), value)]:
                fam.add_metric(list(values), v)
            return fam

        def gauge(name, doc, value, labels=(), rows=None):
            fam = GaugeMetricFamily(f"streamjoin_{name}", doc, labels=list(labels))
            for values, v in rows if rows is not None else [((), value)]:
                fam.add_metric(list(values), float("nan") if v is None else v)
            return fam

        def per_slave(key):
            return [((r,), v) for r, v in zip(slaves, s[key])]

        source = self.plan.source.kind
        yield counter(
            "input_tuples",
            "on-time tuples taken in, by stream and source kind",
            None,
            ("stream", "source"),
            [((st, source), n) for st, n in view["input"].items()],
        )
        yield counter("results", "join results produced", s["results"])
        yield counter(
            "late_tuples",
            "tuples set aside as late (ts below max ts seen minus max_delay, or below the watermark)",
            s["late"],
        )
        yield counter(
            "rejected",
            "inputs rejected (file rows; ZeroMQ messages), by reason",
            None,
            ("reason",),
            [((k,), v) for k, v in view["rejected"].items()],
        )
        yield counter(
            "filtered_tuples",
            "rows a query's filter dropped where they were read, by stream (docs/query.md)",
            None,
            ("stream",),
            [((k,), v) for k, v in view["filtered"].items()],
        )
        yield counter(
            "refused_messages",
            "ZeroMQ messages refused and ignored: no or wrong source.token, by kind (end, tuples)",
            None,
            ("kind",),
            [((k,), view["refused"].get(k, 0)) for k in ("end", "tuples")],
        )
        yield counter(
            "result_stream_gaps",
            "gaps opened in a result stream subscriber's messages, by reason "
            "(subscriber_full: output.subscriber_buffer_bytes behind; subscriber_timeout: ordered, full "
            "for output.subscriber_timeout)",
            None,
            ("reason",),
            [((k,), v) for k, v in view["stream_gaps"].items()],
        )
        yield _histogram(
            "delay_seconds", "production delay of results (arrival of the later tuple to result)", [((), view["hist"])]
        )
        yield _histogram(
            "delay_part_seconds",
            "production delay split into buffer, transfer and join",
            [((p,), h) for p, h in zip(delays.PARTS, view["parts"])],
            ("part",),
        )
        yield counter(
            "slave_busy_seconds", "seconds each slave spent joining", None, ("slave",), per_slave("busy_seconds")
        )
        yield counter("slave_joined_tuples", "tuples each slave joined", None, ("slave",), per_slave("tuples_joined"))
        yield counter("slave_results", "results each slave produced", None, ("slave",), per_slave("slave_results"))
        yield counter(
            "slave_slots_missed",
            "slots at which the slave was still joining its last batch",
            None,
            ("slave",),
            per_slave("slots_missed"),
        )
        yield counter(
            "slave_cpu_seconds", "CPU seconds of each slave process", None, ("slave",), per_slave("cpu_seconds")
        )
        yield counter(
            "slave_comm_seconds",
            "seconds each slave spent receiving batches and sending reports",
            None,
            ("slave",),
            per_slave("comm_seconds"),
        )
        yield gauge(
            "slave_active",
            "1 if the slave is in the active set (paper V-A)",
            None,
            ("slave",),
            [((r,), int(a)) for r, a in zip(slaves, s["active"])],
        )
        yield gauge("slave_partitions", "partition-groups the slave owns", None, ("slave",), per_slave("partitions"))
        yield gauge(
            "slave_occupancy_ratio",
            "mean unjoined tuples at its slots over balance.buffer_capacity, this reorganization epoch (paper IV-C)",
            None,
            ("slave",),
            per_slave("occupancy"),
        )
        yield gauge(
            "slave_window_tuples", "tuples stored in the slave's windows", None, ("slave",), per_slave("window_tuples")
        )
        yield gauge(
            "slave_window_bytes", "bytes of the slave's window state", None, ("slave",), per_slave("window_bytes")
        )
        yield gauge(
            "slave_peak_resident_memory_bytes",
            "largest resident memory the slave reported",
            None,
            ("slave",),
            per_slave("rss_bytes"),
        )
        yield counter(
            "moves",
            "partition-groups moved between slaves, by reason",
            None,
            ("reason",),
            [((k,), v) for k, v in view["moves"].items()],
        )
        yield counter("moved_tuples", "stored tuples moved with partition-groups", s["tuples_moved"])
        yield counter("reorganizations", "reorganization epochs (balancing decisions)", s["reorganizations"])
        yield gauge("partitions_moving", "partition-groups whose state is in flight", len(s["moving"]))
        yield counter("partition_splits", "extendible-hash splits in the slaves", s["partition_splits"])
        yield counter("partition_merges", "extendible-hash merges in the slaves", s["partition_merges"])
        yield gauge("hot_keys", "keys that have a grid of sub-groups now", len(s["hot_keys"]))
        yield gauge(
            "hot_key_grid_size",
            "sub-groups of each hot key",
            None,
            ("key",),
            [((str(h["key"]),), h["size"]) for h in s["hot_keys"]],
        )
        yield counter(
            "hot_key_events",
            "hot keys split out (split) and gathered back (merge)",
            None,
            ("event",),
            [((e,), view["hot_events"].get(e, 0)) for e in ("split", "merge")],
        )
        yield gauge(
            "watermark_seconds",
            "event time below which no on-time tuple can still arrive, per dispatcher",
            None,
            ("dispatcher",),
            [((str(d),), w) for d, w in enumerate(s["watermark"])],
        )
        yield gauge(
            "stream_watermark_seconds",
            "one stream's own largest event time minus its max_delay, per "
            "dispatcher (a stream that lags behind the other shows here; the join's is watermark_seconds)",
            None,
            ("stream", "dispatcher"),
            [
                ((st, str(d)), w)
                for st, key in (("R", "watermark_r"), ("S", "watermark_s"))
                for d, w in enumerate(s[key])
            ],
        )
        yield gauge(
            "stream_idle_seconds",
            "seconds since the stream's input count last rose",
            None,
            ("stream",),
            [(("R",), s["idle_seconds_r"]), (("S",), s["idle_seconds_s"])],
        )
        yield gauge("buffered_tuples", "tuples in the master's mini-buffers", s["buffered"])
        yield gauge("buffer_capacity_tuples", "master.buffer_capacity (per dispatcher)", view["capacity"])
        yield gauge(
            "backlog_max_seconds", "longest a tuple waited beyond one distribution epoch", s["backlog_max_seconds"]
        )
        yield gauge(
            "pacing_lag_max_seconds",
            "paced input: longest the due tuples waited to be ingested",
            s["pacing_lag_max_seconds"],
        )
        yield counter("checkpoints", "complete checkpoints written", s["checkpoints"])
        yield gauge(
            "checkpoint_age_seconds", "seconds since the last checkpoint completed", s["checkpoint_age_seconds"]
        )
        yield gauge("checkpoint_duration_seconds", "seconds the last checkpoint took", s["checkpoint_duration_seconds"])
        yield gauge(
            "run_start_time_seconds",
            "when the run started (unix time; a resumed run: its first start)",
            view["started"],
        )
        if s["kafka_partitions"]:  # Kafka streams, per partition
            place = lambda p: (p["stream"], p["topic"], str(p["partition"]))  # noqa: E731
            for kind, name, doc in (
                (gauge, "lag", "records at the broker not handed on to the join yet"),
                (counter, "records", "records read"),
                (counter, "bytes", "bytes of record values read"),
                (counter, "lost", 'records deleted at the broker before they were read, skipped (on_lost = "skip")'),
                (
                    counter,
                    "rewound",
                    'records a checkpoint had read that the broker no longer held, read on past (on_lost = "skip")',
                ),
            ):
                rows = [(place(p), p[name]) for p in s["kafka_partitions"]]
                suffix = "_records" * (name in ("lag", "lost", "rewound"))
                yield kind(f"kafka_{name}{suffix}", doc, None, KAFKA_LABELS, rows)


def _histogram(name: str, doc: str, rows, labels=()) -> HistogramMetricFamily:
    fam = HistogramMetricFamily(f"streamjoin_{name}", doc, labels=list(labels))
    for values, hist in rows:
        cum = np.cumsum(hist)
        buckets = [(repr(float(e)), int(cum[i])) for e, i in zip(BUCKET_EDGES, _BUCKET_INDEX)]
        fam.add_metric(list(values), buckets + [("+Inf", int(cum[-1]))], sum_value=float(hist @ _MIDDLES))
    return fam
