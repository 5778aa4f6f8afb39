"""The output folder belongs to one run: a lock refuses a second cluster, a dead run's lock is taken
over, the engine removes only the files it wrote and refuses to start where a user's file lies; what it writes
there is JSON any parser reads."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import numpy as np
import pytest

from deploy.launch import mpi_env, mpirun_command
from master.lock import NAME
from protocol.output import OutputError, reset_output
from protocol.strict_json import json_text
from tests.runs import run_cluster, write_config
from tests.cluster.test_cluster import SMALL, check_exact, reference_for

BOUND = 120


def test_reset_removes_the_engines_files_and_refuses_a_users_without_removing_anything(tmp_path):
    own = [
        "results/slave-001-000000.parquet",
        "results/.slave-002-000003.csv.tmp",
        "late/late-d1-000002.csv",
        "archive/input-000000.parquet",
        "rejected/zmq-rejected-d1.csv",
        "aggregates/slave-003-000001.parquet",
        "aggregates/_pending/slave-003-000002.parquet",
        "summary.json",
    ]
    users = ["results/notes.txt", "archive/input.csv", "aggregates/mine/slave-001-000000.parquet"]
    keep = ["replay/selection.parquet", "my-data.csv"]  # outside the parts the engine writes
    for name in own + users + keep:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    with pytest.raises(OutputError) as refused:
        reset_output(tmp_path)
    assert (
        f"output.path: {tmp_path}/aggregates/mine, {tmp_path}/archive/input.csv, {tmp_path}/results/notes.txt "
        "are not written by this engine" in str(refused.value)
    )
    assert all((tmp_path / name).read_text() == name for name in own + users + keep)  # nothing removed
    for name in users:
        (tmp_path / name).unlink()
    shutil.rmtree(tmp_path / "aggregates/mine")
    assert reset_output(tmp_path) == len(own)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my-data.csv", "replay"]


@pytest.mark.parametrize("name", ["results/my-results.parquet", "archive/notes.txt"])
def test_a_users_file_where_the_engine_writes_stops_the_run_with_exit_2(tmp_path, name):
    user = tmp_path / "out" / name
    user.parent.mkdir(parents=True)
    user.write_text("mine")
    run = run_cluster(tmp_path, 3, SMALL, timeout=BOUND)
    assert run.returncode == 2, run.stderr
    assert f"output.path: {user} is not written by this engine" in run.stderr
    assert user.read_text() == "mine"


def test_an_input_file_inside_results_is_neither_deleted_nor_read_as_output(tmp_path):
    data = tmp_path / "out" / "results" / "input.csv"
    data.parent.mkdir(parents=True)
    data.write_text("stream,id,ts,key,value\nR,1,0.0,5,1.0\nS,1,0.1,5,2.0\n")
    run = run_cluster(tmp_path, 3, {"source.kind": "file", "source.path": str(data)}, timeout=BOUND)
    assert run.returncode == 2, run.stderr
    assert "is not written by this engine" in run.stderr and data.exists()


def test_a_read_only_output_folder_is_refused_at_start_naming_it(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    if os.geteuid() == 0:  # root writes through permission bits; an immutable folder stops it
        if subprocess.run(["chattr", "+i", str(out)], capture_output=True).returncode != 0:
            pytest.skip("running as root and chattr +i is not available here")
    else:
        out.chmod(0o555)
    try:
        run = run_cluster(tmp_path, 3, SMALL, timeout=BOUND)
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(out)])
        out.chmod(0o755)
    assert run.returncode == 2, run.stderr
    assert f"{out}/{NAME}" in run.stderr and "Traceback" not in run.stderr


def test_a_second_cluster_on_the_same_output_folder_is_refused_and_the_first_is_untouched(tmp_path):
    first_settings = dict(SMALL, **{"source.rate": 3000.0})  # paced: about 8 s
    expected, _, _ = reference_for(first_settings)
    cfg = write_config(tmp_path / "first", first_settings)
    out = tmp_path / "first" / "out"
    first = subprocess.Popen(
        mpirun_command(3, ["--config", str(cfg)]),
        env=mpi_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (out / NAME).exists() or not (out / NAME).read_text():
            assert time.monotonic() < deadline and first.poll() is None, first.communicate()
            time.sleep(0.1)
        holder = json.loads((out / NAME).read_text())
        second = subprocess.run(
            mpirun_command(3, ["--config", str(cfg)]), env=mpi_env(), capture_output=True, text=True, timeout=BOUND
        )
        assert first.poll() is None, "the first run ended before the second one tried: the test tested nothing"
        assert second.returncode == 2, second.stderr
        assert f"is in use by another cluster (pid {holder['pid']} on host {holder['host']}" in second.stderr
        _, err = first.communicate(timeout=BOUND)
    finally:
        first.kill()
    assert first.returncode == 0, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["results"] == len(expected)
    assert not (out / NAME).exists()  # released at the end


def test_a_dead_runs_lock_is_reported_and_taken_over(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    # a lock file nobody holds (its holder was SIGKILLed: the kernel released the flock, the file stayed)
    (out / NAME).write_text(
        json.dumps({"host": "somewhere", "pid": 4242, "started": time.time() - 60, "command": ["x"]})
    )
    run, _ = check_exact(tmp_path, 3, SMALL)
    assert "the run that held it (pid 4242 on host somewhere" in run.stderr and "taking it over" in run.stderr


def strict_json(text: str):
    """Parse as a strict parser would: NaN, Infinity and -Infinity are not JSON."""

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_a_run_without_results_writes_a_summary_any_json_parser_reads(tmp_path):
    data = tmp_path / "in.csv"
    data.write_text("stream,id,ts,key,value\nR,1,0.0,5,1.0\nR,2,0.1,6,2.0\n")  # no S tuple: no result
    run = run_cluster(tmp_path, 3, {"source.kind": "file", "source.path": str(data)}, timeout=BOUND)
    assert run.returncode == 0, run.stderr
    summary = strict_json((tmp_path / "out" / "summary.json").read_text())
    assert summary["results"] == 0 and summary["input_total"] == 2
    assert summary["delay_seconds"]["p50"] is None and summary["delay_parts_seconds"]["join"]["p99"] is None
    assert "delay p50 n/a" in run.stderr


def test_json_text_writes_null_for_every_non_finite_number():
    value = {"a": float("nan"), "b": [np.float64("inf"), -np.inf, 1.5, np.int64(3)], "c": {"d": float("-inf")}}
    assert strict_json(json_text(value)) == {"a": None, "b": [None, None, 1.5, 3], "c": {"d": None}}
