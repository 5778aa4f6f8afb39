"""The master's run from its start to its end, around the loop (master/run.py): resuming from a checkpoint, the
first batch read while the other ranks start, the line that says every rank runs, and the end -- STOP to
every slave, their final reports, the summary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import resource
import sys
import time
from pathlib import Path

from master.effects import carry_out
from master.state.checkpoints import section
from master.state.intake import IngestDesk
from master.state.stats import ranks_by_host, spans, summary_lines
from protocol import checkpoint, eventtime
from protocol.orders import Order
from protocol.payload import remove_log
from protocol.startup import launched_at, restarts
from protocol.strict_json import json_text

if TYPE_CHECKING:
    from protocol.plan import Plan


def say_started(hosts: list[str], k: int, plan: Plan) -> None:
    by_host = ranks_by_host(hosts)
    print(
        f"started: {'1 master' if k == 1 else f'{k} dispatchers'} + {len(hosts) - k} slaves on {len(by_host)} "
        f"host{'s' * (len(by_host) > 1)} ("
        + "; ".join(f"{h}: {spans(r)}" for h, r in by_host.items())
        + f"); heartbeat_timeout {plan.cluster.heartbeat_timeout:g}s",
        file=sys.stderr,
        flush=True,
    )


def payload_cuts(plan: Plan) -> list[int]:
    """The payload cuts of the complete checkpoints on disk, oldest first (NEG_INF for one that has none)."""
    cuts = []
    for directory in checkpoint.checkpoints(plan.checkpoint.root):
        try:
            cut = checkpoint.load_manifest(directory)["master"].get("payload_cut")
        except checkpoint.CheckpointError:
            continue  # not complete: no recovery starts there
        cuts.append(eventtime.NEG_INF if cut is None else int(cut))
    return cuts


class Lifecycle:
    def _request_stop(self, signum, frame) -> None:
        if self._stop_requested:  # second signal: give up at once
            raise KeyboardInterrupt
        self._stop_requested = True
        self.stats.stopped_by_signal = True
        print("stopping: no more input; joining what was accepted, flushing results ...", file=sys.stderr, flush=True)

    def _perform(self) -> None:
        """Carry out what the desks asked for since the last time, in order (master/state/channels.py)."""
        carry_out(self.channels.take(), self.links, self.intake)

    def _sections(self) -> dict:
        """This dispatcher's part of a checkpoint: the desks' and the shell's, the late tuples set aside so far
        and the archive written first (their files are counted in it)."""
        self._perform()
        self.intake.flush()
        return {
            **self.ingest.state(),
            **self.intake.state(),
            **self.distribution.state(),
            "seq": self.channels.state(),
            "hot_keys": None if self.hot is None else self.hot.state(),
            "payload_cut": self.payload.cut(self.controller.holders())
            if self.payload is not None and self.index == 0
            else None,
        }

    def _resume(self, directory: Path, manifest: dict) -> None:
        """Start where the checkpoint left off: source position, mini-buffers, counters, partition map."""
        m = section(manifest, self.index)
        part = checkpoint.read_part(directory / checkpoint.master_part(self.index))
        self.ingest.restore(m)
        self.intake.restore(m, part[3:])
        self.distribution.restore(m)
        self.channels.restore(m["seq"])
        if m["hot_keys"] is not None:
            self.hot.restore(m["hot_keys"])
        self.checkpoints.restore(part, manifest, self.distribution.epochs_done)
        if self.payload is not None:
            self.payload.restore(payload_cuts(self.plan))

    def read_ahead(self) -> None:
        """Take the first batch of unpaced input while the other ranks start: rank 0 before it lets
        them import their kernels (until then it has the cores to itself), every other dispatcher before it
        waits for them; a file source's reader thread reads on meanwhile.  The run's clock still starts when
        the cluster can join, so rates count at most one batch read before it.  Paced input (by rate or by
        event time) and live sources start when the cluster can join: a paced replay's delays measure the join,
        not the start-up."""
        if self.stats.launched is not None:
            return
        self.stats.launched = launched_at()
        if self.ingest.rate > 0 or self.plan.source.speed > 0 or self.plan.live_endpoints:
            return
        now = time.time()
        self.ingest.start(now)
        self.intake.pull(self.ingest, now, cap=self.results_out.ingest_room(len(self.buffers)))
        self._perform()
        if self.stats.ingested:
            self.stats.first_tuple = now

    def _end(self) -> dict:
        """STOP to every slave and their final reports; rank 0 writes the summary with the others' counters."""
        self.links.close()
        for rank, seq in self.channels.stop().items():  # each answers on the result stream too (rows undecided)
            self.results_out.stopped(rank, seq, self.controller.partitions_of(rank))
        self._perform()
        self.results_out.close()
        while self.channels.busy:
            if not self._route_reports():
                time.sleep(1e-3)
        self.stats.last_result = time.time()  # the slaves' final reports: their results are written
        self._perform()
        self.intake.flush()
        self.metrics.finish(self)
        lateness = self.ingest.stream_summary(time.time())
        if self.index > 0:
            self.links.send_summary(
                {
                    "stats": self.stats.state(time.time()),
                    "results_out": self.results_out.summary(),
                    "source": self.source.finish(),
                    "lateness": lateness,
                }
            )
            return {}
        others = self.links.summaries(self.k)
        # only now has every slave taken its last STOP (a slave's last may be another dispatcher's) and staged
        # its last partial aggregate: publish them all
        self.checkpoints.finish()
        self._perform()
        for other in others:
            self.stats.merge(other["stats"])
        c = self.controller
        summary = self.stats.summary(self.plan, time.time(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        summary["balance"] = {
            "reorganizations": c.reorganizations,
            "moves": c.moves_log,
            "active_changes": c.active_log,
            "active_at_end": sorted(c.active),
            "occupancy": c.occupancy_log,
        }
        summary["hot_keys"] = [] if self.hot is None else self.hot.log
        summary["checkpoints"] = {
            "written": self.checkpoints.written,
            "recovered_from": self.checkpoints.recovered_from,
            "log": self.checkpoints.log,
        }
        summary["restarts"] = restarts()
        finished = [self.source.finish(), *(o["source"] for o in others)]
        summary.update(
            **(self.source.merge(finished) if self.k > 1 and finished[0] else finished[0]),
            **self.results_out.summary([o["results_out"] for o in others if o["results_out"]]),
        )
        if lateness:  # [streams]: each stream's max_delay, late tuples and idle periods
            summary["lateness"] = IngestDesk.merge_summaries([lateness, *(o["lateness"] for o in others)])
        if self.sink is not None:  # every result file is written: the last transaction (docs/output.md)
            summary["kafka_sink"] = self.sink.finish(result_files(self.plan.output.path / "results"))
        remove_log(self.plan.output.path)  # every result is written: no row needs its columns any more
        write_summary(self.plan.output.path / "summary.json", summary)
        print("\n".join(summary_lines(summary, self.plan.output)), file=sys.stderr, flush=True)
        self.metrics.close(self, summary)
        return summary

    def _progress(self) -> None:
        print(
            f"[dispatcher {self.index}] " * (self.k > 1)
            + self.stats.progress_line(
                time.time(), len(self.buffers), len(self.controller.active), len(self.controller.moves_log)
            )
            + self.ingest.idle_note()
            + self.results_out.note(),
            file=sys.stderr,
            flush=True,
        )

    def _watch(self, now: float) -> None:
        """End the job, naming what it waits for, when pending work has not moved for too long (desks.stall)."""
        self.stall.watch(
            now,
            self.ingest.consumed,
            {} if self.hot is None else self.hot.waiting_for(),
            self.checkpoints.waiting_for(),
            self.moves.waiting_for(),
            self.results_out.holding,
        )

    def _may_end(self) -> bool:
        """Input exhausted and joined, no move in flight; with several dispatchers, all of them (DONE, FINISH)."""
        if not (
            self.ingest.exhausted
            and len(self.buffers) == 0
            and not self.channels.busy
            and not self.controller.busy
            and not self.checkpoints.pending
            and not (self.hot is not None and self.hot.fencing)
        ):
            return False
        if self.k == 1:
            return True
        if self.index > 0:
            if not self.done_sent:
                self.channels.tell([0], Order.DONE)
                self.done_sent = True
            return self.finished
        if len(self.done_from) < self.k - 1:
            return False
        self.channels.tell(range(1, self.k), Order.FINISH)
        return True


def result_files(results: Path) -> dict[str, int]:
    """How many result files each slave (`slave-RRR`) wrote, by the end of the run (temporaries start with a dot)."""
    counts: dict[str, int] = {}
    for f in results.glob("slave-*"):
        series, number = f.name.split(".", 1)[0].rsplit("-", 1)
        counts[series] = max(counts.get(series, 0), int(number) + 1)
    return counts


def write_summary(path: Path, summary: dict) -> None:
    """summary.json, whole or not at all (written beside, then renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    null = "no value (e.g. no delay percentiles without results)"
    tmp.write_text(json_text({**summary, "null_means": null}, indent=2))
    tmp.replace(path)
