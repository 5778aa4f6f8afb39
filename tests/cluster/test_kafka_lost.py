"""Kafka records deleted before a stream read them (retention, DeleteRecords), against the real broker (noida-db,
which answers DeleteRecords as Kafka does): never a silent loss.  Deleted between a crash and its recovery, or
while the cluster reads: the job stops with exit 8 and one line naming stream, topic, partition and offsets
(the supervisor does not restart it); with `on_lost = "skip"` it goes on from the partition's first record
still there, the range counted in summary.json and the metrics, the results exactly the reference join of the
records that remain."""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time

import numpy as np
import psutil
import pytest
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient

from deploy.launch import mpi_env, mpirun_command
from master.metrics import KAFKA_LABELS
from protocol import checkpoint
from protocol.lifetime import INPUT_LOST
from tests.cluster.test_kafka import SUPERVISE
from tests.cluster.test_metrics import parse
from tests.kafka import checkpointed, create, now_ms, produce, reference, stream, values
from tests.runs import Run, run_cluster, write_config

IDS = ("views_vid", "buys_bid")
#: a progress line's counts of tuples taken in and set aside late (each dispatcher's, cumulative over restarts)
COUNTS = re.compile(r"\[ *[\d.]+s\] in ([\d,]+) .*\| late ([\d,]+) ")


def delete_below(broker: str, topic: str, partition: int, offset: int) -> None:
    """DeleteRecords: the partition's records below `offset` are gone, as retention would remove them."""
    tp, admin = TopicPartition(topic, partition, offset), AdminClient({"bootstrap.servers": broker})
    admin.delete_records([tp])[tp].result(30)  # the client kept until then: its thread answers the future


def two_waves(broker: str, tmp_path, seed: int, n: int) -> tuple[dict, dict, dict]:
    """Unbounded topics of 2 partitions for views and buys (n records each, 1% late within their partition, the
    first wave produced now, the second by the caller), checkpoints every 2 epochs; (topics, the streams
    with each record's wave, the settings)."""
    rng = np.random.default_rng(seed)
    t0 = now_ms()
    streams = {"views": stream(rng, n, 0, 2, t0, 0.01, spread=0), "buys": stream(rng, n, 100_000, 2, t0, 0.01, 0)}
    topics = {name: f"{name}-{tmp_path.name}" for name in streams}
    for name, s in streams.items():
        create(broker, topics[name], 2)
        s["value"] = values(s, "vid" if name == "views" else "bid")
        s["wave"] = np.arange(n) >= n // 2
    produce_wave(broker, topics, streams, False)
    cfg = checkpointed(broker, topics, **{"output.progress": 0.2, "cluster.heartbeat_timeout": 30.0})
    for name in topics:  # at the end the streams' last rows wait for the other stream until it is idle
        cfg[f"streams.{name}.kafka"]["bounded"] = False
        cfg[f"streams.{name}.idle_timeout"] = "1s"
    return topics, streams, cfg


def produce_wave(broker: str, topics: dict, streams: dict, second: bool) -> None:
    """One wave's records of each stream into its topic; each record's offset noted (`offset`)."""
    for name, s in streams.items():
        mine = np.flatnonzero(s["wave"] == second)
        offsets = produce(broker, topics[name], s["partition"][mine], [s["value"][i] for i in mine.tolist()])
        s.setdefault("offset", np.full(len(s["id"]), -1, np.int64))[mine] = offsets


def without(s: dict, gone: np.ndarray) -> dict:
    return {k: (np.asarray(v)[~gone] if k != "user" else [u for u, g in zip(v, gone) if not g]) for k, v in s.items()}


def stopped_once_in(tmp_path, cfg: dict, want, args: list[str], pause=None) -> Run:
    """The cluster (3 ranks, bare mpirun) until its progress lines count `want` tuples in or late (or `want(its
    stderr so far)`), then its clean stop (SIGUSR1);
    `pause(proc)` once it first counts `pause.first` tuples (a number) or logs a line holding it (a string)."""
    proc = subprocess.Popen(
        mpirun_command(3, ["--config", str(write_config(tmp_path, cfg)), *args]),
        env=mpi_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    killer = threading.Timer(120, proc.kill)  # never a hung test: a run that never counts `want` is killed
    killer.start()
    try:
        for line in proc.stderr:
            lines.append(line)
            if pause is not None and isinstance(pause.first, str) and pause.first in line:
                pause(proc)
                pause = None
            if counts := COUNTS.search(line):
                taken = sum(int(c.replace(",", "")) for c in counts.groups())
                if pause is not None and taken == pause.first:
                    pause(proc)
                    pause = None
                if taken == (want if isinstance(want, int) else want("".join(lines))):
                    proc.send_signal(signal.SIGUSR1)  # a bare mpirun's clean stop
                    break
        rest = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
        rest.start()
        code = proc.wait(timeout=90)
        rest.join(10)
    finally:
        killer.cancel()
        if proc.poll() is None:
            proc.kill()
    return Run(tmp_path / "out", subprocess.CompletedProcess(proc.args, code, "", "".join(lines)))


def assert_skipped_exactly(run: Run, topics: dict, streams: dict, gone: np.ndarray, lost: dict) -> None:
    """Exit 0; views' lost range `lost` counted in the summary and the metrics, logged once; the results the
    reference join of the records that remain."""
    assert run.returncode == 0, run.stderr
    summary = run.summary["live_streams"]["views"]
    assert summary["lost_records"] == gone.sum() == lost["last"] - lost["first"] + 1, run.stderr
    assert summary["lost"] == [lost] and run.summary["live_streams"]["buys"]["lost_records"] == 0
    assert run.stderr.count('skipped (on_lost = "skip")') == 1, run.stderr
    final = parse((run.out / "metrics.prom").read_text())
    labels = dict(zip(KAFKA_LABELS, ("views", topics["views"], "1")))
    assert final[("streamjoin_kafka_lost_records_total", tuple(sorted(labels.items())))] == gone.sum()
    pairs, late, _ = reference(without(streams["views"], gone), streams["buys"])
    assert len(pairs) > 500
    np.testing.assert_array_equal(run.pairs(IDS), pairs)
    np.testing.assert_array_equal(run.late_ids(IDS, ("views", "buys")), late)


def test_records_deleted_between_a_crash_and_its_recovery_stop_it_with_exit_8_or_are_skipped_and_counted(
    tmp_path, broker
):
    """The master is killed as it begins its third checkpoint, having read the first wave; the second wave is
    written, then views' partition 1 loses 150 records above the checkpoint's offset.  The recovery, under the
    supervisor, stops with exit 8 (no restart) and one line naming them; the same recovery with on_lost = "skip"
    goes on past them: exactly the reference join of the records that remain, the 150 counted."""
    topics, streams, cfg = two_waves(broker, tmp_path, 83, 1600)
    fired = tmp_path / "fault-fired"
    crashed = run_cluster(tmp_path, 3, cfg, timeout=120, env={"STREAMJOIN_FAULT": f"0:checkpoint:3:{fired}"})
    assert crashed.returncode != 0 and fired.exists(), crashed.stderr
    produce_wave(broker, topics, streams, True)
    _, manifest = checkpoint.latest_complete(tmp_path / "out" / "checkpoints")
    at = manifest["master"]["source"]["streams"][0]["offsets"][1]  # views' partition 1
    views = streams["views"]
    assert 0 < at < int((views["partition"] == 1).sum()) - 150, at
    delete_below(broker, topics["views"], 1, at + 150)
    gone = (views["partition"] == 1) & (views["offset"] >= at) & (views["offset"] < at + 150)
    stopped = run_cluster(tmp_path, 3, cfg, timeout=120, extra_args=["--recover"], wrapper=SUPERVISE)
    assert stopped.returncode == INPUT_LOST and "restart 1 of" not in stopped.stderr, stopped.stderr
    line = (
        f"error: stream views: kafka topic {topics['views']} partition 1: offsets {at}..{at + 149} were deleted "
        f'before they were read (150 records lost); set streams.views.kafka.on_lost = "skip" to go on without them\n'
    )
    assert line in stopped.stderr and stopped.stderr.count("error: ") == 1, stopped.stderr
    cfg["streams.views.kafka"]["on_lost"] = "skip"
    run = stopped_once_in(tmp_path, cfg, 2 * 1600 - 150, ["--recover"])
    assert run.returncode == 0 and run.summary["checkpoints"]["recovered_from"] is not None, run.stderr
    lost = {"topic": topics["views"], "partition": 1, "first": at, "last": at + 149}
    assert_skipped_exactly(run, topics, streams, gone, lost)


def test_a_topic_made_anew_between_a_crash_and_its_recovery_stops_it_with_exit_8_or_is_read_on_from_its_end(
    tmp_path, broker
):
    """The master is killed as it begins its third checkpoint, having read the first wave; then views' topic is
    deleted and made anew, empty, so the checkpoint's offsets lie beyond its partitions' ends.  The recovery,
    under the supervisor, stops with exit 8 (no restart) naming the offset and the end; with on_lost = "skip" it
    logs each partition and reads on from the end, where the second wave is written once it has said so (the
    master stopped meanwhile): exactly the reference join of the views the checkpoint holds and the new ones, the
    ranges counted as `rewound`."""
    topics, streams, cfg = two_waves(broker, tmp_path, 97, 1600)
    fired = tmp_path / "fault-fired"
    crashed = run_cluster(tmp_path, 3, cfg, timeout=120, env={"STREAMJOIN_FAULT": f"0:checkpoint:3:{fired}"})
    assert crashed.returncode != 0 and fired.exists(), crashed.stderr
    _, manifest = checkpoint.latest_complete(tmp_path / "out" / "checkpoints")
    at = manifest["master"]["source"]["streams"][0]["offsets"]  # views' partitions 0 and 1
    assert min(at) > 0, at
    admin = AdminClient({"bootstrap.servers": broker})
    admin.delete_topics([topics["views"]])[topics["views"]].result(30)
    create(broker, topics["views"], 2)
    stopped = run_cluster(tmp_path, 3, cfg, timeout=120, extra_args=["--recover"], wrapper=SUPERVISE)
    assert stopped.returncode == INPUT_LOST and "restart 1 of" not in stopped.stderr, stopped.stderr
    assert f"partition 0: offset {at[0]} lies beyond the partition's end 0" in stopped.stderr, stopped.stderr
    assert 'set streams.views.kafka.on_lost = "skip" to read on from the end' in stopped.stderr

    def second_wave(proc: subprocess.Popen) -> None:  # both streams' at once: neither idle while the other is read
        master = master_of(proc)
        master.suspend()
        try:
            produce_wave(broker, topics, streams, True)
        finally:
            master.resume()

    second_wave.first = "; read on from offset 0"
    views = streams["views"]
    old = ~views["wave"]
    gone = old & (views["offset"] >= np.array(at)[views["partition"]])
    cfg["streams.views.kafka"]["on_lost"] = "skip"
    run = stopped_once_in(tmp_path, cfg, 2 * 1600 - int(gone.sum()), ["--recover"], second_wave)
    assert run.returncode == 0 and run.summary["checkpoints"]["recovered_from"] is not None, run.stderr
    assert run.stderr.count("; read on from offset 0") == 2, run.stderr
    summary = run.summary["live_streams"]["views"]
    rewound = [{"topic": topics["views"], "partition": p, "first": 0, "last": at[p] - 1} for p in (0, 1)]
    assert sorted(summary["rewound"], key=lambda r: r["partition"]) == rewound, summary
    assert summary["rewound_records"] == sum(at) and summary["lost_records"] == 0, summary
    final = parse((run.out / "metrics.prom").read_text())
    for p in (0, 1):
        labels = tuple(sorted(zip(KAFKA_LABELS, ("views", topics["views"], str(p)))))
        assert final[("streamjoin_kafka_rewound_records_total", labels)] == at[p]
    pairs, late, _ = reference(without(views, gone), streams["buys"])
    assert len(pairs) > 500
    np.testing.assert_array_equal(run.pairs(IDS), pairs)
    np.testing.assert_array_equal(run.late_ids(IDS, ("views", "buys")), late)


def master_of(mpirun: subprocess.Popen) -> psutil.Process:
    """Rank 0 among mpirun's children."""
    ranks = [p for p in psutil.Process(mpirun.pid).children(recursive=True) if "master" in " ".join(p.cmdline())]
    return next(p for p in ranks if p.environ().get("OMPI_COMM_WORLD_RANK") == "0")


@pytest.mark.parametrize("on_lost", ["stop", "skip"])
def test_records_deleted_ahead_of_a_reading_stream_stop_the_run_with_exit_8_or_are_skipped_and_counted(
    tmp_path, broker, on_lost
):
    """The cluster reads the first wave; once it counts every tuple of it, the master is stopped (SIGSTOP: its
    client fetches nothing more), the second wave is written, then 300 more views into partition 1, and that
    partition's records are deleted up to 150 into those.  The master goes on (SIGCONT): its client cannot fetch
    at its position any more.  "stop": exit 8 and one line naming the range, from the client's position to the
    deletion's offset; "skip": the range counted and skipped, the results exactly the reference join of the
    rest."""
    topics, streams, cfg = two_waves(broker, tmp_path, 89, 1600)
    cfg["streams.views.kafka"] |= {"on_lost": on_lost, "config": {"fetch.wait.max.ms": 100}}
    views = streams["views"]
    extra = {"id": np.arange(300) + 1600, "user": ["u1"] * 300, "partition": np.ones(300, np.int64)}
    extra["at"] = views["at"].max() + np.arange(300)
    deleted_to = []

    def delete_ahead(proc: subprocess.Popen) -> None:
        master = master_of(proc)
        master.suspend()
        try:
            produce_wave(broker, topics, streams, True)
            time.sleep(0.5)  # margin: the fetch the client had sent is answered with the wave at the latest
            extra["offset"] = produce(broker, topics["views"], extra["partition"], values(extra, "vid"))
            deleted_to.append(int(extra["offset"][150]))
            delete_below(broker, topics["views"], 1, deleted_to[0])
        finally:
            master.resume()

    delete_ahead.first = 1600
    skipped = r"\(([\d,]+) records lost\); skipped"
    run = stopped_once_in(
        tmp_path,
        cfg,
        lambda err: 2 * 1600 + 300 - sum(map(int, (n.replace(",", "") for n in re.findall(skipped, err)))),
        [],
        delete_ahead,
    )
    assert deleted_to, run.stderr
    found = re.search(
        rf"partition 1: offsets (\d+)\.\.{deleted_to[0] - 1} were deleted before they were read", run.stderr
    )
    assert found, run.stderr
    first = int(found[1])
    wave_end = int(((views["partition"] == 1) & ~views["wave"]).sum())
    assert wave_end <= first < deleted_to[0], run.stderr  # read from where the first wave ended, at most
    if on_lost == "stop":
        assert run.returncode == INPUT_LOST and run.summary is None, run.stderr
        assert 'set streams.views.kafka.on_lost = "skip" to go on without them' in run.stderr
        return
    whole = {k: np.concatenate([views[k], extra[k]]) if k != "user" else views[k] + extra[k] for k in extra}
    gone = (whole["partition"] == 1) & (whole["offset"] >= first) & (whole["offset"] < deleted_to[0])
    lost = {"topic": topics["views"], "partition": 1, "first": first, "last": deleted_to[0] - 1}
    assert_skipped_exactly(run, topics, {"views": whole, "buys": streams["buys"]}, gone, lost)
