"""`python -m tests.nemesis --minutes N [--seed S]`: one unbounded run meeting every kind of fault, one after another.

The run: the namespace test bed (deploy.testbed), the cluster on three hosts (h1: the master and a second
dispatcher; h2, h3: the slaves) under the supervisor (control.supervise), a fourth host holding the Kafka-protocol
test broker (noida-db), which the nemesis never cuts off.  Producers write views and buys into their topics all the
while, at a steady rate with bursts in which one user is hot; the engine left-joins them (an outer join, hot keys
on, groups moving at every reorganization, checkpoints every second) into result files and the transactional Kafka
sink.  The nemesis, on a schedule drawn from the seed, SIGKILLs a slave, the master or the dispatcher, SIGSTOPs a
slave (the heartbeats find it), cuts a slave host's link and brings it back, SIGKILLs the broker (and starts it
again on its data) or pauses it, fills the output disk (a small tmpfs) and frees it.  Each fault waits for the
run to be well again (a checkpoint complete after the last fault) and then the schedule's gap: faults fire on an
event of the run and then on time, so a slow machine fires fewer of them but never fires one into a run that is
still restarting.  At the end the producers stop, the run reads every record (its groups' committed offsets, a
complete checkpoint's, reach every partition's end) and a SIGTERM stops it.

The check: the sink topic read with read_committed and the result files each equal the reference join
(tests.reference) of what the input topics hold after the run, each row once.  The test broker saves about once a
second, so a SIGKILL loses records it had acknowledged: the engine is judged on what the broker kept, and a pair
or row of a record the broker lost after the engine had read it is counted apart, as the broker's loss.  Every
exit code seen (the supervisor's restarts, its own end) must be one the README documents.  While the faults
fire, the resources are sampled (tests.resources: each rank's memory and open files, the master's buffers, the
checkpoints and the payload log on disk), and each must stay flat.  The same seed draws the same schedule
(printed first); `tests/cluster/test_nemesis.py` runs the short form in `make test`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import psutil
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

from deploy.broker import local_broker, up_command
from deploy.launch import mpi_env
from deploy.testbed import TestBed
from protocol.lifetime import CODES
from protocol.output import LEFT_UNMATCHED, MATCHED, read_tables
from tests.kafka import WINDOW, create, read_topic, settings
from tests.matrix import MOVING, enter_netns, within_netns
from tests.reference import duckdb_outer, encode_pairs, late_flags, micros
from tests.resources import MiB, Sampler, Verdict, flatness, folder_bytes
from tests.runs import write_config

FAULTS = (
    "kill-slave",
    "kill-master",
    "kill-dispatcher",
    "stop-slave",
    "cut-host",
    "kill-broker",
    "pause-broker",
    "fill-disk",
)
IDS = ("views_vid", "buys_bid")
PARTITIONS = 4  #: of each input topic
USERS = 120
SLOTS = [2, 2, 1]  #: ranks on h1 (master, dispatcher 1), h2 (slaves 2, 3), h3 (slave 4)
BROKER_HOST = 3  #: the bed's fourth host: the broker, the producers and the checks; never cut off
HEARTBEAT = 5.0
#: far above how far a fault makes one partition's records come after another's (a paused broker's backlog, a
#: recovery's): a partition passed over meanwhile (caught up, idle) brings no record below what was handed on
#: minus this, so no record is late (master.sources.partitions) and the reference need not know the timing
MAX_DELAY = 30.0
#: rows of each stream's duplicate-id check a dispatcher keeps (source.duplicate_window), in memory and in every
#: checkpoint (17 bytes a row): they grow until they hold this many, and the default million takes hours to fill at
#: the soak's rate (about 80 rows a second a stream a dispatcher); this fills within the soak's first minute or
#: two, after which the checkpoints must stay flat (docs/testing.md), and still spans a minute of each stream
DUPLICATE_WINDOW = 5_000
RECOVERY = 180.0  #: seconds a run has to be well again (a checkpoint complete) after a fault
DISPATCHERS = 2  #: ranks 0 (the master) and 1
#: a dispatcher's progress line: its results (a restarted run counts on from its checkpoint's) and buffered tuples
PROGRESS = re.compile(
    r"^(?:\[dispatcher (\d+)\] )?\[\s*[\d.]+s\] in [\d,]+ .*?\| results ([\d,]+) .*?\| buffered ([\d,]+) "
)
RESTART = re.compile(r"restart \d+ of \d+")  #: the supervisor's line of a crash it restarts
HELD = re.compile(r"results wait for a subscriber behind: ([\d.]+) of")  #: a result stream's held MiB
SUPERVISE = [
    *(sys.executable, "-m", "control.supervise"),
    *("--restarts", "1000", "--backoff", "0.5", "--max-backoff", "4", "--"),
]


@dataclass
class Step:
    """One fault of the schedule: `gap` seconds after the run is well again, `hold` seconds long (a pause, a cut,
    a full disk, a broker down), `pick` chooses the victim among those running."""

    fault: str
    gap: float
    hold: float
    pick: int

    def __str__(self) -> str:
        return f"{self.fault} after {self.gap:.1f}s, held {self.hold:.1f}s, victim pick {self.pick}"


def schedule(seed: int, steps: int = 500) -> list[Step]:
    """The nemesis's faults, drawn from `seed` alone: each kind once per round, rounds shuffled."""
    rng = np.random.default_rng([seed, 50])
    out: list[Step] = []
    while len(out) < steps:
        for i in rng.permutation(len(FAULTS)).tolist():
            out.append(
                Step(FAULTS[i], float(rng.uniform(2, 12)), float(rng.uniform(3, 10)), int(rng.integers(1 << 30)))
            )
    return out[:steps]


class Feed(threading.Thread):
    """One stream's producer on the broker's host: `rate` records a second, bursts of 5x for 2 s at random in
    which a third of the records go to user u0 (a hot key); each record's event time is the time it is produced
    (rising within each partition), its partition crc32(user) % PARTITIONS.  Records whose delivery failed are
    sent again; the acknowledged ones are kept (`acked`: id -> (partition, offset)) against what the broker holds at the
    end."""

    def __init__(self, ns: str, bootstrap: str, topic: str, id_column: str, first_id: int, rate: float, seed: int):
        super().__init__(daemon=True)
        self.ns, self.bootstrap, self.topic, self.id_column = ns, bootstrap, topic, id_column
        self.next_id, self.rate = first_id, rate
        self.rng = np.random.default_rng(seed)
        self.values: dict[int, tuple[bytes, int]] = {}  #: id -> (value, partition), of every record sent
        self.acked: dict[int, tuple[int, int]] = {}
        self.retry: set[int] = set()
        self.generation = 0  #: of the producer now: a report of one before it is not heard
        self.fatal = threading.Event()
        self.stopping = threading.Event()
        self.errors: Counter = Counter()
        self.bursts = 0
        self.start()

    def producer(self) -> Producer:
        def on_error(err):
            if err.fatal():
                self.fatal.set()
            self.errors[err.name()] += 1

        return Producer(
            {
                "bootstrap.servers": self.bootstrap,
                "enable.idempotence": True,
                "linger.ms": 5,
                "message.timeout.ms": 600_000,
                "error_cb": on_error,
                "log_level": 0,  # the broker's restarts are expected: counted (`errors`), not logged
            }
        )

    def delivered(self, generation: int, i: int, err, msg) -> None:
        if generation != self.generation:
            return
        if err is None:
            self.acked[i] = (msg.partition(), msg.offset())
        else:
            self.errors[err.name()] += 1
            self.retry.add(i)

    def send(self, p: Producer, i: int) -> None:
        value, partition = self.values[i]
        report = functools.partial(self.delivered, self.generation, i)
        while True:
            try:
                p.produce(self.topic, value, partition=partition, on_delivery=report)
                return
            except BufferError:
                p.poll(0.1)
            except KafkaException:  # fatal: `recover` sends it again
                self.fatal.set()
                return

    def run(self) -> None:
        enter_netns(self.ns)
        p = self.producer()
        tick, burst_until = 0.05, 0.0
        while not self.stopping.is_set():
            now = time.monotonic()
            if now >= burst_until and self.rng.random() < tick / 15:  # about one burst in 15 s
                burst_until, self.bursts = now + 2.0, self.bursts + 1
            bursting = now < burst_until
            n = int(self.rng.poisson(self.rate * tick * (5 if bursting else 1)))
            hot = self.rng.random(n) < (1 / 3 if bursting else 0)
            users = np.where(hot, 0, self.rng.integers(1, USERS, n))
            for u in users.tolist():
                i, self.next_id = self.next_id, self.next_id + 1
                user = f"u{u}"
                record = {self.id_column: i, "user": user, "at": int(time.time() * 1000), "page": f"/p{i % 7}"}
                self.values[i] = (json.dumps(record).encode(), zlib.crc32(user.encode()) % PARTITIONS)
                self.send(p, i)
            p = self.recover(p)
            self.serve(p.poll, 0)
            time.sleep(max(0.0, tick - (time.monotonic() - now)))
        while time.monotonic() < self.deadline:  # every record acknowledged, or the deadline
            p = self.recover(p)
            if self.serve(p.flush, 1) == 0 and not self.retry and not self.fatal.is_set():
                break

    def serve(self, call, *args) -> int:
        """The producer's `call` (poll, flush, purge); a fatal error raised is `recover`'s to mend."""
        try:
            return call(*args) or 0
        except KafkaException:
            self.fatal.set()
            return 1

    def recover(self, p: Producer) -> Producer:
        """A fatal error (the broker restarted without the producer's state): a new producer sends again every
        record not acknowledged; records whose delivery failed are sent again."""
        if self.fatal.is_set():
            self.serve(p.purge)
            self.fatal.clear()
            self.generation += 1
            p = self.producer()
            self.retry = set(self.values) - set(self.acked)
        retry, self.retry = sorted(self.retry), set()
        for i in retry:
            self.send(p, i)
        return p

    def finish(self, within: float) -> None:
        """Stop producing; wait up to `within` s for every record to be acknowledged."""
        self.deadline = time.monotonic() + within
        self.stopping.set()
        self.join(within + 10)


def read_ended(bootstrap: str, topics: dict[str, str]) -> bool:
    """Whether each stream's group has committed (a complete checkpoint's offsets) every partition's end."""
    for topic in topics.values():
        consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"group-{topic}"})
        try:
            parts = [TopicPartition(topic, p) for p in range(PARTITIONS)]
            committed = consumer.committed(parts, timeout=20)
            ends = [consumer.get_watermark_offsets(tp, 20)[1] for tp in parts]
        finally:
            consumer.close()
        if any(c.offset < e for c, e in zip(committed, ends)):
            return False
    return True


@dataclass
class Report:
    seed: int
    minutes: float
    steps: list[Step]
    fired: Counter = field(default_factory=Counter)
    log: list[str] = field(default_factory=list)  #: each fault fired, when, on whom
    exit_codes: Counter = field(default_factory=Counter)  #: of the cluster's runs the supervisor restarted
    final_code: int | None = None
    restarts: int = 0
    results: dict = field(default_factory=dict)
    broker: dict = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    faults: list[dict] = field(default_factory=list)  #: each fired: seconds into the run, kind, victim
    recovery: list[float | None] = field(default_factory=list)  #: per fault: seconds to the first new result
    lost: dict = field(default_factory=dict)  #: per output: pairs and views alone missing (must be 0)
    resources: list[Verdict] = field(default_factory=list)  #: each sampled series' peaks and verdict
    series: dict = field(default_factory=dict)  #: each sampled series: [(seconds, value)]
    sampled: float = 0.0  #: seconds the resources were sampled over
    oldest_rank: float = 0.0  #: seconds the longest-lived rank process ran (faults restart them all)

    @property
    def ok(self) -> bool:
        return not self.failures

    def table(self) -> str:
        rows = [("seed", str(self.seed)), ("minutes", f"{self.minutes:g}")]
        rows += [(f"fault {k}", str(self.fired[k])) for k in FAULTS]
        rows += [("faults fired", str(sum(self.fired.values()))), ("restarts", str(self.restarts))]
        rows += [("exit codes (restarted)", ", ".join(f"{c} x{n}" for c, n in sorted(self.exit_codes.items())))]
        rows += [("exit code (end)", str(self.final_code))]
        rows += [(k, str(v)) for k, v in {**self.results, **self.broker}.items()]
        if self.resources:
            rows += [("resources sampled", f"{self.sampled:.0f}s; the longest a rank lived {self.oldest_rank:.0f}s")]
            rows += [v.row() for v in self.resources]
        rows += [("verdict", "PASS" if self.ok else "FAIL: " + "; ".join(self.failures))]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

    def record(self) -> dict:
        """The report as JSON (`--record`; bench.failover reads it): each fault with the seconds to the first new
        result after it, what was lost, each resource's peaks by thirds (bytes, counts), the verdict."""
        return {
            "seed": self.seed,
            "minutes": self.minutes,
            "faults": [f | {"first_result_s": r} for f, r in zip(self.faults, self.recovery)],
            "restarts": self.restarts,
            "exit_codes": {str(c): n for c, n in sorted(self.exit_codes.items())},
            "final_code": self.final_code,
            "lost": self.lost,
            "results": {k: str(v) for k, v in {**self.results, **self.broker}.items()},
            "sampled_seconds": round(self.sampled, 1),
            "oldest_rank_seconds": round(self.oldest_rank, 1),
            "resources": {v.name: {"thirds": v.thirds, "peak": v.peak, "failure": v.failure} for v in self.resources},
            "series": {name: [[round(t, 1), v] for t, v in points] for name, points in self.series.items()},
            "failures": self.failures,
            "ok": self.ok,
        }


class Nemesis:
    """The bed, the broker, the feeds and the supervised cluster of one soak, and the faults it fires."""

    def __init__(self, tmp: Path, seed: int, rate: float, disk_mib: int, log=print):
        self.tmp, self.seed, self.rate, self.say = tmp, seed, rate, log
        self.stack = ExitStack()
        self.oldest_rank, self.sampled_lines = 0.0, 0  #: what the resources' samples saw so far
        try:
            self.set_up(tmp, disk_mib)
        except BaseException:  # what is up already comes down: no bed, broker or mount left behind
            self.stack.close()
            raise

    def set_up(self, tmp: Path, disk_mib: int) -> None:
        """The bed, the output's tmpfs, the broker on its host and the topics."""
        self.bed = self.stack.enter_context(TestBed(4))
        self.ns = self.bed.ns(BROKER_HOST)
        self.within = within_netns(self.ns)
        self.disk = tmp / "disk"  #: the output's own small file system, which a fault fills
        self.disk.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={disk_mib}m", "nemesis", str(self.disk)], check=True)
        self.stack.callback(subprocess.run, ["umount", "-l", str(self.disk)], capture_output=True)
        self.broker_data = tmp / "broker"
        self.broker_data.mkdir()
        self.host = self.bed.address(BROKER_HOST)
        self.bootstrap = self.stack.enter_context(
            local_broker(self.broker_data, self.bed.on(BROKER_HOST), self.within, host=self.host)
        )
        self.port = int(self.bootstrap.rsplit(":", 1)[1])
        self.topics = {"views": "nemesis-views", "buys": "nemesis-buys"}
        self.sink = "nemesis-pairs"
        for topic, n in [(t, PARTITIONS) for t in self.topics.values()] + [(self.sink, 3)]:
            self.within(lambda: create(self.bootstrap, topic, n))

    def config(self) -> dict:
        cfg = settings(
            self.bootstrap,
            self.topics,
            **{
                "join.type": "left",
                "join.max_delay": f"{MAX_DELAY:g}s",
                "partitioning.partitions": 16,
                "epochs.distribution": "200ms",
                "epochs.reorganization": 1.0,
                "checkpoint.interval": 5,
                "cluster.dispatchers": 2,
                "cluster.heartbeat_timeout": HEARTBEAT,
                "cluster.network": "10.77.0.0/24",
                "hotkeys.enabled": True,
                "hotkeys.threshold": 0.15,
                "source.duplicate_window": DUPLICATE_WINDOW,
                **MOVING,
                "balance.seed": self.seed,
                "output.progress": 1.0,
                "output.kafka": {"topic": self.sink, "bootstrap": self.bootstrap, "timeout": "10s"},
            },
        )
        for name, topic in self.topics.items():
            # the test broker loses records it had acknowledged when killed: a recovery reads on past them
            cfg[f"streams.{name}.kafka"] |= {"bounded": False, "group": f"group-{topic}", "on_lost": "skip"}
            cfg[f"streams.{name}.idle_timeout"] = "1s"
        cfg["output.path"] = str(self.disk / "out")
        return cfg

    def start(self) -> None:
        self.feeds = {
            name: Feed(self.ns, self.bootstrap, topic, "vid" if name == "views" else "bid", k * 10**9, self.rate, seed)
            for k, ((name, topic), seed) in enumerate(zip(self.topics.items(), ([self.seed, 1], [self.seed, 2])))
        }
        hostfile = self.bed.hostfile(SLOTS, [0, 1, 2])
        cmd = [*SUPERVISE, sys.executable, "-m", "deploy.launch", "-n", str(sum(SLOTS)), "--hostfile", str(hostfile)]
        cmd += ["--", "--config", str(write_config(self.tmp, self.config()))]
        self.job = self.bed.start(0, cmd, mpi_env())
        threading.Thread(target=self.keep_log, daemon=True).start()

    def keep_log(self) -> None:
        """The run's stderr into nemesis-SEED.log (the temporary folder) as it comes, for what went wrong."""
        with (Path(tempfile.gettempdir()) / f"nemesis-{self.seed}.log").open("w") as f:
            written = 0
            while True:
                ended = self.job.proc.poll() is not None
                new = self.job.lines[written:]
                f.writelines(line for _, line in new)
                f.flush()
                written += len(new)
                if ended:
                    return
                time.sleep(1.0)

    # --- what the run says -------------------------------------------------------------------------------------

    def lines_since(self, at: float) -> list[str]:
        return [line for t, line in list(self.job.lines) if t > at]

    def wait_since(self, at: float, match, timeout: float) -> bool:
        """Whether a line logged after `at` matches, within `timeout` s (False: none, or the run ended)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if any(match(line) for line in self.lines_since(at)):
                return True
            if self.job.proc.poll() is not None:
                return False
            time.sleep(0.2)
        return False

    def well_since(self, at: float, timeout: float) -> bool:
        """A checkpoint completed after `at`: the run is up and well again."""
        return self.wait_since(at, lambda line: re.search(r"checkpoint \d+ complete", line), timeout)

    # --- victims -----------------------------------------------------------------------------------------------

    def ranks(self) -> dict[int, psutil.Process]:
        """The cluster's ranks now running, by rank (on hosts whose link is up)."""
        out = {}
        for host in range(3):
            for pid in self.bed.pids(host):
                try:
                    p = psutil.Process(pid)
                    if p.name().startswith("python") and "master" in p.cmdline():
                        out[int(p.environ()["OMPI_COMM_WORLD_RANK"])] = p
                except (psutil.Error, KeyError, ValueError):
                    pass
        return out

    def resources(self) -> dict[str, float]:
        """One sample (tests.resources): every running rank's resident memory and open files by rank, the
        supervisor's, each dispatcher's buffered tuples at most since the last sample (its progress lines), the
        checkpoints, the payload log and the rest of the output on disk."""
        out: dict[str, float] = {}
        procs = {
            f"{'master' if r == 0 else 'dispatcher' if r < DISPATCHERS else 'slave'} (rank {r})": p
            for r, p in self.ranks().items()
        }
        procs["supervisor"] = psutil.Process(self.job.proc.pid)
        now = time.time()
        for who, p in procs.items():
            try:
                with p.oneshot():
                    out[f"rss {who}"], out[f"fds {who}"] = p.memory_info().rss, p.num_fds()
                    if who != "supervisor":
                        self.oldest_rank = max(self.oldest_rank, now - p.create_time())
            except psutil.Error:  # ended meanwhile: the next sample sees its successor
                pass
        lines, self.sampled_lines = self.job.lines[self.sampled_lines :], len(self.job.lines)
        for _, line in lines:
            if m := PROGRESS.match(line):
                name = f"buffered at dispatcher {m.group(1) or 0}"
                out[name] = max(out.get(name, 0), int(m.group(3).replace(",", "")))
            if m := HELD.search(line):
                out["held results"] = max(out.get("held results", 0), float(m.group(1)) * MiB)
        folder = self.disk / "out"
        parts = {"checkpoints on disk": folder / "checkpoints", "payload log on disk": folder / "payload"}
        sizes = {name: folder_bytes(path) for name, path in parts.items()}
        out |= sizes
        out["output on disk (results, late, archive, metrics)"] = folder_bytes(folder) - sum(sizes.values())
        return out

    def broker_processes(self) -> list[psutil.Process]:
        out = []
        for pid in self.bed.pids(BROKER_HOST):
            try:
                p = psutil.Process(pid)
                if "noida" in p.name() or any("noida" in w for w in p.cmdline()):
                    out.append(p)
            except psutil.Error:
                pass
        return out

    def start_broker(self) -> None:
        up = subprocess.run(
            up_command(self.broker_data, self.port, self.host, self.bed.on(BROKER_HOST)),
            capture_output=True,
            text=True,
            timeout=120,
        )
        if up.returncode != 0:
            raise RuntimeError(f"the broker does not start again: {up.stderr.strip()[-300:]}")

    # --- faults ------------------------------------------------------------------------------------------------

    def fire(self, step: Step) -> str | None:
        """Fire `step`'s fault; what it hit (None: no victim now, nothing fired)."""
        ranks = self.ranks()
        slaves = sorted(r for r in ranks if r >= 2)
        if step.fault in ("kill-slave", "stop-slave") and slaves:
            rank = slaves[step.pick % len(slaves)]
            ranks[rank].send_signal(signal.SIGKILL if step.fault == "kill-slave" else signal.SIGSTOP)
            if step.fault == "stop-slave":
                stopped = ranks[rank]
                self.wait_since(time.monotonic(), lambda line: "restart" in line, 60)
                try:
                    stopped.resume()  # the job is over; whatever is left of it may end
                except psutil.Error:
                    pass
            return f"rank {rank}"
        if step.fault in ("kill-master", "kill-dispatcher") and (rank := int(step.fault == "kill-dispatcher")) in ranks:
            ranks[rank].send_signal(signal.SIGKILL)
            return f"rank {rank}"
        if step.fault == "cut-host":
            host = 1 + step.pick % 2
            self.bed.cut(host)
            at = time.monotonic()
            self.wait_since(at, lambda line: "restarting on" in line, 60)
            time.sleep(step.hold)
            self.bed.mend(host)
            return f"host {self.bed.name(host)} for {time.monotonic() - at:.1f}s"
        if step.fault in ("kill-broker", "pause-broker"):
            procs = self.broker_processes()
            if not procs:
                return None
            for p in procs:
                p.send_signal(signal.SIGKILL if step.fault == "kill-broker" else signal.SIGSTOP)
            time.sleep(step.hold)
            if step.fault == "kill-broker":
                self.start_broker()
            else:
                for p in procs:
                    p.send_signal(signal.SIGCONT)
            return f"for {step.hold:.1f}s"
        if step.fault == "fill-disk":
            fill = self.tmp / "disk" / "fill"  # beside the output folder, not in it
            subprocess.run(["dd", "if=/dev/zero", f"of={fill}", "bs=1M"], capture_output=True)
            time.sleep(step.hold)
            fill.unlink()
            return f"for {step.hold:.1f}s"
        return None

    def soak(self, report: Report, seconds: float) -> bool:
        """Fire the schedule's faults until `seconds` have passed, each once the run is well again; False (a
        failure noted) when it is not well again within RECOVERY s of a fault."""
        end = time.monotonic() + seconds
        last = time.monotonic()
        for step in report.steps:
            if not self.well_since(last, RECOVERY):
                errors = [line.strip() for line in self.lines_since(last) if line.startswith("error:")]
                fault = report.log[-1].split(None, 1)[1] if report.log else "the start"
                report.failures.append(
                    f"no checkpoint complete within {RECOVERY:g}s of {fault} (the run's last error: "
                    f"{errors[-1] if errors else 'none'})"
                )
                return False
            gap_end = min(end, time.monotonic() + step.gap)
            time.sleep(max(0.0, gap_end - time.monotonic()))
            if time.monotonic() >= end - 10:  # the last seconds are the run's, to be well at the end
                break
            began = time.monotonic()
            hit = self.fire(step)
            if hit is not None:
                report.fired[step.fault] += 1
                report.faults.append({"at": round(began - self.started, 2), "fault": step.fault, "hit": hit})
                report.log.append(f"{began - self.started:7.1f}s {step.fault} {hit}")
                self.say(f"nemesis: {report.log[-1]}")
            last = time.monotonic()
        time.sleep(max(0.0, end - time.monotonic()))
        return True

    def finish(self, report: Report, within: float) -> None:
        """Stop the feeds, wait for the run to have read every record, stop it with SIGTERM."""
        for feed in self.feeds.values():
            feed.finish(120)
        end = time.monotonic() + within
        while not self.within(lambda: read_ended(self.bootstrap, self.topics)):
            if time.monotonic() > end or self.job.proc.poll() is not None:
                if within:  # else the failure that cut it short is noted
                    report.failures.append(f"the run did not read every record within {within:g}s of the feeds' end")
                break
            time.sleep(1.0)
        self.job.proc.send_signal(signal.SIGTERM)
        try:
            report.final_code = self.job.wait(timeout=120)
        except subprocess.TimeoutExpired:
            report.failures.append("the run did not end within 120s of SIGTERM")
            self.job.proc.kill()
            report.final_code = self.job.wait(timeout=30)

    def close(self) -> None:
        if getattr(self, "job", None) is not None and self.job.proc.poll() is None:
            self.job.proc.kill()
        self.stack.close()


def kept(records: list[tuple[int, int, bytes, bytes]], id_column: str) -> dict:
    """A stream of the records a topic holds, in each partition's order: ids, keys (user uN: N), times (ms),
    partitions, and whether each is on time within its partition (below the largest time before it there
    minus max_delay: late), as the engine judges Kafka records."""
    records = sorted(records)
    values = [json.loads(v) for _, _, _, v in records]
    s = {
        "id": np.array([v[id_column] for v in values], np.int64),
        "key": np.array([int(v["user"][1:]) for v in values], np.int64),
        "at": np.array([v["at"] for v in values], np.int64),
        "partition": np.array([p for p, _, _, _ in records], np.int64),
        "offset": np.array([o for _, o, _, _ in records], np.int64),
    }
    s["on_time"] = np.ones(len(values), bool)
    for p in np.unique(s["partition"]):
        mine = s["partition"] == p
        s["on_time"][mine] = ~late_flags(s["at"][mine] * 1000, MAX_DELAY)
    return s


def first_copies(s: dict) -> tuple[dict, np.ndarray]:
    """`s` without the later copies of a repeated id, and those copies' rows: a producer fenced by the restarted
    broker sends again what it had no acknowledgement for, and the broker may have kept it already.  The engine's
    duplicate-id check sets the later copy aside (each copy goes to the same partition, its records hand on in
    offset order, and a resend comes well within `DUPLICATE_WINDOW` rows), so the reference joins the first."""
    order = np.lexsort((s["offset"], s["partition"]))
    _, first = np.unique(s["id"][order], return_index=True)
    keep = np.zeros(len(order), bool)
    keep[order[first]] = True
    return {k: v[keep] for k, v in s.items()}, np.flatnonzero(~keep)


def set_aside(out: Path, topics: dict[str, str], later: dict[str, tuple[dict, np.ndarray]], report: Report) -> None:
    """Every later copy of a repeated id the topics hold (`later`: per stream, every record held and the rows of
    later copies) is listed in `rejected/` as a duplicate id, once."""
    listed = read_tables(out / "rejected")
    for name, (s, rows) in later.items():
        want = Counter(zip(s["partition"][rows].tolist(), s["offset"][rows].tolist()))
        got: Counter = Counter()
        if listed is not None:
            mine = pc.and_(pc.equal(listed["topic"], topics[name]), pc.starts_with(listed["reason"], "duplicate id"))
            rows_listed = listed.filter(mine)
            got.update(zip(rows_listed["partition"].to_pylist(), rows_listed["offset"].to_pylist()))
        unlisted, twice = len(want - got), sum(n - 1 for n in got.values() if n > 1)
        report.results[f"{name}: later copies of an id"] = (
            f"{len(rows)} in the topic; set aside as duplicates {len(got)} (not listed {unlisted}, twice {twice})"
        )
        if unlisted or twice:
            report.failures.append(f"{name}: {unlisted} later copies of an id not set aside, {twice} listed twice")


def with_lost(s: dict, lost: set, feed: Feed, id_column: str) -> dict:
    """`s` with the records the broker lost (`lost` ids) added, as on time: what the engine may have read."""
    values = [json.loads(feed.values[i][0]) for i in sorted(lost)]
    more = {
        "id": [v[id_column] for v in values],
        "key": [int(v["user"][1:]) for v in values],
        "at": [v["at"] for v in values],
        "partition": [feed.values[i][1] for i in sorted(lost)],
        "offset": [feed.acked[i][1] for i in sorted(lost)],
        "on_time": [True] * len(values),
    }
    return {k: np.concatenate([s[k], np.array(more[k], s[k].dtype)]) for k in s}


def at_lost_offsets(s: dict, lost: set, feed: Feed) -> np.ndarray:
    """The ids of records the topic holds at an offset the broker had acknowledged for a record it then lost: it
    gave the offset again, so a reader that had passed it (having read the lost record) never sees them."""
    offsets = s.get("offset")
    taken = {feed.acked[i] for i in lost}
    return np.array(
        sorted(i for i, p, o in zip(s["id"].tolist(), s["partition"].tolist(), offsets.tolist()) if (p, o) in taken),
        np.int64,
    )


def left_join(views: dict, buys: dict) -> tuple[np.ndarray, np.ndarray]:
    """DuckDB's left join of the on-time views and buys (same user, times within the window): (the pairs
    encoded, the views alone)."""
    v, b = views["on_time"], buys["on_time"]
    pairs, alone, _ = duckdb_outer(
        views["id"][v],
        views["at"][v] * 1000,
        views["key"][v],
        buys["id"][b],
        buys["at"][b] * 1000,
        buys["key"][b],
        -micros(WINDOW),
        micros(WINDOW),
        "equal",
        join_type="left",
    )
    return pairs, alone


def rows_of(table: pa.Table | None) -> tuple[np.ndarray, np.ndarray]:
    """(the pairs encoded, the views alone) of result rows."""
    if table is None:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    kind = table["kind"].to_numpy(zero_copy_only=False)
    vid, bid = (table[c].fill_null(0).to_numpy().astype(np.int64) for c in IDS)
    return encode_pairs(vid[kind == MATCHED], bid[kind == MATCHED]), np.sort(vid[kind == LEFT_UNMATCHED])


def judge(name: str, pairs: np.ndarray, alone: np.ndarray, ref: dict, report: Report) -> None:
    """The pairs and views alone of one output against the reference (`ref`): exact on every record the broker
    kept; counted apart, as the broker's: a pair or a lone view of a record it lost after the engine read it, and
    a pair or lone view missing for a record it holds at an offset it had given a lost record (the engine, past
    that offset, never sees it: a Kafka broker's leader epochs would tell the client, the test broker's do not)."""
    lost_v, lost_b = ref["lost_views"], ref["lost_buys"]
    touches = np.isin(pairs >> 32, lost_v) | np.isin(pairs & 0xFFFFFFFF, lost_b)
    got, want = Counter(pairs[~touches].tolist()), Counter(ref["pairs"].tolist())
    gone = np.array(sorted((want - got).elements()), np.int64)
    reused = np.isin(gone >> 32, ref["reused_views"]) | np.isin(gone & 0xFFFFFFFF, ref["reused_buys"])
    missing, extra = int((~reused).sum()), sum((got - want).values())
    twice = sum(n - 1 for n in got.values() if n > 1)
    beyond = len(set(pairs[touches].tolist()) - set(ref["pairs_all"].tolist()))
    lone = Counter(alone[~np.isin(alone, lost_v)].tolist())
    must, may = set(ref["alone"].tolist()), set(ref["alone_maybe"].tolist())
    unseen = must - set(lone)
    lone_reused = len(unseen & set(ref["reused_views"].tolist()))
    lone_missing = len(unseen) - lone_reused
    lone_extra = len(set(lone) - must - may)
    lone_twice = sum(n - 1 for n in lone.values() if n > 1)
    report.results[f"{name}: pairs"] = (
        f"{len(pairs)} (reference {len(ref['pairs'])}; missing {missing}, extra {extra}, twice {twice}; apart: "
        f"{int(touches.sum())} of lost records, {int(reused.sum())} missing of records at their offsets)"
    )
    report.results[f"{name}: views alone"] = (
        f"{len(alone)} (reference {len(must)}; missing {lone_missing}, extra {lone_extra}, twice {lone_twice}; "
        f"apart: {lone_reused} missing at lost records' offsets)"
    )
    report.lost[name] = {"pairs": missing, "views alone": lone_missing}
    if missing or extra or twice or beyond or lone_missing or lone_extra or lone_twice:
        report.failures.append(f"{name} differ from the reference (see the table)")


def check(nemesis: Nemesis, report: Report) -> None:
    """The outputs against the reference join of what the topics hold; the broker's own losses apart."""
    topics = {name: nemesis.within(lambda t=t: read_topic(nemesis.bootstrap, t)) for name, t in nemesis.topics.items()}
    held = {"views": kept(topics["views"], "vid"), "buys": kept(topics["buys"], "bid")}  #: every copy
    firsts = {name: first_copies(s) for name, s in held.items()}
    (views, _), (buys, _) = firsts["views"], firsts["buys"]
    feeds = nemesis.feeds
    lost = {name: set(feeds[name].acked) - set(s["id"].tolist()) for name, s in (("views", views), ("buys", buys))}
    pairs, alone = left_join(views, buys)
    every_pair, alone_any = left_join(
        with_lost(views, lost["views"], feeds["views"], "vid"), with_lost(buys, lost["buys"], feeds["buys"], "bid")
    )
    late = int((~views["on_time"]).sum() + (~buys["on_time"]).sum())
    reused = {name: at_lost_offsets(s, lost[name], feeds[name]) for name, s in (("views", views), ("buys", buys))}
    seen_buys = {k: v[~np.isin(buys["id"], reused["buys"])] for k, v in buys.items()}
    _, alone_unseen = left_join(views, seen_buys)
    ref = {
        "pairs": pairs,
        "pairs_all": every_pair,
        "alone": np.setdiff1d(alone_any, np.array(sorted(lost["views"]), np.int64)),  # alone whatever it read
        # partners only among the records the broker lost, or among those at their offsets (which it may not see)
        "alone_maybe": np.union1d(np.setdiff1d(alone, alone_any), np.setdiff1d(alone_unseen, alone)),
        "lost_views": np.array(sorted(lost["views"]), np.int64),
        "lost_buys": np.array(sorted(lost["buys"]), np.int64),
        "reused_views": reused["views"],
        "reused_buys": reused["buys"],
    }
    report.broker = {
        "input records (kept by the broker)": f"views {len(views['id'])}, buys {len(buys['id'])}",
        "acknowledged, then lost by the broker": f"views {len(lost['views'])}, buys {len(lost['buys'])}",
        "kept at offsets of lost records": f"views {len(reused['views'])}, buys {len(reused['buys'])}",
        "bursts": f"views {feeds['views'].bursts}, buys {feeds['buys'].bursts}",
        "producer errors": dict(feeds["views"].errors + feeds["buys"].errors),
        "late (reference)": late,
    }
    if not len(views["id"]) or not len(buys["id"]) or not len(pairs):
        report.failures.append("the topics hold no records or the reference no pair: nothing was tested")
    out = nemesis.disk / "out"
    set_aside(out, nemesis.topics, {name: (held[name], later) for name, (_, later) in firsts.items()}, report)
    table = read_tables(out / "results")
    judge("files", *rows_of(table), ref, report)
    sink = nemesis.within(lambda: read_topic(nemesis.bootstrap, nemesis.sink))
    values = [json.loads(v) for _, _, _, v in sink]
    columns = {c: [v[c] for v in values] for c in (*IDS, "kind")}
    judge("sink (read_committed)", *rows_of(pa.table(columns) if values else None), ref, report)
    every = nemesis.within(lambda: read_topic(nemesis.bootstrap, nemesis.sink, "read_uncommitted"))
    report.results["sink records of aborted transactions"] = len(every) - len(sink)
    late_rows = read_tables(out / "late")
    if (0 if late_rows is None else late_rows.num_rows) != late:
        report.failures.append(f"{0 if late_rows is None else late_rows.num_rows} rows late, the reference {late}")
    if not report.ok:  # the evidence, beside the run's log
        keep = Path(tempfile.gettempdir()) / f"nemesis-{report.seed}-out"
        shutil.rmtree(keep, ignore_errors=True)
        shutil.copytree(out, keep, ignore=shutil.ignore_patterns("payload", "archive"))
        with (keep / "input.json").open("w") as f:
            json.dump({name: {k: v.tolist() for k, v in x.items()} for name, x in held.items()}, f)
        with (keep / "acked.json").open("w") as f:
            json.dump({name: list(feed.acked.items()) for name, feed in feeds.items()}, f)
        report.results["kept for a look"] = str(keep)


def flat(report: Report, sampler: Sampler, nemesis: Nemesis) -> None:
    """Stop sampling (the soak's faults are over; the end's catch-up is not judged) and judge every resource."""
    report.sampled = sampler.stop()
    report.oldest_rank = nemesis.oldest_rank
    report.resources, report.series = flatness(sampler.series, report.sampled), sampler.series
    if not any(v.name.startswith("rss slave") for v in report.resources):
        report.failures.append(f"no rank was sampled ({sampler.errors} samples failed: {sampler.last_error})")
    report.failures += [f"{v.name}: {v.failure}" for v in report.resources if v.failure]


def first_results(lines: list[tuple[float, str]], faults: list[dict], started: float) -> list[float | None]:
    """Per fault, the seconds from it to the first new result: after the restart it caused (the supervisor's
    line, before the next fault), the first progress line of a dispatcher counting more results than any of its
    lines before that restart -- the crashed run may still have made some after the fault, and the restarted one
    counts on from its checkpoint, so this is past its replay; for a fault ridden out, more than before the fault.
    None: none came before the end."""
    progress = [
        (t - started, int(m.group(1) or 0), int(m.group(2).replace(",", "")))
        for t, line in lines
        if (m := PROGRESS.match(line))
    ]
    restarts = [t - started for t, line in lines if RESTART.search(line)]
    out: list[float | None] = []
    for k, fault in enumerate(faults):
        until = faults[k + 1]["at"] if k + 1 < len(faults) else float("inf")
        since = next((t for t in restarts if fault["at"] <= t < until), fault["at"])
        before: dict[int, int] = {}
        for t, d, n in progress:
            if t < since:
                before[d] = max(before.get(d, 0), n)
        after = (t for t, d, n in progress if t >= since and n > before.get(d, 0))
        out.append(next((round(t - fault["at"], 2) for t in after), None))
    return out


def run(minutes: float, seed: int, rate: float = 100.0, disk_mib: int = 256, log=print) -> Report:
    """One soak of `minutes`; its report (faults fired, exit codes, results, verdict)."""
    report = Report(seed, minutes, schedule(seed))
    with tempfile.TemporaryDirectory(prefix="nemesis-") as folder:
        nemesis = Nemesis(Path(folder), seed, rate, disk_mib, log)
        try:
            nemesis.start()
            nemesis.started = time.monotonic()
            sampler = Sampler(nemesis.resources)
            well = nemesis.well_since(0.0, RECOVERY)
            if not well:
                report.failures.append(f"no checkpoint complete within {RECOVERY:g}s of the start")
            else:
                well = nemesis.soak(report, minutes * 60)
            flat(report, sampler, nemesis)
            nemesis.finish(report, within=180 if well else 0)
            report.recovery = first_results(nemesis.job.lines, report.faults, nemesis.started)
            stderr = nemesis.job.stderr()
            codes = [int(c) for c in re.findall(r"the cluster crashed \(exit code (\d+)\)", stderr)]
            report.exit_codes, report.restarts = Counter(codes), len(RESTART.findall(stderr))
            undocumented = sorted({c for c in [*codes, report.final_code] if c not in CODES})
            if undocumented:
                report.failures.append(f"exit codes the README does not document: {undocumented}")
            if report.final_code != 0:
                report.failures.append(f"the run ended with exit {report.final_code}, not 0, after SIGTERM")
            check(nemesis, report)
        finally:
            nemesis.close()
    return report


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.nemesis", description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=60.0, help="how long the nemesis fires faults (default 60)")
    p.add_argument("--seed", type=int, default=None, help="the schedule's seed (default: drawn, and printed)")
    p.add_argument("--rate", type=float, default=100.0, help="records a second of each stream (default 100)")
    p.add_argument("--disk-mib", type=int, default=256, help="the output's tmpfs, MiB (default 256)")
    p.add_argument("--record", type=Path, default=None, help="write the report as JSON here too (bench.failover)")
    a = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the bed, the broker and the disk are cleaned up
    seed = a.seed if a.seed is not None else int.from_bytes(os.urandom(3), "little")
    steps = schedule(seed)
    print(f"nemesis: seed {seed}; schedule (each once the run is well again):", flush=True)
    for i, step in enumerate(steps[: max(8, int(a.minutes * 6))]):
        print(f"  {i + 1:3d}. {step}", flush=True)
    report = run(a.minutes, seed, a.rate, a.disk_mib, log=lambda m: print(m, flush=True))
    print(report.table(), flush=True)
    if a.record is not None:
        a.record.write_text(json.dumps(report.record(), indent=1))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
