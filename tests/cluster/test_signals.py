"""Signals and process trees: SIGTERM to the supervisor is the cluster's clean stop; killing the
supervisor or the launcher leaves no rank behind; a restart waits for the previous run to end."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from deploy.launch import mpi_env
from master.lock import OutputLock
from tests.runs import write_config
from tests.cluster.test_cluster import SMALL, check_exact

ROOT = Path(__file__).resolve().parent.parent.parent
BOUND = 60  #: seconds for a stop or a death to take effect (the runs below last minutes unstopped)
LONG = dict(SMALL, **{"generator.duration": 120.0, "source.rate": 3000.0, "output.progress": 0.5})


def run_processes(tmp_path) -> list[psutil.Process]:
    """Every process of the run whose config lies in `tmp_path`: launcher, mpirun, ranks."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if str(tmp_path) in " ".join(p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def start(tmp_path, supervised: bool) -> subprocess.Popen:
    """deploy.launch (under control.supervise if `supervised`) on a run of 2 minutes; returns once the cluster
    reports progress."""
    cfg = write_config(tmp_path, LONG)
    cmd = [sys.executable, "-m", "deploy.launch", "-n", "3", "--", "--config", str(cfg)]
    if supervised:
        cmd = [sys.executable, "-m", "control.supervise", "--", *cmd]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=mpi_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while "results" not in proc.stderr.readline():  # the first progress line
        assert time.monotonic() < deadline and proc.poll() is None
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep draining: no blocked writer
    return proc


def gone_within(tmp_path, seconds: float) -> list[psutil.Process]:
    """The run's processes still alive after waiting up to `seconds` for all of them to end."""
    deadline = time.monotonic() + seconds
    while (left := run_processes(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def test_sigterm_to_the_supervisor_stops_the_cluster_cleanly_and_ends_supervision(tmp_path):
    proc = start(tmp_path, supervised=True)
    stopped = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=BOUND)
    finally:
        for p in run_processes(tmp_path):
            p.kill()
    assert code == 0
    assert time.monotonic() - stopped < BOUND
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["stopped_by_signal"] is True
    assert summary["input_total"] < 0.5 * 120 * 2 * SMALL["generator.rate"]  # stopped, not run to its end
    assert not gone_within(tmp_path, 10)


@pytest.mark.parametrize("supervised", [True, False], ids=["supervisor", "launcher"])
def test_killing_the_supervisor_or_the_launcher_leaves_no_rank_running(tmp_path, supervised):
    proc = start(tmp_path, supervised)
    ranks = [p for p in run_processes(tmp_path) if "master" in p.cmdline() and "deploy.launch" not in p.cmdline()]
    assert len(ranks) >= 3  # mpirun and the ranks are there to be orphaned
    proc.kill()
    proc.wait()
    left = [(p, " ".join(p.info["cmdline"][:3])) for p in gone_within(tmp_path, BOUND)]
    for p, _ in left:
        p.kill()
    assert not left, [what for _, what in left]


def test_a_restart_does_not_start_while_the_previous_run_holds_the_output_folder(tmp_path):
    """The crashed run's rank 0 still holds the folder (here: this test); the --recover start waits for it."""
    holder = OutputLock(tmp_path / "out")
    threading.Timer(3.0, holder.release).start()
    released = time.time() + 3.0
    run, _ = check_exact(tmp_path, 3, SMALL, extra_args=["--recover"])
    started = (tmp_path / "out" / "summary.json").stat().st_mtime - run.summary["wall_seconds"]
    assert started >= released - 0.1
    assert "no complete checkpoint" in run.stderr
