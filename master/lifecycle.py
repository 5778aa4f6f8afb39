"""The master's run from its start to its end, around the loop (master/run.py): resuming from a checkpoint, the
first batch read while the other ranks start, the line that says every rank runs, and the end -- STOP to
every slave, their final reports, the summary.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from master.state.checkpoints import section
from master.state.intake import IngestDesk
from master.state.payload import payload_cuts
from master.state.stats import print_summary, ranks_by_host, spans, write_summary
from protocol.liveness import heartbeat_timeout
from protocol.payload import remove_log
from protocol.startup import launched_at, restarts
from protocol.streams import live_endpoints


def say_started(hosts: list[str], k: int, cfg: dict) -> None:
    by_host = ranks_by_host(hosts)
    print(
        f"started: {'1 master' if k == 1 else f'{k} dispatchers'} + {len(hosts) - k} slaves on {len(by_host)} "
        f"host{'s' * (len(by_host) > 1)} ("
        + "; ".join(f"{h}: {spans(r)}" for h, r in by_host.items())
        + f"); heartbeat_timeout {heartbeat_timeout(cfg['cluster'], cfg['epochs']['distribution']):g}s",
        file=sys.stderr,
        flush=True,
    )


class Lifecycle:
    def _resume(self, directory: Path, manifest: dict) -> None:
        """Start where the checkpoint left off: source position, mini-buffers, counters, partition map."""
        m = section(manifest, self.index)
        self.ingest.restore(m)
        self.distribution.restore(m)
        self.links.restore(m["seq"])
        if m["hot_keys"] is not None:
            self.hot.restore(m["hot_keys"])
        self.checkpoints.restore(directory, manifest, self.distribution.epochs_done)
        if self.payload is not None:
            self.payload.restore(payload_cuts(self.cfg))

    def read_ahead(self) -> None:
        """Take the first batch of unpaced input while the other ranks start: rank 0 before it lets
        them import their kernels (until then it has the cores to itself), every other dispatcher before it
        waits for them; a file source's reader thread reads on meanwhile.  The run's clock still starts when
        the cluster can join, so rates count at most one batch read before it.  Paced input and live sources
        start when the cluster can join: a paced replay's delays measure the join, not the start-up."""
        if self.stats.launched is not None:
            return
        self.stats.launched = launched_at()
        if self.ingest.rate > 0 or live_endpoints(self.cfg):
            return
        now = time.time()
        self.ingest.start(now)
        self.ingest.ingest(now, cap=self.results_out.ingest_room(len(self.buffers)))
        if self.stats.ingested:
            self.stats.first_tuple = now

    def _end(self) -> dict:
        """STOP to every slave and their final reports; rank 0 writes the summary with the others' counters."""
        self.links.close()
        for rank, seq in self.links.stop().items():  # each answers on the result stream too (rows undecided)
            self.results_out.stopped(rank, seq, self.controller.partitions_of(rank))
        self.results_out.close()
        while self.links.busy:
            if not self._route_reports():
                time.sleep(1e-3)
        self.stats.last_result = time.time()  # the slaves' final reports: their results are written
        self.checkpoints.finish()
        self.ingest.flush()
        self.metrics.finish(self)
        lateness = self.ingest.stream_summary(time.time())
        if self.index > 0:
            self.links.send_summary(
                {
                    "stats": self.stats.state(),
                    "results_out": self.results_out.summary(),
                    "source": self.source.finish(),
                    "lateness": lateness,
                }
            )
            return {}
        others = self.links.summaries(self.k)
        for other in others:
            self.stats.merge(other["stats"])
        c = self.controller
        summary = self.stats.summary(self.cfg)
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
            **(type(self.source).merge(finished) if self.k > 1 and finished[0] else finished[0]),
            **self.results_out.summary([o["results_out"] for o in others if o["results_out"]]),
        )
        if lateness:  # [streams]: each stream's max_delay, late tuples and idle periods
            summary["lateness"] = IngestDesk.merge_summaries([lateness, *(o["lateness"] for o in others)])
        remove_log(self.cfg["output"]["path"])  # every result is written: no row needs its columns any more
        write_summary(Path(self.cfg["output"]["path"]) / "summary.json", summary)
        print_summary(summary)
        self.metrics.close(self, summary)
        return summary
